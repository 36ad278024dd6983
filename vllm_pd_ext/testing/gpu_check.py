"""One-shot GPU check: P/D on NVIDIA GPUs, pull and push, against a collocated engine.

    python -m vllm_pd_ext.testing.gpu_check              # on a machine with NVIDIA GPUs
    python -m vllm_pd_ext.testing.gpu_check --dry-run    # anywhere: plan and a synthetic report

Offline: it builds a random-weight Llama with a real KV head shape (preset
``gpu`` of ``examples/make_tiny_model.py``: 24 layers, 8 KV heads, head dim
128), starts a collocated reference engine and, per transfer mode, a P and a
D (on GPUs 0 and 1 when there are two, else all on GPU 0 with the memory
split) behind ``vllm-pd-proxy``, and sends prompts of 1k, 8k and 32k tokens
(clipped to ``--max-model-len``). For each it proves: the output is the
reference's (``testing/oracle.py``), D loaded the whole prompt as external KV
with exactly the bytes its blocks hold (D's counters), and compares the
handoff (D's transfer record) with the ``vllm-pd-size`` floor for the measured
link. From UCX's info log it names the transport that carried the KV and
warns loudly when VRAM went over ``tcp``. Writes ``report.json`` and
``report.md`` under ``--work-dir`` and prints the table; exit 0 pass (warnings
allowed), 1 a failed check, 2 no GPU found.

``--dry-run`` needs no GPU: it parses the arguments, builds the model at 2
layers (same head shape), prints the exact commands and environments it
would run, and judges a synthetic result set (``--synthetic fail`` for a
failing one) through the same report code (``gpu_report.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

from vllm_pd_ext import STEP_TRACE_ENV
from vllm_pd_ext.testing import gpu_report as gr
from vllm_pd_ext.tools import step_split
from vllm_pd_ext.tools.launch import Engine, Proxy
from vllm_pd_ext.tools.sizing.formula import handoff, load_config, spec_from_config

REPO = Path(__file__).resolve().parents[2]
MODES = ("pull", "push")
EXTERNAL = "vllm:prompt_tokens_by_source_total[external_kv_transfer]"
KV_BYTES = "vllm:pd_ext_kv_bytes_total"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m vllm_pd_ext.testing.gpu_check",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="no GPU: plan, build a 2-layer "
                    "model, judge a synthetic result set")
    ap.add_argument("--synthetic", choices=("pass", "fail"), default="pass",
                    help="--dry-run: the synthetic result set to judge")
    ap.add_argument("--work-dir", type=Path, default=REPO / ".runs" / "gpu-check")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="where the model is built (default .models/gpu or .models/gpu-dry)")
    ap.add_argument("--prompt-tokens", default="1000,8000,32000",
                    help="prompt sizes, clipped to --max-model-len - --max-tokens")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=32768 + 256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--modes", default="pull,push")
    ap.add_argument("--gpus", default=None, help="GPU indices to use, e.g. 0,1 (default: "
                    "what nvidia-smi lists; the first two)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="per engine (default 0.28 with three engines on one GPU, 0.45 on two)")
    ap.add_argument("--ucx-tls", default=None, help="default cuda_copy,cuda_ipc,tcp (+rc "
                    "when /sys/class/infiniband has a device)")
    ap.add_argument("--ucx-net-devices", default=None, help="default lo (+<ib device>:1)")
    ap.add_argument("--link-gb-s", type=float, default=None,
                    help="the link's sustained GB/s for the floor (default: measured)")
    ap.add_argument("--setup-ms", type=float, default=None)
    ap.add_argument("--strict-transport", action="store_true",
                    help="fail, not warn, when the KV did not take cuda_ipc or RDMA")
    ap.add_argument("--timeout", type=float, default=900.0, help="per engine start, seconds")
    ap.add_argument("--step-trace", action="store_true",
                    help="trace the reference's and each D's step phases "
                         "(VLLM_PD_EXT_STEP_TRACE; the report then ends with 'Where a "
                         "step's time goes'). Opt-in: it imports vLLM's model runner in "
                         "every process of those engines, not yet tried on a GPU")
    return ap


# ------------------------------------------------------------------ placement
def detect_gpus() -> list[str]:
    """NVIDIA GPUs as nvidia-smi's ``index, name, memory`` lines (empty when none)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def ucx_env(args: argparse.Namespace) -> dict[str, str]:
    ib = sorted(p.name for p in Path("/sys/class/infiniband").glob("*"))
    tls = args.ucx_tls or ("cuda_copy,cuda_ipc,tcp" + (",rc" if ib else ""))
    devices = args.ucx_net_devices or ",".join(["lo", *(f"{d}:1" for d in ib[:1])])
    return {"UCX_TLS": tls, "UCX_NET_DEVICES": devices, "UCX_LOG_LEVEL": "info",
            "UCX_PROTO_INFO": "y"}


