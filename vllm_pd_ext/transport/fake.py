"""In-process fake ``Transport`` for tests: real bytes, scripted failures.

Peers are other ``FakeTransport`` objects in the same process, found by name
in a registry that each test owns (``FakeFabric``). ``post_read`` copies with
``ctypes.memmove`` after ``cycles_to_done`` polls, so tests see PROC first;
failure knobs make post, poll or release fail.
"""

from __future__ import annotations

import ctypes
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_pd_ext.transport.base import Transport, TransportError, XferState
from vllm_pd_ext.transport.coalesce import Descriptor


@dataclass
class FakeFabric:
    agents: dict[str, FakeTransport] = field(default_factory=dict)


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
        self.peers: set[str] = set()
        self.fail_post = False
        self.fail_poll = False
        self.fail_release = False
        #: Seconds a post takes (the copy inside NIXL's post call, on one host).
        self.post_delay = 0.0
        self.num_posts = 0
        self.num_descriptors = 0
        self.live_handles: dict[int, _Xfer] = {}
        self.notifs: list[bytes] = []

    def register(self, regions: Sequence[tuple[int, int]], mem_type: str, device_id: int) -> None:
        self.regions.extend(regions)

    def metadata(self) -> bytes:
        return self.agent_name.encode()

    def add_peer(self, metadata: bytes) -> str:
        name = metadata.decode()
        if name not in self.fabric.agents:
            raise TransportError(f"fake peer {name!r} does not exist")
        self.peers.add(name)
        return name

    def remove_peer(self, peer: str) -> None:
        self.peers.discard(peer)

    def _check(self, addr: int, n: int, regions: Sequence[tuple[int, int]]) -> None:
        if not any(base <= addr and addr + n <= base + size for base, size in regions):
            raise TransportError(f"range {addr:#x}+{n} is not registered")

    def post_read(self, peer: str, descs: Sequence[Descriptor], remote_device_id: int) -> Any:
        return self._post(peer, descs, write=False, notif=b"")

    def post_write(self, peer: str, descs: Sequence[Descriptor], remote_device_id: int,
                   notif: bytes) -> Any:
        return self._post(peer, descs, write=True, notif=notif)

    def _post(self, peer: str, descs: Sequence[Descriptor], write: bool, notif: bytes) -> Any:
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
        handle = next(self._ids)
        self.live_handles[handle] = _Xfer(peer, list(descs), self.cycles_to_done, write, notif)
        self.num_posts += 1
        self.num_descriptors += len(descs)
        return handle

    def take_notifs(self) -> list[bytes]:
        out, self.notifs = self.notifs, []
        return out

    def poll(self, handle: Any) -> XferState:
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
        if self.fail_release:
            return False
        self.live_handles.pop(handle, None)
        return True

    def close(self) -> None:
        self.fabric.agents.pop(self.agent_name, None)
