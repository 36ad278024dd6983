"""D's scheduler half in pull mode: pair D's fresh blocks with P's.

Runs on D's scheduler thread (EngineCore process). ``allocate`` is called
from ``update_state_after_alloc`` once vLLM gave the request its blocks: it
cuts D's own prefix-cache hit off P's block list, checks that what is left
covers the prompt exactly, and returns the ``RecvSpec`` the workers read
with (the lease's heartbeats already run since arrival). ``abandon`` tells
P it can free blocks D will never read (prompt fully cached on D, a layout
mismatch, or the request ended before its load was scheduled).

The rank count for releases is D's own TP size: the handshake refuses a P
whose TP size differs (it is part of ``CompatInfo``), so no count from the
request is ever looped over.
"""

from __future__ import annotations

from vllm_pd_ext.log import get_logger
from vllm_pd_ext.scheduler.heartbeats import HeartbeatSender
from vllm_pd_ext.scheduler.load_state import LoadState
from vllm_pd_ext.wire.protocol import KVTransferParams
from vllm_pd_ext.wire.specs import LayoutProblem, RecvSpec

logger = get_logger(__name__)

Endpoint = tuple[str, int]


class PullConsumer:
    """D's half of pull mode (``d_requests.DMode``)."""

    #: Pull never waits on P's initiative: the workers read.
    num_waiting = 0

    def __init__(self, block_size: int, tp_size: int, heartbeats: HeartbeatSender) -> None:
        self.block_size = block_size
        self.tp_size = tp_size
        self.heartbeats = heartbeats

    def allocate(self, rid: str, params: KVTransferParams, num_prompt_tokens: int,
                 num_external_tokens: int, local_blocks: list[int], prompt_digest: str = ""
                 ) -> RecvSpec | LayoutProblem | None:
        """The load for D's new blocks; None when D needs nothing from P.
        (``prompt_digest``: push registers it with P; a READ needs none.)"""
        endpoint = _endpoint(params)
        if num_external_tokens == 0:
            self.abandon(rid, params, "prompt fully cached on D")
            return None
        hit_blocks = (num_prompt_tokens - num_external_tokens) // self.block_size
        need = params.flat_remote_block_ids()[hit_blocks:]
        expected = -(-num_prompt_tokens // self.block_size) - hit_blocks
        problem = None
        if params.remote_num_tokens is not None and params.remote_num_tokens != (
                num_prompt_tokens):
            problem = (f"P prefilled {params.remote_num_tokens} tokens but D's prompt has "
                       f"{num_prompt_tokens} (different prompt or tokenizer?)")
        elif not need or len(need) != expected or len(local_blocks) < len(need):
            # P sends exactly ceil(prompt / block_size) ids; fewer would leave
            # prompt tokens unloaded but counted as loaded.
            problem = (f"block layout mismatch: the prompt needs {expected} blocks from P, "
                       f"P sent {len(need)}, D allocated {len(local_blocks)}")
        if problem is not None:
            logger.error("PDConnector: request %s: %s; its KV load will fail", rid, problem)
            self.abandon(rid, params, "layout mismatch on D")
            return LayoutProblem(problem)
        return RecvSpec(
            request_id=rid,
            local_block_ids=local_blocks[:len(need)],
            remote_block_ids=need,
            remote_engine_id=str(params.remote_engine_id),
            remote_request_id=str(params.remote_request_id),
            remote_host=endpoint[0],
            remote_port=endpoint[1],
            remote_tp_size=self.tp_size,
            num_tokens=num_external_tokens,
        )

    def end(self, rid: str, params: KVTransferParams, state: LoadState) -> None:
        """vLLM finished the request. Before its load was scheduled, P can free
        its blocks now; a READ in flight finishes first (the workers release)."""
        if state is LoadState.WAITING:
            self.abandon(rid, params, "request ended on D before its load")

    def loaded(self, rid: str) -> None:
        """Nothing to do: the worker released P's lease after its READ."""

    def poll(self) -> dict[str, tuple[str, str]]:
        return {}

    def register_seconds(self, rid: str) -> float | None:
        return None

    def abandon(self, rid: str, params: KVTransferParams, why: str) -> None:
        """Stop heartbeating and let every P rank's lease share go."""
        self.heartbeats.untrack(rid)
        # Named as this request: a concurrent pull's P made it the lease's
        # holder in its answer, and a release without it would leave the
        # blocks lent until the lease expired.
        self.heartbeats.release(_endpoint(params), str(params.remote_request_id), self.tp_size,
                                why, consumer=rid)


def _endpoint(params: KVTransferParams) -> Endpoint:
    return str(params.remote_host), int(params.remote_port or 0)
