"""The child processes of the multi-process tests, started with::

    python -m ucm.lab.testing.procs MODE JSON_CONFIG

Their keys and payloads come from :mod:`ucm.lab.testing.core` (``key``, ``payload_of``):
every payload is derived from its key alone, so any process can check any block it loads
byte for byte without talking to the process that wrote it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from typing import Any

from ucm.lab.testing.core import blob, key, payload_of, size_of


def temp_files(root: str) -> list[str]:
    """The store's temporary files (``blocks/xx/.*.tmp``) under ``root``."""
    blocks = os.path.join(root, "blocks")
    found = []
    for sub in sorted(os.listdir(blocks)):
        path = os.path.join(blocks, sub)
        if os.path.isdir(path):
            found += [os.path.join(path, n) for n in os.listdir(path) if n.endswith(".tmp")]
    return found


def _store(cfg: dict):
    from ucm.core.config import DramStoreConfig, PosixStoreConfig
    from ucm.core.store import PosixStore, SharedMemoryStore

    if cfg.get("dram"):  # a host-scope dram store: an arena in shared memory
        store = SharedMemoryStore(
            DramStoreConfig(path=cfg["root"], capacity_gb=cfg.get("capacity_gb") or 0.0625)
        )
        store.check_block_bytes(cfg["max_size"])  # as an engine does at start-up
        return store
    return PosixStore(
        PosixStoreConfig(
            path=cfg["root"],
            fsync=cfg.get("fsync", "never"),
            o_direct=cfg.get("o_direct", False),
            io_threads=cfg.get("io_threads", 4),
            capacity_gb=cfg.get("capacity_gb"),
        )
    )


def child_crash(cfg: dict) -> int:
    """Dump (and remove, and load) blocks forever; the parent kills this with SIGKILL."""
    from ucm.core.store import Status

    rng = random.Random(cfg["seed"])
    max_size = cfg["max_size"]
    keys = [key(i) for i in range(cfg["n_keys"])]
    store = _store(cfg)
    print("running", flush=True)
    while True:
        batch = rng.sample(keys, rng.randint(1, 8))
        results = store.wait(store.dump(batch, [payload_of(k, max_size) for k in batch]))
        for k, r in zip(batch, results):
            if not r.ok:
                print(f"dump of {k.hex()} failed: {r}", file=sys.stderr, flush=True)
                return 3
        if rng.random() < 0.3:  # churn, so that keys are written again
            store.remove(rng.sample(keys, rng.randint(1, 8)))
        if rng.random() < 0.3:  # and a reader may be killed too
            batch = rng.sample(keys, rng.randint(1, 4))
            outs = [bytearray(size_of(k, max_size)) for k in batch]
            for k, out, r in zip(batch, outs, store.wait(store.load(batch, outs))):
                if r.status is Status.OK and bytes(out) != payload_of(k, max_size):
                    print(f"load of {k.hex()} returned wrong bytes", file=sys.stderr, flush=True)
                    return 4
                if r.status not in (Status.OK, Status.MISS):
                    print(f"load of {k.hex()}: {r}", file=sys.stderr, flush=True)
                    return 5


def child_stress(cfg: dict) -> int:
    """Dump, load, remove and look up overlapping keys until the time is up; report counts."""
    from ucm.core.store import Status

    rng = random.Random(cfg["seed"])
    max_size = cfg["max_size"]
    keys = [key(i) for i in range(cfg["n_keys"])]
    expected = {k: payload_of(k, max_size) for k in keys}
    store = _store(cfg)
    print("ready", flush=True)
    sys.stdin.readline()  # the parent says go once every child is ready
    counts: Counter[str] = Counter()
    bad: list[str] = []
    deadline = time.monotonic() + cfg["seconds"]
    while time.monotonic() < deadline:
        op = rng.random()
        batch = rng.sample(keys, rng.randint(1, 8))
        if op < 0.45:
            for k, r in zip(batch, store.wait(store.dump(batch, [expected[k] for k in batch]))):
                counts[f"dump_{r.status.value}"] += 1
                if not r.ok:
                    bad.append(f"dump {k.hex()}: {r}")
        elif op < 0.9:
            outs = [bytearray(len(expected[k])) for k in batch]
            for k, out, r in zip(batch, outs, store.wait(store.load(batch, outs))):
                counts[f"load_{r.status.value}"] += 1
                if r.status is Status.OK:
                    if bytes(out) != expected[k]:
                        bad.append(f"load {k.hex()}: OK with wrong bytes")
                elif r.status is not Status.MISS:
                    bad.append(f"load {k.hex()}: {r}")
        elif op < 0.95:
            counts["removed"] += store.remove(batch)
        else:
            store.lookup(batch)
            store.lookup_prefix(batch)
            counts["lookups"] += 1
    store.close()
    print(json.dumps({"counts": dict(counts), "bad": bad[:20], "n_bad": len(bad)}), flush=True)
    return 0


