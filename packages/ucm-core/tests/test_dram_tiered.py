import pytest
import xxhash
from ucm.core.config import DramStoreConfig, PosixStoreConfig
from ucm.core.store import DramStore, PosixStore, Status, TieredStore

GIB = 1 << 30


def key(i: int) -> bytes:
    return xxhash.xxh3_128_digest(i.to_bytes(8, "little"))


def test_dram_round_trip_and_lru():
    s = DramStore(DramStoreConfig(capacity_gb=3000 / GIB))
    s.wait(s.dump([key(1), key(2)], [b"a" * 1000, b"b" * 1000]))
    out = bytearray(1000)
    assert s.wait(s.load([key(1)], [out]))[0].ok and out == b"a" * 1000  # key(1) now recent
    s.wait(s.dump([key(3), key(4)], [b"c" * 1000, b"d" * 1000]))
    assert s.lookup([key(1), key(2), key(3), key(4)]) == [True, False, True, True]
    assert s.usage().bytes <= 3000


def test_dram_reuses_evicted_buffers():
    s = DramStore(DramStoreConfig(capacity_gb=2000 / GIB))
    s.wait(s.dump([key(1), key(2)], [b"a" * 1000, b"b" * 1000]))
    address = id(s._blocks[key(1)][1].obj), s._blocks[key(1)][1]
    s.wait(s.dump([key(3)], [b"c" * 1000]))
    reused = s._blocks[key(3)][1]
    assert reused.obj is address[1].obj and bytes(reused) == b"c" * 1000
    assert len(s._arena._slabs) == 1


@pytest.mark.parametrize("preallocate", [False, True])
def test_dram_mixed_sizes_under_pressure(preallocate):
    from ucm.core.store.dram.process import SLAB_BYTES

    cap = 2 * SLAB_BYTES
    s = DramStore(DramStoreConfig(capacity_gb=cap / GIB, scope="process", preallocate=preallocate))
    sizes = [SLAB_BYTES // 3, SLAB_BYTES // 7, 12345, SLAB_BYTES // 2]
    for i in range(60):
        size = sizes[i % len(sizes)]
        assert s.wait(s.dump([key(i)], [bytes([i]) * size]))[0].ok
        assert s.usage().bytes <= cap
        out = bytearray(size)
        assert s.wait(s.load([key(i)], [out]))[0].ok and out == bytes([i]) * size
    assert s._arena._mapped <= cap + SLAB_BYTES


def test_dram_errors():
    s = DramStore(DramStoreConfig(capacity_gb=100 / GIB))
    assert s.wait(s.dump([key(1)], [bytes(200)]))[0].status is Status.ERROR
    s.wait(s.dump([key(2)], [bytes(50)], b"A"))
    assert s.wait(s.load([key(2)], [bytearray(50)], b"B"))[0].status is Status.ERROR
    assert s.wait(s.load([key(2)], [bytearray(49)], b"A"))[0].status is Status.ERROR
    assert s.wait(s.load([key(3)], [bytearray(50)], b"A"))[0].status is Status.MISS
    assert s.remove([key(2), key(3)]) == 1 and s.usage().blocks == 0


def test_dram_bad_config():
    from ucm.core.config import parse_store_config
    from ucm.core.settings import ConfigError

    with pytest.raises(ConfigError, match="store.preallocate"):
        parse_store_config({"kind": "dram", "preallocate": "yes"})


@pytest.fixture
def tiered(tmp_path):
    backing = PosixStore(PosixStoreConfig(path=str(tmp_path / "p")))
    t = TieredStore(DramStore(DramStoreConfig(capacity_gb=10_000 / GIB)), backing)
    yield t
    t.close()


def test_tiered_write_through_and_promote(tiered):
    keys = [key(i) for i in range(4)]
    data = [bytes([i]) * 3000 for i in range(4)]
    assert all(r.ok for r in tiered.wait(tiered.dump(keys, data)))
    assert tiered.backing.lookup(keys) == [True] * 4
    assert tiered.front.lookup(keys) == [False, True, True, True]  # 3 x 3000 fit in 10 000
    out = [bytearray(3000) for _ in keys]
    assert all(r.ok for r in tiered.wait(tiered.load(keys, out)))
    assert [bytes(o) for o in out] == data
    assert tiered.front.lookup([key(0)]) == [True]  # promoted from the backing store


def test_tiered_lookup_prefix_spans_both_tiers(tiered):
    keys = [key(i) for i in range(6)]
    tiered.backing.wait(tiered.backing.dump(keys[:3], [b"x"] * 3))
    tiered.front.dump(keys[3:5], [b"y"] * 2)
    assert tiered.lookup_prefix(keys) == 5
    assert tiered.lookup(keys) == [True] * 5 + [False]
    tiered.backing.remove([keys[1]])
    assert tiered.lookup_prefix(keys) == 1


def test_tiered_miss_and_remove(tiered):
    results = tiered.wait(tiered.load([key(1)], [bytearray(10)]))
    assert results[0].status is Status.MISS
    tiered.wait(tiered.dump([key(1)], [b"z" * 10]))
    assert tiered.remove([key(1), key(2)]) == 1
    assert tiered.lookup([key(1)]) == [False]
