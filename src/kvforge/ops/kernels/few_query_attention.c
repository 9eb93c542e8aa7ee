/* Attention of query rows over a contiguous bf16 KV buffer: decode and verification steps, and
 * a prefill in chunks of a few tokens.
 *
 * Layout (row-major, contiguous): q (BH, R, D) bf16, k and v (BH, C, D) bf16, scores (BH, R, S)
 * fp32 with length <= S <= C, weights (BH, R, W) bf16 with W >= S rounded up to even, inverse
 * (BH, R) fp32 (each row's 1 / sum of weights), out (BH, R, D) fp32; BH = batch x
 * KV heads, R = query rows sharing a KV head, C = the buffer's rows, of which the first `length`
 * are real. Row r is query token r % T of a T-token step whose last token sits at row length - 1,
 * so it sees the first length - (T - 1 - r % T) rows (T = 1: all `length`).
 *
 * Three passes, each a few instructions per multiply: scores by bf16 pair dot products
 * (AVX512-BF16's dpbf16, 32 products per instruction into fp32; q and k are bf16 numbers, so
 * every product is exact and only the fp32 sums round), a softmax in fp32 whose weights are
 * rounded to bf16 (as torch's bf16 attention rounds them), and the weighted values by the same
 * pair dot products over pairs of keys, divided by the rounded weights' sum at the end. Each key and value row is read once per block of query
 * rows, straight from the buffer; rows at or past `length` are never read.
 *
 * Invariant: a query row's result depends only on its own query and the rows it sees, never on R,
 * T, BH, rows it does not see, or C: a score is a fixed sequence of dpbf16 over D and one fixed
 * reduction tree (keys are scored 16 at a time, a short last block through a zeroed copy, so a
 * key's bits do not depend on where a block starts); the softmax runs over the row's own keys in
 * 16-lane blocks; the values accumulate pair by pair in key order, and a key the row does not
 * see has weight exactly 0. A one-token decode step and a (k + 1)-row verification therefore give
 * a row the same bits, which lossless speculative decoding needs. Requires AVX-512 F, BW, VL and
 * BF16 (`kvforge_supported`, cpu_check.c) and D in {16, 32, ..., 256}. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "cephes_exp.h"
#include "threads.h"
#include "transpose16.h"

#define BLOCK 16    /* keys scored per block: one 16-lane vector of scores */
#define MAX_DIM 256 /* the scratch: the tail block, the transposed keys */
#define ROWS 4      /* query rows whose value sums share registers */
#define CHUNKS 4    /* 16-dim chunks of the output per pass over the values */
#define PREFETCH 16 /* key blocks read ahead into L2 (measured: into L1, the transposes waited on memory at 7-9 GB/s
                    * whatever the distance; into L2 16 ahead, 12-16 GB/s) */
#define TILE 128    /* keys (even) per pass of every row block over the values: 16 KB of V per 64 dims */

#define INLINE static inline __attribute__((always_inline))

/* The 32 bits at p (a bf16 pair) in every lane, by a load-broadcast (never through a GPR). */
INLINE __m512i broadcast_pair(const uint16_t *p) { return _mm512_broadcastd_epi32(_mm_loadu_si32(p)); }

INLINE __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

/* 16 keys of `dim` bf16 -> kt[p] = dimension pair p of each key, one 32-bit lane per key. */
INLINE void transpose_keys(const uint16_t *keys, __m512i *kt, const long dim) {
    const long pairs = dim / 2;
    for (long p0 = 0; p0 < pairs; p0 += 16) {
        const __mmask16 present = pairs - p0 >= 16 ? 0xFFFF : 0x00FF; /* D = 16 + 32n: a last group of 8 pairs */
        __m512i r[16];
        for (int j = 0; j < BLOCK; j++) r[j] = _mm512_maskz_loadu_epi32(present, keys + j * dim + 2 * p0);
        transpose16(r);
        for (long i = 0; i < 16 && p0 + i < pairs; i++) kt[p0 + i] = r[i];
    }
}

/* Scores of `rows` query rows against 16 keys, one lane per key: the keys transposed once into
 * pairs per lane, then for each block of ROWS rows two dpbf16 chains per row (even and odd pairs,
 * summed once at the end) with the query's pair broadcast. */
