"""FastDeploy's AttentionStore over the host tier (the dram store of scope host), one run.

For FastDeploy-shaped caches (one K and one V tensor per layer, on a GPU or the CPU), the
same batch of blocks written by ``AttentionStore.write`` and read back by a fresh instance
into other block ids, on one shared-memory store:

* **tier**: the blocks copied straight into the store's slots and out of the blocks it
  lends (on a GPU its memory registered with the driver; on the CPU FastDeploy's caches are
  read and written in place by the store's own copy);
* **tier, host checks**: the same with ``digests_on_gpu: false``, each block digested and
  checked by the store's threads on the host rather than by the GPU (on the CPU: the same
  as tier);
* **staged**: ``zero_copy: false``, through staging rows and the store's copy;
* on a GPU, **pinned copy**: the same bytes between the GPU and one pinned buffer, one
  copy each way: what the link allows.

Each round runs the cases back to back, taking turns at going first, after an untimed round;
each figure is the best of ``--repeat`` rounds (5), and each ratio the median of the rounds'
own ratios.  A read is checked against what was written.  The last line with ``--json`` is
a JSON object with every figure.

    python -m ucm.lab.fastdeploy.bench_tier [--device cuda] [--block-tokens 64 8]
        [--threads 2 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import time
import uuid
from typing import Any

import torch
from ucm.fastdeploy.attention_store import AttentionStore

MIB = 1 << 20


def _caches(args: argparse.Namespace, tokens: int, seed: int) -> tuple[list, list]:
    gen = torch.Generator().manual_seed(seed)
    shape = (args.blocks_of(tokens), args.heads, tokens, args.head_dim)

    def one() -> torch.Tensor:
        raw = torch.randint(-32768, 32767, shape, dtype=torch.int16, generator=gen)
        return raw.view(torch.bfloat16).to(args.device)

    return [one() for _ in range(args.layers)], [one() for _ in range(args.layers)]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _measure(args: argparse.Namespace, tokens: int, threads: int, folder: str) -> dict[str, Any]:
    per_layer = args.heads * tokens * args.head_dim * 2
    block = 2 * args.layers * per_layer
    n = args.blocks_of(tokens)
    k, v = _caches(args, tokens, 1)
    k2, v2 = _caches(args, tokens, 2)
    token_ids = list(range(n * tokens))
    table = list(range(n))[::-1]  # the paged cache's order is not the prompt's
    read_ids = list(range(n))
    capacity = 3 * n * block / (1 << 30)
    stores: dict[str, AttentionStore] = {}
    for case, zero_copy, on_gpu in (
        ("tier", True, True),
        ("hostchecks", True, False),
        ("staged", False, True),
    ):
        for role in ("w", "r"):
            stores[case + role] = AttentionStore(
                namespace="bench",
                model_version="bench-tier",
                layer_num=args.layers,
                block_token_size=tokens,
                bytes_per_shard_layer_per_block=per_layer,
                ucm_config={
                    "store": {
                        "kind": "dram",
                        "path": folder,
                        "capacity_gb": capacity,
                        "threads": threads,
                    },
                    "zero_copy": zero_copy,
                    "digests_on_gpu": on_gpu,
                },
                environ={},
            )
    times: dict[str, list[float]] = {}

    def timed(name: str, fn) -> Any:
        _sync(args.device)
        t0 = time.perf_counter()
        got = fn()
        _sync(args.device)
        times.setdefault(name, []).append(time.perf_counter() - t0)
        return got

    def case(name: str) -> None:
        writer, reader = stores[name + "w"], stores[name + "r"]
        written = timed(name + "_write", lambda: writer.write("b", k, v, token_ids, table, 0))
        got = timed(name + "_read", lambda: reader.read("b", k2, v2, token_ids, read_ids, 0))
        if written != n or got != n:
            raise RuntimeError(f"{name}: wrote {written}, read {got} of {n} blocks")
        for j in (0, n // 2, n - 1):
            a, b = k2[-1][read_ids[j]], k[-1][table[j]]  # as bits: random bf16 has NaNs
            if not torch.equal(a.view(torch.int16), b.view(torch.int16)):
                raise RuntimeError(f"{name}: block {j} differs from what was written")
        writer.store.remove(writer.keyspace.keys(token_ids, 0, n))  # the next case writes anew

    cases = [lambda: case("tier"), lambda: case("hostchecks"), lambda: case("staged")]
    if args.device == "cuda":
        flat = torch.randint(0, 255, (n * block,), dtype=torch.uint8, device="cuda")
        pinned = torch.empty(n * block, dtype=torch.uint8, pin_memory=True)

        def pinned_copy() -> None:
            timed("pinned_write", lambda: pinned.copy_(flat, non_blocking=True))
            timed("pinned_read", lambda: flat.copy_(pinned, non_blocking=True))

        cases.append(pinned_copy)
    for r in range(-1, args.repeat):
        for fn in cases if r % 2 == 0 else cases[::-1]:
            fn()
        if r < 0:
            times.clear()  # the first round faults the store's memory in
    for store in stores.values():
        store.close()
    gb = n * block / 1e9
    out: dict[str, Any] = {"block_bytes": block, "blocks": n, "threads": threads, "gb": gb}
    for name, t in times.items():
        out[name + "_gbps"] = gb / min(t)

    def ratio(a: str, b: str) -> float:
        return statistics.median(tb / ta for ta, tb in zip(times[a], times[b], strict=True))

    for way in ("write", "read"):
        out[f"{way}_tier_over_staged"] = ratio(f"tier_{way}", f"staged_{way}")
        out[f"{way}_tier_over_hostchecks"] = ratio(f"tier_{way}", f"hostchecks_{way}")
        if args.device == "cuda":
            out[f"{way}_tier_over_pinned"] = ratio(f"tier_{way}", f"pinned_{way}")
            out[f"{way}_hostchecks_over_pinned"] = ratio(f"hostchecks_{way}", f"pinned_{way}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ucm.lab.fastdeploy.bench_tier", description=__doc__)
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--layers", type=int, default=16, help="layers (16)")
    p.add_argument("--heads", type=int, default=8, help="KV heads of the shard (8)")
    p.add_argument("--head-dim", type=int, default=128, help="head dim (128)")
    p.add_argument(
        "--block-tokens", type=int, nargs="+", default=[64, 8],
        help="tokens per block, one run each (64 8: blocks of 4 MiB and 512 KiB)",
    )  # fmt: skip
    p.add_argument(
        "--threads", type=int, nargs="+", default=[2],
        help="the store's threads (its setting), one run each (2: the default)",
    )  # fmt: skip
    p.add_argument("--mib", type=int, default=512, help="MiB written and read per round (512)")
    p.add_argument("--repeat", type=int, default=5, help="rounds; the best counts (5)")
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    args = p.parse_args(argv)
    for name in ("layers", "heads", "head_dim", "mib", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if any(t < 1 for t in args.block_tokens + args.threads):
        p.error("--block-tokens and --threads must be >= 1")
    per_token = 2 * args.layers * args.heads * args.head_dim * 2
    args.blocks_of = lambda tokens: max(1, args.mib * MIB // (per_token * tokens))
    logging.getLogger("ucm").setLevel(logging.WARNING)
    folder = f"/dev/shm/ucm-bench-fd-tier-{uuid.uuid4().hex[:8]}"
    rows = []
    try:
        for tokens in args.block_tokens:
            for threads in args.threads:
                rows.append(_measure(args, tokens, threads, f"{folder}-{tokens}"))
                shutil.rmtree(f"{folder}-{tokens}", ignore_errors=True)
    finally:
        for tokens in args.block_tokens:
            shutil.rmtree(f"{folder}-{tokens}", ignore_errors=True)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "the CPU"
    print(f"AttentionStore over the host tier, caches on {name}, best of {args.repeat}, GB/s")
    head = (
        f"{'block':>8} {'threads':>7} {'tier write':>10} {'staged':>7} {'ratio':>6} "
        f"{'tier read':>9} {'staged':>7} {'ratio':>6}"
    )
    if args.device == "cuda":
        head += f" {'pinned D2H':>10} {'H2D':>6} {'tier/pinned w':>13} {'r':>5}"
        head += f" {'host checks w':>13} {'r':>5}"
    print(head)
    for row in rows:
        size = row["block_bytes"]
        label = f"{size >> 10} KiB" if size < MIB else f"{size / MIB:g} MiB"
        line = (
            f"{label:>8} {row['threads']:>7} {row['tier_write_gbps']:>10.2f} "
            f"{row['staged_write_gbps']:>7.2f} "
            f"{row['write_tier_over_staged']:>6.2f} {row['tier_read_gbps']:>9.2f} "
            f"{row['staged_read_gbps']:>7.2f} {row['read_tier_over_staged']:>6.2f}"
        )
        if args.device == "cuda":
            line += (
                f" {row['pinned_write_gbps']:>10.2f} {row['pinned_read_gbps']:>6.2f} "
                f"{row['write_tier_over_pinned']:>13.2f} {row['read_tier_over_pinned']:>5.2f}"
                f" {row['write_hostchecks_over_pinned']:>13.2f}"
                f" {row['read_hostchecks_over_pinned']:>5.2f}"
            )
        print(line)
    if args.json:
        print(json.dumps({"device": name, "repeat": args.repeat, "rows": rows}))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
