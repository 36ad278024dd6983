"""The pure half of batching (vllm_pd_proxy.batch): which requests are
batches, what is refused, and the merges by vLLM's rules; plus the members'
request ids. No servers."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pdproxy_helpers import parse_sse
from vllm_pd_proxy.batch import StreamMerge, merge_answers, split_prompts
from vllm_pd_proxy.context import MAX_REQUEST_ID_LEN, member_request_id, sanitize_request_id
from vllm_pd_proxy.errors import ProxyError


@pytest.mark.parametrize(("prompt", "batch"), [
    ("text", None),
    ([1, 2, 3], None),  # one prompt of token ids
    (["one"], None),  # a list of one is one prompt
    ([[1, 2]], None),
    ([], None),
    (["a", [1]], None),  # mixed: the engine refuses it before anything is leased
    (["a", "b"], ["a", "b"]),
    ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_what_is_a_batch(prompt, batch):
    assert split_prompts({"prompt": prompt}, 64) == batch


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": ["a"] * 5}, "prompt"),
    ({"prompt": [[1], []]}, "prompt"),
    ({"prompt": [[1], [True]]}, "prompt"),
    ({"prompt": [[1], [-1]]}, "prompt"),
    ({"prompt": [[1], ["a"]]}, "prompt"),
    ({"prompt_embeds": ["e1", "e2"]}, "prompt_embeds"),
    ({"prompt_embeds": "e1", "prompt": "a"}, "prompt_embeds"),
])
def test_refused_batches_name_the_field(body, param):
    with pytest.raises(ProxyError) as exc:
        split_prompts(body, 4)
    assert exc.value.status == 400
    assert json.loads(exc.value.body)["error"]["param"] == param


def test_a_batch_at_the_limit_and_one_embedding_pass():
    assert split_prompts({"prompt": ["a"] * 4}, 4) == ["a"] * 4
    assert split_prompts({"prompt_embeds": "e1"}, 4) is None
    assert split_prompts({"prompt_embeds": [], "prompt": ["a", "b"]}, 4) == ["a", "b"]


def _answer(prompt: int, n: int, cached: int, **extra: Any) -> dict[str, Any]:
    return {"id": f"cmpl-r-{prompt}", "object": "text_completion", "created": 100 + prompt,
            "model": "m",
            "choices": [{"index": c, "text": f"p{prompt}c{c}", "finish_reason": "length"}
                        for c in range(n)],
            "usage": {"prompt_tokens": 10 + prompt, "total_tokens": 13 + prompt + 2 * n,
                      "completion_tokens": 3 + 2 * n,
                      "prompt_tokens_details": {"cached_tokens": cached}},
            **extra}


def test_merge_answers_by_vllms_rules():
    answers = [_answer(0, 2, 5, metrics={"ttft": 1}, kv_transfer_params=None),
               _answer(1, 2, 7, metrics={"ttft": 2}, kv_transfer_params=None)]
    merged = merge_answers(answers)
    assert (merged["id"], merged["created"], merged["model"]) == ("cmpl-r-0", 100, "m")
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [
        (0, "p0c0"), (1, "p0c1"), (2, "p1c0"), (3, "p1c1")]  # prompt * n + choice
    assert merged["usage"] == {"prompt_tokens": 21, "total_tokens": 35,
                               "completion_tokens": 14,
                               "prompt_tokens_details": {"cached_tokens": 7}}  # the last's
    assert merged["metrics"] is None  # not one prompt's
    assert "pd_telemetry" not in merged
    assert answers[0]["choices"][1]["index"] == 1  # the answers are not changed


def test_merge_answers_keeps_each_prompts_telemetry():
    merged = merge_answers([_answer(0, 1, 0, pd_telemetry={"request_id": "r-0"}),
                            _answer(1, 1, 0, pd_telemetry={"request_id": "r-1"})])
    assert merged["pd_telemetry"] == [{"request_id": "r-0"}, {"request_id": "r-1"}]


def _event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _chunk(prompt: int, index: int, text: str, **extra: Any) -> dict[str, Any]:
    return {"id": f"cmpl-r-{prompt}", "object": "text_completion", "created": 100 + prompt,
            "model": "m", "choices": [{"index": index, "text": text}], **extra}


def test_stream_merge_reindexes_holds_usage_and_drops_done():
    merge = StreamMerge(num_prompts=2, n=2)
    merge.set_head(_event(_chunk(0, 0, "a")))
    out, failed = merge.rewrite(1, _event(_chunk(1, 1, "x", usage={"prompt_tokens": 4}))
                                + b": keep-alive\n\n")
    assert not failed
    first, comment = parse_sse_loose(out)
    assert first == {**_chunk(0, 3, "x"), "usage": {"prompt_tokens": 4}}  # 1 * 2 + 1
    assert comment == b": keep-alive"
    usage0 = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
              "prompt_tokens_details": {"cached_tokens": 1}}
    usage1 = {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10,
              "prompt_tokens_details": {"cached_tokens": 2}}
    done = b"data: [DONE]\n\n"
    out, _ = merge.rewrite(1, _event({**_chunk(1, 0, ""), "choices": [], "usage": usage1,
                                      "metrics": {"x": 1}}) + done)
    assert out == b""
    out, _ = merge.rewrite(0, _event(_chunk(0, 1, "b")) + _event(
        {**_chunk(0, 0, ""), "choices": [], "usage": usage0}) + done)
    assert parse_sse(out) == [_chunk(0, 1, "b")]
    usage = merge.usage_event()
    assert usage is not None
    assert parse_sse(usage) == [{**_chunk(0, 0, ""), "choices": [], "usage": {
        "prompt_tokens": 7, "completion_tokens": 8, "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 1}}}]  # the first prompt's details


def parse_sse_loose(raw: bytes) -> list[Any]:
    """Events as JSON, or as bytes when they are not data events."""
    return [json.loads(e[6:]) if e.startswith(b"data: ") else e
            for e in raw.split(b"\n\n") if e]


def test_stream_merge_error_event_ends_the_batch():
    merge = StreamMerge(num_prompts=2, n=1)
    error = _event({"error": {"message": "boom", "code": 500}})
    out, failed = merge.rewrite(1, _event(_chunk(1, 0, "a")) + error + b"data: [DONE]\n\n")
    assert failed
    assert parse_sse(out) == [_chunk(1, 1, "a"), {"error": {"message": "boom", "code": 500}}]
    assert merge.usage_event() is None  # no prompt sent usage


def test_member_ids_stay_bounded_and_distinct():
    assert member_request_id("abc", 3) == "abc-3"
    long = "r" * MAX_REQUEST_ID_LEN
    ids = [member_request_id(long, i) for i in (1, 10, 63)]
    assert len(set(ids)) == 3
    assert all(len(i) <= MAX_REQUEST_ID_LEN and sanitize_request_id(i) == i for i in ids)
