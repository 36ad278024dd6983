"""Push across TP sizes (issue 26 items 2, 4): real Pushers and
PushReceivers on a fake fabric.

P runs ``p_tp`` ranks, each a real ``Pusher`` over a torch CPU cache of its
heads (``[blocks, heads of the rank, block_size, 2 x head_dim]``, cut out of
one model-wide cache); D runs ``d_tp`` ranks, each a ``PushReceiver`` over a
zeroed cache. The orders are the scheduler's (``scheduler.p_push.write_targets``).
The checks: every D rank's blocks equal the model-wide cache's heads that
rank holds, nothing else was written, a D rank written by several P ranks
reports its KV in only once every one of them landed, and every P rank
releases its lease share once its WRITEs settled.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import zmq
from pdunit_utils import free_port, wait_for

from vllm_pd_ext.compat.layout import kv_regions
from vllm_pd_ext.leases.service import LeaseService
from vllm_pd_ext.leases.table import LeaseState, LeaseTable
from vllm_pd_ext.scheduler.p_push import write_targets
from vllm_pd_ext.transport import XferState
from vllm_pd_ext.transport.fake import FakeFabric, FakeTransport
from vllm_pd_ext.transport.tp_slices import Sharding
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.side_channel import SideChannelServer
from vllm_pd_ext.wire.specs import PushRecvSpec
from vllm_pd_ext.worker.d_push import PushReceiver
from vllm_pd_ext.worker.p_push import Pusher

HOST = "127.0.0.1"
NUM_BLOCKS, BLOCK, HEAD, LAYERS = 10, 16, 8, 2
SRC, DST = [4, 5, 6, 0], [1, 2, 3, 7]
COMPAT = proto.CompatInfo(protocol_version=proto.PROTOCOL_VERSION, model="m", dtype="float32",
                          block_size=BLOCK, kv_layout="LBHNC", num_layers=LAYERS,
                          num_kv_heads=1, head_size=HEAD, tp_size=1, transfer_mode="push")


class Gated(FakeTransport):
    """WRITEs stay PROC (no bytes, no notification) until ``gate`` is set."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.gate = threading.Event()
        self.gate.set()

    def poll(self, handle):  # type: ignore[no-untyped-def]
        if not self.gate.is_set():
            return XferState.PROC
        return super().poll(handle)


class Cluster:
    def __init__(self, p_tp: int, d_tp: int, heads: int) -> None:
        self.fabric = FakeFabric()
        gen = torch.Generator().manual_seed(12)
        self.full = [torch.rand((NUM_BLOCKS, heads, BLOCK, 2 * HEAD), generator=gen)
                     for _ in range(LAYERS)]
        self.p_shard, self.d_shard = Sharding(p_tp, heads), Sharding(d_tp, heads)
        self.leases = LeaseService(LeaseTable(30.0, time.monotonic))
        self.port = free_port()
        self.server = SideChannelServer(HOST, self.port, "eng-p", COMPAT, {}, self.leases)
        self.p_kv, self.p_t, self.pushers = [], [], []
        for r in range(p_tp):
            h = self.p_shard.heads_of(r)
            kv = {f"l{i}": self.full[i][:, h.start:h.stop].clone() for i in range(LAYERS)}
            t = Gated(f"eng-p-tp{r}-x", self.fabric)
            t.enter_thread()
            regs = kv_regions(kv, NUM_BLOCKS)
            t.register([(g.base_addr, g.block_stride * NUM_BLOCKS) for g in regs], "DRAM", 0)
            self.p_kv.append(kv)
            self.p_t.append(t)
            self.pushers.append(Pusher("eng-p", r, t, regs, (HOST, self.port),
                                       transfer_timeout_s=5.0, notify_timeout_s=2.0))
        self.d_kv, self.receivers, self.agents = [], [], []
        for r in range(d_tp):
            kv = {f"l{i}": torch.zeros((NUM_BLOCKS, self.d_shard.heads_per_rank, BLOCK,
                                        2 * HEAD)) for i in range(LAYERS)}
            t = FakeTransport(f"eng-d-tp{r}-x", self.fabric)
            t.enter_thread()
            regs = kv_regions(kv, NUM_BLOCKS)
            t.register([(g.base_addr, g.block_stride * NUM_BLOCKS) for g in regs], "DRAM", 0)
            self.d_kv.append(kv)
            self.receivers.append(PushReceiver(t))
            self.agents.append(proto.AgentInfo(tp_rank=r, agent_name=t.agent_name,
                                               agent_metadata=t.metadata(), mem_type="DRAM",
                                               regions=regs))
        self.ctx = zmq.Context()
        self.socks = []
        for pusher in self.pushers:
            s = self.ctx.socket(zmq.PUSH)
            s.connect(pusher.endpoint)
            self.socks.append(s)

    def order(self, token: str = "tok") -> list[int]:
        """Send each P rank its order, as P's scheduler does; the ranks ordered."""
        targets = write_targets(self.p_shard, self.d_shard, self.agents)
        assert targets is not None
        ordered = []
        for r, sock in enumerate(self.socks):
            if not targets[r]:
                self.leases.release_ranks("pd1", [r], ok=True)  # the scheduler's shortcut
                continue
            ordered.append(r)
            sock.send(proto.encode_order(proto.WriteOrder(
                pd_request_id="pd1", request_id="p1", d_engine_id="eng-d", d_request_id="d1",
                notify_host=HOST, notify_port=1, agent=self.agents[0], src_block_ids=SRC,
                dst_block_ids=DST, post_before=time.monotonic() + 30, notif_token=token,
                targets=targets[r])))
        return ordered

    def landed(self) -> list[bool]:
        out = []
        for rx in self.receivers:
            out.append(bool(rx.collect(time.monotonic())) or rx.num_waiting == 0)
        return out

    def close(self) -> None:
        for s in self.socks:
            s.close(linger=0)
        for p in self.pushers:
            p.close()
        self.ctx.term()
        self.server.close()