INLINE void score_block(const uint16_t *q, const uint16_t *keys, const uint16_t *ahead, float *out, long rows, long stride,
                        const long dim, float scale) {
    __m512i kt[MAX_DIM / 2];
    transpose_keys(keys, kt, dim);
    if (ahead) /* after this block's loads; into L2, so the prefetches do not hold L1's few miss buffers */
        for (int j = 0; j < BLOCK; j++)
            for (long c = 0; c < dim; c += 32) _mm_prefetch((const char *)(ahead + j * dim + c), _MM_HINT_T1);
    const __m512 scaled = _mm512_set1_ps(scale);
    for (long r0 = 0; r0 < rows; r0 += ROWS) {
        const long n = rows - r0 < ROWS ? rows - r0 : ROWS;
        __m512 even[ROWS], odd[ROWS];
        for (int r = 0; r < ROWS; r++) even[r] = odd[r] = _mm512_setzero_ps();
        for (long p = 0; p < dim / 2; p += 2) {
            for (int r = 0; r < ROWS; r++) {
                if (r < n) {
                    const uint16_t *qr = q + (r0 + r) * dim + 2 * p;
                    even[r] = dot_pairs(even[r], kt[p], broadcast_pair(qr));
                    odd[r] = dot_pairs(odd[r], kt[p + 1], broadcast_pair(qr + 2));
                }
            }
        }
        for (int r = 0; r < ROWS; r++)
            if (r < n) _mm512_storeu_ps(out + (r0 + r) * stride, _mm512_mul_ps(_mm512_add_ps(even[r], odd[r]), scaled));
    }
}

INLINE void qk(const uint16_t *q, const uint16_t *k, float *scores, long bh, long rows, long capacity, long length,
               long columns, const long dim, float scale) {
    uint16_t tail[BLOCK * MAX_DIM];
    float tail_scores[BLOCK * 64];
    for (long g = 0; g < bh; g++) {
        const uint16_t *qg = q + g * rows * dim;
        const uint16_t *kg = k + g * capacity * dim;
        float *sg = scores + g * rows * columns;
        long t = 0;
        for (; t + BLOCK <= length; t += BLOCK) {
            /* PREFETCH blocks ahead, running on into the next head's first rows near the end (never
             * past that head's buffer: a pointer outside the array is undefined even unread) */
            const long u = t + PREFETCH * BLOCK;
            const uint16_t *ahead = u < length ? kg + u * dim
                                    : g + 1 < bh && u - length + BLOCK <= capacity ? kg + (capacity + u - length) * dim : NULL;
            score_block(qg, kg + t * dim, ahead, sg + t, rows, columns, dim, scale);
        }
        if (t < length) { /* a short last block: the same arithmetic on a zero-padded copy */
            memset(tail, 0, sizeof(uint16_t) * BLOCK * dim);
            memcpy(tail, kg + t * dim, sizeof(uint16_t) * (length - t) * dim);
            for (long r0 = 0; r0 < rows; r0 += 64) {
                long n = rows - r0 < 64 ? rows - r0 : 64;
                score_block(qg + r0 * dim, tail, NULL, tail_scores, n, BLOCK, dim, scale);
                for (long r = 0; r < n; r++)
                    memcpy(sg + (r0 + r) * columns + t, tail_scores + r * BLOCK, sizeof(float) * (length - t));
            }
        }
        for (long r = 0; r < rows; r++)
            for (long u = length; u < columns; u++) sg[r * columns + u] = -INFINITY;
    }
}

/* exp(x) for x <= 0 (a score minus its row's maximum): cephes_exp.h; below -87.3 (-inf
 * included) exactly 0. */
INLINE __m512 exp_nonpositive(__m512 x) {
    const __mmask16 vanishes = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
    return _mm512_maskz_mov_ps(~vanishes, exp_in_range(_mm512_max_ps(x, _mm512_set1_ps(-87.3f))));
}

INLINE __mmask16 first(long n) { return n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1); }

/* The softmax of each row over the keys it sees, in two passes: its maximum, then the
 * exponentials rounded to bf16 (the weights, unnormalized: at most 1) with their sum, whose
 * inverse `pv` multiplies in at the end, so the weights a row uses sum to exactly 1 after
 * rounding. A row's weights are zero from its last key to `length` rounded up to even. */
