"""Concurrent pull (issue 29, item 2; protocol 9) between two real vLLM
Schedulers (P and D) over real side channels.

D's leg arrives beside P's, naming no blocks (``pd_seed_pending``,
``pd_request_id``): D parks it (no block allocated, vLLM asks again each
step), asks P with ``PullWait``; P's ``PullReady`` brings its params and
token #1 once the prefill ended, in either order; D then loads exactly as a
sequential pull leg and appends token #1 to the prompt. The test plays D's
worker (it pins and releases P's lease over the side channel and reports
``finished_recving``). Every test ends with both leak checks.
"""

from __future__ import annotations

import time

import pytest
from pdsched import (
    BLOCK_SIZE,
    SCHEDULING_MODES,
    create_request,
    create_scheduler,
    create_vllm_config,
    drain,
)
from pdunit_utils import free_port, wait_for
from test_push_schedulers import HOST, assert_scheduler_empty, pd, same_prompt, step
from test_push_seed import report_until_finished
from vllm.v1.request import RequestStatus

from vllm_pd_ext.leases.table import LeaseState
from vllm_pd_ext.metadata import PDHandshakeMetadata
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.side_channel import SideChannelClient, SideChannelError
from vllm_pd_ext.wire.specs import monotonic_clock_id

#: The token pdsched's fake forward samples on P: P's token #1.
P_TOKEN = 100
#: An idle wait that P's answer must cut short, and how soon it must: far
#: apart, so that only a wake that never comes fails (a loaded CI host once
#: took 5 s to carry P's answer across the side channel).
IDLE_WAIT_MS = 30_000.0
WOKEN_WITHIN_S = 20.0
#: P's lease: no test here waits for one to expire, and each that shows a
#: lease gone "at once, not at expiry" allows 20 s, so a side channel that
#: stalls for seconds on a loaded host fails neither.
P_LEASE_S = 60.0


class PullPair:
    """A pull P and a pull D scheduler with real side channels."""

    def __init__(self, mode: str = "sync", push_timeout: float = 30.0,
                 idle_wait_ms: float = 10.0, d_extra: dict[str, object] | None = None,
                 d_blocks: int = 64) -> None:
        # 3 s: side-channel requests here must succeed, on a loaded host too.
        common = {"transfer_mode": "pull", "handshake_timeout": 3.0}
        self.p_port, self.d_port = free_port(), free_port()
        self.p = create_scheduler(create_vllm_config(
            "kv_producer", engine_id="eng-p", extra=dict(
                common, side_channel_port=self.p_port, lease_duration=P_LEASE_S)), mode=mode)
        self.d = create_scheduler(create_vllm_config(
            "kv_consumer", engine_id="eng-d", extra=dict(
                common, side_channel_port=self.d_port, heartbeat_interval=0.2,
                push_timeout=push_timeout, push_idle_wait_ms=idle_wait_ms,
                **(d_extra or {})),
            kv_load_failure_policy="recompute"), num_blocks=d_blocks, mode=mode)
        meta = proto.AgentInfo(tp_rank=0, agent_name="a", agent_metadata=b"m",
                               mem_type="DRAM", regions=[proto.Region(0x1000, 64, 64, 64)])
        for sched in (self.p, self.d):
            sched.connector.set_xfer_handshake_metadata({0: PDHandshakeMetadata(agent=meta)})
        self.client = SideChannelClient(2.0)

    def d_leg(self, pd_id: str) -> dict[str, object]:
        """What the proxy sends D beside P's leg (proxy ``legs.py``)."""
        return dict(do_remote_prefill=True, do_remote_decode=False, remote_engine_id="eng-p",
                    remote_host=HOST, remote_port=self.p_port, tp_size=1,
                    remote_request_id=pd_id, pd_request_id=pd_id, transfer_mode="pull",
                    pd_seed_pending=True, pd_bidirectional=False)

    def close(self) -> None:
        self.client.close()
        self.p.connector.shutdown()
        self.d.connector.shutdown()


@pytest.fixture(params=SCHEDULING_MODES)
def pair(request):
    made = PullPair(request.param)
    yield made
    made.close()


