"""Typed wire messages: ``kv_transfer_params`` and the side channel.

Everything that crosses a process boundary is decoded here, once, into a
frozen ``msgspec.Struct``; the rest of the package never touches untyped
dicts from the wire. Errors name the offending field.

Protocol version history (feeds the compatibility hash, so engines running
different versions refuse each other at the handshake):

- 1: pull mode; handshake with per-rank region layout; lease renew/acquire/release.
- 2: push mode (``PushRegister`` / ``PushAbort`` / ``PushResult``, P's ``WriteOrder``).
- 3: ``PushWaiting`` renewals; ``PushAccepted.state`` ``queued``.
- 4: authentication (``auth.py``): signed frames and legs; P's answer carries
  ``remote_prompt_digest``; ``PushRegister`` carries the prompt digest and
  the token P's WRITE notification must echo (``pdx:<token>/<pd_request_id>``).
- 5: bidirectional KV (``scheduler/bidir.py``): D's final answer names its kept blocks
  with ``remote_block_hashes``; a P leg carrying them reads the matching
  prefix back from D (pull, D's lease); ``pd_bidirectional`` on the D leg.
- 6: tensor parallelism across sizes (``transport/tp_slices.py``): ``CompatInfo``
  carries the model's total KV heads and MLA; a handshake names D's TP size
  and its reply carries every P rank's agent; pins and releases name how
  many D ranks consume the lease.
- 7: tenants in multi-turn: ``remote_block_hashes`` are seeded with the
  request's ``cache_salt`` and LoRA adapter, which D's answer names with
  ``remote_hash_scope``; a P reads back and releases only a turn of its own
  scope (an engine of version 6 hashes a salted turn like an unsalted one).
- 8: token #1 with the KV (push, issue 29): a D leg with ``pd_seed_pending``
  registers with ``want_seed``; P's ``WriteOrder.seed`` is its token #1,
  which the WRITE's notification carries (``pdx:<tag>+<seed>/<id>``) and D
  appends to its prompt before its first step.
- 9: concurrent pull (issue 29): a pull D leg with ``pd_seed_pending`` names
  no blocks; D parks it and asks P (``PullWait``, answered ``PullWaiting``)
  to send its answer when the prefill ends; P sends ``PullReady`` (its
  params and token #1, or the failure); D cancels with ``PullWaitCancel``.
"""

from __future__ import annotations

import enum
import hashlib
import re
from typing import Annotated, Any, ClassVar, Final

import msgspec

PROTOCOL_VERSION: Final = 10

# Bounds on everything that arrives from a client or a peer: a hostile or
# buggy field gets a decode error naming it, never a loop, an allocation or a
# lock hold that grows with it. Each limit is far above any real deployment.
#: Largest side-channel frame (a ``PushRegister`` carries every rank's NIXL
#: metadata: kilobytes per rank).
MAX_FRAME_BYTES: Final = 16 << 20
MAX_ENGINE_ID_LEN: Final = 256
#: Request ids can carry a client's X-Request-Id (HTTP headers: <= 8 KiB).
MAX_REQUEST_ID_LEN: Final = 8192
MAX_IDS_PER_MESSAGE: Final = 4096
#: Block ids per request: 2**20 blocks of 16 tokens is a 16M-token prompt.
MAX_BLOCKS: Final = 1 << 20
MAX_TP_SIZE: Final = 1024
MAX_TTL_S: Final = 3600.0
#: ``PullWait.seq`` at most (a wait renews every few seconds; a peer's
#: larger number is refused at decode).
MAX_WAIT_SEQ: Final = 2**31
#: Tokens P sampled that a D leg's prompt carries after P's prompt (token #1
#: from P, issue 29): D loads P's prompt and computes only these.
MAX_SEEDED_TOKENS: Final = 1
#: A DNS name (labels of letters, digits, ``-``, ``_``), an IPv4 address or
#: an IPv6 literal (optionally bracketed). Excludes what would change the
#: meaning of ``tcp://HOST:PORT`` (spaces, ``/``, ``@``, non-ASCII).
#: ``\Z``, not ``$``: msgspec matches patterns with ``re.search``, where ``$``
#: also matches before a trailing newline (``"localhost\n"`` would pass).
HOST_PATTERN: Final = (r"^(?:[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
                       r"(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*"
                       r"|\[?[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*\]?)\Z")

