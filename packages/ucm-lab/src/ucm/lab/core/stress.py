"""The stores' fault harness: processes share one host-tier arena and one shared posix
folder and run random operations, while a driver kills, stops and resumes them at random
and flips bytes in what they store.

Every operation a worker runs is checked as it ends, and the run as a whole at its end:

- an OK load (a load, or a block lent by ``open_reads`` and still lent when copied out)
  returns exactly the bytes dumped under that key: every payload is derived from its key,
  so any process checks any block;
- no call on the engine's path outlasts its bound (time a worker spent stopped by the driver
  is not counted against its own calls: it says so from its SIGCONT handler);
- no slot stays taken longer than its writer lives: once every worker is dead, one pass of
  the arena reclaims every slot being written, and its books agree with its slots;
- capacity holds: the arena is its size, and the posix folder holds at most its capacity
  plus what may be in flight.

Workers write a JSON line per operation to a file of their own (so that a killed worker's
record survives it); some run in a PID namespace of their own and one as another user (on
the shared posix folder, where another user may write: signed blocks) where the driver
runs as root.  Seeded: the same seed draws the same actions (their timing still varies).

``python -m ucm.lab.core.stress --seconds 600`` (``nox -s stress``) prints the counts.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import xxhash

#: the longest an operation of each kind may take (seconds) before the run fails: a dram
#: call waits at most 2 s per hold of the arena's lock, a lookup 50 ms; a posix dump may
#: wait for the usage count (10 s) and an eviction pass (10 s)
BOUNDS = {"dram": 10.0, "dram_lookup": 1.0, "posix": 30.0, "posix_lookup": 2.0}
KEYS = 512
MAX_BYTES = 16 << 10
DRAM_CAPACITY = 2 << 20  # 128 slots of 16 KiB: full, so evictions run all the time
POSIX_CAPACITY = 4 << 20
SECRET_ENV = "UCM_STRESS_SECRET"
OTHER_UID = 65534  # nobody


def key_of(i: int) -> bytes:
    return xxhash.xxh3_128_digest(b"ucm-stress" + i.to_bytes(8, "little"))


def payload_of(key: bytes, nbytes: int = MAX_BYTES) -> bytes:
    return random.Random(key).randbytes(nbytes)


# -- the worker --


class _Worker:
    def __init__(self, cfg: dict[str, Any]) -> None:
        from ucm.core.config import DramStoreConfig, PosixStoreConfig
        from ucm.core.store import PosixStore, SharedMemoryStore
        from ucm.core.store.dram import arena as arena_module

        # readers' pins end sooner than an engine's, so that slow readers lose theirs
        arena_module.LEASE_NS = int(cfg["lease_s"] * 1e9)
        self.rng = random.Random(cfg["seed"])
        self.out = open(cfg["report"], "a", buffering=1)  # noqa: SIM115 - the worker's life
        self.stops = 0
        signal.signal(signal.SIGCONT, self._resumed)
        self.dram = None
        if cfg.get("dram"):
            self.dram = SharedMemoryStore(
                DramStoreConfig(path=cfg["dram"], capacity_gb=DRAM_CAPACITY / 2**30)
            )
            self.dram.check_block_bytes(MAX_BYTES)
        self.posix = PosixStore(
            PosixStoreConfig(
                path=cfg["posix"], shared=True, secret=f"env:{SECRET_ENV}",
                capacity_gb=POSIX_CAPACITY / 2**30, io_threads=2,
            )
        )  # fmt: skip
        self.keys = [key_of(i) for i in range(KEYS)]

    def _resumed(self, *_: Any) -> None:
        self.stops += 1

    def record(self, kind: str, op: str, took: float, stopped: bool, **counts: Any) -> None:
        self.out.write(json.dumps({"kind": kind, "op": op, "took": took, "stopped": stopped,
                                   **counts}) + "\n")  # fmt: skip

    def wrong(self, what: str) -> None:
        self.out.write(json.dumps({"wrong": what}) + "\n")

    def run(self) -> None:
        print("running", flush=True)
        while True:
            stores = [("posix", self.posix)] + ([("dram", self.dram)] * 3 if self.dram else [])
            kind, store = self.rng.choice(stores)
            ops = ["dump", "load", "lookup", "remove"]
            if kind == "dram":
                ops += ["writes", "reads", "writes", "reads"]
            op = self.rng.choice(ops)
            batch = self.rng.sample(self.keys, self.rng.randint(1, 8))
            stops = self.stops
            started = time.monotonic()
            counts = getattr(self, f"_{op}")(store, batch)
            took = time.monotonic() - started
            self.record(kind, op, took, self.stops != stops, **counts)

    def _check(self, key: bytes, got: bytes | memoryview, what: str) -> bool:
        if bytes(got) != payload_of(key):
            self.wrong(f"{what} of {key.hex()}: OK with another block's bytes")
            return False
        return True

    def _dump(self, store: Any, batch: list[bytes]) -> dict[str, int]:
        results = store.wait(store.dump(batch, [payload_of(k) for k in batch]), 60)
        return dict(Counter(r.status.value for r in results))

    def _load(self, store: Any, batch: list[bytes]) -> dict[str, int]:
        outs = [bytearray(MAX_BYTES) for _ in batch]
        results = store.wait(store.load(batch, outs), 60)
        for k, out, r in zip(batch, outs, results):
            if r.ok:
                self._check(k, out, "load")
        return dict(Counter(r.status.value for r in results))

    def _lookup(self, store: Any, batch: list[bytes]) -> dict[str, int]:
        store.lookup_prefix(batch)
        return {"hits": sum(store.lookup(batch))}

    def _remove(self, store: Any, batch: list[bytes]) -> dict[str, int]:
        return {"removed": store.remove(batch[:2])}

    def _writes(self, store: Any, batch: list[bytes]) -> dict[str, int]:
        """Room reserved, filled late (past a reader's lease: other writers evict meanwhile),
        committed once the copy ended; sometimes given back unwritten."""
        writes = store.open_writes(batch, MAX_BYTES)
        if writes is None:
            return {"no_room": 1}
        if self.rng.random() < 0.3:  # a copy that lands late
            time.sleep(self.rng.uniform(0, 1.0))
        if self.rng.random() < 0.1:
            writes.abort()
            return {"aborted": 1}
        for k, view in zip(batch, writes.views):
            if view is not None:
                view[:] = payload_of(k)
        if self.rng.random() < 0.3:  # the copy's end is seen late (a GPU event waited for)
            time.sleep(self.rng.uniform(0, 0.5))
        results = store.wait(writes.commit(), 60)
        return dict(Counter(r.status.value for r in results))

    def _reads(self, store: Any, batch: list[bytes]) -> dict[str, int]:
        """Blocks lent where they lie, copied out late (sometimes past the pins' lease): a
        block counts only where it was checked and still lent when copied."""
        reads = store.open_reads(batch, MAX_BYTES)
        if reads is None:
            return {"none_lent": 1}
        results = reads.task.wait(60)
        if self.rng.random() < 0.3:  # a copy out that ends late
            time.sleep(self.rng.uniform(0, 0.8))
        copies = [
            bytes(v) if v is not None and r.ok else None for v, r in zip(reads.views, results)
        ]
        kept = reads.release()
        for k, copy, held in zip(batch, copies, kept):
            if copy is not None and held:
                self._check(k, copy, "lent read")
        return {"lent_ok": sum(bool(c) and h for c, h in zip(copies, kept))}


def _worker_main(cfg: dict[str, Any]) -> int:
    if cfg.get("uid") is not None:
        # root drops its privileges once its modules are loaded (its interpreter may live
        # where the other user cannot read): from here on, it is that user
        import ucm.core.store  # noqa: F401

        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])
    _Worker(cfg).run()
    return 0


# -- the driver --


class _Child:
    """A worker process: where it runs and how to reach its real pid."""

    def __init__(self, name: str, cfg: dict[str, Any], prefix: list[str], uid: int | None):
        self.name, self.cfg, self.prefix, self.uid = name, cfg, prefix, uid
        self.proc: subprocess.Popen[str] | None = None
        self.pid = 0  # the worker's own pid, here (not the unshare that started it)
        self.stopped_until = 0.0

    def start(self, seed: int) -> None:
        self.cfg["seed"] = seed
        self.cfg["uid"] = self.uid
        self.proc = subprocess.Popen(
            [*self.prefix, sys.executable, "-m", "ucm.lab.core.stress", "--worker",
             json.dumps(self.cfg)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if line.strip() != "running":
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise RuntimeError(f"worker {self.name} did not start: {line}{err}")
        self.pid = self.proc.pid
        if self.prefix:  # unshare --fork: the worker is its child
            children = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text().split()
            self.pid = int(children[0])

    def signal(self, sig: int) -> None:
        if self.pid <= 0:  # never 0 or -1: those name whole process groups
            return
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.kill()  # the unshare around it, if any
            self.proc.communicate()


def _open_to_everyone(posix: Path) -> None:
    """Make the shared posix store and open all of it to every user, as a team's mount
    with a permissive umask would be: the other user's worker writes blocks too."""
    from ucm.core.config import PosixStoreConfig
    from ucm.core.store import PosixStore

    PosixStore(
        PosixStoreConfig(path=str(posix), shared=True, secret=f"env:{SECRET_ENV}",
                         capacity_gb=POSIX_CAPACITY / 2**30)
    ).close()  # fmt: skip
    for sub in (f"{i:02x}" for i in range(256)):
        (posix / "blocks" / sub).mkdir(exist_ok=True)
        os.chmod(posix / "blocks" / sub, 0o777)
    for name in ("blocks", "writers"):
        os.chmod(posix / name, 0o777)
    for name in ("usage", "evicting"):
        os.chmod(posix / name, 0o666)


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    done = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True)
    return done.returncode == 0


def _flip_dram(folder: str, rng: random.Random) -> bool:
    """Flip one byte of a stored block that nobody reads, under the arena's lock (as a
    co-tenant's bug or a bit flip at rest would): readers must find it, never use it."""
    from ucm.core.store.dram.arena import READY, Arena, ArenaBusy

    arena = Arena.attach(folder, 1 << 40)
    if arena is None:
        return False
    try:
        with arena.locked():
            npc = arena.np
            idle = [int(s) for s in ((npc["state"] == READY) & (npc["pins"] == 0)).nonzero()[0]]
            if not idle:
                return False
            s = rng.choice(idle)
            view = arena.slot(s, int(npc["length"][s]))
            view[rng.randrange(view.nbytes)] ^= 1 << rng.randrange(8)
            return True
    except ArenaBusy:
        return False
    finally:
        arena.close()


def _flip_posix(folder: str, rng: random.Random) -> bool:
    blocks = Path(folder, "blocks").rglob("*")
    files = [p for p in blocks if p.is_file() and not p.name.startswith(".")]
    if not files:
        return False
    path = rng.choice(files)
    try:
        with open(path, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            if not size:
                return False
            at = rng.randrange(size)
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0x10]))
        return True
    except OSError:
        return False


