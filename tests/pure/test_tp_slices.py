"""The tensor-parallel mapping core (transport/tp_slices.py) against a fake
transport that copies bytes between numpy caches shaped like vLLM's CPU
cache, ``[blocks, heads_per_rank, block_size, 2 x head_dim]`` per layer and
rank: every pair of shardings in {1, 2, 4} x {1, 2, 4} ranks, with more KV
heads than ranks and fewer (GQA, replicated heads), gaps in the block ids,
and the refusals by name."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from vllm_pd_ext.transport.tp_slices import (
    Sharding,
    TPMappingError,
    p_ranks_read_by,
    plan,
    slice_descriptors,
    slices_for,
)
from vllm_pd_ext.wire.protocol import Region

LAYERS, BLOCKS, BLOCK_SIZE, HEAD_WORDS = 3, 12, 4, 6  # HEAD_WORDS: 2 x head_dim
WORD = 2  # bf16
#: D reads P's blocks 3, 4, 5 and 9 into its blocks 0, 1, 2 and 7.
REMOTE_IDS, LOCAL_IDS = [3, 4, 5, 9], [0, 1, 2, 7]


class Rank:
    """One rank's KV memory: a flat byte buffer at a base address, with one
    region per layer (a layer's blocks back to back, like one slab)."""

    def __init__(self, base: int, heads: int, fill: np.ndarray | None = None) -> None:
        self.base, self.heads = base, heads
        shape = (LAYERS, BLOCKS, heads, BLOCK_SIZE, HEAD_WORDS)
        self.cache = np.zeros(shape, np.uint16) if fill is None else fill.copy()
        assert self.cache.shape == shape
        self.mem = self.cache.reshape(-1).view(np.uint8)
        block_len = heads * BLOCK_SIZE * HEAD_WORDS * WORD
        self.regions = [Region(base + layer * BLOCKS * block_len, block_len, block_len, BLOCKS)
                        for layer in range(LAYERS)]

    def view(self, addr: int, n: int) -> np.ndarray:
        off = addr - self.base
        assert off >= 0 and off + n <= self.mem.size, "descriptor outside this rank's memory"
        return self.mem[off:off + n]


def model_kv(heads: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(1, 1 << 16, (LAYERS, BLOCKS, heads, BLOCK_SIZE, HEAD_WORDS),
                        dtype=np.uint16)


def transfer(p: Sharding, d: Sharding, kv: np.ndarray) -> tuple[list[Rank], int]:
    """P's ranks hold their heads of ``kv``; every D rank reads its slices.
    Returns D's ranks and the number of descriptors posted."""
    p_ranks = [Rank((1 + r) << 32, p.heads_per_rank,
                    kv[:, :, list(p.heads_of(r))] if not p.mla else kv)
               for r in range(p.tp_size)]
    d_ranks = [Rank((100 + r) << 32, d.heads_per_rank) for r in range(d.tp_size)]
    posted = 0
    for r, dr in enumerate(d_ranks):
        for sl in slices_for(r, p, d):
            pr = p_ranks[sl.p_rank]
            descs = slice_descriptors(LOCAL_IDS, REMOTE_IDS, dr.regions, pr.regions, sl,
                                      dr.heads, pr.heads)
            posted += len(descs)
            for local, remote, n in descs:
                dr.view(local, n)[:] = pr.view(remote, n)
    return d_ranks, posted


SIZES = [1, 2, 4]
CASES = [(tp, td, h) for tp, td in itertools.product(SIZES, SIZES) for h in (1, 2, 4, 8)]


@pytest.mark.parametrize(("p_tp", "d_tp", "heads"), CASES)
def test_every_d_rank_gets_exactly_its_heads(p_tp: int, d_tp: int, heads: int) -> None:
    p, d = Sharding(p_tp, heads), Sharding(d_tp, heads)
    kv = model_kv(heads, seed=p_tp * 100 + d_tp * 10 + heads)
    d_ranks, _ = transfer(p, d, kv)
    for r, dr in enumerate(d_ranks):
        want = kv[:, REMOTE_IDS][:, :, list(d.heads_of(r))]
        np.testing.assert_array_equal(dr.cache[:, LOCAL_IDS], want)
        untouched = [b for b in range(BLOCKS) if b not in LOCAL_IDS]
        assert not dr.cache[:, untouched].any(), "a block D did not ask for was written"


@pytest.mark.parametrize(("p_tp", "d_tp", "heads"), CASES)
def test_each_d_head_is_read_once_and_reads_spread_over_replicas(p_tp: int, d_tp: int,
                                                                 heads: int) -> None:
    p, d = Sharding(p_tp, heads), Sharding(d_tp, heads)
    for r in range(d_tp):
        sls = slices_for(r, p, d)
        covered = [sl.d_head + i for sl in sls for i in range(sl.num_heads)]
        assert sorted(covered) == list(range(d.heads_per_rank))
        assert p_ranks_read_by(r, p, d) == sorted({sl.p_rank for sl in sls})
    if p_tp > heads:  # P replicates: D's ranks must not all read the first replica
        used = {sl.p_rank for r in range(d_tp) for sl in slices_for(r, p, d)}
        assert len(used) == min(p_tp, max(heads, d_tp)), used


def test_descriptor_counts_stay_coalesced_where_the_slices_allow() -> None:
    """Equal sharding moves whole blocks: one descriptor per run of
    consecutive blocks (the three regions are one slab, so a run merges
    across layers only when it spans the whole region; here: per layer).
    A head slice is one descriptor per block and layer."""
    heads = 4
    runs = 2  # [3, 4, 5] -> [0, 1, 2] and [9] -> [7]
    _, same = transfer(Sharding(2, heads), Sharding(2, heads), model_kv(heads))
    assert same == 2 * LAYERS * runs  # two D ranks
    _, split = transfer(Sharding(1, heads), Sharding(2, heads), model_kv(heads))
    assert split == 2 * LAYERS * len(LOCAL_IDS)
    _, gather = transfer(Sharding(2, heads), Sharding(1, heads), model_kv(heads))
    assert gather == 2 * LAYERS * len(LOCAL_IDS)  # one D rank, a slice from each P rank


def test_mla_reads_whole_blocks_and_spreads_ranks() -> None:
    p, d = Sharding(2, 1, mla=True), Sharding(4, 1, mla=True)
    kv = model_kv(1, seed=9)
    d_ranks, posted = transfer(p, d, kv)
    for dr in d_ranks:
        np.testing.assert_array_equal(dr.cache[:, LOCAL_IDS], kv[:, REMOTE_IDS])
    assert [slices_for(r, p, d)[0].p_rank for r in range(4)] == [0, 1, 0, 1]
    assert posted == 4 * LAYERS * 2


@pytest.mark.parametrize(("p", "d", "match"), [
    (Sharding(2, 6), Sharding(3, 6), "neither divides"),
    (Sharding(2, 8), Sharding(2, 4), "num_kv_heads differs"),
    (Sharding(1, 4, heads_contiguous=False), Sharding(2, 4), "P's KV layout interleaves"),
    (Sharding(2, 4), Sharding(1, 4, heads_contiguous=False), "D's KV layout interleaves"),
    (Sharding(2, 1, mla=True), Sharding(2, 4), "MLA"),
])
def test_what_cannot_be_mapped_is_refused_by_name(p: Sharding, d: Sharding, match: str) -> None:
    with pytest.raises(TPMappingError, match=match):
        plan(p, d)
    with pytest.raises(TPMappingError, match=match):
        slices_for(0, p, d)


def test_equal_sharding_needs_no_contiguous_heads() -> None:
    """NHD caches still pair rank to rank: whole blocks, no slice."""
    p = Sharding(2, 8, heads_contiguous=False)
    d = Sharding(2, 8, heads_contiguous=False)
    plan(p, d)
    assert slices_for(1, p, d) == slices_for(1, Sharding(2, 8), Sharding(2, 8))


def test_shardings_vllm_would_refuse_are_refused() -> None:
    with pytest.raises(TPMappingError, match="neither divides"):
        Sharding(3, 4)
    with pytest.raises(TPMappingError, match="must be positive"):
        Sharding(0, 4)
    with pytest.raises(TPMappingError, match="out of range"):
        Sharding(2, 4).heads_of(2)


def test_mismatched_head_bytes_are_refused() -> None:
    sl = slices_for(0, Sharding(1, 4), Sharding(2, 4))[0]
    d = Rank(1 << 40, 2)
    p_regions = [Region(r.base_addr, r.block_stride * 2, r.block_len * 2, BLOCKS)
                 for r in Rank(1 << 41, 4).regions]  # twice the bytes per head
    with pytest.raises(TPMappingError, match="bytes per head differ"):
        slice_descriptors(LOCAL_IDS, REMOTE_IDS, d.regions, p_regions, sl, 2, 4)
