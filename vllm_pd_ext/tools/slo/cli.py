"""``vllm-pd-bench``: is disaggregation worth it here? An equal-budget SLO benchmark.

    # both deployments on this host's cores 0 and 1, same trace, then a verdict
    vllm-pd-bench compare --model .models/bench --rates 0.5,1,2 --prompt-tokens 300 \\
        --slo ttft:2000,tpot:100,itl:250 --out-dir .runs/slo/short
    # one deployment you already run (any OpenAI-compatible URL), same flags
    vllm-pd-bench run --url http://127.0.0.1:8000 --model M --name disaggregated --out pd.json
    vllm-pd-bench verdict agg.json pd.json
    # the proxy's --local-prefill-threshold from compare runs at two lengths
    vllm-pd-bench threshold .runs/slo/short/result.json .runs/slo/long/result.json

For every offered rate: an open-loop, seeded trace (``trace.py``; warm-up
requests excluded), streamed completions (``client.py``), and the summary
(``metrics.py``: ``vllm bench serve`` keys, joint SLO attainment over a
declared denominator, goodput, the generator's own dispatch delay, the queue
trend, and, for deployments this command started, the engines' own waiting
queue). ``verdict.py`` turns two sweeps into SLO-compliant capacities and
says "disaggregation justified / not justified by this evidence", with the
numbers. Disaggregated requests also get their TTFT decomposed
(``breakdown.py``) from the proxy's ``pd_telemetry``. Writes one JSON file
and, with matplotlib installed, PNG plots (``plots.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import shlex
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_pd_ext.tools.slo.client import run_point
from vllm_pd_ext.tools.slo.metrics import Gates, parse_slo, point_passes, summarize
from vllm_pd_ext.tools.slo.trace import as_text, make_trace

_WAITING = re.compile(r"^vllm:num_requests_waiting\{[^}]*\}\s+(\S+)", re.M)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-pd-bench",
                                description=(__doc__ or "").split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    compare = sub.add_parser("compare", help="start both deployments here, sweep, verdict")
    run = sub.add_parser("run", help="sweep one running deployment (its URLs)")
    for sp in (compare, run):
        _load_args(sp)
    compare.add_argument("--model", required=True, help="model directory (served by its path)")
    compare.add_argument("--cores", default="0,1",
                         help="the two cores: aggregated = one engine on each; "
                         "disaggregated = P on the first, D on the second")
    compare.add_argument("--transfer-mode", choices=("pull", "push"), default="pull")
    compare.add_argument("--tp", default="1,1", metavar="P,D",
                         help="disaggregated: P's and D's tensor-parallel sizes (a TP=2 "
                         "engine gets a core per rank out of --cores)")
    compare.add_argument("--max-model-len", type=int, default=4096)
    compare.add_argument("--kv-bytes", type=int, default=1 << 30,
                         help="KV-cache bytes per engine (both deployments)")
    compare.add_argument("--out-dir", default=None,
                         help="result.json, plots and engine logs (default .runs/slo/<time>)")
    compare.add_argument("--proxy-args", default="", metavar="ARGS",
                         help="more vllm-pd-proxy flags for the disaggregated deployment, one "
                         "string (e.g. '--no-first-token-from-prefill': the path on which D "
                         "computes token #1)")
    compare.add_argument("--only", choices=("aggregated", "disaggregated"), default=None,
                         help="measure one deployment only (no verdict)")
    run.add_argument("--url", action="append", required=True,
                     help="where to send requests; repeat for several engines "
                     "(least requests in flight first)")
    run.add_argument("--model", required=True, help="the served model name")
    run.add_argument("--name", default="deployment", help="label in the result")
    run.add_argument("--metrics-url", action="append", default=[],
                     help="engines whose /metrics give the waiting queue (optional)")
    run.add_argument("--out", required=True, help="the result JSON file")
    v = sub.add_parser("verdict", help="the verdict from two 'run' results (baseline "
                       "first) or one 'compare' result")
    v.add_argument("results", nargs="+", metavar="RESULT",
                   help="aggregated.json disaggregated.json, or compare's result.json")
    v.add_argument("--plots", default=None, help="directory for the PNG plots")
    v.add_argument("--slo", default=None,
                   help="judge the stored requests against other cutoffs (same syntax "
                   "as the runs' --slo); default: the runs' own")
    t = sub.add_parser("threshold", help="the proxy's --local-prefill-threshold from "
                       "'compare' results at two or more prompt lengths (docs/slo.md)")
    t.add_argument("results", nargs="+", help="compare's result.json files, same SLO")
    return p


def _load_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load (the same trace for every deployment)")
    g.add_argument("--rates", default="0.5,1,2", help="offered request rates per second")
    g.add_argument("--requests", type=int, default=40, help="measured requests per rate")
    g.add_argument("--warmup", type=int, default=4, help="warm-up requests per rate, excluded")
    g.add_argument("--prompt-tokens", type=int, default=300)
    g.add_argument("--prompt-jitter", type=float, default=0.1,
                   help="prompt lengths uniform in tokens x (1 +- jitter)")
    g.add_argument("--output-tokens", type=int, default=32)
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrivals: 1 = Poisson, < 1 burstier")
    g.add_argument("--text-prompts", action="store_true",
                   help="send each prompt as text (its ids decoded with the model's "
                   "tokenizer, cut to the same token count), not token ids: push's "
                   "--concurrent-dispatch takes text prompts and chat, not token ids")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--timeout", type=float, default=120.0, help="per-request deadline, s")
    g.add_argument("--no-stop-on-overload", action="store_true",
                   help="also run the rates above one whose queue grew without bound")
    g.add_argument("--no-progress", action="store_true")
    g.add_argument("--extra-body", default=None, metavar="JSON",
                   help='a JSON object merged into every request body, e.g. '
                   '\'{"return_token_ids": true}\' to record token ids')
    s = p.add_argument_group("SLO and gates")
    s.add_argument("--slo", default="ttft:2000,tpot:100,itl:250",
                   help="cutoffs in ms a request must all meet: ttft, tpot, itl (max per "
                   "request), e2el")
    s.add_argument("--attainment", type=float, default=0.95, help="joint attainment gate")
    s.add_argument("--max-error-rate", type=float, default=0.01)
    s.add_argument("--denominator", choices=("offered", "completed"), default="offered",
                   help="attainment over all offered requests after warm-up (errors and "
                   "timeouts included) or over the completed ones")


def _rates(text: str) -> list[float]:
    try:
        rates = sorted({float(r) for r in text.split(",") if r.strip()})
    except ValueError:
        raise SystemExit(f"vllm-pd-bench: error: --rates {text!r}: not numbers") from None
    if not rates or any(r <= 0 or math.isnan(r) for r in rates):
        raise SystemExit(f"vllm-pd-bench: error: --rates {text!r}: expected rates > 0")
    return rates


class QueueSampler:
    """Samples the engines' ``vllm:num_requests_waiting`` (summed) every
    ``every_s`` on a thread while a rate point runs: the server's own view
    of whether its queue keeps growing."""

    def __init__(self, urls: list[str], every_s: float = 0.5) -> None:
        self.urls = urls
        self.every_s = every_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slo-bench-queue", daemon=True)
        self._t0 = time.monotonic()

    def __enter__(self) -> QueueSampler:
        if self.urls:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            total = 0.0
            for url in self.urls:
                try:
                    with urllib.request.urlopen(url + "/metrics", timeout=2) as r:
                        text = r.read().decode()
                except OSError:
                    continue
                total += sum(float(v) for v in _WAITING.findall(text))
            self.samples.append((round(time.monotonic() - self._t0, 2), total))

    def summary(self) -> dict[str, Any]:
        waits = [w for _, w in self.samples]
        if not waits:
            return {"samples": 0}
        third = max(1, len(waits) // 3)
        return {"samples": len(waits), "waiting_max": max(waits),
                "waiting_first_third_mean": sum(waits[:third]) / third,
                "waiting_last_third_mean": sum(waits[-third:]) / third}


def _tokenizer(model: str) -> Any:
    """The model's tokenizer (``--text-prompts``): ``model`` must be its directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def sweep(name: str, urls: list[str], model: str, args: argparse.Namespace,
          metrics_urls: list[str]) -> dict[str, Any]:
    """One deployment over every rate; stops above a rate whose queue grew
    without bound (its higher rates can only be worse) unless told not to."""
    slo = parse_slo(args.slo)
    gates = _gates(args)
    extra = _extra_body(args.extra_body)
    points: list[dict[str, Any]] = []
    for i, rate in enumerate(_rates(args.rates)):
        trace = make_trace(rate=rate, num_requests=args.requests, warmup=args.warmup,
                           prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                           seed=args.seed, point=i, burstiness=args.burstiness,
                           prompt_jitter=args.prompt_jitter)
        if args.text_prompts:
            trace = as_text(trace, _tokenizer(args.model))
        with QueueSampler(metrics_urls) as sampler:
            results, duration = asyncio.run(run_point(
                urls, model, trace, timeout_s=args.timeout, progress=not args.no_progress,
                rate=rate, extra_body=extra))
        summary = summarize(results, offered_rate=rate, slo=slo, duration_s=duration,
                            denominator=args.denominator)
        summary["server_queue"] = sampler.summary()
        ok, why = point_passes(summary, gates)
        summary["passes"], summary["fails_because"] = ok, why
        point = {"summary": summary, "breakdown": _breakdown(results),
                 "handoff": _handoff(results), "results": [_as_dict(r) for r in results]}
        points.append(point)
        say(f"{name} @ {rate:g} req/s: attainment {summary['slo_attainment']:.3f}, errors "
            f"{summary['error_rate']:.3f}, p99 TTFT {_ms(summary.get('p99_ttft_ms'))}, p99 ITL "
            f"{_ms(summary.get('p99_itl_ms'))}, queue "
            f"{'stable' if summary['queue']['stable'] else 'GROWING'}: "
            f"{'pass' if ok else 'FAIL (' + '; '.join(why) + ')'}")
        if not summary["queue"]["stable"] and not args.no_stop_on_overload:
            say(f"{name}: queue grew without bound at {rate:g} req/s; higher rates not run")
            break
    return {"name": name, "points": points, "gates": gates.__dict__, "slo": slo.__dict__}


