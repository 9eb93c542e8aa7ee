/* exp(x) in 16 fp32 lanes for x already clamped to [-87.3, 88.72]: Cephes' expf polynomial after
 * reduction by ln 2 (within 2 ulp of expf), scaled by 2^n. Shared by the attention's softmax and
 * silu_mul, which each say what happens outside that range. */
#ifndef KVFORGE_CEPHES_EXP_H
#define KVFORGE_CEPHES_EXP_H
#include <immintrin.h>

static inline __attribute__((always_inline)) __m512 exp_in_range(__m512 x) {
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    return _mm512_scalef_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f))), n);
}
#endif
