"""Descriptor coalescing: turn block-id lists into few (addr, len) transfers.

Pure and unit-tested. A transfer moves ``local_ids[i] <-> remote_ids[i]`` for
every layer region. Runs where both sides' ids are consecutive become one
descriptor per region (each region's blocks are equally strided); then
descriptors adjacent in memory on both sides (e.g. consecutive regions of one
contiguous allocation) are merged again.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_pd_ext.wire.protocol import Region

#: (local_start_block, remote_start_block, num_blocks)
Run = tuple[int, int, int]
#: (local_addr, remote_addr, nbytes)
Descriptor = tuple[int, int, int]


def block_runs(local_ids: Sequence[int], remote_ids: Sequence[int]) -> list[Run]:
    """Maximal runs where local and remote ids both increase by one."""
    if len(local_ids) != len(remote_ids):
        raise ValueError(f"block id lists differ in length: {len(local_ids)} != {len(remote_ids)}")
    runs: list[Run] = []
    for loc, rem in zip(local_ids, remote_ids, strict=True):
        if runs:
            ls, rs, n = runs[-1]
            if loc == ls + n and rem == rs + n:
                runs[-1] = (ls, rs, n + 1)
                continue
        runs.append((loc, rem, 1))
    return runs


def _region_descriptors(run: Run, local: Region, remote: Region) -> list[Descriptor]:
    ls, rs, n = run
    if local.block_len != remote.block_len:
        raise ValueError(f"block length differs: {local.block_len} != {remote.block_len}")
    for start, region in ((ls, local), (rs, remote)):
        if start < 0 or start + n > region.num_blocks:
            raise ValueError(f"blocks {start}..{start + n - 1} out of range {region.num_blocks}")
    contiguous = local.block_stride == local.block_len and remote.block_stride == remote.block_len
    if contiguous:
        return [
            (
                local.base_addr + ls * local.block_stride,
                remote.base_addr + rs * remote.block_stride,
                n * local.block_len,
            )
        ]
    return [
        (
            local.base_addr + (ls + i) * local.block_stride,
            remote.base_addr + (rs + i) * remote.block_stride,
            local.block_len,
        )
        for i in range(n)
    ]


def merge_adjacent(descs: Sequence[Descriptor]) -> list[Descriptor]:
    """Merge neighbours that continue each other on both sides."""
    out: list[Descriptor] = []
    for loc, rem, size in descs:
        if out:
            pl, pr, ps = out[-1]
            if pl + ps == loc and pr + ps == rem:
                out[-1] = (pl, pr, ps + size)
                continue
        out.append((loc, rem, size))
    return out


def build_descriptors(
    local_ids: Sequence[int],
    remote_ids: Sequence[int],
    local_regions: Sequence[Region],
    remote_regions: Sequence[Region],
) -> list[Descriptor]:
    """All descriptors for moving ``remote_ids`` into ``local_ids``, coalesced."""
    if len(local_regions) != len(remote_regions):
        raise ValueError(
            f"region count differs: {len(local_regions)} != {len(remote_regions)}"
        )
    runs = block_runs(local_ids, remote_ids)
    descs: list[Descriptor] = []
    # Region-major order so that a run spanning a whole region can merge with
    # the same run of the next region when the allocation is one slab.
    for local, remote in zip(local_regions, remote_regions, strict=True):
        for run in runs:
            descs.extend(_region_descriptors(run, local, remote))
    return merge_adjacent(descs)
