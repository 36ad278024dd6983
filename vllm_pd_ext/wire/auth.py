"""Shared-secret authentication of the control plane (pure: hashlib, hmac, msgspec).

Role: one module both sides of every authenticated hop import:

* **Side-channel frames** (``FrameAuth``): every request an engine sends to
  another engine's side channel travels as two zmq frames, a ``FrameHeader``
  (key id, timestamp, nonce, HMAC-SHA256) and the message; the server
  verifies the MAC, the timestamp window and that the nonce is new before
  the message is even decoded, and signs its reply over the request's nonce,
  so a reply cannot be replayed onto another request either.
* **Legs** (``sign_leg`` / ``verify_leg``): the proxy signs the
  ``kv_transfer_params`` it sends to P and D (``pd_sig``), binding them to
  the request id and to a digest of the prompt; the engines' API servers
  refuse an unsigned or mis-signed leg with a 4xx (``leg_auth.py``), and the
  connector re-checks the MAC in the EngineCore.

Keys: a ``Keyring`` is one or more secrets (comma- or newline-separated,
each at least ``MIN_SECRET_LEN`` characters) from the environment variable
or file that ``kv_connector_extra_config`` *names*: vLLM logs that config,
so the secret itself never appears in it. The first secret signs; all of
them verify. A key id (``key_id``) is derived from each secret, so two
engines or a proxy mid-rotation agree on which key a frame names without
the secret ever being sent (docs/security.md: rotation in three steps).

Lifecycle: a ``Keyring`` is loaded once per process at startup and never
changes (rotation restarts the processes one by one); a ``FrameAuth`` per
side-channel server holds the replay cache (nonces seen inside the window),
which only frames with a valid MAC can enter, so an unauthenticated flood
cannot grow it.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import re
import threading
import time
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Final

import msgspec

from vllm_pd_ext.log import get_logger

logger = get_logger(__name__)

#: The environment variable read when ``auth_secret_env`` is not set.
DEFAULT_SECRET_ENV: Final = "VLLM_PD_AUTH_SECRET"
MIN_SECRET_LEN: Final = 16
MAX_SECRETS: Final = 8
MAX_SECRET_FILE_BYTES: Final = 64 << 10
#: Seconds a frame's or a leg's timestamp may differ from the receiver's clock.
DEFAULT_WINDOW_S: Final = 30.0
#: Nonces remembered at most (only frames with a valid MAC are remembered).
MAX_NONCES: Final = 1 << 20
NONCE_BYTES: Final = 16
#: The ``kv_transfer_params`` key carrying the proxy's signature.
LEG_FIELD: Final = "pd_sig"
#: The ``kv_transfer_params`` key carrying P's digest of the prompt's token ids.
PROMPT_DIGEST_FIELD: Final = "remote_prompt_digest"

_FRAME_TAG: Final = b"vllm-pd-ext frame v1\0"
_REPLY_TAG: Final = b"vllm-pd-ext reply v1\0"
_LEG_TAG: Final = b"vllm-pd-ext leg v1\0"
_KID_TAG: Final = b"vllm-pd-ext key id\0"


class AuthError(Exception):
    """A frame or a leg failed authentication; ``reason`` names why.

    ``status`` is the HTTP status a leg refusal answers with: 401 when the
    signature is missing, unknown, stale or does not match; 403 when it is
    valid but was made for another prompt or request.
    """

    def __init__(self, reason: str, status: int = 401,
                 param: str = "kv_transfer_params") -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        #: The request field a leg refusal names (OpenAI's ``error.param``).
        self.param = param


class SecretError(ValueError):
    """The configured secret cannot be used (missing file, too short, ...)."""


def key_id(secret: bytes) -> str:
    """The public name of a secret: 8 hex digits of a tagged SHA-256."""
    return hashlib.sha256(_KID_TAG + secret).hexdigest()[:8]


@dataclass(frozen=True)
class Keyring:
    """The secrets this process accepts; ``signing_kid`` names the one it signs with."""

    signing_kid: str
    keys: Mapping[str, bytes]
    source: str

    @property
    def signing_key(self) -> bytes:
        return self.keys[self.signing_kid]

    @classmethod
    def parse(cls, text: str, source: str) -> Keyring:
        """Secrets separated by commas or newlines; the first one signs."""
        secrets = [s.strip() for s in re.split(r"[,\r\n]", text) if s.strip()]
        if not secrets:
            raise SecretError(f"{source} holds no secret")
        if len(secrets) > MAX_SECRETS:
            raise SecretError(f"{source} holds {len(secrets)} secrets; at most {MAX_SECRETS}")
        keys: dict[str, bytes] = {}
        for i, secret in enumerate(secrets):
            if len(secret) < MIN_SECRET_LEN:
                # Never echo the secret, not even its beginning.
                raise SecretError(f"{source}: secret #{i + 1} has {len(secret)} characters; "
                                  f"at least {MIN_SECRET_LEN} are needed")
            keys.setdefault(key_id(secret.encode()), secret.encode())
        return cls(key_id(secrets[0].encode()), keys, source)

    @classmethod
    def load(cls, env_name: str | None, file_path: str | None,
             environ: Mapping[str, str] | None = None) -> Keyring | None:
        """The keyring from ``file_path`` if given (it must be readable), else
        from the environment variable ``env_name``; None when neither is set."""
        if file_path:
            path = Path(file_path)
            try:
                with path.open("rb") as f:
                    _check_mode(file_path, os.fstat(f.fileno()))
                    data = f.read(MAX_SECRET_FILE_BYTES + 1)
            except OSError as exc:
                raise SecretError(f"auth_secret_file {file_path}: {exc.strerror or exc}") from None
            if len(data) > MAX_SECRET_FILE_BYTES:
                raise SecretError(f"auth_secret_file {file_path} is larger than "
                                  f"{MAX_SECRET_FILE_BYTES} bytes")
            try:
                text = data.decode()
            except UnicodeDecodeError:
                raise SecretError(f"auth_secret_file {file_path} is not UTF-8 text") from None
            return cls.parse(text, f"auth_secret_file {file_path}")
        environ = os.environ if environ is None else environ
        name = env_name or DEFAULT_SECRET_ENV
        text = environ.get(name, "")
        if not text.strip():
            return None
        return cls.parse(text, f"environment variable {name}")

    def describe(self) -> str:
        """For logs: where the keys come from and their ids, never a secret."""
        others = sorted(k for k in self.keys if k != self.signing_kid)
        extra = f", also accepting {', '.join(others)}" if others else ""
        return f"{self.source}: signing with key {self.signing_kid}{extra}"


def _check_mode(file_path: str, st: os.stat_result) -> None:
    """Refuse a secret file anyone may write (anyone could then choose the
    secret); warn when its group may write it or others may read it
    (Kubernetes mounts secrets 0644 by default, and a umask of 002 makes
    files group-writable, so those alone are not refused)."""
    mode = st.st_mode & 0o777
    if mode & 0o002:
        raise SecretError(f"auth_secret_file {file_path} is writable by others (mode "
                          f"{mode:o}): chmod 600 it")
    if mode & 0o064:
        who = "writable by its group" if mode & 0o020 else (
            "readable by others" if mode & 0o004 else "readable by its group")
        logger.warning("auth_secret_file %s is %s (mode %o): chmod 600 it (or 0400 via "
                       "the Secret's defaultMode)", file_path, who, mode)


# --------------------------------------------------------------------------
# Side-channel frames
# --------------------------------------------------------------------------


class FrameHeader(msgspec.Struct, frozen=True, array_like=True):
    """The first of an authenticated frame's two parts."""

    kid: Annotated[str, msgspec.Meta(max_length=64)]
    #: Sender's wall clock, milliseconds since the epoch.
    ts_ms: int
    nonce: Annotated[bytes, msgspec.Meta(max_length=64)]
    mac: Annotated[bytes, msgspec.Meta(max_length=64)]


