"""Helpers for the FastDeploy adapter's tests: paddle caches shaped as FastDeploy makes
them, their raw bytes, and store wrappers that inject latency or failures under the real
posix store."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import paddle
import torch
from ucm.core.config import PosixStoreConfig
from ucm.core.store import KeyResult, PosixStore, Status, Store, StoreUsage, Task
from ucm.core.store.base import check_batch
from ucm.fastdeploy import AttentionStore

LAYERS, HEADS, BLOCK, DIM, BLOCKS = 3, 2, 4, 8, 16


def shape(blocks: int = BLOCKS) -> list[int]:
    return [blocks, HEADS, BLOCK, DIM]


def bytes_per_layer_block(dtype: str = "bfloat16") -> int:
    return HEADS * BLOCK * DIM * (1 if dtype == "uint8" else 2)


def random_caches(
    seed: int, layers: int = LAYERS, blocks: int = BLOCKS, dtype: str = "bfloat16"
) -> tuple[list[paddle.Tensor], list[paddle.Tensor]]:
    """FastDeploy's per-layer K and V lists ``[num_blocks, kv_heads, block_size, head_dim]``,
    random bits (so that any misplaced byte shows)."""
    rng = np.random.default_rng(seed)

    def one() -> paddle.Tensor:
        if dtype == "uint8":
            return paddle.to_tensor(rng.integers(0, 256, shape(blocks), dtype=np.uint8))
        bits = rng.integers(-(1 << 15), 1 << 15, shape(blocks), dtype=np.int16)
        t = paddle.zeros(shape(blocks), dtype=dtype)
        torch.from_dlpack(t).view(torch.int16).copy_(torch.from_numpy(bits))
        return t

    return [one() for _ in range(layers)], [one() for _ in range(layers)]


def random_scales(seed: int, layers: int = LAYERS, blocks: int = BLOCKS) -> list[paddle.Tensor]:
    """Block-wise fp8 scales ``[num_blocks, kv_heads, block_size]`` in the default dtype."""
    rng = np.random.default_rng(seed)
    return [
        paddle.to_tensor(rng.random((blocks, HEADS, BLOCK), dtype=np.float32)).astype("bfloat16")
        for _ in range(layers)
    ]


def zeros_like(tensors: Sequence[paddle.Tensor]) -> list[paddle.Tensor]:
    return [paddle.zeros(t.shape, dtype=t.dtype) for t in tensors]


def block_bytes(tensor: paddle.Tensor, block: int) -> bytes:
    """The raw bits of one block of a cache (or scale) tensor."""
    t = torch.from_dlpack(tensor)[block].contiguous()
    return t.view(torch.uint8).numpy().tobytes()


def all_bytes(tensors: Sequence[paddle.Tensor]) -> list[bytes]:
    return [torch.from_dlpack(t).contiguous().view(torch.uint8).numpy().tobytes() for t in tensors]


def tokens(n_tokens: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50_000, n_tokens).tolist()


def make_store(path: str, **kwargs: Any) -> AttentionStore:
    """An AttentionStore over a posix store at ``path`` with the tests' shapes."""
    ucm_config = kwargs.pop("ucm_config", {})
    ucm_config = {"store": {"path": path}, **ucm_config}
    dtype = kwargs.pop("dtype", "bfloat16")
    args = {
        "layer_num": LAYERS,
        "block_token_size": BLOCK,
        "bytes_per_shard_layer_per_block": bytes_per_layer_block(dtype),
        "ucm_config": ucm_config,
        "environ": {},
        "model_version": "test-model",
        **kwargs,
    }
    return AttentionStore(**args)


def stored_files(path: str) -> list[str]:
    """Block files in a posix store directory."""
    root = os.path.join(path, "blocks")
    return sorted(
        name for _, _, names in os.walk(root) for name in names if not name.startswith(".")
    )


def block_path(path: str, key: bytes) -> str:
    h = key.hex()
    return os.path.join(path, "blocks", h[:2], h)


class WrappedStore(Store):
    """The real posix store underneath, with latency or failures injected per key.

    Dumps and loads run one key at a time on this wrapper's threads: each waits ``delay``
    seconds (unless the task was cancelled meanwhile), then asks the posix store.  Keys whose
    index in the whole sequence of dumped keys is in ``fail_dumps`` fail with an I/O error.
    """

    def __init__(
        self,
        path: str,
        dump_delay: float = 0.0,
        load_delay: float = 0.0,
        fail_dumps: set[int] | None = None,
        raise_on: set[str] | None = None,
    ) -> None:
        self.inner = PosixStore(PosixStoreConfig(path=path))
        self.dump_delay = dump_delay
        self.load_delay = load_delay
        self.fail_dumps = fail_dumps or set()
        self.raise_on = raise_on or set()
        self.dumped = 0  # keys handed to dump
        self.dump_calls = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="wrapped-store")

    def _maybe_raise(self, op: str) -> None:
        if op in self.raise_on:
            raise OSError(f"injected failure in {op}")

    def _run(self, n: int, delay: float, one: Any) -> Task:
        task = Task(n)

        def worker() -> None:
            for i in range(n):

                def work(i: int = i) -> KeyResult:
                    time.sleep(delay)
                    return one(i)

                task.run_key(i, work)

        self._pool.submit(worker)
        return task

    def dump(self, keys: Sequence[bytes], buffers: Sequence[object], layout: bytes = b"") -> Task:
        self._maybe_raise("dump")
        views = check_batch(keys, buffers, writable=False)
        with self._lock:
            first = self.dumped
            self.dumped += len(keys)
            self.dump_calls += 1

        def one(i: int) -> KeyResult:
            if first + i in self.fail_dumps:
                return KeyResult(Status.ERROR, "injected write error")
            return self.inner.dump([keys[i]], [views[i]], layout).wait()[0]

        return self._run(len(keys), self.dump_delay, one)

    def load(self, keys: Sequence[bytes], buffers: Sequence[object], layout: bytes = b"") -> Task:
        self._maybe_raise("load")
        views = check_batch(keys, buffers, writable=True)
        return self._run(
            len(keys),
            self.load_delay,
            lambda i: self.inner.load([keys[i]], [views[i]], layout).wait()[0],
        )

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        self._maybe_raise("lookup")
        return self.inner.lookup(keys)

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        self._maybe_raise("lookup")
        return self.inner.lookup_prefix(keys)

    def remove(self, keys: Sequence[bytes]) -> int:
        return self.inner.remove(keys)

    def usage(self) -> StoreUsage:
        return self.inner.usage()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.inner.close()
