"""The break-even prompt length behind the proxy's --local-prefill-threshold."""

from __future__ import annotations

import pytest

from vllm_pd_ext.slo.cli import main
from vllm_pd_ext.slo.threshold import break_even_tokens, fit_line, from_results


def test_fit_line_is_least_squares():
    assert fit_line([(0, 1), (10, 21)]) == pytest.approx((1.0, 2.0))
    a, b = fit_line([(0, 0), (1, 1), (2, 1), (3, 2)])
    assert (a, b) == pytest.approx((0.1, 0.6))
    with pytest.raises(ValueError, match="two or more prompt lengths"):
        fit_line([(300, 20), (300, 25)])


def test_break_even_is_where_the_stall_fills_the_itl_budget():
    # 10 ms + 0.05 ms/token; budget 50 - 5 = 45 ms -> 700 tokens
    out = break_even_tokens([(300, 25.0), (2000, 110.0)], itl_cutoff_ms=50, decode_step_ms=5)
    assert out["ms_per_token"] == pytest.approx(0.05)
    assert out["intercept_ms"] == pytest.approx(10.0)
    assert out["break_even_tokens"] == pytest.approx(700.0)
    assert out["threshold_tokens"] == 688  # rounded down to 16 tokens
    # A budget the fixed cost alone exceeds: never prefill locally.
    assert break_even_tokens([(300, 25.0), (2000, 110.0)], 12, 5)["threshold_tokens"] == 0
    with pytest.raises(ValueError, match="does not grow"):
        break_even_tokens([(300, 30.0), (2000, 30.0)], 50, 5)
    with pytest.raises(ValueError, match="ITL cutoff"):
        break_even_tokens([(300, 25.0), (2000, 110.0)], 0, 5)


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
    out = from_results([_result(2000, 110.0, 5.0, 50, "justified"),
                        _result(300, 25.0, 5.0, 50, "not justified")])
    assert out["threshold_tokens"] == 688
    assert [r["prompt_tokens"] for r in out["runs"]] == [300, 2000]
    assert [r["verdict"] for r in out["runs"]] == ["not justified", "justified"]
    with pytest.raises(ValueError, match="different ITL cutoffs"):
        from_results([_result(2000, 110.0, 5.0, 50, "j"), _result(300, 25.0, 5.0, 80, "n")])
    with pytest.raises(ValueError, match="ITL cutoff"):
        from_results([_result(2000, 110.0, 5.0, None, "j"), _result(300, 25.0, 5.0, None, "n")])
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
