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

- **Prefill time against length.** A least-squares line through the
  disaggregated deployment's P-leg medians (``breakdown.prefill_ms`` p50 at
  the lowest offered rate, where P is not queueing), one point per prompt
  length measured.
- **Decode step.** D's median ITL at that rate.
- **Break-even.** The length where ``intercept + slope * n`` reaches
  ``itl_cutoff - decode_step``, rounded down to a whole 16 tokens.

The verdicts of the same runs are the check: a length below the break-even
should not justify disaggregation, and one above it should.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

ROUND_TO = 16


def fit_line(samples: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through ``(x, y)``;
    needs two distinct ``x``."""
    xs = [float(x) for x, _ in samples]
    ys = [float(y) for _, y in samples]
    if len(set(xs)) < 2:
        raise ValueError("the break-even needs runs at two or more prompt lengths")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = (sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
             / sum((x - mx) ** 2 for x in xs))
    return my - slope * mx, slope


def break_even_tokens(prefill: Sequence[tuple[float, float]], itl_cutoff_ms: float,
                      decode_step_ms: float) -> dict[str, Any]:
    """The break-even from ``(prompt tokens, prefill ms)`` samples."""
    if not (itl_cutoff_ms > 0 and math.isfinite(itl_cutoff_ms)):
        raise ValueError(f"the ITL cutoff must be a number > 0 ms, got {itl_cutoff_ms!r}")
    intercept, slope = fit_line(prefill)
    if slope <= 0:
        raise ValueError(f"prefill time does not grow with prompt length ({slope:.4f} ms per "
                         "token): the runs are too noisy or too short to fit")
    budget = itl_cutoff_ms - decode_step_ms
    raw = max(0.0, (budget - intercept) / slope)
    return {"intercept_ms": intercept, "ms_per_token": slope, "itl_cutoff_ms": itl_cutoff_ms,
            "decode_step_ms": decode_step_ms, "stall_budget_ms": budget,
            "break_even_tokens": raw,
            "threshold_tokens": int(raw // ROUND_TO * ROUND_TO)}


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
        tokens = float(config["prompt_tokens"])
        samples.append((tokens, float(prefill)))
        steps.append(float(step))
        cutoffs.add(float(itl))
        runs.append({"prompt_tokens": tokens, "prefill_p50_ms": prefill,
                     "decode_step_ms": step,
                     "verdict": (result.get("verdict") or {}).get("verdict")})
    if len(cutoffs) != 1:
        raise ValueError(f"the runs have different ITL cutoffs {sorted(cutoffs)}: use one SLO")
    steps.sort()
    out = break_even_tokens(samples, cutoffs.pop(), steps[len(steps) // 2])
    out["runs"] = sorted(runs, key=lambda r: r["prompt_tokens"])
    return out
