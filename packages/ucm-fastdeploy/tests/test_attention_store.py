"""AttentionStore driven as FastDeploy's cache transfer manager drives it."""

from __future__ import annotations

import logging
import os

import attrs
import pytest
from ucm.lab.testing.fastdeploy import (
    BLOCK,
    BLOCKS,
    LAYERS,
    WrappedStore,
    all_bytes,
    block_bytes,
    block_path,
    bytes_per_layer_block,
    make_store,
    random_caches,
    random_scales,
    stored_files,
    tokens,
    zeros_like,
)


def _write_through(fd, k, v, token_ids, block_table, task="w"):
    """FastDeploy's write_back_storage_task: match from 0, write the rest from the match."""
    match = fd.query(task, token_ids, 0)
    if match >= len(block_table):
        return match, 0
    written = fd.write(task, k, v, token_ids, block_table[match:], match)
    return match, written


def _assert_blocks_equal(dst, src, dst_ids, src_ids):
    for layer, (d, s) in enumerate(zip(dst, src)):
        for a, b in zip(dst_ids, src_ids):
            assert block_bytes(d, a) == block_bytes(s, b), f"layer {layer} block {a} <- {b}"


COPIES = pytest.mark.parametrize("copy", [True, False], ids=["in-place", "staged"])


@COPIES
def test_write_through_then_fresh_instance_reads(store_path, copy):
    cfg = {"zero_copy": copy}
    k, v = random_caches(1)
    prompt = tokens(5 * BLOCK + 3)  # five full blocks and a partial one
    table = [9, 2, 14, 5, 11]  # FastDeploy's block table for the full blocks
    with make_store(store_path, ucm_config=cfg) as fd:
        assert _write_through(fd, k, v, prompt, table) == (0, 5)
        # the same prompt again: everything matched, nothing written
        assert _write_through(fd, k, v, prompt, table) == (5, 0)
        # a longer prompt sharing the prefix: only the new blocks are written
        longer = prompt[: 5 * BLOCK] + tokens(3 * BLOCK, seed=7)
        assert _write_through(fd, k, v, longer, [*table, 0, 1, 3]) == (5, 3)
    assert len(stored_files(store_path)) == 8

    # A fresh process: GPU already holds block 0 (start 1); blocks go to other ids.
    k2, v2 = zeros_like(k), zeros_like(v)
    with make_store(store_path, ucm_config=cfg) as fd:
        start = 1
        match = fd.query("r", longer, start)
        assert match == 7
        new_ids = [4, 6, 8, 10, 12, 13, 15, 0]  # FastDeploy allocates ceil(): one spare
        assert fd.read("r", k2, v2, longer, new_ids[:match], start) == 7
    _assert_blocks_equal(k2, k, new_ids[:7], [2, 14, 5, 11, 0, 1, 3])
    _assert_blocks_equal(v2, v, new_ids[:7], [2, 14, 5, 11, 0, 1, 3])
    untouched = [b for b in range(BLOCKS) if b not in new_ids[:7]]
    for t in k2 + v2:
        for b in untouched:
            assert block_bytes(t, b) == bytes(len(block_bytes(t, b)))


@COPIES
def test_fp8_caches_with_scales_round_trip(store_path, copy):
    cfg = {"zero_copy": copy}
    k, v = random_caches(2, dtype="uint8")
    ks, vs = random_scales(3), random_scales(4)
    prompt = tokens(4 * BLOCK, seed=3)
    table = [3, 1, 4, 15]
    with make_store(store_path, dtype="uint8", ucm_config=cfg) as fd:
        assert fd.write("w", k, v, prompt, table, 0, key_scales=ks, val_scales=vs) == 4
    k2, v2, ks2, vs2 = zeros_like(k), zeros_like(v), zeros_like(ks), zeros_like(vs)
    with make_store(store_path, dtype="uint8", ucm_config=cfg) as fd:
        assert fd.query("r", prompt, 0) == 4
        got = fd.read("r", k2, v2, prompt, [0, 2, 5, 7], 0, key_scales=ks2, val_scales=vs2)
        assert got == 4
        # a read without the scales is another layout: refused by the store, nothing read
        assert fd.read("r", zeros_like(k), zeros_like(v), prompt, [0, 1], 0) == 0
    for dst, src in ((k2, k), (v2, v), (ks2, ks), (vs2, vs)):
        _assert_blocks_equal(dst, src, [0, 2, 5, 7], table)


