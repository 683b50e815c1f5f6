/* streamsync._kernel: the one-pass comparison behind streamsync.wire.patch and the copies of
 * streamsync._copies. Built when the package is installed (setup.py), imported like any
 * module; the module holds each function's address, which streamsync._copies calls through
 * ctypes (a foreign call releases the GIL, so pieces of one tensor run on several threads).
 * Where it was not built, torch and ctypes.memmove do the same work. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#include <xmmintrin.h>
#endif
#if defined(__SSE2__) && defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
/* The fp32 -> bf16 cast and the comparison with the cast fused have AVX-512 loops, compiled for
 * that target alone and taken where the CPU (and the OS, which libgcc's check asks too) supports it. */
#define SS_AVX512 1
#endif

#define KERNELS(SUFFIX, T)                                                                   \
    static inline T load_##SUFFIX(const unsigned char *p) {                                 \
        T v;                                                                                 \
        memcpy(&v, p, sizeof(T));                                                            \
        return v;                                                                            \
    }                                                                                        \
    /* Elements [lo, hi) of two arrays: the positions and new values of those that differ;  \
     * -1 once more than `limit` differ. Compares 32 bytes at a time, then the elements of  \
     * a block that differs. `pos` and `vals` have room for `limit` + 32 elements. */       \
    int64_t ss_diff_##SUFFIX(const unsigned char *a, const unsigned char *b, int64_t lo,    \
                             int64_t hi, int32_t *pos32, int64_t *pos64,                    \
                             unsigned char *vals, int64_t limit) {                           \
        const int64_t per = 32 / (int64_t)sizeof(T);                                        \
        int64_t k = 0, i = lo;                                                               \
        for (; i + per <= hi; i += per) {                                                    \
            const unsigned char *pa = a + i * sizeof(T), *pb = b + i * sizeof(T);            \
            uint64_t x0, x1, x2, x3, y0, y1, y2, y3;                                         \
            memcpy(&x0, pa, 8); memcpy(&x1, pa + 8, 8);                                     \
            memcpy(&x2, pa + 16, 8); memcpy(&x3, pa + 24, 8);                               \
            memcpy(&y0, pb, 8); memcpy(&y1, pb + 8, 8);                                     \
            memcpy(&y2, pb + 16, 8); memcpy(&y3, pb + 24, 8);                               \
            if (((x0 ^ y0) | (x1 ^ y1) | (x2 ^ y2) | (x3 ^ y3)) == 0) continue;             \
            /* Branchless: every element is written, only a changed one is kept. */     \
            for (int64_t j = i; j < i + per; j++) {                                          \
                T va = load_##SUFFIX(a + j * sizeof(T)), vb = load_##SUFFIX(b + j * sizeof(T)); \
                if (pos32) pos32[k] = (int32_t)j; else pos64[k] = j;                         \
                memcpy(vals + k * sizeof(T), &va, sizeof(T));                                \
                k += va != vb;                                                               \
            }                                                                                \
            if (k > limit) return -1;                                                        \
        }                                                                                    \
        for (; i < hi; i++) {                                                                \
            T va = load_##SUFFIX(a + i * sizeof(T)), vb = load_##SUFFIX(b + i * sizeof(T));  \
            if (va != vb) {                                                                  \
                if (k == limit) return -1;                                                   \
                if (pos32) pos32[k] = (int32_t)i; else pos64[k] = i;                         \
                memcpy(vals + k * sizeof(T), &va, sizeof(T));                                \
                k++;                                                                         \
            }                                                                                \
        }                                                                                    \
        return k;                                                                            \
    }                                                                                        \
    void ss_apply_##SUFFIX(unsigned char *dst, const int32_t *pos32, const int64_t *pos64,  \
                           const unsigned char *vals, int64_t k) {                           \
        for (int64_t j = 0; j < k; j++) {                                                    \
            int64_t p = pos32 ? (int64_t)pos32[j] : pos64[j];                                \
            memcpy(dst + p * sizeof(T), vals + j * sizeof(T), sizeof(T));                    \
        }                                                                                    \
    }

