/* The Q4 linear's entry point, for the other kernels that call it (see q4_linear_cpu.c for what
 * it computes and what the caller checks). */
#ifndef CAPSULE_Q4_LINEAR_CPU_H
#define CAPSULE_Q4_LINEAR_CPU_H

#include <stdint.h>

int capsule_q4_linear(const float *x, int64_t M, const uint8_t *nib, const float *d, const float *mt,
                      int64_t N, int64_t K, float *y, int threads, int path);

#endif
