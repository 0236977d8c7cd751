"""The store contract (:mod:`ucm.lab.testing.store_contract`) over the kinds of this host:
posix, dram (shared memory, one process's memory), tiered (dram over posix), and those that
sign their blocks with a secret; the ``store`` fixture (conftest.py) is the one every store
test uses."""

import time

import attrs
import pytest
from ucm.core.store import create_store
from ucm.lab.testing.core import blob, key, store_config
from ucm.lab.testing.store_contract import *  # noqa: F403 - the contract's tests
from ucm.lab.testing.store_contract import LOCAL_KINDS


@pytest.fixture(params=LOCAL_KINDS)
def kind(request):
    return request.param


@pytest.mark.parametrize("kind", ["posix", "posix-signed", "dram", "dram-signed", "dram-process"])
def test_the_watched_blocks_a_store_evicts_are_reported(kind, tmp_path, request):
    """What an engine announces as removed to a router: the stores that evict in the
    caller's process hand back the tags of the watched blocks their passes evicted, and
    only those (a signed store files blocks under keyed names: the tags still come back)."""
    config = attrs.evolve(store_config(kind, tmp_path, request), capacity_gb=2 / 1024)
    store = create_store(config)
    try:
        size, n = 64 << 10, 80  # 5 MiB through a store of 2 MiB
        keys = [key(i, b"evict") for i in range(n)]
        watched = set(range(0, n, 2))
        for i in range(n):
            if i in watched:
                store.watch_evictions([keys[i]], [("block", i)])
            assert store.wait(store.dump([keys[i]], [blob(i, size)]))[0].ok, i
        settled, seen = time.monotonic() + 10, -1
        while seen != store.evicted_blocks and time.monotonic() < settled:
            seen = store.evicted_blocks  # a background pass may still run: let it end
            time.sleep(0.3)
        reported = store.take_evicted()
        gone = {i for i, present in enumerate(store.lookup(keys)) if not present}
        assert len(gone) >= n // 2
        assert sorted(reported) == sorted(("block", i) for i in gone & watched)
        assert store.take_evicted() == []
    finally:
        store.close()
