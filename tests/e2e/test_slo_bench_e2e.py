"""vllm-pd-bench against real engines: ``run`` on a collocated engine and on
1P1D behind the proxy (the same seeded trace), then ``verdict`` with plots.

The session's engines are reused (no engine starts here): the collocated
``ref`` engine stands in for the aggregated deployment. What must hold:
every P/D request's tokens equal the collocated engine's (the suite's
oracle), its KV really moved (D's external-KV count grows by every prompt
token sent, and each measured request carries D's transfer record with its
bytes), the TTFT breakdown is built from that telemetry, and the verdict
and plots come out of the two JSON files. ``compare`` (which also starts
the deployments) is the same sweep; docs/slo.md records its runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.helpers import EXTERNAL, delta, log_dir
from vllm_pd_ext.testing.engines import Engine, Proxy
from vllm_pd_ext.testing.oracle import compare, near_tie_nats
from vllm_pd_ext.tools.slo.cli import main
from vllm_pd_ext.tools.slo.trace import make_trace

pytestmark = pytest.mark.engine

# Loose cutoffs: on a shared 2-core CI machine only the structure of the
# verdict is stable, not which deployment wins.
LOAD = ["--rates", "4", "--requests", "5", "--warmup", "1", "--prompt-tokens", "150",
        "--prompt-jitter", "0.2", "--output-tokens", "6", "--seed", "1401",
        "--slo", "ttft:60000,tpot:60000,itl:60000", "--no-progress",
        "--extra-body", '{"return_token_ids": true}']


def _results(path: Path) -> list[dict]:
    run = json.loads(path.read_text())
    (dep,) = run["deployments"].values()
    (point,) = dep["points"]
    return list(point["results"])


def test_bench_run_and_verdict_on_real_engines(ref: Engine, p: Engine, d: Engine, model: str,
                                               tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    agg, pd = tmp_path / "agg.json", tmp_path / "pd.json"
    main(["run", "--url", ref.url, "--model", model, "--name", "aggregated",
          "--out", str(agg), *LOAD])
    px = Proxy([p.url], [d.url], log_dir("proxy-slo-bench"),
               args=["--transfer-telemetry"]).start()
    try:
        px.wait_ready()
        before = d.metrics()
        main(["run", "--url", px.url, "--model", model, "--name", "disaggregated",
              "--metrics-url", p.url, "--metrics-url", d.url, "--out", str(pd), *LOAD])
        after = d.metrics()
    finally:
        px.stop()

    trace = make_trace(rate=4, num_requests=5, warmup=1, prompt_tokens=150, output_tokens=6,
                       seed=1401, prompt_jitter=0.2)
    want, got = _results(agg), _results(pd)
    assert [r["index"] for r in got] == [r.index for r in trace]
    assert all(r["ok"] for r in want + got), [r["error"] for r in want + got]
    # KV moved for every request, warm-up included: D computed none of the prompts.
    assert delta(before, after, EXTERNAL) == sum(len(r.prompt) for r in trace)
    eps = near_tie_nats(ref.dtype)
    for req, w, g in zip(trace, want, got, strict=True):
        assert len(g["token_ids"]) == 6 and len(w["token_ids"]) == 6
        verdict = compare(ref.url, model, req.prompt, g["token_ids"], w["token_ids"], eps)
        assert verdict.same, f"request {req.index}: {verdict.detail}"
        record = g["telemetry"]["transfer"]
        assert record["outcome"] == "ok" and record["bytes"] > 0
        assert record["tokens"] == len(req.prompt)

    run = json.loads(pd.read_text())
    (point,) = run["deployments"]["disaggregated"]["points"]
    summary = point["summary"]
    assert summary["completed"] == 5 and summary["slo_attainment"] == 1.0
    assert summary["server_queue"]["samples"] >= 1
    assert point["breakdown"]["count"] == 5
    # Pull: D's leg leaves after P answered and D's KV is ready only after
    # its READ, so the handoff takes time (a value clamped at 0 would not).
    assert point["breakdown"]["handoff_ms"]["p50"] > 0

    capsys.readouterr()
    main(["verdict", str(agg), str(pd), "--plots", str(tmp_path / "plots")])
    out = capsys.readouterr().out
    assert "VERDICT: disaggregation" in out
    assert "| 4 | aggregated |" in out and "| 4 | disaggregated |" in out
    assert "TTFT breakdown, disaggregated @ 4 req/s" in out
    plots = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert plots == ["attainment.png", "itl_cdf.png", "ttft_breakdown.png", "ttft_cdf.png"]