KERNELS(1, uint8_t)
KERNELS(2, uint16_t)
KERNELS(4, uint32_t)
KERNELS(8, uint64_t)

/* fp32 -> bf16, rounding to nearest even (what torch's conversion does for numbers). */
static inline uint16_t bf16_of(uint32_t x) { return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16); }

/* The index of the first position not strictly above the one before it (`after` before
 * the first) or not below `numel`; -1 when all are fine. */
int64_t ss_check(const int32_t *pos32, const int64_t *pos64, int64_t k, int64_t numel,
                 int64_t after) {
    int64_t prev = after;
    for (int64_t j = 0; j < k; j++) {
        int64_t p = pos32 ? (int64_t)pos32[j] : pos64[j];
        if (p <= prev || p >= numel) return j;
        prev = p;
    }
    return -1;
}

/* Copies from this size up bypass the cache: a sync's destination (a slot another process
 * reads, a model's weights) is not read again by this thread, and glibc's memmove only
 * streams from a threshold it derives from the cache size it is told (48 MiB on a VM that
 * reports a host's cache), below which it runs at about half the speed. */
#define STREAM_FROM 4096

/* A copy whose destination sits up to this many bytes past its source, modulo 4 KiB, runs
 * downwards: going up, each block's loads would share their low 12 address bits with the
 * stores just issued, which the CPU takes for a dependency and waits on ("4K aliasing").
 * That is the receiver's usual case: a slot's page-aligned entry copied into a tensor that
 * torch's allocator placed 64 bytes into a page. glibc's memmove makes the same choice. */
#define ALIAS_WINDOW 256

/* The copies and casts ask for their source this many bytes ahead, into the outer caches
 * (prefetcht2). The non-temporal hint (prefetchnta) halved every copy and cast on a KVM
 * guest of a Xeon with AMX (6.4 against 14.5 GB/s for a 64 MiB copy, one thread), and a
 * page ahead beat 1 KiB for copies that outgrow the cache (13.2 against 11.7 GB/s). */
#define PREFETCH_AHEAD 4096

#if defined(__SSE2__)
/* 64 bytes from `src` to the 16-byte aligned `dst`, stored past the cache. */
static inline void stream64(unsigned char *dst, const unsigned char *src) {
    __m128i a = _mm_loadu_si128((const __m128i *)src);
    __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
    __m128i e = _mm_loadu_si128((const __m128i *)(src + 48));
    _mm_stream_si128((__m128i *)dst, a);
    _mm_stream_si128((__m128i *)(dst + 16), b);
    _mm_stream_si128((__m128i *)(dst + 32), c);
    _mm_stream_si128((__m128i *)(dst + 48), e);
}
#endif

/* memmove(dst, src, n), with non-temporal stores where the two do not overlap and n is at
 * least STREAM_FROM. The caller ends with fence(), once for all its copies. */
static void copy_bytes(unsigned char *dst, const unsigned char *src, size_t n) {
#if defined(__SSE2__)
    uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;
    if (n >= STREAM_FROM && (d + n <= s || s + n <= d)) {
        size_t ahead = (size_t)((d - s) & 4095u);
        if (ahead && ahead < ALIAS_WINDOW) {
            size_t tail = (size_t)((d + n) & 15u);
            n -= tail;
            memcpy(dst + n, src + n, tail);
            for (size_t blocks = n / 64; blocks; blocks--) {
                n -= 64;
                _mm_prefetch((const char *)src + n - PREFETCH_AHEAD, _MM_HINT_T2);
                stream64(dst + n, src + n);
            }
            memcpy(dst, src, n);
            return;
        }
        size_t head = (size_t)(-d & 15u);
        memcpy(dst, src, head);
        dst += head;
        src += head;
        n -= head;
        for (size_t blocks = n / 64; blocks; blocks--) {
            _mm_prefetch((const char *)src + PREFETCH_AHEAD, _MM_HINT_T2);
            stream64(dst, src);
            src += 64;
            dst += 64;
        }
        n %= 64;
    }
#endif
    memmove(dst, src, n);
}