def prefill_on_p(pair: PullPair, pd_id: str, n: int, max_tokens: int = 1,
                 prompt: list[int] | None = None):
    req = create_request(n, request_id=f"p-{pd_id}", max_tokens=max_tokens,
                         prompt=prompt or same_prompt(n), kv_transfer_params={
                             "do_remote_decode": True, "pd_request_id": pd_id,
                             "pd_first_token": True})
    pair.p.add_request(req)
    for _ in range(10):
        step(pair.p)
        if req.is_finished():
            drain(pair.p)
            return req
    raise AssertionError("prefill did not finish")


def park_on_d(pair: PullPair, pd_id: str, n: int, max_tokens: int = 3):
    req = create_request(n, request_id=f"d-{pd_id}", max_tokens=max_tokens,
                         prompt=same_prompt(n), kv_transfer_params=pair.d_leg(pd_id))
    free = pair.d.kv_cache_manager.block_pool.get_num_free_blocks()
    pair.d.add_request(req)
    out, _ = step(pair.d)
    return req, out, free


def step_until_recv(pair: PullPair, req, within_s: float = 30.0, out=None):
    """Step D until its scheduler hands the worker the READ of ``req``
    (``out``: a step already taken, which may have handed it: P's answer
    can reach D within the step that parked the request)."""
    if out is not None:
        for spec in out.kv_connector_metadata.reqs_to_recv:
            if spec.request_id == req.request_id:
                return spec
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        out, _ = step(pair.d)
        for spec in out.kv_connector_metadata.reqs_to_recv:
            if spec.request_id == req.request_id:
                return spec
        time.sleep(0.01)
    raise AssertionError(f"no READ for {req.request_id}; status {req.status}")


def play_worker(pair: PullPair, spec) -> None:
    """D's worker (the READ itself is not played): no pin where P's answer
    extended the lease (``spec.valid_until``, protocol 10), else pin; then
    release."""
    if not spec.valid_until:
        status = pair.client.request(HOST, pair.p_port, proto.LeaseRenew(
            engine_id="eng-d", request_ids=[spec.remote_request_id], acquire=True, tp_rank=0,
            consumer=spec.request_id, consumer_ranks=1))
        assert isinstance(status, proto.LeaseStatus) and status.remaining_s[0] > 0, status
    pair.client.request(HOST, pair.p_port, proto.LeaseRelease(
        engine_id="eng-d", request_ids=[spec.remote_request_id], tp_rank=0, ok=True,
        consumer=spec.request_id))


def both_empty(pair: PullPair) -> None:
    step(pair.d)
    assert_scheduler_empty(pair.d)
    assert wait_for(lambda: (step(pair.p), len(pd(pair.p).lender) == 0)[1])
    assert_scheduler_empty(pair.p)


@pytest.mark.parametrize("order", ["d_first", "p_first"])
def test_parked_until_p_answers_then_reads_p_blocks_and_computes_only_token_one(
        pair: PullPair, order: str) -> None:
    n = 2 * BLOCK_SIZE + 7
    if order == "p_first":
        p_req = prefill_on_p(pair, "pd-1", n)
    d_req, out, free = park_on_d(pair, "pd-1", n)
    if order == "d_first":
        # Parked: vLLM asks again every step, nothing is allocated or read.
        assert d_req.status is RequestStatus.WAITING
        assert out.kv_connector_metadata.reqs_to_recv == []
        assert pair.d.kv_cache_manager.block_pool.get_num_free_blocks() == free
        assert wait_for(lambda: "pd-1" in pd(pair.p).pull_producer._waits)
        p_req = prefill_on_p(pair, "pd-1", n)
    spec = step_until_recv(pair, d_req, out=out if order == "p_first" else None)
    # P's lease, under the proxy's id both legs carried; P's blocks exactly.
    assert spec.remote_request_id == "pd-1" and spec.remote_engine_id == "eng-p"
    assert len(spec.remote_block_ids) == 3 and spec.num_tokens == n
    assert d_req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    # No pin round trip: P extended its lease (P_LEASE_S) as it answered,
    # after D's wait was in; D's bound starts at that wait's send time.
    parked_at = pd(pair.d).d._reqs[d_req.request_id].arrived
    assert parked_at < spec.valid_until <= time.monotonic() + P_LEASE_S
    assert spec.clock == monotonic_clock_id() != ""  # the clock it is on
    lease = pd(pair.p).lender.leases.table.get("pd-1")
    assert lease is not None and lease.state is LeaseState.HELD
    assert [(c.engine_id, c.request_id, r) for c, r in lease.holders] == [
        ("eng-d", d_req.request_id, -1)]
    play_worker(pair, spec)
    outputs, scheduled = report_until_finished(pair, d_req, finished_recving={d_req.request_id})
    # P's token #1 is the prompt's last token; D's first step computed only it.
    assert list(d_req.prompt_token_ids) == [*same_prompt(n), P_TOKEN]
    assert list(p_req.output_token_ids) == [P_TOKEN]
    assert next(iter(scheduled.values())) == 1, scheduled
    assert sum(scheduled.values()) == d_req.max_tokens
    assert d_req.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert all(str(o.finish_reason) != "error" for o in outputs)
    rec = pd(pair.d).d  # the parked time is in the record's p_wait_ms
    assert d_req.request_id not in rec
    both_empty(pair)