static void softmax(const float *scores, uint16_t *weights, float *inverse, long bh, long rows, long columns,
                    long wstride, long length, long tokens, long row0) { /* row i is its head's row row0 + i % rows */
    const long padded = (length + 1) & ~1L;
    for (long i = 0; i < bh * rows; i++) {
        const float *s = scores + i * columns;
        uint16_t *w = weights + i * wstride;
        const long n = length - (tokens - 1 - (row0 + i % rows) % tokens);
        long t;
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (t = 0; t + 16 <= n; t += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + t));
        if (t < n) top = _mm512_max_ps(top, _mm512_mask_loadu_ps(top, first(n - t), s + t));
        const float m = n > 0 ? _mm512_reduce_max_ps(top) : -INFINITY;
        if (m == -INFINITY) { /* sees nothing (a fully masked row): no weight anywhere */
            memset(w, 0, sizeof(uint16_t) * padded);
            inverse[i] = 0.0f;
            continue;
        }
        const __m512 shift = _mm512_set1_ps(m);
        __m512 sum = _mm512_setzero_ps();
        for (t = 0; t < n; t += 16) {
            const __mmask16 valid = first(n - t);
            __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_mask_loadu_ps(shift, valid, s + t), shift));
            __m256i rounded = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_mov_ps(valid, e));
            _mm256_mask_storeu_epi16(w + t, valid, rounded);
            sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16)));
        }
        inverse[i] = 1.0f / _mm512_reduce_add_ps(sum);
        if (padded > n) memset(w + n, 0, sizeof(uint16_t) * (padded - n));
    }
}

/* The permutation value_pairs interleaves two rows with: lane 2i takes a's element i, lane 2i + 1
 * b's (index 32 + i). */
INLINE __m512i pair_interleave(void) {
    uint16_t idx[32];
    for (int i = 0; i < 16; i++) idx[2 * i] = (uint16_t)i, idx[2 * i + 1] = (uint16_t)(32 + i);
    return _mm512_loadu_si512(idx);
}

/* v rows t and t + 1, 16 dims from c, interleaved into pairs (row t's value low); a row at or
 * past `length` reads as zero and is never touched. */
INLINE __m512i value_pairs(const uint16_t *v, long t, long c, long length, const long dim, __m512i interleave) {
    __m512i a = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(v + t * dim + c)));
    __m512i b = t + 1 < length ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(v + (t + 1) * dim + c)))
                               : _mm512_setzero_si512();
    return _mm512_permutex2var_epi16(a, interleave, b);
}

/* Keys [start, length) (start even: the pairs are those of a pass from key 0) with weights column
 * t - start; `resume`: add to the sums already in `out` (a pass over [0, start) left them there,
 * unnormalized) instead of starting from zero; `finish`: normalize at the end (else leave the raw
 * sums). Split so, a row's sums are the same sequence of additions as one pass over [0, length). */
INLINE void pv(const uint16_t *weights, const float *inverse, const uint16_t *v, float *out, long bh, long rows,
               long wstride, long capacity, long start, long length, const long dim, int resume, int finish) {
    const long chunks = dim / 16;
    const __m512i interleave = pair_interleave();
    for (long g = 0; g < bh; g++) {
        const uint16_t *wg = weights + g * rows * wstride;
        const uint16_t *vg = v + g * capacity * dim;
        float *og = out + g * rows * dim;
        for (long c0 = 0; c0 < chunks; c0 += CHUNKS) {
            const long nc = chunks - c0 < CHUNKS ? chunks - c0 : CHUNKS;
            /* keys in tiles that stay in L1 while every block of rows reads them (a prefill chunk
             * has ~100 rows per head); a row's sums wait in `out` between tiles, exactly as in
             * registers, so the bits do not depend on the tiling */
            for (long t0 = start; t0 == start || t0 < length; t0 += TILE) {
                const long t1 = length - t0 < TILE ? length : t0 + TILE;
                for (long r0 = 0; r0 < rows; r0 += ROWS) {
                    const long nr = rows - r0 < ROWS ? rows - r0 : ROWS;
                    __m512 acc[ROWS][CHUNKS];
                    for (long r = 0; r < ROWS; r++)
                        for (long c = 0; c < CHUNKS; c++)
                            acc[r][c] = (t0 == start && !resume) || r >= nr || c >= nc ? _mm512_setzero_ps()
                                                                      : _mm512_loadu_ps(og + (r0 + r) * dim + (c0 + c) * 16);
                    for (long t = t0; t < t1; t += 2) {
                        for (long c = c0 * 16; c < (c0 + nc) * 16; c += 32) { /* 8 pairs ahead, every line read */
                            _mm_prefetch((const char *)(vg + (t + 16) * dim + c), _MM_HINT_T0);
                            _mm_prefetch((const char *)(vg + (t + 17) * dim + c), _MM_HINT_T0);
                        }
                        __m512i vp[CHUNKS];
                        for (long c = 0; c < nc; c++) vp[c] = value_pairs(vg, t, (c0 + c) * 16, length, dim, interleave);
                        for (long r = 0; r < nr; r++) {
                            __m512i wp = broadcast_pair(wg + (r0 + r) * wstride + t - start);
                            for (long c = 0; c < nc; c++) acc[r][c] = dot_pairs(acc[r][c], vp[c], wp);
                        }
                    }
                    const int last = finish && t1 >= length;
                    for (long r = 0; r < nr; r++) {
                        const __m512 norm = _mm512_set1_ps(inverse[g * rows + r0 + r]);
                        for (long c = 0; c < nc; c++) /* + 0: a -0 (all contributions flushed or cancelled) reads +0
                                                       * whether or not the row's unseen keys added (+0) v after it */
                            _mm512_storeu_ps(og + (r0 + r) * dim + (c0 + c) * 16,
                                             last ? _mm512_mul_ps(_mm512_add_ps(acc[r][c], _mm512_setzero_ps()), norm)
                                                  : acc[r][c]);
                    }
                }
            }
        }
    }
}


