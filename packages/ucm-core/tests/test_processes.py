"""The posix store across real processes and real failures.

Keys agree across interpreters, a writer killed at any moment never exposes a torn block,
corrupt and foreign files are detected (never loaded as data), concurrent processes never
see wrong bytes, and a failing write (file size limit, full disk) is an error that leaves
nothing behind.  Child processes run ``ucm.lab.testing.procs``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import xxhash
from ucm.core.block_format import HEADER_BYTES
from ucm.core.config import PosixStoreConfig
from ucm.core.keys import Namespace, block_keys
from ucm.core.settings import GIB
from ucm.core.store import PosixStore, Status
from ucm.core.store.posix import host_tag, scan_store
from ucm.lab.testing.core import blob, key, payload_of, size_of
from ucm.lab.testing.procs import (
    kill_writers_at_random,
    run_stress,
    start_child,
    temp_files,
)

TIMEOUT = 120


child = start_child


def run_child(mode: str, cfg: dict) -> dict:
    proc = child(mode, cfg)
    out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, f"{mode} child exited {proc.returncode}:\n{out}\n{err}"
    return json.loads(out.strip().splitlines()[-1])


def ucm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ucm.core.cli", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def open_store(root, **kwargs) -> PosixStore:
    return PosixStore(PosixStoreConfig(path=str(root), **kwargs))


def block_path(root, key: bytes) -> Path:
    return Path(root) / "blocks" / key.hex()[:2] / key.hex()


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def temp_name(key_hex: str, host: str, pid: int) -> str:
    return f".{key_hex}~{host}~{pid}~0badcafe.tmp"


# --- 1. keys do not depend on the interpreter's hash seed -----------------------------------

KEYS_CHILD = """
import json
from ucm.core.keys import Namespace, block_keys

ns = Namespace(model="org/model@rev bf16 awq", layout="NHD 16x8x128 \u00e9", rank=1,
               world_size=4, group="full-attention", cache_salt="tenant \u2603")
tokens = [(i * 2654435761) % (2**32) for i in range(16 * 40 + 7)]
extras = [b"image-%d" % i if i % 3 == 0 else b"" for i in range(40)]
print(json.dumps({
    "hash_of_str": hash("ucm"),
    "plain": [k.hex() for k in block_keys(ns, tokens, 16)],
    "extras": [k.hex() for k in block_keys(ns, tokens, 16, extras=extras)],
    "digest_seed": [k.hex() for k in block_keys(ns.digest(), tokens, 16)],
}))
"""


def test_keys_identical_across_processes_with_different_hash_seeds():
    outputs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        proc = subprocess.run(
            [sys.executable, "-c", KEYS_CHILD],
            capture_output=True,
            text=True,
            env=env,
            timeout=TIMEOUT,
        )
        assert proc.returncode == 0, proc.stderr
        outputs.append(json.loads(proc.stdout))
    one, two = outputs
    # the seeds did take effect: str hashes differ between the two interpreters
    assert one["hash_of_str"] != two["hash_of_str"]
    for name in ("plain", "extras", "digest_seed"):
        assert one[name] == two[name], name
        assert len(one[name]) == 40 and len(set(one[name])) == 40
        assert all(len(bytes.fromhex(k)) == 16 for k in one[name])
    assert one["plain"] == one["digest_seed"]
    assert not set(one["plain"]) & set(one["extras"])  # block 0 has an extra: all differ
    # and this interpreter (random hash seed) agrees
    ns = Namespace(
        model="org/model@rev bf16 awq",
        layout="NHD 16x8x128 \u00e9",
        rank=1,
        world_size=4,
        group="full-attention",
        cache_salt="tenant \u2603",
    )
    tokens = [(i * 2654435761) % (2**32) for i in range(16 * 40 + 7)]
    assert [k.hex() for k in block_keys(ns, tokens, 16)] == one["plain"]


# --- 2. a writer killed at random moments never leaves a torn block -------------------------

CRASH_KILLS = 60
CRASH_KEYS = 300
CRASH_MAX_SIZE = 256 * 1024
CRASH_CONFIGS = [
    {"fsync": "never", "o_direct": False, "io_threads": 4},
    {"fsync": "never", "o_direct": True, "io_threads": 2},
    {"fsync": "data", "o_direct": False, "io_threads": 1},
    {"fsync": "full", "o_direct": False, "io_threads": 4},
    {"fsync": "never", "o_direct": False, "io_threads": 1},
    {"fsync": "data", "o_direct": True, "io_threads": 4},
]


@pytest.fixture
def medium(tmp_path):
    """(the store's folder, the children's settings): a posix store on the test's disk (the
    host dram store's own run in test_shm_arena.py)."""
    return tmp_path / "store", {}


