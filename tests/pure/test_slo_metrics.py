"""slo/metrics.py: percentiles, SLO cutoffs, one point's summary, the queue
trend and the gates, on small hand-made results with exact answers."""

from __future__ import annotations

import json
import math

import msgspec
import pytest

from vllm_pd_ext.tools.slo.metrics import (
    SLO,
    Gates,
    RequestResult,
    parse_slo,
    percentile,
    percentile_key,
    point_passes,
    queue_trend,
    summarize,
    tpot_s,
)


def ok(i: int, ttft_ms: float = 100.0, *, out: int = 11, tpot_ms: float = 10.0,
       itl_ms: list[float] | None = None, sent: float | None = None,
       sched: float | None = None, warmup: bool = False, prompt: int = 32) -> RequestResult:
    at = float(i) if sched is None else sched
    ttft = ttft_ms / 1000
    return RequestResult(index=i, scheduled_s=at, sent_s=at if sent is None else sent,
                         prompt_tokens=prompt, output_tokens=out, ok=True, ttft_s=ttft,
                         e2e_s=ttft + (out - 1) * tpot_ms / 1000,
                         itl_s=[g / 1000 for g in (itl_ms or [])], warmup=warmup)


def failed(i: int, error: str = "http 503: busy", warmup: bool = False) -> RequestResult:
    return RequestResult(index=i, scheduled_s=float(i), sent_s=float(i), prompt_tokens=32,
                         output_tokens=0, ok=False, error=error, warmup=warmup)


def test_percentile_linear_interpolation_by_hand():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 99) == pytest.approx(3.97)  # rank 2.97: 3 + 0.97 * (4 - 3)
    assert percentile(xs, 25) == pytest.approx(1.75)  # rank 0.75
    assert (percentile(xs, 0), percentile(xs, 100)) == (1.0, 4.0)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(xs, 101)
    assert [percentile_key(q) for q in (50, 99.0, 99.9)] == ["50", "99", "99.9"]


def test_percentile_matches_numpy_default():
    import numpy as np  # installed with vllm and torch

    xs = [((i * 7919) % 1009) / 7 for i in range(257)]
    for q in (1, 33.3, 50, 95, 99, 99.9):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)


def test_parse_slo_forms_and_errors():
    assert parse_slo("ttft:2000,tpot:50,itl:200") == SLO(2000, 50, 200, None)
    assert parse_slo("ttft:2000 tpot:50") == SLO(ttft_ms=2000, tpot_ms=50)
    assert parse_slo(" TTFT:1.5, e2el:9000 ") == SLO(ttft_ms=1.5, e2el_ms=9000)
    for bad, word in [("ttfb:10", "'ttfb'"), ("ttft:abc", "ttft"), ("ttft:-1", "ttft"),
                      ("ttft:1,ttft:2", "twice"), ("tpot", "tpot"), ("", "no cutoff"),
                      ("itl:inf", "itl")]:
        with pytest.raises(ValueError, match=word):
            parse_slo(bad)


def test_tpot_and_joint_pass():
    r = ok(0, ttft_ms=100, out=11, tpot_ms=10, itl_ms=[5, 30, 8])
    assert tpot_s(r) == pytest.approx(0.010)
    assert SLO(ttft_ms=100, tpot_ms=10, itl_ms=30, e2el_ms=200).passes(r)  # cutoffs inclusive
    assert not SLO(ttft_ms=99.9).passes(r)
    assert not SLO(tpot_ms=9.9).passes(r)
    assert not SLO(itl_ms=29.9).passes(r)  # the max gap, not the mean
    assert not SLO(e2el_ms=199).passes(r)
    assert not SLO(ttft_ms=1e9).passes(failed(1))
    one = ok(2, ttft_ms=100, out=1)
    assert tpot_s(one) is None
    assert SLO(ttft_ms=100, tpot_ms=0.001, itl_ms=0.001).passes(one)  # vacuous below 2 tokens


def _seed_cohort() -> list[RequestResult]:
    """The seed's cohort: 100 offered, 95 succeed, 90 meet both cutoffs."""
    out = [failed(i) for i in range(0, 100, 20)]  # 5 errors, spread over time
    slow = set(range(10, 100, 20))  # 5 successes over the TTFT cutoff
    out += [ok(i, 2500.0 if i in slow else 100.0) for i in range(100) if i % 20]
    return out


