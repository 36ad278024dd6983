"""PDConnector: the thin facade vLLM instantiates (twice per engine).

With ``KVConnectorRole.SCHEDULER`` (EngineCore process) it forwards to
``scheduler.dispatcher.PDScheduler`` and applies the EngineCore's patches of
vLLM (``compat.patches``); with ``WORKER`` (each worker process) to
``worker.dispatcher.PDWorker``. It holds no logic of its own beyond
translating vLLM's call shapes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_pd_ext.compat import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorStats,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    patches,
    required_kv_cache_layout,
    speculative_problem,
)
from vllm_pd_ext.compat.engine import note_model_step
from vllm_pd_ext.config import PDConfig
from vllm_pd_ext.metadata import PDConnectorMetadata
from vllm_pd_ext.stats import PDPromMetrics, PDStats

if TYPE_CHECKING:
    from vllm_pd_ext.scheduler.dispatcher import PDScheduler
    from vllm_pd_ext.worker.dispatcher import PDWorker


class PDConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
                 ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = PDConfig.from_extra_config(
            vllm_config.kv_transfer_config.kv_connector_extra_config)
        problem = speculative_problem(vllm_config)
        if problem is not None:
            raise ValueError(f"PDConnector: {problem}")
        self.pd_config = cfg
        self._scheduler: PDScheduler | None = None
        self._worker: PDWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            from vllm_pd_ext.scheduler.dispatcher import PDScheduler

            self._scheduler = PDScheduler(vllm_config, cfg)
            # The EngineCore process's setup, in one explicit call that logs
            # each patch of vLLM (and the CPU affinity) as applied or skipped.
            patches.apply(patches.Process.ENGINE_CORE, patches.Context(
                cfg, vllm_config, on_shutdown=self._scheduler.on_engine_shutdown,
                loads_reported=self._scheduler.take_loads_reported,
                enable_landing=self._scheduler.enable_landing))
        else:
            from vllm_pd_ext.worker.dispatcher import PDWorker

            self._worker = PDWorker(vllm_config, cfg)

    @property
    def scheduler(self) -> PDScheduler:
        assert self._scheduler is not None, "scheduler-side call on a worker connector"
        return self._scheduler

    @property
    def worker(self) -> PDWorker:
        assert self._worker is not None, "worker-side call on a scheduler connector"
        return self._worker

    # ------------------------------------------------------------ scheduler
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int
                                 ) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> PDConnectorMetadata:
        meta = self.scheduler.build_connector_meta(scheduler_output)
        # With spin_while_computing, vLLM's queue readers spin while steps compute.
        note_model_step(not meta.idle)
        return meta

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def on_new_request(self, request: Any) -> None:
        self.scheduler.on_new_request(request)

    def update_connector_output(self, connector_output: Any) -> None:
        if connector_output.finished_recving:
            # The next step computes the requests whose KV arrived.
            note_model_step(True)
        self.scheduler.update_connector_output(connector_output)

    def before_schedule(self, scheduler: Any) -> None:
        """Before each ``schedule()`` (``compat.engine.same_step_landing``)."""
        self.scheduler.before_schedule(scheduler)

    def before_update_from_output(self, connector_output: Any) -> None:
        """Before each step's output is applied (``compat.engine.same_step_landing``)."""
        self.scheduler.before_update_from_output(connector_output)

    def take_requests_to_fail(self) -> dict[str, str]:
        """Requests vLLM must end with an error now (``compat.engine.fail_seed_requests``)."""
        return self.scheduler.take_requests_to_fail()

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self.scheduler.bind_gpu_block_pool(gpu_block_pool)

    def has_pending_block_frees(self) -> bool:
        return self.scheduler.has_pending_block_frees()

    def has_pending_push_work(self) -> bool:
        return self.scheduler.has_pending_push_work()

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self.scheduler.set_xfer_handshake_metadata(metadata)

    # ------------------------------------------------------------ worker
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> Any:
        return self.worker.get_handshake_metadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        assert meta is None or isinstance(meta, PDConnectorMetadata)
        note_model_step(meta is not None and not meta.idle)
        self.worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous: a request runs only after its KV arrived.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        # Pull mode: D reads P's blocks after the prefill; nothing to save.
        return

    def wait_for_save(self) -> None:
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self.worker.get_transfer_results()
        if recving:
            # The next step computes them: wait for it spinning, not asleep.
            note_model_step(True)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self.worker.get_transfer_results()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.build_worker_meta()

    # ------------------------------------------------------------ both
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """The KV cache layout we ask vLLM for: "LBHNC", or None for MLA.

        ``kv_regions`` accepts every layout whose blocks are dense (LBHNC,
        LBNHC, BL*), so this is a preference, not a need: vLLM drops it with a
        warning when a backend cannot use it (``resolve_kv_cache_layout``). We
        state one so that P and D resolve the same layout even when their
        backends' defaults differ (FlashAttention would pick LBNHC, FlashInfer
        and the CPU backend LBHNC), since the handshake refuses a layout
        mismatch; LBHNC is the one most backends support and the one vLLM's
        own NixlConnector asks for. MLA caches have one head slot, where LBHNC
        and LBNHC are the same bytes, so the backend's choice stands.
        """
        return required_kv_cache_layout(vllm_config)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is not None:
            return self._worker.get_kv_connector_stats()
        return self.scheduler.get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return PDStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> PDPromMetrics:
        return PDPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
