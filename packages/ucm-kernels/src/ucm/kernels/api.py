"""The public gather/scatter entry points and the choice of backend.

``backend="auto"`` picks Triton for tensors on a GPU when triton imports (and is not in
interpreter mode), and the torch fallback everywhere else; it also falls back, once and with
a warning, if the Triton kernel cannot be compiled for the device.  ``"triton"`` forces the
kernel (on CPU tensors only under ``TRITON_INTERPRET=1``, which is how the tests run it),
``"torch"`` the fallback and ``"reference"`` the slow plain-torch reference.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Literal

import torch

from ucm.kernels.fallback import run_fallback
from ucm.kernels.reference import run_reference
from ucm.kernels.spec import PayloadLayout, make_layout
from ucm.kernels.validate import GATHER, SCATTER, TransferPlan, build_plan, describe_caches

Backend = Literal["auto", "triton", "torch", "reference"]
BACKENDS = ("auto", "triton", "torch", "reference")

_triton_broken: set[str] = set()  # device types where the kernel failed to compile


@functools.cache
def _triton_module():  # type: ignore[no-untyped-def]
    """The Triton backend module, or the reason it cannot be imported."""
    try:
        from ucm.kernels import triton_copy
    except Exception as exc:  # ImportError, or triton failing to initialise
        return f"{type(exc).__name__}: {exc}"
    return triton_copy


def triton_available(device: torch.device | str | None = None) -> bool:
    """Whether the Triton kernel can run on tensors of ``device`` (default: the GPU)."""
    mod = _triton_module()
    if isinstance(mod, str):
        return False
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type == "cpu":
        return mod.interpreter_enabled()
    return dev.type == "cuda" and torch.cuda.is_available() and not mod.interpreter_enabled()


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend that ``backend`` means for tensors on ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend != "auto":
        return backend
    if device.type == "cpu" or device.type in _triton_broken:
        return "torch"
    return "triton" if triton_available(device) else "torch"


def execute(plan: TransferPlan, backend: str = "auto") -> str:
    """Run a checked plan; return the backend that ran it."""
    chosen = resolve_backend(backend, plan.device)
    if plan.keep is not None and chosen != "triton":
        plan = plan.kept()  # the other backends take whole plans: the verdicts read here
    if plan.num_store_blocks == 0:
        return chosen
    if chosen == "reference":
        run_reference(plan)
    elif chosen == "torch":
        run_fallback(plan)
    else:
        mod = _triton_module()
        if isinstance(mod, str):
            raise RuntimeError(f"backend='triton' asked for, but triton does not import: {mod}")
        if backend == "auto":
            try:
                mod.run_triton(plan)
            except Exception as exc:  # triton's CompilationError, a driver or launcher error
                # A transfer is idempotent (sources and destinations never overlap), so
                # running it again with the fallback is right even if a launch got through.
                _triton_broken.add(plan.device.type)
                warnings.warn(
                    f"Triton copy kernel unavailable on {plan.device} ({exc}); "
                    f"using the torch fallback from now on",
                    RuntimeWarning,
                    stacklevel=3,
                )
                run_fallback(plan.kept())
                chosen = "torch"
        else:
            mod.run_triton(plan)
    return chosen


def gather(
    caches: Sequence[torch.Tensor],
    block_ids: object,
    buffers: torch.Tensor | Sequence[torch.Tensor],
    *,
    token_range: tuple[int, int] | None = None,
    null_block_id: int | None = None,
    scales: Sequence[torch.Tensor] | None = None,
    backend: Backend = "auto",
) -> str:
    """Copy engine blocks into store-block buffers, in the canonical layout.

    Args:
        caches: cache tensors in payload order, each ``[B, N, C]``, ``[B, H, N, C]`` or
            ``[B, H, N, P, D]`` (any strides), all of one shape, dtype and device.
        block_ids: ``[S, k]`` ints: row ``s`` lists the ``k`` engine blocks of store block
            ``s`` (a 1-D list means ``k = 1``).  Repeats and any order are fine.
        buffers: ``[S, X]`` tensor or ``S`` contiguous tensors, dtype of the caches or uint8
            (uint8 when ``scales`` are given), each at least :func:`payload_nbytes` bytes;
            only the first ``payload_nbytes`` bytes are written.
        token_range: ``(t0, t1)``: copy only these tokens of the ``k * N`` (default all).
        null_block_id: ids equal to it are not read: their part of the payload is zeros.
        scales: per-cache scale tensors ``[B, ...]`` (fp8 caches); appended to the payload.
        backend: ``auto``, ``triton``, ``torch`` or ``reference``.

    Returns the backend that ran.  On a GPU the copy is queued on the current stream.
    """
    plan = build_plan(
        GATHER,
        caches,
        block_ids,
        buffers,
        token_range=token_range,
        null_block_id=null_block_id,
        scales=scales,
    )
    return execute(plan, backend)


def scatter(
    caches: Sequence[torch.Tensor],
    block_ids: object,
    buffers: torch.Tensor | Sequence[torch.Tensor],
    *,
    token_range: tuple[int, int] | None = None,
    null_block_id: int | None = None,
    scales: Sequence[torch.Tensor] | None = None,
    backend: Backend = "auto",
) -> str:
    """The reverse of :func:`gather`: write store-block payloads into engine blocks.

    Same arguments.  Null blocks are never written, tokens outside ``token_range`` and
    blocks not listed are untouched; a (non-null) engine block may appear at most once
    among the blocks the range touches.
    """
    plan = build_plan(
        SCATTER,
        caches,
        block_ids,
        buffers,
        token_range=token_range,
        null_block_id=null_block_id,
        scales=scales,
    )
    return execute(plan, backend)


def payload_nbytes(
    caches: Sequence[torch.Tensor],
    blocks_per_store_block: int,
    *,
    token_range: tuple[int, int] | None = None,
    scales: Sequence[torch.Tensor] | None = None,
) -> int:
    """Bytes of one store block's payload for these caches (what a buffer must hold)."""
    return payload_layout(
        caches, blocks_per_store_block, token_range=token_range, scales=scales
    ).nbytes


def payload_layout(
    caches: Sequence[torch.Tensor],
    blocks_per_store_block: int,
    *,
    token_range: tuple[int, int] | None = None,
    scales: Sequence[torch.Tensor] | None = None,
) -> PayloadLayout:
    """The :class:`~ucm.kernels.spec.PayloadLayout` for these caches."""
    return make_layout(describe_caches(caches, scales), blocks_per_store_block, token_range)
