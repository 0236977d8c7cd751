"""Input checks and normalisation, done in full before any backend writes a byte.

Every public entry point turns its arguments into a :class:`TransferPlan` first; the
backends only execute plans.  So a bad block id, dtype, shape, buffer size or token range
raises here (``TypeError`` for a wrong kind or dtype, ``ValueError`` for a wrong value or
shape, each naming the argument and the bad value) and neither the caches nor the buffers
have been touched.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from typing import NamedTuple, overload

import attrs
import numpy as np
import torch

from ucm.kernels.spec import SUPPORTED_DTYPES, CacheSpec, PayloadLayout, _names, make_layout

GATHER = "gather"
SCATTER = "scatter"


class RowsOf(Sequence[torch.Tensor]):
    """The rows of a 2-D tensor as a sequence, each made when asked for: a plan over one
    buffer (a GPU's scratch) needs its first row, not a tensor a row (a tuple of them cost
    0.35 ms a 1,024 rows, twice a plan)."""

    __slots__ = ("_rows",)

    def __init__(self, rows: torch.Tensor) -> None:
        self._rows = rows

    def __len__(self) -> int:
        return int(self._rows.shape[0])

    @overload
    def __getitem__(self, i: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[torch.Tensor]: ...
    def __getitem__(self, i: int | slice) -> torch.Tensor | Sequence[torch.Tensor]:
        if isinstance(i, slice):
            return RowsOf(self._rows[i])
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        return self._rows[i]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._rows.unbind(0))


@attrs.frozen(eq=False)
class TransferPlan:
    """A checked transfer: normalised views of everything a backend touches."""

    direction: str
    layout: PayloadLayout
    #: the cache tensors as ``[B, H, N, P, D]`` views (same storage as the caller's)
    caches: tuple[torch.Tensor, ...]
    #: per-cache scale tensors ``[B, ...]``, or None
    scales: tuple[torch.Tensor, ...] | None
    #: block ids ``[S, k]``, int64, on the CPU
    block_ids: torch.Tensor
    null_block_id: int | None
    #: per store block: the data part of its buffer, 1-D, in the cache dtype
    data: Sequence[torch.Tensor]
    #: per store block: the scale part of its buffer, 1-D uint8 (None without scales)
    scale_bytes: Sequence[torch.Tensor] | None
    #: the data parts as one ``[S, data_numel]`` strided view when the buffers are evenly
    #: spaced in one allocation (rows of a 2-D tensor); lets a backend do one op for all
    stacked: torch.Tensor | None
    #: per store block: its whole payload, 1-D uint8 (``layout.nbytes`` long)
    raw: Sequence[torch.Tensor]
    #: the payloads as one ``[S, nbytes]`` uint8 view when evenly spaced, else None
    raw_stacked: torch.Tensor | None

    #: scatter only: per store block, on the caches' device, whether it is written at all
    #: (a block that failed its check on the device is not); None: every one
    keep: torch.Tensor | None = None

    @property
    def num_store_blocks(self) -> int:
        return int(self.block_ids.shape[0])

    @property
    def device(self) -> torch.device:
        return self.caches[0].device

    def kept(self) -> TransferPlan:
        """This plan without ``keep``: of the kept store blocks alone (waits for the
        device's verdicts)."""
        if self.keep is None:
            return self
        kept = [i for i, k in enumerate(self.keep.tolist()) if k]
        return attrs.evolve(
            self,
            keep=None,
            block_ids=self.block_ids[kept],
            data=tuple(self.data[i] for i in kept),
            scale_bytes=None
            if self.scale_bytes is None
            else tuple(self.scale_bytes[i] for i in kept),
            raw=tuple(self.raw[i] for i in kept),
            stacked=self.stacked[kept] if self.stacked is not None and kept else None,
            raw_stacked=self.raw_stacked[kept] if self.raw_stacked is not None and kept else None,
        )

    def involved_ids(self) -> torch.Tensor:
        """``[S, j1 - j0]``: the engine blocks the token range touches."""
        return self.block_ids[:, self.layout.first_block : self.layout.end_block]


@attrs.frozen(eq=False)
class CheckedCaches:
    """Cache tensors checked and viewed as the backends take them (:func:`check_caches`),
    for callers that move blocks of the same caches step after step: a plan of checked
    caches checks only its block ids and buffers (checking 32 layers' tensors again took
    a few hundred microseconds of each step)."""

    views: tuple[torch.Tensor, ...]
    scales: tuple[torch.Tensor, ...] | None
    spec: CacheSpec
    #: what callers derive from the caches alone, kept with them (the in-place runs)
    memo: dict = attrs.field(factory=dict, repr=False)

    @property
    def device(self) -> torch.device:
        return self.views[0].device


def check_caches(
    caches: Sequence[torch.Tensor], scales: Sequence[torch.Tensor] | None = None
) -> CheckedCaches:
    """Check ``caches`` (and ``scales``) once for many plans; see :func:`normalise_caches`."""
    return CheckedCaches(*normalise_caches(caches, scales))


def describe_caches(
    caches: Sequence[torch.Tensor], scales: Sequence[torch.Tensor] | None = None
) -> CacheSpec:
    """Check ``caches`` (and ``scales``) and describe them; see :func:`normalise_caches`."""
    return normalise_caches(caches, scales)[2]


def normalise_caches(
    caches: Sequence[torch.Tensor], scales: Sequence[torch.Tensor] | None = None
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...] | None, CacheSpec]:
    """``[B, N, C]``, ``[B, H, N, C]`` and ``[B, H, N, P, D]`` views to ``[B, H, N, P, D]``.

    All tensors must share dtype, device and logical shape; strides may differ.
    """
    if isinstance(caches, torch.Tensor) or not isinstance(caches, Sequence):
        raise TypeError(
            f"caches must be a list of tensors (one per layer, or k0, v0, k1, v1, ...), "
            f"got {type(caches).__name__}"
        )
    if len(caches) == 0:
        raise ValueError("caches is empty: give at least one cache tensor")
    views = []
    for i, cache in enumerate(caches):
        if not isinstance(cache, torch.Tensor):
            raise TypeError(f"caches[{i}] must be a torch.Tensor, got {type(cache).__name__}")
        if cache.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"caches[{i}] has dtype {cache.dtype}; supported: {_names(SUPPORTED_DTYPES)} "
                f"(fp8 data as uint8 or a float8 dtype)"
            )
        if cache.dim() == 3:  # single-head latent cache [B, N, C]
            view = cache.unsqueeze(1).unsqueeze(3)
        elif cache.dim() == 4:  # [B, H, N, C]
            view = cache.unsqueeze(3)
        elif cache.dim() == 5:  # [B, H, N, P, D]
            view = cache
        else:
            raise ValueError(
                f"caches[{i}] has shape {tuple(cache.shape)}; expected [B, N, C], "
                f"[B, H, N, C] or [B, H, N, P, D]"
            )
        if view.numel() == 0:
            raise ValueError(f"caches[{i}] has shape {tuple(cache.shape)} with an empty axis")
        views.append(view)
    first = views[0]
    for i, (cache, view) in enumerate(zip(caches, views)):
        if cache.dtype != caches[0].dtype:
            raise TypeError(f"caches[{i}] has dtype {cache.dtype}, caches[0] has {caches[0].dtype}")
        if cache.device != caches[0].device:
            raise ValueError(f"caches[{i}] is on {cache.device}, caches[0] on {caches[0].device}")
        if view.shape != first.shape:
            raise ValueError(
                f"caches[{i}] has shape {tuple(cache.shape)}, caches[0] has "
                f"{tuple(caches[0].shape)}; all cache tensors of one transfer share a shape"
            )
    num_blocks, heads, block_size, parts, head_dim = (int(x) for x in first.shape)

    scale_views = None
    scale_shape = scale_dtype = None
    if scales is not None:
        if isinstance(scales, torch.Tensor) or not isinstance(scales, Sequence):
            raise TypeError(
                f"scales must be a list of tensors (one per cache tensor) or None, "
                f"got {type(scales).__name__}"
            )
        if len(scales) != len(caches):
            raise ValueError(
                f"scales has {len(scales)} tensors, caches has {len(caches)}: one per cache"
            )
        for i, scale in enumerate(scales):
            if not isinstance(scale, torch.Tensor):
                raise TypeError(f"scales[{i}] must be a torch.Tensor, got {type(scale).__name__}")
            if scale.dim() < 1 or scale.shape[0] != num_blocks:
                raise ValueError(
                    f"scales[{i}] has shape {tuple(scale.shape)}; its first axis must be the "
                    f"{num_blocks} engine blocks"
                )
            if scale.shape != scales[0].shape:
                raise ValueError(
                    f"scales[{i}] has shape {tuple(scale.shape)}, scales[0] has "
                    f"{tuple(scales[0].shape)}"
                )
            if scale.dtype != scales[0].dtype:
                raise TypeError(
                    f"scales[{i}] has dtype {scale.dtype}, scales[0] has {scales[0].dtype}"
                )
            if scale.device != first.device:
                raise ValueError(f"scales[{i}] is on {scale.device}, the caches on {first.device}")
        scale_views = tuple(scales)
        scale_shape = tuple(int(x) for x in scales[0].shape[1:])
        scale_dtype = scales[0].dtype

    spec = CacheSpec(
        num_caches=len(views),
        num_blocks=num_blocks,
        num_heads=heads,
        block_size=block_size,
        head_dim=head_dim,
        dtype=first.dtype,
        parts=parts,
        scale_shape=scale_shape,
        scale_dtype=scale_dtype,
    )
    return tuple(views), scale_views, spec


