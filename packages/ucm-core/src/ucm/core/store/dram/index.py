"""The arena's index: which slot holds a key, by open addressing in shared memory.

Buckets of (key0, key1, slot), linear probing from a key's home bucket, a power of two of
at least two buckets per slot (load <= 0.5: short probes, fast misses).  A deleted entry
becomes a tombstone (probes go on past it; an insert may take it), so that a lock-free
reader walking the same run still finds the keys beyond it.

Two rules keep every walk bounded whatever the shared memory holds (another process's bug,
a bit flip, a dead holder's half change):

- no walk takes more than one step per bucket: an index with no EMPTY bucket answers
  "absent" instead of spinning under the lock;
- tombstones never pile up: wherever an entry is dropped, the caller counts it and
  rebuilds the index from the slots once a quarter of the buckets are tombstones (or a
  walk ran long), so EMPTY buckets, where probes stop, stay at least a quarter.

Home buckets (Fibonacci hashing): the top bits of (key0 ^ salt) * _MIX.  Block keys are
hashes of prompts, which a client chooses: were the home their low bits, a client could
search for prompts whose keys share them and make every probe walk one long run under the
lock, stalling every engine on the host.  The salt, random per arena and kept in its
owner-only file, hides which keys collide.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

EMPTY = 0xFFFFFFFF  # a bucket unused since the last rebuild: probes stop here
TOMB = 0xFFFFFFFE  # a deleted entry: probes go on; an insert may take it
_MIX = 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1
#: a walk longer than this asks for a rebuild (expected walks at load 0.75 are under 10)
LONG_WALK = 256
#: vectorised probe rounds before the last few keys finish one by one
_VECTOR_ROUNDS = 2


def home_shift(buckets: int) -> int:
    """How far a 64-bit product is shifted to leave a bucket number (``buckets`` a power
    of two, at least 2)."""
    return 65 - buckets.bit_length()


def homes(salt: int, k0: np.ndarray, buckets: int) -> np.ndarray:
    """The home buckets of keys, as :meth:`Index.find` computes one (uint64 products wrap)."""
    mixed = (k0.astype(np.uint64) ^ np.uint64(salt)) * np.uint64(_MIX)
    return mixed >> np.uint64(home_shift(buckets))


class Index:
    """Scalar walks over the index columns (memoryview casts: several times cheaper per
    item than numpy scalars).  The caller holds the arena's lock."""

    def __init__(self, ik0: Any, ik1: Any, islot: Any, salt: int, buckets: int) -> None:
        self.ik0, self.ik1, self.islot = ik0, ik1, islot
        self.salt = salt
        self.buckets = buckets
        self._mask = buckets - 1
        self._shift = home_shift(buckets)
        #: a walk ran past LONG_WALK since the last rebuild (the caller rebuilds)
        self.long_walk = False

    def home(self, k0: int) -> int:
        return ((k0 ^ self.salt) * _MIX & _M64) >> self._shift

    def find(self, k0: int, k1: int) -> int:
        """The bucket holding the key, or -1."""
        ik0, ik1, islot, mask = self.ik0, self.ik1, self.islot, self._mask
        i = self.home(k0)
        for step in range(self.buckets):
            s = islot[i]
            if s == EMPTY:
                self.long_walk |= step > LONG_WALK
                return -1
            if s != TOMB and ik0[i] == k0 and ik1[i] == k1:
                self.long_walk |= step > LONG_WALK
                return i
            i = (i + 1) & mask
        self.long_walk = True  # no EMPTY bucket at all: only a damaged index
        return -1

    def insert(self, k0: int, k1: int, slot: int) -> bool:
        """Add a key known to be absent (``find`` said so under the same lock); whether it
        took a tombstone.  ``RuntimeError`` where no bucket is free (a damaged index: the
        caller rebuilds it)."""
        ik0, ik1, islot, mask = self.ik0, self.ik1, self.islot, self._mask
        i = self.home(k0)
        for step in range(self.buckets):
            s = islot[i]
            if s >= TOMB:
                self.long_walk |= step > LONG_WALK
                break
            i = (i + 1) & mask
        else:
            self.long_walk = True
            raise RuntimeError("the arena's index has no free bucket")
        islot[i] = TOMB  # a lock-free reader must not match the new key on the old slot
        ik0[i], ik1[i] = k0, k1
        islot[i] = slot  # last: the entry is whole before a lock-free reader can take it
        return bool(s == TOMB)


