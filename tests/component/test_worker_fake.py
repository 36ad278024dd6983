"""PDWorker receive path with FakeTransport and a real SideChannelServer as P.

P's KV memory is real torch CPU tensors registered through a second PDWorker
(so P's AgentInfo/regions come from the same code as in production); D's
worker pulls P's blocks byte for byte through the fake fabric.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from pdunit_utils import free_port, wait_for

from vllm_pd_ext.config import PDConfig
from vllm_pd_ext.leases.service import LeaseService
from vllm_pd_ext.leases.table import LeaseState, LeaseTable
from vllm_pd_ext.metadata import PDConnectorMetadata
from vllm_pd_ext.transport import XferState
from vllm_pd_ext.transport.coalesce import build_descriptors
from vllm_pd_ext.transport.fake import FakeFabric, FakeTransport
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.side_channel import SideChannelServer
from vllm_pd_ext.wire.specs import RecvSpec, monotonic_clock_id
from vllm_pd_ext.worker.dispatcher import PDWorker

HOST = "127.0.0.1"
NUM_BLOCKS = 12
HEADS, BLOCK, HEAD = 2, 32, 16
LAYERS = 3
BLOCK_BYTES = HEADS * BLOCK * 2 * HEAD * 4  # float32


def fake_vllm_config(engine_id: str, producer: bool, block_size: int = BLOCK,
                     num_blocks: int = NUM_BLOCKS):
    """The attributes compat.compat_info / engine_id / PDWorker read."""
    model_config = SimpleNamespace(
        model="tiny-test-model", served_model_name=None, dtype="torch.float32",
        get_num_layers=lambda pc: LAYERS,
        get_num_kv_heads=lambda pc: HEADS,
        get_total_num_kv_heads=lambda: HEADS,
        get_head_size=lambda: HEAD,
    )
    return SimpleNamespace(
        model_config=model_config,
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=block_size,
                                     num_gpu_blocks=num_blocks),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_rank=0,
                                        data_parallel_index=0),
        kv_transfer_config=SimpleNamespace(engine_id=engine_id, is_kv_producer=producer,
                                           is_kv_consumer=not producer),
    )


def kv_tensors(fill: str, layers: int = LAYERS, slab: bool = False) -> dict[str, torch.Tensor]:
    shape = (NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD)
    gen = torch.Generator().manual_seed(7)
    if slab:  # all layers views into one allocation
        big = torch.zeros((layers, *shape), dtype=torch.float32)
        if fill == "rand":
            big.copy_(torch.rand(big.shape, generator=gen))
        return {f"layer.{i}": big[i] for i in range(layers)}
    out = {}
    for i in range(layers):
        t = torch.rand(shape, generator=gen) if fill == "rand" else torch.zeros(shape)
        out[f"layer.{i}"] = t
    return out


class Pair:
    """A P (server + registered worker) and a D worker on one FakeFabric."""

    def __init__(self, *, d_cfg: PDConfig | None = None, p_compat=None, slab=False,
                 lease_s: float = 30.0, serve: bool = True, d_layers: int = LAYERS,
                 p_engine_id: str = "eng-p") -> None:
        self.fabric = FakeFabric()
        # Our agents are named <engine id>-tp<rank>-<suffix>; D checks it.
        self.p_transport = FakeTransport(f"{p_engine_id}-tp0-fake", self.fabric)
        self.d_transport = FakeTransport("eng-d-tp0-fake", self.fabric, cycles_to_done=2)
        self.p_kv = kv_tensors("rand", slab=slab)
        self.d_kv = kv_tensors("zero", layers=d_layers, slab=slab)
        self.p_worker = PDWorker(fake_vllm_config(p_engine_id, True), PDConfig(),
                                 transport=self.p_transport, tp_rank=0)
        self.p_worker.register_kv_caches(self.p_kv)
        self.cfg = d_cfg or PDConfig(handshake_timeout=1.0, transfer_timeout=5.0)
        self.d_worker = PDWorker(fake_vllm_config("eng-d", False), self.cfg,
                                 transport=self.d_transport, tp_rank=0)
        self.d_worker.register_kv_caches(self.d_kv)
        self.leases = LeaseService(LeaseTable(lease_s, time.monotonic))
        self.port = free_port()
        self.server = None
        self.handshakes = 0
        if serve:
            self.server = SideChannelServer(
                HOST, self.port, "eng-p", p_compat or self.p_worker.compat,
                {0: self.p_worker.agent}, self.leases)
            orig = self.server.handle

            def counting(payload: bytes):
                if isinstance(proto.decode_request(payload), proto.HandshakeRequest):
                    self.handshakes += 1
                return orig(payload)

            self.server.handle = counting

    def spec(self, rid="d-req", local=(1, 2, 3, 7), remote=(4, 5, 6, 0), prid="p-req"):
        return RecvSpec(request_id=rid, local_block_ids=list(local),
                        remote_block_ids=list(remote), remote_engine_id="eng-p",
                        remote_request_id=prid, remote_host=HOST, remote_port=self.port,
                        remote_tp_size=1, num_tokens=len(local) * BLOCK)

    def grant(self, prid="p-req"):
        self.leases.grant(prid, num_consumers=1)

    def lease(self, prid="p-req"):
        with self.leases.lock:  # tests may inspect the table
            return self.leases.table.get(prid)

    def close(self):
        self.d_worker.shutdown()
        self.p_worker.shutdown()
        if self.server is not None:
            self.server.close()


@pytest.fixture
def make_pair():
    pairs = []

    def make(**kw):
        pair = Pair(**kw)
        pairs.append(pair)
        return pair

    yield make
    for pair in pairs:
        pair.close()
    for pair in pairs:
        # Every transport call came from a thread that ran the thread hook.
        assert pair.d_transport.unhooked_calls == [] == pair.p_transport.unhooked_calls


def drive(worker: PDWorker, meta: PDConnectorMetadata | None, until: set[str],
          timeout: float = 5.0):
    """Step the worker like vLLM does until every id in ``until`` was reported."""
    sending, recving, failed = set(), set(), set()
    deadline = time.monotonic() + timeout
    worker.start_load_kv(meta)
    while True:
        s, r, f = worker.get_transfer_results()
        assert not (r & recving), f"{r & recving} reported twice"
        sending |= s
        recving |= r
        failed |= f
        if until <= recving or time.monotonic() > deadline:
            return sending, recving, failed
        time.sleep(0.002)
        worker.start_load_kv(None)


def assert_blocks_copied(pair: Pair, local, remote):
    for name, d in pair.d_kv.items():
        p = pair.p_kv[name]
        for lo, re in zip(local, remote, strict=True):
            assert torch.equal(d[lo], p[re]), f"{name} block {lo} != P block {re}"
        untouched = [b for b in range(NUM_BLOCKS) if b not in local]
        assert torch.count_nonzero(d[untouched]) == 0


# ------------------------------------------------------------------ success
@pytest.mark.parametrize("slab", [False, True], ids=["per-layer", "slab"])
def test_pull_copies_blocks_and_releases(make_pair, slab):
    pair = make_pair(slab=slab)
    pair.grant()
    spec = pair.spec()
    t0 = time.monotonic()
    _, recving, failed = drive(pair.d_worker, PDConnectorMetadata(reqs_to_recv=[spec]),
                               {"d-req"})
    took_ms = (time.monotonic() - t0) * 1e3
    assert recving == {"d-req"} and failed == set()
    assert took_ms < 2000
    assert_blocks_copied(pair, spec.local_block_ids, spec.remote_block_ids)
    # P got the release (sent asynchronously) and will free its blocks.
    assert wait_for(lambda: pair.lease() is not None
                    and pair.lease().state is LeaseState.RELEASED)
    assert pair.lease().release_ok is True
    # Stats: bytes, descriptors and blocks of the one transfer.
    stats = pair.d_worker.get_kv_connector_stats()
    assert stats is not None
    expected = build_descriptors(spec.local_block_ids, spec.remote_block_ids,
                                 pair.d_worker.regions, pair.p_worker.agent.regions)
    assert stats.data["num_transfers"] == 1
    assert stats.data["bytes_transferred"] == LAYERS * len(spec.local_block_ids) * BLOCK_BYTES
    assert stats.data["num_descriptors"] == len(expected) == pair.d_transport.num_descriptors
    assert stats.data["num_blocks"] == len(spec.local_block_ids)
    assert stats.data["num_failures"] == 0
    assert len(stats.data["transfer_seconds"]) == 1
    assert pair.d_worker.get_kv_connector_stats() is None  # taken
    assert pair.d_worker.num_in_flight == 0
    assert pair.d_transport.live_handles == {}
    # Telemetry: one record for the load, its phases in order of the state machine.
    meta = pair.d_worker.build_worker_meta()
    assert meta is not None and len(meta.records) == 1
    rec = meta.records[0]
    assert (rec.request_id, rec.remote_request_id, rec.mode, rec.outcome) == (
        "d-req", spec.remote_request_id, "pull", "ok")
    assert rec.bytes == stats.data["bytes_transferred"] and rec.descriptors == len(expected)
    assert (rec.blocks, rec.tokens) == (len(spec.local_block_ids), spec.num_tokens)
    assert rec.p_engine == spec.remote_engine_id
    assert rec.p_addr == f"{spec.remote_host}:{spec.remote_port}"
    assert rec.handshake_ms is not None and rec.pin_ms is not None and rec.read_ms is not None
    # Each phase took time (a new pair: the handshake is a real ZMQ round
    # trip), and together they lie within the load as this test timed it.
    assert min(rec.handshake_ms, rec.pin_ms, rec.read_ms) > 0
    # The pin ran beside the READ (issue 29): the load waited for the slower.
    assert rec.pin_with_read is True
    assert rec.handshake_ms + max(rec.pin_ms, rec.read_ms) <= took_ms
    # The worker's own span holds those phases and ends with the report.
    assert rec.worker_ms is not None
    assert rec.handshake_ms + max(rec.pin_ms, rec.read_ms) <= rec.worker_ms + 0.01
    assert rec.worker_ms <= took_ms
    # The pair's lease is 30 s unless set: the READ started with nearly all of it left.
    assert rec.lease_left_s is not None and 25 < rec.lease_left_s <= 30
    assert pair.d_worker.build_worker_meta() is None  # taken


def test_handshake_cached_across_requests(make_pair):
    pair = make_pair()
    pair.grant("p1")
    pair.grant("p2")
    s1 = pair.spec("d1", local=(0, 1), remote=(2, 3), prid="p1")
    _, r, f = drive(pair.d_worker, PDConnectorMetadata(reqs_to_recv=[s1]), {"d1"})
    assert r == {"d1"} and not f
    s2 = pair.spec("d2", local=(5,), remote=(9,), prid="p2")
    _, r, f = drive(pair.d_worker, PDConnectorMetadata(reqs_to_recv=[s2]), {"d2"})
    assert r == {"d2"} and not f
    assert pair.handshakes == 1
    assert_blocks_copied(pair, [0, 1, 5], [2, 3, 9])


def test_two_requests_in_one_step(make_pair):
    pair = make_pair()
    pair.grant("p1")
    pair.grant("p2")
    meta = PDConnectorMetadata(reqs_to_recv=[
        pair.spec("d1", local=(0, 1), remote=(2, 3), prid="p1"),
        pair.spec("d2", local=(4,), remote=(8,), prid="p2")])
    _, r, f = drive(pair.d_worker, meta, {"d1", "d2"})
    assert r == {"d1", "d2"} and not f
    assert pair.handshakes == 1
    assert_blocks_copied(pair, [0, 1, 4], [2, 3, 8])


# ------------------------------------------------------------------ failures
def test_lease_unknown_fails(make_pair):
    """The READ leaves beside the pin, so it was made; the pin says P does
    not know the lease, so its bytes are not used: the load fails (vLLM's
    failure policy recomputes or ends the request) and nothing counts as
    transferred."""
    pair = make_pair()  # no grant: P does not know p-req
    _, recving, failed = drive(pair.d_worker, PDConnectorMetadata(reqs_to_recv=[pair.spec()]),
                               {"d-req"})
    assert failed == {"d-req"} and recving == {"d-req"}
    assert pair.d_transport.num_posts == 1 and pair.d_transport.live_handles == {}
    assert pair.leases.num_late_messages == 1
    stats = pair.d_worker.get_kv_connector_stats()
    assert stats.data["num_failures"] == 1 and stats.data["num_transfers"] == 0
    meta = pair.d_worker.build_worker_meta()
    assert meta is not None and [r.outcome for r in meta.records] == ["lease_lost"]
    assert "unknown to P" in meta.records[0].detail and meta.records[0].pin_ms is not None
    assert meta.records[0].lease_left_s is None  # no window was ever granted


def test_lease_expired_fails(make_pair):
    pair = make_pair(lease_s=0.05)
    pair.grant()
    time.sleep(0.1)
    _, recving, failed = drive(pair.d_worker, PDConnectorMetadata(reqs_to_recv=[pair.spec()]),
                               {"d-req"})
    assert failed == recving == {"d-req"}
    assert "expired on P" in pair.d_worker.build_worker_meta().records[0].detail


def test_pin_close_to_expiry_counts_a_read_that_ended_inside_it(make_pair):
    """P answers the pin with 0.25 s left, and the answer takes 0.2 s to
    arrive. The READ left with the pin and ended long before
    ``pin_sent + 0.25 s``, while P surely held the blocks: it counts."""
    pair = make_pair()
    pair.grant()
    real_renew = pair.leases.renew

    def slow_renew(msg):
        real_renew(msg)
        time.sleep(0.2)
        return proto.LeaseStatus([0.25])

    pair.leases.renew = slow_renew
    spec = pair.spec()
    _, recving, failed = drive(pair.d_worker, PDConnectorMetadata(reqs_to_recv=[spec]),
                               {"d-req"})
    assert recving == {"d-req"} and failed == set()
    assert_blocks_copied(pair, spec.local_block_ids, spec.remote_block_ids)


def test_read_leaves_before_the_pin_answers_and_counts_only_after(make_pair):
    """The pin's round trip is off the critical path (issue 29): the READ is
    posted and done while P has not answered the pin yet, and the load is
    reported only once the pin came back valid."""
    pair = make_pair()
    pair.grant()
    real_renew = pair.leases.renew
    answered = []

    def slow_renew(msg):
        time.sleep(0.4)
        answered.append(time.monotonic())
        return real_renew(msg)

    pair.leases.renew = slow_renew
    spec = pair.spec()
    pair.d_worker.start_load_kv(PDConnectorMetadata(reqs_to_recv=[spec]))
    done_early = False
    while not answered:
        _, r, _ = pair.d_worker.get_transfer_results()
        assert r == set()  # not before the pin answered
        done_early = done_early or pair.d_worker.reader._jobs["d-req"].settled
        time.sleep(0.01)
        pair.d_worker.start_load_kv(None)
    # The handshake, then the READ, all before the pin's answer.
    assert done_early  # the bytes were in while the pin was on its way
    _, recving, failed = drive(pair.d_worker, None, {"d-req"})
    assert recving == {"d-req"} and failed == set()
    assert_blocks_copied(pair, spec.local_block_ids, spec.remote_block_ids)
    rec = pair.d_worker.build_worker_meta().records[0]
    assert rec.pin_ms is not None and rec.read_ms is not None and rec.pin_ms > rec.read_ms


def test_pin_failing_after_the_read_was_posted_throws_the_bytes_away(make_pair):
    """P answers the pin with "expired" after the READ went out: the load
    fails only once the READ settled (its bytes may still be landing in D's
    blocks), and P is sent no release for a lease it no longer has."""
    pair = make_pair()
    pair.grant()
    pair.d_transport.post_delay = 0.3  # the copy outlasts the pin's answer

    def expired(msg):
        return proto.LeaseStatus([proto.LEASE_EXPIRED])

    pair.leases.renew = expired
    released = []
    real_release = pair.leases.release
    pair.leases.release = lambda msg: released.append(msg) or real_release(msg)
    t0 = time.monotonic()
    _, recving, failed = drive(pair.d_worker, PDConnectorMetadata(reqs_to_recv=[pair.spec()]),
                               {"d-req"})
    assert failed == recving == {"d-req"}
    assert time.monotonic() - t0 >= 0.3  # after the post returned, not at the pin's answer
    assert pair.d_transport.num_posts == 1 and pair.d_transport.live_handles == {}
    assert pair.d_worker.num_in_flight == 0
    time.sleep(0.1)
    assert released == []
    rec = pair.d_worker.build_worker_meta().records[0]
    assert rec.outcome == "lease_lost" and "expired on P" in rec.detail


def test_a_failed_post_waits_for_the_pin_whose_reason_wins(make_pair):
    """P restarted: the READ to its old agent fails in the post and the pin
    is answered "unknown". The load fails once, with the pin's reason (the
    one that says what happened), and no release goes to the new P."""
    pair = make_pair()  # no grant: the (new) P does not know the lease
    pair.d_transport.fail_post = True
    _, recving, failed = drive(pair.d_worker, PDConnectorMetadata(reqs_to_recv=[pair.spec()]),
                               {"d-req"})
    assert failed == recving == {"d-req"}
    rec = pair.d_worker.build_worker_meta().records[0]
    assert rec.outcome == "lease_lost" and "unknown to P (P restarted" in rec.detail
    assert pair.leases.num_late_messages == 1  # the pin only: no release followed


def test_pin_failing_before_a_queued_post_means_no_post(make_pair):
    """Posts are serialised: a READ queued behind a slow one whose pin comes
    back unknown is never posted."""
    pair = make_pair()
    pair.grant("p1")  # p2 is not granted: its pin fails at once
    pair.d_transport.post_delay = 0.5
    meta = PDConnectorMetadata(reqs_to_recv=[
        pair.spec("d1", local=(0, 1), remote=(2, 3), prid="p1"),
        pair.spec("d2", local=(4,), remote=(8,), prid="p2")])
    _, recving, failed = drive(pair.d_worker, meta, {"d1", "d2"})
    assert recving == {"d1", "d2"} and failed == {"d2"}
    assert pair.d_transport.num_posts == 1
    assert_blocks_copied(pair, [0, 1], [2, 3])


@pytest.mark.parametrize("idle", [True, False], ids=["idle_step", "busy_step"])
def test_idle_step_reports_the_load_it_started(make_pair, idle):
    """A step that computes nothing waits (``pull_report_wait_ms``) for the
    load it started and reports it at once: D's scheduler does not wait a
    step to learn of it. A step that computes does not wait."""
    # A long report wait, bounds far below it: only a wait that runs out (or
    # a busy step that waits at all) fails, not a slow CI host.
    pair = make_pair(d_cfg=PDConfig(handshake_timeout=1.0, transfer_timeout=10.0,
                                    pull_report_wait_ms=8000.0))
    pair.grant("p0")
    pair.grant("p1")
    # The first load pays for the handshake.
    drive(pair.d_worker, PDConnectorMetadata(reqs_to_recv=[pair.spec("d0", prid="p0")]),
          {"d0"})
    spec = pair.spec("d1", local=(5, 6), remote=(1, 2), prid="p1")
    t0 = time.monotonic()
    pair.d_worker.start_load_kv(PDConnectorMetadata(reqs_to_recv=[spec], idle=idle))
    _, recving, failed = pair.d_worker.get_transfer_results()
    took = time.monotonic() - t0
    if idle:
        assert recving == {"d1"} and failed == set() and took < 4.0
        assert_blocks_copied(pair, [1, 2, 3, 7, 5, 6], [4, 5, 6, 0, 1, 2])
    else:
        assert recving == set() and took < 4.0
        _, recving, failed = drive(pair.d_worker, None, {"d1"})
        assert recving == {"d1"} and failed == set()


def test_short_lease_still_read(make_pair):
    # A lease shorter than PIN_SAFETY_MARGIN_S is still usable (margin scales).
    pair = make_pair(lease_s=0.5)
    pair.grant()
    spec = pair.spec()
    _, recving, failed = drive(pair.d_worker, PDConnectorMetadata(reqs_to_recv=[spec]),
                               {"d-req"})
    assert recving == {"d-req"} and failed == set()
    assert_blocks_copied(pair, spec.local_block_ids, spec.remote_block_ids)


@pytest.mark.parametrize("knob", ["fail_post", "fail_poll"])
def test_transport_failure_fails_and_releases(make_pair, knob):
    pair = make_pair()
    pair.grant()
    setattr(pair.d_transport, knob, True)
    _, recving, failed = drive(pair.d_worker, PDConnectorMetadata(reqs_to_recv=[pair.spec()]),
                               {"d-req"})
    assert failed == recving == {"d-req"}
    # D tells P it is done (ok=False) so P frees at once instead of at expiry.
    assert wait_for(lambda: pair.lease().state is LeaseState.RELEASED)
    assert pair.lease().release_ok is False
    assert pair.d_transport.live_handles == {}
    assert pair.d_worker.get_kv_connector_stats().data["num_failures"] == 1


def test_incompatible_peer_fails(make_pair):
    other = PDWorker(fake_vllm_config("x", True), PDConfig(), transport=FakeTransport(
        "x", FakeFabric()), tp_rank=0).compat
    pair = make_pair(p_compat=proto.CompatInfo(**{
        **{f: getattr(other, f) for f in other.__struct_fields__}, "block_size": 64}))
    pair.grant()
    _, recving, failed = drive(pair.d_worker, PDConnectorMetadata(reqs_to_recv=[pair.spec()]),
                               {"d-req"})
    assert failed == recving == {"d-req"}
    assert pair.d_transport.peers == set()
    assert pair.d_transport.num_posts == 0


def test_engine_id_mismatch_fails(make_pair):
    pair = make_pair()
    pair.grant()
    spec = pair.spec()
    spec = RecvSpec(**{**spec.__dict__, "remote_engine_id": "eng-old"})
    _, recving, failed = drive(pair.d_worker, PDConnectorMetadata(reqs_to_recv=[spec]),
                               {"d-req"})
    assert failed == recving == {"d-req"}
    assert pair.d_transport.num_posts == 0


def test_layout_mismatch_fails(make_pair):
    pair = make_pair(d_layers=LAYERS - 1)
    pair.grant()
    _, recving, failed = drive(pair.d_worker, PDConnectorMetadata(reqs_to_recv=[pair.spec()]),
                               {"d-req"})
    assert failed == recving == {"d-req"}
    assert pair.d_transport.num_posts == 0


def test_out_of_range_remote_block_fails(make_pair):
    pair = make_pair()
    pair.grant()
    spec = pair.spec(local=(0,), remote=(NUM_BLOCKS,))
    _, recving, failed = drive(pair.d_worker, PDConnectorMetadata(reqs_to_recv=[spec]),
                               {"d-req"})
    assert failed == recving == {"d-req"}
    assert pair.d_transport.num_posts == 0


def test_p_not_running_fails_within_timeout(make_pair):
    # Transfer deadline 10 s: failing at the handshake's 0.3 s is told from
    # waiting out the deadline with room for a loaded host.
    cfg = PDConfig(handshake_timeout=0.3, transfer_timeout=10.0)
    pair = make_pair(d_cfg=cfg, serve=False)
    t0 = time.monotonic()
    _, recving, failed = drive(pair.d_worker, PDConnectorMetadata(reqs_to_recv=[pair.spec()]),
                               {"d-req"})
    elapsed = time.monotonic() - t0
    assert failed == recving == {"d-req"}
    assert elapsed < 4.0, elapsed
    assert pair.d_worker.num_in_flight == 0


def test_transfer_timeout_while_reading(make_pair):
    cfg = PDConfig(handshake_timeout=1.0, transfer_timeout=0.3)
    pair = make_pair(d_cfg=cfg)
    pair.d_transport.cycles_to_done = 10**9  # READ never completes
    pair.grant()
    t0 = time.monotonic()
    _, recving, failed = drive(pair.d_worker, PDConnectorMetadata(reqs_to_recv=[pair.spec()]),
                               {"d-req"})
    assert failed == recving == {"d-req"}
    assert 0.3 <= time.monotonic() - t0 < 2.0
    assert pair.d_transport.live_handles == {}
    assert wait_for(lambda: pair.lease().state is LeaseState.RELEASED)


def test_unreleasable_read_keeps_request_until_release_succeeds(make_pair):
    cfg = PDConfig(handshake_timeout=1.0, transfer_timeout=0.2)
    pair = make_pair(d_cfg=cfg)
    pair.d_transport.cycles_to_done = 10**9
    pair.d_transport.fail_release = True
    pair.grant()
    # 2 s (10 deadlines): time for a loaded host to pin and post the READ.
    _, recving, failed = drive(pair.d_worker, PDConnectorMetadata(reqs_to_recv=[pair.spec()]),
                               {"d-req"}, timeout=2.0)
    # Past its deadline, but the READ may still write D's blocks: not reported.
    assert recving == set() and failed == set()
    assert pair.d_worker.num_in_flight == 1
    assert len(pair.d_transport.live_handles) == 1
    # P's lease is not released while the READ may still run.
    assert pair.lease().state is LeaseState.READING
    pair.d_transport.fail_release = False
    _, recving, failed = drive(pair.d_worker, None, {"d-req"})
    assert failed == recving == {"d-req"}
    assert pair.d_transport.live_handles == {}
    assert pair.d_worker.num_in_flight == 0


def test_done_but_unreleasable_waits(make_pair):
    pair = make_pair()
    pair.grant()
    pair.d_transport.fail_release = True
    _, recving, failed = drive(pair.d_worker, PDConnectorMetadata(reqs_to_recv=[pair.spec()]),
                               {"d-req"}, timeout=0.3)
    assert recving == set() and failed == set()
    pair.d_transport.fail_release = False
    _, recving, failed = drive(pair.d_worker, None, {"d-req"})
    assert recving == {"d-req"} and failed == set()
    assert_blocks_copied(pair, [1, 2, 3, 7], [4, 5, 6, 0])


def test_bad_params_fail_immediately(make_pair):
    pair = make_pair()
    pair.d_worker.start_load_kv(PDConnectorMetadata(
        reqs_to_fail={"bad": ("bad_params", "remote_port: x")}))
    sending, recving, failed = pair.d_worker.get_transfer_results()
    assert recving == failed == {"bad"} and sending == set()
    assert pair.d_worker.get_transfer_results() == (set(), set(), set())
    meta = pair.d_worker.build_worker_meta()
    assert meta is not None
    assert [(r.request_id, r.outcome, r.detail) for r in meta.records] == [
        ("bad", "bad_params", "remote_port: x")]


def test_worker_never_reports_finished_sending(make_pair):
    """P's blocks are pinned and freed by the scheduler half, not via finished_sending."""
    pair = make_pair()
    w = pair.p_worker
    w.start_load_kv(PDConnectorMetadata())
    w.start_load_kv(None)
    assert w.get_transfer_results() == (set(), set(), set())


