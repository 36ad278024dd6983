"""Push mode between two real vLLM Schedulers (P and D) over real side channels.

No workers run: the test plays P's worker (it reads the WRITE orders from
P's order socket and reports the WRITE settled) and D's worker (it reports
``finished_recving``). Every test ends with both leak checks.
"""

from __future__ import annotations

import time

import pytest
import zmq
from pdsched import (
    BLOCK_SIZE,
    SCHEDULING_MODES,
    create_request,
    create_scheduler,
    create_vllm_config,
    drain,
    engine_step,
    is_async,
)
from pdsched import assert_scheduler_empty as assert_no_leak
from pdunit_utils import FakeClock, free_port, wait_for
from vllm.v1.request import RequestStatus

from vllm_pd_ext.leases.table import LeaseState
from vllm_pd_ext.metadata import PDHandshakeMetadata
from vllm_pd_ext.scheduler.pushbook import PushState
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.pump_bell import Bell, BellRinger
from vllm_pd_ext.wire.side_channel import SideChannelClient, SideChannelError

HOST = "127.0.0.1"
LEASE_S = 2.0


def agent(name: str) -> proto.AgentInfo:
    return proto.AgentInfo(tp_rank=0, agent_name=name, agent_metadata=b"meta-" + name.encode(),
                           mem_type="DRAM", regions=[proto.Region(0x1000, 64, 64, 64)])


class Pair:
    """A push P and a push D scheduler, plus P's (fake) worker order socket."""

    def __init__(self, mode: str = "sync", d_policy: str = "fail",
                 d_extra: dict[str, object] | None = None) -> None:
        # 3 s: side-channel requests here must succeed, on a loaded host too.
        common = {"transfer_mode": "push", "handshake_timeout": 3.0}
        self.p_port, self.d_port = free_port(), free_port()
        self.p = create_scheduler(create_vllm_config(
            "kv_producer", engine_id="eng-p", extra=dict(
                common, side_channel_port=self.p_port, lease_duration=LEASE_S)), mode=mode)
        self.d = create_scheduler(create_vllm_config(
            "kv_consumer", engine_id="eng-d", extra=dict(
                common, side_channel_port=self.d_port, heartbeat_interval=0.2,
                push_timeout=30.0, **(d_extra or {})), kv_load_failure_policy=d_policy),
            mode=mode)
        self.ctx = zmq.Context()
        self.orders = self.ctx.socket(zmq.PULL)
        self.orders.setsockopt(zmq.LINGER, 0)
        order_port = self.orders.bind_to_random_port("tcp://127.0.0.1")
        self.p.connector.set_xfer_handshake_metadata({0: PDHandshakeMetadata(
            agent=agent("p-agent"), order_endpoint=f"tcp://127.0.0.1:{order_port}")})
        self.d.connector.set_xfer_handshake_metadata({0: PDHandshakeMetadata(
            agent=agent("d-agent"))})
        self.client = SideChannelClient(2.0)

    def d_params(self, pd_id: str) -> dict[str, object]:
        return dict(do_remote_prefill=True, transfer_mode="push", remote_engine_id="eng-p",
                    remote_host=HOST, remote_port=self.p_port, tp_size=1,
                    remote_request_id=pd_id, pd_request_id=pd_id)

    def next_order(self, timeout_ms: int = 3000) -> proto.WriteOrder | None:
        if not self.orders.poll(timeout_ms):
            return None
        return proto.decode_order(self.orders.recv())

    def settle_write(self, pd_id: str, ok: bool = True, reason: str = "") -> None:
        """What P's worker sends when its WRITE finished."""
        self.client.request(HOST, self.p_port, proto.LeaseRelease(
            engine_id="eng-p", request_ids=[pd_id], tp_rank=0, ok=ok, reason=reason))

    def close(self) -> None:
        self.client.close()
        self.p.connector.shutdown()
        self.d.connector.shutdown()
        self.orders.close()
        self.ctx.term()


@pytest.fixture(params=SCHEDULING_MODES)
def pair(request):
    """Under vLLM's Scheduler (sync) and AsyncScheduler (async, pdsched)."""
    made = Pair(request.param)
    yield made
    made.close()


def step(sched, **output_kw):
    return engine_step(sched, **output_kw)


