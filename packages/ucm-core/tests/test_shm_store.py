"""The dram store of scope host: shared memory that every process on the host sees.

What vLLM needs of it: its scheduler opens the store at start-up and looks blocks up there,
while worker processes write them later; a restarted engine finds what the last one wrote.
The posix promises on this medium (whole blocks after a kill, processes sharing keys, LRU,
checksums) run in test_processes.py and test_store_contract.py.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from ucm.core.config import DramStoreConfig, parse_store_config
from ucm.core.settings import ConfigError
from ucm.core.store import SharedMemoryStore, Status, create_store
from ucm.core.store.chunks import chunk_size
from ucm.core.store.dram.shared import mount_of
from ucm.lab.testing.core import blob, flip_shared_block_byte, key

WRITER = """
import sys
import numpy as np
from ucm.core.store import create_store
from ucm.lab.testing.core import blob, flip_shared_block_byte, key

store = create_store({"kind": "dram", "path": sys.argv[1], "capacity_gb": 0.03125})
results = store.wait(store.dump([key(i) for i in range(8)], [blob(i, 50_000) for i in range(8)]))
assert all(r.ok for r in results), results
store.close()
"""


def test_blocks_written_by_another_process_are_found_by_a_store_opened_before(shm_dir):
    # vLLM's scheduler opens its store first; the workers, other processes, dump later
    scheduler = create_store({"kind": "dram", "path": str(shm_dir), "capacity_gb": 0.03125})
    assert isinstance(scheduler, SharedMemoryStore)
    keys = [key(i) for i in range(8)]
    assert scheduler.lookup_prefix(keys) == 0
    done = subprocess.run([sys.executable, "-c", WRITER, str(shm_dir)], capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    assert scheduler.lookup_prefix(keys) == 8  # the writer has exited: the blocks stay
    out = [np.zeros(50_000, np.uint8) for _ in keys]
    assert all(r.ok for r in scheduler.wait(scheduler.load(keys, out)))
    for i, got in enumerate(out):
        np.testing.assert_array_equal(got, blob(i, 50_000))
    scheduler.close()
    # a restarted engine opens it anew and finds them
    with create_store({"kind": "dram", "path": str(shm_dir), "capacity_gb": 0.03125}) as again:
        assert again.lookup_prefix(keys) == 8
        assert again.usage().blocks == 8


def test_a_corrupted_block_in_shared_memory_is_a_miss(shm_dir):
    store = create_store({"kind": "dram", "path": str(shm_dir), "capacity_gb": 0.03125})
    assert store.wait(store.dump([key(1)], [blob(1, 40_000)]))[0].ok
    flip_shared_block_byte(shm_dir, key(1))
    out = np.zeros(40_000, np.uint8)
    assert store.wait(store.load([key(1)], [out]))[0].status is Status.CORRUPT
    assert store.lookup([key(1)]) == [False]  # removed: the next lookup is a miss
    store.close()


def test_a_path_on_a_disk_is_refused(tmp_path):
    found = mount_of(str(tmp_path))
    if found is None or found[1] in ("tmpfs", "ramfs"):
        pytest.skip(f"the test's folder is itself in memory here: {found}")
    with pytest.raises(ConfigError) as caught:
        create_store({"kind": "dram", "path": str(tmp_path / "shm")})
    assert caught.value.key == "store.path"
    assert "not in memory" in str(caught.value) and "kind 'posix'" in str(caught.value)


def test_a_capacity_larger_than_the_shared_memory_is_refused(shm_dir):
    import os

    stat = os.statvfs("/dev/shm")
    too_big = 2 * stat.f_blocks * stat.f_frsize / (1 << 30)
    with pytest.raises(ConfigError) as caught:
        create_store({"kind": "dram", "path": str(shm_dir), "capacity_gb": too_big})
    assert caught.value.key == "store.capacity_gb"
    assert "--shm-size" in str(caught.value)
    assert not shm_dir.exists()  # refused before anything was made


@pytest.mark.parametrize(
    "settings,key",
    [
        ({"kind": "dram", "preallocate": True}, "store.preallocate"),
        ({"kind": "dram", "scope": "process", "path": "/dev/shm/x"}, "store.path"),
        ({"kind": "dram", "scope": "node"}, "store.scope"),
        ({"kind": "dram", "path": ""}, "store.path"),
    ],
)
def test_settings_that_do_not_go_together_are_refused(settings, key):
    with pytest.raises(ConfigError) as caught:
        parse_store_config(settings)
    assert caught.value.key == key


def test_process_scope_is_the_private_store():
    from ucm.core.store import DramStore

    config = DramStoreConfig(capacity_gb=0.01, scope="process", preallocate=True)
    with create_store(config) as store:
        assert isinstance(store, DramStore)


def test_a_thread_that_waits_for_a_batch_copies_it_when_the_store_threads_are_busy(shm_dir):
    """A vLLM worker waits for its sync loads with its compute core idle, while the store's
    threads share the one core vLLM leaves to everything else: the waiting thread takes the
    chunks no store thread has taken yet.  Here the store's only thread is held elsewhere,
    and a dump and a load still finish, on the thread that waits for them."""
    import threading

    store = SharedMemoryStore(DramStoreConfig(path=str(shm_dir), capacity_gb=0.0625, threads=1))
    held = threading.Event()
    store._pool.submit(held.wait, 30)  # the store's only thread, busy
    try:
        keys = [key(i, b"help") for i in range(12)]
        data = [blob(i, 300_000) for i in range(12)]
        assert all(r.ok for r in store.wait(store.dump(keys, data), 10))
        out = [np.zeros_like(d) for d in data]
        assert all(r.ok for r in store.wait(store.load(keys, out), 10))
        for got, want in zip(out, data):
            np.testing.assert_array_equal(got, want)
    finally:
        held.set()
        store.close()


def test_a_batch_makes_a_chunk_for_each_thread_and_the_one_that_waits():
    kib = 1 << 10
    assert chunk_size(66, 256 * kib, 2) == 22  # three chunks: two threads and a waiter
    assert chunk_size(4, 256 * kib, 2) == 4  # 1 MiB: not worth a second thread
    assert chunk_size(640, 256 * kib, 2) == 32  # at most CHUNK keys
    assert chunk_size(8, 4 << 20, 2) == 2  # and 8 MiB
    assert chunk_size(1, 64 << 20, 4) == 1
