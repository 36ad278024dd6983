"""The pure core of token #1 from P (vllm_pd_proxy.first_token)."""

from __future__ import annotations

import json

from vllm_pd_proxy.first_token import (
    Seed,
    decode_body,
    final_answer,
    final_events,
    first_events,
    is_final,
    merge,
    refusal,
    seed_of,
    seed_refusal,
)
from vllm_pd_proxy.stream_track import StreamTracker


def test_seed_of_a_completions_answer() -> None:
    answer = {"choices": [{"index": 0, "text": " Paris", "token_ids": [3681],
                           "prompt_token_ids": [1, 2, 3], "finish_reason": "length"}]}
    assert seed_of(answer, chat=False) == Seed([1, 2, 3], 3681, " Paris", "length")


def test_seed_of_a_chat_answer_takes_the_top_level_prompt_ids() -> None:
    answer = {"prompt_token_ids": [4, 5], "choices": [{
        "index": 0, "message": {"role": "assistant", "content": "Hi"}, "token_ids": [9],
        "finish_reason": "stop"}]}
    assert seed_of(answer, chat=True) == Seed([4, 5], 9, "Hi", "stop")


def test_no_seed_without_exactly_one_id_and_the_prompt_ids() -> None:
    base = {"text": "x", "token_ids": [7], "prompt_token_ids": [1]}
    assert seed_of({"choices": [dict(base, token_ids=[7, 8])]}, chat=False) is None
    assert seed_of({"choices": [dict(base, token_ids=None)]}, chat=False) is None
    assert seed_of({"choices": [dict(base, prompt_token_ids=None)]}, chat=False) is None
    assert seed_of({"choices": [dict(base, token_ids=[True])]}, chat=False) is None
    assert seed_of({"choices": [base, base]}, chat=False) is None
    assert seed_of({"choices": "nope"}, chat=False) is None


def test_decode_body_continues_after_the_seed() -> None:
    body = {"model": "m", "prompt": "the prompt", "max_tokens": 8, "min_tokens": 3,
            "temperature": 0, "stream": False, "stream_options": {"include_usage": True}}
    seed = Seed([1, 2, 3], 42, "x", "length")
    out = decode_body(body, seed, chat=False, stream=False)
    assert out is not None
    assert out["prompt"] == [1, 2, 3, 42]
    assert out["max_tokens"] == 7 and out["min_tokens"] == 2
    assert out["stream"] is False and "stream_options" not in out
    assert out["return_token_ids"] is True and out["temperature"] == 0
    assert decode_body(dict(body, max_tokens=1), seed, chat=False, stream=True) is None


def test_what_cannot_be_seeded_is_named() -> None:
    assert refusal({"stop": ["\n"]}, chat=False) == "stop_strings"
    assert refusal({"response_format": {"type": "json_object"}}, chat=True) == \
        "structured_output"
    assert refusal({"n": 2}, chat=False) == "n"
    assert refusal({"logprobs": True}, chat=True) == "chat_logprobs"
    assert refusal({"logprobs": 2}, chat=False) is None  # completions logprobs: P gives them
    assert refusal({"presence_penalty": 0.5}, chat=False) == "output_penalties"
    assert refusal({"stream_options": {"continuous_usage_stats": True}}, chat=False) == \
        "continuous_usage"
    assert refusal({"seed": 3, "temperature": 0.8}, chat=False) == "seeded_sampling"
    assert refusal({"seed": 3}, chat=False) == "seeded_sampling"  # vLLM's default: 1.0
    assert refusal({"seed": 3, "temperature": 0}, chat=False) is None  # greedy
    assert refusal({"temperature": 0.8}, chat=False) is None  # any valid sample will do
    assert refusal({}, chat=False, responses=True) == "responses"
    assert refusal({}, chat=False, batch=True) == "batch"
    assert refusal({}, chat=True, multi_turn=True) == "multi_turn"
    assert refusal({"prompt": "p", "max_tokens": 4, "presence_penalty": 0}, chat=False) is None


def test_a_final_token_and_a_token_cut_mid_character() -> None:
    seed = Seed([1], 5, "x", "length")
    assert not is_final(seed, 8) and not is_final(seed, None)
    assert is_final(seed, 1) and is_final(Seed([1], 2, "", "stop"), 8)
    assert seed_refusal({}, Seed([1], 5, "ab\ufffd", "length"), chat=False) == "incomplete_text"
    assert seed_refusal({}, Seed([1], 5, "", "length"), chat=False) == "incomplete_text"
    chat = {"choices": [{"message": {"content": "", "reasoning_content": "hm"}}]}
    assert seed_refusal(chat, Seed([1], 5, "a", "length"), chat=True) == "reasoning"
    assert seed_refusal({}, seed, chat=False) is None


def _data(events: bytes) -> list:
    return [json.loads(e[len(b"data: "):]) for e in events.split(b"\n\n")
            if e.startswith(b"data: {")]


def test_first_events_record_token_one_and_blank_the_ids_unasked() -> None:
    answer = {"id": "cmpl-1", "created": 3, "model": "m", "choices": [{
        "index": 0, "text": " Paris", "finish_reason": "length", "token_ids": [9],
        "prompt_token_ids": [1, 2], "logprobs": {"tokens": [" Paris"], "text_offset": [0],
                                                 "token_logprobs": [-0.1],
                                                 "top_logprobs": None}}]}
    seed = seed_of(answer, chat=False)
    assert seed is not None
    track = StreamTracker(chat=False, blank_ids=True, track_ids=True)
    out, err = track.feed(first_events(answer, seed, chat=False, final=False))
    assert err is None and track.prompt_ids == [1, 2] and track.sent_ids == [9]
    assert track.text_chars == len(" Paris") and not track.finished
    (chunk,) = _data(out)
    assert chunk["id"] == "cmpl-1" and chunk["object"] == "text_completion"
    assert chunk["choices"][0]["text"] == " Paris"
    assert chunk["choices"][0]["token_ids"] is None
    assert chunk["choices"][0]["logprobs"]["token_logprobs"] == [-0.1]