EngineId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ENGINE_ID_LEN)]
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REQUEST_ID_LEN)]
RequestIds = Annotated[list[RequestId], msgspec.Meta(max_length=MAX_IDS_PER_MESSAGE)]
Host = Annotated[str, msgspec.Meta(max_length=253, pattern=HOST_PATTERN)]
Port = Annotated[int, msgspec.Meta(gt=0, lt=65536)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_TP_SIZE)]
TpSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_TP_SIZE)]
BlockId = Annotated[int, msgspec.Meta(ge=0)]
BlockIds = Annotated[list[BlockId], msgspec.Meta(max_length=MAX_BLOCKS)]
Ttl = Annotated[float, msgspec.Meta(gt=0, le=MAX_TTL_S)]
#: One chained block hash (``bidir.block_hashes``): 16 lowercase hex digits.
BlockHash = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{16}\Z")]


def tcp_address(host: str, port: int) -> str:
    """``tcp://host:port`` for zmq; IPv6 literals in brackets."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"

#: ``LeaseStatus.remaining_s`` sentinels.
LEASE_UNKNOWN: Final = -1.0
LEASE_EXPIRED: Final = -2.0


class TransferMode(enum.StrEnum):
    """How the KV moves (``transfer_mode``; the same on P, D and the proxy):
    D's workers read P's blocks (``pull``), or P's write into D's (``push``)."""

    PULL = "pull"
    PUSH = "push"


TRANSFER_MODES: Final = tuple(m.value for m in TransferMode)


class ErrorCode(enum.StrEnum):
    """Why a side-channel round trip failed: ``ErrorReply.code`` on the wire,
    ``side_channel.SideChannelError.code`` on the caller's side.

    The first four are the caller's own verdicts (no peer sent them); the
    rest come in a peer's ``ErrorReply``. ``ErrorReply.code`` stays a plain
    string on the wire, so a newer peer's new code still decodes; compare it
    with these members, never with message text.
    """

    #: No answer in time.
    TIMEOUT = "timeout"
    #: libzmq refused the address, or the socket failed.
    UNREACHABLE = "unreachable"
    #: The answer did not decode (or failed its signature).
    BAD_REPLY = "bad_reply"
    #: A bug on this side.
    LOCAL = "local"
    INCOMPATIBLE = "incompatible"
    MALFORMED = "malformed"
    INTERNAL = "internal"
    UNAUTHENTICATED = "unauthenticated"
    NO_RANK = "no_rank"
    NOT_PUSH = "not_push"
    NOT_PULL = "not_pull"
    NOT_PRODUCER = "not_producer"
    NOT_CONSUMER = "not_consumer"
    REFUSED = "refused"
    STALE = "stale"
    UNKNOWN = "unknown"


#: Codes that mean the peer did not answer at all (it may be dead).
NO_ANSWER_CODES: Final = frozenset({ErrorCode.TIMEOUT, ErrorCode.UNREACHABLE})
#: Codes no peer sent: the caller's own verdicts.
LOCAL_CODES: Final = frozenset({ErrorCode.TIMEOUT, ErrorCode.UNREACHABLE, ErrorCode.BAD_REPLY,
                                ErrorCode.LOCAL})


class ParamsError(ValueError):
    """Malformed ``kv_transfer_params``; the message names the field."""


class KVTransferParams(msgspec.Struct, frozen=True, kw_only=True):
    """vLLM's ``kv_transfer_params`` keys (wire-compatible with NixlConnector).

    Unknown keys (vLLM's private ``_remote_blocks_processed`` markers, a
    proxy's additions) are ignored; wrong types are errors.
    """

    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    remote_engine_id: Annotated[str, msgspec.Meta(max_length=MAX_ENGINE_ID_LEN)] | None = None
    # vLLM sends a tuple of per-KV-cache-group lists; older peers a flat list.
    remote_block_ids: Annotated[list[BlockIds | BlockId],
                                msgspec.Meta(max_length=MAX_BLOCKS)] | None = None
    remote_request_id: Annotated[str, msgspec.Meta(max_length=MAX_REQUEST_ID_LEN)] | None = None
    remote_host: Annotated[str, msgspec.Meta(max_length=253)] | None = None
    remote_port: int | None = None
    tp_size: int = 1
    pp_size: int = 1
    dcp_size: int = 1
    remote_num_tokens: int | None = None
    remote_blocks_expiry_time: float | None = None
    transfer_mode: str | None = None
    remote_prefill_cached_tokens: int | None = None
    pd_ext_probe: bool = False
    pd_request_id: Annotated[str, msgspec.Meta(max_length=MAX_REQUEST_ID_LEN)] | None = None
    #: P's digest of the prompt's token ids (``auth.token_digest``): D refuses
    #: an answer made for another prompt (protocol 4).
    remote_prompt_digest: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    #: The proxy's signature (``auth.sign_leg``); checked by ``auth.verify_leg``.
    pd_sig: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    #: Bidirectional: D's chained hashes of the blocks it kept at the end of
    #: a turn (``bidir.block_hashes``), one per block in ``remote_block_ids``.
    #: A P leg carrying them reads back the prefix whose hashes match.
    remote_block_hashes: Annotated[list[BlockHash],
                                   msgspec.Meta(max_length=MAX_BLOCKS)] | None = None
    #: Bidirectional: whose turn ``remote_block_hashes`` hash (``bidir.scope_tag``
    #: of the request's cache_salt and LoRA adapter); absent: neither (protocol 7).
    #: P reads back and releases only a turn of its own request's scope.
    remote_hash_scope: BlockHash | None = None
    #: D leg: keep this turn's blocks for the next one (True), or not (False);
    #: absent (an upstream proxy): the engine's ``bidirectional_kv_xfer`` decides,
    #: on an engine without a shared secret only (``bidir.wants_keep``).
    pd_bidirectional: bool | None = None
    #: D leg: the last ``pd_seeded_tokens`` of D's prompt are tokens P
    #: sampled (the proxy already sent them to the client); P's KV covers the
    #: prompt before them, and D computes them in its first step.
    pd_seeded_tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_SEEDED_TOKENS)] = 0
    #: P leg: the proxy sends P's token #1 to the client itself, so a prefill
    #: whose token #1 ended the answer (EOS, a stop token) is the whole answer
    #: and hands nothing over (no lease for a D leg that will never come).
    pd_first_token: bool = False
    #: D leg: D's prompt is P's, and P's token #1 is not in it yet: it
    #: arrives with the KV (push: the WRITE's notification; pull: P's
    #: ``PullReady``, protocol 9) and D appends it before its first step,
    #: which computes its KV and samples token #2. The proxy sends this leg
    #: beside P's, before token #1 exists (protocol 8).
    pd_seed_pending: bool = False

    @property
    def is_readback(self) -> bool:
        """A P leg that names D's kept blocks (the next turn of a conversation)."""
        return bool(self.do_remote_decode and not self.do_remote_prefill
                    and self.remote_block_ids and self.remote_engine_id
                    and self.remote_host and self.remote_port and self.remote_request_id)

    @property
    def is_pull_wait(self) -> bool:
        """A concurrent pull D leg: sent before P's prefill ended, so it
        names no blocks; D learns them (and token #1) from P's ``PullReady``."""
        return bool(self.do_remote_prefill and self.pd_seed_pending and self.pd_request_id
                    and self.mode is TransferMode.PULL and not self.remote_block_ids)

    @property
    def mode(self) -> TransferMode:
        """``pull`` unless the params say ``push`` (vLLM's own params omit it);
        ``decode_params`` refused any other value."""
        return TransferMode(self.transfer_mode or TransferMode.PULL)

    def flat_remote_block_ids(self) -> list[int]:
        """The single KV-cache group's block ids (we do not support HMA)."""
        ids: list[Any] = list(self.remote_block_ids or [])
        nested = [isinstance(i, list) for i in ids]
        if all(nested) and ids:
            if len(ids) != 1:
                raise ParamsError(
                    "kv_transfer_params.remote_block_ids: expected 1 KV-cache group, "
                    f"got {len(ids)} (hybrid KV-cache models are not supported)"
                )
            flat: list[Any] = ids[0]
        elif any(nested):
            raise ParamsError("kv_transfer_params.remote_block_ids mixes lists and integers")
        else:
            flat = ids
        if any(not isinstance(b, int) or b < 0 for b in flat):
            raise ParamsError("kv_transfer_params.remote_block_ids must be non-negative integers")
        return [int(b) for b in flat]


#: P's answer always carries these, even when None (a probe names no blocks).
_ANSWER_KEYS: Final = ("do_remote_prefill", "do_remote_decode", "remote_engine_id",
                       "remote_block_ids", "remote_request_id", "remote_host", "remote_port",
                       "tp_size", "pp_size", "dcp_size", "transfer_mode")


def answer_params(params: KVTransferParams) -> dict[str, Any]:
    """P's ``kv_transfer_params`` answer, built from the typed struct: the
    keys vLLM's NixlConnector answer has (``_ANSWER_KEYS``), plus every other
    field that is set. Unset optional fields are left out."""
    wire = msgspec.to_builtins(params)
    return {k: v for k, v in wire.items() if k in _ANSWER_KEYS or (
        v is not None and v != getattr(_DEFAULT_PARAMS, k))}


_PULL_REQUIRED = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
_PUSH_REQUIRED = ("remote_engine_id", "remote_host", "remote_port", "pd_request_id")


_DEFAULT_PARAMS: Final = KVTransferParams()


def decode_params(raw: Any, *, strict: bool = False) -> KVTransferParams | None:
    """Decode a request's ``kv_transfer_params`` dict; ``None`` if absent.

    Raises ``ParamsError`` naming the field when the dict is malformed or
    misses a key that its flags require. ``strict``: no coercion (``"80"``
    is not a port), for params an engine built itself, as the proxy checks
    what one engine hands it for another.
    """
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ParamsError(f"kv_transfer_params must be an object, got {type(raw).__name__}")
    try:
        params = msgspec.convert(raw, KVTransferParams, strict=strict)
    except msgspec.ValidationError as exc:
        raise ParamsError(f"kv_transfer_params: {exc}".replace("`$.", "`")) from exc
    if params.transfer_mode not in (None, *TRANSFER_MODES):
        raise ParamsError(
            f"kv_transfer_params.transfer_mode={params.transfer_mode!r}: accepted values: "
            + ", ".join(TRANSFER_MODES)
        )
    push_leg = (params.do_remote_decode and params.mode is TransferMode.PUSH
                and not params.pd_ext_probe)
    if push_leg and not params.pd_request_id:
        raise ParamsError("kv_transfer_params: transfer_mode='push' needs pd_request_id")
    if params.is_readback:
        # D's kept blocks on a P leg: checked as strictly as P's answer on D.
        assert params.remote_host is not None and params.remote_port is not None
        if not 0 < params.remote_port < 65536:
            raise ParamsError(f"kv_transfer_params.remote_port out of range: {params.remote_port}")
        if not valid_host(params.remote_host):
            raise ParamsError(f"kv_transfer_params.remote_host is not a host name or IP "
                              f"address: {params.remote_host[:80]!r}")
        if not 1 <= params.tp_size <= MAX_TP_SIZE:
            raise ParamsError(f"kv_transfer_params.tp_size must be in 1..{MAX_TP_SIZE}, "
                              f"got {params.tp_size}")
        params.flat_remote_block_ids()  # validates the shape
    if params.do_remote_prefill:
        push = params.mode is TransferMode.PUSH
        required = _PUSH_REQUIRED if push else _PULL_REQUIRED
        missing = [k for k in required if getattr(params, k) in (None, "")]
        if missing:
            raise ParamsError(
                f"kv_transfer_params: do_remote_prefill ({params.mode} mode) needs "
                + ", ".join(missing)
            )
        if params.remote_port is not None and not 0 < params.remote_port < 65536:
            raise ParamsError(f"kv_transfer_params.remote_port out of range: {params.remote_port}")
        if params.remote_host is not None and not valid_host(params.remote_host):
            raise ParamsError(f"kv_transfer_params.remote_host is not a host name or IP "
                              f"address: {params.remote_host[:80]!r}")
        if not push and not params.is_pull_wait and not params.flat_remote_block_ids():
            # (also validates the shape)
            raise ParamsError("kv_transfer_params.remote_block_ids is empty")
        if not 1 <= params.tp_size <= MAX_TP_SIZE:
            raise ParamsError(f"kv_transfer_params.tp_size must be in 1..{MAX_TP_SIZE}, "
                              f"got {params.tp_size}")
    return params


_host_re = re.compile(HOST_PATTERN)


def valid_host(host: str) -> bool:
    return len(host) <= 253 and _host_re.match(host) is not None


# --------------------------------------------------------------------------
# Side channel (pyzmq ROUTER on the engine's side_channel_host:port)
# --------------------------------------------------------------------------


class CompatInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What two engines must agree on to exchange KV blocks."""

    protocol_version: int
    model: str
    dtype: str
    block_size: int
    kv_layout: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    tp_size: int
    transfer_mode: str
    #: Platform device type ("cuda", "cpu", ...); "" from a peer that predates it.
    device: str = ""
    #: The attention backend chosen on the command line, or "auto". Informational:
    #: the scheduler's connector cannot know the backend vLLM finally selects.
    attn_backend: str = ""
    #: The model's KV heads over all ranks (``num_kv_heads`` is per rank);
    #: 0 from a peer that predates tensor parallelism across sizes.
    total_kv_heads: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 0
    #: A latent (MLA) cache: one slot per token, no heads to split.
    mla: bool = False

    #: Carried and logged, never compared.
    INFORMATIONAL: ClassVar[frozenset[str]] = frozenset({"attn_backend"})
    #: Added with a default: compared only when both sides carry a value.
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"device", "total_kv_heads"})
    #: Differ between P and D sharded differently; ``tp_slices.plan`` decides
    #: instead when both sides carry ``total_kv_heads``.
    TP_FIELDS: ClassVar[frozenset[str]] = frozenset({"tp_size", "num_kv_heads"})

    def digest(self) -> str:
        return hashlib.sha256(msgspec.msgpack.encode(self)).hexdigest()[:16]

    def diff(self, other: CompatInfo, ours: bool = True) -> list[str]:
        """Fields that differ, as ``name: ours=X theirs=Y`` (``ours=False``:
        ``name: theirs=Y``, for a peer that must not learn our values).

        TP size and per-rank heads may differ when both sides say how many
        heads the model has: then the sharding pair is checked as a whole
        (``tp_slices.plan``) and a pair it cannot map is one entry naming why.
        """
        sharded = self.total_kv_heads > 0 and other.total_kv_heads > 0
        out = [
            f"{f}: ours={getattr(self, f)!r} theirs={getattr(other, f)!r}" if ours
            else f"{f} differs: theirs={getattr(other, f)!r}"
            for f in self.__struct_fields__
            if f not in self.INFORMATIONAL and getattr(self, f) != getattr(other, f)
            and not (f in self.OPTIONAL
                     and (getattr(self, f) in ("", 0) or getattr(other, f) in ("", 0)))
            and not (sharded and f in self.TP_FIELDS)
        ]
        if sharded and not out:
            # Deferred import: tp_slices builds on this module's Region.
            from vllm_pd_ext.transport.tp_slices import TPMappingError, plan, sharding_of

            try:
                plan(sharding_of(other), sharding_of(self))
            except TPMappingError as exc:
                out.append(f"tensor parallelism: {exc}" if ours
                           else f"tensor parallelism cannot be mapped (theirs: tp_size="
                                f"{other.tp_size})")
        return out


class Region(msgspec.Struct, frozen=True, array_like=True):
    """One registered KV region (a layer, or a layer's K or V half).

    Block ``i`` of the region lives at ``base_addr + i * block_stride`` and is
    ``block_len`` bytes long.
    """

    base_addr: int
    block_stride: int
    block_len: int
    num_blocks: int


class AgentInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's NIXL identity and KV layout, gathered by the scheduler."""

    tp_rank: Rank
    agent_name: EngineId
    agent_metadata: bytes
    mem_type: str
    device_id: int = 0
    #: Kernel blocks per KV block (vLLM's kernel-block split; 1: none). Peers
    #: must agree: a split block orders its bytes differently (compat/layout.py).
    kernel_blocks: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)] = 1
    regions: Annotated[list[Region], msgspec.Meta(max_length=1 << 16)]


