/* RMSNorm of bf16 rows in one call: torch's bf16 path (upcast, F.rms_norm, downcast, weight) is
 * four ops of ~5 us each per row block here, 61 of them in a smollm2 decode step (~1.2 ms).
 *
 * x (rows, dim) bf16 contiguous, w (dim) bf16, out (rows, dim) bf16; dim % 16 == 0. Each row in
 * fp32: r = 1 / sqrt(mean(x^2) + eps), then as the families' modules round:
 *   one_plus = 0 (Llama, Qwen, Mistral: `w * x_normed.to(bf16)`): bf16(w * bf16(x * r));
 *   one_plus = 1 (Gemma 3: `(x_normed * (1 + w.float())).to(bf16)`): bf16(x * r * (1 + w)).
 * The sum of squares runs in 16 lanes over the row in order, then one fixed reduction: a row's bits
 * depend only on the row (not on how many rows share the call), though its last bit may differ
 * from torch's, whose reduction runs in another order; and a result below bf16's normal range
 * (|y| < 1.2e-38) reads 0, where torch keeps the subnormal (vcvtneps2bf16 flushes it). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include "threads.h"

static inline __m512 load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m512 round_bf16(__m512 v) { /* to the nearest bf16 and back to fp32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

struct norm_job {
    const uint16_t *x, *w;
    uint16_t *out;
    long dim;
    float eps;
    int one_plus;
};

static void norm_rows(void *ctx, long r0, long r1) {
    const struct norm_job *j = ctx;
    const long dim = j->dim;
    for (long r = r0; r < r1; r++) {
        const uint16_t *xr = j->x + r * dim;
        uint16_t *o = j->out + r * dim;
        __m512 squares = _mm512_setzero_ps();
        for (long c = 0; c < dim; c += 16) {
            const __m512 v = load_bf16(xr + c);
            squares = _mm512_fmadd_ps(v, v, squares);
        }
        const __m512 scale = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)dim + j->eps));
        for (long c = 0; c < dim; c += 16) {
            const __m512 normed = _mm512_mul_ps(load_bf16(xr + c), scale);
            const __m512 weight = load_bf16(j->w + c);
            const __m512 y = j->one_plus ? _mm512_mul_ps(normed, _mm512_add_ps(_mm512_set1_ps(1.0f), weight))
                                         : _mm512_mul_ps(weight, round_bf16(normed));
            _mm256_storeu_si256((__m256i *)(o + c), (__m256i)_mm512_cvtneps_pbh(y));
        }
    }
}

/* Rows split over the kernels' threads (a row's bits depend on the row alone), at least 64 rows a
 * part: a decode step's one row stays on the caller. */
void kvforge_rms_norm(const uint16_t *x, const uint16_t *w, uint16_t *out, long rows, long dim, float eps, int one_plus) {
    struct norm_job job = {x, w, out, dim, eps, one_plus};
    kvforge_parallel(norm_rows, &job, rows, 64);
}
