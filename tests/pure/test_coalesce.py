"""Descriptor coalescing: exact byte coverage and descriptor counts."""

from __future__ import annotations

import random

import pytest

from vllm_pd_ext.transport.coalesce import block_runs, build_descriptors, merge_adjacent
from vllm_pd_ext.wire.protocol import Region

BLEN = 64


def contiguous_slab(base: int, num_layers: int, num_blocks: int, blen: int = BLEN) -> list[Region]:
    """Layers laid out one after the other in one allocation (CPU layout)."""
    return [Region(base + i * num_blocks * blen, blen, blen, num_blocks) for i in range(num_layers)]


def separate_regions(base: int, num_layers: int, num_blocks: int, gap: int = 4096,
                     blen: int = BLEN) -> list[Region]:
    return [Region(base + i * (num_blocks * blen + gap), blen, blen, num_blocks)
            for i in range(num_layers)]


def strided(base: int, num_layers: int, num_blocks: int, stride: int = 3 * BLEN,
            blen: int = BLEN) -> list[Region]:
    return [Region(base + i * (num_blocks * stride + 8192), stride, blen, num_blocks)
            for i in range(num_layers)]


def interleaved(base: int, num_layers: int, num_blocks: int, blen: int = BLEN) -> list[Region]:
    """Cross-layer BLHNC: block i holds every layer's page, layer after layer."""
    return [Region(base + i * blen, num_layers * blen, blen, num_blocks)
            for i in range(num_layers)]


def per_block(local_ids, remote_ids, lregs, rregs):
    out = []
    for lr, rr in zip(lregs, rregs, strict=True):
        for lo, re in zip(local_ids, remote_ids, strict=True):
            out.append((lr.base_addr + lo * lr.block_stride, rr.base_addr + re * rr.block_stride,
                        lr.block_len))
    return out


def byte_pairs(descs):
    """Every (local_byte, remote_byte) pair a descriptor list moves, at 8-byte grain."""
    pairs = set()
    for loc, rem, n in descs:
        assert n > 0 and n % 8 == 0
        for off in range(0, n, 8):
            pairs.add((loc + off, rem + off))
    return pairs


# ------------------------------------------------------------------ block_runs
def test_block_runs_basic():
    assert block_runs([], []) == []
    assert block_runs([5], [9]) == [(5, 9, 1)]
    assert block_runs([1, 2, 3, 7, 8], [10, 11, 12, 20, 21]) == [(1, 10, 3), (7, 20, 2)]


def test_block_runs_breaks_when_either_side_jumps():
    # local consecutive, remote not
    assert block_runs([1, 2, 3], [5, 6, 8]) == [(1, 5, 2), (3, 8, 1)]
    # remote consecutive, local not
    assert block_runs([1, 3, 4], [5, 6, 7]) == [(1, 5, 1), (3, 6, 2)]
    # descending ids never merge
    assert block_runs([3, 2, 1], [3, 2, 1]) == [(3, 3, 1), (2, 2, 1), (1, 1, 1)]


def test_block_runs_length_mismatch():
    with pytest.raises(ValueError, match="differ in length"):
        block_runs([1, 2], [1])


# ------------------------------------------------------------ build_descriptors
def test_contiguous_separate_regions_one_desc_per_run_per_region():
    lregs = separate_regions(0x10000, 3, 16)
    rregs = separate_regions(0x900000, 3, 16)
    local, remote = [2, 3, 4, 9, 10], [0, 1, 2, 5, 6]
    descs = build_descriptors(local, remote, lregs, rregs)
    assert len(descs) == 2 * 3
    expected = []
    for lr, rr in zip(lregs, rregs, strict=True):
        expected.append((lr.base_addr + 2 * BLEN, rr.base_addr + 0, 3 * BLEN))
        expected.append((lr.base_addr + 9 * BLEN, rr.base_addr + 5 * BLEN, 2 * BLEN))
    assert descs == expected


def test_contiguous_slab_whole_region_run_merges_across_layers():
    nb, layers = 8, 4
    lregs = contiguous_slab(0x10000, layers, nb)
    rregs = contiguous_slab(0x800000, layers, nb)
    ids = list(range(nb))
    descs = build_descriptors(ids, ids, lregs, rregs)
    assert descs == [(0x10000, 0x800000, layers * nb * BLEN)]


def test_contiguous_slab_partial_run_does_not_merge_across_layers():
    nb, layers = 8, 2
    lregs = contiguous_slab(0x10000, layers, nb)
    rregs = contiguous_slab(0x800000, layers, nb)
    descs = build_descriptors([0, 1, 2], [0, 1, 2], lregs, rregs)
    assert len(descs) == layers
    assert byte_pairs(descs) == byte_pairs(per_block([0, 1, 2], [0, 1, 2], lregs, rregs))


def test_non_contiguous_stride_gives_per_block_descriptors():
    lregs = strided(0x10000, 2, 10)
    rregs = strided(0x900000, 2, 10)
    local, remote = [1, 2, 3], [4, 5, 6]
    descs = build_descriptors(local, remote, lregs, rregs)
    assert descs == per_block(local, remote, lregs, rregs)
    assert all(n == BLEN for _, _, n in descs)


