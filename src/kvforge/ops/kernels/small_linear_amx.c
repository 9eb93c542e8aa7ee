/* `small_linear` on AMX tiles (Intel Sapphire Rapids and later): the same packed weight, the same
 * result for every row at every width, but the multiplies done by the tile unit. With AVX-512
 * alone a step's multiplies grow with its rows (9 rows cost 1.6x one row over smollm2-135m's
 * 121 weights, 32 rows 4.8x); a TDPBF16PS multiplies up to 16 rows by 16 outputs over 32 inputs
 * in one instruction, so up to 32 rows the step stays bound by reading the weights once, and
 * from 32 rows on (two_by_two) it keeps pace with oneDNN up to a few hundred rows.
 *
 * The packed layout (N / 16, K / 2, 16, 2) of small_linear.c is already what a B tile holds: 16
 * consecutive pairs of one block are 16 rows of 64 bytes. x (M, K) bf16 rows are A tiles of 32
 * inputs; each C tile sums 16 outputs of up to 16 rows in fp32.
 *
 * Invariant (as small_linear.c's): an output's bits depend only on its row of x and the weight:
 * each output accumulates the 32-input chunks in order in its own C element, whatever M is and
 * however rows are split into tiles, so a decode step, a verification and a batch agree.
 * Requires K % 32 == 0 (the caller keeps the AVX-512 path otherwise) and `kvforge_amx_enable`. */
#include <cpuid.h>
#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define BLOCKS 4  /* C tiles: 4 blocks of 16 outputs per pass over the inputs */
#define ROWS 16   /* rows per A tile */
#define GROUP 12  /* blocks every row chunk reads before the next group (as small_linear.c) */
#define AHEAD 2   /* 32-input chunks of each block prefetched ahead: the weights stream from memory */

static int amx_on;

/* Whether the CPU has AMX-BF16 and Linux lets this process use the tile registers (asked once:
 * the permission is per process); returns 1 if the AMX path is on, else 0. */
int kvforge_amx_enable(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24)))
        return amx_on = 0; /* EDX bit 22 AMX-BF16, bit 24 AMX-TILE */
    unsigned long features = 0;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0 ||
        syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &features) != 0 || !(features & (1ul << XFEATURE_XTILEDATA)))
        return amx_on = 0;
    return amx_on = 1;
}

void kvforge_amx_disable(void) { amx_on = 0; } /* tests: the AVX-512 paths on an AMX CPU */

int kvforge_amx_usable(long k) { return amx_on && k % 32 == 0; }

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
};

/* Every tile 64 bytes wide, tile t `rows[t]` rows (0: unused); shared with the attention kernels. */
void kvforge_amx_configure(const unsigned char rows[8]) {
    struct tile_config cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.bytes_per_row[t] = rows[t] ? 64 : 0;
        cfg.rows[t] = rows[t];
    }
    /* gcc 12 does not see _tile_loadconfig read the struct and drops the stores above without this */
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

/* Tiles 0-3: C (mr rows of 16 fp32); 4: A (mr rows of 32 bf16); 5-7: B (16 pairs of 16 outputs). */
static void configure(int mr) {
    const unsigned char rows[8] = {mr, mr, mr, mr, mr, 16, 16, 16};
    kvforge_amx_configure(rows);
}

