"""The promises every store kind keeps (``ucm.core.store.Store``), as test functions over
the fixtures ``store`` (a fresh store of the kind) and ``kind`` (its name, for
:func:`ucm.lab.testing.core.store_config`).

A test module imports them (``from ucm.lab.testing.store_contract import *``) and gives
``kind`` its kinds: ucm-core's contract modules do so for its kinds, a few kinds a module so
that the slow ones (a Mooncake client's close takes two seconds) run side by side.  A store
kind from another distribution can hold itself to the same promises the same way."""

import threading

import attrs
import numpy as np
import pytest
from ucm.core.block_format import HEADER_BYTES
from ucm.core.config import PosixStoreConfig, TieredStoreConfig
from ucm.core.settings import ConfigError
from ucm.core.store import Status, create_store
from ucm.lab.testing.core import blob, key, store_config

#: the kinds each of ucm-core's contract modules runs, a few a module: the Mooncake ones
#: take seconds a store (its client's close), so they run side by side
LOCAL_KINDS = ["posix", "posix-signed", "dram", "dram-signed", "dram-process", "tiered"]
MOONCAKE_KINDS = [
    pytest.param(k, marks=pytest.mark.mooncake) for k in ("mooncake", "mooncake-signed")
]
OVER_MOONCAKE_KINDS = [
    pytest.param(k, marks=pytest.mark.mooncake) for k in ("tiered-mooncake", "posix-over-mooncake")
]
KINDS = [*LOCAL_KINDS, *MOONCAKE_KINDS, *OVER_MOONCAKE_KINDS]


def test_round_trip_lookup_and_prefix(store):
    keys = [key(i) for i in range(40)]
    data = [blob(i, 20_000 + i) for i in range(40)]
    assert store.lookup(keys) == [False] * 40
    assert store.lookup_prefix(keys) == 0
    assert all(r.ok for r in store.wait(store.dump(keys[:30], data[:30]), 30))
    assert store.lookup(keys) == [True] * 30 + [False] * 10
    assert store.lookup_prefix(keys) == 30
    assert store.lookup_prefix(keys[5:]) == 25
    out = [np.zeros_like(d) for d in data[:30]]
    assert all(r.ok for r in store.wait(store.load(keys[:30], out), 30))
    for got, want in zip(out, data):
        np.testing.assert_array_equal(got, want)


def test_parts_and_one_buffer_are_the_same_block(store):
    data = blob(1, 300_000)
    raw = data.tobytes()
    parts = [bytearray(raw[:1]), bytearray(), bytearray(raw[1:70_001]), bytearray(raw[70_001:])]
    assert store.wait(store.dump([key(1)], [parts]))[0].ok
    assert store.wait(store.dump([key(2)], [data]))[0].ok
    one = np.zeros_like(data)
    assert store.wait(store.load([key(1)], [one]))[0].ok
    np.testing.assert_array_equal(one, data)
    pieces = [bytearray(100_000), bytearray(0), bytearray(200_000)]
    assert store.wait(store.load([key(2)], [pieces]))[0].ok
    assert b"".join(pieces) == raw


def test_a_key_already_stored_is_kept(store):
    first, second = blob(1, 50_000), blob(2, 50_000)
    assert store.wait(store.dump([key(7)], [first]))[0].ok
    assert store.wait(store.dump([key(7)], [second]))[0].ok  # idempotent: OK, not an error
    out = np.zeros_like(first)
    assert store.wait(store.load([key(7)], [out]))[0].ok
    np.testing.assert_array_equal(out, first)


def test_miss_wrong_size_wrong_layout(store):
    data = blob(3, 40_000)
    assert store.wait(store.dump([key(3)], [data], b"layout-a"))[0].ok
    assert store.wait(store.load([key(99)], [np.zeros_like(data)], b"layout-a"))[0].status is (
        Status.MISS
    )
    for size in (39_999, 40_001):
        result = store.wait(store.load([key(3)], [np.zeros(size, np.uint8)], b"layout-a"))[0]
        assert result.status is Status.ERROR, result
        assert "40000" in result.detail
    result = store.wait(store.load([key(3)], [np.zeros_like(data)], b"layout-b"))[0]
    assert result.status is Status.ERROR and "layout" in result.detail
    out = np.zeros_like(data)  # the block itself is fine: a right request still hits
    assert store.wait(store.load([key(3)], [out], b"layout-a"))[0].ok
    np.testing.assert_array_equal(out, data)