_header_decoder = msgspec.msgpack.Decoder(FrameHeader)
_header_encoder = msgspec.msgpack.Encoder()
#: Largest header frame accepted before decoding it.
MAX_HEADER_BYTES: Final = 256


@functools.lru_cache(maxsize=4 * MAX_SECRETS)
def _keyed(key: bytes) -> hmac.HMAC:
    """The HMAC state after the key (its two padded blocks): copied per MAC,
    which skips the key setup and the digest lookup on the hot path."""
    return hmac.new(key, digestmod=hashlib.sha256)


def _mac(key: bytes, *parts: bytes) -> bytes:
    h = _keyed(key).copy()
    for part in parts:
        h.update(part)
    return h.digest()


class FrameAuth:
    """Signs and verifies side-channel frames with one ``Keyring``.

    Thread-safe: a server's single thread verifies, any number of client
    threads sign. ``clock`` is the wall clock (timestamps cross hosts: the
    window tolerates ``window_s`` of skew, so hosts need NTP).
    """

    def __init__(self, keyring: Keyring, window_s: float = DEFAULT_WINDOW_S,
                 clock: Callable[[], float] = time.time, max_nonces: int = MAX_NONCES) -> None:
        self.keyring = keyring
        self.window_s = window_s
        self._clock = clock
        self._max_nonces = max_nonces
        #: Nonce (or leg MAC) -> (when, our clock, a replay of it could no
        #: longer pass the window; the request group that used it).
        self._seen: dict[bytes, tuple[float, str]] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------ requests
    def sign_request(self, body: bytes) -> tuple[bytes, bytes]:
        """(header frame, nonce) for ``body``; keep the nonce to verify the reply."""
        kr = self.keyring
        nonce = os.urandom(NONCE_BYTES)
        ts_ms = int(self._clock() * 1000)
        mac = _mac(kr.signing_key, _FRAME_TAG, kr.signing_kid.encode(), b"\0",
                   ts_ms.to_bytes(8, "big", signed=True), nonce, body)
        return _header_encoder.encode(FrameHeader(kr.signing_kid, ts_ms, nonce, mac)), nonce

    def verify_request(self, header: bytes, body: bytes) -> bytes:
        """The request's nonce; raises ``AuthError`` (nothing is remembered then)."""
        hdr = _decode_header(header)
        key = self.keyring.keys.get(hdr.kid)
        if key is None:
            raise AuthError(f"unknown key id {hdr.kid[:16]!r} (not one of this engine's "
                            "secrets: a wrong or rotated-out secret)")
        if len(hdr.nonce) != NONCE_BYTES:
            raise AuthError("malformed nonce")
        expect = _mac(key, _FRAME_TAG, hdr.kid.encode(), b"\0",
                      hdr.ts_ms.to_bytes(8, "big", signed=True), hdr.nonce, body)
        if not hmac.compare_digest(expect, hdr.mac):
            raise AuthError("bad signature (the frame was altered, or signed with another "
                            "secret)")
        now = self._clock()
        skew = hdr.ts_ms / 1000 - now
        if abs(skew) > self.window_s:
            raise AuthError(f"timestamp {skew:+.1f} s off this engine's clock (window "
                            f"{self.window_s:.0f} s): a replay, or clocks out of sync")
        self._remember(hdr.nonce, hdr.ts_ms / 1000, "replayed frame (its nonce was already "
                       "used)")
        return hdr.nonce

    def _forget_expired(self, now: float) -> None:
        # Insertion order is arrival order; expiries are nearly sorted by it
        # (within the skew), so stopping at the first live one is enough.
        seen = self._seen
        while seen:
            nonce, (until, _group) = next(iter(seen.items()))
            if until >= now:
                break
            del seen[nonce]

    def admit_leg(self, params: Mapping[str, Any], group: str) -> None:
        """The EngineCore's check of a request's signed ``kv_transfer_params``:
        a valid MAC, inside the window, and not used before on this engine
        by another client request.

        ``group`` names the client request an engine request belongs to
        (``compat.sibling_group``): the ``n`` children vLLM fans out of one
        request share its params legitimately; any other request with them
        is a replay. A signature the API server let through once cannot pin
        a second lease or take a second kept turn, whatever prompt comes with
        it (the middleware binds it to the prompt and request id; a body
        that slips past it still meets this). Only valid signatures are
        remembered.
        """
        ts, mac = verify_leg(self.keyring, params, now=self._clock(), window_s=self.window_s)
        self._remember(b"leg:" + mac.encode(), ts, "kv_transfer_params were already used "
                       "by another request (a replayed signature)", group)

    def _remember(self, nonce: bytes, ts: float, replayed: str, group: str = "") -> None:
        with self._lock:
            self._forget_expired(self._clock())
            seen = self._seen.get(nonce)
            if seen is not None:
                if group and seen[1] == group:
                    return
                raise AuthError(replayed)
            if len(self._seen) >= self._max_nonces:
                raise AuthError("replay cache full; refused")
            self._seen[nonce] = (ts + self.window_s, group)

    @property
    def num_nonces(self) -> int:
        return len(self._seen)

    # ------------------------------------------------------------ replies
    def sign_reply(self, body: bytes, request_nonce: bytes) -> bytes:
        kr = self.keyring
        mac = _mac(kr.signing_key, _REPLY_TAG, kr.signing_kid.encode(), b"\0",
                   request_nonce, body)
        return _header_encoder.encode(FrameHeader(kr.signing_kid, 0, b"", mac))

    def verify_reply(self, header: bytes, body: bytes, request_nonce: bytes) -> None:
        hdr = _decode_header(header)
        key = self.keyring.keys.get(hdr.kid)
        if key is None:
            raise AuthError(f"the peer signed its reply with unknown key id {hdr.kid[:16]!r}")
        expect = _mac(key, _REPLY_TAG, hdr.kid.encode(), b"\0", request_nonce, body)
        if not hmac.compare_digest(expect, hdr.mac):
            raise AuthError("the peer's reply has a bad signature")


