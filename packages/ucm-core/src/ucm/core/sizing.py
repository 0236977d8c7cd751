"""How much a model's KV takes in a store, worked out from its ``config.json`` alone.

A store block holds ``block_tokens`` tokens of every layer of one KV-cache group on one
tensor-parallel rank, after a header page (:data:`~ucm.core.block_format.HEADER_BYTES`).
What the engine keeps per token and layer follows from the configuration:

* attention with K and V (MHA, GQA, MQA): ``2 x kv_heads x head_dim`` values; tensor
  parallelism splits the KV heads across ranks, and where there are fewer heads than ranks
  each rank holds one (copies of a head on several ranks, each stored by its rank);
* MLA (DeepSeek-V2/V3, Kimi K2): one latent of ``kv_lora_rank + qk_rope_head_dim`` values,
  the same on every rank, so each block is stored once whatever the number of ranks;
* sliding-window layers (``layer_types``, ``sliding_window_pattern``): the engine keeps
  only the window, and UCM stores, at each block boundary, the window's tail in a store of
  its own (see the Hybrid models page of the docs).

The figures are those of the vLLM connector, which stores exactly the engine's cache
bytes (no fp8 scales, no padding).  Nothing here imports an engine or torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
from ucm.core.block_format import HEADER_BYTES
from ucm.core.config import HybridSettings
from ucm.core.settings import GIB
from ucm.core.store.split import split_gb

#: KV-cache dtypes (vLLM's ``--kv-cache-dtype`` spellings) -> bytes per value; ``auto``
#: takes the model's dtype.  ``float32`` is what ``--dtype float32`` gives with ``auto``.
KV_CACHE_DTYPES: dict[str, int | None] = {
    "auto": None,
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "fp8_ds_mla": 1,
}
#: ``torch_dtype`` spellings of config.json -> bytes per value
MODEL_DTYPES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}
#: the vLLM connector's default ``block_tokens`` (ucm-vllm's settings; repeated here, as
#: ucm-core imports no engine adapter)
DEFAULT_BLOCK_TOKENS = 256
#: ``wa_capacity_fraction``'s default: the window tails' share of a hybrid model's store
DEFAULT_WA_FRACTION = HybridSettings().wa_capacity_fraction
#: DeepSeek's fp8 MLA layout (``fp8_ds_mla``): 512 fp8 latent values, 4 float32 scales and
#: 64 bfloat16 rope values per token and layer
DS_MLA_BYTES = 512 + 4 * 4 + 64 * 2

#: model types whose configuration leaves the sliding-window pattern to transformers'
#: default (every pattern-th layer full attention)
_DEFAULT_PATTERNS = {"gemma2": 2, "gemma3_text": 6}
_FULL = "full_attention"
_WINDOW_TYPES = {"sliding_attention": "sliding_window", "chunked_attention": "attention_chunk_size"}


class SizingError(ValueError):
    """A configuration that does not say what sizing needs; the message names the field."""


@attrs.frozen
class KVShape:
    """What a model's configuration says of its KV cache, before dtype and ranks."""

    model: str
    attention: str  # "MHA", "GQA", "MQA" or "MLA"
    full_layers: int  # layers attending to every earlier token
    window_layers: int  # layers attending to the last ``window_tokens`` only
    window_tokens: int  # 0 without window layers
    kv_heads: int  # KV heads of the whole model (MLA: 1, its latent)
    attention_heads: int | None  # query heads (must split across ranks); MLA may omit it
    head_dim: int  # values per head of K (and of V); MLA: the latent and its rope part
    kv_parts: int  # 2: K and V; 1: MLA's single latent
    dtype: str | None  # the configuration's torch_dtype, if it has one
    mla_dims: tuple[int, int] | None = None  # (kv_lora_rank, qk_rope_head_dim)
    notes: tuple[str, ...] = ()


@attrs.frozen
class Holding:
    """What a capacity holds for one model (all ranks' blocks in one store)."""

    capacity_bytes: int
    full_capacity_bytes: int  # the share left to full-attention blocks (hybrid: 1 - f)
    blocks: int  # full-attention blocks stored, every rank's counted
    tokens: int  # prefix tokens those blocks cover
    window_capacity_bytes: int = 0
    tails: int = 0  # hybrid: window tails (one per boundary and rank) that fit


