/* The dram arena's pins, a batch in one call: a load's bookkeeping under the arena's lock.
 *
 * Why compiled: pinning a block and letting it go took 1.8 us a key in Python (an index
 * walk, four column checks and five updates through memoryview casts), as long as the copy
 * of a 64 KiB block, and with two copy threads and a waiter sharing the GIL it held back
 * loads of 256 KiB blocks to 0.77 of memcpy.  See ucm/core/store/dram/arena.py, the only
 * caller, for the arena's rules, and layout.py for its sections; the caller holds the lock
 * and keeps the mapping alive for the call.
 *
 * Every word of the arena is hostile (another process of the user may have written
 * anything): a slot number from the index is used only below ``slots``, and an index walk
 * takes at most one step per bucket. */
#include <string.h>

#include "arena.h"

#define MIX 0x9E3779B97F4A7C15ULL

ucm_arena ucm_arena_columns(const uint64_t *cols, uint64_t slots, uint64_t buckets,
                            uint64_t salt) {
    ucm_arena a;
    a.sb = (uint64_t *)(uintptr_t)cols[C_SB];
    a.state = (uint32_t *)(uintptr_t)cols[C_STATE];
    a.pins = (uint32_t *)(uintptr_t)cols[C_PINS];
    a.gen = (uint32_t *)(uintptr_t)cols[C_GEN];
    a.owner = (uint32_t *)(uintptr_t)cols[C_OWNER];
    a.free = (uint32_t *)(uintptr_t)cols[C_FREE];
    a.key0 = (uint64_t *)(uintptr_t)cols[C_KEY0];
    a.key1 = (uint64_t *)(uintptr_t)cols[C_KEY1];
    a.length = (uint64_t *)(uintptr_t)cols[C_LENGTH];
    a.layout = (uint64_t *)(uintptr_t)cols[C_LAYOUT];
    a.used = (uint64_t *)(uintptr_t)cols[C_USED];
    a.lease = (int64_t *)(uintptr_t)cols[C_LEASE];
    a.seal = (uint8_t *)(uintptr_t)cols[C_SEAL];
    a.ik0 = (uint64_t *)(uintptr_t)cols[C_IK0];
    a.ik1 = (uint64_t *)(uintptr_t)cols[C_IK1];
    a.islot = (uint32_t *)(uintptr_t)cols[C_ISLOT];
    a.slots = slots, a.buckets = buckets, a.salt = salt;
    return a;
}

/* ``buckets`` is a power of two, at least 2. */
uint64_t ucm_arena_home(const ucm_arena *a, uint64_t k0) {
    return ((k0 ^ a->salt) * MIX) >> (64 - __builtin_ctzll(a->buckets));
}

int64_t ucm_arena_find(const ucm_arena *a, uint64_t k0, uint64_t k1, uint64_t *walk) {
    uint64_t mask = a->buckets - 1;
    uint64_t i = ucm_arena_home(a, k0);
    for (uint64_t step = 0; step < a->buckets; step++) {
        uint32_t s = a->islot[i];
        if (s == UCM_EMPTY || (s != UCM_TOMB && a->ik0[i] == k0 && a->ik1[i] == k1)) {
            *walk = step;
            return s == UCM_EMPTY ? -1 : (int64_t)i;
        }
        i = (i + 1) & mask;
    }
    *walk = a->buckets; /* no EMPTY bucket at all: only a damaged index */
    return -1;
}

/* Only a READY slot whose own key columns are the key's is taken (the index entry is a
 * hint): its pins counted up, its lease made to run at least until ``lease_until``, its
 * use ticked (arena.py: Arena.pin). */
uint64_t ucm_arena_pin_keys(const ucm_arena *a, uint64_t n, const uint64_t *keys,
                            int64_t lease_until, uint64_t *rows, uint8_t *seals) {
    uint64_t longest = 0;
    for (uint64_t k = 0; k < n; k++) {
        uint64_t k0 = keys[2 * k], k1 = keys[2 * k + 1], walk;
        int64_t b = ucm_arena_find(a, k0, k1, &walk);
        longest = walk > longest ? walk : longest;
        uint64_t s = b >= 0 ? a->islot[b] : a->slots;
        uint64_t *row = rows + 4 * k;
        if (s >= a->slots || a->state[s] != UCM_READY || a->key0[s] != k0 ||
            a->key1[s] != k1) {
            row[0] = a->slots, row[1] = row[2] = row[3] = 0;
            memset(seals + UCM_SEAL_BYTES * k, 0, UCM_SEAL_BYTES);
            continue;
        }
        a->pins[s] += 1;
        if (a->lease[s] < lease_until)
            a->lease[s] = lease_until;
        a->used[s] = ++a->sb[UCM_SB_TICK];
        row[0] = s, row[1] = a->gen[s], row[2] = a->length[s], row[3] = a->layout[s];
        memcpy(seals + UCM_SEAL_BYTES * k, a->seal + UCM_SEAL_BYTES * s, UCM_SEAL_BYTES);
    }
    return longest;
}

/* A slot's lease ends with its last pin (arena.py: Arena.unpin); a slot whose gen moved
 * was reused after its lease ran out: nothing to let go of. */
void ucm_arena_unpin_pins(const ucm_arena *a, uint64_t n, const uint64_t *pinned,
                          uint8_t *same) {
    for (uint64_t k = 0; k < n; k++) {
        uint64_t s = pinned[2 * k];
        same[k] = s < a->slots && a->gen[s] == pinned[2 * k + 1];
        if (!same[k])
            continue;
        if (a->pins[s])
            a->pins[s] -= 1;
        if (a->pins[s] == 0)
            a->lease[s] = 0;
    }
}

/* Pin the stored keys' slots for reading (caller holds the lock): key i is words
 * ``keys[2i], keys[2i+1]``; row i of ``rows`` gets the slot, its gen, length and layout
 * (the slot ``slots`` where the key is not stored), and ``seals`` its 32-byte seal.
 * Returns the longest index walk. */
__attribute__((visibility("default"))) uint64_t ucm_arena_pin(
    const uint64_t *cols, uint64_t slots, uint64_t buckets, uint64_t salt, uint64_t n,
    const uint64_t *keys, int64_t lease_until, uint64_t *rows, uint8_t *seals) {
    ucm_arena a = ucm_arena_columns(cols, slots, buckets, salt);
    return ucm_arena_pin_keys(&a, n, keys, lease_until, rows, seals);
}

/* Let go of pins (caller holds the lock): pin i is slot ``pinned[2i]`` at gen
 * ``pinned[2i+1]``; ``same[i]`` gets whether the slot is still the one pinned. */
__attribute__((visibility("default"))) void ucm_arena_unpin(const uint64_t *cols, uint64_t slots,
                                                           uint64_t n, const uint64_t *pinned,
                                                           uint8_t *same) {
    ucm_arena a = ucm_arena_columns(cols, slots, 2, 0); /* no walk: buckets and salt unused */
    ucm_arena_unpin_pins(&a, n, pinned, same);
}
