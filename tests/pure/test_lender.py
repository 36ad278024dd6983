"""BlockLender: the one owner of lent blocks (pure, fake clock, fake pool).

Every lent set is pinned once (one reference per block) and freed exactly
once, tail first, at the sweep after its release or expiry; a key in use
pins nothing; eviction ends only a lease no borrower touched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from vllm_pd_ext.leases.lender import BlockLender
from vllm_pd_ext.leases.service import LeaseService
from vllm_pd_ext.leases.table import LeaseTable
from vllm_pd_ext.wire import protocol as proto


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0


@dataclass
class FakePool:
    """What vLLM's BlockPool does with references, and the order of frees."""

    blocks: list[Block] = field(default_factory=lambda: [Block(i) for i in range(16)])
    freed: list[int] = field(default_factory=list)

    def touch(self, blocks):
        for b in blocks:
            b.ref_cnt += 1

    def free_blocks(self, ordered_blocks):
        for b in ordered_blocks:
            assert b.ref_cnt > 0, f"block {b.block_id} freed twice"
            b.ref_cnt -= 1
            self.freed.append(b.block_id)


@pytest.fixture
def lender(clock):
    service = LeaseService(LeaseTable(10.0, clock))
    lent = BlockLender(service)
    lent.bind(FakePool())
    return lent


def release(key: str) -> proto.LeaseRelease:
    return proto.LeaseRelease(engine_id="d", request_ids=[key], tp_rank=0, ok=True)


def test_lend_pins_each_block_once_and_the_sweep_frees_tail_first(lender, clock):
    pool = lender._pool
    expiry = lender.lend("r", [3, 4, 5], num_consumers=1)
    assert expiry == clock() + 10.0
    assert [b.ref_cnt for b in pool.blocks[3:6]] == [1, 1, 1]
    assert "r" in lender and len(lender) == 1 and lender.block_ids("r") == [3, 4, 5]
    assert lender.sweep().released == [] and pool.freed == []  # not released yet
    lender.leases.release(release("r"))
    assert lender.has_pending_frees()
    result = lender.sweep()
    assert result.released == ["r"] and pool.freed == [5, 4, 3]
    assert [b.ref_cnt for b in pool.blocks[3:6]] == [0, 0, 0]
    assert "r" not in lender and not lender.has_pending_frees()
    assert lender.sweep().released == [] and pool.freed == [5, 4, 3]  # exactly once


def test_expiry_frees_and_reports_inside_the_sweep(lender, clock):
    lender.lend("a", [1], num_consumers=1)
    lender.lend("b", [2], num_consumers=1, duration_s=30.0)
    clock.advance(11.0)
    seen = []
    result = lender.sweep(on_expired=seen.extend)
    assert result.expired == ["a"] and seen == ["a"] and lender._pool.freed == [1]
    assert "b" in lender


def test_a_key_in_use_pins_nothing(lender):
    lender.lend("r", [1, 2], num_consumers=1)
    with pytest.raises(KeyError):
        lender.lend("r", [7, 8], num_consumers=1)
    assert lender._pool.blocks[7].ref_cnt == 0 and lender.block_ids("r") == [1, 2]


def test_unbound_lender_refuses_by_name(clock):
    lent = BlockLender(LeaseService(LeaseTable(10.0, clock)))
    with pytest.raises(RuntimeError, match="bind_gpu_block_pool"):
        lent.lend("r", [1], num_consumers=1)
    assert len(lent) == 0 and lent.leases.counters().num_live == 0


def test_evict_ends_only_an_untouched_lease(lender):
    lender.lend("kept", [1], num_consumers=1)
    lender.lend("read", [2], num_consumers=1)
    lender.leases.renew(proto.LeaseRenew(engine_id="p", request_ids=["read"], acquire=True,
                                         tp_rank=0, consumer="c"))
    assert lender.evict("kept") and not lender.evict("read")
    assert lender.sweep().released == ["kept"] and lender._pool.freed == [1]
