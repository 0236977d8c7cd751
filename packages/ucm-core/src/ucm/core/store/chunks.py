"""How a batch is cut into chunks that a store's threads, and the thread that waits for the
batch, take one at a time (the ``dram`` store's copies, the ``posix`` store's reads).

A chunk is the unit of the work done between two hand-overs of the GIL (one compiled call)
and, in the ``dram`` store, under one hold of the arena's lock: large enough to spread
their cost, small enough that the first copies start soon and that a batch still spreads
over every thread.
"""

from __future__ import annotations

#: keys a thread takes at once (the dram store: reserves or pins under one hold of the
#: arena's lock): small enough that its first copies start soon, large enough to spread the
#: lock's cost and its hand-overs of the GIL (the dram store, 256 KiB blocks, batches of
#: 128, two threads: 16 a chunk 0.39-0.44 / 0.55-0.60 of memcpy, 32 0.49-0.53 / 0.62-0.67,
#: 64 0.46-0.66 / 0.54-0.68, in runs on a noisy VM; with the compiled copies, medians of
#: five rounds, 16 0.97 / 0.74, 32 1.04 / 0.80, 64 1.17 / 0.75)
CHUNK = 32
#: and bytes of blocks one chunk holds at most (CHUNK blocks of 256 KiB), so that a batch of
#: a few large blocks still spreads over the threads: FastDeploy writes steps of 8 blocks of
#: 4 MiB, one chunk each before, sealed by one thread while the others had nothing to do
CHUNK_BYTES = 8 << 20
#: and at least this much, where the batch has it (see chunk_size)
MIN_CHUNK_BYTES = 1 << 20


def chunk_keys(nbytes: int) -> int:
    """Keys a chunk of blocks of ``nbytes`` holds: :data:`CHUNK`, fewer for large blocks."""
    return max(1, min(CHUNK, CHUNK_BYTES // max(nbytes, 1)))


def chunk_size(n: int, nbytes: int, threads: int) -> int:
    """Keys a chunk of a batch of ``n`` blocks of ``nbytes`` holds: :func:`chunk_keys`, or
    fewer, so that the batch makes a chunk for each of ``threads`` threads and a thread that
    waits.  A chunk holds :data:`MIN_CHUNK_BYTES` at least: each costs hand-overs of the GIL
    (and a hold of the dram arena's lock).  (The dram store, two copy threads and a waiter
    on two cores, in one process: 66 blocks of 256 KiB load alike in three, six or nine
    chunks, 2.2-2.8 ms; 8 blocks in 0.49 ms as two chunks, 0.59 as three, 0.93 as eight.)"""
    least = -(-MIN_CHUNK_BYTES // max(nbytes, 1))
    return max(1, min(chunk_keys(nbytes), max(least, -(-n // (threads + 1)))))
