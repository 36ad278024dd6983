"""The peers' NIXL agents loaded into one worker's transport.

One cache, used by every role that moves KV with a peer: D's pull reader
(``d_pull``, P's agents) and P's pusher (``p_push``, D's agents). Only the
role's own thread touches it. Lifecycle of one cached agent, keyed by its
agent name (NIXL's own identity for the remote agent):

1. ``load``: the claimed name must be the named engine's agent for that rank
   (``<engine_id>-tp<rank>-...``, as ``PDWorker`` names agents), its KV layout
   and memory type (DRAM or VRAM, ``memory_problem``) must match ours, and
   NIXL's name for the loaded metadata must be the one claimed. An agent
   already cached under that name is returned only to the same owner with
   the same metadata; anything else fails that caller's transfer
   (``AgentMismatch``) and unloads nothing cached.
2. ``acquire`` / ``release`` around every transfer posted on it.
3. ``retire``: the agent must go (a failed transfer, a peer that restarted);
   it is removed once no transfer uses it, never before.
4. ``reap``: an agent no transfer used for ``idle_ttl_s`` is removed (the peer
   went away); never one in use.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from vllm_pd_ext.log import get_logger
from vllm_pd_ext.transport import Transport, TransportError
from vllm_pd_ext.wire import protocol as proto

logger = get_logger(__name__)

#: An agent no transfer used for this long is removed (the peer went away).
PEER_IDLE_TTL_S = 300.0


class AgentMismatch(TransportError):
    """A peer's agent is not the agent it claims to be; fails that transfer only."""


@dataclass
class CachedAgent:
    name: str
    agent: proto.AgentInfo
    #: Who loaded it (pull: P's (engine id, host, port); push: D's engine id).
    owner: Hashable
    last_used: float
    #: Transfers posted on it that have not settled.
    users: int = 0
    #: To be removed once ``users`` is 0.
    retired: bool = False


class AgentCache:
    def __init__(self, transport: Transport, regions: list[proto.Region], peer: str,
                 clock: Callable[[], float] = time.monotonic,
                 idle_ttl_s: float = PEER_IDLE_TTL_S, kernel_blocks: int = 1) -> None:
        self.transport = transport
        self.regions = regions
        self.kernel_blocks = kernel_blocks
        #: Which side the agents are, for messages: "P" (pull) or "D" (push).
        self.peer = peer
        self.what = f"{peer} agent"
        self.idle_ttl_s = idle_ttl_s
        self._clock = clock
        self._agents: dict[str, CachedAgent] = {}

    def load(self, agent: proto.AgentInfo, engine_id: str, owner: Hashable,
             heads: Heads | None = None) -> CachedAgent:
        """The cached agent for ``agent``, loaded and checked on first use
        (``heads``: see ``layout_problem``). Raises ``AgentMismatch`` (or
        ``TransportError`` from NIXL)."""
        name = agent.agent_name
        prefix = f"{engine_id}-tp{agent.tp_rank}-"
        if not name.startswith(prefix):
            raise AgentMismatch(f"{self.peer} agent {name!r} is not engine {engine_id}'s (its "
                                f"rank {agent.tp_rank} agent is named {prefix}...)")
        cached = self._agents.get(name)
        if cached is not None:
            if cached.agent != agent:
                raise AgentMismatch(f"engine {engine_id} names {self.peer} agent {name!r} with "
                                    "other metadata than the agent loaded under that name (for "
                                    f"{_describe(cached.owner)}); keeping the loaded one")
            if cached.owner != owner:
                raise AgentMismatch(f"{_describe(owner)} names {self.peer} agent {name!r}, "
                                    f"which belongs to {_describe(cached.owner)}")
            cached.retired = False
            return cached
        problem = (layout_problem(agent, self.regions, self.kernel_blocks, heads)
                   or memory_problem(agent, self.transport.mem_type))
        if problem:
            raise TransportError(problem)
        # A loaded agent's metadata under another name: refused without
        # loading it again (a miss only, so the scan is rare).
        other = next((a.name for a in self._agents.values()
                      if a.agent.agent_metadata == agent.agent_metadata), None)
        loaded = other or self.transport.add_peer(agent.agent_metadata, agent.mem_type)
        if loaded != name:
            if loaded not in self._agents:  # never unload an agent in use
                self._unload(loaded)
            raise AgentMismatch(f"engine {engine_id} names {self.peer} agent {name!r} but its "
                                f"NIXL metadata is agent {loaded!r}")
        cached = self._agents[name] = CachedAgent(name, agent, owner, self._clock())
        logger.info("PDConnector: %s %s of engine %s added", self.what, name, engine_id)
        return cached

    def acquire(self, cached: CachedAgent) -> None:
        cached.users += 1
        cached.last_used = self._clock()

    def release(self, cached: CachedAgent) -> None:
        assert cached.users > 0
        cached.users -= 1
        cached.last_used = self._clock()
        if cached.retired and cached.users == 0:
            self._remove(cached)

    def touch(self, cached: CachedAgent) -> None:
        """Used without a transfer (a load is waiting for it): not idle."""
        cached.last_used = self._clock()

    def retire(self, cached: CachedAgent) -> None:
        cached.retired = True
        if cached.users == 0:
            self._remove(cached)

    def reap(self, now: float) -> list[CachedAgent]:
        """Remove every agent idle for ``idle_ttl_s``; the ones removed."""
        gone = [a for a in self._agents.values()
                if a.users == 0 and now - a.last_used >= self.idle_ttl_s]
        for cached in gone:
            logger.info("PDConnector: %s %s unused for %.0f s", self.what, cached.name,
                        now - cached.last_used)
            self._remove(cached)
        return gone

    def __len__(self) -> int:
        return len(self._agents)

    def _remove(self, cached: CachedAgent) -> None:
        assert cached.users == 0, "an agent with a transfer in flight is never removed"
        if self._agents.get(cached.name) is cached:
            del self._agents[cached.name]
            self._unload(cached.name)
            logger.info("PDConnector: dropped %s %s of %s", self.what, cached.name,
                        _describe(cached.owner))

    def _unload(self, name: str) -> None:
        try:
            self.transport.remove_peer(name)
        except Exception:  # the contract says it never raises; stay alive if it does
            logger.exception("PDConnector: removing %s %s failed", self.what, name)