/* fp32 sums (mr rows, `stride` floats apart) plus bias -> bf16 outputs, rounded once. */
static void finish(const float *sums, long stride, const uint16_t *bias, uint16_t *out, long n, int mr, int nb, long b0) {
    for (int c = 0; c < nb; c++) {
        const __m512 add = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                      _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + (b0 + c) * 16))), 16))
                                : _mm512_setzero_ps();
        for (int r = 0; r < mr; r++) {
            const __m512 v = _mm512_add_ps(_mm512_loadu_ps(sums + r * stride + c * 16), add);
            _mm256_storeu_si256((__m256i *)(out + r * n + (b0 + c) * 16), (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

#define PAIR_ROW 32 /* uint16 per pair row: 16 outputs x 2 inputs, 64 bytes */

static inline __attribute__((always_inline)) void zero_sums(void) { /* C tiles 0-3 */
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

static inline void prefetch_chunk(const uint16_t *w) {
    for (int line = 0; line < 16; line++) _mm_prefetch((const char *)(w + line * PAIR_ROW), _MM_HINT_T0);
}

/* Blocks b0 .. b0 + 3 for mr rows (tiles configured for mr). */
static void four_blocks(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *out, long n, long k,
                        int mr, long b0) {
    const long pairs = k / 2, chunks = k / 32;
    const uint16_t *w0 = packed + b0 * pairs * PAIR_ROW, *w1 = w0 + pairs * PAIR_ROW, *w2 = w1 + pairs * PAIR_ROW,
                   *w3 = w2 + pairs * PAIR_ROW;
    zero_sums();
    for (long c = 0; c < chunks; c++) {
        const long at = c * 16 * PAIR_ROW;
        if (c + AHEAD < chunks) {
            const long ahead = at + AHEAD * 16 * PAIR_ROW;
            prefetch_chunk(w0 + ahead);
            prefetch_chunk(w1 + ahead);
            prefetch_chunk(w2 + ahead);
            prefetch_chunk(w3 + ahead);
        }
        _tile_loadd(4, x + c * 32, k * 2);
        _tile_loadd(5, w0 + at, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, w1 + at, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, w2 + at, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, w3 + at, 64);
        _tile_dpbf16ps(3, 4, 5);
    }
    float sums[ROWS * BLOCKS * 16];
    _tile_stored(0, sums, BLOCKS * 64);
    _tile_stored(1, sums + 16, BLOCKS * 64);
    _tile_stored(2, sums + 32, BLOCKS * 64);
    _tile_stored(3, sums + 48, BLOCKS * 64);
    finish(sums, BLOCKS * 16, bias, out, n, mr, BLOCKS, b0);
}

/* One block (the blocks left over after groups of four). */
static void one_block(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *out, long n, long k,
                      int mr, long b0) {
    const long pairs = k / 2, chunks = k / 32;
    const uint16_t *w = packed + b0 * pairs * PAIR_ROW;
    _tile_zero(0);
    for (long c = 0; c < chunks; c++) {
        if (c + AHEAD < chunks) prefetch_chunk(w + (c + AHEAD) * 16 * PAIR_ROW);
        _tile_loadd(4, x + c * 32, k * 2);
        _tile_loadd(5, w + c * 16 * PAIR_ROW, 64);
        _tile_dpbf16ps(0, 4, 5);
    }
    float sums[ROWS * 16];
    _tile_stored(0, sums, 64);
    finish(sums, 16, bias, out, n, mr, 1, b0);
}

/* 32 rows by blocks b0, b0 + 1: tiles 0-3 C (rows 0-15 / 16-31 x block b0 / b0 + 1), 4-5 A (the two
 * row halves), 6-7 B. Each 32-input chunk is two A and two B loads for four multiplies, where
 * four_blocks makes five for four and reloads a B tile that a multiply may still be reading: past
 * a few row groups the step is bound by the multiplies, not the weights (tiles configured all 16). */
static void two_by_two(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *out, long n, long k,
                       long b0) {
    const long pairs = k / 2, chunks = k / 32;
    const uint16_t *w0 = packed + b0 * pairs * PAIR_ROW, *w1 = w0 + pairs * PAIR_ROW;
    zero_sums();
    for (long c = 0; c < chunks; c++) {
        const long at = c * 16 * PAIR_ROW;
        _tile_loadd(4, x + c * 32, k * 2);
        _tile_loadd(6, w0 + at, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(5, x + ROWS * k + c * 32, k * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_loadd(7, w1 + at, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
    }
    float sums[2 * ROWS * 32];
    _tile_stored(0, sums, 128);
    _tile_stored(1, sums + 16, 128);
    _tile_stored(2, sums + ROWS * 32, 128);
    _tile_stored(3, sums + ROWS * 32 + 16, 128);
    finish(sums, 32, bias, out, n, 2 * ROWS, 2, b0);
}

/* Output blocks b0 .. b1 of every row (a part of one of the kernels' threads: tiles are
 * configured per thread). */
void kvforge_small_linear_amx_blocks(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *out,
                                     long m, long n, long k, long b0, long b1) {
    int configured = 0;
    for (long g0 = b0; g0 < b1; g0 += GROUP) {
        const long g1 = b1 - g0 < GROUP ? b1 : g0 + GROUP;
        long r0 = 0;
        for (; r0 + 2 * ROWS <= m; r0 += 2 * ROWS) { /* row groups of 32: two_by_two */
            if (configured != ROWS) configure(configured = ROWS); /* two_by_two's tiles are 16-row tiles too */
            long b = g0;
            for (; b + 2 <= g1; b += 2) two_by_two(x + r0 * k, packed, bias, out + r0 * n, n, k, b);
            if (b < g1) /* an odd block left: one_block runs on the same 16-row tiles */
                for (long h = 0; h < 2; h++)
                    one_block(x + (r0 + h * ROWS) * k, packed, bias, out + (r0 + h * ROWS) * n, n, k, ROWS, b);
        }
        for (; r0 < m; r0 += ROWS) {
            const int mr = m - r0 < ROWS ? (int)(m - r0) : ROWS;
            if (mr != configured) configure(configured = mr);
            long b = g0;
            for (; b + BLOCKS <= g1; b += BLOCKS) four_blocks(x + r0 * k, packed, bias, out + r0 * n, n, k, mr, b);
            for (; b < g1; b++) one_block(x + r0 * k, packed, bias, out + r0 * n, n, k, mr, b);
        }
    }
    _tile_release();
}
