"""In-process fake ``Transport`` for tests: real bytes, scripted failures.

Peers are other ``FakeTransport`` objects in the same process, found by name
in a registry that each test owns (``FakeFabric``). ``post_read`` copies with
``ctypes.memmove`` after ``cycles_to_done`` polls, so tests see PROC first;
failure knobs make post, poll or release fail.

It also holds callers to two parts of the contract (``base.py``) that a
CPU test could not see otherwise:

- memory: each registration keeps its memory type and device; a post whose
  remote range lies in no registration of the peer with the memory type
  given to ``add_peer`` and the device given to the post fails
  (``TransportError``), as a transfer naming the wrong memory would;
- threads: every call must come from a thread that ran ``enter_thread``
  (the hook's thread-local mark); any other call is recorded in
  ``unhooked_calls`` and raises ``AssertionError``.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_pd_ext.transport.base import Transport, TransportError, XferState
from vllm_pd_ext.transport.coalesce import Descriptor


@dataclass
class FakeFabric:
    agents: dict[str, FakeTransport] = field(default_factory=dict)


@dataclass(frozen=True)
class Registration:
    addr: int
    nbytes: int
    mem_type: str
    device_id: int


@dataclass
class _Xfer:
    peer: str
    descs: list[Descriptor]
    polls_left: int
    write: bool = False
    notif: bytes = b""
    state: XferState = XferState.PROC


class FakeTransport(Transport):
    _ids = itertools.count()

    def __init__(self, agent_name: str, fabric: FakeFabric, cycles_to_done: int = 1) -> None:
        self.agent_name = agent_name
        self.fabric = fabric
        fabric.agents[agent_name] = self
        self.cycles_to_done = cycles_to_done
        self.regions: list[tuple[int, int]] = []
        #: Every registered range with its memory type and device.
        self.registrations: list[Registration] = []
        self.peers: set[str] = set()
        #: The memory type ``add_peer`` was given for each loaded peer.
        self.peer_mem: dict[str, str] = {}
        #: (call, thread name) of every call from a thread that never entered.
        self.unhooked_calls: list[tuple[str, str]] = []
        #: Names of the threads that ran ``enter_thread``.
        self.entered_threads: set[str] = set()
        self._entered = threading.local()
        self.fail_post = False
        self.fail_poll = False
        self.fail_release = False
        #: Seconds a post takes (the copy inside NIXL's post call, on one host).
        self.post_delay = 0.0
        self.num_posts = 0
        self.num_descriptors = 0
        self.live_handles: dict[int, _Xfer] = {}
        self.notifs: list[bytes] = []

    def enter_thread(self) -> None:
        super().enter_thread()
        self._entered.ok = True
        self.entered_threads.add(threading.current_thread().name)

    def _on_entered_thread(self, call: str) -> None:
        if not getattr(self._entered, "ok", False):
            thread = threading.current_thread().name
            self.unhooked_calls.append((call, thread))
            raise AssertionError(f"fake transport {self.agent_name}: {call} from thread "
                                 f"{thread!r}, which never ran enter_thread (the thread hook)")

    def register(self, regions: Sequence[tuple[int, int]], mem_type: str, device_id: int) -> None:
        self._on_entered_thread("register")
        self.mem_type, self.device_id = mem_type, device_id
        self.regions.extend(regions)
        self.registrations += [Registration(a, n, mem_type, device_id) for a, n in regions]

    def metadata(self) -> bytes:
        return self.agent_name.encode()

    def add_peer(self, metadata: bytes, mem_type: str) -> str:
        self._on_entered_thread("add_peer")
        name = metadata.decode()
        if name not in self.fabric.agents:
            raise TransportError(f"fake peer {name!r} does not exist")
        self.peer_mem[name] = mem_type
        self.peers.add(name)
        return name

    def remove_peer(self, peer: str) -> None:
        self._on_entered_thread("remove_peer")
        self.peers.discard(peer)
        self.peer_mem.pop(peer, None)

    def _check(self, addr: int, n: int, regions: Sequence[tuple[int, int]]) -> None:
        if not any(base <= addr and addr + n <= base + size for base, size in regions):
            raise TransportError(f"range {addr:#x}+{n} is not registered")

    def _check_remote(self, peer: FakeTransport, addr: int, n: int, mem_type: str,
                      device_id: int) -> None:
        """The remote range must lie in the peer's memory of that type and device."""
        inside = [r for r in peer.registrations if r.addr <= addr and addr + n <= r.addr + r.nbytes]
        if inside and not any(r.mem_type == mem_type and r.device_id == device_id
                              for r in inside):
            got = inside[0]
            raise TransportError(
                f"range {addr:#x}+{n} of peer {peer.agent_name!r} was registered as "
                f"{got.mem_type} on device {got.device_id}, but the transfer names it "
                f"{mem_type} on device {device_id}")

    def post_read(self, peer: str, descs: Sequence[Descriptor], remote_device_id: int) -> Any:
        self._on_entered_thread("post_read")
        return self._post(peer, descs, remote_device_id, write=False, notif=b"")

    def post_write(self, peer: str, descs: Sequence[Descriptor], remote_device_id: int,
                   notif: bytes) -> Any:
        self._on_entered_thread("post_write")
        return self._post(peer, descs, remote_device_id, write=True, notif=notif)

    def _post(self, peer: str, descs: Sequence[Descriptor], remote_device_id: int, write: bool,
              notif: bytes) -> Any:
        if peer not in self.peers:
            raise TransportError(f"unknown peer {peer!r}")
        if self.post_delay:
            time.sleep(self.post_delay)
        if self.fail_post:
            raise TransportError("fake: post failed")
        remote = self.fabric.agents.get(peer)
        if remote is None:
            raise TransportError(f"fake peer {peer!r} is gone")
        for loc, rem, n in descs:
            self._check(loc, n, self.regions)
            self._check(rem, n, remote.regions)
            self._check_remote(remote, rem, n, self.peer_mem[peer], remote_device_id)
        handle = next(self._ids)
        self.live_handles[handle] = _Xfer(peer, list(descs), self.cycles_to_done, write, notif)
        self.num_posts += 1
        self.num_descriptors += len(descs)
        return handle

    def take_notifs(self) -> list[bytes]:
        self._on_entered_thread("take_notifs")
        out, self.notifs = self.notifs, []
        return out

    def poll(self, handle: Any) -> XferState:
        self._on_entered_thread("poll")
        x = self.live_handles[handle]
        if self.fail_poll:
            x.state = XferState.ERR
        elif x.state is XferState.PROC:
            x.polls_left -= 1
            if x.polls_left <= 0:
                for loc, rem, n in x.descs:
                    if x.write:
                        ctypes.memmove(rem, loc, n)
                    else:
                        ctypes.memmove(loc, rem, n)
                x.state = XferState.DONE
                peer = self.fabric.agents.get(x.peer)
                if x.write and x.notif and peer is not None:
                    peer.notifs.append(x.notif)
        return x.state

    def release(self, handle: Any) -> bool:
        self._on_entered_thread("release")
        if self.fail_release:
            return False
        self.live_handles.pop(handle, None)
        return True

    def close(self) -> None:
        self.fabric.agents.pop(self.agent_name, None)
