"""``vllm-pd-size --measure``: our own transport's effective bandwidth here.

Two processes on this host, as in a real handoff: a spawned child registers
a host buffer with NIXL (``NixlTransport``, UCX) and runs the progress pump
like a P in pull mode; this process READs from it with ``post_read`` and
``poll``, as D's worker does. Each message size is read ``reps`` times
(medians). The two largest sizes give the sustained bandwidth (the slope of
``t = setup + bytes / bandwidth``), the smallest the per-transfer setup
term, so the calculator adds the setup once, not twice.

It measures this host only (loopback, or the devices ``UCX_NET_DEVICES``
names); it does not measure a link to another host, and says so. Needs the
``nixl`` extra; nothing here is imported without ``--measure``.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from vllm_pd_ext.transport.base import XferState

DEFAULT_SIZES = (64 << 10, 4 << 20, 64 << 20)


@dataclass(frozen=True)
class Measurement:
    effective_bandwidth_gb_s: float
    setup_ms: float
    #: (bytes, median seconds) per size.
    points: list[tuple[int, float]]
    where: str


def _buffer(nbytes: int, cuda_device: int | None) -> tuple[Any, int, str, int]:
    """(owner, address, NIXL memory type, device id): host memory, or GPU
    memory on ``cuda_device`` (torch, imported only then)."""
    if cuda_device is None:
        buf = (ctypes.c_uint8 * nbytes)()
        return buf, ctypes.addressof(buf), "DRAM", 0
    import torch

    gpu = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{cuda_device}")
    return gpu, gpu.data_ptr(), "VRAM", cuda_device


def _target(conn: Any, nbytes: int, cuda_device: int | None = None) -> None:
    """The child: a registered, progressing READ target until told to stop."""
    sys.stdout = sys.stderr  # NIXL logs to stdout; stdout may be the caller's JSON
    from vllm_pd_ext.transport.nixl import NixlTransport

    _owner, addr, mem, dev = _buffer(nbytes, cuda_device)  # alive until we return
    t = NixlTransport(f"pd-size-target-{os.getpid()}", ["UCX"], progress_thread=False)
    t.register([(addr, nbytes)], mem, dev)
    t.start_progress_pump(0.001)
    conn.send((t.metadata(), addr))
    with contextlib.suppress(EOFError):
        conn.recv()
    t.close()


def measure(sizes: tuple[int, ...] = DEFAULT_SIZES, reps: int = 5,
            timeout_s: float = 60.0,
            cuda_devices: tuple[int, int] | None = None) -> Measurement:
    """Measure; NIXL's log lines (it writes them to stdout) go to stderr.
    ``cuda_devices`` (reader's GPU, target's GPU): GPU memory instead of host
    memory, as D reads P's KV on GPUs (the GPU check, testing/gpu_check.py)."""
    with contextlib.redirect_stdout(sys.stderr):
        return _measure(sizes, reps, timeout_s, cuda_devices)


def _measure(sizes: tuple[int, ...], reps: int, timeout_s: float,
             cuda_devices: tuple[int, int] | None = None) -> Measurement:
    if len(sizes) < 2 or len(set(sizes)) < 2:
        raise ValueError("measuring needs at least two different message sizes")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # never the external interface unasked
    from vllm_pd_ext.transport.nixl import NixlTransport

    largest = max(sizes)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    reader_gpu, target_gpu = cuda_devices if cuda_devices is not None else (None, None)
    proc = ctx.Process(target=_target, args=(child, largest, target_gpu), daemon=True)
    proc.start()
    _owner, local_addr, mem, dev = _buffer(largest, reader_gpu)  # alive until we return
    me = NixlTransport(f"pd-size-reader-{os.getpid()}", ["UCX"], progress_thread=False)
    try:
        if not parent.poll(timeout_s):
            raise RuntimeError("the NIXL target process did not start")
        metadata, remote = parent.recv()
        me.register([(local_addr, largest)], mem, dev)
        peer = me.add_peer(metadata, mem)  # both ends register the same type
        points = []
        for size in sorted(sizes):
            times = []
            for _ in range(reps + 1):  # the first read of each size warms the path up
                started = time.perf_counter()
                handle = me.post_read(peer, [(local_addr, remote, size)], target_gpu or 0)
                deadline = started + timeout_s
                while (state := me.poll(handle)) is XferState.PROC:
                    if time.perf_counter() > deadline:
                        raise RuntimeError(f"a {size}-byte READ did not finish in {timeout_s} s")
                elapsed = time.perf_counter() - started
                me.release(handle)
                if state is not XferState.DONE:
                    raise RuntimeError(f"a {size}-byte READ failed ({state.value})")
                times.append(elapsed)
            points.append((size, statistics.median(times[1:])))
    finally:
        parent.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        me.close()
    (s1, t1), (s2, t2) = points[-2], points[-1]
    slope = (t2 - t1) / (s2 - s1)
    if slope <= 0:  # noise: the larger read was not slower; take its plain rate
        slope = t2 / s2
    gb_s = 1 / slope / 1e9
    s0, t0 = points[0]
    setup_ms = max(0.0, (t0 - s0 * slope) * 1e3)
    devices = os.environ.get("UCX_NET_DEVICES", "")
    tls = os.environ.get("UCX_TLS", "UCX's default")
    memory = ("host memory" if cuda_devices is None
              else f"GPU memory, GPU {cuda_devices[0]} reading GPU {cuda_devices[1]}")
    where = (f"this host only: two processes, {memory}, UCX devices {devices!r}, "
             f"transports {tls}; not a link to another host")
    return Measurement(gb_s, setup_ms, points, where)
