"""Batched prompts on /v1/completions, the pure part: split the request,
merge the answers as one vLLM engine would.

Role: vLLM answers ``"prompt": [p0, p1, ...]`` with one engine request per
prompt, all sharing the request's ``kv_transfer_params``, so only prompt 0's
KV could move from P to D. The proxy therefore sends each prompt as a
request of its own, a complete P/D handoff (:mod:`vllm_pd_proxy.batch_flow`
runs them), and merges the answers here, by vLLM's own rules
(``vllm/entrypoints/openai/completion/serving.py``):

* non-streamed: one answer, prompt 0's ``id``, ``created``, ``model`` (and
  ``kv_transfer_params``); the choices in prompt order, numbered as they
  come (``index`` = prompt * n + choice); usage summed, its
  ``prompt_tokens_details`` the last prompt's; no per-request ``metrics``;
* streamed: every chunk re-indexed the same way (``index`` = choice's index
  + prompt * n) under prompt 0's ``id`` and ``created``; each prompt's
  usage-only chunk held back and replaced, at the end, by one whose usage is
  summed (``prompt_tokens_details``: the first prompt's, vLLM's "first
  iteration"); continuous usage stats pass as they are (vLLM's are per
  prompt and choice too); one ``data: [DONE]``, sent by the flow.

No I/O and no state beyond one :class:`StreamMerge` per streamed batch, on
the event loop. Only batched requests pay for the JSON parse of each event.
"""

from __future__ import annotations

from typing import Any

import msgspec

from . import errors
from .telemetry import FIELD as TELEMETRY_FIELD

_decode = msgspec.json.decode
_encode = msgspec.json.encode

#: Usage counts a batch's answer sums over its prompts.
_SUMMED = ("prompt_tokens", "completion_tokens", "total_tokens")


def split_prompts(body: dict[str, Any], max_prompts: int) -> list[Any] | None:
    """The prompts of a batched completion request, or None if it has one.

    A batch is a list of two or more strings, or of two or more token-id
    lists; a string, a flat list of token ids and a list of one are not (the
    engine takes them as one prompt). A list mixing both kinds is left to
    the engine, which refuses it before anything is leased. 400 (naming the
    field) above ``max_prompts`` prompts, for an empty or malformed token-id
    prompt in a batch, and for ``prompt_embeds`` that would make the engine
    run several prompts under one handoff.
    """
    prompt = body.get("prompt")
    embeds = body.get("prompt_embeds")
    if embeds is not None and embeds != []:
        if (isinstance(embeds, list) and len(embeds) > 1) or prompt is not None:
            raise errors.bad_request(
                "prompt_embeds with several prompts (a list of embeddings, or embeddings "
                "and a prompt) is not supported by the P/D proxy: send one prompt per "
                "request", param="prompt_embeds")
        return None
    if not isinstance(prompt, list) or len(prompt) < 2:
        return None
    if all(isinstance(p, str) for p in prompt):
        pass
    elif all(isinstance(p, list) for p in prompt):
        for i, ids in enumerate(prompt):
            if not ids or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise errors.bad_request(
                    f"prompt[{i}] must be a non-empty list of token ids (integers >= 0)",
                    param="prompt")
    else:
        return None
    if len(prompt) > max_prompts:
        raise errors.bad_request(
            f"a batch of {len(prompt)} prompts is above the proxy's limit of {max_prompts} "
            "(--max-batch-prompts); send fewer prompts per request", param="prompt")
    return prompt


