"""Cheap prompt inspection for routing: token estimates and prefix keys.

Role: the proxy never tokenizes (that would need the model's tokenizer and
cost more than the forwarding itself). It estimates prompt tokens as
``len(text) / 4`` for text and ``len(ids)`` for token-id prompts, which is
enough to compare load between engines and to apply the local-prefill
threshold. Stateless functions plus :class:`PrefixChunks`, a bounded
per-decode-engine memory of the prompt chunks it served, from which the
proxy estimates a prompt's uncached tokens. Called once per request on the
event loop.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

# Average characters per token for English-like text with BPE tokenizers; the
# estimate only has to be monotonic and roughly right, not exact.
CHARS_PER_TOKEN = 4


def _text_of_content(content: Any) -> str:
    """Text of a chat message ``content`` (a string or a list of typed parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        # Chat parts carry "text"; Responses API parts too ("input_text").
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


def responses_as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A Responses API body's prompt as a chat body's ``messages``, for the
    estimates: ``instructions`` as the system message, then ``input`` (a
    string, or a list of message items; other items count as nothing)."""
    messages: list[Any] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        messages.extend(item for item in given if isinstance(item, dict))
    return {"messages": messages}


def _count(flat: str | list[Any]) -> int:
    return len(flat) // CHARS_PER_TOKEN if isinstance(flat, str) else len(flat)


def estimate_tokens(body: dict[str, Any], chat: bool) -> int:
    """Estimated prompt tokens of a completion/chat request body."""
    return _count(_flatten(body, chat))


def _chain(flat: str | list[Any], chunk_tokens: int) -> tuple[int, ...]:
    step = chunk_tokens * CHARS_PER_TOKEN if isinstance(flat, str) else chunk_tokens
    keys: list[int] = []
    prev = 0
    for start in range(0, len(flat) - step + 1, step):
        piece = flat[start:start + step]
        try:
            prev = hash((prev, piece if isinstance(piece, str) else tuple(piece)))
        except TypeError:
            # Not token ids (a client's garbage the engine will refuse):
            # nothing from here on can match a cached prefix.
            break
        keys.append(prev)
    return tuple(keys)


def chunk_keys(body: dict[str, Any], chat: bool, chunk_tokens: int) -> tuple[int, ...]:
    """Chain hashes of the prompt's whole chunks of ``chunk_tokens`` tokens.

    Key ``i`` covers the prompt's first ``(i + 1) * chunk_tokens`` tokens (ids
    counted exactly, text as ``CHARS_PER_TOKEN`` chars per token), the way
    vLLM's block hashes chain, so equal key ``i`` means an equal prefix up to
    it. The partial last chunk has no key: like a partial block, an engine
    does not cache it.
    """
    return _chain(_flatten(body, chat), chunk_tokens)


def inspect_prompt(body: dict[str, Any], chat: bool, chunk_tokens: int | None
                   ) -> tuple[int, tuple[int, ...]]:
    """:func:`estimate_tokens` and, unless ``chunk_tokens`` is None,
    :func:`chunk_keys`, flattening the prompt once (a chat body's messages
    are joined into one string: not worth doing twice per request)."""
    flat = _flatten(body, chat)
    return _count(flat), (() if chunk_tokens is None else _chain(flat, chunk_tokens))


class PrefixChunks:
    """What one decode engine probably still caches: a bounded LRU of the chunk
    keys (:func:`chunk_keys`) of the prompts it served, least recently used
    forgotten first (as the engine's own prefix cache evicts).

    Role: the proxy's estimate of an engine's prefix cache, from which it
    decides on *uncached* prompt tokens (llm-d's decider, Dynamo's
    ``eff_isl``). An estimate only: the engine may have evicted sooner, and
    the proxy never learns of that; the cost of a wrong guess is one local
    prefill that was longer than the threshold.
    """

    __slots__ = ("_capacity", "_keys")

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._keys: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def cached_chunks(self, keys: tuple[int, ...]) -> int:
        """How many of ``keys``, from the first, this engine has served."""
        n = 0
        for key in keys:
            if key not in self._keys:
                break
            n += 1
        return n

    def add(self, keys: tuple[int, ...]) -> None:
        """Remember ``keys`` as served now (most recently used)."""
        for key in keys:
            if key in self._keys:
                self._keys.move_to_end(key)
            else:
                self._keys[key] = None
        while len(self._keys) > self._capacity:
            self._keys.popitem(last=False)
