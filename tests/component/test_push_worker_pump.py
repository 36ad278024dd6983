"""A push D worker drives its progress pump's pace (wire/pump_bell.py):
fast while it expects a WRITE (``pending``), poked awake when it starts
expecting one. FakeTransport records what
the worker asks of the pump; the pump itself is tested on a real NIXL agent
(``tests/transport/test_nixl_pump_pace.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from test_worker_fake import fake_vllm_config, kv_tensors

from vllm_pd_ext.config import PDConfig
from vllm_pd_ext.metadata import PDConnectorMetadata
from vllm_pd_ext.transport.fake import FakeFabric, FakeTransport
from vllm_pd_ext.wire.specs import PushRecvSpec
from vllm_pd_ext.worker.dispatcher import PDWorker


class PumpRecorder(FakeTransport):
    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.pending: Callable[[], bool] | None = None
        self.pump_started = False

    def start_progress_pump(self, interval_s: float, keep_notifs: bool = True,
                            on_notif: Any = None, bell: Any = None,
                            pending: Callable[[], bool] | None = None) -> None:
        # The bell stays open: the test reads its pokes (the worker closes it).
        self.pump_started, self.pending = True, pending


def make_worker(extra: dict[str, Any]) -> tuple[PDWorker, PumpRecorder]:
    transport = PumpRecorder("eng-d-tp0-fake", FakeFabric())
    worker = PDWorker(fake_vllm_config("eng-d", False),
                      PDConfig.from_extra_config({"transfer_mode": "push", **extra}),
                      transport=transport, tp_rank=0)
    worker.register_kv_caches(kv_tensors("zero"))
    return worker, transport


@pytest.fixture
def push_d() -> Iterator[tuple[PDWorker, PumpRecorder]]:
    worker, transport = make_worker({})
    try:
        yield worker, transport
    finally:
        if worker.bell is not None:
            worker.bell.close()
        worker.shutdown()


def spec(rid: str) -> PushRecvSpec:
    return PushRecvSpec(request_id=rid, pd_request_id=f"pd-{rid}", local_block_ids=[1, 2],
                        num_tokens=64)


def poked(worker: PDWorker) -> bool:
    assert worker.bell is not None
    return worker.bell.wait(0.001)


def test_pump_is_fast_while_a_write_is_expected_and_poked_when_one_starts(
        push_d: tuple[PDWorker, PumpRecorder]) -> None:
    worker, transport = push_d
    assert transport.pump_started and transport.pending is not None
    pending = transport.pending
    assert not pending() and not poked(worker)
    worker.start_load_kv(PDConnectorMetadata(push_recv=[spec("a")], idle=True))
    assert pending() and poked(worker)
    # Already expecting one: the pump is fast, no second poke.
    worker.start_load_kv(PDConnectorMetadata(push_recv=[spec("b")], idle=True))
    assert not poked(worker)
    # Both given up: nothing pending any more.
    worker.start_load_kv(PDConnectorMetadata(
        push_fail={"a": ("timeout", "t"), "b": ("timeout", "t")}, idle=True))
    worker.get_transfer_results()
    assert not pending()


def test_multi_turn_d_keeps_the_long_linger() -> None:
    """D's kept turns are read by the next turn's P: its pump keeps the
    linger after each sign of work (no ``pending``)."""
    worker, transport = make_worker({"bidirectional_kv_xfer": True})
    try:
        assert transport.pump_started and transport.pending is None
    finally:
        if worker.bell is not None:
            worker.bell.close()
        worker.shutdown()
