"""``compat.engine.quiet_shm_spin`` on a real vLLM shared-memory ``MessageQueue``.

A reader of vLLM's queue busy-waits for 1 s after each message; once quieted
it sleeps on the queue's notification (no CPU while idle) and still gets
every message at once. This is what stopped a push P's EngineCore from
being starved by spinning readers on a shared core (issue 11's soak).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.distributed.device_communicators import shm_broadcast
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

from vllm_pd_ext.compat import engine as compat_engine


def _pair() -> tuple[Any, Any]:
    writer = MessageQueue(n_reader=1, n_local_reader=1)
    box: dict[str, Any] = {}

    def join() -> None:
        box["reader"] = MessageQueue.create_from_handle(writer.export_handle(), rank=0)
        box["reader"].wait_until_ready()

    t = threading.Thread(target=join)
    t.start()
    writer.wait_until_ready()
    t.join(timeout=30)
    return writer, box["reader"]


def _count_waits(monkeypatch: pytest.MonkeyPatch, reader: Any) -> Counter[str]:
    """Count how the reader waits: ``yield`` (vLLM's busy loop calls
    ``sched_yield`` and returns) or ``poll`` (asleep on the writer's
    notification). Which path runs is the mechanism under test; the CPU it
    burns depends on how loaded the machine is, so it is only reported."""
    calls: Counter[str] = Counter()
    real_yield = shm_broadcast.sched_yield
    real_poll = reader._spin_condition.poller.poll

    def counted_yield() -> None:
        calls["yield"] += 1
        real_yield()

    def counted_poll(*args: Any, **kwargs: Any) -> Any:
        calls["poll"] += 1
        return real_poll(*args, **kwargs)

    monkeypatch.setattr(shm_broadcast, "sched_yield", counted_yield)
    monkeypatch.setattr(reader._spin_condition.poller, "poll", counted_poll)
    return calls


def _idle_cpu(writer: Any, reader: Any, msg: str, wait_s: float = 0.5) -> float:
    """CPU seconds the reader's thread burns waiting ``wait_s`` for nothing
    right after reading ``msg``. The read and the wait run in one thread, back
    to back: a thread start between them (slow on a loaded machine) could
    outlast vLLM's 1 s spin window and hide the spinning."""
    out: dict[str, float] = {}
    writer.enqueue(msg)

    def run() -> None:
        assert reader.dequeue(timeout=5) == msg  # a fresh read: the spin window opens
        t0 = time.thread_time()
        with pytest.raises(TimeoutError):
            reader.dequeue(timeout=wait_s)
        out["cpu"] = time.thread_time() - t0

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=30)
    return out["cpu"]


