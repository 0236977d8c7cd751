"""``ucm bench store``: store throughput against baselines measured in the same run.

For each block size, the same bytes go through
  * raw buffered file I/O (one file, sequential writes then reads) and the posix store;
  * raw O_DIRECT file I/O and the posix store with ``o_direct``;
  * memcpy into and out of pre-faulted memory, on one thread and on as many threads as the
    host tier copies with (``memcpy xN``: its copy threads and the thread that waits for
    them, which takes blocks too; the memory's limit for that many threads, and the
    baseline of every dram case), the dram store (scope process), the dram
    store in shared memory (scope host, what vLLM uses), that store written in place (the
    caller copies each block into the slot the store hands out, as vLLM's worker gathers
    into it, and the store seals and publishes: "dram in place"), and that store's floor:
    its copy threads hashing and copying the blocks with no store around them ("sealed
    copies"), and the same store copying in Python, as it does where its compiled library
    was not built ("dram shared py");
  * with ``--kind mooncake``: Mooncake's own client (``batch_put_from`` /
    ``batch_get_into``, in batches as large as the store's) and the mooncake store, each on
    a master and a segment server started for the run (or both on ``--master``);
and the ratio store / baseline is printed per direction.  Each figure is the best of
``--repeat`` runs, so that a noisy neighbour lowers no ratio by chance, taken in rounds of
every case in turn, so that a host's drift moves a case and its baseline alike.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from tqdm import tqdm
from ucm.core.cli import CliError
from ucm.core.config import (
    DramStoreConfig,
    MooncakeStoreConfig,
    PosixStoreConfig,
    default_store_path,
)
from ucm.core.native import LIBRARY
from ucm.core.settings import GIB
from ucm.core.store import DramStore, KeyResult, PosixStore, SharedMemoryStore, Store, Task
from ucm.core.store.chunks import chunk_keys
from ucm.core.store.dram import arena, sealing
from ucm.core.store.dram.sealing import compiled, move_sealed_batch

BATCH = 128  # keys per dump/load call: what an engine step hands over for a long prompt
#: the cases that copy into a pool of pre-faulted blocks, made once a block size and dropped
#: after its rounds
POOLED = ("memcpy", "sealed copies")
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def memcpy_case(threads: int) -> str:
    """The name of the memcpy baseline on ``threads`` threads."""
    return "memcpy" if threads == 1 else f"memcpy x{threads}"


def aligned(size: int) -> mmap.mmap:
    """A page-aligned buffer of ``size`` bytes, its pages already faulted in."""
    buf = mmap.mmap(-1, size)
    buf.write(b"\x01" * size)  # fault the pages in before timing
    return buf


def _best(repeat: int, run: Callable[[], float]) -> float:
    return min(run() for _ in range(repeat))


def raw_file(directory: str, srcs: list, dsts: list, n: int, direct: bool) -> tuple[float, float]:
    """Seconds to write ``n`` buffers to one file and read them back: the raw baseline."""
    path = os.path.join(directory, "raw.bin")
    try:
        return raw_write(path, srcs, n, direct), raw_read(path, dsts, n, direct)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def raw_write(path: str, srcs: list, n: int, direct: bool) -> float:
    """Seconds to write ``n`` buffers (cycling through ``srcs``) to one file at ``path``."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (_O_DIRECT if direct else 0)
    t0 = time.perf_counter()
    fd = os.open(path, flags, 0o600)
    try:
        for i in range(n):
            os.write(fd, srcs[i % len(srcs)])
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def raw_read(path: str, dsts: list, n: int, direct: bool) -> float:
    """Seconds to read ``n`` buffers' worth of ``path`` back (cycling through ``dsts``)."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | (_O_DIRECT if direct else 0))
    try:
        for i in range(n):
            os.readv(fd, [dsts[i % len(dsts)]])
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def through_store(store: Store, srcs: list, dsts: list, n: int) -> tuple[float, float]:
    """Seconds to dump ``n`` buffers through ``store`` and load them back."""

    def dump(keys: list[bytes], s: int) -> Task:
        return store.dump(keys, [srcs[i % len(srcs)] for i in range(s, s + len(keys))])

    return _round_trip(store, dump, dsts, n)


def written_in_place(store: Store, srcs: list, dsts: list, n: int) -> tuple[float, float]:
    """Seconds to write ``n`` buffers into the store's own memory (``open_writes``: the
    caller copies each block into its slot, as an engine's gather kernel does, and the store
    seals and publishes them) and to load them back (as :func:`through_store`)."""
    size = len(srcs[0])

    def write(keys: list[bytes], s: int) -> Task:
        writes = store.open_writes(keys, size)
        if writes is None:
            raise RuntimeError("the store gave no room to write in place")
        for i, view in enumerate(writes.views, s):
            if view is not None:  # numpy's copy releases the GIL, as a kernel's does
                src = np.frombuffer(srcs[i % len(srcs)], np.uint8)
                np.copyto(np.frombuffer(view, np.uint8), src)
        return writes.commit()

    return _round_trip(store, write, dsts, n)


def _in_python(store: Store, srcs: list, dsts: list, n: int) -> tuple[float, float]:
    """:func:`through_store` with the dram store's copies and pins in Python, as in a wheel
    built without a C compiler."""
    copies, pins = sealing._LIBRARY, arena._LIBRARY
    sealing._LIBRARY = arena._LIBRARY = None
    try:
        return through_store(store, srcs, dsts, n)
    finally:
        sealing._LIBRARY, arena._LIBRARY = copies, pins


def _round_trip(
    store: Store, write: Callable[[list[bytes], int], Task], dsts: list, n: int
) -> tuple[float, float]:
    """Seconds to write ``n`` blocks in batches (``write(keys, first index)``, all in flight
    at once) and to load them back batch by batch."""
    keys = [os.urandom(16) for _ in range(n)]
    t0 = time.perf_counter()
    tasks = [write(keys[s : s + BATCH], s) for s in range(0, n, BATCH)]
    for task in tasks:
        _check(store.wait(task), "write")
    t_dump = time.perf_counter() - t0
    t0 = time.perf_counter()
    for s in range(0, n, BATCH):  # a batch's buffers are distinct: loads run concurrently
        batch = keys[s : s + BATCH]
        _check(store.wait(store.load(batch, dsts[: len(batch)])), "load")
    t_load = time.perf_counter() - t0
    store.remove(keys)
    return t_dump, t_load


def _interleaved(
    cases: list[tuple[str, Callable[[], tuple[float, float]], str | None]],
    repeat: int,
    pool: list,
    size: int,
    n: int,
    label: str,
) -> dict[str, list[tuple[float, float]]]:
    """Each case's runs, in ``repeat`` rounds of every case in turn: a host whose speed
    drifts over a minute (a shared VM) then moves a case and its baseline alike, where
    the runs of one case after another set a case against a baseline timed at another
    speed."""
    timings: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in cases}
    if any(name in POOLED or name.startswith("memcpy x") for name, _, _ in cases):
        # made once for every round: a pool made and dropped around each case left the
        # next case slower on a VM whose freed memory goes back to its host (page
        # reporting: dram dumps at 256 KiB 15-21 GB/s after a dropped pool, 20-28 with
        # it kept)
        pool[:] = [aligned(size) for _ in range(n)]
    try:
        with tqdm(total=repeat * len(cases), desc=label, disable=None, file=sys.stderr) as bar:
            for _ in range(repeat):
                for name, run, _ in cases:
                    timings[name].append(run())
                    bar.update()
    finally:
        pool.clear()
    return timings


def _check(results: list[KeyResult], what: str) -> None:
    bad = [r for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"{what} failed: {bad[0]}")


def _memcpy(srcs: list, pool: list, dsts: list, n: int, threads: int = 1) -> tuple[float, float]:
    """Seconds to copy ``n`` blocks into the pool and back out, ``threads`` threads dealing
    out the blocks of each batch as the host tier's copy threads do (numpy's copy releases
    the GIL)."""
    if threads == 1:
        t0 = time.perf_counter()
        for i in range(n):
            pool[i][:] = srcs[i % len(srcs)]
        t_in = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(n):
            dsts[i % len(dsts)][:] = pool[i]
        return t_in, time.perf_counter() - t0
    pool_arrays = [np.frombuffer(b, np.uint8) for b in pool]
    src_arrays = [np.frombuffer(b, np.uint8) for b in srcs]
    dst_arrays = [np.frombuffer(b, np.uint8) for b in dsts]

    def copy(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
        for dst, src in pairs:
            np.copyto(dst, src)

    def timed(pair: Callable[[int], tuple[np.ndarray, np.ndarray]]) -> float:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as executor:
            for s in range(0, n, BATCH):
                batch = [pair(i) for i in range(s, min(s + BATCH, n))]
                list(executor.map(copy, [batch[k::threads] for k in range(threads)]))
        return time.perf_counter() - t0

    t_in = timed(lambda i: (pool_arrays[i], src_arrays[i % len(srcs)]))
    t_out = timed(lambda i: (dst_arrays[i % len(dsts)], pool_arrays[i]))
    return t_in, t_out


def _sealed_copies(srcs: list, pool: list, dsts: list, n: int, threads: int) -> tuple[float, float]:
    """The host tier's floor: what its copy threads do with no store around them.  Each
    block hashed and copied into the pool, then hashed and copied out by the store's own
    routine (``move_sealed_batch``: compiled, a chunk a call, where the library is built),
    ``threads`` threads dealing out the blocks of each batch as the store does."""

    def move(pairs: list[tuple[memoryview, memoryview]], into: bool) -> None:
        size = chunk_keys(pairs[0][0].nbytes) if pairs else 1
        for c in range(0, len(pairs), size):
            chunk = pairs[c : c + size]
            moves = [((part,), slot) for slot, part in chunk]
            move_sealed_batch(None, [(0, 0)] * len(chunk), 0, moves, into=into)

    def timed(pair: Callable[[int], tuple[memoryview, memoryview]], into: bool) -> float:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as executor:
            for s in range(0, n, BATCH):
                batch = [pair(i) for i in range(s, min(s + BATCH, n))]
                shares = [batch[k::threads] for k in range(threads)]
                list(executor.map(move, shares, [into] * threads))
        return time.perf_counter() - t0

    t_in = timed(lambda i: (memoryview(pool[i]), memoryview(srcs[i % len(srcs)])), True)
    t_out = timed(lambda i: (memoryview(pool[i]), memoryview(dsts[i % BATCH])), False)
    return t_in, t_out


def _lookup_prefix_ms(store: Store, srcs: list, count: int = 512) -> float:
    keys = [os.urandom(16) for _ in range(count)]
    store.wait(store.dump(keys, [srcs[0]] * count))
    times = []
    for _ in range(30):
        t0 = time.perf_counter()
        found = store.lookup_prefix(keys)
        times.append(time.perf_counter() - t0)
        assert found == count
    store.remove(keys)
    return 1e3 * statistics.median(times)


class _RawMooncake:
    """Mooncake's client alone: the mooncake store's baseline, moving the same bytes."""

    def __init__(self, master: str, segment_bytes: int) -> None:
        from mooncake.store import MooncakeDistributedStore  # type: ignore[import-untyped]
        from ucm.core.store.mooncake.link import local_address

        self.client = MooncakeDistributedStore()
        host, port = master.rsplit(":", 1)
        code = self.client.setup(
            local_address(host, int(port)), "P2PHANDSHAKE", segment_bytes, 16 << 20, "tcp", "",
            master,
        )  # fmt: skip
        if code != 0:
            raise RuntimeError(f"Mooncake's client could not set up on {master}: {code}")

    def run(self, srcs: list, dsts: list, n: int) -> tuple[float, float]:
        from ucm.core.store.mooncake.store import address

        keys = [f"ucm-bench-raw/{os.urandom(16).hex()}" for _ in range(n)]
        src_ptrs = [address(memoryview(b)) for b in srcs]
        dst_ptrs = [address(memoryview(b)) for b in dsts]
        size = len(srcs[0])
        t0 = time.perf_counter()
        for s in range(0, n, BATCH):
            batch = keys[s : s + BATCH]
            ptrs = [src_ptrs[i % len(srcs)] for i in range(s, s + len(batch))]
            codes = self.client.batch_put_from(batch, ptrs, [size] * len(batch))
            if any(codes):
                raise RuntimeError(f"raw put failed: {sorted(set(codes))}")
        t_dump = time.perf_counter() - t0
        t0 = time.perf_counter()
        for s in range(0, n, BATCH):
            batch = keys[s : s + BATCH]
            got = self.client.batch_get_into(batch, dst_ptrs[: len(batch)], [size] * len(batch))
            if any(g != size for g in got):
                raise RuntimeError(f"raw get failed: {sorted(set(got))}")
        t_load = time.perf_counter() - t0
        self.client.batch_remove(keys, True)
        return t_dump, t_load

    def close(self) -> None:
        self.client.close()


def _mooncake_cases(
    args: argparse.Namespace, n: int, size: int, srcs: list, dsts: list
) -> tuple[list[tuple[str, Callable[[], tuple[float, float]], str | None]], list[Any]]:
    """Mooncake's own client and the mooncake store, each on a cluster of its own (a master
    and a segment server holding the pool) unless ``--master`` names one: then both use it
    and give it the memory themselves."""
    from ucm.core.store.mooncake.store import MooncakeStore
    from ucm.lab.mooncake import LocalMaster, SegmentServer

    segment = int(1.25 * n * (size + 4096))
    opened: list[Any] = []
    if args.master is None:
        # Blocks go to another process's memory, as to another host's, for both.
        masters = [LocalMaster().start(), LocalMaster().start()]
        opened += masters
        for master in masters:
            # (mooncake_client aborts on a segment of a few MiB)
            opened.append(SegmentServer(master.address, max(64, -(-segment >> 20))).start())
        raw_master, store_master, own = masters[0].address, masters[1].address, 0
    else:
        raw_master, store_master, own = args.master, args.master, segment
    raw = _RawMooncake(raw_master, own)
    store = MooncakeStore(
        MooncakeStoreConfig(
            master=store_master, global_segment_gb=own / GIB, key_prefix="ucm-bench/"
        )
    )
    opened = [raw, store, *reversed(opened)]  # closed in this order
    if not store.connected:
        raise RuntimeError(f"the mooncake store could not reach {store_master}")
    cases: list[tuple[str, Callable[[], tuple[float, float]], str | None]] = [
        ("raw mooncake", lambda: raw.run(srcs, dsts, n), None),
        ("mooncake", lambda: through_store(store, srcs, dsts, n), "raw mooncake"),
    ]
    return cases, opened


SECRET_ENV = "UCM_BENCH_SECRET"
#: the folders in shared memory this run made, removed at its end whatever happens
SHM_FOLDERS: list[str] = []


def _shm_folder() -> str:
    folder = tempfile.mkdtemp(prefix="ucm-bench-", dir="/dev/shm")
    SHM_FOLDERS.append(folder)
    return folder


def _signed_cases(
    root: str, nbytes: int, srcs: list, dsts: list, n: int, opened: list[Any], floor: str
) -> list[tuple[str, Callable[[], tuple[float, float]], str | None]]:
    """The posix and shared-memory stores signing their blocks, against the same baselines."""
    secret = f"env:{SECRET_ENV}"
    posix = PosixStore(PosixStoreConfig(path=os.path.join(root, "signed"), secret=secret))
    shared = SharedMemoryStore(
        DramStoreConfig(
            capacity_gb=2 * nbytes / GIB,
            path=_shm_folder(),
            secret=secret,
        )
    )
    opened += [posix, shared]
    return [
        ("posix signed", lambda: through_store(posix, srcs, dsts, n), "raw file"),
        ("dram shared signed", lambda: through_store(shared, srcs, dsts, n), floor),
    ]


def run_store_bench(args: argparse.Namespace) -> int:
    # By default, beside the default store: the disk a store would use unless told otherwise.
    # Either way in a folder of the run's own, the only thing it removes at the end.
    parent = os.path.dirname(default_store_path()) if args.path is None else args.path
    if os.path.lexists(parent) and not os.path.isdir(parent):
        raise CliError(f"--path {parent} is not a folder")
    if args.kind == "mooncake":
        try:
            import mooncake.store  # type: ignore[import-untyped]  # noqa: F401
        except ImportError as exc:
            raise CliError(
                f"--kind mooncake needs Mooncake's client (pip install 'ucm-core[mooncake]'): {exc}"
            ) from None
    os.makedirs(parent, exist_ok=True)
    root = tempfile.mkdtemp(prefix="ucm-bench-", dir=parent)
    if args.signed:  # a secret of the run's own, in its environment only
        os.environ[SECRET_ENV] = secrets.token_hex(32)
    rows: list[dict[str, object]] = []
    summary: dict[str, object] = {
        "path": root,
        "total_gb": args.total_gb,
        "compiled_copies": compiled(),
        "cases": rows,
    }
    try:
        for kib in args.block_kib:
            size = kib * 1024
            n = max(BATCH, int(args.total_gb * GIB) // size)
            srcs = [aligned(size) for _ in range(16)]
            for i, s in enumerate(srcs):
                s[:16] = i.to_bytes(16, "little")
            dsts = [aligned(size) for _ in range(BATCH)]
            cases: list[tuple[str, Callable[[], tuple[float, float]], str | None]] = []
            raw_dir = os.path.join(root, "raw")
            os.makedirs(raw_dir, exist_ok=True)
            pool: list = []
            opened: list[Any] = []
            if args.kind == "mooncake":
                cases, opened = _mooncake_cases(args, n, size, srcs, dsts)
            else:
                posix = PosixStore(PosixStoreConfig(path=os.path.join(root, "posix")))
                direct = PosixStore(
                    PosixStoreConfig(path=os.path.join(root, "direct"), o_direct=True)
                )
                dram = DramStore(
                    DramStoreConfig(
                        capacity_gb=2 * n * size / GIB, scope="process", preallocate=True
                    )
                )
                # the dram store vLLM uses (scope host): its folder is in shared memory
                shared = SharedMemoryStore(
                    DramStoreConfig(
                        capacity_gb=max(2 * n, 1024) * size / GIB,  # and 512 keys of the lookup
                        path=_shm_folder(),
                    )
                )
                opened = [posix, direct, dram, shared]
                # the shared store copies on its threads and on the thread that waits
                threads = shared.config.threads + 1
                floor = memcpy_case(threads)  # every dram case's baseline
                cases = [
                    ("raw file", lambda: raw_file(raw_dir, srcs, dsts, n, False), None),
                    ("posix", lambda: through_store(posix, srcs, dsts, n), "raw file"),
                    ("raw O_DIRECT", lambda: raw_file(raw_dir, srcs, dsts, n, True), None),
                    (
                        "posix O_DIRECT",
                        lambda: through_store(direct, srcs, dsts, n),
                        "raw O_DIRECT",
                    ),
                    ("memcpy", lambda: _memcpy(srcs, pool, dsts, n), None),
                ]
                if threads > 1:
                    cases.append((floor, lambda: _memcpy(srcs, pool, dsts, n, threads), "memcpy"))
                cases += [
                    ("dram", lambda: through_store(dram, srcs, dsts, n), floor),
                    ("dram shared", lambda: through_store(shared, srcs, dsts, n), floor),
                    ("dram in place", lambda: written_in_place(shared, srcs, dsts, n), floor),
                    (
                        "sealed copies",
                        lambda: _sealed_copies(srcs, pool, dsts, n, threads),
                        floor,
                    ),
                ]
                if compiled():  # what the compiled copies gain, in the same run
                    cases.append(
                        ("dram shared py", lambda: _in_python(shared, srcs, dsts, n), floor)
                    )
                if args.signed:
                    cases += _signed_cases(root, n * size, srcs, dsts, n, opened, floor)
            measured: dict[str, tuple[float, float]] = {}
            label = f"{kib} KiB" if kib < 1024 else f"{kib // 1024} MiB"
            timings = _interleaved(cases, args.repeat, pool, size, n, label)
            for name, _, baseline in cases:
                best = (min(t[0] for t in timings[name]), min(t[1] for t in timings[name]))
                measured[name] = best
                gb = n * size / 1e9
                row: dict[str, object] = {
                    "block_bytes": size,
                    "case": name,
                    "blocks": n,
                    "dump_gbps": gb / best[0],
                    "load_gbps": gb / best[1],
                }
                if baseline:
                    base = measured[baseline]
                    row["baseline"] = baseline
                    row["dump_ratio"] = base[0] / best[0]
                    row["load_ratio"] = base[1] / best[1]
                rows.append(row)
            if (kib == args.block_kib[-1] or n >= 512) and "lookup_prefix_512_ms" not in summary:
                # posix (a stat per key) and the shared-memory arena (an index in memory)
                named = [("mooncake", opened[1])] if args.kind == "mooncake" else [
                    ("posix", opened[0]), ("dram shared", opened[3])
                ]  # fmt: skip
                by_store = {name: _lookup_prefix_ms(store, srcs) for name, store in named}
                summary["lookup_prefix_512_ms"] = by_store[named[0][0]]
                summary["lookup_prefix_store"] = named[0][0]
                summary["lookup_prefix_512_ms_by_store"] = by_store
            for thing in opened:
                (thing.stop if hasattr(thing, "stop") else thing.close)()
                if isinstance(thing, SharedMemoryStore):
                    shutil.rmtree(thing.config.path, ignore_errors=True)
            shutil.rmtree(raw_dir, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        for folder in SHM_FOLDERS:  # a run cut short leaves no shared memory behind
            shutil.rmtree(folder, ignore_errors=True)
        SHM_FOLDERS.clear()
    _print(rows, summary)
    if args.json:
        print(json.dumps(summary))
    return 0


def _print(rows: list[dict[str, object]], summary: dict[str, object]) -> None:
    print(
        f"{'block':>8}  {'case':<15} {'write GB/s':>10} {'read GB/s':>10} "
        f"{'write ratio':>11} {'read ratio':>10}  baseline"
    )
    for row in rows:
        size = int(row["block_bytes"])  # type: ignore[call-overload]
        label = f"{size >> 10} KiB" if size < (1 << 20) else f"{size >> 20} MiB"
        ratios = (
            f"{row['dump_ratio']:>11.2f} {row['load_ratio']:>10.2f}  {row['baseline']}"
            if "baseline" in row
            else f"{'':>11} {'':>10}"
        )
        print(
            f"{label:>8}  {row['case']:<15} {row['dump_gbps']:>10.2f} "
            f"{row['load_gbps']:>10.2f} {ratios}"
        )
    by_store = summary.get("lookup_prefix_512_ms_by_store", {})
    for name, ms in by_store.items():  # type: ignore[union-attr]
        print(f"lookup_prefix of 512 keys ({name}): {ms:.3f} ms")
    if not summary["compiled_copies"]:
        print(f"the dram store copied through Python: {LIBRARY} was not built (no C compiler)")