@pytest.mark.parametrize("dense_side", ["local", "remote"])
def test_a_strided_side_never_coalesces_consecutive_blocks(dense_side):
    """Coalescing a run of blocks into one descriptor needs block_stride ==
    block_len on both sides; one strided side (padded pages, cross-layer
    BLHNC) keeps one descriptor per block."""
    dense, sparse = separate_regions(0x10000, 1, 10), strided(0x900000, 1, 10)
    lregs, rregs = (dense, sparse) if dense_side == "local" else (sparse, dense)
    local, remote = [1, 2, 3, 4], [5, 6, 7, 8]
    descs = build_descriptors(local, remote, lregs, rregs)
    assert descs == per_block(local, remote, lregs, rregs)
    assert all(n == BLEN for _, _, n in descs)


def test_interleaved_layers_merge_only_across_layers_of_one_block():
    # Cross-layer BLHNC: a block's layers abut (one descriptor), blocks do not.
    lregs, rregs = interleaved(0x10000, 3, 10), interleaved(0x900000, 3, 10)
    assert build_descriptors([4], [7], lregs, rregs) == [
        (0x10000 + 4 * 3 * BLEN, 0x900000 + 7 * 3 * BLEN, 3 * BLEN)]
    descs = build_descriptors([4, 5], [7, 8], lregs, rregs)
    assert byte_pairs(descs) == byte_pairs(per_block([4, 5], [7, 8], lregs, rregs))
    assert all(n == BLEN for _, _, n in descs)


def test_block_len_mismatch_raises():
    lregs = [Region(0, 64, 64, 4)]
    rregs = [Region(0x1000, 128, 128, 4)]
    with pytest.raises(ValueError, match="block length differs"):
        build_descriptors([0], [0], lregs, rregs)


def test_region_count_mismatch_raises():
    with pytest.raises(ValueError, match="region count differs"):
        build_descriptors([0], [0], separate_regions(0, 2, 4), separate_regions(0x10000, 3, 4))


def test_id_length_mismatch_raises():
    with pytest.raises(ValueError, match="differ in length"):
        build_descriptors([0, 1], [0], separate_regions(0, 1, 4), separate_regions(0x10000, 1, 4))


@pytest.mark.parametrize(
    ("local", "remote"),
    [([4], [0]), ([0], [4]), ([3, 4], [0, 1]), ([-1], [0]), ([0], [-1])],
)
def test_out_of_range_raises(local, remote):
    lregs = separate_regions(0x10000, 2, 4)
    rregs = separate_regions(0x900000, 2, 4)
    with pytest.raises(ValueError, match="out of range"):
        build_descriptors(local, remote, lregs, rregs)


def test_out_of_range_strided_raises():
    with pytest.raises(ValueError, match="out of range"):
        build_descriptors([0, 5], [0, 1], strided(0, 1, 5), strided(0x100000, 1, 6))


def test_merge_adjacent():
    assert merge_adjacent([]) == []
    assert merge_adjacent([(0, 100, 8), (8, 108, 8), (16, 200, 8)]) == [(0, 100, 16), (16, 200, 8)]
    # adjacent locally but not remotely
    assert merge_adjacent([(0, 100, 8), (8, 120, 8)]) == [(0, 100, 8), (8, 120, 8)]


# ------------------------------------------------------------------ property
LAYOUTS = {
    "slab": contiguous_slab,
    "separate": separate_regions,
    "strided": strided,
    "interleaved": interleaved,
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_random_ids_cover_same_bytes_as_per_block(layout):
    rng = random.Random(1234 + len(layout))
    make = LAYOUTS[layout]
    for _ in range(150):
        nb_local = rng.randint(1, 24)
        nb_remote = rng.randint(1, 24)
        layers = rng.randint(1, 4)
        n = rng.randint(1, min(nb_local, nb_remote))
        mode = rng.random()
        if mode < 0.3:  # consecutive runs on both sides
            ls, rs = rng.randint(0, nb_local - n), rng.randint(0, nb_remote - n)
            local, remote = list(range(ls, ls + n)), list(range(rs, rs + n))
        elif mode < 0.6:  # sorted random (several runs)
            local = sorted(rng.sample(range(nb_local), n))
            remote = sorted(rng.sample(range(nb_remote), n))
        else:  # arbitrary order
            local = rng.sample(range(nb_local), n)
            remote = rng.sample(range(nb_remote), n)
        lregs = make(0x100000, layers, nb_local)
        rregs = make(0x4000000, layers, nb_remote)
        descs = build_descriptors(local, remote, lregs, rregs)
        ref = per_block(local, remote, lregs, rregs)
        assert byte_pairs(descs) == byte_pairs(ref)
        assert sum(d[2] for d in descs) == sum(d[2] for d in ref)  # no byte twice
        assert len(descs) <= len(ref)
        if layout == "strided":
            assert len(descs) == len(ref)
