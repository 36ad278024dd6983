"""D's scheduler half in push mode: register blocks with P, bound the wait.

Runs in D's EngineCore process. The scheduler thread calls ``register``
(after vLLM allocated the blocks), ``abandon`` (the request ended, or needs
nothing from P), ``finished`` (the worker saw P's WRITE notification) and
``poll`` (every step). Replies and P's failure notices arrive on other
threads (the outbox, the side channel) and are queued under a lock;
``poll`` applies them on the scheduler thread and returns the requests whose
load must now be reported failed.

One wait's life (``WaitState``; replies arrive as ``PushEvent`` records)::

    REGISTERING --(P accepts)--> REGISTERED --(notification)--> finished
        |                          |
        |  refused                 |  PushResult(ok=False) | deadline -> abort
        v                          v
      failed                 ABORTING --(P: aborted/unknown/done/failed)--> failed
                                   \\--(P: in_flight)--> IN_FLIGHT: ask again in 1 s

While REGISTERED, D renews the registration every ``push_timeout / 4``
(``PushWaiting``). P answers ``queued`` while it holds the request (its own
leg is queued or prefilling) and then keeps the registration for another
``ttl``; D then moves its deadline to ``push_timeout`` from that answer, up to
``push_queue_timeout`` after registering. A long P queue at a load P can
sustain is therefore waited out, and ``push_timeout`` only bounds a P that
does not hold the request (never got it, lost it, or does not answer).

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

import enum
import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from vllm_pd_ext.log import get_logger
from vllm_pd_ext.policy import FailureReason
from vllm_pd_ext.scheduler.load_state import LoadState
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.auth import FrameAuth
from vllm_pd_ext.wire.outbox import Outbox
from vllm_pd_ext.wire.protocol import ErrorCode
from vllm_pd_ext.wire.side_channel import SideChannelError
from vllm_pd_ext.wire.specs import LayoutProblem, PushRecvSpec

logger = get_logger(__name__)

#: Seconds between repeated aborts while P's WRITE is in flight.
ABORT_RETRY_S = 1.0
#: Seconds D still waits for the notification after P said "done".
DONE_GRACE_S = 2.0

Endpoint = tuple[str, int]


class WaitState(enum.Enum):
    """Where D's side of one push stands (see the module docstring)."""

    #: The registration is sent (or queued); P has not accepted it yet.
    REGISTERING = "registering"
    #: P accepted: D waits for the WRITE's notification.
    REGISTERED = "registered"
    #: An abort is sent and unanswered (never two at once).
    ABORTING = "aborting"
    #: P answered ``in_flight`` (or was unreachable within the WRITE window):
    #: abort again at ``next_abort``.
    IN_FLIGHT = "in_flight"


class EventKind(enum.Enum):
    """What another thread learned about a wait; ``poll`` applies it."""

    #: P accepted the registration.
    ACCEPTED = "accepted"
    #: The registration's send ended without an answer: P may have it.
    UNCONFIRMED = "unconfirmed"
    #: P answered the registration with an error: it will never write.
    REFUSED = "refused"
    #: P's ``PushResult(ok=False)``: the WRITE failed and settled.
    FAILED = "failed"
    #: P answered a renewal (``PushWaiting``); ``detail`` is P's state.
    RENEWED = "renewed"
    #: A renewal got an error or no answer (``detail``).
    RENEW_ERROR = "renew_error"
    #: P answered an abort (``PushEvent.abort_state``).
    ABORT_STATUS = "abort_status"
    #: An abort got no answer (or an error).
    ABORT_ERROR = "abort_error"
    #: P answered a heartbeat: its lease on the prefill expired (or was
    #: released). Only a WRITE already done can still be reported.
    LEASE_EXPIRED = "lease_expired"


