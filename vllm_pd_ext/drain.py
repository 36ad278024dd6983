"""A connector-aware drain for vLLM's API server (ASGI middleware).

Role: let an operator take a P or a D out of service without a client
error. Started with ``vllm serve ... --middleware vllm_pd_ext.drain.DrainMiddleware``
(the engines in ``testing/engines.py`` add it). On SIGTERM or
``POST /pd/drain`` the engine:

1. refuses new work: every ``POST`` (completions, chat, ...) gets a 503 with
   ``Retry-After`` and ``X-PD-Draining: 1``, which ``vllm-pd-proxy`` retries
   on another engine; ``/health`` stays 200 (the process is alive: a
   liveness probe must not kill it mid-drain) but carries ``X-PD-Draining``,
   so the proxy shows the engine as draining; ``GET /pd/ready`` answers 503
   for readiness probes;
2. waits until every request it admitted has been answered (a P's legs have
   granted their leases, a D's decodes have finished);
3. hands over to vLLM's own shutdown in drain mode: the EngineCore keeps
   stepping while any request is held by the connector, i.e. while a D
   still has to READ (pull) or P is still WRITING (push) its KV, and exits
   once every lease is released or expired. The connector gives vLLM that
   drain window (``drain_timeout``) when ``--shutdown-timeout`` is 0
   (``compat.ensure_drain_window``).

The whole drain is bounded by ``drain_timeout`` (``kv_connector_extra_config``,
default 120 s); after it the engine exits whatever is left, as vLLM would.

Lifecycle: one middleware per API server process (the state is per
instance; vLLM builds the app once). The SIGTERM handler is installed on the
server's event loop at lifespan start-up, replacing vLLM's own, which it
calls (through SIGINT, which vLLM handles identically) once step 2 is done.
Only vLLM's API server (``timeout_s`` from argv) and the hand-over import vLLM
(through ``compat``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from vllm_pd_ext.config import extra_config_from_argv
from vllm_pd_ext.log import get_logger

logger = get_logger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DRAIN_PATH = "/pd/drain"
READY_PATH = "/pd/ready"
DRAINING_HEADER = (b"x-pd-draining", b"1")
DEFAULT_DRAIN_TIMEOUT_S = 120.0


class DrainState:
    """Pure bookkeeping of one engine's drain (unit-tested without a server)."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        self.started_at: float | None = None
        self.reason: str | None = None
        self.in_flight = 0
        self.refused = 0
        self.handed_over = False

    @property
    def draining(self) -> bool:
        return self.started_at is not None

    def start(self, reason: str) -> bool:
        """Begin draining; False if it had already begun."""
        if self.started_at is not None:
            return False
        self.started_at, self.reason = self._clock(), reason
        return True

    def admit(self) -> bool:
        """A new request: True (counted in flight) unless draining (counted refused)."""
        if self.draining:
            self.refused += 1
            return False
        self.in_flight += 1
        return True

    def done(self) -> None:
        self.in_flight -= 1

    def remaining_s(self) -> float:
        if self.started_at is None:
            return self.timeout_s
        return max(0.0, self.timeout_s - (self._clock() - self.started_at))

    def as_json(self) -> dict[str, Any]:
        return {
            "draining": self.draining,
            "reason": self.reason,
            "in_flight": self.in_flight,
            "refused": self.refused,
            "handed_over_to_vllm_shutdown": self.handed_over,
            "remaining_s": round(self.remaining_s(), 3),
            "timeout_s": self.timeout_s,
        }


def drain_timeout_from_argv(argv: list[str] | None = None) -> float:
    """``drain_timeout`` from this process's ``--kv-transfer-config`` (API server side).

    The API server has no connector instance; the middleware reads the same
    JSON the engine was started with. Bad or missing values fall back to the
    default: the connector validates the key itself and refuses to start.
    """
    extra = extra_config_from_argv(sys.argv if argv is None else argv) or {}
    try:
        value = float(extra.get("drain_timeout", DEFAULT_DRAIN_TIMEOUT_S))
    except (ValueError, TypeError):
        return DEFAULT_DRAIN_TIMEOUT_S
    return value if value >= 0 else DEFAULT_DRAIN_TIMEOUT_S