#ifndef KVFORGE_NO_AMX
/* The same two passes on AMX tiles where the CPU has them (a head width that is a multiple of
 * 32): the multiplies of many query rows (a verification's 27 per KV head, a batch of samples'
 * shared rows, a prefill chunk's ~100) cost no more than of one. Scores: the keys transposed into
 * pairs as above are a B tile per 32 dims, the query rows A tiles, so each score is summed in its
 * own fp32 element over the dims in order. Values: the weights are A tiles (32 keys), pairs of
 * value rows interleaved as above B tiles (16 dims), each output element summed over chunks of
 * 32 keys in order (within a chunk the tile sums in an order of its own: measured, a pass split
 * at an even key that is not a chunk's first rounds apart, so parts start at multiples of 32:
 * `value_part_step`). The invariant above holds with these sums: a row's bits never depend on
 * the rows beside it or the tiling; keys past `length` are never read (a partial chunk goes
 * through zeroed copies). */
int kvforge_amx_usable(long k);
void kvforge_amx_configure(const unsigned char rows[8]);

#define TROWS 16 /* query rows per A tile */

/* Rows [r0, r0 + nr) (nr <= 32) of one head against its keys: tiles 0, 1 C (16 and nr - 16
 * rows), 2, 3 A (the same rows' queries), 4 B (16 pairs of 16 keys). A tile load does not take
 * data from stores still in flight, nor a vector load from a tile store, so the blocks run as a
 * pipeline over two buffers: block i's keys are transposed while block i - 1 is multiplied and
 * block i - 2's scores scaled into place. */
static void qk_rows_amx(const uint16_t *qg, const uint16_t *kg, float *sg, long nr, long length, long capacity,
                        long columns, long dim, float scale, int more_heads) {
    const long n0 = nr < TROWS ? nr : TROWS, n1 = nr - n0, chunks = dim / 32, blocks = (length + BLOCK - 1) / BLOCK;
    const unsigned char rows[8] = {(unsigned char)n0, (unsigned char)n1, (unsigned char)n0, (unsigned char)n1, 16, 0, 0, 0};
    kvforge_amx_configure(rows);
    __m512i kt[2][MAX_DIM / 2];
    float raw[2][2 * TROWS * BLOCK];
    uint16_t tail[BLOCK * MAX_DIM];
    const __m512 scaled = _mm512_set1_ps(scale);
    for (long i = 0; i < blocks + 2; i++) {
        if (i >= 2) { /* block i - 2: scale its raw scores into place */
            const long t = (i - 2) * BLOCK, keys = length - t < BLOCK ? length - t : BLOCK;
            const float *in = raw[i & 1];
            for (long r = 0; r < nr; r++)
                _mm512_mask_storeu_ps(sg + r * columns + t, first(keys), _mm512_mul_ps(_mm512_loadu_ps(in + r * BLOCK), scaled));
        }
        if (i < blocks) { /* block i: its keys transposed into pairs */
            const long t = i * BLOCK;
            if (t + BLOCK <= length) {
                transpose_keys(kg + t * dim, kt[i & 1], dim);
                const long u = t + PREFETCH * BLOCK; /* as in qk: into L2, never past the next head's buffer */
                const uint16_t *ahead = u < length ? kg + u * dim
                                        : more_heads && u - length + BLOCK <= capacity ? kg + (capacity + u - length) * dim : NULL;
                if (ahead)
                    for (int j = 0; j < BLOCK; j++)
                        for (long c = 0; c < dim; c += 32) _mm_prefetch((const char *)(ahead + j * dim + c), _MM_HINT_T1);
            } else { /* a short last block: the same arithmetic on a zero-padded copy */
                memset(tail, 0, sizeof(uint16_t) * BLOCK * dim);
                memcpy(tail, kg + t * dim, sizeof(uint16_t) * (length - t) * dim);
                transpose_keys(tail, kt[i & 1], dim);
            }
        }
        if (i >= 1 && i <= blocks) { /* block i - 1: the products */
            __asm__ volatile("" : : : "memory"); /* gcc's tile loads do not say they read memory: keep kt's stores */
            const __m512i *keys = kt[(i - 1) & 1];
            float *out = raw[(i - 1) & 1];
            _tile_zero(0);
            if (n1) _tile_zero(1);
            for (long c = 0; c < chunks; c++) {
                _tile_loadd(4, keys + c * 16, 64);
                _tile_loadd(2, qg + c * 32, dim * 2);
                _tile_dpbf16ps(0, 2, 4);
                if (n1) {
                    _tile_loadd(3, qg + TROWS * dim + c * 32, dim * 2);
                    _tile_dpbf16ps(1, 3, 4);
                }
            }
            _tile_stored(0, out, BLOCK * 4);
            if (n1) _tile_stored(1, out + TROWS * BLOCK, BLOCK * 4);
        }
    }
}

