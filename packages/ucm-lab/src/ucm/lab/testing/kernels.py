"""Helpers for tests (here and in the adapters): strided random caches, bitwise checks.

Random *bits*, not random numbers: the payload must survive NaN payloads, infinities and
denormals unchanged, so the generated tensors contain them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from ucm.kernels.fallback import as_bits


def random_bits(
    shape: Sequence[int], dtype: torch.dtype, generator: torch.Generator
) -> torch.Tensor:
    """A contiguous tensor of ``dtype`` whose bytes are uniformly random."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(
        0, 256, (math.prod(shape) * itemsize,), dtype=torch.uint8, generator=generator
    )
    return raw.view(dtype).view(tuple(shape))


def strided_tensor(
    shape: Sequence[int],
    dtype: torch.dtype,
    generator: torch.Generator,
    *,
    order: Sequence[int] | None = None,
    pad: Sequence[int] | None = None,
    offset: int = 0,
) -> torch.Tensor:
    """A random tensor of logical ``shape`` whose memory is laid out axis by axis in
    ``order`` (outermost first), with ``pad[a]`` unused elements after each row of axis
    ``a`` and ``offset`` unused elements before the first: a view with engine-like strides."""
    ndim = len(shape)
    order = list(range(ndim)) if order is None else list(order)
    pad = [0] * ndim if pad is None else list(pad)
    if sorted(order) != list(range(ndim)):
        raise ValueError(f"order {order} is not a permutation of {ndim} axes")
    phys_shape = [shape[a] + pad[a] for a in order]
    base = random_bits([math.prod(phys_shape) + offset], dtype, generator)
    phys = base[offset:].view(phys_shape)
    for pos, a in enumerate(order):
        phys = phys.narrow(pos, 0, shape[a])
    return phys.permute(*(order.index(a) for a in range(ndim)))


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous integer copy of ``tensor``'s bits (for exact, NaN-proof comparison)."""
    return as_bits(tensor).clone(memory_format=torch.contiguous_format)


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "tensor") -> None:
    """Raise AssertionError naming the first differing element unless the bits are equal."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(
            f"{what}: {tuple(actual.shape)} {actual.dtype} vs {tuple(expected.shape)} "
            f"{expected.dtype}"
        )
    a, e = bits(actual), bits(expected)
    diff = a != e
    if bool(diff.any()):
        idx = tuple(int(x) for x in diff.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(diff.sum())} of {diff.numel()} elements differ, first at {idx}: "
            f"{int(a[idx])} != {int(e[idx])}"
        )
