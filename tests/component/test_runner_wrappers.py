"""Our worker half under vLLM's two model runners' connector call orders.

On GPU vLLM defaults to Model Runner V2, which calls the connector through
its own wrapper, ``ActiveKVConnector`` (vllm/v1/worker/gpu/kv_connector.py,
vLLM 0.32): per step ``pre_forward`` (l. 70-91: ``handle_preemptions``,
``bind_connector_metadata``, ``start_load_kv`` only if ``has_sync_kv_loads``),
the forward (``wait_for_layer_load``/``save_kv_layer`` per attention layer),
``finish_forward`` (l. 124-126), then ``post_forward`` (l. 131-151: the
deferred ``start_load_kv`` with ``scheduler_output``, ``request_ids``, ...
as keyword arguments, ``wait_for_save``, ``get_transfer_results``,
``get_block_ids_with_load_errors``, stats, events,
``build_connector_worker_meta``, ``clear_connector_metadata``). A step with
nothing to run goes through ``no_forward`` (l. 153-161; called from
model_runner.py ``execute_model`` l. 1743-1748 and 1800-1803): the same
sequence without a forward, ``start_load_kv`` without keyword arguments.

The wrapper imports on CPU (Triton is only needed by the model runner's
kernels), so these tests drive the real one, with vLLM's
``get_kv_transfer_group`` pointed at a real ``PDConnector`` whose worker half
is a ``PDWorker`` on the fake transport. The V1 runner's order
(``KVConnectorModelRunnerMixin._get_kv_connector_output``,
vllm/v1/worker/kv_connector_model_runner_mixin.py l. 64-107, and
``kv_connector_no_forward`` l. 24-37) is driven the same way for comparison.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
from test_worker_fake import Pair, assert_blocks_copied, fake_vllm_config
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.forward_context import set_forward_context
from vllm.v1.worker import kv_connector_model_runner_mixin as v1_mixin
from vllm.v1.worker.gpu import kv_connector as mrv2

from vllm_pd_ext import compat
from vllm_pd_ext.compat import KVConnectorRole
from vllm_pd_ext.config import PDConfig
from vllm_pd_ext.connector import PDConnector
from vllm_pd_ext.metadata import PDConnectorMetadata

WORKER_METHODS = ("handle_preemptions", "bind_connector_metadata", "start_load_kv",
                  "wait_for_layer_load", "save_kv_layer", "finish_forward", "wait_for_save",
                  "get_transfer_results", "get_finished", "get_block_ids_with_load_errors",
                  "get_kv_connector_stats", "get_kv_connector_kv_cache_events",
                  "build_connector_worker_meta", "clear_connector_metadata")


class TracedConnector(PDConnector):
    """The real facade, recording each worker-side call (and its kwargs)."""

    calls: list[tuple[str, tuple[str, ...]]]


def _traced(name: str) -> Any:
    orig = getattr(PDConnector, name)

    def call(self: TracedConnector, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((name, tuple(sorted(kwargs))))
        return orig(self, *args, **kwargs)

    return call


for _name in WORKER_METHODS:
    setattr(TracedConnector, _name, _traced(_name))


def worker_connector(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> TracedConnector:
    """A WORKER-role PDConnector whose PDWorker is the pair's D worker."""
    monkeypatch.setattr(compat, "tp_rank", lambda: 0)  # no torch.distributed here
    cfg = fake_vllm_config("eng-d", False)
    cfg.kv_transfer_config.kv_connector_extra_config = {}
    cfg.speculative_config = None
    conn = TracedConnector(cfg, KVConnectorRole.WORKER, None)
    conn._worker = pair.d_worker  # the one on the fake transport, caches registered
    conn.calls = []
    return conn


@pytest.fixture
def vllm_config():
    from pdsched import create_vllm_config

    return create_vllm_config("kv_consumer")


@pytest.fixture
def make_pair():
    pairs: list[Pair] = []

    def make(**kw: Any) -> Pair:
        pair = Pair(d_cfg=PDConfig(handshake_timeout=1.0, transfer_timeout=5.0), **kw)
        pairs.append(pair)
        return pair

    yield make
    for pair in pairs:
        pair.close()


