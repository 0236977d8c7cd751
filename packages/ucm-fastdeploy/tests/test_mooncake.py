"""FastDeploy's AttentionStore and UCMStorage on the mooncake store kind: paddle tensors and
slice writes, with nothing changed but the store setting."""

from __future__ import annotations

import secrets
import time

import numpy as np
import pytest
from ucm.fastdeploy import UCMStorage
from ucm.lab.testing.fastdeploy import (
    BLOCK,
    BLOCKS,
    block_bytes,
    make_store,
    random_caches,
    tokens,
    zeros_like,
)


def mooncake(cluster, **overrides) -> dict:
    master, _ = cluster
    # the AttentionStore gives the pool no memory: blocks live in the segment server
    return {
        "kind": "mooncake", "master": master.address, "global_segment_gb": 0,
        "key_prefix": f"fd-{secrets.token_hex(4)}/", "timeout_s": 1.0, **overrides,
    }  # fmt: skip


def _write_through(fd, k, v, token_ids, table):
    match = fd.query("w", token_ids, 0)
    written = fd.write("w", k, v, token_ids, table[match:], match) if match < len(table) else 0
    return match, written


@pytest.mark.parametrize("copy", [True, False], ids=["in-place", "staged"])
def test_write_through_then_a_fresh_instance_reads(mooncake_pool, copy):
    store = mooncake(mooncake_pool)
    cfg = {"zero_copy": copy, "store": store}
    k, v = random_caches(1)
    prompt = tokens(5 * BLOCK + 3)
    table = [9, 2, 14, 5, 11]
    with make_store("unused", ucm_config=cfg) as fd:
        assert _write_through(fd, k, v, prompt, table) == (0, 5)
        assert _write_through(fd, k, v, prompt, table) == (5, 0)
    k2, v2 = zeros_like(k), zeros_like(v)
    with make_store("unused", ucm_config=cfg) as fd:  # a fresh instance: nothing of its own
        # FastDeploy holds block 0 already (start 1): blocks 1-4 come from the store
        assert fd.query("r", prompt, 1) == 4
        assert fd.read("r", k2, v2, prompt, [4, 6, 8, 10], 1) == 4
    for dst, src in zip((k2, v2), (k, v)):
        for layer in range(len(src)):
            for a, b in zip([4, 6, 8, 10], [2, 14, 5, 11]):
                assert block_bytes(dst[layer], a) == block_bytes(src[layer], b)


def test_slice_writes_leave_a_prefix_without_holes(mooncake_pool):
    blocks = BLOCKS - 2
    k, v = random_caches(2, blocks=BLOCKS)
    prompt = tokens(blocks * BLOCK, seed=4)
    env = {"AS_WRITE_SLICE_BLOCK_NUM": "3"}
    with make_store("unused", ucm_config={"store": mooncake(mooncake_pool)}, environ=env) as fd:
        assert fd.write("w", k, v, prompt, list(range(blocks)), 0) == blocks
        assert fd.query("q", prompt, 0) == blocks
        k2, v2 = zeros_like(k), zeros_like(v)
        assert fd.read("r", k2, v2, prompt, list(range(blocks)), 0) == blocks
        for layer in range(len(k)):
            for b in range(blocks):
                assert block_bytes(k2[layer], b) == block_bytes(k[layer], b)


def test_a_dead_master_never_raises_and_costs_no_wait(tmp_path):
    from ucm.lab.mooncake import LocalMaster

    with LocalMaster(log_path=str(tmp_path / "master.log")) as master:
        store = {**mooncake((master, None)), "global_segment_gb": 0.0625}
        k, v = random_caches(3)
        prompt = tokens(4 * BLOCK, seed=5)
        with make_store("unused", ucm_config={"store": store}) as fd:
            assert fd.write("w", k, v, prompt, [0, 1, 2, 3], 0) == 4
            master.kill()
            assert fd.query("q", prompt, 0) == 0  # the first call finds the master gone
            started = time.monotonic()
            for _ in range(10):
                assert fd.query("q", prompt, 0) == 0
                assert fd.write("w", k, v, prompt, [0, 1, 2, 3], 0) == 0
                assert fd.read("r", zeros_like(k), zeros_like(v), prompt, [0, 1, 2, 3], 0) == 0
            # a call that reached the dead master would take ~4 s; these took nothing
            assert time.monotonic() - started < 2.0


def test_ucm_storage_round_trip(mooncake_pool):
    stride, n = 4096, 4
    rng = np.random.default_rng(1)
    write = rng.integers(0, 256, 2 * n * stride, dtype=np.uint8)
    read = np.zeros_like(write)
    keys = [f"prefix_h{i}_0_key" for i in range(n)] + [f"prefix_h{i}_0_value" for i in range(n)]
    ptrs = [write.ctypes.data + i * stride for i in range(2 * n)]
    config = {"store": mooncake(mooncake_pool)}
    with UCMStorage(ucm_config=config, environ={}, namespace="m") as fd:
        fd.register_buffer(write.ctypes.data, write.nbytes)
        assert fd.batch_set(keys, ptrs, [stride] * 2 * n) == [0] * 2 * n
    with UCMStorage(ucm_config=config, environ={}, namespace="m") as fd:
        fd.register_buffer(read.ctypes.data, read.nbytes)
        got = fd.batch_get(
            keys, [read.ctypes.data + i * stride for i in range(2 * n)], [stride] * 2 * n
        )
        assert got == [stride] * 2 * n
    assert np.array_equal(read, write)
