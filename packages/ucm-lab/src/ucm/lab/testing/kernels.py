"""Helpers for tests (here and in the adapters): strided random caches, bitwise checks, the
mover's layered copies held back.

Random *bits*, not random numbers: the payload must survive NaN payloads, infinities and
denormals unchanged, so the generated tensors contain them.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

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


class GatedLayers:
    """The mover's layered copies held back (:mod:`ucm.kernels.mover.layers`): a read's
    first layer is copied at once, each later one only once :attr:`gate` is set, a copy
    still under way while the engine waits.  Put in place by :meth:`install`."""

    def __init__(self) -> None:
        import ucm.kernels.mover.layers as layers

        self._layers = layers
        self.real = layers.copy_layer
        self.gate = threading.Event()
        self.calls = 0  # layers copied or being copied

    def install(self, monkeypatch: Any) -> GatedLayers:
        monkeypatch.setattr(self._layers, "copy_layer", self)
        return self

    def __call__(self, *args: Any) -> None:
        self.calls += 1
        if self.calls > 1:
            self.gate.wait(30)
        self.real(*args)
