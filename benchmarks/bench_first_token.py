"""Token #1 from P (issue 29): TTFT and the handoff, aggregated vs disaggregated,
with the proxy's ``--first-token-from-prefill`` on and off, one run.

For each model and prompt length, one ``vllm-pd-bench compare`` run (the
equal-budget harness of docs/slo.md: the same seeded trace for every
deployment, each engine confined to its core) measures, one after the
other on cores 0 and 1:

* ``aggregated``: two plain vLLM engines, no proxy hop;
* ``pull`` / ``push``: P and D behind ``vllm-pd-proxy``, token #1 from P
  (the default, "seeded"; push sends D's leg with P's and token #1 comes
  with the KV, ``--concurrent-dispatch``);
* ``push-seq``: push with ``--no-concurrent-dispatch`` (D's leg after P's
  answer, the path before issue 29's second step);
* ``pull-off`` / ``push-off``: the same with ``--no-first-token-from-prefill``
  (D computes token #1: the path before issue 29).

Per deployment it reports TTFT p50/p99 and its ratio to the aggregated
one (the target: <= 1.05 on an idle machine), and from each request's
``pd_telemetry`` (``vllm_pd_ext.tools.slo.breakdown.handoff_of``): the gap
between token #1 and token #2 against the transfer time plus one decode
step (target <= 1.2x) and the handoff's orchestration (handoff minus READ
or WRITE time; target p50 <= 1 ms). The rate is low (``--rate``) so the
machine is idle between requests; medians of ``--requests``.

    python benchmarks/bench_first_token.py --models tiny --lengths 128,300,1000,4000
    python benchmarks/bench_first_token.py --report .runs/first-token   # tables again

Engines are started and stopped by vllm-pd-bench (by PID); every result
stays under ``--out-dir`` (one ``compare`` directory per deployment).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec

DEPLOYMENTS = {
    "aggregated": ["--only", "aggregated"],
    "pull": ["--only", "disaggregated", "--transfer-mode", "pull"],
    "pull-off": ["--only", "disaggregated", "--transfer-mode", "pull",
                 "--proxy-args=--no-first-token-from-prefill"],
    "push": ["--only", "disaggregated", "--transfer-mode", "push"],
    "push-seq": ["--only", "disaggregated", "--transfer-mode", "push",
                 "--proxy-args=--no-concurrent-dispatch"],
    "push-off": ["--only", "disaggregated", "--transfer-mode", "push",
                 "--proxy-args=--no-first-token-from-prefill"],
}
#: An idle rate per model (requests per second): P busy at most a fifth of
#: the time, so prefills rarely overlap (rate <= 0.2 / prefill seconds, the
#: prefills as measured on our 2-core AVX2-only CPU host, bf16 without
#: hardware support: tiny 0.1, 0.2, 0.7 and about 3.5 s at 128, 300, 1,000
#: and 4,000 tokens; bench about 2 s at 128 and 5 s at 300, longer
#: lengths extrapolated). A host with AVX-512 bf16 is about 10x faster.
RATES: dict[str, dict[int, float]] = {
    "tiny": {128: 0.5, 300: 0.3, 1000: 0.3, 4000: 0.06},
    "bench": {128: 0.05, 300: 0.04, 1000: 0.01, 4000: 0.002},
}


#: Prompt lengths are uniform in tokens x (1 +- JITTER) (none the same).
JITTER = 0.02


def model_positions(model: str) -> int:
    """The model's ``max_position_embeddings`` (vLLM refuses a longer
    ``--max-model-len``); 4,096 when its config does not say."""
    try:
        config = json.loads((Path(".models") / model / "config.json").read_text())
    except (OSError, ValueError):
        return 4096
    return int(config.get("max_position_embeddings", 4096))


def run(model: str, length: int, name: str, args: argparse.Namespace) -> Path:
    out = Path(args.out_dir) / f"{model}-{length}" / name
    if (out / "result.json").exists() and not args.rerun:
        return out
    rate = args.rate or RATES.get(model, {}).get(length, 1)
    positions = model_positions(model)
    # The jitter may not push a prompt and its answer past the model's
    # positions (4,000 tokens +2% and 16 more is 4,096 with the tiny and
    # bench models' 4,096; 8 spare for rounding and a BOS): shrink it for the
    # longest prompts only.
    jitter = max(0.0, min(JITTER, (positions - args.output_tokens - 8 - length) / length))
    cmd = [sys.executable, "-m", "vllm_pd_ext.tools.slo.cli", "compare",
           "--model", f".models/{model}", "--prompt-tokens", str(length),
           "--prompt-jitter", f"{jitter:.4f}", "--rates", str(rate),
           "--requests", str(args.requests),
           "--warmup", str(args.warmup), "--output-tokens", str(args.output_tokens),
           "--max-model-len", str(positions),
           "--slo", "ttft:100000,tpot:10000,itl:10000", "--no-progress",
           "--out-dir", str(out), *DEPLOYMENTS[name]]
    if args.burstiness != 1.0:
        cmd += ["--burstiness", str(args.burstiness)]
    if args.text_prompts:
        cmd.append("--text-prompts")
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return out


def point(out: Path) -> dict[str, Any] | None:
    try:
        result = json.loads((out / "result.json").read_text())
    except (OSError, ValueError):
        return None
    dep = next(iter(result["deployments"].values()))
    if not dep.get("points"):
        return None
    pt: dict[str, Any] = dep["points"][0]
    if pt.get("results"):
        # The handoff again from the requests, with today's breakdown (a
        # result written by an older one keeps its requests).
        from vllm_pd_ext.tools.slo.breakdown import summarize_handoffs
        from vllm_pd_ext.tools.slo.metrics import RequestResult

        rows = msgspec.convert(pt["results"], list[RequestResult])
        pt["handoff"] = summarize_handoffs(rows)
    return pt


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def report(root: Path) -> list[str]:
    lines = ["| model | prompt | deployment | TTFT p50 / p99 ms | TTFT ratio p50 / p99 | "
             "token #1->#2 gap p50 ms | gap / (transfer + step) p50 / p99 | "
             "orchestration p50 / p99 ms | of which to D / pin / step waits p50 ms | "
             "step waits: scheduler / worker / crossings p50 ms | seeded |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for case in sorted(root.iterdir(), key=lambda p: (p.name.split("-")[0],
                                                      int(p.name.split("-")[-1]))):
        model, length = case.name.rsplit("-", 1)
        base = point(case / "aggregated")
        b = base["summary"] if base else {}
        for name in DEPLOYMENTS:
            pt = point(case / name)
            if pt is None:
                continue
            s, h = pt["summary"], pt.get("handoff") or {}
            ratio = [s.get(k) / b[k] if s.get(k) and b.get(k) else None
                     for k in ("median_ttft_ms", "p99_ttft_ms")]
            gap = h.get("first_gap_ms") or {}
            gr = h.get("gap_ratio") or {}
            orch = h.get("orchestration_ms") or {}
            lines.append(
                f"| {model} | {length} | {name} | {fmt(s.get('median_ttft_ms'))} / "
                f"{fmt(s.get('p99_ttft_ms'))} | {fmt(ratio[0], 2)} / {fmt(ratio[1], 2)} | "
                f"{fmt(gap.get('p50'))} | {fmt(gr.get('p50'), 2)} / {fmt(gr.get('p99'), 2)} | "
                f"{fmt(orch.get('p50'), 2)} / {fmt(orch.get('p99'), 2)} | "
                + " / ".join(fmt((h.get(k) or {}).get("p50"), 2)
                             for k in ("to_d_ms", "pin_ms", "step_wait_ms"))
                + " | " + " / ".join(fmt((h.get(k) or {}).get("p50"), 2)
                                     for k in ("sched_ms", "worker_extra_ms", "crossings_ms"))
                + f" | {h.get('seeded', '-')}/{h.get('count', '-')} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny", help="comma-separated, under .models/")
    ap.add_argument("--lengths", default="128,300,1000,4000")
    ap.add_argument("--deployments", default=",".join(DEPLOYMENTS))
    ap.add_argument("--rate", type=float, default=None, help="override the idle rate")
    ap.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of the arrivals (vllm-pd-bench's): 1 Poisson; a large "
                    "one (50) nearly evenly spaced, so a rate just under 1 / prefill time "
                    "keeps P idle between requests (long prompts of the bench model)")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--out-dir", default=".runs/first-token")
    ap.add_argument("--rerun", action="store_true", help="run cases that have a result")
    ap.add_argument("--text-prompts", action="store_true",
                    help="text prompts (vllm-pd-bench --text-prompts), as push's "
                    "--concurrent-dispatch needs; every deployment gets the same")
    ap.add_argument("--report", default=None, metavar="DIR", help="only print the tables")
    args = ap.parse_args()
    if args.report is None:
        for model in args.models.split(","):
            for length in map(int, args.lengths.split(",")):
                for name in args.deployments.split(","):
                    run(model, length, name, args)
    print("\n".join(report(Path(args.report or args.out_dir))))


if __name__ == "__main__":
    main()
