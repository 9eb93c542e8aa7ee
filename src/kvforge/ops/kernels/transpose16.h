/* A 16 x 16 transpose of 32-bit lanes in AVX-512 registers: the attention's key blocks
 * (few_query_attention.c) and unpacking a packed weight (small_linear.c). */
#ifndef KVFORGE_TRANSPOSE16_H
#define KVFORGE_TRANSPOSE16_H
#include <immintrin.h>

/* In place: afterwards r[i], lane j = r[j]'s 32-bit lane i before: a 16 x 16 transpose (32-bit unpacks within 128-bit
 * lanes, then 64-bit, then two rounds of 128-bit lane shuffles). */
static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
    __m512i a[16], b[16];
    for (int k = 0; k < 8; k++) {
        a[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
        a[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    for (int m = 0; m < 4; m++) { /* b[4m + e], 128-bit lane L: element 4L + e of rows 4m .. 4m + 3 */
        b[4 * m + 0] = _mm512_unpacklo_epi64(a[4 * m], a[4 * m + 2]);
        b[4 * m + 1] = _mm512_unpackhi_epi64(a[4 * m], a[4 * m + 2]);
        b[4 * m + 2] = _mm512_unpacklo_epi64(a[4 * m + 1], a[4 * m + 3]);
        b[4 * m + 3] = _mm512_unpackhi_epi64(a[4 * m + 1], a[4 * m + 3]);
    }
    for (int e = 0; e < 4; e++) { /* row 4L + e gathers lane L of b[e], b[4 + e], b[8 + e], b[12 + e] */
        __m512i c0 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0x44), c1 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0xEE);
        __m512i c2 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0x44), c3 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0xEE);
        r[e] = _mm512_shuffle_i32x4(c0, c2, 0x88);
        r[4 + e] = _mm512_shuffle_i32x4(c0, c2, 0xDD);
        r[8 + e] = _mm512_shuffle_i32x4(c1, c3, 0x88);
        r[12 + e] = _mm512_shuffle_i32x4(c1, c3, 0xDD);
    }
}

#endif