def test_remove(store):
    keys = [key(i) for i in range(4)]
    assert all(r.ok for r in store.wait(store.dump(keys, [blob(i, 1000) for i in range(4)])))
    assert store.remove(keys[:2] + [key(50)]) == 2
    assert store.lookup(keys) == [False, False, True, True]
    result = store.wait(store.load(keys[:1], [np.zeros(1000, np.uint8)]))[0]
    assert result.status is Status.MISS


def test_bad_batches_are_refused_before_any_io(store):
    with pytest.raises(ValueError, match="keys"):
        store.dump([b"short"], [bytearray(10)])
    with pytest.raises(ValueError, match="2 keys but 1 buffers"):
        store.load([key(1), key(2)], [bytearray(10)])
    with pytest.raises(ValueError, match="read-only"):
        store.load([key(1)], [bytes(10)])
    with pytest.raises(TypeError, match="buffer protocol"):
        store.dump([key(1)], [object()])
    assert store.wait(store.dump([], [])) == []
    assert store.lookup([]) == []


def test_many_threads_at_once(store):
    errors = []

    def worker(t: int) -> None:
        try:
            for j in range(10):
                k, data = key(j, bytes([t])), blob(t * 100 + j, 30_000)
                assert store.wait(store.dump([k], [data]), 30)[0].ok
                out = np.zeros_like(data)
                assert store.wait(store.load([k], [out]), 30)[0].ok
                np.testing.assert_array_equal(out, data)
        except BaseException as exc:  # reported below, from the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]


def test_a_cancelled_load_leaves_every_key_settled(store):
    keys = [key(i) for i in range(64)]
    assert all(r.ok for r in store.wait(store.dump(keys, [blob(i, 64_000) for i in range(64)]), 30))
    out = [np.zeros(64_000, np.uint8) for _ in keys]
    task = store.load(keys, out)
    assert task.cancel(wait=30)
    results = store.wait(task, 30)
    assert len(results) == 64
    assert {r.status for r in results} <= {Status.OK, Status.CANCELLED}
    for i, r in enumerate(results):
        if r.ok:
            np.testing.assert_array_equal(out[i], blob(i, 64_000))


def test_a_block_larger_than_the_store_is_refused_at_start_up(kind, tmp_path, request):
    small = {
        "posix": {"capacity_gb": 1.5 / 1024},
        "dram": {"capacity_gb": 1.5 / 1024},
        "dram-process": {"capacity_gb": 1.5 / 1024},
        "mooncake": {"global_segment_gb": 1.5 / 1024},
    }
    config = store_config(kind, tmp_path, request)
    expected = {
        "posix": "store.capacity_gb",
        "dram": "store.capacity_gb",
        "dram-process": "store.capacity_gb",
        "tiered": "store.dram.capacity_gb",
        "mooncake": "store.global_segment_gb",
        "tiered-mooncake": "store.dram.capacity_gb",
        "posix-over-mooncake": "store.local.capacity_gb",
    }[kind.removesuffix("-signed")]
    if kind == "posix-over-mooncake":
        local = PosixStoreConfig(path=config.local.path, **small["posix"])
        config = TieredStoreConfig(local=local, backing=config.backing)
    elif kind.startswith("tiered"):
        dram = attrs.evolve(config.dram, **small["dram"])
        config = TieredStoreConfig(dram=dram, backing=config.backing)
    else:
        config = attrs.evolve(config, **small[kind.removesuffix("-signed")])
    store = create_store(config)
    try:
        store.check_block_bytes(1 << 20)  # fits
        with pytest.raises(ConfigError) as caught:
            store.check_block_bytes(2 << 20)
        assert caught.value.key == expected
        assert str(2 << 20) in str(caught.value) or str((2 << 20) + HEADER_BYTES) in str(
            caught.value
        )
    finally:
        store.close()


#: the tier each kind keeps a block in first: what an engine reports a hit's source as
TIERS = {
    "posix": "disk", "posix-signed": "disk", "dram": "host", "dram-signed": "host",
    "dram-process": "host", "tiered": "host", "mooncake": "remote", "mooncake-signed": "remote",
    "tiered-mooncake": "host", "posix-over-mooncake": "disk",
}  # fmt: skip


def test_every_block_names_the_tier_that_serves_it(store, kind):
    keys = [key(i) for i in range(3)]
    assert all(r.ok for r in store.wait(store.dump(keys, [blob(i, 4000) for i in range(3)]), 30))
    assert store.tier == TIERS[kind]
    assert store.tiers(keys) == [TIERS[kind]] * 3  # a tiered store's front holds them all
