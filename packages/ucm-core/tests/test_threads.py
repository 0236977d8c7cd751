"""Where the stores' threads run (``ucm.core.threads``): an engine that binds its compute to
cores names the free ones, and every thread a store starts from then on runs there, whatever
CPUs the thread that started it had."""

from __future__ import annotations

import os
import threading
import time

import pytest
from ucm.core.store import create_store
from ucm.core.threads import (
    format_cpus,
    memory_nodes,
    parse_cpus,
    place_store_threads,
    spare_cpus,
    store_threads_cpus,
)
from ucm.lab.testing.core import blob, key


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0", {0}), ("0-3,6", {0, 1, 2, 3, 6}), (" 7 , 2-3", {2, 3, 7}), ("5-5", {5})],
)
def test_cpu_lists_read_and_written_as_the_kernel_does(text, cpus):
    assert parse_cpus(text) == cpus
    assert parse_cpus(format_cpus(cpus)) == cpus
    assert format_cpus({0, 1, 2, 3, 6, 8, 9}) == "0-3,6,8-9"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "not a CPU"),
        ("a", "not a CPU"),
        ("3-1", "backwards"),
        ("1,,2", "not a CPU"),
        ("-1", "not a CPU"),
    ],
)
def test_a_bad_cpu_list_is_refused_naming_the_part(text, problem):
    with pytest.raises(ValueError, match=problem):
        parse_cpus(text)


def test_spare_cpus_are_the_free_ones_near_the_compute():
    nodes = {0: frozenset(range(0, 8)), 1: frozenset(range(8, 16))}
    # vLLM's automatic binding on two nodes, two ranks: the last core of each node is free
    assert spare_cpus(range(16), range(0, 7), nodes) == {7}
    assert spare_cpus(range(16), range(8, 15), nodes) == {15}
    # no node information: every free CPU
    assert spare_cpus(range(4), {0}) == {1, 2, 3}
    # nothing free: nothing to move to
    assert spare_cpus({0, 1}, {0, 1}) == frozenset()
    # compute spread over both nodes: both are near
    assert spare_cpus(range(16), {0, 8}, nodes) == set(range(16)) - {0, 8}


def test_memory_nodes_read_from_sysfs(tmp_path):
    for node, text in [(0, "0-3\n"), (1, "4-7,12\n"), (2, "\n")]:
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(text)
    (tmp_path / "node3").mkdir()  # no cpulist: left out
    (tmp_path / "power").mkdir()
    assert memory_nodes(tmp_path) == {0: {0, 1, 2, 3}, 1: {4, 5, 6, 7, 12}, 2: frozenset()}
    assert memory_nodes(tmp_path / "absent") == {}


@pytest.fixture
def two_cpus():
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    yield cpus[0], cpus[-1]
    place_store_threads(None)


def _on_cpu(cpu, work):
    """Run ``work`` in a thread bound to ``cpu`` (as vLLM's worker thread is), leaving this
    thread's CPUs alone."""
    failure = []

    def run():
        try:
            os.sched_setaffinity(0, {cpu})
            work()
        except BaseException as exc:  # noqa: BLE001 - raised again below
            failure.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert not thread.is_alive() and not failure, failure


def _store_threads():
    return {
        t.name: os.sched_getaffinity(t.native_id)
        for t in threading.enumerate()
        if t.name.startswith("ucm-") and t.native_id is not None
    }


@pytest.mark.parametrize("placed", [True, False])
def test_every_store_thread_runs_on_the_placement(tmp_path, shm_dir, two_cpus, placed):
    computing, spare = two_cpus
    place_store_threads({spare} if placed else None)
    assert store_threads_cpus() == ({spare} if placed else None)
    settings = {
        "kind": "tiered",
        "dram": {"path": str(shm_dir), "capacity_gb": 0.01},
        "backing": {"kind": "posix", "path": str(tmp_path / "p"), "capacity_gb": 0.01},
    }
    stores = []

    def dump():
        store = create_store(settings)
        stores.append(store)
        ids = range(16)
        assert all(
            r.ok
            for r in store.wait(store.dump([key(i) for i in ids], [blob(i, 40_000) for i in ids]))
        )
        deadline = time.monotonic() + 30  # the write-behind reaches the posix store
        while not all(store.backing.lookup([key(i) for i in ids])):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for tier in (store.front, store.backing):
            loads = tier.load([key(i) for i in ids], [bytearray(40_000) for _ in ids])
            assert all(r.ok for r in tier.wait(loads))

    before = set(_store_threads())
    try:
        _on_cpu(computing, dump)
        started = {n: cpus for n, cpus in _store_threads().items() if n not in before}
        # the dram store's copies, the posix store's I/O and eviction, the write-behind (its
        # first scan may be over)
        names = {n.rstrip("_0123456789") for n in started}
        assert {"ucm-shm", "ucm-posix", "ucm-posix-evict", "ucm-write-behind"} <= names, names
        assert all(cpus == ({spare} if placed else {computing}) for cpus in started.values()), (
            started
        )
    finally:
        for store in stores:
            store.close()
