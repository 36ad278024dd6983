"""Token #1 from P (issue 29, work in progress): the pure core.

Role: P's leg already samples the answer's first token. When P answers, the
proxy can send that token to the client at once and ask D for the rest: a
continuation whose prompt is the prompt's token ids plus token #1, with
P's KV for the prompt (``pd_seeded_tokens`` tells D that the last token of
its prompt is not P's: it loads P's prompt and computes only the seed).
This module decides whether a request may take that path (``unsupported``),
reads token #1 out of P's answer (``seed_of``) and builds D's leg body
(``decode_body``). Stateless; the flow that uses it is not built yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .migration import continuation_body, mid_stream_unsupported


def unsupported(body: dict[str, Any], chat: bool) -> str | None:
    """Why ``body`` takes today's path (D computes token #1 itself); None:
    it may be seeded. Whatever a mid-stream continuation cannot reproduce,
    a seeded one cannot either (it is the same continuation, after one
    token instead of k)."""
    return mid_stream_unsupported(body, chat)


@dataclass(frozen=True, slots=True)
class Seed:
    """Token #1 as P's answer gives it (its leg asked ``return_token_ids``)."""

    prompt_ids: list[int]
    token_id: int
    text: str
    #: P's own: ``length`` (its leg's one token) or ``stop`` (token #1 ended
    #: the answer: EOS or a stop token), which makes P's answer the whole one.
    finish_reason: str | None


def _ints(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(type(v) is int for v in value):
        return value
    return None


def seed_of(answer: dict[str, Any], chat: bool) -> Seed | None:
    """Token #1 out of P's (non-streamed) answer; None when the answer does
    not name the prompt's ids and exactly one generated id."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    prompt_ids = _ints(choice.get("prompt_token_ids")) or _ints(answer.get("prompt_token_ids"))
    ids = _ints(choice.get("token_ids"))
    if not prompt_ids or ids is None or len(ids) != 1:
        return None
    if chat:
        message = choice.get("message")
        text = message.get("content") if isinstance(message, dict) else None
    else:
        text = choice.get("text")
    if not isinstance(text, str):
        return None
    reason = choice.get("finish_reason")
    return Seed(prompt_ids, ids[0], text, reason if isinstance(reason, str) else None)


def decode_body(body: dict[str, Any], seed: Seed, chat: bool, stream: bool
                ) -> dict[str, Any] | None:
    """D's leg after a seeded token #1: the client's request continued after
    it (``continuation_body``), streamed as the client asked. None when the
    seed already is the whole answer (the client's ``max_tokens`` is 1)."""
    out = continuation_body(body, seed.prompt_ids, [seed.token_id], chat)
    if out is None:
        return None
    out["stream"] = stream
    if not stream:
        out.pop("stream_options", None)
    return out
