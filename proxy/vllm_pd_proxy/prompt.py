"""Cheap prompt inspection for routing: token estimates and prefix keys.

Role: the proxy never tokenizes (that would need the model's tokenizer and
cost more than the forwarding itself). It estimates prompt tokens as
``len(text) / 4`` for text and ``len(ids)`` for token-id prompts, which is
enough to compare load between engines and to apply the local-prefill
threshold. Stateless functions plus :class:`PrefixLRU`, a small per-decode
engine memory of recently served prompt prefixes (prefix-aware conditional
disaggregation). Called once per request on the event loop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

# Average characters per token for English-like text with BPE tokenizers; the
# estimate only has to be monotonic and roughly right, not exact.
CHARS_PER_TOKEN = 4


def _text_of_content(content: Any) -> str:
    """Text of a chat message ``content`` (a string or a list of typed parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict)]
        return "".join(t for t in texts if isinstance(t, str))
    return ""


def _flatten(body: dict[str, Any], chat: bool) -> str | list[Any]:
    """The prompt as one string (text prompts, chat) or one token-id list."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return ""
        # Role names are part of what the engine prefills (chat template), and
        # keep "user: a" distinct from "system: a" for prefix keys.
        return "".join(
            f"{m.get('role', '')}\x00{_text_of_content(m.get('content'))}\x01"
            for m in messages
            if isinstance(m, dict)
        )
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):
            return prompt
        # Batched prompts: the engine prefills all of them; concatenate.
        if isinstance(first, str):
            return "".join(p for p in prompt if isinstance(p, str))
        if isinstance(first, list):
            return [t for p in prompt if isinstance(p, list) for t in p]
    return ""


def estimate_tokens(body: dict[str, Any], chat: bool) -> int:
    """Estimated prompt tokens of a completion/chat request body."""
    flat = _flatten(body, chat)
    if isinstance(flat, str):
        return len(flat) // CHARS_PER_TOKEN
    return len(flat)


def prefix_key(body: dict[str, Any], chat: bool, length: int) -> tuple[Hashable, int] | None:
    """``(key, estimated tokens of the prefix)`` for the first ``length`` chars/ids.

    None when the prompt is not longer than ``length``: such a prompt has no
    shared prefix worth remembering beyond itself.
    """
    flat = _flatten(body, chat)
    if len(flat) <= length:
        return None
    if isinstance(flat, str):
        return hash(flat[:length]), length // CHARS_PER_TOKEN
    return hash(tuple(flat[:length])), length


class PrefixLRU:
    """Bounded set of recently seen prefix keys, least recently used evicted."""

    __slots__ = ("_capacity", "_keys")

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._keys: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys

    def touch(self, key: Hashable) -> bool:
        """Record ``key``; return whether it was already present."""
        hit = key in self._keys
        if hit:
            self._keys.move_to_end(key)
        else:
            self._keys[key] = None
            if len(self._keys) > self._capacity:
                self._keys.popitem(last=False)
        return hit
