/* UCM's block digest: see digest.h.
 *
 * The word loop runs eight independent lanes, which the compiler turns into one vector of
 * eight words (AVX-512), two of four (AVX2) or four of two (SSE2, in every x86-64): an xor,
 * a shift, a 32x32-bit multiply, a rotation and two additions a vector, the speed of memory
 * on one core.  The AVX2 and AVX-512 forms are picked at run time.
 *
 * The stores' copies sum each word in the same pass that copies it (ucm_digest_copy_sum):
 * the words are in registers already, so the sum costs no second read, and it is the sum of
 * exactly what was written.  On one core of a Zen 5 VM (256 KiB blocks out of a 1 GiB
 * arena) copying a 16 KiB piece and then summing it from the cache moved 20 GB/s, the one
 * pass 24-27; into the arena, with streaming stores, 34-35 and 39-43 (memcpy: 30).  An
 * earlier fused AVX-512 loop measured 4-7 % slower than the pieces on an Intel Xeon with
 * AMX (docs/benchmarks.md): `ucm bench store` shows what a host gets. */
#include "digest.h"

#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#define P1 0x9E3779B185EBCA87ULL
#define P2 0xC2B2AE3D27D4EB4FULL
#define MIX 0x165667919E3779F9ULL
#define LANES 8

static inline uint64_t term(uint64_t w, uint64_t key) {
    uint64_t v = w ^ key;
    return (uint64_t)(uint32_t)v * (uint64_t)(uint32_t)(v >> 32) + ((w << 32) | (w >> 32));
}

/* The words a vector loop leaves, one at a time. */
static uint64_t tail_sum(const uint8_t *p, uint64_t n, uint64_t first) {
    uint64_t sum = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t w;
        memcpy(&w, p + 8 * i, 8);
        sum += term(w, (first + 1 + i) * P1);
    }
    return sum;
}

typedef uint64_t (*sum_fn)(const uint8_t *p, uint64_t n, uint64_t first);

/* The sum of the terms of ``n`` words at ``p``, the first being word ``first``. */
static uint64_t sum_baseline(const uint8_t *p, uint64_t n, uint64_t first) {
    uint64_t acc[LANES] = {0}, key[LANES];
    for (int l = 0; l < LANES; l++)
        key[l] = (first + 1 + (uint64_t)l) * P1;
    uint64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        uint64_t w[LANES];
        memcpy(w, p + 8 * i, sizeof w);
        for (int l = 0; l < LANES; l++) {
            acc[l] += term(w[l], key[l]);
            key[l] += LANES * P1;
        }
    }
    uint64_t sum = 0;
    for (int l = 0; l < LANES; l++)
        sum += acc[l];
    return sum + tail_sum(p + 8 * i, n - i, first + i);
}

#if defined(__x86_64__) || defined(_M_X64)
/* Two vectors a round, each with its own accumulator: the multiply's latency overlaps. */
__attribute__((target("avx2"))) static uint64_t sum_avx2(const uint8_t *p, uint64_t n,
                                                          uint64_t first) {
    __m256i key = _mm256_set_epi64x((long long)((first + 4) * P1), (long long)((first + 3) * P1),
                                    (long long)((first + 2) * P1), (long long)((first + 1) * P1));
    const __m256i step = _mm256_set1_epi64x((long long)(4 * P1));
    __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
    uint64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i w0 = _mm256_loadu_si256((const __m256i *)(p + 8 * i));
        __m256i w1 = _mm256_loadu_si256((const __m256i *)(p + 8 * i + 32));
        __m256i v0 = _mm256_xor_si256(w0, key);
        key = _mm256_add_epi64(key, step);
        __m256i v1 = _mm256_xor_si256(w1, key);
        key = _mm256_add_epi64(key, step);
        /* shuffle 0x31: each word's high half in its low; 0xB1: its halves swapped */
        __m256i m0 = _mm256_mul_epu32(v0, _mm256_shuffle_epi32(v0, 0x31));
        __m256i m1 = _mm256_mul_epu32(v1, _mm256_shuffle_epi32(v1, 0x31));
        acc0 = _mm256_add_epi64(acc0, _mm256_add_epi64(m0, _mm256_shuffle_epi32(w0, 0xB1)));
        acc1 = _mm256_add_epi64(acc1, _mm256_add_epi64(m1, _mm256_shuffle_epi32(w1, 0xB1)));
    }
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, _mm256_add_epi64(acc0, acc1));
    return lanes[0] + lanes[1] + lanes[2] + lanes[3] + tail_sum(p + 8 * i, n - i, first + i);
}