static void qk_amx(const uint16_t *q, const uint16_t *k, float *scores, long bh, long rows, long capacity, long length,
                   long columns, long dim, float scale) {
    for (long g = 0; g < bh; g++) {
        float *sg = scores + g * rows * columns;
        for (long r0 = 0; r0 < rows; r0 += 2 * TROWS) {
            const long nr = rows - r0 < 2 * TROWS ? rows - r0 : 2 * TROWS;
            qk_rows_amx(q + (g * rows + r0) * dim, k + g * capacity * dim, sg + r0 * columns, nr, length, capacity, columns,
                        dim, scale, g + 1 < bh);
        }
        for (long r = 0; r < rows; r++)
            for (long u = length; u < columns; u++) sg[r * columns + u] = -INFINITY;
    }
    _tile_release();
}

/* Rows [r0, r0 + nr) (nr <= 32), output dims [d0, d0 + 32): tiles 0-3 C (rows 0-15 / 16-31 x
 * dims d0 / d0 + 16), 4, 5 A (the rows' weights for 32 keys), 6, 7 B (32 keys' values, 16 dims).
 * Pipelined as qk_rows_amx: chunk j's values are interleaved while chunk j - 1 is multiplied. */
static void pv_rows_amx(const uint16_t *wg, const float *inv, const uint16_t *vg, float *og, long nr, long wstride,
                        long start, long length, long dim, long d0, int resume, int finish, __m512i interleave) {
    const long n0 = nr < TROWS ? nr : TROWS, n1 = nr - n0, chunks = (length - start + 31) / 32;
    const int two = d0 + 16 < dim; /* a second 16-dim chunk (D = 16 + 32n ends on one) */
    const unsigned char rows[8] = {(unsigned char)n0, (unsigned char)(two ? n0 : 0), (unsigned char)n1,
                                   (unsigned char)(two ? n1 : 0), (unsigned char)n0, (unsigned char)n1, 16,
                                   (unsigned char)(two ? 16 : 0)};
    kvforge_amx_configure(rows);
    const long ostride = dim * 4;
    if (resume) { /* the sums a pass over [0, start) left, unnormalized */
        _tile_loadd(0, og + d0, ostride);
        if (two) _tile_loadd(1, og + d0 + 16, ostride);
        if (n1) _tile_loadd(2, og + TROWS * dim + d0, ostride);
        if (n1 && two) _tile_loadd(3, og + TROWS * dim + d0 + 16, ostride);
    } else {
        _tile_zero(0);
        if (two) _tile_zero(1);
        if (n1) _tile_zero(2);
        if (n1 && two) _tile_zero(3);
    }
    __m512i b0[2][16], b1[2][16];
    uint16_t a[2][2 * TROWS * 32];
    const uint16_t *weights[2];
    long astride[2];
    for (long j = 0; j <= chunks; j++) {
        if (j < chunks) { /* chunk j: key pairs (t, t + 1) interleaved; keys past `length` read as zero */
            const long t0 = start + j * 32, keys = length - t0 < 32 ? length - t0 : 32, column = t0 - start;
            for (long p = 0; p < 16; p++) {
                const long t = t0 + 2 * p;
                b0[j & 1][p] = t < length ? value_pairs(vg, t, d0, length, dim, interleave) : _mm512_setzero_si512();
                if (two) b1[j & 1][p] = t < length ? value_pairs(vg, t, d0 + 16, length, dim, interleave) : _mm512_setzero_si512();
                if (t + 65 < length) { /* both rows of a pair ahead, never past the rows in use */
                    _mm_prefetch((const char *)(vg + (t + 64) * dim + d0), _MM_HINT_T0);
                    _mm_prefetch((const char *)(vg + (t + 65) * dim + d0), _MM_HINT_T0);
                }
            }
            weights[j & 1] = wg + column, astride[j & 1] = wstride * 2;
            if (keys < 32) { /* a partial chunk (a whole one lies within the weights' rows): a zeroed copy */
                const long have = (keys + 1) & ~1L; /* the weights run to `length` rounded up to even */
                memset(a[j & 1], 0, sizeof(a[0]));
                for (long r = 0; r < nr; r++) memcpy(a[j & 1] + r * 32, wg + r * wstride + column, sizeof(uint16_t) * have);
                weights[j & 1] = a[j & 1], astride[j & 1] = 64;
            }
        }
        if (j >= 1) { /* chunk j - 1: the products */
            __asm__ volatile("" : : : "memory"); /* as in qk_rows_amx: keep the stores into b0, b1 and a */
            const int u = (j - 1) & 1;
            _tile_loadd(6, b0[u], 64);
            if (two) _tile_loadd(7, b1[u], 64);
            _tile_loadd(4, weights[u], astride[u]);
            _tile_dpbf16ps(0, 4, 6);
            if (two) _tile_dpbf16ps(1, 4, 7);
            if (n1) {
                _tile_loadd(5, weights[u] + TROWS * (astride[u] / 2), astride[u]);
                _tile_dpbf16ps(2, 5, 6);
                if (two) _tile_dpbf16ps(3, 5, 7);
            }
        }
    }
    _tile_stored(0, og + d0, ostride);
    if (two) _tile_stored(1, og + d0 + 16, ostride);
    if (n1) _tile_stored(2, og + TROWS * dim + d0, ostride);
    if (n1 && two) _tile_stored(3, og + TROWS * dim + d0 + 16, ostride);
    if (finish) /* + 0 as in pv: a -0 reads +0 */
        for (long r = 0; r < nr; r++) {
            const __m512 norm = _mm512_set1_ps(inv[r]);
            for (long d = d0; d < d0 + (two ? 32 : 16); d += 16) {
                float *o = og + r * dim + d;
                _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_add_ps(_mm512_loadu_ps(o), _mm512_setzero_ps()), norm));
            }
        }
}

