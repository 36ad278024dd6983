"""Tensor-parallel mapping: which P rank, which head slice, at which offset.

Pure and unit-tested (tests/pure/test_tp_slices.py, against numpy caches
shaped like the real ones). With tensor parallelism each rank holds a
contiguous range of the model's KV heads; P and D may shard differently.
For one D rank, ``slices_for`` says what to read from which P rank, and
``slice_descriptors`` turns that into coalesced (local, remote, nbytes)
descriptors over the ranks' registered regions.

Head placement is vLLM's: with ``tp <= num_kv_heads`` rank ``r`` holds heads
``[r * H / tp, (r + 1) * H / tp)``; with ``tp > num_kv_heads`` each rank
holds one head, head ``r * H // tp`` (replicated ``tp / H`` times). Either
size must divide the other, as vLLM itself requires.

A block of a rank's region is its heads one after the other, each head's
bytes contiguous (vLLM's CPU cache ``[blocks, heads, block_size, 2 x
head_dim]``; a GPU cache in HND order). A head slice is then one plain
range per block. A layout whose heads interleave within a block (NHD:
``[blocks, block_size, heads, head_dim]``) cannot be sliced: ``plan``
refuses it by name, as it refuses sizes that do not divide and any split
of an MLA cache (a latent cache has no heads: every D rank reads the whole
block from one P rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllm_pd_ext.transport.coalesce import Descriptor, block_runs, merge_adjacent
from vllm_pd_ext.wire.protocol import CompatInfo, Region

#: KV layouts (``KVCacheLayout`` names and their legacy aliases) whose blocks
#: put one token's heads next to each other: a head is not one range.
INTERLEAVED_LAYOUTS = frozenset({"LBNHC", "BLNHC", "NHD"})


class TPMappingError(ValueError):
    """This pair of shardings cannot be mapped; the message names why."""


@dataclass(frozen=True)
class Sharding:
    """One side's tensor parallelism and KV cache shape."""

    tp_size: int
    #: The model's KV heads in total (``num_key_value_heads``), not per rank.
    num_kv_heads: int
    #: MLA: one latent vector per token, no heads to split.
    mla: bool = False
    #: Each head's bytes contiguous within a block (CPU; HND on GPU).
    heads_contiguous: bool = True

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.num_kv_heads < 1:
            raise TPMappingError(f"tp_size {self.tp_size} and num_kv_heads "
                                 f"{self.num_kv_heads} must be positive")
        if not self.mla and not _divides(self.tp_size, self.num_kv_heads):
            raise TPMappingError(f"tp_size {self.tp_size} and num_kv_heads "
                                 f"{self.num_kv_heads}: neither divides the other")

    @property
    def heads_per_rank(self) -> int:
        return 1 if self.mla else max(1, self.num_kv_heads // self.tp_size)

    def heads_of(self, rank: int) -> range:
        """The global KV heads rank ``rank`` holds (its first is at offset 0)."""
        if not 0 <= rank < self.tp_size:
            raise TPMappingError(f"rank {rank} out of range for tp_size {self.tp_size}")
        if self.mla:
            return range(0, 1)
        if self.tp_size <= self.num_kv_heads:
            n = self.num_kv_heads // self.tp_size
            return range(rank * n, (rank + 1) * n)
        head = rank * self.num_kv_heads // self.tp_size
        return range(head, head + 1)


def sharding_of(c: CompatInfo) -> Sharding:
    """One engine's ``Sharding``, from the compat info it sends."""
    total = c.total_kv_heads or c.num_kv_heads * c.tp_size
    return Sharding(tp_size=c.tp_size, num_kv_heads=total, mla=c.mla,
                    heads_contiguous=c.kv_layout not in INTERLEAVED_LAYOUTS)


def same_slices(p: Sharding, d: Sharding) -> bool:
    """Every D rank reads its own rank's whole blocks (plain transfers)."""
    return p.tp_size == d.tp_size or p.mla


@dataclass(frozen=True)
class Slice:
    """Read ``num_heads`` heads from P rank ``p_rank`` (starting at head
    ``p_head`` of that rank's block) into D's block at head ``d_head``."""

    p_rank: int
    p_head: int
    d_head: int
    num_heads: int


def _divides(a: int, b: int) -> bool:
    return a % b == 0 or b % a == 0


def plan(p: Sharding, d: Sharding) -> None:
    """Refuse, by name, a pair that cannot be mapped; None if it can."""
    if p.mla != d.mla:
        raise TPMappingError(f"one side has an MLA cache and the other not (P mla={p.mla}, "
                             f"D mla={d.mla})")
    if p.mla:
        return
    if p.num_kv_heads != d.num_kv_heads:
        raise TPMappingError(f"num_kv_heads differs: P {p.num_kv_heads}, D {d.num_kv_heads}")
    if not _divides(p.tp_size, d.tp_size):
        raise TPMappingError(f"tp_size P {p.tp_size} and D {d.tp_size}: neither divides the "
                             "other")
    if p.tp_size != d.tp_size:
        for side, s in (("P", p), ("D", d)):
            if not s.heads_contiguous and s.heads_per_rank > 1:
                raise TPMappingError(f"{side}'s KV layout interleaves heads within a block "
                                     "(NHD): a head slice is not one range per block")


def slices_for(d_rank: int, p: Sharding, d: Sharding) -> list[Slice]:
    """What D rank ``d_rank`` reads, from which P ranks, in D's head order.

    Each of D's heads is read exactly once; a head P replicates over
    several ranks is read from the replica ``d_rank`` maps to, so that D's
    ranks spread their reads over P's ranks.
    """
    plan(p, d)
    if p.mla:
        return [Slice(d_rank % p.tp_size, 0, 0, 1)]
    out: list[Slice] = []
    wanted = d.heads_of(d_rank)
    for head in wanted:
        holders = [r for r in range(p.tp_size) if head in p.heads_of(r)]
        p_rank = holders[d_rank % len(holders)]
        p_head = head - p.heads_of(p_rank).start
        d_head = head - wanted.start
        last = out[-1] if out else None
        if (last is not None and last.p_rank == p_rank
                and last.p_head + last.num_heads == p_head
                and last.d_head + last.num_heads == d_head):
            out[-1] = Slice(p_rank, last.p_head, last.d_head, last.num_heads + 1)
        else:
            out.append(Slice(p_rank, p_head, d_head, 1))
    return out


def p_ranks_read_by(d_rank: int, p: Sharding, d: Sharding) -> list[int]:
    """The P ranks D rank ``d_rank`` reads from (each holds its blocks
    until that rank released them: a lease's consumers)."""
    return sorted({s.p_rank for s in slices_for(d_rank, p, d)})


def slice_descriptors(
    local_ids: Sequence[int],
    remote_ids: Sequence[int],
    local_regions: Sequence[Region],
    remote_regions: Sequence[Region],
    sl: Slice,
    local_heads: int,
    remote_heads: int,
) -> list[Descriptor]:
    """Descriptors moving slice ``sl`` of ``remote_ids`` (one P rank's
    regions) into ``local_ids`` (this D rank's regions), coalesced.

    ``local_heads``/``remote_heads``: heads per block on each side; each
    head is ``block_len / heads`` bytes and must be as long on both sides.
    A slice covering whole blocks on both sides coalesces like a plain
    transfer (runs of consecutive blocks become one range); a partial
    slice is one range per block and layer.
    """
    if len(local_regions) != len(remote_regions):
        raise TPMappingError(f"region count differs: {len(local_regions)} != "
                             f"{len(remote_regions)}")
    runs = block_runs(local_ids, remote_ids)
    descs: list[Descriptor] = []
    for local, remote in zip(local_regions, remote_regions, strict=True):
        if local.block_len % local_heads or remote.block_len % remote_heads:
            raise TPMappingError(f"block length {local.block_len}/{remote.block_len} is not "
                                 f"a multiple of {local_heads}/{remote_heads} heads")
        head_len = local.block_len // local_heads
        if remote.block_len // remote_heads != head_len:
            raise TPMappingError(f"bytes per head differ: D {head_len}, P "
                                 f"{remote.block_len // remote_heads} (block size, head size "
                                 "or dtype differ)")
        if sl.d_head + sl.num_heads > local_heads or sl.p_head + sl.num_heads > remote_heads:
            raise TPMappingError(f"slice {sl} exceeds the blocks' heads "
                                 f"({local_heads} D, {remote_heads} P)")
        size = sl.num_heads * head_len
        whole = size == local.block_len == remote.block_len
        for ls, rs, n in runs:
            for start, region in ((ls, local), (rs, remote)):
                if start < 0 or start + n > region.num_blocks:
                    raise TPMappingError(f"blocks {start}..{start + n - 1} out of range "
                                         f"{region.num_blocks}")
            if whole and local.block_stride == local.block_len == remote.block_stride:
                descs.append((local.base_addr + ls * local.block_stride,
                              remote.base_addr + rs * remote.block_stride, n * size))
                continue
            descs.extend(
                (local.base_addr + (ls + i) * local.block_stride + sl.d_head * head_len,
                 remote.base_addr + (rs + i) * remote.block_stride + sl.p_head * head_len,
                 size)
                for i in range(n))
    return merge_adjacent(descs)