def run(seconds: float, seed: int, workers: int, folder: str | None, lease_s: float) -> dict:
    rng = random.Random(seed)
    base = Path(tempfile.mkdtemp(prefix="ucm-stress-", dir=folder))
    os.chmod(base, 0o755)
    shm = f"/dev/shm/ucm-stress-{uuid.uuid4().hex[:12]}"
    posix = base / "posix"
    posix.mkdir()
    os.chmod(posix, 0o777)  # a team's shared folder: another user writes it too
    os.environ.setdefault(SECRET_ENV, "stress-secret-" + uuid.uuid4().hex)
    root = os.geteuid() == 0
    _open_to_everyone(posix)
    unshare = _can_unshare()
    children: list[_Child] = []
    for i in range(workers):
        report = base / f"worker{i}.jsonl"
        report.touch()
        other = root and i == workers - 1 and workers > 1
        if other:
            os.chown(report, OTHER_UID, OTHER_UID)
        cfg = {"report": str(report), "posix": str(posix), "lease_s": lease_s,
               "dram": None if other else shm}  # fmt: skip
        own_namespace = unshare and i % 2 and not other
        prefix = ["unshare", "--pid", "--fork", "--kill-child"] if own_namespace else []
        children.append(_Child(f"worker{i}", cfg, prefix, OTHER_UID if other else None))
    events: Counter[str] = Counter()
    try:
        for c in children:
            c.start(rng.getrandbits(32))
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(0.05, 0.4))
            now = time.monotonic()
            for c in children:
                if c.stopped_until and now >= c.stopped_until:
                    c.signal(signal.SIGCONT)
                    c.stopped_until = 0.0
            action = rng.random()
            c = rng.choice(children)
            if action < 0.15:
                c.kill()
                c.start(rng.getrandbits(32))
                events["kills"] += 1
            elif action < 0.35 and not c.stopped_until:
                c.signal(signal.SIGSTOP)
                c.stopped_until = now + rng.uniform(0.05, 3.0)
                events["stops"] += 1
            elif action < 0.55:
                events["dram_flips"] += _flip_dram(shm, rng)
            elif action < 0.65:
                events["posix_flips"] += _flip_posix(str(posix), rng)
    finally:
        for c in children:
            c.kill()
    summary = _summarise(base, children, events)
    summary.update(_check_after(shm, str(posix)))
    summary["seed"], summary["seconds"], summary["workers"] = seed, seconds, workers
    summary["pid_namespaces"] = unshare
    summary["other_uid"] = root and workers > 1
    shutil.rmtree(shm, ignore_errors=True)
    shutil.rmtree(base, ignore_errors=True)
    return summary


