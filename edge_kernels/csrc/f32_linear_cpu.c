/* A linear layer over fp32 weights on the CPU: y (M, N) = x (M, K) . W^T, where W is up to
 * F32_PARTS row blocks stacked (q, k and v read as one q|k|v matrix, gate and up as gate|up,
 * with no copy of the checkpoint's tensors).
 *
 * Why: the decode step of a dense fp32 model (decode_step_cpu.c) reads ~500 MB of weights a
 * token; this streams them once at batch <= XROWS, with a software prefetch ahead of the rows.
 *
 * Order: each output is summed the same way whatever M, the thread count or the row's place:
 * products of 16 consecutive inputs added to 16 lanes, chunk after chunk (a last partial chunk
 * zero-padded), then the lanes as a tree (vec16.h). No fused multiply-add (setup.py passes
 * -ffp-contract=off): every clone rounds alike. Not torch's (MKL's) order: a model run through
 * this kernel has its own numerics (a capsule binds them: runtime.decode_step). No Python API:
 * loaded with ctypes by edge_kernels/cpu_library.py; edge_kernels/f32_linear_cpu.py and
 * decode_step_cpu.py check every argument first.
 */
#include <stdint.h>
#include <string.h>

#include "f32_linear_cpu.h"
#include "parallel.h"
#include "vec16.h"

#define ROWS 16          /* outputs reduced together (one v16 of sums) */
#define XROWS 4          /* rows of x per pass over the weights */
_Static_assert(ROWS == LANES, "store_sums reduces one v16 of sums per group");
#define AHEAD 1024       /* floats prefetched ahead of the row being read (4 KB) */

typedef struct {
    const float *x;         /* (M, K) */
    const f32_parts_t *w;
    float *y;               /* (M, N) */
    int64_t M, N, K, g0, g1;    /* this worker's groups of ROWS outputs: g0 .. g1 - 1 */
} job_t;

/* row n of the stacked matrix */
static inline const float *row_of(const f32_parts_t *w, int64_t n, int64_t K) {
    int p = 0;
    while (p + 1 < w->n && n >= w->rows[p]) n -= w->rows[p++];
    return w->part[p] + n * K;
}

/* outputs n0 .. n0 + n - 1 (n <= ROWS) for x rows m0 .. m0 + mm - 1 (mm <= XROWS) */
static inline __attribute__((always_inline))
void rows(const job_t *j, int64_t n0, int64_t n, int64_t m0, const int64_t mm) {
    const int64_t K = j->K, body = K - K % LANES;
    v16 part[XROWS][ROWS];
    for (int64_t r = 0; r < n; r++) {
        const float *w = row_of(j->w, n0 + r, K);
        v16 acc[XROWS];
        for (int64_t m = 0; m < mm; m++) acc[m] = (v16){0};
        for (int64_t k = 0; k < body; k += LANES) {
            __builtin_prefetch(w + k + AHEAD);
            const v16 wk = load16(w + k);
            for (int64_t m = 0; m < mm; m++) acc[m] += wk * load16(j->x + (m0 + m) * K + k);
        }
        if (body < K) {   /* the last partial chunk, zero-padded: the same order as a full one */
            float wt[LANES] = {0}, xt[LANES] = {0};
            memcpy(wt, w + body, sizeof(float) * (size_t)(K - body));
            for (int64_t m = 0; m < mm; m++) {
                memcpy(xt, j->x + (m0 + m) * K + body, sizeof(float) * (size_t)(K - body));
                acc[m] += load16(wt) * load16(xt);
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

int capsule_f32_linear(const float *x, int64_t M, const f32_parts_t *w, int64_t K, float *y, int threads) {
    int64_t N = 0;
    for (int p = 0; p < w->n; p++) N += w->rows[p];
    const int64_t G = (N + ROWS - 1) / ROWS;
    const int n = capsule_workers(threads, G);
    job_t jobs[MAX_WORKERS];
    for (int i = 0; i < n; i++) jobs[i] = (job_t){x, w, y, M, N, K, G * i / n, G * (i + 1) / n};
    return capsule_run_workers(n, worker, jobs);
}