class HandshakeRequest(msgspec.Struct, frozen=True, tag="handshake", kw_only=True):
    engine_id: EngineId
    tp_rank: Rank
    compat: CompatInfo


class HandshakeReply(msgspec.Struct, frozen=True, tag="handshake_reply", kw_only=True):
    engine_id: EngineId
    compat: CompatInfo
    #: The agent of P's rank that D's rank reads first (its own rank when
    #: both sides shard alike).
    agent: AgentInfo
    #: Every P rank's agent, by rank: a D rank sharded differently reads
    #: head slices from one or several of them (``tp_slices``).
    agents: Annotated[list[AgentInfo], msgspec.Meta(max_length=MAX_TP_SIZE)] = []


class LeaseRenew(msgspec.Struct, frozen=True, tag="renew", kw_only=True):
    """Heartbeat (``acquire=False``) or read pin (``acquire=True``).

    A pin that names ``consumer`` (D's own request id) and ``tp_rank`` (D's
    rank) holds the lease until that consumer releases that rank, so two D
    requests reading one P answer (a replayed D leg, n > 1) each keep the
    blocks. The defaults (an older peer) pin as before: by rank count only.
    """

    engine_id: EngineId
    request_ids: RequestIds
    acquire: bool = False
    #: D's rank that pins; -1: not named.
    tp_rank: Annotated[int, msgspec.Meta(ge=-1, lt=MAX_TP_SIZE)] = -1
    consumer: Annotated[str, msgspec.Meta(max_length=MAX_REQUEST_ID_LEN)] = ""
    #: How many D ranks consume the lease (D's TP size); 0: not named (the
    #: lease keeps the count it was granted with).
    consumer_ranks: Annotated[int, msgspec.Meta(ge=0, le=MAX_TP_SIZE)] = 0


