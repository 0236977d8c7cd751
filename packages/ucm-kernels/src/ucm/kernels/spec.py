"""What a store block holds: the cache description and the canonical payload layout.

The canonical payload of one store block does not depend on the engine's paged layout:

* the store block covers ``k`` consecutive engine blocks of ``N`` tokens, ``T = k * N``
  tokens, of which the token range ``[t0, t1)`` is copied (the whole ``[0, T)`` by default);
* for each cache tensor, in the order the caller lists them, the range is laid out as a
  contiguous ``[H, t1 - t0, C]`` array (heads outer, then tokens, then channels; ``C`` is
  ``parts * head_dim``, e.g. K then V for a vLLM view), and the arrays are concatenated;
* when scale tensors are given (fp8 caches), their bytes follow the data: for each cache
  tensor in order, for each engine block that the range touches in list order, the block's
  scale entry ``scale[b]`` in C order, in the scale tensor's native dtype; a null block
  contributes zero bytes of the same size.

The engine block size ``N`` changes nothing in the data part (a block written with 16-token
engine blocks reads back into 32-token ones); it only decides how many scale entries follow.
"""

from __future__ import annotations

import math

import attrs
import torch

#: cache dtypes the kernels move (bit for bit: they never interpret the values)
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ONE_BYTE_DTYPES = tuple(
    d
    for d in (
        torch.uint8,
        torch.int8,
        getattr(torch, "float8_e4m3fn", None),
        getattr(torch, "float8_e5m2", None),
        getattr(torch, "float8_e4m3fnuz", None),
        getattr(torch, "float8_e5m2fnuz", None),
    )
    if d is not None
)
SUPPORTED_DTYPES = FLOAT_DTYPES + ONE_BYTE_DTYPES

#: format tag of :meth:`PayloadLayout.descriptor`; bump when the canonical layout changes
LAYOUT_VERSION = 1


def _positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{attribute.name} must be a positive integer, got {value!r}")


@attrs.frozen
class CacheSpec:
    """The cache tensors of one transfer, normalised to ``[B, H, N, P, D]`` each.

    ``num_caches`` tensors of identical logical shape and dtype (their strides may differ).
    ``scale_shape`` is the shape of one engine block's scale entry (``scale[b].shape``),
    ``None`` when the caches carry no scales.
    """

    num_caches: int = attrs.field(validator=_positive)
    num_blocks: int = attrs.field(validator=_positive)
    num_heads: int = attrs.field(validator=_positive)
    block_size: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    dtype: torch.dtype = attrs.field()
    parts: int = attrs.field(default=1, validator=_positive)
    scale_shape: tuple[int, ...] | None = attrs.field(
        default=None, converter=lambda s: None if s is None else tuple(int(x) for x in s)
    )
    scale_dtype: torch.dtype | None = None

    @dtype.validator
    def _check_dtype(self, attribute: attrs.Attribute, value: torch.dtype) -> None:
        if value not in SUPPORTED_DTYPES:
            raise TypeError(f"dtype must be one of {_names(SUPPORTED_DTYPES)}, got {value}")

    def __attrs_post_init__(self) -> None:
        if (self.scale_shape is None) != (self.scale_dtype is None):
            raise ValueError("scale_shape and scale_dtype go together (both or neither)")

    @property
    def channels(self) -> int:
        """``C``: channels per head and token (K and V concatenated for a vLLM view)."""
        return self.parts * self.head_dim

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def scale_entry_nbytes(self) -> int:
        """Bytes of one engine block's scale entry (0 without scales)."""
        if self.scale_shape is None or self.scale_dtype is None:
            return 0
        return math.prod(self.scale_shape) * self.scale_dtype.itemsize


