"""block_segments: the payload as views of the cache memory, byte for byte what gather makes."""

from __future__ import annotations

import pytest
import torch
from ucm.lab.testing.kernels import random_bits

from ucm.kernels import block_segments, gather, payload_nbytes, scatter


def _join(parts) -> bytes:
    return b"".join(bytes(p) for p in parts)


def _gathered(caches, ids, **kwargs) -> list[bytes]:
    n = payload_nbytes(caches, len(ids[0]) if isinstance(ids[0], list) else 1, **kwargs)
    buf = torch.zeros(len(ids), n, dtype=torch.uint8)
    gather(caches, ids, buf, backend="reference", **kwargs)
    return [bytes(row.numpy()) for row in buf]


def _fd_caches(gen, layers=3, blocks=6, dtype=torch.bfloat16):
    return [random_bits((blocks, 2, 4, 8), dtype, gen) for _ in range(2 * layers)]


def test_fastdeploy_layout_is_its_own_payload():
    gen = torch.Generator().manual_seed(1)
    caches = _fd_caches(gen)
    ids = [5, 0, 3, 3]  # any order, repeats
    segments = block_segments(caches, ids)
    assert segments is not None and [len(p) for p in segments] == [6] * 4
    assert [_join(p) for p in segments] == _gathered(caches, ids)
    # the views are the caches' memory: writing through them writes the blocks
    segments[1][2][:] = bytes(segments[1][2].nbytes)
    assert not caches[2][0].view(torch.int16).any() and caches[2][1].view(torch.int16).any()


def test_segments_index_and_slice_like_a_list():
    caches = _fd_caches(torch.Generator().manual_seed(6))
    segments = block_segments(caches, [5, 0, 3, 1])
    assert segments is not None and len(segments) == 4
    expected = _gathered(caches, [5, 0, 3, 1])
    assert [_join(p) for p in segments[1:3]] == expected[1:3]
    assert _join(segments[-1]) == expected[3] and segments[4:] == []
    with pytest.raises(IndexError):
        segments[4]


def test_fp8_scales_follow_the_data():
    gen = torch.Generator().manual_seed(2)
    caches = _fd_caches(gen, dtype=torch.uint8)
    scales = [random_bits((6, 2, 4), torch.float32, gen) for _ in caches]
    segments = block_segments(caches, [4, 1], scales=scales)
    assert segments is not None and len(segments[0]) == 12
    assert [_join(p) for p in segments] == _gathered(caches, [4, 1], scales=scales)
    assert segments.nbytes == len(_join(segments[0])) == payload_nbytes(caches, 1, scales=scales)


def test_single_head_caches_span_engine_blocks_and_token_ranges():
    gen = torch.Generator().manual_seed(3)
    caches = [random_bits((8, 4, 16), torch.float16, gen) for _ in range(2)]  # MLA [B, N, C]
    ids = [[1, 6, 2], [7, 0, 3]]
    for token_range in (None, (2, 11), (5, 7)):
        segments = block_segments(caches, ids, token_range=token_range)
        assert segments is not None
        assert [_join(p) for p in segments] == _gathered(caches, ids, token_range=token_range)
        assert segments.nbytes == len(_join(segments[1]))


def _heads(g, shape=(6, 2, 4, 8)):
    return random_bits(shape, torch.float16, g)


@pytest.mark.parametrize(
    "why, make",
    [
        ("heads interleave over blocks", lambda g: ([_heads(g)], [[0, 1]], {})),
        ("tokens not outermost", lambda g: ([_heads(g, (6, 4, 2, 8)).transpose(1, 2)], [0], {})),
        ("a part of a block with heads", lambda g: ([_heads(g)], [0], {"token_range": (1, 3)})),
        ("a null block", lambda g: ([_heads(g)], [0, 5], {"null_block_id": 5})),
    ],
)
def test_layouts_without_runs_give_none(why, make):
    caches, ids, kwargs = make(torch.Generator().manual_seed(4))
    assert block_segments(caches, ids, **kwargs) is None, why


def test_arguments_are_checked_like_gather():
    caches = [torch.zeros(4, 2, 4, 8, dtype=torch.float16)]
    with pytest.raises(ValueError, match=r"block_ids\[1\]\[0\] = 4 is out of range"):
        block_segments(caches, [0, 4])
    with pytest.raises(TypeError, match="caches must be a list"):
        block_segments(caches[0], [0])


def test_the_fallback_copies_runs_both_ways():
    gen = torch.Generator().manual_seed(5)
    caches = _fd_caches(gen, dtype=torch.uint8)
    scales = [random_bits((6, 2, 4), torch.float32, gen) for _ in caches]
    n = payload_nbytes(caches, 1, scales=scales)
    buf = torch.zeros(3, n, dtype=torch.uint8)
    assert gather(caches, [2, 5, 0], buf, scales=scales, backend="torch") == "torch"
    assert [bytes(r.numpy()) for r in buf] == _gathered(caches, [2, 5, 0], scales=scales)
    target = [torch.zeros_like(c) for c in caches]
    target_scales = [torch.zeros_like(s) for s in scales]
    scatter(target, [1, 3, 4], buf, scales=target_scales, backend="torch")
    for c, t, s, ts in zip(caches, target, scales, target_scales):
        assert torch.equal(t[[1, 3, 4]], c[[2, 5, 0]]) and not t[[0, 2, 5]].any()
        assert torch.equal(ts[[1, 3, 4]].view(torch.int32), s[[2, 5, 0]].view(torch.int32))
