"""The transfer toolkit both adapters share: host rows reused, the verified prefix, payloads
made in place."""

import torch
from ucm.core.store.task import KeyResult, Status

from ucm.kernels import block_segments
from ucm.kernels.transfer import (
    RowPool,
    deferred_payloads,
    first_problem,
    row_buffers,
    verified_prefix,
)

OK = KeyResult(Status.OK)
MISS = KeyResult(Status.MISS)
CORRUPT = KeyResult(Status.CORRUPT, "payload checksum mismatch")


def test_rows_given_back_are_taken_again_from_one_allocation():
    pool = RowPool(keep_bytes=1 << 20)
    rows = pool.take(4096, 4, pin=False)
    assert [r.numel() for r in rows] == [4096] * 4
    pool.give(rows)
    assert pool.free_bytes == 4 * 4096
    again = pool.take(4096, 3, pin=False)
    assert [r.data_ptr() for r in again] == [r.data_ptr() for r in rows[:3]]
    spacing = {b.data_ptr() - a.data_ptr() for a, b in zip(again, again[1:])}
    assert spacing == {4096}  # evenly spaced: the kernels move them in one operation
    assert pool.free_bytes == 4096
    assert pool.take(4096, 1, pin=False)[0].data_ptr() == rows[3].data_ptr()


def test_rows_of_other_sizes_are_kept_apart_and_new_ones_made_when_short():
    pool = RowPool(keep_bytes=1 << 20)
    small, large = pool.take(1024, 2, pin=False), pool.take(2048, 1, pin=False)
    pool.give([*small, *large])  # mixed sizes in one call
    got = pool.take(2048, 2, pin=False)
    assert got[0].data_ptr() == large[0].data_ptr() and got[1].numel() == 2048
    assert pool.free_bytes == 2 * 1024


def test_no_more_than_keep_bytes_are_kept():
    pool = RowPool(keep_bytes=3 * 1000)
    pool.give(pool.take(1000, 5, pin=False))
    assert pool.free_bytes == 3000
    pool.reserve(1000, 2, pin=False)
    assert pool.free_bytes == 3000


def test_a_block_counts_only_if_it_and_every_block_before_it_verified():
    assert verified_prefix([OK, OK, OK]) == 3
    assert verified_prefix([OK, CORRUPT, OK]) == 1
    assert verified_prefix([OK, None, OK]) == 1  # no answer is a failure
    assert verified_prefix([]) == 0
    # several groups per block: block 1 of the second group failed
    assert verified_prefix([OK, OK, OK, MISS, OK], blocks=[0, 0, 1, 1, 2]) == 1
    # a load that starts past blocks the engine holds: block numbers, not positions
    assert verified_prefix([OK, OK], blocks=[5, 6]) == 7
    assert verified_prefix([OK, MISS], blocks=[5, 6]) == 6


def test_the_first_problem_is_named():
    assert first_problem([OK, CORRUPT, MISS]) == "payload checksum mismatch"
    assert first_problem([OK, MISS]) == "miss"
    assert first_problem([OK, None]) == "timed out"
    assert first_problem([OK]) == ""


def test_rows_and_cache_blocks_as_store_buffers():
    row = torch.arange(8, dtype=torch.uint8)
    (view,) = row_buffers([row])
    view[0] = 99  # the store writes the row itself
    assert row[0] == 99
    cache = torch.arange(4 * 2 * 8, dtype=torch.float32).reshape(4, 2, 8)  # [B, N, C]
    segments = block_segments([cache], [[1], [3]])
    payloads = deferred_payloads(segments, [1])
    assert len(payloads) == 1 and payloads[0].nbytes == 2 * 8 * 4
    data = b"".join(bytes(p) for p in payloads[0].parts)
    assert data == cache[3].numpy().tobytes()
