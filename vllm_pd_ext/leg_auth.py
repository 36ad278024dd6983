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
engine. Requests without ``kv_transfer_params`` pass untouched, as does
everything when no secret is configured.

The EngineCore checks the signature again (``PDScheduler``: its MAC, the
window, and that it was not used by another request), so an engine started
without this middleware still never hands over or loads KV for an unsigned
or replayed leg; the middleware is what turns that into a clear 4xx.

Every field of ``kv_transfer_params`` is privileged (a handoff either way,
``pd_bidirectional``'s kept turn, a read-back): any non-empty params must
be signed. A signed leg with a batch of prompts gets 400 naming ``prompt``
(vLLM would run every prompt with the one leg), and a body giving a key
such as ``kv_transfer_params`` twice gets 400 (parsers differ on which
copy wins). The body is parsed, never matched as bytes, whenever it could
decode to the key (its bytes, or any ``\\u`` escape that could spell it).

Lifecycle: one instance per API server process, built by vLLM with the app;
at its first request it reads the secret from vLLM's parsed config
(``app.state.vllm_config``: every command-line form, ``--config`` files
too), else from the JSON on the command line, else from the environment
(with an ERROR: a secret exists but no config was found). The body is then
handed on unchanged.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from typing import Any

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
    """The secret(s) and window of this engine's ``--kv-transfer-config``
    (the plain JSON form; ``resolve`` reads what vLLM parsed)."""
    extra = extra_config_from_argv(sys.argv if argv is None else argv)
    if extra is None:
        return None, auth.DEFAULT_WINDOW_S
    return _from_extra(extra)


def _from_extra(extra: dict[str, Any]) -> tuple[auth.Keyring | None, float]:
    try:
        cfg = PDConfig.from_extra_config(extra)
        return cfg.load_keyring(), cfg.auth_window_s
    except ConfigError as exc:
        # The connector refuses to start with the same message; until then
        # refuse every leg rather than accept unsigned ones.
        logger.error("PDConnector leg auth: %s; every leg is refused", exc)
        return _REFUSE_ALL, auth.DEFAULT_WINDOW_S


def resolve(app: Any, environ: Mapping[str, str] | None = None
            ) -> tuple[auth.Keyring | None, float]:
    """This API server's secret(s) and window: from vLLM's parsed config
    (``app``: the server's app, ``scope["app"]``), else the JSON on the
    command line, else the environment. A secret found only in the
    environment is used, with an ERROR: an engine whose EngineCore has the
    secret must never pass unsigned legs because its command line was
    spelled in a form this could not read."""
    from vllm_pd_ext.compat.serving import kv_extra_config_of

    extra = kv_extra_config_of(app)
    if extra is None:
        extra = extra_config_from_argv(sys.argv)
    if extra is not None:
        return _from_extra(extra)
    try:
        keyring = auth.Keyring.load(None, None, environ)
    except auth.SecretError as exc:
        logger.error("PDConnector leg auth: %s; every leg is refused", exc)
        return _REFUSE_ALL, auth.DEFAULT_WINDOW_S
    if keyring is not None:
        logger.error("PDConnector leg auth: found no kv_transfer_config for this API server, "
                     "but %s holds a shared secret: checking every leg with it (pass "
                     "--kv-transfer-config to the engine, or unset the variable)",
                     auth.DEFAULT_SECRET_ENV)
    return keyring, auth.DEFAULT_WINDOW_S


#: A keyring no signature can match (the configured secret could not be read).
_REFUSE_ALL = auth.Keyring("00000000", {}, "an unreadable secret")
#: Keys a body may carry once: a second copy must not decide what the
#: engine sees after this check saw the first (parsers differ on duplicates).
_SINGLE_KEYS = frozenset({"kv_transfer_params", "prompt", "messages", "input", "instructions",
                          "n", "best_of"})


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out and key in _SINGLE_KEYS:
            raise _Duplicate(key)
        out[key] = value
    return out


class _Duplicate(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def batch_size(prompt: Any) -> int:
    """How many prompts a completions ``prompt`` holds (a list of strings or
    of token-id lists is a batch; one string or one token-id list is one)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        return len(prompt)
    return 1


def check_leg(keyring: auth.Keyring, body: bytes, request_id: str, now: float,
              window_s: float) -> auth.AuthError | None:
    """Why this request body's leg must be refused; None if it may pass.

    Any ``kv_transfer_params`` that ask for anything (every field of them
    is privileged: a handoff either way, a kept turn, a read-back) must be
    signed for this request id and prompt, inside the window. Bodies that
    are not JSON objects, or carry no params, pass: vLLM reports those
    problems itself.
    """
    try:
        data = json.loads(body, object_pairs_hook=_no_duplicates)
    except _Duplicate as dup:
        return auth.AuthError(f"the body gives {dup.key!r} more than once", status=400,
                              param=dup.key)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    params = data.get("kv_transfer_params")
    if params is None or params == {}:
        return None
    if not isinstance(params, dict):
        return auth.AuthError("kv_transfer_params must be a JSON object", status=400)
    try:
        auth.verify_leg(keyring, params, request_id=request_id, body=data, now=now,
                        window_s=window_s)
    except auth.AuthError as exc:
        return exc
    if (n := batch_size(data.get("prompt"))) > 1:
        # vLLM would run every prompt with this one leg: K leases for one
        # answer. The proxy sends each prompt as a handoff of its own.
        return auth.AuthError(f"prompt: a handoff leg takes one prompt, this body has a batch "
                              f"of {n} (send each as its own request; vllm-pd-proxy does)",
                              status=400, param="prompt")
    return None


class LegAuthMiddleware:
    """Raw ASGI middleware: 401/403 for a handoff leg the proxy did not sign."""

    def __init__(self, app: ASGIApp, keyring: auth.Keyring | None = None,
                 window_s: float | None = None, from_argv: bool = True,
                 lazy: bool | None = None) -> None:
        self.app = app
        self.keyring = keyring
        self.window_s = auth.DEFAULT_WINDOW_S if window_s is None else window_s
        #: Whether the secret is still to be read from vLLM's parsed config
        #: (at the first request: the app's state is set only by then).
        self._unresolved = (keyring is None and from_argv) if lazy is None else lazy
        self.num_refused = 0
        self._logged_at = -1e9
        if from_argv:
            # In vLLM's API server: its patches (streamed answers carry D's
            # kv_transfer_params for multi-turn), once per process.
            from vllm_pd_ext.compat import patches

            patches.apply_once(patches.Process.API_SERVER)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._unresolved and scope["type"] == "http":
            self._unresolved = False
            self.keyring, self.window_s = resolve(scope.get("app"))
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
                await _error(send, problem.status, _message(problem), _TYPES[problem.status],
                             problem.param)
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


_TYPES = {400: "invalid_request_error", 401: "unauthenticated", 403: "forbidden"}


def _message(problem: auth.AuthError) -> str:
    return problem.reason if problem.status == 400 else f"unauthenticated leg: {problem.reason}"


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return ""


async def _error(send: Send, status: int, message: str, err_type: str,
                 param: str = "kv_transfer_params") -> None:
    data = json.dumps({"error": {"message": message, "type": err_type,
                                 "param": param, "code": status}}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
