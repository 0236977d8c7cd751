/* UCM's block digest: the checksum of a block's payload, defined once for every place that
 * computes it (this library, the Python fallback in ucm/core/digest.py, and a GPU's copy
 * kernels in ucm/kernels/digest.py), so a block sealed by any of them checks with the others.
 *
 * The payload is read as little-endian 64-bit words w_j (the last one zero-padded).  Each
 * word adds, modulo 2**64,
 *
 *     v = w_j ^ (j + 1) * P1,    lo32(v) * hi32(v) + rotl64(w_j, 32)
 *
 * to a sum, and the digest is the sum mixed with the payload's length (finish below).  A
 * word's term depends only on its value and its place, so any piece of a payload sums on
 * its own and the pieces' sums add up: a GPU sums thousands of pieces at once, a CPU eight
 * lanes a vector.  Not a MAC: a signed store's blocks carry a keyed one instead. */
#ifndef UCM_DIGEST_H
#define UCM_DIGEST_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint64_t sum;    /* of the terms of the whole words given so far */
    uint64_t words;  /* whole words given so far */
    uint8_t held[8]; /* bytes of the next word, not yet whole */
    uint32_t nheld;  /* 0-7 */
} ucm_digest_state;

void ucm_digest_reset(ucm_digest_state *st);
void ucm_digest_update(ucm_digest_state *st, const uint8_t *p, size_t n);
uint64_t ucm_digest_final(const ucm_digest_state *st);
/* The sum of the terms of ``n`` whole words at ``p``, the first being word ``first`` of its
 * payload: a piece's share of the payload's sum. */
uint64_t ucm_digest_sum(const uint8_t *p, uint64_t n, uint64_t first);
/* Copy ``n`` whole words from ``src`` to ``dst`` and return the sum of their terms, the first
 * being word ``first``: one pass, each word summed as it is stored, so the sum is that of the
 * bytes written, whatever ``src`` holds meanwhile.  ``stream``: write around the cache (a
 * store's slot, read again long after); the caller fences before it publishes them. */
uint64_t ucm_digest_copy_sum(uint8_t *dst, const uint8_t *src, uint64_t n, uint64_t first,
                             int stream);
/* ucm_digest_update of ``n`` bytes copied from ``src`` to ``dst`` as they are summed. */
void ucm_digest_copy(ucm_digest_state *st, uint8_t *dst, const uint8_t *src, size_t n,
                     int stream);

#endif