def _decode_header(header: bytes) -> FrameHeader:
    if len(header) > MAX_HEADER_BYTES:
        raise AuthError(f"auth header of {len(header)} bytes (at most {MAX_HEADER_BYTES})")
    try:
        hdr: FrameHeader = _header_decoder.decode(header)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise AuthError(f"malformed auth header: {exc}") from None
    return hdr


# --------------------------------------------------------------------------
# Legs: the proxy's signature over kv_transfer_params
# --------------------------------------------------------------------------

_canonical = msgspec.json.Encoder(order="sorted")


def body_prompt_digest(body: Mapping[str, Any]) -> str:
    """Digest of what a request body asks to be prefilled (``prompt`` and
    ``messages``, whichever it has; a Responses API body's ``input`` and
    ``instructions``): the proxy and the engine's API server compute it from
    the same JSON."""
    fields = {"prompt": body.get("prompt"), "messages": body.get("messages")}
    if "input" in body:  # the Responses API: its input and instructions too
        fields.update(input=body.get("input"), instructions=body.get("instructions"))
    try:
        data = _canonical.encode(fields)
    except (TypeError, msgspec.EncodeError):
        data = repr(tuple(fields.values())).encode()
    return hashlib.sha256(data).hexdigest()[:32]


def token_digest(token_ids: Any) -> str:
    """Digest of a prompt's token ids (P's answer carries it; D compares)."""
    return hashlib.sha256(array("q", token_ids).tobytes()).hexdigest()[:32]


