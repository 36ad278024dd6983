"""Per-request results, SLO cutoffs and one rate point's summary.

Pure (stdlib and msgspec). ``client.run_point`` produces one
:class:`RequestResult` per trace request; :func:`summarize` turns one rate
point's results into the numbers ``vllm bench serve`` reports (same key names
where they overlap) plus ours: offered rate, error rate, joint SLO
attainment over a declared denominator, the generator's dispatch delay and
the queue trend; :func:`point_passes` applies the gates that decide whether
the point counts towards SLO-compliant capacity (``verdict.capacity``).

Conventions, as ``vllm bench serve``: latencies in ms; TTFT, TPOT, ITL and
E2EL lists come from successful requests only; TPOT = (E2E - TTFT) /
(output tokens - 1) for requests with at least 2 output tokens; ITL pools
every gap of every successful request; std is the population std;
percentiles interpolate linearly (numpy's default). Warm-up results are
dropped before anything is counted. An empty list gives ``None`` (JSON
null), never NaN.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import msgspec

DEFAULT_PERCENTILES = (50.0, 95.0, 99.0)
#: Below this many successful requests the TTFT trend is not judged.
MIN_TREND_SAMPLE = 6


class RequestResult(msgspec.Struct, kw_only=True):
    """What happened to one trace request (times in seconds, one time base:
    the rate point's start)."""

    index: int
    #: The trace's ``at_s``.
    scheduled_s: float
    #: When the request headers left (the generator's own lag is
    #: ``sent_s - scheduled_s``).
    sent_s: float
    prompt_tokens: int
    #: Tokens generated: the stream's ``usage.completion_tokens``, else the
    #: number of content chunks.
    output_tokens: int
    ok: bool
    #: Why it failed: ``"http 503: ..."``, ``"timeout"``, ``"connection: ..."``.
    error: str = ""
    ttft_s: float | None = None
    e2e_s: float | None = None
    #: Gaps between consecutive content chunks after the first.
    itl_s: list[float] = msgspec.field(default_factory=list)
    #: The proxy's ``pd_telemetry`` dict, opaque here (``breakdown``).
    telemetry: dict[str, Any] | None = None
    warmup: bool = False
    #: The generated text (the trace is greedy: a reader can compare
    #: deployments request by request).
    text: str = ""
    #: The generated token ids, when the server sends them (vLLM with
    #: ``--extra-body '{"return_token_ids": true}'``).
    token_ids: list[int] = msgspec.field(default_factory=list)


def tpot_s(r: RequestResult) -> float | None:
    """Time per output token after the first, or None (fewer than 2 tokens,
    or no TTFT/E2E)."""
    if r.output_tokens < 2 or r.ttft_s is None or r.e2e_s is None:
        return None
    return (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)


def percentile(xs: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation between
    closest ranks, as ``numpy.percentile``'s default; None when empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q!r}")
    if not xs:
        return None
    s = sorted(xs)
    h = (len(s) - 1) * q / 100
    lo = math.floor(h)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (h - lo) * (s[hi] - s[lo])


def percentile_key(q: float) -> str:
    """vLLM's spelling: 99 -> ``"99"``, 99.9 -> ``"99.9"``."""
    return str(int(q)) if int(q) == q else str(q)


_SLO_KEYS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "itl": "itl_ms", "e2el": "e2el_ms"}


@dataclass(frozen=True)
class SLO:
    """Latency cutoffs in ms; None: not required. A request passes jointly
    when it succeeded and meets every given cutoff (``<=``).

    ``itl_ms`` bounds each request's *maximum* gap. A request with fewer
    than 2 output tokens has no TPOT and no gap: it passes the TPOT and ITL
    cutoffs vacuously (so does one whose tokens all came in one chunk, for
    ITL); give ``e2el_ms`` or enough output tokens to constrain it.
    """

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    itl_ms: float | None = None
    e2el_ms: float | None = None

    def passes(self, r: RequestResult) -> bool:
        if not r.ok:
            return False
        if self.ttft_ms is not None and (r.ttft_s is None or r.ttft_s * 1000 > self.ttft_ms):
            return False
        if self.e2el_ms is not None and (r.e2e_s is None or r.e2e_s * 1000 > self.e2el_ms):
            return False
        tpot = tpot_s(r)
        if self.tpot_ms is not None and tpot is not None and tpot * 1000 > self.tpot_ms:
            return False
        return not (self.itl_ms is not None and r.itl_s and max(r.itl_s) * 1000 > self.itl_ms)

    def describe(self) -> str:
        parts = [f"{k} <= {v:g} ms" for k, f in _SLO_KEYS.items()
                 if (v := getattr(self, f)) is not None]
        return ", ".join(parts) or "no latency cutoff"


def parse_slo(text: str) -> SLO:
    """``"ttft:2000,tpot:50,itl:200"`` or space-separated (``vllm bench
    serve --goodput`` style); keys ttft, tpot, itl, e2el, values in ms."""
    values: dict[str, float] = {}
    for item in (p for p in re.split(r"[,\s]+", text.strip()) if p):
        key, sep, raw = item.partition(":")
        key = key.strip().lower()
        if key not in _SLO_KEYS:
            raise ValueError(f"SLO key {key!r} (in {item!r}) is unknown; "
                             f"accepted: {', '.join(_SLO_KEYS)}")
        if not sep:
            raise ValueError(f"SLO {key}: expected {key}:<ms>, got {item!r}")
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"SLO {key}: {raw!r} is not a number of ms") from None
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"SLO {key}: must be a finite number of ms > 0, got {raw!r}")
        if _SLO_KEYS[key] in values:
            raise ValueError(f"SLO {key}: given twice")
        values[_SLO_KEYS[key]] = value
    if not values:
        raise ValueError(f"SLO {text!r}: no cutoff given (e.g. ttft:2000,tpot:50)")
    return SLO(**values)


