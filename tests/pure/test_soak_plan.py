"""The chaos soak's pure core: schedule, workload, oracle, recovery, table."""

from __future__ import annotations

import itertools

import pytest

from vllm_pd_ext.testing.soak_plan import (
    ENGINE_FAULTS,
    LOOPBACK_FAULTS,
    NETNS_FAULTS,
    FaultKind,
    FaultRecord,
    Result,
    Verdict,
    classify,
    make_schedule,
    make_workload,
    recovery,
    rolling_schedule,
    summary_row,
    table,
)

ENGINES = ["P0", "P1", "D0", "D1"]


def test_schedule_is_seeded_covers_every_class_and_engine_faults_never_overlap() -> None:
    a = make_schedule(7, ENGINES, ["D0", "D1"], lease_s=6.0, count=20)
    assert a == make_schedule(7, ENGINES, ["D0", "D1"], lease_s=6.0, count=20)
    assert a != make_schedule(8, ENGINES, ["D0", "D1"], lease_s=6.0, count=20)
    assert {f.kind for f in a} == set(NETNS_FAULTS)
    assert len(a) == 20
    for prev, nxt in itertools.pairwise(a):
        # The next fault starts after the previous one's outage plus a gap.
        assert nxt.at_s >= prev.at_s + prev.duration_s + 2.0 - 1e-9
    for f in a:
        if f.kind is FaultKind.STOP or f.kind is FaultKind.PARTITION_LONG:
            assert f.duration_s > 6.0, f  # longer than a lease
        if f.kind is FaultKind.PARTITION_SHORT:
            assert 0 < f.duration_s < 6.0, f
        if f.kind in ENGINE_FAULTS:
            assert f.target in ENGINES
        elif f.kind is FaultKind.MALFORMED_D_LEG:
            assert f.target in ("D0", "D1")
        else:
            assert f.target is None and f.duration_s == 0


def test_schedule_refuses_fewer_faults_than_classes() -> None:
    with pytest.raises(ValueError, match="every one of the 8"):
        make_schedule(1, ENGINES, ["D0"], lease_s=6.0, count=7)


def test_workload_lengths_prefixes_and_streams() -> None:
    jobs = make_workload(3, 300)
    assert jobs == make_workload(3, 300)
    assert len({j.rid for j in jobs}) == 300
    assert all(1 <= len(j.prompt) <= 3 * 128 for j in jobs)
    shared = [j for j in jobs if j.shared_prefix is not None]
    assert 50 < len(shared) < 130  # about 30%
    by_prefix: dict[int, list[list[int]]] = {}
    for j in shared:
        by_prefix.setdefault(j.shared_prefix or 0, []).append(j.prompt)
    for prompts in by_prefix.values():
        # Those with the same prefix index share at least one whole block.
        assert all(p[:128] == prompts[0][:128] for p in prompts)
    assert 100 < sum(j.stream for j in jobs) < 200


WANT = [5, 6, 7]


@pytest.mark.parametrize(("result", "verdict"), [
    (Result("a", 0, status=200, tokens=[5, 6, 7]), Verdict.EQUAL),
    (Result("a", 0, status=200, tokens=[5, 6, 8]), Verdict.WRONG),
    (Result("a", 0, status=200, tokens=[5, 6, 8], near_tie=True), Verdict.EQUAL),
    (Result("a", 0, status=503, error="no healthy prefill backend"), Verdict.CLEAN_ERROR),
    (Result("a", 0, status=None, timed_out=True), Verdict.HANG),
    (Result("a", 0, status=200, tokens=None, timed_out=True), Verdict.HANG),
    # The connection closed before a status line: the client was told nothing.
    (Result("a", 0, status=None, detail="RemoteDisconnected"), Verdict.TRUNCATED),
    # A 200 body that broke off.
    (Result("a", 0, status=200, tokens=None), Verdict.TRUNCATED),
    # Streams: [DONE] needed, or an error event.
    (Result("a", 0, status=200, stream=True, tokens=[5, 6, 7], done_marker=True), Verdict.EQUAL),
    (Result("a", 0, status=200, stream=True, tokens=None), Verdict.TRUNCATED),
    (Result("a", 0, status=200, stream=True, error='{"message": "decode failed"}'),
     Verdict.CLEAN_ERROR),
    (Result("a", 0, status=200, stream=True, tokens=[5, 6], done_marker=True), Verdict.WRONG),
])
def test_classify(result: Result, verdict: Verdict) -> None:
    assert classify(result, WANT) is verdict


