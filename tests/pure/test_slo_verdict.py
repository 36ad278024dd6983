"""slo/verdict.py and slo/plots.py: conservative capacity, the verdict's
cases (justified, not, neither passed, different rate sets), the table."""

from __future__ import annotations

import sys

import pytest

from vllm_pd_ext.tools.slo.metrics import Gates, RequestResult
from vllm_pd_ext.tools.slo.plots import plot_all
from vllm_pd_ext.tools.slo.verdict import (
    JUSTIFIED,
    NEITHER_PASSED,
    NOT_JUSTIFIED,
    capacity,
    render_table,
    verdict,
)

SLO = {"ttft_ms": 2000.0, "tpot_ms": 50.0, "itl_ms": None, "e2el_ms": None}


def point(rate: float, attainment: float, error_rate: float = 0.0, stable: bool = True,
          p99_ttft: float = 500.0, p99_itl: float = 40.0) -> dict:
    return {"offered_rate": rate, "slo_attainment": attainment, "error_rate": error_rate,
            "attainment_denominator": "offered", "slo": SLO, "p99_ttft_ms": p99_ttft,
            "median_ttft_ms": p99_ttft / 2, "p99_itl_ms": p99_itl, "median_itl_ms": 20.0,
            "p99_tpot_ms": 30.0, "request_goodput": rate * attainment,
            "queue": {"stable": stable, "why": "stable: fine" if stable else "unstable: grows"}}


def sweep(name: str, atts: dict[float, float]) -> dict:
    return {"name": name, "points": [point(r, a) for r, a in atts.items()]}


def test_capacity_counts_only_an_unbroken_run_of_passes():
    pts = [point(8, 0.99), point(1, 0.99), point(4, 0.80), point(2, 0.96)]
    cap = capacity(pts, Gates())
    assert cap["capacity_rps"] == 2.0
    assert cap["passing_rates"] == [1.0, 2.0, 8.0]
    assert cap["not_counted"] == [8.0]
    assert cap["failing"] == {4.0: ["attainment 0.80 < 0.95"]}
    assert capacity([point(1, 0.5)], Gates())["capacity_rps"] == 0.0
    assert capacity([], Gates())["capacity_rps"] == 0.0
    unstable = capacity([point(1, 0.99), point(2, 0.99, stable=False)], Gates())
    assert unstable["capacity_rps"] == 1.0
    assert capacity([point(1, 0.99), point(2, 0.99, stable=False)],
                    Gates(require_stable_queue=False))["capacity_rps"] == 2.0
    with pytest.raises(ValueError, match="twice"):
        capacity([point(1, 0.99), point(1.0, 0.9)], Gates())


def test_verdict_justified_when_candidate_capacity_is_higher():
    base = sweep("aggregated", {1: 0.99, 2: 0.97, 4: 0.60, 8: 0.10})
    cand = sweep("disaggregated", {1: 0.99, 2: 0.99, 4: 0.96, 8: 0.30})
    v = verdict(base, cand)
    assert v["verdict"] == JUSTIFIED
    assert v["capacity"] == {"aggregated": 2.0, "disaggregated": 4.0}
    text = "\n".join(v["evidence"])
    assert "SLO-compliant capacity: aggregated 2 rps, disaggregated 4 rps" in text
    assert "4 rps: aggregated attainment 0.600, p99 TTFT 500.0 ms, p99 ITL 40.0 ms" in text
    assert "disaggregated capacity 4 rps > aggregated 2 rps" in text
    assert NEITHER_PASSED not in text


@pytest.mark.parametrize(("cand_atts", "cap"), [
    ({1: 0.99, 2: 0.99, 4: 0.5}, 2.0),  # equal capacity
    ({1: 0.99, 2: 0.5, 4: 0.99}, 1.0),  # lower; its pass at 4 sits above a failure
])
def test_verdict_not_justified_without_strictly_higher_capacity(cand_atts, cap):
    base = sweep("aggregated", {1: 0.99, 2: 0.99, 4: 0.5})
    v = verdict(base, sweep("disaggregated", cand_atts))
    assert v["verdict"] == NOT_JUSTIFIED
    assert v["capacity"] == {"aggregated": 2.0, "disaggregated": cap}
    assert f"disaggregated capacity {cap:g} rps is not above aggregated 2 rps" in v["evidence"]


def test_verdict_neither_passed():
    v = verdict(sweep("aggregated", {1: 0.5, 2: 0.1}), sweep("disaggregated", {1: 0.9, 2: 0.2}))
    assert v["verdict"] == NOT_JUSTIFIED
    assert NEITHER_PASSED in v["evidence"]
    assert NEITHER_PASSED == ("neither deployment met the SLO at any tested rate: capacity 0 "
                              "for both; test lower rates or loosen the SLO")
    assert v["capacity"] == {"aggregated": 0.0, "disaggregated": 0.0}


def test_verdict_compares_only_common_rates():
    base = sweep("aggregated", {1: 0.99, 2: 0.99, 4: 0.99})
    cand = sweep("disaggregated", {1: 0.99, 2: 0.99, 4: 0.99, 8: 0.99})
    v = verdict(base, cand)
    assert v["common_rates"] == [1.0, 2.0, 4.0]
    assert v["capacity"] == {"aggregated": 4.0, "disaggregated": 4.0}  # 8 not compared
    assert v["verdict"] == NOT_JUSTIFIED
    assert any("comparing only the common rates [1, 2, 4]" in line
               and "disaggregated only [8]" in line for line in v["evidence"])
    assert not any(line.startswith("8 rps") for line in v["evidence"])
    assert any("at least that; higher rates were not tested" in line for line in v["evidence"])
    disjoint = verdict(sweep("a", {1: 0.99}), sweep("b", {2: 0.99}))
    assert disjoint["verdict"] == NOT_JUSTIFIED and disjoint["common_rates"] == []


