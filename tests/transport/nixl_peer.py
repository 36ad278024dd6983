"""The target for the two-process NIXL tests (runs in a spawned child).

Kept free of pytest and torch so the child starts fast. Protocol over a
``multiprocessing`` pipe: the child sends ``(metadata, base_addr, nbytes)``
once its buffer is registered and its progress pump runs, then waits for
``"stop"`` (or is killed).

``serve`` is a READ target (a patterned buffer). ``serve_write_target`` is a
push-mode WRITE target (a zeroed buffer) that also answers
``("notifs", timeout_s)`` with ``(notifications, buffer snapshot)`` as soon
as ``take_notifs`` returned any (or at the timeout), and
``("bytes", offset, n)`` with its buffer's contents.
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


def serve_write_target(conn, nbytes: int) -> None:
    os.environ["UCX_NET_DEVICES"] = "lo"
    import time

    from vllm_pd_ext.transport.nixl import NixlTransport

    buf = (ctypes.c_uint8 * nbytes)()
    addr = ctypes.addressof(buf)
    t = NixlTransport(f"write-target-{os.getpid()}", ["UCX"], progress_thread=False)
    t.register([(addr, nbytes)], "DRAM", 0)
    t.start_progress_pump(0.001)
    conn.send((t.metadata(), addr, nbytes))
    try:
        while True:
            if not conn.poll(0.05):
                continue
            cmd = conn.recv()
            if cmd == "stop":
                break
            if cmd[0] == "notifs":
                # Snapshot the buffer the moment a notification is seen: the
                # data it announces must already be there.
                got: list[bytes] = []
                deadline = time.monotonic() + cmd[1]
                while True:
                    got.extend(t.take_notifs())
                    if got or time.monotonic() >= deadline:
                        break
                    time.sleep(0.001)
                conn.send((got, ctypes.string_at(addr, nbytes)))
            elif cmd[0] == "bytes":
                conn.send(ctypes.string_at(addr + cmd[1], cmd[2]))
    except EOFError:
        pass
    t.close()
    conn.send("closed")


def read_from_killed(conn, metadata: bytes, remote_addr: int, block: int) -> None:
    """The initiator of the killed-peer test, in a child of its own.

    READs one block (expects DONE), sends ``"read"``, waits for ``"killed"``
    (the parent SIGKILLed the target), then tries three READs and sends
    ``(outcomes, seconds, removed_ok)``. It leaves with ``os._exit``: UCX
    1.x can abort (``ucs_arbiter_group_is_empty``) while destroying a worker
    whose peer died with requests in flight; that teardown is UCX's, happens
    only at shutdown, and must not take the test runner with it.
    """
    os.environ["UCX_NET_DEVICES"] = "lo"
    import time

    from vllm_pd_ext.transport import TransportError, XferState
    from vllm_pd_ext.transport.nixl import NixlTransport

    buf = (ctypes.c_uint8 * (4 * block))()
    addr = ctypes.addressof(buf)
    t = NixlTransport(f"initiator-{os.getpid()}", ["UCX"], progress_thread=False)
    t.register([(addr, 4 * block)], "DRAM", 0)

    def read(offset: int, timeout: float) -> str:
        try:
            handle = t.post_read(peer, [(addr + offset, remote_addr + offset, block)], 0)
        except TransportError as exc:
            return f"TransportError: {exc}"
        deadline = time.monotonic() + timeout
        state = t.poll(handle)
        while state is XferState.PROC and time.monotonic() < deadline:
            time.sleep(0.0005)
            state = t.poll(handle)
        if state is not XferState.PROC:
            t.release(handle)
        return state.value

    peer = t.add_peer(metadata, "DRAM")
    first = read(0, 20.0)
    conn.send(("read", first, ctypes.string_at(addr, block)))
    conn.recv()  # "killed"
    t0 = time.monotonic()
    outcomes = [read(block * (i + 1), 10.0) for i in range(3)]
    elapsed = time.monotonic() - t0
    try:
        t.remove_peer(peer)  # gone peers can be removed without raising
        removed = True
    except Exception:
        removed = False
    conn.send((outcomes, elapsed, removed))
    conn.close()
    os._exit(0)
