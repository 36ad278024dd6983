"""Conversation affinity (``--multi-turn``): a turn's D, read-back and filing.

One :class:`Affinity` per proxy, built by the
:class:`~vllm_pd_proxy.forward.Forwarder` around the pure
:class:`~vllm_pd_proxy.conversations.ConversationStore`, the decode pool and
the metrics; used on the event loop only. Per request with a conversation
key:

1. :meth:`Affinity.take_turn`: the conversation's last turn, if its D is still
   routable (``pd_proxy_multi_turn_total``: ``hit``, ``miss``, ``expired``,
   ``d_unavailable``); the entry is used once;
2. :meth:`Affinity.affine_decode`: that D for this turn's D leg while it is not
   much busier than the least loaded D (``pd_proxy_multi_turn_decode_total``:
   ``same`` or ``other``);
3. the flows add the turn to the P leg (:meth:`Affinity.with_readback`) and,
   if P fails with a read-back in it, send the P leg once more without
   (:meth:`Affinity.readback_failed`, ``readback_failed``);
4. :meth:`Affinity.file_turn`: D's answer kept for the next turn (or the
   entry dropped), whatever the request's outcome.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from . import errors
from .backends import Backend, Pool
from .config import ProxyConfig
from .context import RequestContext, log_safe
from .conversations import ConversationStore, Turn, readback_params
from .metrics import Metrics

# The logger of the request path (docs/proxy.md names it; log lines unchanged).
logger = logging.getLogger("vllm_pd_proxy.forward")


class Affinity:
    """Which D serves a conversation's next turn, and what P reads back."""

    def __init__(self, config: ProxyConfig, decode: Pool, metrics: Metrics) -> None:
        self._slack = config.multi_turn_affinity_slack
        self._decode = decode
        self._metrics = metrics
        self._turns = ConversationStore(
            config.multi_turn_store_size, config.multi_turn_ttl, time.monotonic,
            max_bytes=config.multi_turn_store_mib << 20)

    def take_turn(self, key: str) -> Turn | None:
        """The conversation's last turn, if P can still read it back from its D."""
        turn, outcome = self._turns.take(key)
        if turn is not None and not self._decode_by_url(turn.decode_url):
            turn, outcome = None, "d_unavailable"
        self._metrics.multi_turn.labels(outcome).inc()
        return turn

    def affine_decode(self, turn: Turn) -> Backend | None:
        """The D that kept the last turn, while it is not much busier than the
        least loaded routable D (its prefix cache holds the history)."""
        same = self._decode_by_url(turn.decode_url)
        usable = self._decode.usable()
        if same is not None and usable:
            least = min(b.in_flight for b in usable)
            if same.in_flight <= least + self._slack:
                self._metrics.affinity.labels("same").inc()
                return same
        self._metrics.affinity.labels("other").inc()
        return None

    def file_turn(self, ctx: RequestContext, key: str) -> None:
        """Keep D's answer for the conversation's next turn, or drop the entry."""
        # D sends its params only with a request that ended well (in a stream's
        # finishing chunk), so having them is enough, even if the client then
        # closed the connection before the stream's very end.
        params, decode = ctx.kept_turn, ctx.decode
        if params is None or decode is None:
            self._turns.drop(key)  # the previous turn's blocks were read or are gone
            return
        self._turns.put(key, decode.url, params, time.time())

    @staticmethod
    def with_readback(params: dict[str, Any], turn: Turn | None) -> dict[str, Any]:
        """A P leg's ``params``, plus the turn to read back if there is one."""
        return params if turn is None else readback_params(turn.params, params)

    def readback_failed(
        self, ctx: RequestContext, exc: errors.ProxyError, turn: Turn | None
    ) -> bool:
        """A P leg with a read-back failed on P (D gone, lease lost, with P's
        kv_load_failure_policy=fail): worth one more try without it."""
        failed = (turn is not None and exc.backend is not None and exc.backend.role == "prefill"
                  and exc.outcome == errors.Outcome.UPSTREAM_5XX and not exc.draining)
        if failed:
            self._metrics.multi_turn.labels("readback_failed").inc()
            logger.warning("request %s: prefill with read-back failed (%s); prefilling the "
                           "whole prompt", ctx.request_id, log_safe(exc.message))
        return failed

    def _decode_by_url(self, url: str) -> Backend | None:
        for backend in self._decode.backends:
            if backend.url == url and backend.routable:
                return backend
        return None
