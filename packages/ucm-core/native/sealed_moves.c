/* The dram store's copies, a batch in one call: each block digested (digest.h) and copied.
 *
 * Why compiled: a block of 256 KiB copies in about 25 us, and the Python routine around
 * each copy (one xxh3 call and one numpy copy, each releasing and taking back the GIL)
 * made two copy threads wait on each other's GIL hand-overs for tens of microseconds a
 * block on a small VM.  This call takes the GIL once for a whole chunk of a batch (ctypes
 * releases it around foreign calls), so one thread's bookkeeping in Python overlaps the
 * other's copies.  See ucm/core/store/dram/sealing.py, its only caller, for the contract.
 *
 * The seal is the block's digest (digest.h), the one every other path computes over the
 * same bytes (ucm/core/digest.py, a GPU's copy kernels), so blocks sealed with or without
 * this library check alike.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "digest.h"
#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h> /* SSE2: in every x86-64 */
#define STREAMING_STORES 1
#endif

/* Each word is summed in the pass that copies it (ucm_digest_copy: digest.h), so a seal is
 * that of the very bytes written.  A dump seals what it wrote into the slot, whatever the
 * caller's buffer holds meanwhile; a load's check covers the very bytes the engine gets,
 * whatever shared memory holds meanwhile.
 *
 * A copy into a slot writes around the cache (streaming stores): a slot is read back by a
 * later load, long after, and a plain store first reads every destination line into the
 * cache (measured on a Zen 3 VM, 256 KiB blocks into a 512 MiB pool: 7.4-7.7 GB/s plain,
 * 15.5-17.4 streaming).  A load's copy stays plain: the engine reads its blocks next. */

enum { CHECK = 0, INTO_SLOT = 1, OUT_OF_SLOT = 2 };

/* Move ``count`` blocks.  Block i lies in the slot at ``slots[i]``, ``lengths[i]`` bytes;
 * its payload is the next ``nparts[i]`` parts of ``part_addr``/``part_len`` (the parts'
 * lengths add up to ``lengths[i]``, checked by the caller).
 *   mode CHECK: hash the slot only (``nparts`` are 0);
 *   mode INTO_SLOT: copy the parts into the slot;
 *   mode OUT_OF_SLOT: copy the slot into the parts.
 * ``seals[i]`` gets the digest of the block's bytes (as written, when copied).  Returns the blocks moved. */
__attribute__((visibility("default"))) uint64_t ucm_move_sealed(
    uint64_t count, int mode, const uint64_t *slots, const uint64_t *lengths,
    const uint64_t *nparts, const uint64_t *part_addr, const uint64_t *part_len,
    uint64_t *seals) {
    ucm_digest_state state;
    uint64_t p = 0;
    for (uint64_t i = 0; i < count; i++) {
        uint8_t *slot = (uint8_t *)(uintptr_t)slots[i];
        if (mode == CHECK) {
            ucm_digest_reset(&state);
            ucm_digest_update(&state, slot, (size_t)lengths[i]);
            seals[i] = ucm_digest_final(&state);
            continue;
        }
        ucm_digest_reset(&state);
        uint64_t at = 0;
        for (uint64_t k = 0; k < nparts[i]; k++, p++) {
            uint8_t *part = (uint8_t *)(uintptr_t)part_addr[p];
            size_t n = (size_t)part_len[p];
            if (mode == INTO_SLOT)
                ucm_digest_copy(&state, slot + at, part, n, 1);
            else
                ucm_digest_copy(&state, part, slot + at, n, 0);
            at += n;
        }
        seals[i] = ucm_digest_final(&state);
    }
#ifdef STREAMING_STORES
    if (mode == INTO_SLOT)
        _mm_sfence(); /* the streamed bytes are in memory before the caller publishes them */
#endif
    return count;
}

/* Copy one layer of ``nblocks`` lent blocks into an engine's cache and sum what it wrote.
 * Block b lies at ``slots[b]``; its payload is ``nparts`` parts, part p at offset
 * ``offsets[p]`` of the payload, ``lengths[p]`` bytes (whole words), landing at
 * ``dsts[b * nparts + p]``.  Parts ``first`` to ``end - 1`` of every block are copied (a
 * layer's), and the sum of each one's words where it landed, the first being word
 * ``offsets[p] / 8`` of its payload, is added to ``sums[b]``.  A block's parts' sums add up
 * to its payload's (digest.h), so a load may copy every block a layer at a time and check
 * each once its last layer landed, over the very bytes the engine reads (as OUT_OF_SLOT
 * does).  Returns the parts copied. */
__attribute__((visibility("default"))) uint64_t ucm_copy_layer(
    uint64_t nblocks, uint64_t nparts, const uint64_t *dsts, const uint64_t *slots,
    const uint64_t *offsets, const uint64_t *lengths, uint64_t first, uint64_t end,
    uint64_t *sums) {
    for (uint64_t b = 0; b < nblocks; b++) {
        for (uint64_t p = first; p < end; p++) {
            uint8_t *dst = (uint8_t *)(uintptr_t)dsts[b * nparts + p];
            const uint8_t *src = (const uint8_t *)(uintptr_t)(slots[b] + offsets[p]);
            sums[b] += ucm_digest_copy_sum(dst, src, lengths[p] / 8, offsets[p] / 8, 0);
        }
    }
    return nblocks * (end - first);
}
