"""Copies between an engine's cache and the host dram tier, straight into and out of the
tier's own memory, against the same copies through a pinned buffer, in the same run.

The host tier (a ``dram`` store of scope ``host``) keeps its blocks in an arena of shared
memory.  On a GPU the arena is registered with the CUDA driver
(:class:`ucm.kernels.PinnedRegions`), so that the DMA engine copies straight into a block's
slot (``Store.open_writes``) and out of a lent block (``Store.open_reads``).  For each block
size this prints:

* the copy alone, device to host and back: into the arena's slots against into one pinned
  buffer of the same bytes (:class:`ucm.kernels.HostStager` both ways).  Target: 1.0;
* a dump and a load through the store, as an engine's worker does them: the copy into the
  slots and the store's seal, against the copy into pinned rows and the store's own copy
  (the way every dump went before), and the lent blocks checked and copied out, against a
  load into rows and the copy from them;
* the same dump and load with the blocks digested and checked by the device
  (:mod:`ucm.kernels.digest`: the store books digests, no host thread reads a block),
  against the copy alone through one pinned buffer (target: 0.8), and the host's CPU time
  per GB of each way (the process's, every thread's);
* the same copies into slots in random order, as an arena that has turned over hands them
  out, by DMA a row, by the kernel writing host memory itself (``direct=True``), and as
  one row table (:mod:`ucm.kernels.row_table`: the rows through the device's scratch, one
  kernel launch between it and the slots);
* the device-checked dump and load again on an arena whose free slots lie apart (half of
  two batches removed at random), as a busy server's are;
* how long registering the arena took;
* with ``--stages``, the device-checked dump and load of each size stage by stage (the
  store's calls, the copies, the bookkeeping), medians of ``--repeat`` batches.

On the CPU (no GPU) the same copies run on a CPU cache: nothing is registered, the
"pinned" buffer is plain memory, and the copies take the slots as a tensor each, as the
mover does there (no row table columns).

    python -m ucm.lab.kernels.bench_tier [--device auto|cpu|cuda] [--repeat N] [--json]
        [--stages]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import uuid
from collections.abc import Callable

import torch
from ucm.core import SlotReads, SlotWrites
from ucm.core.config import DramStoreConfig
from ucm.core.store import SharedMemoryStore
from ucm.kernels import HostStager, PinnedRegions, alloc_host_buffers
from ucm.kernels.mover import row_buffers
from ucm.kernels.pinning import host_rows
from ucm.kernels.row_table import RowTable

#: host rows as the stager takes them
Rows = torch.Tensor | list[torch.Tensor] | RowTable

MIB = 2**20
LAYERS = 8
HEADS, HEAD_DIM = 8, 64  # bf16: 2 KiB of K and V per token and layer, 16 KiB for 8 layers
TAG = b"bench-tier"


#: per way measured, the median host CPU seconds of a batch (all the process's threads)
CPU_SECONDS: dict[str, float] = {}


def _timed(
    fn: Callable[[], object],
    sync: Callable[[], None],
    repeat: int,
    name: str = "",
    after: Callable[[], None] = lambda: None,
) -> float:
    """Median seconds of ``fn`` (synchronised before and after), after one warm-up; its
    median CPU seconds go to ``CPU_SECONDS[name]``.  ``after`` runs untimed after each."""
    fn()
    sync()
    after()
    samples, cpu = [], []
    for _ in range(repeat):
        sync()
        started, used = time.perf_counter(), time.process_time()
        fn()
        sync()
        samples.append(time.perf_counter() - started)
        cpu.append(time.process_time() - used)
        after()
    if name:
        CPU_SECONDS[name] = statistics.median(cpu)
    return statistics.median(samples)


class Case:
    """One block size: a cache of ``count`` blocks and a host tier made for them."""

    def __init__(self, device: torch.device, block_bytes: int, total_bytes: int) -> None:
        self.device = device
        tokens = block_bytes // (LAYERS * 2 * HEADS * HEAD_DIM * 2)
        self.count = total_bytes // block_bytes
        self.nbytes = block_bytes
        gen = torch.Generator().manual_seed(block_bytes)
        self.caches = [
            torch.randn(self.count + 1, 2, tokens, HEADS, HEAD_DIM, generator=gen)
            .to(torch.bfloat16)
            .to(device)
            for _ in range(LAYERS)
        ]
        self.ids = [[1 + b] for b in range(self.count)]  # one engine block a store block
        self.stager = HostStager(device)
        # the kernel reading and writing the host memory itself: one launch, whatever the
        # order of the rows
        self.direct = HostStager(device, direct=device.type == "cuda")
        self.path = f"/dev/shm/ucm-bench-tier-{uuid.uuid4().hex[:8]}"
        capacity = 3 * total_bytes + 64 * MIB  # rows of two batches stored, room to write
        self.store = SharedMemoryStore(
            DramStoreConfig(path=self.path, capacity_gb=capacity / 2**30)
        )
        self.store.check_block_bytes(block_bytes)
        self.pinned = PinnedRegions()
        started = time.perf_counter()
        regions = self.store.host_memory()
        self.registered = device.type == "cuda" and all(self.pinned.register(r) for r in regions)
        self.register_s = time.perf_counter() - started
        self.region_bytes = sum(r.nbytes for r in regions)
        self.rows = alloc_host_buffers(block_bytes, self.count)
        self.written: list[bytes] = []  # the last dump's keys

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def keys(self) -> list[bytes]:
        """Fresh keys for a batch: random, as block keys are (hashes)."""
        return [os.urandom(16) for _ in range(self.count)]

    # -- the copies alone --

    def slot_tensors(self, views: list[memoryview | None]) -> list[torch.Tensor]:
        """The slots as host rows, as the worker makes them (slices of the registered
        arena on a GPU)."""
        if self.registered:
            return self.pinned.rows(views)  # type: ignore[arg-type]
        return [torch.frombuffer(v, dtype=torch.uint8) for v in views]  # type: ignore[call-overload]

    def host_rows(self, lent: SlotWrites | SlotReads, which: list[int] | None = None) -> Rows:
        """Views of the store's room or loan as the mover hands them to the stager: on a GPU
        one row table over the registered arena, on the CPU a tensor a view."""
        which = list(range(len(lent.views))) if which is None else which
        return host_rows(self.pinned, lent, which)

    def d2h(
        self,
        rows: Rows,
        direct: bool = False,
        digests: torch.Tensor | None = None,
    ) -> None:
        stager = self.direct if direct else self.stager
        stager.dump(self.caches, self.ids, rows, digests=digests).wait()

    def h2d(self, rows: Rows, direct: bool = False) -> None:
        (self.direct if direct else self.stager).load(self.caches, self.ids, rows).wait()

    # -- through the store --

    def dump_rows(self) -> None:
        keys = self.keys()
        self.d2h(self.rows)
        assert all(
            r.ok for r in self.store.wait(self.store.dump(keys, row_buffers(list(self.rows)), TAG))
        )
        self.written = keys

    def dump_in_place(self) -> None:
        keys = self.keys()
        writes = self.store.open_writes(keys, self.nbytes, TAG)
        assert writes is not None
        self.d2h(self.slot_tensors(writes.views))
        assert all(r.ok for r in self.store.wait(writes.commit()))
        self.written = keys

    def dump_digested(self) -> None:
        """Into the slots, digested by the device: the store books the digests."""
        keys = self.keys()
        writes = self.store.open_writes(keys, self.nbytes, TAG)
        assert writes is not None and writes.takes_digests
        digests = torch.zeros(self.count, dtype=torch.int64, pin_memory=self.registered)
        self.d2h(self.host_rows(writes), digests=digests)
        found = [d & ((1 << 64) - 1) for d in digests.tolist()]
        assert all(r.ok for r in self.store.wait(writes.commit(found)))
        self.written = keys

    def load_checked(self, keys: list[bytes]) -> None:
        """Lent unchecked, checked by the device on the way into the cache."""
        reads = self.store.open_reads(keys, self.nbytes, TAG, check=False)
        assert reads is not None and reads.digests is not None
        try:
            rows = self.host_rows(reads)
            verdicts, handle = self.stager.load_checked(self.caches, self.ids, rows, reads.digests)
            handle.wait()
            assert all(verdicts.tolist())
        finally:
            assert all(reads.release())

    def forget(self) -> None:
        """Remove what the last dump wrote (untimed: the next one needs the room)."""
        self.store.remove(self.written)
        self.written = []

    def load_rows(self, keys: list[bytes]) -> None:
        assert all(
            r.ok for r in self.store.wait(self.store.load(keys, row_buffers(list(self.rows)), TAG))
        )
        self.h2d(self.rows)

    def load_lent(self, keys: list[bytes]) -> None:
        reads = self.store.open_reads(keys, self.nbytes, TAG)
        assert reads is not None and all(r.ok for r in reads.task.wait(60))
        try:
            self.h2d(self.slot_tensors(reads.views))
        finally:
            assert all(reads.release())

    def close(self) -> None:
        self.pinned.close()
        self.store.close()
        shutil.rmtree(self.path, ignore_errors=True)


def _check(case: Case) -> None:
    """A round trip through the tier in place equals the cache: dumped in place, loaded
    lent; then digested and checked by the device through row tables."""
    keys = case.keys()
    writes = case.store.open_writes(keys, case.nbytes, TAG)
    assert writes is not None
    case.d2h(case.slot_tensors(writes.views))
    assert all(r.ok for r in case.store.wait(writes.commit()))
    expected = [c.clone() for c in case.caches]
    for c in case.caches:
        c[1:].normal_()  # overwritten: the load must put every block back
    reads = case.store.open_reads(keys, case.nbytes, TAG)
    assert reads is not None and all(r.ok for r in reads.task.wait(60))
    case.h2d(case.slot_tensors(reads.views))
    assert all(reads.release())
    case.sync()
    for got, want in zip(case.caches, expected):
        if not torch.equal(got, want):
            raise AssertionError("a block loaded from the tier differs from the one dumped")
    case.store.remove(keys)
    case.dump_digested()
    for c in case.caches:
        c[1:].normal_()
    case.load_checked(case.written)  # every block passes its digest
    case.sync()
    for got, want in zip(case.caches, expected):
        if not torch.equal(got, want):
            raise AssertionError("a block checked by the device differs from the one dumped")
    case.forget()


def _measure(case: Case, repeat: int) -> dict[str, float]:
    """Seconds per batch of every way, the same blocks each way."""
    slots = case.store.open_writes(case.keys(), case.nbytes, TAG)
    assert slots is not None
    slot_rows = case.slot_tensors(slots.views)
    t = {
        "d2h_pinned": _timed(lambda: case.d2h(case.rows), case.sync, repeat, "d2h_pinned"),
        "d2h_slots": _timed(lambda: case.d2h(slot_rows), case.sync, repeat),
        "h2d_pinned": _timed(lambda: case.h2d(case.rows), case.sync, repeat, "h2d_pinned"),
        "h2d_slots": _timed(lambda: case.h2d(slot_rows), case.sync, repeat),
    }
    # slots out of order (an arena long in use): no two rows of a batch one after another
    shuffled = [slot_rows[i] for i in torch.randperm(len(slot_rows)).tolist()]
    t["d2h_scattered"] = _timed(lambda: case.d2h(shuffled), case.sync, repeat)
    t["h2d_scattered"] = _timed(lambda: case.h2d(shuffled), case.sync, repeat)
    t["d2h_direct"] = _timed(lambda: case.d2h(shuffled, direct=True), case.sync, repeat)
    t["h2d_direct"] = _timed(lambda: case.h2d(shuffled, direct=True), case.sync, repeat)
    if case.registered:  # (on the CPU the copies take the rows as tensors)
        table = case.host_rows(slots, torch.randperm(len(slot_rows)).tolist())
        t["d2h_table"] = _timed(lambda: case.d2h(table), case.sync, repeat)
        t["h2d_table"] = _timed(lambda: case.h2d(table), case.sync, repeat)
    shuffled.clear()
    slot_rows = []  # the views go before their room does
    slots.abort()
    for name, fn in (
        ("dump_rows", case.dump_rows),
        ("dump_in_place", case.dump_in_place),
        ("dump_digested", case.dump_digested),
    ):
        t[name] = _timed(fn, case.sync, repeat, name, after=case.forget)
    stored = case.keys()
    dumped = case.store.wait(case.store.dump(stored, row_buffers(list(case.rows)), TAG))
    assert all(r.ok for r in dumped)
    for name, load in (
        ("load_rows", case.load_rows),
        ("load_lent", case.load_lent),
        ("load_checked", case.load_checked),
    ):
        t[name] = _timed(lambda load=load: load(stored), case.sync, repeat, name)  # type: ignore[misc]
    case.store.remove(stored)
    _scatter_free_slots(case)
    t["dump_digested_apart"] = _timed(case.dump_digested, case.sync, repeat, after=case.forget)
    case.dump_digested()  # into slots apart: the loads' blocks
    stored = case.written
    t["load_checked_apart"] = _timed(lambda: case.load_checked(stored), case.sync, repeat)
    case.forget()
    return t


def _scatter_free_slots(case: Case) -> None:
    """Leave the arena's free slots apart, as eviction leaves a busy server's: two batches
    stored, half of them removed at random (the next batch takes every other slot)."""
    keys = case.keys() + case.keys()
    rows = row_buffers(list(case.rows))
    for part in (keys[: case.count], keys[case.count :]):
        assert all(r.ok for r in case.store.wait(case.store.dump(part, rows, TAG)))
    gone = torch.randperm(len(keys))[: case.count].tolist()
    case.store.remove([keys[i] for i in gone])


def _stages(case: Case, repeat: int) -> dict[str, float]:
    """Median milliseconds of each stage of a device-checked dump and load of one batch."""
    times: dict[str, list[float]] = {}
    mark = [0.0]

    def lap(name: str = "") -> None:
        """End the stage under way (``name``; "" starts the first) and start the next."""
        case.sync()
        now = time.perf_counter()
        if name:
            times.setdefault(name, []).append(now - mark[0])
        mark[0] = now

    for _ in range(repeat + 1):  # the first round warms up
        keys = case.keys()
        digests = torch.zeros(case.count, dtype=torch.int64, pin_memory=case.registered)
        lap()
        writes = case.store.open_writes(keys, case.nbytes, TAG)
        assert writes is not None
        lap("open_writes")
        rows = case.host_rows(writes)
        lap("host rows")
        case.stager.dump(case.caches, case.ids, rows).wait()
        lap("copy alone")
        case.stager.dump(case.caches, case.ids, rows, digests=digests).wait()
        lap("copy and digest")
        found = [d & ((1 << 64) - 1) for d in digests.tolist()]
        case.store.wait(writes.commit(found))
        lap("commit (book)")
        del rows
        reads = case.store.open_reads(keys, case.nbytes, TAG, check=False)
        assert reads is not None and reads.digests is not None
        lap("open_reads")
        rows = case.host_rows(reads)
        lap("host rows (lent)")
        case.stager.load_checked(case.caches, case.ids, rows, reads.digests)[1].wait()
        lap("checked load")
        del rows
        reads.release()
        lap("release")
        case.store.remove(keys)
    return {k: 1e3 * statistics.median(v[1:]) for k, v in times.items()}


def run(
    device: torch.device, sizes: list[int], total_bytes: int, repeat: int, stages: bool = False
) -> list[dict]:
    out = []
    for block_bytes in sizes:
        case = Case(device, block_bytes, total_bytes)
        try:
            _check(case)
            t = _measure(case, repeat)
            staged = _stages(case, repeat) if stages else {}
        finally:
            case.close()
        gb = case.count * case.nbytes / 1e9
        gbs = {k: gb / v for k, v in t.items()}
        out.append({
            "block_bytes": block_bytes, "blocks": case.count, "registered": case.registered,
            "register_s": case.register_s, "region_bytes": case.region_bytes,
            "gb_s": gbs,
            "cpu_s_per_gb": {k: v / gb for k, v in CPU_SECONDS.items()},
            "stages_ms": staged,
            "ratios": {
                "d2h": gbs["d2h_slots"] / gbs["d2h_pinned"],
                "h2d": gbs["h2d_slots"] / gbs["h2d_pinned"],
                "dump": gbs["dump_in_place"] / gbs["dump_rows"],
                "load": gbs["load_lent"] / gbs["load_rows"],
                "dump_digested_over_pinned": gbs["dump_digested"] / gbs["d2h_pinned"],
                "load_checked_over_pinned": gbs["load_checked"] / gbs["h2d_pinned"],
                "dump_in_place_over_pinned": gbs["dump_in_place"] / gbs["d2h_pinned"],
                "load_lent_over_pinned": gbs["load_lent"] / gbs["h2d_pinned"],
            },
        })  # fmt: skip
        CPU_SECONDS.clear()
    return out


def _cell(gbs: dict[str, float], a: str, b: str, ratio: float) -> str:
    return f"{gbs[a]:5.1f}/{gbs[b]:5.1f} ({ratio:4.2f})"


def _print(device: torch.device, rows: list[dict]) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"host tier copies on {name}: GB/s (ratio in place / through a pinned buffer)")
    print(f"{'block':>8} {'copy D2H':>18} {'copy H2D':>18} {'dump':>18} {'load':>18}")
    for r in rows:
        g, q = r["gb_s"], r["ratios"]
        print(
            f"{r['block_bytes'] // 1024:>5}KiB {_cell(g, 'd2h_slots', 'd2h_pinned', q['d2h'])} "
            f"{_cell(g, 'h2d_slots', 'h2d_pinned', q['h2d'])} "
            f"{_cell(g, 'dump_in_place', 'dump_rows', q['dump'])} "
            f"{_cell(g, 'load_lent', 'load_rows', q['load'])}"
        )
    print(
        "slots out of order: D2H, H2D GB/s (ratio to the pinned buffer), a DMA copy a row / "
        "the kernel direct / a row table"
    )
    for r in rows:
        g = r["gb_s"]
        cells = [
            f"{g[k]:5.1f} ({g[k] / g[base]:4.2f})" if k in g else f"{'-':>12}"
            for k, base in (
                ("d2h_scattered", "d2h_pinned"),
                ("h2d_scattered", "h2d_pinned"),
                ("d2h_direct", "d2h_pinned"),
                ("h2d_direct", "h2d_pinned"),
                ("d2h_table", "d2h_pinned"),
                ("h2d_table", "h2d_pinned"),
            )
        ]
        print(f"{r['block_bytes'] // 1024:>5}KiB " + " ".join(cells))
    print(
        "digested and checked by the device: GB/s (ratio to the pinned buffer), and host CPU "
        "s/GB, against sealed and checked by the store's threads"
    )
    print(f"{'block':>8} {'dump':>14} {'by store':>14} {'load':>14} {'by store':>14}  CPU s/GB")
    for r in rows:
        g, q, c = r["gb_s"], r["ratios"], r["cpu_s_per_gb"]
        print(
            f"{r['block_bytes'] // 1024:>5}KiB "
            f"{g['dump_digested']:5.1f} ({q['dump_digested_over_pinned']:4.2f})  "
            f"{g['dump_in_place']:5.1f} ({q['dump_in_place_over_pinned']:4.2f})  "
            f"{g['load_checked']:5.1f} ({q['load_checked_over_pinned']:4.2f})  "
            f"{g['load_lent']:5.1f} ({q['load_lent_over_pinned']:4.2f})  "
            f"dump {c['dump_digested']:.3f} / {c['dump_in_place']:.3f}, "
            f"load {c['load_checked']:.3f} / {c['load_lent']:.3f}, "
            f"pinned copy {c['d2h_pinned']:.3f} / {c['h2d_pinned']:.3f}"
        )
    print("the same, the arena's free slots apart: GB/s (ratio to the pinned buffer)")
    for r in rows:
        g = r["gb_s"]
        dump, load = g["dump_digested_apart"], g["load_checked_apart"]
        print(
            f"{r['block_bytes'] // 1024:>5}KiB dump {dump:5.1f} ({dump / g['d2h_pinned']:4.2f})  "
            f"load {load:5.1f} ({load / g['h2d_pinned']:4.2f})"
        )
    for r in rows:
        if r["stages_ms"]:
            cells = ", ".join(f"{k} {v:.2f}" for k, v in r["stages_ms"].items())
            print(f"{r['block_bytes'] // 1024:>5}KiB stages, ms: {cells}")
    for r in rows:
        if r["registered"]:
            gib = r["region_bytes"] / 2**30
            print(
                f"registered {gib:.2f} GiB of arena in {r['register_s']:.3f} s "
                f"({gib / max(r['register_s'], 1e-9):.1f} GiB/s)"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--total-mib", type=int, default=512, help="bytes a batch moves")
    parser.add_argument("--sizes-kib", default="256,2048", help="store block sizes")
    parser.add_argument("--json", action="store_true", help="print every figure as JSON last")
    parser.add_argument(
        "--stages", action="store_true", help="time the device-checked dump and load by stage"
    )
    args = parser.parse_args(argv)
    wanted = (
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    device = torch.device(wanted)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    sizes = [int(s) * 1024 for s in args.sizes_kib.split(",")]
    rows = run(device, sizes, args.total_mib * MIB, args.repeat, args.stages)
    _print(device, rows)
    if args.json:
        print(json.dumps({"device": str(device), "cases": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
