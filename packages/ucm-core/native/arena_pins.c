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
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define EMPTY 0xFFFFFFFFu
#define TOMB 0xFFFFFFFEu
#define READY 2u
#define MIX 0x9E3779B97F4A7C15ULL
#define SEAL_BYTES 32
#define SB_TICK 5

/* The sections the calls read and write, their addresses in this order in ``cols``. */
enum { C_SB, C_STATE, C_PINS, C_GEN, C_KEY0, C_KEY1, C_LENGTH, C_LAYOUT, C_USED, C_LEASE,
       C_SEAL, C_IK0, C_IK1, C_ISLOT, C_COUNT };

typedef struct {
    uint64_t *sb;
    uint32_t *state, *pins, *gen;
    uint64_t *key0, *key1, *length, *layout, *used;
    int64_t *lease;
    uint8_t *seal;
    uint64_t *ik0, *ik1;
    uint32_t *islot;
} arena;

static arena columns(const uint64_t *cols) {
    arena a;
    a.sb = (uint64_t *)(uintptr_t)cols[C_SB];
    a.state = (uint32_t *)(uintptr_t)cols[C_STATE];
    a.pins = (uint32_t *)(uintptr_t)cols[C_PINS];
    a.gen = (uint32_t *)(uintptr_t)cols[C_GEN];
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
    return a;
}

/* The bucket holding the key, or -1 (index.py: Index.find); ``*walk`` gets the steps. */
static int64_t find(const arena *a, uint64_t buckets, uint64_t salt, uint64_t k0, uint64_t k1,
                    uint64_t *walk) {
    uint64_t mask = buckets - 1, i = ((k0 ^ salt) * MIX) >> (64 - __builtin_ctzll(buckets));
    for (uint64_t step = 0; step < buckets; step++) {
        uint32_t s = a->islot[i];
        if (s == EMPTY || (s != TOMB && a->ik0[i] == k0 && a->ik1[i] == k1)) {
            *walk = step;
            return s == EMPTY ? -1 : (int64_t)i;
        }
        i = (i + 1) & mask;
    }
    *walk = buckets; /* no EMPTY bucket at all: only a damaged index */
    return -1;
}

/* Pin the stored keys' slots for reading (arena.py: Arena.pin): key i is words
 * ``keys[2i], keys[2i+1]``; only a READY slot whose own key columns are the key's is
 * taken (the index entry is a hint): its pins counted up, its lease made to run at least
 * until ``lease_until``, its use ticked.  Row i of ``rows`` gets the slot, its gen, length
 * and layout (the slot ``slots`` where the key is not stored), and ``seals`` its 32-byte
 * seal.  ``buckets`` is a power of two, at least 2.  Returns the longest index walk. */
__attribute__((visibility("default"))) uint64_t ucm_arena_pin(
    const uint64_t *cols, uint64_t slots, uint64_t buckets, uint64_t salt, uint64_t n,
    const uint64_t *keys, int64_t lease_until, uint64_t *rows, uint8_t *seals) {
    arena a = columns(cols);
    uint64_t longest = 0;
    for (uint64_t k = 0; k < n; k++) {
        uint64_t k0 = keys[2 * k], k1 = keys[2 * k + 1], walk;
        int64_t b = find(&a, buckets, salt, k0, k1, &walk);
        longest = walk > longest ? walk : longest;
        uint64_t s = b >= 0 ? a.islot[b] : slots;
        uint64_t *row = rows + 4 * k;
        if (s >= slots || a.state[s] != READY || a.key0[s] != k0 || a.key1[s] != k1) {
            row[0] = slots, row[1] = row[2] = row[3] = 0;
            memset(seals + SEAL_BYTES * k, 0, SEAL_BYTES);
            continue;
        }
        a.pins[s] += 1;
        if (a.lease[s] < lease_until)
            a.lease[s] = lease_until;
        a.used[s] = ++a.sb[SB_TICK];
        row[0] = s, row[1] = a.gen[s], row[2] = a.length[s], row[3] = a.layout[s];
        memcpy(seals + SEAL_BYTES * k, a.seal + SEAL_BYTES * s, SEAL_BYTES);
    }
    return longest;
}

/* Let go of pins (arena.py: Arena.unpin): pin i is slot ``pinned[2i]`` at gen
 * ``pinned[2i+1]``.  ``same[i]`` gets whether the slot is still the one pinned (else its
 * lease ran out and it was reused: nothing to let go of); a slot's lease ends with its
 * last pin. */
__attribute__((visibility("default"))) void ucm_arena_unpin(const uint64_t *cols, uint64_t slots,
                                                           uint64_t n, const uint64_t *pinned,
                                                           uint8_t *same) {
    arena a = columns(cols);
    for (uint64_t k = 0; k < n; k++) {
        uint64_t s = pinned[2 * k];
        same[k] = s < slots && a.gen[s] == pinned[2 * k + 1];
        if (!same[k])
            continue;
        if (a.pins[s])
            a.pins[s] -= 1;
        if (a.pins[s] == 0)
            a.lease[s] = 0;
    }
}
