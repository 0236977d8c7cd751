/* A dram store's write books, a batch in one call under the arena's lock: the slots a
 * batch reserves, and the blocks it publishes (ucm/core/store/dram/arena.py: Arena.reserve
 * and Arena.publish, whose loops in Python these replace where the library is built; the
 * caller holds the lock, keeps the mapping alive for the call and moves the sequence word
 * around it).
 *
 * Why compiled: a GPU host's mover books a step of 64 blocks of 512 KiB (32 MiB, which an
 * H200's link moves in 0.6 ms) with a reservation and a publication each, and Python spent
 * 100-200 us on each (numpy's fixed costs from 64 keys, a loop a key below): with the plan
 * and the copies' calls, the host's part of a step was as long as the link's.  Compiled,
 * a key costs a walk of the index and a few words, and no batch size needs a way of its own.
 *
 * Every word of the arena is hostile (another process of the user may have written
 * anything): a slot number is used only below ``slots``, the free stack only within the
 * arena, and an index walk takes at most one step per bucket.  What the books cannot make
 * sense of (a free stack that names a slot that is not free, or would run past the arena)
 * stops the call: the caller raises, leaving the arena marked dirty, and the next holder of
 * the lock rebuilds the books from the columns. */
#include <string.h>

#include "arena.h"

enum { TAKEN = 0, STORED = 1, FULL = 2 };
enum { F_LONG_WALK = 1, F_CORRUPT = 2 };
#define CORRUPT_STACK UINT64_MAX

/* Slot ``s`` free again: its pins, lease and owner cleared, its gen moved (a pin or a write
 * of it must see that), pushed on the free stack (arena.py: Arena._free_slot).  0 where the
 * stack would run past the arena: the slot is FREE but not on it (the books' rebuild puts
 * it there). */
static int free_slot(const ucm_arena *a, uint64_t s) {
    uint64_t top = a->sb[UCM_SB_FREE_TOP];
    a->state[s] = UCM_FREE;
    a->pins[s] = 0, a->lease[s] = 0, a->owner[s] = 0;
    a->gen[s] += 1;
    if (top >= a->slots)
        return 0;
    a->free[top] = (uint32_t)s;
    a->sb[UCM_SB_FREE_TOP] = top + 1;
    return 1;
}

/* Reserve a slot for each key not stored (caller holds the lock; no key twice in the batch:
 * the caller's loop handles that): key i is words ``keys[2i], keys[2i+1]``; ``codes[i]``
 * gets TAKEN (row i of ``rows``: the slot and its gen, the slot now WRITING, ``word``'s),
 * STORED (the index holds the key; row i: the slot it names, to spare when evicting) or,
 * with ``full`` set, FULL (no slot free).  Returns how many keys were settled: ``n``, or
 * fewer where a key needs a slot, none is free and ``full`` is not set (the caller evicts,
 * then calls again for the rest), or CORRUPT_STACK.  ``*walk`` gets the longest walk. */
__attribute__((visibility("default"))) uint64_t ucm_arena_reserve(
    const uint64_t *cols, uint64_t slots, uint64_t buckets, uint64_t salt, uint64_t n,
    const uint64_t *keys, uint64_t word, int full, uint64_t *rows, uint8_t *codes,
    uint64_t *walk) {
    ucm_arena a = ucm_arena_columns(cols, slots, buckets, salt);
    uint64_t k = 0;
    for (; k < n; k++) {
        uint64_t k0 = keys[2 * k], k1 = keys[2 * k + 1], steps;
        uint64_t *row = rows + 2 * k;
        int64_t b = ucm_arena_find(&a, k0, k1, &steps);
        *walk = steps > *walk ? steps : *walk;
        if (b >= 0) {
            codes[k] = STORED, row[0] = a.islot[b], row[1] = 0;
            continue;
        }
        uint64_t top = a.sb[UCM_SB_FREE_TOP];
        if (top > slots)
            return CORRUPT_STACK;
        if (top == 0) {
            if (!full)
                break;
            codes[k] = FULL, row[0] = row[1] = 0;
            continue;
        }
        uint64_t s = a.free[top - 1];
        if (s >= slots || a.state[s] != UCM_FREE)
            return CORRUPT_STACK; /* never index with an unchecked number */
        a.sb[UCM_SB_FREE_TOP] = top - 1;
        a.state[s] = UCM_WRITING;
        a.owner[s] = (uint32_t)word;
        a.lease[s] = 0; /* a writer's slot has no lease: it is its until it dies */
        a.key0[s] = k0, a.key1[s] = k1;
        codes[k] = TAKEN, row[0] = s, row[1] = a.gen[s];
    }
    return k;
}

