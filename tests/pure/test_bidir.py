"""bidir.py: block hashes, prefix matching, the read-back plan, kept-turn budget."""

from __future__ import annotations

import pytest

from vllm_pd_ext.scheduler import bidir
from vllm_pd_ext.scheduler.bidir import Fallback, KeptTurns, ReadBackPlan, plan_readback

BS = 16


def test_hashes_chain_every_token_before_them():
    tokens = list(range(100, 164))  # 4 blocks
    hashes = bidir.block_hashes(tokens, BS)
    assert len(hashes) == 4 and all(len(h) == bidir.HASH_HEX for h in hashes)
    assert len(set(hashes)) == 4
    # A change in block 0 changes every later hash (chained), not just block 0's.
    changed = bidir.block_hashes([1, *tokens[1:]], BS)
    assert all(a != b for a, b in zip(hashes, changed, strict=True))
    # A change in block 2 leaves blocks 0 and 1 alone.
    later = bidir.block_hashes([*tokens[:40], 7, *tokens[41:]], BS)
    assert later[:2] == hashes[:2] and later[2] != hashes[2] and later[3] != hashes[3]
    # Partial blocks are never hashed; num_blocks caps the count.
    assert len(bidir.block_hashes(tokens[:47], BS)) == 2
    assert bidir.block_hashes(tokens, BS, 1) == hashes[:1]
    # The block size is part of the hash: another layout never matches.
    assert bidir.block_hashes(tokens, 32)[0] not in hashes


def test_matched_blocks_counts_the_leading_run_only():
    history = list(range(200, 264))
    hashes = bidir.block_hashes(history, BS)
    assert bidir.matched_blocks([*history, 1, 2, 3], BS, hashes) == 4  # an extension
    assert bidir.matched_blocks(history[:33], BS, hashes) == 2  # a shorter prompt
    edited = [*history[:20], 9, *history[21:]]
    assert bidir.matched_blocks(edited, BS, hashes) == 1  # rewritten in block 1
    assert bidir.matched_blocks([5, *history[1:]], BS, hashes) == 0  # new system prompt
    assert bidir.matched_blocks(history, BS, []) == 0
    # A wrong hash in the middle stops the match there, even if later ones agree.
    forged = [*hashes[:1], "0" * 16, *hashes[2:]]
    assert bidir.matched_blocks(history, BS, forged) == 1


@pytest.mark.parametrize(("prompt", "local", "matched", "offered", "threshold", "want"), [
    # Extends the history: read every matched block P does not hold.
    (100, 0, 4, 4, 16, ReadBackPlan(num_tokens=64, first_block=0, num_blocks=4)),
    (100, 32, 4, 4, 16, ReadBackPlan(num_tokens=32, first_block=2, num_blocks=2)),
    # P computes at least the last prompt token: a prompt that ends on the
    # history's last block reads one block less.
    (64, 0, 4, 4, 16, ReadBackPlan(num_tokens=48, first_block=0, num_blocks=3)),
    (100, 0, 6, 4, 16, ReadBackPlan(num_tokens=64, first_block=0, num_blocks=4)),
    (100, 0, 0, 4, 16, Fallback.MISMATCH),
    (100, 64, 4, 4, 16, Fallback.CACHED),
    (100, 32, 4, 4, 64, Fallback.SHORT),
    (100, 8, 4, 4, 16, Fallback.LAYOUT),
    (10, 0, 1, 1, 0, Fallback.MISMATCH),  # shorter than a block: nothing to read
])
def test_plan_readback(prompt, local, matched, offered, threshold, want):
    assert plan_readback(num_prompt_tokens=prompt, num_local_tokens=local, block_size=BS,
                         num_matched_blocks=matched, num_offered_blocks=offered,
                         threshold=threshold) == want


def test_wants_keep():
    assert bidir.wants_keep(True, True) and bidir.wants_keep(True, None)
    assert not bidir.wants_keep(True, False)
    assert not bidir.wants_keep(False, True) and not bidir.wants_keep(False, None)