__attribute__((target("avx512f"))) static uint64_t sum_avx512(const uint8_t *p, uint64_t n,
                                                              uint64_t first) {
    __m512i key = _mm512_set_epi64(
        (long long)((first + 8) * P1), (long long)((first + 7) * P1), (long long)((first + 6) * P1),
        (long long)((first + 5) * P1), (long long)((first + 4) * P1), (long long)((first + 3) * P1),
        (long long)((first + 2) * P1), (long long)((first + 1) * P1));
    const __m512i step = _mm512_set1_epi64((long long)(8 * P1));
    __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
    uint64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i w0 = _mm512_loadu_si512((const void *)(p + 8 * i));
        __m512i w1 = _mm512_loadu_si512((const void *)(p + 8 * i + 64));
        __m512i v0 = _mm512_xor_si512(w0, key);
        key = _mm512_add_epi64(key, step);
        __m512i v1 = _mm512_xor_si512(w1, key);
        key = _mm512_add_epi64(key, step);
        __m512i m0 = _mm512_mul_epu32(v0, _mm512_shuffle_epi32(v0, (_MM_PERM_ENUM)0x31));
        __m512i m1 = _mm512_mul_epu32(v1, _mm512_shuffle_epi32(v1, (_MM_PERM_ENUM)0x31));
        acc0 = _mm512_add_epi64(acc0, _mm512_add_epi64(m0, _mm512_rol_epi64(w0, 32)));
        acc1 = _mm512_add_epi64(acc1, _mm512_add_epi64(m1, _mm512_rol_epi64(w1, 32)));
    }
    uint64_t lanes[8];
    _mm512_storeu_si512((void *)lanes, _mm512_add_epi64(acc0, acc1));
    uint64_t sum = 0;
    for (int l = 0; l < 8; l++)
        sum += lanes[l];
    return sum + tail_sum(p + 8 * i, n - i, first + i);
}
#endif

/* Copy and sum in one pass (digest.h: ucm_digest_copy_sum), a form per word loop above. */
typedef uint64_t (*copy_fn)(uint8_t *dst, const uint8_t *src, uint64_t n, uint64_t first,
                            int stream);

static uint64_t copy_tail(uint8_t *dst, const uint8_t *src, uint64_t n, uint64_t first) {
    memcpy(dst, src, 8 * n);
    return tail_sum(dst, n, first);
}

static uint64_t copy_baseline(uint8_t *dst, const uint8_t *src, uint64_t n, uint64_t first,
                              int stream) {
    (void)stream; /* plain stores: no portable way around the cache */
    uint64_t acc[LANES] = {0}, key[LANES];
    for (int l = 0; l < LANES; l++)
        key[l] = (first + 1 + (uint64_t)l) * P1;
    uint64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        uint64_t w[LANES];
        memcpy(w, src + 8 * i, sizeof w);
        memcpy(dst + 8 * i, w, sizeof w);
        for (int l = 0; l < LANES; l++) {
            acc[l] += term(w[l], key[l]);
            key[l] += LANES * P1;
        }
    }
    uint64_t sum = 0;
    for (int l = 0; l < LANES; l++)
        sum += acc[l];
    return sum + copy_tail(dst + 8 * i, src + 8 * i, n - i, first + i);
}

#if defined(__x86_64__) || defined(_M_X64)
/* Streaming stores need a destination on the vector's grid (``width`` bytes): copy and
 * sum the words before it one at a time, moving the copy's start past them.  Returns their
 * sum; ``*stream`` cleared where whole words never reach the grid (plain stores then). */
static uint64_t stream_head(uint8_t **dst, const uint8_t **src, uint64_t *n, uint64_t *first,
                            int *stream, uintptr_t width) {
    uintptr_t off = (uintptr_t)*dst & (width - 1);
    if (!*stream || off == 0)
        return 0;
    uint64_t head = (width - off) / 8;
    if (off & 7 || head >= *n) { /* off the word grid, or too short to reach it */
        *stream = 0;
        return 0;
    }
    uint64_t sum = copy_tail(*dst, *src, head, *first);
    *dst += 8 * head, *src += 8 * head, *n -= head, *first += head;
    return sum;
}