def normalise_block_ids(block_ids: object, num_blocks: int) -> torch.Tensor:
    """A 2-D ``[S, k]`` (or 1-D ``[S]``, meaning ``k = 1``) list or tensor of engine block
    ids to a CPU int64 tensor, every id in ``[0, num_blocks)``."""
    fast = _ids_of_list(block_ids, num_blocks)
    if fast is not None:
        return fast
    if isinstance(block_ids, torch.Tensor):
        ids = block_ids.detach()
    else:
        try:
            ids = torch.as_tensor(block_ids)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(
                f"block_ids must be a 2-D list or tensor of ints [store blocks, k]: {exc}"
            ) from None
    if ids.numel() == 0:
        raise ValueError(f"block_ids is empty (shape {tuple(ids.shape)}): give [store blocks, k]")
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise TypeError(f"block_ids must hold integers, got dtype {ids.dtype}")
    if ids.dim() == 1:
        ids = ids.unsqueeze(1)
    if ids.dim() != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(
            f"block_ids must be [store blocks, k] with both at least 1, got shape "
            f"{tuple(ids.shape)}"
        )
    ids = ids.to(device="cpu", dtype=torch.int64)
    bad = (ids < 0) | (ids >= num_blocks)
    if bool(bad.any()):
        s, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"block_ids[{s}][{j}] = {int(ids[s, j])} is out of range: the caches hold "
            f"{num_blocks} engine blocks (ids 0..{num_blocks - 1})"
        )
    return ids


