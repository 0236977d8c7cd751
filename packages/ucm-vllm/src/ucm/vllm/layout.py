"""What the connector stores for a model: KV-cache groups, key scopes and block geometry.

Derived once from vLLM's ``KVCacheConfig`` and ``VllmConfig`` identically in the scheduler
and the worker processes, so both name the same keys.  A full-attention group stores one
block per ``block_tokens`` tokens (for every layer of the group, the engine blocks covering
them); a window group (sliding window, chunked local attention, compressor state) stores
only its tail at block boundaries (see :mod:`ucm.core.hybrid`).  Groups are told apart by
their spec type and window, never by model name or position.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import attrs
from ucm.core import (
    FULL,
    WINDOW,
    HybridLayout,
    KVGroup,
    Namespace,
    config_digest,
    key_rank,
    weights_digest,
)
from ucm.vllm.config import ConnectorConfig

log = logging.getLogger(__name__)


@attrs.frozen
class GroupLayout:
    index: int  # position in kv_cache_config.kv_cache_groups
    layer_names: tuple[str, ...]
    engine_block_tokens: int
    kind: str  # "full" (every block of the prefix is needed) or "window"
    replicated: bool  # the same KV on every rank (MLA): ranks split the writes, all read
    descriptor: str  # what the bytes are: spec type, dtype, heads, head size, page bytes
    window_tokens: int = 0  # window groups: tokens attention looks back
    compress_ratio: int = 1  # compressor state: tokens per entry (1: none)


@attrs.frozen
class ModelLayout:
    fingerprint: str
    block_tokens: int
    rank: int
    world_size: int
    groups: tuple[GroupLayout, ...]
    # the engine-neutral description the planners work on
    hybrid: HybridLayout = attrs.field(init=False, eq=False, repr=False)
    # (group index, rank) -> key scope digest, derived once: every lookup and transfer uses one
    _scopes: dict[tuple[int, int], bytes] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        kv_groups = tuple(
            KVGroup(
                kind=FULL if g.kind == "full" else WINDOW,
                block_tokens=g.engine_block_tokens,
                window_tokens=g.window_tokens if g.kind == "window" else 0,
                compress_ratio=g.compress_ratio,
                num_layers=len(g.layer_names),
            )
            for g in self.groups
        )
        object.__setattr__(self, "hybrid", HybridLayout(kv_groups, self.block_tokens))
        scopes = {
            (g.index, r): self._make_scope(g, r)
            for g in self.groups
            for r in range(self.world_size)
        }
        object.__setattr__(self, "_scopes", scopes)

    @property
    def has_windows(self) -> bool:
        return any(g.kind == "window" for g in self.groups)

    @property
    def stored_groups(self) -> tuple[GroupLayout, ...]:
        """Groups with something to store: full groups, window groups with a tail."""
        tails = self.hybrid.tail_groups
        return tuple(g for g in self.groups if g.kind == "full" or g.index in tails)

    def chain_namespace(
        self, cache_salt: str | None, adapter: str = "", epoch: str = ""
    ) -> Namespace:
        """Seeds the token chain shared by every group and rank of one request; ``adapter``
        names the request's LoRA adapter (:func:`adapter_identity`), if any; ``epoch``,
        the engine's epoch since its last reset of the prefix cache, if any."""
        model = f"{self.fingerprint}|adapter:{adapter}" if adapter else self.fingerprint
        if epoch:
            model = f"{model}|epoch:{epoch}"
        return Namespace(model=model, layout="vllm-token-chain", cache_salt=cache_salt or "")

    def scope(self, group: GroupLayout, rank: int) -> bytes:
        """The key scope (digest) of one group on one rank (replicated groups: one for all)."""
        return self._scopes[(group.index, rank)]

    def _make_scope(self, group: GroupLayout, rank: int) -> Namespace:
        rank, world = (0, 1) if group.replicated else (rank, self.world_size)
        what = "tail" if group.kind == "window" else "store"
        return Namespace(
            model=self.fingerprint,
            layout=f"vllm:{group.descriptor}:{what}{self.block_tokens}",
            rank=rank,
            world_size=world,
            group=str(group.index),
        )

    def writes(self, group: GroupLayout, key: int) -> bool:
        """Whether this rank dumps chain key ``key`` of ``group``: every rank its own shard;
        of a cache replicated on every rank, key ``i`` is written by rank ``i % world``
        (a window tail at boundary ``b`` has key ``b - 1``: it goes with that block)."""
        return not group.replicated or key_rank(key, self.world_size) == self.rank


def model_fingerprint(vllm_config: object, config: ConnectorConfig) -> str:
    """What names the model in every key: the configuration as vLLM applies it (overrides
    included), the weights' content (:mod:`ucm.core.model_identity`), dtype, quantization
    and KV-cache dtype; never the path it was loaded from.  ``model_fingerprint`` in the
    settings overrides it."""
    if config.model_fingerprint:
        return config.model_fingerprint
    mc = vllm_config.model_config  # type: ignore[attr-defined]
    cc = vllm_config.cache_config  # type: ignore[attr-defined]
    parts = [
        "config:" + config_digest(mc.hf_config.to_dict()),
        "weights:" + _weights_identity(vllm_config, config.weights_digest),
        f"dtype:{mc.dtype}",
        f"quantization:{getattr(mc, 'quantization', None) or ''}",
        f"kv-cache:{getattr(cc, 'cache_dtype', '')}",
    ]
    return "|".join(parts)