__attribute__((target("avx2"))) static uint64_t copy_avx2(uint8_t *dst, const uint8_t *src,
                                                           uint64_t n, uint64_t first,
                                                           int stream) {
    uint64_t sum = stream_head(&dst, &src, &n, &first, &stream, 32);
    __m256i key = _mm256_set_epi64x((long long)((first + 4) * P1), (long long)((first + 3) * P1),
                                    (long long)((first + 2) * P1), (long long)((first + 1) * P1));
    const __m256i step = _mm256_set1_epi64x((long long)(4 * P1));
    __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
    uint64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i w0 = _mm256_loadu_si256((const __m256i *)(src + 8 * i));
        __m256i w1 = _mm256_loadu_si256((const __m256i *)(src + 8 * i + 32));
        if (stream) {
            _mm256_stream_si256((__m256i *)(dst + 8 * i), w0);
            _mm256_stream_si256((__m256i *)(dst + 8 * i + 32), w1);
        } else {
            _mm256_storeu_si256((__m256i *)(dst + 8 * i), w0);
            _mm256_storeu_si256((__m256i *)(dst + 8 * i + 32), w1);
        }
        __m256i v0 = _mm256_xor_si256(w0, key);
        key = _mm256_add_epi64(key, step);
        __m256i v1 = _mm256_xor_si256(w1, key);
        key = _mm256_add_epi64(key, step);
        __m256i m0 = _mm256_mul_epu32(v0, _mm256_shuffle_epi32(v0, 0x31));
        __m256i m1 = _mm256_mul_epu32(v1, _mm256_shuffle_epi32(v1, 0x31));
        acc0 = _mm256_add_epi64(acc0, _mm256_add_epi64(m0, _mm256_shuffle_epi32(w0, 0xB1)));
        acc1 = _mm256_add_epi64(acc1, _mm256_add_epi64(m1, _mm256_shuffle_epi32(w1, 0xB1)));
    }
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, _mm256_add_epi64(acc0, acc1));
    sum += lanes[0] + lanes[1] + lanes[2] + lanes[3];
    return sum + copy_tail(dst + 8 * i, src + 8 * i, n - i, first + i);
}

__attribute__((target("avx512f"))) static uint64_t copy_avx512(uint8_t *dst, const uint8_t *src,
                                                               uint64_t n, uint64_t first,
                                                               int stream) {
    uint64_t sum = stream_head(&dst, &src, &n, &first, &stream, 64);
    __m512i key = _mm512_set_epi64(
        (long long)((first + 8) * P1), (long long)((first + 7) * P1), (long long)((first + 6) * P1),
        (long long)((first + 5) * P1), (long long)((first + 4) * P1), (long long)((first + 3) * P1),
        (long long)((first + 2) * P1), (long long)((first + 1) * P1));
    const __m512i step = _mm512_set1_epi64((long long)(8 * P1));
    __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
    uint64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i w0 = _mm512_loadu_si512((const void *)(src + 8 * i));
        __m512i w1 = _mm512_loadu_si512((const void *)(src + 8 * i + 64));
        if (stream) {
            _mm512_stream_si512((void *)(dst + 8 * i), w0);
            _mm512_stream_si512((void *)(dst + 8 * i + 64), w1);
        } else {
            _mm512_storeu_si512((void *)(dst + 8 * i), w0);
            _mm512_storeu_si512((void *)(dst + 8 * i + 64), w1);
        }
        __m512i v0 = _mm512_xor_si512(w0, key);
        key = _mm512_add_epi64(key, step);
        __m512i v1 = _mm512_xor_si512(w1, key);
        key = _mm512_add_epi64(key, step);
        __m512i m0 = _mm512_mul_epu32(v0, _mm512_shuffle_epi32(v0, (_MM_PERM_ENUM)0x31));
        __m512i m1 = _mm512_mul_epu32(v1, _mm512_shuffle_epi32(v1, (_MM_PERM_ENUM)0x31));
        acc0 = _mm512_add_epi64(acc0, _mm512_add_epi64(m0, _mm512_rol_epi64(w0, 32)));
        acc1 = _mm512_add_epi64(acc1, _mm512_add_epi64(m1, _mm512_rol_epi64(w1, 32)));
    }
    uint64_t lanes[8];
    _mm512_storeu_si512((void *)lanes, _mm512_add_epi64(acc0, acc1));
    for (int l = 0; l < 8; l++)
        sum += lanes[l];
    return sum + copy_tail(dst + 8 * i, src + 8 * i, n - i, first + i);
}
#endif

