"""Real NIXL WRITE with a notification (push mode) between two processes.

The target (a spawned child, ``nixl_peer.serve_write_target``) registers a
zeroed buffer, runs NixlTransport's progress pump and collects notifications
with ``take_notifs``; this process is P: it posts the WRITE, polls it to the
end, releases the handle and then does nothing more, as P's push thread does.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import time

import pytest

pytest.importorskip("nixl")

import nixl_peer

from vllm_pd_ext.leases.service import LeaseService
from vllm_pd_ext.leases.table import LeaseState, LeaseTable
from vllm_pd_ext.tools.ports import free_port
from vllm_pd_ext.transport import TransportError, XferState
from vllm_pd_ext.transport.coalesce import build_descriptors
from vllm_pd_ext.transport.nixl import NixlTransport
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.protocol import Region
from vllm_pd_ext.wire.side_channel import SideChannelServer
from vllm_pd_ext.worker.p_push import Pusher

pytestmark = pytest.mark.nixl

BLOCK = 4096
NUM_BLOCKS = 16
LAYERS = 2
NBYTES = BLOCK * NUM_BLOCKS * LAYERS
SRC, DST = [5, 6, 7], [1, 2, 9]


COMPAT = proto.CompatInfo(protocol_version=proto.PROTOCOL_VERSION, model="m", dtype="bf16",
                          block_size=16, kv_layout="NHD", num_layers=LAYERS, num_kv_heads=1,
                          head_size=8, tp_size=1, transfer_mode="push")


def regions(addr: int) -> list[Region]:
    per_layer = BLOCK * NUM_BLOCKS
    return [Region(addr + i * per_layer, BLOCK, BLOCK, NUM_BLOCKS) for i in range(LAYERS)]


class WriteTarget:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=nixl_peer.serve_write_target, args=(child, NBYTES),
                                daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(60):
            raise TimeoutError("NIXL write target did not start within 60 s")
        self.metadata, self.addr, self.nbytes = self.conn.recv()

    def notifs(self, timeout: float) -> tuple[list[bytes], bytes]:
        self.conn.send(("notifs", timeout))
        assert self.conn.poll(timeout + 30)
        return self.conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):
                self.conn.send("stop")
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self.conn.close()


@pytest.fixture
def target():
    t = WriteTarget()
    yield t
    t.stop()


@pytest.fixture
def pusher():
    buf = (ctypes.c_uint8 * NBYTES)()
    ctypes.memmove(buf, nixl_peer.pattern(NBYTES), NBYTES)
    t = NixlTransport(f"pusher-{os.getpid()}-{time.monotonic_ns()}", ["UCX"],
                      progress_thread=False)
    t.register([(ctypes.addressof(buf), NBYTES)], "DRAM", 0)
    t.buf = buf
    t.addr = ctypes.addressof(buf)
    yield t
    t.close()


def write(t: NixlTransport, peer: str, descs, notif: bytes, timeout: float = 20.0) -> XferState:
    handle = t.post_write(peer, descs, 0, notif)
    deadline = time.monotonic() + timeout
    state = t.poll(handle)
    while state is XferState.PROC and time.monotonic() < deadline:
        time.sleep(0.0005)
        state = t.poll(handle)
    if state is not XferState.PROC:
        assert t.release(handle)
    return state


def expected_target(pusher_addr: int, target_addr: int, descs) -> bytes:
    """The target's buffer after ``descs`` were written into zeroes."""
    want = bytearray(NBYTES)
    ref = nixl_peer.pattern(NBYTES)
    for loc, rem, n in descs:
        src, dst = loc - pusher_addr, rem - target_addr
        want[dst:dst + n] = ref[src:src + n]
    return bytes(want)


