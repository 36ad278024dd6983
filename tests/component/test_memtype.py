"""Memory type end to end, the thread hook, and ``kv_buffer_device`` (issue 25).

- the fake transport holds a post to the memory type and device the peer
  registered, as NIXL would;
- a peer whose KV is in another memory type (DRAM vs VRAM) is refused, in
  pull at the handshake and in push at the WRITE order, naming both types;
- every thread that calls the transport ran the worker's thread hook (the
  fake refuses any other call; the harnesses of ``test_worker_fake``,
  ``test_pull_isolation`` and ``test_push_fake`` assert none happened);
- ``kv_buffer_device`` that names memory the KV is not in stops startup.
"""

from __future__ import annotations

import ctypes
import threading
from types import SimpleNamespace

import msgspec
import pytest
from test_push_fake import Rig, assert_failed
from test_worker_fake import HOST, Pair, drive, fake_vllm_config, kv_tensors

from vllm_pd_ext.config import ConfigError, PDConfig
from vllm_pd_ext.metadata import PDConnectorMetadata
from vllm_pd_ext.policy import FailureReason
from vllm_pd_ext.transport import TransportError
from vllm_pd_ext.transport.fake import FakeFabric, FakeTransport
from vllm_pd_ext.wire.side_channel import SideChannelServer
from vllm_pd_ext.worker import device
from vllm_pd_ext.worker.dispatcher import PDWorker

NBYTES = 4096


@pytest.fixture
def two():
    """Two fake agents on one fabric, each with one registered buffer."""
    fabric = FakeFabric()
    bufs = [(ctypes.c_uint8 * NBYTES)() for _ in range(2)]
    a, b = FakeTransport("a", fabric), FakeTransport("b", fabric)
    a.enter_thread()
    b.enter_thread()
    a.register([(ctypes.addressof(bufs[0]), NBYTES)], "DRAM", 0)
    b.register([(ctypes.addressof(bufs[1]), NBYTES)], "DRAM", 0)
    descs = [(ctypes.addressof(bufs[0]), ctypes.addressof(bufs[1]), 64)]
    yield a, b, descs
    del bufs


def test_fake_records_each_registration(two):
    a, _, descs = two
    [reg] = a.registrations
    assert (reg.addr, reg.nbytes, reg.mem_type, reg.device_id) == (descs[0][0], NBYTES,
                                                                    "DRAM", 0)
    assert (a.mem_type, a.device_id) == ("DRAM", 0)


def test_post_naming_the_peers_memory_type_wrongly_fails(two):
    a, _, descs = two
    peer = a.add_peer(b"b", "VRAM")  # b registered DRAM
    for post in (lambda: a.post_read(peer, descs, 0),
                 lambda: a.post_write(peer, descs, 0, b"n")):
        with pytest.raises(TransportError, match="registered as DRAM on device 0, but the "
                                                 "transfer names it VRAM on device 0"):
            post()
    assert a.num_posts == 0


def test_post_naming_the_peers_device_wrongly_fails(two):
    a, _, descs = two
    peer = a.add_peer(b"b", "DRAM")
    with pytest.raises(TransportError, match="DRAM on device 0, but the transfer names it "
                                             "DRAM on device 1"):
        a.post_read(peer, descs, 1)
    handle = a.post_read(peer, descs, 0)  # the registered memory: fine
    a.release(handle)


def test_a_call_from_a_thread_that_skipped_the_hook_is_refused(two):
    a, _, descs = two
    peer = a.add_peer(b"b", "DRAM")
    errors: list[BaseException] = []

    def rogue() -> None:
        try:
            a.post_read(peer, descs, 0)
        except AssertionError as exc:
            errors.append(exc)

    t = threading.Thread(target=rogue, name="rogue")
    t.start()
    t.join()
    assert len(errors) == 1 and "never ran enter_thread" in str(errors[0])
    assert a.unhooked_calls == [("post_read", "rogue")]


def test_pull_from_a_p_in_other_memory_is_refused_at_the_handshake():
    pair = Pair(serve=False)
    try:
        assert pair.p_worker.agent is not None
        vram = msgspec.structs.replace(pair.p_worker.agent, mem_type="VRAM")
        pair.server = SideChannelServer(HOST, pair.port, "eng-p", pair.p_worker.compat,
                                        {0: vram}, pair.leases)
        pair.grant()
        _, _, failed = drive(pair.d_worker, PDConnectorMetadata(
            reqs_to_recv=[pair.spec()]), {"d-req"})
        assert failed == {"d-req"}
        meta = pair.d_worker.build_worker_meta()
        assert meta is not None
        [record] = meta.records
        assert record.outcome == FailureReason.INCOMPATIBLE.value
        assert "in VRAM and ours in DRAM" in record.detail
        assert pair.d_transport.peers == set() and pair.d_transport.num_posts == 0
    finally:
        pair.close()