class LeaseStatus(msgspec.Struct, frozen=True, tag="lease_status"):
    """Per requested id: seconds left, or ``LEASE_UNKNOWN`` / ``LEASE_EXPIRED``."""

    remaining_s: Annotated[list[float], msgspec.Meta(max_length=MAX_IDS_PER_MESSAGE)]


class LeaseRelease(msgspec.Struct, frozen=True, tag="release", kw_only=True):
    """D is done with P's blocks (read finished, failed, or not needed).

    ``consumer`` (D's own request id, as in its pin) also drops that pin's
    hold; without it (an older peer, or a release before any pin) the rank
    is counted but another consumer's hold is never dropped.
    """

    engine_id: EngineId
    request_ids: RequestIds
    tp_rank: Rank
    ok: bool = True
    reason: str = ""
    consumer: Annotated[str, msgspec.Meta(max_length=MAX_REQUEST_ID_LEN)] = ""
    #: As in ``LeaseRenew``: D's TP size, 0 when not named.
    consumer_ranks: Annotated[int, msgspec.Meta(ge=0, le=MAX_TP_SIZE)] = 0


class Ack(msgspec.Struct, frozen=True, tag="ack"):
    pass


class ErrorReply(msgspec.Struct, frozen=True, tag="error"):
    code: str
    message: str