static void pv_amx(const uint16_t *weights, const float *inverse, const uint16_t *v, float *out, long bh, long rows,
                   long wstride, long capacity, long start, long length, long dim, int resume, int finish) {
    const __m512i interleave = pair_interleave();
    for (long g = 0; g < bh; g++)
        for (long r0 = 0; r0 < rows; r0 += 2 * TROWS) {
            const long nr = rows - r0 < 2 * TROWS ? rows - r0 : 2 * TROWS;
            for (long d0 = 0; d0 < dim; d0 += 32)
                pv_rows_amx(weights + (g * rows + r0) * wstride, inverse + g * rows + r0, v + g * capacity * dim,
                            out + (g * rows + r0) * dim, nr, wstride, start, length, dim, d0, resume, finish, interleave);
        }
    _tile_release();
}
#endif

/* Entry points: each head width its own compiled loop (constant trip counts keep the
 * accumulators in registers). */
#define BY_DIM(call, dim)                                                                          \
    switch (dim) {                                                                                 \
    case 64: call(64); break;                                                                      \
    case 128: call(128); break;                                                                    \
    case 256: call(256); break;                                                                    \
    default: call(dim);                                                                            \
    }

/* The entry points split their heads (BH) over the kernels' threads (threads.c): a head's
 * rows are computed by one thread with the one-thread arithmetic, so the bits do not depend on
 * the thread count. */