/* Orders the non-temporal stores before whatever tells the reader the bytes are there. */
static inline void fence(void) {
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

/* One copy (streamsync._copies, a large move or a piece of one). */
void ss_copy(void *dst, const void *src, int64_t n) {
    copy_bytes((unsigned char *)dst, (const unsigned char *)src, (size_t)n);
    fence();
}

/* Element i of the casts below, one at a time (before the aligned blocks, and after):
 * fp32 -> bf16 returns 1, writing nothing, when the element is a NaN. */
static inline int cast_f32_bf16_at(unsigned char *dst, const unsigned char *src, int64_t i) {
    uint32_t x;
    memcpy(&x, src + 4 * i, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return 1;
    uint16_t c = bf16_of(x);
    memcpy(dst + 2 * i, &c, 2);
    return 0;
}

static inline void cast_bf16_f32_at(unsigned char *dst, const unsigned char *src, int64_t i) {
    uint16_t h;
    memcpy(&h, src + 2 * i, 2);
    uint32_t x = (uint32_t)h << 16;
    memcpy(dst + 4 * i, &x, 4);
}

#if defined(SS_AVX512)
/* Blocks of 32 elements from `i`, where `dst + 2 * i` is 64-byte aligned, while a whole block
 * remains: one 64-byte store per block, a quarter of the SSE2 loop's instructions. Returns
 * the index it stopped at, negative (-1 - index) at a block holding a NaN. */
__attribute__((target("avx512f,avx512bw"))) static int64_t cast_f32_bf16_avx512(
    unsigned char *dst, const unsigned char *src, int64_t i, int64_t n) {
    const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff);
    /* packs interleaves its two sources per 128-bit lane; this puts the lanes in order. */
    const __m512i lanes = _mm512_set_epi64(7, 5, 3, 1, 6, 4, 2, 0);
    for (; i + 32 <= n; i += 32) {
        const unsigned char *p = src + 4 * i;
        _mm_prefetch((const char *)p + PREFETCH_AHEAD, _MM_HINT_T2);
        _mm_prefetch((const char *)p + PREFETCH_AHEAD + 64, _MM_HINT_T2);
        __m512 f0 = _mm512_loadu_ps((const float *)p);
        __m512 f1 = _mm512_loadu_ps((const float *)(p + 64));
        if (_mm512_cmp_ps_mask(f0, f0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(f1, f1, _CMP_UNORD_Q)) {
            _mm_sfence();
            return -1 - i;
        }
        __m512i x0 = _mm512_castps_si512(f0), x1 = _mm512_castps_si512(f1);
#define SS_ROUND512(x)                                                                       \
    _mm512_srai_epi32(                                                                       \
        _mm512_add_epi32(_mm512_add_epi32(x, bias), _mm512_and_si512(_mm512_srli_epi32(x, 16), one)), 16)
        __m512i packed = _mm512_packs_epi32(SS_ROUND512(x0), SS_ROUND512(x1));
#undef SS_ROUND512
        _mm512_stream_si512((void *)(dst + 2 * i), _mm512_permutexvar_epi64(lanes, packed));
    }
    _mm_sfence();
    return i;
}

static int use_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}
#endif

/* The fused comparison below, one element at a time from `i` (after its blocks). */
static int64_t diff_f32_bf16_tail(const unsigned char *a, const unsigned char *b, int64_t i,
                                  int64_t hi, int32_t *pos32, int64_t *pos64,
                                  unsigned char *vals, int64_t limit, int64_t k) {
    for (; i < hi; i++) {
        uint32_t x;
        uint16_t old;
        memcpy(&x, a + i * 4, 4);
        memcpy(&old, b + i * 2, 2);
        if ((x & 0x7fffffffu) > 0x7f800000u) return -2;
        uint16_t c = bf16_of(x);
        if (c != old) {
            if (k == limit) return -1;
            if (pos32) pos32[k] = (int32_t)i; else pos64[k] = i;
            memcpy(vals + k * 2, &c, 2);
            k++;
        }
    }
    return k;
}

/* Keeps the elements of the block of 16 at `i` (cast to `c`) that differ from the baseline:
 * branchless, every element is written, only a changed one is kept. */
static inline int64_t keep_block(const uint16_t *c, const unsigned char *b, int64_t i,
                                 int32_t *pos32, int64_t *pos64, unsigned char *vals,
                                 int64_t k) {
    for (int j = 0; j < 16; j++) {
        uint16_t old;
        memcpy(&old, b + (i + j) * 2, 2);
        if (pos32) pos32[k] = (int32_t)(i + j); else pos64[k] = i + j;
        memcpy(vals + k * 2, &c[j], 2);
        k += c[j] != old;
    }
    return k;
}

/* Blocks of 16 from `i` while a whole one remains, then the tail (SSE2 where compiled for
 * it): each block is checked for a NaN, then compared, then its changes kept. */
static int64_t diff_f32_bf16_from(const unsigned char *a, const unsigned char *b, int64_t i,
                                  int64_t hi, int32_t *pos32, int64_t *pos64,
                                  unsigned char *vals, int64_t limit, int64_t k) {
#if defined(__SSE2__)
    const __m128i one = _mm_set1_epi32(1), bias = _mm_set1_epi32(0x7fff);
    const __m128i magnitude = _mm_set1_epi32(0x7fffffff), inf = _mm_set1_epi32(0x7f800000);
    for (; i + 16 <= hi; i += 16) {
        const unsigned char *pa = a + 4 * i, *pb = b + 2 * i;
        _mm_prefetch((const char *)pa + PREFETCH_AHEAD, _MM_HINT_T2);
        _mm_prefetch((const char *)pb + PREFETCH_AHEAD / 2, _MM_HINT_T2);
        __m128i x0 = _mm_loadu_si128((const __m128i *)pa);
        __m128i x1 = _mm_loadu_si128((const __m128i *)(pa + 16));
        __m128i x2 = _mm_loadu_si128((const __m128i *)(pa + 32));
        __m128i x3 = _mm_loadu_si128((const __m128i *)(pa + 48));
        /* A NaN's magnitude is above infinity's (both positive as signed integers). */
#define SS_NAN(x) _mm_cmpgt_epi32(_mm_and_si128(x, magnitude), inf)
        __m128i nan = _mm_or_si128(_mm_or_si128(SS_NAN(x0), SS_NAN(x1)),
                                   _mm_or_si128(SS_NAN(x2), SS_NAN(x3)));
#undef SS_NAN
        if (_mm_movemask_epi8(nan)) return -2;
        /* As the cast's SSE2 loop: rounded, sign-extended, packed without losing a bit. */
#define SS_ROUND(x) \
    _mm_srai_epi32(_mm_add_epi32(_mm_add_epi32(x, bias), _mm_and_si128(_mm_srli_epi32(x, 16), one)), 16)
        __m128i lo = _mm_packs_epi32(SS_ROUND(x0), SS_ROUND(x1));
        __m128i hi8 = _mm_packs_epi32(SS_ROUND(x2), SS_ROUND(x3));
#undef SS_ROUND
        __m128i same = _mm_and_si128(_mm_cmpeq_epi16(lo, _mm_loadu_si128((const __m128i *)pb)),
                                     _mm_cmpeq_epi16(hi8, _mm_loadu_si128((const __m128i *)(pb + 16))));
        if (_mm_movemask_epi8(same) == 0xffff) continue;
        uint16_t c[16];
        _mm_storeu_si128((__m128i *)c, lo);
        _mm_storeu_si128((__m128i *)(c + 8), hi8);
        k = keep_block(c, b, i, pos32, pos64, vals, k);
        if (k > limit) return -1;
    }
#else
    for (; i + 16 <= hi; i += 16) {
        uint32_t x[16], nan = 0, diff = 0;
        uint16_t c[16], old[16];
        memcpy(x, a + i * 4, 64);
        memcpy(old, b + i * 2, 32);
        for (int j = 0; j < 16; j++) {
            nan |= (x[j] & 0x7fffffffu) > 0x7f800000u;
            c[j] = bf16_of(x[j]);
            diff |= (uint32_t)(c[j] ^ old[j]);
        }
        if (nan) return -2;
        if (!diff) continue;
        k = keep_block(c, b, i, pos32, pos64, vals, k);
        if (k > limit) return -1;
    }
#endif
    return diff_f32_bf16_tail(a, b, i, hi, pos32, pos64, vals, limit, k);
}
#if defined(SS_AVX512)
#define SS_TARGET_AVX512 __attribute__((target("avx512f,avx512bw")))

/* The bf16 bits of 16 fp32 elements that hold no NaN (so the sum stays below 2^32 and a
 * logical shift gives them), each in the low half of its 32-bit lane. */
SS_TARGET_AVX512 static inline __m512i bf16_of_avx512(__m512i x) {
    const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff);
    return _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(x, bias), _mm512_and_si512(_mm512_srli_epi32(x, 16), one)), 16);
}

