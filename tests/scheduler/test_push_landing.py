"""Same-step landing (issue 29) between two real vLLM Schedulers in push mode.

D's worker forwards each WRITE notification its progress pump collects to
D's scheduler (``Waker`` -> ``IdleWait``); the scheduler checks it as the
worker does (``LandingView``) and promotes the request before vLLM's
``schedule()``, so the request's first step runs in the very step the
scheduler saw the KV land, instead of one step after the workers' report.
The workers' report of that load still comes, in that step's output, and
must vanish before vLLM sees it: vLLM asserts on a running request listed
in ``finished_recving`` and frees a finished one's blocks twice.

The test plays D's worker: a real ``Waker`` forwards the notification, the
step's output carries the worker's report, as test_push_seed.py.
"""

from __future__ import annotations

import time

import pytest
from pdsched import SCHEDULING_MODES, create_request, drain, is_async
from pdunit_utils import wait_for
from test_push_schedulers import (
    Pair,
    assert_scheduler_empty,
    pd,
    prefill_on_p,
    same_prompt,
    step,
)
from vllm.v1.request import RequestStatus

from vllm_pd_ext.metadata import PDWorkerMetadata
from vllm_pd_ext.scheduler.pushbook import PushState
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire import telemetry
from vllm_pd_ext.wire.wakeup import Waker

#: The token pdsched's fake forward samples on P: P's token #1.
P_TOKEN = 100
N = 2 * 32 + 7


class Landing:
    """A push pair whose D has a worker's ``Waker`` connected, and one
    ``pd_seed_pending`` D leg whose P prefilled and wrote."""

    def __init__(self, mode: str, max_tokens: int = 3, telemetry_in_answer: bool = False
                 ) -> None:
        self.pair = Pair(mode, d_extra={"same_step_landing": True})
        d = pd(self.pair.d)
        assert d.landing is not None, "the same_step_landing patch did not turn the view on"
        d.d._telemetry_in_answer = telemetry_in_answer
        self.waker = Waker(0)
        d.idle.connect([self.waker.endpoint])
        params = dict(self.pair.d_params("pd-land"), pd_seed_pending=True)
        self.req = create_request(N, request_id="d-land", max_tokens=max_tokens,
                                  prompt=same_prompt(N), kv_transfer_params=params)
        self.pair.d.add_request(self.req)
        out, _ = step(self.pair.d)
        (self.spec,) = out.kv_connector_metadata.push_recv
        assert wait_for(lambda: pd(self.pair.p).producer.book.state("pd-land")
                        is PushState.REGISTERED)
        prefill_on_p(self.pair, "pd-land", N)
        assert self.pair.next_order() is not None
        self.pair.settle_write("pd-land")

    def forward(self, token: str | None = None, seed: int = P_TOKEN) -> None:
        """D's pump collected P's notification and forwards it."""
        notif = proto.push_notif("pd-land", self.spec.notif_token if token is None else token,
                                 seed=seed)
        # The PUSH socket drops a wake until the scheduler's side is connected.
        deadline = time.monotonic() + 5
        while self.waker.num_wakes == 0 and time.monotonic() < deadline:
            self.waker.wake([notif])
            time.sleep(0.01)
        assert self.waker.num_wakes == 1
        # Until it reached the scheduler, however long a loaded host takes to
        # carry it: taken into the inbox the step reads, and a wake put back
        # in its place (a step that sleeps first returns at once, as it
        # would have for the worker's).
        idle = pd(self.pair.d).idle
        assert wait_for(lambda: (idle.drain(),
                                 any(notif in n for _, n in idle._inbox))[1])
        idle.wake()

    def report(self) -> dict:
        """The workers' report of the load, with token #1 and the record."""
        rid = self.req.request_id
        record = telemetry.TransferRecord(
            request_id=rid, remote_request_id="pd-land", p_engine="", p_addr="",
            mode="push", bytes=4096, blocks=3, tokens=N)
        return {"finished_recving": {rid},
                "worker_meta": PDWorkerMetadata([record], {rid: P_TOKEN})}

    def run_to_end(self) -> None:
        """Step D until the request ended (and, async, nothing is in flight)."""
        for _ in range(6):
            if self.req.is_finished():
                break
            step(self.pair.d)
        drain(self.pair.d)

    def close(self) -> None:
        self.waker.close()
        self.pair.close()


@pytest.fixture(params=SCHEDULING_MODES)
def mode(request) -> str:
    return request.param


def landed_count(sched) -> int:
    return pd(sched).num_landed_before_step


def test_the_request_runs_in_the_step_its_landing_is_seen(mode: str) -> None:
    t = Landing(mode)
    try:
        rid = t.req.request_id
        t.forward()
        out, _ = step(t.pair.d, **t.report())
        # The very step that saw the notification computes P's token #1
        # (appended to the prompt), sampling token #2: no empty step first.
        assert out.num_scheduled_tokens.get(rid) == 1, out.num_scheduled_tokens
        assert list(t.req.prompt_token_ids) == [*same_prompt(N), P_TOKEN]
        assert landed_count(t.pair.d) == 1
        t.run_to_end()
        assert t.req.status is RequestStatus.FINISHED_LENGTH_CAPPED
        assert len(t.req.output_token_ids) == t.req.max_tokens
        # The workers' report was taken out of its step: nothing left to strip.
        assert pd(t.pair.d)._claimed == {}
        step(t.pair.d)
        assert_scheduler_empty(t.pair.d)
        step(t.pair.p)
        assert_scheduler_empty(t.pair.p)
    finally:
        t.close()