@pytest.fixture
def make_cluster():
    made = []

    def make(*args: int) -> Cluster:
        c = Cluster(*args)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.mark.parametrize(("p_tp", "d_tp", "heads"), [
    (1, 2, 2), (2, 1, 2), (1, 4, 4), (4, 1, 4), (2, 4, 4), (4, 2, 4),
    # GQA with fewer KV heads than ranks: replicas; two of P's four ranks write nothing.
    (4, 2, 2), (2, 4, 2), (4, 1, 2),
])
def test_every_d_rank_gets_exactly_its_heads(make_cluster, p_tp, d_tp, heads):
    c = make_cluster(p_tp, d_tp, heads)
    c.leases.grant("pd1", num_consumers=p_tp)
    c.leases.hold("pd1")
    for rx in c.receivers:
        rx.expect(PushRecvSpec("d1", "pd1", DST, len(DST) * BLOCK, "tok"), time.monotonic())
    c.order()
    done = [False] * d_tp
    deadline = time.monotonic() + 5
    while not all(done) and time.monotonic() < deadline:
        for r, rx in enumerate(c.receivers):
            done[r] = done[r] or bool(rx.collect(time.monotonic()))
        time.sleep(0.005)
    assert all(done), done
    for rank, kv in enumerate(c.d_kv):
        h = c.d_shard.heads_of(rank)
        for i in range(LAYERS):
            got, want = kv[f"l{i}"], c.full[i][:, h.start:h.stop]
            for d_block, p_block in zip(DST, SRC, strict=True):
                assert torch.equal(got[d_block], want[p_block]), (rank, i, d_block)
            others = [b for b in range(NUM_BLOCKS) if b not in DST]
            assert torch.count_nonzero(got[others]) == 0
    assert wait_for(lambda: c.leases.table.get("pd1") is not None
                    and c.leases.table.get("pd1").state is LeaseState.RELEASED)


def test_a_d_rank_written_by_two_p_ranks_waits_for_both(make_cluster):
    """P TP=2 -> D TP=1: P rank 1's WRITE is held back; rank 0's lands and
    notifies, yet D's rank reports nothing until rank 1's lands too."""
    c = make_cluster(2, 1, 2)
    c.leases.grant("pd1", num_consumers=2)
    c.leases.hold("pd1")
    c.p_t[1].gate.clear()
    rx = c.receivers[0]
    rx.expect(PushRecvSpec("d1", "pd1", DST, len(DST) * BLOCK, "tok"), time.monotonic())
    assert c.order() == [0, 1]
    assert wait_for(lambda: bool(c.d_kv[0]["l0"][DST[0], 0].count_nonzero()))  # rank 0 in
    time.sleep(0.1)
    assert rx.collect(time.monotonic()) == [] and rx.num_waiting == 1
    assert torch.count_nonzero(c.d_kv[0]["l0"][DST[0], 1]) == 0  # rank 1's head not yet
    c.p_t[1].gate.set()
    assert wait_for(lambda: bool(rx.collect(time.monotonic())))
    assert torch.equal(c.d_kv[0]["l0"][DST[0]], c.full[0][SRC[0]])


def test_notification_tags_name_the_writer_and_how_many_write():
    """Tags: a plain token is one writer; ``tok.0.2`` is writer 0 of 2; a
    malformed suffix matches no token."""
    assert proto.notif_writer("tok") == ("tok", 0, 1)
    assert proto.notif_writer("tok.1.2") == ("tok", 1, 2)
    assert proto.notif_writer("tok.3.2") == ("tok", 3, 2)  # P rank 3, one of 2 writers
    for bad in ("tok.1.0", "tok.x.2", "tok.1", "tok.1.99999", "tok.\u00b2.2", "tok.1.2.3"):
        assert proto.notif_writer(bad) == (bad, 0, 1)
    assert proto.push_notif("pd", "tok", 1, 2) == b"pdx:tok.1.2/pd"
    assert proto.push_notif("pd", "tok") == b"pdx:tok/pd"
