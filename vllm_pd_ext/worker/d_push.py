"""D's worker half in push mode: wait for P's WRITE notifications.

Runs on D's worker main thread (the engine step). The scheduler hands over
one ``PushRecvSpec`` per registered request (``expect``); P's WRITE carries
the notification ``pdx:<token>/<pd_request_id>``, which NIXL delivers after the
data, so a request is reported loaded exactly when its bytes have landed.
A notification can beat its spec (P is fast, the step is not): it is kept
until the spec arrives, and forgotten after ``EARLY_TTL_S``. A notification
may carry P's token #1 (``pdx:<token>+<seed>/<id>``, ``pd_seed_pending``):
it lands with its ``Landed.seed`` (-1 when none came, or P's ranks sent
different ones).

Failures are decided by the scheduler half (which knows when no WRITE can
land any more) and handed down as ``push_fail``; ``drop`` then stops the
wait so a request is reported exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_pd_ext.log import get_logger
from vllm_pd_ext.transport import Transport
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.specs import PushRecvSpec

logger = get_logger(__name__)

#: Seconds a notification without a spec is kept.
EARLY_TTL_S = 120.0
#: Distinct tags kept per early push id: one per P rank writing into this
#: rank (up to 64, P sharded more finely than D), plus a few forgeries.
MAX_EARLY_TOKENS = 4 + 64


@dataclass(frozen=True)
class Landed:
    spec: PushRecvSpec
    wait_s: float
    #: P's token #1 from the notification(s); -1: none.
    seed: int = -1


class PushReceiver:
    def __init__(self, transport: Transport, early_ttl_s: float = EARLY_TTL_S,
                 warn_unknown: bool = True) -> None:
        self.transport = transport
        #: How long a notification without a spec is kept, and whether its
        #: drop is worth a warning (the scheduler's replay, ``d_landing``,
        #: sees the late copies of pushes it already forgot: no warning).
        self.early_ttl_s = early_ttl_s
        self.warn_unknown = warn_unknown
        self._expected: dict[str, tuple[PushRecvSpec, float]] = {}
        self._by_request: dict[str, str] = {}
        #: pd_request_id -> token -> arrival, for notifications ahead of their spec.
        self._early: dict[str, dict[str, float]] = {}
        #: pd_request_id -> token -> the seed its notification carried.
        self._seeds: dict[str, dict[str, int]] = {}
        #: Notifications dropped for a wrong token.
        self.num_foreign = 0

    def expect(self, spec: PushRecvSpec, now: float) -> None:
        self._expected[spec.pd_request_id] = (spec, now)
        self._by_request[spec.request_id] = spec.pd_request_id

    def drop(self, request_id: str) -> bool:
        """Stop waiting; True if the request was still waiting."""
        pd_id = self._by_request.pop(request_id, None)
        return pd_id is not None and self._expected.pop(pd_id, None) is not None

    def collect(self, now: float) -> list[Landed]:
        for msg in self.transport.take_notifs():
            parsed = proto.parse_push_notif(msg)
            if parsed is None:
                logger.warning("PDConnector: unexpected NIXL notification %r", msg[:64])
                continue
            pd_id, tag = parsed
            token, seed = proto.notif_seed(tag)
            tokens = self._early.setdefault(pd_id, {})
            if len(tokens) < MAX_EARLY_TOKENS:
                tokens[token] = now
                if seed >= 0:
                    self._seeds.setdefault(pd_id, {})[token] = seed
        out = []
        for pd_id in [p for p in self._early if p in self._expected]:
            tokens = self._early[pd_id]
            spec, since = self._expected[pd_id]
            tags = [proto.notif_writer(t) for t in tokens]
            ours = [(w, n) for tok, w, n in tags if tok == spec.notif_token]
            if len(ours) < len(tags):
                # Not from the P this push was registered with: it does not count.
                self.num_foreign += len(tags) - len(ours)
                logger.warning("PDConnector: notification for push %s without its "
                               "registration's token dropped (not from the P it was "
                               "registered with)", pd_id)
                seeds = self._seeds.get(pd_id, {})
                for tag, (tok, _, _) in zip(list(tokens), tags, strict=True):
                    if tok != spec.notif_token:
                        del tokens[tag]
                        seeds.pop(tag, None)
            # P sharded unlike D: every P rank writing into this rank notifies
            # (``writer`` of ``writers``); the KV is in once all of them are.
            writers = {n for _, n in ours}
            if not ours or len(writers) != 1 or len({w for w, _ in ours}) < writers.pop():
                if not tokens:
                    del self._early[pd_id]
                    self._seeds.pop(pd_id, None)
                continue
            del self._early[pd_id]
            del self._expected[pd_id]
            self._by_request.pop(spec.request_id, None)
            # Every rank of P sends the same token #1; any disagreement (or
            # a rank without one) leaves none, and the load fails.
            seeds = self._seeds.pop(pd_id, {})
            got = {seeds.get(tag, -1) for tag in tokens}
            out.append(Landed(spec, now - since, got.pop() if len(got) == 1 else -1))
        for pd_id, tokens in list(self._early.items()):
            if now - max(tokens.values()) > self.early_ttl_s:
                del self._early[pd_id]
                self._seeds.pop(pd_id, None)
                if self.warn_unknown:
                    logger.warning("PDConnector: notification for unknown push %s dropped",
                                   pd_id)
        return out

    @property
    def num_waiting(self) -> int:
        return len(self._expected)