@attrs.frozen
class KVSize:
    """The bytes of a model's KV in a store, for one KV-cache dtype, tensor-parallel size
    and block size.  "Per rank" figures are one rank's shard; a store shared by the ranks
    of an engine holds ``writers`` blocks per ``block_tokens`` tokens."""

    shape: KVShape
    kv_cache_dtype: str  # what the values are stored as (``auto`` resolved)
    dtype_bytes: int
    tensor_parallel_size: int
    block_tokens: int
    kv_heads_per_rank: int
    bytes_per_token_layer: int  # one rank, one layer
    bytes_per_token: int  # one rank, every full-attention layer
    writers: int  # blocks stored per block_tokens tokens: one per rank, or one (MLA)
    window_bytes_per_token: int = 0  # one rank, every window layer
    notes: tuple[str, ...] = ()

    @property
    def block_payload_bytes(self) -> int:
        """One rank's full-attention block, without its header."""
        return self.block_tokens * self.bytes_per_token

    @property
    def block_bytes(self) -> int:
        """One stored full-attention block: header page and payload."""
        return HEADER_BYTES + self.block_payload_bytes

    @property
    def stored_bytes_per_token(self) -> float:
        """Store bytes per prefix token, every rank's block and header counted."""
        return self.writers * self.block_bytes / self.block_tokens

    @property
    def tail_tokens(self) -> int:
        """Tokens of a window tail (the engine rounds it up to whole engine blocks)."""
        return self.shape.window_tokens if self.window_bytes_per_token else 0

    @property
    def tail_bytes(self) -> int:
        """One rank's stored window tail (header included); 0 without window layers."""
        if not self.tail_tokens:
            return 0
        return HEADER_BYTES + self.tail_tokens * self.window_bytes_per_token

    def holds(
        self, capacity_bytes: int, wa_capacity_fraction: float = DEFAULT_WA_FRACTION
    ) -> Holding:
        """What ``capacity_bytes`` of store holds; a hybrid model's store is split as the
        engine adapters split it (``wa_capacity_fraction`` to the window tails)."""
        if capacity_bytes <= 0:
            raise SizingError(f"capacity must be positive, got {capacity_bytes} bytes")
        if not 0 < wa_capacity_fraction < 1:
            raise SizingError(
                f"wa_capacity_fraction must be between 0 and 1, got {wa_capacity_fraction}"
            )
        full_cap, window_cap = capacity_bytes, 0
        if self.tail_bytes:
            fa_gb, wa_gb = split_gb(capacity_bytes / GIB, wa_capacity_fraction)
            full_cap, window_cap = int(fa_gb * GIB), int(wa_gb * GIB)
        boundaries = full_cap // (self.writers * self.block_bytes)
        tails = window_cap // self.tail_bytes if self.tail_bytes else 0
        return Holding(
            capacity_bytes=capacity_bytes,
            full_capacity_bytes=full_cap,
            blocks=boundaries * self.writers,
            tokens=boundaries * self.block_tokens,
            window_capacity_bytes=window_cap,
            tails=tails,
        )

    def as_dict(self, holding: Holding | None = None) -> dict[str, Any]:
        """Every figure, for ``--json``."""
        shape = self.shape
        out: dict[str, Any] = {
            "model": shape.model,
            "attention": shape.attention,
            "layers": shape.full_layers + shape.window_layers,
            "full_attention_layers": shape.full_layers,
            "window_layers": shape.window_layers,
            "window_tokens": shape.window_tokens,
            "kv_heads": shape.kv_heads,
            "kv_heads_per_rank": self.kv_heads_per_rank,
            "head_dim": shape.head_dim,
            "kv_cache_dtype": self.kv_cache_dtype,
            "dtype_bytes": self.dtype_bytes,
            "tensor_parallel_size": self.tensor_parallel_size,
            "block_tokens": self.block_tokens,
            "bytes_per_token_layer": self.bytes_per_token_layer,
            "bytes_per_token": self.bytes_per_token,
            "bytes_per_token_all_ranks": self.writers * self.bytes_per_token,
            "block_payload_bytes": self.block_payload_bytes,
            "header_bytes": HEADER_BYTES,
            "block_bytes": self.block_bytes,
            "blocks_per_boundary": self.writers,
            "stored_bytes_per_token": self.stored_bytes_per_token,
            "tail_tokens": self.tail_tokens,
            "tail_bytes": self.tail_bytes,
            "notes": list(self.notes),
        }
        if holding is not None:
            out["capacity"] = attrs.asdict(holding)
        return out


