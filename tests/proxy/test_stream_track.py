"""The pure cores of request migration: the stream tracker and the
continuation's body (proxy/vllm_pd_proxy/stream_track.py, migration.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from vllm_pd_proxy.errors import Outcome, ProxyError, no_backend
from vllm_pd_proxy.migration import (
    Cause,
    Ending,
    Migration,
    continuation_body,
    engine_failure,
    mid_stream_unsupported,
    no_prefill_left,
)
from vllm_pd_proxy.stream_track import StreamTracker


def ev(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def parse(raw: bytes) -> list[Any]:
    out = []
    for part in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        if part.startswith(b"data: "):
            data = part[6:]
            out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


def cmpl(text: str, ids: list[int] | None, finish: str | None = None,
         prompt: list[int] | None = None, rid: str = "cmpl-a", **choice: Any) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": 5, "model": "m",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                         "stop_reason": None, "prompt_token_ids": prompt, "token_ids": ids,
                         **choice}]}


def test_original_stream_records_ids_and_blanks_them_as_vllm_does() -> None:
    t = StreamTracker(chat=False, blank_ids=True, track_ids=True)
    out, err = t.feed(ev(cmpl("a", [7], prompt=[1, 2])) + ev(cmpl("b", [8])))
    assert err is None
    first, second = parse(out)
    assert first["choices"][0]["token_ids"] is None
    assert first["choices"][0]["prompt_token_ids"] is None
    assert first["choices"][0]["text"] == "a" and second["choices"][0]["text"] == "b"
    assert t.prompt_ids == [1, 2] and t.sent_ids == [7, 8] and t.text_chars == 2
    assert t.can_continue


def test_client_that_asked_for_ids_keeps_them() -> None:
    t = StreamTracker(chat=False, blank_ids=False, track_ids=True)
    out, _ = t.feed(ev(cmpl("a", [7], prompt=[1, 2])))
    assert parse(out)[0]["choices"][0]["token_ids"] == [7]
    assert parse(out)[0]["choices"][0]["prompt_token_ids"] == [1, 2]


def test_chat_chunks_sent_only_for_the_ids_are_dropped() -> None:
    t = StreamTracker(chat=True, blank_ids=True, track_ids=True)
    role = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "prompt_token_ids": [1, 2], "choices": [{"index": 0, "delta": {
                "role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
    empty = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": None,
                          "token_ids": [9]}]}
    out, _ = t.feed(ev(role) + ev(empty))
    (got,) = parse(out)
    assert got["prompt_token_ids"] is None and got["choices"][0]["delta"]["role"] == "assistant"
    assert t.prompt_ids == [1, 2] and t.sent_ids == [9]


def test_an_error_event_is_withheld_with_everything_after_it() -> None:
    t = StreamTracker(chat=False, blank_ids=True, track_ids=True)
    raw = (ev(cmpl("a", [7], prompt=[1])) + ev({"error": {"message": "dead", "code": 503}})
           + b"data: [DONE]\n\n")
    out, err = t.feed(raw)
    assert [e["choices"][0]["text"] for e in parse(out)] == ["a"]
    assert err is not None and err.status == 503 and err.message == "dead"
    assert json.loads(err.raw)["error"]["message"] == "dead"
    assert not t.done


def test_passthrough_tracker_only_parses_events_that_can_be_errors() -> None:
    t = StreamTracker(chat=False, blank_ids=False, track_ids=False)
    raw = ev(cmpl('say "error" please', None)) + b"data: [DONE]\n\n"
    out, err = t.feed(raw)
    assert out == raw and err is None and t.done  # verbatim: the quotes are escaped
    out, err = t.feed(ev({"error": "boom"}))
    assert out == b"" and err is not None and err.status == 500


def test_crlf_events_are_split_too() -> None:
    t = StreamTracker(chat=False, blank_ids=True, track_ids=True)
    raw = (b"data: " + json.dumps(cmpl("a", [7], prompt=[1])).encode() + b"\r\n\r\n"
           + b"data: [DONE]\r\n\r\n")
    out, err = t.feed(raw)
    assert err is None and t.sent_ids == [7] and t.done
    assert parse(out)[0]["choices"][0]["token_ids"] is None


def test_continuation_is_spliced_into_the_original_stream() -> None:
    t = StreamTracker(chat=False, blank_ids=True, track_ids=True)
    t.feed(ev(cmpl("ab", [7, 8], prompt=[1, 2, 3])))
    t.begin_continuation()
    lp = {"tokens": ["c"], "token_logprobs": [-0.1], "top_logprobs": None, "text_offset": [0]}
    out, err = t.feed(ev(cmpl("c", [9], prompt=[1, 2, 3, 7, 8], rid="cmpl-other",
                              logprobs=lp) | {"created": 99})
                      + ev({"id": "cmpl-other", "object": "text_completion", "created": 99,
                            "model": "m", "choices": [], "usage": {
                                "prompt_tokens": 5, "completion_tokens": 1,
                                "total_tokens": 6}}))
    assert err is None
    chunk, usage = parse(out)
    assert chunk["id"] == "cmpl-a" and chunk["created"] == 5
    assert chunk["choices"][0]["prompt_token_ids"] is None
    assert chunk["choices"][0]["token_ids"] is None
    assert chunk["choices"][0]["logprobs"]["text_offset"] == [2]  # after "ab"
    assert usage["id"] == "cmpl-a"
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert t.sent_ids == [7, 8, 9]


def _lp(tokens: list[str], offsets: list[int]) -> dict[str, Any]:
    return {"tokens": tokens, "token_logprobs": [-0.1] * len(tokens),
            "top_logprobs": None, "text_offset": offsets}


def test_continuation_offsets_shift_by_a_constant_past_what_the_client_got() -> None:
    """D's continuation offsets are already cumulative in its own stream:
    each chunk shifts by where the client's offsets stood when it began
    (once, a shift by the growing text counted the continuation twice)."""
    t = StreamTracker(chat=False, blank_ids=True, track_ids=True)
    t.feed(ev(cmpl("ab", [7], prompt=[1], logprobs=_lp(["ab"], [0]))))
    t.begin_continuation()
    out, _ = t.feed(ev(cmpl("cd", [8], rid="x", logprobs=_lp(["cd"], [0])))
                    + ev(cmpl("ef", [9], rid="x", logprobs=_lp(["ef"], [2]))))
    first, second = parse(out)
    assert first["choices"][0]["logprobs"]["text_offset"] == [2]
    assert second["choices"][0]["logprobs"]["text_offset"] == [4]


def test_token_id_strings_advance_the_offsets_not_the_text() -> None:
    """With ``return_tokens_as_token_ids`` vLLM's offsets follow the
    ``token_id:N`` strings, so the continuation starts after the last of them."""
    t = StreamTracker(chat=False, blank_ids=True, track_ids=True)
    t.feed(ev(cmpl("a", [7], prompt=[1], logprobs=_lp(["token_id:7"], [0]))))
    t.begin_continuation()
    out, _ = t.feed(ev(cmpl("b", [8], rid="x", logprobs=_lp(["token_id:8"], [0]))))
    assert parse(out)[0]["choices"][0]["logprobs"]["text_offset"] == [len("token_id:7")]


def test_chat_continuation_becomes_chat_chunks() -> None:
    t = StreamTracker(chat=True, blank_ids=True, track_ids=True)
    t.feed(ev({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
               "prompt_token_ids": [1], "choices": [{"index": 0, "delta": {
                   "role": "assistant", "content": ""}, "logprobs": None,
                   "finish_reason": None}]})
           + ev({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                 "choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": None,
                              "finish_reason": None, "token_ids": [4]}]}))
    t.begin_continuation()
    out, _ = t.feed(ev(cmpl("y", [5], prompt=[1, 4], rid="cmpl-b"))
                    + ev(cmpl("", [6], finish="length", rid="cmpl-b")))
    first, last = parse(out)
    assert first == {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                     "choices": [{"index": 0, "delta": {"content": "y"}, "logprobs": None,
                                  "finish_reason": None, "token_ids": None}]}
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["stop_reason"] is None
    assert t.finished and not t.can_continue


def test_finish_length_ends_a_stream_whose_finish_was_lost() -> None:
    t = StreamTracker(chat=False, blank_ids=True, track_ids=True)
    t.feed(ev(cmpl("ab", [7, 8], prompt=[1])))
    t.begin_continuation()
    chunk, usage, done = parse(t.finish_length(include_usage=True))
    assert chunk["choices"][0]["finish_reason"] == "length" and chunk["id"] == "cmpl-a"
    assert usage["usage"] == {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    assert done == "[DONE]"


def test_continuation_body_from_token_ids() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 10, "min_tokens": 4, "temperature": 0,
            "truncate_prompt_tokens": 100, "stream": True,
            "stream_options": {"include_usage": True}, "seed": 3, "logprobs": 2, "echo": False}
    cont = continuation_body(body, [1, 2], [7, 8, 9], chat=False)
    assert cont == {"model": "m", "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}, "seed": 3, "max_tokens": 7,
                    "min_tokens": 1, "logprobs": 2, "prompt": [1, 2, 7, 8, 9],
                    "return_token_ids": True}
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}],
            "max_completion_tokens": 5, "stream": True, "tools": None, "top_p": 0.5}
    cont = continuation_body(chat, [1], [4, 5], chat=True)
    assert cont is not None and "messages" not in cont and "tools" not in cont
    assert cont["max_tokens"] == 3 and cont["prompt"] == [1, 4, 5] and cont["top_p"] == 0.5
    # Nothing left to generate.
    assert continuation_body({"max_tokens": 2}, [1], [4, 5], chat=False) is None


@pytest.mark.parametrize(("body", "chat", "why"), [
    ({"stop": ["x"]}, False, "stop strings"),
    ({"stop": []}, False, None),
    ({"response_format": {"type": "json_object"}}, True, "structured output"),
    ({"n": 2}, False, "n > 1"),
    ({"logprobs": True}, True, "chat logprobs"),
    ({"logprobs": 2}, False, None),
    ({"tools": [{"type": "function"}]}, True, "tool calls"),
    ({"prompt_embeds": "AAAA"}, False, "prompt_embeds"),
])
def test_what_cannot_continue_mid_stream(body: dict[str, Any], chat: bool,
                                         why: str | None) -> None:
    got = mid_stream_unsupported(body, chat)
    assert (got is None) if why is None else (got is not None and why in got)


def test_budget_and_deadline() -> None:
    m = Migration(limit=2, deadline=10.0)
    assert m.allow(Cause.DECODE, now=1.0, since=0.5)
    m.resumed(2.0)
    assert m.allow(Cause.MID_STREAM, now=3.0, since=2.5)
    m.resumed(4.0)
    assert m.added == pytest.approx(3.0)
    assert not m.allow(Cause.MID_STREAM, now=5.0, since=5.0)
    assert (m.refused, m.refused_cause) == (Ending.EXHAUSTED, Cause.MID_STREAM)
    late = Migration(limit=5, deadline=10.0)
    assert not late.allow(Cause.PREFILL, now=10.0, since=9.0)


def test_which_failures_migrate() -> None:
    assert engine_failure(ProxyError(502, "x", err_type="e", outcome=Outcome.UPSTREAM_5XX))
    assert engine_failure(ProxyError(503, "x", err_type="e", outcome=Outcome.UPSTREAM_5XX,
                                     draining=True))
    assert not engine_failure(ProxyError(400, "x", err_type="e",
                                         outcome=Outcome.UPSTREAM_4XX))
    assert not engine_failure(ProxyError(503, "x", err_type="e", outcome=Outcome.QUEUE_FULL))
    assert no_prefill_left(no_backend("none", "prefill"))
    assert not no_prefill_left(no_backend("none", "decode"))
