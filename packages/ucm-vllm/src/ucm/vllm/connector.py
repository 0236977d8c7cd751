"""``UCMConnector``: vLLM's KV connector interface over a UCM store.

Load it into stock vLLM with::

    --kv-transfer-config '{"kv_connector": "UCMConnector",
        "kv_connector_module_path": "ucm.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"store": {"kind": "posix", "path": "/data/ucm"}}}'

vLLM creates one instance in the scheduler process (role SCHEDULER) and one per worker
(role WORKER); each delegates to its half in :mod:`ucm.vllm.scheduler` or
:mod:`ucm.vllm.worker`.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from typing import Any

from ucm.core import place_store_threads
from ucm.vllm.config import connector_config, sync_loads
from ucm.vllm.events import StoredEvents, StoredReport, medium_of
from ucm.vllm.gauges import GaugeSampler
from ucm.vllm.layout import describe
from ucm.vllm.placement import worker_store_cpus
from ucm.vllm.scheduler import SchedulerSide
from ucm.vllm.stats import UCMPromMetrics, UCMStats
from ucm.vllm.stores import ConnectorStores
from ucm.vllm.support import loads_refused, version_warning
from ucm.vllm.worker import WorkerSide

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # vLLM before 0.32 counts no hits by source
    CacheHitSource = None  # type: ignore[assignment,misc]

log = logging.getLogger(__name__)

#: a store tier (``Store.tier``) as vLLM counts hits by source
#: (``vllm:prompt_tokens_cached_by_source``, vLLM 0.32 on): other hosts' memory is what
#: vLLM's own Mooncake connector reports, p2p
HIT_SOURCES = (
    {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK, "remote": CacheHitSource.P2P}
    if CacheHitSource is not None
    else {}
)


class UCMConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_through_vllm()
        transfer = self._kv_transfer_config
        self.config = connector_config(transfer.kv_connector_extra_config)
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import (
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )
            from vllm.platforms import current_platform

            rank, world = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
            # before the stores open: the threads they start go there
            place_store_threads(
                worker_store_cpus(self.config.store_cpus, current_platform.is_cpu())
            )
        else:
            rank, world = 0, vllm_config.parallel_config.tensor_parallel_size
        self.layout = describe(vllm_config, kv_cache_config, self.config, rank, world)
        if role == KVConnectorRole.SCHEDULER and self.config.recompute_on_load_error:
            # A cache miss must never fail a request: recompute what could not be loaded.
            transfer.kv_load_failure_policy = "recompute"
        if self.layout.has_windows:
            log.info(
                "UCMConnector: hybrid model, window-group tails (blocks) per group: %s",
                self.layout.hybrid.tail_blocks,
            )
        sync = sync_loads(self.config, len(kv_cache_config.kv_cache_groups))
        stores = ConnectorStores.open(
            self.config.store,
            self.layout.has_windows,
            self.config.wa_capacity_fraction,
            lookups_only=role == KVConnectorRole.SCHEDULER,
        )
        events = vllm_config.kv_events_config
        self.events_on = bool(events is not None and events.enable_kv_cache_events)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self.gauges: GaugeSampler | None = None
        if role == KVConnectorRole.SCHEDULER:
            _log_start(self.config, self.layout)
            refused = _loads_refused(vllm_config)
            if refused:
                log.warning(refused)
            self.gauges = GaugeSampler(stores)  # the store as a whole: one side reports it
            self.scheduler = SchedulerSide(
                self.layout,
                stores,
                self.config.load_tokens_threshold,
                sync_loads=sync,
                wa_dump_block_wise=self.config.wa_dump_block_wise,
                weights_digest=self.config.weights_digest,
                loads=refused is None,
                events=StoredEvents(
                    self.layout,
                    getattr(kv_cache_config, "hash_block_size", None)
                    or vllm_config.cache_config.block_size,
                    medium_of(self.config.store),
                )
                if self.events_on
                else None,
                on_reset=self.config.on_reset,
                aligned_to=_hits_aligned_to(vllm_config),
            )
        else:
            self.worker = WorkerSide(
                self.layout,
                stores,
                len(kv_cache_config.kv_cache_groups),
                sync_loads=sync,
                load_timeout_s=self.config.load_timeout_s,
                layer_wise=self.config.layer_wise_loads,
                staging_bytes=self.config.staging_mib << 20,
                report_blocks=self.events_on,
                zero_copy=self.config.zero_copy,
                digests_on_gpu=self.config.digests_on_gpu,
                piece_bytes=self.config.pipeline_chunk_mb << 20,
                pipeline_depth=self.config.pipeline_depth,
                cancel_grace_s=self.config.cancel_grace_s,
                remember_stored=self.config.on_reset == "remove",
            )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped dump is a later miss

    # -- scheduler side --

    def _sched(self) -> SchedulerSide:
        assert self.scheduler is not None, "called on the worker-side connector"
        return self.scheduler

    def _work(self) -> WorkerSide:
        assert self.worker is not None, "called on the scheduler-side connector"
        return self.worker

    def on_new_request(self, request: Any) -> None:
        self._sched().on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[Any, int]:
        out: dict[Any, int] = {}
        for tier, tokens in self._sched().hit_tiers(request, num_external_tokens).items():
            source = HIT_SOURCES.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[source] = out.get(source, 0) + tokens
        return out

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        # Every group: full-attention blocks, and the window groups' tails at the hit.
        return tuple(g.index for g in self.layout.groups)

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched().sent(connector_output.finished_sending or ())
        report = getattr(connector_output, "kv_connector_worker_meta", None)
        events = self._sched().events
        if events is not None and isinstance(report, StoredReport):
            events.blocks.report(report.reports)

    def take_events(self) -> Iterable[Any]:
        events = self.scheduler.events if self.scheduler is not None else None
        return events.blocks.take() if events is not None else ()

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def has_pending_block_frees(self) -> bool:
        # finished requests' blocks come back once their dumps end: wait, do not preempt
        return self._sched().frees_pending()

    def has_pending_push_work(self) -> bool:
        # keep stepping while idle until the workers report those dumps done
        return self._sched().steps_needed()

    def reset_cache(self) -> bool:
        # vLLM's reset_prefix_cache(reset_connector=True): weights updated in place, sleep,
        # pause_scheduler(clear_cache=True), POST /reset_prefix_cache?reset_external=true
        return self._sched().reset()

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    # -- worker side --

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._work().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._work().start_load_kv(self._get_connector_metadata())  # type: ignore[arg-type]

    def wait_for_layer_load(self, layer_name: str) -> None:
        # sync loads read in place a layer at a time; the others complete in start_load_kv
        # (sync) or before vLLM schedules their requests (async)
        self._work().wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # every layer is gathered at once in wait_for_save

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            self._work().wait_for_save(self._get_connector_metadata())  # type: ignore[arg-type]

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._work().get_transfer_results(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving | failed, failed_recving=failed
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def build_connector_worker_meta(self) -> StoredReport | None:
        # what this rank stored or dropped this step, for the scheduler's KV events
        return StoredReport(self._work().take_reports()) if self.events_on else None

    @classmethod
    def supports_sleep_mode(cls, *args: Any, **kwargs: Any) -> bool:
        # vLLM 0.33: sleep resets the prefix cache with ours (on_reset), and the caches are
        # released only once no load may scatter into them (unregister_kv_caches)
        return True

    def unregister_kv_caches(self) -> None:
        if self.worker is not None:
            self.worker.release_caches()

    def restore_kv_caches(self) -> None:
        return  # the same tensors come back (vLLM keeps their addresses across sleep)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().take_load_errors()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._work().handle_preemptions(kv_connector_metadata)  # type: ignore[arg-type]

    def shutdown(self) -> None:
        if self.gauges is not None:
            self.gauges.close()
        if self.worker is not None:
            self.worker.shutdown()
        elif self.scheduler is not None and self.scheduler.stores is not None:
            self.scheduler.stores.close()

    # -- statistics --

    def get_kv_connector_stats(self) -> UCMStats | None:
        side = self.scheduler or self.worker
        data = {
            **((side.stats.take() if side is not None else None) or {}),
            **((self.gauges.take() if self.gauges is not None else None) or {}),
        }
        return UCMStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> UCMStats | None:
        return UCMStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> UCMPromMetrics:
        return UCMPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _log_through_vllm() -> None:
    """Send UCM's log records through vLLM's handlers, in its format: vLLM configures only
    its own ``vllm`` logger, so the ``ucm`` loggers' INFO records (the start-up line, the
    store's capacity) would be dropped and their warnings printed bare.  Left alone where
    the application configured logging for ``ucm`` or for the root logger."""
    ours, theirs = logging.getLogger("ucm"), logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False


def _log_start(config: Any, layout: Any) -> None:
    """Once per engine (the scheduler's connector): that UCM is active, and with what."""
    import vllm

    log.info(
        "UCMConnector active: store %s; %d-token blocks; %d KV-cache group(s); "
        "tensor-parallel world %d; model identity %s",
        config.store.summary(),
        layout.block_tokens,
        len(layout.groups),
        layout.world_size,
        # engines that print other identities never share blocks: the first thing to
        # compare between two hosts that should
        hashlib.sha256(layout.fingerprint.encode()).hexdigest()[:16],
    )
    warning = version_warning(getattr(vllm, "__version__", "unknown"))
    if warning:
        log.warning(warning)


def _hits_aligned_to(vllm_config: Any) -> int:
    """vLLM's block size where it drops an external hit that does not end on a block
    boundary (with its routed-experts output, 0.33), else 1."""
    aux = getattr(vllm_config, "aux_output_config", None)
    if aux is not None and getattr(aux, "enable_return_routed_experts", False):
        return int(vllm_config.cache_config.block_size)
    return 1


def _loads_refused(vllm_config: Any) -> str | None:
    from vllm.platforms import current_platform

    return loads_refused(
        cpu=current_platform.is_cpu(),
        mla=bool(getattr(vllm_config.model_config, "use_mla", False)),
        prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
    )