def sched_out(meta: PDConnectorMetadata, finished: set[str] | None = None) -> Any:
    """What the wrappers read of a SchedulerOutput."""
    return SimpleNamespace(kv_connector_metadata=meta, has_sync_kv_loads=False,
                           finished_req_ids=finished or set(), total_num_scheduled_tokens=0)


def mrv2_wrapper(monkeypatch: pytest.MonkeyPatch, conn: PDConnector, vllm_config: Any,
                 kv: dict[str, Any]) -> mrv2.ActiveKVConnector:
    monkeypatch.setattr(mrv2, "get_kv_transfer_group", lambda: conn)
    # set_disabled writes this global; the test leaves it as found.
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", None)
    conn.register_kv_caches = lambda caches: None  # the pair's worker registered already
    return mrv2.ActiveKVConnector(vllm_config, kv)


def mrv2_forward_step(wrapper: mrv2.ActiveKVConnector, conn: PDConnector, vllm_config: Any,
                      meta: PDConnectorMetadata, layers: list[str]) -> Any:
    """model_runner.py execute_model l. 2019-2046 (eager) then sample_tokens
    l. 2276: pre_forward inside the forward context, the layers, then
    finish_forward and post_forward."""
    so = sched_out(meta)
    batch = SimpleNamespace(idx_mapping=[0], req_ids=["running"], num_tokens=1)
    with set_forward_context(None, vllm_config):
        wrapper.pre_forward(so, batch)
        for layer in layers:  # what maybe_transfer_kv_layer does around attention
            conn.wait_for_layer_load(layer)
            conn.save_kv_layer(layer, None, None)
    wrapper.finish_forward()
    return wrapper.post_forward(so.finished_req_ids)


def reports(kv_out: Any) -> tuple[set[str], set[str], set[str]]:
    """(sending, recving, failed) of a KVConnectorOutput; vLLM drops an empty
    one (``ModelRunnerOutput.with_kv_conn_output_only``: None)."""
    if kv_out is None:
        return set(), set(), set()
    return (set(kv_out.finished_sending or ()), set(kv_out.finished_recving or ()),
            set(kv_out.failed_recving or ()))


def names(conn: TracedConnector) -> list[str]:
    return [n for n, _ in conn.calls]


MRV2_STEP = ["handle_preemptions", "bind_connector_metadata", "finish_forward",
             "start_load_kv", "wait_for_save", "get_transfer_results",
             "get_block_ids_with_load_errors", "get_kv_connector_stats",
             "get_kv_connector_kv_cache_events", "build_connector_worker_meta",
             "clear_connector_metadata"]


def test_mrv2_load_through_forward_and_no_forward_steps(make_pair, monkeypatch, vllm_config):
    """A pull load bound on a forward step finishes over later no-forward
    steps (D's request waits for its KV, so D often has nothing to run) and
    is reported exactly once; nothing stays pending."""
    pair = make_pair()
    pair.grant()
    conn = worker_connector(pair, monkeypatch)
    wrapper = mrv2_wrapper(monkeypatch, conn, vllm_config, pair.d_kv)
    spec = pair.spec()
    layers = list(pair.d_kv)
    out = mrv2_forward_step(wrapper, conn, vllm_config,
                            PDConnectorMetadata(reqs_to_recv=[spec]), layers)
    # The per-layer hooks run inside the forward; the rest in MRV2's order.
    per_layer = [n for n in names(conn) if n in ("wait_for_layer_load", "save_kv_layer")]
    assert per_layer == ["wait_for_layer_load", "save_kv_layer"] * len(layers)
    assert [n for n in names(conn) if n not in per_layer] == MRV2_STEP
    # MRV2's deferred start_load_kv passes the batch as keyword arguments.
    (kwargs,) = [kw for n, kw in conn.calls if n == "start_load_kv"]
    assert kwargs == ("num_tokens", "request_ids", "request_state_indices", "scheduler_output")
    recving = set(out.finished_recving or ())
    failed = set(out.failed_recving)
    steps = 0
    while "d-req" not in recving and steps < 2000:
        time.sleep(0.002)
        conn.calls = []
        empty = wrapper.no_forward(sched_out(PDConnectorMetadata()))
        assert names(conn) == MRV2_STEP  # same order, no forward, no layers
        assert [kw for n, kw in conn.calls if n == "start_load_kv"] == [()]
        sending, new, new_failed = reports(empty.kv_connector_output)
        assert not sending  # P's blocks are freed by the scheduler half
        assert not (new & recving), "reported twice"
        recving |= new
        failed |= new_failed
        steps += 1
    assert recving == {"d-req"} and failed == set()
    assert_blocks_copied(pair, spec.local_block_ids, spec.remote_block_ids)
    # Nothing pending: no load in flight, later steps report nothing, the
    # metadata was cleared each step.
    assert pair.d_worker.num_in_flight == 0 and pair.d_transport.live_handles == {}
    for _ in range(3):
        kv_out = wrapper.no_forward(sched_out(PDConnectorMetadata())).kv_connector_output
        assert reports(kv_out) == (set(), set(), set())
    assert not conn.has_connector_metadata()


