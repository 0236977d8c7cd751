import threading
import time

import pytest
import xxhash
from ucm.core.config import DramStoreConfig, PosixStoreConfig
from ucm.core.store import DramStore, PosixStore, Status, TieredStore
from ucm.core.store.task import Task

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
    assert len(s._pool._slabs) == 1


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
    assert s._pool._mapped <= cap + SLAB_BYTES


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


def test_a_tiered_store_tells_which_tier_serves_each_block(tiered):
    # what an engine reports as each hit's source: the host's memory or the disk below
    keys = [key(i) for i in range(4)]
    tiered.backing.wait(tiered.backing.dump(keys, [b"x"] * 4))
    tiered.wait(tiered.front.dump(keys[1:3], [b"y"] * 2))
    assert tiered.tiers(keys) == ["disk", "host", "host", "disk"]
    assert (tiered.tier, tiered.front.tier, tiered.backing.tier) == ("host", "host", "disk")
    assert tiered.backing.tiers(keys) == ["disk"] * 4  # one tier: no lookup


def test_tiered_miss_and_remove(tiered):
    results = tiered.wait(tiered.load([key(1)], [bytearray(10)]))
    assert results[0].status is Status.MISS
    tiered.wait(tiered.dump([key(1)], [b"z" * 10]))
    assert tiered.remove([key(1), key(2)]) == 1
    assert tiered.lookup([key(1)]) == [False]


class GatedStore(PosixStore):
    """A posix store whose writes wait for ``gate`` (a slow disk or network), in the
    background: ``dump`` returns at once, its task completes once the gate opens."""

    def __init__(self, config):
        super().__init__(config)
        self.gate = threading.Event()
        self.dumps = 0

    def dump(self, keys, buffers, layout=b""):
        self.dumps += 1
        task = Task(len(keys))

        def run():
            self.gate.wait(30)
            inner = PosixStore.dump(self, keys, buffers, layout)
            for i, result in enumerate(inner.wait(30)):
                task.set_result(i, result)

        threading.Thread(target=run, daemon=True).start()
        return task


@pytest.fixture
def behind(tmp_path):
    backing = GatedStore(PosixStoreConfig(path=str(tmp_path / "p")))
    front = DramStore(DramStoreConfig(capacity_gb=(1 << 20) / GIB, scope="process"))
    t = TieredStore(front, backing, write_behind_bytes=64_000)
    yield t
    t.backing.gate.set()
    t.close()


def test_tiered_dumps_wait_for_the_local_tier_only_and_the_blocks_go_below_behind(behind):
    keys = [key(i) for i in range(4)]
    data = [bytes([i]) * 3000 for i in range(4)]
    task = behind.dump(keys, data)
    # done while the backing store cannot write: the engine waited for memory only
    assert all(r.ok for r in behind.wait(task, 5))
    assert behind.backing.lookup(keys) == [False] * 4
    assert behind.lookup(keys) == [True] * 4  # served by the local tier meanwhile
    data[0] = b"changed by the engine after the dump"  # the caller's buffers are free
    behind.backing.gate.set()
    assert behind.behind.drain(10)
    assert behind.backing.lookup(keys) == [True] * 4
    out = [bytearray(3000) for _ in keys]
    assert all(r.ok for r in behind.backing.wait(behind.backing.load(keys, out)))
    assert out == [bytes([i]) * 3000 for i in range(4)]  # the local tier's copies


def test_tiered_writes_through_past_the_budget_and_where_the_local_tier_failed(behind):
    first = [key(i) for i in range(20)]
    assert all(r.ok for r in behind.wait(behind.dump(first, [b"a" * 3000] * 20), 5))
    # 60 000 bytes wait to go below; 8 more blocks would pass the 64 000-byte budget
    more = [key(100 + i) for i in range(8)]
    task = behind.dump(more, [b"b" * 3000] * 8)
    time.sleep(0.3)
    assert not task.done()  # the engine now waits for the backing store (back-pressure)
    behind.backing.gate.set()
    assert all(r.ok for r in behind.wait(task, 10))
    assert behind.backing.lookup(more) == [True] * 8  # written from the caller's buffers
    assert behind.behind.drain(10)
    assert behind.backing.lookup(first) == [True] * 20
    # a block the local tier refuses (larger than its capacity) is written through too
    big = key(999)
    assert behind.wait(behind.dump([big], [b"c" * (2 << 20)]), 10)[0].ok
    assert behind.front.lookup([big]) == [False] and behind.backing.lookup([big]) == [True]


def test_tiered_close_writes_what_waits_behind(tmp_path):
    backing = PosixStore(PosixStoreConfig(path=str(tmp_path / "p")))
    front = DramStore(DramStoreConfig(capacity_gb=(1 << 20) / GIB, scope="process"))
    tiered = TieredStore(front, backing, write_behind_bytes=1 << 20)
    keys = [key(i) for i in range(16)]
    assert all(r.ok for r in tiered.wait(tiered.dump(keys, [b"d" * 4096] * 16), 5))
    tiered.close()
    again = PosixStore(PosixStoreConfig(path=str(tmp_path / "p")))
    assert again.lookup(keys) == [True] * 16
    again.close()


def test_a_tiered_store_reads_from_memory_where_its_local_tier_is_memory_and_both_do(tmp_path):
    # an engine reads such a store's loads straight into its cache: the load below, and
    # the promotion of what it read (a copy into memory), end at once when cancelled
    local = PosixStore(PosixStoreConfig(path=str(tmp_path / "p")))
    memory = DramStore(DramStoreConfig(capacity_gb=10_000 / GIB))
    assert TieredStore(memory, local).reads_from_memory == local.reads_from_memory
    other = PosixStore(PosixStoreConfig(path=str(tmp_path / "q")))
    assert not TieredStore(other, local).reads_from_memory  # promotions write a disk
    local.close()
    other.close()