@dataclass
class Plan:
    layout: str
    gpus: list[str]
    prompts: list[int]
    ref: Engine
    pairs: dict[str, tuple[Engine, Engine]]
    proxy_args: dict[str, list[str]]
    env: dict[str, str] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        def one(e: Engine) -> dict[str, Any]:
            return {"command": shlex.join(e.command()), "env": e.environment(base={})}
        return {"layout": self.layout, "gpus": self.gpus, "prompts": self.prompts,
                "ref": one(self.ref),
                "modes": {m: {"p": one(p), "d": one(d), "proxy_args": self.proxy_args[m]}
                          for m, (p, d) in self.pairs.items()}}


def make_plan(args: argparse.Namespace, gpus: list[str], model: str) -> Plan:
    ids = ([i.strip() for i in args.gpus.split(",") if i.strip()] if args.gpus
           else [g.split(",")[0].strip() for g in gpus])
    two = len(ids) >= 2
    util = args.gpu_memory_utilization or (0.45 if two else 0.28)
    p_gpu, d_gpu = ids[0], ids[1] if two else ids[0]
    env = ucx_env(args)
    log = args.work_dir / "logs"
    extra = ["--block-size", str(args.block_size)]

    def engine(name: str, gpu: str, connector: str | None, role: str | None,
               mode: str | None) -> Engine:
        # The reference's token #2 step beside D's first step after a load
        # (issue 29's gap): one request at a time, so the trace is cheap.
        traced = ({STEP_TRACE_ENV: str(args.work_dir / "steps" / name)}
                  if args.step_trace and role != "kv_producer" else {})
        return Engine(name, model, log, connector=connector, role=role,
                      extra_config={"transfer_mode": mode} if mode else {},
                      max_model_len=args.max_model_len, device="cuda",
                      gpu_memory_utilization=util, cuda_devices=gpu, extra_args=list(extra),
                      env={**env, **traced})

    cap = args.max_model_len - args.max_tokens
    prompts = sorted({min(int(n), cap) for n in args.prompt_tokens.split(",")})
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"--modes: unknown {bad}; known: {', '.join(MODES)}")
    return Plan(
        layout=(f"two GPUs: P and the reference on GPU {p_gpu}, D on GPU {d_gpu}" if two else
                f"one GPU ({p_gpu}): reference, P and D at {util} of its memory each"),
        gpus=gpus, prompts=prompts, ref=engine("ref", p_gpu, None, None, None),
        pairs={m: (engine(f"p-{m}", p_gpu, "PDConnector", "kv_producer", m),
                   engine(f"d-{m}", d_gpu, "PDConnector", "kv_consumer", m)) for m in modes},
        proxy_args={m: ["--transfer-mode", m] for m in modes}, env=env)


def build_model(out: Path, preset: str) -> str:
    subprocess.run([sys.executable, str(REPO / "examples/make_tiny_model.py"), "--out",
                    str(out), "--preset", preset], check=True, stdout=subprocess.DEVNULL)
    return str(out)


# ------------------------------------------------------------------ the run
def token_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 3000) for _ in range(n)]


