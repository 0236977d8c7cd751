/* XXH3-64, seed 0 and the default secret: see xxh3.h.
 *
 * The input is read in stripes of 64 bytes, each mixed into eight 64-bit accumulators with
 * its own 64 bytes of the secret (stripe j of a block at secret + 8j); after 16 stripes (a
 * block of 1 KiB) the accumulators are scrambled.  The last stripe is always the input's
 * last 64 bytes, mixed with secret + 121, so a stripe is accumulated here only once more
 * input is known to follow it.  Inputs of 240 bytes or less take short paths of their own.
 *
 * The stripe loop has an SSE2 form (in every x86-64), and AVX2 and AVX-512 forms picked at
 * run time; elsewhere a portable one the compiler may vectorise. */
#include "xxh3.h"

#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define UCM_X86 1
#endif

#define P32_1 0x9E3779B1U
#define P32_2 0x85EBCA77U
#define P32_3 0xC2B2AE3DU
#define P64_1 0x9E3779B185EBCA87ULL
#define P64_2 0xC2B2AE3D27D4EB4FULL
#define P64_3 0x165667B19E3779F9ULL
#define P64_4 0x85EBCA77C2B2AE63ULL
#define P64_5 0x27D4EB2F165667C5ULL
#define MX1 0x165667919E3779F9ULL
#define MX2 0x9FB21C651E98DF25ULL

#define STRIPE 64
#define STRIPES_PER_BLOCK 16 /* (secret size - 64) / 8 */
#define SCRAMBLE_AT 128      /* secret size - 64 */
#define LAST_STRIPE_AT 121   /* secret size - 64 - 7 */
#define MERGE_AT 11
/* input read ahead of the stripe being mixed, so that memory keeps up (past the end of the
 * input a prefetch is a hint, never a fault) */
#define PREFETCH_AHEAD 384

/* the default secret, 192 bytes */
static const uint8_t SECRET[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

/* little-endian reads at any alignment (every platform UCM builds for is little-endian) */
static inline uint64_t r64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}
static inline uint32_t r32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}
static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t fold128(uint64_t a, uint64_t b) {
    unsigned __int128 m = (unsigned __int128)a * b;
    return (uint64_t)m ^ (uint64_t)(m >> 64);
}

static inline uint64_t avalanche(uint64_t h) {
    h ^= h >> 37;
    h *= MX1;
    return h ^ (h >> 32);
}

static inline uint64_t xxh64_avalanche(uint64_t h) {
    h ^= h >> 33;
    h *= P64_2;
    h ^= h >> 29;
    h *= P64_3;
    return h ^ (h >> 32);
}

static inline uint64_t mix16(const uint8_t *p, const uint8_t *s) {
    return fold128(r64(p) ^ r64(s), r64(p + 8) ^ r64(s + 8));
}

/* ---- inputs of 0 to 240 bytes ---- */

static uint64_t short_hash(const uint8_t *p, size_t n) {
    const uint8_t *s = SECRET;
    if (n == 0)
        return xxh64_avalanche(r64(s + 56) ^ r64(s + 64));
    if (n <= 3) {
        uint32_t c = ((uint32_t)p[0] << 16) | ((uint32_t)p[n >> 1] << 24) | p[n - 1] |
                     ((uint32_t)n << 8);
        return xxh64_avalanche((uint64_t)c ^ (uint64_t)(r32(s) ^ r32(s + 4)));
    }
    if (n <= 8) {
        uint64_t v = (uint64_t)r32(p + n - 4) + ((uint64_t)r32(p) << 32);
        uint64_t h = v ^ (r64(s + 8) ^ r64(s + 16));
        h ^= rotl(h, 49) ^ rotl(h, 24);
        h *= MX2;
        h ^= (h >> 35) + n;
        h *= MX2;
        return h ^ (h >> 28);
    }
    if (n <= 16) {
        uint64_t lo = r64(p) ^ (r64(s + 24) ^ r64(s + 32));
        uint64_t hi = r64(p + n - 8) ^ (r64(s + 40) ^ r64(s + 48));
        uint64_t acc = n + __builtin_bswap64(lo) + hi + fold128(lo, hi);
        return avalanche(acc);
    }
    uint64_t acc = n * P64_1;
    if (n <= 128) {
        /* pairs of 16 bytes from both ends, widening by 16 per 32 bytes of input */
        for (size_t k = (n - 1) / 32 + 1; k-- > 0;) {
            acc += mix16(p + 16 * k, s + 32 * k);
            acc += mix16(p + n - 16 * (k + 1), s + 32 * k + 16);
        }
        return avalanche(acc);
    }
    for (size_t i = 0; i < 8; i++)
        acc += mix16(p + 16 * i, s + 16 * i);
    uint64_t tail = mix16(p + n - 16, s + 119);
    acc = avalanche(acc);
    for (size_t i = 8; i < n / 16; i++)
        tail += mix16(p + 16 * i, s + 16 * (i - 8) + 3);
    return avalanche(acc + tail);
}

