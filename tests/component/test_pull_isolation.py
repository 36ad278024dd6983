"""Pull mode: a frozen, failing, lying or departed P costs only its own loads.

D's worker (fake transport, real ZMQ side channels on 127.0.0.1) reads from
several Ps at once. A frozen P is a real side-channel server whose handler
blocks until released: it accepts messages and never answers, as a
SIGSTOPped engine does (the real-engine version is tests/e2e/test_isolation.py).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from pdunit_utils import free_port, wait_for
from test_worker_fake import BLOCK, fake_vllm_config, kv_tensors

from vllm_pd_ext.config import PDConfig
from vllm_pd_ext.leases.service import LeaseService
from vllm_pd_ext.leases.table import LeaseTable
from vllm_pd_ext.metadata import PDConnectorMetadata
from vllm_pd_ext.policy import FailureReason
from vllm_pd_ext.scheduler.heartbeats import HeartbeatSender
from vllm_pd_ext.transport.fake import FakeFabric, FakeTransport
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.side_channel import SideChannelServer
from vllm_pd_ext.wire.specs import RecvSpec
from vllm_pd_ext.worker import d_pull as d_pull_worker
from vllm_pd_ext.worker.dispatcher import PDWorker

HOST = "127.0.0.1"


class FakeP:
    """One P on the fabric: a registered worker, its leases and side channel."""

    def __init__(self, fabric: FakeFabric, engine_id: str, *, lease_s: float = 30.0,
                 agent_name: str | None = None, claim_engine_id: str | None = None) -> None:
        self.engine_id = engine_id
        self.transport = FakeTransport(agent_name or f"{engine_id}-tp0-fake", fabric)
        self.kv = kv_tensors("rand")
        # Each P's KV differs, so a READ from the wrong P is seen.
        for t in self.kv.values():
            t.add_(float(len(fabric.agents)))
        self.worker = PDWorker(fake_vllm_config(engine_id, True), PDConfig(),
                               transport=self.transport, tp_rank=0)
        self.worker.register_kv_caches(self.kv)
        self.leases = LeaseService(LeaseTable(lease_s, time.monotonic))
        self.port = free_port()
        self.frozen = threading.Event()
        self.thawed = threading.Event()
        self.thawed.set()
        assert self.worker.agent is not None
        self.server = SideChannelServer(HOST, self.port, claim_engine_id or engine_id,
                                        self.worker.compat, {0: self.worker.agent}, self.leases)
        orig = self.server.handle
        self.handshakes = 0

        def handle(payload: bytes) -> proto.Reply:
            self.thawed.wait()  # frozen: take the message, never answer in time
            if isinstance(proto.decode_request(payload), proto.HandshakeRequest):
                self.handshakes += 1
            return orig(payload)

        self.server.handle = handle  # type: ignore[method-assign]

    def freeze(self) -> None:
        self.thawed.clear()

    def thaw(self) -> None:
        self.thawed.set()

    def grant(self, prid: str) -> None:
        self.leases.grant(prid, num_consumers=1)

    def spec(self, rid: str, prid: str, local: tuple[int, ...], remote: tuple[int, ...],
             engine_id: str | None = None) -> RecvSpec:
        return RecvSpec(request_id=rid, local_block_ids=list(local),
                        remote_block_ids=list(remote),
                        remote_engine_id=engine_id or self.engine_id, remote_request_id=prid,
                        remote_host=HOST, remote_port=self.port, remote_tp_size=1,
                        num_tokens=len(local) * BLOCK)

    def close(self) -> None:
        self.thaw()
        self.server.close()
        self.worker.shutdown()


@pytest.fixture
def world(request):
    """A fabric, a D worker and a factory for Ps; everything closed after.
    D's side-channel timeout is 1 s, or the test's indirect parameter."""
    fabric = FakeFabric()
    made: list[FakeP] = []
    d_kv = kv_tensors("zero")
    d_transport = FakeTransport("eng-d-tp0-fake", fabric)
    d = PDWorker(fake_vllm_config("eng-d", False),
                 PDConfig(handshake_timeout=getattr(request, "param", 1.0),
                          transfer_timeout=6.0),
                 transport=d_transport, tp_rank=0)
    d.register_kv_caches(d_kv)

    def make_p(engine_id: str, **kw) -> FakeP:
        p = FakeP(fabric, engine_id, **kw)
        made.append(p)
        return p

    yield make_p, d, d_kv, d_transport
    for p in made:
        p.thaw()
    d.shutdown()
    for p in made:
        p.close()
    # Every transport call came from a thread that ran the thread hook.
    assert d_transport.unhooked_calls == []
    assert all(p.transport.unhooked_calls == [] for p in made)


class Driver:
    """Steps D's worker as vLLM does, recording when each load was reported."""

    def __init__(self, worker: PDWorker) -> None:
        self.worker = worker
        self.done: dict[str, float] = {}
        self.failed: set[str] = set()
        self.started: dict[str, float] = {}

    def add(self, *specs: RecvSpec) -> None:
        now = time.monotonic()
        for s in specs:
            self.started[s.request_id] = now
        self.worker.start_load_kv(PDConnectorMetadata(reqs_to_recv=list(specs)))

    def step(self) -> None:
        self.worker.start_load_kv(None)
        _, recving, failed = self.worker.get_transfer_results()
        now = time.monotonic()
        for rid in recving:
            assert rid not in self.done, f"{rid} reported twice"
            self.done[rid] = now
        self.failed |= failed

    def run_until(self, ids: set[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ids <= set(self.done) and time.monotonic() < deadline:
            self.step()
            time.sleep(0.002)

    def took(self, rid: str) -> float:
        return self.done[rid] - self.started[rid]


def assert_read_from(p: FakeP, d_kv, local, remote) -> None:
    for name, t in d_kv.items():
        for lo, re in zip(local, remote, strict=True):
            assert torch.equal(t[lo], p.kv[name][re]), f"{name}: block {lo} is not P's {re}"


# Side-channel timeout 2 s (not 1): a P2 load that waited behind P1's pin takes
# 2 s, so P2's loads can be given 1 s on a loaded host and still tell.
@pytest.mark.parametrize("world", [2.0], indirect=True)
def test_frozen_p_delays_only_its_own_loads(world) -> None:
    """Item 8: 8 loads wait on a frozen P1 (handshake cached); loads from P2
    go on at their usual speed, and P1's 8 fail together long before their
    deadline instead of one side-channel timeout each."""
    make_p, d, d_kv, _ = world
    p1, p2 = make_p("eng-p1"), make_p("eng-p2")
    drv = Driver(d)
    for p in (p1, p2):  # warm: both handshakes cached
        p.grant("warm")
        drv.add(p.spec(f"warm-{p.engine_id}", "warm", (0,), (1,)))
    drv.run_until({"warm-eng-p1", "warm-eng-p2"}, 5)
    assert not drv.failed
    p1.freeze()
    stuck = [p1.spec(f"stuck{i}", f"s{i}", (i + 1,), (i + 2,)) for i in range(8)]
    for s in stuck:
        p1.grant(s.remote_request_id)
    drv.add(*stuck)
    healthy = []
    for i in range(6):
        s = p2.spec(f"ok{i}", f"ok{i}", (9 + i % 3,), (i,))
        p2.grant(s.remote_request_id)
        drv.add(s)
        drv.run_until({s.request_id}, 5)
        healthy.append(drv.took(s.request_id))
        assert_read_from(p2, d_kv, s.local_block_ids, s.remote_block_ids)
    stuck_ids = {s.request_id for s in stuck}
    drv.run_until(stuck_ids, 8)
    assert drv.failed == stuck_ids, "P2's loads must not fail; every P1 load must"
    # Side-channel timeout 2 s: the first pin times out, the 7 behind it fail with it
    # (one timeout each would run into the 6 s transfer deadline).
    assert max(drv.took(r) for r in stuck_ids) < 4.5
    assert max(healthy) < 1.0, f"P2 handoffs during P1's freeze took {healthy}"


def test_failed_pin_does_not_fail_other_loads_to_the_same_p(world) -> None:
    """Item 9: a pin P does not know (LEASE_UNKNOWN) fails that load only; the
    peer is re-checked with a fresh handshake and kept (same engine)."""
    make_p, d, d_kv, _ = world
    p = make_p("eng-p")
    drv = Driver(d)
    p.grant("good")
    good = p.spec("good", "good", (1, 2), (3, 4))
    bogus = p.spec("bogus", "no-such-lease", (5,), (6,))
    p.freeze()  # both pins are queued before either is answered
    drv.add(bogus, good)
    time.sleep(0.1)
    p.thaw()
    drv.run_until({"good", "bogus"}, 5)
    assert drv.failed == {"bogus"}
    assert_read_from(p, d_kv, good.local_block_ids, good.remote_block_ids)
    assert wait_for(lambda: p.handshakes == 2)  # the re-check
    drv.step()
    assert d.reader is not None and d.reader.num_peers == 1
    p.grant("after")
    after = p.spec("after", "after", (7,), (8,))
    drv.add(after)
    drv.run_until({"after"}, 5)
    assert "after" not in drv.failed
    assert p.handshakes == 2  # the re-checked handshake is still cached


def test_handshake_cache_is_keyed_by_endpoint_and_checks_agent_names(world) -> None:
    """Item 11: a request naming P's engine id at another host never evicts or
    replaces P's cached agent; a peer whose agent name does not match the
    engine id it claims is refused naming both."""
    make_p, d, d_kv, d_transport = world
    real = make_p("eng-p")
    impostor = make_p("eng-evil", claim_engine_id="eng-p")  # agent eng-evil-tp0-fake
    drv = Driver(d)
    real.grant("r1")
    drv.add(real.spec("r1", "r1", (1,), (2,)))
    drv.run_until({"r1"}, 5)
    impostor.grant("x")
    drv.add(impostor.spec("x", "x", (3,), (4,), engine_id="eng-p"))
    drv.run_until({"x"}, 5)
    assert "x" in drv.failed
    assert "eng-evil-tp0-fake" not in d_transport.peers
    real.grant("r2")
    drv.add(real.spec("r2", "r2", (5, 6), (7, 8)))
    drv.run_until({"r2"}, 5)
    assert "r2" not in drv.failed
    assert_read_from(real, d_kv, (5, 6), (7, 8))
    assert real.handshakes == 1


def test_impostor_reusing_the_real_agent_name_is_refused(world) -> None:
    """Same engine id, same agent name, another endpoint: refused before its
    metadata is loaded, so it cannot replace the real P's agent."""
    make_p, d, d_kv, _ = world
    real = make_p("eng-p")
    drv = Driver(d)
    real.grant("r1")
    drv.add(real.spec("r1", "r1", (1,), (2,)))
    drv.run_until({"r1"}, 5)
    # A second server at another port replays the real P's handshake.
    assert real.worker.agent is not None
    other = LeaseService(LeaseTable(30, time.monotonic))
    port = free_port()
    server = SideChannelServer(HOST, port, "eng-p", real.worker.compat,
                               {0: real.worker.agent}, other)
    try:
        other.grant("x", num_consumers=1)
        spec = RecvSpec(request_id="x", local_block_ids=[3], remote_block_ids=[4],
                        remote_engine_id="eng-p", remote_request_id="x", remote_host=HOST,
                        remote_port=port, remote_tp_size=1, num_tokens=BLOCK)
        drv.add(spec)
        drv.run_until({"x"}, 5)
        assert drv.failed == {"x"}
    finally:
        server.close()
    real.grant("r2")
    drv.add(real.spec("r2", "r2", (5,), (6,)))
    drv.run_until({"r2"}, 5)
    assert "r2" not in drv.failed
    assert_read_from(real, d_kv, (5,), (6,))


# A 5 s side-channel timeout: this test counts resources, not time, and in
# CI it runs beside engine starts that can stall a thread past 1 s (a
# handshake timed out once at 1 s there, 2026-12-05).
@pytest.mark.parametrize("world", [5.0], indirect=True)
def test_peers_that_come_and_go_leave_nothing_behind(world, monkeypatch) -> None:
    """Item 10: 50 Ps each serve one load and go away; D's cached handshakes,
    NIXL agents, side-channel lanes (threads) and sockets return to their
    starting level once idle past their TTLs."""
    monkeypatch.setattr(d_pull_worker, "PEER_IDLE_TTL_S", 0.3)
    monkeypatch.setattr(d_pull_worker, "REAP_EVERY_S", 0.05)
    from vllm_pd_ext.wire import outbox
    monkeypatch.setattr(outbox, "LANE_IDLE_TTL_S", 0.3)
    make_p, d, _, d_transport = world
    drv = Driver(d)
    p0 = make_p("eng-first")  # starts D's reader and its poster thread
    p0.grant("w")
    drv.add(p0.spec("w", "w", (0,), (1,)))
    drv.run_until({"w"}, 5)
    time.sleep(0.5)
    drv.step()
    import os
    threads0 = threading.active_count()
    fds0 = len(os.listdir("/proc/self/fd"))
    assert d.reader is not None
    for i in range(50):
        p = make_p(f"eng-churn{i}")
        p.grant("r")
        drv.add(p.spec(f"c{i}", "r", (1 + i % 8,), (2,)))
        drv.run_until({f"c{i}"}, 5)
        assert f"c{i}" not in drv.failed
        p.close()
    assert d.reader.num_peers > 0
    time.sleep(0.6)

    def settled() -> bool:
        drv.step()
        return d.reader is not None and d.reader.num_peers == 0 and (
            threading.active_count() <= threads0)

    assert wait_for(settled, timeout=5), (d.reader.num_peers, threading.active_count(),
                                          threads0)
    assert d_transport.peers == set()
    # Each P's own worker and server were closed; D's sockets went with its lanes.
    assert len(os.listdir("/proc/self/fd")) <= fds0 + 2


def test_renewals_to_a_live_p_never_wait_behind_a_dead_ps_releases() -> None:
    """Item 8: D's heartbeat thread used to send every queued release (one
    timeout each) before any renew. With 40 releases queued to a frozen P1
    (4 s of timeouts), P2's 2 s lease must still be renewed in time."""
    fabric = FakeFabric()
    # A 2 s lease (not 1.2 s): a loaded host may stall the renewals for a second.
    p1, p2 = FakeP(fabric, "eng-p1"), FakeP(fabric, "eng-p2", lease_s=2.0)
    sender = HeartbeatSender("eng-d", interval_s=0.2, timeout_s=1.0)
    try:
        p1.freeze()
        p2.grant("live")
        for i in range(40):
            sender.release((HOST, p1.port), f"gone{i}", 1, "not needed")
        sender.track("d-live", (HOST, p2.port), "live")
        t_end = time.monotonic() + 3.5
        while time.monotonic() < t_end:
            result = p2.leases.sweep()
            assert result.expired == [], "P2's lease expired behind P1's releases"
            time.sleep(0.05)
        lease = p2.leases.table.get("live")
        # A few: a loaded host fails some of the 0.1 s renewal requests.
        assert lease is not None and lease.num_renewals >= 3
    finally:
        p1.thaw()
        sender.close()
        p1.close()
        p2.close()


def test_loads_past_their_deadline_fail_even_when_p_never_answers(world) -> None:
    """A frozen P from the start (no cached handshake): every load gets its
    answer (a failure naming the handshake) and no release is sent to it."""
    make_p, d, _, _ = world
    p = make_p("eng-frozen")
    p.freeze()
    drv = Driver(d)
    specs = [p.spec(f"f{i}", f"f{i}", (i,), (i,)) for i in range(4)]
    drv.add(*specs)
    drv.run_until({s.request_id for s in specs}, 5)
    assert drv.failed == {s.request_id for s in specs}
    assert max(drv.took(s.request_id) for s in specs) < 2.5
    # Only the one handshake was ever queued to the frozen P: no releases.
    p.thaw()
    time.sleep(0.3)
    assert p.handshakes == 1
    assert p.leases.counters().num_late_messages == 0


def test_failure_reason_of_an_incompatible_peer_uses_the_error_code(world) -> None:
    """The side channel's error code, not its message text, names the reason."""
    make_p, d, _, _ = world
    p = make_p("eng-p")
    assert p.worker.agent is not None
    p.server.compat = proto.CompatInfo(**{**{f: getattr(p.worker.compat, f)
                                             for f in p.worker.compat.__struct_fields__},
                                          "block_size": 999})
    # Straight to the reader: start_load_kv advances it once itself, and a
    # fast handshake would be settled (and its failure consumed) there.
    reader = d._pull_reader()
    reader.expect(p.spec("i", "i", (1,), (2,)))
    seen: list[tuple[str, FailureReason]] = []
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        seen = [(rid, reason) for rid, _, reason, _ in reader.advance()]
        time.sleep(0.01)
    assert seen == [("i", FailureReason.INCOMPATIBLE)]
