"""Bad input raises a clear error (naming the argument and the value) before any write."""

from __future__ import annotations

import pytest
import torch
from ucm.lab.testing.kernels import assert_bits_equal, random_bits

from ucm.kernels import gather, payload_nbytes, scatter, triton_available

B, H, N, C, L, K = 6, 2, 4, 8, 3, 2

BACKENDS = [
    "reference",
    "torch",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            not triton_available("cpu"), reason="Triton on the CPU needs TRITON_INTERPRET=1"
        ),
    ),
]


def _setup(dtype=torch.bfloat16, scales=False):
    gen = torch.Generator().manual_seed(3)
    caches = [random_bits((B, H, N, C), dtype, gen) for _ in range(L)]
    sc = [random_bits((B, H), torch.float32, gen) for _ in range(L)] if scales else None
    nbytes = payload_nbytes(caches, K, scales=sc)
    buf_dtype = torch.uint8 if scales else dtype
    buffers = random_bits((2, nbytes // buf_dtype.itemsize), buf_dtype, gen)
    return caches, sc, buffers


# (description, change to the good arguments, exception, words the message must contain)
BAD = [
    ("id too large", dict(block_ids=[[1, 2], [3, B]]), ValueError, ["block_ids[1][1]", str(B)]),
    ("negative id", dict(block_ids=[[1, -1], [3, 4]]), ValueError, ["block_ids[0][1]", "-1"]),
    ("float ids", dict(block_ids=[[1.0, 2.0], [3.0, 4.0]]), TypeError, ["block_ids", "float"]),
    ("ragged ids", dict(block_ids=[[1, 2], [3]]), TypeError, ["block_ids"]),
    ("3-D ids", dict(block_ids=[[[1, 2]], [[3, 4]]]), ValueError, ["block_ids", "(2, 1, 2)"]),
    ("no ids", dict(block_ids=[]), ValueError, ["block_ids"]),
    ("wrong buffer dtype", dict(buffer_dtype=torch.float32), TypeError, ["buffers[0]", "float32"]),
    ("buffer too small", dict(buffer_shrink=2), ValueError, ["buffers[0]", "bytes"]),
    ("buffer rows", dict(buffer_rows=3), ValueError, ["buffers", "(3,"]),
    ("buffer list length", dict(buffer_list=1), ValueError, ["buffers has 1", "2 store blocks"]),
    ("buffer not contiguous", dict(buffer_strided=True), ValueError, ["buffers[0]", "contiguous"]),
    ("buffer misaligned", dict(buffer_misaligned=True), ValueError, ["buffers[0]", "aligned"]),
    ("buffers overlap", dict(buffer_overlap=True), ValueError, ["overlaps"]),
    ("cache dtype", dict(cache_dtype=(1, torch.float16)), TypeError, ["caches[1]", "float16"]),
    ("cache shape", dict(cache_shape=(2, (B, H, N + 1, C))), ValueError, ["caches[2]", "shape"]),
    ("cache rank", dict(cache_shape=(0, (B, H * N * C))), ValueError, ["caches[0]", "shape"]),
    ("unsupported dtype", dict(all_dtype=torch.float64), TypeError, ["caches[0]", "float64"]),
    ("no caches", dict(no_caches=True), ValueError, ["caches is empty"]),
    ("range past end", dict(token_range=(2, K * N + 1)), ValueError, ["token_range", str(K * N)]),
    ("empty range", dict(token_range=(3, 3)), ValueError, ["token_range"]),
    ("negative range", dict(token_range=(-1, 3)), ValueError, ["token_range"]),
    ("range not a pair", dict(token_range=5), TypeError, ["token_range"]),
    ("null out of range", dict(null_block_id=B), ValueError, ["null_block_id", str(B)]),
    ("backend", dict(backend="cuda-magic"), ValueError, ["backend", "cuda-magic"]),
]


def _apply(change, caches, scales, buffers):
    kw = {"block_ids": [[1, 2], [3, 4]], "token_range": None, "null_block_id": None}
    caches = list(caches)
    for key, value in change.items():
        if key in kw or key == "backend":
            kw[key] = value
        elif key == "buffer_dtype":
            buffers = torch.zeros(2, buffers.numel(), dtype=value)
        elif key == "buffer_shrink":
            buffers = buffers[:, :-value]
        elif key == "buffer_rows":
            buffers = torch.zeros(value, buffers.shape[1], dtype=buffers.dtype)
        elif key == "buffer_list":
            buffers = [buffers[0]] * value
        elif key == "buffer_strided":
            big = torch.zeros(2, buffers.shape[1] * 2, dtype=buffers.dtype)
            buffers = [big[0, ::2], big[1, ::2]]
        elif key == "buffer_misaligned":
            raw = torch.zeros(2 * buffers.numel() * buffers.element_size() + 2, dtype=torch.uint8)
            row = buffers.shape[1] * buffers.element_size()
            buffers = [raw[1 : 1 + row], raw[1 + row : 1 + 2 * row]]
        elif key == "buffer_overlap":
            buffers = [buffers[0], buffers[0]]
        elif key == "cache_dtype":
            i, dtype = value
            caches[i] = caches[i].view(torch.int16).to(dtype)
        elif key == "cache_shape":
            i, shape = value
            caches[i] = torch.zeros(shape, dtype=caches[i].dtype)
        elif key == "all_dtype":
            caches = [c.to(value) for c in caches]
        elif key == "no_caches":
            caches = []
        else:
            raise AssertionError(key)
    return caches, buffers, kw


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", [gather, scatter])
@pytest.mark.parametrize("desc,change,exc,words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_before_writing(backend, op, desc, change, exc, words) -> None:
    caches, scales, buffers = _setup()
    caches, buffers, kw = _apply(change, caches, scales, buffers)
    kw.setdefault("backend", backend)
    before_caches = [c.clone() for c in caches]
    before_buffers = [b.clone() for b in buffers] if isinstance(buffers, list) else buffers.clone()
    with pytest.raises(exc) as info:
        op(caches, kw.pop("block_ids"), buffers, **kw)
    message = str(info.value)
    for word in words:
        assert word in message, f"{desc}: {word!r} not in {message!r}"
    for c, b in zip(caches, before_caches):
        assert_bits_equal(c, b, "cache")
    if isinstance(buffers, list):
        for x, y in zip(buffers, before_buffers):
            assert_bits_equal(x, y, "buffer")
    else:
        assert_bits_equal(buffers, before_buffers, "buffer")


@pytest.mark.parametrize("backend", BACKENDS)
def test_scatter_refuses_a_block_twice(backend) -> None:
    caches, _, buffers = _setup()
    before = [c.clone() for c in caches]
    with pytest.raises(ValueError, match="engine block 3 appears 2 times"):
        scatter(caches, [[1, 3], [3, 4]], buffers, backend=backend)
    for c, b in zip(caches, before):
        assert_bits_equal(c, b, "cache")
    # ... but a repeat outside the token range, or of the null block, is fine
    scatter(
        caches,
        [[1, 3], [3, 4]],
        buffers[:, : buffers.shape[1] // 2],
        token_range=(0, N),
        backend=backend,
    )
    gather(caches, [[0, 3], [0, 4]], buffers, null_block_id=0, backend=backend)
    scatter(caches, [[0, 3], [0, 4]], buffers, null_block_id=0, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_checks(backend) -> None:
    caches8 = [c.view(torch.int16).to(torch.uint8) for c in _setup()[0]]
    gen = torch.Generator().manual_seed(1)
    scales = [random_bits((B, H), torch.float32, gen) for _ in range(L)]
    nbytes = payload_nbytes(caches8, K, scales=scales)
    assert nbytes == L * H * K * N * C + L * K * H * 4
    buf = torch.zeros(2, nbytes, dtype=torch.uint8)
    gather(caches8, [[1, 2], [3, 4]], buf, scales=scales, backend=backend)
    with pytest.raises(ValueError, match=r"scales has 2 tensors, caches has 3"):
        gather(caches8, [[1, 2], [3, 4]], buf, scales=scales[:2], backend=backend)
    with pytest.raises(ValueError, match=r"scales\[1\] has shape \(5, 2\)"):
        bad = [scales[0], scales[1][:5], scales[2]]
        gather(caches8, [[1, 2], [3, 4]], buf, scales=bad, backend=backend)
    with pytest.raises(TypeError, match=r"scales\[2\] has dtype torch.float16"):
        bad = [scales[0], scales[1], scales[2].half()]
        gather(caches8, [[1, 2], [3, 4]], buf, scales=bad, backend=backend)
    caches16 = _setup()[0]
    buf16 = torch.zeros(2, nbytes, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"buffers\[0\].*with scales.*uint8"):
        gather(caches16, [[1, 2], [3, 4]], buf16, scales=scales, backend=backend)


@pytest.mark.parametrize(
    "given",
    [[5, 0, 7], (5, 0, 7), [[1, 2], [3, 4], [0, 7]], [[3]], [True, 1], [2**63, 1], [1, -1]],
)
def test_block_ids_from_lists_are_what_a_tensor_of_them_gives(given) -> None:
    # lists of ints go a faster way (numpy); whatever they hold, ids and errors are those
    # of the same ids as a tensor, or of the checks a tensor goes through
    from ucm.kernels.validate import normalise_block_ids

    def outcome(ids):
        try:
            return normalise_block_ids(ids, 8)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            return type(exc)

    got = outcome(given)
    try:
        as_tensor = torch.as_tensor(given)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        assert isinstance(got, type) and issubclass(got, Exception), got  # refused too
        return
    want = outcome(as_tensor)
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == torch.int64
        assert got.shape == want.shape and torch.equal(got, want)
    else:
        assert got is want