class DrainMiddleware:
    """Raw ASGI middleware: refuse new work while draining, then hand over to vLLM."""

    def __init__(self, app: ASGIApp, timeout_s: float | None = None,
                 hand_over: Callable[[], None] | None = None) -> None:
        self.app = app
        self.state = DrainState(drain_timeout_from_argv() if timeout_s is None
                                else timeout_s)
        if timeout_s is None:
            # In vLLM's API server: its patches, once per process (what this
            # middleware relies on is probed there: SIGINT, argv).
            from vllm_pd_ext.compat import patches

            patches.apply_once(patches.Process.API_SERVER)
        # What ends the process once drained: vLLM's own SIGINT/SIGTERM handler.
        self._hand_over = hand_over or (lambda: os.kill(os.getpid(), signal.SIGINT))
        self._installed = False
        self._task: asyncio.Task[None] | None = None
        self._app: Any = None  # the Starlette app, for its engine client

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._app is None:
            self._app = scope.get("app")
        if scope["type"] == "lifespan":
            self._install_sigterm()
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self._install_sigterm()
        path, method = scope.get("path", ""), scope.get("method", "GET")
        if path == DRAIN_PATH:
            if method == "POST":
                self.begin("POST /pd/drain")
                await _json(send, 202, self.state.as_json())
            else:
                await _json(send, 200, self.state.as_json())
            return
        if path == READY_PATH:
            await _json(send, 503 if self.state.draining else 200, self.state.as_json())
            return
        if method != "POST":
            await self.app(scope, receive, self._marking(send) if self.state.draining else send)
            return
        if not self.state.admit():
            await _json(send, 503, {"error": {
                "message": ("engine is draining (shutting down): it takes no new requests; "
                            "retry on another engine"),
                "type": "draining", "code": 503}},
                extra=[(b"retry-after", b"1")])
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.done()

    def _marking(self, send: Send) -> Send:
        async def marked(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = [*message.get("headers", []), DRAINING_HEADER]
            await send(message)
        return marked

    # ---------------------------------------------------------------- drain
    def begin(self, reason: str) -> None:
        if not self.state.start(reason):
            return
        logger.warning("PDConnector drain started (%s): refusing new requests, %d in flight, "
                       "timeout %.0f s", reason, self.state.in_flight, self.state.timeout_s)
        self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        while self.state.in_flight > 0 and self.state.remaining_s() > 0:
            await asyncio.sleep(0.05)
        if self.state.in_flight > 0:
            logger.warning("PDConnector drain: %d request(s) still in flight after %.0f s; "
                           "shutting down anyway", self.state.in_flight, self.state.timeout_s)
        else:
            logger.info("PDConnector drain: every admitted request answered; vLLM's shutdown "
                        "now waits for the connector's leases (up to %.0f s)",
                        self.state.remaining_s())
        self._give_vllm_a_window()
        self.state.handed_over = True
        self._hand_over()

    def _give_vllm_a_window(self) -> None:
        """The API server's own shutdown must wait for the EngineCore's drain
        (with vLLM's default 0 it kills the EngineCore at once)."""
        client = getattr(getattr(self._app, "state", None), "engine_client", None)
        config = getattr(client, "vllm_config", None)
        if config is None:
            return
        try:
            from vllm_pd_ext.compat.engine import ensure_drain_window

            ensure_drain_window(config, self.state.timeout_s)
        except Exception:  # never let the hint block the shutdown itself
            logger.exception("PDConnector drain: could not set vLLM's shutdown window")

    def _install_sigterm(self) -> None:
        if self._installed:
            return
        self._installed = True
        try:
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGTERM, self.begin, "SIGTERM")
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            # Not the main thread's loop (e.g. a test client): the admin call still works.
            logger.warning("PDConnector drain: SIGTERM handler not installed (%s)", exc)


async def _json(send: Send, status: int, body: Any,
                extra: list[tuple[bytes, bytes]] | None = None) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(data)).encode())]
    if status == 503 or (isinstance(body, dict) and body.get("draining")):
        headers.append(DRAINING_HEADER)
    headers += extra or []
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