def test_write_lands_before_its_notification(target, pusher):
    peer = pusher.add_peer(target.metadata, "DRAM")
    descs = build_descriptors(SRC, DST, regions(pusher.addr), regions(target.addr))
    assert len(descs) == 2 * LAYERS  # [5,6]->[1,2] and [7]->[9] per layer
    assert write(pusher, peer, descs, proto.push_notif("pd-1", "ab12")) is XferState.DONE
    notifs, snapshot = target.notifs(timeout=20.0)
    assert notifs == [b"pdx:ab12/pd-1"]
    assert proto.parse_push_notif(notifs[0]) == ("pd-1", "ab12")
    # Taken as soon as the notification was seen: every byte already landed,
    # and nothing outside the destination blocks was touched.
    want = expected_target(pusher.addr, target.addr, descs)
    assert snapshot == want
    per_layer = BLOCK * NUM_BLOCKS
    assert snapshot[9 * BLOCK:10 * BLOCK] == nixl_peer.pattern(NBYTES)[7 * BLOCK:8 * BLOCK]
    assert snapshot[per_layer + BLOCK:per_layer + 3 * BLOCK] == (
        nixl_peer.pattern(NBYTES)[per_layer + 5 * BLOCK:per_layer + 7 * BLOCK])
    # Each notification is taken once.
    assert target.notifs(timeout=0.2)[0] == []


def test_write_to_unregistered_range_fails(target, pusher):
    peer = pusher.add_peer(target.metadata, "DRAM")
    outside = target.addr + target.nbytes + (1 << 20)
    for bad in ([(pusher.addr, outside, BLOCK)],
                [(pusher.addr, target.addr + target.nbytes - BLOCK, 2 * BLOCK)]):
        try:
            state = write(pusher, peer, bad, b"pdx:bad", timeout=10.0)
        except TransportError:
            continue
        assert state is XferState.ERR
    # The transport still works, and only the good WRITE's notification arrives.
    good = [(pusher.addr, target.addr, BLOCK)]
    assert write(pusher, peer, good, b"pdx:good") is XferState.DONE
    notifs, snapshot = target.notifs(timeout=20.0)
    assert notifs == [b"pdx:good"]
    assert snapshot == expected_target(pusher.addr, target.addr, good)
    assert target.notifs(timeout=0.5)[0] == []


# ------------------------------------------------ P's Pusher over real NIXL
class InProcessD:
    """A D worker's NIXL agent in this process: a zeroed buffer, a pump."""

    def __init__(self, name: str) -> None:
        self.buf = (ctypes.c_uint8 * NBYTES)()
        self.addr = ctypes.addressof(self.buf)
        self.t = NixlTransport(name, ["UCX"], progress_thread=False)
        self.t.register([(self.addr, NBYTES)], "DRAM", 0)
        self.t.start_progress_pump(0.001)

    def agent(self, name: str | None = None, metadata: bytes | None = None) -> proto.AgentInfo:
        return proto.AgentInfo(tp_rank=0, agent_name=name or self.t.agent_name,
                               agent_metadata=metadata or self.t.metadata(), mem_type="DRAM",
                               regions=regions(self.addr))

    def block(self, b: int) -> bytes:
        return ctypes.string_at(self.addr + b * BLOCK, BLOCK)


