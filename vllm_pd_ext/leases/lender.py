"""The one owner of lent KV blocks: pins them in vLLM's block pool under a
lease and frees each lent set exactly once.

Who lends through it, all on the EngineCore's scheduler thread:

- P, at the end of a ``do_remote_decode`` prefill, lends the prompt's blocks
  to the D that reads them (pull, ``scheduler.p_pull``) or that P writes
  them into (push, ``scheduler.p_push``);
- D, at the end of a multi-turn turn, lends the turn's blocks to the next
  turn's P (``scheduler.d_keep``).

Lifecycle of one lent set (key: the lease id the borrower knows):

1. ``lend``: the lease is granted in the ``LeaseService`` first (a key in use
   raises ``KeyError`` before any block is touched), then each block gets one
   extra reference (``BlockPool.touch``), so vLLM can drop its own at once
   and the request leaves the scheduler (an idle P does not step).
2. Borrowers renew, pin and release the lease through the ``LeaseService``
   on the side-channel thread; nothing here runs there.
3. ``sweep`` (every step and every arriving request): for each released or
   expired lease, our reference is dropped (``free_blocks``, tail first, as
   vLLM frees a request's blocks, so the prefix stays cached longest).

``num_exclusive`` and ``num_free_blocks`` let D's kept turns give blocks
back when vLLM runs short (``scheduler.d_keep.TurnKeeper.relieve``).

Why not vLLM's delayed free (``request_finished -> (True, ...)``): vLLM keeps
stepping an engine that holds such requests and its worker busy-polls for a
second after each step; an idle P holding one lease burned 119% of a core
(docs/architecture.md). Pure: the block pool is duck-typed (``BlockPool``
below; ``compat.check_block_pool`` verifies vLLM's at bind time).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from vllm_pd_ext.leases.service import LeaseService
from vllm_pd_ext.leases.table import SweepResult


class BlockPool(Protocol):
    """What the lender uses of vLLM's ``BlockPool``."""

    blocks: Sequence[Any]

    def touch(self, blocks: Sequence[Any]) -> None: ...

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None: ...

    def get_num_free_blocks(self) -> int: ...


class BlockLender:
    """Lent block sets by lease key, over one ``LeaseService``."""

    def __init__(self, leases: LeaseService) -> None:
        self.leases = leases
        self._pool: BlockPool | None = None
        self._lent: dict[str, list[Any]] = {}

    def bind(self, pool: BlockPool) -> None:
        """vLLM's block pool (``bind_gpu_block_pool``, at the scheduler's start)."""
        self._pool = pool

    def lend(self, key: str, block_ids: Sequence[int], *, num_consumers: int,
             duration_s: float | None = None) -> float:
        """Pin ``block_ids`` under a new lease ``key``; its monotonic expiry.

        ``KeyError`` if ``key`` is leased already (nothing is pinned then);
        ``duration_s``: a first expiry other than the lease duration.
        """
        if self._pool is None:
            raise RuntimeError("PDConnector: vLLM did not bind its block pool "
                               "(bind_gpu_block_pool); this vLLM version is not supported")
        expiry = self.leases.grant(key, num_consumers=num_consumers, duration_s=duration_s)
        blocks = [self._pool.blocks[i] for i in block_ids]
        self._pool.touch(blocks)
        self._lent[key] = blocks
        return expiry

    def sweep(self, on_expired: Callable[[list[str]], None] | None = None) -> SweepResult:
        """Free the blocks of every lease released or expired since the last
        sweep, exactly once. ``on_expired`` runs inside the lease sweep's
        critical section (``LeaseService.sweep``). O(what changed)."""
        result = self.leases.sweep(on_expired=on_expired)
        for key in (*result.released, *result.expired):
            blocks = self._lent.pop(key)
            assert self._pool is not None  # nothing is lent before bind
            self._pool.free_blocks(reversed(blocks))
        return result

    def evict(self, key: str) -> bool:
        """End a lease no borrower has touched yet; its blocks go at the next
        sweep. False if it is in use (or gone)."""
        return self.leases.evict(key)

    def num_exclusive(self, key: str) -> int:
        """How many of the blocks lent under ``key`` only this lease holds
        (vLLM's ``ref_cnt`` is 1: no request uses them): what ending it gives
        back to the free pool. 0 for an unknown key."""
        return sum(1 for block in self._lent.get(key, ()) if block.ref_cnt == 1)

    def num_free_blocks(self) -> int:
        """vLLM's free blocks (cached ones included: vLLM evicts those itself)."""
        assert self._pool is not None  # nothing asks before bind
        return self._pool.get_num_free_blocks()

    def has_pending_frees(self) -> bool:
        """A released lease waits for the next sweep (O(1))."""
        return self.leases.has_released()

    def block_ids(self, key: str) -> list[int]:
        """The ids of the blocks lent under ``key`` (KeyError if none)."""
        return [block.block_id for block in self._lent[key]]

    def __contains__(self, key: object) -> bool:
        return key in self._lent

    def __len__(self) -> int:
        return len(self._lent)
