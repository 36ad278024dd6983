"""Figures for a finished comparison (optional: needs matplotlib).

``plot_all`` draws, with matplotlib's Agg canvas (no display, no pyplot
state):

* ``attainment.png``: SLO attainment against offered rate, both
  deployments, with the attainment gate as a line;
* ``ttft_cdf.png`` and ``itl_cdf.png``: the CDFs of TTFT and of the pooled
  inter-token gaps of both deployments at one rate, the highest rate both
  sweeps tested with successful requests (the most loaded like-for-like
  point);
* ``ttft_breakdown.png``: stacked bars of the median front / prefill /
  handoff / first-step components per rate for the candidate
  (disaggregated) deployment, when its results carry telemetry.

A deployment is ``{"name", "points": [{"summary": {...}, "results": [...]}],
"gates"?}`` with results as plain dicts. Without matplotlib it returns ``[]``
and the caller says how to install it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from vllm_pd_ext.tools.slo.breakdown import COMPONENTS, summarize_breakdowns
from vllm_pd_ext.tools.slo.metrics import Gates, RequestResult
from vllm_pd_ext.tools.slo.verdict import point_summary


def _results(point: Mapping[str, Any]) -> list[RequestResult]:
    return [r if isinstance(r, RequestResult) else msgspec.convert(r, RequestResult)
            for r in point.get("results") or []]


def _points(dep: Mapping[str, Any]) -> dict[float, Mapping[str, Any]]:
    return {float(point_summary(p)["offered_rate"]): p for p in dep.get("points") or []}


def _ok(point: Mapping[str, Any]) -> list[RequestResult]:
    return [r for r in _results(point) if r.ok and not r.warmup]


def _cdf(ax: Any, values: Sequence[float], label: str) -> None:
    xs = sorted(values)
    ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)


def plot_all(out_dir: str | Path, baseline: Mapping[str, Any],
             candidate: Mapping[str, Any]) -> list[Path]:
    """Write the figures into ``out_dir``; the paths written (``[]`` when
    matplotlib is not installed)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    deps = [(str(d.get("name") or default), _points(d))
            for d, default in ((baseline, "aggregated"), (candidate, "disaggregated"))]

    def new(title: str, xlabel: str, ylabel: str) -> tuple[Any, Any]:
        fig = Figure(figsize=(7, 4.5), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        return fig, ax

    def save(fig: Any, name: str) -> None:
        path = out / name
        fig.savefig(path, dpi=120)
        written.append(path)

    gates = Gates(**(baseline.get("gates") or {}))
    fig, ax = new("SLO attainment vs offered rate", "offered rate (req/s)", "attainment")
    for name, points in deps:
        rates = sorted(r for r in points if math.isfinite(r))
        att = [point_summary(points[r]).get("slo_attainment") for r in rates]
        ax.plot(rates, [math.nan if a is None else a for a in att], marker="o", label=name)
    ax.axhline(gates.attainment_min, color="gray", linestyle="--",
               label=f"gate {gates.attainment_min:g}")
    ax.set_ylim(0, 1.05)
    ax.legend()
    save(fig, "attainment.png")

    common = [r for r in sorted(set(deps[0][1]) & set(deps[1][1]), reverse=True)
              if all(_ok(points[r]) for _, points in deps)]
    if common:
        rate = common[0]
        for metric, fname in (("TTFT", "ttft_cdf.png"), ("ITL", "itl_cdf.png")):
            fig, ax = new(f"{metric} CDF at {rate:g} req/s", f"{metric} (ms)", "fraction")
            for name, points in deps:
                ok = _ok(points[rate])
                values = ([r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
                          if metric == "TTFT" else [g * 1000 for r in ok for g in r.itl_s])
                if values:
                    _cdf(ax, values, name)
            ax.legend()
            save(fig, fname)

    name, points = deps[1]
    rows = [(rate, summarize_breakdowns(_results(points[rate]))) for rate in sorted(points)]
    rows = [(rate, b) for rate, b in rows if b["count"]]
    if rows:
        fig, ax = new(f"TTFT breakdown (medians), {name}", "offered rate (req/s)", "ms")
        labels = [f"{rate:g}" for rate, _ in rows]
        bottom = [0.0] * len(rows)
        for comp in COMPONENTS:
            heights = [b[comp]["p50"] or 0.0 for _, b in rows]
            ax.bar(labels, heights, bottom=bottom, label=comp.removesuffix("_ms"))
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        ax.legend()
        save(fig, "ttft_breakdown.png")
    return written
