"""Helpers for the proxy tests: a fake vLLM engine and SSE utilities.

Every fake binds 127.0.0.1 on an ephemeral port (aiohttp's TestServer).
Imported by conftest.py and the tests (unique module name on purpose).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer
from multidict import CIMultiDict

from vllm_pd_ext.tools.sse import parse as parse_events


@dataclass
class Seen:
    """One request a fake engine received."""

    path: str
    body: dict[str, Any]
    headers: CIMultiDict[str]
    at: float


Override = Callable[["FakeEngine", web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]


@dataclass
class FakeEngine:
    """A stand-in for a vLLM OpenAI server, prefill or decode flavoured.

    Knobs: ``health_status``, ``fail_status`` (answer completions with it),
    ``delay`` (before answering), ``chunks``/``chunk_delay`` (decode stream),
    ``kv_params`` (P answer's kv_transfer_params; None omits them),
    ``engine_id``/``probe_transfer_mode`` (identity probe answer; None omits
    transfer_mode), ``api_key`` (as vLLM's ``--api-key``: ``/v1/*`` needs
    ``Authorization: Bearer <key>``, else 401), ``override`` (a custom handler).
    As with vllm_pd_ext's connector, the probe and a prefill answer carry the
    same identity; :meth:`restart` changes it in both. ``seen`` records
    completion requests, ``gets`` the GET requests (health, models);
    ``in_flight``/``max_in_flight`` count the completion legs running now and
    at most at once (identity probes excluded).
    """

    role: str
    engine_id: str = "engine-a"
    probe_transfer_mode: str | None = "push"
    model: str = "fake-model"
    health_status: int = 200
    health_delay: float = 0.0
    fail_status: int | None = None
    delay: float = 0.0
    chunks: list[str] = field(default_factory=lambda: ["Hello", ",", " world"])
    chunk_delay: float = 0.0
    kv_params: dict[str, Any] | None = None
    api_key: str | None = None
    #: As vllm_pd_ext's drain middleware: every POST gets 503 + X-PD-Draining,
    #: /health stays 200 with the header.
    draining: bool = False
    override: Override | None = None
    seen: list[Seen] = field(default_factory=list)
    gets: list[Seen] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0  # the most completion legs it ran at once
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    received: asyncio.Event = field(default_factory=asyncio.Event)
    server: TestServer | None = None

    def __post_init__(self) -> None:
        if self.kv_params is None and self.role == "prefill":
            self.kv_params = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                **self.identity(),
                "remote_block_ids": [1, 2, 3],
            }

    def identity(self) -> dict[str, Any]:
        """What the engine says about itself in the probe and in P answers."""
        identity: dict[str, Any] = {
            "remote_engine_id": self.engine_id,
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "tp_size": 2,
        }
        if self.probe_transfer_mode is not None:
            identity["transfer_mode"] = self.probe_transfer_mode
        return identity

    def restart(self, engine_id: str) -> None:
        """The engine restarted at the same URL: a new engine id everywhere."""
        self.engine_id = engine_id
        if self.kv_params is not None and "remote_engine_id" in self.kv_params:
            self.kv_params = {**self.kv_params, "remote_engine_id": engine_id}

    @property
    def url(self) -> str:
        assert self.server is not None
        return str(self.server.make_url("")).rstrip("/")

    def legs(self) -> list[Seen]:
        """Completion requests received, identity probes excluded."""
        return [
            s
            for s in self.seen
            if s.path.startswith("/v1/")
            and s.path != "/v1/models"
            and not (s.body.get("kv_transfer_params") or {}).get("pd_ext_probe")
        ]

    def probes(self) -> list[Seen]:
        return [
            s for s in self.seen if (s.body.get("kv_transfer_params") or {}).get("pd_ext_probe")
        ]

    def health_checks(self) -> list[Seen]:
        """``GET /health`` calls received (one per health round)."""
        return [s for s in self.gets if s.path == "/health"]

    async def start(self) -> FakeEngine:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_post("/v1/responses", self._completions)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        return self

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()

    def _unauthorized(self, request: web.Request) -> web.Response | None:
        """vLLM's --api-key check: 401 unless the bearer token matches."""
        if self.api_key is None or request.headers.get("Authorization") == (
            f"Bearer {self.api_key}"
        ):
            return None
        return web.json_response({"error": "Unauthorized"}, status=401)

    async def _health(self, request: web.Request) -> web.Response:
        self.gets.append(Seen(request.path, {}, CIMultiDict(request.headers), time.monotonic()))
        if self.health_delay:
            await asyncio.sleep(self.health_delay)
        headers = {"X-PD-Draining": "1"} if self.draining else {}
        return web.Response(status=self.health_status, headers=headers)

    async def _models(self, request: web.Request) -> web.Response:
        self.gets.append(Seen(request.path, {}, CIMultiDict(request.headers), time.monotonic()))
        if (denied := self._unauthorized(request)) is not None:
            return denied
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model"}]}
        )

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(Seen(request.path, body, CIMultiDict(request.headers), time.monotonic()))
        if (denied := self._unauthorized(request)) is not None:
            return denied
        if self.draining:
            err = {"error": {"message": "engine is draining", "type": "draining", "code": 503}}
            return web.json_response(
                err, status=503, headers={"X-PD-Draining": "1", "Retry-After": "1"}
            )
        kv = body.get("kv_transfer_params") or {}
        if kv.get("pd_ext_probe"):
            answer = {"id": "probe", "choices": [{"index": 0, "text": "x"}]}
            return web.json_response({**answer, "kv_transfer_params": self.identity()})
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.received.set()
        try:
            if self.override is not None:
                return await self.override(self, request, body)
            if self.delay:
                await asyncio.sleep(self.delay)
            if self.fail_status is not None:
                err = {"error": {"message": f"fake {self.role} failure", "code": self.fail_status}}
                return web.json_response(err, status=self.fail_status)
            if self.role == "prefill":
                answer = completion(request.path, body, "x")
                if self.kv_params is not None:
                    answer["kv_transfer_params"] = self.kv_params
                return web.json_response(answer)
            if body.get("stream"):
                return await self.stream(request, body)
            return web.json_response(completion(request.path, body, "".join(self.chunks)))
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        finally:
            self.in_flight -= 1

    async def stream(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for text in self.chunks:
            if self.chunk_delay:
                await asyncio.sleep(self.chunk_delay)
            await out.write(sse(chunk(request.path, text)))
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


def completion(path: str, body: dict[str, Any], text: str) -> dict[str, Any]:
    if path.endswith("/chat/completions"):
        return {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": body.get("model"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
        }
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "model": body.get("model"),
        "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
    }


