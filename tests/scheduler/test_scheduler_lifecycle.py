"""PDConnector inside a real vLLM Scheduler (no workers, no model run).

Worker results are fed back by hand (or from a PDWorker with a fake
transport) as ``KVConnectorOutput``; every test ends with the leak check.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from pdsched import (
    BLOCK_SIZE,
    EOS_TOKEN_ID,
    SCHEDULING_MODES,
    assert_scheduler_empty,
    create_request,
    create_scheduler,
    create_vllm_config,
    drain,
    engine_step,
    is_async,
    make_output,
    merge_outputs,
)
from pdunit_utils import free_port, wait_for
from vllm.v1.request import RequestStatus

from vllm_pd_ext import compat
from vllm_pd_ext.config import PDConfig
from vllm_pd_ext.leases.table import LeaseState, LeaseTable
from vllm_pd_ext.metadata import PDConnectorMetadata, PDHandshakeMetadata
from vllm_pd_ext.transport.fake import FakeFabric, FakeTransport
from vllm_pd_ext.wire import auth
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.pump_bell import Bell
from vllm_pd_ext.wire.side_channel import LeaseService, SideChannelClient, SideChannelServer
from vllm_pd_ext.worker.dispatcher import PDWorker

HOST = "127.0.0.1"


@pytest.fixture(params=SCHEDULING_MODES)
def make_scheduler(request):
    """Schedulers of one mode: every test here runs under vLLM's ``Scheduler``
    (sync) and its ``AsyncScheduler`` driven like the batch queue (async)."""
    made = []

    def make(kv_role="kv_consumer", num_blocks=64, policy="fail", **extra):
        extra.setdefault("side_channel_port", free_port())
        # 1 s, not less: a release to the fake P timed out at 0.2 s in CI, with
        # two e2e lanes starting engines beside this tier.
        extra.setdefault("handshake_timeout", 1.0)
        cfg = create_vllm_config(kv_role, extra=extra, kv_load_failure_policy=policy,
                                 engine_id=f"eng-{kv_role}")
        sched = create_scheduler(cfg, num_blocks=num_blocks, mode=request.param)
        made.append(sched)
        return sched

    yield make
    for sched in made:
        sched.connector.shutdown()


def pd(sched):
    """The connector's scheduler half (PDScheduler)."""
    return sched.connector._scheduler


def step(sched, **output_kw):
    """One engine step (pdsched.engine_step): schedule, fake the forward,
    update; under async scheduling the update is the previous step's.
    Returns (sched_out, core_out)."""
    return engine_step(sched, **output_kw)


def assert_empty_after_step(sched):
    """One more engine step (clears vLLM's per-step finished set), then the leak check."""
    step(sched)
    if is_async(sched):  # the steps in flight, then one more to clear it again
        drain(sched)
        step(sched)
        drain(sched)
    assert_scheduler_empty(sched)


def outputs_of(core):
    return [o for eco in core.values() for o in eco.outputs]


def settle(sched, core):
    """``core`` plus, under async scheduling, the outputs of the steps still
    in flight (the step that finishes a request is processed one step later)."""
    return merge_outputs(dict(core), drain(sched))


def run_until_finished(sched, req, max_steps=20):
    finals = []
    for _ in range(max_steps):
        _, core = step(sched)
        finals += [o for o in outputs_of(core)
                   if o.request_id == req.request_id and o.finish_reason is not None]
        if req.is_finished():
            # async: the step scheduled after the last one finishes too.
            finals += [o for o in outputs_of(drain(sched))
                       if o.request_id == req.request_id and o.finish_reason is not None]
            return finals
    raise AssertionError(f"{req.request_id} did not finish: {req.status}")


def num_free(sched):
    return sched.kv_cache_manager.block_pool.free_block_queue.num_free_blocks


def remote_params(port, num_blocks=4, num_tokens=None, rid="p-req", **over):
    params = dict(do_remote_prefill=True, do_remote_decode=False, remote_engine_id="eng-p",
                  remote_request_id=rid, remote_host=HOST, remote_port=port,
                  remote_block_ids=[list(range(20, 20 + num_blocks))], tp_size=1)
    if num_tokens is not None:
        params["remote_num_tokens"] = num_tokens
    params.update(over)
    return params


# ====================================================================== P side
def finish_prefill(sched, num_tokens=100):
    req = create_request(num_tokens, kv_transfer_params={"do_remote_decode": True}, max_tokens=1)
    sched.add_request(req)
    finals = run_until_finished(sched, req)
    assert req.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert len(finals) == 1
    return req, finals[0].kv_transfer_params