def _ends_with_error(pair: PullPair, d_req, within_s: float = 30.0) -> list:
    outputs: list = []
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        _, eco = step(pair.d)
        outputs += [o for e in eco.values() for o in e.outputs
                    if o.request_id == d_req.request_id]
        if d_req.is_finished():
            break
        time.sleep(0.01)
    for e in drain(pair.d).values():
        outputs += [o for o in e.outputs if o.request_id == d_req.request_id]
    assert d_req.status is RequestStatus.FINISHED_ERROR, d_req.status
    assert str(outputs[-1].finish_reason) == "error"
    # Never sampled token #1 itself, whatever kv_load_failure_policy (recompute here).
    assert list(d_req.output_token_ids) == [] and d_req.num_computed_tokens == 0
    return outputs


def test_p_prefill_that_hands_nothing_over_ends_d_with_an_error(pair: PullPair, caplog) -> None:
    n = BLOCK_SIZE + 3
    d_req, _, _ = park_on_d(pair, "pd-stop", n)
    assert wait_for(lambda: "pd-stop" in pd(pair.p).pull_producer._waits)
    # Aborted on P (the proxy cancelled P's leg): no KV, D learns at once.
    p_req = create_request(n, request_id="p-stop", max_tokens=1, prompt=same_prompt(n),
                           kv_transfer_params={"do_remote_decode": True,
                                               "pd_request_id": "pd-stop"})
    pair.p.add_request(p_req)
    pair.p.finish_requests([p_req.request_id], RequestStatus.FINISHED_ABORTED)
    _ends_with_error(pair, d_req)
    assert any("P reports no KV" in r.message and "FINISHED_ABORTED" in r.message
               for r in caplog.records)
    both_empty(pair)


def test_d_ending_while_parked_cancels_and_p_frees_the_blocks_it_lends(pair: PullPair) -> None:
    n = 2 * BLOCK_SIZE
    d_req, _, _ = park_on_d(pair, "pd-gone", n)
    assert wait_for(lambda: "pd-gone" in pd(pair.p).pull_producer._waits)
    pair.d.finish_requests([d_req.request_id], RequestStatus.FINISHED_ABORTED)
    assert wait_for(lambda: "pd-gone" in pd(pair.p).pull_producer._cancelled)
    prefill_on_p(pair, "pd-gone", n)
    # Nobody will read it: P evicted the lease at once, not at its expiry.
    assert "pd-gone" not in pd(pair.p).pull_producer._ready
    both_empty(pair)


