"""Multi-turn conversations: which D kept a conversation's last turn.

Pure (no I/O); one :class:`ConversationStore` per proxy, used by
:mod:`vllm_pd_proxy.affinity` on the event loop only.

After a turn, D's answer carries ``kv_transfer_params`` naming the blocks it
kept (``vllm_pd_ext.scheduler.bidir``). The proxy takes them out of the answer (the
client never sees engine addresses), files them under the conversation's
key, and on the next turn:

- hands them to P's leg, so P reads the history back from D instead of
  recomputing it (P verifies the prefix by hash; a rewritten history just
  matches less, or nothing);
- sends the D leg to the same D while it is routable and not much busier
  than the least loaded one, so D's own prefix cache serves the history too.

An entry is used once (the next turn's D answer replaces it), expires with
D's lease (``remote_blocks_expiry_time``, less a margin) or the store's TTL,
whichever is first, and the store is bounded (least recently used go first).

Conversation key, first found: the ``X-Session-Id`` header (name set by
``--session-header``), the body's ``conversation_id`` (vLLM's multi-turn demo
proxy; removed before the body reaches an engine), else a hash of the model,
the ``user`` field and the conversation's opening (chat: the messages up to
the first user message; completions: the first 256 characters or 64 token
ids). Two conversations of one tenant with the same opening share a key:
harmless, since P reads back only what matches its own prompt.

Every key is scoped by the request's ``cache_salt`` (vLLM's per-tenant
prefix-cache isolation): a request with a salt never shares a key with one
without or with another salt, whatever header or ``conversation_id`` it
names, so one tenant can neither take nor end another's kept turn. The
engines check the same on their side (``remote_hash_scope``).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vllm_pd_ext.wire.protocol import KVTransferParams, ParamsError, decode_params

#: Seconds before D's stated expiry an entry is no longer handed out.
EXPIRY_MARGIN_S = 5.0
#: Longest key taken from a client (header or conversation_id).
MAX_KEY_LEN = 256
#: How D's answer names its params (vLLM writes compact JSON), and says it has none.
_KV_KEY = b'"kv_transfer_params"'
_KV_NULL = b'"kv_transfer_params":null'
#: Bytes counted per entry besides its params (key, URL, objects).
_ENTRY_OVERHEAD = 256
#: The kv_transfer_params fields P needs to read a kept turn back.
_READBACK_FIELDS = (
    "remote_engine_id",
    "remote_host",
    "remote_port",
    "remote_block_ids",
    "remote_request_id",
    "remote_block_hashes",
    "remote_blocks_expiry_time",
    "remote_num_tokens",
    "remote_hash_scope",
    "tp_size",
)


@dataclass(frozen=True, slots=True)
class Turn:
    """One conversation's last turn: the D that kept it and its params
    (held as compact JSON of the read-back fields: a long history's hashes
    are tens of KB as Python objects, a few KB as bytes)."""

    decode_url: str
    params_json: bytes
    expires_at: float  # the proxy's monotonic clock

    @property
    def params(self) -> dict[str, Any]:
        params: dict[str, Any] = json.loads(self.params_json)
        return params

    @property
    def size(self) -> int:
        return len(self.params_json) + len(self.decode_url) + _ENTRY_OVERHEAD


class ConversationStore:
    """Bounded LRU of :class:`Turn` by conversation key, with expiry: at
    most ``capacity`` entries and ``max_bytes`` of them."""

    def __init__(self, capacity: int, ttl_s: float, clock: Callable[[], float],
                 max_bytes: int = 256 << 20) -> None:
        self.capacity = max(1, capacity)
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._turns: OrderedDict[str, Turn] = OrderedDict()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._turns)

    def take(self, key: str) -> tuple[Turn | None, str]:
        """Remove and return the key's turn: ``(turn, "hit")``, or
        ``(None, "miss" | "expired")``."""
        turn = self._pop(key)
        if turn is None:
            return None, "miss"
        if turn.expires_at <= self._clock():
            return None, "expired"
        return turn, "hit"

    def put(self, key: str, decode_url: str, params: dict[str, Any], wall_now: float) -> bool:
        """File D's answer; False (nothing filed) if it names no kept blocks,
        is already about to expire, or alone exceeds the byte budget."""
        leg = decode_kept_turn(params)
        if leg is None:
            return False
        now = self._clock()
        expires_at = now + self.ttl_s
        expiry = leg.remote_blocks_expiry_time
        if expiry is not None:
            expires_at = min(expires_at, now + (expiry - wall_now) - EXPIRY_MARGIN_S)
        if expires_at <= now:
            return False
        kept = {k: params[k] for k in _READBACK_FIELDS if k in params}
        turn = Turn(decode_url, json.dumps(kept, separators=(",", ":")).encode(), expires_at)
        self._pop(key)
        if turn.size + len(key) > self.max_bytes:
            return False
        self._turns[key] = turn
        self.num_bytes += turn.size + len(key)
        while len(self._turns) > self.capacity or self.num_bytes > self.max_bytes:
            self._pop(next(iter(self._turns)))
        return True

    def drop(self, key: str) -> None:
        self._pop(key)

    def _pop(self, key: str) -> Turn | None:
        turn = self._turns.pop(key, None)
        if turn is not None:
            self.num_bytes -= turn.size + len(key)
        return turn


def decode_kept_turn(params: Any) -> KVTransferParams | None:
    """D's answer as the read-back P will be sent, if it names kept blocks P
    can verify (one hash per block) and read; None otherwise.

    Decoded with P's own decoder (:func:`~vllm_pd_ext.wire.protocol.decode_params`,
    strict: exact JSON types), only the fields the next P leg will carry:
    anything P would refuse, or a D would not send, is dropped here, so a
    broken or hostile D cannot make the next turn's P leg malformed.
    """
    if not isinstance(params, dict):
        return None
    try:
        leg = decode_params(readback_params(params, {}), strict=True)
    except ParamsError:
        return None
    if leg is None or not leg.is_readback:
        return None
    # The proxy's own needs on top of P's: exactly one KV-cache group of
    # blocks (D keeps one), each with its hash (P verifies the prefix by them).
    blocks, hashes = leg.remote_block_ids, leg.remote_block_hashes
    if (blocks is None or len(blocks) != 1 or not isinstance(blocks[0], list)
            or not blocks[0] or hashes is None or len(hashes) != len(blocks[0])):
        return None
    return leg


def readback_params(kept: Mapping[str, Any], leg: Mapping[str, Any]) -> dict[str, Any]:
    """A P leg's params (``leg``) plus what P needs to read ``kept`` back."""
    out = dict(leg)
    for key in _READBACK_FIELDS:
        if key in kept:
            out[key] = kept[key]
    out["do_remote_decode"] = True
    out["do_remote_prefill"] = False
    return out


