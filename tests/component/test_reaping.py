"""Nothing per peer outlives the peer: outbox lanes, client sockets, push agents.

Peers come and go (restarts, scaling), so anything kept per peer must be
reaped once idle. Each churn test lets 50 peers come and go (real ZMQ
servers on 127.0.0.1, started and stopped; fake D agents for the pusher)
and then checks that threads, open file descriptors and loaded agents are
back at their starting level.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time

import zmq
from pdunit_utils import FakeClock, free_port, wait_for

from vllm_pd_ext.leases.service import LeaseService
from vllm_pd_ext.leases.table import LeaseState, LeaseTable
from vllm_pd_ext.transport import XferState
from vllm_pd_ext.transport.fake import FakeFabric, FakeTransport
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.outbox import Outbox
from vllm_pd_ext.wire.side_channel import SideChannelClient, SideChannelServer
from vllm_pd_ext.worker.p_push import Pusher

HOST = "127.0.0.1"
NUM_PEERS = 50
COMPAT = proto.CompatInfo(protocol_version=proto.PROTOCOL_VERSION, model="m", dtype="bf16",
                          block_size=16, kv_layout="NHD", num_layers=1, num_kv_heads=1,
                          head_size=8, tp_size=1, transfer_mode="push")
#: zmq.Context.instance(), which every SideChannelClient shares, is created
#: on first use and kept for the process: libzmq's I/O and reaper threads
#: (native, not Python threads) and a few descriptors (its mailboxes and
#: epoll fd). Nothing else may stay.
CONTEXT_THREADS = 2
CONTEXT_FDS = 6
#: Python threads whose own shutdown ends a moment after their work
#: (a retiring lane closes its client, then exits): waited for, not slack.
SETTLE_S = 10.0


def num_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def num_native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


class Level:
    """Threads and descriptors now, to compare with after the churn."""

    def __init__(self) -> None:
        self.threads = threading.active_count()
        self.native = num_native_threads()
        self.fds = num_fds()

    def back(self, slack_threads: int = CONTEXT_THREADS, slack_fds: int = CONTEXT_FDS) -> bool:
        # Python threads exactly; native threads and fds up to the shared
        # context's (it may be created during the test).
        return (threading.active_count() == self.threads
                and num_native_threads() <= self.native + slack_threads
                and num_fds() <= self.fds + slack_fds)

    def __repr__(self) -> str:
        return (f"threads {self.threads} -> {threading.active_count()}, native {self.native} "
                f"-> {num_native_threads()}, fds {self.fds} -> {num_fds()}")


class Recorder:
    """A push handler that records what reaches a side channel, in order."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.lock = threading.Lock()

    def handle(self, msg: proto.Request) -> proto.Reply:
        assert isinstance(msg, proto.PushAbort)
        with self.lock:
            self.seen.append(msg.pd_request_id)
        return proto.PushAbortStatus("unknown")

    def on_release(self, msg: proto.LeaseRelease) -> None:
        return


def server(port: int, rec: Recorder | None = None) -> SideChannelServer:
    return SideChannelServer(HOST, port, "eng-p", COMPAT, {}, None, push=rec or Recorder())


def abort(pd_id: str) -> proto.PushAbort:
    return proto.PushAbort(engine_id="eng-d", pd_request_id=pd_id)


# ------------------------------------------------------------------ outbox
def test_outbox_lanes_of_departed_peers_end():
    level = Level()
    # 10 s, not 2: one round trip took longer than 2 s in a CI run, with two
    # e2e lanes' engines on the same 2 cores (the reply was then a timeout).
    box = Outbox(timeout_s=10.0, idle_ttl_s=0.3)
    replies: list[object] = []
    try:
        for i in range(NUM_PEERS):  # each peer comes, is talked to, and goes
            port = free_port()
            srv = server(port)
            box.send(HOST, port, abort("x"), replies.append)
            assert wait_for(lambda i=i: len(replies) == i + 1, timeout=15.0)
            srv.close()
        assert wait_for(lambda: len(replies) == NUM_PEERS)
        odd = [r for r in replies if r != proto.PushAbortStatus("unknown")]
        assert not odd, odd
        assert wait_for(lambda: box.num_lanes == 0, timeout=SETTLE_S), box.num_lanes
        assert wait_for(level.back, timeout=SETTLE_S), level
    finally:
        box.close()