def chunk(path: str, text: str) -> dict[str, Any]:
    if path.endswith("/chat/completions"):
        return {
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": text}}],
        }
    return {"object": "text_completion", "choices": [{"index": 0, "text": text}]}


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def parse_sse(raw: bytes) -> list[Any]:
    """The payloads of the proxy's SSE body, ``"[DONE]"`` as it stands; the
    framing is checked too (``strict``: data lines only, one per event,
    nothing after [DONE], no cut event)."""
    return [event.payload for event in parse_events(raw, strict=True)]


async def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll ``predicate`` until true; fail the test (not hang) after ``timeout``."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


# ------------------------------------------------------ a vLLM-like engine
#: ``created`` of every vllm_like answer (vLLM's is the time in seconds).
CREATED = 1700000000


def _compact_sse(obj: dict[str, Any]) -> bytes:
    """An event as vLLM writes it (compact JSON)."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def is_batch(prompt: Any) -> bool:
    """vLLM's rule: a list of two or more strings or token-id lists."""
    return isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int)


def _tokens(prompt: Any, choice: int, max_tokens: int) -> list[str]:
    """The fake's output for one prompt and choice: names both."""
    label = prompt if isinstance(prompt, str) else f"ids{prompt[0]}"
    return [label, f"#{choice}", "."][:max_tokens]


