"""P's scheduler half for bidirectional KV: read a previous turn back from D.

Runs on P's scheduler thread (EngineCore process). A P leg whose
``kv_transfer_params`` name the blocks D kept at the end of the previous
turn (``KVTransferParams.is_readback``) goes through:

1. ``arrive`` (``on_new_request``): verify the prefix by hash
   (``bidir.matched_blocks`` over P's own prompt tokens, scoped by its
   ``cache_salt`` and LoRA adapter); on no match, a disabled engine, params
   without hashes or an expired lease, fall back at once (D's lease is
   released) - P then prefills the whole prompt. A turn of another scope
   (another tenant's, ``remote_hash_scope``) is neither read nor released:
   it is not this request's to end. Otherwise heartbeat D's lease from now,
   as D does for P's.
2. ``plan`` (``get_num_new_matched_tokens``): subtract P's own prefix-cache
   hit; below ``kv_recompute_threshold`` tokens, fall back. Else vLLM is
   told to load that many tokens asynchronously.
3. ``allocate`` (``update_state_after_alloc``): a ``RecvSpec`` pairing D's
   blocks with P's new ones; the worker's ``PullReader`` handshakes, pins
   D's lease, READs and releases it (the same path D uses to read P).
4. ``loaded`` (``update_connector_output``), ``finish``
   (``request_finished``): heartbeats stop; a load that failed is counted
   (vLLM's ``kv_load_failure_policy`` applies: ``recompute`` prefills on P,
   ``fail`` fails the P leg and the proxy retries it without read-back).

Every fallback is counted by reason (``bidir.Fallback``); the P leg itself
then continues as an ordinary prefill and hands its KV to D as usual.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from vllm_pd_ext.log import get_logger
from vllm_pd_ext.scheduler import bidir
from vllm_pd_ext.scheduler.bidir import Fallback, ReadBackPlan
from vllm_pd_ext.scheduler.heartbeats import HeartbeatSender
from vllm_pd_ext.scheduler.load_state import Load, LoadState
from vllm_pd_ext.wire.protocol import KVTransferParams
from vllm_pd_ext.wire.specs import RecvSpec

logger = get_logger(__name__)


@dataclass
class ReadBack(Load):
    """One P request that may read a previous turn back from D."""

    params: KVTransferParams
    remote_blocks: list[int]
    matched_blocks: int
    plan: ReadBackPlan | None = None


class ReadBackConsumer:
    def __init__(self, *, enabled: bool, block_size: int, tp_size: int, threshold: int,
                 heartbeats: HeartbeatSender, count: Callable[[Fallback], None],
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.enabled = enabled
        self.block_size = block_size
        self.tp_size = tp_size
        self.threshold = threshold
        self.heartbeats = heartbeats
        self._count = count
        self._wall = wall_clock
        self._reqs: dict[str, ReadBack] = {}
        #: Tokens and loads read back, for the stats (taken by the scheduler).
        self.num_tokens = 0
        self.num_loads = 0

    def __contains__(self, rid: object) -> bool:
        return rid in self._reqs

    def __len__(self) -> int:
        return len(self._reqs)

    # ---------------------------------------------------------------- steps
    def arrive(self, rid: str, params: KVTransferParams, prompt_token_ids: list[int],
               scope: bytes | None = None) -> None:
        """A P leg naming D's kept turn; ``scope``: this request's
        (``bidir.hash_scope`` of its cache_salt and LoRA adapter)."""
        why = self._refusal(params, scope)
        remote: list[int] = []
        matched = 0
        if why is None:
            remote = params.flat_remote_block_ids()
            hashes = list(params.remote_block_hashes or ())[:len(remote)]
            matched = bidir.matched_blocks(prompt_token_ids, self.block_size, hashes, scope)
            if matched == 0:
                why = Fallback.MISMATCH
        if why is not None:
            self._fall_back(rid, params, why)
            return
        self._reqs[rid] = ReadBack(params, remote, matched)
        assert params.remote_host is not None and params.remote_port is not None
        self.heartbeats.track(rid, (params.remote_host, params.remote_port),
                              str(params.remote_request_id))
        logger.info("PDConnector: request %s: %d of %d blocks kept by engine %s match this "
                    "prompt", rid, matched, len(remote), params.remote_engine_id)

    def _refusal(self, params: KVTransferParams, scope: bytes | None) -> Fallback | None:
        # First: every other fallback releases D's lease, and another
        # tenant's turn is not this request's to end.
        if params.remote_hash_scope != bidir.scope_tag(scope):
            return Fallback.FOREIGN
        if not self.enabled:
            return Fallback.DISABLED
        if not params.remote_block_hashes:
            return Fallback.UNVERIFIABLE
        if params.tp_size != self.tp_size:
            return Fallback.LAYOUT
        expiry = params.remote_blocks_expiry_time
        if expiry is not None and self._wall() > expiry - bidir.EXPIRY_MARGIN_S:
            return Fallback.EXPIRED
        return None

    def plan(self, rid: str, num_prompt_tokens: int, num_computed_tokens: int
             ) -> tuple[int, bool] | None:
        """vLLM's ``get_num_new_matched_tokens`` answer; None: not ours."""
        rb = self._reqs.get(rid)
        if rb is None or rb.state is not LoadState.WAITING:
            return None
        plan = bidir.plan_readback(
            num_prompt_tokens=num_prompt_tokens, num_local_tokens=num_computed_tokens,
            block_size=self.block_size, num_matched_blocks=rb.matched_blocks,
            num_offered_blocks=len(rb.remote_blocks), threshold=self.threshold)
        if isinstance(plan, Fallback):
            del self._reqs[rid]
            self._fall_back(rid, rb.params, plan)
            return 0, False
        rb.plan = plan
        return plan.num_tokens, True

    def allocate(self, rid: str, local_blocks: list[int], num_external_tokens: int
                 ) -> RecvSpec | str | None:
        """The load for P's new blocks; a string: why it cannot be (fail it);
        None: not ours, or nothing to load."""
        rb = self._reqs.get(rid)
        if rb is None or rb.state is not LoadState.WAITING or rb.plan is None:
            return None
        plan = rb.plan
        params = rb.params
        if num_external_tokens == 0:
            del self._reqs[rid]
            self._release(rid, params, "not needed after all")
            return None
        if num_external_tokens != plan.num_tokens or len(local_blocks) < plan.num_blocks:
            del self._reqs[rid]
            self._fall_back(rid, params, Fallback.LAYOUT)
            return (f"read-back layout mismatch: planned {plan.num_tokens} tokens in "
                    f"{plan.num_blocks} blocks, vLLM allocated {len(local_blocks)} for "
                    f"{num_external_tokens}")
        rb.allocate(loading=True)
        assert params.remote_host is not None and params.remote_port is not None
        return RecvSpec(
            request_id=rid,
            local_block_ids=local_blocks[:plan.num_blocks],
            remote_block_ids=rb.remote_blocks[plan.first_block:plan.first_block
                                              + plan.num_blocks],
            remote_engine_id=str(params.remote_engine_id),
            remote_request_id=str(params.remote_request_id),
            remote_host=params.remote_host,
            remote_port=params.remote_port,
            remote_tp_size=self.tp_size,
            num_tokens=plan.num_tokens,
            readback=True,
        )

    def loaded(self, rid: str, failed: bool) -> bool:
        """The workers reported this request's load; True if it was ours."""
        rb = self._reqs.get(rid)
        if rb is None or not rb.in_flight:
            return False
        ended = rb.reported()
        self.heartbeats.untrack(rid)
        if failed:
            self._count(Fallback.FAILED)
        elif rb.plan is not None:
            self.num_tokens += rb.plan.num_tokens
            self.num_loads += 1
        if ended or failed:
            del self._reqs[rid]
        return True

    def finish(self, rid: str) -> None:
        """vLLM finished the request (``request_finished``)."""
        rb = self._reqs.get(rid)
        if rb is None or not rb.end():
            return  # (a load in flight: the workers still report it)
        del self._reqs[rid]
        if rb.state is LoadState.WAITING:
            self._release(rid, rb.params, "request ended on P before its read-back")
        else:
            self.heartbeats.untrack(rid)

    # ------------------------------------------------------------- helpers
    def _fall_back(self, rid: str, params: KVTransferParams, why: Fallback) -> None:
        self._count(why)
        if why is Fallback.FOREIGN:
            logger.warning("PDConnector: request %s: the turn engine %s kept is of another "
                           "cache_salt or LoRA adapter; P neither reads nor releases it, and "
                           "prefills the prompt", rid, params.remote_engine_id)
            return
        level = logger.info if why in (Fallback.CACHED, Fallback.SHORT) else logger.warning
        level("PDConnector: request %s: no read-back from engine %s (%s); P prefills it",
              rid, params.remote_engine_id, why.value)
        self._release(rid, params, why.value)

    def _release(self, rid: str, params: KVTransferParams, why: str) -> None:
        """Let D free the kept turn now rather than at its expiry."""
        self.heartbeats.untrack(rid)
        if params.remote_host and params.remote_port:
            self.heartbeats.release((params.remote_host, params.remote_port),
                                    str(params.remote_request_id), self.tp_size, why)
