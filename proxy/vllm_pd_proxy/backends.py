"""Backend bookkeeping: one :class:`Backend` per configured engine URL.

Lifecycle: ``create_app`` builds a prefill and a decode :class:`Pool` from the
config. The health loop (:mod:`vllm_pd_proxy.health`) writes ``state``,
``last_error`` and, in push mode (and pull with ``--concurrent-dispatch``),
the prefill ``identity``; the request path
(:mod:`vllm_pd_proxy.forward`, :mod:`vllm_pd_proxy.upstream`) reads them to
route and brackets every leg with
:meth:`Backend.acquire`/:meth:`Backend.release` so the routing policy sees
outstanding work. Everything runs on the event loop thread, so plain ints and
fields are enough (no locks).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from .prompt import PrefixChunks

if TYPE_CHECKING:
    from .routing import RoutingPolicy

Role = Literal["prefill", "decode"]
# "draining": the engine said so (vllm_pd_ext's drain: SIGTERM or POST
# /pd/drain); it finishes what it has, takes nothing new, then exits.
State = Literal["unknown", "healthy", "unhealthy", "draining"]


@dataclass(frozen=True, slots=True)
class PrefillIdentity:
    """What a D leg sent beside P's (push, concurrent pull) needs to know
    about its prefill engine.

    Learned by the probe request (see :mod:`vllm_pd_proxy.health`); an engine
    restart changes ``engine_id``, which is why a P answer that names another
engine replaces it, and why the health round re-probes one that nothing
confirmed lately (``health.IDENTITY_STALE_ROUNDS``).
    """

    engine_id: str
    host: str
    port: int
    tp_size: int
    transfer_mode: str | None
    probed_at: float

    def as_json(self) -> dict[str, Any]:
        return {
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": self.tp_size,
            "transfer_mode": self.transfer_mode,
            "probed_s_ago": round(time.monotonic() - self.probed_at, 3),
        }


@dataclass(eq=False, slots=True)
class Backend:
    """One engine (prefill or decode) and the proxy's view of it."""

    url: str
    role: Role
    index: int
    # "unknown" (never probed) is routable: the proxy must serve before its
    # first health round finishes, and a failed leg triggers a probe anyway.
    state: State = "unknown"
    last_error: str | None = None
    last_checked: float | None = None
    in_flight: int = 0
    outstanding_tokens: int = 0
    requests_total: int = 0
    # Prefill role, where identities are probed (ProxyConfig.probes_identity).
    identity: PrefillIdentity | None = None
    identity_error: str | None = None
    identity_error_at: float | None = None
    # When ``identity`` was last confirmed (monotonic): by a probe, or by a P
    # answer that named the same engine. The health round re-probes only a
    # stale one (health.IDENTITY_STALE_ROUNDS).
    identity_at: float | None = None
    # Decode role with --local-prefill-threshold only: what it probably caches.
    prefixes: PrefixChunks | None = None
    # The last health probe timed out (slow, not known dead).
    slow: bool = False

    @property
    def routable(self) -> bool:
        return self.state in ("unknown", "healthy")

    def acquire(self, tokens: int) -> None:
        self.in_flight += 1
        self.outstanding_tokens += tokens
        self.requests_total += 1

    def release(self, tokens: int) -> None:
        self.in_flight -= 1
        self.outstanding_tokens -= tokens

    def mark(self, state: State, error: str | None = None, slow: bool = False) -> None:
        self.state = state
        self.slow = slow
        self.last_error = error
        self.last_checked = time.monotonic()

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "url": self.url,
            "state": self.state,
            "last_error": self.last_error,
            "last_checked_s_ago": (
                None
                if self.last_checked is None
                else round(time.monotonic() - self.last_checked, 3)
            ),
            "in_flight": self.in_flight,
            "outstanding_tokens": self.outstanding_tokens,
            "requests_total": self.requests_total,
        }
        if self.role == "prefill" and (self.identity or self.identity_error):
            out["identity"] = self.identity.as_json() if self.identity else None
            out["identity_error"] = self.identity_error
        return out


class Pool:
    """The backends of one role plus the routing policy that picks among them."""

    def __init__(self, role: Role, urls: Iterable[str], policy: RoutingPolicy) -> None:
        self.role: Role = role
        self.backends = [Backend(url, role, i) for i, url in enumerate(urls)]
        self.policy = policy

    def pick(self, tokens: int, exclude: Iterable[Backend] = ()) -> Backend | None:
        """Choose a routable backend not in ``exclude``; None when there is none."""
        candidates = self.usable(exclude)
        return self.choose(candidates, tokens) if candidates else None

    def usable(self, exclude: Iterable[Backend] = ()) -> list[Backend]:
        """The backends a leg may go to: routable ones not in ``exclude``.

        A probe that timed out is no proof of death (an overloaded engine
        answers /health late): with nothing routable left, the slow ones.
        """
        excluded = set(exclude)
        candidates = [b for b in self.backends if b.routable and b not in excluded]
        if not candidates:
            candidates = [b for b in self.backends if b.slow and b not in excluded]
        return candidates

    def choose(self, candidates: list[Backend], tokens: int) -> Backend:
        """The routing policy's choice among ``candidates`` (never empty)."""
        if len(candidates) == 1:
            return candidates[0]
        return self.policy.choose(candidates, tokens)

    def any_routable(self) -> bool:
        return any(b.routable or b.slow for b in self.backends)

    def healthy_count(self) -> int:
        return sum(1 for b in self.backends if b.state == "healthy")

    def describe_unavailable(self) -> str:
        """Why no backend of this role can take a request (for the 503 body)."""
        parts = [
            f"{b.url}: {b.state} ({b.last_error or 'no error recorded'})" for b in self.backends
        ]
        return f"no healthy {self.role} backend; " + "; ".join(parts)
