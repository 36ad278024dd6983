"""The transport interface: one worker's view of moving KV blocks.

Implementations: ``nixl.NixlTransport`` (one NIXL agent per worker) and
``fake.FakeTransport`` (in-process, for tests). Only ``PDWorker`` and the
objects it starts (``PullReader``, ``Pusher``, ``PushReceiver``) and their
``worker.peers.AgentCache`` call a transport.

Contract (who calls what, on which thread, in which order):

1. ``register(regions, mem_type, device_id)``: once, from
   ``PDWorker.register_kv_caches`` on the worker's step thread, after vLLM
   allocated the KV cache. Raises ``TransportError`` if the memory cannot
   be registered.
2. ``start_progress_pump(interval_s, keep_notifs)``: right after, on the
   transfer's target only (P's worker in pull mode, D's in push mode) and
   only when NIXL's own progress thread is off and
   ``nixl_progress_interval_ms`` > 0. ``keep_notifs`` is False in pull mode,
   where nobody calls ``take_notifs``: what arrives is dropped.
   Not abstract: the default does nothing (the fake needs no progress);
   NIXL starts the ``pd-nixl-progress`` thread.
3. ``agent_name`` / ``metadata()``: read once by ``register_kv_caches`` into
   the worker's ``AgentInfo``, which peers receive over the side channel
   (pull: in P's ``HandshakeReply``; push: in D's ``PushRegister``).
4. ``add_peer(metadata)`` loads a peer's metadata and returns the peer name
   used below (``TransportError`` if refused); ``remove_peer(peer)`` drops
   it when it failed or restarted and no transfer with it is in flight
   (never raises). Pull: D's step thread after a handshake; push: P's
   ``pd-push`` thread on the first order for a D agent.
5. ``post_read(peer, descs, remote_device_id)`` (pull, D's ``pd-post``
   thread) and ``post_write(peer, descs, remote_device_id, notif)`` (push,
   P's ``pd-push`` thread) start a transfer of ``(local_addr, remote_addr,
   nbytes)`` descriptors and return a handle; ``TransportError`` if it
   could not be posted (nothing in flight). On one host the copy may run
   inside the call. A WRITE delivers ``notif`` to the peer after the data.
6. ``poll(handle)`` returns ``PROC``, ``DONE`` or ``ERR`` (errors are
   reported as ``ERR``, never raised): pull, once on the ``pd-post`` thread
   right after the post, then on D's step thread; push, on ``pd-push``.
7. ``release(handle)`` once the transfer ended or its deadline passed, on
   the thread that polls it: False if the transfer may still touch memory,
   in which case the caller keeps the blocks on both sides and tries again
   later.
8. ``take_notifs()``: push, D's step thread (``PushReceiver.collect``): the
   notifications received from any peer since the last call, including
   those the progress pump collected meanwhile.
9. ``close()`` at worker shutdown (``PDWorker.shutdown``), after the
   ``pd-push`` and ``pd-post`` threads stopped; stops the progress pump and
   deregisters the memory.

One transport is thus called from up to three threads at once (the step
thread, ``pd-post`` or ``pd-push``, and ``pd-nixl-progress``); the NIXL
implementation runs its agent in NIXL's strict thread-safe mode
(``NIXL_THREAD_SYNC_STRICT``).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Sequence
from typing import Any

from vllm_pd_ext.transport.coalesce import Descriptor


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

    def start_progress_pump(self, interval_s: float, keep_notifs: bool = True,
                            on_notif: Callable[[], None] | None = None) -> None:
        """Make progress as a transfer target without the engine stepping;
        ``on_notif`` is called from the pump's thread when notifications were
        kept (D's push worker wakes its scheduler with it)."""
        return

    @abc.abstractmethod
    def close(self) -> None: ...
