"""The e2e tier's lanes: which modules share which engines, in what order.

A lane is a list of e2e modules that run one after another in one process,
on that process's session engines (tests/e2e/conftest.py). ``tests/run.sh``
gives each lane a pytest-xdist worker of its own, beside the two workers of the
engine-free tiers (tests/conftest.py), so that one lane's tests use the
cores while another lane waits on an engine start, a lease or a timeout:
engine starts and waits are most of the e2e tier's time, and on 2 cores
one lane alone leaves more than half of the CPU idle (docs/testing.md,
"Suite timings"). Run in one process (``tests/run.sh tests/e2e``), the
lanes run one after another, in the order below, on one set of session
engines.

- ``session``: the modules that use the session's P and D (``p``, ``d``,
  and the second producer ``p2``). ``test_isolation.py`` and
  ``test_drain.py`` come last: the first freezes ``p2``, the second drains
  ``p2`` and ``d`` for good (SIGTERM: they exit), so no module after them
  in this lane could use those engines.
- ``own-sets``: modules that start engine sets of their own and use, of
  the session, only the collocated ``ref`` engine (the oracle), which in a
  full run is the one the controller shares with every lane
  (tests/e2e/shared_ref.py).

Each lane is balanced to about half of the e2e tier's time (per-module
times in docs/testing.md). An unlisted module runs first in the
``session`` lane, where every session engine is available.
"""

from __future__ import annotations

from pathlib import Path

SESSION = "session"
OWN_SETS = "own-sets"

LANES: dict[str, list[str]] = {
    SESSION: [
        "test_pull.py", "test_proxy_e2e.py", "test_conformance.py", "test_d_variants.py",
        "test_oracle.py", "test_concurrency.py", "test_sizing_e2e.py", "test_slo_bench_e2e.py",
        # TP=2 beside the session's TP=1 P and D (one extra engine, 2 ranks).
        "test_tp.py",
        # test_push.py's mode-mismatch test also sends legs to the session's P and D.
        "test_failures.py", "test_push.py",
        "test_isolation.py", "test_drain.py",
    ],
    OWN_SETS: [
        "test_auth_e2e.py", "test_intree_nixl.py", "test_multiturn.py",
        # `vllm serve --api-server-count 2`: drained through vLLM's parent.
        "test_drain_api_servers.py",
        "test_multiturn_push.py", "test_multihost.py",
        # Collected only with PD_EXT_TP_MATRIX=1 (tests/e2e/tp_matrix/conftest.py).
        "test_tp_matrix.py",
    ],
}

#: The session engines a lane's modules use, started together on first need.
SESSION_ENGINES: dict[str, tuple[str, ...]] = {
    SESSION: ("ref", "p", "d"),
    OWN_SETS: ("ref",),
}

#: Session engines that only some of a lane's modules use, started with the
#: lane's ``SESSION_ENGINES`` when any of those modules is in the run: ``p2``
#: then starts at the lane's beginning, beside ``p`` and ``d``, instead of on
#: the critical path at the lane's end (about 100 s of a full run's wall time
#: under CI's load), and a run of other modules does not start it at all.
SESSION_EXTRAS: dict[str, dict[str, tuple[str, ...]]] = {
    SESSION: {"p2": ("test_isolation.py", "test_drain.py")},
}


def early_engines(lane: str, modules: set[str]) -> tuple[str, ...]:
    """What to start when ``lane``'s first test runs, given the file names
    of the run's e2e modules: its session engines and the extras they need."""
    extras = tuple(name for name, users in SESSION_EXTRAS.get(lane, {}).items()
                   if any(m in modules for m in users))
    return SESSION_ENGINES[lane] + extras


def lane_of(path: str | Path) -> str:
    """The lane of an e2e module, by its file name."""
    name = Path(path).name
    for lane, modules in LANES.items():
        if name in modules:
            return lane
    return SESSION


def order_key(path: str | Path) -> tuple[int, int]:
    """Sort key of an e2e module: its lane, then its place in the lane
    (unlisted modules first in the ``session`` lane)."""
    name = Path(path).name
    lane = lane_of(name)
    modules = LANES[lane]
    return list(LANES).index(lane), modules.index(name) if name in modules else -1
