"""Issue 26 items 2-3: what the handshake, the lease and D's scheduler say
about engines sharded differently (pure: no engine, no socket)."""

from __future__ import annotations

import msgspec
import pytest

from vllm_pd_ext.leases.table import LeaseState, LeaseTable
from vllm_pd_ext.scheduler.d_requests import tp_size_problem
from vllm_pd_ext.tools.launch import parse_tp_pair, tp_bind
from vllm_pd_ext.transport.tp_slices import sharding_of
from vllm_pd_ext.wire.protocol import (
    PROTOCOL_VERSION,
    AgentInfo,
    CompatInfo,
    Region,
)
from vllm_pd_ext.worker.peers import layout_problem

BASE = CompatInfo(protocol_version=PROTOCOL_VERSION, model="m", dtype="bfloat16",
                  block_size=16, kv_layout="LBHNC", num_layers=4, num_kv_heads=4,
                  head_size=64, tp_size=1, transfer_mode="pull", total_kv_heads=4)


def shard(tp: int, **kw: object) -> CompatInfo:
    heads = int(kw.pop("total_kv_heads", 4))  # type: ignore[call-overload]
    return msgspec.structs.replace(BASE, tp_size=tp, num_kv_heads=max(1, heads // tp),
                                   total_kv_heads=heads, **kw)


@pytest.mark.parametrize(("a", "b"), [(1, 2), (2, 1), (2, 4), (4, 2), (1, 8), (8, 2)])
def test_divisible_tp_sizes_with_the_same_heads_are_compatible(a: int, b: int) -> None:
    assert shard(a).diff(shard(b)) == [] == shard(b).diff(shard(a))


def test_sizes_that_do_not_divide_are_refused_by_name() -> None:
    (line,) = shard(2).diff(shard(3, total_kv_heads=6))
    assert "total_kv_heads" in line  # another model's heads first
    (line,) = shard(2, total_kv_heads=6).diff(shard(3, total_kv_heads=6))
    assert line.startswith("tensor parallelism:") and "neither divides" in line


def test_interleaved_layout_cannot_be_sliced_but_equal_tp_can() -> None:
    nhd2, nhd1 = shard(2, kv_layout="LBNHC"), shard(1, kv_layout="LBNHC")
    assert nhd2.diff(shard(2, kv_layout="LBNHC")) == []
    (line,) = nhd1.diff(nhd2)
    assert "interleaves heads" in line


def test_mla_is_never_split_and_never_paired_with_heads() -> None:
    mla1, mla2 = shard(1, mla=True, total_kv_heads=1), shard(2, mla=True, total_kv_heads=1)
    assert mla1.diff(mla2) == []  # a latent cache is read whole from one P rank
    assert "mla" in " ".join(shard(1).diff(shard(1, mla=True)))


def test_a_peer_without_total_heads_must_shard_alike() -> None:
    old = msgspec.structs.replace(shard(2), total_kv_heads=0)
    assert sorted(x.split(":")[0] for x in shard(1).diff(old)) == ["num_kv_heads", "tp_size"]
    assert msgspec.structs.replace(shard(1), total_kv_heads=0).diff(shard(1)) == []


def test_an_unauthenticated_peer_is_not_told_our_sharding() -> None:
    (line,) = shard(2, total_kv_heads=6).diff(shard(3, total_kv_heads=6), ours=False)
    assert "tp_size=3" in line and "2" not in line.replace("tp_size=3", "")


def test_gqa_replicated_heads_sharding() -> None:
    s = sharding_of(shard(4, total_kv_heads=2))
    assert s.num_kv_heads == 2 and [s.heads_of(r) for r in range(4)] == [
        range(0, 1), range(0, 1), range(1, 2), range(1, 2)]


def test_lease_takes_d_consumer_count_from_the_first_pin() -> None:
    t = LeaseTable(30.0, lambda: 0.0)
    t.grant("r", num_consumers=1)  # P TP=1 grants with its own rank count
    assert t.renew("r", acquire=True, holder=(("d", "x"), 0), consumer_ranks=2) > 0
    assert not t.release("r", 0, consumer=("d", "x"))  # type: ignore[arg-type]
    assert t.get("r").state is LeaseState.READING  # type: ignore[union-attr]
    assert t.release("r", 1)  # the second D rank: now released
    # P TP=2 -> D TP=1: one D rank's release ends it.
    t.grant("s", num_consumers=2)
    assert t.release("s", 0, consumer_ranks=1)


def test_consumer_count_never_changes_after_a_release() -> None:
    t = LeaseTable(30.0, lambda: 0.0)
    t.grant("r", num_consumers=2)
    assert not t.release("r", 0)
    t.renew("r", acquire=True, consumer_ranks=1)  # too late to shrink it
    assert t.get("r").num_consumers == 2  # type: ignore[union-attr]
    assert t.release("r", 1)


def test_d_scheduler_admits_divisible_sizes_and_refuses_the_rest_by_name() -> None:
    assert tp_size_problem(2, 1) == "" == tp_size_problem(1, 4) == tp_size_problem(4, 4)
    assert "one must divide the other" in tp_size_problem(3, 2)


def test_tp_flags() -> None:
    assert parse_tp_pair("1,2") == (1, 2)
    for bad in ("2", "1,3", "a,b", "0,1"):
        with pytest.raises(ValueError, match="--tp"):
            parse_tp_pair(bad)
    assert tp_bind(1, "1") == "1" and tp_bind(2, "1") == "0|1"
    with pytest.raises(ValueError, match="needs 4 cores"):
        tp_bind(4, "0")


def _agent(block_len: int, kernel_blocks: int = 1, layers: int = 2) -> AgentInfo:
    return AgentInfo(tp_rank=0, agent_name="p-tp0-x", agent_metadata=b"", mem_type="DRAM",
                     kernel_blocks=kernel_blocks,
                     regions=[Region(4096 * i, block_len, block_len, 8) for i in range(layers)])


def test_head_slices_pair_blocks_whose_heads_are_equally_long() -> None:
    ours = _agent(1024).regions  # D: one head of 1 KiB per block
    assert layout_problem(_agent(2048), ours, 1, heads=(1, 2)) == ""
    assert "not as long as ours" in layout_problem(_agent(3072), ours, 1, heads=(1, 2))
    assert "KV regions" in layout_problem(_agent(2048, layers=3), ours, 1, heads=(1, 2))
    # Without heads (same sharding) the blocks must be equal, as before.
    assert layout_problem(_agent(2048), ours) != ""


def test_kernel_block_splits_cannot_be_head_sliced() -> None:
    problem = layout_problem(_agent(2048, kernel_blocks=2), _agent(1024).regions, 2,
                             heads=(1, 2))
    assert "kernel blocks" in problem and "not one range per block" in problem
