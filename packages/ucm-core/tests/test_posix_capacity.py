"""The posix store's capacity policy, without a file: what fits, how far eviction goes, and
which blocks go first."""

import attrs
from ucm.core.store.posix.capacity import (
    ROOM_BLOCKS,
    SAMPLE_FACTOR,
    Capacity,
    eviction_order,
    sample_is_enough,
)


@attrs.frozen
class Block:
    name: str
    mtime_ns: int


def test_an_unlimited_store_takes_everything_and_never_refuses():
    capacity = Capacity(None, 0.1)
    assert capacity.refusal(1 << 40) is None
    assert capacity.take(1 << 40, used=1 << 50) and capacity.inflight_bytes == 1 << 40


def test_a_block_larger_than_the_limit_is_refused_with_both_sizes():
    refusal = Capacity(1000, 0.1).refusal(1001)
    assert refusal is not None and "1001" in refusal and "1000" in refusal
    assert Capacity(1000, 0.1).refusal(1000) is None


def test_take_counts_what_the_store_holds_and_writes_in_flight():
    capacity = Capacity(1000, 0.1)
    assert capacity.take(300, used=600)  # 600 stored + 300 in flight
    assert not capacity.take(101, used=600)  # would pass the limit
    assert capacity.inflight_bytes == 300
    capacity.finished(300)
    assert capacity.inflight_bytes == 0
    assert capacity.take(100, used=900) and not capacity.take(1, used=900)


def test_a_write_that_ends_gives_its_bytes_back():
    capacity = Capacity(1000, 0.1)
    assert capacity.take(500, used=0)
    capacity.finished(500)
    assert capacity.inflight_bytes == 0 and capacity.take(1000, used=0)


def test_least_recently_used_go_first_and_blocks_being_read_never():
    blocks = [Block("c", 30), Block("a", 10), Block("d", 40), Block("b", 20)]
    assert [b.name for b in eviction_order(blocks)] == ["a", "b", "c", "d"]
    assert [b.name for b in eviction_order(blocks, skip={"a", "c"})] == ["b", "d"]


def test_a_pass_frees_what_is_over_and_a_share_and_samples_a_multiple_of_it():
    capacity = Capacity(100_000, 0.01)
    share = 1000
    assert capacity.pass_need(10, used=50_000) == share
    assert capacity.pass_need(10, used=100_000) == 10 + share
    capacity.inflight_bytes = 400
    assert capacity.pass_need(10, used=100_000) == 410 + share
    # a small store still frees room for several of the largest blocks written: room for
    # one would go to other writers
    assert capacity.pass_need(500, used=50_000) == ROOM_BLOCKS * 500
    capacity.take(900, used=0)
    assert capacity.pass_need(10, used=50_000) == ROOM_BLOCKS * 900
    assert not sample_is_enough(SAMPLE_FACTOR * 1000 - 1, 1000)
    assert sample_is_enough(SAMPLE_FACTOR * 1000, 1000)


def test_the_background_evictor_starts_when_less_than_the_share_is_free():
    capacity = Capacity(100_000, 0.01)
    assert not capacity.needs_headroom(99_000)
    assert capacity.needs_headroom(99_001)
    capacity.inflight_bytes = 500  # writes in flight count too
    assert capacity.needs_headroom(98_600)
    assert not Capacity(None, 0.01).needs_headroom(10**18)
