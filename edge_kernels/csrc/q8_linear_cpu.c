/* A linear layer over Q8_0 weights on the CPU: y (M, N) = x (M, K) . W^T, where
 * W[n, k] = codes[n, k] * scales[n, k / 32] (a GGUF Q8_0 matrix: int8 codes, one scale per 32).
 *
 * Why: with int4 layers, the logits' matmul over the tied embeddings (49,152 x 576 for SmolLM2)
 * was the largest read of a decode step. Kept as Q8_0 it reads 1.1 bytes a weight (fp16: 2,
 * fp32: 4) and every weight is its exact dequantized value (code * scale is exact in fp32), so
 * the logits are the dequantized model's up to summation order, not an fp16 copy's.
 *
 * Order: each output is summed the same way whatever M, the thread count or the row's place in
 * the matrix: per block of 32, (w[0:16] * x[0:16] + w[16:32] * x[16:32]) * scale added to 16
 * lanes, then the lanes as a tree (l + l+8, + 4, + 2, + 1). No fused multiply-add (setup.py passes
 * -ffp-contract=off): every clone rounds alike. No Python API: loaded with ctypes by
 * edge_kernels/cpu_library.py; edge_kernels/q8_linear_cpu.py checks every argument first.
 */
#include <stdint.h>
#include <string.h>

#include "parallel.h"
#include "vec16.h"

#define QBLOCK 32        /* weights per scale */
#define ROWS 16          /* outputs reduced together (one v16 of sums) */
#define XROWS 4          /* rows of x per pass over the weights */
_Static_assert(ROWS == LANES, "store_sums reduces one v16 of sums per group");

typedef struct {
    const float *x;         /* (M, K) */
    const int8_t *codes;    /* (N, K) */
    const float *scales;    /* (N, K / 32) */
    float *y;               /* (M, N) */
    int64_t M, N, K, g0, g1;    /* this worker's groups of ROWS outputs: g0 .. g1 - 1 */
} job_t;

/* 16 int8 codes as floats (exact). Widened element by element: GCC lowers a vector-extension
 * int8 -> int32 conversion to scalar code, this loop to one sign-extending load. */
static inline __attribute__((always_inline)) v16 codes16(const int8_t *p) {
    int32_t t[16];
    for (int i = 0; i < 16; i++) t[i] = p[i];
    v16i c;
    memcpy(&c, t, sizeof c);
    return __builtin_convertvector(c, v16);
}

/* rows n0 .. n0 + n - 1 (n <= ROWS) for x rows m0 .. m0 + mm - 1 (mm <= XROWS): each row's
 * 16-lane sums into part[m][r], then the 16 lanes of each reduced as one tree */
static inline __attribute__((always_inline))
void rows(const job_t *j, int64_t n0, int64_t n, int64_t m0, const int64_t mm) {
    const int64_t K = j->K, nb = K / QBLOCK;
    v16 part[XROWS][ROWS];
    for (int64_t r = 0; r < n; r++) {
        const int8_t *c = j->codes + (n0 + r) * K;
        const float *s = j->scales + (n0 + r) * nb;
        v16 acc[XROWS];
        for (int64_t m = 0; m < mm; m++) acc[m] = (v16){0};
        for (int64_t b = 0; b < nb; b++) {
            __builtin_prefetch(c + (b + 8) * QBLOCK);
            const v16 w0 = codes16(c + b * QBLOCK), w1 = codes16(c + b * QBLOCK + 16);
            const float d = s[b];
            for (int64_t m = 0; m < mm; m++) {
                const float *xm = j->x + (m0 + m) * K + b * QBLOCK;
                acc[m] += (w0 * load16(xm) + w1 * load16(xm + 16)) * d;
            }
        }
        for (int64_t m = 0; m < mm; m++) part[m][r] = acc[m];
    }
    for (int64_t m = 0; m < mm; m++) store_sums(j->y + (m0 + m) * j->N + n0, part[m], n);
}

CLONES static void groups(const job_t *j) {
    for (int64_t g = j->g0; g < j->g1; g++) {
        const int64_t n0 = g * ROWS, n = j->N - n0 < ROWS ? j->N - n0 : ROWS;
        int64_t m0 = 0;
        for (; m0 + XROWS <= j->M; m0 += XROWS) rows(j, n0, n, m0, XROWS);
        switch (j->M - m0) {   /* constant x-row counts: the loops over m unroll */
        case 1: rows(j, n0, n, m0, 1); break;
        case 2: rows(j, n0, n, m0, 2); break;
        case 3: rows(j, n0, n, m0, 3); break;
        default: break;
        }
    }
}

static void worker(void *arg, int w) { groups((const job_t *)arg + w); }

/* Returns 0, or -1 when a thread could not be started (the caller raises). The caller has
 * checked: M, N >= 1, K a positive multiple of 32, every array contiguous and of its size. */
int capsule_q8_linear(const float *x, int64_t M, const int8_t *codes, const float *scales,
                      int64_t N, int64_t K, float *y, int threads) {
    const int64_t G = (N + ROWS - 1) / ROWS;
    const int n = capsule_workers(threads, G);
    job_t jobs[MAX_WORKERS];
    for (int i = 0; i < n; i++) jobs[i] = (job_t){x, codes, scales, y, M, N, K, G * i / n, G * (i + 1) / n};
    return capsule_run_workers(n, worker, jobs);
}