def _extra_body(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        extra = json.loads(text)
    except ValueError:
        raise ValueError(f"--extra-body {text[:80]!r}: not JSON") from None
    if not isinstance(extra, dict):
        raise ValueError("--extra-body: expected a JSON object")
    return extra


def _gates(args: argparse.Namespace) -> Gates:
    return Gates(attainment_min=args.attainment, error_rate_max=args.max_error_rate)


def _breakdown(results: list[Any]) -> dict[str, Any] | None:
    from vllm_pd_ext.tools.slo.breakdown import summarize_breakdowns

    out: dict[str, Any] | None = summarize_breakdowns(results)
    return out


def _handoff(results: list[Any]) -> dict[str, Any]:
    from vllm_pd_ext.tools.slo.breakdown import summarize_handoffs

    out: dict[str, Any] = summarize_handoffs(results)
    return out


def _as_dict(r: Any) -> dict[str, Any]:
    import msgspec

    out: dict[str, Any] = msgspec.to_builtins(r)
    return out


def _ms(x: Any) -> str:
    return "n/a" if x is None else f"{x:.0f} ms"


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def compare(args: argparse.Namespace) -> dict[str, Any]:
    from vllm_pd_ext.tools.launch import parse_tp_pair
    from vllm_pd_ext.tools.slo.deploy import Deployment

    out_dir = Path(args.out_dir or f".runs/slo/{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    cores = tuple(c.strip() for c in args.cores.split(","))
    kinds = [args.only] if args.only else ["aggregated", "disaggregated"]
    result: dict[str, Any] = {"command": "compare", "config": _config(args),
                              "deployments": {}}
    for kind in kinds:
        dep = Deployment(kind, args.model, out_dir / "logs", cores=cores,
                         transfer_mode=args.transfer_mode, max_model_len=args.max_model_len,
                         kv_bytes=args.kv_bytes, tp=parse_tp_pair(args.tp, len(cores)),
                         proxy_args=shlex.split(args.proxy_args))
        where = ", ".join(f"{e.name} on core {e.cpu_bind}" for e in dep.engines)
        say(f"starting {dep.name} ({where})")
        dep.start()
        try:
            swept = sweep(dep.name, dep.urls, args.model, args, dep.engine_urls)
        finally:
            dep.stop()
        swept["deployment"] = dep.describe()
        result["deployments"][kind] = swept
        _write(out_dir / "result.json", result)
    if len(kinds) == 2:
        _conclude(result, result["deployments"]["aggregated"],
                  result["deployments"]["disaggregated"], out_dir)
    _write(out_dir / "result.json", result)
    say(f"wrote {out_dir / 'result.json'}")
    return result


def _conclude(result: dict[str, Any], base: dict[str, Any], cand: dict[str, Any],
              plot_dir: Path | None) -> None:
    from vllm_pd_ext.tools.slo.verdict import render_table, verdict

    gates = Gates(**base["gates"])
    strip = [{"name": d["name"], "points": [p["summary"] for p in d["points"]]}
             for d in (base, cand)]
    v = verdict(strip[0], strip[1], gates=gates, baseline_name=base["name"],
                candidate_name=cand["name"])
    result["verdict"] = v
    print()
    print(render_table(strip[0], strip[1], gates=gates))
    for d in (base, cand):
        for p in d["points"]:
            b = p.get("breakdown")
            if b and b.get("count"):
                print(f"TTFT breakdown, {d['name']} @ {p['summary']['offered_rate']:g} req/s "
                      f"(medians of {b.get('count')}): " + ", ".join(
                          f"{k} {v['p50']:.1f} ms" for k, v in b.items()
                          if isinstance(v, dict) and v.get("p50") is not None))
    for line in ttft_ratios(base, cand):
        print(line)
    for p in cand["points"]:
        h = p.get("handoff")
        if h and h.get("count"):
            print(f"handoff, {cand['name']} @ {p['summary']['offered_rate']:g} req/s "
                  f"({h['count']} requests, {h['seeded']} with token #1 from P), p50 / p99: "
                  + ", ".join(f"{k} {h[k]['p50']:.2f} / {h[k]['p99']:.2f}"
                              for k in ("first_gap_ms", "transfer_ms", "decode_step_ms",
                                        "gap_ratio", "handoff_ms", "orchestration_ms")
                              if h[k]["p50"] is not None))
    print()
    print(f"VERDICT: {v['verdict']}")
    for line in v["evidence"]:
        print(f"  - {line}")
    if plot_dir is not None:
        from vllm_pd_ext.tools.slo.plots import plot_all

        paths = plot_all(plot_dir, base, cand)
        result["plots"] = [str(p) for p in paths]
        if paths:
            say("plots: " + ", ".join(str(p) for p in paths))
        else:
            say("no plots: pip install matplotlib")


def ttft_ratios(base: dict[str, Any], cand: dict[str, Any]) -> list[str]:
    """Per rate both ran: TTFT p50 and p99 of ``cand`` over ``base``."""
    by_rate = {p["summary"]["offered_rate"]: p["summary"] for p in base["points"]}
    lines = []
    for p in cand["points"]:
        s = p["summary"]
        b = by_rate.get(s["offered_rate"])
        if b is None:
            continue
        ratios = []
        for key in ("median_ttft_ms", "p99_ttft_ms"):
            x, y = s.get(key), b.get(key)
            ratios.append(f"{x / y:.2f}" if x and y else "n/a")
        lines.append(f"TTFT {cand['name']} / {base['name']} @ {s['offered_rate']:g} req/s: "
                     f"p50 {ratios[0]}, p99 {ratios[1]}")
    return lines


def _verdict_inputs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """(baseline, candidate) from one compare result or two run results."""
    if len(runs) == 1:
        deps = runs[0].get("deployments") or {}
        if set(deps) != {"aggregated", "disaggregated"}:
            raise ValueError("one result given: expected compare's, with both deployments")
        return [deps["aggregated"], deps["disaggregated"]]
    if len(runs) != 2:
        raise ValueError("expected two 'run' results (baseline first) or one 'compare' result")
    return [next(iter(r["deployments"].values())) for r in runs]


def rejudge(dep: dict[str, Any], slo: Any) -> dict[str, Any]:
    """``dep`` with every point's summary recomputed under ``slo`` from its
    stored requests (same requests, same timings, other cutoffs)."""
    import msgspec

    from vllm_pd_ext.tools.slo.metrics import RequestResult

    gates = Gates(**dep["gates"])
    points = []
    for point in dep["points"]:
        old = point["summary"]
        results = [msgspec.convert(r, RequestResult) for r in point["results"]]
        summary = summarize(results, offered_rate=old["offered_rate"], slo=slo,
                            duration_s=old["duration"],
                            denominator=old.get("attainment_denominator", "offered"))
        summary["server_queue"] = old.get("server_queue")
        ok, why = point_passes(summary, gates)
        summary["passes"], summary["fails_because"] = ok, why
        points.append(dict(point, summary=summary))
    return dict(dep, points=points, slo=slo.__dict__)


def threshold(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Print the break-even (slo/threshold.py) and the runs' verdicts beside it."""
    from vllm_pd_ext.tools.slo.threshold import from_results

    out = from_results(results)
    for run in out["runs"]:
        print(f"{run['prompt_tokens']:.0f} tokens: P prefill p50 {run['prefill_p50_ms']:.1f} ms, "
              f"D decode step {run['decode_step_ms']:.1f} ms; {run['verdict'] or 'no verdict'}")
    lo, hi = out["segment"]
    print(f"prefill grows {out['ms_per_token']:.4f} ms/token between {lo:g} and {hi:g} tokens; "
          f"stall budget = ITL cutoff {out['itl_cutoff_ms']:g} ms - decode step "
          f"{out['decode_step_ms']:.1f} ms = {out['stall_budget_ms']:.1f} ms")
    print(f"break-even by the stall rule: {out['break_even_tokens']:.0f} uncached tokens")
    if out["capped_by_verdict"]:
        print(f"capped: disaggregation was measured to pay from "
              f"{out['justified_from_tokens']:.0f} tokens, below the rule's break-even")
    print(f"-> vllm-pd-proxy --local-prefill-threshold {out['threshold_tokens']}")
    return out


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k not in ("cmd",)}


def _write(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1, default=str))


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "compare":
            compare(args)
        elif args.cmd == "run":
            result = {"command": "run", "config": _config(args),
                      "deployments": {args.name: sweep(args.name, args.url, args.model, args,
                                                       args.metrics_url)}}
            _write(Path(args.out), result)
            say(f"wrote {args.out}")
        elif args.cmd == "threshold":
            threshold([json.loads(Path(f).read_text()) for f in args.results])
        else:
            deps = _verdict_inputs([json.loads(Path(f).read_text()) for f in args.results])
            if args.slo is not None:
                deps = [rejudge(d, parse_slo(args.slo)) for d in deps]
            out: dict[str, Any] = {"command": "verdict"}
            _conclude(out, deps[0], deps[1], Path(args.plots) if args.plots else None)
    except ValueError as exc:
        print(f"vllm-pd-bench: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
