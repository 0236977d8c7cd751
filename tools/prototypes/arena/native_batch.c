/* One compiled call per thread per batch: hash (xxh3-64) and copy every block it is given,
 * with the GIL released once for the whole batch (ctypes releases it around the call).
 * A measurement for the host tier's design, not project code: see README.md.
 *
 * Build (xxhash.h from the xxhash sdist: pip download --no-binary :all: xxhash==3.5.0):
 *   gcc -O3 -mavx2 -shared -fPIC -I xxhash-3.5.0/deps/xxhash -o libnative_batch.so native_batch.c
 */
#define XXH_INLINE_ALL
#include "xxhash.h"
#include <stdint.h>
#include <string.h>

void move_sealed_batch(uint8_t **dst, uint8_t **src, uint64_t nbytes, uint64_t count,
                       uint64_t *seals) {
    for (uint64_t i = 0; i < count; i++) {
        seals[i] = XXH3_64bits(src[i], nbytes); /* hashed where it is read, then copied */
        memcpy(dst[i], src[i], nbytes);
    }
}