def read_model_config(path: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a model folder (or the JSON file itself; a weight file
    stands for its folder)."""
    given = Path(path).expanduser()
    if given.is_dir():
        file = given / "config.json"
    elif given.is_file():
        file = given if given.suffix == ".json" else given.parent / "config.json"
    else:
        raise SizingError(f"{path}: no such file or folder")
    if not file.is_file():
        raise SizingError(f"no config.json in {file.parent}: sizing reads the model's config.json")
    try:
        config = json.loads(file.read_text())
    except ValueError as exc:
        raise SizingError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise SizingError(f"{file} holds a JSON {type(config).__name__}, not an object")
    return config


def kv_shape(config: Mapping[str, Any]) -> KVShape:
    """The KV cache a configuration describes; :class:`SizingError` names a missing field."""
    notes: list[str] = []
    cfg: Mapping[str, Any] = config
    text = config.get("text_config")
    if isinstance(text, Mapping) and "num_hidden_layers" not in config:
        # a multimodal model: the language model holds the KV (its fields win, the dtype may
        # be written at the top only)
        cfg = {**config, **text}
        notes.append("sized from text_config (the language model holds the KV)")
    model = _model_name(cfg)
    layers = _positive_int(cfg, "num_hidden_layers")
    dtype = cfg.get("torch_dtype", cfg.get("dtype"))
    if dtype is not None and not isinstance(dtype, str):
        raise SizingError(f"config.json: torch_dtype must be a string, got {dtype!r}")
    attention_heads = _optional_int(cfg, "num_attention_heads")
    nextn = _optional_int(cfg, "num_nextn_predict_layers")
    if nextn:
        notes.append(
            f"num_nextn_predict_layers {nextn} not counted: the MTP layers hold KV only "
            "with speculative decoding"
        )
    if cfg.get("kv_lora_rank") is not None:
        lora = _positive_int(cfg, "kv_lora_rank")
        rope = _positive_int(cfg, "qk_rope_head_dim", why="an MLA model (kv_lora_rank set)")
        return KVShape(
            model=model,
            attention="MLA",
            full_layers=layers,
            window_layers=0,
            window_tokens=0,
            kv_heads=1,
            attention_heads=attention_heads,
            head_dim=lora + rope,
            kv_parts=1,
            dtype=dtype,
            mla_dims=(lora, rope),
            notes=tuple(notes),
        )
    kv_heads = _optional_int(cfg, "num_key_value_heads")
    if kv_heads is None:
        if attention_heads is None:
            raise SizingError(
                "config.json has neither num_key_value_heads nor num_attention_heads: "
                "sizing needs the number of KV heads"
            )
        kv_heads = attention_heads
    head_dim = _optional_int(cfg, "head_dim")
    if head_dim is None:
        hidden = _optional_int(cfg, "hidden_size")
        if hidden is None or attention_heads is None:
            raise SizingError(
                "config.json has no head_dim, nor hidden_size and num_attention_heads to "
                "derive it from"
            )
        if hidden % attention_heads:
            raise SizingError(
                f"config.json has no head_dim, and hidden_size {hidden} is not a multiple "
                f"of num_attention_heads {attention_heads}"
            )
        head_dim = hidden // attention_heads
    if attention_heads is None or kv_heads == attention_heads:
        attention = "MHA"
    else:
        attention = "MQA" if kv_heads == 1 else "GQA"
    full, window, window_tokens = _layer_kinds(cfg, layers, notes)
    return KVShape(
        model=model,
        attention=attention,
        full_layers=full,
        window_layers=window,
        window_tokens=window_tokens,
        kv_heads=kv_heads,
        attention_heads=attention_heads,
        head_dim=head_dim,
        kv_parts=2,
        dtype=dtype,
        notes=tuple(notes),
    )


def kv_size(
    shape: KVShape,
    *,
    kv_cache_dtype: str = "auto",
    tensor_parallel_size: int = 1,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> KVSize:
    """The store bytes of ``shape`` for a KV-cache dtype, tensor-parallel size and block
    size, as vLLM lays the cache out and the vLLM connector stores it."""
    if tensor_parallel_size < 1:
        raise SizingError(f"tensor_parallel_size must be at least 1, got {tensor_parallel_size}")
    if block_tokens < 1:
        raise SizingError(f"block_tokens must be at least 1, got {block_tokens}")
    notes = list(shape.notes)
    name, dtype_bytes = _kv_dtype(shape, kv_cache_dtype, notes)
    tp = tensor_parallel_size
    heads = shape.attention_heads
    if heads is not None and heads % tp:
        raise SizingError(
            f"num_attention_heads {heads} cannot be split across {tp} ranks (vLLM needs the "
            "tensor-parallel size to divide it)"
        )
    if shape.attention == "MLA":
        per_rank, writers = 1, 1  # the same latent on every rank: block i stored by one
        values = shape.head_dim
        if name == "fp8_ds_mla":
            values = DS_MLA_BYTES  # bytes, in a uint8 cache
    else:
        kv = shape.kv_heads
        if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
            raise SizingError(
                f"num_key_value_heads {kv} cannot be split across {tp} ranks (vLLM needs "
                "one of the two to divide the other)"
            )
        per_rank, writers = max(1, kv // tp), tp
        if kv < tp:
            notes.append(
                f"{kv} KV heads on {tp} ranks: each rank holds a copy of one head and stores it"
            )
        values = shape.kv_parts * per_rank * shape.head_dim
    per_layer = values * dtype_bytes
    if shape.window_layers:
        notes.append(
            f"{shape.window_layers} window layers ({shape.window_tokens} tokens): at each "
            "block boundary their tail is stored apart (the engine rounds it up to whole "
            "engine blocks); their KV is not in bytes_per_token"
        )
    return KVSize(
        shape=shape,
        kv_cache_dtype=name,
        dtype_bytes=dtype_bytes,
        tensor_parallel_size=tp,
        block_tokens=block_tokens,
        kv_heads_per_rank=per_rank,
        bytes_per_token_layer=per_layer,
        bytes_per_token=per_layer * shape.full_layers,
        writers=writers,
        window_bytes_per_token=per_layer * shape.window_layers,
        notes=tuple(notes),
    )


def model_kv_size(
    path: str | Path,
    *,
    kv_cache_dtype: str = "auto",
    tensor_parallel_size: int = 1,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> KVSize:
    """:func:`kv_size` of the model whose folder (or config.json) is at ``path``."""
    return kv_size(
        kv_shape(read_model_config(path)),
        kv_cache_dtype=kv_cache_dtype,
        tensor_parallel_size=tensor_parallel_size,
        block_tokens=block_tokens,
    )


# --- reading the configuration ---------------------------------------------------------------


def _model_name(cfg: Mapping[str, Any]) -> str:
    architectures = cfg.get("architectures")
    if isinstance(architectures, list) and architectures and isinstance(architectures[0], str):
        return architectures[0]
    return str(cfg.get("model_type") or "unknown")


def _optional_int(cfg: Mapping[str, Any], name: str) -> int | None:
    value = cfg.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise SizingError(f"config.json: {name} must be a whole number, got {value!r}")
    return value


def _positive_int(cfg: Mapping[str, Any], name: str, why: str = "") -> int:
    value = _optional_int(cfg, name)
    if not value:
        need = f", which {why} needs" if why else ""
        got = "has no" if value is None else "has 0 for"
        raise SizingError(f"config.json {got} {name}{need}")
    return value


def _layer_kinds(cfg: Mapping[str, Any], layers: int, notes: list[str]) -> tuple[int, int, int]:
    """(full-attention layers, window layers, window tokens)."""
    types = cfg.get("layer_types")
    pattern = _optional_int(cfg, "sliding_window_pattern")
    model_type = cfg.get("model_type")
    if types is None and not pattern and cfg.get("sliding_window"):
        # configurations that leave the pattern to the class's default
        pattern = _DEFAULT_PATTERNS.get(str(model_type), 0)
        if pattern:
            notes.append(
                f"sliding_window_pattern {pattern}: transformers' default for {model_type}"
            )
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise SizingError(
                f"config.json: layer_types must list the {layers} layers' types, got {types!r}"
            )
    elif pattern:
        # transformers' rule (Gemma 2 and 3): every pattern-th layer is full attention,
        # the others slide
        types = [_FULL if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    else:
        # Qwen2's configs name a window that use_sliding_window turns off
        off = cfg.get("use_sliding_window") is False
        for field in ("sliding_window", "attention_chunk_size"):
            if cfg.get(field) and not (off and field == "sliding_window"):
                notes.append(
                    f"{field} {cfg[field]} without layer_types: every layer counted as full "
                    "attention (where the engine gives layers a window, UCM stores only "
                    "their tails: see Hybrid models)"
                )
        return layers, 0, 0
    kinds = set(map(str, types))
    unknown = kinds - {_FULL, *_WINDOW_TYPES}
    if unknown:
        raise SizingError(
            f"config.json: layer_types holds {', '.join(sorted(unknown))}: UCM "
            f"stores attention KV only ({_FULL}, {', '.join(_WINDOW_TYPES)})"
        )
    window_kinds = kinds & set(_WINDOW_TYPES)
    if len(window_kinds) > 1:
        raise SizingError("config.json: layer_types mixes sliding and chunked attention")
    if not window_kinds:
        return layers, 0, 0
    (kind,) = window_kinds
    field = _WINDOW_TYPES[kind]
    window = _positive_int(cfg, field, why=f"a model with {kind} layers")
    full = sum(1 for t in types if t == _FULL)
    return full, layers - full, window


def _kv_dtype(shape: KVShape, kv_cache_dtype: str, notes: list[str]) -> tuple[str, int]:
    """(the dtype the KV is stored as, its bytes per value)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise SizingError(
            f"KV-cache dtype {kv_cache_dtype!r} is not sized here; one of "
            f"{', '.join(KV_CACHE_DTYPES)}"
        )
    if kv_cache_dtype == "fp8_ds_mla" and shape.mla_dims != (512, 64):
        raise SizingError(
            "fp8_ds_mla is DeepSeek's MLA layout for kv_lora_rank 512 and qk_rope_head_dim 64"
        )
    fixed = KV_CACHE_DTYPES[kv_cache_dtype]
    if fixed is not None:
        return kv_cache_dtype, fixed
    if shape.dtype is None:
        raise SizingError(
            "config.json has no torch_dtype (nor dtype): give the KV-cache dtype "
            "(bfloat16, float16, fp8, ...)"
        )
    size = MODEL_DTYPES.get(shape.dtype)
    if size is None:
        raise SizingError(
            f"config.json: torch_dtype {shape.dtype!r} is not one of "
            f"{', '.join(MODEL_DTYPES)}: give the KV-cache dtype"
        )
    if size == 4:
        notes.append(
            "a float32 checkpoint: vLLM serves it in 16 bits (bfloat16 or float16) unless "
            "--dtype float32 (then give --kv-cache-dtype float32)"
        )
        return "bfloat16", 2
    return {"half": "float16"}.get(shape.dtype, shape.dtype), size


__all__ = [
    "DEFAULT_BLOCK_TOKENS",
    "KV_CACHE_DTYPES",
    "Holding",
    "KVShape",
    "KVSize",
    "SizingError",
    "kv_shape",
    "kv_size",
    "model_kv_size",
    "read_model_config",
]
