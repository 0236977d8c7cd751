"""``AttentionStore``: FastDeploy's AttentionStore backend contract over a UCM store.

FastDeploy's cache transfer manager (one process per tensor-parallel rank) drives it:

* write-through when a request finishes: ``m = query(task, tokens, 0)`` then
  ``write(task, K, V, tokens, gpu_block_ids[m:], start_write_block_idx=m)``;
* prefetch on a prefix miss of at least one block: ``m = query(task, tokens, start)`` then
  ``read(task, K, V, tokens, new_block_ids[:m], start_read_block_idx=start)``;
* ``flush_token_index`` (rank 0) after each, to report what is resident in GPU memory.

``gpu_block_ids[j]`` holds block ``start + j`` of ``token_ids``; only full blocks are stored
(a trailing partial block has no key, and its id, if listed, is left alone).  Each block is
one store object holding every layer's K and V of this shard (and the fp8 scales), in the
kernels' canonical payload layout, under a key chained over the token prefix up to the end
of the block (see :mod:`ucm.fastdeploy.keys`).

Bad arguments raise (``TypeError``/``ValueError`` naming the argument) before any byte moves;
a failing or slow store never raises: the call returns fewer blocks and logs a warning.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import attrs
from ucm.core import Store, create_store, model_digest, write_sliced
from ucm.core.settings import ConfigError, int_at_least, non_empty_str
from ucm.fastdeploy.config import FastDeployConfig, load_config
from ucm.fastdeploy.keys import KeySpace
from ucm.fastdeploy.residency import ResidencyIndex
from ucm.fastdeploy.tensors import (
    CacheSet,
    check_block_ids,
    check_caches,
    check_index,
    check_timeout,
    check_tokens,
)
from ucm.kernels.mover import Ahead, Batch, Mover, MoverSettings, RowPool, read_run, write_run

log = logging.getLogger(__name__)

#: the process's rows (a FastDeploy cache transfer process has one AttentionStore, tests and
#: benchmarks make many: they all reuse these), as much kept as 16 steps of the default
#: 32 MiB
SHARED_POOL = RowPool(512 << 20)

#: keys of one lookup call in ``query``: the timeout is checked between calls
_QUERY_BATCH = 256


@attrs.frozen
class AttentionStoreConfig:
    """FastDeploy's constructor fields (after its AS_* environment overrides)."""

    namespace: str = attrs.field(validator=non_empty_str)
    pod_name: str = attrs.field(validator=non_empty_str)
    model_version: str = attrs.field(validator=non_empty_str)
    shard_id: int = attrs.field(validator=int_at_least(0))
    shard_num: int = attrs.field(validator=int_at_least(1))
    layer_num: int = attrs.field(validator=int_at_least(1))
    block_token_size: int = attrs.field(validator=int_at_least(1))
    bytes_per_shard_layer_per_block: int = attrs.field(validator=int_at_least(1))
    device_id: int = attrs.field(validator=int_at_least(0))
    dp_id: int = attrs.field(validator=int_at_least(0))
    splitwise_role: str = attrs.field(validator=non_empty_str)

    def __attrs_post_init__(self) -> None:
        if self.shard_id >= self.shard_num:
            raise ConfigError(
                "shard_id",
                f"must be in [0, shard_num), got shard_id={self.shard_id} "
                f"shard_num={self.shard_num}",
            )


