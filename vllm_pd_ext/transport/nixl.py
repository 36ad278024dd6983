"""NIXL implementation of ``Transport`` (UCX by default; DRAM on CPU, VRAM on GPU).

NIXL is imported lazily so that the scheduler process and the proxy never
load it; a missing NIXL fails loudly with an install hint, never silently.
We do not use NIXL's listener thread (it binds 0.0.0.0): metadata travels over
our side channel. With the progress thread off (the CPU default), ``poll``
drives progress.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from vllm_pd_ext.log import get_logger
from vllm_pd_ext.transport.base import Transport, TransportError, XferState
from vllm_pd_ext.transport.coalesce import Descriptor
from vllm_pd_ext.transport.ucx_env import explain_backend_failure
from vllm_pd_ext.wire.pump_bell import Bell, PumpPace

logger = get_logger(__name__)

#: Notifications kept for ``take_notifs`` at most; past it the oldest go (a
#: peer flooding us must not grow memory). D's receiver drains every step.
MAX_PENDING_NOTIFS = 65536


def _import_nixl() -> Any:
    try:
        from nixl import _api
    except ImportError as exc:
        raise ImportError(
            "PDConnector needs NIXL on the worker: pip install 'vllm-pd-ext[nixl]' "
            "(installs nixl==1.5.1; install torch or vLLM first so NIXL does not pull CUDA torch)"
        ) from exc
    return _api


class NixlTransport(Transport):
    def __init__(self, agent_name: str, backends: Sequence[str], progress_thread: bool) -> None:
        api = _import_nixl()
        self._api = api
        cfg = api.nixl_agent_config(
            enable_prog_thread=progress_thread,
            enable_listen_thread=False,
            backends=list(backends),
            # The progress pump below calls into the agent from a second thread.
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self.agent_name = agent_name
        try:
            self._agent = api.nixl_agent(agent_name, cfg)
        except Exception as exc:
            hint = explain_backend_failure()
            if hint is None:
                raise
            raise TransportError(f"NIXL could not create its {'/'.join(backends)} backend "
                                 f"({exc}): {hint}") from exc
        self._reg: list[Any] = []
        #: Each loaded peer's memory type (its ``AgentInfo.mem_type``): the
        #: remote descriptors of a transfer with it name that memory.
        self._peer_mem: dict[str, str] = {}
        self._notifs: list[bytes] = []
        self._notif_lock = threading.Lock()
        #: Pull mode: nobody takes notifications, so they are not kept.
        self._keep_notifs = True
        self.num_dropped_notifs = 0
        self._pump_stop = threading.Event()
        self._pump: threading.Thread | None = None
        #: Rounds the progress pump ran (tests read its pace from it).
        self.num_pump_rounds = 0

    def start_progress_pump(self, interval_s: float, keep_notifs: bool = True,
                            on_notif: Callable[[list[bytes]], None] | None = None,
                            bell: Bell | None = None,
                            pending: Callable[[], bool] | None = None) -> None:
        """Progress the agent from a daemon thread; ``keep_notifs=False``
        drops what arrives (nobody will take it); ``on_notif`` runs on the
        pump's thread with the notifications it just kept (after they were
        kept, so ``take_notifs`` returns them by the time it runs).

        Without NIXL's progress thread (which spins a core on CPU) a READ
        target never answers UCX's connection wire-up, so the first READ
        from each new peer hangs (and over TCP every READ needs the
        target's progress). Without ``bell`` the pump runs every
        ``interval_s``; with it, at that pace only while a peer works with
        us (``wire/pump_bell.py``: each timed wake-up costs ~40 us of CPU,
        4% of a core at 1 ms), and the pump's thread closes the bell.
        """
        self._keep_notifs = keep_notifs
        if self._pump is not None:
            return
        pace = PumpPace(interval_s, pending=pending) if bell is not None else None

        def wait() -> bool:
            """Sleep one period; True to stop."""
            if bell is None or pace is None:
                return self._pump_stop.wait(interval_s)
            if bell.wait(pace.interval()):
                pace.hurry()
            return self._pump_stop.is_set()

        def run() -> None:
            self.enter_thread()
            try:
                while not wait():
                    self.num_pump_rounds += 1
                    try:
                        kept = self._collect_notifs()
                        if kept:
                            if pace is not None:
                                pace.hurry()
                            if on_notif is not None:
                                on_notif(kept)
                    except Exception as exc:  # keep pumping; log once per burst
                        logger.debug("NIXL progress pump: %s", exc)
            finally:
                if bell is not None:
                    bell.close()

        self._pump = threading.Thread(target=run, name="pd-nixl-progress", daemon=True)
        self._pump.start()

    def _collect_notifs(self) -> list[bytes]:
        """The notifications kept now (none: nothing new, or not kept)."""
        new = self._agent.get_new_notifs()
        if not new:
            return []
        with self._notif_lock:
            if not self._keep_notifs:
                self.num_dropped_notifs += sum(len(msgs) for msgs in new.values())
                return []
            kept = [bytes(m) for msgs in new.values() for m in msgs]
            self._notifs.extend(kept)
            excess = len(self._notifs) - MAX_PENDING_NOTIFS
            if excess > 0:
                del self._notifs[:excess]
                self.num_dropped_notifs += excess
                logger.warning("PDConnector: %d NIXL notifications dropped: more than %d "
                               "pending", excess, MAX_PENDING_NOTIFS)
        return kept

    def take_notifs(self) -> list[bytes]:
        try:
            self._collect_notifs()
        except Exception as exc:
            logger.warning("NIXL get_new_notifs failed: %s", exc)
        with self._notif_lock:
            out, self._notifs = self._notifs, []
        return out

    def register(self, regions: Sequence[tuple[int, int]], mem_type: str, device_id: int) -> None:
        self.mem_type = mem_type
        self.device_id = device_id
        descs = [(addr, nbytes, device_id, "") for addr, nbytes in regions]
        try:
            self._reg.append(self._agent.register_memory(descs, mem_type))
        except Exception as exc:
            raise TransportError(f"NIXL could not register {len(descs)} KV regions: {exc}") from exc

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def add_peer(self, metadata: bytes, mem_type: str) -> str:
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            raise TransportError(f"NIXL rejected peer metadata: {exc}") from exc
        peer = name.decode() if isinstance(name, bytes) else str(name)
        self._peer_mem[peer] = mem_type
        return peer

    def remove_peer(self, peer: str) -> None:
        self._peer_mem.pop(peer, None)
        try:
            self._agent.remove_remote_agent(peer)
        except Exception as exc:  # already gone: nothing to undo
            logger.debug("NIXL remove_remote_agent(%s): %s", peer, exc)

    def post_read(self, peer: str, descs: Sequence[Descriptor], remote_device_id: int) -> Any:
        return self._post("READ", peer, descs, remote_device_id, b"")

    def post_write(self, peer: str, descs: Sequence[Descriptor], remote_device_id: int,
                   notif: bytes) -> Any:
        return self._post("WRITE", peer, descs, remote_device_id, notif)

    def _post(self, op: str, peer: str, descs: Sequence[Descriptor], remote_device_id: int,
              notif: bytes) -> Any:
        remote_mem = self._peer_mem.get(peer)
        if remote_mem is None:
            raise TransportError(f"NIXL {op} with {peer}: not a loaded peer")
        local = [(loc, n, self.device_id) for loc, _, n in descs]
        remote = [(rem, n, remote_device_id) for _, rem, n in descs]
        try:
            ldl = self._agent.get_xfer_descs(local, self.mem_type)
            rdl = self._agent.get_xfer_descs(remote, remote_mem)
            handle = self._agent.initialize_xfer(op, ldl, rdl, peer, notif)
        except Exception as exc:
            raise TransportError(f"NIXL could not prepare a {op} with {peer}: {exc}") from exc
        try:
            self._agent.transfer(handle)
        except Exception as exc:
            if self.release(handle):
                raise TransportError(f"NIXL could not post a {op} with {peer}: {exc}") from exc
            # The handle may still be live: let poll() report ERR and the
            # caller keep the blocks until release succeeds.
            logger.warning("NIXL transfer() raised and the handle is still live: %s", exc)
        # "ERR" at post is reported by the next poll(), on the normal path.
        return handle

    def poll(self, handle: Any) -> XferState:
        try:
            state = self._agent.check_xfer_state(handle)
        except Exception as exc:
            logger.warning("NIXL check_xfer_state failed: %s", exc)
            return XferState.ERR
        return XferState(state) if state in ("PROC", "DONE", "ERR") else XferState.ERR

    def release(self, handle: Any) -> bool:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:
            logger.warning("NIXL release_xfer_handle failed (transfer may be in flight): %s", exc)
            return False
        return True

    def close(self) -> None:
        self._pump_stop.set()
        if self._pump is not None:
            self._pump.join(timeout=1)
        for reg in self._reg:
            try:
                self._agent.deregister_memory(reg)
            except Exception as exc:
                logger.debug("NIXL deregister_memory: %s", exc)
        self._reg.clear()
