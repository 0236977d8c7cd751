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

/* A block moves in pieces that stay in the core's cache between the hash and the copy.  A
 * dump hashes a piece of the caller's bytes, then copies it: its seal is that of what the
 * caller gave.  A load copies a piece out, then hashes what landed: its check covers the
 * very bytes the engine gets, whatever shared memory holds meanwhile (and the hash reads
 * them from the cache: 0.82-0.97 of memcpy on one thread against 0.73-0.81 hashing first,
 * 256 KiB blocks on a Zen 3 VM; 16 KiB pieces measured best of 4 KiB to 256 KiB). */
#define PIECE ((uint64_t)16 << 10)

enum { CHECK = 0, INTO_SLOT = 1, OUT_OF_SLOT = 2 };

/* A copy into a slot: with streaming stores, which write around the cache.  A slot is read
 * back by a later load, long after, and a plain store first reads every destination line
 * into the cache (measured on a Zen 3 VM, 256 KiB blocks into a 512 MiB pool: 7.4-7.7 GB/s
 * plain, 15.5-17.4 streaming).  A load's copy stays plain: the engine reads its blocks next,
 * and streaming them out of the cache was slower (8.7-9.3 GB/s against 9.1-10.9). */
static void copy_into_slot(uint8_t *dst, const uint8_t *src, size_t n) {
#ifdef STREAMING_STORES
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (n < 1024 || head > n) {
        memcpy(dst, src, n);
        return;
    }
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
#else
    memcpy(dst, src, n);
#endif
}

/* Move ``count`` blocks.  Block i lies in the slot at ``slots[i]``, ``lengths[i]`` bytes;
 * its payload is the next ``nparts[i]`` parts of ``part_addr``/``part_len`` (the parts'
 * lengths add up to ``lengths[i]``, checked by the caller).
 *   mode CHECK: hash the slot only (``nparts`` are 0);
 *   mode INTO_SLOT: copy the parts into the slot, hashing the parts;
 *   mode OUT_OF_SLOT: copy the slot into the parts, hashing the parts once written.
 * ``seals[i]`` gets the digest of the block's bytes.  Returns the blocks moved. */
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
            uint64_t n = part_len[p];
            for (uint64_t off = 0; off < n; off += PIECE) {
                size_t m = (size_t)(n - off < PIECE ? n - off : PIECE);
                if (mode == INTO_SLOT) {
                    ucm_digest_update(&state, part + off, m);
                    copy_into_slot(slot + at + off, part + off, m);
                } else {
                    memcpy(part + off, slot + at + off, m);
                    ucm_digest_update(&state, part + off, m);
                }
            }
            at += n;
        }
        seals[i] = ucm_digest_final(&state);
    }
#ifdef STREAMING_STORES
    _mm_sfence(); /* the streamed bytes are in memory before the caller publishes them */
#endif
    return count;
}

/* Copy one layer of ``nblocks`` lent blocks into an engine's cache and sum what landed.
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
            uint64_t n = lengths[p], sum = 0;
            for (uint64_t off = 0; off < n; off += PIECE) {
                size_t m = (size_t)(n - off < PIECE ? n - off : PIECE);
                memcpy(dst + off, src + off, m);
                sum += ucm_digest_sum(dst + off, m / 8, offsets[p] / 8 + off / 8);
            }
            sums[b] += sum;
        }
    }
    return nblocks * (end - first);
}