def _fastdeploy_env(fields: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """FastDeploy's own overrides, as its AttentionStore applies them."""
    fields = dict(fields)
    for name, var in (
        ("namespace", "AS_NAMESPACE"),
        ("pod_name", "AS_POD_NAME"),
        ("model_version", "AS_MODEL_VERSION"),
    ):
        if var in environ:
            fields[name] = environ[var]
    raw = environ.get("ENABLE_EP_DP_IN_FD", "1")
    try:
        ep_dp = int(raw)
    except ValueError:
        raise ConfigError("ENABLE_EP_DP_IN_FD", f"must be 0 or 1, got {raw!r}") from None
    if ep_dp and isinstance(fields.get("pod_name"), str):
        fields["pod_name"] = f"{fields['pod_name']}_{fields['splitwise_role']}_{fields['dp_id']}"
    return fields


#: FastDeploy's default model_version: it names no model
DEFAULT_MODEL_VERSION = "v0"


def _model_digest(settings: FastDeployConfig, model_version: str) -> str:
    """What names the model's content in keys ("" where model_version alone names it)."""
    if settings.model_path is not None:
        try:
            return model_digest(settings.model_path, settings.weights_digest)
        except (OSError, ValueError) as exc:
            raise ConfigError("ucm_config.model_path", str(exc)) from None
    if model_version == DEFAULT_MODEL_VERSION:
        raise ConfigError(
            "model_version",
            f"is FastDeploy's default {DEFAULT_MODEL_VERSION!r}, which names no model: two "
            "models with the same cache shape would exchange KV blocks. Set ucm_config "
            "model_path to the model's folder (its config and weights then name it), or "
            "AS_MODEL_VERSION to a name of these exact weights",
        )
    return ""


class AttentionStore:
    """FastDeploy's AttentionStore contract backed by a UCM store (see the module docstring).

    ``ucm_config`` is a dict of settings or the path of a YAML file (default: the file named
    by ``UCM_CONFIG_FILE``, else the embedded posix store); ``store`` replaces the store it
    describes (the caller keeps ownership).  FastDeploy drives an AttentionStore only through
    ``query``, ``write``, ``read`` and ``flush_token_index``; the key/value methods of its
    KVCacheStorage contract are :class:`~ucm.fastdeploy.UCMStorage`'s.
    """

    def __init__(
        self,
        namespace: str = "default_ns",
        pod_name: str = "default_pod",
        model_version: str = "v0",
        shard_id: int = 0,
        shard_num: int = 1,
        layer_num: int = 1,
        block_token_size: int = 64,
        bytes_per_shard_layer_per_block: int = 1024,
        device_id: int = 0,
        dp_id: int = 0,
        splitwise_role: str = "mixed",
        ucm_config: Mapping[str, Any] | str | os.PathLike[str] | FastDeployConfig | None = None,
        *,
        store: Store | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        environ = os.environ if environ is None else environ
        fields = _fastdeploy_env(
            {
                "namespace": namespace,
                "pod_name": pod_name,
                "model_version": model_version,
                "shard_id": shard_id,
                "shard_num": shard_num,
                "layer_num": layer_num,
                "block_token_size": block_token_size,
                "bytes_per_shard_layer_per_block": bytes_per_shard_layer_per_block,
                "device_id": device_id,
                "dp_id": dp_id,
                "splitwise_role": splitwise_role,
            },
            environ,
        )
        self.config = AttentionStoreConfig(**fields)
        self.settings = load_config(ucm_config, environ)
        self.policy = self.settings.slice_write
        c = self.config
        self.keyspace = KeySpace(
            c.namespace,
            c.model_version,
            c.shard_id,
            c.shard_num,
            c.layer_num,
            c.block_token_size,
            c.bytes_per_shard_layer_per_block,
            _model_digest(self.settings, c.model_version),
        )
        self._owns_store = store is None
        self.store = create_store(self.settings.store) if store is None else store
        try:  # a store that could never hold a block (K and V of every layer) is refused now
            self.store.check_block_bytes(2 * c.layer_num * c.bytes_per_shard_layer_per_block)
        except ConfigError:
            if self._owns_store:
                self.store.close()
            raise
        self.residency = ResidencyIndex(self.settings.residency_index_blocks)
        self._mover = Mover(
            MoverSettings(
                zero_copy=self.settings.zero_copy,
                device_digests=None if self.settings.digests_on_gpu else False,
                step_bytes=self.settings.pipeline_chunk_mb << 20,
                depth=self.settings.pipeline_depth,
                grace_s=self.settings.cancel_grace_s,
            ),
            SHARED_POOL,
        )
        log.info(
            "ucm fastdeploy AttentionStore: namespace=%s model_version=%s shard=%d/%d "
            "layers=%d block_tokens=%d store=%s slice_blocks=%d slice_timeout_s=%g "
            "total_timeout_s=%s",
            c.namespace,
            c.model_version,
            c.shard_id,
            c.shard_num,
            c.layer_num,
            c.block_token_size,
            self.settings.store.kind,
            self.policy.slice_blocks,
            self.policy.slice_timeout_s,
            "call" if self.policy.total_timeout_s is None else f"{self.policy.total_timeout_s:g}",
        )

    # -- FastDeploy's methods -------------------------------------------------------------

    def query(
        self,
        task_id: str,
        token_ids: Any,
        start_match_block_idx: int,
        timeout: float = 10.0,
    ) -> int:
        """How many blocks from ``start_match_block_idx`` on can be read."""
        tokens = check_tokens(token_ids)
        start = check_index(start_match_block_idx, "start_match_block_idx")
        deadline = time.monotonic() + check_timeout(timeout)
        full = len(tokens) // self.config.block_token_size
        if start >= full:
            return 0
        keys = self.keyspace.keys(tokens, start, full)
        matched = 0
        try:
            for i in range(0, len(keys), _QUERY_BATCH):
                batch = keys[i : i + _QUERY_BATCH]
                found = self.store.lookup_prefix(batch)
                matched += found
                if found < len(batch):
                    break
                if time.monotonic() > deadline and i + _QUERY_BATCH < len(keys):
                    log.warning(
                        "ucm fastdeploy query task_id=%s: timed out after %g s with %d of %d "
                        "blocks checked",
                        task_id,
                        timeout,
                        matched,
                        len(keys),
                    )
                    break
        except Exception as exc:  # noqa: BLE001 - a failing store is a miss
            log.warning("ucm fastdeploy query task_id=%s: lookup failed: %s", task_id, exc)
        log.debug(
            "ucm fastdeploy query task_id=%s: start=%d matched=%d/%d",
            task_id,
            start,
            matched,
            len(keys),
        )
        return matched

    def write(
        self,
        task_id: str,
        key_cache: Any,
        val_cache: Any,
        token_ids: Any,
        gpu_block_ids: Any,
        start_write_block_idx: int,
        timeout: float = 30.0,
        *,
        key_scales: Any = None,
        val_scales: Any = None,
    ) -> int:
        """Store blocks ``start_write_block_idx + j`` from ``gpu_block_ids[j]``, in slices;
        return how many leading blocks are stored (the stored prefix never has holes)."""
        cs, ids, tokens, start, timeout = self._prepare(
            key_cache, val_cache, token_ids, gpu_block_ids, start_write_block_idx, timeout,
            key_scales, val_scales, unique=False,
        )  # fmt: skip
        n = self._blocks(tokens, start, ids, task_id, "write")
        if n == 0:
            return 0
        keys = self.keyspace.keys(tokens, start, start + n)
        label = f"task_id={task_id}"
        log.debug(
            "ucm fastdeploy write %s: blocks=[%d, %d) payload_bytes=%d timeout=%g",
            label,
            start,
            start + n,
            cs.nbytes,
            timeout,
        )

        ahead = Ahead(self._mover.pool)  # the next slice's first steps, gathered early
        caches, tag = cs.for_mover(), cs.tag()

        def write_slice(s: int, e: int, budget: float) -> int:
            deadline = time.monotonic() + budget
            following = min(e + self.policy.slice_blocks, start + n)
            batch = Batch(
                caches, ids[s - start : e - start], keys[s - start : e - start], self.store,
                tag, cs.nbytes,
            )  # fmt: skip
            following_ids = ids[e - start : following - start]
            following_keys = keys[e - start : following - start]
            return write_run(
                self._mover, batch, deadline, f"fastdeploy {label}", ahead, following_ids,
                following_keys,
            )  # fmt: skip

        try:
            report = write_sliced(
                self.policy, start, start + n, write_slice, call_timeout_s=timeout, label=label
            )
        finally:
            ahead.release()
        return report.written

    def read(
        self,
        task_id: str,
        key_cache: Any,
        val_cache: Any,
        token_ids: Any,
        gpu_block_ids: Any,
        start_read_block_idx: int,
        timeout: float = 30.0,
        *,
        key_scales: Any = None,
        val_scales: Any = None,
    ) -> int:
        """Fill ``gpu_block_ids[j]`` with block ``start_read_block_idx + j``; return how many
        leading blocks were filled (stopping at the first missing or unverified block)."""
        cs, ids, tokens, start, timeout = self._prepare(
            key_cache, val_cache, token_ids, gpu_block_ids, start_read_block_idx, timeout,
            key_scales, val_scales, unique=True,
        )  # fmt: skip
        n = self._blocks(tokens, start, ids, task_id, "read")
        if n == 0:
            return 0
        began = time.monotonic()
        keys = self.keyspace.keys(tokens, start, start + n)
        label = f"task_id={task_id}"
        batch = Batch(cs.for_mover(), ids[:n], keys, self.store, cs.tag(), cs.nbytes)
        filled = read_run(self._mover, batch, began + timeout, f"fastdeploy {label}")
        log.debug(
            "ucm fastdeploy read %s: blocks=[%d, %d) read=%d/%d seconds=%.3f",
            label,
            start,
            start + n,
            filled,
            n,
            time.monotonic() - began,
        )
        return filled

    def flush_token_index(
        self, task_id: str, token_ids: Any, start_block_idx: int, reside_in_gpu: bool
    ) -> None:
        """Record that blocks from ``start_block_idx`` on are (``True``) or are no longer
        (``False``) resident in this pod's GPU memory; see :meth:`resident_blocks`."""
        tokens = check_tokens(token_ids)
        start = check_index(start_block_idx, "start_block_idx")
        if not isinstance(reside_in_gpu, bool):
            raise TypeError(f"reside_in_gpu must be True or False, got {reside_in_gpu!r}")
        full = len(tokens) // self.config.block_token_size
        chain = self.keyspace.chain(tokens, full)[start:]
        self.residency.mark(chain, reside_in_gpu)
        log.debug(
            "ucm fastdeploy flush_token_index task_id=%s: blocks=[%d, %d) reside_in_gpu=%s pod=%s",
            task_id,
            start,
            max(start, full),
            reside_in_gpu,
            self.config.pod_name,
        )

    # -- what flush_token_index keeps -----------------------------------------------------

    def resident_blocks(self, token_ids: Any, start_block_idx: int = 0) -> int:
        """How many blocks from ``start_block_idx`` on this pod reported resident in GPU."""
        tokens = check_tokens(token_ids)
        start = check_index(start_block_idx, "start_block_idx")
        full = len(tokens) // self.config.block_token_size
        return self.residency.prefix(self.keyspace.chain(tokens, full)[start:])

    def residency_of(self, token_ids: Any, start_block_idx: int = 0) -> list[frozenset[str]]:
        """Per full block from ``start_block_idx`` on: where it is, a subset of
        ``{"gpu", "store"}`` (``gpu``: this pod reported it resident; ``store``: this
        shard's block is stored)."""
        tokens = check_tokens(token_ids)
        start = check_index(start_block_idx, "start_block_idx")
        full = len(tokens) // self.config.block_token_size
        if start >= full:
            return []
        in_gpu = self.residency.resident(self.keyspace.chain(tokens, full)[start:])
        try:
            stored = self.store.lookup(self.keyspace.keys(tokens, start, full))
        except Exception as exc:  # noqa: BLE001
            log.warning("ucm fastdeploy residency_of: lookup failed: %s", exc)
            stored = [False] * len(in_gpu)
        return [
            frozenset(p for p, there in (("gpu", g), ("store", s)) if there)
            for g, s in zip(in_gpu, stored)
        ]

    # -- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        """Unregister the store's memory from the GPU's driver, then close the store (when
        this object created it)."""
        self._mover.close()
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> AttentionStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers --------------------------------------------------------------------------

    def _prepare(
        self,
        key_cache: Any,
        val_cache: Any,
        token_ids: Any,
        gpu_block_ids: Any,
        start_idx: Any,
        timeout: Any,
        key_scales: Any,
        val_scales: Any,
        *,
        unique: bool,
    ) -> tuple[CacheSet, list[int], list[int], int, float]:
        """Every argument checked, in the order FastDeploy gives them, before any I/O."""
        what = "start_read_block_idx" if unique else "start_write_block_idx"
        tokens = check_tokens(token_ids)
        start = check_index(start_idx, what)
        seconds = check_timeout(timeout)
        c = self.config
        cs = check_caches(
            key_cache,
            val_cache,
            layer_num=c.layer_num,
            block_token_size=c.block_token_size,
            bytes_per_shard_layer_per_block=c.bytes_per_shard_layer_per_block,
            key_scales=key_scales,
            val_scales=val_scales,
        )
        ids = check_block_ids(gpu_block_ids, cs.num_blocks, unique=unique)
        # (token ids that are not uint32 fail when the keys are made, still before any I/O)
        return cs, ids, tokens, start, seconds

    def _blocks(self, tokens: list[int], start: int, ids: list[int], task_id: str, op: str) -> int:
        """Blocks to move: those listed that ``token_ids`` covers in full."""
        full = len(tokens) // self.config.block_token_size
        n = max(0, min(len(ids), full - start))
        if n < len(ids):
            log.debug(
                "ucm fastdeploy %s task_id=%s: %d block ids given, token_ids cover %d full "
                "blocks from %d; moving %d",
                op,
                task_id,
                len(ids),
                max(0, full - start),
                start,
                n,
            )
        return n