def bulk_find(
    salt: int,
    ik0: np.ndarray,
    ik1: np.ndarray,
    islot: np.ndarray,
    k0: np.ndarray,
    k1: np.ndarray,
    want_bucket: bool = False,
) -> np.ndarray:
    """The slot (or bucket) of every key, EMPTY where absent: all keys advance one probe a
    round, so the Python overhead is per round (the longest probe), not per key; the few
    keys left after ``_VECTOR_ROUNDS`` rounds finish one by one.  At most one step per
    bucket, whatever the index holds."""
    mask = np.uint64(islot.size - 1)
    pos = homes(salt, k0, islot.size)
    out = np.full(k0.size, EMPTY, np.uint64 if want_bucket else np.uint32)
    todo = np.arange(k0.size)
    rounds = 0
    while todo.size:
        rounds += 1
        if rounds > _VECTOR_ROUNDS and todo.size <= 16:
            m = int(mask)
            for t in todo.tolist():
                a, b, i = int(k0[t]), int(k1[t]), int(pos[t])
                for _ in range(islot.size):
                    sl = int(islot[i])
                    if sl == EMPTY:
                        break
                    if sl < TOMB and int(ik0[i]) == a and int(ik1[i]) == b:
                        out[t] = i if want_bucket else sl
                        break
                    i = (i + 1) & m
            break
        p = pos[todo]
        s = islot[p]
        match = (s < TOMB) & (ik0[p] == k0[todo]) & (ik1[p] == k1[todo])
        out[todo[match]] = p[match] if want_bucket else s[match]
        todo = todo[(s != EMPTY) & ~match]
        pos[todo] = (pos[todo] + np.uint64(1)) & mask
        if rounds >= islot.size:  # every bucket seen: an index without an EMPTY one
            break
    return out


def bulk_insert(
    salt: int,
    ik0: np.ndarray,
    ik1: np.ndarray,
    islot: np.ndarray,
    k0: np.ndarray,
    k1: np.ndarray,
    slots: np.ndarray,
) -> Inserted:
    """Insert keys known to be absent and distinct: each round, every pending key takes its
    bucket if free (EMPTY or TOMB; the first of several contenders wins), the others probe
    on.  Key words are written before the slot word (lock-free readers match on a slot below
    TOMB only).  Returns how many tombstones were taken, the rounds it took (the longest
    walk) and the keys left without a bucket (none unless the index is full: a damaged
    one, or more keys than half the buckets)."""
    mask = np.uint64(islot.size - 1)
    pos = homes(salt, k0, islot.size)
    todo = np.arange(k0.size)
    tombs = rounds = 0
    for _ in range(islot.size):
        if not todo.size:
            break
        rounds += 1
        p = pos[todo]
        free = islot[p] >= TOMB
        cand = todo[free]
        _, first = np.unique(pos[cand], return_index=True)
        win = cand[first]
        at = pos[win]
        tombs += int((islot[at] == TOMB).sum())
        ik0[at], ik1[at] = k0[win], k1[win]
        islot[at] = slots[win]
        won = np.zeros(k0.size, bool)
        won[win] = True
        todo = todo[~won[todo]]
        pos[todo] = (pos[todo] + np.uint64(1)) & mask
    return Inserted(tombs, rounds, todo)


class Inserted(NamedTuple):
    """What :func:`bulk_insert` did."""

    tombs: int  # tombstones taken
    rounds: int  # probe rounds: the longest walk
    left: np.ndarray  # positions of the keys that found no bucket