def _summarise(base: Path, children: list[_Child], events: Counter[str]) -> dict:
    ops: Counter[str] = Counter()
    statuses: Counter[str] = Counter()
    slowest: dict[str, float] = {}
    over: list[str] = []
    wrong: list[str] = []
    for c in children:
        for line in Path(c.cfg["report"]).read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # the last line of a killed worker, cut short
            if "wrong" in rec:
                wrong.append(rec["wrong"])
                continue
            kind = rec["kind"] + ("_lookup" if rec["op"] == "lookup" else "")
            ops[f"{rec['kind']}_{rec['op']}"] += 1
            for name, n in rec.items():
                if name not in ("kind", "op", "took", "stopped"):
                    statuses[name] += n
            if rec["stopped"]:
                continue  # its own stop, not a wait
            slowest[kind] = max(slowest.get(kind, 0.0), rec["took"])
            if rec["took"] > BOUNDS[kind]:
                over.append(f"{rec['kind']} {rec['op']} took {rec['took']:.2f} s")
    return {"operations": sum(ops.values()), "by_op": dict(ops), "results": dict(statuses),
            **events, "slowest_s": {k: round(v, 3) for k, v in slowest.items()},
            "over_bound": over[:20], "wrong_bytes": len(wrong), "wrong": wrong[:20]}  # fmt: skip


