"""What the connector stores for a model: KV-cache groups, key scopes and block geometry.

Derived once from vLLM's ``KVCacheConfig`` and ``VllmConfig`` identically in the scheduler
and the worker processes, so both name the same keys.  A store block holds
``block_tokens`` tokens of one group on one shard: for every layer of the group, the
engine blocks that cover those tokens.
"""

from __future__ import annotations

import attrs
from ucm.core.keys import Namespace
from ucm.vllm.config import ConnectorConfig


@attrs.frozen
class GroupLayout:
    index: int  # position in kv_cache_config.kv_cache_groups
    layer_names: tuple[str, ...]
    engine_block_tokens: int
    kind: str  # "full" (every block of the prefix is needed) or "window"
    replicated: bool  # the same KV on every rank (MLA): rank 0 writes, all read
    descriptor: str  # what the bytes are: spec type, dtype, heads, head size, page bytes

    def blocks_per_store_block(self, block_tokens: int) -> int:
        return block_tokens // self.engine_block_tokens


@attrs.frozen
class ModelLayout:
    fingerprint: str
    block_tokens: int
    rank: int
    world_size: int
    groups: tuple[GroupLayout, ...]

    @property
    def stored_groups(self) -> tuple[GroupLayout, ...]:
        return tuple(g for g in self.groups if g.kind == "full")

    def chain_namespace(self, cache_salt: str | None) -> Namespace:
        """Seeds the token chain shared by every group and rank of one request."""
        return Namespace(
            model=self.fingerprint, layout="vllm-token-chain", cache_salt=cache_salt or ""
        )

    def scope(self, group: GroupLayout, rank: int) -> Namespace:
        """The key scope of one group on one rank (replicated groups: one scope for all)."""
        rank, world = (0, 1) if group.replicated else (rank, self.world_size)
        return Namespace(
            model=self.fingerprint,
            layout=f"vllm:{group.descriptor}:store{self.block_tokens}",
            rank=rank,
            world_size=world,
            group=str(group.index),
        )

    def writes(self, group: GroupLayout) -> bool:
        """Whether this rank dumps the group (one writer for replicated caches)."""
        return not group.replicated or self.rank == 0


def model_fingerprint(vllm_config: object, override: str | None) -> str:
    if override:
        return override
    mc = vllm_config.model_config  # type: ignore[attr-defined]
    cc = vllm_config.cache_config  # type: ignore[attr-defined]
    parts = [
        str(mc.model),
        str(getattr(mc, "revision", None) or ""),
        str(mc.dtype),
        str(getattr(mc, "quantization", None) or ""),
        str(getattr(cc, "cache_dtype", "")),
    ]
    return "|".join(parts)


def describe(
    vllm_config: object, kv_cache_config: object, config: ConnectorConfig, rank: int, world: int
) -> ModelLayout:
    """The layout of a model as vLLM configured it, checked against the connector settings."""
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MLAAttentionSpec,
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
        window = isinstance(spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec)) or (
            isinstance(spec, FullAttentionSpec)
            and (spec.sliding_window is not None or spec.attention_chunk_size is not None)
        )
        if config.block_tokens % spec.block_size:
            raise ValueError(
                f"kv_connector_extra_config.block_tokens: {config.block_tokens} is not a "
                f"multiple of the block size {spec.block_size} of KV-cache group {index}"
            )
        descriptor = (
            f"{type(spec).__name__}:{spec.dtype}:bs{spec.block_size}:h{spec.num_kv_heads}"
            f":d{spec.head_size}:page{spec.page_size_bytes}:L{len(group.layer_names)}"
        )
        groups.append(
            GroupLayout(
                index=index,
                layer_names=tuple(group.layer_names),
                engine_block_tokens=spec.block_size,
                kind="window" if window else "full",
                replicated=isinstance(spec, MLAAttentionSpec),
                descriptor=descriptor,
            )
        )
    return ModelLayout(
        fingerprint=model_fingerprint(vllm_config, config.model_fingerprint),
        block_tokens=config.block_tokens,
        rank=rank,
        world_size=world,
        groups=tuple(groups),
    )
