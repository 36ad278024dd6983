"""slo/breakdown.py: the TTFT split from the proxy's pd_telemetry."""

from __future__ import annotations

import pytest

from vllm_pd_ext.tools.slo.breakdown import (
    handoff_of,
    summarize_breakdowns,
    summarize_handoffs,
    ttft_breakdown,
)
from vllm_pd_ext.tools.slo.metrics import RequestResult


def telemetry(mode: str = "pull", *, sent: float = 0.4, done: float = 35.2,
              decode_sent: float = 35.6, kv_ready: float = 9.1) -> dict:
    return {"proxy": {"mode": mode, "prefill_sent_ms": sent, "prefill_done_ms": done,
                      "decode_sent_ms": decode_sent, "decode_first_byte_ms": 52.0},
            "transfer": {"kv_ready_ms": kv_ready, "bytes": 123}}


def test_pull_split_by_hand():
    b = ttft_breakdown(60.0, telemetry())
    assert b == pytest.approx({"front_ms": 0.4, "prefill_ms": 34.8,
                               "handoff_ms": 9.5,  # 35.6 + 9.1 - 35.2
                               "first_step_ms": 15.3})  # 60 - 35.2 - 9.5


def test_d_api_server_time_counts_in_the_handoff_and_to_d():
    """``api_ms`` (D's API server and input queue) lies between the proxy
    sending D's leg and D's scheduler seeing it: the handoff holds it."""
    tele = telemetry()
    tele["transfer"].update(api_ms=2.5, read_ms=2.0)
    b = ttft_breakdown(60.0, tele)
    assert b is not None and b["handoff_ms"] == pytest.approx(12.0)  # 35.6 + 2.5 + 9.1 - 35.2
    assert b["first_step_ms"] == pytest.approx(12.8)
    h = handoff_of(_streamed(tele))
    assert h is not None
    assert h["to_d_ms"] == pytest.approx(2.9)  # 0.4 in the proxy + 2.5 in D's API server
    assert h["orchestration_ms"] == pytest.approx(10.0)  # 12.0 minus the 2.0 READ


def test_push_handoff_is_what_remains_after_p_answered():
    # D's leg left with P's at 0.5 ms; its KV was ready at 0.5 + 40 = 40.5 ms: 5.3 ms after P
    b = ttft_breakdown(50.0, telemetry("push", decode_sent=0.5, kv_ready=40.0))
    assert b == pytest.approx({"front_ms": 0.4, "prefill_ms": 34.8, "handoff_ms": 5.3,
                               "first_step_ms": 9.5})
    # KV ready before P answered: no handoff left
    b = ttft_breakdown(50.0, telemetry("push", decode_sent=0.5, kv_ready=20.0))
    assert b is not None and b["handoff_ms"] == 0.0
    assert b["first_step_ms"] == pytest.approx(14.8)


def test_first_step_clamped_at_zero():
    b = ttft_breakdown(40.0, telemetry())  # 40 - 35.2 - 9.5 < 0
    assert b is not None and b["first_step_ms"] == 0.0


@pytest.mark.parametrize("tele", [
    None, {}, telemetry("local"), {"proxy": telemetry()["proxy"]},
    {"proxy": {**telemetry()["proxy"], "prefill_done_ms": None},
     "transfer": {"kv_ready_ms": 1.0}},
    {"proxy": telemetry()["proxy"], "transfer": {"kv_ready_ms": True}},
    {"proxy": "pull", "transfer": {}},
])
def test_none_unless_pull_or_push_with_every_key(tele):
    assert ttft_breakdown(60.0, tele) is None


def _result(i: int, ttft_ms: float, tele: dict | None, *, ok: bool = True,
            warmup: bool = False) -> RequestResult:
    return RequestResult(index=i, scheduled_s=0.0, sent_s=0.0, prompt_tokens=1,
                         output_tokens=2, ok=ok, ttft_s=ttft_ms / 1000, e2e_s=1.0,
                         telemetry=tele, warmup=warmup)