def test_seed_cohort_attainment_both_denominators_and_gate():
    slo = SLO(ttft_ms=2000, tpot_ms=50)
    results = _seed_cohort() + [failed(1000 + i, warmup=True) for i in range(7)]
    s = summarize(results, offered_rate=2.0, slo=slo, duration_s=50.0)
    assert (s["offered"], s["completed"], s["failed"]) == (100, 95, 5)
    assert s["error_rate"] == pytest.approx(0.05)
    assert s["goodput_requests"] == 90
    assert s["slo_attainment"] == pytest.approx(0.90)
    assert s["attainment_denominator"] == "offered"
    assert s["request_goodput"] == pytest.approx(90 / 50)
    assert s["request_throughput"] == pytest.approx(95 / 50)
    assert s["errors_by_kind"] == {"http 503": 5}
    assert s["queue"]["stable"], s["queue"]["why"]
    completed = summarize(results, offered_rate=2.0, slo=slo, duration_s=50.0,
                          denominator="completed")
    assert completed["slo_attainment"] == pytest.approx(90 / 95)
    passed, reasons = point_passes(s, Gates())
    assert not passed
    assert reasons == ["attainment 0.90 < 0.95", "error rate 0.05 > 0.01"]
    # 90/95 = 0.947 also fails the 0.95 gate, printed so the two differ
    assert point_passes(completed, Gates(error_rate_max=0.1)) == (
        False, ["attainment 0.947 < 0.95"])
    with pytest.raises(ValueError, match="denominator"):
        summarize(results, offered_rate=2.0, slo=slo, duration_s=50.0,
                  denominator="attempted")  # type: ignore[arg-type]


def test_summary_latency_stats_by_hand():
    results = [ok(0, 100, out=3, tpot_ms=10, itl_ms=[10, 10], prompt=5),
               ok(1, 200, out=3, tpot_ms=20, itl_ms=[15, 25], prompt=7),
               ok(2, 300, out=1, tpot_ms=0, prompt=9),
               ok(3, 400, out=2, tpot_ms=40, itl_ms=[40], prompt=11),
               ok(4, 999, warmup=True)]
    s = summarize(results, offered_rate=1.0, slo=SLO(ttft_ms=250), duration_s=4.0,
                  percentiles=(50, 99, 99.9))
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (32, 9)
    assert s["output_throughput"] == pytest.approx(9 / 4)
    assert s["total_token_throughput"] == pytest.approx(41 / 4)
    assert s["mean_ttft_ms"] == pytest.approx(250)
    assert s["median_ttft_ms"] == pytest.approx(250)
    assert s["std_ttft_ms"] == pytest.approx(math.sqrt(12500))  # population std
    assert s["p99_ttft_ms"] == pytest.approx(397)
    assert s["p99.9_ttft_ms"] == pytest.approx(399.7)
    assert s["median_tpot_ms"] == pytest.approx(20)  # 10, 20, 40: one-token request has none
    assert s["mean_itl_ms"] == pytest.approx(20)  # pooled gaps 10, 10, 15, 25, 40 (ms)
    assert s["p50_ttft_ms"] == s["median_ttft_ms"]
    assert s["slo_attainment"] == pytest.approx(0.5)
    assert s["request_goodput"] == pytest.approx(0.5)


def test_dispatch_delay_warmup_excluded():
    results = [ok(i, sched=float(i), sent=i + d / 1000) for i, d in enumerate([1, 2, 3, 100])]
    results.append(ok(9, sched=0.0, sent=5.0, warmup=True))
    s = summarize(results, offered_rate=1.0, slo=SLO(ttft_ms=1000), duration_s=4.0)
    assert s["dispatch_delay_p50_ms"] == pytest.approx(2.5)
    assert s["dispatch_delay_max_ms"] == pytest.approx(100)
    assert s["dispatch_delay_p99_ms"] == pytest.approx(3 + 0.97 * 97)