def test_chat_first_events_are_a_role_chunk_then_the_token() -> None:
    answer = {"id": "chatcmpl-1", "created": 3, "model": "m", "prompt_token_ids": [4, 5],
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"},
                           "token_ids": [7], "finish_reason": "stop", "stop_reason": None}],
              "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}
    seed = seed_of(answer, chat=True)
    assert seed is not None
    events = final_events(answer, seed, chat=True, include_usage=True)
    role, token, usage = _data(events)
    assert events.endswith(b"data: [DONE]\n\n")
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["prompt_token_ids"] == [4, 5]
    assert token["object"] == "chat.completion.chunk"
    assert token["choices"][0]["delta"] == {"content": "Hi"}
    assert token["choices"][0]["finish_reason"] == "stop"
    assert usage["usage"]["completion_tokens"] == 1 and usage["choices"] == []


def test_final_answer_drops_the_params_and_unasked_ids() -> None:
    answer = {"id": "x", "kv_transfer_params": {"a": 1}, "prompt_token_ids": [1],
              "choices": [{"token_ids": [2], "text": "a"}]}
    out = final_answer(answer, chat=True, wants_ids=False)
    assert "kv_transfer_params" not in out and out["prompt_token_ids"] is None
    assert out["choices"][0]["token_ids"] is None and answer["choices"][0]["token_ids"] == [2]
    assert final_answer(answer, chat=True, wants_ids=True)["choices"][0]["token_ids"] == [2]


def test_merge_puts_token_one_before_d_rest() -> None:
    p = {"id": "cmpl-1", "created": 3, "model": "m", "kv_transfer_params": {"x": 1},
         "choices": [{"index": 0, "text": "A", "finish_reason": "length", "token_ids": [9],
                      "prompt_token_ids": [1, 2],
                      "logprobs": {"tokens": ["A"], "text_offset": [0],
                                   "token_logprobs": [-1.0], "top_logprobs": [{"A": -1.0}]}}],
         "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}
    d = {"id": "cmpl-2", "choices": [{"index": 0, "text": "BC", "finish_reason": "stop",
                                      "stop_reason": None, "token_ids": [10, 11],
                                      "prompt_token_ids": [1, 2, 9],
                                      "logprobs": {"tokens": ["B", "C"], "text_offset": [0, 1],
                                                   "token_logprobs": [-2.0, -3.0],
                                                   "top_logprobs": [{"B": -2.0}, {"C": -3.0}]}}],
         "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
         "pd_telemetry": {"proxy": {}}}
    seed = seed_of(p, chat=False)
    assert seed is not None
    out = merge(p, d, seed, chat=False, wants_ids=True)
    assert out is not None
    choice = out["choices"][0]
    assert out["id"] == "cmpl-1" and "kv_transfer_params" not in out
    assert choice["text"] == "ABC" and choice["finish_reason"] == "stop"
    assert choice["token_ids"] == [9, 10, 11] and choice["prompt_token_ids"] == [1, 2]
    assert choice["logprobs"]["text_offset"] == [0, 1, 2]
    assert choice["logprobs"]["token_logprobs"] == [-1.0, -2.0, -3.0]
    assert out["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert out["pd_telemetry"] == {"proxy": {}}
    blank = merge(p, d, seed, chat=False, wants_ids=False)
    assert blank is not None and blank["choices"][0]["token_ids"] is None
    assert merge(p, {"choices": []}, seed, chat=False, wants_ids=False) is None


def test_chat_merge_joins_the_message_content() -> None:
    p = {"id": "chatcmpl-1", "object": "chat.completion", "prompt_token_ids": [4],
         "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"},
                      "token_ids": [7], "finish_reason": "length"}],
         "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
    d = {"choices": [{"text": " there", "finish_reason": "length", "token_ids": [8]}],
         "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}
    seed = seed_of(p, chat=True)
    assert seed is not None
    out = merge(p, d, seed, chat=True, wants_ids=False)
    assert out is not None and out["object"] == "chat.completion"
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "Hi there"}
    assert out["usage"]["completion_tokens"] == 2 and out["prompt_token_ids"] is None


def test_merge_moves_offsets_past_token_id_strings() -> None:
    """``return_tokens_as_token_ids``: offsets follow the ``token_id:N`` strings."""
    lp1 = {"tokens": ["token_id:9"], "text_offset": [0], "token_logprobs": [-1.0],
           "top_logprobs": None}
    lp2 = {"tokens": ["token_id:10", "token_id:11"], "text_offset": [0, 11],
           "token_logprobs": [-2.0, -3.0], "top_logprobs": None}
    p = {"choices": [{"text": "A", "finish_reason": "length", "token_ids": [9],
                      "prompt_token_ids": [1], "logprobs": lp1}]}
    d = {"choices": [{"text": "BC", "finish_reason": "length", "token_ids": [10, 11],
                      "logprobs": lp2}]}
    seed = seed_of(p, chat=False)
    assert seed is not None
    out = merge(p, d, seed, chat=False, wants_ids=False)
    assert out is not None
    assert out["choices"][0]["logprobs"]["text_offset"] == [0, 10, 21]