def _stats(name: str, xs: list[float], percentiles: Sequence[float]) -> dict[str, Any]:
    out: dict[str, Any] = {
        f"mean_{name}_ms": statistics.fmean(xs) if xs else None,
        f"median_{name}_ms": percentile(xs, 50),
        f"std_{name}_ms": statistics.pstdev(xs) if xs else None,
    }
    for q in percentiles:
        out[f"p{percentile_key(q)}_{name}_ms"] = percentile(xs, q)
    return out


def _per_s(count: float, duration_s: float) -> float | None:
    return count / duration_s if duration_s > 0 else None


def error_kind(error: str) -> str:
    """The part of an error before its detail: ``"http 503"``, ``"timeout"``."""
    return error.split(":", 1)[0].strip() or "unknown"


def summarize(results: Iterable[RequestResult], *, offered_rate: float, slo: SLO,
              duration_s: float, percentiles: Sequence[float] = DEFAULT_PERCENTILES,
              denominator: Literal["offered", "completed"] = "offered") -> dict[str, Any]:
    """One rate point, warm-ups excluded. ``slo_attainment`` = joint passes /
    ``denominator``: ``"offered"`` (every request offered after warm-up,
    errors and timeouts included; the default) or ``"completed"``
    (successful ones only). ``request_goodput`` = passes / ``duration_s``."""
    if denominator not in ("offered", "completed"):
        raise ValueError(f"denominator must be 'offered' or 'completed', got {denominator!r}")
    measured = [r for r in results if not r.warmup]
    done = [r for r in measured if r.ok]
    passes = sum(1 for r in done if slo.passes(r))
    offered, completed = len(measured), len(done)
    total_in = sum(r.prompt_tokens for r in done)
    total_out = sum(r.output_tokens for r in done)
    base = offered if denominator == "offered" else completed
    delays = [(r.sent_s - r.scheduled_s) * 1000 for r in measured]
    out: dict[str, Any] = {
        "offered_rate": offered_rate,
        "offered": offered,
        "completed": completed,
        "failed": offered - completed,
        "duration": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": _per_s(completed, duration_s),
        "request_goodput": _per_s(passes, duration_s),
        "output_throughput": _per_s(total_out, duration_s),
        "total_token_throughput": _per_s(total_in + total_out, duration_s),
        "error_rate": (offered - completed) / offered if offered else None,
        "errors_by_kind": dict(Counter(error_kind(r.error) for r in measured if not r.ok)),
        "slo": asdict(slo),
        "goodput_requests": passes,
        "slo_attainment": passes / base if base else None,
        "attainment_denominator": denominator,
        "dispatch_delay_p50_ms": percentile(delays, 50),
        "dispatch_delay_p99_ms": percentile(delays, 99),
        "dispatch_delay_max_ms": max(delays) if delays else None,
    }
    ttft = [r.ttft_s * 1000 for r in done if r.ttft_s is not None]
    tpot = [t * 1000 for r in done if (t := tpot_s(r)) is not None]
    itl = [gap * 1000 for r in done for gap in r.itl_s]
    e2el = [r.e2e_s * 1000 for r in done if r.e2e_s is not None]
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        out.update(_stats(name, xs, percentiles))
    out["queue"] = queue_trend(measured, offered_rate)
    return out


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Least-squares slope of ys against xs; None without spread in xs."""
    if len(xs) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def queue_trend(results: Iterable[RequestResult], offered_rate: float) -> dict[str, Any]:
    """Whether the queue stayed bounded over the measurement window.

    Over the successful post-warm-up requests ordered by ``sent_s``: (a) the
    least-squares slope of TTFT (ms) against send time (s); (b) the median
    TTFT of the last third against the first third (``growth_ratio`` =
    last / first); (c) completed requests per second over the window (first
    scheduled send to last completion) relative to ``offered_rate``,
    reported as ``throughput_ratio`` but not gated (the error-rate and
    attainment gates already count what did not finish).

    Gate: unstable iff any request timed out, or the last third's median TTFT
    exceeds max(2 x the first third's, the first third's + 500 ms) *and* the
    slope is positive. With fewer than ``MIN_TREND_SAMPLE`` (6) successful
    requests only timeouts decide, and ``why`` says the sample is too small.
    """
    measured = [r for r in results if not r.warmup]
    timeouts = sum(1 for r in measured if not r.ok and r.error == "timeout")
    done = sorted((r for r in measured if r.ok and r.ttft_s is not None),
                  key=lambda r: r.sent_s)
    xs = [r.sent_s for r in done]
    ys = [r.ttft_s * 1000 for r in done if r.ttft_s is not None]
    third = len(done) // 3
    first = percentile(ys[:third], 50) if third else None
    last = percentile(ys[-third:], 50) if third else None
    slope = _slope(xs, ys)
    ends = [r.sent_s + r.e2e_s for r in done if r.e2e_s is not None]
    window = max(ends) - min(r.scheduled_s for r in measured) if ends else 0.0
    completed_rps = len(done) / window if window > 0 else None
    ratio = (completed_rps / offered_rate
             if completed_rps is not None and math.isfinite(offered_rate) else None)
    out: dict[str, Any] = {
        "ttft_slope_ms_per_s": slope,
        "ttft_first_third_p50_ms": first,
        "ttft_last_third_p50_ms": last,
        "growth_ratio": last / first if first and last is not None else None,
        "completed_rps": completed_rps,
        "throughput_ratio": ratio,
        "timeouts": timeouts,
        "sample": len(done),
    }
    reasons: list[str] = []
    if timeouts:
        reasons.append(f"{timeouts} request(s) timed out")
    if len(done) < MIN_TREND_SAMPLE:
        stable = not timeouts
        reasons.append(f"sample too small to judge the TTFT trend ({len(done)} successful "
                       f"< {MIN_TREND_SAMPLE}); decided by timeouts only")
    else:
        assert first is not None and last is not None
        limit = max(2 * first, first + 500)
        growing = last > limit and slope is not None and slope > 0
        stable = not timeouts and not growing
        verb = "grows" if growing else "bounded"
        reasons.append(f"TTFT {verb}: last-third median {last:.1f} ms vs limit {limit:.1f} ms "
                       f"(first third {first:.1f} ms), slope {slope or 0.0:+.2f} ms/s")
    if ratio is not None:
        reasons.append(f"completed {completed_rps:.3g} rps = {ratio:.2f} x offered")
    out["stable"] = stable
    out["why"] = ("stable: " if stable else "unstable: ") + "; ".join(reasons)
    return out


@dataclass(frozen=True)
class Gates:
    """What one rate point must meet to count towards capacity."""

    attainment_min: float = 0.95
    error_rate_max: float = 0.01
    require_stable_queue: bool = True


def _fmt_against(value: float, bound: float) -> str:
    """``value`` with 2 decimals, more when 2 would print it equal to ``bound``."""
    for nd in range(2, 7):
        if f"{value:.{nd}f}" != f"{bound:.{nd}f}":
            return f"{value:.{nd}f}"
    return repr(value)


def point_passes(summary: dict[str, Any], gates: Gates) -> tuple[bool, list[str]]:
    """Whether a summary meets the gates, and the reasons when it does not."""
    reasons: list[str] = []
    attainment = summary.get("slo_attainment")
    if attainment is None:
        reasons.append("no request measured")
    elif attainment < gates.attainment_min:
        reasons.append(f"attainment {_fmt_against(attainment, gates.attainment_min)} "
                       f"< {gates.attainment_min:.2f}")
    error_rate = summary.get("error_rate")
    if error_rate is not None and error_rate > gates.error_rate_max:
        reasons.append(f"error rate {_fmt_against(error_rate, gates.error_rate_max)} "
                       f"> {gates.error_rate_max:.2f}")
    queue = summary.get("queue") or {}
    if gates.require_stable_queue and not queue.get("stable", False):
        reasons.append(f"queue {queue.get('why', 'not judged')}")
    return not reasons, reasons