class PushRegister(msgspec.Struct, frozen=True, tag="push_register", kw_only=True):
    """D -> P (push): "write the KV of ``pd_request_id`` into these blocks".

    ``block_ids[i]`` receives the prompt's block ``first_block + i``; blocks
    before ``first_block`` are D's prefix-cache hit and are not written.
    """

    engine_id: EngineId
    compat: CompatInfo
    #: The P engine id D was told about; a restarted P refuses the registration.
    expect_engine_id: EngineId
    pd_request_id: RequestId
    request_id: RequestId
    notify_host: Host
    notify_port: Port
    agents: Annotated[list[AgentInfo], msgspec.Meta(max_length=MAX_TP_SIZE)]
    first_block: BlockId
    block_ids: BlockIds
    num_tokens: Annotated[int, msgspec.Meta(ge=0)]
    #: P posts no WRITE later than this many seconds after receipt.
    ttl_s: Ttl
    #: ``auth.token_digest`` of D's prompt: P refuses to write another prompt's KV.
    prompt_digest: Annotated[str, msgspec.Meta(max_length=64)] = ""
    #: Random per registration: P's WRITE notification echoes it, so D counts
    #: only a notification from the P it registered with.
    notif_token: Annotated[str, msgspec.Meta(max_length=64, pattern=r"^[0-9a-f]*\Z")] = ""
    #: The notification must carry P's token #1 (``pd_seed_pending``): a P
    #: without one refuses the WRITE (protocol 8).
    want_seed: bool = False


