"""UCM's FastDeploy backend, driven as FastDeploy's cache transfer manager drives it, on the CPU.

FastDeploy builds its storage backend in each cache transfer manager process from its own
command line and takes UCM's settings from the YAML file named by ``UCM_CONFIG_FILE``. This
script does the same with paddle CPU tensors for the KV caches:

1. this process writes two finished requests the way ``write_back_storage_task`` does
   (``query`` from block 0, ``write`` the rest from the match, ``flush_token_index``); the
   second request shares most of its prompt with the first, so only its new blocks are written;
2. a fresh process (a restart, or another FastDeploy instance on the same store) builds the
   backend again and reads the second request back the way ``read_storage_task`` does, into
   other cache blocks, checks every byte, and prints the hits.

    python examples/fastdeploy/run_backend.py                    # posix store in a temp folder
    python examples/fastdeploy/run_backend.py --config ucm.yaml  # your settings
    python examples/fastdeploy/run_backend.py --backend file     # the KVCacheStorage path

The line numbers below are those of fastdeploy/cache_manager/cache_transfer_manager.py
listed in docs/fastdeploy.md (section "FastDeploy's calls").
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

with warnings.catch_warnings():  # paddle warns at import that ccache is missing: irrelevant
    warnings.filterwarnings("ignore", message="No ccache found")
    import paddle

from ucm.core.settings import ConfigError  # noqa: E402
from ucm.fastdeploy import AttentionStore, UCMStorage  # noqa: E402

MODEL = "ERNIE-4.5-0.3B-Paddle"  # FastDeploy's namespace is the model folder's name
SHARED, NEW_A, NEW_B, TAIL = 6, 2, 4, 3  # blocks shared by both prompts, new blocks, extra tokens


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["attention_store", "file"], default="attention_store")
    p.add_argument("--config", help="UCM's YAML settings (default: a posix store in --workdir)")
    p.add_argument("--model", help="the model folder (default: a tiny stand-in in --workdir)")
    p.add_argument("--workdir", help="folder for the store and the model (default: a temp one)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--block-size", type=int, default=16, help="tokens per block")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument(
        "--phase", choices=["all", "write", "read"], default="all", help=argparse.SUPPRESS
    )
    return p.parse_args()


# -- what FastDeploy has: a model folder, its KV caches, the prompts --------------------------


def make_model(folder: Path) -> None:
    """A stand-in model folder: config.json and a one-tensor safetensors file, whose digests
    name the model in UCM's keys (``model_path`` in the YAML)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["Ernie4_5_ForCausalLM"]}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    data = np.arange(4, dtype=np.float32).tobytes()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + data)


def caches(args: argparse.Namespace, num_blocks: int, seed: int | None) -> tuple[list, list]:
    """FastDeploy's per-layer K and V caches ``[num_blocks, kv_heads, block_size, head_dim]``
    in bfloat16: random (the same for the same seed in any process) or zero."""
    shape = [num_blocks, args.kv_heads, args.block_size, args.head_dim]
    rng = np.random.default_rng(seed)

    def one() -> paddle.Tensor:
        if seed is None:
            return paddle.zeros(shape, dtype="bfloat16")
        return paddle.to_tensor(rng.standard_normal(shape, dtype=np.float32)).astype("bfloat16")

    return [one() for _ in range(args.layers)], [one() for _ in range(args.layers)]


def prompts(args: argparse.Namespace) -> tuple[list[int], list[int], list[int]]:
    """Request A, request B (A's first SHARED blocks, then its own, then a partial block) and
    request C, which nobody wrote."""
    rng = np.random.default_rng(7)
    bs = args.block_size
    shared = rng.integers(0, 100_000, SHARED * bs).tolist()
    a = shared + rng.integers(0, 100_000, NEW_A * bs).tolist()
    b = shared + rng.integers(0, 100_000, NEW_B * bs + TAIL).tolist()
    c = rng.integers(0, 100_000, len(b)).tolist()
    return a, b, c


