"""The progress pump's pace (wire/pump_bell.PumpPace): fast after any sign
of work, for the linger period, then idle; never faster than asked."""

from __future__ import annotations

import pytest

from vllm_pd_ext.wire import pump_bell
from vllm_pd_ext.wire.pump_bell import PumpPace


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_fast_from_the_start_then_idle_after_the_linger() -> None:
    clock = Clock()
    pace = PumpPace(0.001, idle_s=0.02, linger_s=10.0, clock=clock)
    assert pace.interval() == 0.001
    clock.t += 9.99
    assert pace.fast and pace.interval() == 0.001
    clock.t += 0.02
    assert not pace.fast and pace.interval() == 0.02


def test_hurry_extends_from_now_and_never_shortens() -> None:
    clock = Clock()
    pace = PumpPace(0.001, idle_s=0.02, linger_s=10.0, clock=clock)
    clock.t += 30.0
    assert pace.interval() == 0.02
    pace.hurry()
    assert pace.interval() == 0.001
    clock.t += 5.0
    pace.hurry()  # the linger counts from the latest sign of work
    clock.t += 9.0
    assert pace.fast
    clock.t += 1.5
    assert not pace.fast


@pytest.mark.parametrize("fast", [0.001, 0.05])
def test_idle_is_never_faster_than_the_configured_period(fast: float) -> None:
    pace = PumpPace(fast, idle_s=0.02, linger_s=0.0, clock=Clock())
    assert pace.interval() == max(fast, 0.02)


def test_defaults_come_from_the_module() -> None:
    pace = PumpPace(0.001, clock=Clock())
    assert (pace.idle_s, pace.linger_s) == (pump_bell.IDLE_INTERVAL_S, pump_bell.LINGER_S)


def test_pending_work_keeps_the_pump_fast_and_shortens_the_linger() -> None:
    """A push D's pump: fast while WRITEs are expected, then only
    ``PENDING_LINGER_S`` after the last sign of work, not 10 s (each wake-up
    takes the core from D's decode steps)."""
    clock = Clock()
    waiting = [False]
    pace = PumpPace(0.001, idle_s=0.02, clock=clock, pending=lambda: waiting[0])
    assert pace.linger_s == pump_bell.PENDING_LINGER_S < pump_bell.LINGER_S
    clock.t += pump_bell.PENDING_LINGER_S + 0.01
    assert pace.interval() == 0.02
    waiting[0] = True
    clock.t += 60.0  # however long the wait for P's WRITE
    assert not pace.fast and pace.interval() == 0.001
    waiting[0] = False
    assert pace.interval() == 0.02
    pace.hurry()  # a notification collected, a ring
    assert pace.interval() == 0.001
    clock.t += pump_bell.PENDING_LINGER_S + 0.01
    assert pace.interval() == 0.02
