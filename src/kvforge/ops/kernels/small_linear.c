/* A linear layer for a few rows (a decode step, a verification, a small batch) in bf16, over a
 * weight packed once into pairs: what oneDNN does slowly here (one row streams the weights at
 * ~10 GB/s where one core reads 20 GB/s).
 *
 * Layout: the weight W (N, K) bf16, row-major as torch keeps it, is packed into (N / 16, K / 2,
 * 16, 2): block b, pair p holds (W[16b + j][2p], W[16b + j][2p + 1]) in lane j, so one 64-byte
 * load feeds a vdpbf16ps that adds input pair p's two products to 16 outputs at once. x (M, K)
 * bf16, bias (N) bf16 or NULL, out (M, N) bf16 rounded to nearest even once, after the bias.
 *
 * Invariant: an output's bits depend only on its row of x and the weight: each output is one
 * accumulator that adds the pairs p = 0, 1, ... in order, whatever M is and however rows and
 * blocks are tiled, so a row rounds alike in a one-token decode step, a 9-token verification
 * and a 16-sequence batch (lossless speculative decoding needs the first two to agree).
 * Requires AVX512-BF16 (`kvforge_supported`, in few_query_attention.c), N % 16 == 0, K even. */
#include <immintrin.h>
#include <stdint.h>
#include "threads.h"
#include "transpose16.h"

#define INLINE static inline __attribute__((always_inline))
#define AHEAD 8 /* pairs prefetched ahead in each block: the weights stream from memory */

void kvforge_pack_pairs(const uint16_t *w, uint16_t *packed, long n, long k) {
    const long pairs = k / 2;
    for (long b = 0; b < n / 16; b++)
        for (long p = 0; p < pairs; p++)
            for (long j = 0; j < 16; j++) {
                const uint16_t *src = w + (16 * b + j) * k + 2 * p;
                uint16_t *dst = packed + ((b * pairs + p) * 16 + j) * 2;
                dst[0] = src[0];
                dst[1] = src[1];
            }
}

/* The inverse of kvforge_pack_pairs for blocks [b0, b1): each (input pair, output) is one 32-bit
 * unit, so a block is a (K / 2) x 16 transpose of them. */
struct unpack_job {
    const uint32_t *packed;
    uint32_t *w;
    long pairs;
};

static void unpack_blocks(void *ctx, long b0, long b1) {
    const struct unpack_job *j = ctx;
    const long pairs = j->pairs;
    for (long b = b0; b < b1; b++) {
        const uint32_t *src = j->packed + b * pairs * 16;
        uint32_t *dst = j->w + 16 * b * pairs;
        long p0 = 0;
        for (; p0 + 16 <= pairs; p0 += 16) { /* 16 pairs x 16 outputs in registers */
            __m512i r[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(src + (p0 + i) * 16);
            transpose16(r);
            for (int o = 0; o < 16; o++) _mm512_storeu_si512(dst + o * pairs + p0, r[o]);
        }
        for (long o = 0; o < 16; o++)
            for (long p = p0; p < pairs; p++) dst[o * pairs + p] = src[p * 16 + o];
    }
}

/* A packed weight back to (N, K) row-major, over the kernels' threads (a prefill's linear runs
 * F.linear over it where the unpacked weight was released: `ops.linear.release_unpacked`). */
void kvforge_unpack_pairs(const uint16_t *packed, uint16_t *w, long n, long k) {
    struct unpack_job job = {(const uint32_t *)packed, (uint32_t *)w, k / 2};
    kvforge_parallel(unpack_blocks, &job, n / 16, 1);
}

/* fp32 -> bf16, round to nearest even (NaN stays NaN) */
INLINE __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

/* MR rows x NB blocks of 16 outputs in registers, both constants in each instance so the loops
 * unroll and the accumulators stay in registers. */
#define TILE(MR, NB)                                                                                       \
    static void tile_##MR##_##NB(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *out, \
                                 long n, long k, long b0) {                                                \
        const long pairs = k / 2;                                                                          \
        __m512 acc[MR][NB];                                                                                \
        for (int r = 0; r < MR; r++)                                                                       \
            for (int c = 0; c < NB; c++) acc[r][c] = _mm512_setzero_ps();                                  \
        const uint16_t *wb = packed + b0 * pairs * 32;                                                     \
        for (long p = 0; p < pairs; p++) {                                                                 \
            __m512i w[NB];                                                                                 \
            for (int c = 0; c < NB; c++) {                                                                 \
                w[c] = _mm512_loadu_si512(wb + (c * pairs + p) * 32);                                      \
                _mm_prefetch((const char *)(wb + (c * pairs + p + AHEAD) * 32), _MM_HINT_T0);              \
            }                                                                                              \
            for (int r = 0; r < MR; r++) {                                                                 \
                const __m512i xv = _mm512_broadcastd_epi32(_mm_loadu_si32(x + r * k + 2 * p));            \
                for (int c = 0; c < NB; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)w[c], (__m512bh)xv); \
            }                                                                                              \
        }                                                                                                  \
        for (int c = 0; c < NB; c++) {                                                                     \
            const __m512 add = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(                               \
                                          _mm512_cvtepu16_epi32(_mm256_loadu_si256(                        \
                                              (const __m256i *)(bias + (b0 + c) * 16))), 16))              \
                                    : _mm512_setzero_ps();                                                 \
            for (int r = 0; r < MR; r++)                                                                   \
                _mm256_storeu_si256((__m256i *)(out + r * n + (b0 + c) * 16), to_bf16(_mm512_add_ps(acc[r][c], add))); \
        }                                                                                                  \
    }