def block_hashes(token_ids: list[int], block_size: int) -> list[str]:
    """The prefix cache manager's chained block hashes (the string keys of the file path)."""
    out, prior = [], b""
    for i in range(len(token_ids) // block_size):
        h = hashlib.sha256(
            prior + np.array(token_ids[i * block_size : (i + 1) * block_size]).tobytes()
        )
        out.append(h.hexdigest())
        prior = h.digest()
    return out


# -- the backends, built and called as cache_transfer_manager.py does -------------------------


class AttentionStorePath:
    """``--kvcache-storage-backend attention_store``."""

    def __init__(self, args: argparse.Namespace, rank: int = 0, n_ranks: int = 1) -> None:
        item_bytes = 2  # bfloat16
        layer_block_bytes = args.kv_heads * args.block_size * args.head_dim * item_bytes
        self.bs = args.block_size
        self.backend = AttentionStore(  # _init_storage, :297
            namespace=MODEL,
            shard_id=rank,
            shard_num=n_ranks,
            layer_num=args.layers,
            block_token_size=args.block_size,
            bytes_per_shard_layer_per_block=layer_block_bytes,
            device_id=0,
            dp_id=0,
        )

    def write_back(self, task_id, k, v, token_ids, block_ids):
        match = self.backend.query(task_id, token_ids, 0, 30.0)  # :903
        if match >= len(block_ids):  # :906: nothing new
            return match, 0
        written = self.backend.write(  # :864, start_write_block_idx = match
            task_id, k, v, token_ids, block_ids[match:], match, 30.0
        )
        self.backend.flush_token_index(task_id, token_ids, 0, False)  # :939 (rank 0)
        return match, written

    def read(self, task_id, k, v, token_ids, block_ids):
        match = self.backend.query(task_id, token_ids, 0, 30.0)  # :712
        read = 0
        if match > 0:
            read = self.backend.read(  # :673, token_ids cut to the match (:729)
                task_id, k, v, token_ids[: match * self.bs], block_ids[:match], 0, 30.0
            )
            self.backend.flush_token_index(task_id, token_ids, 0, True)  # :750 (rank 0)
        return match, read

    def close(self) -> None:
        self.backend.close()


class FilePath:
    """``--kvcache-storage-backend file`` with UCMStorage in FastDeploy's FileStore's place:
    KV goes through registered host buffers laid out ``[block, layer, heads, tokens, dim]``,
    under FastDeploy's string keys."""

    def __init__(
        self, args: argparse.Namespace, rank: int = 0, n_ranks: int = 1, max_blocks: int = 64
    ) -> None:
        self.rank, self.bs = rank, args.block_size
        self.backend = UCMStorage(namespace=MODEL, tp_rank=rank, tp_size=n_ranks)  # :313
        # _init_storage_buffer (:340): one buffer to read into, one to write from, [K | V]
        self.stride = args.layers * args.kv_heads * args.block_size * args.head_dim * 2
        self.half = max_blocks * self.stride
        self.buffers = {}
        for name in ("read", "write"):
            buf = np.zeros(2 * self.half, dtype=np.uint8)
            self.buffers[name] = buf
            self.backend.register_buffer(buf.ctypes.data, buf.nbytes)  # :364, :369

    def _keys(self, token_ids: list[int]) -> tuple[list[str], list[str]]:
        hashes = block_hashes(token_ids, self.bs)
        return (
            [f"prefix_{h}_{self.rank}_key" for h in hashes],
            [f"prefix_{h}_{self.rank}_value" for h in hashes],
        )

    def _swap(
        self, caches: list, base: int, gpu_ids: list[int], cpu_ids: list[int], mode: int
    ) -> None:
        """swap_cache_layout, FastDeploy's compiled op, on the CPU: 0 caches -> buffer."""
        for gpu_id, cpu_id in zip(gpu_ids, cpu_ids):
            for layer, t in enumerate(caches):
                nbytes = math.prod(t.shape[1:]) * t.element_size()
                cache = t.data_ptr() + gpu_id * nbytes
                host = base + (cpu_id * len(caches) + layer) * nbytes
                ctypes.memmove(*((host, cache) if mode == 0 else (cache, host)), nbytes)

    def _locations(self, name: str, cpu_ids: list[int]) -> list[int]:
        base = self.buffers[name].ctypes.data
        return [base + i * self.stride for i in cpu_ids] + [
            base + self.half + i * self.stride for i in cpu_ids
        ]

    def write_back(self, task_id, k, v, token_ids, block_ids):
        kk, vk = self._keys(token_ids)
        cpu_ids = list(range(len(block_ids)))
        # write_back_storage_task means to query first (:899); its test at :898 compares the
        # backend's name with a tuple, so FastDeploy skips it and stores every block again
        match = self.backend.query(kk, vk, None, None, 30.0)
        if match >= len(kk):
            return match, 0
        kk, vk, block_ids, cpu_ids = kk[match:], vk[match:], block_ids[match:], cpu_ids[match:]
        base = self.buffers["write"].ctypes.data
        self._swap(k, base, block_ids, cpu_ids, 0)  # :786
        self._swap(v, base + self.half, block_ids, cpu_ids, 0)
        codes = self.backend.batch_set(  # :848
            keys=kk + vk,
            target_locations=self._locations("write", cpu_ids),
            target_sizes=[self.stride] * 2 * len(kk),
        )
        n = len(kk)
        return match, sum(1 for i in range(n) if codes[i] == 0 and codes[n + i] == 0)

    def read(self, task_id, k, v, token_ids, block_ids):
        kk, vk = self._keys(token_ids)
        match = self.backend.query(kk, vk, None, None, 30.0)  # :708
        cpu_ids = list(range(match))
        codes = self.backend.batch_get(  # :597
            keys=kk[:match] + vk[:match],
            target_locations=self._locations("read", cpu_ids),
            target_sizes=[self.stride] * 2 * match,
        )
        read = 0  # the leading blocks whose K and V both loaded (:612)
        while read < match and codes[read] > 0 and codes[match + read] > 0:
            read += 1
        base = self.buffers["read"].ctypes.data
        self._swap(k, base, block_ids[:read], cpu_ids[:read], 1)  # :623
        self._swap(v, base + self.half, block_ids[:read], cpu_ids[:read], 1)
        return match, read

    def close(self) -> None:
        self.backend.close()


# -- the two processes ------------------------------------------------------------------------


def backend(args: argparse.Namespace):
    return AttentionStorePath(args) if args.backend == "attention_store" else FilePath(args)


def write_phase(args: argparse.Namespace) -> None:
    a, b, _ = prompts(args)
    num_blocks = 32
    k, v = caches(args, num_blocks, seed=1)
    fd = backend(args)
    try:
        for task_id, tokens, table in (
            ("req-A", a, list(range(0, SHARED + NEW_A))),
            ("req-B", b, list(range(SHARED)) + list(range(16, 16 + NEW_B))),  # B reuses A's blocks
        ):
            full = len(tokens) // args.block_size
            match, written = fd.write_back(task_id, k, v, tokens, table)
            print(f"[write] {task_id}: {match} of {full} blocks already stored, wrote {written}")
    finally:
        fd.close()


def read_phase(args: argparse.Namespace) -> int:
    a, b, c = prompts(args)
    num_blocks = 32
    src_k, src_v = caches(args, num_blocks, seed=1)
    src_table = list(range(SHARED)) + list(range(16, 16 + NEW_B))  # where B's KV was written from
    k, v = caches(args, num_blocks, seed=None)
    new_ids = [31 - i for i in range(SHARED + NEW_B)]  # other blocks than the writer's
    fd = backend(args)
    try:
        full = len(b) // args.block_size
        match, read = fd.read("req-B", k, v, b, new_ids)
        same = all(
            np.array_equal(dst[d].astype("float32").numpy(), src[s].astype("float32").numpy())
            for dst, src in zip(k + v, src_k + src_v)
            for d, s in zip(new_ids[:read], src_table)
        )
        print(
            f"[read, fresh process] req-B: {match} of {full} blocks stored, read {read}, "
            f"bytes {'identical' if same else 'DIFFERENT'}"
        )
        c_match, _ = fd.read("req-C", *caches(args, num_blocks, seed=None), c, new_ids)
        print(
            f"[read, fresh process] req-C (a prompt nobody wrote): {c_match} of {full} blocks "
            "stored"
        )
        print(
            f"hits: {read} of {full} blocks of req-B ({read * args.block_size} of {len(b)} prompt "
            f"tokens) from the store"
        )
        return 0 if same and read == full and c_match == 0 else 1
    finally:
        fd.close()


def main() -> int:
    args = parse_args()
    try:
        return run(args)
    except ConfigError as exc:  # a setting the backend refuses when built: one line
        print(f"run_backend.py: {exc}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    if args.phase == "write":
        write_phase(args)
        return 0
    if args.phase == "read":
        return read_phase(args)

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ucm-fastdeploy-example-"))
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        if args.config is None:  # what UCM_CONFIG_FILE names in a FastDeploy deployment
            model = Path(args.model) if args.model else workdir / MODEL
            if not args.model:
                make_model(model)
            config = workdir / "ucm.yaml"
            config.write_text(
                f"store:\n  kind: posix\n  path: {workdir / 'store'}\n  capacity_gb: 1\n"
                f"model_path: {model}\n"
            )
            args.config = str(config)
        os.environ["UCM_CONFIG_FILE"] = str(Path(args.config).resolve())
        print(f"ucm fastdeploy example: backend={args.backend} UCM_CONFIG_FILE={args.config}")
        write_phase(args)
        me = [sys.executable, os.path.abspath(__file__), "--backend", args.backend]
        me += ["--layers", str(args.layers), "--kv-heads", str(args.kv_heads)]
        me += ["--block-size", str(args.block_size), "--head-dim", str(args.head_dim)]
        sys.stdout.flush()
        return subprocess.run([*me, "--phase", "read"], env=os.environ.copy()).returncode
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
