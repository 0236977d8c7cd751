"""The ``ucm`` command line, run as a separate process over real store directories."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest
import xxhash
from ucm.core.block_format import HEADER_BYTES
from ucm.core.config import DramStoreConfig, PosixStoreConfig
from ucm.core.settings import GIB
from ucm.core.store import PosixStore
from ucm.core.store.dram import sealing
from ucm.core.store.posix import scan_store
from ucm.lab.core.bench import memcpy_case

TIMEOUT = 180
MIB = 1 << 20


def ucm(*args: str, executable: list[str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*(executable or [sys.executable, "-m", "ucm.core.cli"]), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def key(i: int) -> bytes:
    return xxhash.xxh3_128_digest(b"cli" + i.to_bytes(8, "little"))


def payload(i: int, size: int) -> bytes:
    return random.Random(i).randbytes(size)


def block_path(root: Path, k: bytes) -> Path:
    return root / "blocks" / k.hex()[:2] / k.hex()


def make_store(root: Path, sizes: list[int], **config) -> list[bytes]:
    keys = [key(i) for i in range(len(sizes))]
    with PosixStore(PosixStoreConfig(path=str(root), **config)) as store:
        results = store.wait(store.dump(keys, [payload(i, s) for i, s in enumerate(sizes)]))
        assert all(r.ok for r in results), results
    return keys


# --- stats -------------------------------------------------------------------------------------


def test_stats_json_counts_blocks_bytes_and_capacity(tmp_path):
    root = tmp_path / "store"
    sizes = [1000, 50_000, 4096]
    make_store(root, sizes, capacity_gb=0.5)
    (root / "blocks" / "README").write_text("not a block")

    done = ucm("store", "stats", str(root), "--json")
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout)
    expected_bytes = sum(HEADER_BYTES + s for s in sizes)
    assert stats["path"] == str(root)
    assert stats["blocks"] == 3
    assert stats["bytes"] == expected_bytes
    assert stats["capacity_bytes"] == GIB // 2
    assert math.isclose(stats["capacity_used"], expected_bytes / (GIB // 2))
    assert stats["foreign_files"] == 1

    done = ucm("store", "stats", str(root))
    assert done.returncode == 0, done.stderr
    assert "blocks    3" in done.stdout
    assert f"({expected_bytes})" in done.stdout
    assert "capacity  512.0 MiB" in done.stdout
    assert "foreign   1 files" in done.stdout


def test_stats_of_an_unlimited_and_of_an_empty_store(tmp_path):
    root = tmp_path / "store"
    make_store(root, [], capacity_gb=None)
    done = ucm("store", "stats", str(root), "--json")
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout)
    assert (stats["blocks"], stats["bytes"], stats["capacity_bytes"]) == (0, 0, None)
    assert stats["capacity_used"] is None
    done = ucm("store", "stats", str(root))
    assert done.returncode == 0 and "capacity  unlimited" in done.stdout


def test_console_script_is_installed_and_runs(tmp_path):
    script = Path(sys.executable).parent / "ucm"
    if not script.exists():
        pytest.skip(f"no ucm console script next to {sys.executable}")
    root = tmp_path / "store"
    make_store(root, [2000])
    done = ucm("store", "stats", str(root), "--json", executable=[str(script)])
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["blocks"] == 1


# --- verify ------------------------------------------------------------------------------------


def test_verify_clean_corrupt_and_remove(tmp_path):
    root = tmp_path / "store"
    keys = make_store(root, [3000, 20_000, 70_000, 1])
    done = ucm("store", "verify", str(root))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK: 4 blocks checked, 0 corrupt" in done.stdout
    assert "CORRUPT" not in done.stdout

    bad = block_path(root, keys[2])
    data = bytearray(bad.read_bytes())
    data[HEADER_BYTES + 12345] ^= 0x80
    bad.write_bytes(bytes(data))
    done = ucm("store", "verify", str(root))
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"CORRUPT {bad}: payload checksum mismatch" in done.stdout
    assert "FAILED: 4 blocks checked, 1 corrupt" in done.stdout
    assert bad.exists()

    done = ucm("store", "verify", str(root), "--remove")
    assert done.returncode == 0, done.stdout  # repaired: nothing corrupt is left
    assert "REPAIRED: 4 blocks checked, 1 corrupt (1 removed)" in done.stdout
    assert not bad.exists()
    assert all(block_path(root, k).exists() for k in keys if k != keys[2])

    done = ucm("store", "verify", str(root))
    assert done.returncode == 0, done.stdout
    assert "OK: 3 blocks checked, 0 corrupt" in done.stdout


def test_verify_lists_foreign_files_without_failing(tmp_path):
    root = tmp_path / "store"
    make_store(root, [100, 200])
    (root / "blocks" / "ab").mkdir(exist_ok=True)
    stray = root / "blocks" / "ab" / "stray.bin"
    stray.write_bytes(b"\0" * 10)
    done = ucm("store", "verify", str(root))
    assert done.returncode == 0, done.stdout
    assert f"FOREIGN {stray}: not a UCM block" in done.stdout
    assert "OK: 2 blocks checked, 0 corrupt, 1 foreign files" in done.stdout
    assert stray.exists()


# --- gc ----------------------------------------------------------------------------------------


def test_gc_trims_to_capacity_keeping_the_most_recently_used(tmp_path):
    root = tmp_path / "store"
    n = 8
    keys = make_store(root, [MIB] * n)
    block_bytes = HEADER_BYTES + MIB
    # recency unrelated to the order of the keys
    order = list(range(n))
    random.Random(7).shuffle(order)
    base = time.time() - 10_000
    for rank, i in enumerate(order):
        t = int((base + 100 * rank) * 1e9)
        os.utime(block_path(root, keys[i]), ns=(t, t))
    # a load makes the least recently used block the most recent one
    oldest = keys[order[0]]
    with PosixStore(PosixStoreConfig(path=str(root))) as store:
        assert store.wait(store.load([oldest], [bytearray(MIB)]))[0].ok
    newest_first = [oldest] + [keys[i] for i in reversed(order[1:])]

    capacity_gb = 3.5 * MIB / GIB  # room for three blocks
    done = ucm("store", "gc", str(root), "--capacity-gb", repr(capacity_gb))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"gc: {n - 3} blocks removed" in done.stdout
    survivors = {b.name for b in scan_store(str(root)).blocks}
    assert survivors == {k.hex() for k in newest_first[:3]}

    stats = json.loads(ucm("store", "stats", str(root), "--json").stdout)
    assert stats["blocks"] == 3
    assert stats["bytes"] == 3 * block_bytes <= int(capacity_gb * GIB)

    # under the capacity already: nothing goes
    done = ucm("store", "gc", str(root), "--capacity-gb", "1")
    assert done.returncode == 0 and "gc: 0 blocks removed" in done.stdout
    assert {b.name for b in scan_store(str(root)).blocks} == survivors
    done = ucm("store", "verify", str(root))
    assert done.returncode == 0, done.stdout


@pytest.mark.parametrize("capacity", ["0", "-1", "inf", "nan", "1e300", "lots"])
def test_gc_refuses_a_capacity_that_is_not_a_positive_size(tmp_path, capacity):
    root = tmp_path / "store"
    keys = make_store(root, [1000])
    done = ucm("store", "gc", str(root), "--capacity-gb", capacity)
    assert done.returncode == 2, done.stderr
    assert "--capacity-gb" in done.stderr and "Traceback" not in done.stderr
    assert block_path(root, keys[0]).exists()


# --- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("what", ["missing", "empty_dir", "file"])
@pytest.mark.parametrize(
    "command", [["stats"], ["stats", "--json"], ["verify"], ["gc", "--capacity-gb", "1"]]
)
def test_a_path_that_is_not_a_store_is_refused(tmp_path, what, command):
    path = tmp_path / "not-a-store"
    if what == "empty_dir":
        path.mkdir()
        (path / "precious.txt").write_text("keep me")
    elif what == "file":
        path.write_text("keep me")
    done = ucm("store", command[0], str(path), *command[1:])
    assert done.returncode == 1, done.stdout + done.stderr
    expected = {
        "missing": "no such folder",
        "empty_dir": "is not a UCM store",
        "file": "is not a folder",
    }[what]
    if "--json" in command:  # one JSON object, on standard output
        assert expected in json.loads(done.stdout)["error"] and done.stderr == ""
    else:
        assert expected in done.stderr and "Traceback" not in done.stderr
        assert done.stdout == ""
    # nothing was created or deleted
    if what == "missing":
        assert not path.exists()
    elif what == "file":
        assert path.read_text() == "keep me"
    else:
        assert sorted(p.name for p in path.iterdir()) == ["precious.txt"]


def test_a_hybrid_models_root_is_its_two_stores(tmp_path):
    root = tmp_path / "hybrid"
    make_store(root / "fa", [1000, 2000])
    make_store(root / "wa", [3000])
    done = ucm("store", "stats", str(root), "--json")
    assert done.returncode == 0, done.stderr
    stores = json.loads(done.stdout)["stores"]
    assert [(s["path"], s["blocks"]) for s in stores] == [
        (str(root / "fa"), 2),
        (str(root / "wa"), 1),
    ]
    done = ucm("store", "verify", str(root))
    assert done.returncode == 0 and done.stdout.count("OK: ") == 2, done.stdout
    done = ucm("store", "gc", str(root), "--capacity-gb", "1e-9")
    assert done.returncode == 0, done.stderr
    assert [line.split(":")[0] for line in done.stdout.splitlines()] == ["gc fa", "gc wa"]
    assert scan_store(str(root / "fa")).blocks == scan_store(str(root / "wa")).blocks == []


@pytest.mark.parametrize(
    "bad",
    [
        ["--block-kib", "0"],
        ["--repeat", "0"],
        ["--total-gb", "-5"],
        ["--total-gb", "inf"],
        ["--path", "FILE"],
    ],
)
def test_bench_store_refuses_bad_arguments_in_one_line(tmp_path, bad):
    (tmp_path / "FILE").write_text("keep me")
    bad = [str(tmp_path / "FILE") if a == "FILE" else a for a in bad]
    done = ucm("bench", "store", "--total-gb", "0.01", "--repeat", "1", *bad)
    assert done.returncode in (1, 2), done.stdout + done.stderr
    assert "Traceback" not in done.stderr and bad[0] in done.stderr, done.stderr
    assert (tmp_path / "FILE").read_text() == "keep me"


def test_gc_dry_run_says_what_it_would_remove_and_removes_nothing(tmp_path):
    root = tmp_path / "store"
    make_store(root, [1000, 2000, 3000])
    done = ucm("store", "gc", str(root), "--capacity-gb", "1e-9", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "gc: would remove 3 blocks" in done.stdout
    assert len(scan_store(str(root)).blocks) == 3


def test_usage_errors_exit_2(tmp_path):
    assert ucm().returncode == 2
    assert ucm("store").returncode == 2
    done = ucm("store", "gc", str(tmp_path))  # what to remove is required
    assert done.returncode == 1 and "--capacity-gb" in done.stderr


# --- bench -------------------------------------------------------------------------------------


def test_bench_store_runs_and_ends_with_json(tmp_path):
    bench_dir = tmp_path / "bench"
    (bench_dir / "raw").mkdir(parents=True)  # the user's own, named like the run's files
    (bench_dir / "raw" / "precious").write_text("not the benchmark's")
    done = ucm(
        "bench", "store", "--total-gb", "0.01", "--repeat", "1", "--block-kib", "64",
        "--json", "--signed", "--path", str(bench_dir),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["total_gb"] == 0.01
    cases = summary["cases"]
    # the store copying in Python beside it, where its compiled copies were built
    assert summary["compiled_copies"] is sealing.compiled()
    in_python = ["dram shared py"] if sealing.compiled() else []
    # memcpy on as many threads as the host tier copies with (its copy threads and the
    # thread that waits for them): every dram case's baseline
    threads = attrs.fields(DramStoreConfig).threads.default + 1
    floor = memcpy_case(threads)
    threaded = [floor] if threads > 1 else []
    assert [c["case"] for c in cases] == [
        "raw file", "posix", "raw O_DIRECT", "posix O_DIRECT", "memcpy", *threaded, "dram",
        "dram shared", "dram in place",
        "sealed copies", *in_python, "posix signed", "dram shared signed",
    ]  # fmt: skip
    blocks = max(128, int(0.01 * GIB) // (64 * 1024))
    for case in cases:
        assert case["block_bytes"] == 64 * 1024 and case["blocks"] == blocks
        assert case["dump_gbps"] > 0 and case["load_gbps"] > 0
    baselines = {c["case"]: c.get("baseline") for c in cases}
    assert baselines == {
        "raw file": None, "posix": "raw file",
        "raw O_DIRECT": None, "posix O_DIRECT": "raw O_DIRECT",
        "memcpy": None, **{case: "memcpy" for case in threaded},
        "dram": floor, "dram shared": floor, "dram in place": floor, "sealed copies": floor,
        "posix signed": "raw file", "dram shared signed": floor,
        **{case: floor for case in in_python},
    }  # fmt: skip
    for case in cases:
        if case.get("baseline"):
            for ratio in ("dump_ratio", "load_ratio"):
                assert math.isfinite(case[ratio]) and case[ratio] > 0, case
    assert summary["lookup_prefix_512_ms"] > 0
    assert set(summary["lookup_prefix_512_ms_by_store"]) == {"posix", "dram shared"}
    # the human-readable table comes first
    assert any("posix O_DIRECT" in line for line in lines[:-1])
    # the benchmark removes what it made in the directory it was given, and nothing else
    assert sorted(p.name for p in bench_dir.iterdir()) == ["raw"]
    assert (bench_dir / "raw" / "precious").read_text() == "not the benchmark's"


@pytest.mark.mooncake
def test_bench_store_mooncake_against_the_raw_client(tmp_path):
    from ucm.lab.pytest_plugin import require_mooncake

    require_mooncake()
    done = ucm(
        "bench", "store", "--kind", "mooncake", "--total-gb", "0.01", "--repeat", "1",
        "--block-kib", "64", "--json", "--path", str(tmp_path / "bench"),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    cases = {c["case"]: c for c in summary["cases"]}
    assert list(cases) == ["raw mooncake", "mooncake"]
    assert cases["mooncake"]["baseline"] == "raw mooncake"
    assert cases["mooncake"]["dump_ratio"] > 0 and cases["mooncake"]["load_ratio"] > 0
    assert summary["lookup_prefix_store"] == "mooncake" and summary["lookup_prefix_512_ms"] > 0


def test_model_id_names_copies_alike(tmp_path, monkeypatch, capsys):
    import shutil

    from ucm.core.cli import main

    monkeypatch.setenv("UCM_CACHE_DIR", str(tmp_path / "cache"))
    a = tmp_path / "a"
    a.mkdir()
    (a / "model.safetensors").write_bytes(bytes(range(256)) * 1000)
    shutil.copytree(a, tmp_path / "b")
    digests = []
    for folder in ("a", "b"):
        assert main(["model-id", str(tmp_path / folder), "--json"]) == 0
        digests.append(json.loads(capsys.readouterr().out)["weights"])
    assert digests[0] == digests[1]
    assert main(["model-id", str(tmp_path / "cache")]) == 1
    assert "no weight files" in capsys.readouterr().err
    assert main(["model-id", str(tmp_path / "cache"), "--json"]) == 1
    assert "no weight files" in json.loads(capsys.readouterr().out)["error"]
