"""What a streamed answer has given the client, and the splice of a continuation.

Role: pure (no I/O). One :class:`StreamTracker` per streamed prompt when
``--max-migrations`` > 0; :func:`~vllm_pd_proxy.relay.relay_stream` passes
every run of complete SSE events from D through :meth:`StreamTracker.feed`
before the client sink, and learns from it:

* an **error event** from D (``data: {"error": ...}``) is withheld and
  reported, so the proxy can migrate instead of relaying it (before the
  first byte: the whole handoff again; after it: a continuation);
* the **token ids** the client already has: the proxy asks D for them
  (``return_token_ids``) and, when the client did not, blanks them as vLLM
  does (``null``) and drops the chunks vLLM sends only because they were
  asked for, so the client sees what a collocated engine sends;
* a **continuation** (a completions stream from another D, see
  :mod:`vllm_pd_proxy.migration`, or the chat stream of push's concurrent
  D leg after P's token #1) is rewritten into the original stream:
  the original id, ``created``, model and object, chat chunks for a chat
  request, completions ``text_offset`` shifted past the text already sent,
  and usage counting the original prompt and every generated token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

_decode = msgspec.json.decode
_encode = msgspec.json.encode
_DATA = b"data:"
_ERROR_KEY = b'"error"'  # only a key (or the exact value "error") has it unescaped


@dataclass(slots=True)
class UpstreamError:
    """An error event D sent: its status code and message."""

    status: int
    message: str
    #: The event's data as D sent it (relayed verbatim if it ends the stream).
    raw: bytes = b""


def _events(buf: bytes) -> list[bytes]:
    """``buf`` (complete events) split into events, separators kept."""
    out: list[bytes] = []
    start = 0
    n = len(buf)
    while start < n:
        lf = buf.find(b"\n\n", start)
        crlf = buf.find(b"\r\n\r\n", start)
        if lf < 0 and crlf < 0:
            out.append(buf[start:])
            break
        end = crlf + 4 if crlf >= 0 and (lf < 0 or crlf < lf) else lf + 2
        out.append(buf[start:end])
        start = end
    return out


def _payload(event: bytes) -> bytes | None:
    """The data of a one-line ``data:`` event (None: anything else)."""
    body = event.rstrip(b"\r\n")
    if not body.startswith(_DATA) or b"\n" in body:
        return None
    return body[len(_DATA):].strip()


def _error_of(obj: Any) -> UpstreamError | None:
    if not isinstance(obj, dict) or "error" not in obj or "choices" in obj:
        return None
    err = obj["error"]
    status, message = 500, str(err)[:300]
    if isinstance(err, dict):
        code = err.get("code")
        if isinstance(code, int) and 400 <= code <= 599:
            status = code
        message = str(err.get("message", message))[:300]
    return UpstreamError(status, message)


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(type(v) is int for v in value):
        return value
    return None


@dataclass(slots=True)
class StreamTracker:
    """One streamed prompt's state across the D legs that serve it.

    ``chat``: a chat stream (a continuation's completions chunks become chat
    chunks); ``blank_ids``: the proxy asked for token ids the client did not
    (blank them); ``track_ids``: D was asked for token ids (a continuation
    is possible).
    """

    chat: bool
    blank_ids: bool
    track_ids: bool
    prompt_ids: list[int] | None = None
    sent_ids: list[int] = field(default_factory=list)
    #: Characters of completion text the client got.
    text_chars: int = 0
    #: Where the next completions logprobs ``text_offset`` starts: the last
    #: one the client got plus its token's length (vLLM advances offsets by
    #: the logprobs' token strings, which ``return_tokens_as_token_ids``
    #: makes ``token_id:N``); None: no logprobs yet (``text_chars`` then).
    offset_next: int | None = None
    #: A continuation's offsets are shifted by this (set when it begins).
    offset_base: int = 0
    #: A chunk with a finish_reason reached the client.
    finished: bool = False
    #: ``data: [DONE]`` reached the client.
    done: bool = False
    #: Whether any event reached the client.
    wrote: bool = False
    #: From the first chunk: id, created, model, object.
    head: dict[str, Any] = field(default_factory=dict)
    #: The last chat chunk with choices, as the client got it (the shape a
    #: continuation's chunks copy).
    template: dict[str, Any] | None = None
    #: Set while relaying a continuation: the prompt and completion tokens
    #: of the original request before it.
    base: tuple[int, int] | None = None

    @property
    def can_continue(self) -> bool:
        """Whether a continuation can pick up where the client is."""
        return (self.track_ids and self.prompt_ids is not None and not self.finished
                and not self.done)

    def begin_continuation(self) -> None:
        """The next events come from a continuation leg."""
        assert self.prompt_ids is not None
        self.base = (len(self.prompt_ids), len(self.sent_ids))
        # The continuation's own offsets start at 0 and accumulate; the
        # client's went on from here.
        self.offset_base = self.text_chars if self.offset_next is None else self.offset_next

    def finish_length(self, include_usage: bool) -> bytes:
        """The end of a stream whose every token reached the client but whose
        finishing chunk was lost: ``finish_reason`` ``length``, the usage
        chunk if asked, ``[DONE]`` (call after :meth:`begin_continuation`)."""
        chunks: list[dict[str, Any]] = [{"choices": [{"index": 0, "text": "", "logprobs": None,
                                "finish_reason": "length", "stop_reason": None,
                                "token_ids": []}]}]
        if include_usage:
            chunks.append({"choices": [], "usage": {"prompt_tokens": 0, "completion_tokens": 0,
                                                    "total_tokens": 0}})
        out = [b"data: " + _encode(c) + b"\n\n" for c in map(self._splice, chunks)
               if c is not None]
        return b"".join(out) + b"data: [DONE]\n\n"

    def feed(self, events: bytes) -> tuple[bytes, UpstreamError | None]:
        """Complete SSE events from D: (what the client gets, D's error event).

        An error event and everything after it are withheld.
        """
        rewrite = self.track_ids or self.base is not None
        if not rewrite and _ERROR_KEY not in events:
            self.wrote = self.wrote or bool(events)
            self.done = self.done or b"data: [DONE]" in events
            return events, None
        out: list[bytes] = []
        for event in _events(events):
            data = _payload(event)
            if data is None or data == b"[DONE]":
                self.done = self.done or data == b"[DONE]"
                out.append(event)
                continue
            if not rewrite and _ERROR_KEY not in data:
                out.append(event)
                continue
            try:
                obj = _decode(data)
            except msgspec.DecodeError:
                out.append(event)
                continue
            error = _error_of(obj)
            if error is not None:
                error.raw = data
                return self._flush(out), error
            if not isinstance(obj, dict) or not rewrite:
                out.append(event)
                continue
            obj = self._splice(obj) if self.base is not None else self._original(obj)
            if obj is not None:
                out.append(b"data: " + _encode(obj) + b"\n\n")
        return self._flush(out), None

    def _flush(self, out: list[bytes]) -> bytes:
        joined = b"".join(out)
        self.wrote = self.wrote or bool(joined)
        return joined

    # ---------------------------------------------------------- the original
    def _original(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """A chunk of the first D's stream: record it; blank asked-for ids."""
        if not self.head:
            self.head = {k: obj[k] for k in ("id", "created", "model", "object") if k in obj}
        top_ids = _int_list(obj.get("prompt_token_ids"))
        if top_ids is not None and self.prompt_ids is None:
            self.prompt_ids = list(top_ids)
        if top_ids is not None and self.blank_ids:
            obj["prompt_token_ids"] = None
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return obj
        keep = not choices  # a usage chunk
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            ids = _int_list(choice.get("prompt_token_ids"))
            if ids is not None and self.prompt_ids is None:
                self.prompt_ids = list(ids)
            new = _int_list(choice.get("token_ids"))
            if new is not None:
                self.sent_ids.extend(new)
            text = choice.get("text")
            if isinstance(text, str):
                self.text_chars += len(text)
            self._note_offsets(choice.get("logprobs"))
            if choice.get("finish_reason") is not None:
                self.finished = True
            if self.blank_ids:
                if "prompt_token_ids" in choice:
                    choice["prompt_token_ids"] = None
                if "token_ids" in choice:
                    choice["token_ids"] = None
            if self.chat and self.blank_ids and _empty_chat_delta(choice):
                continue  # sent only because token ids were asked for
            keep = True
        if self.chat and choices:
            self.template = obj
        return obj if keep else None

    # ------------------------------------------------------ the continuation
    def _splice(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """A continuation chunk (completions, or chat from a concurrent D
        leg) as the original stream's next."""
        assert self.base is not None
        choices = obj.get("choices")
        usage = obj.get("usage")
        if isinstance(usage, dict):
            usage = self._usage(usage)
        if not isinstance(choices, list) or not choices:
            out = self._top(obj)
            out["choices"] = [] if isinstance(choices, list) else choices
            if usage is not None:
                out["usage"] = usage
            return out
        choice = choices[0] if isinstance(choices[0], dict) else {}
        delta = choice.get("delta")
        extra: dict[str, Any] = {}
        if isinstance(delta, dict):
            # A chat continuation (push's concurrent D leg is the client's
            # chat request): its role chunk went out with token #1 already;
            # what its parsers put beside the content goes through.
            if "role" in delta and not delta.get("content") and choice.get(
                    "finish_reason") is None and not choice.get("token_ids"):
                return None
            raw_text = delta.get("content")
            extra = {k: v for k, v in delta.items()
                     if k not in ("role", "content") and v is not None}
        else:
            raw_text = choice.get("text")
        new = _int_list(choice.get("token_ids")) or []
        self.sent_ids.extend(new)
        text = raw_text if isinstance(raw_text, str) else ""
        finish = choice.get("finish_reason")
        if finish is not None:
            self.finished = True
        ids_out = None if self.blank_ids else new
        if not self.chat:
            one = dict(choice)
            one["index"] = 0
            if "prompt_token_ids" in one:
                one["prompt_token_ids"] = None
            if "token_ids" in one:
                one["token_ids"] = ids_out
            logprobs = one.get("logprobs")
            if isinstance(logprobs, dict) and isinstance(logprobs.get("text_offset"), list):
                shift = self.offset_base
                logprobs["text_offset"] = [o + shift if type(o) is int else o
                                           for o in logprobs["text_offset"]]
            self._note_offsets(logprobs)
            self.text_chars += len(text)
            out = self._top(obj)
            out["choices"] = [one]
        else:
            if not text and not extra and finish is None and self.blank_ids:
                return None  # vLLM's chat sends no empty chunk unasked
            out = self._chat_chunk(obj, text, finish, choice.get("stop_reason"), ids_out)
            if extra:
                out["choices"][0]["delta"].update(extra)
        if usage is not None:
            out["usage"] = usage
        return out

    def _note_offsets(self, logprobs: Any) -> None:
        """Remember where the offsets of the client's next logprobs start."""
        after = next_text_offset(logprobs)
        if after is not None:
            self.offset_next = after

    def _top(self, obj: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in obj.items() if k != "choices"}
        out.update(self.head)
        return out

    def _chat_chunk(self, obj: dict[str, Any], text: str, finish: Any, stop_reason: Any,
                    ids: list[int] | None) -> dict[str, Any]:
        template = self.template or {"choices": [{"index": 0, "delta": {},
                                                  "logprobs": None, "finish_reason": None}]}
        out = {k: v for k, v in template.items()
               if k not in ("choices", "usage", "prompt_token_ids", "prompt_text")}
        out.update(self.head)
        base = template["choices"][0] if template.get("choices") else {}
        choice = {k: v for k, v in base.items() if k not in ("delta", "logprobs",
                                                             "finish_reason", "stop_reason",
                                                             "token_ids")}
        choice["index"] = 0
        choice["delta"] = {"content": text} if text else {}
        choice["logprobs"] = None
        choice["finish_reason"] = finish
        if finish is not None or "stop_reason" in base:
            choice["stop_reason"] = stop_reason
        choice["token_ids"] = ids
        out["choices"] = [choice]
        if "usage" in obj and obj["usage"] is None:
            out["usage"] = None
        return out

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        assert self.base is not None
        prompt, generated = self.base
        out = dict(usage)
        completion = usage.get("completion_tokens")
        completion = completion if type(completion) is int else 0
        out["prompt_tokens"] = prompt
        out["completion_tokens"] = generated + completion
        out["total_tokens"] = prompt + generated + completion
        return out


def next_text_offset(logprobs: Any) -> int | None:
    """Where completions logprobs offsets go on after ``logprobs``: the last
    offset plus its token string's length (vLLM advances them by the token
    strings, ``token_id:N`` with ``return_tokens_as_token_ids``, not by the
    text); None when ``logprobs`` has no offsets."""
    if not isinstance(logprobs, dict):
        return None
    offsets, tokens = logprobs.get("text_offset"), logprobs.get("tokens")
    if (isinstance(offsets, list) and isinstance(tokens, list) and offsets
            and len(offsets) == len(tokens) and type(offsets[-1]) is int
            and isinstance(tokens[-1], str)):
        return int(offsets[-1]) + len(tokens[-1])
    return None


def _empty_chat_delta(choice: dict[str, Any]) -> bool:
    return (choice.get("delta") == {} and choice.get("finish_reason") is None
            and choice.get("logprobs") is None)