# ----------------------------------------------------------- client sockets
def test_client_sockets_of_departed_peers_are_closed():
    level = Level()
    clock = FakeClock()
    client = SideChannelClient(timeout_s=2.0, clock=clock, idle_ttl_s=60.0)
    try:
        for _ in range(NUM_PEERS):
            port = free_port()
            srv = server(port)
            assert client.request(HOST, port, abort("x")) == proto.PushAbortStatus("unknown")
            srv.close()
            clock.advance(1.0)
        assert client.num_sockets == NUM_PEERS
        clock.advance(60.0)
        assert client.reap() == NUM_PEERS and client.num_sockets == 0
        # libzmq closes the sockets' descriptors on its I/O thread, soon after.
        assert wait_for(level.back, timeout=SETTLE_S), level
    finally:
        client.close()


def test_client_reaps_only_sockets_idle_for_the_ttl():
    clock = FakeClock()
    client = SideChannelClient(timeout_s=2.0, clock=clock, idle_ttl_s=60.0)
    ports = [free_port(), free_port()]
    servers = [server(p) for p in ports]
    try:
        client.request(HOST, ports[0], abort("a"))
        clock.advance(50.0)
        client.request(HOST, ports[1], abort("b"))
        clock.advance(20.0)  # a idle 70 s, b idle 20 s
        client.request(HOST, ports[1], abort("c"))  # each request reaps first
        assert client.num_sockets == 1
        clock.advance(30.0)
        client.request(HOST, ports[0], abort("d"))  # reconnects; b was touched 30 s ago
        assert client.num_sockets == 2
    finally:
        client.close()
        for s in servers:
            s.close()


def test_client_drop_closes_one_endpoint():
    ports = [free_port(), free_port()]
    servers = [server(p) for p in ports]
    client = SideChannelClient(timeout_s=2.0)
    try:
        for p in ports:
            client.request(HOST, p, abort("a"))
        assert client.drop(HOST, ports[0]) is True and client.num_sockets == 1
        assert client.drop(HOST, ports[0]) is False
        assert client.request(HOST, ports[0], abort("b")) == proto.PushAbortStatus("unknown")
        assert client.num_sockets == 2
    finally:
        client.close()
        for s in servers:
            s.close()


# -------------------------------------------------------------- push agents
BLOCK, NUM_BLOCKS = 64, 4
NBYTES = BLOCK * NUM_BLOCKS


