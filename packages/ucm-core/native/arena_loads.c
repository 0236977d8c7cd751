/* A chunk of a dram store's load in one call, the GIL let go throughout: pins under the
 * arena's lock, each block copied out of its slot and checked as it lands, the pins let go
 * under the lock again (ucm/core/store/dram/shared.py: SharedMemoryStore._load_chunk, the
 * same steps in Python, which this replaces where the library is built and the store is
 * unsigned).
 *
 * Why: around each block's copy Python spent about 5 us (the pins, the copy's arguments,
 * the checks and the results) holding the one GIL that two copy threads and the waiting
 * thread share, which kept loads of 256 KiB blocks at 0.77-0.79 of memcpy on three threads
 * on a 2-vCPU VM while the copy alone ran at 1.6 of it.
 *
 * The slot's bytes are hostile: a block is copied only from a slot below ``slots``, only
 * if its stored length is the one asked for and fits a slot, and it counts only where its
 * digest, summed over the bytes written, is its stored seal. */
#include <string.h>

#include "arena.h"
#include "arena_lock.h"
#include "digest.h"

enum { LOAD_DONE = 0, LOAD_BUSY = 1, LOAD_ELSEWHERE = 2 };
enum { R_MISS = 0, R_OK = 1, R_MISMATCH = 2, R_CORRUPT = 3 };
enum { F_LONG_WALK = 1, F_UNPINNED_LATER = 2 };

static int seal_is(const uint8_t *stored, uint64_t digest) {
    uint8_t want[UCM_SEAL_BYTES] = {0};
    for (int i = 0; i < 8; i++)
        want[i] = (uint8_t)(digest >> (8 * i));
    return memcmp(stored, want, UCM_SEAL_BYTES) == 0;
}

/* Load ``n`` blocks: key i (words ``keys[2i], keys[2i+1]``), ``nbytes[i]`` bytes of layout
 * ``layout_word``, lands in its ``counts[i]`` parts, the next of ``part_addr``/``part_len``
 * (their lengths add up to ``nbytes[i]``: the caller's own buffers).  ``lock``, ``lock_fd``
 * and ``file_fd`` are the arena's (``file_bytes`` its size), ``cols`` its sections
 * (arena.h), ``data`` its slots, ``slot_bytes`` apart.  Each hold of the lock waits at most
 * ``wait_ns``; pins last ``lease_ns``.
 *
 * Out: row i of ``rows`` and ``seals`` as ucm_arena_pin gives them; ``codes[i]`` one of
 * R_*; ``*flags``: F_LONG_WALK (the index wants a rebuild), F_UNPINNED_LATER (the second
 * hold was not had: the caller lets go of the pinned rows at its next hold).  Returns
 * LOAD_DONE, LOAD_BUSY (the first hold not had: nothing done) or LOAD_ELSEWHERE (the
 * arena is closed, cut short or being mended: nothing done, Python's path answers). */
__attribute__((visibility("default"))) int ucm_arena_load_chunk(
    ucm_lock *lock, int lock_fd, int file_fd, uint64_t file_bytes, const uint64_t *cols,
    uint64_t slots, uint64_t buckets, uint64_t salt, uint64_t data, uint64_t slot_bytes,
    uint64_t n, const uint64_t *keys, const uint64_t *nbytes, uint64_t layout_word,
    const uint64_t *counts, const uint64_t *part_addr, const uint64_t *part_len,
    int64_t lease_ns, int64_t wait_ns, uint64_t *rows, uint8_t *seals, uint8_t *codes,
    uint64_t *flags) {
    ucm_arena a = ucm_arena_columns(cols, slots, buckets, salt);
    *flags = 0;
    int held = ucm_arena_hold(lock, lock_fd, file_fd, file_bytes, a.sb, ucm_now_ns() + wait_ns);
    if (held != HOLD_HELD)
        return held == HOLD_BUSY ? LOAD_BUSY : LOAD_ELSEWHERE;
    a.sb[UCM_SB_DIRTY] = 1;
    uint64_t longest = ucm_arena_pin_keys(&a, n, keys, ucm_now_ns() + lease_ns, rows, seals);
    a.sb[UCM_SB_DIRTY] = 0;
    ucm_arena_let_go(lock, lock_fd);
    if (longest > UCM_LONG_WALK)
        *flags |= F_LONG_WALK;

    uint64_t p = 0;
    for (uint64_t k = 0; k < n; p += counts[k], k++) {
        const uint64_t *row = rows + 4 * k;
        if (row[0] >= slots) {
            codes[k] = R_MISS;
            continue;
        }
        if (row[2] != nbytes[k] || row[3] != layout_word || nbytes[k] > slot_bytes) {
            codes[k] = R_MISMATCH;
            continue;
        }
        const uint8_t *slot = (const uint8_t *)(uintptr_t)(data + row[0] * slot_bytes);
        ucm_digest_state st;
        ucm_digest_reset(&st);
        uint64_t at = 0;
        for (uint64_t q = p; q < p + counts[k]; q++) {
            uint64_t len = part_len[q];
            if (at + len > nbytes[k]) /* never past the block (the caller's sums agree) */
                len = at < nbytes[k] ? nbytes[k] - at : 0;
            ucm_digest_copy(&st, (uint8_t *)(uintptr_t)part_addr[q], slot + at, len, 0);
            at += len;
        }
        codes[k] = at == nbytes[k] && seal_is(seals + UCM_SEAL_BYTES * k, ucm_digest_final(&st))
                       ? R_OK
                       : R_CORRUPT;
    }

    /* every pin goes: the pinned rows, as slot and gen pairs */
    uint64_t pinned[2 * 64];
    uint8_t same[64];
    held = ucm_arena_hold(lock, lock_fd, file_fd, file_bytes, a.sb, ucm_now_ns() + wait_ns);
    if (held != HOLD_HELD) {
        *flags |= F_UNPINNED_LATER;
        return LOAD_DONE;
    }
    a.sb[UCM_SB_DIRTY] = 1;
    for (uint64_t k0 = 0; k0 < n; k0 += 64) { /* a stack's worth at a time */
        uint64_t m = 0, which[64];
        for (uint64_t k = k0; k < n && k < k0 + 64; k++) {
            if (rows[4 * k] < slots) {
                pinned[2 * m] = rows[4 * k], pinned[2 * m + 1] = rows[4 * k + 1];
                which[m++] = k;
            }
        }
        ucm_arena_unpin_pins(&a, m, pinned, same);
        for (uint64_t j = 0; j < m; j++)
            if (!same[j]) /* its lease ran out and the slot was reused: not the block read */
                codes[which[j]] = R_MISS;
    }
    a.sb[UCM_SB_DIRTY] = 0;
    ucm_arena_let_go(lock, lock_fd);
    return LOAD_DONE;
}
