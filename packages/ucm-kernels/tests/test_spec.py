"""Payload sizes, offsets, descriptors and logical views."""

from __future__ import annotations

import pytest
import torch
from ucm.lab.testing.kernels import assert_bits_equal, random_bits

from ucm.kernels import (
    CacheSpec,
    PayloadLayout,
    describe_caches,
    gather,
    logical_view,
    make_layout,
    payload_layout,
    payload_nbytes,
)


def test_sizes_for_a_realistic_vllm_layer_set() -> None:
    # 32 layers, 8 KV heads, head 128 (C = 256 with K|V), 16-token engine blocks, 256-token
    # store blocks: 1 MiB per layer, 32 MiB per store block.
    spec = CacheSpec(
        num_caches=32,
        num_blocks=100,
        num_heads=8,
        block_size=16,
        head_dim=256,
        dtype=torch.bfloat16,
    )
    lay = make_layout(spec, 16)
    assert lay.tokens_per_store_block == 256
    assert lay.tensor_numel == 8 * 256 * 256
    assert lay.nbytes == 32 * 2**20
    assert lay.tensor_offset(3) == 3 * 8 * 256 * 256
    assert lay.scale_nbytes == 0


def test_token_range_and_scale_offsets() -> None:
    spec = CacheSpec(
        num_caches=2,
        num_blocks=10,
        num_heads=2,
        block_size=4,
        head_dim=8,
        dtype=torch.uint8,
        scale_shape=(2,),
        scale_dtype=torch.float32,
    )
    lay = make_layout(spec, 3, (5, 11))  # tokens 5..10 touch blocks 1 and 2
    assert (lay.first_block, lay.end_block, lay.num_involved_blocks) == (1, 3, 2)
    assert lay.data_nbytes == 2 * 2 * 6 * 8
    assert lay.scale_nbytes == 2 * 2 * 8
    assert lay.scale_offset(0, 0) == lay.data_nbytes
    assert lay.scale_offset(1, 1) == lay.data_nbytes + 8 + 8 + 8
    assert lay.nbytes == lay.data_nbytes + lay.scale_nbytes


def test_descriptor_ignores_engine_block_size_but_not_layout() -> None:
    a = CacheSpec(
        num_caches=4, num_blocks=50, num_heads=2, block_size=16, head_dim=64, dtype=torch.float16
    )
    b = CacheSpec(
        num_caches=4,
        num_blocks=9,
        num_heads=2,
        block_size=32,
        head_dim=32,
        parts=2,
        dtype=torch.float16,
    )
    assert make_layout(a, 4).descriptor() == make_layout(b, 2).descriptor()
    assert make_layout(a, 4).descriptor() != make_layout(a, 4, (0, 32)).descriptor()
    assert make_layout(a, 4).descriptor() != make_layout(a, 2).descriptor()
    assert b"dtype=float16" in make_layout(a, 4).descriptor()


def test_payload_is_the_same_for_different_engine_block_sizes() -> None:
    """The canonical bytes do not depend on N: 4 blocks of 2 tokens == 2 blocks of 4."""
    gen = torch.Generator().manual_seed(0)
    small = random_bits((10, 2, 2, 3), torch.bfloat16, gen)  # [B, H, N=2, C]
    ids_small = [[4, 5, 6, 7]]
    big = torch.stack(  # blocks 2 and 3 of N=4 hold small blocks 4,5 and 6,7
        [torch.cat([small[2 * b], small[2 * b + 1]], dim=1) for b in range(5)]
    )
    out_a = torch.empty(1, payload_nbytes([small], 4) // 2, dtype=torch.bfloat16)
    out_b = torch.empty_like(out_a)
    gather([small], ids_small, out_a)
    gather([big], [[2, 3]], out_b)
    assert_bits_equal(out_a, out_b)


def test_layout_validation() -> None:
    spec = CacheSpec(
        num_caches=1, num_blocks=4, num_heads=1, block_size=4, head_dim=4, dtype=torch.float32
    )
    with pytest.raises(ValueError, match="token_range"):
        make_layout(spec, 2, (0, 9))
    with pytest.raises(ValueError, match="blocks_per_store_block"):
        PayloadLayout(spec, 0)
    with pytest.raises(TypeError, match="dtype"):
        CacheSpec(
            num_caches=1, num_blocks=4, num_heads=1, block_size=4, head_dim=4, dtype=torch.float64
        )
    with pytest.raises(ValueError, match="num_heads"):
        CacheSpec(
            num_caches=1, num_blocks=4, num_heads=0, block_size=4, head_dim=4, dtype=torch.float32
        )


def test_describe_normalises_mla_and_split_views() -> None:
    mla = [torch.zeros(7, 16, 576, dtype=torch.bfloat16)]
    spec = describe_caches(mla)
    assert (spec.num_heads, spec.block_size, spec.channels) == (1, 16, 576)
    kv = torch.zeros(2, 7, 16, 4, 64, dtype=torch.bfloat16)  # [2, B, N, H, D]
    view = logical_view(kv, "KBNHD")
    assert view.shape == (7, 4, 16, 2, 64)
    spec = describe_caches([view])
    assert (spec.num_heads, spec.parts, spec.head_dim, spec.channels) == (4, 2, 64, 128)
    assert (
        payload_layout([view], 2).descriptor()
        == payload_layout([torch.zeros(7, 4, 16, 128, dtype=torch.bfloat16)], 2).descriptor()
    )


def test_logical_view_letters() -> None:
    t = torch.zeros(5, 16, 4, 32)  # NHD
    assert logical_view(t, "BNHC").shape == (5, 4, 16, 32)
    assert logical_view(t, "BNHC").data_ptr() == t.data_ptr()
    assert logical_view(torch.zeros(5, 16, 64), "BNC").shape == (5, 1, 16, 64)
    for bad in ["BNH", "BNHX", "BNHH", "HNCD", "KNHD"]:
        with pytest.raises(ValueError, match="axes"):
            logical_view(t, bad)


def test_logical_view_kv_split_matches_concatenated_channels() -> None:
    """Gathering a [2, B, N, H, D] cache equals gathering the same data stored K|V."""
    gen = torch.Generator().manual_seed(5)
    kv = random_bits((2, 6, 4, 3, 8), torch.float16, gen)  # [2, B, N, H, D]
    concat = torch.cat([kv[0], kv[1]], dim=-1).permute(0, 2, 1, 3)  # [B, H, N, 2D]
    a = torch.empty(2, payload_nbytes([concat], 2) // 2, dtype=torch.float16)
    b = torch.empty_like(a)
    gather([logical_view(kv, "KBNHD")], [[1, 4], [5, 0]], a)
    gather([concat], [[1, 4], [5, 0]], b)
    assert_bits_equal(a, b)
