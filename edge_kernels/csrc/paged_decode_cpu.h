/* The paged decode attention's entry point, for the other kernels that call it (see
 * paged_decode_cpu.c for what it computes and what the caller checks). */
#ifndef CAPSULE_PAGED_DECODE_CPU_H
#define CAPSULE_PAGED_DECODE_CPU_H

#include <stdint.h>

int capsule_paged_decode(const float *q, const void *k, const void *v, int kv_bf16,
                         int64_t blk_stride, int64_t slot_stride, int64_t head_stride,
                         const int64_t *tables, int64_t nb, const int64_t *seq_lens,
                         const uint8_t *valid, int64_t B, int64_t H, int64_t KV, int64_t hd,
                         int64_t bs, float scale, float *out, int threads);

#endif
