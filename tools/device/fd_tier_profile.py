"""Where FastDeploy's writes and reads into the host tier spend their time, on a GPU machine.

The shapes of ``python -m ucm.lab.fastdeploy.bench_tier`` (16 layers, 8 heads of 128, 512 MiB
a round); per round the caller's seconds in each step of the mover, then one write and one
read under cProfile.  Run from the repository root with the bench's PYTHONPATH:

    python3 tools/device/fd_tier_profile.py [--threads 2] [--block-tokens 64 8]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import logging
import pstats
import shutil
import time
import uuid

import torch
import ucm.fastdeploy.transfer as transfer
from ucm.fastdeploy.attention_store import AttentionStore

SPENT: collections.Counter[str] = collections.Counter()


def _timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[name] += time.perf_counter() - t0

    return wrapper


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--block-tokens", type=int, nargs="+", default=[64, 8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    logging.getLogger("ucm").setLevel(logging.WARNING)
    M = transfer.Mover
    M._start_tier_write = _timed("write: open, start gather", M._start_tier_write)  # type: ignore[method-assign]
    T = transfer._TierWrite
    T.commit = _timed("write: copied? commit", T.commit)  # type: ignore[method-assign]
    M._settle = _timed("write: settle (wait for seals)", M._settle)  # type: ignore[method-assign]
    M._load = _timed("read: open_reads or load", M._load)  # type: ignore[method-assign]
    M._start_copy_lent = _timed("read: start copy", M._start_copy_lent)  # type: ignore[method-assign]
    L = transfer._LentCopy
    L.finish = _timed("read: copied? release", L.finish)  # type: ignore[method-assign]
    transfer._wait = _timed("wait for a step", transfer._wait)
    for tokens in args.block_tokens:
        _profile(args, tokens)


def _profile(args: argparse.Namespace, tokens: int) -> None:
    layers, heads, dim = 16, 8, 128
    per_layer = heads * tokens * dim * 2
    block = 2 * layers * per_layer
    n = (512 << 20) // block
    folder = f"/dev/shm/ucm-fd-prof-{uuid.uuid4().hex[:8]}"

    def make() -> AttentionStore:
        return AttentionStore(
            namespace="prof", model_version="prof", layer_num=layers,
            block_token_size=tokens, bytes_per_shard_layer_per_block=per_layer,
            ucm_config={"store": {"kind": "dram", "path": folder,
                                  "capacity_gb": 3 * n * block / (1 << 30),
                                  "threads": args.threads}},
            environ={},
        )  # fmt: skip

    def caches() -> list[torch.Tensor]:
        return [
            torch.randint(
                0, 255, (n, heads, tokens, dim * 2), dtype=torch.uint8, device=args.device
            ).view(torch.bfloat16)
            for _ in range(layers)
        ]

    k, v, k2, v2 = caches(), caches(), caches(), caches()
    ids = list(range(n))
    tok = list(range(n * tokens))
    writer, reader = make(), make()

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    def one(profile: cProfile.Profile | None = None) -> tuple[float, float]:
        sync()
        t0 = time.perf_counter()
        if profile:
            profile.enable()
        assert writer.write("p", k, v, tok, ids[::-1], 0) == n
        t1 = time.perf_counter()
        assert reader.read("p", k2, v2, tok, ids, 0) == n
        sync()
        if profile:
            profile.disable()
        t2 = time.perf_counter()
        writer.store.remove(writer.keyspace.keys(tok, 0, n))
        return t1 - t0, t2 - t1

    one()
    print(f"== blocks of {block >> 10} KiB, {n} a round, store threads {args.threads}")
    for r in range(args.rounds):
        SPENT.clear()
        w, rd = one()
        gb = n * block / 1e9
        print(f"round {r}: write {w * 1e3:.1f} ms ({gb / w:.1f} GB/s), "
              f"read {rd * 1e3:.1f} ms ({gb / rd:.1f} GB/s)")  # fmt: skip
        for name, sec in sorted(SPENT.items()):
            print(f"    {name:<34} {sec * 1e3:8.1f} ms")
    prof = cProfile.Profile()
    one(prof)
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(18)
    writer.close()
    reader.close()
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
