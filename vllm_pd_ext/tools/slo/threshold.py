"""The proxy's ``--local-prefill-threshold`` from measurements: the break-even
uncached prompt length.

Role: pure arithmetic over ``vllm-pd-bench compare`` results (its
``threshold`` subcommand, and docs/slo.md). The argument is the seed's
short-prompt case. A prompt prefilled locally on D stalls every stream D is
decoding for about the prefill's duration. Sent to P instead, it costs only
its own request a handoff. So a local prefill is harmless while its stall
fits the inter-token budget: the SLO's ITL cutoff minus D's own decode step.
Above that length, every local prefill breaks the ITL SLO of the streams it
interrupts, and disaggregation repairs that.

- **Prefill time against length.** The disaggregated deployment's P-leg
  medians (``breakdown.prefill_ms`` p50 at the lowest offered rate, where P
  queues least), one point per prompt length measured, joined by straight
  lines.
- **Decode step.** D's median ITL at that rate (the median over the runs).
- **Break-even.** The length where that prefill time reaches
  ``itl_cutoff - decode_step``, rounded down to a whole 16 tokens.

The verdicts of the same runs are the check, and they take precedence over
the rule. Under load, prefills that arrive together share one step, so the
stall is longer than one prefill's. If a run found disaggregation justified
at a length below the rule's break-even, the threshold is capped at that
length.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_pd_ext.tools.slo.verdict import JUSTIFIED

ROUND_TO = 16


def _points(samples: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Samples sorted by length, repeated lengths averaged."""
    by_x: dict[float, list[float]] = {}
    for x, y in samples:
        by_x.setdefault(float(x), []).append(float(y))
    if len(by_x) < 2:
        raise ValueError("the break-even needs runs at two or more prompt lengths")
    return [(x, sum(ys) / len(ys)) for x, ys in sorted(by_x.items())]


def break_even_tokens(prefill: Sequence[tuple[float, float]], itl_cutoff_ms: float,
                      decode_step_ms: float) -> dict[str, Any]:
    """The break-even from ``(prompt tokens, prefill ms)`` samples.

    Prefill time is interpolated linearly between neighbouring measured
    lengths (attention makes it superlinear, so one line through all of them
    would misplace the crossing), and extended beyond the shortest or longest
    length by the slope of the end segment.
    """
    if not (itl_cutoff_ms > 0 and math.isfinite(itl_cutoff_ms)):
        raise ValueError(f"the ITL cutoff must be a number > 0 ms, got {itl_cutoff_ms!r}")
    points = _points(prefill)
    budget = itl_cutoff_ms - decode_step_ms
    segment = len(points) - 2
    for i in range(len(points) - 1):
        if points[i + 1][1] >= budget:
            segment = i
            break
    (x0, y0), (x1, y1) = points[segment], points[segment + 1]
    slope = (y1 - y0) / (x1 - x0)
    if slope <= 0:
        raise ValueError(f"prefill time does not grow with prompt length between {x0:g} and "
                         f"{x1:g} tokens ({slope:.4f} ms per token): the runs are too noisy "
                         "or too short")
    raw = max(0.0, x0 + (budget - y0) / slope)
    return {"ms_per_token": slope, "segment": [x0, x1], "itl_cutoff_ms": itl_cutoff_ms,
            "decode_step_ms": decode_step_ms, "stall_budget_ms": budget,
            "break_even_tokens": raw, "threshold_tokens": int(raw // ROUND_TO * ROUND_TO)}


def _lowest_point(dep: Mapping[str, Any]) -> Mapping[str, Any]:
    points = dep.get("points") or []
    if not points:
        raise ValueError(f"{dep.get('name', 'deployment')}: no rate point in the result")
    return min(points, key=lambda p: float(p["summary"]["offered_rate"]))


def from_results(results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The break-even from ``compare`` results (one per prompt length, same
    SLO), with each run's verdict beside it."""
    samples: list[tuple[float, float]] = []
    steps: list[float] = []
    cutoffs: set[float] = set()
    runs: list[dict[str, Any]] = []
    for result in results:
        config = result.get("config") or {}
        dis = (result.get("deployments") or {}).get("disaggregated")
        if dis is None:
            raise ValueError("a result without the disaggregated deployment (run compare)")
        point = _lowest_point(dis)
        breakdown = point.get("breakdown") or {}
        prefill = (breakdown.get("prefill_ms") or {}).get("p50")
        step = point["summary"].get("median_itl_ms")
        itl = (point["summary"].get("slo") or {}).get("itl_ms")
        if prefill is None or step is None or itl is None:
            raise ValueError("a result without P-leg telemetry, ITL or an ITL cutoff "
                             "(run compare with --slo itl:...)")
        if not isinstance(config.get("prompt_tokens"), int | float):
            raise ValueError("a result without its --prompt-tokens (run compare)")
        tokens = float(config["prompt_tokens"])
        samples.append((tokens, float(prefill)))
        steps.append(float(step))
        cutoffs.add(float(itl))
        runs.append({"prompt_tokens": tokens, "prefill_p50_ms": prefill,
                     "decode_step_ms": step,
                     "verdict": (result.get("verdict") or {}).get("verdict")})
    if len(cutoffs) != 1:
        raise ValueError(f"the runs have different ITL cutoffs {sorted(cutoffs)}: use one SLO")
    out = break_even_tokens(samples, cutoffs.pop(), statistics.median(steps))
    out["runs"] = sorted(runs, key=lambda r: r["prompt_tokens"])
    # Under load prefills coalesce into one step (two arrivals, one longer
    # stall), which the one-prefill stall rule does not see: where a run
    # measured that disaggregation pays at a shorter length, that length wins.
    justified = [r["prompt_tokens"] for r in runs if r["verdict"] == JUSTIFIED]
    bound = min(justified) if justified else None
    out["justified_from_tokens"] = bound
    if bound is not None and bound < out["break_even_tokens"]:
        out["threshold_tokens"] = int(bound // ROUND_TO * ROUND_TO)
        out["capped_by_verdict"] = True
    else:
        out["capped_by_verdict"] = False
    return out