class PushAcceptedState(enum.StrEnum):
    """``PushAccepted.state``; on the wire as its string value."""

    #: P's prefill has not finished yet.
    WAITING = "waiting"
    #: The prefill had finished: P ordered the WRITE.
    WRITING = "writing"
    #: P holds the request (queued or prefilling): the registration is kept
    #: for another ``ttl`` from now (protocol 3).
    QUEUED = "queued"


class PushAccepted(msgspec.Struct, frozen=True, tag="push_accepted", kw_only=True):
    engine_id: str
    #: Any other string is refused at decode (``Invalid enum value ... $.state``).
    state: PushAcceptedState


class PushWaiting(msgspec.Struct, frozen=True, tag="push_waiting", kw_only=True):
    """D -> P (push, protocol 3): D still waits for ``pd_request_id``. P
    answers ``PushAccepted``: ``queued`` (P holds the request; the
    registration's window is renewed to ``ttl`` from now), ``waiting`` (the
    registration stands, P has not seen the request: no renewal) or
    ``writing``; an unknown id is an ``unknown`` error."""

    engine_id: EngineId
    pd_request_id: RequestId


class PushAbort(msgspec.Struct, frozen=True, tag="push_abort", kw_only=True):
    """D -> P: D will not take the KV of ``pd_request_id`` (any state)."""

    engine_id: EngineId
    pd_request_id: RequestId
    reason: str = ""


class PushAbortState(enum.StrEnum):
    """``PushAbortStatus.state``; on the wire as its string value."""

    #: No WRITE will ever be posted (P knew the id, or never heard of it).
    ABORTED = "aborted"
    UNKNOWN = "unknown"
    #: The WRITE settled (all of P's ranks).
    DONE = "done"
    FAILED = "failed"
    #: A WRITE may still land: D must wait and ask again.
    IN_FLIGHT = "in_flight"

    @property
    def is_safe(self) -> bool:
        """D may reuse its registered blocks: no WRITE from P can land any more."""
        return self is not PushAbortState.IN_FLIGHT


#: ``PushAbortStatus.state``: after which D may reuse its registered blocks.
ABORT_SAFE_STATES: Final = frozenset(state for state in PushAbortState if state.is_safe)