def test_cancel_after_p_answered_evicts_the_unread_lease(pair: PullPair) -> None:
    n = 2 * BLOCK_SIZE
    d_req, _, _ = park_on_d(pair, "pd-late", n)
    assert wait_for(lambda: "pd-late" in pd(pair.p).pull_producer._waits)
    prefill_on_p(pair, "pd-late", n)
    assert "pd-late" in pd(pair.p).lender
    # D ends before it took P's answer (no step ran in between).
    pair.d.finish_requests([d_req.request_id], RequestStatus.FINISHED_ABORTED)
    assert wait_for(lambda: (step(pair.p), "pd-late" not in pd(pair.p).lender)[1],
                    timeout=P_LEASE_S / 3)
    both_empty(pair)


def test_wait_past_push_timeout_ends_with_an_error_naming_it(caplog) -> None:
    pair = PullPair(push_timeout=0.3)
    try:
        d_req, _, _ = park_on_d(pair, "pd-never", BLOCK_SIZE + 1)
        _ends_with_error(pair, d_req)
        assert any("within push_timeout" in r.message and "prefill leg reach it" in r.message
                   for r in caplog.records)
        # P forgets the wait once its ttl passed (the sweep runs each step).
        assert wait_for(lambda: (step(pair.p),
                                 "pd-never" not in pd(pair.p).pull_producer._waits)[1])
        both_empty(pair)
    finally:
        pair.close()


def test_p_restarted_since_probed_refuses_the_wait(caplog) -> None:
    pair = PullPair()
    try:
        leg = dict(pair.d_leg("pd-stale"), remote_engine_id="eng-old")
        d_req = create_request(BLOCK_SIZE, request_id="d-stale", max_tokens=2,
                               prompt=same_prompt(BLOCK_SIZE), kv_transfer_params=leg)
        pair.d.add_request(d_req)
        _ends_with_error(pair, d_req)
        assert any("P refused the wait" in r.message and "P restarted" in r.message
                   for r in caplog.records)
        both_empty(pair)
    finally:
        pair.close()


def test_an_answer_for_another_prompt_is_refused_and_its_lease_freed(pair: PullPair,
                                                                     caplog) -> None:
    n = 2 * BLOCK_SIZE
    d_req, _, _ = park_on_d(pair, "pd-other", n)
    assert wait_for(lambda: "pd-other" in pd(pair.p).pull_producer._waits)
    prefill_on_p(pair, "pd-other", n, prompt=[7] * n)
    _ends_with_error(pair, d_req)
    assert any("prefill of another prompt" in r.message for r in caplog.records)
    both_empty(pair)  # D's cancel made P evict the lease nobody reads


def test_hostile_pull_answers_are_refused_and_change_nothing(pair: PullPair) -> None:
    d_req, _, _ = park_on_d(pair, "pd-h", BLOCK_SIZE)

    def send(msg: proto.Request) -> proto.Reply | SideChannelError:
        try:
            return pair.client.request(HOST, pair.d_port, msg)
        except SideChannelError as exc:
            return exc

    wrong = send(proto.PullReady(engine_id="eng-x", pd_request_id="pd-h", ok=False,
                                 detail="spoofed"))
    unknown = send(proto.PullReady(engine_id="eng-p", pd_request_id="pd-nobody", ok=False))
    waits_on_d = send(proto.PullWait(
        engine_id="eng-x", expect_engine_id="eng-d", pd_request_id="pd-h", request_id="x",
        notify_host=HOST, notify_port=1, ttl_s=1.0))
    assert isinstance(wrong, SideChannelError) and wrong.code == proto.ErrorCode.REFUSED
    assert isinstance(unknown, SideChannelError) and unknown.code == proto.ErrorCode.UNKNOWN
    # D is a pull consumer: it holds no prefills, whatever it is asked.
    assert isinstance(waits_on_d, SideChannelError)
    for _ in range(5):
        step(pair.d)
    assert d_req.status is RequestStatus.WAITING and not d_req.is_finished()
    # Another D cannot take over P's wait for this id.
    other = proto.PullWait(engine_id="eng-x", expect_engine_id="eng-p", pd_request_id="pd-h",
                           request_id="x", notify_host=HOST, notify_port=1, ttl_s=1.0)
    with pytest.raises(SideChannelError, match="awaited by another engine"):
        pair.client.request(HOST, pair.p_port, other)
    pair.d.finish_requests([d_req.request_id], RequestStatus.FINISHED_ABORTED)
    both_empty(pair)