def _prompt_tokens(prompt: Any) -> int:
    return len(prompt.split()) if isinstance(prompt, str) else len(prompt)


async def vllm_like(engine: FakeEngine, request: web.Request, body: dict[str, Any]
                    ) -> web.StreamResponse:
    """An ``override`` answering /v1/completions as vLLM's server does, by the
    rules of ``vllm/entrypoints/openai/completion/serving.py``: every prompt
    of a batch, ``n`` choices each (index = prompt * n + choice), usage summed
    (``prompt_tokens_details``: the last prompt's, or the first's in a
    stream), streams with ``include_usage`` / ``continuous_usage_stats``,
    ``echo``. Fake tokens name the prompt and the choice. A P/D leg with a
    batch fails with 500 (vLLM hands over only prompt 0's KV). A prefill
    engine adds its ``kv_params`` to the answer, as a KV producer does."""
    if engine.delay:
        await asyncio.sleep(engine.delay)
    prompt = body.get("prompt")
    prompts = prompt if is_batch(prompt) else [prompt]
    if len(prompts) > 1 and body.get("kv_transfer_params"):
        return web.json_response({"error": {"message": "Internal server error", "code": 500}},
                                 status=500)
    n = body.get("n") or 1
    max_tokens = body.get("max_tokens") or 16
    rid = request.headers.get("X-Request-Id", "x")
    head = {"id": f"cmpl-{rid}", "object": "text_completion", "created": CREATED,
            "model": body.get("model") or engine.model}
    outputs = [[_tokens(p, c, max_tokens) for c in range(n)] for p in prompts]
    prompt_tokens = [_prompt_tokens(p) for p in prompts]
    cached = [t // 2 for t in prompt_tokens]  # differs between prompts of other lengths
    completion_tokens = sum(len(t) for per_prompt in outputs for t in per_prompt)

    def usage(details_from: int) -> dict[str, Any]:
        return {"prompt_tokens": sum(prompt_tokens),
                "total_tokens": sum(prompt_tokens) + completion_tokens,
                "completion_tokens": completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached[details_from]}}

    echo = bool(body.get("echo"))
    if not body.get("stream"):
        choices = []
        for p, per_prompt in zip(prompts, outputs, strict=True):
            for tokens in per_prompt:
                text = (p if echo and isinstance(p, str) else "") + "".join(tokens)
                choices.append({"index": len(choices), "text": text, "logprobs": None,
                                "finish_reason": "length", "stop_reason": None,
                                "prompt_logprobs": None})
        answer = {**head, "choices": choices, "usage": {**usage(-1),
                  "completion_tokens_details": None}, "system_fingerprint": None,
                  "kv_transfer_params": engine.kv_params if engine.role == "prefill" else None}
        return web.json_response(answer)
    options = body.get("stream_options") or {}
    continuous = options.get("include_usage") and options.get("continuous_usage_stats")
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await out.prepare(request)
    for step in range(max(len(t) for per_prompt in outputs for t in per_prompt)):
        for i, per_prompt in enumerate(outputs):
            for c, tokens in enumerate(per_prompt):
                if step >= len(tokens):
                    continue
                if engine.chunk_delay:
                    await asyncio.sleep(engine.chunk_delay)
                text = tokens[step]
                if echo and step == 0 and isinstance(prompts[i], str):
                    text = prompts[i] + text
                last = step == len(tokens) - 1
                one = {**head, "choices": [{"index": i * n + c, "text": text, "logprobs": None,
                                            "finish_reason": "length" if last else None,
                                            "stop_reason": None}]}
                if continuous:
                    one["usage"] = {"prompt_tokens": prompt_tokens[i],
                                    "completion_tokens": step + 1,
                                    "total_tokens": prompt_tokens[i] + step + 1}
                await out.write(_compact_sse(one))
    if options.get("include_usage"):
        await out.write(_compact_sse({**head, "choices": [], "usage": usage(0)}))
    await out.write(b"data: [DONE]\n\n")
    await out.write_eof()
    return out
