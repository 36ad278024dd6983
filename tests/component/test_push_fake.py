"""Push mode's worker halves end to end over FakeTransport.

P: a real ``Pusher`` (ZMQ PULL on 127.0.0.1) over a ctypes buffer, fed
``WriteOrder``s through a PUSH socket; its lease releases go to a real
``SideChannelServer`` with a lease table (P's own side channel). D: a
FakeTransport over a numpy buffer, a ``PushReceiver``, and a second
``SideChannelServer`` standing for D's side channel: the worker never sends
to it (P's scheduler tells D of a failure once every rank settled). Every
message either server receives is logged in arrival order.
"""

from __future__ import annotations

import ctypes
import importlib.util
import itertools
import logging
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
from pdunit_utils import free_port, wait_for

from vllm_pd_ext.leases.service import LeaseService
from vllm_pd_ext.leases.table import LeaseState, LeaseTable
from vllm_pd_ext.transport import XferState
from vllm_pd_ext.transport.fake import FakeFabric, FakeTransport
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.side_channel import SideChannelServer
from vllm_pd_ext.wire.specs import PushRecvSpec
from vllm_pd_ext.worker.d_push import PushReceiver
from vllm_pd_ext.worker.p_push import Pusher

HOST = "127.0.0.1"
BLOCK = 256
NUM_BLOCKS = 12
LAYERS = 2
NBYTES = BLOCK * NUM_BLOCKS * LAYERS
SRC, DST = [5, 6, 7], [1, 2, 9]
#: D's agent, named as PDWorker names agents (``<engine id>-tp<rank>-<random>``).
D_AGENT = "eng-d-tp0-d1"
COMPAT = proto.CompatInfo(protocol_version=2, model="m", dtype="bfloat16", block_size=16,
                          kv_layout="LBHNC", num_layers=LAYERS, num_kv_heads=2, head_size=64,
                          tp_size=1, transfer_mode="push")


def regions(addr: int) -> list[proto.Region]:
    per_layer = BLOCK * NUM_BLOCKS
    return [proto.Region(addr + i * per_layer, BLOCK, BLOCK, NUM_BLOCKS) for i in range(LAYERS)]


