"""AttentionStore with caches on a CUDA GPU: the staged path (pinned buffers, the Triton
kernels on a side stream).  Skipped without a GPU.

FastDeploy's paddle GPU tensors reach the kernels as torch CUDA views through DLPack, so
these tests hand torch CUDA tensors directly: they need neither paddle nor this folder's
conftest (``pytest --noconftest`` runs them where paddle is not installed; ``shm_dir`` comes
from ucm.lab's pytest plugin: ``-p ucm.lab.pytest_plugin`` where ucm-lab is not installed).
"""

from __future__ import annotations

import pytest
import torch
from ucm.fastdeploy import AttentionStore

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LAYERS, HEADS, BLOCK, DIM, BLOCKS = 3, 2, 16, 64, 48


def _store(path: str, heads: int = HEADS, dim: int = DIM, **kwargs) -> AttentionStore:
    dtype = kwargs.pop("dtype", torch.bfloat16)
    per_layer = heads * BLOCK * dim * dtype.itemsize
    ucm_config = {"store": {"path": path}, **kwargs.pop("ucm_config", {})}
    return AttentionStore(
        layer_num=LAYERS,
        block_token_size=BLOCK,
        bytes_per_shard_layer_per_block=per_layer,
        ucm_config=ucm_config,
        environ={},
        model_version="test-model",
        **kwargs,
    )


def _random(seed: int, dtype: torch.dtype, device: str, shape=(BLOCKS, HEADS, BLOCK, DIM)):
    """Random bits of ``dtype`` (NaN payloads included): a misplaced byte shows."""
    gen = torch.Generator().manual_seed(seed)
    size = dtype.itemsize
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).to(device)


def _caches(seed: int, dtype: torch.dtype, device: str, heads: int = HEADS, dim: int = DIM):
    shape = (BLOCKS, heads, BLOCK, dim)
    return (
        [_random(seed * 100 + i, dtype, device, shape) for i in range(LAYERS)],
        [_random(seed * 100 + 50 + i, dtype, device, shape) for i in range(LAYERS)],
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().contiguous().view(torch.uint8)


def _tokens(n_blocks: int) -> list[int]:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, 50_000, (n_blocks * BLOCK,), generator=gen).tolist()


@pytest.mark.parametrize(
    ("heads", "dim"),
    [(HEADS, DIM), (8, 128)],  # blocks of 24 KiB: one step; of 384 KiB: 2 or 3 a 1 MiB step
)
def test_write_then_fresh_read_on_the_gpu_is_bit_exact(tmp_path, heads: int, dim: int) -> None:
    config = {"slice_write": {"slice_blocks": 7}, "pipeline_chunk_mb": 1}
    k, v = _caches(1, torch.bfloat16, "cuda", heads, dim)
    n = 30
    table = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(5))[:n].tolist()
    tokens = _tokens(n)
    writer = _store(str(tmp_path), heads, dim, ucm_config=config)
    assert writer.query("w", tokens, 0) == 0
    assert writer.write("w", k, v, tokens, table, 0) == n

    k2, v2 = _caches(2, torch.bfloat16, "cuda", heads, dim)  # other contents, overwritten
    before = [_bits(t) for t in k2 + v2]
    reader = _store(str(tmp_path), heads, dim, ucm_config=config)
    assert reader.query("r", tokens, 0) == n
    targets = list(range(BLOCKS - 1, BLOCKS - 1 - n, -1))
    assert reader.read("r", k2, v2, tokens, targets, 0) == n
    for layer, (src, dst, old) in enumerate(zip(k + v, k2 + v2, before, strict=True)):
        got, want = _bits(dst), _bits(src)
        for j in range(n):
            assert torch.equal(got[targets[j]], want[table[j]]), f"cache {layer}, block {j}"
        untouched = sorted(set(range(BLOCKS)) - set(targets))
        assert torch.equal(got[untouched], old[untouched]), f"cache {layer}: other blocks"


def test_fp8_with_scales_round_trip_on_the_gpu(tmp_path) -> None:
    k, v = _caches(3, torch.uint8, "cuda")
    ks = [_random(300 + i, torch.bfloat16, "cuda", (BLOCKS, HEADS, BLOCK)) for i in range(LAYERS)]
    vs = [_random(400 + i, torch.bfloat16, "cuda", (BLOCKS, HEADS, BLOCK)) for i in range(LAYERS)]
    n = 12
    tokens = _tokens(n)
    table = list(range(5, 5 + n))
    writer = _store(str(tmp_path), dtype=torch.uint8)
    assert writer.write("w", k, v, tokens, table, 0, key_scales=ks, val_scales=vs) == n

    k2, v2 = _caches(4, torch.uint8, "cuda")
    ks2 = [torch.zeros_like(s) for s in ks]
    vs2 = [torch.zeros_like(s) for s in vs]
    reader = _store(str(tmp_path), dtype=torch.uint8)
    ids = list(range(20, 20 + n))
    assert reader.read("r", k2, v2, tokens, ids, 0, key_scales=ks2, val_scales=vs2) == n
    for src, dst in zip(k + v + ks + vs, k2 + v2 + ks2 + vs2, strict=True):
        assert torch.equal(_bits(dst)[ids], _bits(src)[table])