SS_TARGET_AVX512 static inline __mmask16 nan_avx512(__m512i x) {
    return _mm512_cmpgt_epu32_mask(_mm512_and_si512(x, _mm512_set1_epi32(0x7fffffff)),
                                   _mm512_set1_epi32(0x7f800000));
}

/* Keeps the `changed` elements of the block of 16 at `i` (cast to `c`): their positions and
 * values compressed into place, 16 of each stored (the room the caller leaves). */
SS_TARGET_AVX512 static inline int64_t keep_avx512(__m512i c, __mmask16 changed, int64_t i,
                                                   int32_t *pos32, int64_t *pos64,
                                                   unsigned char *vals, int64_t k) {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    _mm256_storeu_si256((__m256i *)(vals + 2 * k),
                        _mm512_cvtepi32_epi16(_mm512_maskz_compress_epi32(changed, c)));
    __m512i at = _mm512_maskz_compress_epi32(changed, lane);
    if (pos32) {
        _mm512_storeu_si512((void *)(pos32 + k), _mm512_add_epi32(at, _mm512_set1_epi32((int32_t)i)));
    } else {
        __m512i from = _mm512_set1_epi64(i);
        _mm512_storeu_si512((void *)(pos64 + k),
                            _mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(at)), from));
        _mm512_storeu_si512((void *)(pos64 + k + 8),
                            _mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(at, 1)), from));
    }
    return k + __builtin_popcount((unsigned)changed);
}

