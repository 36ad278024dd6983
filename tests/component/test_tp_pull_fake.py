"""Pull across TP sizes (issue 26 item 4): real PDWorkers on a fake fabric.

P runs ``p_tp`` worker ranks, D ``d_tp``; each rank's KV is a torch CPU
tensor shaped like vLLM's CPU cache (``[blocks, heads of the rank,
block_size, 2 x head_dim]``), cut out of one model-wide cache. One real
``SideChannelServer`` serves P's leases and every P rank's agent; each D
rank handshakes, pins, reads its head slices from the P ranks that hold
them and releases. The checks: every D rank's blocks equal the model-wide
cache's heads that rank holds, byte for byte; nothing else was written; the
lease is released only once every D rank released (D's TP size is its
consumer count, whatever P's is); descriptors per rank as the mapping says.
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
from vllm_pd_ext.transport.fake import FakeFabric, FakeTransport
from vllm_pd_ext.transport.tp_slices import Sharding
from vllm_pd_ext.wire.side_channel import SideChannelServer
from vllm_pd_ext.wire.specs import RecvSpec
from vllm_pd_ext.worker.dispatcher import PDWorker

HOST = "127.0.0.1"
NUM_BLOCKS, BLOCK, HEAD, LAYERS = 10, 16, 8, 2
LOCAL, REMOTE = [1, 2, 3, 7], [4, 5, 6, 0]


def config(engine_id: str, producer: bool, tp: int, heads: int):
    per_rank = max(1, heads // tp)
    model_config = SimpleNamespace(
        model="tiny-tp-model", served_model_name=None, dtype="torch.float32",
        get_num_layers=lambda pc: LAYERS, get_num_kv_heads=lambda pc: per_rank,
        get_total_num_kv_heads=lambda: heads, get_head_size=lambda: HEAD)
    return SimpleNamespace(
        model_config=model_config,
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=BLOCK,
                                     num_gpu_blocks=NUM_BLOCKS),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, data_parallel_rank=0,
                                        data_parallel_index=0),
        kv_transfer_config=SimpleNamespace(engine_id=engine_id, is_kv_producer=producer,
                                           is_kv_consumer=not producer))


class Cluster:
    def __init__(self, p_tp: int, d_tp: int, heads: int) -> None:
        self.fabric = FakeFabric()
        gen = torch.Generator().manual_seed(11)
        #: The model-wide cache: what a TP=1 engine would hold.
        self.full = [torch.rand((NUM_BLOCKS, heads, BLOCK, 2 * HEAD), generator=gen)
                     for _ in range(LAYERS)]
        self.p_shard, self.d_shard = Sharding(p_tp, heads), Sharding(d_tp, heads)
        self.p_workers, self.d_workers, self.d_kv, self.d_transports = [], [], [], []
        self.p_kv: list[dict[str, torch.Tensor]] = []
        agents = {}
        for r in range(p_tp):
            t = FakeTransport(f"eng-p-tp{r}-fake", self.fabric)
            w = PDWorker(config("eng-p", True, p_tp, heads), PDConfig(), transport=t,
                         tp_rank=r)
            h = self.p_shard.heads_of(r)
            kv = {f"layer.{i}": self.full[i][:, h.start:h.stop].clone() for i in range(LAYERS)}
            w.register_kv_caches(kv)
            self.p_kv.append(kv)  # the workers keep addresses only, as vLLM keeps the tensors
            self.p_workers.append(w)
            agents[r] = w.agent
        cfg = PDConfig(handshake_timeout=1.0, transfer_timeout=5.0)
        for r in range(d_tp):
            t = FakeTransport(f"eng-d-tp{r}-fake", self.fabric, cycles_to_done=2)
            self.d_transports.append(t)
            w = PDWorker(config("eng-d", False, d_tp, heads), cfg, transport=t, tp_rank=r)
            kv = {f"layer.{i}": torch.zeros((NUM_BLOCKS, self.d_shard.heads_per_rank, BLOCK,
                                             2 * HEAD)) for i in range(LAYERS)}
            w.register_kv_caches(kv)
            self.d_workers.append(w)
            self.d_kv.append(kv)
        self.leases = LeaseService(LeaseTable(30.0, time.monotonic))
        self.port = free_port()
        self.server = SideChannelServer(HOST, self.port, "eng-p", self.p_workers[0].compat,
                                        agents, self.leases)

    def spec(self) -> RecvSpec:
        return RecvSpec(request_id="d-req", local_block_ids=LOCAL, remote_block_ids=REMOTE,
                        remote_engine_id="eng-p", remote_request_id="p-req",
                        remote_host=HOST, remote_port=self.port,
                        remote_tp_size=self.p_shard.tp_size, num_tokens=len(LOCAL) * BLOCK)

    def lease(self):
        with self.leases.lock:
            return self.leases.table.get("p-req")

    def close(self) -> None:
        for w in self.d_workers + self.p_workers:
            w.shutdown()
        self.server.close()


@pytest.fixture
def make_cluster():
    made = []

    def make(*args):
        c = Cluster(*args)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def load(worker: PDWorker, spec: RecvSpec, timeout: float = 5.0) -> tuple[set, set]:
    worker.start_load_kv(PDConnectorMetadata(reqs_to_recv=[spec]))
    deadline = time.monotonic() + timeout
    recving, failed = set(), set()
    while not recving and time.monotonic() < deadline:
        time.sleep(0.002)
        worker.start_load_kv(None)
        _, r, f = worker.get_transfer_results()
        recving |= r
        failed |= f
    return recving, failed


@pytest.mark.parametrize(("p_tp", "d_tp", "heads"), [
    (1, 2, 2), (2, 1, 2), (2, 2, 2), (1, 4, 4), (4, 1, 4), (2, 4, 4), (4, 2, 4),
    # GQA with fewer KV heads than ranks: TP=4 replicates each of 2 heads.
    (4, 2, 2), (2, 4, 2), (1, 4, 2), (4, 1, 2),
])
def test_every_d_rank_gets_exactly_its_heads(make_cluster, p_tp, d_tp, heads):
    c = make_cluster(p_tp, d_tp, heads)
    # Granted with P's rank count, as P's scheduler does before D is chosen.
    c.leases.grant("p-req", num_consumers=p_tp)
    spec = c.spec()
    for rank, worker in enumerate(c.d_workers):
        recving, failed = load(worker, spec)
        assert recving == {"d-req"} and failed == set(), (rank, failed)
        if rank < d_tp - 1:
            # Released by this rank, but the other D ranks have not read yet.
            assert wait_for(lambda r=rank: r in c.lease().released_ranks)
            assert c.lease().state is not LeaseState.RELEASED
    assert wait_for(lambda: c.lease() is not None and c.lease().state is LeaseState.RELEASED)
    assert c.lease().num_consumers == d_tp and c.lease().release_ok
    for rank, kv in enumerate(c.d_kv):
        h = c.d_shard.heads_of(rank)
        for i in range(LAYERS):
            got, want = kv[f"layer.{i}"], c.full[i][:, h.start:h.stop]
            for lo, re in zip(LOCAL, REMOTE, strict=True):
                assert torch.equal(got[lo], want[re]), (rank, i, lo)
            untouched = [b for b in range(NUM_BLOCKS) if b not in LOCAL]
            assert torch.count_nonzero(got[untouched]) == 0


@pytest.mark.parametrize(("p_tp", "d_tp", "heads", "descs_per_rank"), [
    # Same sharding: whole blocks, runs coalesced (blocks 1-3 <- 4-6, 7 <- 0).
    (2, 2, 2, 2 * LAYERS),
    # A head slice is one range per block and layer.
    (1, 2, 2, len(LOCAL) * LAYERS),
    # D reads a slice from each of P's ranks.
    (2, 1, 2, 2 * len(LOCAL) * LAYERS),
    # P rank holds 2 heads, D rank 1 of them: partial blocks.
    (2, 4, 4, len(LOCAL) * LAYERS),
    # D's 2 heads of a rank come whole from one P rank each... 2 P ranks.
    (4, 2, 4, 2 * len(LOCAL) * LAYERS),
])
def test_descriptors_per_rank(make_cluster, p_tp, d_tp, heads, descs_per_rank):
    c = make_cluster(p_tp, d_tp, heads)
    c.leases.grant("p-req", num_consumers=p_tp)
    for worker in c.d_workers:
        assert load(worker, c.spec())[0] == {"d-req"}
        stats = worker.get_kv_connector_stats()
        assert stats is not None and stats.data["num_descriptors"] == descs_per_rank


def test_a_failed_rank_fails_the_load_and_p_keeps_blocks_until_every_rank_released(
        make_cluster):
    """P TP=1 -> D TP=2: rank 0 reads; rank 1's READ fails (its P agent's
    fabric entry is gone). Rank 1 reports the load failed; P's lease is
    released only after both ranks released, rank 1 with ok=False."""
    c = make_cluster(1, 2, 2)
    c.leases.grant("p-req", num_consumers=1)
    spec = c.spec()
    assert load(c.d_workers[0], spec)[0] == {"d-req"}
    assert wait_for(lambda: 0 in c.lease().released_ranks)
    assert c.lease().state is not LeaseState.RELEASED  # rank 1 may still read
    c.d_transports[1].fail_post = True
    recving, failed = load(c.d_workers[1], spec)
    assert recving == failed == {"d-req"}
    assert wait_for(lambda: c.lease() is not None and c.lease().state is LeaseState.RELEASED)
    assert c.lease().release_ok is False
