"""The equality oracle's pure rule (vllm_pd_ext/testing/oracle.py) and its
answer parsing; the real-engine negative controls are tests/e2e/test_oracle.py."""

from __future__ import annotations

import pytest

from vllm_pd_ext.testing.oracle import (
    NEAR_TIE_NATS,
    OracleError,
    judge,
    near_tie_nats,
    output_of,
    stream_output,
)

EPS = 0.1


def test_identical_outputs_are_exact_without_scores() -> None:
    v = judge([5, 6, 7], [5, 6, 7], None, EPS)
    assert v.same and v.exact and bool(v)
    assert v.summary() == "same (token for token)"


def test_runner_up_at_a_near_tie_is_the_same_output() -> None:
    # Position 1: the reference rates 6 and 9 within 0.03 nats; the candidate
    # took 9 and then followed the reference's best at every position.
    scores = [{5: -1.0}, {6: -3.36, 9: -3.39}, {4: -0.5, 8: -2.0}]
    v = judge([5, 9, 4], [5, 6, 7], scores, EPS)
    assert v.same and not v.exact
    assert v.near_ties == (1,)
    assert v.worst_gap == pytest.approx(0.03)


def test_gap_beyond_eps_is_different_and_names_the_position() -> None:
    scores = [{5: -1.0}, {6: -3.0, 9: -3.2}]
    v = judge([5, 9], [5, 6], scores, EPS)
    assert not v.same and v.position == 1
    assert "position 1" in v.detail and "gap 0.2000 > eps 0.1" in v.detail


def test_exactly_eps_is_still_a_near_tie() -> None:
    # Binary-exact values: the gap is exactly eps.
    assert judge([9], [6], [{6: -1.0, 9: -1.125}], 0.125).same
    assert not judge([9], [6], [{6: -1.0, 9: -1.125}], 0.0625).same


def test_a_near_tie_hides_nothing_after_it() -> None:
    """After a tolerated runner-up, every later position is still judged."""
    scores = [{6: -2.0, 9: -2.01}, {4: -1.0}, {4: -0.2, 7: -3.0}]
    v = judge([9, 4, 7], [6, 1, 1], scores, EPS)
    assert not v.same and v.position == 2
    assert v.near_ties == (0,)


def test_exact_tie_taken_the_other_way_counts_as_near_tie() -> None:
    v = judge([9], [6], [{6: -1.5, 9: -1.5}], EPS)
    assert v.same and v.near_ties == (0,) and v.worst_gap == 0.0


@pytest.mark.parametrize(("cand", "ref", "who"), [([5, 6], [5, 6, 7], "candidate"),
                                                  ([5, 6, 7], [5, 6], "reference")])
def test_an_output_that_stops_early_is_different(cand: list[int], ref: list[int],
                                                 who: str) -> None:
    v = judge(cand, ref, None, EPS)
    assert not v.same and v.position == 2
    assert f"the {who} stopped after 2 tokens" in v.detail


def test_scores_are_required_and_must_cover_every_position() -> None:
    with pytest.raises(ValueError, match="scores are needed"):
        judge([5, 9], [5, 6], None, EPS)
    with pytest.raises(ValueError, match="1 scored positions for 2"):
        judge([5, 9], [5, 6], [{5: -1.0}], EPS)
    with pytest.raises(ValueError, match="no score for the candidate's token 9"):
        judge([5, 9], [5, 6], [{5: -1.0}, {6: -1.0}], EPS)


def test_epsilon_is_named_per_dtype() -> None:
    assert near_tie_nats("bfloat16") == NEAR_TIE_NATS["bfloat16"] == 0.1
    with pytest.raises(ValueError, match="no near-tie epsilon measured for dtype 'float64'"):
        near_tie_nats("float64")


def test_output_of_completion_and_chat_answers() -> None:
    completion = {"choices": [{"text": " ab", "token_ids": [7, 8], "prompt_token_ids": [1, 2],
                               "finish_reason": "length"}]}
    out = output_of(completion)
    assert (out.prompt, out.tokens, out.text, out.finish_reason) == ((1, 2), (7, 8), " ab",
                                                                     "length")
    chat = {"prompt_token_ids": [1, 3],
            "choices": [{"message": {"content": "hi"}, "token_ids": [4], "finish_reason": "stop"}]}
    out = output_of(chat)
    assert (out.prompt, out.tokens, out.text) == ((1, 3), (4,), "hi")
    with pytest.raises(OracleError, match="return_token_ids"):
        output_of({"choices": [{"text": "x"}]})


def test_stream_output_joins_completion_and_chat_chunks() -> None:
    events = [{"choices": [{"text": " a", "token_ids": [7], "prompt_token_ids": [1, 2]}]},
              {"choices": [{"text": "b", "token_ids": [8], "prompt_token_ids": None,
                            "finish_reason": "length"}]},
              "[DONE]"]
    out = stream_output(events)
    assert (out.prompt, out.tokens, out.text, out.finish_reason) == ((1, 2), (7, 8), " ab",
                                                                     "length")
    chat = [{"prompt_token_ids": [1], "choices": [{"delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"delta": {"content": "x"}, "token_ids": [5]}]}, "[DONE]"]
    assert stream_output(chat).tokens == (5,)
    with pytest.raises(OracleError, match="no prompt_token_ids"):
        stream_output([{"choices": [{"text": "a", "token_ids": [1]}]}])