def _rid_digest(request_id: str) -> str:
    return hashlib.sha256(request_id.encode(errors="replace")).hexdigest()[:16]


def _leg_mac(key: bytes, head: str, params: Mapping[str, Any]) -> str:
    unsigned = ({k: v for k, v in params.items() if k != LEG_FIELD} if LEG_FIELD in params
                else params)
    return _mac(key, _LEG_TAG, head.encode(), b"\0", _canonical.encode(unsigned)).hex()


def sign_leg(keyring: Keyring, params: Mapping[str, Any], request_id: str,
             body: Mapping[str, Any], now: float | None = None,
             prompt_digest: str | None = None) -> dict[str, Any]:
    """``params`` plus ``pd_sig``, bound to ``request_id`` and ``body``'s prompt
    (``prompt_digest``: ``body_prompt_digest(body)`` already computed)."""
    ts_ms = int((time.time() if now is None else now) * 1000)
    digest = prompt_digest or body_prompt_digest(body)
    head = f"v1.{keyring.signing_kid}.{ts_ms}.{digest}.{_rid_digest(request_id)}"
    signed = dict(params)
    signed[LEG_FIELD] = f"{head}.{_leg_mac(keyring.signing_key, head, params)}"
    return signed


_LEG_RE = re.compile(r"^v1\.([0-9a-f]{8})\.(-?[0-9]{1,16})\.([0-9a-f]{32})\.([0-9a-f]{16})"
                     r"\.([0-9a-f]{64})\Z")


def verify_leg(keyring: Keyring, params: Mapping[str, Any], *, request_id: str | None = None,
               body: Mapping[str, Any] | None = None, now: float | None = None,
               window_s: float = DEFAULT_WINDOW_S) -> tuple[float, str]:
    """The signature's (timestamp in seconds, MAC); ``AuthError`` unless
    ``params`` carry a valid ``pd_sig``.

    The API server passes everything (``request_id``, ``body``, ``now``); the
    EngineCore, which sees neither the body nor the proxy's request id,
    checks the MAC and the window when the request arrives, and that the
    signature is used once (``FrameAuth.admit_leg``).
    """
    token = params.get(LEG_FIELD)
    if token is None:
        raise AuthError("kv_transfer_params are not signed (this engine has a shared secret: "
                        "the proxy must be started with the same secret)")
    if not isinstance(token, str) or (m := _LEG_RE.match(token)) is None:
        raise AuthError("kv_transfer_params.pd_sig is malformed")
    kid, ts_raw, prompt, rid, mac = m.groups()
    key = keyring.keys.get(kid)
    if key is None:
        raise AuthError(f"kv_transfer_params are signed with unknown key id {kid} (a wrong "
                        "or rotated-out secret)")
    head = token[:token.rfind(".")]
    if not hmac.compare_digest(_leg_mac(key, head, params), mac):
        raise AuthError("kv_transfer_params signature does not match (altered params, or "
                        "signed with another secret)")
    if now is not None:
        skew = int(ts_raw) / 1000 - now
        if abs(skew) > window_s:
            raise AuthError(f"kv_transfer_params signature is {-skew:+.1f} s old (window "
                            f"{window_s:.0f} s): a replay, or clocks out of sync")
    if body is not None and body_prompt_digest(body) != prompt:
        raise AuthError("kv_transfer_params were signed for another prompt", status=403)
    if request_id is not None and _rid_digest(request_id) != rid:
        raise AuthError("kv_transfer_params were signed for another request id "
                        "(X-Request-Id)", status=403)
    return int(ts_raw) / 1000, mac
