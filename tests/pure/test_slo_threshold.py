"""The break-even prompt length behind the proxy's --local-prefill-threshold."""

from __future__ import annotations

import pytest

from vllm_pd_ext.tools.slo.cli import main
from vllm_pd_ext.tools.slo.threshold import break_even_tokens, from_results
from vllm_pd_ext.tools.slo.verdict import JUSTIFIED, NOT_JUSTIFIED


def test_break_even_is_where_the_stall_fills_the_itl_budget():
    # 10 ms + 0.05 ms/token; budget 50 - 5 = 45 ms -> 700 tokens
    out = break_even_tokens([(300, 25.0), (2000, 110.0)], itl_cutoff_ms=50, decode_step_ms=5)
    assert out["ms_per_token"] == pytest.approx(0.05)
    assert out["break_even_tokens"] == pytest.approx(700.0)
    assert out["threshold_tokens"] == 688  # rounded down to 16 tokens
    # Below the shortest length: the first segment extended (and never < 0).
    assert break_even_tokens([(300, 25.0), (2000, 110.0)], 25, 5)["break_even_tokens"] == (
        pytest.approx(200.0))
    assert break_even_tokens([(300, 25.0), (2000, 110.0)], 12, 5)["threshold_tokens"] == 0
    # Beyond the longest: the last segment extended.
    assert break_even_tokens([(300, 25.0), (2000, 110.0)], 125, 5)["break_even_tokens"] == (
        pytest.approx(2200.0))
    with pytest.raises(ValueError, match="does not grow"):
        break_even_tokens([(300, 30.0), (2000, 30.0)], 50, 5)
    with pytest.raises(ValueError, match="ITL cutoff"):
        break_even_tokens([(300, 25.0), (2000, 110.0)], 0, 5)
    with pytest.raises(ValueError, match="two or more prompt lengths"):
        break_even_tokens([(300, 20.0), (300, 25.0)], 50, 5)


def test_superlinear_prefill_is_interpolated_between_neighbours():
    # 0.05 ms/token up to 1000 tokens, then 0.2: one straight line through all
    # three points would put the 45 ms crossing near 500 tokens, not at 700.
    samples = [(300, 25.0), (1000, 60.0), (2000, 260.0)]
    out = break_even_tokens(samples, 50, 5)
    assert out["segment"] == [300.0, 1000.0]
    assert out["break_even_tokens"] == pytest.approx(700.0)
    assert break_even_tokens(samples, 165, 5)["break_even_tokens"] == pytest.approx(1500.0)
    # Repeated lengths are averaged.
    assert break_even_tokens([(300, 20.0), (300, 30.0), (2000, 110.0)], 50, 5)[
        "break_even_tokens"] == pytest.approx(700.0)


def _result(tokens: int, prefill_ms: float, step_ms: float, itl_ms: float | None,
            verdict: str) -> dict:
    low = {"summary": {"offered_rate": 1.0, "median_itl_ms": step_ms,
                       "slo": {"itl_ms": itl_ms}},
           "breakdown": {"count": 3, "prefill_ms": {"p50": prefill_ms, "p99": prefill_ms}}}
    high = {"summary": {"offered_rate": 4.0, "median_itl_ms": 99.0, "slo": {"itl_ms": itl_ms}},
            "breakdown": {"count": 3, "prefill_ms": {"p50": 999.0, "p99": 999.0}}}
    return {"config": {"prompt_tokens": tokens}, "verdict": {"verdict": verdict},
            "deployments": {"disaggregated": {"name": "disaggregated-pull",
                                              "points": [high, low]}}}


def test_from_results_uses_the_lowest_rate_and_keeps_the_verdicts():
    out = from_results([_result(2000, 110.0, 5.0, 50, JUSTIFIED),
                        _result(300, 25.0, 5.0, 50, NOT_JUSTIFIED)])
    assert out["threshold_tokens"] == 688 and not out["capped_by_verdict"]
    assert [r["prompt_tokens"] for r in out["runs"]] == [300, 2000]
    assert [r["verdict"][:18] for r in out["runs"]] == ["disaggregation not", "disaggregation jus"]
    # A run that found disaggregation paying below the rule's 700 tokens caps it.
    capped = from_results([_result(2000, 110.0, 5.0, 50, JUSTIFIED),
                           _result(500, 35.0, 5.0, 50, JUSTIFIED),
                           _result(300, 25.0, 5.0, 50, NOT_JUSTIFIED)])
    assert capped["break_even_tokens"] > 500 and capped["capped_by_verdict"]
    assert capped["threshold_tokens"] == 496
    with pytest.raises(ValueError, match="different ITL cutoffs"):
        from_results([_result(2000, 110.0, 5.0, 50, "j"), _result(300, 25.0, 5.0, 80, "n")])
    with pytest.raises(ValueError, match="ITL cutoff"):
        from_results([_result(2000, 110.0, 5.0, None, "j"), _result(300, 25.0, 5.0, None, "n")])
    with pytest.raises(ValueError, match="prompt-tokens"):
        from_results([dict(_result(2000, 110.0, 5.0, 50, JUSTIFIED), config={}),
                      _result(300, 25.0, 5.0, 50, NOT_JUSTIFIED)])
    with pytest.raises(ValueError, match="disaggregated deployment"):
        from_results([{"config": {"prompt_tokens": 300}, "deployments": {}}])


def test_threshold_command_prints_the_flag(tmp_path, capsys):
    import json

    files = []
    for tokens, prefill in ((300, 25.0), (2000, 110.0)):
        f = tmp_path / f"{tokens}.json"
        f.write_text(json.dumps(_result(tokens, prefill, 5.0, 50, "v")))
        files.append(str(f))
    main(["threshold", *files])
    assert "vllm-pd-proxy --local-prefill-threshold 688" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["threshold", files[0]])
    assert exc.value.code == 2
    assert "two or more prompt lengths" in capsys.readouterr().err
