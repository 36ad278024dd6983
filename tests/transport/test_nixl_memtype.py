"""NixlTransport: a transfer's remote side names the peer's memory type, and
the progress pump runs the thread hook (issue 25)."""

from __future__ import annotations

import threading
import time

from vllm_pd_ext.transport.nixl import NixlTransport


class RecordingAgent:
    """Stands in for the NIXL agent: records what the transfer is built from."""

    def __init__(self) -> None:
        self.descs: list[tuple[list, str]] = []

    def add_remote_agent(self, metadata: bytes) -> bytes:
        return b"peer"

    def get_xfer_descs(self, descs: list, mem_type: str) -> tuple:
        self.descs.append((descs, mem_type))
        return (descs, mem_type)

    def initialize_xfer(self, *args: object) -> str:
        return "handle"

    def transfer(self, handle: str) -> str:
        return "PROC"

    def get_new_notifs(self) -> dict:
        return {}


def test_remote_descriptors_name_the_peers_memory_type():
    t = NixlTransport("memtype-test", ["UCX"], progress_thread=False)
    try:
        assert (t.mem_type, t.device_id) == ("DRAM", 0)  # nothing registered yet
        real, t._agent = t._agent, RecordingAgent()
        peer = t.add_peer(b"meta", "VRAM")
        t.post_read(peer, [(0x1000, 0x2000, 64)], 2)
        assert t._agent.descs == [([(0x1000, 64, 0)], "DRAM"), ([(0x2000, 64, 2)], "VRAM")]
        t._agent = real
    finally:
        t.close()


def test_progress_pump_runs_the_thread_hook():
    t = NixlTransport("hook-test", ["UCX"], progress_thread=False)
    ran: list[str] = []
    t.set_thread_hook(lambda: ran.append(threading.current_thread().name))
    try:
        t.start_progress_pump(0.001, keep_notifs=False)
        deadline = time.monotonic() + 5
        while not ran and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ran == ["pd-nixl-progress"]
    finally:
        t.close()