def test_p_holds_blocks_until_release(make_scheduler):
    sched = make_scheduler("kv_producer")
    total_free = num_free(sched)
    req, params = finish_prefill(sched, num_tokens=100)
    nblocks = -(-100 // BLOCK_SIZE)
    # vLLM's NixlConnector keys, pointing at this engine's side channel.
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "eng-kv_producer"
    assert params["remote_host"] == HOST
    assert params["remote_port"] == pd(sched).port
    assert params["remote_request_id"] == req.request_id
    assert params["tp_size"] == 1
    assert params["remote_num_tokens"] == 100
    assert params["remote_blocks_expiry_time"] > time.time() + 20
    assert len(params["remote_block_ids"]) == 1 and len(params["remote_block_ids"][0]) == nblocks
    # And D decodes them back without error.
    assert proto.decode_params(params).flat_remote_block_ids() == params["remote_block_ids"][0]
    # Built from the typed struct: NixlConnector's keys plus ours that are set
    # (vLLM's scheduler itself adds remote_prefill_cached_tokens).
    assert set(params) - {"remote_prefill_cached_tokens"} == {
        "do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_block_ids",
        "remote_request_id", "remote_host", "remote_port", "tp_size", "pp_size", "dcp_size",
        "transfer_mode", "remote_num_tokens", "remote_blocks_expiry_time",
        "remote_prompt_digest"}
    assert params["remote_prompt_digest"] == auth.token_digest(req.prompt_token_ids)
    # The request left vLLM's scheduler (an idle P does not step) but its
    # blocks stay pinned by the lease.
    assert req.request_id not in sched.requests
    assert num_free(sched) == total_free - nblocks
    assert req.request_id in pd(sched).leases.table
    for _ in range(3):
        step(sched)
    assert not sched.has_requests()  # nothing keeps the engine stepping
    assert num_free(sched) == total_free - nblocks

    # D's release arrives (as the side-channel thread would deliver it).
    pd(sched).leases.release(proto.LeaseRelease(engine_id="eng-d", request_ids=[req.request_id],
                                                tp_rank=0))
    assert sched.connector.has_pending_block_frees()
    step(sched)
    assert num_free(sched) == total_free
    assert pd(sched).num_pinned_requests == 0
    step(sched)
    assert num_free(sched) == total_free  # freed exactly once
    assert_empty_after_step(sched)


def test_p_release_over_real_side_channel(make_scheduler):
    sched = make_scheduler("kv_producer")
    connector = sched.connector
    connector.set_xfer_handshake_metadata({})  # starts the side channel
    req, params = finish_prefill(sched)
    client = SideChannelClient(2.0)
    try:
        status = client.request(HOST, params["remote_port"], proto.LeaseRenew(
            engine_id="eng-d", request_ids=[req.request_id], acquire=True))
        assert status.remaining_s[0] > 20
        assert pd(sched).leases.table.get(req.request_id).state is LeaseState.READING
        client.request(HOST, params["remote_port"], proto.LeaseRelease(
            engine_id="eng-d", request_ids=[req.request_id], tp_rank=0))
    finally:
        client.close()
    # The next request's arrival sweeps the released lease before it competes
    # for blocks.
    total = num_free(sched)
    poke = create_request(32, max_tokens=1)
    sched.add_request(poke)
    assert num_free(sched) == total + -(-100 // BLOCK_SIZE)
    run_until_finished(sched, poke)
    assert_empty_after_step(sched)


def test_p_rings_its_workers_pump_when_d_pins(make_scheduler):
    """P's scheduler half rings each rank's pump bell (published in the
    workers' handshake metadata) when D's pin reaches the side channel: the
    READ follows, and the target's pump must be fast for it."""
    sched = make_scheduler("kv_producer")
    bells = [Bell(), Bell()]
    agents = [proto.AgentInfo(tp_rank=r, agent_name=f"p-agent-{r}", agent_metadata=b"md",
                              mem_type="DRAM", regions=[proto.Region(4096, 64, 64, 8)])
              for r in range(2)]
    sched.connector.set_xfer_handshake_metadata({
        r: PDHandshakeMetadata(agent=agents[r], pump_endpoint=bells[r].endpoint)
        for r in range(2)})
    req, params = finish_prefill(sched)
    client = SideChannelClient(2.0)
    try:
        assert not bells[0].wait(0.05)  # nothing yet
        client.request(HOST, params["remote_port"], proto.LeaseRenew(
            engine_id="eng-d", request_ids=[req.request_id], acquire=True))
        assert all(b.wait(5.0) for b in bells)
        client.request(HOST, params["remote_port"], proto.LeaseRelease(
            engine_id="eng-d", request_ids=[req.request_id], tp_rank=0))
    finally:
        client.close()
        for b in bells:
            b.close()
    step(sched)
    assert_empty_after_step(sched)


def test_p_lease_expiry_frees_blocks(make_scheduler):
    sched = make_scheduler("kv_producer")
    # PDConfig refuses leases under MIN_LEASE_S; shorten the table's lease directly
    # so that the test does not wait seconds.
    pd(sched).leases.table = LeaseTable(0.2, time.monotonic)
    # Before the grant: a host that stalls between the grant and t0 must not
    # shorten the measured lease (the lease then expires < 0.2 s after t0).
    t0 = time.monotonic()
    req, _ = finish_prefill(sched)
    held = num_free(sched)
    expiries = 0
    while num_free(sched) == held and time.monotonic() - t0 < 5:
        out = sched.schedule()
        core = sched.update_from_output(out, make_output([]))
        expiries += sum(eco.scheduler_stats.kv_connector_stats.get("num_lease_expiries", 0)
                        for eco in core.values()
                        if eco.scheduler_stats and eco.scheduler_stats.kv_connector_stats)
    assert num_free(sched) > held
    assert pd(sched).num_pinned_requests == 0
    assert time.monotonic() - t0 >= 0.15
    # The expiry is counted in the stats vLLM collects from the connector.
    assert expiries == 1
    # A late pin is refused as expired, never resurrected.
    assert pd(sched).leases.table.renew(req.request_id, acquire=True) == proto.LEASE_EXPIRED
    assert_empty_after_step(sched)


def test_p_aborted_prefill_hands_nothing_over(make_scheduler):
    sched = make_scheduler("kv_producer")
    req = create_request(100, kv_transfer_params={"do_remote_decode": True}, max_tokens=1)
    sched.add_request(req)
    sched.schedule()
    sched.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    assert len(pd(sched).leases.table) == 0
    assert_empty_after_step(sched)


@pytest.mark.parametrize("first_token", [True, False])
def test_p_prefill_stopped_at_token_one_hands_over_only_without_pd_first_token(
        make_scheduler, first_token):
    """Token #1 is EOS. With ``pd_first_token`` the proxy sends it itself and
    no D leg follows: no lease, every block free at once. Without it (today's
    path: D recomputes token #1) P lends the blocks as for ``length``."""
    sched = make_scheduler("kv_producer")
    total_free = num_free(sched)
    params = {"do_remote_decode": True, **({"pd_first_token": True} if first_token else {})}
    req = create_request(100, kv_transfer_params=params, max_tokens=4)
    sched.add_request(req)
    finals = []
    for _ in range(10):
        _, core = step(sched, token_id=EOS_TOKEN_ID)
        finals += [o for o in outputs_of(settle(sched, core))
                   if o.request_id == req.request_id and o.finish_reason is not None]
        if req.is_finished():
            break
    assert req.status is RequestStatus.FINISHED_STOPPED
    assert len(finals) == 1
    if first_token:
        assert finals[0].kv_transfer_params is None
        assert len(pd(sched).leases.table) == 0
        assert num_free(sched) == total_free
    else:
        assert finals[0].kv_transfer_params["remote_num_tokens"] == 100
        assert len(pd(sched).leases.table) == 1
        assert pd(sched).leases.table.release(req.request_id)
    assert_empty_after_step(sched)


def test_p_probe_returns_identity_only(make_scheduler):
    sched = make_scheduler("kv_producer")
    req = create_request(64, kv_transfer_params={"do_remote_decode": True, "pd_ext_probe": True},
                         max_tokens=1)
    sched.add_request(req)
    finals = run_until_finished(sched, req)
    params = finals[0].kv_transfer_params
    assert params["remote_engine_id"] == "eng-kv_producer"
    assert params["remote_block_ids"] is None and params["remote_request_id"] is None
    assert len(pd(sched).leases.table) == 0
    assert_empty_after_step(sched)


def test_p_malformed_params_run_locally(make_scheduler):
    sched = make_scheduler("kv_producer")
    bad = create_request(64, kv_transfer_params={"do_remote_decode": True, "tp_size": "x"},
                         max_tokens=1)
    good = create_request(64, kv_transfer_params={"do_remote_decode": True}, max_tokens=1)
    sched.add_request(bad)
    sched.add_request(good)
    run_until_finished(sched, bad)
    assert good.is_finished()
    assert bad.request_id not in sched.requests  # freed at once, no lease
    assert list(pd(sched).leases.table._leases) == [good.request_id]
    pd(sched).leases.release(proto.LeaseRelease(engine_id="d", request_ids=[good.request_id],
                                                tp_rank=0))
    step(sched)
    assert pd(sched).num_pinned_requests == 0
    assert_empty_after_step(sched)


# ====================================================================== D side
def admit_remote(sched, req):
    sched.add_request(req)
    out, _ = step(sched)
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert out.num_scheduled_tokens == {}
    return out.kv_connector_metadata


def test_d_remote_prefill_lifecycle(make_scheduler):
    sched = make_scheduler()
    dead_p = free_port()
    total_free = num_free(sched)
    req = create_request(100, kv_transfer_params=remote_params(dead_p, 4, num_tokens=100),
                         max_tokens=2)
    meta = admit_remote(sched, req)
    assert isinstance(meta, PDConnectorMetadata)
    assert len(meta.reqs_to_recv) == 1 and meta.reqs_to_fail == {}
    spec = meta.reqs_to_recv[0]
    assert spec.request_id == req.request_id
    assert spec.remote_block_ids == [20, 21, 22, 23]
    assert len(spec.local_block_ids) == 4 and len(set(spec.local_block_ids)) == 4
    assert spec.local_block_ids == sched.kv_cache_manager.get_block_ids(req.request_id)[0]
    assert (spec.remote_engine_id, spec.remote_request_id) == ("eng-p", "p-req")
    assert (spec.remote_host, spec.remote_port, spec.remote_tp_size) == (HOST, dead_p, 1)
    assert spec.num_tokens == 100
    assert num_free(sched) == total_free - 4
    # Telemetry: D's API server stamped the request (vLLM's arrival_time)
    # just before the scheduler saw it; the load left in this step.
    d = pd(sched).d._reqs[req.request_id]
    assert d.api_s is not None and 0 <= d.api_s < 5
    assert d.arrived <= d.dispatched
    # Heartbeats to a dead P fail in the background; the engine keeps stepping.
    for _ in range(3):
        out, _ = step(sched)
        assert out.kv_connector_metadata.reqs_to_recv == []
        assert req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert wait_for(lambda: pd(sched).heartbeats._thread is not None)
    assert pd(sched).take_loads_reported() is False
    # The worker reports the load done: the request runs its last token and decodes.
    step(sched, finished_recving={req.request_id})
    # The EngineCore may skip its idle yield once: the next step has work.
    assert pd(sched).take_loads_reported() is True
    assert pd(sched).take_loads_reported() is False
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {req.request_id: 1}
    assert req.request_id not in pd(sched).heartbeats._tracked
    run_until_finished(sched, req)
    assert req.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert_empty_after_step(sched)


def test_d_prefix_cache_hit_requests_only_missing_blocks(make_scheduler):
    sched = make_scheduler()
    prompt = [5 + i for i in range(160)]  # 5 blocks
    local = create_request(160, prompt=prompt, max_tokens=1)
    sched.add_request(local)
    run_until_finished(sched, local)
    assert_empty_after_step(sched)
    # D's prompt shares the first 3 blocks (96 tokens) with what D computed.
    d_prompt = prompt[:96] + [2000 + i for i in range(64)]
    req = create_request(160, prompt=d_prompt, max_tokens=1,
                         kv_transfer_params=remote_params(free_port(), 5, num_tokens=160))
    meta = admit_remote(sched, req)
    spec = meta.reqs_to_recv[0]
    assert spec.remote_block_ids == [23, 24]  # front cut by the 3 cached blocks
    assert len(spec.local_block_ids) == 2
    all_local = sched.kv_cache_manager.get_block_ids(req.request_id)[0]
    assert len(all_local) == 5 and spec.local_block_ids == all_local[3:]
    assert spec.num_tokens == 64
    assert req.num_computed_tokens == 160
    step(sched, finished_recving={req.request_id})
    run_until_finished(sched, req)
    assert_empty_after_step(sched)


def test_d_failed_recving_fail_policy(make_scheduler):
    sched = make_scheduler(policy="fail")
    req = create_request(100, kv_transfer_params=remote_params(free_port(), 4))
    admit_remote(sched, req)
    _, core = step(sched, finished_recving={req.request_id}, failed_recving={req.request_id})
    assert req.status is RequestStatus.FINISHED_ERROR
    finals = [o for o in outputs_of(core) if o.request_id == req.request_id]
    assert finals and str(finals[-1].finish_reason).lower().endswith("error")
    assert_empty_after_step(sched)


def test_d_failed_recving_recompute_policy(make_scheduler):
    sched = make_scheduler(policy="recompute")
    req = create_request(100, kv_transfer_params=remote_params(free_port(), 4), max_tokens=1)
    admit_remote(sched, req)
    step(sched, finished_recving={req.request_id}, failed_recving={req.request_id})
    assert not req.is_finished()
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {req.request_id: 100}  # full local prefill
    drain(sched)  # async: that step's output
    assert req.is_finished() and req.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert_empty_after_step(sched)


def test_d_malformed_params_fail_load_engine_keeps_working(make_scheduler):
    sched = make_scheduler(policy="fail")
    vcfg = sched.vllm_config
    worker = PDWorker(vcfg, PDConfig.from_extra_config(
        vcfg.kv_transfer_config.kv_connector_extra_config),
        transport=FakeTransport("d", FakeFabric()), tp_rank=0)
    try:
        bad = create_request(100, kv_transfer_params=remote_params(free_port(), 4,
                                                                   remote_port="x"))
        ok = create_request(64, max_tokens=3)
        sched.add_request(bad)
        sched.add_request(ok)
        out = sched.schedule()
        assert bad.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        meta = out.kv_connector_metadata
        assert meta.reqs_to_recv == []
        assert meta.reqs_to_fail[bad.request_id][0] == "bad_params"
        assert "remote_port" in meta.reqs_to_fail[bad.request_id][1]
        # The worker turns reqs_to_fail into a failed load.
        worker.start_load_kv(meta)
        sending, recving, failed = worker.get_transfer_results()
        assert recving == failed == {bad.request_id} and not sending
        sched.update_from_output(out, make_output(
            list(out.num_scheduled_tokens), finished_recving=recving, failed_recving=failed))
        assert bad.status is RequestStatus.FINISHED_ERROR
        run_until_finished(sched, ok)
        assert ok.status is RequestStatus.FINISHED_LENGTH_CAPPED
        assert_empty_after_step(sched)
    finally:
        worker.shutdown()


@pytest.fixture
def fake_p():
    """A side channel with a lease table, standing in for P's scheduler."""
    leases = LeaseService(LeaseTable(30.0, time.monotonic))
    port = free_port()
    compat = proto.CompatInfo(protocol_version=1, model="m", dtype="d", block_size=32,
                              kv_layout="x", num_layers=1, num_kv_heads=1, head_size=1,
                              tp_size=1, transfer_mode="pull")
    server = SideChannelServer(HOST, port, "eng-p", compat, {}, leases)
    yield port, leases
    server.close()


def test_d_abort_before_allocation_releases_p(make_scheduler, fake_p):
    port, leases = fake_p
    with leases.lock:
        leases.table.grant("p-req")
    sched = make_scheduler(heartbeat_interval=0.05)
    req = create_request(100, kv_transfer_params=remote_params(port, 4))
    sched.add_request(req)  # not scheduled yet: no blocks allocated
    # Heartbeats start as soon as D knows the request.
    assert wait_for(lambda: leases.num_heartbeats >= 1)
    sched.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    assert wait_for(lambda: leases.table.get("p-req").state is LeaseState.RELEASED)
    assert leases.table.get("p-req").release_ok is False
    assert req.request_id not in pd(sched).heartbeats._tracked
    assert_empty_after_step(sched)


def test_d_abort_while_waiting_keeps_blocks_until_reported(make_scheduler, fake_p):
    port, leases = fake_p
    with leases.lock:
        leases.table.grant("p-req")
    sched = make_scheduler(heartbeat_interval=0.05)
    req = create_request(100, kv_transfer_params=remote_params(port, 4))
    admit_remote(sched, req)
    sched.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    # vLLM keeps the blocks: a READ may still be writing them.
    assert req.request_id in sched.requests
    # Heartbeats keep P's lease alive until the worker settles the load.
    before = leases.num_heartbeats
    assert wait_for(lambda: leases.num_heartbeats > before + 1)
    assert leases.table.get("p-req").state is LeaseState.HELD
    step(sched, finished_recving={req.request_id})
    assert req.request_id not in pd(sched).heartbeats._tracked
    assert_empty_after_step(sched)


def test_d_request_without_params_runs_locally(make_scheduler):
    sched = make_scheduler()
    req = create_request(64, max_tokens=2)
    sched.add_request(req)
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {req.request_id: 64}
    assert out.kv_connector_metadata.reqs_to_recv == []
    run_until_finished(sched, req)
    assert_empty_after_step(sched)


def test_d_remote_num_tokens_mismatch_fails_load_and_releases_p(make_scheduler, fake_p):
    port, leases = fake_p
    with leases.lock:
        leases.table.grant("p-req")
    sched = make_scheduler(policy="fail")
    req = create_request(100, kv_transfer_params=remote_params(port, 4, num_tokens=99))
    meta = admit_remote(sched, req)
    assert meta.reqs_to_recv == []
    reason, why = meta.reqs_to_fail[req.request_id]
    assert reason == "layout_mismatch" and "99" in why
    # P's blocks will never be read: D frees them at once instead of at expiry.
    assert wait_for(lambda: leases.table.get("p-req").state is LeaseState.RELEASED)
    step(sched, finished_recving={req.request_id}, failed_recving={req.request_id})
    assert req.status is RequestStatus.FINISHED_ERROR
    assert_empty_after_step(sched)


def test_d_too_few_remote_blocks_fails_load(make_scheduler):
    # 100 tokens need 4 blocks; P's params list only 3 (no remote_num_tokens,
    # as NixlConnector-style peers send). Loading 3 blocks and counting all 100
    # tokens as computed would leave tokens 96..99 with stale KV.
    sched = make_scheduler(policy="fail")
    req = create_request(100, kv_transfer_params=remote_params(free_port(), 3))
    meta = admit_remote(sched, req)
    assert meta.reqs_to_recv == [], meta.reqs_to_recv
    assert req.request_id in meta.reqs_to_fail
    step(sched, finished_recving={req.request_id}, failed_recving={req.request_id})
    assert_empty_after_step(sched)


@pytest.mark.parametrize("tp_size", [2, 1024])
def test_d_tp_size_in_params_is_never_looped_over(make_scheduler, fake_p, tp_size):
    """Item 2 (issue 26: a P with another TP size may pair): the rank count
    is D's own TP size. A request naming any tp_size that D's divides is one
    load (one spec; the handshake checks P's real sharding), admitted at
    once, and nothing is sent per claimed rank."""
    port, _ = fake_p
    sched = make_scheduler(policy="fail")
    req = create_request(100, kv_transfer_params=remote_params(port, 4, tp_size=tp_size))
    t0 = time.monotonic()
    meta = admit_remote(sched, req)
    assert time.monotonic() - t0 < 1.0
    assert [s.request_id for s in meta.reqs_to_recv] == [req.request_id]
    assert meta.reqs_to_fail == {}
    assert pd(sched).heartbeats.num_lanes <= 1  # one P endpoint, not one per claimed rank


def test_d_n_children_share_one_load_then_hit_the_prefix_cache(make_scheduler, fake_p):
    """Issue 24 item 2: vLLM fans ``n`` > 1 out into children that share the
    parent's params (one dict). The first child loads P's KV; the second
    (same prompt, same lease) is not scheduled while that load is pending,
    never loads or heartbeats itself, and once the load is reported it
    computes only what the prefix cache lacks (the partial last block)."""
    port, leases = fake_p
    with leases.lock:
        leases.table.grant("p-req")
    sched = make_scheduler(policy="fail")
    prompt = [10 + i for i in range(100)]
    params = remote_params(port, 4, num_tokens=100,
                           remote_prompt_digest=auth.token_digest(prompt))
    first = create_request(100, prompt=prompt, kv_transfer_params=params, max_tokens=3)
    second = create_request(100, prompt=prompt, kv_transfer_params=params, max_tokens=3)
    sched.add_request(first)
    sched.add_request(second)
    for _ in range(3):  # the load is pending: the second child waits, unscheduled
        out, _ = step(sched)
        meta = out.kv_connector_metadata
        assert second.request_id not in out.num_scheduled_tokens
        assert second.status is RequestStatus.WAITING
        assert all(s.request_id == first.request_id for s in meta.reqs_to_recv)
        assert meta.reqs_to_fail == {}
    assert first.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert list(pd(sched).heartbeats._tracked) == [first.request_id]
    step(sched, finished_recving={first.request_id})
    out, _ = step(sched)
    # Both run now: the second over the 3 whole blocks the load cached.
    assert out.num_scheduled_tokens.get(second.request_id) == 100 - 3 * BLOCK_SIZE
    assert second.request_id not in pd(sched).d
    run_until_finished(sched, first)
    run_until_finished(sched, second)
    assert first.status is second.status is RequestStatus.FINISHED_LENGTH_CAPPED
    # The loader's workers release P's lease after their READ (no workers
    # here); the follower, ending, must not have released it.
    assert leases.table.get("p-req").state is not LeaseState.RELEASED
    assert_empty_after_step(sched)


def test_d_n_child_added_after_its_sibling_finished_loads_nothing(make_scheduler, fake_p):
    """vLLM adds ``n`` children one by one: the first may load and finish
    before the next arrives (a CI run saw it in push mode: the late child
    registered with P, which had already dropped the push, and failed the
    request). A late sibling (same parent id, vLLM's ``{i}_{parent}``)
    loads nothing and runs as an ordinary request; a request of another
    client naming the same lease still goes the old way."""
    port, leases = fake_p
    with leases.lock:
        leases.table.grant("p-req")
    sched = make_scheduler(policy="fail")
    prompt = [10 + i for i in range(100)]
    params = remote_params(port, 4, num_tokens=100,
                           remote_prompt_digest=auth.token_digest(prompt))
    parent = "cmpl-x-0-1a2b3c4d"
    first = create_request(100, prompt=prompt, kv_transfer_params=params, max_tokens=2,
                           request_id=f"0_{parent}")
    sched.add_request(first)
    step(sched)
    step(sched, finished_recving={first.request_id})
    run_until_finished(sched, first)
    assert first.status is RequestStatus.FINISHED_LENGTH_CAPPED
    late = create_request(100, prompt=prompt, kv_transfer_params=params, max_tokens=2,
                          request_id=f"1_{parent}")
    sched.add_request(late)
    out, _ = step(sched)
    assert out.kv_connector_metadata.reqs_to_recv == []
    assert out.kv_connector_metadata.reqs_to_fail == {}
    assert late.request_id in out.num_scheduled_tokens  # runs at once, as an ordinary one
    run_until_finished(sched, late)
    assert late.status is RequestStatus.FINISHED_LENGTH_CAPPED
    # Another client's request on that lease is no sibling: it tries to load.
    other = create_request(100, prompt=prompt, kv_transfer_params=params, max_tokens=2,
                           request_id="cmpl-y-0-5e6f7a8b")
    sched.add_request(other)
    out, _ = step(sched)
    assert [s.request_id for s in out.kv_connector_metadata.reqs_to_recv] == [other.request_id]


def test_d_child_aborted_while_waiting_for_its_leader_leaves_nothing(make_scheduler, fake_p):
    """A follower that ends before the shared load does (the client went
    away) leaves no record; the leader's load and lease are untouched."""
    port, leases = fake_p
    with leases.lock:
        leases.table.grant("p-req")
    sched = make_scheduler(policy="fail")
    prompt = [20 + i for i in range(100)]
    params = remote_params(port, 4, num_tokens=100,
                           remote_prompt_digest=auth.token_digest(prompt))
    first = create_request(100, prompt=prompt, kv_transfer_params=params)
    second = create_request(100, prompt=prompt, kv_transfer_params=params)
    sched.add_request(first)
    sched.add_request(second)
    step(sched)
    sched.finish_requests(second.request_id, RequestStatus.FINISHED_ABORTED)
    assert second.request_id not in pd(sched).d and first.request_id in pd(sched).d
    assert leases.table.get("p-req").state is not LeaseState.RELEASED
    step(sched, finished_recving={first.request_id})
    run_until_finished(sched, first)
    assert_empty_after_step(sched)


def test_d_second_live_request_on_one_p_lease_never_reads_it(make_scheduler, fake_p):
    """Items 6 and 7 (issue 24: no longer a failure): the same P answer on a
    second live request for another prompt (a replayed D leg): the first
    loads; the second never reads P, waits for that load, then computes its
    own prompt whole (the prefix cache is keyed by tokens: nothing of the
    first's KV matches). Once the first ended, the lease is free to be named
    again (P then says whether it still exists)."""
    port, _ = fake_p
    sched = make_scheduler(policy="fail")
    params = remote_params(port, 4, num_tokens=100)
    first = create_request(100, kv_transfer_params=params)
    meta = admit_remote(sched, first)
    assert [s.request_id for s in meta.reqs_to_recv] == [first.request_id]
    replay = create_request(100, kv_transfer_params=dict(params))
    assert replay.prompt_token_ids != first.prompt_token_ids
    sched.add_request(replay)
    out, _ = step(sched)
    assert out.kv_connector_metadata.reqs_to_recv == []
    assert out.kv_connector_metadata.reqs_to_fail == {}
    assert replay.request_id not in out.num_scheduled_tokens  # waits for the load
    step(sched, finished_recving={first.request_id})
    out, _ = step(sched)
    assert out.num_scheduled_tokens.get(replay.request_id) == 100  # computes it all
    run_until_finished(sched, first)
    run_until_finished(sched, replay)
    assert replay.status is RequestStatus.FINISHED_LENGTH_CAPPED
    later = create_request(100, kv_transfer_params=dict(params))
    meta = admit_remote(sched, later)
    assert [s.request_id for s in meta.reqs_to_recv] == [later.request_id]
    step(sched, finished_recving={later.request_id})
    run_until_finished(sched, later)
    assert_empty_after_step(sched)


def test_d_lease_claim_of_an_aborted_load_ends_when_the_worker_reports_it(make_scheduler,
                                                                          fake_p):
    """A request aborted while its load is in flight keeps its claim on the
    lease (and its record) until the workers report the load; a request
    naming that lease meanwhile never reads it (the blocks may be freed):
    it computes its prompt itself at once."""
    port, _ = fake_p
    sched = make_scheduler(policy="fail")
    params = remote_params(port, 4, num_tokens=100)
    req = create_request(100, kv_transfer_params=params)
    admit_remote(sched, req)
    sched.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    replay = create_request(100, kv_transfer_params=dict(params))
    sched.add_request(replay)
    out, _ = step(sched, finished_recving={req.request_id})
    assert out.kv_connector_metadata.reqs_to_recv == []
    assert out.num_scheduled_tokens.get(replay.request_id) == 100
    run_until_finished(sched, replay)
    assert len(pd(sched).d) == 0 and pd(sched).d.lease_users == {}
    assert_empty_after_step(sched)


# ============================================================ authentication
SECRET = "s3cret-for-tests-0123456789"


@pytest.fixture
def secret_file(tmp_path):
    f = tmp_path / "secret"
    f.write_text(SECRET)
    return str(f)


def test_engine_core_refuses_unsigned_legs_even_without_the_middleware(
        make_scheduler, fake_p, secret_file):
    """Issue 12 item 4, the EngineCore's own check: with a secret, an
    unsigned or altered D leg fails its load (nothing is pinned or read,
    not even a heartbeat leaves), and an unsigned P leg hands no KV over."""
    port, _ = fake_p
    kr = auth.Keyring.parse(SECRET, "test")
    d = make_scheduler(policy="fail", auth_secret_file=secret_file)
    assert pd(d).auth is not None
    unsigned = create_request(100, kv_transfer_params=remote_params(port, 4))
    altered = create_request(100, kv_transfer_params={
        **auth.sign_leg(kr, remote_params(port, 4), "rid", {"prompt": "x"}),
        "remote_block_ids": [[1, 2, 3, 4]]})
    for req, why in ((unsigned, "not signed"), (altered, "does not match")):
        meta = admit_remote(d, req)
        assert meta.reqs_to_recv == []
        reason, detail = meta.reqs_to_fail[req.request_id]
        assert reason == "bad_params" and "unauthenticated" in detail and why in detail
        step(d, finished_recving={req.request_id}, failed_recving={req.request_id})
        assert req.status is RequestStatus.FINISHED_ERROR
    assert pd(d).heartbeats.num_lanes == 0
    assert_empty_after_step(d)

    p = make_scheduler("kv_producer", auth_secret_file=secret_file)
    free = num_free(p)
    _, params = finish_prefill(p, num_tokens=100)  # unsigned do_remote_decode
    assert params is None and pd(p).num_pinned_requests == 0
    assert num_free(p) == free
    leg = auth.sign_leg(kr, {"do_remote_decode": True}, "rid", {"prompt": "x"})
    req = create_request(100, kv_transfer_params=leg, max_tokens=1)
    p.add_request(req)
    finals = run_until_finished(p, req)
    assert finals[0].kv_transfer_params["do_remote_prefill"] is True
    assert pd(p).num_pinned_requests == 1


def test_d_refuses_a_p_answer_made_for_another_prompt(make_scheduler, fake_p):
    """Item 4's old risk: a D leg paired with another request's P answer of
    the same length would decode on the wrong KV; P's answer carries its
    prompt's digest and D refuses a mismatch before reading anything."""
    port, _ = fake_p
    d = make_scheduler(policy="fail")
    req = create_request(100, kv_transfer_params=remote_params(
        port, 1, remote_prompt_digest=auth.token_digest(range(100))))
    meta = admit_remote(d, req)
    reason, why = meta.reqs_to_fail[req.request_id]
    assert reason == "bad_params" and "another prompt" in why
    step(d, finished_recving={req.request_id}, failed_recving={req.request_id})
    assert pd(d).heartbeats.num_lanes == 0
    assert_empty_after_step(d)


@pytest.mark.parametrize("p_tokens", [100, 4 * BLOCK_SIZE])
def test_d_with_a_seeded_token_loads_p_prompt_and_computes_only_the_seed(
        make_scheduler, p_tokens):
    """Issue 29 (token #1 from P): D's prompt is P's prompt plus the token P
    sampled. D loads P's KV for P's prompt only (its digest checked over
    that part), then computes the one seeded token (a decode step's work,
    sampling token #2), never P's last prompt token again."""
    sched = make_scheduler()
    prompt = [3 + i % 500 for i in range(p_tokens)] + [777]
    blocks = -(-p_tokens // BLOCK_SIZE)
    req = create_request(0, prompt=prompt, max_tokens=2, kv_transfer_params=remote_params(
        free_port(), blocks, num_tokens=p_tokens, pd_seeded_tokens=1,
        remote_prompt_digest=auth.token_digest(prompt[:-1])))
    meta = admit_remote(sched, req)
    assert meta.reqs_to_fail == {}
    (spec,) = meta.reqs_to_recv
    assert spec.num_tokens == p_tokens and len(spec.remote_block_ids) == blocks
    assert len(spec.local_block_ids) == blocks
    step(sched, finished_recving={req.request_id})
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {req.request_id: 1}  # the seeded token only
    assert req.num_computed_tokens >= p_tokens
    run_until_finished(sched, req)
    assert_empty_after_step(sched)


def test_d_refuses_seeded_tokens_that_leave_no_prompt_or_another_prefix(make_scheduler):
    sched = make_scheduler(policy="fail")
    whole = create_request(1, prompt=[9], kv_transfer_params=remote_params(
        free_port(), 1, pd_seeded_tokens=1))
    meta = admit_remote(sched, whole)
    assert "pd_seeded_tokens=1 leaves no prompt" in meta.reqs_to_fail[whole.request_id][1]
    step(sched, finished_recving={whole.request_id}, failed_recving={whole.request_id})
    prompt = list(range(40, 140))
    other = create_request(0, prompt=prompt, kv_transfer_params=remote_params(
        free_port(), 4, num_tokens=99, pd_seeded_tokens=1,
        remote_prompt_digest=auth.token_digest(prompt)))  # the digest of the whole prompt
    meta = admit_remote(sched, other)
    assert "another prompt" in meta.reqs_to_fail[other.request_id][1]
    step(sched, finished_recving={other.request_id}, failed_recving={other.request_id})
    assert_empty_after_step(sched)


def test_since_api_arrival_trusts_only_a_plausible_stamp():
    now = time.time()
    # A stamp 10 s old, bounded loosely above: a stalled host may pause between
    # the two clock reads (a value in ms, or a stamp taken as stale, still fails).
    assert 10 <= compat.since_api_arrival(SimpleNamespace(arrival_time=now - 10)) < 40
    # Missing, not a number, in the future (another host's clock), or stale.
    for stamp in (None, True, "1.0", now + 5, now - 7200):
        assert compat.since_api_arrival(SimpleNamespace(arrival_time=stamp)) is None
    assert compat.since_api_arrival(object()) is None