def test_mrv2_failed_load_and_disabled_wrapper(make_pair, monkeypatch, vllm_config):
    """A load the scheduler failed (reqs_to_fail) is reported failed and
    received on the very no-forward step it is bound; while MRV2 disables
    the connector (warm-up, profiling: warmup.py l. 204, 362) our connector
    is not called at all."""
    pair = make_pair()
    conn = worker_connector(pair, monkeypatch)
    wrapper = mrv2_wrapper(monkeypatch, conn, vllm_config, pair.d_kv)
    wrapper.set_disabled(True)
    assert wrapper.no_forward(sched_out(PDConnectorMetadata())).kv_connector_output is None
    assert conn.calls == []
    wrapper.set_disabled(False)
    meta = PDConnectorMetadata(reqs_to_fail={"bad": ("bad_params", "remote_port")})
    kv_out = wrapper.no_forward(sched_out(meta)).kv_connector_output
    assert kv_out is not None
    assert kv_out.finished_recving == {"bad"} and kv_out.failed_recving == {"bad"}
    assert names(conn) == MRV2_STEP
    kv_out = wrapper.no_forward(sched_out(PDConnectorMetadata())).kv_connector_output
    assert reports(kv_out) == (set(), set(), set())


V1_STEP = ["bind_connector_metadata", "start_load_kv", "wait_for_save", "get_transfer_results",
           "get_block_ids_with_load_errors", "get_kv_connector_stats",
           "get_kv_connector_kv_cache_events", "build_connector_worker_meta",
           "clear_connector_metadata"]


def test_v1_runner_order_for_comparison(make_pair, monkeypatch, vllm_config):
    """The V1 runner (CPU's runner, so also what tests/e2e exercise):
    bind, start_load_kv after the forward without kwargs, wait_for_save,
    results, clear; no handle_preemptions / finish_forward in the mixin
    (gpu_model_runner.py calls handle_preemptions itself, l. 3971). The same
    load completes over kv_connector_no_forward steps."""
    pair = make_pair()
    pair.grant()
    conn = worker_connector(pair, monkeypatch)
    monkeypatch.setattr(v1_mixin, "get_kv_transfer_group", lambda: conn)
    monkeypatch.setattr(v1_mixin, "has_kv_transfer_group", lambda: True)
    spec = pair.spec()
    mixin = v1_mixin.KVConnectorModelRunnerMixin
    out = mixin.kv_connector_no_forward(
        sched_out(PDConnectorMetadata(reqs_to_recv=[spec])), vllm_config)
    assert names(conn) == V1_STEP
    assert [kw for n, kw in conn.calls if n == "start_load_kv"] == [()]
    recving = reports(out.kv_connector_output)[1]
    for _ in range(2000):
        if "d-req" in recving:
            break
        time.sleep(0.002)
        out = mixin.kv_connector_no_forward(sched_out(PDConnectorMetadata()), vllm_config)
        recving |= reports(out.kv_connector_output)[1]
    assert recving == {"d-req"}
    assert_blocks_copied(pair, spec.local_block_ids, spec.remote_block_ids)
    assert pair.d_worker.num_in_flight == 0 and not conn.has_connector_metadata()