def expected_bytes(bytes_per_token: int, tokens: int, block_size: int) -> int:
    return -(-tokens // block_size) * block_size * bytes_per_token


def floor_ms(spec: Any, nbytes: float, link: dict[str, Any]) -> float | None:
    if not link.get("gb_s") or nbytes <= 0:
        return None
    tokens = max(1, round(nbytes / spec.bytes_per_token))
    return handoff(spec, tokens, [link["gb_s"]], link["setup_ms"], float("inf")
                   ).links[0].handoff_floor_ms


def transfer_records(d: Engine) -> list[dict[str, Any]]:
    """D's transfer records so far (its ``PDConnector: transfer {...}`` log lines)."""
    import msgspec

    from vllm_pd_ext.wire.telemetry import parse_log_line
    recs = (parse_log_line(line) for line in d.log_text().splitlines())
    return [msgspec.to_builtins(r) for r in recs if r is not None]


def run_case(mode: str, n: int, ref: Engine, d: Engine, proxy: Proxy, model: str,
             args: argparse.Namespace, spec: Any, link: dict[str, Any]) -> gr.Case:
    from vllm_pd_ext.testing.oracle import compare, near_tie_nats, output_of

    case = gr.Case(mode, n, expected_kv_bytes=expected_bytes(spec.bytes_per_token, n,
                                                             args.block_size))
    body = {"model": model, "prompt": token_prompt(n, MODES.index(mode) * 100_003 + n),
            "max_tokens": args.max_tokens, "temperature": 0, "return_token_ids": True}
    try:
        status, want = ref.post("/v1/completions", body, timeout=600)
        if status != 200:
            raise RuntimeError(f"reference answered {status}: {str(want)[:300]}")
        before, seen = d.metrics(), len(transfer_records(d))
        # (Proxy.post is Engine.post, which mypy cannot bind to a Proxy.)
        case.status, got = cast(Any, proxy).post("/v1/completions", body, timeout=600)
        after = d.metrics()
        if case.status != 200:
            case.error = str(got)[:500]
            return case
        g, w = output_of(got), output_of(want)
        v = compare(ref.url, model, g.prompt, g.tokens, w.tokens, near_tie_nats(ref.dtype),
                    timeout=600)
        case.same, case.exact, case.oracle = v.same, v.exact, v.summary()
        case.external_tokens = after.get(EXTERNAL, 0.0) - before.get(EXTERNAL, 0.0)
        case.kv_bytes = after.get(KV_BYTES, 0.0) - before.get(KV_BYTES, 0.0)
        recs = transfer_records(d)[seen:]
        if recs:
            r = case.transfer = recs[-1]
            case.handoff_ms = handoff_ms_of(r, mode)
        case.floor_ms = floor_ms(spec, case.kv_bytes, link)
    except Exception as exc:  # every failure is a row of the report
        case.error = f"{type(exc).__name__}: {exc}"[:800]
    return case


def handoff_ms_of(record: dict[str, Any], mode: str) -> float:
    """The KV's part of one transfer record: pull's pin and READ (the slower
    of the two when the pin ran beside the READ, ``pin_with_read``, else
    their sum), push's wait for P's WRITE."""
    parts = [float(record.get(k) or 0.0) for k in (
        ("pin_ms", "read_ms") if mode == "pull" else ("write_wait_ms",))]
    return max(parts) if record.get("pin_with_read") is True else sum(parts)


def measure_link(args: argparse.Namespace, plan: Plan) -> dict[str, Any]:
    """The link for the floor: ``--link-gb-s``, else NIXL READs of GPU memory
    between two processes placed as D and P are (``vllm-pd-size --measure``'s
    code on VRAM), in a child so that this process holds no CUDA context."""
    if args.link_gb_s:
        return {"gb_s": args.link_gb_s, "setup_ms": args.setup_ms or 0.0,
                "source": "--link-gb-s"}
    p, d = next(iter(plan.pairs.values()))
    devices = (int(d.cuda_devices or 0), int(p.cuda_devices or 0))
    out = args.work_dir / "link.json"
    code = ("import dataclasses, json, pathlib; from vllm_pd_ext.tools.sizing.measure import "
            f"measure; m = measure(cuda_devices={devices!r}); "
            f"pathlib.Path({str(out)!r}).write_text(json.dumps(dataclasses.asdict(m)))")
    env = {**os.environ, **plan.env, "UCX_LOG_LEVEL": "warn"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    try:
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=env, timeout=300, check=True)
        m = json.loads(out.read_text())
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        err = getattr(exc, "stderr", "") or ""
        return {"gb_s": None, "setup_ms": 0.0,
                "source": f"measurement failed: {exc} {err[-500:]}".strip()}
    return {"gb_s": m["effective_bandwidth_gb_s"],
            "setup_ms": m["setup_ms"] if args.setup_ms is None else args.setup_ms,
            "source": f"NIXL READ of GPU memory ({m['where']})"}


def run_live(plan: Plan, args: argparse.Namespace, model: str, spec: Any,
             link: dict[str, Any]) -> tuple[list[gr.Case], dict[str, Any], list[str]]:
    cases: list[gr.Case] = []
    transports: dict[str, Any] = {}
    errors: list[str] = []
    try:
        plan.ref.start().wait_ready(timeout=args.timeout)
        for mode, (p, d) in plan.pairs.items():
            proxy = Proxy([p.url], [d.url], args.work_dir / "logs" / f"proxy-{mode}",
                          args=plan.proxy_args[mode])
            try:
                for e in (p, d):  # one at a time: each sizes its KV from free memory
                    e.start().wait_ready(timeout=args.timeout)
                proxy.start().wait_ready()
                for n in plan.prompts:
                    cases.append(run_case(mode, n, plan.ref, d, proxy, model, args, spec, link))
                    print(f"{mode} {n} tokens: {cases[-1].error or cases[-1].oracle}",
                          flush=True)
            except Exception as exc:
                errors.append(f"{mode}: {type(exc).__name__}: {str(exc)[-1500:]}")
            finally:
                proxy.stop()
                for e in (d, p):
                    e.stop()
                text = "".join(e.log_text() for e in (p, d) if e.log_path.exists())
                transports[mode] = gr.ucx_transports(text)
    except Exception as exc:
        errors.append(f"reference: {type(exc).__name__}: {str(exc)[-1500:]}")
    finally:
        plan.ref.stop()
    return cases, transports, errors


def step_splits(plan: Plan, args: argparse.Namespace
                ) -> dict[str, tuple[dict[str, dict[str, float | int | None]], str] | str]:
    """Engine name -> its step split and note (``tools/step_split.py``), or
    why there is none; only the engines the plan traced."""
    out: dict[str, tuple[dict[str, dict[str, float | int | None]], str] | str] = {}
    engines = [plan.ref, *(d for _, d in plan.pairs.values())]
    for e in engines:
        folder = e.env.get(STEP_TRACE_ENV)
        if folder is None:
            continue
        if args.dry_run:
            out[e.name] = "not run (dry run)"
            continue
        try:
            out[e.name] = step_split.split_folder(Path(folder))
        except (OSError, ValueError) as exc:
            out[e.name] = f"no trace ({exc})"
    return out


def synthetic(plan: Plan, spec: Any, block_size: int, kind: str
              ) -> tuple[list[gr.Case], dict[str, Any], list[str]]:
    """A result set shaped like a run's: all good, or (``fail``) one output
    that differs, one request whose KV D computed itself, and tcp only."""
    link = {"gb_s": 100.0, "setup_ms": 0.05}
    cases = []
    for mode in plan.pairs:
        for n in plan.prompts:
            nbytes = expected_bytes(spec.bytes_per_token, n, block_size)
            fl = floor_ms(spec, nbytes, link)
            cases.append(gr.Case(mode, n, status=200, same=True, exact=True,
                                 oracle="same (token for token)", external_tokens=n,
                                 kv_bytes=nbytes, expected_kv_bytes=nbytes,
                                 handoff_ms=None if fl is None else fl * 3, floor_ms=fl))
    transports = {m: {"cuda_copy": ["cuda"], "cuda_ipc": ["cuda"], "tcp": ["lo"]}
                  for m in plan.pairs}
    if kind == "fail":
        cases[0].same, cases[0].exact, cases[0].oracle = False, False, "different: synthetic"
        cases[-1].external_tokens, cases[-1].kv_bytes = 0, 0
        transports = {m: {"tcp": ["lo"]} for m in plan.pairs}
    return cases, transports, []


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    gpus = detect_gpus()
    if not gpus and not args.dry_run:
        print("gpu_check: no NVIDIA GPU found (nvidia-smi lists none). Run it on a machine "
              "with one or more NVIDIA GPUs, or use --dry-run to plan and check the report "
              "code on CPU.", file=sys.stderr)
        return 2
    dry_gpus = gpus or ["0, dry-run GPU, 0 MiB", "1, dry-run GPU, 0 MiB"]
    preset = "gpu-dry" if args.dry_run else "gpu"
    model = build_model(args.model_dir or REPO / ".models" / preset, preset)
    spec = spec_from_config(load_config(model))
    plan = make_plan(args, dry_gpus if args.dry_run else gpus, model)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    described = plan.describe()
    (args.work_dir / "plan.json").write_text(json.dumps(described, indent=1))
    print(f"## Plan ({plan.layout})\n")
    for name, e in [("ref", plan.ref), *((e.name, e) for pair in plan.pairs.values()
                                         for e in pair)]:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in e.environment(base={}).items())
        print(f"{name}: {env} \\\n  {shlex.join(e.command())}\n")
    for mode, pargs in plan.proxy_args.items():
        print(f"proxy ({mode}): vllm-pd-proxy {shlex.join(pargs)}")
    started = time.time()
    if args.dry_run:
        link: dict[str, Any] = {"gb_s": 100.0, "setup_ms": 0.05, "source": "synthetic"}
        cases, transports, errors = synthetic(plan, spec, args.block_size, args.synthetic)
    else:
        link = measure_link(args, plan)
        cases, transports, errors = run_live(plan, args, model, spec, link)
    meta = {"mode_of_run": "dry run (synthetic results)" if args.dry_run else "GPU",
            "gpus": plan.gpus, "layout": plan.layout, "ucx_env": plan.env, "link": link,
            "model": f"{model} ({asdict(spec)}, {spec.bytes_per_token} B/token)",
            "started": started, "seconds": round(time.time() - started, 1)}
    report = gr.judge(cases, transports, meta, errors, args.strict_transport)
    steps = step_splits(plan, args)
    (args.work_dir / "report.json").write_text(json.dumps(
        {**report.to_json(), "plan": described,
         "steps": {k: v if isinstance(v, str) else v[0] for k, v in steps.items()}}, indent=1))
    text = gr.render(report) + gr.render_steps(steps)
    (args.work_dir / "report.md").write_text(text)
    print("\n" + text)
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