/* ---- stripes: acc[i ^ 1] += data[i]; acc[i] += lo32(data[i] ^ key[i]) * hi32(same) ---- */

typedef void (*stripes_fn)(uint64_t *acc, const uint8_t *p, size_t count, const uint8_t *s);
typedef void (*scramble_fn)(uint64_t *acc, const uint8_t *s);

static void stripes_portable(uint64_t *acc, const uint8_t *p, size_t count, const uint8_t *s) {
    for (size_t j = 0; j < count; j++, p += STRIPE, s += 8) {
        for (int i = 0; i < 8; i++) {
            uint64_t d = r64(p + 8 * i), k = d ^ r64(s + 8 * i);
            acc[i ^ 1] += d;
            acc[i] += (k & 0xFFFFFFFFu) * (k >> 32);
        }
    }
}

static void scramble_portable(uint64_t *acc, const uint8_t *s) {
    for (int i = 0; i < 8; i++) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= r64(s + 8 * i);
        acc[i] = a * P32_1;
    }
}

#ifdef UCM_X86
static void stripes_sse2(uint64_t *acc, const uint8_t *p, size_t count, const uint8_t *s) {
    __m128i a[4];
    for (int i = 0; i < 4; i++)
        a[i] = _mm_loadu_si128((const __m128i *)(acc + 2 * i));
    for (size_t j = 0; j < count; j++, p += STRIPE, s += 8) {
        for (int i = 0; i < 4; i++) {
            __m128i d = _mm_loadu_si128((const __m128i *)(p + 16 * i));
            __m128i k = _mm_xor_si128(d, _mm_loadu_si128((const __m128i *)(s + 16 * i)));
            __m128i product = _mm_mul_epu32(k, _mm_shuffle_epi32(k, _MM_SHUFFLE(0, 3, 0, 1)));
            __m128i swapped = _mm_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2));
            a[i] = _mm_add_epi64(a[i], _mm_add_epi64(product, swapped));
        }
    }
    for (int i = 0; i < 4; i++)
        _mm_storeu_si128((__m128i *)(acc + 2 * i), a[i]);
}

__attribute__((target("avx2"))) static void stripes_avx2(uint64_t *acc, const uint8_t *p,
                                                         size_t count, const uint8_t *s) {
    __m256i a0 = _mm256_loadu_si256((const __m256i *)acc);
    __m256i a1 = _mm256_loadu_si256((const __m256i *)(acc + 4));
    for (size_t j = 0; j < count; j++, p += STRIPE, s += 8) {
        __builtin_prefetch(p + PREFETCH_AHEAD);
        __m256i d0 = _mm256_loadu_si256((const __m256i *)p);
        __m256i d1 = _mm256_loadu_si256((const __m256i *)(p + 32));
        __m256i k0 = _mm256_xor_si256(d0, _mm256_loadu_si256((const __m256i *)s));
        __m256i k1 = _mm256_xor_si256(d1, _mm256_loadu_si256((const __m256i *)(s + 32)));
        __m256i m0 = _mm256_mul_epu32(k0, _mm256_shuffle_epi32(k0, _MM_SHUFFLE(0, 3, 0, 1)));
        __m256i m1 = _mm256_mul_epu32(k1, _mm256_shuffle_epi32(k1, _MM_SHUFFLE(0, 3, 0, 1)));
        a0 = _mm256_add_epi64(a0, _mm256_add_epi64(
                                      m0, _mm256_shuffle_epi32(d0, _MM_SHUFFLE(1, 0, 3, 2))));
        a1 = _mm256_add_epi64(a1, _mm256_add_epi64(
                                      m1, _mm256_shuffle_epi32(d1, _MM_SHUFFLE(1, 0, 3, 2))));
    }
    _mm256_storeu_si256((__m256i *)acc, a0);
    _mm256_storeu_si256((__m256i *)(acc + 4), a1);
}