@pytest.mark.stress
def test_writer_killed_at_random_moments_leaves_only_whole_blocks(medium):
    root, medium_cfg = medium
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    configs = []
    for i in range(CRASH_KILLS):
        cfg = dict(CRASH_CONFIGS[i % len(CRASH_CONFIGS)])
        cfg.update(root=str(root), seed=rng.getrandbits(32), n_keys=CRASH_KEYS, **medium_cfg)
        cfg.update(max_size=CRASH_MAX_SIZE)
        configs.append(cfg)
    last_pid = kill_writers_at_random(configs, seed, TIMEOUT)

    blocks_dir = root / "blocks"
    names = {k.hex(): k for k in (key(j) for j in range(CRASH_KEYS))}
    present = set()
    for sub in blocks_dir.iterdir():
        for f in sub.iterdir():
            if not f.name.endswith(".tmp"):
                # nothing but blocks of our keys (and temporary files) was ever created
                assert f.name in names and sub.name == f.name[:2], f
                present.add(f.name)
    assert present, "the children stored nothing"

    # what a writer killed mid-block leaves (kills land there only now and then, so make sure)
    leftover = block_path(root, key(0)).parent / temp_name(key(0).hex(), host_tag(), last_pid)
    leftover.parent.mkdir(exist_ok=True)
    leftover.write_bytes(b"half a block")
    # a new store's initial scan removes the temporary files of the dead writers
    store = open_store(root)
    try:
        usage = store.usage()
        assert temp_files(str(root)) == []
        scan = scan_store(str(root))
        assert {b.name for b in scan.blocks} == present
        # a writer killed between counting a block and publishing it, or between removing
        # one and counting that, leaves the shared count high, never low ...
        assert usage.blocks >= len(scan.blocks) and usage.bytes >= scan.bytes
        assert scan.foreign == []
        # ... and the next eviction pass (here gc's) sets it from the disk
        done = ucm("store", "gc", str(root), "--capacity-gb", "1000")
        assert done.returncode == 0, done.stdout + done.stderr
        usage = store.usage()
        assert (usage.blocks, usage.bytes) == (len(scan.blocks), scan.bytes)

        # every stored block is whole: it loads with exactly the bytes its key implies
        keys = list(names.values())
        outs = [bytearray(size_of(k, CRASH_MAX_SIZE)) for k in keys]
        results = store.wait(store.load(keys, outs))
        for k, out, r in zip(keys, outs, results):
            if k.hex() in present:
                assert r.status is Status.OK, (k.hex(), r)
                assert bytes(out) == payload_of(k, CRASH_MAX_SIZE), k.hex()
            else:
                assert r.status is Status.MISS, (k.hex(), r)
        assert store.errors == 0
    finally:
        store.close()

    done = ucm("store", "verify", str(root))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"OK: {len(present)} blocks checked, 0 corrupt" in done.stdout