def test_summarize_breakdowns_medians_p99_and_exclusions():
    results = [_result(i, 50.0 + 10 * i, telemetry(done=35.2)) for i in range(5)]
    results += [_result(10, 5000.0, telemetry(), warmup=True),
                _result(11, 5000.0, telemetry(), ok=False),
                _result(12, 70.0, None), _result(13, 70.0, telemetry("local"))]
    s = summarize_breakdowns(results)
    assert s["count"] == 5
    # first steps: 50,60,70,80,90 - 35.2 - 9.5 = 5.3, 15.3, 25.3, 35.3, 45.3
    assert s["first_step_ms"]["p50"] == pytest.approx(25.3)
    assert s["first_step_ms"]["p99"] == pytest.approx(35.3 + 0.96 * 10)
    assert s["prefill_ms"] == pytest.approx({"p50": 34.8, "p99": 34.8})
    assert s["handoff_ms"]["p50"] == pytest.approx(9.5)
    assert s["front_ms"]["p50"] == pytest.approx(0.4)
    empty = summarize_breakdowns([])
    assert empty == {"count": 0, "front_ms": {"p50": None, "p99": None},
                     "prefill_ms": {"p50": None, "p99": None},
                     "handoff_ms": {"p50": None, "p99": None},
                     "first_step_ms": {"p50": None, "p99": None}}


def _streamed(tele, itl=(0.012, 0.003, 0.004, 0.005), ok=True, warmup=False):
    return RequestResult(index=0, scheduled_s=0, sent_s=0, prompt_tokens=300, output_tokens=5,
                         ok=ok, ttft_s=0.036, e2e_s=0.06, itl_s=list(itl), telemetry=tele,
                         warmup=warmup)


def test_handoff_of_a_seeded_pull_request_by_hand():
    tele = telemetry()
    tele["proxy"]["first_token"] = "seeded"
    tele["transfer"]["read_ms"] = 2.0
    h = handoff_of(_streamed(tele))
    assert h == pytest.approx({
        "first_gap_ms": 12.0, "decode_step_ms": 4.0,  # the median of 3, 4, 5 ms
        "transfer_ms": 2.0, "gap_ratio": 2.0,  # 12 / (2 + 4)
        "handoff_ms": 9.5, "orchestration_ms": 7.5,  # 35.6 + 9.1 - 35.2; minus the READ
        "to_d_ms": 0.4, "pin_ms": 0.0, "step_wait_ms": 7.1})  # 9.5 - 9.1; 9.1 - 2 - 0


@pytest.mark.parametrize("beside", [False, True], ids=["pin_then_read", "pin_with_read"])
def test_step_wait_subtracts_the_pin_and_read_as_they_ran(beside):
    tele = telemetry()
    tele["transfer"].update(read_ms=2.0, pin_ms=3.0)
    if beside:
        tele["transfer"]["pin_with_read"] = True
    h = handoff_of(_streamed(tele))
    assert h is not None
    # kv_ready 9.1: minus 2 + 3 in turn, or minus the slower (3) side by side.
    assert h["step_wait_ms"] == pytest.approx(6.1 if beside else 4.1)
    assert h["orchestration_ms"] == pytest.approx(7.5)  # handoff minus the READ either way


def test_step_waits_split_into_scheduler_worker_and_crossings():
    tele = telemetry()
    # kv_ready 9.1 = 0.6 in the scheduler pass + 5.5 in the worker + 3.0
    # crossing the step queues; the worker's 5.5 held the 3.0 pin beside
    # the 2.0 READ, so 2.5 of it was the worker's own.
    tele["transfer"].update(read_ms=2.0, pin_ms=3.0, pin_with_read=True, sched_ms=0.6,
                            worker_ms=5.5)
    h = handoff_of(_streamed(tele))
    assert h is not None
    assert h["sched_ms"] == pytest.approx(0.6)
    assert h["worker_extra_ms"] == pytest.approx(2.5)
    assert h["crossings_ms"] == pytest.approx(3.0)
    # The three add up to the step waits.
    assert h["sched_ms"] + h["worker_extra_ms"] + h["crossings_ms"] == pytest.approx(
        h["step_wait_ms"])
    # Summaries skip the split where a record has none (push, older runs).
    push = telemetry("push", decode_sent=36.0, kv_ready=3.0)
    push["transfer"]["write_wait_ms"] = 2.5
    s = summarize_handoffs([_streamed(tele), _streamed(push)])
    assert s["count"] == 2 and s["crossings_ms"]["p50"] == pytest.approx(3.0)
    assert s["to_d_ms"]["p50"] is not None