def test_quieted_reader_sleeps_when_idle_and_still_gets_messages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No step of this process ran the model (see the test below).
    monkeypatch.setattr(compat_engine, "_last_model_step", [float("-inf")])
    monkeypatch.setattr(compat_engine, "_spin_while_computing", [False])
    writer, reader = _pair()
    calls = _count_waits(monkeypatch, reader)
    # Before: vLLM's reader busy-loops for 1 s after a read. The read and the
    # 0.5 s wait run back to back in one thread, so the whole wait lies in
    # that window: it yields and never sleeps on the notification.
    spinning = _idle_cpu(writer, reader, "warm")
    assert calls["yield"] > 0 and calls["poll"] == 0, dict(calls)

    assert compat_engine.quiet_shm_spin() >= 1
    assert reader._spin_condition.busy_loop_s == 0
    calls.clear()
    quiet = _idle_cpu(writer, reader, "warm again")
    # After: the idle wait sleeps on the notification and never spins.
    assert calls["poll"] > 0 and calls["yield"] == 0, dict(calls)
    assert quiet < 0.05, f"a quieted reader burned {quiet:.3f} s of CPU while idle"

    # Every message still arrives at once: the writer notifies after each write.
    got: list[tuple[str, float]] = []

    def read() -> None:
        for _ in range(20):
            got.append((reader.dequeue(timeout=5), time.monotonic()))

    t = threading.Thread(target=read)
    t.start()
    lags = []
    for i in range(20):
        time.sleep(0.01)
        sent = time.monotonic()
        writer.enqueue(f"m{i}")
        while len(got) <= i:
            time.sleep(0.0002)
        lags.append(got[i][1] - sent)
    t.join(timeout=30)
    assert [m for m, _ in got] == [f"m{i}" for i in range(20)]
    assert sorted(lags)[len(lags) // 2] < 0.01, f"median wake-up {sorted(lags)[10] * 1e3:.2f} ms"
    print(f"idle CPU spinning {spinning:.3f} s, quiet {quiet:.4f} s; median wake-up "
          f"{sorted(lags)[10] * 1e6:.0f} us")


def test_readers_created_after_the_class_patch_are_quiet(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """``quiet_new_shm_readers`` (the plugin hook's patch, for engines without
    our connector): a queue built afterwards sleeps instead of spinning and
    still gets every message; applying it twice changes nothing more."""
    monkeypatch.setattr(shm_broadcast.SpinCondition, "__init__",
                        shm_broadcast.SpinCondition.__init__)  # undone after the test
    assert compat_engine.quiet_new_shm_readers()
    assert not compat_engine.quiet_new_shm_readers()
    writer, reader = _pair()
    assert reader._spin_condition.busy_loop_s == 0
    calls = _count_waits(monkeypatch, reader)
    for i in range(20):
        writer.enqueue(f"m{i}")
        assert reader.dequeue(timeout=5) == f"m{i}"
    _idle_cpu(writer, reader, "last")
    assert calls["yield"] == 0 and calls["poll"] > 0, calls


def test_the_plugin_hook_quiets_new_readers_only_when_asked(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """``register()`` (vLLM's plugin hook, in every vLLM process) applies
    ``quiet_shm_spin_everywhere`` with ``VLLM_PD_EXT_QUIET_SHM_SPIN=1`` and
    leaves vLLM alone without it."""
    import vllm_pd_ext
    from vllm_pd_ext.compat import patches

    monkeypatch.setattr(shm_broadcast.SpinCondition, "__init__",
                        shm_broadcast.SpinCondition.__init__)  # undone after the test
    monkeypatch.setattr(patches, "_once", {})
    monkeypatch.delenv(vllm_pd_ext.QUIET_SPIN_ENV, raising=False)
    monkeypatch.delenv(vllm_pd_ext.STEP_TRACE_ENV, raising=False)
    vllm_pd_ext.register()
    assert not getattr(shm_broadcast.SpinCondition.__init__, "_pd_ext_quiet", False)
    monkeypatch.setattr(patches, "_once", {})
    monkeypatch.setenv(vllm_pd_ext.QUIET_SPIN_ENV, "1")
    vllm_pd_ext.register()
    assert getattr(shm_broadcast.SpinCondition.__init__, "_pd_ext_quiet", False)
    # The hook's other patch, the step trace, is off without its variable.
    assert {o.name: o.status for o in patches._once[patches.Process.PLUGIN]} == {
        "quiet_shm_spin_everywhere": "applied", "step_trace": "skipped"}


@pytest.mark.parametrize("spin_while_computing", [False, True])
def test_quieted_reader_spins_while_the_model_runs_only_when_asked(
        monkeypatch: pytest.MonkeyPatch, spin_while_computing: bool) -> None:
    """With ``spin_while_computing`` (opt-in), while the engine's steps
    compute (``note_model_step(True)`` at each) a quieted reader spins as
    vLLM's does: the notification's wake-up cost each decode step 0.4 to 3.8 ms
    on our CPU host. Empty steps (``note_model_step(False)``: only KV
    moves, issue 11's case) and ``MODEL_SPIN_S`` after the last computing
    step, it sleeps again. By default it never spins."""
    monkeypatch.setattr(compat_engine, "_last_model_step", [float("-inf")])
    monkeypatch.setattr(compat_engine, "_spin_while_computing", [False])
    monkeypatch.setattr(compat_engine, "MODEL_SPIN_S", 0.3)
    writer, reader = _pair()
    calls = _count_waits(monkeypatch, reader)
    assert compat_engine.quiet_shm_spin(spin_while_computing=spin_while_computing) >= 1

    compat_engine.note_model_step(False)
    _idle_cpu(writer, reader, "empty step", wait_s=0.1)
    assert calls["poll"] > 0 and calls["yield"] == 0, dict(calls)

    calls.clear()
    compat_engine.note_model_step(True)
    _idle_cpu(writer, reader, "decode step", wait_s=0.1)
    if spin_while_computing:
        assert calls["yield"] > 0 and calls["poll"] == 0, dict(calls)
    else:
        assert calls["poll"] > 0 and calls["yield"] == 0, dict(calls)

    # The window ends MODEL_SPIN_S after the last computing step.
    time.sleep(0.3)
    calls.clear()
    _idle_cpu(writer, reader, "after decoding", wait_s=0.1)
    assert calls["poll"] > 0 and calls["yield"] == 0, dict(calls)


class _FakeHalf:
    """The halves' calls the facade makes here, recorded."""

    def __init__(self, idle: bool = False, recving: set[str] | None = None) -> None:
        self.idle, self.recving = idle, recving or set()

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        from vllm_pd_ext.metadata import PDConnectorMetadata

        return PDConnectorMetadata(idle=self.idle)

    def update_connector_output(self, output: Any) -> None:
        pass

    def get_transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        return set(), set(self.recving), set()


@pytest.mark.parametrize("case", ["computing step", "empty step", "load reported to the "
                                  "scheduler", "load reported by the worker", "nothing"])
def test_the_facade_notes_the_steps_that_compute(monkeypatch: pytest.MonkeyPatch,
                                                 case: str) -> None:
    """The connector marks a step that computes (the metadata is not
    ``idle``) and a step that reports a finished load (the next one computes
    it: its queue crossings should not wait for a wake-up); never an empty
    step, which issue 11's starvation came from."""
    from types import SimpleNamespace

    from vllm_pd_ext.connector import PDConnector

    stamp = [float("-inf")]
    monkeypatch.setattr(compat_engine, "_last_model_step", stamp)
    conn = PDConnector.__new__(PDConnector)
    if case == "computing step":
        conn._scheduler, conn._worker = _FakeHalf(idle=False), None  # type: ignore[assignment]
        conn.build_connector_meta(SimpleNamespace())
    elif case == "empty step":
        conn._scheduler, conn._worker = _FakeHalf(idle=True), None  # type: ignore[assignment]
        conn.build_connector_meta(SimpleNamespace())
    elif case == "load reported to the scheduler":
        conn._scheduler, conn._worker = _FakeHalf(), None  # type: ignore[assignment]
        conn.update_connector_output(SimpleNamespace(finished_recving={"r1"}))
    elif case == "load reported by the worker":
        conn._scheduler, conn._worker = None, _FakeHalf(recving={"r1"})  # type: ignore[assignment]
        conn.get_transfer_results(set())
    else:
        conn._scheduler, conn._worker = _FakeHalf(), _FakeHalf()  # type: ignore[assignment]
        conn.update_connector_output(SimpleNamespace(finished_recving=set()))
        conn.get_transfer_results(set())
    noted = stamp[0] > float("-inf")
    assert noted == (case not in ("empty step", "nothing")), case