def test_all_failed_and_empty_give_null_never_nan():
    s = summarize([failed(0, "timeout"), failed(1)], offered_rate=1.0, slo=SLO(ttft_ms=1),
                  duration_s=2.0)
    assert s["slo_attainment"] == 0.0 and s["error_rate"] == 1.0
    assert s["mean_ttft_ms"] is None and s["p99_itl_ms"] is None
    assert not s["queue"]["stable"]  # a timeout
    json.dumps(s, allow_nan=False)
    empty = summarize([], offered_rate=1.0, slo=SLO(ttft_ms=1), duration_s=0.0)
    assert empty["slo_attainment"] is None and empty["request_throughput"] is None
    json.dumps(empty, allow_nan=False)
    assert point_passes(empty, Gates())[0] is False


def test_request_result_round_trips_json():
    r = ok(3, itl_ms=[1.5])
    r2 = msgspec.json.decode(msgspec.json.encode(r), type=RequestResult)
    assert r2 == r
    assert msgspec.convert(msgspec.to_builtins(failed(2)), RequestResult) == failed(2)


def _trend(ttfts_ms: list[float]) -> dict:
    return queue_trend([ok(i, t, sent=i * 0.5) for i, t in enumerate(ttfts_ms)], 2.0)


def test_queue_trend_growing_is_unstable():
    q = _trend([100.0 + 200 * i for i in range(12)])  # 200 ms more per request, 400 ms/s
    assert not q["stable"]
    assert q["ttft_slope_ms_per_s"] == pytest.approx(400)
    assert q["ttft_first_third_p50_ms"] == pytest.approx(400)  # 100, 300, 500, 700
    assert q["ttft_last_third_p50_ms"] == pytest.approx(2000)  # 1700 .. 2300
    assert q["growth_ratio"] == pytest.approx(5)
    assert "grows" in q["why"]


def test_queue_trend_bounded_growth_and_noise_are_stable():
    # last third doubles+ but stays within first + 500 ms: stable
    q = _trend([100.0] * 4 + [150.0] * 4 + [250.0] * 4)
    assert q["stable"] and q["ttft_slope_ms_per_s"] > 0
    # last third over the limit, but the slope falls (one early outlier): stable
    q = _trend([100.0, 100, 100, 20000] + [100.0] * 4 + [1000.0] * 4)
    assert q["ttft_last_third_p50_ms"] == 1000 and q["ttft_first_third_p50_ms"] == 100
    assert q["ttft_slope_ms_per_s"] < 0
    assert q["stable"]
    # the same last third with a rising slope: unstable
    q = _trend([100.0] * 8 + [1000.0] * 4)
    assert q["ttft_slope_ms_per_s"] > 0 and not q["stable"]
    # exactly at the limit max(2 x 100, 100 + 500) = 600: not over it, stable
    assert _trend([100.0] * 8 + [600.0] * 4)["stable"]
    assert not _trend([100.0] * 8 + [600.1] * 4)["stable"]
    flat = _trend([100.0, 105, 95, 100, 98, 102, 101, 99, 100])
    assert flat["stable"] and "bounded" in flat["why"]


def test_queue_trend_timeouts_and_small_samples():
    rs = [ok(i, 100.0 * (i + 1), sent=float(i)) for i in range(5)]
    small = queue_trend(rs, 1.0)
    assert small["stable"] and "too small" in small["why"]  # grows, but only 5 samples
    timed_out = queue_trend([*rs, failed(9, "timeout")], 1.0)
    assert not timed_out["stable"] and "1 request(s) timed out" in timed_out["why"]
    flat = [ok(i, 100.0, sent=float(i)) for i in range(9)]
    assert not queue_trend([*flat, failed(9, "timeout")], 1.0)["stable"]
    assert queue_trend([*flat, failed(9, "http 500: x")], 1.0)["stable"]


def test_point_passes_reasons():
    good = summarize([ok(i, 100.0, sent=float(i)) for i in range(10)], offered_rate=1.0,
                     slo=SLO(ttft_ms=200), duration_s=10.0)
    assert point_passes(good, Gates()) == (True, [])
    bad_queue = {**good, "queue": {"stable": False, "why": "unstable: 2 request(s) timed out"}}
    assert point_passes(bad_queue, Gates()) == (
        False, ["queue unstable: 2 request(s) timed out"])
    assert point_passes(bad_queue, Gates(require_stable_queue=False)) == (True, [])
    assert point_passes({**good, "error_rate": 0.02}, Gates()) == (
        False, ["error rate 0.02 > 0.01"])
