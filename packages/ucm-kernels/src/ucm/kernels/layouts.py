"""Logical views of engine cache tensors: permutations and reshapes, never copies.

The kernels take each cache tensor as a logical ``[B, H, N, C]`` view (or ``[B, N, C]`` for
a single-head latent cache, or ``[B, H, N, P, D]`` when the channels are split over two
strided axes, e.g. K and V stored in separate halves of the allocation).  The physical
memory order does not matter: the kernels follow the view's strides.  :func:`logical_view`
builds such a view from a tensor whose axes are named by letters, so an adapter can say what
its engine allocates without writing the permutation by hand.

Letters: ``B`` blocks, ``H`` KV heads, ``N`` tokens in a block, ``C`` channels (one axis),
``K`` the K/V axis (size 2, K first) and ``D`` head dim (``K`` and ``D`` together make the
channels: ``C = K|V``).  Examples::

    logical_view(t, "BNHC")   # vLLM NHD with K|V in the last axis  -> [B, H, N, C]
    logical_view(t, "BHNC")   # vLLM HND                            -> [B, H, N, C] (as is)
    logical_view(t, "KBNHD")  # FlashAttention [2, B, N, H, D]      -> [B, H, N, 2, D]
    logical_view(t, "BNC")    # MLA latent cache                    -> [B, 1, N, C]
"""

from __future__ import annotations

import torch


def logical_view(tensor: torch.Tensor, axes: str) -> torch.Tensor:
    """A view of ``tensor`` in the kernels' logical order (see the module docstring)."""
    axes = axes.upper()
    if len(axes) != tensor.dim():
        raise ValueError(f"axes {axes!r} name {len(axes)} axes, the tensor has {tensor.dim()}")
    if len(set(axes)) != len(axes) or not set(axes) <= set("BHNCKD"):
        raise ValueError(f"axes {axes!r}: use each of B, H, N, C, K, D at most once")
    for need in "BN":
        if need not in axes:
            raise ValueError(f"axes {axes!r} must name the block axis B and the token axis N")
    split = "K" in axes or "D" in axes
    if split and ("C" in axes or "K" not in axes or "D" not in axes):
        raise ValueError(f"axes {axes!r}: give either C, or K and D together")
    if not split and "C" not in axes:
        raise ValueError(f"axes {axes!r} must name the channel axis C (or K and D)")
    view = tensor
    if "H" not in axes:  # a single-head (MLA) cache: add a head axis of size 1
        view = view.unsqueeze(axes.index("N"))
        axes = axes.replace("N", "HN")
    order = "BHNKD" if split else "BHNC"
    return view.permute(*(axes.index(a) for a in order))