struct attention_job {
    const uint16_t *q, *k, *v;
    float *scores, *out, scale;
    uint16_t *weights;
    float *inverse;
    long rows, capacity, start, length, columns, wstride, dim, tokens;
    int resume, finish, failed;
    const long *lengths; /* kvforge_attend: each sequence's own length (NULL: `length` for all); the three
                          * passes: each head's own (BH of them), for a batch whose sequences end apart */
    long heads;          /* kvforge_attend with `lengths`: the heads of one sequence */
};

/* Head g's length in a pass over heads [g0, g1): its own where the job gives one per head. */
INLINE long head_length(const struct attention_job *j, long g) { return j->lengths ? j->lengths[g] : j->length; }

static void qk_heads(void *ctx, long g0, long g1) {
    const struct attention_job *j = ctx;
    if (j->lengths && g1 - g0 > 1) { /* each head its own length: one head per pass (the same arithmetic) */
        for (long g = g0; g < g1; g++) qk_heads(ctx, g, g + 1);
        return;
    }
    const long dim = j->dim, bh = g1 - g0, length = head_length(j, g0);
    const uint16_t *q = j->q + g0 * j->rows * dim, *k = j->k + g0 * j->capacity * dim;
    float *scores = j->scores + g0 * j->rows * j->columns;
#ifndef KVFORGE_NO_AMX
    if (kvforge_amx_usable(dim)) { /* a head width takes one path at every row count: its rows round alike */
        qk_amx(q, k, scores, bh, j->rows, j->capacity, length, j->columns, dim, j->scale);
        return;
    }
#endif
#define QK(d) qk(q, k, scores, bh, j->rows, j->capacity, length, j->columns, d, j->scale)
    BY_DIM(QK, dim)
}

void kvforge_qk(const uint16_t *q, const uint16_t *k, float *scores, long bh, long rows, long capacity, long length,
                long columns, long dim, float scale, const long *lengths) {
    struct attention_job job = {.q = q, .k = k, .scores = scores, .scale = scale, .rows = rows, .capacity = capacity,
                                .length = length, .columns = columns, .dim = dim, .lengths = lengths};
    kvforge_parallel(qk_heads, &job, bh, 1);
}

static void softmax_heads(void *ctx, long g0, long g1) {
    const struct attention_job *j = ctx;
    if (j->lengths && g1 - g0 > 1) { /* each head its own length: one head per pass */
        for (long g = g0; g < g1; g++) softmax_heads(ctx, g, g + 1);
        return;
    }
    softmax(j->scores + g0 * j->rows * j->columns, j->weights + g0 * j->rows * j->wstride, j->inverse + g0 * j->rows,
            g1 - g0, j->rows, j->columns, j->wstride, head_length(j, g0), j->tokens, 0);
}

void kvforge_softmax(const float *scores, uint16_t *weights, float *inverse, long bh, long rows, long columns,
                     long wstride, long length, long tokens, const long *lengths) {
    struct attention_job job = {.scores = (float *)scores, .weights = weights, .inverse = inverse, .rows = rows,
                                .columns = columns, .wstride = wstride, .length = length, .tokens = tokens,
                                .lengths = lengths};
    kvforge_parallel(softmax_heads, &job, bh, 1);
}

static void pv_heads(void *ctx, long g0, long g1) {
    const struct attention_job *j = ctx;
    if (j->lengths && g1 - g0 > 1) { /* each head its own length: one head per pass (the same arithmetic) */
        for (long g = g0; g < g1; g++) pv_heads(ctx, g, g + 1);
        return;
    }
    const long dim = j->dim, bh = g1 - g0, length = head_length(j, g0);
    const uint16_t *weights = j->weights + g0 * j->rows * j->wstride, *v = j->v + g0 * j->capacity * dim;
    const float *inverse = j->inverse + g0 * j->rows;
    float *out = j->out + g0 * j->rows * dim;
#ifndef KVFORGE_NO_AMX
    if (kvforge_amx_usable(dim)) {
        pv_amx(weights, inverse, v, out, bh, j->rows, j->wstride, j->capacity, j->start, length, dim, j->resume,
               j->finish);
        return;
    }
#endif
#define PV(d) \
    pv(weights, inverse, v, out, bh, j->rows, j->wstride, j->capacity, j->start, length, d, j->resume, j->finish)
    BY_DIM(PV, dim)
}