def test_pusher_keeps_the_real_agent_and_reaps_departed_ones(pusher):
    """Over real NIXL: another agent created under a cached D agent's name
    fails only its orders, whether they claim that name or a new one (NIXL
    reads the name from the metadata, and refuses to load a second agent
    under a loaded name); the real agent is neither evicted nor reloaded and
    keeps receiving. Every D agent that went away is then removed from P's
    NIXL agent after the idle TTL."""
    import zmq

    leases = LeaseService(LeaseTable(60.0, time.monotonic))
    port = free_port()
    srv = SideChannelServer("127.0.0.1", port, "eng-p", COMPAT, {}, leases)
    push = Pusher("eng-p", 0, pusher, regions(pusher.addr), ("127.0.0.1", port),
                  transfer_timeout_s=20.0, notify_timeout_s=5.0, peer_idle_ttl_s=1.0)
    ctx = zmq.Context()
    orders = ctx.socket(zmq.PUSH)
    orders.connect(push.endpoint)
    tag = f"{os.getpid()}x{time.monotonic_ns()}"
    n = [0]

    def order(engine: str, agent: proto.AgentInfo) -> str:
        n[0] += 1
        pd_id = f"pd-{n[0]}"
        leases.grant(pd_id, 1)
        leases.hold(pd_id)
        orders.send(proto.encode_order(proto.WriteOrder(
            pd_request_id=pd_id, request_id="p", d_engine_id=engine, d_request_id="d",
            notify_host="127.0.0.1", notify_port=1, agent=agent, src_block_ids=SRC,
            dst_block_ids=DST, post_before=time.monotonic() + 30)))
        return pd_id

    def settled(pd_id: str):
        """The lease once this rank released it (ok or not)."""
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            with leases.lock:
                lease = leases.table.get(pd_id)
            if lease.state is LeaseState.RELEASED:
                return lease
            time.sleep(0.01)
        raise AssertionError(f"{pd_id} was never released")

    loads: list[bytes] = []
    load = pusher.add_peer
    pusher.add_peer = lambda md, mem: loads.append(md) or load(md, mem)  # count P's loads
    ds: list[InProcessD] = []
    try:
        real = InProcessD(f"eng-d0-tp0-{tag}")
        ds.append(real)
        # Another agent that NIXL knows under the real one's name. Made before
        # the real one's WRITE: made after it, on a loaded machine, it can take
        # longer than the pusher's 1 s idle TTL, which would evict the real
        # peer and leave nothing cached for it to be confused with.
        evil = InProcessD(real.t.agent_name)
        ds.append(evil)
        assert settled(order("eng-d0", real.agent())).release_ok
        assert real.block(9) == nixl_peer.pattern(NBYTES)[7 * BLOCK:8 * BLOCK]
        for agent in (evil.agent(),                              # the cached name
                      evil.agent(name=f"eng-d0-tp0-other{tag}")):  # a new name
            lease = settled(order("eng-d0", agent))
            assert not lease.release_ok
        assert push.num_peers == 1
        ctypes.memset(real.addr, 0, NBYTES)
        assert settled(order("eng-d0", real.agent())).release_ok
        assert real.block(9) == nixl_peer.pattern(NBYTES)[7 * BLOCK:8 * BLOCK]
        assert not any(evil.buf)
        assert loads.count(real.t.metadata()) == 1  # never evicted, never reloaded
        # More D peers come, receive a WRITE each, and go.
        for i in range(1, 4):
            d = InProcessD(f"eng-d{i}-tp0-{tag}")
            ds.append(d)
            assert settled(order(f"eng-d{i}", d.agent())).release_ok
        names = [d.t.agent_name for d in ds]
        for d in ds:
            d.t.close()
        deadline = time.monotonic() + 10.0
        while push.num_peers and time.monotonic() < deadline:
            time.sleep(0.05)
        assert push.num_peers == 0
        assert not any(pusher._agent.check_remote_metadata(name) for name in names)
    finally:
        orders.close(linger=0)
        ctx.term()
        push.close()
        srv.close()
        for d in ds:
            d.t.close()


def test_the_pump_hands_on_notif_what_it_kept_for_take_notifs(pusher):
    """D's worker forwards what its pump collects to its scheduler
    (same_step_landing): the callback gets each notification, after it was
    kept, so the worker's own ``take_notifs`` still returns it."""
    import threading

    got: list[bytes] = []
    seen = threading.Event()
    buf = (ctypes.c_uint8 * NBYTES)()
    d = NixlTransport(f"d-fwd-{os.getpid()}-{time.monotonic_ns()}", ["UCX"],
                      progress_thread=False)
    try:
        d.register([(ctypes.addressof(buf), NBYTES)], "DRAM", 0)
        kept_first: list[list[bytes]] = []

        def on_notif(notifs: list[bytes]) -> None:
            with d._notif_lock:
                kept_first.append(list(d._notifs))
            got.extend(notifs)
            seen.set()

        d.start_progress_pump(0.001, on_notif=on_notif)
        peer = pusher.add_peer(d.metadata(), "DRAM")
        descs = build_descriptors(SRC, DST, regions(pusher.addr), regions(ctypes.addressof(buf)))
        notif = proto.push_notif("pd-fwd", "cd34", seed=17)
        assert write(pusher, peer, descs, notif) is XferState.DONE
        assert seen.wait(20.0), "the pump never called on_notif"
        assert got == [notif]
        assert kept_first[0] == [notif]  # kept before the callback ran
        assert d.take_notifs() == [notif]
        assert ctypes.string_at(ctypes.addressof(buf) + 9 * BLOCK, BLOCK) == (
            nixl_peer.pattern(NBYTES)[7 * BLOCK:8 * BLOCK])
    finally:
        d.close()