def test_pull_runs_every_transport_call_on_a_hooked_thread():
    pair = Pair()
    try:
        pair.grant()
        _, recving, _ = drive(pair.d_worker, PDConnectorMetadata(reqs_to_recv=[pair.spec()]),
                              {"d-req"})
        assert recving == {"d-req"}
        # The step thread (register, add_peer, poll, release) and the poster.
        assert {threading.current_thread().name, "pd-post_0"} <= (
            pair.d_transport.entered_threads)
        assert pair.d_transport.num_posts == 1
    finally:
        pair.close()
    assert pair.d_transport.unhooked_calls == [] == pair.p_transport.unhooked_calls


def test_push_to_a_d_in_other_memory_is_refused_naming_both_types():
    rig = Rig()
    try:
        rig.order(agent=msgspec.structs.replace(rig.agent(), mem_type="VRAM"))
        assert_failed(rig, "pd1", "in VRAM and ours in DRAM")
        assert rig.p_t.num_posts == 0 and rig.p_t.peers == set()
        assert "pd-push" in rig.p_t.entered_threads
    finally:
        rig.close()
    assert rig.p_t.unhooked_calls == []


def test_worker_installs_the_hook_for_its_memory():
    ran: list[str] = []
    transport = FakeTransport("eng-d-tp0-fake", FakeFabric())
    orig = transport.set_thread_hook

    def spy(hook):
        orig(lambda: (hook(), ran.append(threading.current_thread().name)))

    transport.set_thread_hook = spy  # type: ignore[method-assign]
    worker = PDWorker(fake_vllm_config("eng-d", False), PDConfig(), transport=transport,
                      tp_rank=0)
    worker.register_kv_caches(kv_tensors("zero"))
    try:
        assert ran == [threading.current_thread().name]  # before register, on this thread
        assert transport.registrations[0].mem_type == "DRAM"
    finally:
        worker.shutdown()


def test_thread_hook_sets_the_cuda_device_only_for_vram(monkeypatch):
    import torch

    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    device.thread_hook(device.KVMemory("DRAM", 0))()
    assert calls == []
    device.thread_hook(device.KVMemory("VRAM", 3))()
    assert calls == [3]


def test_a_failing_hook_is_logged_and_the_thread_goes_on(caplog):
    t = FakeTransport("x", FakeFabric())

    def broken() -> None:
        raise RuntimeError("no such device")

    t.set_thread_hook(broken)
    t.enter_thread()
    assert "thread hook failed" in caplog.text
    t.register([], "DRAM", 0)  # the thread still counts as entered


def cuda_tensor(index: int | None):
    return SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=index))


@pytest.mark.parametrize("value, tensor, ok", [
    (None, kv_tensors("zero", layers=1)["layer.0"], True),
    ("cpu", kv_tensors("zero", layers=1)["layer.0"], True),
    ("cuda", kv_tensors("zero", layers=1)["layer.0"], False),
    ("cuda", cuda_tensor(1), True),
    ("cuda:1", cuda_tensor(1), True),
    ("cpu", cuda_tensor(1), False),
    ("xpu", cuda_tensor(None), False),
])
def test_kv_buffer_device(value, tensor, ok):
    mem = device.kv_memory(tensor)
    if ok:
        device.check_kv_buffer_device(value, mem)
        return
    with pytest.raises(ConfigError) as info:
        device.check_kv_buffer_device(value, mem)
    msg = str(info.value)
    assert f"kv_buffer_device={value!r}" in msg and mem.describe() in msg
    assert "supports only kv_buffer_device=" in msg and "not implemented" in msg


def test_cpu_kv_buffer_on_a_cuda_kv_cache_stops_register_kv_caches(monkeypatch):
    cfg = fake_vllm_config("eng-d", False)
    cfg.kv_transfer_config.kv_buffer_device = "cpu"
    transport = FakeTransport("eng-d-tp0-fake", FakeFabric())
    worker = PDWorker(cfg, PDConfig(), transport=transport, tp_rank=0)
    monkeypatch.setattr(device, "kv_memory", lambda t: device.KVMemory("VRAM", 0))
    with pytest.raises(ConfigError, match=r"kv_buffer_device='cpu'.*\(cuda:0\).*"
                                          r"supports only kv_buffer_device='cuda'"):
        worker.register_kv_caches(kv_tensors("zero"))
    assert transport.registrations == []  # refused before anything was registered


def test_cpu_kv_buffer_on_a_cpu_engine_keeps_working():
    cfg = fake_vllm_config("eng-d", False)
    cfg.kv_transfer_config.kv_buffer_device = "cpu"
    transport = FakeTransport("eng-d-tp0-fake", FakeFabric())
    worker = PDWorker(cfg, PDConfig(), transport=transport, tp_rank=0)
    worker.register_kv_caches(kv_tensors("zero"))
    try:
        assert worker.agent is not None and worker.agent.mem_type == "DRAM"
    finally:
        worker.shutdown()