TILE(1, 8)
TILE(2, 6)
TILE(3, 4)
TILE(4, 4)
TILE(5, 4)
TILE(6, 4)
TILE(7, 3)
TILE(8, 3)
TILE(9, 3)
TILE(1, 1)
TILE(2, 1)
TILE(3, 1)
TILE(4, 1)
TILE(5, 1)
TILE(6, 1)
TILE(7, 1)
TILE(8, 1)
TILE(9, 1)

/* For 1..9 rows: the widest tile whose accumulators, weights and broadcast fit in AVX-512's 32
 * registers (R x W + W + 1), and its one-block form for the blocks left over. */
typedef void (*tile_fn)(const uint16_t *, const uint16_t *, const uint16_t *, uint16_t *, long, long, long);
#define MAX_ROWS 9
static const long widths[MAX_ROWS + 1] = {0, 8, 6, 4, 4, 4, 4, 3, 3, 3};
static const tile_fn whole[MAX_ROWS + 1] = {0, tile_1_8, tile_2_6, tile_3_4, tile_4_4, tile_5_4, tile_6_4, tile_7_3, tile_8_3, tile_9_3};
static const tile_fn single[MAX_ROWS + 1] = {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1, tile_7_1, tile_8_1, tile_9_1};

/* Blocks b0 .. b1 of `mr` rows (1 .. 9): whole tiles, then single blocks. */
static void rows_over_blocks(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *out, long mr,
                             long n, long k, long b0, long b1) {
    long b = b0;
    for (; b + widths[mr] <= b1; b += widths[mr]) whole[mr](x, packed, bias, out, n, k, b);
    for (; b < b1; b++) single[mr](x, packed, bias, out, n, k, b);
}

/* Rows in passes of 9 (a k = 8 verification is one pass), the rest in the last (measured on
 * smollm2's 121 weights: 16 rows as 9 + 7 0.92x the time of 8 + 8; evening out 10 rows as 5 + 5
 * 1.12x 8 + 2: a 5-row tile does fewer multiplies per load). */
static long row_tile(long left) { return left < MAX_ROWS ? left : MAX_ROWS; }

/* Rows in tiles of up to 9; every row tile reads a group of 12 blocks (192 outputs: 590 KB of
 * weight at K = 1536, within L2) before the next group, so the weights stream from memory once. */
#define GROUP 12

#ifndef KVFORGE_NO_AMX
int kvforge_amx_usable(long k);
void kvforge_small_linear_amx_blocks(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *out,
                                     long m, long n, long k, long b0, long b1);
#endif

struct linear_job {
    const uint16_t *x, *packed, *bias;
    uint16_t *out;
    long m, n, k;
};

/* Output blocks b0 .. b1 of every row. */
static void linear_blocks(void *ctx, long b0, long b1) {
    const struct linear_job *j = ctx;
#ifndef KVFORGE_NO_AMX
    if (kvforge_amx_usable(j->k)) { /* a weight takes one path at every width: its rows round alike */
        kvforge_small_linear_amx_blocks(j->x, j->packed, j->bias, j->out, j->m, j->n, j->k, b0, b1);
        return;
    }
#endif
    if (j->m == 1) {
        rows_over_blocks(j->x, j->packed, j->bias, j->out, 1, j->n, j->k, b0, b1);
        return;
    }
    for (long g0 = b0; g0 < b1; g0 += GROUP) {
        const long g1 = b1 - g0 < GROUP ? b1 : g0 + GROUP;
        for (long r0 = 0, mr; r0 < j->m; r0 += mr) {
            mr = row_tile(j->m - r0);
            rows_over_blocks(j->x + r0 * j->k, j->packed, j->bias, j->out + r0 * j->n, mr, j->n, j->k, g0, g1);
        }
    }
}

/* The kernels' threads each take a run of whole groups of output blocks (an output's bits do not
 * depend on which thread computes it, nor on the blocks beside it). */
void kvforge_small_linear(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *out, long m,
                          long n, long k) {
    struct linear_job job = {x, packed, bias, out, m, n, k};
    kvforge_parallel(linear_blocks, &job, n / 16, m == 1 ? widths[1] : GROUP);
}