def test_an_idle_d_sleeps_while_parked_and_p_answer_wakes_it() -> None:
    """D's steps while a leg is parked schedule nothing: each sleeps up to
    ``push_idle_wait_ms`` (not vLLM's back-to-back empty steps, which take
    the CPU from P on a shared host); P's answer wakes the sleep at once,
    and the step after it skips vLLM's idle yield."""
    import threading

    pair = PullPair(idle_wait_ms=IDLE_WAIT_MS)
    try:
        d_req, _, _ = park_on_d(pair, "pd-idle", BLOCK_SIZE)  # (its step slept: no answer)
        assert wait_for(lambda: "pd-idle" in pd(pair.p).pull_producer._waits)
        idle = pd(pair.d).idle
        assert idle is not None and idle.num_waits >= 1
        woken = idle.num_woken
        timer = threading.Timer(0.2, lambda: prefill_on_p(pair, "pd-idle", BLOCK_SIZE))
        timer.start()
        t0 = time.monotonic()
        step(pair.d)  # sleeps until P's answer arrives (not the whole wait)
        took = time.monotonic() - t0
        timer.join()
        assert idle.num_woken == woken + 1 and took < WOKEN_WITHIN_S, took
        assert pd(pair.d).take_loads_reported()  # vLLM's idle yield is skipped
        spec = step_until_recv(pair, d_req)
        play_worker(pair, spec)
        report_until_finished(pair, d_req, finished_recving={d_req.request_id})
        assert d_req.status is RequestStatus.FINISHED_LENGTH_CAPPED
        both_empty(pair)
    finally:
        pair.close()


@pytest.mark.parametrize("mode", SCHEDULING_MODES)
def test_with_same_step_landing_the_step_p_answer_wakes_starts_the_read(mode: str) -> None:
    """``same_step_landing``: an idle D sleeps before ``schedule()``, so the
    ``schedule()`` P's answer wakes allocates the request and that very
    step carries its READ to the workers. (Without the key, the step slept
    in was already planned empty: the READ leaves a step later, above.)"""
    import threading

    pair = PullPair(mode, idle_wait_ms=IDLE_WAIT_MS, d_extra={"same_step_landing": True})
    try:
        sched = pd(pair.d)
        assert sched._pull_wait_first and sched.landing is None
        d_req, _, free = park_on_d(pair, "pd-first", 2 * BLOCK_SIZE + 3)
        assert wait_for(lambda: "pd-first" in pd(pair.p).pull_producer._waits)
        idle = sched.idle
        assert idle is not None
        waits, woken = idle.num_waits, idle.num_woken
        timer = threading.Timer(0.2, lambda: prefill_on_p(pair, "pd-first", 2 * BLOCK_SIZE + 3))
        timer.start()
        t0 = time.monotonic()
        out, _ = step(pair.d)  # sleeps before schedule() until P's answer arrives
        took = time.monotonic() - t0
        timer.join()
        assert (idle.num_woken == woken + 1 and idle.num_waits == waits + 1
                and took < WOKEN_WITHIN_S), took
        (spec,) = out.kv_connector_metadata.reqs_to_recv
        assert spec.request_id == d_req.request_id and spec.remote_request_id == "pd-first"
        assert d_req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        # Its blocks (the prompt's three) were allocated in that schedule().
        assert pair.d.kv_cache_manager.block_pool.get_num_free_blocks() == free - 3
        play_worker(pair, spec)
        report_until_finished(pair, d_req, finished_recving={d_req.request_id})
        assert d_req.status is RequestStatus.FINISHED_LENGTH_CAPPED
        assert d_req.output_token_ids[0] == P_TOKEN
        both_empty(pair)
    finally:
        pair.close()


