/* The one-pass comparison behind streamsync.wire.patch: built on first use with the
 * system's C compiler (cc -O3), called through ctypes (which releases the GIL, so pieces of
 * one tensor run on several threads). Without a compiler, torch does the same work. */
#include <stdint.h>
#include <string.h>

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

/* The cast fused into the comparison: elements [lo, hi) of fp32 `a` as bf16 against bf16
 * `b`; as ss_diff_2 otherwise. -2 at the first NaN (torch's own conversion gives NaNs
 * different bits on different paths, so such a tensor is cast by torch). */
int64_t ss_diff_f32_bf16(const unsigned char *a, const unsigned char *b, int64_t lo, int64_t hi,
                         int32_t *pos32, int64_t *pos64, unsigned char *vals, int64_t limit) {
    int64_t k = 0, i = lo;
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
        for (int j = 0; j < 16; j++) {
            if (pos32) pos32[k] = (int32_t)(i + j); else pos64[k] = i + j;
            memcpy(vals + k * 2, &c[j], 2);
            k += c[j] != old[j];
        }
        if (k > limit) return -1;
    }
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

/* `n` copies, each (destination address, source address, bytes) in `moves`: the many small
 * memmoves of a bucket in one call (streamsync._copies.memmove_many). */
void ss_memmove_many(const int64_t *moves, int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        memmove((void *)(intptr_t)moves[3 * j], (const void *)(intptr_t)moves[3 * j + 1],
                (size_t)moves[3 * j + 2]);
    }
}
