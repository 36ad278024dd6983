"""telemetry.py: merging TP ranks' records, the structured log line."""

from __future__ import annotations

import json

import msgspec

from vllm_pd_ext.wire import telemetry
from vllm_pd_ext.wire.telemetry import TransferRecord


def rec(**kw: object) -> TransferRecord:
    base: dict[str, object] = dict(request_id="d1", remote_request_id="p1", p_engine="eng-p",
                                   p_addr="127.0.0.1:5600", mode="pull")
    base.update(kw)
    return TransferRecord(**base)  # type: ignore[arg-type]


def test_merge_adds_sizes_takes_the_slowest_phase_and_the_least_lease():
    a = rec(bytes=100, descriptors=2, blocks=3, tokens=300, handshake_ms=1.0, pin_ms=2.0,
            read_ms=5.0, lease_left_s=20.0)
    b = rec(bytes=150, descriptors=3, blocks=3, tokens=300, handshake_ms=4.0, pin_ms=1.0,
            read_ms=7.5, lease_left_s=12.5)
    m = telemetry.merge(a, b)
    assert (m.bytes, m.descriptors, m.blocks, m.tokens, m.ranks) == (250, 5, 3, 300, 2)
    assert (m.handshake_ms, m.pin_ms, m.read_ms, m.lease_left_s) == (4.0, 2.0, 7.5, 12.5)
    assert m.outcome == "ok"


def test_merge_a_failed_rank_fails_the_request_and_unknown_counts_stay_unknown():
    ok = rec(bytes=100, descriptors=2, read_ms=3.0)
    bad = rec(outcome="lease_lost", detail="P's blocks expired", descriptors=None)
    for m in (telemetry.merge(ok, bad), telemetry.merge(bad, ok)):
        assert (m.outcome, m.detail) == ("lease_lost", "P's blocks expired")
        assert m.descriptors is None and m.read_ms == 3.0 and m.bytes == 100


def test_merge_by_request_groups_ranks():
    out = telemetry.merge_by_request([rec(bytes=1), rec(request_id="d2", bytes=5), rec(bytes=2)])
    assert {k: (v.bytes, v.ranks) for k, v in out.items()} == {"d1": (3, 2), "d2": (5, 1)}


def test_log_line_is_one_parseable_json_object():
    r = rec(bytes=786_432, descriptors=4, blocks=3, tokens=300, read_ms=1.25, kv_ready_ms=9.0,
            detail='a "quoted"\nline')
    line = telemetry.log_line(r)
    assert "\n" not in line and line.startswith(telemetry.LOG_PREFIX)
    body = json.loads(line[len(telemetry.LOG_PREFIX):])
    assert body["bytes"] == 786_432 and body["kv_ready_ms"] == 9.0
    assert "pin_ms" not in body  # fields a load did not reach are left out
    assert telemetry.parse_log_line("INFO 12-02 [scheduler.py:1] " + line) == r
    assert telemetry.parse_log_line("PDConnector: transfer {not json") is None
    assert telemetry.parse_log_line("PDConnector: transfer {\"bytes\": 1}") is None  # no ids
    assert telemetry.parse_log_line("unrelated") is None


def test_to_dict_is_plain_json_and_round_trips():
    r = rec(bytes=10, write_wait_ms=3.5, mode="push", descriptors=None)
    d = telemetry.to_dict(r)
    assert json.loads(json.dumps(d)) == d
    assert msgspec.convert(d, TransferRecord) == r
    assert telemetry.ms(0.0123456) == 12.346
