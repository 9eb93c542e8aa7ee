/* Few-query attention over a contiguous bf16 KV buffer, for decode and verification steps.
 *
 * Layout (row-major, contiguous): q (BH, R, D) fp32, k and v (BH, C, D) bf16, scores (BH, R, C)
 * fp32, out (BH, R, D) fp32; BH = batch x KV heads, R = query rows sharing a KV head, C = the
 * buffer's rows, of which the first `length` are real.
 *
 * Each key and value row is read once for all R query rows of its head, straight from the
 * buffer, and rows past `length` are never read (their scores are -inf, their weights unused).
 * Invariant: a query row's result depends only on its own query and the real rows, never on R,
 * BH, `length` beyond its own keys or C: every score is a 16-lane FMA chain over D followed by
 * one fixed reduction tree (keys are scored 16 at a time, a short last block through a zeroed
 * copy, so a key's bits do not depend on where a block starts), and values accumulate in key
 * order. A one-token decode step and a (k + 1)-row verification therefore give a row the same
 * bits, which lossless speculative decoding needs. Requires AVX-512F and D in {16, 32, ..., 256}. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 16
#define MAX_CHUNKS 16 /* D / 16 */

static inline __m512 load_bf16(const uint16_t *p) {
    __m256i half = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

/* a[j] (16 lanes each) -> lane j = the sum of a[j]'s lanes, one fixed tree for every j. */
static inline __m512 transpose_sum(__m512 a[16]) {
    __m512 b[8], c[4];
    for (int j = 0; j < 8; j++)
        b[j] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * j], a[2 * j + 1]), _mm512_unpackhi_ps(a[2 * j], a[2 * j + 1]));
    for (int j = 0; j < 4; j++) {
        __m512d x = _mm512_castps_pd(b[2 * j]), y = _mm512_castps_pd(b[2 * j + 1]);
        c[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* c[j], per 128-bit lane L: the lane-L partial sums of a[4j .. 4j+3] */
    __m512 e01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    __m512 e23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e01, e23, 0x88), _mm512_shuffle_f32x4(e01, e23, 0xDD));
}

#define INLINE static inline __attribute__((always_inline))

/* Scores of `rows` query rows against 16 keys: the keys converted once into an fp32 scratch
 * (L1-resident), 16 accumulators per row in registers. */
INLINE void score_block(const float *q, const uint16_t *keys, float *out, long rows, long capacity, const long dim,
                        float scale) {
    float kf[BLOCK * 16 * MAX_CHUNKS];
    for (int j = 0; j < BLOCK; j++) {
        for (long c = 0; c < dim; c += 32) /* the block after the next, one cache line per 32 keys' dims */
            _mm_prefetch((const char *)(keys + (2 * BLOCK + j) * dim + c), _MM_HINT_T0);
        for (long c = 0; c < dim; c += 16) _mm512_storeu_ps(kf + j * dim + c, load_bf16(keys + j * dim + c));
    }
    __m512 scaled = _mm512_set1_ps(scale);
    for (long r = 0; r < rows; r++) {
        const float *qr = q + r * dim;
        __m512 acc[BLOCK];
        for (int j = 0; j < BLOCK; j++) acc[j] = _mm512_setzero_ps();
        for (long c = 0; c < dim; c += 16) {
            __m512 qc = _mm512_loadu_ps(qr + c);
            for (int j = 0; j < BLOCK; j++) acc[j] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(kf + j * dim + c), acc[j]);
        }
        _mm512_storeu_ps(out + r * capacity, _mm512_mul_ps(transpose_sum(acc), scaled));
    }
}

INLINE void qk(const float *q, const uint16_t *k, float *scores, long bh, long rows, long capacity, long length,
               const long dim, float scale) {
    uint16_t tail[BLOCK * 16 * MAX_CHUNKS];
    float tail_scores[BLOCK * 64];
    for (long g = 0; g < bh; g++) {
        const float *qg = q + g * rows * dim;
        const uint16_t *kg = k + g * capacity * dim;
        float *sg = scores + g * rows * capacity;
        long t = 0;
        for (; t + BLOCK <= length; t += BLOCK) score_block(qg, kg + t * dim, sg + t, rows, capacity, dim, scale);
        if (t < length) { /* a short last block: the same arithmetic on a zero-padded copy */
            memset(tail, 0, sizeof(uint16_t) * BLOCK * dim);
            memcpy(tail, kg + t * dim, sizeof(uint16_t) * (length - t) * dim);
            for (long r0 = 0; r0 < rows; r0 += 64) {
                long n = rows - r0 < 64 ? rows - r0 : 64;
                score_block(qg + r0 * dim, tail, tail_scores, n, BLOCK, dim, scale);
                for (long r = 0; r < n; r++)
                    memcpy(sg + (r0 + r) * capacity + t, tail_scores + r * BLOCK, sizeof(float) * (length - t));
            }
        }
        for (long r = 0; r < rows; r++)
            for (long u = length; u < capacity; u++) sg[r * capacity + u] = -INFINITY;
    }
}

INLINE void pv(const float *weights, const uint16_t *v, float *out, long bh, long rows, long capacity, long length,
               const long dim) {
    const long chunks = dim / 16;
    for (long g = 0; g < bh; g++) {
        const float *wg = weights + g * rows * capacity;
        const uint16_t *vg = v + g * capacity * dim;
        float *og = out + g * rows * dim;
        for (long r0 = 0; r0 < rows; r0 += 4) { /* four rows' accumulators in registers */
            long n = rows - r0 < 4 ? rows - r0 : 4;
            __m512 acc[4][MAX_CHUNKS];
            for (long r = 0; r < 4; r++)
                for (long c = 0; c < chunks; c++) acc[r][c] = _mm512_setzero_ps();
            for (long t = 0; t < length; t++) {
                const uint16_t *vt = vg + t * dim;
                for (long c = 0; c < dim; c += 32) _mm_prefetch((const char *)(vt + 16 * dim + c), _MM_HINT_T0);
                for (long c = 0; c < chunks; c++) {
                    __m512 vc = load_bf16(vt + c * 16);
                    for (long r = 0; r < n; r++)
                        acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(wg[(r0 + r) * capacity + t]), vc, acc[r][c]);
                }
            }
            for (long r = 0; r < n; r++)
                for (long c = 0; c < chunks; c++) _mm512_storeu_ps(og + (r0 + r) * dim + c * 16, acc[r][c]);
        }
    }
}

/* Entry points: each head width its own compiled loop (constant trip counts keep the
 * accumulators in registers). */
#define BY_DIM(call, dim)                                                                          \
    switch (dim) {                                                                                 \
    case 64: call(64); break;                                                                      \
    case 128: call(128); break;                                                                    \
    case 256: call(256); break;                                                                    \
    default: call(dim);                                                                            \
    }

void kvforge_qk(const float *q, const uint16_t *k, float *scores, long bh, long rows, long capacity, long length,
                long dim, float scale) {
#define QK(d) qk(q, k, scores, bh, rows, capacity, length, d, scale)
    BY_DIM(QK, dim)
}

void kvforge_pv(const float *weights, const uint16_t *v, float *out, long bh, long rows, long capacity, long length,
                long dim) {
#define PV(d) pv(weights, v, out, bh, rows, capacity, length, d)
    BY_DIM(PV, dim)
}
