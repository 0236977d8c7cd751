"""The connector's settings: ``kv_connector_extra_config``, validated at start-up."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import attrs
from ucm.core import DIGEST_MODES, parse_cpus
from ucm.core.config import (
    DramStoreConfig,
    StoreSettings,
    cancel_grace_s_setting,
    digests_on_gpu_setting,
    pipeline_chunk_mb_setting,
    pipeline_depth_setting,
    store_setting,
    wa_capacity_fraction_setting,
    wa_dump_block_wise_setting,
    zero_copy_setting,
)
from ucm.core.settings import (
    ConfigError,
    boolean,
    from_dict,
    int_in_range,
    one_of,
    positive_number,
    setting,
    with_config_file,
)

log = logging.getLogger(__name__)


def _optional_str(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(attribute.name, f"must be a non-empty string or null, got {value!r}")


# what the configuration reference shows for this one
_optional_str.allowed = "non-empty, or `null`"  # type: ignore[attr-defined]


def _cpus_setting(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value in ("spare", "inherit"):
        return
    try:
        if not isinstance(value, str):
            raise ValueError("not a string")
        parse_cpus(value)
    except ValueError as exc:
        raise ConfigError(
            attribute.name,
            f"must be 'spare', 'inherit' or a CPU list like '12-15', got {value!r} ({exc})",
        ) from None


_cpus_setting.allowed = "`spare`, `inherit`, or a CPU list"  # type: ignore[attr-defined]


@attrs.frozen
class ConnectorConfig:
    """Settings of ``UCMConnector`` (``kv_connector_extra_config``)."""

    store: StoreSettings = store_setting()
    block_tokens: int = setting(
        "Tokens per stored block; a multiple of vLLM's block size in every KV-cache group. "
        "A hit ends at the last whole stored block, so in a growing conversation each "
        "request recomputes half a block on average: vLLM's block size hits the most "
        "(``nox -s bench_serve`` runs with it); larger blocks move more bytes per call.",
        default=256,
        validator=int_in_range(1, 1 << 20),
    )
    load_tokens_threshold: int = setting(
        "Fewest tokens a store hit must add to what vLLM holds to be loaded; smaller hits "
        "are recomputed.",
        default=0,
        validator=int_in_range(0, 1 << 30),
    )
    model_fingerprint: str | None = setting(
        "Names the model in every key, in place of what UCM derives from its content (the "
        "configuration, the weights' content, dtype, quantization, KV-cache dtype). Set it "
        "where the weights are not local files; change it whenever the weights change.",
        default=None,
        validator=_optional_str,
    )
    weights_digest: str = setting(
        "How the weights' content is named. ``sampled``: each file's size, safetensors "
        "header and 64 pieces of 64 KiB spread over it (a retrained or fine-tuned model "
        "always differs); ``full``: every byte. Hub snapshots are named by their blobs' "
        "SHA-256 either way, and digests are cached by path, size and times, so a model "
        "seen before is not read again.",
        default="sampled",
        validator=one_of(*DIGEST_MODES),
    )
    load_mode: str = setting(
        "When store hits are loaded. ``sync``: before the forward pass of the step that "
        "schedules the request (the shortest time to first token; the step waits for the "
        "read). ``async``: in the background, the request joins a later step (other "
        "requests run meanwhile). ``auto``: sync for models with one KV-cache group, async "
        "otherwise (vLLM takes per-block load errors only from single-group models).",
        default="auto",
        validator=one_of("auto", "sync", "async"),
    )
    load_timeout_s: float = setting(
        "Seconds a load may wait for the store (a sync load holds its step that long, an "
        "async one its request); blocks not read by then are recomputed.",
        default=10.0,
        validator=positive_number,
    )
    layer_wise_loads: bool = setting(
        "Sync loads straight into a CPU cache (from a ``dram`` store, or a ``tiered`` one "
        "whose memory holds the blocks) go a layer at a time: the forward pass starts while "
        "they are under way and waits for each layer's KV right before reading it (vLLM's "
        "``wait_for_layer_load``). Each block is checked once its last layer landed; one "
        "that fails makes vLLM discard what the step computed from it and recompute it. "
        "Used once vLLM was seen waiting for every layer; false: every load ends before "
        "the forward pass starts.",
        default=True,
        validator=boolean,
    )
    zero_copy: bool = zero_copy_setting()
    digests_on_gpu: bool = digests_on_gpu_setting()
    pipeline_chunk_mb: int = pipeline_chunk_mb_setting(16)
    pipeline_depth: int = pipeline_depth_setting(2)
    cancel_grace_s: float = cancel_grace_s_setting()
    staging_mib: int = setting(
        "Host memory (MiB) kept for moving blocks between the KV cache and the store, "
        "touched (and pinned, with a GPU) at start-up so that the first load does not pay "
        "for it; transfers larger than this allocate more for their duration.",
        default=128,
        validator=int_in_range(0, 1 << 20),
    )
    store_cpus: str = setting(
        "CPUs the store's threads run on in vLLM's CPU workers (copies, checksums, file and "
        "network I/O). vLLM on the CPU binds each worker's compute to cores and, with a KV "
        "connector, keeps one more core a rank free. ``spare``: the store's threads run on "
        "the cores of the worker's NUMA node that vLLM's automatic binding left free, so "
        "that a dump's copy overlaps the next forward pass instead of taking its core; "
        "where none is free, where ``VLLM_CPU_OMP_THREADS_BIND`` names cores (other "
        "engines may own the rest), and on a GPU, they stay where the worker's threads run. "
        "``inherit``: they always stay. A CPU list such as ``7`` or ``12-15,28``: there.",
        default="spare",
        validator=_cpus_setting,
    )
    wa_dump_block_wise: bool = wa_dump_block_wise_setting()
    wa_capacity_fraction: float = wa_capacity_fraction_setting()
    on_reset: str = setting(
        "What a reset of vLLM's prefix cache with the connector's does to UCM "
        "(``reset_prefix_cache(reset_connector=True)``: after weights are updated in "
        "place, on ``sleep``, ``pause_scheduler(clear_cache=True)``, ``POST "
        "/reset_prefix_cache?reset_external=true``). ``forget``: this engine never loads a "
        "block stored before the reset (its keys move to a new epoch); the blocks stay for "
        "the other engines sharing the store. ``remove``: forget, and each rank removes "
        "the blocks it stored since the engine started or last reset, at the next step "
        "(for a store no other engine reads). ``keep``: nothing changes (for weights that "
        "never change in place: a sleeping engine wakes to its stored blocks).",
        default="forget",
        validator=one_of("forget", "remove", "keep"),
    )
    recompute_on_load_error: bool = setting(
        "Make vLLM recompute blocks that fail to load (sets kv_load_failure_policy to "
        "'recompute'); false keeps vLLM's policy, which by default fails the request.",
        default=True,
        validator=boolean,
    )

    def __attrs_post_init__(self) -> None:
        if isinstance(self.store, DramStoreConfig) and self.store.scope == "process":
            # vLLM asks its scheduler process what is stored and moves blocks in its worker
            # processes: a store private to one process is empty in the other, never a hit.
            raise ConfigError(
                "store.scope",
                "'process' cannot hit under vLLM: its scheduler looks blocks up in one "
                "process and its workers store them in others; use scope 'host' (shared "
                "memory, the default)",
            )


#: names a YAML file of settings when ``kv_connector_extra_config`` holds none (as
#: FastDeploy's backend reads it): one file for every process and engine of a deployment
CONFIG_FILE_ENV = "UCM_CONFIG_FILE"


def connector_config(
    extra: Mapping[str, Any] | None, environ: Mapping[str, str] = os.environ
) -> ConnectorConfig:
    """Build from ``kv_connector_extra_config`` (with ``config_file`` resolved), or from
    the file ``UCM_CONFIG_FILE`` names when that holds no setting."""
    data = dict(extra or {})
    path = environ.get(CONFIG_FILE_ENV)
    if path is not None and not data:
        if not path.strip():
            raise ConfigError(CONFIG_FILE_ENV, "is set but empty; name a YAML file or unset it")
        data = {"config_file": path}
    elif path:
        log.warning(
            "UCMConnector: %s=%s is ignored: kv_connector_extra_config has settings of its "
            "own (name the file there as config_file to use both)",
            CONFIG_FILE_ENV,
            path,
        )
    return from_dict(ConnectorConfig, with_config_file(data), "kv_connector_extra_config")


def sync_loads(config: ConnectorConfig, num_groups: int) -> bool:
    """Whether hits load before the forward pass (see ``load_mode``)."""
    if config.load_mode == "sync" and num_groups > 1:
        # vLLM maps per-block load errors back to requests only with one KV-cache group.
        raise ConfigError(
            "kv_connector_extra_config.load_mode",
            f"'sync' needs a model with one KV-cache group, this one has {num_groups}; "
            "use 'auto' or 'async'",
        )
    return config.load_mode == "sync" or (config.load_mode == "auto" and num_groups == 1)
