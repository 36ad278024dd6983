"""Request migration: finish a request elsewhere when an engine fails it.

Role: the pure core of the proxy's per-request failure handling (no I/O).
One :class:`Migration` per client prompt, made by
:meth:`~vllm_pd_proxy.forward.Forwarder.serve`, which asks it after every
failure whether and how the request goes on:

* **before the client saw a byte** (a P leg that failed after its retries,
  a D leg that failed before its first event, or whose first event was an
  error): the whole handoff again, a fresh P leg (P hands out a new lease
  under a new engine request id, so no lease is pinned twice) and another D,
  avoiding the engine at fault; D prefills locally when no P is left;
* **mid-stream** (D died, reset, stalled past ``--stream-idle-timeout`` or
  sent an error event after tokens reached the client): a continuation on
  another D, which prefills the prompt's token ids plus every token id the
  client already got (:func:`continuation_body`; token ids, never
  re-tokenized text) and generates what is left of ``max_tokens``; the
  :class:`~vllm_pd_proxy.stream_track.StreamTracker` splices its events
  into the client's stream.

Bounded by ``--max-migrations`` per prompt and, with
``--request-deadline``, by the time left. Whatever cannot migrate ends as
before: an HTTP error, or an error event in the stream.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from .errors import Outcome, ProxyError

#: The endpoint every continuation goes to: only completions take token ids.
CONTINUATION_ENDPOINT = "/v1/completions"


class Cause(enum.StrEnum):
    """Why a request migrated (the ``cause`` label of the metric)."""

    #: A P leg failed (after ``--prefill-retries``): the handoff again.
    PREFILL = "prefill_failed"
    #: No P left for the request: D prefills it.
    NO_PREFILL = "no_prefill"
    #: A D leg failed before the client got a byte: the handoff again.
    DECODE = "decode_failed"
    #: D failed after tokens reached the client: a continuation.
    MID_STREAM = "mid_stream"


class Ending(enum.StrEnum):
    """How a migrated request ended (the ``outcome`` label)."""

    OK = "ok"
    #: It migrated and a later attempt failed too (the client got the error).
    FAILED = "failed"
    #: It could not migrate: the budget or the deadline was spent.
    EXHAUSTED = "exhausted"
    #: It could not migrate: a feature a continuation cannot reproduce.
    UNSUPPORTED = "unsupported"
    #: It migrated and the client went away before the end.
    CANCELLED = "cancelled"


# Engine failures another engine may not repeat; everything else is the
# request's own fault (4xx), back-pressure (queue full or timed out: another
# attempt would wait again) or the proxy's.
_ENGINE_OUTCOMES = frozenset({
    Outcome.UPSTREAM_5XX, Outcome.UPSTREAM_UNREACHABLE, Outcome.PROTOCOL_ERROR,
    Outcome.TIMEOUT, Outcome.STREAM_ERROR,
})


def engine_failure(exc: ProxyError) -> bool:
    """Whether ``exc`` is an engine's failure that another engine may not repeat."""
    return exc.outcome in _ENGINE_OUTCOMES or exc.draining


def no_prefill_left(exc: ProxyError) -> bool:
    """No P engine could take the leg (every one failed it or is unroutable)."""
    return exc.outcome == Outcome.NO_BACKEND and exc.role == "prefill"


# Request fields whose meaning a continuation (a fresh completions request
# over token ids) cannot reproduce mid-stream, each with why.
_MID_STREAM_UNSUPPORTED: tuple[tuple[str, str], ...] = (
    ("stop", "stop strings (text held back for them is lost, and one may span the cut)"),
    ("echo", "echo"),
    ("response_format", "structured output (the grammar cannot resume mid-answer)"),
    ("structured_outputs", "structured output (the grammar cannot resume mid-answer)"),
    ("guided_json", "structured output (the grammar cannot resume mid-answer)"),
    ("guided_regex", "structured output (the grammar cannot resume mid-answer)"),
    ("guided_choice", "structured output (the grammar cannot resume mid-answer)"),
    ("guided_grammar", "structured output (the grammar cannot resume mid-answer)"),
    ("tools", "tool calls (the tool parser cannot resume mid-answer)"),
    ("bad_words", "bad_words"),
    ("prompt_embeds", "prompt_embeds (the prompt has no token ids to continue from)"),
    ("logit_bias", "logit_bias"),
)