def test_handshake_metadata_describes_regions(make_pair):
    pair = make_pair()
    meta = pair.p_worker.get_handshake_metadata()
    assert meta is not None and meta.agent.agent_name == "eng-p-tp0-fake"
    assert meta.agent.mem_type == "DRAM"
    assert len(meta.agent.regions) == LAYERS
    for region, t in zip(meta.agent.regions, pair.p_kv.values(), strict=True):
        assert region.base_addr == t.data_ptr()
        assert region.block_len == region.block_stride == BLOCK_BYTES
        assert region.num_blocks == NUM_BLOCKS
    # Whole storages registered with the transport, once each.
    assert sorted(pair.p_transport.regions) == sorted(
        (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        for t in pair.p_kv.values())


def test_p_not_running_fails_every_waiting_request(make_pair):
    # Two requests wait on the same handshake; when it fails both must fail
    # (neither may crash the worker step).
    cfg = PDConfig(handshake_timeout=0.3, transfer_timeout=3.0)
    pair = make_pair(d_cfg=cfg, serve=False)
    meta = PDConnectorMetadata(reqs_to_recv=[
        pair.spec("d1", local=(0,), remote=(1,), prid="p1"),
        pair.spec("d2", local=(2,), remote=(3,), prid="p2")])
    _, recving, failed = drive(pair.d_worker, meta, {"d1", "d2"})
    assert failed == recving == {"d1", "d2"}
    assert pair.d_worker.num_in_flight == 0


def test_slow_post_does_not_block_the_engine_step(make_pair):
    """On one host the copy runs inside NIXL's post call; it happens on the
    poster thread, so start_load_kv returns at once and other work goes on."""
    pair = make_pair()
    pair.grant()
    pair.d_transport.post_delay = 0.3
    spec = pair.spec()
    pair.d_worker.start_load_kv(PDConnectorMetadata(reqs_to_recv=[spec]))
    slowest = 0.0
    deadline = time.monotonic() + 5
    recving: set[str] = set()
    while "d-req" not in recving and time.monotonic() < deadline:
        t0 = time.monotonic()
        pair.d_worker.start_load_kv(None)
        _, r, _ = pair.d_worker.get_transfer_results()
        slowest = max(slowest, time.monotonic() - t0)
        recving |= r
        time.sleep(0.005)
    assert recving == {"d-req"}
    assert slowest < 0.1, f"a step took {slowest * 1e3:.0f} ms"
    assert_blocks_copied(pair, spec.local_block_ids, spec.remote_block_ids)


def test_pin_that_runs_out_while_waiting_for_the_poster_is_not_read(make_pair):
    """Posts are serialised on one thread. A READ queued behind a 1.5 s copy
    must re-check its pin (1 s lease) when its turn comes: never post after
    the lease may have run out on P. The 1.5 s copy itself outlived its
    1 s pin, so its KV is not trusted either (P may have reused the blocks
    mid-copy): both loads fail, and only one READ was ever posted."""
    pair = make_pair(lease_s=1.0)
    pair.grant("p1")
    pair.grant("p2")
    pair.d_transport.post_delay = 1.5
    meta = PDConnectorMetadata(reqs_to_recv=[
        pair.spec("d1", local=(0, 1), remote=(2, 3), prid="p1"),
        pair.spec("d2", local=(4,), remote=(8,), prid="p2")])
    _, recving, failed = drive(pair.d_worker, meta, {"d1", "d2"}, timeout=8)
    assert recving == {"d1", "d2"}
    assert failed == {"d1", "d2"}
    assert pair.d_transport.num_posts == 1  # the one that waited was never posted


def test_finished_loads_leave_no_trace_in_the_peer_slot(make_pair):
    pair = make_pair()
    specs = [pair.spec(f"d{i}", local=(i,), remote=(i + 5,), prid=f"p{i}") for i in range(5)]
    for s in specs:
        pair.grant(s.remote_request_id)
    _, recving, failed = drive(pair.d_worker, PDConnectorMetadata(reqs_to_recv=specs),
                               {s.request_id for s in specs})
    assert len(recving) == 5 and not failed
    entry = pair.d_worker.reader._peers[("eng-p", HOST, pair.port)]
    assert (entry.waiting == set() and entry.peer is not None
            and [a.users for a in entry.peer.agents] == [0])


def test_unexpected_post_exception_fails_that_load_only(make_pair, monkeypatch):
    """A transport bug (not a TransportError) in the post fails that load,
    releases P's lease, and the worker step survives to load the next one."""
    pair = make_pair()
    pair.grant("p1")
    pair.grant("p2")
    real_post = pair.d_transport.post_read
    calls = []

    def buggy(peer, descs, device_id):
        calls.append(peer)
        if len(calls) == 1:
            raise RuntimeError("transport bug")
        return real_post(peer, descs, device_id)

    monkeypatch.setattr(pair.d_transport, "post_read", buggy)
    first = pair.spec("d1", local=(0, 1), remote=(2, 3), prid="p1")
    _, recving, failed = drive(pair.d_worker, PDConnectorMetadata(reqs_to_recv=[first]), {"d1"})
    assert failed == recving == {"d1"}
    assert wait_for(lambda: pair.lease("p1").state is LeaseState.RELEASED)
    second = pair.spec("d2", local=(4, 5), remote=(6, 7), prid="p2")
    _, recving, failed = drive(pair.d_worker, PDConnectorMetadata(reqs_to_recv=[second]), {"d2"})
    assert recving == {"d2"} and not failed
    assert_blocks_copied(pair, second.local_block_ids, second.remote_block_ids)
    assert pair.d_worker.reader is not None and pair.d_worker.reader.num_peers == 1


def test_read_that_ends_after_the_pinned_lease_is_not_trusted(make_pair, caplog):
    """A READ still running when P's pinned lease could have expired (P frozen
    mid-READ: on resume it sweeps and refills the blocks before serving the
    READ) may have copied reused blocks: the load fails with lease_lost, its
    KV is not used (found by the CI soak's SIGSTOP fault over TCP)."""
    pair = make_pair(lease_s=1.0)
    pair.grant()
    orig = pair.d_transport.poll
    until = time.monotonic() + 1.5  # past the pin's 1 s
    pair.d_transport.poll = lambda h: XferState.PROC if time.monotonic() < until else orig(h)
    _, recving, failed = drive(pair.d_worker, PDConnectorMetadata(reqs_to_recv=[pair.spec()]),
                               {"d-req"})
    assert failed == recving == {"d-req"}
    assert "after P's pinned lease could have expired" in caplog.text
    assert "lease_lost" in caplog.text
    assert pair.d_transport.live_handles == {}


def test_read_that_ends_inside_the_pinned_lease_loads(make_pair):
    """The control: the same slow READ inside a longer lease loads normally."""
    pair = make_pair(lease_s=10.0)
    pair.grant()
    orig = pair.d_transport.poll
    until = time.monotonic() + 1.5
    pair.d_transport.poll = lambda h: XferState.PROC if time.monotonic() < until else orig(h)
    _, recving, failed = drive(pair.d_worker, PDConnectorMetadata(reqs_to_recv=[pair.spec()]),
                               {"d-req"})
    assert recving == {"d-req"} and failed == set()
    assert_blocks_copied(pair, (1, 2, 3, 7), (4, 5, 6, 0))


# ------------------------------------------------- concurrent pull: no pin
def _count_pins(pair: Pair) -> list[proto.LeaseRenew]:
    """The pins P's side channel receives, from now on."""
    pins: list[proto.LeaseRenew] = []
    orig = pair.server.handle

    def handle(payload: bytes):
        msg = proto.decode_request(payload)
        if isinstance(msg, proto.LeaseRenew) and msg.acquire:
            pins.append(msg)
        return orig(payload)

    pair.server.handle = handle
    return pins


def test_a_read_p_answer_guaranteed_leaves_without_a_pin(make_pair):
    """Concurrent pull (protocol 10): P's answer extended the lease and D's
    scheduler turned that into ``valid_until``; the worker reads at once,
    with no pin round trip, and releases as always."""
    import dataclasses

    pair = make_pair()
    pair.grant()
    pins = _count_pins(pair)
    spec = dataclasses.replace(pair.spec(), valid_until=time.monotonic() + 20.0,
                               clock=monotonic_clock_id())
    _, recving, failed = drive(pair.d_worker, PDConnectorMetadata(reqs_to_recv=[spec]),
                               {"d-req"})
    assert recving == {"d-req"} and failed == set()
    assert_blocks_copied(pair, (1, 2, 3, 7), (4, 5, 6, 0))
    assert pins == []
    assert wait_for(lambda: pair.lease() is None or pair.lease().state is LeaseState.RELEASED)
    (rec,) = pair.d_worker.build_worker_meta().records
    assert rec.pin_in_answer is True and rec.pin_ms is None and rec.pin_with_read is None
    assert rec.lease_left_s is not None and 15 < rec.lease_left_s <= 20


def test_a_guarantee_that_runs_out_during_the_read_is_not_trusted(make_pair, caplog):
    """The window P's answer gave is checked as a pin's: a READ that ends
    past it may have copied reused blocks, so the load fails."""
    import dataclasses

    pair = make_pair()
    pair.grant()
    spec = dataclasses.replace(pair.spec(), valid_until=time.monotonic() + 2.5,
                               clock=monotonic_clock_id())
    orig = pair.d_transport.poll
    until = time.monotonic() + 3.0
    pair.d_transport.poll = lambda h: XferState.PROC if time.monotonic() < until else orig(h)
    _, recving, failed = drive(pair.d_worker, PDConnectorMetadata(reqs_to_recv=[spec]),
                               {"d-req"})
    assert failed == recving == {"d-req"}
    assert "lease could have expired" in caplog.text and "lease_lost" in caplog.text


@pytest.mark.parametrize("why", ["short", "other_clock", "no_clock"])
def test_a_guarantee_too_short_or_on_another_clock_is_pinned_as_before(make_pair, why):
    """Less than ``UNPINNED_MIN_LEFT_S`` left (a late answer), or a window on
    a clock this worker does not read (a worker on another node than its
    scheduler, multi-node TP; or one that could not name its clock): the
    worker pins, as a sequential pull does, and the pin sets the window."""
    import dataclasses

    pair = make_pair()
    pair.grant()
    pins = _count_pins(pair)
    left, clock = {"short": (1.0, monotonic_clock_id()), "other_clock": (20.0, "another-boot"),
                   "no_clock": (20.0, "")}[why]
    spec = dataclasses.replace(pair.spec(), valid_until=time.monotonic() + left, clock=clock)
    _, recving, failed = drive(pair.d_worker, PDConnectorMetadata(reqs_to_recv=[spec]),
                               {"d-req"})
    assert recving == {"d-req"} and failed == set() and len(pins) == 1
    (rec,) = pair.d_worker.build_worker_meta().records
    assert rec.pin_in_answer is None and rec.pin_with_read is True
    assert rec.lease_left_s is not None and 25 < rec.lease_left_s <= 30
