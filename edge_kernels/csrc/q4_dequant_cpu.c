/* A Q4 matrix (q4_linear_cpu.c's layout) dequantized to fp32: w[n, 32 b + e] = d[n, b] * q + m[n, b],
 * one multiply and one add, each rounded (no fused multiply-add: setup.py passes
 * -ffp-contract=off), so every weight is the GGUF's own dequantized value (gguf.quants', which the
 * dequantized model loads), bit for bit.
 *
 * Why: a prefill chunk has hundreds of rows; there the int16 kernel's per-row work costs more than
 * a dense fp32 GEMM over the matrix dequantized once (q4_linear_cpu.py picks by the row count).
 * No Python API: loaded with ctypes by edge_kernels/cpu_library.py; q4_linear_cpu.py checks
 * every argument first.
 */
#include <stdint.h>

#include "parallel.h"

#define QBLOCK 32

typedef struct {
    const uint8_t *nib;     /* (N, K / 2) */
    const float *d;         /* (N, K / 32) */
    const float *mt;        /* (K / 32, N) */
    float *w;               /* (N, K) */
    int64_t N, K, n0, n1;   /* this worker's rows */
} job_t;

static void rows(void *arg, int worker) {
    const job_t *j = (const job_t *)arg + worker;
    const int64_t nb = j->K / QBLOCK;
    for (int64_t n = j->n0; n < j->n1; n++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *q = j->nib + n * (j->K / 2) + 16 * b;
            const float d = j->d[n * nb + b], m = j->mt[b * j->N + n];
            float *w = j->w + n * j->K + QBLOCK * b;
            for (int e = 0; e < 16; e++) {
                w[e] = d * (float)(q[e] & 15) + m;
                w[e + 16] = d * (float)(q[e] >> 4) + m;
            }
        }
}

/* Returns 0, or -1 when a thread could not be started. The caller has checked: N >= 1, K a
 * positive multiple of 32, every array contiguous and of its size. */
int capsule_q4_dequantize(const uint8_t *nib, const float *d, const float *mt, int64_t N, int64_t K, float *w,
                          int threads) {
    const int n = capsule_workers(threads, N);
    job_t jobs[MAX_WORKERS];
    for (int i = 0; i < n; i++) jobs[i] = (job_t){nib, d, mt, w, N, K, N * i / n, N * (i + 1) / n};
    return capsule_run_workers(n, rows, jobs);
}