def mid_stream_unsupported(body: dict[str, Any], chat: bool) -> str | None:
    """Why a stream of ``body`` cannot continue on another D (None: it can)."""
    for key, why in _MID_STREAM_UNSUPPORTED:
        if body.get(key):
            return why
    for key in ("n", "best_of"):
        value = body.get(key)
        if isinstance(value, int) and value > 1:
            return f"{key} > 1 (each choice stops at another token)"
    if chat and (body.get("logprobs") or body.get("top_logprobs")):
        return "chat logprobs (a continuation reports completions logprobs)"
    if body.get("prompt_logprobs"):
        return "prompt_logprobs"
    return None


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


#: vLLM's ``max_tokens`` for a completions request that names none
#: (``CompletionRequest.max_tokens``; chat has no such default).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def continuation_body(body: dict[str, Any], prompt_ids: list[int], sent_ids: list[int],
                      chat: bool) -> dict[str, Any] | None:
    """The completions request that continues ``body`` after ``sent_ids``.

    Its prompt is the original prompt's token ids and the generated ones
    (what the first D returned with ``return_token_ids``); ``max_tokens``
    and ``min_tokens`` lose what was already generated. None when nothing is
    left to generate (the caller ends the stream with ``length``).
    """
    done = len(sent_ids)
    out: dict[str, Any] = {}
    # Sampling and output fields carry over; the prompt, the chat-only
    # fields and what the proxy sets itself do not.
    drop = {"prompt", "messages", "max_completion_tokens", "max_tokens", "min_tokens",
            "min_completion_tokens", "kv_transfer_params", "echo", "suffix",
            "chat_template", "chat_template_kwargs", "add_generation_prompt",
            "continue_final_message", "documents", "tools", "tool_choice",
            "parallel_tool_calls", "reasoning_effort", "include_reasoning",
            "logprobs", "top_logprobs", "prompt_logprobs", "conversation_id",
            "mm_processor_kwargs", "media_io_kwargs", "prompt_embeds",
            # The ids are the prompt as the first D saw it, truncated already.
            "truncate_prompt_tokens"}
    for key, value in body.items():
        if key not in drop:
            out[key] = value
    limit = _positive_int(body.get("max_completion_tokens") if chat else None)
    if limit is None:
        limit = _positive_int(body.get("max_tokens"))
    if limit is None and not chat and "max_tokens" not in body:
        # vLLM's completions default, which the client got on the first D:
        # the continuation (whose own default it would be again) is bounded
        # by what is left of it.
        limit = COMPLETIONS_DEFAULT_MAX_TOKENS
    if limit is not None:
        if limit - done <= 0:
            return None
        out["max_tokens"] = limit - done
    elif not chat and "max_tokens" in body:
        # ``null`` said outright: the model's length bounds it, not vLLM's
        # completions default (which an absent field would get).
        out["max_tokens"] = None
    least = _positive_int(body.get("min_tokens")) or _positive_int(
        body.get("min_completion_tokens"))
    if least and least - done > 0:
        out["min_tokens"] = least - done
    if not chat and _positive_int(body.get("logprobs")) is not None:
        out["logprobs"] = body["logprobs"]
    out["prompt"] = [*prompt_ids, *sent_ids]
    out["stream"] = True
    out["return_token_ids"] = True
    return out


@dataclass(slots=True)
class Migration:
    """One prompt's migrations: how many, why, and the time they added.

    ``limit``: ``--max-migrations``; ``deadline``: the loop time after which
    none starts (None: no deadline).
    """

    limit: int
    deadline: float | None = None
    causes: list[Cause] = field(default_factory=list)
    #: Seconds between each failure's last progress and the replacement's
    #: first byte, summed (the client's extra wait).
    added: float = 0.0
    #: When the current failure's gap began (None: no migration under way).
    gap_from: float | None = None
    #: Why the last failure could not migrate (None: it could, or none
    #: failed), and that failure's cause.
    refused: Ending | None = None
    refused_cause: Cause = Cause.DECODE

    def allow(self, cause: Cause, now: float, since: float) -> bool:
        """Whether one more migration (of ``cause``) may start now; records it.

        ``since``: when the failed attempt last made progress (sent its leg
        or its last event).
        """
        if len(self.causes) >= self.limit or (
                self.deadline is not None and now >= self.deadline):
            self.refused, self.refused_cause = Ending.EXHAUSTED, cause
            return False
        self.causes.append(cause)
        if self.gap_from is None:
            self.gap_from = since
        return True

    def refuse_unsupported(self, cause: Cause) -> None:
        self.refused, self.refused_cause = Ending.UNSUPPORTED, cause

    def resumed(self, now: float) -> None:
        """The replacement's first byte arrived: the gap is over."""
        if self.gap_from is not None:
            self.added += max(now - self.gap_from, 0.0)
            self.gap_from = None