@attrs.frozen
class PayloadLayout:
    """Where each byte of one store block's payload comes from.

    Offsets are counted from the start of the payload: data offsets in elements of the
    cache dtype, scale offsets in bytes.
    """

    cache: CacheSpec
    blocks_per_store_block: int = attrs.field(validator=_positive)
    token_start: int = attrs.field(default=0)
    token_end: int | None = attrs.field(default=None)

    def __attrs_post_init__(self) -> None:
        total = self.tokens_per_store_block
        end = total if self.token_end is None else self.token_end
        for name, value in (("token_range start", self.token_start), ("token_range end", end)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if not 0 <= self.token_start < end <= total:
            raise ValueError(
                f"token_range ({self.token_start}, {end}) must satisfy 0 <= start < end <= "
                f"{total} (= {self.blocks_per_store_block} blocks x {self.cache.block_size} tokens)"
            )
        object.__setattr__(self, "token_end", end)

    # --- token range ---------------------------------------------------------------------
    @property
    def tokens_per_store_block(self) -> int:
        """``T = k * N``."""
        return self.blocks_per_store_block * self.cache.block_size

    @property
    def num_tokens(self) -> int:
        """``t1 - t0``: tokens copied per store block."""
        return int(self.token_end) - self.token_start  # type: ignore[arg-type]

    @property
    def first_block(self) -> int:
        """Index (within a store block's list) of the first engine block the range touches."""
        return self.token_start // self.cache.block_size

    @property
    def end_block(self) -> int:
        """One past the last engine block the range touches."""
        return -(-int(self.token_end) // self.cache.block_size)  # type: ignore[arg-type]

    @property
    def num_involved_blocks(self) -> int:
        return self.end_block - self.first_block

    # --- sizes and offsets -----------------------------------------------------------------
    @property
    def tensor_numel(self) -> int:
        """Elements of one cache tensor's ``[H, t1 - t0, C]`` part."""
        return self.cache.num_heads * self.num_tokens * self.cache.channels

    @property
    def data_numel(self) -> int:
        return self.cache.num_caches * self.tensor_numel

    @property
    def data_nbytes(self) -> int:
        return self.data_numel * self.cache.itemsize

    @property
    def scale_nbytes(self) -> int:
        return self.cache.num_caches * self.num_involved_blocks * self.cache.scale_entry_nbytes

    @property
    def nbytes(self) -> int:
        """Bytes of one store block's payload: what a buffer must hold."""
        return self.data_nbytes + self.scale_nbytes

    def tensor_offset(self, index: int) -> int:
        """Element offset of cache tensor ``index``'s part."""
        return index * self.tensor_numel

    def scale_offset(self, index: int, block: int) -> int:
        """Byte offset of the scale entry of cache tensor ``index`` for the ``block``-th
        involved engine block (0 = the block holding ``token_start``)."""
        per_tensor = self.num_involved_blocks * self.cache.scale_entry_nbytes
        return self.data_nbytes + index * per_tensor + block * self.cache.scale_entry_nbytes

    def descriptor(self) -> bytes:
        """A layout descriptor for the block-format header: equal descriptors mean the
        payload bytes are interchangeable.  Engine-specific facts (physical strides, the
        number of engine blocks, ``N`` itself) are left out on purpose."""
        c = self.cache
        parts = [
            f"ucm-kv/{LAYOUT_VERSION}",
            f"dtype={_dtype_name(c.dtype)}",
            f"caches={c.num_caches}",
            f"heads={c.num_heads}",
            f"channels={c.channels}",
            f"tokens={self.tokens_per_store_block}",
            f"range={self.token_start}:{self.token_end}",
        ]
        if c.scale_shape is not None and c.scale_dtype is not None:
            shape = "x".join(str(s) for s in c.scale_shape) or "1"
            parts.append(f"scales={_dtype_name(c.scale_dtype)}[{shape}]*{self.num_involved_blocks}")
        return ";".join(parts).encode()


def make_layout(
    cache: CacheSpec, blocks_per_store_block: int, token_range: tuple[int, int] | None = None
) -> PayloadLayout:
    """The payload layout of store blocks of ``blocks_per_store_block`` engine blocks,
    optionally restricted to ``token_range = (t0, t1)``."""
    if token_range is None:
        return PayloadLayout(cache, blocks_per_store_block)
    t0, t1 = _pair(token_range)
    return PayloadLayout(cache, blocks_per_store_block, t0, t1)


def _pair(token_range: object) -> tuple[int, int]:
    try:
        t0, t1 = token_range  # type: ignore[misc]
    except (TypeError, ValueError):
        raise TypeError(f"token_range must be a pair (start, end), got {token_range!r}") from None
    return t0, t1


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(_dtype_name(d) for d in dtypes)
