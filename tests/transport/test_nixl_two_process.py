"""Real NIXL (UCX over loopback) between two processes.

The target (a spawned child, ``nixl_peer.serve``) registers a patterned
buffer and runs NixlTransport's progress pump; this process is the
initiator. Without the target's pump the first READ from a new peer never
completes (UCX wire-up needs target progress), so every target pumps.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import time

import pytest

pytest.importorskip("nixl")

import nixl_peer

from vllm_pd_ext.transport import TransportError, XferState
from vllm_pd_ext.transport.coalesce import build_descriptors
from vllm_pd_ext.transport.nixl import NixlTransport
from vllm_pd_ext.wire.protocol import Region

pytestmark = pytest.mark.nixl

BLOCK = 4096
NUM_BLOCKS = 32
LAYERS = 2
NBYTES = BLOCK * NUM_BLOCKS * LAYERS


class Target:
    def __init__(self, pump: bool = True) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=nixl_peer.serve, args=(child, NBYTES, pump), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(60):
            raise TimeoutError("NIXL target did not start within 60 s")
        self.metadata, self.addr, self.nbytes = self.conn.recv()

    def regions(self) -> list[Region]:
        per_layer = BLOCK * NUM_BLOCKS
        return [Region(self.addr + i * per_layer, BLOCK, BLOCK, NUM_BLOCKS) for i in range(LAYERS)]

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):
                self.conn.send("stop")
            self.proc.join(10)
        if self.proc.is_alive():
            self.kill()
        self.conn.close()


class Initiator:
    def __init__(self) -> None:
        self.buf = (ctypes.c_uint8 * NBYTES)()
        self.addr = ctypes.addressof(self.buf)
        self.t = NixlTransport(f"initiator-{os.getpid()}-{time.monotonic_ns()}", ["UCX"],
                               progress_thread=False)
        self.t.register([(self.addr, NBYTES)], "DRAM", 0)

    def regions(self) -> list[Region]:
        per_layer = BLOCK * NUM_BLOCKS
        return [Region(self.addr + i * per_layer, BLOCK, BLOCK, NUM_BLOCKS) for i in range(LAYERS)]

    def read(self, peer: str, descs, timeout: float = 20.0) -> XferState:
        handle = self.t.post_read(peer, descs, 0)
        deadline = time.monotonic() + timeout
        state = self.t.poll(handle)
        while state is XferState.PROC and time.monotonic() < deadline:
            time.sleep(0.0005)
            state = self.t.poll(handle)
        if state is not XferState.PROC:
            assert self.t.release(handle)
        return state

    def bytes_at(self, addr: int, n: int) -> bytes:
        return ctypes.string_at(addr, n)


@pytest.fixture
def target():
    t = Target()
    yield t
    t.stop()


@pytest.fixture
def initiator():
    i = Initiator()
    yield i
    i.t.close()


def test_read_coalesced_ranges(target, initiator):
    peer = initiator.t.add_peer(target.metadata, "DRAM")
    assert isinstance(peer, str) and peer
    local_ids = [0, 1, 2, 10, 11, 20]
    remote_ids = [5, 6, 7, 3, 4, 31]
    descs = build_descriptors(local_ids, remote_ids, initiator.regions(), target.regions())
    assert len(descs) == 3 * LAYERS  # three runs per layer, coalesced
    assert initiator.read(peer, descs) is XferState.DONE
    ref = nixl_peer.pattern(NBYTES)
    for loc, rem, n in descs:
        off = rem - target.addr
        assert initiator.bytes_at(loc, n) == ref[off:off + n]
    # Untouched local blocks stay zero.
    zero_block = bytes(BLOCK)
    for layer, region in enumerate(initiator.regions()):
        for b in range(NUM_BLOCKS):
            if b not in local_ids:
                assert initiator.bytes_at(region.base_addr + b * BLOCK, BLOCK) == zero_block, (
                    layer, b)
    # A second READ over the established connection also completes.
    descs2 = build_descriptors(list(range(NUM_BLOCKS)), list(range(NUM_BLOCKS)),
                               initiator.regions(), target.regions())
    assert descs2 == [(initiator.addr, target.addr, NBYTES)]  # one slab, one descriptor
    assert initiator.read(peer, descs2) is XferState.DONE
    assert initiator.bytes_at(initiator.addr, NBYTES) == ref


def test_read_unregistered_remote_range_raises(target, initiator):
    peer = initiator.t.add_peer(target.metadata, "DRAM")
    outside = target.addr + target.nbytes + (1 << 20)
    with pytest.raises(TransportError):
        initiator.t.post_read(peer, [(initiator.addr, outside, BLOCK)], 0)
    # Straddling the end of the registration is refused too.
    with pytest.raises(TransportError):
        initiator.t.post_read(peer, [(initiator.addr, target.addr + target.nbytes - BLOCK,
                                      2 * BLOCK)], 0)
    # The transport still works for a valid range afterwards.
    assert initiator.read(peer, [(initiator.addr, target.addr, BLOCK)]) is XferState.DONE
    assert initiator.bytes_at(initiator.addr, BLOCK) == nixl_peer.pattern(BLOCK)


def test_unknown_peer_and_bad_metadata(initiator):
    with pytest.raises(TransportError):
        initiator.t.post_read("no-such-agent", [(initiator.addr, 0x1000, BLOCK)], 0)
    with pytest.raises(TransportError):
        initiator.t.add_peer(b"definitely not nixl metadata", "DRAM")


def test_killed_peer_fails_rather_than_hangs(target):
    """A READ from a SIGKILLed peer ends promptly in an error, never hangs.
    The initiator runs in a child of its own (nixl_peer.read_from_killed says
    why): UCX may abort while tearing down a worker whose peer died."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=nixl_peer.read_from_killed,
                       args=(child, target.metadata, target.addr, BLOCK), daemon=True)
    proc.start()
    child.close()
    try:
        assert conn.poll(60), "the initiator did not start"
        what, first, data = conn.recv()
        assert (what, first) == ("read", "DONE")
        assert data == nixl_peer.pattern(NBYTES)[:BLOCK]
        target.kill()
        assert not target.proc.is_alive()
        conn.send("killed")
        assert conn.poll(60), "READs from the killed peer hung"
        outcomes, elapsed, removed = conn.recv()
        assert elapsed < 30, outcomes
        assert all(o == "ERR" or o.startswith("TransportError") for o in outcomes), outcomes
        assert removed
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