def assert_scheduler_empty(sched) -> None:
    """The leak check; async: after the steps in flight and one more."""
    if is_async(sched):
        drain(sched)
        step(sched)
        drain(sched)
    assert_no_leak(sched)


def same_prompt(num_tokens: int) -> list[int]:
    """P and D of one push see the same prompt (P checks its digest)."""
    return [10 + (7 * i) % 3000 for i in range(num_tokens)]


def prefill_on_p(pair: Pair, pd_id: str, num_tokens: int, request_id: str = "p-internal",
                 prompt: list[int] | None = None):
    req = create_request(num_tokens, request_id=request_id, max_tokens=1,
                         prompt=prompt or same_prompt(num_tokens), kv_transfer_params={
        "do_remote_decode": True, "transfer_mode": "push", "pd_request_id": pd_id})
    pair.p.add_request(req)
    for _ in range(10):
        step(pair.p)
        if req.is_finished():
            drain(pair.p)
            return req
    raise AssertionError("prefill did not finish")


def admit_on_d(pair: Pair, pd_id: str, num_tokens: int, request_id: str = "d-internal"):
    req = create_request(num_tokens, request_id=request_id, max_tokens=2,
                         prompt=same_prompt(num_tokens), kv_transfer_params=pair.d_params(pd_id))
    pair.d.add_request(req)
    out, _ = step(pair.d)
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    return req, out.kv_connector_metadata


def pd(sched):
    return sched.connector._scheduler


def wait_push_fail(pair: Pair, d_req, pause: float = 0.02) -> tuple[str, str]:
    """Step D until its scheduler hands the worker a failed push; returns
    (reason, detail) for ``d_req``."""
    fail: dict[str, tuple[str, str]] = {}
    deadline = time.monotonic() + 30.0  # a side-channel crossing or two, on a loaded host
    while time.monotonic() < deadline:
        out, _ = step(pair.d)
        fail.update(out.kv_connector_metadata.push_fail)
        if fail:
            break
        time.sleep(pause)
    return fail[d_req.request_id]


def finish_both(pair: Pair, d_req) -> None:
    step(pair.d, finished_recving={d_req.request_id})
    for _ in range(5):
        step(pair.d)
        if d_req.is_finished():
            break
    drain(pair.d)
    assert d_req.is_finished()
    step(pair.d)
    step(pair.p)  # P's sweep frees the released lease
    assert_scheduler_empty(pair.d)
    assert_scheduler_empty(pair.p)


def fail_load_and_check_both_empty(pair: Pair, d_req) -> None:
    """D's worker reports the failed load: the request ends (policy fail)
    and neither engine holds anything."""
    step(pair.d, finished_recving={d_req.request_id}, failed_recving={d_req.request_id})
    step(pair.d)
    assert d_req.is_finished()  # kv_load_failure_policy=fail
    step(pair.d)
    assert_scheduler_empty(pair.d)
    step(pair.p)
    assert_scheduler_empty(pair.p)


def test_registration_first_then_prefill_orders_exact_blocks(pair: Pair) -> None:
    d_req, meta = admit_on_d(pair, "pd-1", 3 * BLOCK_SIZE + 5)
    (spec,) = meta.push_recv
    assert spec.pd_request_id == "pd-1" and len(spec.local_block_ids) == 4
    assert wait_for(lambda: pd(pair.p).producer.book.state("pd-1") is PushState.REGISTERED)
    assert pair.next_order(100) is None  # nothing to write before the prefill
    p_req = prefill_on_p(pair, "pd-1", 3 * BLOCK_SIZE + 5)
    order = pair.next_order()
    assert order is not None
    assert order.dst_block_ids == spec.local_block_ids
    assert len(order.src_block_ids) == 4 and order.agent.agent_name == "d-agent"
    assert (order.request_id, order.d_request_id) == (p_req.request_id, d_req.request_id)
    # Held for the WRITE: never expires, even long past the lease.
    assert pd(pair.p).leases.table.get("pd-1").state is LeaseState.WRITING
    pair.settle_write("pd-1")
    assert wait_for(lambda: pd(pair.p).producer.book.state("pd-1") is PushState.DONE)
    finish_both(pair, d_req)