def _done(rid: str, start: float, end: float, verdict: Verdict, p: str, d: str) -> Result:
    r = Result(rid, start, ended_s=end, status=200, prefill=p, decode=d)
    r.verdict = verdict
    return r


def test_recovery_is_the_first_good_handoff_through_the_faulted_engine_after_healing() -> None:
    from vllm_pd_ext.testing.soak_plan import Fault

    rec = FaultRecord(Fault(10.0, FaultKind.KILL, "P1", 0.0), fired_s=10.0, healed_s=40.0)
    results = [
        _done("before-heal", 30, 31, Verdict.EQUAL, "P1", "D0"),  # started before healing
        _done("other-engine", 41, 42, Verdict.EQUAL, "P0", "D0"),  # not through P1
        _done("failed", 41, 43, Verdict.CLEAN_ERROR, "P1", "D1"),
        _done("good-late", 44, 50, Verdict.EQUAL, "P1", "D1"),
        _done("good", 42, 45, Verdict.EQUAL, "P1", "D0"),
    ]
    assert recovery(rec, results) == 35.0  # 45 - 10
    assert recovery(rec, results[:3]) is None
    client = FaultRecord(Fault(10.0, FaultKind.ABORT_BURST, None, 0.0), fired_s=12.0,
                         healed_s=12.5)
    assert recovery(client, results) == 19.0  # any engine: "before-heal" ends at 31


def test_summary_row_and_table() -> None:
    rs = [_done("a", 0, 1, Verdict.EQUAL, "P0", "D0"),
          _done("b", 0, 1, Verdict.CLEAN_ERROR, "P0", "D0"),
          _done("c", 0, 1, Verdict.HANG, "P0", "D0")]
    from vllm_pd_ext.testing.soak_plan import Fault

    rec = FaultRecord(Fault(1.0, FaultKind.STOP, "D0", 8.0), recovery_s=12.5)
    row = summary_row(rs, leaked_blocks=2, records=[rec])
    assert row == {"requests": 3, "equal": 1, "clean errors": 1, "hangs": 1, "wrong": 0,
                   "truncated": 0, "leaked blocks": 2, "max recovery s": 12.5,
                   "faults without recovery": 0}
    text = table(row)
    assert text.splitlines()[0].startswith("| requests | equal | clean errors | hangs | wrong")
    assert text.splitlines()[2] == "| 3 | 1 | 1 | 1 | 0 | 0 | 2 | 12.5 | 0 |"


def test_loopback_schedule_has_no_partitions() -> None:
    from vllm_pd_ext.testing.soak_plan import LOOPBACK_FAULTS, PARTITIONS

    s = make_schedule(3, ENGINES, ["D0"], lease_s=6.0, count=12, kinds=LOOPBACK_FAULTS)
    assert {f.kind for f in s} == set(LOOPBACK_FAULTS)
    assert not PARTITIONS & {f.kind for f in s}


def test_rolling_schedule_restarts_every_engine_in_turn() -> None:
    s = rolling_schedule(["P0", "D0", "P1", "D1"], rounds=2, first_s=5.0, gap_s=4.0)
    assert [f.target for f in s] == ["P0", "D0", "P1", "D1"] * 2
    assert {f.kind for f in s} == {FaultKind.DRAIN_RESTART}
    assert [f.at_s for f in s] == [5.0 + 4.0 * i for i in range(8)]
    assert FaultKind.DRAIN_RESTART not in LOOPBACK_FAULTS + NETNS_FAULTS  # not a chaos fault
    with pytest.raises(ValueError):
        rolling_schedule([], rounds=1)