class GatedTransport(FakeTransport):
    """A FakeTransport whose WRITEs stay PROC until ``gate`` is set; it
    records every peer it loads (``adds``)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.gate = threading.Event()
        self.gate.set()
        self.adds: list[str] = []
        #: When each poll of a WRITE happened (monotonic).
        self.poll_times: list[float] = []

    def add_peer(self, metadata, mem_type):
        name = super().add_peer(metadata, mem_type)
        self.adds.append(name)
        return name

    def poll(self, handle):
        self.poll_times.append(time.monotonic())
        if not self.gate.is_set():
            return XferState.PROC
        return super().poll(handle)


class Recorder:
    """Push handler for a SideChannelServer: logs what arrives, in order."""

    def __init__(self, log: list, lock: threading.Lock) -> None:
        self.log, self.lock = log, lock

    def handle(self, msg):
        with self.lock:
            self.log.append(msg)
        return proto.Ack()

    def on_release(self, msg):
        with self.lock:
            self.log.append(msg)


class Rig:
    def __init__(self) -> None:
        self.fabric = FakeFabric()
        self.p_buf = (ctypes.c_uint8 * NBYTES)()
        ctypes.memmove(self.p_buf, bytes((i * 7 + 3) % 251 for i in range(NBYTES)), NBYTES)
        self.p_addr = ctypes.addressof(self.p_buf)
        self.d_buf = np.zeros(NBYTES, dtype=np.uint8)
        self.d_addr = self.d_buf.ctypes.data
        # The test thread plays both workers' step threads (PDWorker enters
        # its own in register_kv_caches); the Pusher's thread enters itself.
        self.p_t = GatedTransport("p-agent", self.fabric)
        self.p_t.enter_thread()
        self.p_t.register([(self.p_addr, NBYTES)], "DRAM", 0)
        self.d_t = FakeTransport(D_AGENT, self.fabric)
        self.d_t.enter_thread()
        self.d_t.register([(self.d_addr, NBYTES)], "DRAM", 0)
        self.receiver = PushReceiver(self.d_t)
        self.log: list = []
        lock = threading.Lock()
        self.leases = LeaseService(LeaseTable(30.0, time.monotonic))
        self.p_port, self.d_port = free_port(), free_port()
        self.p_server = SideChannelServer(HOST, self.p_port, "eng-p", COMPAT, {}, self.leases,
                                          push=Recorder(self.log, lock))
        self.d_server = SideChannelServer(HOST, self.d_port, "eng-d", COMPAT, {}, None,
                                          push=Recorder(self.log, lock))
        self.writes: list[tuple[int, int, int, float]] = []
        self.pusher = Pusher("eng-p", 0, self.p_t, regions(self.p_addr), (HOST, self.p_port),
                             transfer_timeout_s=5.0, notify_timeout_s=2.0,
                             on_write=lambda *a: self.writes.append(a))
        self.ctx = zmq.Context()
        self.orders = self.ctx.socket(zmq.PUSH)
        self.orders.connect(self.pusher.endpoint)

    def agent(self, d_regions=None) -> proto.AgentInfo:
        return proto.AgentInfo(tp_rank=0, agent_name=D_AGENT, agent_metadata=D_AGENT.encode(),
                               mem_type="DRAM", regions=d_regions or regions(self.d_addr))

    def order(self, pd_id="pd1", post_in=30.0, **kw) -> proto.WriteOrder:
        self.leases.grant(pd_id, 1)
        self.leases.hold(pd_id)
        fields = dict(pd_request_id=pd_id, request_id="p-req", d_engine_id="eng-d",
                      d_request_id="d-req", notify_host=HOST, notify_port=self.d_port,
                      agent=self.agent(), src_block_ids=SRC, dst_block_ids=DST,
                      post_before=time.monotonic() + post_in)
        fields.update(kw)
        order = proto.WriteOrder(**fields)
        self.orders.send(proto.encode_order(order))
        return order

    def lease(self, pd_id="pd1"):
        with self.leases.lock:
            return self.leases.table.get(pd_id)

    def messages(self, kind: type) -> list:
        return [m for m in list(self.log) if isinstance(m, kind)]

    def p_block(self, layer: int, b: int) -> bytes:
        return ctypes.string_at(regions(self.p_addr)[layer].base_addr + b * BLOCK, BLOCK)

    def d_block(self, layer: int, b: int) -> bytes:
        off = layer * BLOCK * NUM_BLOCKS + b * BLOCK
        return self.d_buf[off:off + BLOCK].tobytes()

    def assert_untouched(self) -> None:
        assert not self.d_buf.any()
        assert self.d_t.take_notifs() == []

    def close(self) -> None:
        self.orders.close(linger=0)
        self.ctx.term()
        self.pusher.close()
        self.p_server.close()
        self.d_server.close()


@pytest.fixture
def rig():
    r = Rig()
    yield r
    r.close()
    # Every transport call came from a thread that ran the thread hook.
    assert r.p_t.unhooked_calls == [] == r.d_t.unhooked_calls


def spec(pd_id="pd1", token="") -> PushRecvSpec:
    return PushRecvSpec(request_id="d-req", pd_request_id=pd_id, local_block_ids=DST,
                        num_tokens=48, notif_token=token)


def assert_failed(rig: Rig, pd_id: str, detail: str) -> None:
    """P's worker released its lease share with ok=False and the reason (only
    after the WRITE's handle was released); it sends nothing to D itself."""
    assert wait_for(lambda: rig.messages(proto.LeaseRelease))
    [release] = rig.messages(proto.LeaseRelease)
    assert release.request_ids == [pd_id] and release.ok is False and release.tp_rank == 0
    assert detail in release.reason
    time.sleep(0.05)
    assert rig.messages(proto.PushResult) == []
    assert rig.lease(pd_id).state is LeaseState.RELEASED
    assert rig.lease(pd_id).release_ok is False