def _ids_of_list(block_ids: object, num_blocks: int) -> torch.Tensor | None:
    """A list of ints, or of lists of ints, as :func:`normalise_block_ids` gives it, made
    with numpy (a mover's step of 64 blocks: 23 -> 5 us); None where it is anything else
    or wrong (the checks below then say what)."""
    if not isinstance(block_ids, (list, tuple)) or not block_ids:
        return None
    try:
        ids = np.array(block_ids)
    except (TypeError, ValueError, OverflowError):
        return None
    if ids.dtype != np.int64 or ids.ndim not in (1, 2) or 0 in ids.shape:
        return None
    if ids.min() < 0 or ids.max() >= num_blocks:
        return None
    return torch.from_numpy(ids.reshape(len(ids), -1))


def build_plan(
    direction: str,
    caches: Sequence[torch.Tensor] | CheckedCaches,
    block_ids: object,
    buffers: torch.Tensor | Sequence[torch.Tensor],
    *,
    token_range: tuple[int, int] | None = None,
    null_block_id: int | None = None,
    scales: Sequence[torch.Tensor] | None = None,
    host_buffers: bool = False,
) -> TransferPlan:
    """Check every argument of a gather or scatter and return the plan.

    ``host_buffers`` lets the buffers live on the CPU while the caches are on an accelerator
    (the staging path); otherwise they must share the caches' device.  ``caches`` checked
    already (:func:`check_caches`) carry their scales: ``scales`` is then None.
    """
    if direction not in (GATHER, SCATTER):
        raise ValueError(f"direction must be {GATHER!r} or {SCATTER!r}, got {direction!r}")
    if isinstance(caches, CheckedCaches):
        if scales is not None:
            raise ValueError("checked caches carry their scales: give scales=None")
        views, scale_views, spec = caches.views, caches.scales, caches.spec
    else:
        views, scale_views, spec = normalise_caches(caches, scales)
    ids = normalise_block_ids(block_ids, spec.num_blocks)
    if null_block_id is not None:
        try:
            null_block_id = operator.index(null_block_id)
        except TypeError:
            raise TypeError(
                f"null_block_id must be an int or None, got {null_block_id!r}"
            ) from None
        if not 0 <= null_block_id < spec.num_blocks:
            raise ValueError(
                f"null_block_id = {null_block_id} is out of range for {spec.num_blocks} blocks"
            )
    if token_range is not None:
        try:
            t0, t1 = token_range
            token_range = (operator.index(t0), operator.index(t1))
        except (TypeError, ValueError):
            raise TypeError(
                f"token_range must be a pair of ints (start, end), got {token_range!r}"
            ) from None
    layout = make_layout(spec, int(ids.shape[1]), token_range)

    if direction == SCATTER:
        # Two writes to one engine block would race on a GPU (and their order would decide
        # the result): a load never targets one block twice, so refuse it.
        involved = ids[:, layout.first_block : layout.end_block].reshape(-1)
        if null_block_id is not None:
            involved = involved[involved != null_block_id]
        uniq, counts = torch.unique(involved, return_counts=True)
        if bool((counts > 1).any()):
            dup = int(uniq[counts > 1][0])
            raise ValueError(
                f"block_ids: engine block {dup} appears {int(counts[counts > 1][0])} times in "
                f"the token range; scatter writes each engine block at most once"
            )

    parts = _split_buffers(
        buffers, layout, int(ids.shape[0]), views[0].device, host_buffers, scale_views is not None
    )
    return TransferPlan(
        direction=direction,
        layout=layout,
        caches=views,
        scales=scale_views,
        block_ids=ids,
        null_block_id=null_block_id,
        **parts,
    )


