"""NixlTransport keeps NIXL notifications only for someone who takes them,
and never more than ``MAX_PENDING_NOTIFS`` (a real agent; its
``get_new_notifs`` is replaced to feed a flood)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("nixl")

from vllm_pd_ext.transport import nixl as nixl_mod
from vllm_pd_ext.transport.nixl import NixlTransport

pytestmark = pytest.mark.nixl


class Flood:
    """Stands in for the agent's notification queue: two per call."""

    def __init__(self, agent: object) -> None:
        self.agent = agent
        self.calls = 0

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        self.calls += 1
        return {"peer": [b"pdx:%d" % self.calls, b"noise"]}

    def __getattr__(self, name: str) -> object:
        return getattr(self.agent, name)


@pytest.fixture
def transport() -> Iterator[tuple[NixlTransport, Flood]]:
    t = NixlTransport(f"notif-test-{os.getpid()}-{time.monotonic_ns()}", ["UCX"],
                      progress_thread=False)
    real = t._agent
    flood = Flood(real)
    t._agent = flood
    try:
        yield t, flood
    finally:
        t.close()
        t._agent = real


def test_pull_target_keeps_no_notifications(transport) -> None:
    """P in pull mode: nobody takes notifications; they used to pile up."""
    t, flood = transport
    t.start_progress_pump(0.001, keep_notifs=False)
    deadline = time.monotonic() + 5
    while flood.calls < 50 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert flood.calls >= 50
    assert len(t._notifs) == 0
    assert t.num_dropped_notifs >= 100


def test_pending_notifications_are_bounded(transport, monkeypatch) -> None:
    t, _ = transport
    monkeypatch.setattr(nixl_mod, "MAX_PENDING_NOTIFS", 10)
    for _ in range(20):
        t._collect_notifs()
    got = t.take_notifs()  # collects one more round, then drains
    assert len(got) == 10 and got[-2:] == [b"pdx:21", b"noise"]  # the newest are kept
    assert t.num_dropped_notifs == 32
    assert t.take_notifs() == [b"pdx:22", b"noise"]