def merge_answers(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """One non-streamed answer from the batch's answers, in prompt order."""
    merged = dict(answers[0])
    choices: list[Any] = []
    for answer in answers:
        for choice in answer.get("choices") or ():
            # vLLM numbers a batch's choices as it appends them: prompt * n + choice.
            choices.append({**choice, "index": len(choices)} if isinstance(choice, dict)
                           else choice)
    merged["choices"] = choices
    usages = [u for a in answers if isinstance(u := a.get("usage"), dict)]
    if usages and len(usages) == len(answers):
        # vLLM takes prompt_tokens_details from the last prompt of the batch.
        merged["usage"] = sum_usage(usages, details=usages[-1])
    if merged.get("metrics") is not None:
        merged["metrics"] = None  # vLLM: not attributable to one prompt
    if any(TELEMETRY_FIELD in a for a in answers):
        merged[TELEMETRY_FIELD] = [a.get(TELEMETRY_FIELD) for a in answers]
    return merged


def sum_usage(usages: list[dict[str, Any]], details: dict[str, Any]) -> dict[str, Any]:
    """The first usage with the counts summed over all, and ``details``'
    ``prompt_tokens_details`` (if it has the key)."""
    total = dict(usages[0])
    for key in _SUMMED:
        counts = [u.get(key) for u in usages]
        if all(isinstance(c, int) for c in counts):
            total[key] = sum(counts)
    if "prompt_tokens_details" in details:
        total["prompt_tokens_details"] = details["prompt_tokens_details"]
    return total


class StreamMerge:
    """The merge of a streamed batch's SSE events (pure; one per batch).

    :meth:`set_head` with prompt 0's first events, then :meth:`rewrite` for
    every run of complete events of every prompt, in any interleaving; at
    the end :meth:`usage_event` for the summed usage chunk, if there is one.
    """

    __slots__ = ("_head", "_held", "_n")

    def __init__(self, num_prompts: int, n: int) -> None:
        self._n = n
        self._head: dict[str, Any] = {}
        self._held: list[dict[str, Any] | None] = [None] * num_prompts

    def set_head(self, events: bytes) -> None:
        """Take ``id`` and ``created`` from prompt 0's first chunk."""
        for payload in _payloads(events):
            chunk = _json(payload)
            if chunk is not None and "id" in chunk:
                self._head = {k: chunk[k] for k in ("id", "created") if k in chunk}
                return

    def rewrite(self, prompt: int, events: bytes) -> tuple[bytes, bool]:
        """Prompt ``prompt``'s complete events as the merged stream carries
        them, and whether one was an error (the batch's stream ends with it).

        ``[DONE]`` and the usage-only chunk are taken out (the flow sends one
        of each at the end); other chunks get the batch's indices and head.
        """
        out: list[bytes] = []
        failed = False
        for event in events.split(b"\n\n"):
            if not event.strip():
                continue
            payload = _payload(event)
            chunk = _json(payload) if payload is not None else None
            if chunk is None:
                if payload is None or payload.strip() != b"[DONE]":
                    out.append(event + b"\n\n")  # a comment, or what we cannot read
                continue
            if "error" in chunk and "choices" not in chunk:
                failed = True
                out.append(event + b"\n\n")
                break
            choices = chunk.get("choices")
            if choices == [] and chunk.get("usage") is not None:
                self._held[prompt] = chunk
                continue
            if isinstance(choices, list):
                offset = prompt * self._n
                for choice in choices:
                    if isinstance(choice, dict) and isinstance(choice.get("index"), int):
                        choice["index"] += offset
            chunk.update(self._head)
            out.append(b"data: " + _encode(chunk) + b"\n\n")
        return b"".join(out), failed

    def usage_event(self) -> bytes | None:
        """The summed usage chunk (None if no prompt sent one): the first
        prompt's, counts summed over all, no per-request ``metrics``."""
        held = [c for c in self._held if c is not None]
        if not held:
            return None
        usages = [c["usage"] for c in held]
        chunk = dict(held[0], usage=sum_usage(usages, details=usages[0]), **self._head)
        chunk.pop("metrics", None)  # vLLM: not attributable to one prompt
        return b"data: " + _encode(chunk) + b"\n\n"


def _payload(event: bytes) -> bytes | None:
    """The data of one SSE event (vLLM sends one ``data:`` line per event)."""
    event = event.strip()
    if not event.startswith(b"data:"):
        return None
    return event[5:].lstrip(b" ")


def _payloads(events: bytes) -> list[bytes]:
    return [p for e in events.split(b"\n\n") if (p := _payload(e)) is not None]


def _json(payload: bytes) -> dict[str, Any] | None:
    if not payload.startswith(b"{"):
        return None
    try:
        value = _decode(payload)
    except msgspec.DecodeError:
        return None
    return value if isinstance(value, dict) else None
