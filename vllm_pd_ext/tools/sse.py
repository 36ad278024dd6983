"""The client side of an OpenAI-style completion stream (``text/event-stream``).

Who uses it: every client here that reads a streamed ``/v1/completions`` or
``/v1/chat/completions`` answer: the SLO benchmark's client
(``tools/slo/client.py``), the soak's client, the e2e tests' helpers, the
proxy tests (``strict``) and the benchmarks. Not the proxy: its relay
forwards events whole, with its own limits, and never decodes them.

What vLLM writes, and so what this reads: one ``data: <JSON object>`` line
per event, a blank line after each, ``data: [DONE]`` last. An in-stream
failure is an object with an ``"error"`` key (vLLM's and the proxy's own).
:class:`SSEParser` turns bytes split anywhere (mid-line, mid-UTF-8) into
:class:`Event`\\s, one per ``data:`` line as soon as its line ends (a
client timing tokens must not wait for the blank line). Other SSE fields
and comments are skipped; anything after ``[DONE]`` is ignored.

Lifecycle of one parser: ``feed()`` each piece as it arrives, in order;
``close()`` once at the end of the body (it flushes a last line without a
line end). ``done`` tells whether ``[DONE]`` came. :func:`iter_events` does
both over a blocking source of byte pieces, :func:`response_events` over a
blocking HTTP response, :func:`parse` over a whole body.
A malformed ``data:`` line raises :class:`SSEError` (a ``ValueError``).
:func:`text_of`, :func:`token_ids_of` and :func:`error_message` read what
a chunk carries.

``strict=True`` is for tests of a server's framing: it also rejects any
line that is not a ``data:`` line, two ``data:`` lines without the blank
line between, anything after ``[DONE]``, and a body that ends inside an
event.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import msgspec

#: The payload of the last event, as it stands on the wire.
DONE: Final = "[DONE]"


class SSEError(ValueError):
    """A stream that is not what vLLM would send (names the offending line)."""


class Kind(enum.Enum):
    CHUNK = "chunk"  # a JSON object: generated text, usage, telemetry
    ERROR = "error"  # a JSON object with an "error" key: the request failed
    DONE = "done"  # data: [DONE]: the stream is complete


@dataclass(frozen=True, slots=True)
class Event:
    """One ``data:`` line: its kind and its JSON object (``{}`` for DONE)."""

    kind: Kind
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def payload(self) -> dict[str, Any] | str:
        """The object, or ``"[DONE]"``: a list of payloads ends as the wire does."""
        return DONE if self.kind is Kind.DONE else self.data



_DONE_EVENT: Final = Event(Kind.DONE)


class SSEParser:
    """Incremental parser: bytes in, :class:`Event`\\s out (see the module docstring)."""

    def __init__(self, *, strict: bool = False) -> None:
        self._buf = bytearray()
        self._strict = strict
        self._in_event = False  # strict: a data line still waits for its blank line
        self.done = False

    def feed(self, data: bytes) -> list[Event]:
        """The events whose lines ``data`` completes, in order."""
        self._buf += data
        out: list[Event] = []
        while (nl := self._buf.find(b"\n")) >= 0:
            line = bytes(self._buf[:nl])
            del self._buf[:nl + 1]
            if (event := self._line(line)) is not None:
                out.append(event)
        return out

    def close(self) -> list[Event]:
        """End of the body: the event of a last line without a line end, if any."""
        line, self._buf = bytes(self._buf), bytearray()
        if self._strict and (line.rstrip(b"\r") or self._in_event):
            raise SSEError(f"the stream ends inside an event: {line[:80]!r}")
        event = self._line(line)
        return [] if event is None else [event]

    def _line(self, line: bytes) -> Event | None:
        line = line.rstrip(b"\r")
        if self._strict:
            self._check_framing(line)
        if self.done or not line.startswith(b"data:"):
            return None
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return _DONE_EVENT
        if not payload:
            return None
        try:
            obj = msgspec.json.decode(payload)
        except msgspec.DecodeError as exc:
            raise SSEError(f"malformed data line {payload[:80]!r}: {exc}") from None
        if not isinstance(obj, dict):
            raise SSEError(f"data line is not a JSON object: {payload[:80]!r}")
        return Event(Kind.ERROR if "error" in obj else Kind.CHUNK, obj)

    def _check_framing(self, line: bytes) -> None:
        if not line:
            self._in_event = False
            return
        if self.done:
            raise SSEError(f"a line after [DONE]: {line[:80]!r}")
        if not line.startswith(b"data:"):
            raise SSEError(f"not a data line: {line[:80]!r}")
        if self._in_event:
            raise SSEError(f"two data lines in one event: {line[:80]!r}")
        self._in_event = True


def iter_events(pieces: Iterable[bytes], *, strict: bool = False) -> Iterator[Event]:
    """Events from a blocking source of byte pieces, each yielded as soon as
    its piece is read (for an HTTP response: :func:`response_events`).

    It reads the source to its end (a caller that has what it needs, e.g.
    ``[DONE]``, breaks out of the loop) and flushes a last unterminated line.
    """
    parser = SSEParser(strict=strict)
    for piece in pieces:
        yield from parser.feed(piece)
    yield from parser.close()


class Readable(Protocol):
    """A blocking response body: ``http.client.HTTPResponse`` (``urllib``'s too)."""

    def read1(self, n: int = -1, /) -> bytes: ...


def response_events(resp: Readable, *, strict: bool = False) -> Iterator[Event]:
    """:func:`iter_events` over a blocking response, reading what has arrived
    (``read1``): an event is out as soon as its bytes are, and a socket closed
    under the reader (a deadline's watchdog) ends it with an ``OSError``."""
    return iter_events(iter(lambda: resp.read1(65536), b""), strict=strict)


def parse(body: bytes, *, strict: bool = False) -> list[Event]:
    """Every event of a whole body."""
    return list(iter_events([body], strict=strict))


def text_of(chunk: Mapping[str, Any]) -> str:
    """The generated text a chunk (or a whole answer) carries: each choice's
    completion ``text`` or chat ``delta.content``; "" for none."""
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return ""
    out = []
    for choice in choices:
        if isinstance(choice, dict):
            delta = choice.get("delta")
            text = choice.get("text") or (delta.get("content") if isinstance(delta, dict)
                                          else None)
            if isinstance(text, str):
                out.append(text)
    return "".join(out)


def token_ids_of(chunk: Mapping[str, Any]) -> list[int]:
    """The token ids a chunk (or a whole answer) carries, every choice's
    ``token_ids`` (vLLM with ``return_token_ids``); [] for none."""
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return []
    out: list[int] = []
    for choice in choices:
        ids = choice.get("token_ids") if isinstance(choice, dict) else None
        if isinstance(ids, list):
            out.extend(i for i in ids if isinstance(i, int))
    return out


def error_message(chunk: Mapping[str, Any]) -> str:
    """An error event's text: ``error.message``, else the error itself; "" for none."""
    error = chunk.get("error")
    if error is None:
        return ""
    return str(error.get("message", error) if isinstance(error, dict) else error)
