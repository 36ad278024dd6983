"""``tools/step_split.py``: step-phase trace files to the split of a step.

Synthetic traces with known times (the real engines' are read in
``tests/e2e/test_push.py::test_step_trace_splits_d_first_step_after_the_load``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_pd_ext.compat import step_trace
from vllm_pd_ext.tools import step_split

CORE, WORKER = 100, 200


def step_lines(t0: float, tokens: dict[str, int], new: list[str], worker: int = WORKER
               ) -> tuple[list[str], list[str], float]:
    """One step's EngineCore and worker lines starting at ``t0`` (seconds);
    each phase 1 ms, the forward 5 ms; returns (core, worker, end)."""
    detail = json.dumps({"new": new, "tokens": tokens})
    ms = 0.001
    core = [f"{t0:.6f} {CORE} schedule B", f"{t0 + ms:.6f} {CORE} schedule E"]
    w = [f"{t0 + 2 * ms:.6f} {worker} execute B {detail}",
         f"{t0 + 3 * ms:.6f} {worker} admit B", f"{t0 + 4 * ms:.6f} {worker} admit E",
         f"{t0 + 5 * ms:.6f} {worker} prepare B", f"{t0 + 6 * ms:.6f} {worker} prepare E",
         f"{t0 + 7 * ms:.6f} {worker} forward B", f"{t0 + 12 * ms:.6f} {worker} forward E",
         f"{t0 + 13 * ms:.6f} {worker} execute E",
         f"{t0 + 14 * ms:.6f} {worker} sample B", f"{t0 + 15 * ms:.6f} {worker} sample E"]
    core += [f"{t0 + 16 * ms:.6f} {CORE} update B {detail}",
             f"{t0 + 17 * ms:.6f} {CORE} update E"]
    return core, w, t0 + 17 * ms


def write_trace(folder: Path, steps: list[tuple[dict[str, int], list[str]]],
                gap_s: float = 0.01) -> None:
    core: list[str] = []
    worker: list[str] = []
    t = 10.0
    for tokens, new in steps:
        c, w, end = step_lines(t, tokens, new)
        core += c
        worker += w
        t = end + gap_s
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"steps-{CORE}.log").write_text("\n".join(core) + "\n")
    (folder / f"steps-{WORKER}.log").write_text("\n".join(worker) + "\n")


def test_kinds_and_phases_of_a_collocated_request_and_a_d_request(tmp_path: Path) -> None:
    write_trace(tmp_path, [
        ({"agg": 300}, ["agg"]),   # the collocated engine's prefill
        ({"agg": 1}, []),          # its token #2
        ({"agg": 1}, []),
        ({"agg": 1}, []),
        ({}, []),                  # an empty step (D waiting for KV)
        ({"d": 1}, ["d"]),         # D's token #2 over loaded KV
        ({"d": 1}, []),
        ({"d": 1}, []),
        ({"d": 1, "agg2": 5}, ["agg2"]),  # two requests: batch
    ])
    rows, note = step_split.split_folder(tmp_path)
    assert note == f"EngineCore pid {CORE}, worker pid {WORKER}"
    assert {k: r["steps"] for k, r in rows.items()} == {
        "first, 1 token": 1, "first, prefill": 1, "second": 2, "later": 3, "batch": 1}
    first = rows["first, 1 token"]
    want = {"schedule": 1.0, "to worker": 1.0, "admit": 1.0, "prepare": 1.0,
            "to forward": 1.0, "forward": 5.0, "after forward": 1.0, "to sample": 1.0,
            "sample": 1.0, "back": 1.0, "update": 1.0, "step": 17.0, "idle before": 10.0}
    for phase, ms in want.items():
        assert first[phase] == pytest.approx(ms, abs=1e-3), phase
    table = step_split.table(rows)
    assert table.splitlines()[0].startswith("| step | steps | schedule | to worker | admit")
    assert "| first, 1 token | 1 | 1.00 | 1.00 | 1.00 |" in table


def test_hostile_and_torn_lines_are_skipped(tmp_path: Path) -> None:
    write_trace(tmp_path, [({"r": 3}, ["r"]), ({"r": 1}, [])])
    with open(tmp_path / f"steps-{WORKER}.log", "a") as f:
        f.write("garbage\n1.0 x execute B\n2.0 200 execute Q\n3.0 200 execute B {not json\n"
                '4.0 200 execute B ["a list"]\n5.0 200 exec')  # a torn last line
    by_pid = step_split.read_folder(tmp_path)
    assert sorted(by_pid) == [CORE, WORKER]
    assert all(e.edge in ("B", "E") for evs in by_pid.values() for e in evs)
    # A detail that is not a dict is dropped, the event kept.
    assert step_split.parse_line('4.0 200 execute B ["a list"]') == step_split.Event(
        4.0, 200, "execute", "B", None)
    rows, _ = step_split.split_folder(tmp_path)
    assert rows["first, prefill"]["steps"] == 1 and rows["second"]["steps"] == 1


def test_token_counts_that_are_not_integers_are_ignored() -> None:
    detail = json.dumps({"new": ["r"], "tokens": {"r": True, "s": "7", "t": 2}})
    steps = step_split.cut_steps([
        step_split.Event(1.0, 1, "schedule", "B"),
        step_split.parse_line(f"1.001 2 execute B {detail}"),  # type: ignore[list-item]
        step_split.Event(1.002, 1, "update", "E"),
    ])
    assert steps[0].tokens == {"t": 2}


def test_a_folder_without_a_worker_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "steps-1.log").write_text("1.0 1 schedule B\n1.1 1 schedule E\n")
    with pytest.raises(ValueError, match="no EngineCore or no worker events"):
        step_split.split_folder(tmp_path)
    assert step_split.main([str(tmp_path)]) == 1


def test_several_workers_use_the_lowest_pid(tmp_path: Path) -> None:
    write_trace(tmp_path, [({"r": 3}, ["r"])])
    (tmp_path / "steps-300.log").write_text(
        (tmp_path / f"steps-{WORKER}.log").read_text().replace(f" {WORKER} ", " 300 "))
    _, note = step_split.split_folder(tmp_path)
    assert note == f"EngineCore pid {CORE}, worker pid {WORKER} (of 2 workers)"


def test_describe_step_lists_a_small_step_and_counts_a_large_one() -> None:
    class NewReq:
        def __init__(self, rid: str) -> None:
            self.req_id = rid

    class Out:
        num_scheduled_tokens = {"a": 1, "b,\"c": 4}
        scheduled_new_reqs = [NewReq("b,\"c")]

    assert json.loads(step_trace.describe_step(Out())) == {
        "new": ["b,\"c"], "tokens": {"a": 1, "b,\"c": 4}}
    Out.num_scheduled_tokens = {str(i): 1 for i in range(step_trace.MAX_LISTED + 1)}
    assert json.loads(step_trace.describe_step(Out())) == {
        "requests": step_trace.MAX_LISTED + 1, "new_count": 1,
        "total": step_trace.MAX_LISTED + 1}


def test_a_prefill_in_chunks_is_not_the_second_step(tmp_path: Path) -> None:
    """A prompt longer than one step's token budget: its later chunks are
    ``prefill chunk``; token #2's step is still ``second``."""
    write_trace(tmp_path, [
        ({"long": 2048}, ["long"]),
        ({"long": 1952}, []),
        ({"long": 1}, []),
        ({"long": 1}, []),
        ({"x": 1, "long": 1}, ["x"]),  # a batch: x's "second" is a later one
        ({"x": 1}, []),
    ])
    rows, _ = step_split.split_folder(tmp_path)
    assert {k: r["steps"] for k, r in rows.items()} == {
        "first, prefill": 1, "prefill chunk": 1, "second": 1, "later": 2, "batch": 1}
