"""Bidirectional (multi-turn) KV: which of D's kept blocks P may read back.

Pure: no vLLM, no NIXL, no clock of its own. Both engines call it on their
scheduler thread.

At the end of a turn D keeps the request's full blocks (prompt and answer)
under a lease and sends their *chained block hashes* with its
``kv_transfer_params`` (``block_hashes``). On the next turn P recomputes
the same hashes over its own prompt's tokens and reads back only the blocks
whose hash matches, in order from the first: a client that rewrote history,
dropped reasoning tokens or changed the system prompt gets a shorter match,
or none, and P prefills the rest itself. A count from the wire is never
trusted: a block is reused only when its hash, and so every token before
it, equals P's.

The hashes are scoped (``hash_scope``) as vLLM scopes its own prefix-cache
hashes: by the request's ``cache_salt`` (a tenant's secret) and its LoRA
adapter. A turn kept for one scope never matches a prompt of another, and
D's answer names its scope (``scope_tag``) so that P can tell another
tenant's turn (``Fallback.FOREIGN``: neither read nor released) from its own
diverged history (``Fallback.MISMATCH``: released).

``plan_readback`` turns the match, P's own prefix-cache hit and the
threshold (``kv_recompute_threshold``) into what P loads, or the reason it
loads nothing (a ``Fallback``; each one is counted in P's metrics).
"""

from __future__ import annotations

import enum
import hashlib
import json
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

#: Hex digits per block hash: 64 bits. The hash only has to tell a changed
#: history from an unchanged one (the leg itself is signed by the proxy);
#: 2**-64 per block is far below any real chance of a collision.
HASH_HEX: Final = 16
#: Seconds before D's stated expiry at which P no longer starts a read-back
#: (covers clock skew between hosts and the time to pin).
EXPIRY_MARGIN_S: Final = 2.0


class Fallback(enum.Enum):
    """Why P reads nothing back from D for a turn; the value is the metric label."""

    #: The kept turn was made under another ``cache_salt`` or LoRA adapter
    #: than this request's (``scope_tag``): another tenant's. P neither reads
    #: it nor releases it (not this request's to end).
    FOREIGN = "scope_mismatch"
    #: This engine runs without ``bidirectional_kv_xfer``.
    DISABLED = "disabled"
    #: The params name no block hashes (e.g. an upstream D): nothing can be
    #: verified, so nothing is read.
    UNVERIFIABLE = "unverifiable"
    #: Not even the first block of the new prompt equals D's history.
    MISMATCH = "prefix_mismatch"
    #: What D would send is shorter than ``kv_recompute_threshold`` tokens.
    SHORT = "below_threshold"
    #: D's lease is past (or about to pass) its expiry.
    EXPIRED = "expired"
    #: P's own prefix cache already holds everything D could send.
    CACHED = "cached_on_p"
    #: D's params do not fit this engine (TP size, block count).
    LAYOUT = "layout_mismatch"
    #: The read-back was planned but the load failed (D gone, lease lost).
    FAILED = "load_failed"


FALLBACK_LABELS: Final = tuple(f.value for f in Fallback)


def hash_scope(cache_salt: str | None, lora_name: str | None = None) -> bytes | None:
    """What besides its tokens makes a request's KV its own, as vLLM's block
    hashes see it (``kv_cache_utils.generate_block_hash_extra_keys``): its
    ``cache_salt`` and its LoRA adapter. None when it has neither."""
    if not cache_salt and not lora_name:
        return None
    scope = json.dumps([cache_salt or "", lora_name or ""], separators=(",", ":"))
    return hashlib.sha256(b"pdx-scope-v1:" + scope.encode()).digest()