def test_write_lands_before_receiver_reports(rig):
    rig.receiver.expect(spec(), time.monotonic())
    rig.p_t.gate.clear()
    rig.order()
    assert wait_for(lambda: rig.pusher.num_in_flight == 1)
    # Posted but not landed: D has neither bytes nor a notification.
    for _ in range(5):
        assert rig.receiver.collect(time.monotonic()) == []
        time.sleep(0.01)
    assert not rig.d_buf.any() and rig.messages(proto.LeaseRelease) == []
    rig.p_t.gate.set()
    landed: list = []
    assert wait_for(lambda: landed.extend(rig.receiver.collect(time.monotonic())) or landed)
    [got] = landed
    assert got.spec == spec() and got.wait_s >= 0.05
    assert rig.receiver.num_waiting == 0
    for layer in range(LAYERS):
        for b in range(NUM_BLOCKS):
            want = rig.p_block(layer, SRC[DST.index(b)]) if b in DST else bytes(BLOCK)
            assert rig.d_block(layer, b) == want, (layer, b)
    # [5,6]->[1,2] and [7]->[9]: two runs per layer.
    assert rig.p_t.num_posts == 1 and rig.p_t.num_descriptors == 2 * LAYERS
    assert wait_for(lambda: rig.messages(proto.LeaseRelease))
    [release] = rig.messages(proto.LeaseRelease)
    assert release.ok is True and release.request_ids == ["pd1"] and release.tp_rank == 0
    assert release.engine_id == "eng-p"
    assert rig.lease().state is LeaseState.RELEASED and rig.lease().release_ok
    assert rig.messages(proto.PushResult) == []  # success is only the notification
    assert rig.writes and rig.writes[0][:3] == (3 * BLOCK * LAYERS, 2 * LAYERS, 3)
    assert rig.pusher.num_in_flight == 0 and rig.p_t.live_handles == {}


def poll_gaps(rig: Rig, count: int = 40, deadline_s: float = 10.0) -> list[float]:
    """The gaps between the push thread's next ``count`` + 1 polls of the
    in-flight WRITE, sorted. Counted, not timed: a CI machine that
    deschedules this process for 200 ms costs one long gap, not the sample."""
    start = len(rig.p_t.poll_times)
    assert wait_for(lambda: len(rig.p_t.poll_times) - start > count, timeout=deadline_s), \
        len(rig.p_t.poll_times) - start
    times = rig.p_t.poll_times[start:start + count + 1]
    return sorted(b - a for a, b in itertools.pairwise(times))


