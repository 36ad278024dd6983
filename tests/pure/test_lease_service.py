"""LeaseService, P's lease owner: its named operations, the atomicity it
offers push mode, and that no caller reaches past it into the table."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest

from vllm_pd_ext.leases.service import LeaseCounters, LeaseService
from vllm_pd_ext.leases.table import LeaseState, LeaseTable
from vllm_pd_ext.wire import protocol as proto

SRC = Path(__file__).resolve().parents[2] / "vllm_pd_ext"


@pytest.fixture
def service(clock):
    return LeaseService(LeaseTable(10.0, clock))


def pin(rid: str, consumer: str = "", rank: int = -1) -> proto.LeaseRenew:
    return proto.LeaseRenew(engine_id="eng-d", request_ids=[rid], acquire=True,
                            tp_rank=rank, consumer=consumer)


def release(rid: str, rank: int = 0, consumer: str = "", ok: bool = True) -> proto.LeaseRelease:
    return proto.LeaseRelease(engine_id="eng-d", request_ids=[rid], tp_rank=rank, ok=ok,
                              consumer=consumer)


def test_grant_release_sweep(service, clock):
    expiry = service.grant("r1", num_consumers=1)
    assert expiry == clock.now + 10.0 and service.next_expiry() == expiry
    with pytest.raises(KeyError):
        service.grant("r1", num_consumers=1)
    assert not service.has_released()
    service.release(release("r1"))
    assert service.has_released()
    res = service.sweep()
    assert res.released == ["r1"] and res.expired == []
    assert not service.has_released() and service.next_expiry() is None


def test_sweep_calls_on_expired_only_with_expired_ids(service, clock):
    seen: list[list[str]] = []
    service.grant("a", num_consumers=1)
    service.grant("b", num_consumers=1)
    service.release(release("b"))
    assert service.sweep(on_expired=seen.append).released == ["b"]
    assert seen == []  # nothing expired: no call
    clock.advance(10.0)
    assert service.sweep(on_expired=seen.append).expired == ["a"]
    assert seen == [["a"]]


def test_on_expired_runs_inside_the_sweeps_critical_section(service, clock):
    """Push mode forgets expired prefills in the callback; a registration on
    the side-channel thread (``atomic()``) must wait until the sweep is over."""
    service.grant("a", num_consumers=1)
    clock.advance(10.0)
    entered = threading.Event()

    def register() -> None:
        with service.atomic():
            entered.set()

    other = threading.Thread(target=register)
    got_in: list[bool] = []

    def on_expired(ids: list[str]) -> None:
        other.start()
        got_in.append(entered.wait(0.2))
        assert service.hold("a") is False  # reentrant; and the lease is gone

    service.sweep(on_expired=on_expired)
    other.join(2)
    assert got_in == [False] and entered.is_set()


def test_atomic_groups_operations(service):
    service.grant("w", num_consumers=2)
    with service.atomic():
        assert service.hold("w") is True
        assert service.release_ranks("w", [0], ok=True) is False
    assert service.table.get("w").state is LeaseState.WRITING
    assert service.release_ranks("w", range(2), ok=False) is True
    assert service.sweep().released == ["w"]


def test_holders_over_the_message_handlers(service):
    service.grant("r", num_consumers=1)
    service.renew(pin("r", consumer="d-1", rank=0))
    service.renew(pin("r", consumer="d-2", rank=0))
    service.release(release("r", consumer="d-1"))
    assert not service.has_released()
    service.release(release("r"))  # names no consumer: d-2 keeps it
    assert not service.has_released()
    service.release(release("r", consumer="d-2"))
    assert service.sweep().released == ["r"]


def test_counters(service, clock):
    service.grant("r", num_consumers=1)
    service.renew(proto.LeaseRenew(engine_id="d", request_ids=["r", "ghost"]))
    clock.advance(10.0)
    service.sweep()
    assert service.counters() == LeaseCounters(
        num_live=0, num_heartbeats=2, num_late_messages=1, num_expired=1, num_renewals=1)


OWNER = Path("leases") / "service.py"


@pytest.mark.parametrize("path", sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                                        if p.relative_to(SRC) != OWNER))
def test_callers_use_the_owners_operations(path):
    """Only LeaseService touches the table and its lock."""
    text = (SRC / path).read_text(encoding="utf-8")
    reach = re.findall(r"(?<!vllm_pd_ext\.)leases\.(?:lock|table)\b|\.table\.\w+\(", text)
    assert not reach, f"vllm_pd_ext/{path} reaches into the lease owner: {reach}"