def adapter_identity(lora_request: object, mode: str) -> str:
    """What names a LoRA adapter in keys: its name, and the content of its weights and of
    its ``adapter_config.json`` (by path where there are no local files)."""
    name = str(getattr(lora_request, "lora_name", ""))
    path = str(getattr(lora_request, "lora_path", "") or "")
    local = _local_model_path(path, None) if path else None
    digest = weights_digest(local, mode) if local is not None else None
    if digest is None:
        log.warning(
            "UCMConnector: no weight files found for LoRA adapter %s (%s): its blocks are "
            "named by its path",
            name,
            path,
        )
        return f"{name}|path:{path}"
    config = Path(str(local), "adapter_config.json")
    if config.is_file():
        digest += "|config:" + config_digest(json.loads(config.read_text()))
    return f"{name}|weights:{digest}"


def adapter_files(lora_request: object) -> tuple[tuple[str, int, int, int, int], ...]:
    """What changes when an adapter's files do: the name, size, inode, modification and
    change time of each file in its folder (one ``scandir``: cheap enough per request).
    Empty where the adapter has no local folder."""
    path = str(getattr(lora_request, "lora_path", "") or "")
    if not path or not os.path.isdir(path):
        return ()
    try:
        entries = sorted(os.scandir(path), key=lambda e: e.name)
        found = []
        for entry in entries:
            st = entry.stat()
            found.append((entry.name, st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns))
    except OSError:
        return ()
    return tuple(found)


def _weights_identity(vllm_config: object, mode: str) -> str:
    mc = vllm_config.model_config  # type: ignore[attr-defined]
    load_format = str(getattr(vllm_config.load_config, "load_format", ""))  # type: ignore[attr-defined]
    if load_format.lower().endswith("dummy"):
        return f"dummy:seed={mc.seed}"  # random weights: the seed names them
    location = _local_model_path(str(mc.model), getattr(mc, "revision", None))
    digest = weights_digest(location, mode) if location is not None else None
    if digest is not None:
        return digest
    log.warning(
        "UCMConnector: no weight files found for %s: keys name the model by its path and "
        "revision (set kv_connector_extra_config.model_fingerprint to share a store across "
        "paths, and change it when the weights change)",
        mc.model,
    )
    return f"path:{mc.model}@{getattr(mc, 'revision', None) or ''}"


def _local_model_path(model: str, revision: str | None) -> str | None:
    """The local folder or file of ``model``: itself, or its snapshot in the hub cache."""
    if os.path.exists(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # noqa: BLE001 - not in the hub cache (or not a hub id): no local copy
        return None


def describe(
    vllm_config: object, kv_cache_config: object, config: ConnectorConfig, rank: int, world: int
) -> ModelLayout:
    """The layout of a model as vLLM configured it, checked against the connector settings."""
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        ChunkedLocalAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    groups = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):  # type: ignore[attr-defined]
        spec = group.kv_cache_spec
        if not isinstance(spec, AttentionSpec):
            raise ValueError(
                f"UCMConnector: KV-cache group {index} is {type(spec).__name__}; "
                "only attention caches can be stored"
            )
        window_tokens = _window_tokens(spec, SlidingWindowSpec, ChunkedLocalAttentionSpec)
        if config.block_tokens % spec.block_size:
            raise ValueError(
                f"kv_connector_extra_config.block_tokens: {config.block_tokens} is not a "
                f"multiple of the block size {spec.block_size} of KV-cache group {index}"
            )
        descriptor = (
            f"{type(spec).__name__}:{spec.dtype}:bs{spec.block_size}:h{spec.num_kv_heads}"
            f":d{spec.head_size}:page{spec.page_size_bytes}:L{len(group.layer_names)}"
        )
        ratio = _compress_ratio(spec, group.layer_names, vllm_config)
        groups.append(
            GroupLayout(
                index=index,
                layer_names=tuple(group.layer_names),
                engine_block_tokens=spec.block_size,
                kind="window" if window_tokens else "full",
                replicated=isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec)),
                descriptor=descriptor + (f":w{window_tokens}:r{ratio}" if window_tokens else ""),
                window_tokens=window_tokens,
                compress_ratio=ratio,
            )
        )
    return ModelLayout(
        fingerprint=model_fingerprint(vllm_config, config),
        block_tokens=config.block_tokens,
        rank=rank,
        world_size=world,
        groups=tuple(groups),
    )


def _window_tokens(spec: object, sliding: type, chunked: type) -> int:
    """Tokens a window group's attention looks back (0: full attention)."""
    if isinstance(spec, sliding):
        return int(spec.sliding_window)  # type: ignore[attr-defined]
    if isinstance(spec, chunked):
        return int(spec.attention_chunk_size)  # type: ignore[attr-defined]
    for name in ("sliding_window", "attention_chunk_size"):  # older FullAttentionSpec fields
        value = getattr(spec, name, None)
        if value:
            return int(value)
    return 0


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _compress_ratio(spec: object, layer_names: list[str], vllm_config: object) -> int:
    """Tokens per compressed entry of a group: the spec's, else the model config's
    ``compress_ratios`` (one per layer) for the group's layers, else 1.  Where the layers
    disagree the smallest ratio is taken: it keeps the longest tail."""
    own = getattr(spec, "compress_ratio", None)
    if own:
        return int(own)
    hf = getattr(getattr(vllm_config, "model_config", None), "hf_text_config", None)
    ratios = getattr(hf, "compress_ratios", None)
    if not ratios:
        return 1
    found = []
    for name in layer_names:
        match = _LAYER_INDEX.search(name)
        if match and int(match.group(1)) < len(ratios):
            found.append(int(ratios[int(match.group(1))]) or 1)
    return max(1, min(found)) if found else 1
