"""The backends against the plain torch reference, bit for bit, over generated cases.

Cases cover: 3-D (MLA), 4-D and 5-D (K/V split) cache views with permuted, padded and
offset physical layouts (per cache tensor, so one transfer mixes stride patterns); every
supported dtype as random bits (NaN payloads included); block lists with repeats, null
blocks and any order; token ranges; fp8 scales; buffers as one 2-D tensor, separate
tensors, strided rows of one allocation, typed or bytes.
"""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ucm.lab.testing.kernels import assert_bits_equal, bits, random_bits, strided_tensor

from ucm.kernels import gather, payload_layout, scatter, triton_available
from ucm.kernels.api import execute
from ucm.kernels.fallback import run_fallback
from ucm.kernels.validate import build_plan

FAST = settings(
    deadline=None, database=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow]
)
# The interpreter runs each Triton program in numpy: fewer, small examples.
SLOW = settings(
    deadline=None, database=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow]
)

#: where the Triton kernel runs: the GPU when there is one (the cases are built on the CPU and
#: copied there byte for byte, strides and shared allocations kept), else the interpreter
TRITON_DEVICE = "cuda" if triton_available("cuda") else "cpu"

needs_triton = pytest.mark.skipif(
    not triton_available(TRITON_DEVICE),
    reason="the Triton kernels need a CUDA GPU, or TRITON_INTERPRET=1 on the CPU, with triton",
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.float8_e4m3fn]


@attrs.frozen
class Case:
    dtype: torch.dtype
    ndim: int  # 3: [B, N, C], 4: [B, H, N, C], 5: [B, H, N, P, D]
    num_blocks: int
    heads: int
    block_size: int
    parts: int
    head_dim: int
    layouts: tuple  # per cache tensor: (order, pad, offset); one entry when shared
    shared: bool  # all cache tensors are slices of one allocation (layer axis anywhere)
    num_caches: int
    block_ids: tuple
    null_block_id: int | None
    token_range: tuple[int, int] | None
    scale_shape: tuple[int, ...] | None
    buffer_form: str
    seed: int

    @property
    def shape(self) -> tuple[int, ...]:
        b, h, n, p, d = self.num_blocks, self.heads, self.block_size, self.parts, self.head_dim
        return {3: (b, n, d), 4: (b, h, n, p * d), 5: (b, h, n, p, d)}[self.ndim]

    def build(self):
        """Fresh caches, scales and buffers: identical bits and layouts on every call."""
        gen = torch.Generator().manual_seed(self.seed)
        if self.shared:
            ((o, p, off),) = self.layouts
            big = strided_tensor(
                (self.num_caches, *self.shape), self.dtype, gen, order=o, pad=p, offset=off
            )
            caches = list(big.unbind(0))
        else:
            caches = [
                strided_tensor(self.shape, self.dtype, gen, order=o, pad=p, offset=off)
                for o, p, off in self.layouts
            ]
        scales = None
        if self.scale_shape is not None:
            scales = [
                random_bits((self.num_blocks, *self.scale_shape), torch.float32, gen)
                for _ in caches
            ]
        lay = payload_layout(
            caches, len(self.block_ids[0]), token_range=self.token_range, scales=scales
        )
        count = len(self.block_ids)
        itemsize = caches[0].element_size()
        typed = self.buffer_form.endswith("typed") and scales is None and lay.nbytes % itemsize == 0
        dtype = self.dtype if typed else torch.uint8
        unit = itemsize if typed else 1
        numel = lay.nbytes // unit
        if self.buffer_form.startswith("2d"):
            buffers = random_bits((count, numel), dtype, gen)
        elif self.buffer_form.startswith("list"):
            # separate allocations, each a little longer than the payload
            buffers = [random_bits((numel + 3,), dtype, gen) for _ in range(count)]
        else:  # "rows": evenly spaced rows of one allocation, with a gap between them
            big = random_bits((count, numel + 8), dtype, gen)  # 8: keeps rows aligned
            buffers = [big[s, :numel] for s in range(count)]
        return caches, scales, buffers

    def kwargs(self, scales):
        return dict(token_range=self.token_range, null_block_id=self.null_block_id, scales=scales)


