"""AttentionStore over the host tier (the dram store of scope host), blocks copied straight
into and out of the store's memory: no staging row, no copy on the store's threads.

On a GPU that is every call (tests in test_cuda.py); on the CPU it is caches whose blocks
are not runs of memory (here: token-major blocks seen as FastDeploy's head-major shape) and
large enough to copy as fast as into rows.  The store's checks stay: a block flipped in
shared memory stops a read there and is dropped.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from ucm.core.store import SharedMemoryStore
from ucm.core.store.dram.arena import WRITING
from ucm.fastdeploy import AttentionStore
from ucm.kernels.mover import Mover
from ucm.lab.testing.core import flip_shared_block_byte

LAYERS, HEADS, BLOCK, DIM, BLOCKS = 4, 8, 64, 128, 24  # bf16: 1 MiB a block, every layer


def _store(path: Path, heads: int = HEADS, **settings) -> AttentionStore:
    store = {"kind": "dram", "path": str(path), "capacity_gb": 0.0625}
    return AttentionStore(
        layer_num=LAYERS,
        block_token_size=BLOCK,
        bytes_per_shard_layer_per_block=heads * BLOCK * DIM * 2,
        ucm_config={"store": store, **settings},
        environ={},
        model_version="test-model",
    )


def _caches(seed: int, heads: int = HEADS) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer K and V ``[blocks, heads, block, dim]`` whose memory is token-major
    (``[blocks, block, heads, dim]``): a block's head is not one run of memory."""
    gen = torch.Generator().manual_seed(seed)

    def one() -> torch.Tensor:
        raw = torch.randint(
            0, 256, (BLOCKS, BLOCK, heads, DIM * 2), dtype=torch.uint8, generator=gen
        )
        return raw.view(torch.bfloat16).permute(0, 2, 1, 3)

    return [one() for _ in range(LAYERS)], [one() for _ in range(LAYERS)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _tokens(n_blocks: int) -> list[int]:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, 50_000, (n_blocks * BLOCK,), generator=gen).tolist()


def _no_staging(monkeypatch: pytest.MonkeyPatch) -> None:
    def staged(*args: object, **kwargs: object) -> None:
        raise AssertionError("a block went through a staging row")

    monkeypatch.setattr(Mover, "gather_rows", staged)
    monkeypatch.setattr(Mover, "scatter_rows", staged)


def test_blocks_move_straight_into_and_out_of_the_host_tier(shm_dir, monkeypatch) -> None:
    _no_staging(monkeypatch)
    k, v = _caches(1)
    n = 14
    table = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(5))[:n].tolist()
    tokens = _tokens(n)
    with _store(shm_dir, slice_write={"slice_blocks": 5}, pipeline_chunk_mb=3) as writer:
        assert writer.write("w", k, v, tokens, table, 0) == n
    k2, v2 = _caches(2)
    before = [_bits(t) for t in k2 + v2]
    targets = list(range(BLOCKS - 1, BLOCKS - 1 - n, -1))
    with _store(shm_dir, pipeline_chunk_mb=3) as reader:  # a fresh engine on the same host
        assert reader.query("r", tokens, 0) == n
        assert reader.read("r", k2, v2, tokens, targets, 0) == n
    for src, dst, old in zip(k + v, k2 + v2, before, strict=True):
        got, want = _bits(dst), _bits(src)
        for j in range(n):
            assert torch.equal(got[targets[j]], want[table[j]]), f"block {j}"
        untouched = sorted(set(range(BLOCKS)) - set(targets))
        assert torch.equal(got[untouched], old[untouched])


def test_a_flipped_block_stops_the_read_there_and_is_dropped(shm_dir, monkeypatch) -> None:
    _no_staging(monkeypatch)
    k, v = _caches(3)
    n = 8
    tokens = _tokens(n)
    with _store(shm_dir) as writer:
        assert writer.write("w", k, v, tokens, list(range(n)), 0) == n
        flip_shared_block_byte(shm_dir, writer.keyspace.keys(tokens, 0, n)[5], offset=777)
    k2, v2 = _caches(4)
    ids = list(range(BLOCKS - n, BLOCKS))
    with _store(shm_dir, pipeline_chunk_mb=2) as reader:  # steps of 2: the third stops
        assert reader.read("r", k2, v2, tokens, ids, 0) == 5
        assert reader.query("q", tokens, 0) == 5  # the corrupt block is gone
    for src, dst in zip(k + v, k2 + v2, strict=True):
        assert torch.equal(_bits(dst)[ids[:5]], _bits(src)[:5])


