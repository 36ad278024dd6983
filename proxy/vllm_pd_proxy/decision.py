"""Conditional disaggregation: prefill a request on D itself, or on a P.

Pure (no I/O, no clock, no pools): :func:`decide` maps what the proxy knows
about one request (its estimated prompt tokens, how many of them the chosen
decode engine probably caches, whether a conversation turn waits to be read
back, how busy the prefill engines are) and the thresholds of the config to
a :class:`Decision`. The :class:`~vllm_pd_proxy.forward.Forwarder` gathers
those inputs (it picks D first, reads D's prefix memory and P's loads) once
per request, calls :func:`decide`, and counts the result in
``pd_proxy_prefill_decisions_total{decision, reason}``.

The rules, first match wins:

0. the request needs D to run the prompt's forward pass itself: local
   (``prompt_pass``; prompt logprobs, ``echo`` with logprobs, beam search:
   vLLM computes prompt logprobs from that pass and never from loaded KV,
   and runs beam search as requests of its own API server), whatever the
   threshold, so that no P prefills for nothing; checked by the
   :class:`~vllm_pd_proxy.forward.Forwarder` (:func:`needs_prompt_pass`)
   before :func:`decide`, except for a turn with a kept turn to read back;
1. ``--local-prefill-threshold 0``: remote (``always_remote``);
2. a kept turn to read back: remote (``multi_turn``; only P's read releases
   D's kept blocks, so it is never skipped);
3. uncached tokens below the threshold: local, ``prefix_hit`` when the
   whole prompt is not below it (D's cache made it short), else
   ``short_prompt``;
4. ``--max-prefill-queue`` set and every usable P has that many P legs in
   flight: local (``prefill_busy``);
5. otherwise remote (``long_prompt``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class Reason(enum.StrEnum):
    """Why a request was prefilled where it was; the value is the metric label."""

    SHORT_PROMPT = "short_prompt"
    PREFIX_HIT = "prefix_hit"
    PREFILL_BUSY = "prefill_busy"
    LONG_PROMPT = "long_prompt"
    MULTI_TURN = "multi_turn"
    ALWAYS_REMOTE = "always_remote"
    PROMPT_PASS = "prompt_pass"


@dataclass(frozen=True, slots=True)
class Decision:
    """Where one request is prefilled, and why."""

    is_local: bool
    reason: Reason
    #: The prompt tokens D probably does not cache (None: not estimated,
    #: conditional disaggregation is off).
    uncached_tokens: int | None = None

    @property
    def label(self) -> str:
        """The ``decision`` label: ``local`` or ``remote``."""
        return "local" if self.is_local else "remote"


#: Conditional disaggregation off: one decision for every request (no allocation).
ALWAYS_REMOTE = Decision(False, Reason.ALWAYS_REMOTE)
#: D must run the prompt itself (rule 0).
PROMPT_PASS = Decision(True, Reason.PROMPT_PASS)


def needs_prompt_pass(body: dict[str, Any]) -> bool:
    """Whether the request needs D to run its prompt's forward pass (rule 0):
    prompt logprobs (``prompt_logprobs``, or ``echo`` with ``logprobs`` on
    /v1/completions) or beam search."""
    if body.get("use_beam_search") is True:
        return True
    if _asked(body.get("prompt_logprobs")):  # 0 asks too: the prompt token's own
        return True
    return bool(body.get("echo")) and _asked(body.get("logprobs"))


def _asked(value: Any) -> bool:
    return value is not None and value is not False


def decide(
    num_tokens: int,
    num_cached_tokens: int,
    *,
    threshold: int,
    has_turn: bool = False,
    max_prefill_queue: int = 0,
    prefill_loads: Sequence[int] = (),
) -> Decision:
    """Where to prefill a prompt of ``num_tokens`` (estimated) tokens.

    ``num_cached_tokens``: how many of them the chosen D probably holds in
    its prefix cache; ``threshold``: ``--local-prefill-threshold`` (0: off);
    ``has_turn``: a kept turn waits to be read back through P;
    ``prefill_loads``: P legs in flight on each usable prefill engine, for
    ``max_prefill_queue`` (``--max-prefill-queue``, 0: off).
    """
    if not threshold:
        return ALWAYS_REMOTE
    uncached = max(0, num_tokens - num_cached_tokens)
    if has_turn:
        return Decision(False, Reason.MULTI_TURN, uncached)
    if uncached < threshold:
        reason = Reason.PREFIX_HIT if num_tokens >= threshold else Reason.SHORT_PROMPT
        return Decision(True, reason, uncached)
    if max_prefill_queue and is_saturated(prefill_loads, max_prefill_queue):
        return Decision(True, Reason.PREFILL_BUSY, uncached)
    return Decision(False, Reason.LONG_PROMPT, uncached)


def is_saturated(loads: Sequence[int], limit: int) -> bool:
    """Every engine (there is at least one) already has ``limit`` legs in flight."""
    return bool(loads) and min(loads) >= limit