def test_stale_temp_files_removed_only_when_their_writer_is_gone(tmp_path):
    root = tmp_path / "store"
    store = open_store(root)
    k = key(1)
    store.wait(store.dump([k], [payload_of(k, 5000)]))
    store.close()
    host = host_tag()
    sub = block_path(root, k).parent
    live = child("sleep", {"seconds": 300, "root": str(root)})  # a writer of the store
    try:
        assert live.stdout.readline().strip() == "running"
        writer = live.stdout.readline().strip()
        assert writer.startswith(f"{host}~{live.pid}~")
        temps = {
            "dead": sub / temp_name(k.hex(), host, dead_pid()),
            "live": sub / f".{k.hex()}~{writer}.tmp",
            "other_host_fresh": sub / temp_name(k.hex(), "elsewhere", 1),
            "other_host_old": sub / temp_name(k.hex(), "elsewhere", 2),
        }
        for path in temps.values():
            path.write_bytes(b"partial block")
        old = time.time() - 2 * 3600
        os.utime(temps["other_host_old"], (old, old))

        store = open_store(root)
        assert store.usage().blocks == 1
        store.close()
        left = {name for name, path in temps.items() if path.exists()}
        assert left == {"live", "other_host_fresh"}
        assert block_path(root, k).exists()

        done = ucm("store", "verify", str(root))  # the writer is still alive: kept
        assert done.returncode == 0 and "0 stale temporary files removed" in done.stdout
        assert temps["live"].exists()
    finally:
        live.kill()
        live.wait()
    done = ucm("store", "verify", str(root))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 stale temporary files removed" in done.stdout
    assert not temps["live"].exists() and temps["other_host_fresh"].exists()


# --- 3. corruption is detected, removed and never returned as data ---------------------------

LAYOUT = b"layout-v1"
SIZE = 10000  # not a multiple of the page: exercises the O_DIRECT tail


def _flip(offset):
    def mutate(path: Path, other: Path) -> None:
        data = bytearray(path.read_bytes())
        at = offset if offset >= 0 else HEADER_BYTES + SIZE + offset
        data[at] ^= 0x01
        path.write_bytes(bytes(data))

    return mutate


def _truncate(length):
    def mutate(path: Path, other: Path) -> None:
        os.truncate(path, length)

    return mutate


def _copy_other(path: Path, other: Path) -> None:
    shutil.copyfile(other, path)


def _copy_smaller(path: Path, other: Path) -> None:
    shutil.copyfile(other.with_name(other.name + ".small"), path)


def _swap_payload(path: Path, other: Path) -> None:
    data = path.read_bytes()[:HEADER_BYTES] + other.read_bytes()[HEADER_BYTES:]
    path.write_bytes(data)


def _zeros(path: Path, other: Path) -> None:
    path.write_bytes(bytes(path.stat().st_size))


def _garbage(path: Path, other: Path) -> None:
    path.write_bytes(os.urandom(path.stat().st_size))


def _header_only(path: Path, other: Path) -> None:
    path.write_bytes(path.read_bytes()[:HEADER_BYTES])


