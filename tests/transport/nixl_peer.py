"""The READ target for the two-process NIXL tests (runs in a spawned child).

Kept free of pytest and torch so the child starts fast. Protocol over a
``multiprocessing`` pipe: the child sends ``(metadata, base_addr, nbytes)``
once its buffer is registered and its progress pump runs, then waits for
``"stop"`` (or is killed).
"""

from __future__ import annotations

import ctypes
import os


def pattern(nbytes: int) -> bytes:
    return bytes((i * 7 + 3) % 251 for i in range(nbytes))


def serve(conn, nbytes: int, pump: bool = True) -> None:
    os.environ["UCX_NET_DEVICES"] = "lo"
    from vllm_pd_ext.transport.nixl import NixlTransport

    buf = (ctypes.c_uint8 * nbytes)()
    ctypes.memmove(buf, pattern(nbytes), nbytes)
    addr = ctypes.addressof(buf)
    t = NixlTransport(f"target-{os.getpid()}", ["UCX"], progress_thread=False)
    t.register([(addr, nbytes)], "DRAM", 0)
    if pump:
        t.start_progress_pump(0.001)
    conn.send((t.metadata(), addr, nbytes))
    try:
        while True:
            if conn.poll(0.05) and conn.recv() == "stop":
                break
    except EOFError:
        pass
    t.close()
    conn.send("closed")