@COPIES
def test_read_stops_at_missing_and_corrupt_blocks(store_path, caplog, copy):
    k, v = random_caches(5)
    prompt = tokens(6 * BLOCK, seed=5)
    with make_store(store_path) as fd:
        assert fd.write("w", k, v, prompt, [0, 1, 2, 3, 4, 5], 0) == 6
        keys = fd.keyspace.keys(prompt, 0, 6)
    with open(block_path(store_path, keys[4]), "r+b") as f:  # flip a payload byte
        f.seek(4096 + 10)
        byte = f.read(1)
        f.seek(4096 + 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    k2, v2 = zeros_like(k), zeros_like(v)
    cfg = {"zero_copy": copy}
    with make_store(store_path, ucm_config=cfg) as fd, caplog.at_level(logging.WARNING):
        assert fd.read("r", k2, v2, prompt, [6, 7, 8, 9, 10, 11], 0) == 4
        assert "read 4 of 6 blocks" in caplog.text
        assert fd.query("q", prompt, 0) == 4  # the corrupt block was removed
        os.unlink(block_path(store_path, keys[1]))
        assert fd.query("q", prompt, 0) == 1
        k3, v3 = zeros_like(k), zeros_like(v)
        assert fd.read("r", k3, v3, prompt, [6, 7, 8, 9], 0) == 1
    _assert_blocks_equal(k2, k, [6, 7, 8, 9], [0, 1, 2, 3])
    if not copy:  # staged: nothing past the verified prefix was written
        for t in k2 + v2:
            assert block_bytes(t, 10) == bytes(len(block_bytes(t, 10)))
            assert block_bytes(t, 11) == bytes(len(block_bytes(t, 11)))
    # (in place, blocks 10 and 11 were loaded into before the check failed: FastDeploy
    # computes every block past the count it is given, as with its own backends)


def test_token_ids_cover_only_full_blocks(store_path):
    k, v = random_caches(6)
    prompt = tokens(2 * BLOCK + 1, seed=6)
    with make_store(store_path) as fd:
        # more ids than full blocks: the partial block has no key and is not stored
        assert fd.write("w", k, v, prompt, [0, 1, 2], 0) == 2
        assert fd.write("w", k, v, prompt, [2], 2) == 0
        assert fd.query("q", prompt, 0) == 2
        assert fd.query("q", prompt, 5) == 0
        assert fd.query("q", prompt[: BLOCK - 1], 0) == 0
    assert len(stored_files(store_path)) == 2


def test_failing_store_never_raises(store_path, caplog):
    k, v = random_caches(7)
    prompt = tokens(3 * BLOCK, seed=8)
    with make_store(store_path) as fd:
        assert fd.write("w", k, v, prompt, [0, 1, 2], 0) == 3
    for op in ("dump", "load", "lookup"):
        store = WrappedStore(store_path, raise_on={op})
        fd = make_store(store_path, store=store)
        with caplog.at_level(logging.WARNING):
            caplog.clear()
            other = tokens(3 * BLOCK, seed=9)
            wrote = fd.write("w", k, v, other, [0, 1, 2], 0)
            read = fd.read("r", zeros_like(k), zeros_like(v), prompt, [3, 4, 5], 0)
            matched = fd.query("q", prompt, 0)
        assert (wrote, read, matched) == {
            "dump": (0, 3, 3),
            "load": (3, 0, 3),
            "lookup": (3, 3, 0),
        }[op]
        assert "injected failure" in caplog.text
        store.close()


@COPIES
def test_read_timeout_returns_the_loaded_prefix(store_path, copy):
    k, v = random_caches(10)
    prompt = tokens(8 * BLOCK, seed=10)
    with make_store(store_path) as fd:
        assert fd.write("w", k, v, prompt, list(range(8)), 0) == 8
    store = WrappedStore(store_path, load_delay=0.3)
    fd = make_store(store_path, store=store, ucm_config={"zero_copy": copy})
    fd._mover.settings = attrs.evolve(fd._mover.settings, step_bytes=fd_block_nbytes())
    k2, v2 = zeros_like(k), zeros_like(v)
    got = fd.read("r", k2, v2, prompt, list(range(8, 16)), 0, timeout=0.45)
    assert 1 <= got < 8
    _assert_blocks_equal(k2, k, list(range(8, 8 + got)), list(range(got)))
    # when read returns, the store is done with the caches: nothing lands later
    after = [all_bytes([t]) for t in k2 + v2]
    store._pool.shutdown(wait=True)  # let every queued load run
    assert [all_bytes([t]) for t in k2 + v2] == after
    if not copy:  # staged: only the filled blocks were ever written
        for t in k2 + v2:
            assert all(
                block_bytes(t, b) == bytes(len(block_bytes(t, b))) for b in range(8 + got, 16)
            )
    store.close()


def test_in_place_needs_no_staging_and_other_layouts_are_staged(store_path, monkeypatch):
    k, v = random_caches(4, blocks=32)
    prompt = tokens(3 * BLOCK, seed=4)
    with make_store(store_path) as fd:

        def no_staging(*args):
            raise AssertionError("in place: no staging buffer")

        monkeypatch.setattr(fd._mover.pool, "take", no_staging)
        assert fd.write("w", k[:LAYERS], v[:LAYERS], prompt, [1, 2, 3], 0) == 3
        k2, v2 = zeros_like(k), zeros_like(v)
        assert fd.read("r", k2, v2, prompt, [7, 8, 9], 0) == 3
        _assert_blocks_equal(k2, k, [7, 8, 9], [1, 2, 3])
        monkeypatch.undo()
        # every other block of a bigger allocation: strided views, staged through the kernels
        import torch

        ks = [torch.from_dlpack(t)[::2] for t in k2]
        vs = [torch.from_dlpack(t)[::2] for t in v2]
        assert fd.read("r", ks, vs, prompt, [4, 5, 6], 0) == 3
        _assert_blocks_equal(k2, k, [8, 10, 12], [1, 2, 3])


def test_in_place_moves_keep_few_views_alive(store_path, monkeypatch):
    # Views made up front for every block of a long read or write would all stay alive
    # until it ends: thousands of objects for the garbage collector, whose full passes
    # then stall every I/O thread.  A block's views live only while it is moved: one block
    # a thread when written, a chunk of blocks a thread when read (ucm.core.store.chunks).
    import gc

    from ucm.core.store.chunks import CHUNK
    from ucm.core.store.posix import store as posix_store

    n = 1000
    k, v = random_caches(12, blocks=n)
    prompt = tokens(n * BLOCK, seed=12)
    live: list[int] = []
    real_write, real_read = os.pwritev, posix_store.read_blocks

    def views() -> int:
        return sum(type(o) is memoryview for o in gc.get_objects())

    def counted(call, sampled):
        def run(*args):
            if len(live) < 3 and sampled(*args):  # a few samples while blocks are moved
                live.append(views() - before)
            return call(*args)

        return run

    monkeypatch.setattr(os, "pwritev", counted(real_write, lambda fd, *_: fd > 0))
    monkeypatch.setattr(posix_store, "read_blocks", counted(real_read, lambda *_: True))
    with make_store(store_path, ucm_config={"store": {"path": store_path, "io_threads": 2}}) as fd:
        before = views()
        assert fd.write("w", k, v, prompt, list(range(n)), 0) == n
        written, live[:] = list(live), []
        k2, v2 = zeros_like(k), zeros_like(v)
        before = views()
        assert fd.read("r", k2, v2, prompt, list(range(n)), 0) == n
    parts = 2 * LAYERS  # views per block
    assert written and live
    assert max(written) < 8 * parts, written  # n * parts if made up front
    # a chunk a thread that reads (two I/O threads, the threads waiting for steps in flight)
    assert max(live) < 6 * (CHUNK + 1) * parts < n * parts / 4, live
    _assert_blocks_equal(k2, k, list(range(n)), list(range(n)))


def test_flush_token_index_keeps_residency(store_path):
    k, v = random_caches(11)
    prompt = tokens(4 * BLOCK + 2, seed=11)
    with make_store(store_path) as fd:
        assert fd.resident_blocks(prompt) == 0
        fd.write("w", k, v, prompt, [0, 1], 0)
        fd.flush_token_index("w", prompt, 0, False)
        assert fd.residency_of(prompt) == [frozenset({"store"})] * 2 + [frozenset()] * 2
        fd.flush_token_index("r", prompt, 0, True)  # after a read: all of it in HBM
        assert fd.resident_blocks(prompt) == 4
        assert fd.resident_blocks(prompt, 1) == 3
        assert fd.residency_of(prompt, 1)[0] == frozenset({"gpu", "store"})
        fd.flush_token_index("w", prompt, 2, False)  # blocks 2.. left HBM
        assert fd.resident_blocks(prompt) == 2
        assert fd.resident_blocks(prompt[: 3 * BLOCK] + [1, 2, 3, 4]) == 2  # same prefix
        with pytest.raises(TypeError, match="reside_in_gpu"):
            fd.flush_token_index("w", prompt, 0, 1)
        with pytest.raises(ValueError, match="start_block_idx"):
            fd.flush_token_index("w", prompt, -1, True)


def test_paddle_caches_are_not_copied(store_path):
    """The kernels see the paddle tensors' own memory (DLPack), so a read fills them."""
    import torch

    k, v = random_caches(12)
    prompt = tokens(BLOCK, seed=12)
    with make_store(store_path) as fd:
        fd.write("w", k, v, prompt, [3], 0)
        k2, v2 = zeros_like(k), zeros_like(v)
        ptrs = [t.data_ptr() for t in k2]
        assert fd.read("r", k2, v2, prompt, [0], 0) == 1
    assert [torch.from_dlpack(t).data_ptr() for t in k2] == ptrs
    assert all_bytes([k2[0][0:1]]) == all_bytes([k[0][3:4]])


def fd_block_nbytes() -> int:
    return 2 * LAYERS * bytes_per_layer_block()


def test_many_layers_many_steps(store_path):
    """Writes and reads that span several pipeline steps and slices."""
    blocks = 40
    k, v = random_caches(13, blocks=blocks)
    prompt = tokens(blocks * BLOCK, seed=13)
    table = list(range(blocks))[::-1]
    cfg = {"pipeline_chunk_mb": 1, "pipeline_depth": 2, "slice_write": {"slice_blocks": 7}}
    with make_store(store_path, ucm_config=cfg) as fd:
        fd._mover.settings = attrs.evolve(fd._mover.settings, step_bytes=3 * fd_block_nbytes())
        assert fd.write("w", k, v, prompt, table, 0) == blocks
        k2, v2 = zeros_like(k), zeros_like(v)
        assert fd.read("r", k2, v2, prompt, list(range(blocks)), 0) == blocks
    _assert_blocks_equal(k2, k, list(range(blocks)), table)
    _assert_blocks_equal(v2, v, list(range(blocks)), table)


def test_key_value_methods_are_left_to_ucm_storage(store_path):
    with make_store(store_path) as fd:
        for name in ("get", "batch_get", "set", "batch_set", "exists", "clear"):
            assert not hasattr(fd, name)


def test_torch_tensors_work_too(store_path):
    import torch

    k, v = random_caches(14)
    tk = [torch.from_dlpack(t) for t in k]
    tv = [torch.from_dlpack(t) for t in v]
    prompt = tokens(2 * BLOCK, seed=14)
    with make_store(store_path) as fd:
        assert fd.write("w", tk, tv, prompt, [5, 6], 0) == 2
        k2 = zeros_like(k)
        v2 = zeros_like(v)
        assert fd.read("r", k2, v2, prompt, [0, 1], 0) == 2
    _assert_blocks_equal(k2, k, [0, 1], [5, 6])


def test_paddle_import_is_not_needed_for_config():
    import subprocess
    import sys

    code = (
        "import sys; import ucm.fastdeploy.config; import ucm.fastdeploy; "
        "assert 'paddle' not in sys.modules and 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
