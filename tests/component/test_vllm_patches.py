"""Every patch of vLLM internals against the installed vLLM (``compat/patches.py``).

A patch whose target moved fails here, by name, before it reaches
production (where it would be skipped with an ERROR). ``apply`` logs one
line per patch of the process; a moved target is skipped, never applied.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from types import SimpleNamespace

import pytest

from vllm_pd_ext import STEP_TRACE_ENV, compat
from vllm_pd_ext.compat import patches
from vllm_pd_ext.config import PDConfig


@pytest.mark.parametrize("patch", patches.PATCHES, ids=lambda p: p.name)
def test_every_patch_target_is_where_the_patch_expects_it(patch: patches.Patch,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    # Opt-in patches probe only when asked for (step_trace).
    monkeypatch.setenv(STEP_TRACE_ENV, "/nonexistent/only-probed")
    assert patch.probe() is None, (
        f"vLLM {compat.VLLM_VERSION}: the target of patch {patch.name} ({patch.target}) "
        f"moved: {patch.probe()}; adapt compat/patches.py")
    assert patch.versions and all(v.count(".") == 1 for v in patch.versions)
    assert compat.VLLM_VERSION.startswith(patch.versions)


def test_table_covers_each_process_and_names_are_unique() -> None:
    names = [p.name for p in patches.PATCHES]
    assert len(names) == len(set(names))
    for process in patches.Process:
        assert any(process in p.processes for p in patches.PATCHES), process


def test_a_moved_target_is_skipped_loudly_never_applied(monkeypatch, caplog) -> None:
    applied = []
    moved = replace(patches.PATCHES[0], name="moved_one", processes=(patches.Process.WORKER,),
                    probe=lambda: "vllm.x.Y: no 'z'", apply=lambda ctx: applied.append(1) or "")
    monkeypatch.setattr(patches, "PATCHES", (moved,))
    with caplog.at_level(logging.ERROR, logger="vllm.pd_ext"):
        out = patches.apply(patches.Process.WORKER)
    assert out == [patches.Outcome("moved_one", "moved", "vllm.x.Y: no 'z'")]
    assert not applied
    assert "moved_one skipped" in caplog.text and "no 'z'" in caplog.text


def test_apply_logs_each_patch_of_the_process(caplog) -> None:
    cfg = PDConfig(quiet_shm_spin=False)
    with caplog.at_level(logging.DEBUG, logger="vllm.pd_ext"):
        out = patches.apply(patches.Process.WORKER, patches.Context(cfg=cfg))
    by_name = {o.name: o for o in out}
    assert set(by_name) == {p.name for p in patches.PATCHES
                            if patches.Process.WORKER in p.processes}
    assert by_name["quiet_shm_spin"].status == "skipped"
    assert by_name["quiet_shm_spin"].detail == "quiet_shm_spin is false"
    assert by_name["connector_registry"].status == "checked"
    assert "quiet_shm_spin skipped in the worker: quiet_shm_spin is false" in caplog.text


def test_probes_name_what_moved() -> None:
    pool = "vllm.v1.core.block_pool.BlockPool"
    assert patches._needs(pool, "def touch")() is None
    assert "def touch_all" in str(patches._needs(pool, "def touch_all")())
    assert "no 'touch_all'" in str(patches._needs(f"{pool}.touch_all")())
    assert "no field 'nope'" in str(patches._has_field("vllm.config.VllmConfig", "nope")())
    assert patches._needs_once("vllm.v1.engine.core", "time.sleep(")() is None
    assert "times, not once" in str(patches._needs_once(pool, "def ")())


def test_idle_yield_is_skipped_only_when_the_connector_says_work_is_ready(monkeypatch) -> None:
    """The EngineCore loop's 1 ms yield after a model-less step: skipped
    once per report of a finished load, kept otherwise; every other use of
    ``time`` is the real module."""
    import time

    from vllm_pd_ext.compat import engine as engine_patches

    slept: list[float] = []
    fake_time = SimpleNamespace(sleep=slept.append, monotonic=time.monotonic)
    ready = [False]

    def work_ready() -> bool:
        was, ready[0] = ready[0], False
        return was

    loop_time = engine_patches._LoopTime(fake_time, work_ready)
    loop_time.sleep(0.001)
    ready[0] = True
    loop_time.sleep(0.001)  # skipped, and the flag is taken
    loop_time.sleep(0.001)
    ready[0] = True
    loop_time.sleep(0.5)  # not the idle yield: kept (and the flag is not taken)
    assert slept == [0.001, 0.001, 0.5] and ready[0] is True
    assert loop_time.monotonic is time.monotonic



def test_the_step_trace_probe_imports_nothing_unless_asked(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """Without ``VLLM_PD_EXT_STEP_TRACE`` the opt-in patch's probe imports
    nothing (vLLM's model runner has no business in an API server)."""
    (patch,) = [p for p in patches.PATCHES if p.name == "step_trace"]
    imported: list[str] = []
    monkeypatch.setattr(patches, "_import", lambda path: imported.append(path))
    monkeypatch.delenv(STEP_TRACE_ENV, raising=False)
    assert patch.probe() is None and imported == []
    monkeypatch.setenv(STEP_TRACE_ENV, "/x")
    patch.probe()
    assert any("gpu_model_runner" in path for path in imported)
