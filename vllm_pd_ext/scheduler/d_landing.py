"""D in push mode: see a push land from the scheduler, without a step.

Why: D's worker learns that P's WRITE landed from its NIXL notification,
but reports it only in the output of the step that collects it; the
request is scheduled in the step after that. On an idle D that is one
empty step's round trip to the worker and back (two crossings between the
EngineCore and its workers) between the bytes landing and D computing
token #2 (issue 29, docs/slo.md "the gap").

What: each worker's progress pump forwards the notifications it kept with
its wake (``wire/wakeup.py``). ``LandingView`` holds one ``PushReceiver``
per worker rank, the worker's own verifier fed with those copies and the
same specs, so a push counts as landed here exactly when every rank's
worker will count it so: every rank saw the notification(s) of the P it was
registered with, carrying one token #1. The scheduler half then promotes
the request before ``schedule()`` (``PDScheduler.before_schedule``) and
takes it out of the worker's later report.

The copies are hints. A rank whose notification the view never saw (the
forward dropped, or the worker's step thread took it first) keeps the
request out of the view until the worker's own report, which ends it here
(``forget``).

Lifecycle: one per D scheduler half in push mode; ``expect`` when a push's
spec leaves for the workers, ``forget`` when its wait ends any other way
(the workers' report, a failure sent down, the request's end).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_pd_ext.wire.specs import PushRecvSpec
from vllm_pd_ext.worker.d_push import PushReceiver

#: Seconds a forwarded notification without a spec is kept in the view.
LATE_COPY_TTL_S = 5.0


class _Inbox:
    """A ``PushReceiver``'s transport: only ``take_notifs`` is called."""

    def __init__(self) -> None:
        self.notifs: list[bytes] = []

    def take_notifs(self) -> list[bytes]:
        out, self.notifs = self.notifs, []
        return out


@dataclass(frozen=True)
class SeenLanded:
    spec: PushRecvSpec
    #: P's token #1, the same on every rank; -1: none, or ranks disagree.
    seed: int
    #: The longest any rank waited for it, from ``expect``.
    wait_s: float


class LandingView:
    """Every D worker rank's ``PushReceiver``, replayed in the scheduler."""

    def __init__(self, tp_size: int) -> None:
        self.tp_size = tp_size
        self._inboxes = [_Inbox() for _ in range(tp_size)]
        # Most copies the view never matches are late ones, of pushes the
        # workers' report already ended here: dropped soon, and silently.
        self._ranks = [PushReceiver(inbox, early_ttl_s=LATE_COPY_TTL_S,  # type: ignore[arg-type]
                                    warn_unknown=False) for inbox in self._inboxes]
        #: request id -> {rank: (seed, wait_s)} of ranks that saw it land.
        self._partial: dict[str, dict[int, tuple[int, float]]] = {}
        #: Forwarded notifications from a rank this engine does not have.
        self.num_bad_rank = 0

    def expect(self, spec: PushRecvSpec, now: float) -> None:
        for receiver in self._ranks:
            receiver.expect(spec, now)

    def forget(self, request_id: str) -> None:
        for receiver in self._ranks:
            receiver.drop(request_id)
        self._partial.pop(request_id, None)

    def feed(self, rank: int, notifs: list[bytes]) -> None:
        if not 0 <= rank < self.tp_size:
            self.num_bad_rank += 1
            return
        self._inboxes[rank].notifs.extend(notifs)

    def collect(self, now: float) -> list[SeenLanded]:
        """The pushes every rank has seen land since the last call."""
        out = []
        for rank, receiver in enumerate(self._ranks):
            for landed in receiver.collect(now):
                rid = landed.spec.request_id
                seen = self._partial.setdefault(rid, {})
                seen[rank] = (landed.seed, landed.wait_s)
                if len(seen) < self.tp_size:
                    continue
                del self._partial[rid]
                seeds = {s for s, _ in seen.values()}
                out.append(SeenLanded(landed.spec, seeds.pop() if len(seeds) == 1 else -1,
                                      max(w for _, w in seen.values())))
        return out

    @property
    def num_waiting(self) -> int:
        return max(r.num_waiting for r in self._ranks)
