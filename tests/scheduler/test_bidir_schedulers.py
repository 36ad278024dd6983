"""Multi-turn on real vLLM schedulers (no model run): D keeps a finished
turn under a lease, P reads back only the prefix that matches its prompt.

The side channel is real (D's lease service on a free port); the workers
are replaced by reporting loads done or failed, as in the other scheduler
tests.
"""

from __future__ import annotations

import time

import pytest
from pdsched import BLOCK_SIZE, create_request
from pdunit_utils import free_port, wait_for
from test_scheduler_lifecycle import (
    HOST,
    SECRET,
    admit_remote,
    assert_empty_after_step,
    fake_p,  # noqa: F401 - fixture (here: D's side channel and lease table)
    make_scheduler,  # noqa: F401 - fixture
    num_free,
    outputs_of,
    pd,
    remote_params,
    run_until_finished,
    secret_file,  # noqa: F401 - fixture
    settle,
    step,
)
from vllm.v1.request import RequestStatus

from vllm_pd_ext.leases.table import LeaseState
from vllm_pd_ext.scheduler import bidir
from vllm_pd_ext.wire import auth

BIDIR = {"bidirectional_kv_xfer": True, "kv_recompute_threshold": 1}


def finish_kept_turn(sched, num_tokens=100, max_tokens=30, keep=True, prompt=None,
                     cache_salt=None, sign=None):
    """A D request (remote prefill) decoded to the end; its final params.
    ``sign``: a keyring to sign the leg with (an engine with a secret)."""
    params = remote_params(free_port(), -(-num_tokens // BLOCK_SIZE), num_tokens=num_tokens)
    if keep is not None:
        params["pd_bidirectional"] = keep
    if sign is not None:
        params = auth.sign_leg(sign, params, "rid", {"prompt": "x"})
    req = create_request(num_tokens, kv_transfer_params=params, max_tokens=max_tokens,
                         prompt=prompt, cache_salt=cache_salt)
    admit_remote(sched, req)
    step(sched, finished_recving={req.request_id})
    finals = run_until_finished(sched, req, max_steps=max_tokens + 5)
    return req, finals[-1].kv_transfer_params


def test_d_keeps_a_finished_turn_under_a_lease(make_scheduler):  # noqa: F811
    sched = make_scheduler(**BIDIR)
    free0 = num_free(sched)
    req, kept = finish_kept_turn(sched)
    tokens = list(req.all_token_ids)
    n_kv = len(tokens) - 1  # the last sampled token has no KV
    nblocks = n_kv // BLOCK_SIZE
    assert kept is not None, "D answered no kv_transfer_params"
    assert kept["do_remote_decode"] is True and kept["do_remote_prefill"] is False
    assert kept["remote_request_id"] == req.request_id
    assert len(kept["remote_block_ids"][0]) == nblocks == len(kept["remote_block_hashes"])
    assert kept["remote_block_hashes"] == bidir.block_hashes(tokens, BLOCK_SIZE, nblocks)
    assert kept["remote_num_tokens"] == nblocks * BLOCK_SIZE
    assert kept["remote_blocks_expiry_time"] > time.time() + 400  # decoder_kv_blocks_ttl
    lease = pd(sched).leases.table.get(req.request_id)
    assert lease is not None and lease.state is LeaseState.HELD
    assert num_free(sched) == free0 - nblocks  # pinned; the rest went back


def test_d_keeps_a_turn_it_prefilled_itself(make_scheduler):  # noqa: F811
    sched = make_scheduler(kv_role="kv_both", **BIDIR)
    req = create_request(70, kv_transfer_params={"pd_bidirectional": True}, max_tokens=40)
    sched.add_request(req)
    finals = run_until_finished(sched, req, max_steps=50)
    kept = finals[-1].kv_transfer_params
    assert kept is not None and kept["remote_request_id"] == req.request_id
    assert len(kept["remote_block_hashes"]) == (70 + 40 - 1) // BLOCK_SIZE


# ====================================================================== P reads back
def kept_params(port, history, nblocks=None, **over):
    """D's answer for a kept turn of ``history`` (as _keep_turn builds it)."""
    n = len(history) // BLOCK_SIZE if nblocks is None else nblocks
    params = dict(do_remote_decode=True, do_remote_prefill=False, remote_engine_id="eng-d",
                  remote_request_id="d-req", remote_host=HOST, remote_port=port,
                  remote_block_ids=[list(range(40, 40 + n))], tp_size=1,
                  remote_num_tokens=n * BLOCK_SIZE,
                  remote_blocks_expiry_time=time.time() + 300,
                  remote_block_hashes=bidir.block_hashes(history, BLOCK_SIZE, n))
    params.update(over)
    return params


def count_fallbacks(sched):
    """Record the read-back fallbacks P reports (the step takes its stats)."""
    seen: dict[str, int] = {}
    report = pd(sched).readback._count

    def spy(why):
        seen[why.value] = seen.get(why.value, 0) + 1
        report(why)

    pd(sched).readback._count = spy
    return seen


def test_p_reads_back_the_matching_history_then_hands_off(make_scheduler, fake_p):  # noqa: F811
    port, d_leases = fake_p
    with d_leases.lock:
        d_leases.table.grant("d-req")
    sched = make_scheduler(kv_role="kv_both", heartbeat_interval=0.05, **BIDIR)
    fell = count_fallbacks(sched)
    history = [10 + i for i in range(100)]  # 3 full blocks kept
    prompt = history + [500 + i for i in range(40)]
    req = create_request(len(prompt), prompt=prompt, max_tokens=1,
                         kv_transfer_params=kept_params(port, history))
    meta = admit_remote(sched, req)
    (spec,) = meta.reqs_to_recv
    assert spec.readback and spec.remote_block_ids == [40, 41, 42]
    assert spec.num_tokens == 96 and len(spec.local_block_ids) == 3
    assert (spec.remote_engine_id, spec.remote_request_id) == ("eng-d", "d-req")
    # While P waits, it heartbeats D's lease (no fixed TTL on D's side).
    assert wait_for(lambda: d_leases.num_heartbeats >= 1)
    step(sched, finished_recving={req.request_id})
    out, core = step(sched)
    assert out.num_scheduled_tokens == {req.request_id: len(prompt) - 96}  # only the rest
    core = settle(sched, core)
    assert req.status is RequestStatus.FINISHED_LENGTH_CAPPED
    (final,) = [o for o in outputs_of(core) if o.finish_reason is not None]
    answer = final.kv_transfer_params
    assert answer["do_remote_prefill"] is True and answer["remote_engine_id"] != "eng-d"
    assert pd(sched).readback.num_tokens == 96 and not fell
    assert req.request_id not in pd(sched).heartbeats._tracked
    assert len(pd(sched).readback) == 0


@pytest.mark.parametrize(("case", "reason"), [
    ("rewritten", "prefix_mismatch"),
    ("no_hashes", "unverifiable"),
    ("expired", "expired"),
    ("short", "below_threshold"),
    ("disabled", "disabled"),
    ("tp", "layout_mismatch"),
])
def test_p_falls_back_to_a_full_prefill_and_frees_d(make_scheduler, fake_p, case,  # noqa: F811
                                                    reason):
    port, d_leases = fake_p
    with d_leases.lock:
        d_leases.table.grant("d-req")
    extra = dict(BIDIR)
    if case == "short":
        extra["kv_recompute_threshold"] = 1000
    if case == "disabled":
        extra["bidirectional_kv_xfer"] = False
    sched = make_scheduler(kv_role="kv_both", **extra)
    fell = count_fallbacks(sched)
    history = [10 + i for i in range(100)]
    prompt = history + [500 + i for i in range(40)]
    over: dict = {}
    if case == "rewritten":
        prompt = [9, *prompt[1:]]  # a new system prompt
    elif case == "no_hashes":
        over["remote_block_hashes"] = None
    elif case == "expired":
        over["remote_blocks_expiry_time"] = time.time() + 1  # inside P's margin
    elif case == "tp":
        over["tp_size"] = 2
    req = create_request(len(prompt), prompt=prompt, max_tokens=1,
                         kv_transfer_params=kept_params(port, history, **over))
    sched.add_request(req)
    out, core = step(sched)
    assert out.kv_connector_metadata.reqs_to_recv == []
    assert out.num_scheduled_tokens == {req.request_id: len(prompt)}  # P prefills it all
    core = settle(sched, core)
    assert fell == {reason: 1}
    # D learns at once that this turn will not be read (not at its expiry).
    assert wait_for(lambda: d_leases.table.get("d-req").state is LeaseState.RELEASED)
    (final,) = [o for o in outputs_of(core) if o.finish_reason is not None]
    assert final.kv_transfer_params["do_remote_prefill"] is True  # the handoff goes on


def test_p_failed_read_back_is_counted_and_policy_applies(make_scheduler):  # noqa: F811
    sched = make_scheduler(kv_role="kv_both", policy="recompute", **BIDIR)
    fell = count_fallbacks(sched)
    history = [10 + i for i in range(100)]
    prompt = history + [500 + i for i in range(40)]
    req = create_request(len(prompt), prompt=prompt, max_tokens=1,
                         kv_transfer_params=kept_params(free_port(), history))
    admit_remote(sched, req)
    step(sched, finished_recving={req.request_id}, failed_recving={req.request_id})
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {req.request_id: len(prompt)}  # recomputed on P
    assert fell == {"load_failed": 1}
    run_until_finished(sched, req)
    assert len(pd(sched).readback) == 0


def test_p_abort_before_read_back_releases_d(make_scheduler, fake_p):  # noqa: F811
    port, d_leases = fake_p
    with d_leases.lock:
        d_leases.table.grant("d-req")
    sched = make_scheduler(kv_role="kv_both", **BIDIR)
    history = [10 + i for i in range(100)]
    req = create_request(140, prompt=history + list(range(40)), max_tokens=1,
                         kv_transfer_params=kept_params(port, history))
    sched.add_request(req)  # not scheduled yet
    sched.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    assert wait_for(lambda: d_leases.table.get("d-req").state is LeaseState.RELEASED)
    assert len(pd(sched).readback) == 0
    assert_empty_after_step(sched)


# ====================================================================== D keeps
def test_d_does_not_keep_declined_aborted_or_disabled_turns(make_scheduler):  # noqa: F811
    sched = make_scheduler(**BIDIR)
    _, kept = finish_kept_turn(sched, keep=False)
    assert kept is None
    req = create_request(100, kv_transfer_params={"pd_bidirectional": True}, max_tokens=30)
    sched.add_request(req)
    step(sched)
    sched.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    assert len(pd(sched).keeper.kept) == 0
    assert_empty_after_step(sched)
    off = make_scheduler()
    _, kept = finish_kept_turn(off)
    assert kept is None
    assert_empty_after_step(off)


def test_d_budget_evicts_the_oldest_unread_turn(make_scheduler):  # noqa: F811
    # 64 blocks, budget 0.1: 6 blocks kept at most; each turn keeps 4.
    sched = make_scheduler(num_blocks=64, decoder_kv_blocks_budget=0.1, **BIDIR)
    first, kept1 = finish_kept_turn(sched, num_tokens=100, max_tokens=30)
    assert kept1 is not None and len(pd(sched).keeper.kept) == 1
    free_before = num_free(sched)
    second, kept2 = finish_kept_turn(sched, num_tokens=100, max_tokens=30)
    assert kept2 is not None
    assert pd(sched).keeper.kept.oldest_first() == [second.request_id]
    assert pd(sched).leases.table.get(first.request_id) is None  # evicted and swept
    assert num_free(sched) == free_before  # the first turn's blocks were freed
    assert pd(sched).keeper.kept.num_blocks <= pd(sched).keeper.kept.budget_blocks


def test_d_read_turn_is_freed_on_release_and_shutdown_drops_unread(make_scheduler):  # noqa: F811
    sched = make_scheduler(**BIDIR)
    free0 = num_free(sched)
    read, _ = finish_kept_turn(sched)
    unread, _ = finish_kept_turn(sched)
    service = pd(sched).leases
    with service.lock:
        service.table.release(read.request_id, 0)  # P read it and released
    step(sched)
    assert pd(sched).keeper.kept.oldest_first() == [unread.request_id]
    # SIGTERM: unread kept turns end at once, so the drain does not wait 480 s.
    pd(sched).shutting_down = True
    assert pd(sched).has_pending_push_work() is True  # until the sweep frees it
    step(sched)
    assert pd(sched).has_pending_push_work() is False
    assert num_free(sched) == free0


def test_d_keeps_for_a_proxy_that_does_not_ask(make_scheduler):  # noqa: F811
    """vLLM's multi-turn demo proxy sends P's answer verbatim (no
    pd_bidirectional): the engine's bidirectional_kv_xfer decides."""
    sched = make_scheduler(**BIDIR)
    req, kept = finish_kept_turn(sched, keep=None)
    assert kept is not None and kept["remote_request_id"] == req.request_id


def test_d_with_a_secret_keeps_a_turn_only_when_the_signed_leg_asks(
        make_scheduler, secret_file):  # noqa: F811
    """Issue 27 item 8: with a shared secret every leg is vllm-pd-proxy's,
    which always says pd_bidirectional; a signed leg that does not say is no
    request to keep the turn (without a secret, vLLM's demo proxy's legs
    still are: test_d_keeps_for_a_proxy_that_does_not_ask)."""
    kr = auth.Keyring.parse(SECRET, "test")
    sched = make_scheduler(auth_secret_file=secret_file, **BIDIR)
    for keep, kept_it in ((None, False), (False, False), (True, True)):
        _, kept = finish_kept_turn(sched, keep=keep, sign=kr)
        assert (kept is not None and "remote_block_hashes" in kept) is kept_it, keep
    assert len(pd(sched).keeper.kept) == 1


# ====================================================================== tenants
SALT_A, SALT_B = "tenant-a", "tenant-b"


def test_d_scopes_a_kept_turns_hashes_by_its_cache_salt(make_scheduler):  # noqa: F811
    """Issue 27 item 7: the same tokens kept for two tenants hash apart, as
    vLLM's own prefix-cache hashes do, and D's answer names the scope."""
    sched = make_scheduler(**BIDIR)
    prompt = [10 + i for i in range(100)]
    plain, kept_plain = finish_kept_turn(sched, prompt=prompt)
    salted, kept_salted = finish_kept_turn(sched, prompt=prompt, cache_salt=SALT_A)
    tokens = list(salted.all_token_ids)
    assert tokens == list(plain.all_token_ids)  # the same history, token for token
    n = len(kept_salted["remote_block_hashes"])
    scope = bidir.hash_scope(SALT_A)
    assert "remote_hash_scope" not in kept_plain
    assert kept_plain["remote_block_hashes"] == bidir.block_hashes(tokens, BLOCK_SIZE, n)
    assert kept_salted["remote_hash_scope"] == bidir.scope_tag(scope)
    assert kept_salted["remote_block_hashes"] == bidir.block_hashes(tokens, BLOCK_SIZE, n, scope)
    assert not set(kept_salted["remote_block_hashes"]) & set(kept_plain["remote_block_hashes"])


def salted_kept_params(port, history, salt, **over):
    """D's answer for a turn of ``history`` kept for a request salted ``salt``."""
    scope = bidir.hash_scope(salt)
    n = len(history) // BLOCK_SIZE
    params = kept_params(port, history, remote_block_hashes=bidir.block_hashes(
        history, BLOCK_SIZE, n, scope), **over)
    if scope is not None:
        params["remote_hash_scope"] = bidir.scope_tag(scope)
    return params


@pytest.mark.parametrize(("kept_salt", "p_salt"), [
    (SALT_B, SALT_A), (None, SALT_A), (SALT_B, None)])
def test_p_neither_reads_nor_frees_another_tenants_turn(make_scheduler, fake_p,  # noqa: F811
                                                        kept_salt, p_salt):
    """Issue 27 item 7: a P leg naming a turn kept for another cache_salt
    (a proxy that mixed up conversations) reads nothing of it, whatever the
    tokens, and leaves it to its owner: D's lease is not released. A
    mismatch within one tenant still releases it (the control)."""
    port, d_leases = fake_p
    with d_leases.lock:
        d_leases.table.grant("d-req")
        d_leases.table.grant("d-own")
    sched = make_scheduler(kv_role="kv_both", **BIDIR)
    fell = count_fallbacks(sched)
    history = [10 + i for i in range(100)]
    prompt = history + [500 + i for i in range(40)]
    req = create_request(len(prompt), prompt=prompt, max_tokens=1, cache_salt=p_salt,
                         kv_transfer_params=salted_kept_params(port, history, kept_salt))
    sched.add_request(req)
    out, core = step(sched)
    assert out.kv_connector_metadata.reqs_to_recv == []
    assert out.num_scheduled_tokens == {req.request_id: len(prompt)}  # P prefills it all
    settle(sched, core)
    assert fell == {"scope_mismatch": 1}
    # The control: P's own tenant's turn, with a rewritten history, is released
    # through the same lane to D; once that arrived, nothing else is on its way.
    own = create_request(len(prompt), prompt=[9, *prompt[1:]], max_tokens=1, cache_salt=p_salt,
                         kv_transfer_params=salted_kept_params(port, history, p_salt,
                                                               remote_request_id="d-own"))
    sched.add_request(own)
    settle(sched, step(sched)[1])
    assert fell == {"scope_mismatch": 1, "prefix_mismatch": 1}
    assert wait_for(lambda: d_leases.table.get("d-own").state is LeaseState.RELEASED)
    assert d_leases.table.get("d-req").state is LeaseState.HELD  # the owner's, still
    run_until_finished(sched, req)
    run_until_finished(sched, own)


def test_p_reads_back_a_turn_of_its_own_salt(make_scheduler, fake_p):  # noqa: F811
    port, d_leases = fake_p
    with d_leases.lock:
        d_leases.table.grant("d-req")
    sched = make_scheduler(kv_role="kv_both", **BIDIR)
    fell = count_fallbacks(sched)
    history = [10 + i for i in range(100)]
    prompt = history + [500 + i for i in range(40)]
    req = create_request(len(prompt), prompt=prompt, max_tokens=1, cache_salt=SALT_A,
                         kv_transfer_params=salted_kept_params(port, history, SALT_A))
    (spec,) = admit_remote(sched, req).reqs_to_recv
    assert spec.readback and spec.remote_block_ids == [40, 41, 42] and not fell
    step(sched, finished_recving={req.request_id})
    run_until_finished(sched, req)
    assert pd(sched).readback.num_tokens == 96


# ====================================================================== pressure
def keep_three_big_turns(sched):
    """57 of the pool's 63 blocks kept in 3 turns of 19 blocks; 6 stay free."""
    turns = [finish_kept_turn(sched, num_tokens=600, max_tokens=30)[0] for _ in range(3)]
    assert pd(sched).keeper.kept.num_blocks == 57 and num_free(sched) == 6
    return turns


def count_stat(sched, key):
    """The increments of one PDStats counter from now (the steps take the stats)."""
    seen: list[int] = []
    stats = pd(sched)._stats
    inc = stats.inc

    def spy(name, n=1):
        if name == key:
            seen.append(n)
        inc(name, n)

    stats.inc = spy
    return seen


def test_a_running_request_takes_kept_blocks_instead_of_being_preempted(
        make_scheduler):  # noqa: F811
    """Issue 27 item 8: a decoding request that needs a block while unread
    kept turns hold the rest ends the oldest kept turn (vLLM asks the
    connector before it preempts) instead of being preempted."""
    sched = make_scheduler(num_blocks=64, decoder_kv_blocks_budget=0.9, **BIDIR)
    oldest, *rest = keep_three_big_turns(sched)
    evicted = count_stat(sched, "num_turns_evicted")
    req = create_request(150, max_tokens=100)  # 5 blocks now, 8 by its end
    sched.add_request(req)
    run_until_finished(sched, req, max_steps=110)
    assert req.num_preemptions == 0
    assert pd(sched).keeper.kept.oldest_first() == [r.request_id for r in rest]
    assert pd(sched).leases.table.get(oldest.request_id) is None  # ended and swept
    assert sum(evicted) == 1


def test_a_waiting_request_takes_kept_blocks_instead_of_queueing(make_scheduler):  # noqa: F811
    """Issue 27 item 8: a new request whose blocks do not fit while unread
    kept turns hold them is not queued until they expire (480 s): the oldest
    unread turns end, enough for it; a turn a P is reading is never ended."""
    sched = make_scheduler(num_blocks=64, decoder_kv_blocks_budget=0.9, **BIDIR)
    oldest, second, third = keep_three_big_turns(sched)
    with pd(sched).leases.lock:  # a P heartbeats the oldest: it is being read
        pd(sched).leases.table.renew(oldest.request_id)
    req = create_request(400, max_tokens=5)  # 13 blocks: 6 are free
    sched.add_request(req)
    run_until_finished(sched, req, max_steps=10)
    assert req.num_preemptions == 0
    assert pd(sched).keeper.kept.oldest_first() == [oldest.request_id, third.request_id]
    assert pd(sched).leases.table.get(second.request_id) is None
