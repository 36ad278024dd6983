"""Where one request's asynchronous KV load stands, as the scheduler sees it.

Used for D's loads from P (``d_requests.DRequest``) and P's read-backs from
D (``p_readback.ReadBack``). Pure. The transitions, all on the scheduler
thread, and the vLLM calls that make them::

    WAITING --allocate(load)--> LOADING --reported--> READY
       |                           |
       |--allocate(nothing)--> READY   --end--> (forgotten)
       |                           |
       +--end--> (forgotten:       +--end--> ENDED --reported--> (forgotten)
                  nothing was sent
                  to the workers)

``allocate``: ``update_state_after_alloc``; ``reported``: the workers listed
the id in ``finished_recving`` (done or failed); ``end``: ``request_finished``.
A record in LOADING or ENDED must stay until the workers report it: vLLM
keeps the request's blocks until then, and a transfer may still write them.
"""

from __future__ import annotations

import enum


class LoadState(enum.Enum):
    #: Arrived; vLLM has not allocated its blocks yet.
    WAITING = "waiting"
    #: A load (or its failure) is queued for the workers, who will report it.
    LOADING = "loading"
    #: Nothing (more) to load: loaded, failed and reported, or all cached here.
    READY = "ready"
    #: vLLM finished the request while its load was in flight.
    ENDED = "ended"


class Load:
    """A ``LoadState`` with its transitions (a mixin for per-request records)."""

    state: LoadState = LoadState.WAITING

    @property
    def in_flight(self) -> bool:
        """The workers have yet to report this request's load."""
        return self.state in (LoadState.LOADING, LoadState.ENDED)

    def allocate(self, loading: bool) -> None:
        assert self.state is LoadState.WAITING, self.state
        self.state = LoadState.LOADING if loading else LoadState.READY

    def reported(self) -> bool:
        """The workers reported the load; True if the record can go now."""
        assert self.in_flight, self.state
        ended = self.state is LoadState.ENDED
        self.state = LoadState.READY
        return ended

    def end(self) -> bool:
        """vLLM finished the request; True if the record can go now (no load
        in flight), False if it stays until the workers report the load."""
        if self.in_flight:
            self.state = LoadState.ENDED
            return False
        return True
