/* The fp32 linear's entry point and its stacked matrix (see f32_linear_cpu.c for what it
 * computes). */
#ifndef CAPSULE_F32_LINEAR_CPU_H
#define CAPSULE_F32_LINEAR_CPU_H

#include <stdint.h>

#define F32_PARTS 3

/* W (N, K) as n row blocks stacked: part[p] is (rows[p], K) contiguous; N = the rows' sum */
typedef struct {
    const float *part[F32_PARTS];
    int64_t rows[F32_PARTS];
    int32_t n;
} f32_parts_t;

/* Returns 0, or -1 when a thread could not be started (the caller raises). The caller has
 * checked: M >= 1, 1 <= n <= F32_PARTS, every rows[p] >= 1, K >= 1, every array contiguous and
 * of its size. */
int capsule_f32_linear(const float *x, int64_t M, const f32_parts_t *w, int64_t K, float *y, int threads);

#endif