void kvforge_pv(const uint16_t *weights, const float *inverse, const uint16_t *v, float *out, long bh, long rows,
                long wstride, long capacity, long start, long length, long dim, int resume, int finish,
                const long *lengths) {
    struct attention_job job = {.weights = (uint16_t *)weights, .inverse = (float *)inverse, .v = v, .out = out,
                                .rows = rows, .wstride = wstride, .capacity = capacity, .start = start, .length = length,
                                .dim = dim, .resume = resume, .finish = finish, .lengths = lengths};
    kvforge_parallel(pv_heads, &job, bh, 1);
}

/* The three passes in one call over rows [0, length) of every head, ATTEND_ROWS query rows at a
 * time: a group's scores and weights (32 x 4K keys: 512 KB of scores) stay in L2 between the
 * passes, where three whole-call passes send a prefill chunk's (3 heads x 96 rows x 4K keys: 4.7
 * MB) through memory three times. Each row's arithmetic is the passes' own, so the bits are too.
 * The threads take whole (head, row group) items. With `lengths` (one per sequence of `heads`
 * heads), each sequence's heads read their own rows [0, lengths[b]), its step's last token at row
 * lengths[b] - 1 (a batch whose sequences have different lengths), `length` their largest: each
 * row's bits are those of a call over its sequence alone. Requires every length >= 1. Returns 0,
 * or -1 where a thread's scratch could not be allocated (its rows not written). */
#define ATTEND_ROWS 32

static void attend_groups(void *ctx, long i0, long i1) {
    struct attention_job *j = ctx;
    const long rows = j->rows, longest = j->length, dim = j->dim, capacity = j->capacity, tokens = j->tokens;
    const long groups = (rows + ATTEND_ROWS - 1) / ATTEND_ROWS;
    const float scale = j->scale;
    float *scores = malloc(sizeof(float) * ATTEND_ROWS * longest);
    uint16_t *weights = malloc(sizeof(uint16_t) * ATTEND_ROWS * ((longest + 1) & ~1L));
    float inverse[ATTEND_ROWS];
    if (!scores || !weights) {
        free(scores);
        free(weights);
        __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED); /* any part's failure fails the call */
        return;
    }
#ifndef KVFORGE_NO_AMX
    const int amx = kvforge_amx_usable(dim);
    const __m512i interleave = pair_interleave();
#endif
    for (long i = i0; i < i1; i++) {
        const long g = i / groups, r0 = i % groups * ATTEND_ROWS;
        const long nr = rows - r0 < ATTEND_ROWS ? rows - r0 : ATTEND_ROWS;
        const long length = j->lengths ? j->lengths[g / j->heads] : longest, wstride = (length + 1) & ~1L;
        const uint16_t *qg = j->q + (g * rows + r0) * dim, *kg = j->k + g * capacity * dim, *vg = j->v + g * capacity * dim;
        float *og = j->out + (g * rows + r0) * dim;
#ifndef KVFORGE_NO_AMX
        if (amx) {
            qk_rows_amx(qg, kg, scores, nr, length, capacity, length, dim, scale, (g + 1) * groups < i1);
            softmax(scores, weights, inverse, 1, nr, length, wstride, length, tokens, r0);
            for (long d0 = 0; d0 < dim; d0 += 32)
                pv_rows_amx(weights, inverse, vg, og, nr, wstride, 0, length, dim, d0, 0, 1, interleave);
            continue;
        }
#endif
#define ATTEND_QK(d) qk(qg, kg, scores, 1, nr, capacity, length, length, d, scale)
#define ATTEND_PV(d) pv(weights, inverse, vg, og, 1, nr, wstride, capacity, 0, length, d, 0, 1)
        BY_DIM(ATTEND_QK, dim)
        softmax(scores, weights, inverse, 1, nr, length, wstride, length, tokens, r0);
        BY_DIM(ATTEND_PV, dim)
    }
#ifndef KVFORGE_NO_AMX
    if (amx) _tile_release();
#endif
    free(scores);
    free(weights);
}

int kvforge_attend(const uint16_t *q, const uint16_t *k, const uint16_t *v, float *out, long bh, long rows,
                   long capacity, long length, long dim, float scale, long tokens, const long *lengths, long heads) {
    struct attention_job job = {.q = q, .k = k, .v = v, .out = out, .scale = scale, .rows = rows, .capacity = capacity,
                                .length = length, .dim = dim, .tokens = tokens, .lengths = lengths, .heads = heads};
    kvforge_parallel(attend_groups, &job, bh * ((rows + ATTEND_ROWS - 1) / ATTEND_ROWS), 1);
    return job.failed ? -1 : 0;
}