def test_off_by_default() -> None:
    """``same_step_landing`` is opt-in: a push D without it has no view."""
    pair = Pair("sync")
    try:
        assert pd(pair.d).landing is None
    finally:
        pair.close()


def test_without_a_forward_the_request_waits_for_the_workers_report(mode: str) -> None:
    """The control: the same pair, no forwarded notification."""
    t = Landing(mode)
    try:
        rid = t.req.request_id
        out, _ = step(t.pair.d, **t.report())
        assert rid not in out.num_scheduled_tokens
        out, _ = step(t.pair.d)
        assert out.num_scheduled_tokens.get(rid) == 1
        assert landed_count(t.pair.d) == 0
        t.run_to_end()
        assert t.req.status is RequestStatus.FINISHED_LENGTH_CAPPED
        step(t.pair.d)
        assert_scheduler_empty(t.pair.d)
    finally:
        t.close()


@pytest.mark.parametrize("bad", ["foreign_token", "no_seed"])
def test_a_forward_the_worker_would_not_accept_promotes_nothing(mode: str, bad: str) -> None:
    """A notification not from the registered P, or one without token #1,
    is left to the workers' report, which decides (here: the request ends
    with an error when token #1 is missing)."""
    t = Landing(mode)
    try:
        rid = t.req.request_id
        if bad == "foreign_token":
            t.forward(token="not-the-registration")
        else:
            t.forward(seed=-1)
        out, _ = step(t.pair.d)
        assert rid not in out.num_scheduled_tokens
        assert landed_count(t.pair.d) == 0
        assert t.req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        report = t.report()
        if bad == "no_seed":
            report["worker_meta"] = PDWorkerMetadata()
        step(t.pair.d, **report)
        t.run_to_end()
        expected = (RequestStatus.FINISHED_LENGTH_CAPPED if bad == "foreign_token"
                    else RequestStatus.FINISHED_ERROR)
        assert t.req.status is expected
        step(t.pair.d)
        assert_scheduler_empty(t.pair.d)
    finally:
        t.close()


def test_a_request_aborted_after_its_landing_was_seen_frees_its_blocks_once(mode: str
                                                                            ) -> None:
    """Promoted, then aborted before the workers' report comes: vLLM frees
    its blocks at the abort; the report that follows must not free them again."""
    t = Landing(mode)
    try:
        rid = t.req.request_id
        t.forward()
        step(t.pair.d)
        assert landed_count(t.pair.d) == 1
        t.pair.d.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        step(t.pair.d, **t.report())
        drain(t.pair.d)
        step(t.pair.d)
        assert pd(t.pair.d)._claimed == {}
        assert_scheduler_empty(t.pair.d)
    finally:
        t.close()


def test_a_request_ending_in_that_step_still_answers_with_its_record(mode: str) -> None:
    """max_tokens=1: the first step is the last; the workers' record comes in
    that step's output, and is read before vLLM finishes the request."""
    t = Landing(mode, max_tokens=1, telemetry_in_answer=True)
    try:
        t.forward()
        _, eco = step(t.pair.d, **t.report())
        for _ in range(3):
            if t.req.is_finished() and not is_async(t.pair.d):
                break
            more = drain(t.pair.d) if is_async(t.pair.d) else step(t.pair.d)[1]
            for k, v in more.items():
                eco.setdefault(k, v) if k not in eco else eco[k].outputs.extend(v.outputs)
        assert t.req.is_finished()
        (final,) = [o for e in eco.values() for o in e.outputs
                    if o.request_id == t.req.request_id and o.finish_reason is not None]
        record = (final.kv_transfer_params or {}).get(telemetry.PARAMS_KEY)
        assert record is not None and record["bytes"] == 4096, final.kv_transfer_params
        step(t.pair.d)
        assert_scheduler_empty(t.pair.d)
    finally:
        t.close()


def test_a_failure_in_the_landing_path_turns_it_off_and_the_report_path_serves(
        mode: str, caplog) -> None:
    """A bug in the view must not end the EngineCore: the step goes on, the
    view is turned off, and the load is served by the workers' report."""
    t = Landing(mode)
    try:
        d = pd(t.pair.d)

        def broken(now: float) -> list:
            raise RuntimeError("injected")

        d.landing.collect = broken
        t.forward()
        step(t.pair.d, **t.report())  # no exception out of schedule()
        assert d.landing is None and landed_count(t.pair.d) == 0
        assert any("same-step landing failed" in r.message for r in caplog.records)
        t.run_to_end()
        assert t.req.status is RequestStatus.FINISHED_LENGTH_CAPPED
        step(t.pair.d)
        assert_scheduler_empty(t.pair.d)
    finally:
        t.close()