def test_heartbeats_keyed_by_pd_request_id_keep_p_lease_alive(pair: Pair) -> None:
    """P's prefill finishes first; D has the request (and heartbeats) but has
    not registered yet: D's heartbeats, sent under the shared id while both
    engines use other internal ids, keep P's lease past its duration."""
    pd_id = "pd-hb"
    d_req = create_request(200, request_id="d-internal-hb", max_tokens=2,
                           prompt=same_prompt(200), kv_transfer_params=pair.d_params(pd_id))
    pair.d.connector.on_new_request(d_req)  # arrival: heartbeats start (no schedule yet)
    leases = pd(pair.p).leases
    # P's leases on a clock the test moves (from now on), so that a host
    # stalled for seconds cannot expire the lease between two heartbeats.
    clock = FakeClock(time.monotonic())
    leases.table._clock = clock
    prefill_on_p(pair, pd_id, 200, request_id="p-internal-hb")
    lease = leases.table.get(pd_id)
    assert lease is not None
    for _ in range(3):  # a renewal in each half lease, 1.5 leases in all
        renewals = lease.num_renewals
        assert wait_for(lambda: lease.num_renewals > renewals)  # noqa: B023
        clock.advance(LEASE_S / 2)
    step(pair.p)  # sweeps: an unrenewed lease would be gone now
    assert leases.table.get(pd_id) is lease and lease.state is LeaseState.HELD
    # Now D schedules the request: the registration matches at once.
    pair.d.add_request(d_req)
    out, _ = step(pair.d)
    (spec,) = out.kv_connector_metadata.push_recv
    order = pair.next_order()
    assert order is not None and order.dst_block_ids == spec.local_block_ids
    pair.settle_write(pd_id)
    finish_both(pair, d_req)


def test_d_abort_after_registration_waits_for_p_then_frees(pair: Pair) -> None:
    d_req, _ = admit_on_d(pair, "pd-abort", 150)
    assert wait_for(lambda: pd(pair.p).producer.book.state("pd-abort") is PushState.REGISTERED)
    pair.d.finish_requests(d_req.request_id, RequestStatus.FINISHED_ABORTED)
    assert d_req.request_id in pair.d.requests  # blocks kept: a WRITE might land
    assert wait_push_fail(pair, d_req)[0] == "aborted"
    assert pd(pair.p).producer.book.state("pd-abort") is PushState.ABORTED
    # D's worker reports it: vLLM frees the blocks.
    step(pair.d, finished_recving={d_req.request_id}, failed_recving={d_req.request_id})
    step(pair.d)
    assert_scheduler_empty(pair.d)
    # P's prefill for the aborted id is freed at once and never written.
    prefill_on_p(pair, "pd-abort", 150)
    assert pair.next_order(300) is None
    step(pair.p)
    assert_scheduler_empty(pair.p)


def test_d_abort_while_write_in_flight_keeps_blocks_until_settled(pair: Pair) -> None:
    d_req, _ = admit_on_d(pair, "pd-inflight", 150)
    assert wait_for(lambda: pd(pair.p).producer.book.state("pd-inflight") is PushState.REGISTERED)
    prefill_on_p(pair, "pd-inflight", 150)
    assert pair.next_order() is not None  # the WRITE is now "in flight"
    pair.d.finish_requests(d_req.request_id, RequestStatus.FINISHED_ABORTED)
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:  # P answers in_flight: D must keep waiting
        out, _ = step(pair.d)
        assert out.kv_connector_metadata.push_fail == {}
        time.sleep(0.05)
    assert d_req.request_id in pair.d.requests
    pair.settle_write("pd-inflight")
    # D re-asks every second; now P says done.
    assert wait_push_fail(pair, d_req, pause=0.05)[0] == "aborted"
    step(pair.d, finished_recving={d_req.request_id}, failed_recving={d_req.request_id})
    step(pair.d)
    assert_scheduler_empty(pair.d)
    step(pair.p)
    assert_scheduler_empty(pair.p)