def child_fsize(cfg: dict) -> int:
    """Dump blocks past RLIMIT_FSIZE (writes fail with EFBIG) and then a small one; report."""
    import resource
    import signal

    from ucm.core.block_format import HEADER_BYTES

    store = _store(cfg)
    store.usage()  # the initial scan is done: nothing else of this process writes files
    limit = cfg["limit"]
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write with EFBIG, do not die

    def block(i: int, size: int) -> tuple[bytes, bytes]:
        k = key(i, b"fsize")
        return k, blob(k, size).tobytes()

    sizes = {
        "big": 4 * limit,
        "just_over": limit - HEADER_BYTES + 1,  # the file would be one byte over the limit
        "exact": limit - HEADER_BYTES,  # exactly the limit (page-aligned: also with O_DIRECT)
        "small": 1000,
    }
    blocks = {name: block(i, size) for i, (name, size) in enumerate(sizes.items())}
    names = ["big", "exact", "just_over"]
    results = store.wait(store.dump([blocks[n][0] for n in names], [blocks[n][1] for n in names]))
    report: dict = {"first": {n: [r.status.value, r.detail] for n, r in zip(names, results)}}
    report["lookup"] = dict(zip(names, store.lookup([blocks[n][0] for n in names])))
    report["usage_after_failures"] = [store.usage().blocks, store.usage().bytes]
    k, data = blocks["small"]
    (r,) = store.wait(store.dump([k], [data]))
    report["small_dump"] = [r.status.value, r.detail]
    out = bytearray(len(data))
    (r,) = store.wait(store.load([k], [out]))
    report["small_load"] = [r.status.value, r.detail, bytes(out) == data]
    report["usage_end"] = [store.usage().blocks, store.usage().bytes]
    report["keys"] = {n: b[0].hex() for n, b in blocks.items()}
    report["sizes"] = sizes
    store.close()
    print(json.dumps(report), flush=True)
    return 0


def child_sleep(cfg: dict) -> int:
    """Sleep; with ``root``, as a writer of the store there (its id on the second line)."""
    print("running", flush=True)
    if "root" in cfg:
        store = _store(cfg)
        print(store._writer[0], flush=True)
    time.sleep(cfg.get("seconds", 600))
    return 0


CHILDREN = {
    "crash": child_crash,
    "stress": child_stress,
    "fsize": child_fsize,
    "sleep": child_sleep,
}


def start_child(mode: str, cfg: dict, **kwargs: Any) -> subprocess.Popen[str]:
    """``python -m ucm.lab.testing.procs MODE CONFIG``, its pipes text."""
    return subprocess.Popen(
        [sys.executable, "-m", "ucm.lab.testing.procs", mode, json.dumps(cfg)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs,
    )  # fmt: skip


def kill_writers_at_random(configs: list[dict], seed: int, timeout: float = 120) -> int:
    """Start a ``crash`` child per config and SIGKILL each within 50 ms of its start (the
    delays drawn from ``seed``); the test fails on a child that did not start or ended by
    itself.  Returns the last child's pid."""
    rng = random.Random(seed)
    pid = 0
    for i, cfg in enumerate(configs):
        proc = start_child("crash", cfg)
        pid = proc.pid
        try:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if line.strip() == "running":
                time.sleep(rng.uniform(0, 0.05))
                proc.kill()
            out, err = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert line.strip() == "running", f"child {i} (seed {seed}) did not start:\n{err}"
        assert proc.returncode == -signal.SIGKILL, (
            f"child {i} (seed {seed}, {cfg}) ended on its own ({proc.returncode}):\n{out}{err}"
        )
    return pid


def run_stress(configs: list[dict], timeout: float = 120) -> list[dict]:
    """Start a ``stress`` child per config, let them go at once, and return their reports
    (the test fails on a child that does not start or exits badly)."""
    procs = []
    try:
        for cfg in configs:
            procs.append(start_child("stress", cfg, stdin=subprocess.PIPE))
        for proc in procs:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            assert line.strip() == "ready", proc.stderr.read()  # type: ignore[union-attr]
        for proc in procs:
            proc.stdin.write("go\n")  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
        reports = []
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, f"child exited {proc.returncode}:\n{out}\n{err}"
            reports.append(json.loads(out.strip().splitlines()[-1]))
        return reports
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    sys.exit(CHILDREN[sys.argv[1]](json.loads(sys.argv[2])))
