"""A fake engine that generates deterministic tokens as vLLM streams them.

The override for :class:`pdproxy_helpers.FakeEngine` used by the migration
tests: the next token is a function of every token before it (prompt and
generated), so a continuation from the prompt's ids plus the tokens already
sent yields exactly the tokens of an uninterrupted run, as greedy decoding
on a real engine does. It speaks vLLM's streaming format for completions and
chat, with ``return_token_ids`` (``prompt_token_ids`` on the first chunk,
``token_ids`` on every chunk), ``max_tokens``, ``stream_options``
usage and ``finish_reason`` ``length``. ``Faults`` makes it fail a leg.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from pdproxy_helpers import FakeEngine


def tokenize(path: str, body: dict[str, Any]) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if path.endswith("/chat/completions"):
        text = "|".join(str(m.get("content")) for m in body.get("messages", []))
        return [1, *(ord(c) % 500 + 10 for c in text), 2]
    return [ord(c) % 500 + 10 for c in str(prompt)]


def next_token(ids: list[int]) -> int:
    return (sum(ids[-3:]) * 31 + len(ids)) % 997 + 3


def text_of(token: int) -> str:
    return f"t{token} "


def generate(prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    out = []
    for _ in range(n):
        tok = next_token(ids)
        ids.append(tok)
        out.append(tok)
    return out


@dataclass
class Faults:
    """How the engine fails its next legs (each field counts down per leg)."""

    #: die (close the connection) after this many tokens of a stream
    die_after: int | None = None
    #: send an error event after this many tokens
    error_after: int | None = None
    #: stop sending (stall) after this many tokens
    stall_after: int | None = None
    #: answer every leg with this status before any byte
    status: int | None = None
    #: how many legs fail this way (None: all)
    times: int | None = None


def _chunk(chat: bool, rid: str, text: str, ids: list[int] | None, finish: str | None,
           prompt_ids: list[int] | None, first: bool) -> dict[str, Any]:
    if chat:
        delta: dict[str, Any] = {"content": text} if text else {}
        if first:
            delta = {"role": "assistant", "content": ""}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                  "finish_reason": finish, "token_ids": ids}
        if finish is not None:
            choice["stop_reason"] = None
        out = {"id": rid, "object": "chat.completion.chunk", "created": 7, "model": "m",
               "choices": [choice]}
        if first:
            out["prompt_token_ids"] = prompt_ids
        return out
    return {"id": rid, "object": "text_completion", "created": 7, "model": "m",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                         "stop_reason": None, "prompt_token_ids": prompt_ids,
                         "token_ids": ids}]}


def _usage(prompt: list[int], n: int) -> dict[str, int]:
    return {"prompt_tokens": len(prompt), "completion_tokens": n,
            "total_tokens": len(prompt) + n}


class TokenEngine:
    """The override: ``await engines("decode", override=TokenEngine())``."""

    def __init__(self, faults: Faults | None = None, delay: float = 0.0,
                 kv_params: dict[str, Any] | None = None, stop_first: bool = False,
                 gate: asyncio.Event | None = None, pd_ext: bool = True,
                 answer_delay: float = 0.0, partial_first: bool = False) -> None:
        self.faults = faults or Faults()
        self.delay = delay
        self.kv_params = kv_params
        #: A prefill engine: its first token ends the answer (EOS).
        self.stop_first = stop_first
        #: A decode engine: answers nothing until the gate is set.
        self.gate = gate
        #: A prefill engine: answers as vllm_pd_ext's P (a prompt digest in
        #: its params), not as vLLM's NixlConnector.
        self.pd_ext = pd_ext
        #: A prefill engine: seconds before it answers.
        self.answer_delay = answer_delay
        #: A prefill engine: token #1 ends inside a character (its text is
        #: U+FFFD until the next token, as a byte-level BPE's can be).
        self.partial_first = partial_first
        #: ``time.monotonic()`` of each prefill answer.
        self.answered_at: list[float] = []
        self.legs = 0
        self.bodies: list[dict[str, Any]] = []

    def _fault(self) -> Faults | None:
        f = self.faults
        if f.times is not None and f.times <= 0:
            return None
        if f.times is not None:
            f.times -= 1
        return f

    def _prefill_answer(self, engine: FakeEngine, chat: bool, rid: str, prompt: list[int],
                        token: int, body: dict[str, Any], with_ids: bool) -> dict[str, Any]:
        """P's one-token answer as vLLM gives it; the KV handed over only for
        a leg that asked (``kv_transfer_params``) and did not stop at token
        #1 under ``pd_first_token`` (as vllm_pd_ext's P)."""
        finish = "stop" if self.stop_first else "length"
        text = "\ufffd" if self.partial_first else text_of(token)
        choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": text}}
                                  if chat else {"index": 0, "text": text, "logprobs": None})
        choice["finish_reason"] = finish
        choice["stop_reason"] = None
        answer: dict[str, Any] = {"id": rid, "object": "chat.completion" if chat
                                  else "text_completion", "created": 7, "model": "m",
                                  "choices": [choice], "usage": _usage(prompt, 1)}
        if with_ids:
            choice["token_ids"] = [token]
            if chat:
                answer["prompt_token_ids"] = prompt
            else:
                choice["prompt_token_ids"] = prompt
        leg = body.get("kv_transfer_params")
        stopped = self.stop_first and isinstance(leg, dict) and leg.get("pd_first_token")
        if engine.kv_params is not None and isinstance(leg, dict) and not stopped:
            answer["kv_transfer_params"] = dict(engine.kv_params)
            if self.pd_ext:
                answer["kv_transfer_params"]["remote_prompt_digest"] = "d" * 32
        return answer

    async def __call__(self, engine: FakeEngine, request: web.Request,
                       body: dict[str, Any]) -> web.StreamResponse:
        self.legs += 1
        self.bodies.append(body)
        fault = self._fault()
        if fault is not None and fault.status is not None:
            return web.json_response({"error": {"message": "fake failure",
                                                "code": fault.status}}, status=fault.status)
        chat = request.path.endswith("/chat/completions")
        prompt = tokenize(request.path, body)
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        leg = body.get("kv_transfer_params")
        if isinstance(leg, dict) and leg.get("pd_seed_pending") and engine.role == "decode":
            # Sent beside P's leg: P's token #1 comes with the KV and D goes
            # on after it (its prompt, as its API server saw it, is P's).
            tokens = generate([*prompt, generate(prompt, 1)[0]], limit)
        else:
            tokens = generate(prompt, limit)
        with_ids = bool(body.get("return_token_ids"))
        rid = f"cmpl-{engine.engine_id}-{self.legs}"
        if engine.role == "prefill":
            if self.answer_delay:
                await asyncio.sleep(self.answer_delay)
            self.answered_at.append(time.monotonic())
            return web.json_response(self._prefill_answer(engine, chat, rid, prompt, tokens[0],
                                                          body, with_ids))
        if self.gate is not None:
            await self.gate.wait()
        if not body.get("stream"):
            text = "".join(text_of(t) for t in tokens)
            choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant",
                                                               "content": text}}
                                      if chat else {"index": 0, "text": text})
            choice["finish_reason"] = "length"
            if with_ids:
                choice["token_ids"] = tokens
            return web.json_response({"id": rid, "object": "x", "model": "m",
                                      "choices": [choice],
                                      "usage": {"prompt_tokens": len(prompt),
                                                "completion_tokens": len(tokens),
                                                "total_tokens": len(prompt) + len(tokens)}})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)

        async def send(obj: dict[str, Any]) -> None:
            await out.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        if chat:
            await send(_chunk(True, rid, "", None, None, prompt if with_ids else None, True))
        for i, tok in enumerate(tokens):
            if fault is not None and fault.die_after == i:
                assert request.transport is not None
                request.transport.close()
                return out
            if fault is not None and fault.error_after == i:
                await send({"error": {"message": "engine died", "type": "InternalServerError",
                                      "code": 500}})
                await out.write(b"data: [DONE]\n\n")
                return out
            if fault is not None and fault.stall_after == i:
                await asyncio.sleep(3600)
            if self.delay:
                await asyncio.sleep(self.delay)
            finish = "length" if i == len(tokens) - 1 else None
            await send(_chunk(chat, rid, text_of(tok), [tok] if with_ids else None, finish,
                              prompt if with_ids and i == 0 and not chat else None, False))
        options = body.get("stream_options") or {}
        if options.get("include_usage"):
            await send({"id": rid, "object": "chat.completion.chunk" if chat
                        else "text_completion", "created": 7, "model": "m", "choices": [],
                        "usage": {"prompt_tokens": len(prompt),
                                  "completion_tokens": len(tokens),
                                  "total_tokens": len(prompt) + len(tokens)}})
        await out.write(b"data: [DONE]\n\n")
        return out


def stream_text(events: list[Any], chat: bool = False) -> str:
    """The text a client read from parsed SSE events (chat: the deltas)."""
    out = []
    for e in events:
        if e == "[DONE]" or not e.get("choices"):
            continue
        c = e["choices"][0]
        out.append((c.get("delta") or {}).get("content") or "" if chat else c.get("text", ""))
    return "".join(out)