class PushAbortStatus(msgspec.Struct, frozen=True, tag="push_abort_status"):
    """P's answer to ``PushAbort`` (see ``PushAbortState``). Any other string
    is refused at decode (``Invalid enum value ... $.state``)."""

    state: PushAbortState


class PushResult(msgspec.Struct, frozen=True, tag="push_result", kw_only=True):
    """P's worker -> D: the WRITE for one rank failed and has settled (no
    byte will land later). Success travels as NIXL's notification instead,
    ordered after the data."""

    engine_id: EngineId
    pd_request_id: RequestId
    #: -1: P's scheduler, speaking for every rank once all have settled.
    tp_rank: Annotated[int, msgspec.Meta(ge=-1, lt=MAX_TP_SIZE)]
    ok: bool
    detail: str = ""


class PullWait(msgspec.Struct, frozen=True, tag="pull_wait", kw_only=True):
    """D -> P (pull, protocol 9; ``seq`` 10): "send me your answer for ``pd_request_id``
    at ``notify_host:notify_port`` once its prefill ends". D sent its leg
    beside P's (``pd_seed_pending``), so P's blocks were not known yet. P
    answers ``PullWaiting`` at once and keeps the wait ``ttl_s`` (D renews
    it by sending it again); the answer itself comes as ``PullReady``."""

    engine_id: EngineId
    #: The P engine id D was told about; a restarted P refuses the wait.
    expect_engine_id: EngineId
    pd_request_id: RequestId
    request_id: RequestId
    notify_host: Host
    notify_port: Port
    ttl_s: Ttl
    #: D's count of the ``PullWait``s it sent for this request (1, 2, ...
    #: with each renewal); P's ``PullReady`` names the latest it had
    #: received (protocol 10), which bounds P's lease extension from below
    #: on D's own clock.
    seq: Annotated[int, msgspec.Meta(ge=0, le=MAX_WAIT_SEQ)] = 0


class PullWaitState(enum.StrEnum):
    """``PullWaiting.state``; on the wire as its string value."""

    #: P has not seen the request yet: the wait is kept for ``ttl`` from now.
    WAITING = "waiting"
    #: P holds the request (queued or prefilling): the wait is kept for
    #: ``ttl`` from now, and D may wait up to its queue timeout.
    QUEUED = "queued"
    #: The prefill had ended: ``PullReady`` is on its way (sent again).
    READY = "ready"


class PullWaiting(msgspec.Struct, frozen=True, tag="pull_waiting", kw_only=True):
    engine_id: str
    #: Any other string is refused at decode (``Invalid enum value ... $.state``).
    state: PullWaitState


class PullWaitCancel(msgspec.Struct, frozen=True, tag="pull_wait_cancel", kw_only=True):
    """D -> P (pull): D's request ended before it read ``pd_request_id``: P
    drops the wait and frees the blocks it lent (D will never read them)."""

    engine_id: EngineId
    pd_request_id: RequestId
    reason: Annotated[str, msgspec.Meta(max_length=1024)] = ""


class PullReady(msgspec.Struct, frozen=True, tag="pull_ready", kw_only=True):
    """P -> D (pull, protocol 9; ``lease_s`` and ``wait_seq`` 10): the
    prefill D waits for ended. ``ok``: its blocks are leased to D under
    ``params`` (P's answer, as the proxy would have forwarded it) and
    ``first_token`` is the token P sampled; else
    ``detail`` says why no KV comes. D answers ``Ack``, or an ``unknown``
    error when no request of its waits for it (P then frees the lease)."""

    engine_id: EngineId
    pd_request_id: RequestId
    ok: bool
    params: KVTransferParams | None = None
    first_token: Annotated[int, msgspec.Meta(ge=-1)] = -1
    detail: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    #: Protocol 10, ``ok`` only: right before sending this, P extended the
    #: lease so that it lasts ``lease_s`` more, after it had received D's
    #: ``PullWait`` number ``wait_seq``. D, having sent that one at ``t``
    #: (its clock), knows the blocks stay P's until ``t + lease_s`` and
    #: reads without a pin round trip (``RecvSpec.valid_until``). 0: no
    #: extension (D pins, as a sequential pull does).
    lease_s: Annotated[float, msgspec.Meta(ge=0, le=MAX_TTL_S)] = 0.0
    wait_seq: Annotated[int, msgspec.Meta(ge=0, le=MAX_WAIT_SEQ)] = 0


