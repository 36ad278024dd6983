"""SLO-compliant capacity per deployment, and the aggregated-vs-disaggregated
verdict from two rate sweeps.

Pure. A deployment is ``{"name": ..., "points": [...]}`` where each point is a
``metrics.summarize`` summary, or ``{"summary": summary, "results": [...]}``
as the benchmark stores it. Capacity is the highest tested offered rate that
passes the gates *with every lower tested rate passing too*: a pass above a
failure is listed but not counted, so a lucky point above an overload cannot
raise capacity. The verdict compares capacities over the rates both sweeps
tested, states only measured numbers, and calls disaggregation justified only
when its capacity is strictly higher.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vllm_pd_ext.tools.slo.metrics import Gates, point_passes

JUSTIFIED = "disaggregation justified by this evidence"
NOT_JUSTIFIED = "disaggregation not justified by this evidence"
NEITHER_PASSED = ("neither deployment met the SLO at any tested rate: capacity 0 for both; "
                  "test lower rates or loosen the SLO")


def point_summary(point: Mapping[str, Any]) -> Mapping[str, Any]:
    """The summary of a stored point, or the point itself when it is one."""
    summary = point.get("summary")
    return summary if isinstance(summary, Mapping) else point


def _by_rate(points: Sequence[Mapping[str, Any]], name: str) -> dict[float, Mapping[str, Any]]:
    out: dict[float, Mapping[str, Any]] = {}
    for point in points:
        summary = point_summary(point)
        rate = float(summary["offered_rate"])
        if rate in out:
            raise ValueError(f"{name}: offered rate {rate:g} appears twice in the sweep")
        out[rate] = summary
    return dict(sorted(out.items()))


def capacity(points: Sequence[Mapping[str, Any]], gates: Gates | None = None) -> dict[str, Any]:
    """``capacity_rps`` (0.0 when no rate counts), ``passing_rates`` (every
    rate that met the gates), ``failing`` ({rate: reasons}) and
    ``not_counted`` (passing rates above a failure)."""
    gates = gates or Gates()
    cap, counting = 0.0, True
    passing: list[float] = []
    not_counted: list[float] = []
    failing: dict[float, list[str]] = {}
    for rate, summary in _by_rate(points, "sweep").items():
        ok, reasons = point_passes(dict(summary), gates)
        if not ok:
            failing[rate] = reasons
            counting = False
            continue
        passing.append(rate)
        if counting:
            cap = rate
        else:
            not_counted.append(rate)
    return {"capacity_rps": cap, "passing_rates": passing, "failing": failing,
            "not_counted": not_counted}


def _fmt(x: Any, nd: int = 1) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def _same(field: str, summaries: list[Mapping[str, Any]]) -> None:
    values = {repr(s.get(field)) for s in summaries}
    if len(values) > 1:
        raise ValueError(f"the sweeps differ in {field} ({', '.join(sorted(values))}): "
                         "the comparison needs one declared value")


def _point_line(name: str, summary: Mapping[str, Any], gates: Gates) -> str:
    ok, reasons = point_passes(dict(summary), gates)
    verdict = "pass" if ok else "fail: " + "; ".join(reasons)
    return (f"{name} attainment {_fmt(summary.get('slo_attainment'), 3)}, p99 TTFT "
            f"{_fmt(summary.get('p99_ttft_ms'))} ms, p99 ITL {_fmt(summary.get('p99_itl_ms'))}"
            f" ms ({verdict})")


def verdict(baseline: Mapping[str, Any], candidate: Mapping[str, Any], *,
            gates: Gates | None = None, baseline_name: str = "aggregated",
            candidate_name: str = "disaggregated") -> dict[str, Any]:
    """``{"verdict", "evidence": [lines], "capacity": {name: rps},
    "common_rates"}`` from two sweeps (names from their ``"name"`` keys,
    else the keyword defaults)."""
    gates = gates or Gates()
    b_name = str(baseline.get("name") or baseline_name)
    c_name = str(candidate.get("name") or candidate_name)
    if b_name == c_name:
        raise ValueError(f"both deployments are named {b_name!r}")
    b_all = _by_rate(baseline.get("points", []), b_name)
    c_all = _by_rate(candidate.get("points", []), c_name)
    common = sorted(set(b_all) & set(c_all))
    _same("slo", [*b_all.values(), *c_all.values()])
    _same("attainment_denominator", [*b_all.values(), *c_all.values()])
    evidence: list[str] = []
    if set(b_all) != set(c_all):
        only_b = ", ".join(f"{r:g}" for r in sorted(set(b_all) - set(c_all))) or "none"
        only_c = ", ".join(f"{r:g}" for r in sorted(set(c_all) - set(b_all))) or "none"
        evidence.append(f"the sweeps tested different rates: comparing only the common rates "
                        f"[{', '.join(f'{r:g}' for r in common)}] rps; not compared: "
                        f"{b_name} only [{only_b}], {c_name} only [{only_c}]")
    if not common:
        evidence.append("no rate was tested on both deployments: nothing to compare")
        return {"verdict": NOT_JUSTIFIED, "evidence": evidence,
                "capacity": {b_name: 0.0, c_name: 0.0}, "common_rates": []}
    first = b_all[common[0]]
    evidence.append(f"gates: attainment >= {gates.attainment_min:g} (joint passes / "
                    f"{first.get('attainment_denominator', 'offered')} requests after warm-up), "
                    f"error rate <= {gates.error_rate_max:g}"
                    + (", stable queue" if gates.require_stable_queue else ""))
    b_cap = capacity([b_all[r] for r in common], gates)
    c_cap = capacity([c_all[r] for r in common], gates)
    for rate in common:
        evidence.append(f"{rate:g} rps: {_point_line(b_name, b_all[rate], gates)}; "
                        f"{_point_line(c_name, c_all[rate], gates)}")
    cb, cc = b_cap["capacity_rps"], c_cap["capacity_rps"]
    evidence.append(f"SLO-compliant capacity: {b_name} {cb:g} rps, {c_name} {cc:g} rps")
    for name, cap in ((b_name, b_cap), (c_name, c_cap)):
        for rate in cap["not_counted"]:
            evidence.append(f"{name} passed at {rate:g} rps above a failing lower rate: "
                            "not counted")
        if cap["capacity_rps"] == common[-1]:
            evidence.append(f"{name} passed at the highest tested rate ({common[-1]:g} rps): "
                            "its capacity is at least that; higher rates were not tested")
    if not b_cap["passing_rates"] and not c_cap["passing_rates"]:
        evidence.append(NEITHER_PASSED)
        justified = False
    elif cb == 0 and cc == 0:
        evidence.append("capacity 0 for both: no deployment passed its lowest tested rate")
        justified = False
    elif cc > cb:
        evidence.append(f"{c_name} capacity {cc:g} rps > {b_name} {cb:g} rps")
        justified = True
    else:
        evidence.append(f"{c_name} capacity {cc:g} rps is not above {b_name} {cb:g} rps")
        justified = False
    return {"verdict": JUSTIFIED if justified else NOT_JUSTIFIED, "evidence": evidence,
            "capacity": {b_name: cb, c_name: cc}, "common_rates": common}


_COLUMNS = ("rate (rps)", "deployment", "attainment", "error rate", "TTFT p50 ms",
            "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "TPOT p99 ms", "goodput rps",
            "queue stable", "pass")


def render_table(baseline: Mapping[str, Any], candidate: Mapping[str, Any],
                 gates: Gates | None = None) -> str:
    """A Markdown table, one row per tested rate and deployment."""
    gates = gates or Gates()
    sweeps = [(str(d.get("name") or default), _by_rate(d.get("points", []), default))
              for d, default in ((baseline, "aggregated"), (candidate, "disaggregated"))]
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    for rate in sorted({r for _, by_rate in sweeps for r in by_rate}):
        for name, by_rate in sweeps:
            if rate not in by_rate:
                continue
            s = by_rate[rate]
            ok, _ = point_passes(dict(s), gates)
            stable = (s.get("queue") or {}).get("stable")
            cells = [f"{rate:g}", name, _fmt(s.get("slo_attainment"), 3),
                     _fmt(s.get("error_rate"), 3), _fmt(s.get("median_ttft_ms")),
                     _fmt(s.get("p99_ttft_ms")), _fmt(s.get("median_itl_ms")),
                     _fmt(s.get("p99_itl_ms")), _fmt(s.get("p99_tpot_ms")),
                     _fmt(s.get("request_goodput"), 2),
                     "n/a" if stable is None else ("yes" if stable else "no"),
                     "yes" if ok else "no"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
