"""The pure core of token #1 from P (issue 29, work in progress)."""

from __future__ import annotations

from vllm_pd_proxy.first_token import Seed, decode_body, seed_of, unsupported


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
    assert unsupported({"stop": ["\n"]}, chat=False) is not None
    assert "structured output" in (unsupported({"response_format": {"type": "json_object"}},
                                                chat=True) or "")
    assert unsupported({"prompt": "p", "max_tokens": 4}, chat=False) is None