/* The fused comparison's blocks of 16 from `*at` while a whole one remains, four at a time
 * while four remain: four blocks with no NaN and no change cost one test, and the blocks of a
 * group with either are taken in order, each checked for a NaN before its changes are kept,
 * so the result is the portable loop's. Leaves `*at` where it stopped; returns the count so
 * far, or -1 / -2 as ss_diff_f32_bf16. */
SS_TARGET_AVX512 static int64_t diff_f32_bf16_avx512(const unsigned char *a, const unsigned char *b,
                                                     int64_t *at, int64_t hi, int32_t *pos32,
                                                     int64_t *pos64, unsigned char *vals,
                                                     int64_t limit, int64_t k) {
    int64_t i = *at;
    for (; i + 64 <= hi; i += 64) {
        const unsigned char *pa = a + 4 * i, *pb = b + 2 * i;
        for (int line = 0; line < 256; line += 64)
            _mm_prefetch((const char *)pa + PREFETCH_AHEAD + line, _MM_HINT_T2);
        _mm_prefetch((const char *)pb + PREFETCH_AHEAD / 2, _MM_HINT_T2);
        _mm_prefetch((const char *)pb + PREFETCH_AHEAD / 2 + 64, _MM_HINT_T2);
        __m512i c[4];
        __mmask16 nan[4], changed[4];
        for (int q = 0; q < 4; q++) {
            __m512i x = _mm512_loadu_si512((const void *)(pa + 64 * q));
            c[q] = bf16_of_avx512(x);
            nan[q] = nan_avx512(x);
            changed[q] = _mm512_cmpneq_epi32_mask(
                c[q], _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(pb + 32 * q))));
        }
        if (!(nan[0] | nan[1] | nan[2] | nan[3] | changed[0] | changed[1] | changed[2] | changed[3]))
            continue;
        for (int q = 0; q < 4; q++) {
            if (nan[q]) return -2;
            if (!changed[q]) continue;
            k = keep_avx512(c[q], changed[q], i + 16 * q, pos32, pos64, vals, k);
            if (k > limit) return -1;
        }
    }
    for (; i + 16 <= hi; i += 16) {
        __m512i x = _mm512_loadu_si512((const void *)(a + 4 * i));
        if (nan_avx512(x)) return -2;
        __m512i c = bf16_of_avx512(x);
        __mmask16 changed = _mm512_cmpneq_epi32_mask(
            c, _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b + 2 * i))));
        if (!changed) continue;
        k = keep_avx512(c, changed, i, pos32, pos64, vals, k);
        if (k > limit) return -1;
    }
    *at = i;
    return k;
}
#endif

