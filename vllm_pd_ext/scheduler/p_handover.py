"""P's leg at its end, in either transfer mode: hand the prefill's KV over.

Runs on P's scheduler thread, from ``request_finished`` of a ``P_HANDOFF``
or ``PROBE`` leg (``legs.Leg``). A probe gets this engine's identity only; a
prefill that ended well has its blocks lent by the mode's half (``PMode``:
``p_pull.PullProducer``, ``p_push.PushProducer``) and P answers with
vLLM-compatible ``kv_transfer_params`` naming them; anything else hands
nothing over (and, in push mode, tells a D already waiting at once).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import msgspec

from vllm_pd_ext import compat
from vllm_pd_ext.log import get_logger
from vllm_pd_ext.scheduler.legs import Leg
from vllm_pd_ext.stats import PDStats
from vllm_pd_ext.wire import auth
from vllm_pd_ext.wire.protocol import KVTransferParams, answer_params

logger = get_logger(__name__)


class PMode(Protocol):
    """P's half of one transfer mode (``PullProducer``, ``p_push.PushProducer``)."""

    def lease_key(self, request_id: str, params: KVTransferParams) -> str:
        """The id P's lease (and D's heartbeats) go by."""

    def admit(self, key: str) -> None:
        """P's leg arrived (before its prefill is scheduled)."""

    def retire(self, key: str) -> None:
        """P's leg finished, however it ended."""

    def prefill_failed(self, key: str, request_id: str, status: str) -> None:
        """The prefill ended without KV to hand over."""

    def lend(self, key: str, request_id: str, block_ids: list[int], num_tokens: int,
             prompt_digest: str, first_token: int = -1) -> float:
        """Lease the prompt's blocks to D; the lease's monotonic expiry.
        ``KeyError`` if ``key`` is leased already (nothing pinned then).
        ``first_token``: the token P sampled (push sends it with the KV to a
        D that asks; pull's D gets it in its prompt)."""

    def announce(self, key: str, request_id: str, params: KVTransferParams, first_token: int,
                 expiry: float) -> None:
        """The lease ``key`` exists and P's answer ``params`` name it
        (concurrent pull tells a waiting D; push: nothing)."""

    def sweep(self) -> None:
        """Every step, before the lease sweep."""

    def forget_expired(self, keys: list[str]) -> None:
        """Inside the lease sweep: these leases expired unreleased."""


def hand_over(p_mode: PMode, identity: KVTransferParams, request: Any, block_ids: list[int],
              kind: Leg, params: KVTransferParams, stats: PDStats, lease_s: float
              ) -> dict[str, Any] | None:
    """P: lend a finished prefill's blocks to D; P's answer, or None."""
    rid = request.request_id
    ours = params.mode is identity.mode
    key = p_mode.lease_key(rid, params)
    if ours:
        p_mode.retire(key)
    if kind is Leg.PROBE:
        return answer_params(identity)
    if params.pd_first_token and compat.is_stopped(request):
        # The proxy sends this token #1 itself and it ended the answer: no D
        # leg follows, so a lease would only hold the blocks until it expired.
        logger.debug("PDConnector: prefill %s stopped at its first token; no KV handed "
                     "over (the answer is complete)", rid)
        if ours:
            p_mode.prefill_failed(key, rid, "stopped at its first token")
        return None
    if not compat.is_finished_ok(request) or not block_ids:
        logger.info("PDConnector: prefill %s ended with %s; no KV handed over", rid,
                    request.status)
        if ours:
            # A D already waiting for this KV learns it now, not at its deadline.
            p_mode.prefill_failed(key, rid, str(request.status))
        return None
    if not ours:
        logger.error("PDConnector: prefill %s asks for transfer_mode=%r but this engine runs "
                     "%r; blocks freed, no KV handed over", rid, params.mode.value,
                     identity.mode.value)
        return None
    digest = auth.token_digest(request.prompt_token_ids)
    num_tokens = int(request.num_computed_tokens)
    try:
        first_token = compat.first_output_token(request)
        expiry = p_mode.lend(key, rid, list(block_ids), num_tokens, digest, first_token)
    except KeyError:
        logger.error("PDConnector: prefill %s: pd_request_id %s is already in use; "
                     "blocks freed, no KV handed over", rid, key)
        return None
    stats.inc("num_leases_granted")
    logger.info("PDConnector: prefill %s done; lease on %d blocks for %.0f s",
                rid, len(block_ids), lease_s)
    answer = msgspec.structs.replace(
        identity,
        remote_block_ids=[list(block_ids)],
        remote_request_id=key,
        remote_num_tokens=num_tokens,
        remote_blocks_expiry_time=time.time() + (expiry - time.monotonic()),
        remote_prompt_digest=digest,
    )
    p_mode.announce(key, rid, answer, first_token, expiry)
    return answer_params(answer)

