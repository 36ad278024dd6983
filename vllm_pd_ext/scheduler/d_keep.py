"""D keeps a finished turn's KV for the conversation's next turn (multi-turn).

Runs on D's scheduler thread, at ``request_finished`` of a turn whose leg
asks for it (``pd_bidirectional``; a leg that does not say leaves it to the
engine's ``bidirectional_kv_xfer`` on an engine without a shared secret,
``bidir.wants_keep``). Lifecycle of one kept turn:

1. ``keep``: the turn's full blocks (prompt and answer, every token whose KV
   is written) are lent through the ``BlockLender`` under a lease keyed by
   D's request id, first expiring after ``decoder_kv_blocks_ttl`` and then
   renewed by the reading P's heartbeats like any lease. The answer names
   the blocks and their chained hashes (``bidir.block_hashes``, scoped by the
   request's ``cache_salt`` and LoRA adapter, named by ``remote_hash_scope``),
   so the next turn's P can check which prefix matches its prompt.
2. Kept turns are bounded by ``decoder_kv_blocks_budget`` (``KeptTurns``):
   to admit a turn the oldest unread one is evicted; a turn being read is
   never evicted.
3. ``relieve`` (vLLM runs short of blocks: a running request got none, or
   a waiting one's do not fit): the oldest unread turns end until enough of
   their blocks come back, before vLLM preempts or queues work.
4. ``forget`` (each sweep): turns whose blocks the lender freed leave the
   budget; an expired one is a conversation that did not come back (normal,
   counted apart from P's lease expiries).
5. Shutdown (vLLM's SIGTERM reached the EngineCore): turns nobody reads yet
   would hold a drain for their whole TTL, so ``evict_unread`` ends them at
   once (a reader already pinning one is served), and a turn that finishes
   from then on is not kept at all (``keep`` answers None): a decode ending
   during the drain must not hold it to the force-kill.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from vllm_pd_ext import compat
from vllm_pd_ext.config import PDConfig
from vllm_pd_ext.leases.lender import BlockLender
from vllm_pd_ext.log import get_logger
from vllm_pd_ext.scheduler import bidir
from vllm_pd_ext.scheduler.bidir import KeptTurns
from vllm_pd_ext.stats import PDStats
from vllm_pd_ext.wire.protocol import KVTransferParams, answer_params

logger = get_logger(__name__)


class TurnKeeper:
    def __init__(self, cfg: PDConfig, lender: BlockLender, identity: KVTransferParams,
                 block_size: int, stats: PDStats, legs_signed: bool = False,
                 is_shutting_down: Callable[[], bool] = lambda: False) -> None:
        self.cfg = cfg
        #: The EngineCore was told to shut down (``PDScheduler.shutting_down``).
        self.is_shutting_down = is_shutting_down
        self.lender = lender
        #: The engine has a shared secret: every leg is vllm-pd-proxy's.
        self.legs_signed = legs_signed
        #: This engine as a KV source (engine id, host, port, TP size).
        self.identity = identity
        self.block_size = block_size
        self.stats = stats
        #: Sized by ``bind`` once vLLM's block pool is known.
        self.kept = KeptTurns(0)
        self._evicted_unread = False
        if cfg.bidirectional_kv_xfer:
            logger.info("PDConnector: bidirectional KV on: finished turns are kept for %.0f s "
                        "(decoder_kv_blocks_ttl, then renewed by the reader), next turns read "
                        "back >= %d tokens (kv_recompute_threshold)", cfg.decoder_kv_blocks_ttl,
                        cfg.kv_recompute_threshold)

    def bind(self, num_blocks: int) -> None:
        self.kept = KeptTurns(int(num_blocks * self.cfg.decoder_kv_blocks_budget))

    def keep(self, request: Any, block_ids: list[int], params: KVTransferParams,
             sweep: Any) -> dict[str, Any] | None:
        """Keep a finished turn's full blocks; the answer naming them, or None.
        ``sweep`` frees what the budget evicted before more blocks are pinned."""
        if not bidir.wants_keep(self.cfg.bidirectional_kv_xfer, params.pd_bidirectional,
                                self.legs_signed):
            return None
        if not compat.is_finished_ok(request):
            return None
        tokens = compat.kv_ready_token_ids(request)
        num_blocks = min(len(tokens) // self.block_size, len(block_ids))
        if num_blocks == 0:
            return None
        rid = request.request_id
        if self.is_shutting_down():
            self.stats.inc("num_turns_not_kept")
            logger.info("PDConnector: turn %s not kept: the engine is shutting down (a kept "
                        "turn would hold the drain until its TTL)", rid)
            return None
        scope = bidir.hash_scope(*compat.cache_scope(request))
        if not self.kept.admit(num_blocks, self.lender.evict):
            self.stats.inc("num_turns_not_kept")
            logger.info("PDConnector: turn %s not kept: %d blocks do not fit "
                        "decoder_kv_blocks_budget (%d of %d blocks kept, all in use)", rid,
                        num_blocks, self.kept.num_blocks, self.kept.budget_blocks)
            return None
        sweep()
        ids = list(block_ids[:num_blocks])
        try:
            expiry = self.lender.lend(rid, ids, num_consumers=self.identity.tp_size,
                                      duration_s=self.cfg.decoder_kv_blocks_ttl)
        except KeyError:
            return None
        self.kept.add(rid, num_blocks)
        self.stats.inc("num_turns_kept")
        self.stats.inc("kept_blocks", num_blocks)
        logger.info("PDConnector: turn %s kept: %d blocks (%d tokens) for the next turn",
                    rid, num_blocks, num_blocks * self.block_size)
        return answer_params(KVTransferParams(
            do_remote_decode=True,
            do_remote_prefill=False,
            remote_engine_id=self.identity.remote_engine_id,
            remote_host=self.identity.remote_host,
            remote_port=self.identity.remote_port,
            tp_size=self.identity.tp_size,
            remote_block_ids=[ids],
            remote_request_id=rid,
            remote_num_tokens=num_blocks * self.block_size,
            remote_blocks_expiry_time=time.time() + (expiry - time.monotonic()),
            remote_block_hashes=bidir.block_hashes(tokens, self.block_size, num_blocks, scope),
            remote_hash_scope=bidir.scope_tag(scope),
        ))

    def relieve(self, num_blocks: int) -> int:
        """vLLM is ``num_blocks`` blocks short: end the oldest unread kept
        turns until that many of their blocks are on their way back (only a
        block no request shares comes free: ``BlockLender.num_exclusive``).
        The sweep frees them. Returns the blocks given back (0: none could be)."""
        freed: dict[str, int] = {}

        def give_back(key: str) -> int:
            n = self.lender.num_exclusive(key)
            if n == 0 or not self.lender.evict(key):
                return 0
            freed[key] = n
            return n

        for key in self.kept.relieve(num_blocks, give_back):
            logger.info("PDConnector: kept turn %s ended early: vLLM is short of KV blocks "
                        "(%d of its blocks come back)", key, freed[key])
        self.stats.inc("num_turns_evicted", len(freed))
        return sum(freed.values())

    def forget(self, freed: list[str], expired: list[str]) -> set[str]:
        """The lender freed these leases' blocks; returns the expired ones that
        were kept turns (logged here; the caller logs the others)."""
        turns = {key for key in expired if key in self.kept}
        for key in turns:
            logger.info("PDConnector: kept turn %s expired unread; freeing its blocks", key)
        for key in freed:
            self.kept.discard(key)
        self.stats.inc("num_turns_expired", len(turns))
        return turns

    def evict_unread(self) -> None:
        """Shutting down: end the kept turns no reader has pinned (once)."""
        if self._evicted_unread:
            return
        self._evicted_unread = True
        for key in self.kept.oldest_first():
            if self.lender.evict(key):
                self.kept.discard(key)
