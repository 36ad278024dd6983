"""D's scheduler half in push mode: register blocks with P, bound the wait.

Runs in D's EngineCore process. The scheduler thread calls ``register``
(after vLLM allocated the blocks), ``abandon`` (the request ended, or needs
nothing from P), ``finished`` (the worker saw P's WRITE notification) and
``poll`` (every step). Replies and P's failure notices arrive on other
threads (the outbox, the side channel) and are queued under a lock;
``poll`` applies them on the scheduler thread and returns the requests whose
load must now be reported failed.

One wait's life::

    register --(P accepts)--> registered --(notification)--> finished
        |                          |
        |  refused                 |  PushResult(ok=False) | deadline -> abort
        v                          v
      failed                 aborting --(P: aborted/unknown/done/failed)--> failed
                                   \\--(P: in_flight)--> ask again in 1 s

D reuses the blocks only when P said no WRITE can land any more: it refused
the registration, reported its WRITE settled, or answered an abort with a
safe state. If P cannot be reached, D waits until P's WRITE window has
closed: P posts nothing later than ``ttl`` after receiving the
registration, and a posted WRITE ends within ``write_timeout`` (P's
``transfer_timeout``). The window is counted from the registration's reply
(P received it before answering) or, without a reply, from the send's
timeout plus one more side-channel timeout; until the registration has
left, the window is open. Aborts are re-sent only after P answered the
previous one, so an unreachable P does not pile them up.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from vllm_pd_ext import protocol as proto
from vllm_pd_ext.log import get_logger
from vllm_pd_ext.outbox import Outbox
from vllm_pd_ext.policy import FailureReason
from vllm_pd_ext.side_channel import SideChannelError

logger = get_logger(__name__)

#: Seconds between repeated aborts while P's WRITE is in flight.
ABORT_RETRY_S = 1.0
#: Seconds D still waits for the notification after P said "done".
DONE_GRACE_S = 2.0

Endpoint = tuple[str, int]


@dataclass
class PushWait:
    request_id: str
    pd_request_id: str
    endpoint: Endpoint
    #: When D gives up waiting and aborts.
    deadline: float
    #: No WRITE from P can touch D's blocks after this (monotonic); open
    #: (infinite) until the registration's send has ended.
    window_closes: float = math.inf
    state: str = "registering"
    ended: bool = False
    abort_sent: bool = False
    next_abort: float = 0.0
    done_seen: bool = False
    why: str = ""


class PushConsumer:
    def __init__(self, engine_id: str, compat: proto.CompatInfo, host: str, port: int,
                 push_timeout_s: float, side_channel_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic, *,
                 write_timeout_s: float = 30.0) -> None:
        self.engine_id = engine_id
        self.compat = compat
        self.host = host
        self.port = port
        self.push_timeout_s = push_timeout_s
        self.side_channel_timeout_s = side_channel_timeout_s
        self.write_timeout_s = write_timeout_s
        self.agents: list[proto.AgentInfo] = []
        self._clock = clock
        self._outbox = Outbox(side_channel_timeout_s, name="pd-push-register")
        self._waits: dict[str, PushWait] = {}
        self._by_pd: dict[str, str] = {}
        self._lock = threading.Lock()
        self._events: list[tuple[str, str, str]] = []

    # ------------------------------------------------------------ scheduler
    def register(self, request_id: str, pd_id: str, endpoint: Endpoint,
                 expect_engine_id: str, first_block: int, block_ids: list[int],
                 num_tokens: int) -> None:
        now = self._clock()
        wait = PushWait(request_id, pd_id, endpoint,
                        deadline=now + self.push_timeout_s + self.side_channel_timeout_s)
        self._waits[request_id] = wait
        with self._lock:
            self._by_pd[pd_id] = request_id
        msg = proto.PushRegister(
            engine_id=self.engine_id, compat=self.compat, expect_engine_id=expect_engine_id,
            pd_request_id=pd_id, request_id=request_id, notify_host=self.host,
            notify_port=self.port, agents=self.agents, first_block=first_block,
            block_ids=list(block_ids), num_tokens=num_tokens, ttl_s=self.push_timeout_s)
        self._outbox.send(endpoint[0], endpoint[1], msg,
                          lambda r: self._on_register_reply(request_id, expect_engine_id, r))
        logger.info("PDConnector: request %s registered %d blocks (from block %d) with %s:%d "
                    "for push %s", request_id, len(block_ids), first_block, endpoint[0],
                    endpoint[1], pd_id)

    def abandon(self, request_id: str, pd_id: str, endpoint: Endpoint, reason: str) -> bool:
        """The request ended on D (or needs nothing from P). Returns True if
        its registered blocks must stay allocated until ``poll`` reports it."""
        wait = self._waits.get(request_id)
        if wait is None:
            # Never registered: only tell P to drop its side (frees P's blocks
            # now rather than at lease expiry).
            self._outbox.send(endpoint[0], endpoint[1], proto.PushAbort(
                engine_id=self.engine_id, pd_request_id=pd_id, reason=reason))
            return False
        wait.ended = True
        wait.why = reason
        self._send_abort(wait, reason)
        return True

    def finished(self, request_id: str) -> None:
        """The worker reported the request's KV landed (or its load failed)."""
        wait = self._waits.pop(request_id, None)
        if wait is not None:
            with self._lock:
                self._by_pd.pop(wait.pd_request_id, None)

    def poll(self) -> dict[str, tuple[str, str]]:
        """Apply replies and deadlines; returns request id -> (reason, detail)
        for loads that must be reported failed now (their blocks are safe)."""
        with self._lock:
            events, self._events = self._events, []
        out: dict[str, tuple[str, str]] = {}
        for rid, kind, detail in events:
            wait = self._waits.get(rid)
            if wait is not None:
                self._apply(wait, kind, detail, out)
        now = self._clock()
        for wait in list(self._waits.values()):
            if wait.request_id in out:
                continue
            if not wait.abort_sent and now >= wait.deadline:
                if wait.done_seen:
                    self._settle(wait, FailureReason.TRANSFER,
                                 "P reports its WRITE done but no completion notification "
                                 "arrived", out)
                    continue
                wait.why = wait.why or (f"no KV from P within push_timeout "
                                        f"({self.push_timeout_s:.1f} s)")
                self._send_abort(wait, "deadline passed on D")
            elif wait.abort_sent and wait.state == "in_flight" and now >= wait.next_abort:
                # (state becomes "aborting" until P answers: never two at once)
                self._send_abort(wait, wait.why)
        return out

    @property
    def num_waiting(self) -> int:
        return len(self._waits)

    # ------------------------------------------------------------ threads
    def on_result(self, msg: proto.PushResult) -> proto.Reply:
        """Side-channel thread: P's WRITE failed and settled."""
        with self._lock:
            rid = self._by_pd.get(msg.pd_request_id)
            if rid is not None:
                self._events.append((rid, "failed", msg.detail))
        if rid is None:
            logger.info("PDConnector: push result for unknown %s from engine %s (ok=%s)",
                        msg.pd_request_id, msg.engine_id, msg.ok)
        return proto.Ack()

    def _on_register_reply(self, rid: str, expect: str,
                           reply: proto.Reply | SideChannelError) -> None:
        if isinstance(reply, proto.PushAccepted):
            event = ("accepted", reply.state)
        elif isinstance(reply, SideChannelError) and "refused" not in str(reply):
            # Unknown whether P got it: the deadline (and the abort) decide.
            event = ("unconfirmed", str(reply))
        else:
            event = ("refused", str(reply))
        with self._lock:
            self._events.append((rid, *event))

    def _on_abort_reply(self, rid: str, reply: proto.Reply | SideChannelError) -> None:
        if isinstance(reply, proto.PushAbortStatus):
            event = ("abort_" + reply.state, "")
        else:
            event = ("abort_error", str(reply))
        with self._lock:
            self._events.append((rid, *event))

    # ------------------------------------------------------------ internals
    def _apply(self, wait: PushWait, kind: str, detail: str,
               out: dict[str, tuple[str, str]]) -> None:
        now = self._clock()
        if kind == "accepted":
            wait.state = "registered"
            wait.window_closes = now + self.push_timeout_s + self.write_timeout_s
        elif kind == "unconfirmed":
            wait.window_closes = (now + self.side_channel_timeout_s + self.push_timeout_s
                                  + self.write_timeout_s)
            logger.warning("PDConnector: registration of %s with %s:%d unconfirmed: %s",
                           wait.request_id, *wait.endpoint, detail)
        elif kind == "refused":
            reason = (FailureReason.INCOMPATIBLE if "incompatible" in detail
                      else FailureReason.HANDSHAKE)
            self._settle(wait, reason, f"P refused the push registration: {detail}", out)
        elif kind == "failed":
            self._settle(wait, FailureReason.TRANSFER, f"P could not write the KV: {detail}",
                         out)
        elif kind in ("abort_aborted", "abort_unknown", "abort_failed"):
            self._settle(wait, FailureReason.ABORTED if wait.ended else FailureReason.TIMEOUT,
                         wait.why or "aborted", out)
        elif kind == "abort_done":
            if wait.ended:
                self._settle(wait, FailureReason.ABORTED, wait.why, out)
            else:
                # The notification is on its way (it follows the data).
                wait.done_seen = True
                wait.abort_sent = False
                wait.deadline = now + DONE_GRACE_S
        elif kind == "abort_in_flight":
            wait.state = "in_flight"
            wait.next_abort = now + ABORT_RETRY_S
        elif kind == "abort_error":
            if now >= wait.window_closes:
                self._settle(wait, FailureReason.ABORTED if wait.ended else
                             FailureReason.HANDSHAKE,
                             f"{wait.why}; P is unreachable ({detail}) and its WRITE window "
                             "has closed", out)
            else:
                wait.state = "in_flight"
                wait.next_abort = min(now + ABORT_RETRY_S, wait.window_closes)

    def _send_abort(self, wait: PushWait, reason: str) -> None:
        wait.abort_sent = True
        if wait.state != "registering":
            wait.state = "aborting"
        wait.next_abort = self._clock() + ABORT_RETRY_S
        rid = wait.request_id
        self._outbox.send(wait.endpoint[0], wait.endpoint[1], proto.PushAbort(
            engine_id=self.engine_id, pd_request_id=wait.pd_request_id, reason=reason),
            lambda r: self._on_abort_reply(rid, r))

    def _settle(self, wait: PushWait, reason: FailureReason, detail: str,
                out: dict[str, tuple[str, str]]) -> None:
        self.finished(wait.request_id)
        if wait.ended:  # not a failure: vLLM only needs the blocks back
            reason = FailureReason.ABORTED
        out[wait.request_id] = (reason.value, detail)

    def close(self) -> None:
        self._outbox.close()
