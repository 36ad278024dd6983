"""TTFT of a disaggregated request, split into where the time went.

Pure. The proxy, with its telemetry flag on, ends the stream with a chunk
carrying ``pd_telemetry`` (kept as ``RequestResult.telemetry``), in ms:

    {"proxy": {"mode": "pull"|"push"|"local", "prefill_sent_ms", "prefill_done_ms",
               "decode_sent_ms", "decode_first_byte_ms"},   # from the proxy's receipt
     "transfer": {"kv_ready_ms", ...}}                       # D: request arrival -> KV loaded

The split (all ms):

    front       = prefill_sent                        proxy's own work before P's leg
    prefill     = prefill_done - prefill_sent         P's queue and compute
    handoff     = max(0, decode_sent + api + kv_ready - prefill_done)
                                                      P answered -> D's KV ready; ``api``
                                                      (``transfer.api_ms``, 0 in records
                                                      without it) is D's API server and
                                                      input queue; in push mode D's leg
                                                      leaves with P's, so this is what
                                                      remains after P answered
    first_step  = max(0, ttft - prefill_done - handoff)
                                                      D's first step and the way back

The client's TTFT and the proxy's times have different origins (the client
starts earlier by the client-to-proxy hop), and clocks have finite
granularity, so ``first_step`` can come out slightly negative: it is clamped
at 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from vllm_pd_ext.tools.slo.metrics import RequestResult, percentile

COMPONENTS = ("front_ms", "prefill_ms", "handoff_ms", "first_step_ms")


def _number(section: Mapping[str, Any], key: str) -> float | None:
    value = section.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _handoff(done: float, decode_sent: float, transfer: Mapping[str, Any],
             kv_ready: float) -> float:
    """P's answer to D's KV ready: the proxy's part (P's answer to D's leg
    sent), D's API server and input queue (``api_ms``; records made before
    it existed lack it and count 0), then D's scheduler (``kv_ready``)."""
    # D's leg may leave before P answers (push without token #1 from P):
    # then what remains after P's answer counts.
    return max(0.0, decode_sent + (_number(transfer, "api_ms") or 0.0) + kv_ready - done)


def ttft_breakdown(ttft_ms: float, telemetry: Mapping[str, Any] | None) -> dict[str, float] | None:
    """The split above; None unless the mode is pull or push and the
    needed keys are numbers."""
    if not isinstance(telemetry, Mapping):
        return None
    proxy, transfer = telemetry.get("proxy"), telemetry.get("transfer")
    if not isinstance(proxy, Mapping) or not isinstance(transfer, Mapping):
        return None
    if proxy.get("mode") not in ("pull", "push"):
        return None
    sent = _number(proxy, "prefill_sent_ms")
    done = _number(proxy, "prefill_done_ms")
    decode_sent = _number(proxy, "decode_sent_ms")
    kv_ready = _number(transfer, "kv_ready_ms")
    if sent is None or done is None or decode_sent is None or kv_ready is None:
        return None
    handoff = _handoff(done, decode_sent, transfer, kv_ready)
    return {"front_ms": sent, "prefill_ms": done - sent, "handoff_ms": handoff,
            "first_step_ms": max(0.0, ttft_ms - done - handoff)}


def summarize_breakdowns(results: Iterable[RequestResult]) -> dict[str, Any]:
    """``{"count": n, "<component>_ms": {"p50": ..., "p99": ...}, ...}`` over
    the successful, non-warm-up results that have a breakdown (None values
    when there is none)."""
    rows = [b for r in results
            if not r.warmup and r.ok and r.ttft_s is not None
            and (b := ttft_breakdown(r.ttft_s * 1000, r.telemetry)) is not None]
    out: dict[str, Any] = {"count": len(rows)}
    for name in COMPONENTS:
        xs = [row[name] for row in rows]
        out[name] = {"p50": percentile(xs, 50), "p99": percentile(xs, 99)}
    return out


HANDOFF = ("first_gap_ms", "decode_step_ms", "transfer_ms", "gap_ratio", "handoff_ms",
           "orchestration_ms", "to_d_ms", "pin_ms", "step_wait_ms",
           "sched_ms", "worker_extra_ms", "crossings_ms", "after_p_ms")


