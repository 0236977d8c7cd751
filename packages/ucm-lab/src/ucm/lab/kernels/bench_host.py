"""The host's share of a GPU host's copies, measured on any machine.

On a GPU host the mover queues its copies (and the digest kernels) on a side stream and
goes on: what the host does for a step (the store's calls, the plan, the row table, the
bookkeeping) runs beside the device's copies, and a run goes no faster than the slower of
the two.  The link moves 32 MiB in about 0.6 ms (an H200's pinned copy, 55 GB/s): a step's
host work must take less for the copies to run at the link's speed.

This runs the GPU route's every host call on the CPU with the device's work left out:
the store's memory is taken as registered (the mover hands the stager row tables), blocks
go through the store's memory digested "by the device", and the copies, the row copies and
the digest kernels are skipped (every digest zero, booked and checked as real ones are).
What is timed is what a GPU host's CPU does, less the kernels' launches (a few to a dozen
microseconds each on a GPU host, a few a step).

Each block size is emulated with blocks of the same shape (layers, K and V, tokens) but
one head of 8 values, so that a step holds as many blocks as at the real size and the
store and the plans do the same work; the real size is what the figures are per:

* **fastdeploy**: ``AttentionStore.write`` then ``read`` of ``--mib`` of blocks with
  FastDeploy's settings (steps of 32 MiB, slices of 100 blocks), 16 layers;
* **worker**: the vLLM worker's calls for one request's blocks, ``Mover.dump`` then
  ``start_read`` and ``settle_read``, in batches of ``--batch-mib``.

For each it prints the host's microseconds a step (a batch) and the GB/s of real blocks
the host could feed the link, and that figure's ratio to ``--link-gbps``: at 1.0 the host
is as busy as the link, and copies overlapped with it stay near the link's speed only
well above it.

    python -m ucm.lab.kernels.bench_host [--block-kib 512 2048 8192 32768] [--mib 512]
        [--batch-mib 32] [--repeat 8] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch
from ucm.core import create_store
from ucm.kernels import staging
from ucm.kernels.mover import Batch, Caches, Mover, MoverSettings, Route

KIB = 1 << 10
MIB = 1 << 20
LAYERS = 16
#: the real caches' bytes a token of a layer's K or V (8 heads of 128 bf16 values)
REAL_TOKEN_BYTES = 8 * 128 * 2
#: the emulated caches': one head of 8 bf16 values
HEAD_DIM = 8
TOKEN_BYTES = HEAD_DIM * 2
#: FastDeploy's defaults: MiB a step (pipeline_chunk_mb), blocks a slice (slice_blocks)
STEP_MIB = 32


@contextlib.contextmanager
def device_work_skipped() -> Iterator[None]:
    """The stager's device work (gathers and scatters, row copies, digests) skipped: every
    digest zero, so that booked and checked digests agree."""
    saved = staging.execute, staging.copy_rows, staging.row_digests

    def digests(rows: torch.Tensor, backend: str = "auto") -> torch.Tensor:
        return torch.zeros(rows.shape[0], dtype=torch.int64, device=rows.device)

    staging.execute = lambda plan, backend="auto": "skipped"  # type: ignore[assignment]
    staging.copy_rows = lambda *args, **kwargs: None  # type: ignore[assignment]
    staging.row_digests = digests  # type: ignore[assignment]
    try:
        yield
    finally:
        staging.execute, staging.copy_rows, staging.row_digests = saved


def as_gpu_host(mover: Mover, store: Any) -> None:
    """``mover`` moves ``store``'s blocks as on a GPU host: through the store's memory,
    taken as registered, digested and checked by the (skipped) device."""
    regions = store.host_memory()
    if not regions:
        raise RuntimeError("the store has no host memory yet: check_block_bytes first")
    for region in regions:
        mover.pinned._regions.append(torch.frombuffer(region, dtype=torch.uint8))
    mover.settings = attrs.evolve(mover.settings, device_digests=True)
    mover.route = lambda batch, cache_lent: (Route.STORE_MEMORY, None)  # type: ignore[method-assign]


def _undo(mover: Mover) -> None:
    mover.pinned._regions.clear()  # nothing was registered with a driver


def _caches(blocks: int, tokens: int) -> list[torch.Tensor]:
    """K and V of each layer, ``[blocks, 1, tokens, HEAD_DIM]``, of random bits."""
    gen = torch.Generator().manual_seed(blocks + tokens)

    def one() -> torch.Tensor:
        raw = torch.randint(-32768, 32767, (blocks, 1, tokens, HEAD_DIM), dtype=torch.int16,
                            generator=gen)  # fmt: skip
        return raw.view(torch.bfloat16)

    return [one() for _ in range(2 * LAYERS)]


def fastdeploy(real_block: int, mib: int, repeat: int, folder: str) -> dict[str, float]:
    """Seconds a step of FastDeploy's write and read take the host (medians of runs)."""
    from ucm.fastdeploy.attention_store import AttentionStore

    tokens = real_block // (2 * LAYERS * REAL_TOKEN_BYTES)
    per_layer = tokens * TOKEN_BYTES
    block = 2 * LAYERS * per_layer
    n = max(1, mib * MIB // real_block)
    per_step = max(1, STEP_MIB * MIB // real_block)
    caches = _caches(n, tokens)
    k, v = caches[::2], caches[1::2]
    token_ids = list(range(n * tokens))
    table = list(range(n))[::-1]

    def store() -> AttentionStore:
        made = AttentionStore(
            namespace="bench", model_version="bench-host", layer_num=LAYERS,
            block_token_size=tokens, bytes_per_shard_layer_per_block=per_layer,
            ucm_config={"store": {"kind": "dram", "path": folder,
                                  "capacity_gb": 3 * n * block / 2**30}},
            environ={},
        )  # fmt: skip
        mover = made._mover
        as_gpu_host(mover, made.store)
        mover.settings = attrs.evolve(mover.settings, step_bytes=per_step * block)
        return made

    writer, reader = store(), store()
    write: list[float] = []
    read: list[float] = []
    try:
        for r in range(repeat + 1):
            t0 = time.perf_counter()
            wrote = writer.write("b", k, v, token_ids, table, 0)
            t1 = time.perf_counter()
            got = reader.read("b", k, v, token_ids, list(range(n)), 0)
            t2 = time.perf_counter()
            if wrote != n or got != n:
                raise RuntimeError(f"fastdeploy: wrote {wrote}, read {got} of {n} blocks")
            writer.store.remove(writer.keyspace.keys(token_ids, 0, n))
            if r:  # the first run maps the store's memory
                write.append(t1 - t0)
                read.append(t2 - t1)
    finally:
        for made in (writer, reader):
            _undo(made._mover)
            made.close()
    steps = -(-n // per_step)
    return {"blocks": n, "steps": steps, "write_s": statistics.median(write),
            "read_s": statistics.median(read)}  # fmt: skip


def worker(real_block: int, batch_mib: int, repeat: int, folder: str) -> dict[str, float]:
    """Seconds a batch of the vLLM worker's dump and load take the host (medians)."""
    tokens = real_block // (2 * LAYERS * REAL_TOKEN_BYTES)
    n = max(1, batch_mib * MIB // real_block)
    caches = Caches(_caches(2 * n, tokens))
    nbytes = caches.payload_nbytes()
    store = create_store({"kind": "dram", "path": folder, "capacity_gb": 3 * n * nbytes / 2**30})
    store.check_block_bytes(nbytes)  # as the worker does at start-up: the store maps its memory
    mover = Mover(MoverSettings())
    as_gpu_host(mover, store)
    dump: list[float] = []
    load: list[float] = []
    try:
        for r in range(repeat + 1):
            keys = [os.urandom(16) for _ in range(n)]
            t0 = time.perf_counter()
            task = mover.dump(Batch(caches, list(range(n)), keys, store, b"bench", nbytes))
            t1 = time.perf_counter()
            if not all(x.ok for x in task.wait(30)):
                raise RuntimeError("worker: a dump failed")
            t2 = time.perf_counter()
            read = mover.start_read(Batch(caches, list(range(n, 2 * n)), keys, store, b"bench",
                                          nbytes))  # fmt: skip
            if read.task is not None:
                read.task.wait(30)
            results = mover.settle_read(read)
            t3 = time.perf_counter()
            if not all(x is not None and x.ok for x in results):
                raise RuntimeError("worker: a load failed")
            store.remove(keys)
            if r:
                dump.append(t1 - t0)
                load.append(t3 - t2)
    finally:
        _undo(mover)
        mover.close()
        store.close()
    return {"blocks": n, "dump_s": statistics.median(dump), "load_s": statistics.median(load)}


def _label(nbytes: int) -> str:
    return f"{nbytes >> 10} KiB" if nbytes < MIB else f"{nbytes / MIB:g} MiB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ucm.lab.kernels.bench_host", description=__doc__)
    p.add_argument(
        "--block-kib", type=int, nargs="+", default=[512, 2048, 8192, 32768],
        help="real block sizes, KiB (512 2048 8192 32768)",
    )  # fmt: skip
    p.add_argument("--mib", type=int, default=512, help="MiB of real blocks a FastDeploy run")
    p.add_argument("--batch-mib", type=int, default=32, help="MiB of real blocks a worker batch")
    p.add_argument("--repeat", type=int, default=8, help="timed runs; medians (8)")
    p.add_argument("--link-gbps", type=float, default=55.0, help="the link, GB/s (55: H200)")
    p.add_argument("--cases", nargs="+", default=["fastdeploy", "worker"],
                   choices=["fastdeploy", "worker"])  # fmt: skip
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    args = p.parse_args(argv)
    unit = 2 * LAYERS * REAL_TOKEN_BYTES  # a token of every layer
    for kib in args.block_kib:
        if kib < 1 or kib * KIB % unit:
            p.error(f"--block-kib {kib}: a block is whole tokens of {unit >> 10} KiB")
    if min(args.mib, args.batch_mib, args.repeat) < 1 or args.link_gbps <= 0:
        p.error("--mib, --batch-mib, --repeat and --link-gbps must be positive")
    logging.getLogger("ucm").setLevel(logging.ERROR)
    folder = f"/dev/shm/ucm-bench-host-{uuid.uuid4().hex[:8]}"
    rows: list[dict[str, Any]] = []
    try:
        with device_work_skipped():
            for kib in args.block_kib:
                real = kib * KIB
                row: dict[str, Any] = {"block_bytes": real}
                runs: dict[str, Callable[[str], dict[str, float]]] = {
                    "fastdeploy": lambda f, real=real: fastdeploy(real, args.mib, args.repeat, f),
                    "worker": lambda f, real=real: worker(real, args.batch_mib, args.repeat, f),
                }
                for case in args.cases:
                    at = f"{folder}-{case}-{kib}"
                    try:
                        row[case] = runs[case](at)
                    finally:
                        shutil.rmtree(at, ignore_errors=True)
                rows.append(row)
    finally:
        for path in os.listdir("/dev/shm"):
            if path.startswith(os.path.basename(folder)):
                shutil.rmtree(os.path.join("/dev/shm", path), ignore_errors=True)
    print(f"The host's share of the GPU route (device work skipped), medians of {args.repeat}; "
          f"GB/s of real blocks the host could feed, and its ratio to a {args.link_gbps:g} GB/s "
          "link")  # fmt: skip
    head = f"{'block':>8}"
    if "fastdeploy" in args.cases:
        head += f" | {'fd write us/step':>16} {'GB/s':>6} {'x link':>6}"
        head += f" | {'fd read us/step':>15} {'GB/s':>6} {'x link':>6}"
    if "worker" in args.cases:
        head += f" | {'dump us/batch':>13} {'GB/s':>6} {'x link':>6}"
        head += f" | {'load us/batch':>13} {'GB/s':>6} {'x link':>6}"
    print(head)
    for row in rows:
        line = f"{_label(row['block_bytes']):>8}"
        for case, ways, width in (("fastdeploy", ("write", "read"), (16, 15)),
                                  ("worker", ("dump", "load"), (13, 13))):  # fmt: skip
            got = row.get(case)
            if got is None:
                continue
            gb = got["blocks"] * row["block_bytes"] / 1e9
            per = got.get("steps", 1)
            for way, w in zip(ways, width):
                seconds = got[f"{way}_s"]
                feeds = gb / seconds
                got[f"{way}_gbps"] = feeds
                line += f" | {seconds / per * 1e6:>{w}.0f} {feeds:>6.1f} "
                line += f"{feeds / args.link_gbps:>6.2f}"
        print(line)
    if args.json:
        print(json.dumps({"link_gbps": args.link_gbps, "rows": rows}))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
