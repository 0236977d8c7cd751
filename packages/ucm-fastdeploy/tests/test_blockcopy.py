"""The CPU block copies give the kernels' canonical payload, byte for byte, and both paths
of the adapter read each other's blocks."""

from __future__ import annotations

import pytest
import torch
from fd_testing import (
    BLOCK,
    LAYERS,
    block_bytes,
    bytes_per_layer_block,
    make_store,
    random_caches,
    random_scales,
    tokens,
    zeros_like,
)
from ucm.fastdeploy.blockcopy import BlockCopier
from ucm.fastdeploy.tensors import check_caches
from ucm.kernels import gather, scatter


def _cacheset(dtype, scales):
    k, v = random_caches(1, dtype=dtype)
    ks, vs = (random_scales(2), random_scales(3)) if scales else (None, None)
    cs = check_caches(
        k,
        v,
        layer_num=LAYERS,
        block_token_size=BLOCK,
        bytes_per_shard_layer_per_block=bytes_per_layer_block(dtype),
        key_scales=ks,
        val_scales=vs,
    )
    return cs


@pytest.mark.parametrize(("dtype", "scales"), [("bfloat16", False), ("uint8", True)])
def test_gather_and_scatter_match_the_kernels(dtype, scales):
    cs = _cacheset(dtype, scales)
    ids = [7, 0, 15, 7, 3]  # a write may list a block twice
    ours = torch.zeros((len(ids), cs.nbytes), dtype=torch.uint8)
    theirs = torch.ones((len(ids), cs.nbytes), dtype=torch.uint8)
    BlockCopier(cs).gather(ids, ours)
    gather(list(cs.caches), ids, theirs, scales=list(cs.scales) if scales else None)
    assert torch.equal(ours, theirs)

    # scatter the payloads into other blocks of empty caches, both ways
    targets = [2, 4, 6, 8, 10]
    ours_cs = _empty_like(cs)
    theirs_cs = _empty_like(cs)
    BlockCopier(ours_cs).scatter(targets, ours)
    scatter(list(theirs_cs.caches), targets, ours,
            scales=list(theirs_cs.scales) if scales else None)  # fmt: skip
    for a, b in zip((*ours_cs.caches, *(ours_cs.scales or ())),
                    (*theirs_cs.caches, *(theirs_cs.scales or ()))):  # fmt: skip
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _empty_like(cs):
    import attrs

    caches = tuple(torch.zeros_like(t) for t in cs.caches)
    scales = None if cs.scales is None else tuple(torch.zeros_like(t) for t in cs.scales)
    return attrs.evolve(cs, caches=caches, scales=scales)


def test_non_contiguous_caches_go_through_the_kernels(store_path):
    k, v = random_caches(4, blocks=32)
    # every other block of a bigger allocation: a strided view the block copies cannot take
    ks, vs = [t[::2] for t in k], [t[::2] for t in v]
    prompt = tokens(3 * BLOCK, seed=4)
    with make_store(store_path) as fd:
        assert not BlockCopier.applies(fd._prepare(ks, vs, prompt, [1, 2, 3], 0, 1.0, None,
                                                   None, unique=False)[0])  # fmt: skip
        assert fd.write("w", ks, vs, prompt, [1, 2, 3], 0) == 3
    # read back with the block copies, and with the kernels only: the same bytes
    for cpu_block_copy in (True, False):
        k2, v2 = zeros_like(k[:1] * LAYERS), zeros_like(v[:1] * LAYERS)
        with make_store(store_path, ucm_config={"cpu_block_copy": cpu_block_copy}) as fd:
            assert fd.read("r", k2, v2, prompt, [5, 6, 7], 0) == 3
        for a, b in zip(k2, k):
            assert [block_bytes(a, j) for j in (5, 6, 7)] == [block_bytes(b, j) for j in (2, 4, 6)]
