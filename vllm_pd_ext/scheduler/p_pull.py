"""P's scheduler half in pull mode: lend a finished prefill's blocks to D.

Runs on P's scheduler thread (EngineCore process). The dispatcher calls
``lend`` from ``request_finished`` of a ``do_remote_decode`` prefill that
ended normally: the prompt's blocks are pinned under a lease keyed by P's
own request id (what D learns as ``remote_request_id``), for every D rank
to read (``tp_size`` consumers). D's workers then pin, READ and release it
over the side channel (``leases.service``); the sweep frees the blocks.

Push mode's half (``p_push.PushProducer``) has the same operations, keyed
by the proxy's ``pd_request_id``, and starts P's WRITEs instead.
"""

from __future__ import annotations

from typing import Protocol

from vllm_pd_ext.leases.lender import BlockLender
from vllm_pd_ext.wire.protocol import KVTransferParams


class PMode(Protocol):
    """P's half of one transfer mode (``PullProducer``, ``p_push.PushProducer``)."""

    def lease_key(self, request_id: str, params: KVTransferParams) -> str:
        """The id P's lease (and D's heartbeats) go by."""

    def admit(self, key: str) -> None:
        """P's leg arrived (before its prefill is scheduled)."""

    def retire(self, key: str) -> None:
        """P's leg finished, however it ended."""

    def prefill_failed(self, key: str, request_id: str, status: str) -> None:
        """The prefill ended without KV to hand over."""

    def lend(self, key: str, request_id: str, block_ids: list[int], num_tokens: int,
             prompt_digest: str) -> float:
        """Lease the prompt's blocks to D; the lease's monotonic expiry.
        ``KeyError`` if ``key`` is leased already (nothing pinned then)."""

    def sweep(self) -> None:
        """Every step, before the lease sweep."""

    def forget_expired(self, keys: list[str]) -> None:
        """Inside the lease sweep: these leases expired unreleased."""


class PullProducer:
    """P's half of pull mode: D reads, so P only lends."""

    def __init__(self, lender: BlockLender, tp_size: int) -> None:
        self.lender = lender
        self.tp_size = tp_size

    def lease_key(self, request_id: str, params: KVTransferParams) -> str:
        return request_id

    def admit(self, key: str) -> None:
        pass

    def retire(self, key: str) -> None:
        pass

    def prefill_failed(self, key: str, request_id: str, status: str) -> None:
        pass  # D learns at its pin: the lease is unknown

    def lend(self, key: str, request_id: str, block_ids: list[int], num_tokens: int,
             prompt_digest: str) -> float:
        # Every D rank reads its share; the lease ends when all released.
        return self.lender.lend(key, block_ids, num_consumers=self.tp_size)

    def sweep(self) -> None:
        pass

    def forget_expired(self, keys: list[str]) -> None:
        pass