def _check_after(shm: str, posix: str) -> dict:
    """Every worker dead: one pass reclaims every slot being written; the books agree."""
    from ucm.core.store.dram.arena import Arena
    from ucm.core.store.posix import scan_store

    out: dict[str, Any] = {}
    arena = Arena.attach(shm, 1 << 40)
    if arena is not None:
        try:
            out["writing_left_by_the_dead"] = arena.stats()["writing"]
            arena.evict(0)
            out["writing_after_one_pass"] = arena.stats()["writing"]
            with arena.locked():
                out["arena_problems"] = arena.check()
            g = arena.geometry
            out["arena_within_capacity"] = g.slots * g.slot_bytes <= DRAM_CAPACITY
        finally:
            arena.close()
    scan = scan_store(posix)
    held = sum(b.size for b in scan.blocks)
    # each process counts the others' published blocks, not their writes in flight: two
    # I/O threads a worker may each pass the limit by one block
    slack = 16 * (MAX_BYTES + 4096)
    out["posix_bytes"] = held
    out["posix_within_capacity"] = held <= POSIX_CAPACITY + slack
    return out


def failures(summary: dict) -> list[str]:
    """What the run found wrong (empty: it passed)."""
    found = []
    if summary["wrong_bytes"]:
        found.append(f"{summary['wrong_bytes']} loads OK with wrong bytes: {summary['wrong']}")
    if summary["over_bound"]:
        found.append(f"calls over their bound: {summary['over_bound']}")
    if summary.get("writing_after_one_pass"):
        found.append(f"{summary['writing_after_one_pass']} slots still taken by dead writers")
    if summary.get("arena_problems"):
        found.append(f"the arena's books: {summary['arena_problems']}")
    if summary.get("arena_within_capacity") is False or not summary["posix_within_capacity"]:
        found.append("a store held more than its capacity")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ucm.lab.core.stress",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--folder", help="where the posix folder goes (default: the temp dir)")
    parser.add_argument("--lease-s", type=float, default=0.5, help="readers' pin lease")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker_main(json.loads(args.worker))
    summary = run(args.seconds, args.seed, args.workers, args.folder, args.lease_s)
    print(json.dumps(summary, indent=1))
    found = failures(summary)
    for line in found:
        print("FAILED:", line, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
