"""FastDeploy's cache tensors as the kernels take them, checked before any byte moves.

FastDeploy hands one paddle tensor per layer for K and one for V, each
``[num_blocks, kv_heads, block_size, head_dim]`` (uint8 data plus per-block scales
``[num_blocks, kv_heads, block_size]`` for block-wise fp8).  The kernels take torch tensors:
a paddle tensor becomes one through DLPack, which shares its memory (no copy, CPU or GPU).
The payload order is ``k0, v0, k1, v1, ...``, with the scales in the same order after the
data (the kernels' canonical layout), so one store object holds every layer of a block.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import attrs
import torch
from ucm.kernels import PayloadLayout, payload_layout
from ucm.kernels.mover import Caches

#: the header's layout tag: what the payload bytes mean, on top of the kernels' descriptor
TAG_PREFIX = b"fastdeploy-as/1;order=k0v0k1v1|"


def to_torch(tensor: object, what: str) -> torch.Tensor:
    """A torch view of a paddle (or torch) tensor, sharing its memory."""
    if isinstance(tensor, torch.Tensor):
        return tensor
    if hasattr(tensor, "__dlpack__"):
        try:
            return torch.from_dlpack(tensor)  # type: ignore[arg-type]
        except (RuntimeError, TypeError, BufferError) as exc:
            raise TypeError(f"{what} cannot be shared with torch through DLPack: {exc}") from None
    raise TypeError(f"{what} must be a paddle or torch tensor, got {type(tensor).__name__}")


@attrs.frozen(eq=False)
class CacheSet:
    """The checked caches of one call, in payload order."""

    caches: tuple[torch.Tensor, ...]
    scales: tuple[torch.Tensor, ...] | None
    layout: PayloadLayout

    @property
    def num_blocks(self) -> int:
        return int(self.caches[0].shape[0])

    @property
    def device(self) -> torch.device:
        return self.caches[0].device

    @property
    def nbytes(self) -> int:
        """Bytes of one block's payload (every layer, K and V, with scales)."""
        return self.layout.nbytes

    def tag(self) -> bytes:
        return TAG_PREFIX + self.layout.descriptor()

    def for_mover(self) -> Caches:
        """These caches as the mover takes them."""
        return Caches(self.caches, self.scales)


def _as_list(value: object, what: str) -> list[object]:
    if isinstance(value, (list, tuple)):
        return list(value)
    raise TypeError(f"{what} must be a list with one tensor per layer, got {type(value).__name__}")


def check_caches(
    key_cache: object,
    val_cache: object,
    *,
    layer_num: int,
    block_token_size: int,
    bytes_per_shard_layer_per_block: int,
    key_scales: object = None,
    val_scales: object = None,
) -> CacheSet:
    """Check FastDeploy's per-layer K and V lists (and fp8 scales) against the store's shape."""
    keys = _as_list(key_cache, "key_cache")
    vals = _as_list(val_cache, "val_cache")
    for name, items in (("key_cache", keys), ("val_cache", vals)):
        if len(items) != layer_num:
            raise ValueError(
                f"{name} has {len(items)} tensors, the store was built for layer_num={layer_num}"
            )
    tensors = [
        (f"{name}[{i}]", to_torch(t, f"{name}[{i}]"))
        for i in range(layer_num)
        for name, t in (("key_cache", keys[i]), ("val_cache", vals[i]))
    ]
    first_name, first = tensors[0]
    if first.dim() != 4:
        raise ValueError(
            f"{first_name} has shape {list(first.shape)}; expected [num_blocks, kv_heads, "
            f"block_size, head_dim]"
        )
    for name, t in tensors[1:]:
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                f"{name} is {list(t.shape)} {t.dtype} on {t.device}, {first_name} is "
                f"{list(first.shape)} {first.dtype} on {first.device}: every layer's K and V "
                f"must match"
            )
    num_blocks, heads, block_size, head_dim = (int(x) for x in first.shape)
    if block_size != block_token_size:
        raise ValueError(
            f"{first_name} holds {block_size} tokens per block (axis 2 of {list(first.shape)}), "
            f"the store was built for block_token_size={block_token_size}"
        )
    per_layer = heads * block_size * head_dim * first.element_size()
    if per_layer != bytes_per_shard_layer_per_block:
        raise ValueError(
            f"{first_name} holds {per_layer} bytes per block ({heads} heads x {block_size} "
            f"tokens x {head_dim} x {first.element_size()} bytes), the store was built for "
            f"bytes_per_shard_layer_per_block={bytes_per_shard_layer_per_block}"
        )
    scales = _check_scales(key_scales, val_scales, layer_num, first)
    caches = tuple(t for _, t in tensors)
    try:
        layout = payload_layout(caches, 1, scales=scales)
    except (TypeError, ValueError) as exc:  # e.g. a dtype the kernels do not move
        raise type(exc)(f"key_cache/val_cache: {exc}") from None
    return CacheSet(caches, scales, layout)