def test_a_completed_write_is_logged_as_the_benchmark_reads_it(rig, caplog):
    """``benchmarks/bench_idle_ab.py`` times a concurrent push's bytes from
    this log line (D's record cannot tell the WRITE from P's prefill): its
    pattern must keep matching it."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_idle_ab.py"
    spec = importlib.util.spec_from_file_location("bench_idle_ab", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with caplog.at_level(logging.INFO, logger="vllm.pd_ext"):
        rig.order()
        assert wait_for(lambda: rig.messages(proto.LeaseRelease))
        assert wait_for(lambda: any("pushed" in r.getMessage() for r in caplog.records))
    [line] = [r.getMessage() for r in caplog.records if "pushed" in r.getMessage()]
    m = bench.PUSHED.search(line)
    assert m is not None, line
    assert m[1] == "pd1" and 0 <= float(m[2]) < 60_000


def test_in_flight_write_is_progressed_faster_than_once_a_millisecond(rig):
    """On one host UCX moves a WRITE and its notification only while P
    progresses it: the push thread must not wait out the socket poll's 1 ms
    floor between rounds (it did, and D saw each notification later). A
    WRITE in flight past ``fast_progress_s`` (large, or a dead D) goes back
    to a round per millisecond, so a stuck peer does not keep P's core busy."""
    rig.pusher.fast_progress_s = 60.0  # young for the whole first sample
    rig.p_t.gate.clear()
    rig.order()
    assert wait_for(lambda: rig.pusher.num_in_flight == 1)
    young = poll_gaps(rig)
    rig.pusher.fast_progress_s = 0.0  # the same WRITE is now old
    poll_gaps(rig, count=3)  # let a round that began young end
    old = poll_gaps(rig)
    rig.p_t.gate.set()
    assert wait_for(lambda: rig.messages(proto.LeaseRelease))
    # Medians: robust to the preemptions a loaded CI machine brings.
    assert young[len(young) // 2] < 0.5e-3, young[len(young) // 2]
    assert old[len(old) // 2] > 0.8e-3, old[len(old) // 2]


def test_notification_before_spec_is_kept(rig):
    rig.order()
    assert wait_for(lambda: rig.messages(proto.LeaseRelease))
    assert rig.receiver.collect(time.monotonic()) == []  # nobody waits for it yet
    rig.receiver.expect(spec(), time.monotonic())
    [got] = rig.receiver.collect(time.monotonic())
    assert got.spec.request_id == "d-req"
    assert rig.d_block(0, 9) == rig.p_block(0, 7)


def test_only_a_notification_with_the_registrations_token_counts(rig):
    """Issue 12 item 3: a WRITE notification counts only if it echoes the
    token D sent the P it registered with; another sender's (forged, or
    another P's for the same id) is dropped and D keeps waiting."""
    rig.receiver.expect(spec(token="c0ffee"), time.monotonic())
    rig.d_t.notifs.append(proto.push_notif("pd1", "bad"))
    rig.d_t.notifs.append(proto.push_notif("pd1"))
    assert rig.receiver.collect(time.monotonic()) == []
    assert rig.receiver.num_waiting == 1 and rig.receiver.num_foreign == 2
    rig.order(notif_token="c0ffee")
    landed: list = []
    assert wait_for(lambda: landed.extend(rig.receiver.collect(time.monotonic())) or landed)
    assert landed[0].spec.notif_token == "c0ffee"
    assert rig.d_block(0, 9) == rig.p_block(0, 7)


def test_the_write_carries_token_one_and_only_the_registered_ps_counts(rig):
    """Issue 29 (``pd_seed_pending``): P's order names its token #1, the
    WRITE's notification carries it, and D's receiver lands it with the
    KV. A forged notification (wrong token) cannot plant another seed."""
    rig.receiver.expect(spec(token="c0ffee"), time.monotonic())
    rig.d_t.notifs.append(proto.push_notif("pd1", "bad", seed=666))
    rig.order(notif_token="c0ffee", seed=4242)
    landed: list = []
    assert wait_for(lambda: landed.extend(rig.receiver.collect(time.monotonic())) or landed)
    [got] = landed
    assert got.seed == 4242 and rig.receiver.num_foreign == 1
    assert rig.d_block(0, 9) == rig.p_block(0, 7)
    # Without one (an order for a D that did not ask), the landing says so.
    rig.receiver.expect(spec(pd_id="pd2", token="beef"), time.monotonic())
    rig.order("pd2", notif_token="beef")
    landed.clear()
    assert wait_for(lambda: landed.extend(rig.receiver.collect(time.monotonic())) or landed)
    assert landed[0].seed == -1


def test_notif_seed_reads_only_a_well_formed_seed():
    assert proto.push_notif("pd", "ab", seed=7) == b"pdx:ab+7/pd"
    assert proto.push_notif("pd", "ab", 1, 2, seed=7) == b"pdx:ab.1.2+7/pd"
    assert proto.push_notif("pd", "ab") == b"pdx:ab/pd"
    assert proto.notif_seed("ab+7") == ("ab", 7)
    assert proto.notif_seed("ab.1.2+0") == ("ab.1.2", 0)
    assert proto.notif_seed("ab") == ("ab", -1)
    # Malformed: the tag keeps it, and then matches no registration's token.
    for bad in ("ab+", "ab+-1", "ab+1e3", "ab+99999999999", f"ab+{2**31}", "ab+ 1"):
        assert proto.notif_seed(bad) == (bad, -1), bad


def test_failed_post_reports_and_releases(rig):
    rig.receiver.expect(spec(), time.monotonic())
    rig.p_t.fail_post = True
    rig.order()
    assert_failed(rig, "pd1", "could not be posted")
    rig.assert_untouched()
    assert rig.receiver.collect(time.monotonic()) == []
    assert D_AGENT not in rig.p_t.peers  # a failed peer is dropped
    # The next order re-adds the peer and goes through.
    rig.p_t.fail_post = False
    rig.order("pd2")
    assert wait_for(lambda: len(rig.messages(proto.LeaseRelease)) == 2)
    assert rig.messages(proto.LeaseRelease)[1].ok is True
    assert rig.d_block(1, 1) == rig.p_block(1, 5)


@pytest.mark.parametrize("write_fails", [False, True], ids=["done", "err"])
def test_unreleasable_handle_holds_both_sides(rig, write_fails):
    rig.p_t.fail_release = True
    rig.p_t.fail_poll = write_fails
    rig.order()
    assert wait_for(lambda: rig.p_t.num_posts == 1)
    time.sleep(0.3)  # many push-thread iterations
    assert rig.log == []
    assert rig.pusher.num_in_flight == 1
    assert rig.lease().state is LeaseState.WRITING
    rig.p_t.fail_release = False
    if write_fails:
        assert_failed(rig, "pd1", "NIXL reported an error")
    else:
        assert wait_for(lambda: rig.messages(proto.LeaseRelease))
        assert rig.messages(proto.LeaseRelease)[0].ok is True
        assert rig.messages(proto.PushResult) == []
    assert rig.pusher.num_in_flight == 0


def test_order_past_its_window_is_never_posted(rig):
    rig.order(post_in=-1.0)
    assert_failed(rig, "pd1", "window closed")
    assert rig.p_t.num_posts == 0
    rig.assert_untouched()


@pytest.mark.parametrize("bad", ["block_len", "count"])
def test_region_layout_mismatch(rig, bad):
    good = regions(rig.d_addr)
    if bad == "block_len":
        d_regions = [proto.Region(r.base_addr, BLOCK, BLOCK // 2, NUM_BLOCKS) for r in good]
    else:
        d_regions = good[:1]
    rig.order(agent=rig.agent(d_regions))
    assert_failed(rig, "pd1", "layout differs")
    assert rig.p_t.num_posts == 0
    rig.assert_untouched()


def test_malformed_order_dropped_thread_survives(rig):
    rig.orders.send(b"\x00garbage")
    rig.order()
    assert wait_for(lambda: rig.messages(proto.LeaseRelease))
    assert rig.messages(proto.LeaseRelease)[0].ok is True


def releases(rig: Rig, pd_id: str) -> list[proto.LeaseRelease]:
    return [m for m in rig.messages(proto.LeaseRelease) if m.request_ids == [pd_id]]


def test_failed_write_keeps_an_agent_other_writes_use_until_they_end(rig):
    """A failed post marks the agent failed; it is removed only once the
    other WRITE to it ended, never under it."""
    rig.p_t.gate.clear()
    rig.order("pd1")
    assert wait_for(lambda: rig.pusher.num_in_flight == 1)
    rig.p_t.fail_post = True
    rig.order("pd2")
    assert wait_for(lambda: releases(rig, "pd2"))
    assert D_AGENT in rig.p_t.peers  # pd1's WRITE still uses it
    rig.p_t.fail_post = False
    rig.p_t.gate.set()
    assert wait_for(lambda: releases(rig, "pd1"))
    assert releases(rig, "pd1")[0].ok is True
    assert wait_for(lambda: D_AGENT not in rig.p_t.peers)
    assert rig.pusher.num_peers == 0


# --------------------------------------------------- D agents: cache poisoning
EVIL = "eng-x-tp0-evil"  # another engine's agent, with its own memory


@pytest.mark.parametrize("claim", [
    "real-name-other-metadata",
    "other-name-real-metadata",
    "other-name-other-metadata",
    "other-engines-agent",
    "real-name-other-layout",
])
def test_an_order_whose_agent_is_not_what_it_claims_fails_alone(rig, claim):
    """An order naming the real D's engine but another agent (or the real
    agent's name with another's metadata) fails only itself: the real
    agent stays loaded, and later WRITEs for the real D reach it."""
    rig.order("pd1")
    assert wait_for(lambda: releases(rig, "pd1"))
    assert releases(rig, "pd1")[0].ok is True and rig.p_t.adds == [D_AGENT]
    evil_buf = np.zeros(NBYTES, dtype=np.uint8)
    evil_t = FakeTransport(EVIL, rig.fabric)
    evil_t.enter_thread()
    evil_t.register([(evil_buf.ctypes.data, NBYTES)], "DRAM", 0)
    real_regions, evil_regions = regions(rig.d_addr), regions(evil_buf.ctypes.data)
    half = [proto.Region(r.base_addr, BLOCK, BLOCK // 2, NUM_BLOCKS) for r in real_regions]
    name, metadata, d_regions, want = {
        "real-name-other-metadata": (D_AGENT, EVIL.encode(), evil_regions,
                                     f"names D agent '{D_AGENT}' with other metadata"),
        "other-name-real-metadata": ("eng-d-tp0-other", D_AGENT.encode(), real_regions,
                                     f"names D agent 'eng-d-tp0-other' but its NIXL metadata "
                                     f"is agent '{D_AGENT}'"),
        "other-name-other-metadata": ("eng-d-tp0-other", EVIL.encode(), evil_regions,
                                      f"names D agent 'eng-d-tp0-other' but its NIXL metadata "
                                      f"is agent '{EVIL}'"),
        "other-engines-agent": (EVIL, EVIL.encode(), evil_regions,
                                f"D agent '{EVIL}' is not engine eng-d's"),
        "real-name-other-layout": (D_AGENT, D_AGENT.encode(), half,
                                   f"names D agent '{D_AGENT}' with other metadata"),
    }[claim]
    bad = proto.AgentInfo(tp_rank=0, agent_name=name, agent_metadata=metadata,
                          mem_type="DRAM", regions=d_regions)
    rig.order("pd2", agent=bad)
    assert wait_for(lambda: releases(rig, "pd2"))
    [failed] = releases(rig, "pd2")
    assert failed.ok is False and want in failed.reason, failed.reason
    # The real agent was neither evicted nor replaced; nothing else stays loaded.
    assert rig.p_t.peers == {D_AGENT} and rig.pusher.num_peers == 1
    assert rig.p_t.adds.count(D_AGENT) == 1
    rig.d_buf[:] = 0
    rig.order("pd3")
    assert wait_for(lambda: releases(rig, "pd3"))
    assert releases(rig, "pd3")[0].ok is True
    assert rig.d_block(0, 9) == rig.p_block(0, 7) and rig.d_block(1, 1) == rig.p_block(1, 5)
    assert rig.p_t.adds.count(D_AGENT) == 1  # the cached agent, not a reload
    assert not evil_buf.any() and evil_t.take_notifs() == []


# ------------------------------------------------- the push thread outlives bugs
def test_a_stats_callback_bug_still_releases_the_lease(rig):
    def boom(*_):
        raise RuntimeError("injected")

    rig.pusher._on_write = boom
    rig.order()
    assert wait_for(lambda: rig.messages(proto.LeaseRelease))
    assert rig.messages(proto.LeaseRelease)[0].ok is True


def test_a_poll_that_raises_fails_only_its_write(rig, monkeypatch):
    real = rig.p_t.poll
    calls: list[int] = []

    def flaky(handle):
        calls.append(handle)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real(handle)

    monkeypatch.setattr(rig.p_t, "poll", flaky)
    rig.order("pd1")
    assert wait_for(lambda: releases(rig, "pd1"))
    [failed] = releases(rig, "pd1")
    assert failed.ok is False and "NIXL reported an error" in failed.reason
    rig.order("pd2")
    assert wait_for(lambda: releases(rig, "pd2"))
    assert releases(rig, "pd2")[0].ok is True
    assert rig.pusher.num_in_flight == 0


def test_push_thread_survives_an_error_outside_any_order(rig, monkeypatch):
    real = proto.decode_order
    calls: list[bytes] = []

    def flaky(data):
        calls.append(data)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real(data)

    monkeypatch.setattr(proto, "decode_order", flaky)
    rig.orders.send(b"whatever")
    rig.order()
    assert wait_for(lambda: rig.messages(proto.LeaseRelease))
    assert rig.messages(proto.LeaseRelease)[0].ok is True