def test_with_same_step_landing_a_step_with_work_does_not_sleep() -> None:
    """The wait before ``schedule()`` is for an idle D only: with a request
    running beside the parked leg, D's steps never sleep."""
    pair = PullPair(idle_wait_ms=IDLE_WAIT_MS, d_extra={"same_step_landing": True})
    try:
        local = create_request(BLOCK_SIZE, request_id="local", max_tokens=50)
        pair.d.add_request(local)
        step(pair.d)
        d_req, _, _ = park_on_d(pair, "pd-busy", BLOCK_SIZE)
        idle = pd(pair.d).idle
        assert idle is not None
        t0 = time.monotonic()
        for _ in range(5):
            step(pair.d)
        # Five steps on a loaded host; one idle wait alone takes IDLE_WAIT_MS.
        assert time.monotonic() - t0 < WOKEN_WITHIN_S and idle.num_waits == 0
        assert local.status is RequestStatus.RUNNING and d_req.status is RequestStatus.WAITING
        pair.d.finish_requests([local.request_id, d_req.request_id],
                               RequestStatus.FINISHED_ABORTED)
        both_empty(pair)
    finally:
        pair.close()


def test_p_answer_holds_the_lease_for_the_waiting_d_alone(pair: PullPair) -> None:
    """P's answer extends the lease and holds it for the waiting D request,
    as D's pin would (protocol 10; D reads unpinned): another engine's
    release or heartbeat is refused; D's own release (no pin) frees it."""
    n = 2 * BLOCK_SIZE + 1
    d_req, _, _ = park_on_d(pair, "pd-own", n)
    assert wait_for(lambda: "pd-own" in pd(pair.p).pull_producer._waits)
    prefill_on_p(pair, "pd-own", n)
    spec = step_until_recv(pair, d_req)
    assert spec.valid_until > time.monotonic() + P_LEASE_S / 2
    for msg in (proto.LeaseRelease(engine_id="eng-x", request_ids=["pd-own"], tp_rank=0,
                                   consumer="x-1"),
                proto.LeaseRenew(engine_id="eng-x", request_ids=["pd-own"], acquire=True,
                                 tp_rank=0, consumer="x-1")):
        pair.client.request(HOST, pair.p_port, msg)
    for _ in range(3):
        step(pair.p)
    lease = pd(pair.p).lender.leases.table.get("pd-own")
    assert lease is not None and lease.state is LeaseState.HELD and not lease.released_ranks
    assert pd(pair.p).lender.leases.num_wrong_sender == 2
    play_worker(pair, spec)  # D: no pin, READ (not played), release
    report_until_finished(pair, d_req, finished_recving={d_req.request_id})
    assert d_req.status is RequestStatus.FINISHED_LENGTH_CAPPED
    both_empty(pair)


def test_d_ending_after_p_answer_but_before_its_load_frees_p_blocks_at_once() -> None:
    """D took P's answer but had no free blocks for it (its KV cache is
    full), so its load was never scheduled; the client then gives up. D's
    scheduler releases P's lease naming the request, which drops the hold
    P's answer gave it: P frees the blocks now, not when the lease expires."""
    pair = PullPair(d_blocks=8)
    try:
        local = create_request(6 * BLOCK_SIZE, request_id="local", max_tokens=80)
        pair.d.add_request(local)
        step(pair.d)
        n = 2 * BLOCK_SIZE + 1  # 3 blocks; D has 1 free
        d_req, _, _ = park_on_d(pair, "pd-full", n)
        assert wait_for(lambda: "pd-full" in pd(pair.p).pull_producer._waits)
        prefill_on_p(pair, "pd-full", n)
        book = pd(pair.d).d._reqs
        assert wait_for(lambda: (step(pair.d), not book[d_req.request_id].parked)[1])
        for _ in range(3):
            out, _ = step(pair.d)
            assert out.kv_connector_metadata.reqs_to_recv == []
        assert d_req.status is RequestStatus.WAITING and local.status is RequestStatus.RUNNING
        pair.d.finish_requests([d_req.request_id], RequestStatus.FINISHED_ABORTED)
        # The lease lasts P_LEASE_S; it is gone well before.
        assert wait_for(lambda: (step(pair.p), "pd-full" not in pd(pair.p).lender)[1],
                        timeout=P_LEASE_S / 3)
        pair.d.finish_requests([local.request_id], RequestStatus.FINISHED_ABORTED)
        both_empty(pair)
    finally:
        pair.close()