/* The cast fused into the comparison: elements [lo, hi) of fp32 `a` as bf16 against bf16
 * `b`; as ss_diff_2 otherwise, in blocks of 16 elements. -2 at the first block holding a NaN
 * (torch's own conversion gives NaNs different bits on different paths, so such a tensor is
 * cast by torch). */
int64_t ss_diff_f32_bf16(const unsigned char *a, const unsigned char *b, int64_t lo, int64_t hi,
                         int32_t *pos32, int64_t *pos64, unsigned char *vals, int64_t limit) {
    int64_t k = 0;
#if defined(SS_AVX512)
    if (use_avx512()) {
        k = diff_f32_bf16_avx512(a, b, &lo, hi, pos32, pos64, vals, limit, k);
        if (k < 0) return k;
    }
#endif
    return diff_f32_bf16_from(a, b, lo, hi, pos32, pos64, vals, limit, k);
}

/* The same comparison without the AVX-512 loop, so that tests reach the loop every CPU runs. */
int64_t ss_diff_f32_bf16_portable(const unsigned char *a, const unsigned char *b, int64_t lo,
                                  int64_t hi, int32_t *pos32, int64_t *pos64,
                                  unsigned char *vals, int64_t limit) {
    return diff_f32_bf16_from(a, b, lo, hi, pos32, pos64, vals, limit, 0);
}