def scope_tag(scope: bytes | None) -> str | None:
    """The scope as D's answer names it (``remote_hash_scope``): 16 hex
    digits, None for no scope. It says whose turn it is, nothing more: the
    hashes themselves are seeded with the whole scope."""
    return None if scope is None else scope[:HASH_HEX // 2].hex()


def block_hashes(token_ids: Sequence[int], block_size: int,
                 num_blocks: int | None = None, scope: bytes | None = None) -> list[str]:
    """Chained hashes of the first ``num_blocks`` full blocks of ``token_ids``
    (all full blocks when None): hash *i* covers tokens ``0 .. (i+1)*bs``,
    and the request's ``scope`` (``hash_scope``; None: unscoped)."""
    full = len(token_ids) // block_size
    n = full if num_blocks is None else min(num_blocks, full)
    out: list[str] = []
    seed = b"pdx-blocks-v1:%d" % block_size
    if scope is not None:
        seed += b":" + scope
    prev = hashlib.sha256(seed).digest()
    fmt = f"<{block_size}q"
    for i in range(n):
        chunk = token_ids[i * block_size:(i + 1) * block_size]
        prev = hashlib.sha256(prev + struct.pack(fmt, *chunk)).digest()
        out.append(prev[:HASH_HEX // 2].hex())
    return out


def matched_blocks(token_ids: Sequence[int], block_size: int, hashes: Sequence[str],
                   scope: bytes | None = None) -> int:
    """How many leading blocks of ``token_ids`` (under ``scope``) hash to
    ``hashes`` (in order)."""
    mine = block_hashes(token_ids, block_size, len(hashes), scope)
    n = 0
    for a, b in zip(mine, hashes, strict=False):
        if a != b:
            break
        n += 1
    return n


@dataclass(frozen=True)
class ReadBackPlan:
    """What P loads from D: D's blocks ``[first_block, first_block + num_blocks)``
    into P's first ``num_blocks`` newly allocated blocks."""

    num_tokens: int
    first_block: int
    num_blocks: int


def plan_readback(*, num_prompt_tokens: int, num_local_tokens: int, block_size: int,
                  num_matched_blocks: int, num_offered_blocks: int, threshold: int
                  ) -> ReadBackPlan | Fallback:
    """The read-back for one P request, or why there is none.

    ``num_local_tokens``: P's own prefix-cache hit (vLLM's, block-aligned).
    P always computes at least the prompt's last token itself (vLLM needs
    its logits), so at most ``(num_prompt_tokens - 1) // block_size`` blocks
    are read.
    """
    usable = min(num_matched_blocks, num_offered_blocks,
                 max(num_prompt_tokens - 1, 0) // block_size)
    if usable <= 0:
        return Fallback.MISMATCH
    if num_local_tokens % block_size:
        return Fallback.LAYOUT  # vLLM's prefix hits are whole blocks
    local_blocks = num_local_tokens // block_size
    if local_blocks >= usable:
        return Fallback.CACHED
    tokens = (usable - local_blocks) * block_size
    if tokens < threshold:
        return Fallback.SHORT
    return ReadBackPlan(num_tokens=tokens, first_block=local_blocks,
                        num_blocks=usable - local_blocks)


def wants_keep(engine_enabled: bool, leg_asks: bool | None, legs_signed: bool = False) -> bool:
    """Whether D keeps a finished turn's blocks: the engine allows it and the
    D leg asks for it (``pd_bidirectional``). A leg that does not say (vLLM's
    multi-turn demo proxy) leaves it to the engine, but only on an engine
    without a shared secret: with one (``legs_signed``), every leg comes from
    vllm-pd-proxy, which always says, so silence is no request."""
    if not engine_enabled:
        return False
    if leg_asks is None:
        return not legs_signed
    return leg_asks


class KeptTurns:
    """D's kept turns, oldest first, within a budget of blocks.

    ``admit`` makes room for a new turn by evicting the oldest kept turns
    that ``evict`` agrees to end (no P reads or heartbeats them yet); a turn
    that still does not fit is not kept. ``relieve`` ends the oldest ones
    when vLLM itself runs short of blocks. The owner calls ``discard`` when a
    kept turn's lease ends for any reason (read, expired, evicted).
    """

    def __init__(self, budget_blocks: int) -> None:
        self.budget_blocks = max(0, budget_blocks)
        self._kept: dict[str, int] = {}
        self.num_blocks = 0

    def __len__(self) -> int:
        return len(self._kept)

    def __contains__(self, key: object) -> bool:
        return key in self._kept

    def oldest_first(self) -> list[str]:
        return list(self._kept)

    def admit(self, num_blocks: int, evict: Callable[[str], bool]) -> bool:
        if num_blocks > self.budget_blocks:
            return False
        for key in list(self._kept):
            if self.num_blocks + num_blocks <= self.budget_blocks:
                break
            if evict(key):
                self.discard(key)
        return self.num_blocks + num_blocks <= self.budget_blocks

    def relieve(self, num_blocks: int, give_back: Callable[[str], int]) -> list[str]:
        """Memory pressure: end the oldest kept turns until ``num_blocks``
        blocks are on their way back to vLLM. ``give_back(key)`` ends one
        turn if it can and returns how many blocks that frees (0: it did not
        end it: a P reads it, or no block of it would come free). Returns the
        ended turns, oldest first."""
        ended: list[str] = []
        freed = 0
        for key in list(self._kept):
            if freed >= num_blocks:
                break
            n = give_back(key)
            if n > 0:
                self.discard(key)
                ended.append(key)
                freed += n
        return ended

    def add(self, key: str, num_blocks: int) -> None:
        self.discard(key)
        self._kept[key] = num_blocks
        self.num_blocks += num_blocks

    def discard(self, key: str) -> None:
        n = self._kept.pop(key, None)
        if n is not None:
            self.num_blocks -= n