/* Add a key known to be absent (index.py: Index.insert): the first EMPTY or TOMB bucket of
 * its walk; -1 where there is none (a damaged index: the caller rebuilds it).  The key's
 * words are written before its slot word, under a tombstone: a reader without the lock
 * never matches the new key on the old slot. */
static int64_t insert(const ucm_arena *a, uint64_t k0, uint64_t k1, uint32_t s, uint64_t *walk) {
    uint64_t mask = a->buckets - 1, i = ucm_arena_home(a, k0);
    for (uint64_t step = 0; step < a->buckets; step++, i = (i + 1) & mask) {
        uint32_t was = a->islot[i];
        if (was < UCM_TOMB)
            continue;
        *walk = step;
        __atomic_store_n(&a->islot[i], UCM_TOMB, __ATOMIC_RELEASE);
        a->ik0[i] = k0, a->ik1[i] = k1;
        __atomic_store_n(&a->islot[i], s, __ATOMIC_RELEASE);
        if (was == UCM_TOMB)
            a->sb[UCM_SB_TOMBS] -= 1;
        return (int64_t)i;
    }
    *walk = a->buckets;
    return -1;
}

/* Publish reserved slots (caller holds the lock; arena.py: Arena.publish): block i, slot
 * ``held[2i]`` at gen ``held[2i+1]`` under key ``keys[2i], keys[2i+1]``, of ``lengths[i]``
 * bytes (-1: give the slot back unwritten; every block ``length`` where ``lengths`` is
 * NULL), layout word ``layouts[i]`` (``layout`` where NULL) and seal the ``seal_bytes``
 * (at most 32) at ``seals + seal_bytes * i``, zero-padded (a batch booked with its
 * digests passes 8 bytes a block).  ``out[i]``: whether the key is now stored (0 where the
 * slot is no longer ``word``'s for the key, or was given back; 1, the slot given back,
 * where the key was published meanwhile).  Returns F_* flags: F_LONG_WALK (the index wants
 * a rebuild), F_CORRUPT (the free stack would run past the arena: blocks from i on are
 * untouched). */
__attribute__((visibility("default"))) uint64_t ucm_arena_publish(
    const uint64_t *cols, uint64_t slots, uint64_t buckets, uint64_t salt, uint64_t n,
    const uint64_t *held, const int64_t *lengths, int64_t length, const uint64_t *layouts,
    uint64_t layout, const uint8_t *seals, uint64_t seal_bytes, const uint64_t *keys,
    uint64_t word, uint8_t *out) {
    ucm_arena a = ucm_arena_columns(cols, slots, buckets, salt);
    uint64_t longest = 0, flags = 0;
    if (seal_bytes > UCM_SEAL_BYTES)
        seal_bytes = UCM_SEAL_BYTES;
    memset(out, 0, n);
    for (uint64_t k = 0; k < n; k++) {
        uint64_t s = held[2 * k], k0 = keys[2 * k], k1 = keys[2 * k + 1], steps = 0;
        int64_t len = lengths ? lengths[k] : length;
        int mine = word && s < slots && a.state[s] == UCM_WRITING &&
                   held[2 * k + 1] == a.gen[s] && a.owner[s] == word &&
                   a.key0[s] == k0 && a.key1[s] == k1;
        if (!mine)
            continue;
        int64_t found = len < 0 ? -1 : ucm_arena_find(&a, k0, k1, &steps);
        longest = steps > longest ? steps : longest;
        if (len < 0 || found >= 0) { /* cancelled, failed, or published meanwhile */
            if (!free_slot(&a, s))
                return flags | F_CORRUPT;
            out[k] = len >= 0;
            continue;
        }
        a.length[s] = (uint64_t)len;
        a.layout[s] = layouts ? layouts[k] : layout;
        uint8_t *seal = a.seal + UCM_SEAL_BYTES * s;
        memcpy(seal, seals + seal_bytes * k, seal_bytes);
        memset(seal + seal_bytes, 0, UCM_SEAL_BYTES - seal_bytes);
        a.used[s] = ++a.sb[UCM_SB_TICK];
        a.lease[s] = 0;
        int64_t bucket = insert(&a, k0, k1, (uint32_t)s, &steps);
        longest = steps > longest ? steps : longest;
        if (bucket < 0) { /* no free bucket: a damaged index, rebuilt on the way out */
            flags |= F_LONG_WALK;
            if (!free_slot(&a, s))
                return flags | F_CORRUPT;
            continue;
        }
        a.owner[s] = 0;
        __atomic_store_n(&a.state[s], UCM_READY, __ATOMIC_RELEASE); /* the slot made whole */
        a.sb[UCM_SB_USED] += 1;
        a.sb[UCM_SB_BYTES] += (uint64_t)len;
        out[k] = 1;
    }
    return longest > UCM_LONG_WALK ? flags | F_LONG_WALK : flags;
}
