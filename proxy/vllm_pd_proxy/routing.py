"""Routing policies: which backend of a role gets the next leg.

Role: a policy is any object with ``choose(candidates, tokens) -> Backend``
(:class:`RoutingPolicy`). :data:`POLICIES` maps the ``--routing`` names to the
built-in factories; ``create_app(config, policies=...)`` accepts more, so a
deployment can plug its own without touching module state. Lifecycle: one
policy instance per pool (prefill, decode), created by ``create_app`` and
called on the event loop for every leg with the routable candidates only
(unhealthy and already-failed backends are filtered out by the pool).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .backends import Backend


class RoutingPolicy(Protocol):
    """Chooses one of ``candidates`` (never empty) for a leg of ``tokens``."""

    def choose(self, candidates: Sequence[Backend], tokens: int) -> Backend: ...


class RoundRobin:
    """Cycle through the candidates, ignoring load."""

    def __init__(self) -> None:
        self._counter = 0

    def choose(self, candidates: Sequence[Backend], tokens: int) -> Backend:
        backend = candidates[self._counter % len(candidates)]
        self._counter += 1
        return backend


class LeastLoaded:
    """Least outstanding work: prompt tokens in flight plus a per-request cost.

    ``REQUEST_COST`` charges every in-flight request as if it had that many
    extra prompt tokens, so many tiny requests still count as load (each one
    occupies a scheduler slot and, on decode engines, a sequence in the
    batch). Ties rotate the starting point so idle engines share the load.
    """

    REQUEST_COST = 64

    def __init__(self) -> None:
        self._offset = 0

    def choose(self, candidates: Sequence[Backend], tokens: int) -> Backend:
        n = len(candidates)
        start = self._offset % n
        self._offset += 1
        best = candidates[start]
        best_score = best.outstanding_tokens + self.REQUEST_COST * best.in_flight
        for i in range(1, n):
            backend = candidates[(start + i) % n]
            score = backend.outstanding_tokens + self.REQUEST_COST * backend.in_flight
            if score < best_score:
                best, best_score = backend, score
        return best


PolicyFactory = Callable[[], RoutingPolicy]

# Read-only: extra policies are passed to create_app, not registered globally.
POLICIES: Mapping[str, PolicyFactory] = MappingProxyType(
    {"least-loaded": LeastLoaded, "round-robin": RoundRobin}
)


def make_policy(name: str, extra: Mapping[str, PolicyFactory] | None = None) -> RoutingPolicy:
    """Instantiate the policy called ``name`` from the built-ins and ``extra``."""
    registry = {**POLICIES, **(extra or {})}
    try:
        factory = registry[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(registry)}") from None
    return factory()
