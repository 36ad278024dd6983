"""Real NIXL WRITE with a notification (push mode) between two processes.

The target (a spawned child, ``nixl_peer.serve_write_target``) registers a
zeroed buffer, runs NixlTransport's progress pump and collects notifications
with ``take_notifs``; this process is P: it posts the WRITE, polls it to the
end, releases the handle and then does nothing more, as P's push thread does.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import time

import pytest

pytest.importorskip("nixl")

import nixl_peer

from vllm_pd_ext import protocol as proto
from vllm_pd_ext.coalesce import build_descriptors
from vllm_pd_ext.protocol import Region
from vllm_pd_ext.transport import TransportError, XferState
from vllm_pd_ext.transport.nixl import NixlTransport

pytestmark = pytest.mark.nixl

BLOCK = 4096
NUM_BLOCKS = 16
LAYERS = 2
NBYTES = BLOCK * NUM_BLOCKS * LAYERS
SRC, DST = [5, 6, 7], [1, 2, 9]


def regions(addr: int) -> list[Region]:
    per_layer = BLOCK * NUM_BLOCKS
    return [Region(addr + i * per_layer, BLOCK, BLOCK, NUM_BLOCKS) for i in range(LAYERS)]


class WriteTarget:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=nixl_peer.serve_write_target, args=(child, NBYTES),
                                daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(60):
            raise TimeoutError("NIXL write target did not start within 60 s")
        self.metadata, self.addr, self.nbytes = self.conn.recv()

    def notifs(self, timeout: float) -> tuple[list[bytes], bytes]:
        self.conn.send(("notifs", timeout))
        assert self.conn.poll(timeout + 30)
        return self.conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):
                self.conn.send("stop")
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self.conn.close()


@pytest.fixture
def target():
    t = WriteTarget()
    yield t
    t.stop()


@pytest.fixture
def pusher():
    buf = (ctypes.c_uint8 * NBYTES)()
    ctypes.memmove(buf, nixl_peer.pattern(NBYTES), NBYTES)
    t = NixlTransport(f"pusher-{os.getpid()}-{time.monotonic_ns()}", ["UCX"],
                      progress_thread=False)
    t.register([(ctypes.addressof(buf), NBYTES)], "DRAM", 0)
    t.buf = buf
    t.addr = ctypes.addressof(buf)
    yield t
    t.close()


def write(t: NixlTransport, peer: str, descs, notif: bytes, timeout: float = 20.0) -> XferState:
    handle = t.post_write(peer, descs, 0, notif)
    deadline = time.monotonic() + timeout
    state = t.poll(handle)
    while state is XferState.PROC and time.monotonic() < deadline:
        time.sleep(0.0005)
        state = t.poll(handle)
    if state is not XferState.PROC:
        assert t.release(handle)
    return state


def expected_target(pusher_addr: int, target_addr: int, descs) -> bytes:
    """The target's buffer after ``descs`` were written into zeroes."""
    want = bytearray(NBYTES)
    ref = nixl_peer.pattern(NBYTES)
    for loc, rem, n in descs:
        src, dst = loc - pusher_addr, rem - target_addr
        want[dst:dst + n] = ref[src:src + n]
    return bytes(want)


def test_write_lands_before_its_notification(target, pusher):
    peer = pusher.add_peer(target.metadata)
    descs = build_descriptors(SRC, DST, regions(pusher.addr), regions(target.addr))
    assert len(descs) == 2 * LAYERS  # [5,6]->[1,2] and [7]->[9] per layer
    assert write(pusher, peer, descs, proto.push_notif("pd-1")) is XferState.DONE
    notifs, snapshot = target.notifs(timeout=20.0)
    assert notifs == [b"pdx:pd-1"]
    assert proto.parse_push_notif(notifs[0]) == "pd-1"
    # Taken as soon as the notification was seen: every byte already landed,
    # and nothing outside the destination blocks was touched.
    want = expected_target(pusher.addr, target.addr, descs)
    assert snapshot == want
    per_layer = BLOCK * NUM_BLOCKS
    assert snapshot[9 * BLOCK:10 * BLOCK] == nixl_peer.pattern(NBYTES)[7 * BLOCK:8 * BLOCK]
    assert snapshot[per_layer + BLOCK:per_layer + 3 * BLOCK] == (
        nixl_peer.pattern(NBYTES)[per_layer + 5 * BLOCK:per_layer + 7 * BLOCK])
    # Each notification is taken once.
    assert target.notifs(timeout=0.2)[0] == []


def test_write_to_unregistered_range_fails(target, pusher):
    peer = pusher.add_peer(target.metadata)
    outside = target.addr + target.nbytes + (1 << 20)
    for bad in ([(pusher.addr, outside, BLOCK)],
                [(pusher.addr, target.addr + target.nbytes - BLOCK, 2 * BLOCK)]):
        try:
            state = write(pusher, peer, bad, b"pdx:bad", timeout=10.0)
        except TransportError:
            continue
        assert state is XferState.ERR
    # The transport still works, and only the good WRITE's notification arrives.
    good = [(pusher.addr, target.addr, BLOCK)]
    assert write(pusher, peer, good, b"pdx:good") is XferState.DONE
    notifs, snapshot = target.notifs(timeout=20.0)
    assert notifs == [b"pdx:good"]
    assert snapshot == expected_target(pusher.addr, target.addr, good)
    assert target.notifs(timeout=0.5)[0] == []