@st.composite
def cases(draw, scatter_side: bool, small: bool = False) -> Case:
    dtype = draw(st.sampled_from(DTYPES))
    ndim = draw(st.sampled_from([3, 4, 5]))
    count = draw(st.integers(1, 2 if small else 3))
    k = draw(st.integers(1, 3))
    num_blocks = count * k + draw(st.integers(1, 3))
    heads = 1 if ndim == 3 else draw(st.integers(1, 2 if small else 3))
    block_size = draw(st.integers(1, 5))
    parts = 2 if ndim == 5 else 1
    head_dim = draw(st.integers(1, 9))
    num_caches = draw(st.integers(1, 2 if small else 3))

    def layout(dims):
        order = draw(st.permutations(range(dims)))
        pad = draw(st.lists(st.integers(0, 1), min_size=dims, max_size=dims))
        return (tuple(order), tuple(pad), draw(st.integers(0, 3)))

    shared = draw(st.booleans())
    if shared:
        layouts = (layout(ndim + 1),)
    else:
        same = draw(st.booleans())
        first = layout(ndim)
        layouts = tuple(first if same or i == 0 else layout(ndim) for i in range(num_caches))

    null = draw(st.sampled_from([None, 0, 0, num_blocks - 1]))
    if scatter_side:
        # a load never targets one engine block twice (scatter refuses it)
        perm = draw(st.permutations(range(num_blocks)))
        flat = list(perm[: count * k])
    else:  # repeats and null blocks allowed, any order
        flat = draw(
            st.lists(st.integers(0, num_blocks - 1), min_size=count * k, max_size=count * k)
        )
    if null is not None:
        flat = [null if draw(st.integers(0, 3)) == 0 else b for b in flat]
    ids = tuple(tuple(flat[s * k : (s + 1) * k]) for s in range(count))

    total = k * block_size
    token_range = None
    if draw(st.booleans()):
        t0 = draw(st.integers(0, total - 1))
        token_range = (t0, draw(st.integers(t0 + 1, total)))

    scale_shape = None
    if dtype.itemsize == 1 and draw(st.booleans()):
        scale_shape = draw(st.sampled_from([(), (heads,), (heads, block_size)]))
    form = draw(st.sampled_from(["2d-typed", "2d-bytes", "list-typed", "rows-bytes", "rows-typed"]))
    return Case(
        dtype,
        ndim,
        num_blocks,
        heads,
        block_size,
        parts,
        head_dim,
        layouts,
        shared,
        num_caches,
        ids,
        null,
        token_range,
        scale_shape,
        form,
        draw(st.integers(0, 2**31 - 1)),
    )


def _run(direction: str, caches, block_ids, buffers, backend: str, **kwargs) -> None:
    """``backend``: reference, triton, or a forced variant of the fallback: torch-1 and
    torch-2 on 1 or 2 threads (the threaded split otherwise starts at 8 MiB), torch-index
    scattering with index_copy_ as it does on a GPU, all without the contiguous-run copies;
    torch-runs with them where the layout allows (the general way elsewhere)."""
    if backend == "triton" and TRITON_DEVICE != "cpu":
        _run_on_device(direction, caches, block_ids, buffers, **kwargs)
        return
    plan = build_plan(direction, caches, block_ids, buffers, **kwargs)
    if backend == "torch-index":
        run_fallback(plan, workers=1, per_block=False, runs=False)
    elif backend == "torch-runs":
        run_fallback(plan)
    elif backend.startswith("torch-"):
        run_fallback(plan, workers=int(backend.removeprefix("torch-")), runs=False)
    else:
        assert execute(plan, backend) == backend


