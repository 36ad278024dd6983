"""The GPU check's judge and report (pure: no vLLM, torch, NIXL or network).

``gpu_check.py`` collects raw results, one ``Case`` per (mode, prompt
size), from real engines or, with ``--dry-run``, from a synthetic set; this
module decides each check's verdict and renders the Markdown table and the
JSON report, so that the dry run exercises exactly the code a GPU run uses.

Verdicts: ``PASS``, ``WARN`` (reported loudly, does not fail the run) and
``FAIL`` (the run exits 1). A case fails when the answer is not a 200, when
its tokens are not the collocated engine's (the oracle), or when D did not
load the whole prompt as external KV with exactly the bytes its blocks hold.
The UCX transport and the handoff time against the ``vllm-pd-size`` floor
are warnings: KV in VRAM that crossed over ``tcp`` works, only slowly.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from vllm_pd_ext.tools import step_split

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"

#: UCX transports that move GPU memory without staging it through host
#: memory over a socket: CUDA IPC within a node, RDMA (GPUDirect) across.
GPU_TRANSPORTS = ("cuda_ipc", "gdr_copy", "rc", "rc_mlx5", "rc_verbs", "dc", "dc_mlx5",
                  "ud", "ud_mlx5", "ud_verbs")
KNOWN_TRANSPORTS = (*GPU_TRANSPORTS, "tcp", "cuda_copy", "cma", "knem", "xpmem", "sysv",
                    "posix", "self")
_TL = re.compile(r"(?<![\w/])(" + "|".join(sorted(KNOWN_TRANSPORTS, key=len, reverse=True))
                 + r")/([\w:.\-]+)")

#: A pull handoff slower than this many times its floor is reported (WARN).
SLOW_FACTOR = 20.0


def ucx_transports(log_text: str) -> dict[str, list[str]]:
    """Transports UCX reports using, from engine logs written with
    ``UCX_LOG_LEVEL=info`` (its ``ep_cfg[..]: tag(tcp/lo); rma(cuda_ipc/cuda)``
    lines; ``UCX_PROTO_INFO=y`` tables name them the same way):
    transport -> the devices seen with it."""
    seen: dict[str, set[str]] = {}
    for line in log_text.splitlines():
        if "UCX" not in line and "ep_cfg" not in line and "|" not in line:
            continue
        for m in _TL.finditer(line):
            seen.setdefault(m.group(1), set()).add(m.group(2))
    return {tl: sorted(devs) for tl, devs in sorted(seen.items())}


@dataclass
class Case:
    """One request through the proxy and what it left behind (raw, unjudged)."""

    mode: str
    prompt_tokens: int
    status: int = 0
    error: str | None = None
    #: The oracle's verdict (``oracle.Verdict``): same, exact, summary.
    same: bool | None = None
    exact: bool | None = None
    oracle: str = ""
    #: Deltas of D's counters over the request.
    external_tokens: float = 0.0
    kv_bytes: float = 0.0
    expected_kv_bytes: int = 0
    #: Pull: pin + READ; push: D's wait for P's WRITE (includes P's prefill).
    handoff_ms: float | None = None
    floor_ms: float | None = None
    transfer: dict[str, Any] = field(default_factory=dict)


@dataclass
class Check:
    name: str
    verdict: str
    detail: str


@dataclass
class CaseVerdict:
    case: Case
    checks: list[Check]

    @property
    def verdict(self) -> str:
        return worst(c.verdict for c in self.checks)


def worst(verdicts: Iterable[str]) -> str:
    vs = list(verdicts)
    return FAIL if FAIL in vs else WARN if WARN in vs else PASS


def judge_case(case: Case) -> CaseVerdict:
    checks = []
    if case.error or case.status != 200:
        checks.append(Check("answer", FAIL, case.error or f"HTTP {case.status}"))
        return CaseVerdict(case, checks)
    checks.append(Check("answer", PASS, "200"))
    if case.same is None:
        checks.append(Check("equal", FAIL, "not judged by the oracle"))
    else:
        checks.append(Check("equal", PASS if case.same else FAIL, case.oracle))
    tokens_ok = case.external_tokens == case.prompt_tokens
    bytes_ok = case.kv_bytes == case.expected_kv_bytes > 0
    checks.append(Check(
        "kv moved", PASS if tokens_ok and bytes_ok else FAIL,
        f"external-KV tokens {case.external_tokens:.0f} of {case.prompt_tokens}, "
        f"bytes {case.kv_bytes:.0f} (expected {case.expected_kv_bytes})"))
    if case.mode != "pull":
        checks.append(Check("handoff", PASS, "push: D's wait includes P's prefill; not "
                                             "compared with the floor"))
    elif case.handoff_ms is None or not case.floor_ms:
        checks.append(Check("handoff", WARN, "no transfer record or no floor to compare"))
    else:
        ratio = case.handoff_ms / case.floor_ms
        if ratio > SLOW_FACTOR:
            checks.append(Check("handoff", WARN, f"{ratio:.1f}x the floor (> {SLOW_FACTOR:g}x)"))
        elif ratio < 1:
            checks.append(Check("handoff", WARN, f"{ratio:.2f}x the floor: faster than the "
                                                 "measured link; give --link-gb-s"))
        else:
            checks.append(Check("handoff", PASS, f"{ratio:.1f}x the floor"))
    return CaseVerdict(case, checks)


def judge_transport(mode: str, transports: Mapping[str, Sequence[str]],
                    strict: bool) -> Check:
    """Did the KV in VRAM take a GPU path (CUDA IPC, RDMA)? tcp alone: loud WARN."""
    gpu = [t for t in transports if t in GPU_TRANSPORTS]
    listed = ", ".join(f"{t}/{'|'.join(d)}" for t, d in transports.items()) or "none"
    bad = FAIL if strict else WARN
    if gpu:
        return Check(f"transport ({mode})", PASS, f"GPU path {', '.join(gpu)} (seen: {listed})")
    if "tcp" in transports:
        return Check(f"transport ({mode})", bad,
                     f"!!! VRAM went over tcp: no cuda_ipc or RDMA transport in UCX's log "
                     f"(seen: {listed}); check UCX_TLS and UCX_NET_DEVICES")
    return Check(f"transport ({mode})", bad,
                 f"UCX's log names no transport (seen: {listed}); was UCX_LOG_LEVEL=info set?")


@dataclass
class Report:
    cases: list[CaseVerdict]
    run_checks: list[Check]
    meta: dict[str, Any]

    @property
    def verdict(self) -> str:
        return worst([*(c.verdict for c in self.cases), *(c.verdict for c in self.run_checks)])

    @property
    def exit_code(self) -> int:
        return 1 if self.verdict == FAIL else 0

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "exit_code": self.exit_code, "meta": self.meta,
                "run_checks": [asdict(c) for c in self.run_checks],
                "cases": [{**asdict(cv.case), "verdict": cv.verdict,
                           "checks": [asdict(c) for c in cv.checks]} for cv in self.cases]}


def judge(cases: Sequence[Case], transports: Mapping[str, Mapping[str, Sequence[str]]],
          meta: dict[str, Any], errors: Sequence[str] = (), strict_transport: bool = False,
          ) -> Report:
    """Every verdict of one run. ``transports``: mode -> ``ucx_transports``;
    ``errors``: what stopped a mode before its cases (an engine that did not start)."""
    run = [Check("run", FAIL, e) for e in errors]
    if not cases:
        run.append(Check("run", FAIL, "no case ran"))
    run += [judge_transport(mode, tls, strict_transport) for mode, tls in transports.items()]
    return Report([judge_case(c) for c in cases], run, meta)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def render(report: Report) -> str:
    """The Markdown report: one row per case, then the run's checks."""
    m = report.meta
    lines = [f"# GPU check: {report.verdict}", ""]
    for key in ("mode_of_run", "gpus", "layout", "model", "ucx_env", "link"):
        if key in m:
            lines.append(f"- {key}: {m[key]}")
    lines += ["", "| mode | prompt tokens | answer | equal | KV moved | handoff ms | floor ms "
              "| x floor | verdict |", "|---|---:|---|---|---|---:|---:|---:|---|"]
    for cv in report.cases:
        c, by = cv.case, {ch.name: ch for ch in cv.checks}
        ratio = (f"{c.handoff_ms / c.floor_ms:.1f}" if c.handoff_ms is not None and c.floor_ms
                 else "-")
        cells = [c.mode, str(c.prompt_tokens)]
        for name in ("answer", "equal", "kv moved"):
            ch = by.get(name)
            cells.append("-" if ch is None else ch.verdict)
        cells += [_ms(c.handoff_ms), _ms(c.floor_ms), ratio, f"**{cv.verdict}**"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for ch in report.run_checks:
        lines.append(f"- {ch.verdict} {ch.name}: {ch.detail}")
    problems = [(cv.case, ch) for cv in report.cases for ch in cv.checks if ch.verdict != PASS]
    for case, ch in problems:
        lines.append(f"- {ch.verdict} {case.mode} {case.prompt_tokens} tokens, {ch.name}: "
                     f"{ch.detail}")
    return "\n".join(lines) + "\n"


def render_steps(splits: Mapping[str, tuple[Mapping[str, Mapping[str, float | int | None]], str]
                                 | str]) -> str:
    """The report's step-phase section (``VLLM_PD_EXT_STEP_TRACE``): per
    traced engine, its split by kind of step, or why there is none. Read
    the reference's ``second`` row (its token #2) against each D's ``first,
    1 token`` (token #2 after the KV load: issue 29's gap)."""
    if not splits:
        return ""
    lines = ["", "## Where a step's time goes (medians, ms)", ""]
    for name, got in splits.items():
        if isinstance(got, str):
            lines += [f"- {name}: {got}", ""]
            continue
        rows, note = got
        lines += [f"{name} ({note}):", "", step_split.table(rows), ""]
    return "\n".join(lines)
