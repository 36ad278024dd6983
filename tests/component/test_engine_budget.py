"""The e2e lanes' shared engine budget (tests/e2e/engine_set.py): a set that
would exceed it waits for another process's set to stop, a dead process's
engines do not count, and a process alone on the machine never waits.

"Another process" is PID 1 here (alive, never ours), written into the
budget file as a running lane would; subprocesses would test the same lock.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from tests.e2e import lanes
from tests.e2e.engine_set import EngineBudget

OTHER = 1  # init: alive, and not this process


def held_by(path: Path) -> dict[int, int]:
    return {int(k): v for k, v in json.loads(path.read_text()).items()}


def test_a_set_within_the_budget_starts_at_once_and_gives_it_back(tmp_path: Path) -> None:
    budget = EngineBudget(tmp_path / "b.json", cap=4)
    budget.acquire(3, "three")
    assert held_by(budget.path) == {os.getpid(): 3}
    budget.release(3)
    assert budget.held() == 0


def test_a_set_over_the_budget_waits_for_another_process(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    path.write_text(json.dumps({OTHER: 3}))
    budget = EngineBudget(path, cap=4)
    done = threading.Event()

    def start() -> None:
        budget.acquire(2, "two")
        done.set()

    th = threading.Thread(target=start, daemon=True)
    th.start()
    assert not done.wait(1.5), "started although 3 + 2 > 4"
    path.write_text(json.dumps({OTHER: 1}))  # the other lane stopped two engines
    assert done.wait(5.0), "still waiting with 1 + 2 <= 4"
    assert held_by(path) == {OTHER: 1, os.getpid(): 2}


def test_engines_of_a_dead_process_do_not_count(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    path.write_text(json.dumps({dead: 8}))
    budget = EngineBudget(path, cap=4)
    t0 = time.monotonic()
    budget.acquire(4, "four")
    assert time.monotonic() - t0 < 5.0  # generous for stalled hosts; counted, it waits 1800 s
    assert held_by(path) == {os.getpid(): 4}


def test_alone_a_set_larger_than_the_budget_still_starts(tmp_path: Path) -> None:
    budget = EngineBudget(tmp_path / "b.json", cap=4)
    budget.acquire(1, "ref")
    budget.acquire(5, "five")  # nothing else runs: waiting could never help
    assert budget.held() == 6


def test_past_its_timeout_a_set_starts_and_says_so(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "b.json"
    path.write_text(json.dumps({OTHER: 4}))
    EngineBudget(path, cap=4).acquire(1, "late", timeout=0.5)
    assert "late starts over the budget (4 + 1 > 4)" in capsys.readouterr().err


def test_a_garbled_budget_file_is_read_as_empty(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    path.write_text("{not json")
    budget = EngineBudget(path, cap=2)
    budget.acquire(2, "two")
    assert held_by(path) == {os.getpid(): 2}


def test_every_e2e_module_has_a_lane_and_the_drain_ends_its_lane() -> None:
    modules = sorted(p.name for p in Path(lanes.__file__).parent.rglob("test_*.py"))
    listed = [m for ms in lanes.LANES.values() for m in ms]
    assert sorted(listed) == modules, "add the module to a lane in tests/e2e/lanes.py"
    assert lanes.LANES[lanes.SESSION][-1] == "test_drain.py"
    for lane, modules_of_lane in lanes.LANES.items():
        if lane != lanes.SESSION:  # only the session lane has the session's P and D
            assert "p" not in lanes.SESSION_ENGINES[lane]
            assert "test_drain.py" not in modules_of_lane


def test_p2_starts_with_the_session_set_only_when_its_modules_run() -> None:
    session = lanes.SESSION_ENGINES[lanes.SESSION]
    assert lanes.early_engines(lanes.SESSION, {"test_pull.py"}) == session
    for user in ("test_isolation.py", "test_drain.py"):
        assert lanes.early_engines(lanes.SESSION, {"test_pull.py", user}) == (*session, "p2")
    # Only the session lane has session producers to start early.
    assert lanes.early_engines(lanes.OWN_SETS, {"test_drain.py"}) == ("ref",)
    # Every extra's users are modules of its lane.
    for lane, extras in lanes.SESSION_EXTRAS.items():
        for users in extras.values():
            assert set(users) <= set(lanes.LANES[lane])