def conversation_key(
    headers: Mapping[str, str], body: dict[str, Any], chat: bool, header: str
) -> str | None:
    """The conversation's key (see the module docstring); pops ``conversation_id``."""
    given = body.pop("conversation_id", None)
    salt = body.get("cache_salt")
    raw = headers.get(header)
    if raw:
        return _salted("h", raw[:MAX_KEY_LEN], salt)
    if isinstance(given, str | int) and not isinstance(given, bool) and str(given):
        return _salted("c", str(given)[:MAX_KEY_LEN], salt)
    opening: Any
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        opening = []
        for message in messages:
            opening.append(message)
            if isinstance(message, dict) and message.get("role") == "user":
                break
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            opening = prompt[:256]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt[:64]):
            opening = prompt[:64]
        else:
            return None
    digest = hashlib.sha256(
        json.dumps(
            [body.get("model"), body.get("user"), salt, opening], sort_keys=True, default=str
        ).encode()
    ).hexdigest()
    return "p:" + digest[:32]


def _salted(kind: str, name: str, salt: Any) -> str:
    """A client-named key: ``kind:name`` as given without a salt; with one, a
    digest of both under another prefix (``hs:``, ``cs:``), so no name, with
    or without a salt, can spell another salt's key."""
    if salt is None:
        return f"{kind}:{name}"
    digest = hashlib.sha256(json.dumps([name, salt], default=str).encode()).hexdigest()
    return f"{kind}s:{digest[:32]}"


def extract_kv_params(payload: bytes, sse: bool) -> tuple[bytes, dict[str, Any] | None]:
    """Take ``kv_transfer_params`` out of a D answer (a JSON body, or complete
    SSE events); returns the payload without them, and the params. Bytes
    without the key, or where it is ``null`` (vLLM's answer when the
    connector said nothing), are returned as they are, unparsed or unchanged."""
    if payload.count(_KV_KEY) == payload.count(_KV_NULL):  # the common case
        return payload, None
    if not sse:
        try:
            body = json.loads(payload)
        except ValueError:
            return payload, None
        if not isinstance(body, dict) or body.get("kv_transfer_params") is None:
            return payload, None
        found = body.pop("kv_transfer_params")
        return json.dumps(body, separators=(",", ":")).encode(), _as_dict(found)
    out: list[bytes] = []
    params: dict[str, Any] | None = None
    for event in payload.split(b"\n\n"):
        if event.startswith(b"data: {") and _KV_KEY in event:
            try:
                body = json.loads(event[6:])
            except ValueError:
                out.append(event)
                continue
            if isinstance(body, dict) and body.get("kv_transfer_params") is not None:
                params = _as_dict(body.pop("kv_transfer_params")) or params
                event = b"data: " + json.dumps(body, separators=(",", ":")).encode()
        out.append(event)
    return b"\n\n".join(out), params


def _as_dict(value: Any) -> dict[str, Any] | None:
    return value if isinstance(value, dict) else None
