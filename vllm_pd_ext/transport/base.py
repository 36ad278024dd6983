"""The transport interface: one worker's view of moving KV blocks.

Contract (who calls what, in which order):

1. ``register(regions, mem_type)`` once, after vLLM allocated the KV cache.
2. ``agent_name`` / ``metadata()`` are published through the side channel.
3. ``add_peer(metadata)`` when a peer's handshake arrives; returns the peer
   name used below. ``remove_peer`` when the peer is known dead or restarted.
4. ``post_read(peer, descs)`` copies remote bytes into local memory and
   returns a handle; ``poll(handle)`` drives progress and returns the state;
   ``release(handle)`` frees the handle and returns False if the transfer
   may still be in flight (the caller must then keep the destination blocks
   and poll again later). ``post_write`` (push mode) is the mirror image and
   delivers ``notif`` to the peer after the data; the peer collects it with
   ``take_notifs``.
5. ``close()`` at worker shutdown.

Calls come from the engine step, the poster thread (pull), the push thread
(push) and the progress pump; the NIXL implementation runs its agent in
NIXL's strict thread-safe mode.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence
from typing import Any

from vllm_pd_ext.coalesce import Descriptor


class XferState(enum.Enum):
    PROC = "PROC"
    DONE = "DONE"
    ERR = "ERR"


class TransportError(RuntimeError):
    """A transfer could not be posted or the peer is unusable."""


class Transport(abc.ABC):
    agent_name: str

    @abc.abstractmethod
    def register(self, regions: Sequence[tuple[int, int]], mem_type: str, device_id: int) -> None:
        """Register ``(addr, nbytes)`` ranges of local KV memory."""

    @abc.abstractmethod
    def metadata(self) -> bytes:
        """Opaque bytes a peer passes to ``add_peer``."""

    @abc.abstractmethod
    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns its name."""

    @abc.abstractmethod
    def remove_peer(self, peer: str) -> None: ...

    @abc.abstractmethod
    def post_read(self, peer: str, descs: Sequence[Descriptor], remote_device_id: int) -> Any:
        """Start reading ``(local_addr, remote_addr, nbytes)`` ranges from ``peer``."""

    @abc.abstractmethod
    def post_write(self, peer: str, descs: Sequence[Descriptor], remote_device_id: int,
                   notif: bytes) -> Any:
        """Start writing ``(local_addr, remote_addr, nbytes)`` ranges to ``peer``;
        ``notif`` reaches the peer after the data."""

    @abc.abstractmethod
    def take_notifs(self) -> list[bytes]:
        """Notifications received since the last call (any peer)."""

    @abc.abstractmethod
    def poll(self, handle: Any) -> XferState: ...

    @abc.abstractmethod
    def release(self, handle: Any) -> bool:
        """Free a handle; False if the transfer may still touch memory."""

    def start_progress_pump(self, interval_s: float) -> None:
        """Make progress as a transfer target without the engine stepping."""
        return

    @abc.abstractmethod
    def close(self) -> None: ...