def _check_scales(
    key_scales: object, val_scales: object, layer_num: int, first: torch.Tensor
) -> tuple[torch.Tensor, ...] | None:
    if key_scales is None and val_scales is None:
        return None
    if key_scales is None or val_scales is None:
        raise ValueError("key_scales and val_scales go together: give both or neither")
    ks = _as_list(key_scales, "key_scales")
    vs = _as_list(val_scales, "val_scales")
    for name, items in (("key_scales", ks), ("val_scales", vs)):
        if len(items) != layer_num:
            raise ValueError(f"{name} has {len(items)} tensors, layer_num is {layer_num}")
    tensors = [
        (f"{name}[{i}]", to_torch(t, f"{name}[{i}]"))
        for i in range(layer_num)
        for name, t in (("key_scales", ks[i]), ("val_scales", vs[i]))
    ]
    name0, s0 = tensors[0]
    if s0.dim() < 1 or s0.shape[0] != first.shape[0]:
        raise ValueError(
            f"{name0} has shape {list(s0.shape)}; its first axis must be the "
            f"{int(first.shape[0])} blocks of the caches"
        )
    for name, s in tensors:
        if s.shape != s0.shape or s.dtype != s0.dtype or s.device != first.device:
            raise ValueError(
                f"{name} is {list(s.shape)} {s.dtype} on {s.device}; expected "
                f"{list(s0.shape)} {s0.dtype} on {first.device} like {name0} and the caches"
            )
    return tuple(s for _, s in tensors)


def check_block_ids(
    gpu_block_ids: object, num_blocks: int, *, unique: bool, what: str = "gpu_block_ids"
) -> list[int]:
    """Block ids as plain ints, each in ``[0, num_blocks)`` (and distinct when ``unique``)."""
    if hasattr(gpu_block_ids, "tolist") and not isinstance(gpu_block_ids, (list, tuple)):
        gpu_block_ids = gpu_block_ids.tolist()  # a numpy array or tensor
    if not isinstance(gpu_block_ids, Sequence) or isinstance(gpu_block_ids, (str, bytes)):
        raise TypeError(f"{what} must be a list of ints, got {type(gpu_block_ids).__name__}")
    ids: list[int] = []
    for i, b in enumerate(gpu_block_ids):
        if isinstance(b, bool):
            raise TypeError(f"{what}[{i}] must be an int, got {b!r}")
        try:
            b = operator.index(b)
        except TypeError:
            raise TypeError(f"{what}[{i}] must be an int, got {b!r}") from None
        if not 0 <= b < num_blocks:
            raise ValueError(
                f"{what}[{i}] = {b} is out of range: the caches hold {num_blocks} blocks "
                f"(ids 0..{num_blocks - 1})"
            )
        ids.append(b)
    if unique and len(set(ids)) != len(ids):
        seen: set[int] = set()
        dup = next(b for b in ids if b in seen or seen.add(b))  # type: ignore[func-returns-value]
        raise ValueError(f"{what} lists block {dup} twice; a read fills each block once")
    return ids


def check_tokens(token_ids: object) -> list[int]:
    """Token ids as a list (numpy arrays and tensors are converted)."""
    if hasattr(token_ids, "tolist") and not isinstance(token_ids, (list, tuple)):
        token_ids = token_ids.tolist()
    if not isinstance(token_ids, Sequence) or isinstance(token_ids, (str, bytes)):
        raise TypeError(f"token_ids must be a list of ints, got {type(token_ids).__name__}")
    return list(token_ids)


def check_index(value: object, what: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int >= 0, got {value!r}")
    try:
        index = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int >= 0, got {value!r}") from None
    if index < 0:
        raise ValueError(f"{what} must be >= 0, got {index}")
    return index


def check_timeout(value: object, what: str = "timeout") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number of seconds, got {value!r}")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{what} must be a positive, finite number of seconds, got {value!r}")
    return float(value)