@pytest.mark.parametrize(("write_on", "read_on"), [("cpu", "cuda"), ("cuda", "cpu")])
def test_blocks_move_between_cpu_and_gpu_caches(tmp_path, write_on: str, read_on: str) -> None:
    """The stored bytes do not depend on where the caches were: a block written from CPU
    caches (in place) reads into GPU caches (staged), and the other way round."""
    k, v = _caches(5, torch.bfloat16, write_on)
    n = 10
    tokens = _tokens(n)
    assert _store(str(tmp_path)).write("w", k, v, tokens, list(range(n)), 0) == n
    k2, v2 = _caches(6, torch.bfloat16, read_on)
    ids = list(range(BLOCKS - n, BLOCKS))
    assert _store(str(tmp_path)).read("r", k2, v2, tokens, ids, 0) == n
    for src, dst in zip(k + v, k2 + v2, strict=True):
        assert torch.equal(_bits(dst)[ids], _bits(src)[:n])


def test_write_sees_the_kernels_queued_before_it(tmp_path) -> None:
    """A write right after the forward pass queued its KV writes on the current stream
    (nothing synchronised) stores the new KV, not what the cache held before."""
    k, v = _caches(7, torch.bfloat16, "cuda")
    new_k, new_v = _caches(8, torch.bfloat16, "cuda")
    torch.cuda.synchronize()
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # keep the current stream busy for a while first
        big = big @ big / 64
    for dst, src in zip(k + v, new_k + new_v, strict=True):
        dst.copy_(src)  # queued behind the products
    n = 8
    tokens = _tokens(n)
    assert _store(str(tmp_path)).write("w", k, v, tokens, list(range(n)), 0) == n
    k2, v2 = _caches(9, torch.bfloat16, "cuda")
    assert _store(str(tmp_path)).read("r", k2, v2, tokens, list(range(n)), 0) == n
    for src, dst in zip(new_k + new_v, k2 + v2, strict=True):
        assert torch.equal(_bits(dst)[:n], _bits(src)[:n])


def _tier(path, **settings) -> AttentionStore:
    store = {"kind": "dram", "path": str(path), "capacity_gb": 0.0625}
    return _store(path, 8, 128, ucm_config={"store": store, **settings})


def _no_staging(monkeypatch: pytest.MonkeyPatch) -> None:
    from ucm.kernels.mover import Mover

    def staged(*args: object, **kwargs: object) -> None:
        raise AssertionError("a block went through a staging row")

    monkeypatch.setattr(Mover, "gather_rows", staged)
    monkeypatch.setattr(Mover, "scatter_rows", staged)


def test_gpu_blocks_move_straight_into_and_out_of_the_host_tier(shm_dir, monkeypatch) -> None:
    """With the dram store of scope host, the store's memory is registered with the driver
    and the DMA engine copies straight into its slots and out of its lent blocks."""
    _no_staging(monkeypatch)
    config = {"slice_write": {"slice_blocks": 7}, "pipeline_chunk_mb": 1}
    k, v = _caches(11, torch.bfloat16, "cuda", 8, 128)
    n = 30
    table = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(5))[:n].tolist()
    tokens = _tokens(n)
    with _tier(shm_dir, **config) as writer:
        assert writer.write("w", k, v, tokens, table, 0) == n
        assert len(writer._mover.pinned) == 1  # the arena, registered
    k2, v2 = _caches(12, torch.bfloat16, "cuda", 8, 128)
    before = [_bits(t) for t in k2 + v2]
    targets = list(range(BLOCKS - 1, BLOCKS - 1 - n, -1))
    with _tier(shm_dir, **config) as reader:
        assert reader.query("r", tokens, 0) == n
        assert reader.read("r", k2, v2, tokens, targets, 0) == n
    for src, dst, old in zip(k + v, k2 + v2, before, strict=True):
        got, want = _bits(dst), _bits(src)
        for j in range(n):
            assert torch.equal(got[targets[j]], want[table[j]]), f"block {j}"
        untouched = sorted(set(range(BLOCKS)) - set(targets))
        assert torch.equal(got[untouched], old[untouched])


def test_a_flipped_block_in_the_host_tier_stops_a_gpu_read(shm_dir, monkeypatch) -> None:
    from ucm.lab.testing.core import flip_shared_block_byte

    _no_staging(monkeypatch)
    k, v = _caches(13, torch.bfloat16, "cuda", 8, 128)
    n = 10
    tokens = _tokens(n)
    with _tier(shm_dir) as writer:
        assert writer.write("w", k, v, tokens, list(range(n)), 0) == n
        flip_shared_block_byte(shm_dir, writer.keyspace.keys(tokens, 0, n)[6], offset=4321)
    k2, v2 = _caches(14, torch.bfloat16, "cuda", 8, 128)
    ids = list(range(BLOCKS - n, BLOCKS))
    with _tier(shm_dir) as reader:
        assert reader.read("r", k2, v2, tokens, ids, 0) == 6
        assert reader.query("q", tokens, 0) == 6  # the corrupt block is gone
    for src, dst in zip(k + v, k2 + v2, strict=True):
        assert torch.equal(_bits(dst)[ids[:6]], _bits(src)[:6])