# header fields: magic 0, version 4, header size 6, flags 8, key 12, payload length 28,
# payload checksum 36, layout length 44, layout 46, header checksum after the layout
CORRUPTIONS = {
    "zero_length": _truncate(0),
    "truncated_in_header": _truncate(100),
    "header_only": _header_only,
    "truncated_in_payload": _truncate(HEADER_BYTES + SIZE // 2),
    "last_byte_missing": _truncate(HEADER_BYTES + SIZE - 1),
    "flip_magic": _flip(0),
    "flip_header_size": _flip(6),
    "flip_flags": _flip(8),
    "flip_key": _flip(20),
    "flip_payload_length": _flip(28),
    "flip_payload_checksum": _flip(40),
    "flip_layout_length": _flip(44),
    "flip_layout": _flip(47),
    "flip_header_checksum": _flip(46 + len(LAYOUT) + 3),
    "flip_header_padding": _flip(4000),
    "flip_payload_first": _flip(HEADER_BYTES),
    "flip_payload_middle": _flip(HEADER_BYTES + SIZE // 2),
    "flip_payload_last": _flip(-1),
    "other_key_same_size": _copy_other,
    "other_key_other_size": _copy_smaller,
    "other_payload": _swap_payload,
    "zeros": _zeros,
    "garbage": _garbage,
}


def _other_version(path: Path, version: int = 1) -> None:
    """Make the block at ``path`` one of format ``version`` (a whole header of its own)."""
    data = bytearray(path.read_bytes())
    data[4:6] = version.to_bytes(2, "little")
    end = 46 + int.from_bytes(data[44:46], "little")
    data[end : end + 8] = xxhash.xxh3_64_intdigest(bytes(data[:end])).to_bytes(8, "little")
    path.write_bytes(bytes(data))


def test_a_block_of_another_format_version_is_a_miss_left_alone(tmp_path):
    """Upgrades: a build never deletes what another build (newer or older) may read;
    ``ucm store gc --other-versions`` removes those blocks when asked."""
    root = tmp_path / "store"
    keys, data = _setup_corruptible(root)
    _other_version(block_path(root, keys[0]))
    with open_store(root) as store:
        (r,) = store.wait(store.load([keys[0]], [bytearray(SIZE)], LAYOUT))
        assert r.status is Status.MISS and "format version 1" in r.detail, r
        assert store.errors == 0
    assert block_path(root, keys[0]).exists()
    done = ucm("store", "verify", "--remove", str(root))
    assert done.returncode == 0, done.stdout
    assert f"OTHER VERSION {block_path(root, keys[0])}" in done.stdout
    assert block_path(root, keys[0]).exists()
    done = ucm("store", "gc", str(root), "--other-versions", "--dry-run")
    assert "would remove 1 blocks of other format versions" in done.stdout
    assert block_path(root, keys[0]).exists()
    done = ucm("store", "gc", str(root), "--other-versions")
    assert done.returncode == 0 and "removed 1 blocks" in done.stdout, done.stdout
    assert not block_path(root, keys[0]).exists()
    assert all(block_path(root, k).exists() for k in keys[1:])


def _setup_corruptible(root) -> tuple[list[bytes], dict[bytes, bytes]]:
    keys = [key(i, b"corrupt") for i in range(4)]
    data = {k: random.Random(k).randbytes(SIZE) for k in keys[:3]}
    data[keys[3]] = random.Random(keys[3]).randbytes(3000)
    with open_store(root) as store:
        results = store.wait(store.dump(keys, [data[k] for k in keys], LAYOUT))
        assert all(r.ok for r in results)
    # a spare copy of a smaller block, for "another key's (smaller) file copied over"
    small = block_path(root, keys[3])
    shutil.copyfile(small, block_path(root, keys[1]).with_name(keys[1].hex() + ".small"))
    return keys, data


@pytest.mark.parametrize("o_direct", [False, True], ids=["pagecache", "o_direct"])
@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupt_block_is_detected_removed_and_reads_as_miss(tmp_path, corruption, o_direct):
    root = tmp_path / "store"
    keys, data = _setup_corruptible(root)
    target, other = keys[0], keys[1]
    CORRUPTIONS[corruption](block_path(root, target), block_path(root, other))
    block_path(root, other).with_name(other.hex() + ".small").unlink()

    with open_store(root, o_direct=o_direct) as store:
        out = bytearray(SIZE)
        (r,) = store.wait(store.load([target], [out], LAYOUT))
        assert r.status is Status.CORRUPT, r
        assert r.detail
        assert not block_path(root, target).exists()
        assert store.lookup([target]) == [False]
        (r,) = store.wait(store.load([target], [bytearray(SIZE)], LAYOUT))
        assert r.status is Status.MISS
        # the other blocks are untouched and still load exactly
        rest = keys[1:]
        outs = [bytearray(len(data[k])) for k in rest]
        assert all(r.ok for r in store.wait(store.load(rest, outs, LAYOUT)))
        assert [bytes(o) for o in outs] == [data[k] for k in rest]
        # and the key can be stored again
        (r,) = store.wait(store.dump([target], [data[target]], LAYOUT))
        assert r.ok
        (r,) = store.wait(store.load([target], [out], LAYOUT))
        assert r.ok and bytes(out) == data[target]


def _add_foreign_files(root, moved_key: bytes) -> list[Path]:
    blocks = Path(root) / "blocks"
    (blocks / "ab").mkdir(exist_ok=True)
    other_prefix = "cd" if moved_key.hex()[:2] != "cd" else "ce"
    (blocks / other_prefix).mkdir(exist_ok=True)
    misplaced = blocks / other_prefix / moved_key.hex()
    block_path(root, moved_key).rename(misplaced)  # a whole block, but not where it belongs
    foreign = [
        blocks / "ab" / "notes.txt",
        blocks / "ab" / ("AB" + "0" * 30),  # 32 characters but not lower-case hex
        blocks / "ab" / ("ab" + "0" * 31),  # 33 hex characters
        blocks / "ab" / os.urandom(6).hex(),
        blocks / "README",  # a file at the top of blocks/
        misplaced,
    ]
    for path in foreign[:-1]:
        path.write_bytes(os.urandom(5000))
    (blocks / "abc").mkdir()  # a directory whose name is not a two-character prefix
    foreign.append(blocks / "abc")
    (blocks / "ab" / ("ab" + "1" * 30)).mkdir()  # a directory with a block's name
    foreign.append(blocks / "ab" / ("ab" + "1" * 30))
    return foreign


def test_foreign_files_are_ignored_and_left_alone(tmp_path):
    root = tmp_path / "store"
    keys = [key(i, b"foreign") for i in range(6)]
    data = {k: payload_of(k, 20000) for k in keys}
    with open_store(root) as store:
        assert all(r.ok for r in store.wait(store.dump(keys, [data[k] for k in keys])))
    moved = keys[5]
    foreign = _add_foreign_files(root, moved)

    scan = scan_store(str(root))
    assert len(scan.blocks) == 5
    assert scan.bytes == sum(HEADER_BYTES + len(data[k]) for k in keys[:5])
    with open_store(root) as store:
        outs = [bytearray(len(data[k])) for k in keys]
        results = store.wait(store.load(keys, outs))
        assert [r.status for r in results] == [Status.OK] * 5 + [Status.MISS]
        assert [bytes(o) for o in outs[:5]] == [data[k] for k in keys[:5]]
        assert store.errors == 0
    assert all(p.exists() for p in foreign)

    done = ucm("store", "verify", str(root))
    assert done.returncode == 0, done.stdout + done.stderr
    listed = {
        line.split(" ", 1)[1].split(":")[0]
        for line in done.stdout.splitlines()
        if line.startswith("FOREIGN ")
    }
    assert listed == {str(p) for p in foreign}
    assert "OK: 5 blocks checked, 0 corrupt" in done.stdout
    assert f"{len(foreign)} foreign files" in done.stdout
    assert all(p.exists() for p in foreign)


def test_verify_reports_every_corrupt_block_and_remove_deletes_only_them(tmp_path):
    root = tmp_path / "store"
    names = sorted(CORRUPTIONS)
    keys = [key(i, b"verify") for i in range(len(names) + 3)]
    data = {k: random.Random(k).randbytes(SIZE) for k in keys}
    with open_store(root) as store:
        assert all(r.ok for r in store.wait(store.dump(keys, [data[k] for k in keys], LAYOUT)))
    spare = keys[-1]
    small = key(999, b"verify")
    with open_store(root) as store:
        store.wait(store.dump([small], [b"x" * 3000], LAYOUT))
    shutil.copyfile(
        block_path(root, small), block_path(root, spare).with_name(spare.hex() + ".small")
    )
    good = {keys[-3], keys[-1], small}
    corrupt = {}
    for name, k in zip(names, keys):
        CORRUPTIONS[name](block_path(root, k), block_path(root, spare))
        corrupt[str(block_path(root, k))] = name
    block_path(root, spare).with_name(spare.hex() + ".small").unlink()
    foreign = _add_foreign_files(root, keys[-2])

    done = ucm("store", "verify", str(root))
    assert done.returncode == 1, done.stdout + done.stderr
    reported = {
        line.split(" ", 1)[1].split(": ")[0]
        for line in done.stdout.splitlines()
        if line.startswith("CORRUPT ")
    }
    missed = {corrupt[p] for p in set(corrupt) - reported}
    assert not missed, f"verify missed: {missed}"
    assert reported == set(corrupt)
    assert sum(line.startswith("FOREIGN ") for line in done.stdout.splitlines()) == len(foreign)
    assert f"FAILED: {len(corrupt) + len(good)} blocks checked, {len(corrupt)} corrupt" in (
        done.stdout
    )
    assert all(Path(p).exists() for p in corrupt)  # without --remove nothing is deleted

    done = ucm("store", "verify", "--remove", str(root))
    assert done.returncode == 0 and "REPAIRED" in done.stdout and " removed)" in done.stdout
    assert not any(Path(p).exists() for p in corrupt)
    assert all(p.exists() for p in foreign)
    assert all(block_path(root, k).exists() for k in good)

    done = ucm("store", "verify", str(root))
    assert done.returncode == 0, done.stdout
    assert f"OK: {len(good)} blocks checked, 0 corrupt" in done.stdout


# --- 4. processes sharing a directory never see wrong bytes ---------------------------------

STRESS_PROCESSES = 4
STRESS_SECONDS = 3.0
STRESS_KEYS = 192
STRESS_MAX_SIZE = 64 * 1024


@pytest.mark.parametrize("capacity", [None, 3 << 20], ids=["unlimited", "evicting"])
def test_concurrent_processes_dump_and_load_overlapping_keys(medium, capacity):
    root, medium_cfg = medium
    configs = [
        {"fsync": "never", "o_direct": False, "io_threads": 4},
        {"fsync": "never", "o_direct": True, "io_threads": 2},
        {"fsync": "data", "o_direct": False, "io_threads": 2},
        {"fsync": "never", "o_direct": False, "io_threads": 1},
    ]
    cfgs = []
    for i in range(STRESS_PROCESSES):
        cfg = dict(configs[i % len(configs)], root=str(root), seed=1000 + i, **medium_cfg)
        cfg.update(n_keys=STRESS_KEYS, max_size=STRESS_MAX_SIZE, seconds=STRESS_SECONDS)
        cfg["capacity_gb"] = capacity / GIB if capacity else None
        cfgs.append(cfg)
    reports = run_stress(cfgs, TIMEOUT)

    for report in reports:
        assert report["n_bad"] == 0, report["bad"]
        statuses = {name for name in report["counts"] if name.startswith(("dump_", "load_"))}
        assert statuses <= {"dump_ok", "load_ok", "load_miss"}, report["counts"]
    total = {}
    for report in reports:
        for name, n in report["counts"].items():
            total[name] = total.get(name, 0) + n
    assert total.get("dump_ok", 0) > 0 and total.get("load_ok", 0) > 0, total

    # every writer finished: no temporary file, and every block on disk verifies
    assert temp_files(str(root)) == []
    assert scan_store(str(root)).blocks
    done = ucm("store", "verify", str(root))
    assert done.returncode == 0, done.stdout + done.stderr


# --- 6. a write that fails is an error and leaves nothing behind -----------------------------

FSIZE_LIMIT = 64 * 1024


@pytest.mark.parametrize(
    "o_direct,fsync", [(False, "never"), (True, "never"), (False, "full")], ids=str
)
def test_write_past_file_size_limit_is_an_error_and_the_process_goes_on(tmp_path, o_direct, fsync):
    root = tmp_path / "store"
    cfg = {"root": str(root), "limit": FSIZE_LIMIT, "o_direct": o_direct, "fsync": fsync}
    report = run_child("fsize", cfg)
    first = report["first"]
    keys = {name: bytes.fromhex(h) for name, h in report["keys"].items()}
    for name in ("big", "just_over"):
        status, detail = first[name]
        assert status == Status.ERROR.value, (name, first[name])
        assert keys[name].hex() in detail and "too large" in detail.lower(), detail
        assert report["lookup"][name] is False
        assert not block_path(root, keys[name]).exists()
    assert first["exact"] == [Status.OK.value, ""]
    assert report["lookup"]["exact"] is True
    assert os.path.getsize(block_path(root, keys["exact"])) == FSIZE_LIMIT
    # the failed writes were not counted as stored bytes
    assert report["usage_after_failures"] == [1, FSIZE_LIMIT]
    assert report["small_dump"] == [Status.OK.value, ""]
    assert report["small_load"] == [Status.OK.value, "", True]
    assert report["usage_end"][0] == 2
    assert temp_files(str(root)) == []

    with open_store(root) as store:
        outs = {n: bytearray(s) for n, s in report["sizes"].items()}
        names = list(outs)
        results = store.wait(store.load([keys[n] for n in names], [outs[n] for n in names]))
        statuses = dict(zip(names, (r.status for r in results)))
        assert statuses == {
            "big": Status.MISS,
            "just_over": Status.MISS,
            "exact": Status.OK,
            "small": Status.OK,
        }
        for n in ("exact", "small"):
            assert bytes(outs[n]) == blob(keys[n], report["sizes"][n]).tobytes()


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command here: cannot make a small filesystem to fill")
    try:
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mnt)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except OSError as exc:
        pytest.skip(f"cannot run mount: {exc}")
    if proc.returncode != 0 or not os.path.ismount(mnt):
        pytest.skip(f"mounting a tmpfs is not permitted here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_full_filesystem_fails_dumps_without_partial_blocks(tiny_tmpfs):
    root = tiny_tmpfs / "store"
    keys = [key(i, b"tmpfs") for i in range(16)]
    data = {k: random.Random(k).randbytes(96 * 1024) for k in keys}  # 16 x 100 KiB > 1 MiB
    # the default capacity (half the free space) never lets the filesystem fill: it evicts
    with open_store(tiny_tmpfs / "auto", io_threads=1) as store:
        results = store.wait(store.dump(keys, [data[k] for k in keys]))
        assert all(r.ok for r in results), results
        assert scan_store(str(tiny_tmpfs / "auto")).bytes <= 512 << 10
    shutil.rmtree(tiny_tmpfs / "auto")
    with open_store(root, io_threads=4, capacity_gb=None) as store:  # no limit: it fills
        results = store.wait(store.dump(keys, [data[k] for k in keys]))
        stored = [k for k, r in zip(keys, results) if r.status is Status.OK]
        failed = [k for k, r in zip(keys, results) if r.status is Status.ERROR]
        assert len(stored) + len(failed) == len(keys), results
        assert stored and failed, results
        for r in results:
            if not r.ok:
                assert "no space" in r.detail.lower(), r.detail
        assert temp_files(str(root)) == []
        assert store.lookup(failed) == [False] * len(failed)
        assert not any(block_path(root, k).exists() for k in failed)
        scan = scan_store(str(root))
        assert {b.name for b in scan.blocks} == {k.hex() for k in stored}
        assert (store.usage().blocks, store.usage().bytes) == (len(scan.blocks), scan.bytes)

        outs = [bytearray(len(data[k])) for k in keys]
        results = store.wait(store.load(keys, outs))
        for k, out, r in zip(keys, outs, results):
            if k in stored:
                assert r.ok and bytes(out) == data[k]
            else:
                assert r.status is Status.MISS

        # freeing space lets a failed block be stored
        assert store.remove(stored[:2]) == 2
        (r,) = store.wait(store.dump([failed[0]], [data[failed[0]]]))
        assert r.ok, r
        out = bytearray(len(data[failed[0]]))
        (r,) = store.wait(store.load([failed[0]], [out]))
        assert r.ok and bytes(out) == data[failed[0]]

    done = ucm("store", "verify", str(root))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"OK: {len(stored) - 1} blocks checked, 0 corrupt" in done.stdout


def test_read_only_filesystem_serves_loads_and_refuses_dumps(tiny_tmpfs):
    root = tiny_tmpfs / "store"
    keys = [key(i, b"ro") for i in range(4)]
    data = {k: random.Random(k).randbytes(32 * 1024) for k in keys}
    with open_store(root) as store:
        assert all(r.ok for r in store.wait(store.dump(keys[:3], [data[k] for k in keys[:3]])))
        assert not store.read_only
    remount = subprocess.run(
        ["mount", "-o", "remount,ro", str(tiny_tmpfs)], capture_output=True, text=True
    )
    if remount.returncode != 0:
        pytest.skip(f"cannot remount read-only here: {remount.stderr.strip()}")
    # a shared cache built elsewhere and mounted read-only: hits load, dumps fail cleanly
    with open_store(root) as store:
        assert store.read_only
        assert store.lookup_prefix(keys) == 3
        outs = [bytearray(len(data[k])) for k in keys]
        results = store.wait(store.load(keys, outs))
        assert [r.status for r in results] == [Status.OK] * 3 + [Status.MISS]
        assert all(bytes(o) == data[k] for o, k in zip(outs[:3], keys))
        (r,) = store.wait(store.dump(keys[3:], [data[keys[3]]]))
        assert r.status is Status.ERROR and "read-only" in r.detail
    # a store path that does not exist on a read-only filesystem is an error naming it
    with pytest.raises(OSError, match="cannot use .* as a UCM store"):
        open_store(tiny_tmpfs / "elsewhere")


# --- capacity is one for every process of a store -----------------------------------------------


def test_processes_sharing_a_store_hold_its_capacity_between_them(tmp_path):
    """Four processes dumping into one 4 MiB store at once: what is on disk stays within the
    capacity (plus the blocks being written), not four times it."""
    root = tmp_path / "store"
    block, capacity = 64 * 1024, 4 << 20
    config = {"root": str(root), "capacity_gb": capacity / GIB, "io_threads": 2}
    open_store(root, capacity_gb=capacity / GIB).close()
    script = (
        "import os, sys\n"
        "from ucm.core.config import PosixStoreConfig\n"
        "from ucm.core.store import PosixStore\n"
        f"cfg = {config!r}\n"
        "s = PosixStore(PosixStoreConfig(path=cfg['root'], capacity_gb=cfg['capacity_gb'],"
        " io_threads=cfg['io_threads']))\n"
        "for batch in range(16):\n"
        "    keys = [os.urandom(16) for _ in range(8)]\n"
        f"    results = s.wait(s.dump(keys, [bytes({block})] * 8))\n"
        "    assert all(r.ok for r in results), results\n"
        "s.close()\n"
    )
    children = [subprocess.Popen([sys.executable, "-c", script]) for _ in range(4)]
    peak = 0
    while any(c.poll() is None for c in children):
        peak = max(peak, scan_store(str(root)).bytes)
        time.sleep(0.002)
    assert [c.wait(TIMEOUT) for c in children] == [0, 0, 0, 0]
    peak = max(peak, scan_store(str(root)).bytes)
    in_flight = 4 * 2 * (HEADER_BYTES + block)  # each process's writes under way
    assert peak <= capacity + in_flight, (peak, capacity)
    assert 4 * 16 * 8 * block > 3 * capacity  # what was written would not have fit
