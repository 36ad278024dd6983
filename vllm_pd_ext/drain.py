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
default 120 s): the hand-over gives vLLM only what step 2 left of it (at
least 1 s), and after that the engine exits whatever is left, as vLLM would.

With a shared secret configured, ``POST /pd/drain`` needs the drain token
(``drain_auth.py``): 401 without it. ``GET /pd/drain`` and ``/pd/ready``
stay open (probes read them).

With several API servers (``vllm serve --api-server-count N``) the process
that gets SIGTERM is vLLM's parent of them all; the plugin gives it the
drain window (``compat/serve_parent.py``) and it sends SIGTERM to each API
server (each drains as above) and then to the EngineCores. A ``POST
/pd/drain`` reaches one API server of N: it sends SIGTERM to that parent, so
the whole engine drains; where the parent would kill at once instead, it
answers 409 and drains nothing (docs/deployment.md).

Lifecycle: one middleware per API server process (the state is per
instance; vLLM builds the app once). The SIGTERM handler is installed on the
server's event loop at lifespan start-up, replacing vLLM's own, which it
calls (through SIGINT, which vLLM handles identically) once step 2 is done.
Only vLLM's API server (``timeout_s`` from argv) and ``VllmSide`` (the
hand-over, the API-server count, the parent) import vLLM (through ``compat``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from vllm_pd_ext.config import extra_config_from_argv
from vllm_pd_ext.drain_auth import drain_auth_problem
from vllm_pd_ext.log import get_logger

if TYPE_CHECKING:
    from vllm_pd_ext.wire.auth import Keyring

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
#: Seconds between two log lines about refused drain calls (a flood logs one).
REFUSED_LOG_EVERY_S = 10.0


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


def handover_window_s(remaining_s: float, timeout_s: float) -> int:
    """The shutdown window vLLM gets at the hand-over: what is left of the
    drain, in whole seconds rounded down (so the drain stays within
    ``drain_timeout``), at least 1 s; 0 (vLLM's abort-at-once) when the
    drain is off (``drain_timeout`` 0)."""
    if timeout_s <= 0:
        return 0
    return max(1, int(remaining_s))


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


class VllmSide:
    """What the middleware asks of vLLM, through ``compat`` (imported on
    first use, so this module stays pure); tests pass a fake."""

    def set_window(self, vllm_config: Any, seconds: int) -> int:
        """vLLM's shutdown window for this API server's engine client."""
        from vllm_pd_ext.compat.engine import ensure_drain_window

        return ensure_drain_window(vllm_config, seconds)

    def api_servers(self, vllm_config: Any) -> tuple[int, int]:
        """(API servers sharing this engine, this one's index)."""
        from vllm_pd_ext.compat.serve_parent import api_servers

        return api_servers(vllm_config)

    def parent_drains(self, vllm_config: Any) -> bool:
        from vllm_pd_ext.compat.serve_parent import parent_drains

        return parent_drains(vllm_config)

    def sigterm_parent(self) -> int | None:
        from vllm_pd_ext.compat.serve_parent import sigterm_vllm_parent

        return sigterm_vllm_parent()


class DrainMiddleware:
    """Raw ASGI middleware: refuse new work while draining, then hand over to vLLM."""

    def __init__(self, app: ASGIApp, timeout_s: float | None = None,
                 hand_over: Callable[[], None] | None = None, *,
                 clock: Callable[[], float] = time.monotonic,
                 keyring: Keyring | None = None, vllm: VllmSide | None = None) -> None:
        self.app = app
        in_server = timeout_s is None
        self.state = DrainState(drain_timeout_from_argv() if timeout_s is None
                                else timeout_s, clock)
        #: With a secret, POST /pd/drain needs the drain token (drain_auth.py).
        self.keyring = keyring
        #: In vLLM's server the secret is read from its parsed config at the
        #: first POST /pd/drain (``leg_auth.resolve``: the app state is set by then).
        self._keyring_unresolved = in_server
        self.vllm = vllm or VllmSide()
        if in_server:
            # In vLLM's API server: its patches, once per process (what this
            # middleware relies on is probed there: SIGINT, argv).
            from vllm_pd_ext.compat import patches

            patches.apply_once(patches.Process.API_SERVER)
        # What ends the process once drained: vLLM's own SIGINT/SIGTERM handler.
        self._hand_over = hand_over or (lambda: os.kill(os.getpid(), signal.SIGINT))
        self._installed = False
        self._task: asyncio.Task[None] | None = None
        self._app: Any = None  # the Starlette app, for its engine client
        self._refused_logged_at = -1e9

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._app is None:
            self._app = scope.get("app")
        if scope["type"] == "lifespan":
            self._install_sigterm()
            self._check_api_servers()
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self._install_sigterm()
        path, method = scope.get("path", ""), scope.get("method", "GET")
        if path == DRAIN_PATH:
            if method == "POST":
                await self._post_drain(scope, send)
            else:
                await _json(send, 200, self._status())
            return
        if path == READY_PATH:
            await _json(send, 503 if self.state.draining else 200, self._status())
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

    def _vllm_config(self) -> Any:
        client = getattr(getattr(self._app, "state", None), "engine_client", None)
        return getattr(client, "vllm_config", None)

    def _api_servers(self) -> tuple[int, int]:
        config = self._vllm_config()
        return (1, 0) if config is None else self.vllm.api_servers(config)

    def _status(self) -> dict[str, Any]:
        status = self.state.as_json()
        count, rank = self._api_servers()
        if count > 1:
            status.update(api_server=rank, api_servers=count)
        return status

    # ------------------------------------------------------------ POST /pd/drain
    async def _post_drain(self, scope: Scope, send: Send) -> None:
        if self._keyring_unresolved:
            self._keyring_unresolved = False
            self.keyring = _resolve_keyring(scope.get("app"))
        problem = drain_auth_problem(self.keyring, scope.get("headers", []))
        if problem is not None:
            self._log_refused(scope, problem)
            await _json(send, 401, {"error": {"message": f"POST /pd/drain refused: {problem}",
                                              "type": "unauthenticated", "code": 401}},
                        extra=[(b"www-authenticate", b'Bearer realm="pd-drain"')])
            return
        count, rank = self._api_servers()
        if count > 1 and not self.state.draining:
            refusal = self._drain_every_api_server(count, rank)
            if refusal is not None:
                await _json(send, 409, {"error": {"message": refusal,
                                                  "type": "drain_unavailable", "code": 409}})
                return
        self.begin("POST /pd/drain")
        await _json(send, 202, self._status())

    def _drain_every_api_server(self, count: int, rank: int) -> str | None:
        """This API server is one of ``count``: have vLLM's parent drain them
        all (SIGTERM to it). Why it cannot, or None once asked."""
        if not self.vllm.parent_drains(self._vllm_config()):
            refusal = (f"this engine runs {count} API servers (--api-server-count) and vLLM's "
                       "parent process would kill them and the engine at once "
                       "(--shutdown-timeout 0): POST /pd/drain would drain 1 of them. Start "
                       "it with `vllm serve` and --middleware vllm_pd_ext.drain.DrainMiddleware "
                       "(the plugin sets the window), or pass --shutdown-timeout; nothing "
                       "was drained")
        else:
            pid = self.vllm.sigterm_parent()
            if pid is not None:
                logger.warning("PDConnector drain: POST /pd/drain on API server %d of %d: "
                               "SIGTERM sent to vLLM's parent process (pid %d), which drains "
                               "every API server and then the engine", rank, count, pid)
                return None
            refusal = (f"this API server is one of {count} but has no vLLM parent process "
                       "to drain them all; nothing was drained")
        logger.error("PDConnector drain: POST /pd/drain refused with 409: %s", refusal)
        return refusal

    def _log_refused(self, scope: Scope, problem: str) -> None:
        now = time.monotonic()
        if now - self._refused_logged_at >= REFUSED_LOG_EVERY_S:
            self._refused_logged_at = now
            client = scope.get("client") or ("?", 0)
            logger.warning("PDConnector drain: refused POST /pd/drain from %s with 401: %s",
                           client[0], problem)

    def _check_api_servers(self) -> None:
        """At start-up: say so if SIGTERM cannot drain (several API servers
        under a parent that would kill them at once)."""
        config = self._vllm_config()
        if config is None:
            return
        count, rank = self.vllm.api_servers(config)
        if count > 1 and rank == 0 and not self.vllm.parent_drains(config):
            logger.warning("PDConnector drain: %d API servers and --shutdown-timeout 0: "
                           "SIGTERM to vLLM's parent kills them and the engine at once, and "
                           "POST /pd/drain is refused (409); see docs/deployment.md", count)

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
        window = handover_window_s(self.state.remaining_s(), self.state.timeout_s)
        if self.state.in_flight > 0:
            logger.warning("PDConnector drain: %d request(s) still in flight after %.0f s; "
                           "shutting down anyway", self.state.in_flight, self.state.timeout_s)
        else:
            logger.info("PDConnector drain: every admitted request answered; vLLM's shutdown "
                        "now waits for the connector's leases (up to %d s)", window)
        self._give_vllm_a_window(window)
        self.state.handed_over = True
        self._hand_over()

    def _give_vllm_a_window(self, window: int) -> None:
        """The API server's own shutdown must wait for the EngineCore's drain
        (with vLLM's default 0 it kills the EngineCore at once), but only for
        what is left of ``drain_timeout``."""
        config = self._vllm_config()
        if config is None or window <= 0:
            return
        try:
            self.vllm.set_window(config, window)
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


def _resolve_keyring(app: Any) -> Keyring | None:
    """The secret the connector and ``LegAuthMiddleware`` use (vLLM's parsed
    config, else argv, else the environment); imported here, as that module
    imports this one."""
    from vllm_pd_ext import leg_auth

    return leg_auth.resolve(app)[0]


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