def rebind_buffers(
    plan: TransferPlan,
    buffers: torch.Tensor | Sequence[torch.Tensor],
    *,
    host_buffers: bool = False,
) -> TransferPlan:
    """The same transfer with other buffers (checked like the originals)."""
    parts = _split_buffers(
        buffers,
        plan.layout,
        plan.num_store_blocks,
        plan.device,
        host_buffers,
        plan.scales is not None,
    )
    return attrs.evolve(plan, **parts)


def _split_buffers(
    buffers: torch.Tensor | Sequence[torch.Tensor],
    layout: PayloadLayout,
    count: int,
    device: torch.device,
    host_ok: bool,
    has_scales: bool,
) -> dict[str, object]:
    dtype = layout.cache.dtype
    if isinstance(buffers, torch.Tensor):
        if buffers.dim() == 1 and count == 1:
            buffers = buffers.unsqueeze(0)
        if buffers.dim() != 2 or buffers.shape[0] != count:
            raise ValueError(
                f"buffers has shape {tuple(buffers.shape)}; expected [{count}, bytes or "
                f"elements] (one row per store block) or a list of {count} tensors"
            )
        if (
            buffers.is_contiguous()
            and buffers.shape[1] * buffers.element_size() % dtype.itemsize == 0
        ):
            # Rows of one contiguous tensor share dtype, device, size and alignment: check
            # the first, and make every row's views in one call each (host time: a call
            # with a row per store block made three views per row, in Python).
            _checked_row(0, buffers[0], _RowSizes.of(layout), device, host_ok, has_scales)
            rows2d = buffers.view(torch.uint8)
            raw = rows2d[:, : layout.nbytes]
            data2d = rows2d[:, : layout.data_nbytes].view(dtype)
            return {
                "data": RowsOf(data2d),
                "scale_bytes": RowsOf(raw[:, layout.data_nbytes :]) if has_scales else None,
                "stacked": data2d,
                "raw": RowsOf(raw),
                "raw_stacked": raw,
            }
        rows = list(buffers.unbind(0))
    elif isinstance(buffers, Sequence):
        rows = list(buffers)
        if len(rows) != count:
            raise ValueError(f"buffers has {len(rows)} entries, block_ids has {count} store blocks")
    else:
        raise TypeError(
            f"buffers must be a 2-D tensor or a list of tensors, got {type(buffers).__name__}"
        )

    # the layout's sizes are properties computed on each use: once here, not once a row
    # (a list of rows, such as a store's scattered slots, paid tens of microseconds a row)
    sizes = _RowSizes.of(layout)
    raws = [_checked_row(s, row, sizes, device, host_ok, has_scales) for s, row in enumerate(rows)]

    spans = sorted((r.data_ptr(), r.data_ptr() + r.numel(), s) for s, r in enumerate(raws))
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"buffers[{b}] overlaps buffers[{a}]")

    data_nbytes = sizes.data_nbytes
    if has_scales:
        data = tuple(r[:data_nbytes].view(dtype) for r in raws)
        scale_bytes: tuple[torch.Tensor, ...] | None = tuple(r[data_nbytes:] for r in raws)
    else:  # a row is its data
        data = tuple(r.view(dtype) for r in raws)
        scale_bytes = None
    return {
        "data": data,
        "scale_bytes": scale_bytes,
        "stacked": _stack(data, layout.data_numel),
        "raw": tuple(raws),
        "raw_stacked": _stack(tuple(raws), sizes.nbytes),
    }