def test_verdict_refuses_mismatched_declarations():
    base, cand = sweep("aggregated", {1: 0.99}), sweep("disaggregated", {1: 0.99})
    cand["points"][0]["slo"] = {**SLO, "ttft_ms": 4000.0}
    with pytest.raises(ValueError, match="slo"):
        verdict(base, cand)
    cand = sweep("disaggregated", {1: 0.99})
    cand["points"][0]["attainment_denominator"] = "completed"
    with pytest.raises(ValueError, match="attainment_denominator"):
        verdict(base, cand)
    with pytest.raises(ValueError, match="named"):
        verdict(base, sweep("aggregated", {1: 0.99}))


def test_verdict_accepts_stored_points_and_default_names():
    base = {"points": [{"summary": point(1, 0.99), "results": []}]}
    cand = {"points": [{"summary": point(1, 0.5), "results": []}]}
    v = verdict(base, cand)
    assert v["capacity"] == {"aggregated": 1.0, "disaggregated": 0.0}


def test_render_table():
    base = sweep("aggregated", {1: 0.99, 2: 0.5})
    cand = sweep("disaggregated", {1: 0.97, 4: 0.96})
    lines = render_table(base, cand).splitlines()
    assert lines[0].startswith("| rate (rps) | deployment | attainment | error rate |")
    assert len(lines) == 2 + 4
    assert lines[2] == ("| 1 | aggregated | 0.990 | 0.000 | 250.0 | 500.0 | 20.0 | 40.0 | 30.0 "
                        "| 0.99 | yes | yes |")
    assert lines[4].startswith("| 2 | aggregated | 0.500 |") and lines[4].endswith("| no |")
    assert lines[5].startswith("| 4 | disaggregated |")


def _stored(name: str) -> dict:
    results = [RequestResult(index=i, scheduled_s=i, sent_s=i, prompt_tokens=4, output_tokens=3,
                             ok=True, ttft_s=0.1 + i / 100, e2e_s=0.2, itl_s=[0.05, 0.05],
                             telemetry={"proxy": {"mode": "pull", "prefill_sent_ms": 1.0,
                                                  "prefill_done_ms": 50.0,
                                                  "decode_sent_ms": 51.0},
                                        "transfer": {"kv_ready_ms": 9.0}})
               for i in range(5)]
    return {"name": name, "points": [
        {"summary": point(r, 0.99), "results": [
            {f: getattr(x, f) for f in x.__struct_fields__} for x in results]}
        for r in (1.0, 2.0)]}


def test_plots_without_matplotlib_return_nothing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    assert plot_all(tmp_path, _stored("aggregated"), _stored("disaggregated")) == []
    assert list(tmp_path.iterdir()) == []


def test_plots_with_matplotlib(tmp_path):
    # matplotlib is in the dev extra: this test runs, never skips, in CI.
    paths = plot_all(tmp_path / "plots", _stored("aggregated"), _stored("disaggregated"))
    assert sorted(p.name for p in paths) == ["attainment.png", "itl_cdf.png",
                                             "ttft_breakdown.png", "ttft_cdf.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in paths)


def _swept(name: str, max_itl_s: float, slo: str) -> dict:
    """A deployment as the benchmark stores it: 10 requests at 1 rps whose
    largest token gap is ``max_itl_s``, summarized under ``slo``."""
    from vllm_pd_ext.tools.slo.metrics import Gates, parse_slo, summarize

    results = [RequestResult(index=i, scheduled_s=float(i), sent_s=float(i), prompt_tokens=4,
                             output_tokens=3, ok=True, ttft_s=0.1, e2e_s=0.3,
                             itl_s=[0.01, max_itl_s]) for i in range(10)]
    summary = summarize(results, offered_rate=1.0, slo=parse_slo(slo), duration_s=10.0)
    return {"name": name, "gates": Gates().__dict__, "slo": {},
            "points": [{"summary": summary, "results": [
                {f: getattr(x, f) for f in x.__struct_fields__} for x in results]}]}


def test_verdict_rejudges_stored_requests_under_another_slo(tmp_path, capsys):
    import json

    from vllm_pd_ext.tools.slo.cli import main

    result = {"deployments": {"aggregated": _swept("aggregated", 0.15, "itl:100"),
                              "disaggregated": _swept("disaggregated-pull", 0.02, "itl:100")}}
    path = tmp_path / "result.json"
    path.write_text(json.dumps(result))
    main(["verdict", str(path)])
    out = capsys.readouterr().out
    assert "VERDICT: disaggregation justified" in out
    assert "aggregated 0 rps, disaggregated-pull 1 rps" in out
    # The same requests against a 200 ms ITL cutoff: both pass, not justified.
    main(["verdict", str(path), "--slo", "itl:200"])
    out = capsys.readouterr().out
    assert "VERDICT: disaggregation not justified" in out
    assert "aggregated 1 rps, disaggregated-pull 1 rps" in out
    with pytest.raises(SystemExit):
        main(["verdict", str(path), str(path), str(path)])