class WriteTarget(msgspec.Struct, frozen=True, kw_only=True):
    """One D rank a P rank writes head slices to, when P and D shard
    differently (``tp_slices``): the rank's agent, the slices as ``(P head,
    D head, heads)`` within a block, each side's heads per block, and how
    many P ranks write into that D rank (its notification says so)."""

    agent: AgentInfo
    slices: list[tuple[int, int, int]]
    p_heads: int
    d_heads: int
    writers: int = 1


class WriteOrder(msgspec.Struct, frozen=True, kw_only=True):
    """P's scheduler -> one of P's workers: post this WRITE now (to ``agent``,
    whole blocks; or, P and D sharded differently, one WRITE per ``targets``
    entry)."""

    pd_request_id: str
    request_id: str
    d_engine_id: str
    d_request_id: str
    notify_host: str
    notify_port: int
    agent: AgentInfo
    src_block_ids: list[int]
    dst_block_ids: list[int]
    #: ``time.monotonic()`` (host-wide) after which the WRITE must not be posted.
    post_before: float
    #: D's ``PushRegister.notif_token``, echoed in the notification.
    notif_token: str = ""
    #: Non-empty: P and D shard differently; ``agent`` is then unused.
    targets: list[WriteTarget] = []
    #: P's token #1, for the notification (``PushRegister.want_seed``); -1: none.
    seed: int = -1


def push_notif(pd_request_id: str, token: str = "", writer: int = 0, writers: int = 1,
               seed: int = -1) -> bytes:
    """The NIXL notification that tells D a WRITE has landed:
    ``pdx:<token>/<id>``; ``pdx:<token>.<writer>.<writers>/<id>`` when
    ``writers`` P ranks write into one D rank (each must land); ``+<seed>``
    after the tag carries P's token #1 (``seed`` >= 0)."""
    tag = token if writers == 1 else f"{token}.{writer}.{writers}"
    if seed >= 0:
        tag += f"+{seed}"
    return b"pdx:" + tag.encode() + b"/" + pd_request_id.encode()


#: A token id: at most 10 digits, below 2**31 (no vocabulary is larger).
MAX_SEED: Final = 2**31 - 1


def notif_seed(tag: str) -> tuple[str, int]:
    """A notification tag as (the tag without its seed, the seed; -1: none).
    A malformed seed is kept in the tag, where it matches no token."""
    base, sep, digits = tag.rpartition("+")
    if not sep:
        return tag, -1
    if not re.fullmatch(r"[0-9]{1,10}", digits) or int(digits) > MAX_SEED:
        return tag, -1
    return base, int(digits)


def parse_push_notif(msg: bytes) -> tuple[str, str] | None:
    """(pd_request_id, tag) of a WRITE notification; None for anything else.
    ``notif_writer`` splits the tag."""
    if not msg.startswith(b"pdx:") or b"/" not in msg:
        return None
    token, _, pd_id = msg[4:].partition(b"/")
    return pd_id.decode(errors="replace"), token.decode(errors="replace")


def notif_writer(tag: str) -> tuple[str, int, int]:
    """A notification tag as (token, writer P rank, writers); a plain token
    is one writer. A malformed suffix is (tag, 0, 1): it matches no token."""
    token, sep, rest = tag.partition(".")
    if not sep:
        return tag, 0, 1
    writer, _, writers = rest.partition(".")
    if not (re.fullmatch(r"[0-9]{1,4}", writer) and re.fullmatch(r"[0-9]{1,4}", writers)):
        return tag, 0, 1
    # ``writer`` is the P rank (any of P's), ``writers`` how many write here.
    n = int(writers)
    if not (int(writer) < MAX_TP_SIZE and 1 <= n <= MAX_TP_SIZE):
        return tag, 0, 1
    return token, int(writer), n


Request = (HandshakeRequest | LeaseRenew | LeaseRelease | PushRegister | PushWaiting | PushAbort
           | PushResult | PullWait | PullWaitCancel | PullReady)
Reply = (HandshakeReply | LeaseStatus | Ack | ErrorReply | PushAccepted | PushAbortStatus
         | PullWaiting)

_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_encoder = msgspec.msgpack.Encoder()


def encode(msg: Request | Reply) -> bytes:
    return _encoder.encode(msg)


def decode_request(data: bytes) -> Request:
    """Raises ``msgspec.DecodeError`` / ``ValidationError`` on garbage."""
    msg: Request = _request_decoder.decode(data)
    return msg


def decode_reply(data: bytes) -> Reply:
    msg: Reply = _reply_decoder.decode(data)
    return msg


_order_decoder = msgspec.msgpack.Decoder(WriteOrder)


def encode_order(order: WriteOrder) -> bytes:
    return _encoder.encode(order)


def decode_order(data: bytes) -> WriteOrder:
    order: WriteOrder = _order_decoder.decode(data)
    return order