#: (our heads per block, the peer's): a peer sharded differently, whose
#: blocks pair with ours head slice by head slice (``tp_slices``).
Heads = tuple[int, int]


def layout_problem(agent: proto.AgentInfo, regions: list[proto.Region],
                   kernel_blocks: int = 1, heads: Heads | None = None) -> str:
    """Why a peer's KV regions cannot pair with ours block for block, or
    with ``heads``, head for head ("" if they can)."""
    if heads is not None and heads[0] != heads[1]:
        return _slice_layout_problem(agent, regions, kernel_blocks, heads)
    if len(agent.regions) != len(regions) or any(
            a.block_len != b.block_len for a, b in zip(agent.regions, regions, strict=False)):
        return "the peer's KV region layout differs from ours"
    if agent.kernel_blocks != kernel_blocks:
        return (f"the peer splits each KV block into {agent.kernel_blocks} kernel block(s) "
                f"and we into {kernel_blocks}: the bytes within a block are ordered "
                "differently (give both engines the same attention backend and block size)")
    return ""


def _slice_layout_problem(agent: proto.AgentInfo, regions: list[proto.Region],
                          kernel_blocks: int, heads: Heads) -> str:
    ours, theirs = heads
    if len(agent.regions) != len(regions):
        return (f"the peer has {len(agent.regions)} KV regions and we have {len(regions)} "
                "(another model, or another cache layout)")
    for a, b in zip(agent.regions, regions, strict=True):
        if b.block_len % ours or a.block_len % theirs or (
                a.block_len // theirs != b.block_len // ours):
            return (f"a head of the peer's KV blocks is not as long as ours ({a.block_len} B "
                    f"for {theirs} head(s) against {b.block_len} B for {ours}): block size, "
                    "head size or dtype differ")
    if agent.kernel_blocks != 1 or kernel_blocks != 1:
        return (f"the KV blocks are split into kernel blocks (peer {agent.kernel_blocks}, "
                f"ours {kernel_blocks}): a head is then not one range per block, so engines "
                "with different TP sizes cannot exchange them (use the same TP size, or a "
                "block size the attention backend does not split)")
    return ""


def memory_problem(agent: proto.AgentInfo, mem_type: str) -> str:
    """Why a peer's KV memory cannot pair with ours ("" if it can).

    NIXL could move DRAM <-> VRAM, but a host-memory KV cache is not paired
    with a GPU one: nothing of ours tests that path (its UCX transports,
    its throughput), so it is refused, naming both types."""
    if agent.mem_type != mem_type:
        return (f"the peer's KV cache is in {agent.mem_type} and ours in {mem_type}: "
                "PDConnector pairs only engines whose KV caches are in the same memory "
                "type (both DRAM or both VRAM)")
    return ""


def _describe(owner: Hashable) -> str:
    if isinstance(owner, tuple) and len(owner) == 3:
        return f"engine {owner[0]} at {owner[1]}:{owner[2]}"
    return f"engine {owner}"
