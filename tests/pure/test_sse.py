"""tools/sse.py: the one SSE client parser, fed bytes split anywhere, its
event kinds, the blocking iterator, and strict framing for server tests."""

from __future__ import annotations

import json
from typing import Any

import pytest

from vllm_pd_ext.tools import sse
from vllm_pd_ext.tools.sse import DONE, Event, Kind, SSEError, SSEParser


def data(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def text_chunk(text: str) -> dict[str, Any]:
    return {"id": "cmpl-1", "object": "text_completion",
            "choices": [{"index": 0, "text": text, "finish_reason": None}]}


ERROR = {"error": {"message": "kv load failed", "code": 500}}
STREAM = (b": keep-alive comment\r\n"
          + b"event: message\n"
          + data(text_chunk("h\u00e9llo \u2603"))
          + b"data:" + json.dumps(text_chunk("x")).encode() + b"\r\n\r\n"
          + data(ERROR)
          + data({"choices": [], "usage": {"completion_tokens": 2}, "pd_telemetry": {"a": 1}})
          + b"data: [DONE]\n\n"
          + b"data: {\"after\": true}\n\n")


def _parse(pieces: list[bytes]) -> tuple[list[Event], bool]:
    parser = SSEParser()
    events = [e for piece in pieces for e in parser.feed(piece)]
    return events + parser.close(), parser.done


def test_kinds_payloads_and_nothing_after_done():
    events, done = _parse([STREAM])
    assert done
    assert [e.kind for e in events] == [Kind.CHUNK, Kind.CHUNK, Kind.ERROR, Kind.CHUNK, Kind.DONE]
    assert events[0].data["choices"][0]["text"] == "h\u00e9llo \u2603"
    assert events[1].data["choices"][0]["text"] == "x"
    assert sse.error_message(events[2].data) == "kv load failed"
    assert sse.error_message(events[0].data) == ""
    assert events[3].data["pd_telemetry"] == {"a": 1}
    assert [e.payload for e in events][-2:] == [events[3].data, DONE]
    assert events[4].data == {} and DONE == "[DONE]"


def test_any_split_gives_the_same_events():
    whole = _parse([STREAM])
    for cut in range(1, len(STREAM)):
        assert _parse([STREAM[:cut], STREAM[cut:]]) == whole, cut
    assert _parse([STREAM[i:i + 1] for i in range(len(STREAM))]) == whole
    for a, b in ((3, 40), (17, 18), (60, 61)):
        assert _parse([STREAM[:a], STREAM[a:b], STREAM[b:]]) == whole


def test_an_event_is_out_when_its_line_ends():
    """A client timing tokens gets each event with the bytes that end its
    line, not one read later with the blank line."""
    parser = SSEParser()
    assert parser.feed(data(text_chunk("a"))[:-2]) == []
    assert [e.kind for e in parser.feed(b"\n")] == [Kind.CHUNK]
    assert parser.feed(b"\n") == []


def test_error_message_of_a_plain_error_and_kind_of_any_error_key():
    (event,) = sse.parse(data({"error": "boom"}))
    assert (event.kind, sse.error_message(event.data)) == (Kind.ERROR, "boom")
    (event,) = sse.parse(data({"error": {"code": 503}}))
    assert sse.error_message(event.data) == "{'code': 503}"


def test_unterminated_last_line_and_malformed_lines():
    parser = SSEParser()
    assert parser.feed(data(text_chunk("a"))[:-2] + b"\n" + b"data: [DO") != []
    assert not parser.done
    assert parser.feed(b"NE]") == []
    assert parser.close() == [Event(Kind.DONE)] and parser.done
    with pytest.raises(SSEError, match="malformed"):
        SSEParser().feed(b"data: {oops}\n")
    with pytest.raises(SSEError, match="not a JSON object"):
        SSEParser().feed(b"data: [1, 2]\n")
    assert issubclass(SSEError, ValueError)  # callers that caught json's errors still do
    assert sse.parse(b"data:\n\ndata: \n\n") == []  # empty data lines carry nothing


def test_iter_events_yields_as_pieces_arrive_and_reads_to_the_end():
    read: list[bytes] = []

    def pieces():
        for piece in (data(text_chunk("a")), data(text_chunk("b")) + b"data: [DONE]\n\n",
                      b"data: {\"late\": 1}\n\n", b"data: [DONE]"):
            read.append(piece)
            yield piece

    it = sse.iter_events(pieces())
    assert next(it).data["choices"][0]["text"] == "a" and len(read) == 1  # not buffered
    assert [e.kind for e in it] == [Kind.CHUNK, Kind.DONE]
    assert len(read) == 4  # the rest is read (and ignored): the caller breaks to stop
    # A last line without its line end still counts (a line-iterated response).
    assert [e.kind for e in sse.iter_events([b"data: {}\n", b"data: [DONE]"])] == [
        Kind.CHUNK, Kind.DONE]


def test_response_events_reads_what_has_arrived():
    """A blocking response is read with read1 (what has arrived, up to a
    size), so an event is out without waiting for a full buffer."""

    class Response:
        def __init__(self, pieces: list[bytes]) -> None:
            self.pieces, self.sizes = pieces, []

        def read1(self, n: int = -1, /) -> bytes:
            self.sizes.append(n)
            return self.pieces.pop(0) if self.pieces else b""

    resp = Response([data(text_chunk("a")), b"data: [DO", b"NE]\n\n"])
    it = sse.response_events(resp)
    assert next(it).kind is Kind.CHUNK and resp.sizes == [65536]
    assert [e.kind for e in it] == [Kind.DONE] and resp.sizes == [65536] * 4


def test_strict_accepts_what_vllm_writes():
    body = data(text_chunk("a")) + data(ERROR) + b"data: [DONE]\r\n\r\n"
    assert [e.payload for e in sse.parse(body, strict=True)] == [text_chunk("a"), ERROR, DONE]
    assert sse.parse(b"", strict=True) == []


@pytest.mark.parametrize(("body", "why"), [
    (b": comment\n\n" + data({}), "not a data line"),
    (b"event: x\n" + data({}), "not a data line"),
    (b"data: {}\ndata: {}\n\n", "two data lines"),
    (b"data: [DONE]\n\n" + data({}), "after \\[DONE\\]"),
    (data({}) + b"da", "ends inside an event"),
    (b"data: {}\n", "ends inside an event"),
])
def test_strict_rejects_other_framing(body: bytes, why: str):
    assert sse.parse(body)  # the tolerant client reads something from each
    with pytest.raises(SSEError, match=why):
        sse.parse(body, strict=True)


def test_text_and_token_ids_of_completion_chat_and_odd_chunks():
    assert sse.text_of(text_chunk("ab")) == "ab"
    chat = {"choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": [5, 6]},
                        {"index": 1, "delta": {"role": "assistant"}, "token_ids": [7]}]}
    assert (sse.text_of(chat), sse.token_ids_of(chat)) == ("x", [5, 6, 7])
    usage = {"choices": [], "usage": {"completion_tokens": 2}}
    for odd in (usage, {}, {"choices": None}, {"choices": ["x", {"token_ids": "no"}]}):
        assert (sse.text_of(odd), sse.token_ids_of(odd)) == ("", [])
    # A whole (non-streamed) answer has the same choices.
    answer = {"choices": [{"text": "hi", "token_ids": [1, 2], "finish_reason": "length"}]}
    assert (sse.text_of(answer), sse.token_ids_of(answer)) == ("hi", [1, 2])