__attribute__((target("avx2"))) static void scramble_avx2(uint64_t *acc, const uint8_t *s) {
    const __m256i prime = _mm256_set1_epi32((int)P32_1);
    for (int i = 0; i < 2; i++) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(acc + 4 * i));
        a = _mm256_xor_si256(a, _mm256_srli_epi64(a, 47));
        a = _mm256_xor_si256(a, _mm256_loadu_si256((const __m256i *)(s + 32 * i)));
        __m256i lo = _mm256_mul_epu32(a, prime);
        __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), prime);
        _mm256_storeu_si256((__m256i *)(acc + 4 * i), _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32)));
    }
}

/* all eight accumulators in one register; every stripe is one load of 64 bytes */
__attribute__((target("avx512f"))) static void stripes_avx512(uint64_t *acc, const uint8_t *p,
                                                              size_t count, const uint8_t *s) {
    __m512i a = _mm512_loadu_si512((const void *)acc);
    for (size_t j = 0; j < count; j++, p += STRIPE, s += 8) {
        __builtin_prefetch(p + PREFETCH_AHEAD);
        __m512i d = _mm512_loadu_si512((const void *)p);
        __m512i k = _mm512_xor_si512(d, _mm512_loadu_si512((const void *)s));
        __m512i m = _mm512_mul_epu32(k, _mm512_shuffle_epi32(k, (_MM_PERM_ENUM)_MM_SHUFFLE(0, 3, 0, 1)));
        __m512i swapped = _mm512_shuffle_epi32(d, (_MM_PERM_ENUM)_MM_SHUFFLE(1, 0, 3, 2));
        a = _mm512_add_epi64(a, _mm512_add_epi64(m, swapped));
    }
    _mm512_storeu_si512((void *)acc, a);
}

__attribute__((target("avx512f"))) static void scramble_avx512(uint64_t *acc, const uint8_t *s) {
    __m512i a = _mm512_loadu_si512((const void *)acc);
    a = _mm512_xor_si512(a, _mm512_srli_epi64(a, 47));
    a = _mm512_xor_si512(a, _mm512_loadu_si512((const void *)s));
    const __m512i prime = _mm512_set1_epi32((int)P32_1);
    __m512i lo = _mm512_mul_epu32(a, prime);
    __m512i hi = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), prime);
    _mm512_storeu_si512((void *)acc, _mm512_add_epi64(lo, _mm512_slli_epi64(hi, 32)));
}
#endif

static stripes_fn stripes = stripes_portable;
static scramble_fn scramble = scramble_portable;

/* Run the stripe loop ``form`` (0 portable, 1 SSE2, 2 AVX2, 3 AVX-512), or the fastest this
 * processor has below it; returns the form chosen.  The tests check each form. */
__attribute__((visibility("default"))) int ucm_xxh3_choose(int form) {
    scramble = scramble_portable;
#ifdef UCM_X86
    __builtin_cpu_init();
    if (form >= 3 && __builtin_cpu_supports("avx512f")) {
        stripes = stripes_avx512;
        scramble = scramble_avx512;
        return 3;
    }
    if (form >= 2 && __builtin_cpu_supports("avx2")) {
        stripes = stripes_avx2;
        scramble = scramble_avx2;
        return 2;
    }
    if (form >= 1) {
        stripes = stripes_sse2;
        return 1;
    }
#endif
    stripes = stripes_portable;
    return 0;
}

