"""Token #1 from P: the pure core.

Role: P's leg already samples the answer's first token. When P answers, the
proxy sends that token to the client at once and asks D for the rest: a
continuation whose prompt is the prompt's token ids plus token #1, with P's
KV for the prompt (``pd_seeded_tokens`` tells D that the last token of its
prompt is not P's: it loads P's prompt and computes only token #1's KV in
its first step, which samples token #2). No token is computed twice, none
is sent twice.

This module decides whether a request may take that path (:func:`refusal`),
reads token #1 out of P's answer (:func:`seed_of`, :func:`seed_refusal`),
builds D's leg body (:func:`decode_body`), the stream's first events
(:func:`first_events`, :func:`final_events`) and a non-streamed answer
merged from P's token and D's rest (:func:`merge`). Stateless, no I/O; the
flow that uses it is :mod:`vllm_pd_proxy.first_token_flow`.

Every reason a request takes today's path (D computes token #1 itself) is a
short label, the ``reason`` of ``pd_proxy_first_token_total``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from .migration import COMPLETIONS_DEFAULT_MAX_TOKENS, continuation_body
from .stream_track import next_text_offset

_encode = msgspec.json.encode

# Request fields whose meaning a continuation after token #1 (a completions
# request over token ids) cannot reproduce exactly, each with its label.
_REFUSED_FIELDS: tuple[tuple[str, str], ...] = (
    # The text held back for a stop string would be lost at the cut.
    ("stop", "stop_strings"),
    ("echo", "echo"),
    # The grammar (or tool parser) would have to consume token #1 on D.
    ("response_format", "structured_output"),
    ("structured_outputs", "structured_output"),
    ("guided_json", "structured_output"),
    ("guided_regex", "structured_output"),
    ("guided_choice", "structured_output"),
    ("guided_grammar", "structured_output"),
    ("tools", "tools"),
    ("bad_words", "bad_words"),
    ("logit_bias", "logit_bias"),
    ("prompt_embeds", "prompt_embeds"),
    ("prompt_logprobs", "prompt_logprobs"),
    # vLLM applies these to generated tokens only: token #1 in D's prompt
    # would escape them.
    ("presence_penalty", "output_penalties"),
    ("frequency_penalty", "output_penalties"),
)


def refusal(body: dict[str, Any], chat: bool, *, responses: bool = False,
            batch: bool = False, multi_turn: bool = False) -> str | None:
    """Why ``body`` takes today's path (a label); None: it may be seeded.

    ``responses``: a Responses API request (its events are no completion
    chunks); ``batch``: a prompt of a batch (its stream is merged with the
    others'); ``multi_turn``: D keeps the turn for the next one.
    """
    if responses:
        return "responses"
    if batch:
        return "batch"
    if multi_turn:
        return "multi_turn"
    for key, label in _REFUSED_FIELDS:
        if body.get(key):
            return label
    for key in ("n", "best_of"):
        value = body.get(key)
        if isinstance(value, int) and value > 1:
            return "n"
    if chat and (body.get("logprobs") or body.get("top_logprobs")):
        return "chat_logprobs"
    if body.get("seed") is not None and body.get("temperature", 1.0) != 0:
        # A seeded sample is reproducible: the collocated engine draws token
        # #2 from a generator that already drew token #1; D's would not.
        return "seeded_sampling"
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("continuous_usage_stats"):
        return "continuous_usage"
    return None


def limit_of(body: dict[str, Any], chat: bool) -> int | None:
    """The client's token limit (None: none given)."""
    keys = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    for key in keys:
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


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


def _choice(answer: dict[str, Any]) -> dict[str, Any] | None:
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    return choices[0]


def seed_of(answer: dict[str, Any], chat: bool) -> Seed | None:
    """Token #1 out of P's (non-streamed) answer; None when the answer does
    not name the prompt's ids and exactly one generated id."""
    choice = _choice(answer)
    if choice is None:
        return None
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


def is_final(seed: Seed, limit: int | None) -> bool:
    """P's answer is the whole answer: token #1 ended it (``stop``), or the
    client asked for one token."""
    return seed.finish_reason != "length" or limit == 1


def seed_refusal(answer: dict[str, Any], seed: Seed, chat: bool) -> str | None:
    """Why P's answer cannot seed a continuation (a label; None: it can)."""
    if not seed.text or seed.text.endswith("\ufffd"):
        # Token #1 ends inside a character: its text is not final until the
        # next token, which D's detokenizer would have to combine with it.
        return "incomplete_text"
    if chat:
        choice = _choice(answer) or {}
        message = choice.get("message")
        if isinstance(message, dict) and (message.get("reasoning_content")
                                          or message.get("reasoning")
                                          or message.get("tool_calls")):
            return "reasoning"  # a parser split token #1 off the content
    return None


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


def pending_body(body: dict[str, Any], stream: bool, chat: bool = False
                 ) -> dict[str, Any] | None:
    """D's leg sent beside P's (push or pull, ``pd_seed_pending``), before token #1
    exists: the client's request (completions or chat), less the token P
    samples (its limit and ``min_tokens`` one fewer), asking for token ids
    (the stream's tracker splices it after token #1). D appends P's token
    #1 to its prompt when it learns it from P. None when P's token is the whole
    answer (a limit of 1): then no D leg goes at all."""
    if chat:
        # vLLM's chat takes max_completion_tokens over max_tokens (the limit
        # goes on under the key that set it); none named is "the rest of the
        # context", which token #1 in D's prompt already shortens by one.
        limits: tuple[str, ...] = ("max_completion_tokens", "max_tokens")
        limit: Any = limit_of(body, True)
        key = next((k for k in limits if body.get(k) == limit), limits[0])
    else:
        key = "max_tokens"
        limits = (key,)
        # vLLM's completions default when none is named: D's leg would get
        # its own default again, one token too many after P's.
        limit = body.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
    out = {k: v for k, v in body.items() if k not in (*limits, "min_tokens",
                                                       "kv_transfer_params")}
    if type(limit) is int:
        if limit <= 1:
            return None
        out[key] = limit - 1
    elif limit is None and not chat:
        out["max_tokens"] = None  # "no limit" said outright: not D's default
    least = body.get("min_tokens")
    if type(least) is int and least > 1:
        out["min_tokens"] = least - 1
    out["stream"] = stream
    if not stream:
        out.pop("stream_options", None)
    out["return_token_ids"] = True
    return out


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


def _head(answer: dict[str, Any], chat: bool) -> dict[str, Any]:
    head: dict[str, Any] = {k: answer[k] for k in ("id", "created", "model") if k in answer}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    return head


def first_events(answer: dict[str, Any], seed: Seed, chat: bool, final: bool) -> bytes:
    """The stream's first events, carrying token #1, in the shape a D leg
    asked for ``return_token_ids`` streams them (the
    :class:`~vllm_pd_proxy.stream_track.StreamTracker` records them and
    blanks the ids a client did not ask for): for chat the role chunk with
    the prompt's ids, then the token's chunk. ``final``: the token ends the
    answer (P's ``finish_reason`` goes on it)."""
    head = _head(answer, chat)
    choice = _choice(answer) or {}
    finish = choice.get("finish_reason") if final else None
    if chat:
        message = choice.get("message")
        role = message.get("role") if isinstance(message, dict) else None
        out = _sse({**head, "choices": [{"index": 0, "delta": {
            "role": role if isinstance(role, str) else "assistant", "content": ""},
            "logprobs": None, "finish_reason": None}],
            "prompt_token_ids": seed.prompt_ids})
        one: dict[str, Any] = {"index": 0, "delta": {"content": seed.text}, "logprobs": None,
                               "finish_reason": finish, "token_ids": [seed.token_id]}
        if final:
            one["stop_reason"] = choice.get("stop_reason")
        return out + _sse({**head, "choices": [one]})
    return _sse({**head, "choices": [{
        "index": 0, "text": seed.text, "logprobs": choice.get("logprobs"),
        "finish_reason": finish, "stop_reason": choice.get("stop_reason") if final else None,
        "prompt_token_ids": seed.prompt_ids, "token_ids": [seed.token_id]}]})


def final_events(answer: dict[str, Any], seed: Seed, chat: bool,
                 include_usage: bool) -> bytes:
    """The whole stream of an answer P finished at token #1: its events,
    the usage chunk if asked, ``[DONE]``."""
    out = first_events(answer, seed, chat, final=True)
    usage = answer.get("usage")
    if include_usage and isinstance(usage, dict):
        out += _sse({**_head(answer, chat), "choices": [], "usage": usage})
    return out + b"data: [DONE]\n\n"


def final_answer(answer: dict[str, Any], chat: bool, wants_ids: bool) -> dict[str, Any]:
    """P's answer as the client's whole (non-streamed) answer: without its
    ``kv_transfer_params``, the token ids only if the client asked."""
    out = {k: v for k, v in answer.items() if k != "kv_transfer_params"}
    if not wants_ids:
        _blank_ids(out)
    return out


def _blank_ids(answer: dict[str, Any]) -> None:
    if "prompt_token_ids" in answer:
        answer["prompt_token_ids"] = None
    choices = answer.get("choices")
    if isinstance(choices, list):
        answer["choices"] = choices = [dict(c) if isinstance(c, dict) else c for c in choices]
        for c in choices:
            if isinstance(c, dict):
                for key in ("prompt_token_ids", "token_ids"):
                    if key in c:
                        c[key] = None


def _merge_logprobs(first: Any, rest: Any, text: str) -> Any:
    """Completions logprobs of token #1 (P) and the rest (D), D's text
    offsets moved past token #1's."""
    if not isinstance(first, dict) or not isinstance(rest, dict):
        return first if rest is None else rest if first is None else None
    after = next_text_offset(first)
    shift = len(text) if after is None else after
    out: dict[str, Any] = {}
    for key in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
        a, b = first.get(key), rest.get(key)
        if not isinstance(a, list) or not isinstance(b, list):
            out[key] = a if isinstance(a, list) else b
            continue
        if key == "text_offset":
            b = [o + shift if type(o) is int else o for o in b]
        out[key] = [*a, *b]
    return out


def merge(p_answer: dict[str, Any], d_answer: dict[str, Any], seed: Seed, chat: bool,
          wants_ids: bool) -> dict[str, Any] | None:
    """The client's non-streamed answer: token #1 from P's answer, the rest
    from D's (a completions answer to the continuation, or a chat answer to
    a concurrent leg); None when D's
    answer is not one choice."""
    d_choice = _choice(d_answer)
    p_choice = _choice(p_answer)
    if d_choice is None or p_choice is None:
        return None
    rest_text = d_choice.get("text")
    d_message = d_choice.get("message")
    if isinstance(d_message, dict):  # a chat D leg (concurrent dispatch)
        rest_text = d_message.get("content")
    rest_text = rest_text if isinstance(rest_text, str) else ""
    out = {k: v for k, v in p_answer.items() if k not in ("kv_transfer_params", "choices")}
    choice = dict(p_choice)
    if chat:
        message = dict(choice.get("message") or {})
        message["content"] = seed.text + rest_text
        choice["message"] = message
    else:
        choice["text"] = seed.text + rest_text
        choice["logprobs"] = _merge_logprobs(p_choice.get("logprobs"),
                                             d_choice.get("logprobs"), seed.text)
    choice["finish_reason"] = d_choice.get("finish_reason")
    choice["stop_reason"] = d_choice.get("stop_reason")
    rest_ids = _ints(d_choice.get("token_ids")) or []
    choice["token_ids"] = [seed.token_id, *rest_ids]
    out["choices"] = [choice]
    p_usage, d_usage = p_answer.get("usage"), d_answer.get("usage")
    if isinstance(p_usage, dict) and isinstance(d_usage, dict):
        more = d_usage.get("completion_tokens")
        more = more if type(more) is int else 0
        usage = dict(p_usage)
        prompt = usage.get("prompt_tokens")
        prompt = prompt if type(prompt) is int else len(seed.prompt_ids)
        usage["completion_tokens"] = 1 + more
        usage["total_tokens"] = prompt + 1 + more
        out["usage"] = usage
    for key, value in d_answer.items():
        if key.startswith("pd_"):  # the proxy's telemetry record
            out[key] = value
    if not wants_ids:
        _blank_ids(out)
    return out