def test_push_handoff_takes_the_write_wait_as_the_bytes_time():
    tele = telemetry("push", decode_sent=36.0, kv_ready=3.0)
    tele["transfer"]["write_wait_ms"] = 2.5
    h = handoff_of(_streamed(tele))
    assert h is not None and h["transfer_ms"] == 2.5
    assert h["handoff_ms"] == pytest.approx(3.8) and h["orchestration_ms"] == pytest.approx(1.3)


def test_no_handoff_without_a_transfer_time_or_two_gaps():
    assert handoff_of(_streamed(telemetry())) is None  # neither read_ms nor write_wait_ms
    tele = telemetry()
    tele["transfer"]["read_ms"] = 1.0
    assert handoff_of(_streamed(tele, itl=(0.01,))) is None
    assert handoff_of(_streamed(None)) is None


def test_summarize_handoffs_counts_the_seeded_and_skips_failures():
    seeded = telemetry()
    seeded["proxy"]["first_token"] = "seeded"
    seeded["transfer"]["read_ms"] = 1.0
    plain = telemetry()
    plain["transfer"]["read_ms"] = 3.0
    concurrent = telemetry("push")
    concurrent["proxy"]["first_token"] = "seeded:concurrent"  # push, D beside P
    concurrent["transfer"]["write_wait_ms"] = 2.0
    fallback = telemetry()
    fallback["proxy"]["first_token"] = "fallback:stop_strings"
    fallback["transfer"]["read_ms"] = 2.0
    out = summarize_handoffs([_streamed(seeded), _streamed(plain), _streamed(seeded, ok=False),
                              _streamed(seeded, warmup=True), _streamed(concurrent),
                              _streamed(fallback)])
    assert out["count"] == 4 and out["seeded"] == 2
    # 1, 3, 2 and the concurrent one's 0 (its wait for the WRITE spans P's
    # prefill: counted as no transfer, so its ratios are upper bounds).
    assert out["transfer_ms"]["p50"] == pytest.approx(1.5)
    one = handoff_of(_streamed(concurrent))
    assert one is not None and one["transfer_ms"] == 0.0
    assert one["orchestration_ms"] == pytest.approx(one["handoff_ms"])


def test_a_concurrent_pull_counts_its_read_and_what_followed_p_answer():
    """D's leg left with P's (``seeded:concurrent``) but D READs P's blocks
    once P's answer came: the READ is the bytes' time (not 0 as for
    push's WRITE wait), and ``p_wait_ms`` splits off what D did after P
    was done."""
    tele = telemetry(decode_sent=0.5, kv_ready=40.0)  # arrived with P's leg
    tele["proxy"]["first_token"] = "seeded:concurrent"
    tele["transfer"].update(read_ms=1.5, pin_ms=1.0, pin_with_read=True, p_wait_ms=36.0)
    h = handoff_of(_streamed(tele))
    assert h is not None
    assert h["transfer_ms"] == 1.5
    assert h["handoff_ms"] == pytest.approx(5.3)  # 0.5 + 40 - 35.2
    assert h["orchestration_ms"] == pytest.approx(3.8)  # minus the READ
    assert h["after_p_ms"] == pytest.approx(4.0)  # 40 - 36, on D's clock
    assert h["step_wait_ms"] == pytest.approx(2.5)  # minus the slower of pin and READ
