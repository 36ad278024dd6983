"""Refuse unsigned legs at the API server with a 4xx (ASGI middleware).

Role: with a shared secret configured (``auth_secret_file`` /
``auth_secret_env``), an engine acts on ``kv_transfer_params`` that ask for
a KV handoff (``do_remote_prefill`` on D, ``do_remote_decode`` on P) only
when ``vllm-pd-proxy`` signed them for this request id and this prompt
(``auth.sign_leg``). Started with
``vllm serve ... --middleware vllm_pd_ext.leg_auth.LegAuthMiddleware`` (the
engines in ``testing/engines.py`` add it). A refused leg gets 401 (unsigned,
unknown key, stale, bad signature) or 403 (signed for another prompt or
request id), with a JSON error naming the reason, and never reaches the
engine. Requests without handoff flags pass untouched, as does everything
when no secret is configured.

The EngineCore checks the signature's MAC again (``PDScheduler``), so an
engine started without this middleware still never hands over or loads KV
for an unsigned leg; the middleware is what turns that into a clear 4xx.

Lifecycle: one instance per API server process, built by vLLM with the app;
it reads the secret once, from the same ``--kv-transfer-config`` the
connector gets. Only a POST whose body can decode to ``kv_transfer_params``
(its bytes, or any ``\\u`` escape that could spell them) is parsed; the
body is then handed on unchanged.
"""

from __future__ import annotations

import json
import sys
import time

from vllm_pd_ext.config import ConfigError, PDConfig, extra_config_from_argv
from vllm_pd_ext.drain import ASGIApp, Message, Receive, Scope, Send
from vllm_pd_ext.log import get_logger
from vllm_pd_ext.wire import auth

logger = get_logger(__name__)

#: Larger bodies are refused before they are buffered (the proxy's default
#: --max-request-bytes is 64 MiB).
MAX_BODY_BYTES = 256 << 20
_MARKER = b"kv_transfer_params"
#: A JSON ``\uXXXX`` escape: a key spelled with one (``"kv_transfer\u005fparams"``)
#: decodes to ``kv_transfer_params`` without its bytes in the body.
_ESCAPE = b"\\u"


def may_carry_params(body: bytes) -> bool:
    """Whether ``body`` can decode to an object with ``kv_transfer_params``
    (cheap: most requests skip the parse). Only a ``\\u`` escape can spell
    the key without its bytes (none of its characters has another JSON
    escape), so a body with neither is parsed by no one here."""
    return _MARKER in body or _ESCAPE in body


def keyring_from_argv(argv: list[str] | None = None) -> tuple[auth.Keyring | None, float]:
    """The secret(s) and window of this engine's ``--kv-transfer-config``."""
    extra = extra_config_from_argv(sys.argv if argv is None else argv)
    if extra is None:
        return None, auth.DEFAULT_WINDOW_S
    try:
        cfg = PDConfig.from_extra_config(extra)
        return cfg.load_keyring(), cfg.auth_window_s
    except ConfigError as exc:
        # The connector refuses to start with the same message; until then
        # refuse every leg rather than accept unsigned ones.
        logger.error("PDConnector leg auth: %s; every leg is refused", exc)
        return _REFUSE_ALL, auth.DEFAULT_WINDOW_S


#: A keyring no signature can match (the configured secret could not be read).
_REFUSE_ALL = auth.Keyring("00000000", {}, "an unreadable secret")


def check_leg(keyring: auth.Keyring, body: bytes, request_id: str, now: float,
              window_s: float) -> auth.AuthError | None:
    """Why this request body's leg must be refused; None if it may pass.

    Bodies that are not JSON objects, or carry no handoff flags, pass: vLLM
    (or the connector) reports those problems itself.
    """
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    params = data.get("kv_transfer_params") if isinstance(data, dict) else None
    if not isinstance(params, dict) or not (params.get("do_remote_prefill")
                                            or params.get("do_remote_decode")):
        return None
    try:
        auth.verify_leg(keyring, params, request_id=request_id, body=data, now=now,
                        window_s=window_s)
    except auth.AuthError as exc:
        return exc
    return None


class LegAuthMiddleware:
    """Raw ASGI middleware: 401/403 for a handoff leg the proxy did not sign."""

    def __init__(self, app: ASGIApp, keyring: auth.Keyring | None = None,
                 window_s: float | None = None, from_argv: bool = True) -> None:
        self.app = app
        if keyring is None and from_argv:
            keyring, argv_window = keyring_from_argv()
            window_s = argv_window if window_s is None else window_s
        self.keyring = keyring
        self.window_s = auth.DEFAULT_WINDOW_S if window_s is None else window_s
        self.num_refused = 0
        self._logged_at = -1e9
        if from_argv:
            # In vLLM's API server: its patches (streamed answers carry D's
            # kv_transfer_params for multi-turn), once per process.
            from vllm_pd_ext.compat import patches

            patches.apply_once(patches.Process.API_SERVER)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (self.keyring is None or scope["type"] != "http"
                or scope.get("method") != "POST"):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                await _error(send, 413, f"request body larger than {MAX_BODY_BYTES} bytes",
                             "request_too_large")
                return
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        if may_carry_params(body):
            rid = _header(scope, b"x-request-id")
            problem = check_leg(self.keyring, body, rid, time.time(), self.window_s)
            if problem is not None:
                self._refused(scope, problem)
                await _error(send, problem.status, f"unauthenticated leg: {problem.reason}",
                             "unauthenticated" if problem.status == 401 else "forbidden")
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _refused(self, scope: Scope, problem: auth.AuthError) -> None:
        self.num_refused += 1
        now = time.monotonic()
        if now - self._logged_at >= 10.0:  # one line per 10 s under a flood
            self._logged_at = now
            client = scope.get("client") or ("?", 0)
            logger.warning("PDConnector: refused a leg from %s with %d (%d refused so far): %s",
                           client[0], problem.status, self.num_refused, problem.reason)


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return ""


async def _error(send: Send, status: int, message: str, err_type: str) -> None:
    data = json.dumps({"error": {"message": message, "type": err_type,
                                 "param": "kv_transfer_params", "code": status}}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