def test_with_signed_legs_only_a_leg_that_asks_keeps():
    """Issue 27 item 8: with a shared secret only vllm-pd-proxy signs legs,
    and it always says; silence is not a request to keep a turn for 480 s."""
    assert bidir.wants_keep(True, True, legs_signed=True)
    assert not bidir.wants_keep(True, None, legs_signed=True)
    assert not bidir.wants_keep(True, False, legs_signed=True)
    assert not bidir.wants_keep(False, True, legs_signed=True)


def test_hashes_are_scoped_by_cache_salt_and_lora():
    """Issue 27 item 7: as vLLM's own prefix-cache hashes, a tenant's
    (cache_salt) or adapter's (LoRA) turn never matches another's prompt."""
    tokens = list(range(100, 164))
    plain = bidir.block_hashes(tokens, BS)
    assert bidir.hash_scope(None) is None and bidir.scope_tag(None) is None
    assert bidir.block_hashes(tokens, BS, scope=None) == plain  # unsalted: as before
    scopes = [bidir.hash_scope("a"), bidir.hash_scope("b"), bidir.hash_scope(None, "lora1"),
              bidir.hash_scope("a", "lora1")]
    assert len(set(scopes)) == 4 and bidir.hash_scope("a") == scopes[0]
    tags = [bidir.scope_tag(s) for s in scopes]
    assert len(set(tags)) == 4 and all(len(t or "") == bidir.HASH_HEX for t in tags)
    hashed = [bidir.block_hashes(tokens, BS, scope=s) for s in scopes]
    for i, one in enumerate([plain, *hashed]):
        for other in [plain, *hashed][i + 1:]:
            assert not set(one) & set(other)
    a = hashed[0]
    assert bidir.matched_blocks([*tokens, 1], BS, a, scopes[0]) == 4
    assert bidir.matched_blocks([*tokens, 1], BS, a) == 0  # an unsalted prompt
    assert bidir.matched_blocks([*tokens, 1], BS, a, scopes[1]) == 0  # another tenant
    assert bidir.matched_blocks([*tokens, 1], BS, plain, scopes[0]) == 0


def test_kept_turns_relieve_pressure_oldest_first():
    """Issue 27 item 8: when vLLM runs short, the oldest turns that give
    blocks back end first, until enough come back; a turn being read (or
    whose blocks a request shares) gives nothing back and stays."""
    kept = KeptTurns(100)
    for key, n in (("a", 5), ("b", 4), ("c", 3), ("d", 6)):
        kept.add(key, n)
    gives = {"a": 5, "b": 0, "c": 3, "d": 6}  # "b" is being read
    ended = kept.relieve(6, lambda key: gives[key])
    assert ended == ["a", "c"] and kept.oldest_first() == ["b", "d"]
    assert kept.num_blocks == 10
    assert kept.relieve(0, lambda key: 99) == []  # nothing needed: nothing ends
    assert kept.relieve(100, lambda key: gives[key]) == ["d"]
    assert kept.oldest_first() == ["b"]


def test_kept_turns_budget_evicts_oldest_unused_first():
    kept = KeptTurns(10)
    evicted: list[str] = []
    in_use = {"b"}

    def evict(key: str) -> bool:
        if key in in_use:
            return False
        evicted.append(key)
        return True

    for key in ("a", "b", "c"):
        assert kept.admit(3, evict)
        kept.add(key, 3)
    assert kept.num_blocks == 9 and not evicted
    # 4 more need 3 freed: "a" (oldest) goes; "b" is being read and stays.
    assert kept.admit(4, evict)
    kept.add("d", 4)
    assert evicted == ["a"] and kept.num_blocks == 10 and "a" not in kept
    # 7 more: "c" and "d" go, "b" stays; 3 + 7 fits.
    assert kept.admit(7, evict)
    assert evicted == ["a", "c", "d"] and kept.oldest_first() == ["b"]
    # Never more than the budget, even with everything evictable.
    assert not kept.admit(11, evict)
    kept.discard("b")
    kept.discard("missing")
    assert kept.num_blocks == 0 and len(kept) == 0