/* Elements [i, n) of the cast: SSE2 blocks of 16, one at a time around them. */
static int64_t cast_f32_bf16_from(unsigned char *dst, const unsigned char *src, int64_t i,
                                  int64_t n) {
#if defined(__SSE2__)
    for (; i < n && ((uintptr_t)(dst + 2 * i) & 15u); i++) {
        if (cast_f32_bf16_at(dst, src, i)) return i;
    }
    const __m128i one = _mm_set1_epi32(1), bias = _mm_set1_epi32(0x7fff);
    for (; i + 16 <= n; i += 16) {
        const unsigned char *p = src + 4 * i;
        /* The cast reads twice the bytes it writes, and one thread keeps up with its reads
         * only when they are asked for a page ahead. */
        _mm_prefetch((const char *)p + PREFETCH_AHEAD, _MM_HINT_T2);
        __m128 f0 = _mm_loadu_ps((const float *)p);
        __m128 f1 = _mm_loadu_ps((const float *)(p + 16));
        __m128 f2 = _mm_loadu_ps((const float *)(p + 32));
        __m128 f3 = _mm_loadu_ps((const float *)(p + 48));
        /* NaN: the only value unordered with itself. */
        __m128 nan = _mm_or_ps(_mm_or_ps(_mm_cmpunord_ps(f0, f0), _mm_cmpunord_ps(f1, f1)),
                               _mm_or_ps(_mm_cmpunord_ps(f2, f2), _mm_cmpunord_ps(f3, f3)));
        if (_mm_movemask_ps(nan)) {
            _mm_sfence();
            return i;
        }
        __m128i x0 = _mm_castps_si128(f0), x1 = _mm_castps_si128(f1);
        __m128i x2 = _mm_castps_si128(f2), x3 = _mm_castps_si128(f3);
        /* x + 0x7fff + (bit 16 of x), then the high half, sign-extended so that the
         * saturating pack keeps every bit. */
#define SS_ROUND(x) \
    _mm_srai_epi32(_mm_add_epi32(_mm_add_epi32(x, bias), _mm_and_si128(_mm_srli_epi32(x, 16), one)), 16)
        __m128i lo = _mm_packs_epi32(SS_ROUND(x0), SS_ROUND(x1));
        __m128i hi = _mm_packs_epi32(SS_ROUND(x2), SS_ROUND(x3));
#undef SS_ROUND
        _mm_stream_si128((__m128i *)(dst + 2 * i), lo);
        _mm_stream_si128((__m128i *)(dst + 2 * i + 16), hi);
    }
    _mm_sfence();
#endif
    for (; i < n; i++) {
        if (cast_f32_bf16_at(dst, src, i)) return i;
    }
    return -1;
}

/* fp32 -> bf16 of `n` elements, rounding to nearest even (bit for bit what torch gives for
 * every number), stored past the cache as ss_copy does. Returns -1 when done, or the index
 * of the first block holding a NaN, where it stops (torch gives NaNs different bits on
 * different paths, so the caller casts such a tensor with torch). */
int64_t ss_cast_f32_bf16(unsigned char *dst, const unsigned char *src, int64_t n) {
    int64_t i = 0;
#if defined(SS_AVX512)
    if (n >= 64 && use_avx512()) {
        for (; i < n && ((uintptr_t)(dst + 2 * i) & 63u); i++) {
            if (cast_f32_bf16_at(dst, src, i)) return i;
        }
        i = cast_f32_bf16_avx512(dst, src, i, n);
        if (i < 0) return -1 - i;
    }
#endif
    return cast_f32_bf16_from(dst, src, i, n);
}

/* The same cast without the AVX-512 loop, so that tests reach the loop every CPU runs. */
int64_t ss_cast_f32_bf16_portable(unsigned char *dst, const unsigned char *src, int64_t n) {
    return cast_f32_bf16_from(dst, src, 0, n);
}

/* bf16 -> fp32 of `n` elements (exact: the 16 bits become the high half, as in torch),
 * stored past the cache as ss_copy does. */
void ss_cast_bf16_f32(unsigned char *dst, const unsigned char *src, int64_t n) {
    int64_t i = 0;
#if defined(__SSE2__)
    for (; i < n && ((uintptr_t)(dst + 4 * i) & 15u); i++) {
        cast_bf16_f32_at(dst, src, i);
    }
    const __m128i zero = _mm_setzero_si128();
    for (; i + 16 <= n; i += 16) {
        const unsigned char *p = src + 2 * i;
        _mm_prefetch((const char *)p + PREFETCH_AHEAD / 2, _MM_HINT_T2);
        __m128i a = _mm_loadu_si128((const __m128i *)p);
        __m128i b = _mm_loadu_si128((const __m128i *)(p + 16));
        _mm_stream_si128((__m128i *)(dst + 4 * i), _mm_unpacklo_epi16(zero, a));
        _mm_stream_si128((__m128i *)(dst + 4 * i + 16), _mm_unpackhi_epi16(zero, a));
        _mm_stream_si128((__m128i *)(dst + 4 * i + 32), _mm_unpacklo_epi16(zero, b));
        _mm_stream_si128((__m128i *)(dst + 4 * i + 48), _mm_unpackhi_epi16(zero, b));
    }
    _mm_sfence();
#endif
    for (; i < n; i++) {
        cast_bf16_f32_at(dst, src, i);
    }
}

