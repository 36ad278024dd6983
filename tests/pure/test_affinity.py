"""affinity.py: which VLLM_CPU_OMP_THREADS_BIND values bind the EngineCore, and to what."""

from __future__ import annotations

import json
import os
import threading

import pytest

from vllm_pd_ext.compat import affinity


@pytest.mark.parametrize(("spec", "cores"), [
    ("0", {0}),
    ("1", {1}),
    ("0-3", {0, 1, 2, 3}),
    ("0-1,4,6-7", {0, 1, 4, 6, 7}),
    (" 2 ", {2}),
    # One set per TP rank: the EngineCore gets what the engine was given.
    ("0|1", {0, 1}),
    ("0-3|4-7", set(range(8))),
    ("0-1 | 6", {0, 1, 6}),
])
def test_explicit_core_lists_parse(spec, cores):
    assert affinity.parse_cpu_list(spec) == cores


@pytest.mark.parametrize("spec", [
    "", "auto", "nobind", "0-3|", "|0", "0|a", "a", "3-1", "1-", "-1", "0,,1", "0-99999",
    "1.5",
])
def test_anything_else_binds_nothing(spec):
    assert affinity.parse_cpu_list(spec) is None


def test_not_cpu_or_unset_binds_nothing():
    assert affinity.bind_engine_core(False, "0") is None
    assert affinity.bind_engine_core(True, None) is None
    assert affinity.bind_engine_core(True, "auto") is None


def _in_child(fn) -> tuple[set[int], list[set[int]]]:
    """Run ``fn`` in a forked child (affinity is per process); returns the
    child's mask and every thread's mask after it ran."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            stop = threading.Event()
            t = threading.Thread(target=stop.wait, daemon=True)
            t.start()
            fn()
            masks = [sorted(os.sched_getaffinity(int(tid)))
                     for tid in os.listdir("/proc/self/task")]
            os.write(w, json.dumps([sorted(os.sched_getaffinity(0)), masks]).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.waitpid(pid, 0)
    own, masks = json.loads(data.decode())
    return set(own), [set(m) for m in masks]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 allowed cores")
def test_binding_moves_every_existing_thread():
    core = min(os.sched_getaffinity(0))
    own, masks = _in_child(lambda: affinity.bind_engine_core(True, str(core)))
    assert own == {core}
    assert len(masks) >= 2 and all(m == {core} for m in masks)


def test_cores_outside_the_allowed_set_bind_nothing():
    allowed = os.sched_getaffinity(0)
    outside = max(allowed) + 1
    assert affinity.bind_engine_core(True, str(outside)) is None
    assert os.sched_getaffinity(0) == allowed