static sum_fn words_sum = sum_baseline;
static copy_fn words_copy = copy_baseline;

/* Use the word loop ``form`` (0 the baseline's, 2 AVX2, 3 AVX-512), or the fastest this
 * processor has below it; returns the form chosen.  The tests check each form. */
__attribute__((visibility("default"))) int ucm_digest_choose(int form) {
#if defined(__x86_64__) || defined(_M_X64)
    __builtin_cpu_init();
    if (form >= 3 && __builtin_cpu_supports("avx512f")) {
        words_sum = sum_avx512;
        words_copy = copy_avx512;
        return 3;
    }
    if (form >= 2 && __builtin_cpu_supports("avx2")) {
        words_sum = sum_avx2;
        words_copy = copy_avx2;
        return 2;
    }
#endif
    words_sum = sum_baseline;
    words_copy = copy_baseline;
    return 0;
}

/* the fastest word loop, chosen once when the library is loaded */
__attribute__((constructor)) static void choose_fastest(void) { ucm_digest_choose(3); }

/* The sum of the terms of ``n`` words at ``p`` (any alignment), the first being word
 * ``first`` of its payload: the piece of a digest the Python side asks for. */
__attribute__((visibility("default"))) uint64_t ucm_digest_sum(const uint8_t *p, uint64_t n,
                                                               uint64_t first) {
    return words_sum(p, n, first);
}

uint64_t ucm_digest_copy_sum(uint8_t *dst, const uint8_t *src, uint64_t n, uint64_t first,
                             int stream) {
    return words_copy(dst, src, n, first, stream);
}

/* The digest of a payload of ``nbytes`` whose terms sum to ``sum``. */
__attribute__((visibility("default"))) uint64_t ucm_digest_finish(uint64_t sum,
                                                                  uint64_t nbytes) {
    uint64_t h = sum ^ nbytes * P2;
    h ^= h >> 37;
    h *= MIX;
    return h ^ (h >> 32);
}

void ucm_digest_reset(ucm_digest_state *st) { memset(st, 0, sizeof *st); }

void ucm_digest_update(ucm_digest_state *st, const uint8_t *p, size_t n) {
    if (st->nheld) { /* complete the word begun by the last update */
        size_t fill = 8 - st->nheld < n ? 8 - st->nheld : n;
        memcpy(st->held + st->nheld, p, fill);
        st->nheld += (uint32_t)fill, p += fill, n -= fill;
        if (st->nheld < 8)
            return;
        st->sum += words_sum(st->held, 1, st->words++);
        st->nheld = 0;
    }
    size_t whole = n / 8;
    st->sum += words_sum(p, whole, st->words);
    st->words += whole;
    memcpy(st->held, p + 8 * whole, n - 8 * whole);
    st->nheld = (uint32_t)(n - 8 * whole);
}

void ucm_digest_copy(ucm_digest_state *st, uint8_t *dst, const uint8_t *src, size_t n,
                     int stream) {
    if (st->nheld) { /* the word begun by the last update: its bytes as copied */
        size_t fill = 8 - st->nheld < n ? 8 - st->nheld : n;
        memcpy(dst, src, fill);
        memcpy(st->held + st->nheld, dst, fill);
        st->nheld += (uint32_t)fill, src += fill, dst += fill, n -= fill;
        if (st->nheld < 8)
            return;
        st->sum += words_sum(st->held, 1, st->words++);
        st->nheld = 0;
    }
    size_t whole = n / 8;
    st->sum += words_copy(dst, src, whole, st->words, stream);
    st->words += whole;
    memcpy(dst + 8 * whole, src + 8 * whole, n - 8 * whole);
    memcpy(st->held, dst + 8 * whole, n - 8 * whole);
    st->nheld = (uint32_t)(n - 8 * whole);
}

uint64_t ucm_digest_final(const ucm_digest_state *st) {
    uint64_t sum = st->sum;
    if (st->nheld) { /* the last word, zero-padded */
        uint8_t last[8] = {0};
        memcpy(last, st->held, st->nheld);
        sum += words_sum(last, 1, st->words);
    }
    return ucm_digest_finish(sum, 8 * st->words + st->nheld);
}

/* The digest of ``n`` bytes at ``p``. */
__attribute__((visibility("default"))) uint64_t ucm_digest(const void *p, size_t n) {
    ucm_digest_state st;
    ucm_digest_reset(&st);
    ucm_digest_update(&st, (const uint8_t *)p, n);
    return ucm_digest_final(&st);
}