def test_small_blocks_and_zero_copy_off_are_staged(shm_dir, monkeypatch) -> None:
    """Below 1 MiB a block copies faster into rows than into slots apart; zero_copy false
    stages everything.  Both store the same bytes."""
    calls = {"gather": 0, "scatter": 0}
    gather, scatter = Mover.gather_rows, Mover.scatter_rows

    def counted_gather(self, *args):
        calls["gather"] += 1
        return gather(self, *args)

    def counted_scatter(self, *args):
        calls["scatter"] += 1
        return scatter(self, *args)

    monkeypatch.setattr(Mover, "gather_rows", counted_gather)
    monkeypatch.setattr(Mover, "scatter_rows", counted_scatter)
    n = 6
    tokens = _tokens(n)
    for heads, settings in ((2, {}), (HEADS, {"zero_copy": False})):
        calls.update(gather=0, scatter=0)
        folder = shm_dir / f"h{heads}"
        k, v = _caches(5, heads)
        with _store(folder, heads, **settings) as writer:
            assert writer.write("w", k, v, tokens, list(range(n)), 0) == n
        k2, v2 = _caches(6, heads)
        with _store(folder, heads, **settings) as reader:
            assert reader.read("r", k2, v2, tokens, list(range(n)), 0) == n
        assert calls["gather"] > 0 and calls["scatter"] > 0, (heads, settings)
        for src, dst in zip(k + v, k2 + v2, strict=True):
            assert torch.equal(_bits(dst)[:n], _bits(src)[:n])


def test_a_step_the_store_has_no_room_for_goes_through_rows_in_order(shm_dir, monkeypatch) -> None:
    """Steps copied into the store's memory and steps through rows mix in one call (the
    store lent or reserved nothing for one): every block lands, and the stored prefix is
    counted in order."""
    calls = {"open_writes": 0, "open_reads": 0, "gather": 0, "scatter": 0}

    def every_third_refused(name: str, real):
        def call(self, *args, **kwargs):
            calls[name] += 1
            return None if calls[name] % 3 == 2 else real(self, *args, **kwargs)

        return call

    def counted(name: str, real):
        def call(self, *args, **kwargs):
            calls[name] += 1
            return real(self, *args, **kwargs)

        return call

    for name in ("open_writes", "open_reads"):
        real = getattr(SharedMemoryStore, name)
        monkeypatch.setattr(SharedMemoryStore, name, every_third_refused(name, real))
    monkeypatch.setattr(Mover, "gather_rows", counted("gather", Mover.gather_rows))
    monkeypatch.setattr(Mover, "scatter_rows", counted("scatter", Mover.scatter_rows))
    k, v = _caches(7)
    n = 11
    tokens = _tokens(n)
    with _store(shm_dir, pipeline_chunk_mb=2) as writer:  # steps of 2 blocks: 6 steps
        assert writer.write("w", k, v, tokens, list(range(n)), 0) == n
    k2, v2 = _caches(8)
    ids = list(range(BLOCKS - n, BLOCKS))
    with _store(shm_dir, pipeline_chunk_mb=2) as reader:
        assert reader.read("r", k2, v2, tokens, ids, 0) == n
    assert calls["open_writes"] == 6 and calls["gather"] == 2, calls
    assert calls["open_reads"] == 6 and calls["scatter"] == 2, calls
    for src, dst in zip(k + v, k2 + v2, strict=True):
        assert torch.equal(_bits(dst)[ids], _bits(src)[:n])


def _eventually(condition, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def _slowed(monkeypatch: pytest.MonkeyPatch, name: str, seconds: float) -> None:
    """Make the store's threads take ``seconds`` a chunk for ``name`` (seals or checks)."""
    real = getattr(SharedMemoryStore, name)

    def slow(self, *args, **kwargs):
        time.sleep(seconds)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(SharedMemoryStore, name, slow)


def test_a_write_into_the_tier_cut_by_its_deadline_leaves_exactly_its_prefix(
    shm_dir, monkeypatch
) -> None:
    _slowed(monkeypatch, "_seal_chunk", 0.25)  # a chunk a step of 2 blocks: 0.75 s on 2 threads
    k, v = _caches(9)
    n = 12
    tokens = _tokens(n)
    with _store(shm_dir, pipeline_chunk_mb=2, cancel_grace_s=1.0) as writer:
        written = writer.write("w", k, v, tokens, list(range(n)), 0, timeout=0.6)
        assert 0 < written < n, written
        arena = writer.store._attached()
        # once the seals cancelled in flight have ended: no slot left reserved
        assert _eventually(lambda: int((arena.np["state"] == WRITING).sum()) == 0)
        assert writer.query("q", tokens, 0) == written
        assert writer.store.usage().blocks == written  # nothing past the prefix


def test_a_read_out_of_the_tier_cut_by_its_deadline_gives_every_block_back(
    shm_dir, monkeypatch
) -> None:
    k, v = _caches(10)
    n = 12
    tokens = _tokens(n)
    with _store(shm_dir) as writer:
        assert writer.write("w", k, v, tokens, list(range(n)), 0) == n
    _slowed(monkeypatch, "_check_chunk", 0.15)
    k2, v2 = _caches(11)
    ids = list(range(BLOCKS - n, BLOCKS))
    with _store(shm_dir, pipeline_chunk_mb=2, cancel_grace_s=1.0) as reader:
        filled = reader.read("r", k2, v2, tokens, ids, 0, timeout=0.4)
        assert filled < n, filled
        for src, dst in zip(k + v, k2 + v2, strict=True):
            assert torch.equal(_bits(dst)[ids[:filled]], _bits(src)[:filled])
        arena = reader.store._attached()
        # once the checks in progress when the loans ended have finished: no pin left
        assert _eventually(lambda: int(arena.np["pins"].sum()) == 0)
        assert reader.query("q", tokens, 0) == n  # cut short, nothing dropped