def _run_on_device(direction: str, caches, block_ids, buffers, **kwargs) -> None:
    """Run the Triton kernel on copies of the CPU tensors' whole allocations on the GPU
    (same strides and offsets, shared allocations still shared), then copy every byte of
    those allocations back, padding included: a stray write shows in the CPU checks."""
    storages: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def moved(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in storages:
            host = torch.empty(0, dtype=torch.uint8).set_(storage)
            storages[key] = (host, host.to(TRITON_DEVICE))
        base = storages[key][1].view(t.dtype)
        return base.as_strided(t.shape, t.stride(), t.storage_offset())

    scales = kwargs.get("scales")
    on_device = dict(kwargs, scales=None if scales is None else [moved(s) for s in scales])
    bufs = moved(buffers) if isinstance(buffers, torch.Tensor) else [moved(b) for b in buffers]
    plan = build_plan(direction, [moved(c) for c in caches], block_ids, bufs, **on_device)
    assert execute(plan, "triton") == "triton"
    torch.cuda.synchronize()
    for host, device in storages.values():
        host.copy_(device)


def _check_gather(case: Case, backend: str) -> None:
    caches, scales, want = case.build()
    gather(caches, case.block_ids, want, **case.kwargs(scales), backend="reference")
    caches2, scales2, got = case.build()
    _run("gather", caches2, case.block_ids, got, backend, **case.kwargs(scales2))
    for s, (g, w) in enumerate(zip(got, want)):
        assert_bits_equal(g, w, f"buffer {s}")  # the bytes past the payload included
    fresh, fresh_scales, _ = case.build()  # gather leaves the caches alone
    for i, (c, f) in enumerate(zip(caches2, fresh)):
        assert_bits_equal(c, f, f"cache {i}")
    for i, (c, f) in enumerate(zip(scales2 or [], fresh_scales or [])):
        assert_bits_equal(c, f, f"scale {i}")


def _check_scatter(case: Case, backend: str) -> None:
    want, want_scales, buffers = case.build()
    scatter(want, case.block_ids, buffers, **case.kwargs(want_scales), backend="reference")
    got, got_scales, buffers2 = case.build()
    _run("scatter", got, case.block_ids, buffers2, backend, **case.kwargs(got_scales))
    for i, (g, w) in enumerate(zip(got, want)):
        assert_bits_equal(g, w, f"cache {i}")
    for i, (g, w) in enumerate(zip(got_scales or [], want_scales or [])):
        assert_bits_equal(g, w, f"scale {i}")
    for s, (b, b2) in enumerate(zip(buffers, buffers2)):
        assert_bits_equal(b2, b, f"buffer {s}")  # scatter leaves the buffers alone


FALLBACK = ["torch-1", "torch-2", "torch-index", "torch-runs"]


@pytest.mark.parametrize("backend", FALLBACK)
@FAST
@given(case=cases(scatter_side=False))
def test_fallback_gather_matches_reference(backend: str, case: Case) -> None:
    _check_gather(case, backend)


@pytest.mark.parametrize("backend", FALLBACK)
@FAST
@given(case=cases(scatter_side=True))
def test_fallback_scatter_matches_reference(backend: str, case: Case) -> None:
    _check_scatter(case, backend)


@needs_triton
@SLOW
@given(cases(scatter_side=False))
def test_triton_gather_matches_reference(case: Case) -> None:
    _check_gather(case, "triton")


@needs_triton
@SLOW
@given(cases(scatter_side=True))
def test_triton_scatter_matches_reference(case: Case) -> None:
    _check_scatter(case, "triton")


def _roundtrip(case: Case, backend: str) -> None:
    """gather, then scatter into a cache with other contents: exactly the involved tokens of
    the listed non-null blocks come back; every other byte keeps the other contents."""
    caches, scales, buffers = case.build()
    _run("gather", caches, case.block_ids, buffers, backend, **case.kwargs(scales))
    other = attrs.evolve(case, seed=case.seed ^ 0x5A5A5A)
    target, target_scales, _ = other.build()
    before, before_scales, _ = other.build()
    _run("scatter", target, case.block_ids, buffers, backend, **case.kwargs(target_scales))

    n = case.block_size
    t0, t1 = case.token_range or (0, len(case.block_ids[0]) * n)
    written = torch.zeros(case.num_blocks, n, dtype=torch.bool)
    touched_blocks = torch.zeros(case.num_blocks, dtype=torch.bool)
    for row in case.block_ids:
        for tok in range(t0, t1):
            b = row[tok // n]
            if b != case.null_block_id:
                written[b, tok % n] = True
                touched_blocks[b] = True
    for i, (tgt, src, old) in enumerate(zip(target, caches, before)):
        expect, src = bits(old), bits(src)  # integer views: index_put has no fp8 kernel
        if tgt.dim() == 3:  # [B, N, C]
            expect[written] = src[written]
        else:  # [B, H, N, ...]: tokens are axis 2
            idx = written.nonzero()
            expect[idx[:, 0], :, idx[:, 1]] = src[idx[:, 0], :, idx[:, 1]]
        assert_bits_equal(bits(tgt), expect, f"cache {i}")
    for i, (tgt, src, old) in enumerate(
        zip(target_scales or [], scales or [], before_scales or [])
    ):
        # integer views: a float copy through a mask may quiet a signalling NaN (seen once
        # in 3,000 generated cases: 0x7fa5... came back as 0x7fe5...)
        expect, src = bits(old), bits(src)
        expect[touched_blocks] = src[touched_blocks]
        assert_bits_equal(bits(tgt), expect, f"scale {i}")


@pytest.mark.parametrize("backend", FALLBACK)
@FAST
@given(case=cases(scatter_side=True))
def test_fallback_roundtrip_restores_listed_blocks_only(backend: str, case: Case) -> None:
    _roundtrip(case, backend)


@needs_triton
@SLOW
@given(cases(scatter_side=True))
def test_triton_roundtrip_restores_listed_blocks_only(case: Case) -> None:
    _roundtrip(case, "triton")


# --- fixed cases the small generated shapes do not reach --------------------------------
def _fixed(ndim, heads, block_size, parts, head_dim, k, dtype, token_range=None, order=None):
    nb = 2 * k + 2
    shape_nd = {3: 3, 4: 4, 5: 5}[ndim]
    return Case(
        dtype,
        ndim,
        nb,
        heads,
        block_size,
        parts,
        head_dim,
        tuple((tuple(order or range(shape_nd)), (0,) * shape_nd, 0) for _ in range(2)),
        False,
        2,
        (tuple(range(1, k + 1)), tuple(range(nb - 1, nb - 1 - k, -1))),
        None,
        token_range,
        None,
        "2d-typed",
        1234,
    )


FIXED = {
    # several token tiles and head_dim tiles (BLOCK_D caps at 256), masked tails
    "tiles": _fixed(4, 2, 8, 1, 300, 3, torch.bfloat16, token_range=(3, 24)),
    # realistic-looking, aligned: the 16-byte ALIGN path
    "aligned-hnd": _fixed(4, 2, 16, 1, 64, 2, torch.float16),
    # vLLM NHD physical order [B, N, H, C] seen through the logical view
    "nhd": _fixed(4, 2, 16, 1, 32, 2, torch.bfloat16, order=(0, 2, 1, 3)),
    # FlashAttention-style K/V split [2, B, N, H, D]
    "kv-first": _fixed(5, 2, 4, 2, 16, 2, torch.bfloat16, order=(3, 0, 2, 1, 4)),
    # MLA latent, 576 channels
    "mla": _fixed(3, 1, 4, 1, 576, 2, torch.bfloat16),
    "fp8": _fixed(4, 2, 8, 1, 16, 2, torch.uint8),
}


@pytest.mark.parametrize("backend", [*FALLBACK, pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("name", sorted(FIXED))
def test_fixed_cases(name: str, backend: str) -> None:
    _check_gather(FIXED[name], backend)
    _check_scatter(FIXED[name], backend)
    _roundtrip(FIXED[name], backend)


def test_reference_layout_by_hand() -> None:
    """The reference itself against the layout written out element by element."""
    gen = torch.Generator().manual_seed(7)
    b, h, n, c = 5, 2, 3, 4
    caches = [
        strided_tensor((b, h, n, c), torch.float32, gen, order=(0, 2, 1, 3)) for _ in range(2)
    ]
    ids = [[4, 1], [0, 2]]
    t0, t1 = 2, 5
    lay = payload_layout(caches, 2, token_range=(t0, t1))
    buf = torch.empty(2, lay.nbytes // 4)
    gather(caches, ids, buf, token_range=(t0, t1), null_block_id=0, backend="reference")
    expect = torch.empty(2, lay.nbytes // 4)
    for s, row in enumerate(ids):
        pos = 0
        for cache in caches:
            for head in range(h):
                for tok in range(t0, t1):
                    blk = row[tok // n]
                    for ch in range(c):
                        v = 0.0 if blk == 0 else float(cache[blk, head, tok % n, ch])
                        expect[s, pos] = v
                        pos += 1
        assert pos == lay.data_numel == math.prod((2, h, t1 - t0, c))
    assert_bits_equal(buf, expect, "buffer")