class GatedTransport(FakeTransport):
    """P's FakeTransport: WRITEs stay PROC while ``gate`` is clear."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.gate = threading.Event()
        self.gate.set()

    def poll(self, handle):
        return XferState.PROC if not self.gate.is_set() else super().poll(handle)


class PushRig:
    """A Pusher on a fake P agent, its side channel, and D agents on demand."""

    def __init__(self, ttl_s: float) -> None:
        self.fabric = FakeFabric()
        self.bufs: list[ctypes.Array[ctypes.c_uint8]] = []
        self.p_t = GatedTransport("eng-p-tp0-p", self.fabric)
        self.p_t.enter_thread()  # the test thread plays P's step thread
        self.p_t.register([(self._buf(), NBYTES)], "DRAM", 0)
        self.leases = LeaseService(LeaseTable(30.0, time.monotonic))
        self.port = free_port()
        self.srv = SideChannelServer(HOST, self.port, "eng-p", COMPAT, {}, self.leases)
        self.pusher = Pusher("eng-p", 0, self.p_t, self.regions(self.bufs[0]),
                             (HOST, self.port), transfer_timeout_s=5.0, notify_timeout_s=2.0,
                             peer_idle_ttl_s=ttl_s)
        self.ctx = zmq.Context()
        self.orders = self.ctx.socket(zmq.PUSH)
        self.orders.connect(self.pusher.endpoint)
        self.n = 0

    def _buf(self) -> int:
        self.bufs.append((ctypes.c_uint8 * NBYTES)())
        return ctypes.addressof(self.bufs[-1])

    @staticmethod
    def regions(buf: ctypes.Array[ctypes.c_uint8]) -> list[proto.Region]:
        return [proto.Region(ctypes.addressof(buf), BLOCK, BLOCK, NUM_BLOCKS)]

    def d_agent(self, engine: str) -> FakeTransport:
        t = FakeTransport(f"{engine}-tp0-x", self.fabric)
        t.enter_thread()
        t.register([(self._buf(), NBYTES)], "DRAM", 0)
        return t

    def push(self, d: FakeTransport, engine: str) -> str:
        self.n += 1
        pd_id = f"pd-{self.n}"
        self.leases.grant(pd_id, 1)
        self.leases.hold(pd_id)
        agent = proto.AgentInfo(tp_rank=0, agent_name=d.agent_name,
                                agent_metadata=d.metadata(), mem_type="DRAM",
                                regions=[proto.Region(d.regions[0][0], BLOCK, BLOCK,
                                                      NUM_BLOCKS)])
        self.orders.send(proto.encode_order(proto.WriteOrder(
            pd_request_id=pd_id, request_id="p", d_engine_id=engine, d_request_id="d",
            notify_host=HOST, notify_port=1, agent=agent, src_block_ids=[1],
            dst_block_ids=[2], post_before=time.monotonic() + 30)))
        return pd_id

    def released(self, pd_id: str) -> bool:
        with self.leases.lock:
            lease = self.leases.table.get(pd_id)
        return lease is not None and lease.state is LeaseState.RELEASED and lease.release_ok

    def close(self) -> None:
        self.orders.close(linger=0)
        self.ctx.term()
        self.pusher.close()
        self.srv.close()


def test_push_agents_of_departed_d_peers_are_removed():
    rig = PushRig(ttl_s=0.3)
    try:
        # Warm up: the first release starts the pusher's lane to P's own side
        # channel (kept while used, as every lane), so measure after it.
        warm = rig.d_agent("eng-warm")
        warm_id = rig.push(warm, "eng-warm")
        assert wait_for(lambda: rig.released(warm_id))
        assert wait_for(lambda: rig.pusher.num_peers == 0)
        level = Level()
        for i in range(NUM_PEERS):  # each D comes, receives one WRITE, and goes
            d = rig.d_agent(f"eng-d{i}")
            pd_id = rig.push(d, f"eng-d{i}")
            assert wait_for(lambda pd_id=pd_id: rig.released(pd_id)), pd_id
            d.close()
        assert wait_for(lambda: rig.pusher.num_peers == 0, timeout=SETTLE_S)
        assert rig.p_t.peers == set()
        assert wait_for(lambda: level.back(0, 0), timeout=SETTLE_S), level
    finally:
        rig.close()


def test_push_agent_with_a_write_in_flight_is_never_removed():
    rig = PushRig(ttl_s=0.2)
    try:
        d = rig.d_agent("eng-d")
        rig.p_t.gate.clear()
        pd_id = rig.push(d, "eng-d")
        assert wait_for(lambda: rig.pusher.num_in_flight == 1)
        time.sleep(1.0)  # five TTLs, many reaper passes
        assert rig.p_t.peers == {d.agent_name} and rig.pusher.num_peers == 1
        rig.p_t.gate.set()
        assert wait_for(lambda: rig.released(pd_id))
        # Idle from the WRITE's end on, then reaped.
        assert wait_for(lambda: rig.p_t.peers == set(), timeout=3.0)
    finally:
        rig.close()
