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
2. ``start_progress_pump(interval_s, keep_notifs, on_notif, bell, pending)``: right after, on the
   transfer's target only (P's worker in pull mode, D's in push mode) and
   only when NIXL's own progress thread is off and
   ``nixl_progress_interval_ms`` > 0. ``keep_notifs`` is False in pull mode,
   where nobody calls ``take_notifs``: what arrives is dropped.
   Not abstract: the default does nothing (the fake needs no progress);
   NIXL starts the ``pd-nixl-progress`` thread.
3. ``agent_name`` / ``metadata()``: read once by ``register_kv_caches`` into
   the worker's ``AgentInfo``, which peers receive over the side channel
   (pull: in P's ``HandshakeReply``; push: in D's ``PushRegister``).
4. ``add_peer(metadata, mem_type)`` loads a peer's metadata and returns the
   peer name used below (``TransportError`` if refused); ``mem_type`` is the
   memory the peer registered (``AgentInfo.mem_type``), which the remote
   side of every transfer with it names. ``remove_peer(peer)`` drops
   it when it failed or restarted and no transfer with it is in flight
   (never raises). Pull: D's step thread after a handshake; push: P's
   ``pd-push`` thread on the first order for a D agent. Which memory types
   may pair is the caller's decision (``worker.peers.AgentCache`` refuses a
   peer whose memory type differs from ours); a transport serves both.
5. ``post_read(peer, descs, remote_device_id)`` (pull, D's ``pd-post``
   thread) and ``post_write(peer, descs, remote_device_id, notif)`` (push,
   P's ``pd-push`` thread) start a transfer of ``(local_addr, remote_addr,
   nbytes)`` descriptors, the remote ranges in the peer's memory type on its
   device ``remote_device_id`` (``AgentInfo.device_id``), and return a
   handle; ``TransportError`` if it could not be posted (nothing in
   flight). On one host the copy may run inside the call. A WRITE delivers
   ``notif`` to the peer after the data.
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

Threads: every thread that calls a transport calls ``enter_thread()`` first,
which runs the hook ``set_thread_hook`` installed (``PDWorker`` installs it
before ``register``: on a CUDA KV cache it sets the thread's CUDA device, as
UCX turns ``cuda_ipc`` off for a thread without one; on CPU it does nothing).
The step thread enters in ``register_kv_caches``, ``pd-post`` through its
executor's initializer, ``pd-push`` when it starts, ``pd-nixl-progress``
(started here) when it starts. NIXL's own progress thread
(``nixl_progress_thread: true``) and UCX's threads are not ours to hook.
``fake.FakeTransport`` refuses a call from a thread that did not enter.
"""

from __future__ import annotations

import abc
import enum
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from vllm_pd_ext.log import get_logger
from vllm_pd_ext.transport.coalesce import Descriptor

if TYPE_CHECKING:
    from vllm_pd_ext.wire.pump_bell import Bell

logger = get_logger(__name__)


class XferState(enum.Enum):
    PROC = "PROC"
    DONE = "DONE"
    ERR = "ERR"


class TransportError(RuntimeError):
    """A transfer could not be posted or the peer is unusable."""


class Transport(abc.ABC):
    agent_name: str
    #: The local KV memory, as ``register`` was given it ("DRAM" or "VRAM").
    mem_type: str = "DRAM"
    device_id: int = 0
    #: Run by ``enter_thread`` (``set_thread_hook``); None: nothing to do.
    _thread_hook: Callable[[], None] | None = None

    def set_thread_hook(self, hook: Callable[[], None]) -> None:
        """What every thread calling this transport runs first (``enter_thread``)."""
        self._thread_hook = hook

    def enter_thread(self) -> None:
        """Run the thread hook on the calling thread, before its first call.
        A failing hook is logged, not raised: the thread's transfers still
        work (on CUDA, without UCX's ``cuda_ipc``)."""
        if self._thread_hook is None:
            return
        try:
            self._thread_hook()
        except Exception:
            logger.exception("PDConnector: the transport's thread hook failed on thread %s",
                             threading.current_thread().name)

    @abc.abstractmethod
    def register(self, regions: Sequence[tuple[int, int]], mem_type: str, device_id: int) -> None:
        """Register ``(addr, nbytes)`` ranges of local KV memory (``mem_type``
        "DRAM" or "VRAM", on device ``device_id``)."""

    @abc.abstractmethod
    def metadata(self) -> bytes:
        """Opaque bytes a peer passes to ``add_peer``."""

    @abc.abstractmethod
    def add_peer(self, metadata: bytes, mem_type: str) -> str:
        """Load a peer's metadata; returns its name. ``mem_type`` is the
        memory the peer registered (its ``AgentInfo.mem_type``)."""

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
                            on_notif: Callable[[list[bytes]], None] | None = None,
                            bell: Bell | None = None,
                            pending: Callable[[], bool] | None = None) -> None:
        """Make progress as a transfer target without the engine stepping;
        ``on_notif`` is called from the pump's thread with the notifications
        it kept (D's push worker forwards them to its scheduler with it); with ``bell``
        the pump slows down while no peer works with us and the bell wakes
        it (``wire/pump_bell.py``); the pump then owns and closes the bell.
        ``pending`` (with ``bell``): work is expected while it returns True
        (a push D's WRITEs); the pump stays fast then and lingers briefly
        after (``PumpPace``)."""
        if bell is not None:
            bell.close()

    @abc.abstractmethod
    def close(self) -> None: ...