/* the fastest stripe loop, chosen once when the library is loaded */
__attribute__((constructor)) static void choose_fastest(void) { ucm_xxh3_choose(3); }

/* Accumulate ``count`` whole stripes, scrambling at each block's end. */
static void accumulate(uint64_t *acc, uint32_t *at, const uint8_t *p, size_t count) {
    while (count) {
        size_t n = STRIPES_PER_BLOCK - *at;
        if (n > count)
            n = count;
        stripes(acc, p, n, SECRET + 8 * *at);
        p += n * STRIPE, count -= n, *at += (uint32_t)n;
        if (*at == STRIPES_PER_BLOCK) {
            scramble(acc, SECRET + SCRAMBLE_AT);
            *at = 0;
        }
    }
}

void ucm_xxh3_reset(ucm_xxh3_state *st) {
    static const uint64_t start[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    memcpy(st->acc, start, sizeof start);
    st->total = 0;
    st->stripes = 0;
    st->buffered = 0;
}

void ucm_xxh3_update(ucm_xxh3_state *st, const uint8_t *p, size_t n) {
    st->total += n;
    if (st->buffered + n <= UCM_XXH3_BUFFER) {
        memcpy(st->buf + st->buffered, p, n);
        st->buffered += (uint32_t)n;
        return;
    }
    if (st->buffered) { /* fill the buffer: more input follows it, so it is accumulated */
        size_t fill = UCM_XXH3_BUFFER - st->buffered;
        memcpy(st->buf + st->buffered, p, fill);
        p += fill, n -= fill;
        accumulate(st->acc, &st->stripes, st->buf, UCM_XXH3_BUFFER / STRIPE);
        memcpy(st->last, st->buf + UCM_XXH3_BUFFER - STRIPE, STRIPE);
        st->buffered = 0;
    }
    if (n > UCM_XXH3_BUFFER) { /* straight from the input, holding back 1-64 bytes */
        size_t count = (n - 1) / STRIPE;
        accumulate(st->acc, &st->stripes, p, count);
        memcpy(st->last, p + (count - 1) * STRIPE, STRIPE);
        p += count * STRIPE, n -= count * STRIPE;
    }
    memcpy(st->buf, p, n);
    st->buffered = (uint32_t)n;
}

uint64_t ucm_xxh3_digest(const ucm_xxh3_state *st) {
    if (st->total <= 240)
        return short_hash(st->buf, (size_t)st->total);
    uint64_t acc[8];
    uint32_t at = st->stripes;
    memcpy(acc, st->acc, sizeof acc);
    size_t held = st->buffered; /* 1-256: never all of the input is accumulated */
    accumulate(acc, &at, st->buf, (held - 1) / STRIPE);
    uint8_t tail[STRIPE];
    const uint8_t *last = st->buf + held - STRIPE;
    if (held < STRIPE) { /* the last stripe reaches back into accumulated input */
        memcpy(tail, st->last + held, STRIPE - held);
        memcpy(tail + STRIPE - held, st->buf, held);
        last = tail;
    }
    stripes(acc, last, 1, SECRET + LAST_STRIPE_AT);
    uint64_t h = st->total * P64_1;
    for (int i = 0; i < 4; i++)
        h += fold128(acc[2 * i] ^ r64(SECRET + MERGE_AT + 16 * i),
                     acc[2 * i + 1] ^ r64(SECRET + MERGE_AT + 16 * i + 8));
    return avalanche(h);
}

uint64_t ucm_xxh3_64(const void *p, size_t n) {
    if (n <= 240)
        return short_hash((const uint8_t *)p, n);
    ucm_xxh3_state st;
    ucm_xxh3_reset(&st);
    ucm_xxh3_update(&st, (const uint8_t *)p, n);
    return ucm_xxh3_digest(&st);
}