@dataclass(frozen=True)
class PushEvent:
    request_id: str
    kind: EventKind
    detail: str = ""
    #: ``REFUSED``: the refusal's failure reason.
    reason: FailureReason = FailureReason.HANDSHAKE
    #: ``ABORT_STATUS``: P's answer.
    abort_state: proto.PushAbortState | None = None
    #: When the reply arrived (the consumer's clock); 0: not recorded.
    at: float = 0.0
    #: ``LEASE_EXPIRED``: the P endpoint that said so.
    endpoint: Endpoint | None = None


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
    state: WaitState = WaitState.REGISTERING
    ended: bool = False
    abort_sent: bool = False
    next_abort: float = 0.0
    done_seen: bool = False
    why: str = ""
    registered_at: float = 0.0
    #: When the next renewal (``PushWaiting``) leaves; one at a time.
    renew_at: float = math.inf
    renewing: bool = False
    #: P confirmed it holds the request (queued or prefilling).
    queued: bool = False
    #: The registration's round trip, once P accepted it (telemetry).
    register_s: float | None = None


class PushConsumer:
    def __init__(self, engine_id: str, compat: proto.CompatInfo, host: str, port: int,
                 push_timeout_s: float, side_channel_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic, *,
                 write_timeout_s: float = 30.0, queue_timeout_s: float = 600.0,
                 auth: FrameAuth | None = None) -> None:
        self.engine_id = engine_id
        self.compat = compat
        self.host = host
        self.port = port
        self.push_timeout_s = push_timeout_s
        self.side_channel_timeout_s = side_channel_timeout_s
        self.write_timeout_s = write_timeout_s
        self.queue_timeout_s = max(queue_timeout_s, push_timeout_s)
        self.renew_every_s = push_timeout_s / 4
        #: Called after another thread queued an event (wakes D's idle wait).
        self.on_event: Callable[[], None] | None = None
        self.agents: list[proto.AgentInfo] = []
        self._clock = clock
        self._outbox = Outbox(side_channel_timeout_s, name="pd-push-register", auth=auth)
        self._waits: dict[str, PushWait] = {}
        self._by_pd: dict[str, str] = {}
        #: pd_request_id -> the P engine it was registered with (PushResult's sender).
        self._p_engine: dict[str, str] = {}
        #: PushResults refused: not from the P the push was registered with.
        self.num_wrong_sender = 0
        self._lock = threading.Lock()
        self._events: list[PushEvent] = []

    # ------------------------------------------------------------ scheduler
    def allocate(self, rid: str, params: proto.KVTransferParams, num_prompt_tokens: int,
                 num_external_tokens: int, local_blocks: list[int], prompt_digest: str = ""
                 ) -> PushRecvSpec | LayoutProblem | None:
        """Register the blocks D lacks with P (called from
        ``update_state_after_alloc``); None when D needs nothing from P."""
        pd_id = str(params.pd_request_id)
        endpoint = (str(params.remote_host), int(params.remote_port or 0))
        if num_external_tokens == 0:
            self.abandon(rid, pd_id, endpoint, "prompt fully cached on D")
            return None
        block_size = self.compat.block_size
        num_local_hit = num_prompt_tokens - num_external_tokens
        first_block, partial = divmod(num_local_hit, block_size)
        need = -(-num_prompt_tokens // block_size) - first_block
        problem = None
        if partial:
            problem = (f"D's prefix-cache hit of {num_local_hit} tokens is not a whole number "
                       f"of {block_size}-token blocks")
        elif need <= 0 or len(local_blocks) < need:
            problem = (f"block layout mismatch: the prompt needs {need} blocks from P, D "
                       f"allocated {len(local_blocks)}")
        if problem is not None:
            logger.error("PDConnector: request %s: %s; its KV load will fail", rid, problem)
            self.abandon(rid, pd_id, endpoint, "layout mismatch on D")
            return LayoutProblem(problem)
        token = secrets.token_hex(8)
        want_seed = params.pd_seed_pending
        self.register(rid, pd_id, endpoint, str(params.remote_engine_id), first_block,
                      local_blocks[:need], num_prompt_tokens, prompt_digest, token, want_seed)
        return PushRecvSpec(rid, pd_id, local_blocks[:need], num_external_tokens, token,
                            want_seed)

    def register(self, request_id: str, pd_id: str, endpoint: Endpoint,
                 expect_engine_id: str, first_block: int, block_ids: list[int],
                 num_tokens: int, prompt_digest: str = "", notif_token: str = "",
                 want_seed: bool = False) -> None:
        now = self._clock()
        wait = PushWait(request_id, pd_id, endpoint,
                        deadline=now + self.push_timeout_s + self.side_channel_timeout_s,
                        registered_at=now)
        self._waits[request_id] = wait
        with self._lock:
            self._by_pd[pd_id] = request_id
            self._p_engine[pd_id] = expect_engine_id
        msg = proto.PushRegister(
            engine_id=self.engine_id, compat=self.compat, expect_engine_id=expect_engine_id,
            pd_request_id=pd_id, request_id=request_id, notify_host=self.host,
            notify_port=self.port, agents=self.agents, first_block=first_block,
            block_ids=list(block_ids), num_tokens=num_tokens, ttl_s=self.push_timeout_s,
            prompt_digest=prompt_digest, notif_token=notif_token, want_seed=want_seed)
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

    def end(self, request_id: str, params: proto.KVTransferParams, state: LoadState) -> None:
        """vLLM finished the request before or during its wait for P's WRITE:
        P must stop (or never start) writing before D's blocks are reused;
        ``poll`` reports the request once P confirmed."""
        self.abandon(request_id, str(params.pd_request_id),
                     (str(params.remote_host), int(params.remote_port or 0)),
                     "request ended on D")

    def register_seconds(self, request_id: str) -> float | None:
        """The registration's round trip of a waiting request, once accepted."""
        wait = self._waits.get(request_id)
        return wait.register_s if wait is not None else None

    def loaded(self, request_id: str) -> None:
        """The worker reported the request's KV landed (or its load failed)."""
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        wait = self._waits.pop(request_id, None)
        if wait is not None:
            with self._lock:
                self._by_pd.pop(wait.pd_request_id, None)
                self._p_engine.pop(wait.pd_request_id, None)

    def poll(self) -> dict[str, tuple[str, str]]:
        """Apply replies and deadlines; returns request id -> (reason, detail)
        for loads that must be reported failed now (their blocks are safe)."""
        with self._lock:
            events, self._events = self._events, []
        out: dict[str, tuple[str, str]] = {}
        for event in events:
            wait = self._waits.get(event.request_id)
            if wait is not None:
                self._apply(wait, event, out)
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
                wait.why = wait.why or self._deadline_why(wait, now)
                self._send_abort(wait, "deadline passed on D")
            elif (not wait.abort_sent and wait.state is WaitState.REGISTERED
                  and not wait.renewing and now >= wait.renew_at):
                self._send_renewal(wait, now)
            elif (wait.abort_sent and wait.state is WaitState.IN_FLIGHT
                  and now >= wait.next_abort):
                # (state becomes ABORTING until P answers: never two at once)
                self._send_abort(wait, wait.why)
        return out

    @property
    def num_waiting(self) -> int:
        return len(self._waits)

    def _deadline_why(self, wait: PushWait, now: float) -> str:
        if wait.queued:
            return (f"no KV from P within push_queue_timeout ({self.queue_timeout_s:.1f} s) "
                    "although P reported the request queued (waited "
                    f"{now - wait.registered_at:.1f} s)")
        return (f"no KV from P within push_timeout ({self.push_timeout_s:.1f} s); P never "
                "confirmed it holds the request (did the prefill leg reach it?)")

    def _send_renewal(self, wait: PushWait, now: float) -> None:
        wait.renewing = True
        wait.renew_at = now + self.renew_every_s
        rid = wait.request_id
        self._outbox.send(wait.endpoint[0], wait.endpoint[1], proto.PushWaiting(
            engine_id=self.engine_id, pd_request_id=wait.pd_request_id),
            lambda r: self._on_renew_reply(rid, r))

    def _confirmed_queued(self, wait: PushWait, now: float) -> None:
        """P holds the request and keeps the registration until ``now + ttl``."""
        wait.queued = True
        cap = wait.registered_at + self.queue_timeout_s + self.side_channel_timeout_s
        wait.deadline = max(wait.deadline, min(
            cap, now + self.push_timeout_s + self.side_channel_timeout_s))
        wait.window_closes = max(wait.window_closes, now + self.push_timeout_s
                                 + self.write_timeout_s)

    # ------------------------------------------------------------ threads
    def on_result(self, msg: proto.PushResult) -> proto.Reply:
        """Side-channel thread: P's WRITE failed and settled."""
        with self._lock:
            rid = self._by_pd.get(msg.pd_request_id)
            expect = self._p_engine.get(msg.pd_request_id)
            if rid is not None and expect != msg.engine_id:
                self.num_wrong_sender += 1
                logger.warning("PDConnector: push result for %s from engine %s refused: it "
                               "was registered with engine %s", msg.pd_request_id,
                               msg.engine_id, expect)
                return proto.ErrorReply(ErrorCode.REFUSED, f"push {msg.pd_request_id} was not "
                                        f"registered with engine {msg.engine_id}")
            if rid is not None:
                self._events.append(PushEvent(rid, EventKind.FAILED, msg.detail))
        if rid is not None and self.on_event is not None:
            self.on_event()
        if rid is None:
            logger.info("PDConnector: push result for unknown %s from engine %s (ok=%s)",
                        msg.pd_request_id, msg.engine_id, msg.ok)
        return proto.Ack()

    def lease_expired(self, endpoint: Endpoint, pd_ids: list[str]) -> None:
        """Heartbeat lane: P reports its leases on ``pd_ids`` expired or
        released. A wait for one of them would otherwise last until its
        deadline (``push_timeout``), typically after P was unreachable
        while D registered (the registration unconfirmed, P's lease lapsed
        meanwhile); ``poll`` aborts it instead, which also learns whether a
        WRITE landed after all."""
        with self._lock:
            rids = [rid for pd_id in pd_ids if (rid := self._by_pd.get(pd_id)) is not None]
            self._events.extend(PushEvent(rid, EventKind.LEASE_EXPIRED, endpoint=endpoint)
                                for rid in rids)
        if rids and self.on_event is not None:
            self.on_event()

    def _on_register_reply(self, rid: str, expect: str,
                           reply: proto.Reply | SideChannelError) -> None:
        if isinstance(reply, proto.PushAccepted):
            event = PushEvent(rid, EventKind.ACCEPTED, str(reply.state), at=self._clock())
        elif isinstance(reply, SideChannelError) and not reply.refused:
            # Unknown whether P got it: the deadline (and the abort) decide.
            event = PushEvent(rid, EventKind.UNCONFIRMED, str(reply))
        else:
            code = reply.code if isinstance(reply, SideChannelError | proto.ErrorReply) else ""
            event = PushEvent(rid, EventKind.REFUSED, str(reply),
                              reason=FailureReason.INCOMPATIBLE if code == ErrorCode.INCOMPATIBLE
                              else FailureReason.HANDSHAKE)
        self._queue(event)

    def _on_renew_reply(self, rid: str, reply: proto.Reply | SideChannelError) -> None:
        if isinstance(reply, proto.PushAccepted):
            self._queue(PushEvent(rid, EventKind.RENEWED, str(reply.state)))
        elif isinstance(reply, SideChannelError) and not reply.refused:
            # No answer: P may have renewed, so its window may be longer.
            self._queue(PushEvent(rid, EventKind.RENEW_ERROR, str(reply)))
        else:
            # A definite "no" (unknown, refused): nothing was renewed.
            self._queue(PushEvent(rid, EventKind.RENEWED, f"not renewed: {reply}"))

    def _queue(self, event: PushEvent) -> None:
        with self._lock:
            self._events.append(event)
        if self.on_event is not None:
            self.on_event()

    def _on_abort_reply(self, rid: str, reply: proto.Reply | SideChannelError) -> None:
        if isinstance(reply, proto.PushAbortStatus):
            # (already an enum when decoded; the call also types an in-process reply)
            event = PushEvent(rid, EventKind.ABORT_STATUS,
                              abort_state=proto.PushAbortState(reply.state))
        else:
            event = PushEvent(rid, EventKind.ABORT_ERROR, str(reply))
        self._queue(event)

    # ------------------------------------------------------------ internals
    def _apply(self, wait: PushWait, event: PushEvent,
               out: dict[str, tuple[str, str]]) -> None:
        now = self._clock()
        kind, detail = event.kind, event.detail
        if kind is EventKind.ACCEPTED:
            wait.state = WaitState.REGISTERED
            if event.at:
                wait.register_s = max(0.0, event.at - wait.registered_at)
            wait.window_closes = now + self.push_timeout_s + self.write_timeout_s
            wait.renew_at = now + self.renew_every_s
            if detail == proto.PushAcceptedState.QUEUED:
                self._confirmed_queued(wait, now)
        elif kind is EventKind.RENEWED:
            wait.renewing = False
            if detail == proto.PushAcceptedState.QUEUED:
                self._confirmed_queued(wait, now)
        elif kind is EventKind.RENEW_ERROR:
            wait.renewing = False
            # P may have renewed before the answer was lost: assume it did.
            wait.window_closes = max(wait.window_closes, now + self.side_channel_timeout_s
                                     + self.push_timeout_s + self.write_timeout_s)
            logger.warning("PDConnector: renewing the push registration of %s with %s:%d "
                           "failed: %s", wait.request_id, *wait.endpoint, detail)
        elif kind is EventKind.UNCONFIRMED:
            wait.window_closes = (now + self.side_channel_timeout_s + self.push_timeout_s
                                  + self.write_timeout_s)
            logger.warning("PDConnector: registration of %s with %s:%d unconfirmed: %s",
                           wait.request_id, *wait.endpoint, detail)
        elif kind is EventKind.REFUSED:
            self._settle(wait, event.reason, f"P refused the push registration: {detail}", out)
        elif kind is EventKind.FAILED:
            self._settle(wait, FailureReason.TRANSFER, f"P could not write the KV: {detail}",
                         out)
        elif kind is EventKind.ABORT_STATUS:
            self._apply_abort_status(wait, event.abort_state, now, out)
        elif kind is EventKind.LEASE_EXPIRED:
            # Not while an abort is out (its answer decides) or after P said
            # its WRITE is done (the notification is on its way). Another P
            # reusing the id cannot end this wait: the endpoint must match.
            if not wait.abort_sent and not wait.done_seen and event.endpoint == wait.endpoint:
                wait.why = ("P's lease on the prefill expired before its KV reached this "
                            "engine (was P unreachable while D registered?)")
                logger.warning("PDConnector: request %s: %s; aborting the push %s",
                               wait.request_id, wait.why, wait.pd_request_id)
                self._send_abort(wait, "P's lease expired")
        elif kind is EventKind.ABORT_ERROR:
            if now >= wait.window_closes:
                self._settle(wait, FailureReason.ABORTED if wait.ended else
                             FailureReason.HANDSHAKE,
                             f"{wait.why}; P is unreachable ({detail}) and its WRITE window "
                             "has closed", out)
            else:
                wait.state = WaitState.IN_FLIGHT
                wait.next_abort = min(now + ABORT_RETRY_S, wait.window_closes)

    def _apply_abort_status(self, wait: PushWait, state: proto.PushAbortState | None,
                            now: float, out: dict[str, tuple[str, str]]) -> None:
        """P answered an abort."""
        if state is proto.PushAbortState.DONE:
            if wait.ended:
                self._settle(wait, FailureReason.ABORTED, wait.why, out)
            else:
                # The notification is on its way (it follows the data).
                wait.done_seen = True
                wait.abort_sent = False
                wait.deadline = now + DONE_GRACE_S
        elif state is proto.PushAbortState.IN_FLIGHT:
            wait.state = WaitState.IN_FLIGHT
            wait.next_abort = now + ABORT_RETRY_S
        else:
            assert state is not None and state.is_safe, state  # ABORTED, UNKNOWN, FAILED
            self._settle(wait, FailureReason.ABORTED if wait.ended else FailureReason.TIMEOUT,
                         wait.why or "aborted", out)

    def _send_abort(self, wait: PushWait, reason: str) -> None:
        wait.abort_sent = True
        if wait.state is not WaitState.REGISTERING:
            wait.state = WaitState.ABORTING
        wait.next_abort = self._clock() + ABORT_RETRY_S
        rid = wait.request_id
        self._outbox.send(wait.endpoint[0], wait.endpoint[1], proto.PushAbort(
            engine_id=self.engine_id, pd_request_id=wait.pd_request_id, reason=reason),
            lambda r: self._on_abort_reply(rid, r))

    def _settle(self, wait: PushWait, reason: FailureReason, detail: str,
                out: dict[str, tuple[str, str]]) -> None:
        self._forget(wait.request_id)
        if wait.ended:  # not a failure: vLLM only needs the blocks back
            reason = FailureReason.ABORTED
        out[wait.request_id] = (reason.value, detail)

    def close(self) -> None:
        self._outbox.close()