class _RowSizes(NamedTuple):
    """What a row of a payload layout is checked against."""

    nbytes: int
    data_nbytes: int
    dtype: torch.dtype
    itemsize: int

    @classmethod
    def of(cls, layout: PayloadLayout) -> _RowSizes:
        dtype = layout.cache.dtype
        return cls(layout.nbytes, layout.data_nbytes, dtype, dtype.itemsize)


def _checked_row(
    s: int,
    row: object,
    sizes: _RowSizes,
    device: torch.device,
    host_ok: bool,
    has_scales: bool,
) -> torch.Tensor:
    """Row ``s`` of the buffers, checked, as its payload's ``sizes.nbytes`` bytes."""
    dtype = sizes.dtype
    if not isinstance(row, torch.Tensor):
        raise TypeError(f"buffers[{s}] must be a torch.Tensor, got {type(row).__name__}")
    if has_scales and row.dtype != torch.uint8:
        raise TypeError(
            f"buffers[{s}] has dtype {row.dtype}; with scales the payload mixes data and "
            f"scale bytes, so buffers must be uint8"
        )
    if row.dtype not in (dtype, torch.uint8):
        raise TypeError(
            f"buffers[{s}] has dtype {row.dtype}; the caches are {dtype}, so buffers must "
            f"be {dtype} or uint8"
        )
    if row.device != device and not (host_ok and row.device.type == "cpu"):
        raise ValueError(f"buffers[{s}] is on {row.device}, the caches on {device}")
    if not row.is_contiguous():
        raise ValueError(f"buffers[{s}] is not contiguous (strides {tuple(row.stride())})")
    raw = row if row.dim() == 1 and row.dtype == torch.uint8 else row.reshape(-1).view(torch.uint8)
    held = raw.numel()
    if held < sizes.nbytes:
        raise ValueError(
            f"buffers[{s}] holds {held} bytes, the payload needs {sizes.nbytes} "
            f"({sizes.data_nbytes} data + {sizes.nbytes - sizes.data_nbytes} scales)"
        )
    if raw.data_ptr() % sizes.itemsize:
        raise ValueError(
            f"buffers[{s}] starts at an address not aligned to {sizes.itemsize} bytes "
            f"(the {dtype} element size)"
        )
    return raw if held == sizes.nbytes else raw[: sizes.nbytes]


def _stack(data: tuple[torch.Tensor, ...], numel: int) -> torch.Tensor | None:
    """One ``[S, numel]`` view over evenly spaced rows of one allocation, else None."""
    first = data[0]
    itemsize = first.element_size()
    if len(data) == 1:
        return first.unsqueeze(0)
    storage = first.untyped_storage().data_ptr()
    step = data[1].data_ptr() - first.data_ptr()
    if step <= 0 or step % itemsize:
        return None
    for s, row in enumerate(data):
        if row.untyped_storage().data_ptr() != storage:
            return None
        if row.data_ptr() != first.data_ptr() + s * step:
            return None
    return first.as_strided((len(data), numel), (step // itemsize, 1))
