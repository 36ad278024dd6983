"""P's scheduler half in pull mode: lend a finished prefill's blocks to D.

Runs on P's scheduler thread (EngineCore process). The dispatcher calls
``lend`` from ``request_finished`` of a ``do_remote_decode`` prefill that
ended normally: the prompt's blocks are pinned under a lease keyed by P's
own request id (what D learns as ``remote_request_id``), for every D rank
to read (``tp_size`` consumers). D's workers then pin, READ and release it
over the side channel (``leases.service``); the sweep frees the blocks.

Both modes' P halves implement ``p_handover.PMode``; push mode's
(``p_push.PushProducer``) keys its leases by the proxy's ``pd_request_id``
and starts P's WRITEs once D registered.
"""

from __future__ import annotations

from vllm_pd_ext.leases.lender import BlockLender
from vllm_pd_ext.wire.protocol import KVTransferParams


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
             prompt_digest: str, first_token: int = -1) -> float:
        # Every D rank reads its share; the lease ends when all released.
        return self.lender.lend(key, block_ids, num_consumers=self.tp_size)

    def sweep(self) -> None:
        pass

    def forget_expired(self, keys: list[str]) -> None:
        pass