def test_prefix_hit_on_d_registers_only_missing_blocks(pair: Pair) -> None:
    shared = [7 + i for i in range(2 * BLOCK_SIZE)]
    # A local request fills D's prefix cache with the two shared blocks.
    local = create_request(0, prompt=shared + [5] * 10, max_tokens=1)
    pair.d.add_request(local)
    for _ in range(5):
        step(pair.d)
    assert local.is_finished()
    prompt = shared + [9] * 40
    d_req = create_request(0, prompt=prompt, request_id="d-hit", max_tokens=2,
                           kv_transfer_params=pair.d_params("pd-hit"))
    pair.d.add_request(d_req)
    out, _ = step(pair.d)
    (spec,) = out.kv_connector_metadata.push_recv
    # 64 shared tokens are cached on D; the other 40 span blocks 2 and 3.
    assert len(spec.local_block_ids) == 2 and spec.num_tokens == 40
    p_req = create_request(0, prompt=prompt, max_tokens=1, kv_transfer_params={
        "do_remote_decode": True, "transfer_mode": "push", "pd_request_id": "pd-hit"})
    pair.p.add_request(p_req)
    for _ in range(5):
        step(pair.p)
    order = pair.next_order()
    assert order is not None
    p_blocks = pd(pair.p).lender.block_ids("pd-hit")
    # P writes its blocks 2 and 3 (not 0 and 1) into D's fresh blocks.
    assert order.src_block_ids == p_blocks[2:4]
    assert order.dst_block_ids == spec.local_block_ids
    pair.settle_write("pd-hit")
    finish_both(pair, d_req)


def test_prefill_aborted_on_p_fails_waiting_d_at_once(pair: Pair) -> None:
    d_req, _ = admit_on_d(pair, "pd-p-abort", 150)
    assert wait_for(lambda: pd(pair.p).producer.book.state("pd-p-abort") is PushState.REGISTERED)
    p_req = create_request(150, max_tokens=1, kv_transfer_params={
        "do_remote_decode": True, "transfer_mode": "push", "pd_request_id": "pd-p-abort"})
    pair.p.add_request(p_req)
    pair.p.finish_requests(p_req.request_id, RequestStatus.FINISHED_ABORTED)
    reason, detail = wait_push_fail(pair, d_req)  # well before D's 30 s push_timeout
    assert reason == "transfer_error" and "ended with FINISHED_ABORTED" in detail
    assert pair.next_order(100) is None
    fail_load_and_check_both_empty(pair, d_req)


def test_failed_write_reaches_d_through_p_scheduler_at_once(pair: Pair) -> None:
    d_req, _ = admit_on_d(pair, "pd-wfail", 150)
    assert wait_for(lambda: pd(pair.p).producer.book.state("pd-wfail") is PushState.REGISTERED)
    prefill_on_p(pair, "pd-wfail", 150)
    assert pair.next_order() is not None
    pair.settle_write("pd-wfail", ok=False, reason="NIXL reported an error for the WRITE")
    reason, detail = wait_push_fail(pair, d_req)  # well before D's 30 s push_timeout
    assert reason == "transfer_error"
    assert detail == "P could not write the KV: NIXL reported an error for the WRITE"
    fail_load_and_check_both_empty(pair, d_req)


def test_p_refuses_to_write_the_kv_of_another_prompt(pair: Pair) -> None:
    """Issue 12 item 4: a D leg paired with another request's P leg of the
    same length gets no WRITE (it would decode on the wrong KV): D's
    registration carries its prompt's digest and P compares it with its own."""
    d_req, _ = admit_on_d(pair, "pd-other", 150)
    assert wait_for(lambda: pd(pair.p).producer.book.state("pd-other") is PushState.REGISTERED)
    other = [11 + (5 * i) % 3000 for i in range(150)]  # same length, other tokens
    prefill_on_p(pair, "pd-other", 150, prompt=other)
    assert pair.next_order(200) is None  # no WRITE ordered
    reason, detail = wait_push_fail(pair, d_req)
    assert reason == "transfer_error"
    assert "prompt digests differ" in detail
    step(pair.d, finished_recving={d_req.request_id}, failed_recving={d_req.request_id})
    step(pair.d)
    step(pair.d)
    step(pair.p)
    assert_scheduler_empty(pair.p)


