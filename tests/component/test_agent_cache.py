"""The one peer-agent cache (``worker/peers.py``) over the fake transport.

Both roles that move KV with a peer use it (D's pull reader for P's agents,
P's pusher for D's); these tests pin the invariants both rely on: an agent
is loaded once and checked first, a mismatch unloads nothing cached, and an
agent in use is never removed (retired or idle).
"""

from __future__ import annotations

import pytest

from vllm_pd_ext.transport.fake import FakeFabric, FakeTransport
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.worker.peers import AgentCache, AgentMismatch

REGIONS = [proto.Region(0x1000, 64, 64, 8)]


def agent(name: str, metadata: str | None = None, block_len: int = 64) -> proto.AgentInfo:
    return proto.AgentInfo(tp_rank=0, agent_name=name, agent_metadata=(metadata or name).encode(),
                           mem_type="DRAM", regions=[proto.Region(0x9000, 64, block_len, 8)])


@pytest.fixture
def world(clock):
    fabric = FakeFabric()
    local = FakeTransport("eng-d-tp0-me", fabric)
    local.enter_thread()  # the test thread plays the role's thread
    for name in ("eng-p-tp0-a", "eng-p-tp0-b", "eng-q-tp0-c"):
        FakeTransport(name, fabric)
    return local, AgentCache(local, REGIONS, "P", clock=clock, idle_ttl_s=10.0)


def test_an_agent_is_loaded_once_and_returned_to_its_owner(world):
    local, cache = world
    first = cache.load(agent("eng-p-tp0-a"), "eng-p", "owner-1")
    assert cache.load(agent("eng-p-tp0-a"), "eng-p", "owner-1") is first
    assert local.peers == {"eng-p-tp0-a"} and len(cache) == 1


@pytest.mark.parametrize("claim, engine, owner, why", [
    (agent("eng-q-tp0-c"), "eng-p", "owner-1", "is not engine eng-p's"),
    (agent("eng-p-tp0-a", "eng-p-tp0-b"), "eng-p", "owner-1", "with other metadata"),
    (agent("eng-p-tp0-a"), "eng-p", "owner-2", "which belongs to engine owner-1"),
    (agent("eng-p-tp0-b", "eng-p-tp0-a"), "eng-p", "owner-1", "NIXL metadata is agent"),
])
def test_a_claim_that_does_not_hold_fails_alone(world, claim, engine, owner, why):
    local, cache = world
    loaded = cache.load(agent("eng-p-tp0-a"), "eng-p", "owner-1")
    with pytest.raises(AgentMismatch, match=why):
        cache.load(claim, engine, owner)
    assert local.peers == {"eng-p-tp0-a"} and cache.load(
        agent("eng-p-tp0-a"), "eng-p", "owner-1") is loaded


def test_metadata_of_another_agent_is_unloaded_again(world):
    local, cache = world
    with pytest.raises(AgentMismatch, match="NIXL metadata is agent 'eng-p-tp0-b'"):
        cache.load(agent("eng-p-tp0-a", "eng-p-tp0-b"), "eng-p", "owner-1")
    assert local.peers == set() and len(cache) == 0


def test_another_layout_is_refused_before_loading(world):
    local, cache = world
    with pytest.raises(Exception, match="layout differs"):
        cache.load(agent("eng-p-tp0-a", block_len=32), "eng-p", "owner-1")
    assert local.peers == set()


def test_a_retired_agent_goes_only_when_its_last_transfer_settles(world):
    local, cache = world
    a = cache.load(agent("eng-p-tp0-a"), "eng-p", "owner-1")
    cache.acquire(a)
    cache.acquire(a)
    cache.retire(a)
    cache.release(a)
    assert local.peers == {"eng-p-tp0-a"}
    cache.release(a)
    assert local.peers == set() and len(cache) == 0


def test_idle_agents_are_reaped_never_one_in_use(world, clock):
    local, cache = world
    busy = cache.load(agent("eng-p-tp0-a"), "eng-p", "owner-1")
    idle = cache.load(agent("eng-p-tp0-b"), "eng-p", "owner-2")
    cache.acquire(busy)
    clock.advance(9.0)
    assert cache.reap(clock()) == []
    cache.touch(idle)  # a load waits for it: not idle
    clock.advance(9.0)
    assert cache.reap(clock()) == []
    clock.advance(2.0)
    assert cache.reap(clock()) == [idle]
    assert local.peers == {"eng-p-tp0-a"}
    cache.release(busy)
    clock.advance(10.0)
    assert cache.reap(clock()) == [busy] and local.peers == set()
