"""``ucm bench scale``: the posix store with many blocks against an empty one, in one run.

A store is filled with ``--blocks`` small blocks up to its capacity, its batches of dumps
timed as it fills (``filling``: no eviction yet); then a fresh process opens it (as an
engine that restarts does) and dumps new blocks in batches, each of which must evict, and
looks up 512 stored keys at a time.  The same process runs on an empty store of the same
capacity.  Printed for each, and as ratios to filling: the time to open the store and to
make its first dump, the p50 / p99 / max time of a batch of dumps, ``lookup_prefix`` of 512
keys, and the process's peak memory (``VmHWM``).  Payloads are small by default (the header
page dominates a file), to keep a million blocks within a few GiB of disk.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ucm.core.block_format import HEADER_BYTES
from ucm.core.config import PosixStoreConfig
from ucm.core.store import PosixStore

LOOKUP_KEYS = 512


def key(i: int) -> bytes:
    return i.to_bytes(8, "little") * 2


def fill(path: str, blocks: int, payload: int, batch: int) -> tuple[float, dict]:
    """Dump ``blocks`` blocks into the store at ``path`` in batches of ``batch``; seconds
    taken, and the batches' times (as :func:`run_case` gives them)."""
    capacity = blocks * (HEADER_BYTES + payload)
    store = PosixStore(PosixStoreConfig(path=path, capacity_gb=capacity / (1 << 30)))
    data = bytes(payload)
    started = time.perf_counter()
    times = []
    # the last 2 % of the capacity wakes the background evictor: batches past it are not
    # "filling" any more
    quiet = int(blocks * 0.97)
    for start in range(0, blocks, batch):
        keys = [key(i) for i in range(start, min(blocks, start + batch))]
        t0 = time.perf_counter()
        results = store.wait(store.dump(keys, [data] * len(keys)))
        if start + batch <= quiet:
            times.append(time.perf_counter() - t0)
        if not all(r.ok for r in results):
            raise RuntimeError(f"filling the store failed: {results[0]}")
    store.close()
    return time.perf_counter() - started, _batch_figures(times)


def _batch_figures(times: list[float]) -> dict:
    times = sorted(times)
    return {
        "dump_batch_p50_ms": 1e3 * statistics.median(times),
        "dump_batch_p99_ms": 1e3 * times[min(len(times) - 1, int(0.99 * len(times)))],
        "dump_batch_max_ms": 1e3 * times[-1],
    }


def _peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_case(path: str, blocks: int, stored: int, payload: int, dumps: int, batch: int) -> dict:
    """In a fresh process: open the store at ``path`` (capacity for ``blocks``, holding
    ``stored``), dump ``dumps`` new blocks in batches, look keys up; the figures."""
    base = _peak_rss_mib()
    capacity = blocks * (HEADER_BYTES + payload)
    started = time.perf_counter()
    store = PosixStore(PosixStoreConfig(path=path, capacity_gb=capacity / (1 << 30)))
    opened = time.perf_counter() - started
    data = bytes(payload)
    times = []
    first = None
    for n, start in enumerate(range(blocks, blocks + dumps, batch)):
        keys = [key(i) for i in range(start, start + batch)]
        t0 = time.perf_counter()
        results = store.wait(store.dump(keys, [data] * len(keys)))
        times.append(time.perf_counter() - t0)
        if n == 0:
            first = time.perf_counter() - started
        if not all(r.ok for r in results):
            raise RuntimeError(f"a dump failed: {results[0]}")
    lookups = []
    end = blocks + len(times) * batch  # the last keys dumped: still stored
    present = [key(i) for i in range(max(blocks, end - LOOKUP_KEYS), end)]
    for _ in range(50):
        t0 = time.perf_counter()
        found = store.lookup_prefix(present)
        lookups.append(time.perf_counter() - t0)
    if found != len(present):
        raise RuntimeError(f"lookup_prefix found {found} of {len(present)} just stored")
    usage = store.usage()  # waits for the start-up scan
    evicted = store.evicted_blocks
    store.close()
    return {
        "stored_before": stored,
        "open_s": opened,
        "first_dump_s": first,
        **_batch_figures(times),
        "lookup_512_p50_ms": 1e3 * statistics.median(lookups),
        "peak_rss_mib": _peak_rss_mib(),
        "rss_before_mib": base,
        "evicted": evicted,
        "blocks_after": usage.blocks,
    }


def _child(queue: Any, *args: Any) -> None:
    try:
        queue.put(run_case(*args))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put({"error": repr(exc)})


def in_process(*args: Any) -> dict:
    """``run_case`` in a fresh process (its memory is its own)."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue, *args))
    proc.start()
    result = queue.get()
    proc.join()
    if "error" in result:
        raise RuntimeError(result["error"])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ucm bench scale", description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1_000_000, help="blocks in the full store")
    parser.add_argument("--payload-bytes", type=int, default=64)
    parser.add_argument(
        "--dumps", type=int, default=20_000, help="blocks dumped per case (512 are looked up)"
    )
    parser.add_argument("--batch", type=int, default=64, help="blocks per dump call")
    parser.add_argument("--path", help="folder for the stores (default: a temporary one)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="ucm-scale-", dir=args.path))
    try:
        full, empty = str(work / "full"), str(work / "empty")
        filled, filling = fill(full, args.blocks, args.payload_bytes, args.batch)
        print(f"filled {args.blocks} blocks in {filled:.1f} s", flush=True)
        common = (args.payload_bytes, args.dumps, args.batch)
        rows = {
            "filling": filling,
            "empty": in_process(empty, args.blocks, 0, *common),
            "full": in_process(full, args.blocks, args.blocks, *common),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    names = [k for k in rows["full"] if k not in ("stored_before",)]
    print(f"{'':22}{'filling':>12}{'empty':>12}{'full':>12}{'full/empty':>12}{'full/filling':>14}")
    for name in names:
        f, a, b = rows["filling"].get(name), rows["empty"][name], rows["full"][name]
        ratio = f"{b / a:12.2f}" if isinstance(a, float) and a else f"{'':12}"
        to_fill = f"{b / f:14.2f}" if f else f"{'':14}"
        shown = f"{f:12.4g}" if f is not None else f"{'':12}"
        print(f"{name:22}{shown}{a:12.4g}{b:12.4g}{ratio}{to_fill}")
    if args.json:
        print(json.dumps({"settings": vars(args), "cpu_count": os.cpu_count(), **rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