def test_abort_result_and_write_release_only_from_the_engine_concerned(pair: Pair) -> None:
    """Issue 12 item 3: an abort counts only from the D that registered, a
    result only from the P registered with, and the release that settles
    P's WRITE only from P itself; the push then completes normally."""
    d_req, meta = admit_on_d(pair, "pd-own", 150)
    assert wait_for(lambda: pd(pair.p).producer.book.state("pd-own") is PushState.REGISTERED)
    with pytest.raises(SideChannelError, match="registered by another engine"):
        pair.client.request(HOST, pair.p_port, proto.PushAbort(
            engine_id="eng-other", pd_request_id="pd-own"))
    assert pd(pair.p).producer.book.state("pd-own") is PushState.REGISTERED
    with pytest.raises(SideChannelError, match="not registered with engine eng-other"):
        pair.client.request(HOST, pair.d_port, proto.PushResult(
            engine_id="eng-other", pd_request_id="pd-own", tp_rank=-1, ok=False))
    prefill_on_p(pair, "pd-own", 150)
    order = pair.next_order()
    assert order is not None and order.notif_token == meta.push_recv[0].notif_token
    pair.client.request(HOST, pair.p_port, proto.LeaseRelease(
        engine_id="eng-other", request_ids=["pd-own"], tp_rank=0))
    lease = pd(pair.p).leases.table.get("pd-own")
    assert lease is not None and lease.state is LeaseState.WRITING  # not settled by them
    out, _ = step(pair.d)
    assert d_req.request_id not in out.kv_connector_metadata.push_fail  # D still waits
    pair.settle_write("pd-own")
    finish_both(pair, d_req)
    assert pd(pair.p).producer.num_wrong_sender == 1  # the abort
    assert pd(pair.p).leases.counters().num_wrong_sender == 1  # the release
    assert pd(pair.d).consumer.num_wrong_sender == 1  # the result


def test_d_rings_its_pump_on_every_step_while_it_waits_for_writes(pair: Pair) -> None:
    """While a request waits for P's WRITEs, each step of D rings its
    workers' pump bell (the pump collects P's notifications fast); once
    nothing waits, steps ring no more."""
    bell = Bell()
    pd(pair.d).ringer = ringer = BellRinger([bell.endpoint])
    try:
        d_req, _ = admit_on_d(pair, "pd-ring", 2 * BLOCK_SIZE)
        assert ringer.num_rings >= 1
        assert wait_for(lambda: bell.wait(0.05))
        pair.d.finish_requests(d_req.request_id, RequestStatus.FINISHED_ABORTED)
        assert wait_push_fail(pair, d_req)[0] == "aborted"
        step(pair.d, finished_recving={d_req.request_id}, failed_recving={d_req.request_id})
        step(pair.d)
        assert pd(pair.d).consumer.num_waiting == 0
        ringer._last = -1e9
        rings = ringer.num_rings
        step(pair.d)
        step(pair.d)
        assert ringer.num_rings == rings
    finally:
        pd(pair.d).ringer = None
        ringer.close()
        bell.close()


def test_p_lease_expired_while_registration_unconfirmed_fails_d_at_once(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """P was cut off while D registered (the registration's send timed out,
    so D does not know whether P has it) and P's lease lapsed meanwhile.
    Once P is reachable, D's heartbeat is answered "expired": D aborts and
    fails the load well before its 30 s push_timeout (before: it waited it
    out, and the proxy's deadline passed first)."""
    pd_id = "pd-lapsed"
    prefill_on_p(pair, pd_id, 150)
    time.sleep(LEASE_S * 1.5)
    step(pair.p)  # P's sweep: the unrenewed lease expires, its blocks are freed
    assert pd(pair.p).leases.table.get(pd_id) is None
    outbox = pd(pair.d).consumer._outbox
    real_send = outbox.send

    def lose_registrations(host, port, msg, callback=None):
        if isinstance(msg, proto.PushRegister):  # the partition eats it
            callback(SideChannelError("side channel did not answer within 500 ms", "timeout"))
            return
        real_send(host, port, msg, callback)

    monkeypatch.setattr(outbox, "send", lose_registrations)
    started = time.monotonic()
    d_req, _ = admit_on_d(pair, pd_id, 150)
    reason, detail = wait_push_fail(pair, d_req, pause=0.1)
    assert time.monotonic() - started < 10
    assert reason == "timeout" and "lease on the prefill expired" in detail
    # P's tombstone answered the abort (no WRITE can come); it stays.
    assert pd(pair.p).producer.book.state(pd_id) is PushState.EXPIRED
    fail_load_and_check_both_empty(pair, d_req)
