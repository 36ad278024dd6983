"""Token #1 with the KV (issue 29, ``pd_seed_pending``) between two real
vLLM Schedulers in push mode.

The proxy sends D's leg beside P's, before token #1 exists: D registers
asking for it, P's WRITE order carries the token P sampled, D's worker
hands it up with the load's report, and D appends it to the prompt before
the first step, which then computes that one token (sampling token #2).
Without it (no seed, a failed load) the request ends with an error under
either ``kv_load_failure_policy``: D must never sample token #1 again, the
client has P's. The test plays both workers, as test_push_schedulers.py.
"""

from __future__ import annotations

import pytest
from pdsched import BLOCK_SIZE, SCHEDULING_MODES, create_request, drain
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

#: The token pdsched's fake forward samples on P: P's token #1.
P_TOKEN = 100


@pytest.fixture(params=[(m, policy) for m in SCHEDULING_MODES for policy in ("recompute",
                                                                             "fail")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def pair(request):
    made = Pair(*request.param)
    yield made
    made.close()


def admit_pending(pair: Pair, pd_id: str, num_tokens: int, max_tokens: int = 3):
    params = dict(pair.d_params(pd_id), pd_seed_pending=True)
    req = create_request(num_tokens, request_id=f"d-{pd_id}", max_tokens=max_tokens,
                         prompt=same_prompt(num_tokens), kv_transfer_params=params)
    pair.d.add_request(req)
    out, _ = step(pair.d)
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    return req, out.kv_connector_metadata


def report_until_finished(pair: Pair, req, **report) -> tuple[list, dict[str, int]]:
    """D's worker reports the load; step until the request ends. Returns
    (every output of the request, tokens scheduled for it per step)."""
    outputs: list = []
    scheduled: dict[str, int] = {}
    kw = report
    for i in range(8):
        out, eco = step(pair.d, **kw)
        kw = {}
        n = out.num_scheduled_tokens.get(req.request_id)
        if n:
            scheduled[f"step{i}"] = n
        outputs += [o for e in eco.values() for o in e.outputs if o.request_id == req.request_id]
        if req.is_finished():
            break
    for e in drain(pair.d).values():
        outputs += [o for o in e.outputs if o.request_id == req.request_id]
    return outputs, scheduled


def test_seed_comes_with_the_write_and_d_computes_only_it(pair: Pair) -> None:
    n = 2 * BLOCK_SIZE + 7
    d_req, meta = admit_pending(pair, "pd-seed", n)
    (spec,) = meta.push_recv
    assert spec.want_seed
    assert wait_for(lambda: pd(pair.p).producer.book.state("pd-seed") is PushState.REGISTERED)
    prefill_on_p(pair, "pd-seed", n)
    order = pair.next_order()
    assert order is not None and order.seed == P_TOKEN
    pair.settle_write("pd-seed")
    outputs, scheduled = report_until_finished(
        pair, d_req, finished_recving={d_req.request_id},
        worker_meta=PDWorkerMetadata(seeds={d_req.request_id: P_TOKEN}))
    # P's token #1 is the prompt's last token now; D's first step computed
    # it alone (a decode step's work), never P's prompt again.
    assert list(d_req.prompt_token_ids) == [*same_prompt(n), P_TOKEN]
    assert d_req.num_prompt_tokens == n + 1
    assert next(iter(scheduled.values())) == 1, scheduled
    assert sum(scheduled.values()) == d_req.max_tokens  # one step per token: no prefill
    assert d_req.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert len(d_req.output_token_ids) == d_req.max_tokens
    assert all(str(o.finish_reason) != "error" for o in outputs)
    step(pair.d)
    assert_scheduler_empty(pair.d)
    step(pair.p)
    assert_scheduler_empty(pair.p)


@pytest.mark.parametrize("how", ["no_seed", "load_failed", "out_of_vocabulary"])
def test_without_token_one_d_ends_with_an_error_under_either_policy(pair: Pair, how: str,
                                                                    caplog) -> None:
    """The recompute policy would sample token #1 again (the client has
    P's): the request ends with an error instead, having run no step, and
    every block is free."""
    n = BLOCK_SIZE + 3
    d_req, _ = admit_pending(pair, f"pd-{how}", n)
    report: dict = {"finished_recving": {d_req.request_id}}
    if how == "load_failed":
        report["failed_recving"] = {d_req.request_id}
    elif how == "out_of_vocabulary":
        report["worker_meta"] = PDWorkerMetadata(seeds={d_req.request_id: 10**9})
    outputs, scheduled = report_until_finished(pair, d_req, **report)
    assert d_req.status is RequestStatus.FINISHED_ERROR
    assert scheduled == {}  # never computed a token
    assert [o.finish_reason for o in outputs if o.finish_reason is not None] == [
        outputs[-1].finish_reason] and str(outputs[-1].finish_reason) == "error"
    assert list(d_req.prompt_token_ids) == same_prompt(n)
    assert list(d_req.output_token_ids) == []
    why = {"no_seed": "carried no token #1", "load_failed": "its KV load failed",
           "out_of_vocabulary": "outside this model's vocabulary"}[how]
    ours = any("cannot continue after P's token #1" in r.message and why in r.message
               for r in caplog.records)
    # Under ``fail`` vLLM itself ends a failed load first; the rest is ours.
    assert ours is (how != "load_failed" or pair.d.recompute_kv_load_failures)
    step(pair.d)
    assert_scheduler_empty(pair.d)
    # P never prefilled: abandon what D registered.
    step(pair.p)


def test_a_seed_pending_leg_in_pull_mode_is_refused_and_ends_with_an_error() -> None:
    """The seed only travels with push's WRITE: a pull D refuses the leg
    (its load fails, naming the field) and still never recomputes it."""
    from pdsched import create_scheduler, create_vllm_config
    from pdunit_utils import free_port

    sched = create_scheduler(create_vllm_config(
        "kv_consumer", engine_id="eng-d", extra={"handshake_timeout": 3.0},
        kv_load_failure_policy="recompute"))
    try:
        req = create_request(100, request_id="d-pull", max_tokens=2, kv_transfer_params=dict(
            do_remote_prefill=True, remote_engine_id="eng-p", remote_host="127.0.0.1",
            remote_port=free_port(), remote_block_ids=[1], remote_request_id="p-1",
            remote_num_tokens=100, pd_seed_pending=True))
        sched.add_request(req)
        out, _ = step(sched)
        assert "pd_seed_pending needs no pd_seeded_tokens and transfer_mode 'push'" in (
            out.kv_connector_metadata.reqs_to_fail[req.request_id][1])
        step(sched, finished_recving={req.request_id}, failed_recving={req.request_id})
        drain(sched)
        assert req.status is RequestStatus.FINISHED_ERROR
        step(sched)
        assert_scheduler_empty(sched)
    finally:
        sched.connector.shutdown()