def handoff_of(result: RequestResult) -> dict[str, float] | None:
    """One disaggregated request's handoff, as the client and the telemetry
    saw it (None: no telemetry with a transfer record, or fewer than 3
    tokens):

    - ``first_gap_ms``: token #1 to token #2 at the client. With token #1
      from P (``pd_telemetry.proxy.first_token`` ``seeded``) the handoff
      happens inside this gap; otherwise inside TTFT;
    - ``decode_step_ms``: the request's median gap after that (one decode step);
    - ``transfer_ms``: the bytes' own time: pull's READ (``read_ms``); push's
      wait for P's WRITE (``write_wait_ms``: P's post, the WRITE and its
      notification, so push's orchestration below is a lower bound); 0 for
      push's concurrent dispatch (``seeded:concurrent`` without ``read_ms``:
      the wait spans P's prefill), so its ratio and orchestration are upper
      bounds; a concurrent pull's READ is its own (``read_ms``);
    - ``gap_ratio``: ``first_gap / (transfer + decode_step)`` (1: nothing
      beyond the bytes and the step that needs them);
    - ``handoff_ms``: P's answer to D's KV ready (proxy and D clocks);
    - ``orchestration_ms``: ``handoff - transfer``, what the handoff costs
      beyond the bytes, split into
      ``to_d_ms`` (``handoff - kv_ready``: P's answer to D's scheduler
      seeing the request: the proxy, HTTP, D's API server and its engine
      core's input queue; ``api_ms`` of the record is the last two, and
      records without it leave them out of the handoff), ``pin_ms``
      (pull: the pin round trip, beside the READ when the record says
      ``pin_with_read``; push: the registration round trip) and
      ``step_wait_ms`` (the rest of ``kv_ready``: waiting for engine steps
      to start the load and to report it, and the handshake when not
      cached). When the record has ``sched_ms`` and
      ``worker_ms`` (pull), the step waits split further into
      ``sched_ms`` (the rest of D's scheduler pass after the arrival),
      ``worker_extra_ms`` (in D's worker beyond the pin and READ: handshake,
      posting, and waiting for a step to report) and ``crossings_ms`` (the
      remainder: the two crossings of vLLM's step queues, scheduler to
      workers and back, with the work of the steps around them);
    - ``after_p_ms`` (concurrent pull, the record's ``p_wait_ms``): P's
      answer reaching D to D's KV ready, on D's clock alone: what the
      handoff cost D once P was done (its ``step_wait_ms`` is this less
      the pin and READ).
    """
    tele = result.telemetry
    if not isinstance(tele, Mapping) or len(result.itl_s) < 2:
        return None
    proxy, transfer = tele.get("proxy"), tele.get("transfer")
    if not isinstance(proxy, Mapping) or not isinstance(transfer, Mapping):
        return None
    done = _number(proxy, "prefill_done_ms")
    sent = _number(proxy, "decode_sent_ms")
    ready = _number(transfer, "kv_ready_ms")
    moved = _number(transfer, "read_ms")
    if moved is None:
        moved = _number(transfer, "write_wait_ms")
    concurrent = proxy.get("first_token") == "seeded:concurrent"
    if concurrent and moved is not None and _number(transfer, "read_ms") is None:
        # D's leg went out with P's: its wait for the WRITE spans P's
        # prefill, not the bytes. Counted as 0, so the gap ratio and the
        # orchestration are upper bounds (the WRITE itself is P's
        # ``kv_write_seconds``, about a millisecond at 300 tokens).
        moved = 0.0
    if done is None or sent is None or ready is None or moved is None:
        return None
    rest = sorted(result.itl_s[1:])
    step = rest[len(rest) // 2] * 1000
    gap = result.itl_s[0] * 1000
    handoff = _handoff(done, sent, transfer, ready)
    pin = _number(transfer, "pin_ms")
    if pin is None:
        pin = _number(transfer, "register_ms") or 0.0
    # The pin beside the READ (``pin_with_read``): the load waited for the
    # slower of the two; before, for both in turn.
    waited = max(moved, pin) if transfer.get("pin_with_read") is True else moved + pin
    out = {"first_gap_ms": gap, "decode_step_ms": step, "transfer_ms": moved,
           "gap_ratio": gap / (moved + step) if moved + step > 0 else 0.0,
           "handoff_ms": handoff, "orchestration_ms": max(0.0, handoff - moved),
           "to_d_ms": max(0.0, handoff - ready), "pin_ms": pin}
    p_wait = _number(transfer, "p_wait_ms")
    if not concurrent:  # (concurrent: ``kv_ready`` spans P's prefill)
        out["step_wait_ms"] = max(0.0, ready - waited)
    elif p_wait is not None:  # concurrent pull: from P's answer on
        out["after_p_ms"] = max(0.0, ready - p_wait)
        out["step_wait_ms"] = max(0.0, ready - p_wait - waited)
    sched, worker = _number(transfer, "sched_ms"), _number(transfer, "worker_ms")
    if sched is not None and worker is not None:
        out.update(sched_ms=sched, worker_extra_ms=max(0.0, worker - waited),
                   crossings_ms=max(0.0, ready - sched - worker))
    return out


def summarize_handoffs(results: Iterable[RequestResult]) -> dict[str, Any]:
    """``{"count": n, "seeded": k, "<name>": {"p50": ..., "p99": ...}, ...}``
    over the successful, non-warm-up results that have a handoff;
    ``seeded``: how many took token #1 from P (either push flow)."""
    rows: list[dict[str, float]] = []
    seeded = 0
    for r in results:
        if r.warmup or not r.ok:
            continue
        one = handoff_of(r)
        if one is None:
            continue
        rows.append(one)
        proxy = (r.telemetry or {}).get("proxy") or {}
        # ``seeded`` or ``seeded:concurrent`` (push's D leg beside P's).
        seeded += str(proxy.get("first_token", "")).split(":")[0] == "seeded"
    out: dict[str, Any] = {"count": len(rows), "seeded": seeded}
    for name in HANDOFF:
        xs = [row[name] for row in rows if name in row]
        out[name] = {"p50": percentile(xs, 50), "p99": percentile(xs, 99)}
    return out
