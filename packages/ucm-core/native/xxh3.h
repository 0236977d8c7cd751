/* XXH3-64 (seed 0, the default secret), written for UCM from the algorithm's description:
 * the seal of a dram block is the value the `xxhash` package's xxh3_64 gives for the same
 * bytes, so blocks sealed here, by the store's Python routine or by `ucm store verify`
 * check alike.  Tested bit for bit against that package (tests/test_shm_sealing.py).
 *
 * Streaming: any split of the input into updates gives the one-shot value. */
#ifndef UCM_XXH3_H
#define UCM_XXH3_H

#include <stddef.h>
#include <stdint.h>

#define UCM_XXH3_BUFFER 256 /* input held back until more follows: four stripes */

typedef struct {
    uint64_t acc[8];
    uint64_t total;                  /* bytes given so far */
    uint32_t stripes;                /* stripes accumulated in the current block, 0-15 */
    uint32_t buffered;               /* bytes in buf, 1-256 once anything was given */
    uint8_t buf[UCM_XXH3_BUFFER];    /* input not yet accumulated: all of it up to 256 bytes */
    uint8_t last[64];                /* the last 64 bytes accumulated */
} ucm_xxh3_state;

void ucm_xxh3_reset(ucm_xxh3_state *st);
void ucm_xxh3_update(ucm_xxh3_state *st, const uint8_t *p, size_t n);
uint64_t ucm_xxh3_digest(const ucm_xxh3_state *st);
uint64_t ucm_xxh3_64(const void *p, size_t n);

#endif