/* `n` copies, each (destination address, source address, bytes) in `moves`: the many small
 * memmoves of a bucket in one call (streamsync._copies.memmove_many). */
void ss_memmove_many(const int64_t *moves, int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        copy_bytes((unsigned char *)(intptr_t)moves[3 * j],
                   (const unsigned char *)(intptr_t)moves[3 * j + 1], (size_t)moves[3 * j + 2]);
    }
    fence();
}

#if defined(__linux__)
#include <sys/prctl.h>
#endif
#if defined(__unix__) || defined(__APPLE__)
#include <dlfcn.h>
#endif

/* Names the calling thread for the OS (top -H, /proc/PID/task/N/comm), where Linux allows. */
void ss_name_thread(const char *name) {
#if defined(__linux__)
    prctl(PR_SET_NAME, name, 0, 0, 0);
#else
    (void)name;
#endif
}

/* omp_set_num_threads of the OpenMP runtime at `path`, only if the process has already
 * loaded it (RTLD_NOLOAD: nothing is ever loaded here), else NULL. The handle is kept: the
 * runtime stays loaded for as long as torch, which loaded it, does. */
void *ss_openmp_setter(const char *path) {
#if (defined(__unix__) || defined(__APPLE__)) && defined(RTLD_NOLOAD)
    void *handle = dlopen(path, RTLD_LAZY | RTLD_NOLOAD);
    return handle ? dlsym(handle, "omp_set_num_threads") : NULL;
#else
    (void)path;
    return NULL;
#endif
}

/* The module: each function's address, as an int named after it. */
static const struct {
    const char *name;
    void *address;
} ss_functions[] = {
    {"ss_diff_1", (void *)ss_diff_1},
    {"ss_diff_2", (void *)ss_diff_2},
    {"ss_diff_4", (void *)ss_diff_4},
    {"ss_diff_8", (void *)ss_diff_8},
    {"ss_apply_1", (void *)ss_apply_1},
    {"ss_apply_2", (void *)ss_apply_2},
    {"ss_apply_4", (void *)ss_apply_4},
    {"ss_apply_8", (void *)ss_apply_8},
    {"ss_diff_f32_bf16", (void *)ss_diff_f32_bf16},
    {"ss_diff_f32_bf16_portable", (void *)ss_diff_f32_bf16_portable},
    {"ss_check", (void *)ss_check},
    {"ss_copy", (void *)ss_copy},
    {"ss_memmove_many", (void *)ss_memmove_many},
    {"ss_cast_f32_bf16", (void *)ss_cast_f32_bf16},
    {"ss_cast_f32_bf16_portable", (void *)ss_cast_f32_bf16_portable},
    {"ss_cast_bf16_f32", (void *)ss_cast_bf16_f32},
    {"ss_name_thread", (void *)ss_name_thread},
    {"ss_openmp_setter", (void *)ss_openmp_setter},
};

static struct PyModuleDef ss_module = {
    PyModuleDef_HEAD_INIT,
    "streamsync._kernel",
    "streamsync's compiled kernel: each function's address, called through ctypes by "
    "streamsync._copies.",
    -1,
    NULL,
};

PyMODINIT_FUNC PyInit__kernel(void) {
    PyObject *module = PyModule_Create(&ss_module);
    if (module == NULL) return NULL;
    for (size_t j = 0; j < sizeof(ss_functions) / sizeof(ss_functions[0]); j++) {
        PyObject *address = PyLong_FromVoidPtr(ss_functions[j].address);
        if (address == NULL || PyModule_AddObjectRef(module, ss_functions[j].name, address) < 0) {
            Py_XDECREF(address);
            Py_DECREF(module);
            return NULL;
        }
        Py_DECREF(address);
    }
    return module;
}
