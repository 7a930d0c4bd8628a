/* The paged decode attention's entry points, for the other kernels that call them (see
 * paged_decode_cpu.c and decode_layer_cpu.c for what they compute and what the caller checks). */
#ifndef CAPSULE_PAGED_DECODE_CPU_H
#define CAPSULE_PAGED_DECODE_CPU_H

#include <stdint.h>

int capsule_paged_decode(const float *q, const void *k, const void *v, int kv_bf16,
                         int64_t blk_stride, int64_t slot_stride, int64_t head_stride,
                         const int64_t *tables, int64_t nb, const int64_t *seq_lens,
                         const uint8_t *valid, int64_t B, int64_t H, int64_t KV, int64_t hd,
                         int64_t bs, float scale, float *out, int threads);

int capsule_decode_layer(const float *q, int64_t q_row, const float *k, int64_t k_row,
                         const float *v, int64_t v_row, const float *cos, const float *sin,
                         const int64_t *slots, void *kc, void *vc, int kv_bf16,
                         int64_t blk_stride, int64_t slot_stride, int64_t head_stride,
                         const int64_t *tables, int64_t nb, const int64_t *seq_lens,
                         const uint8_t *valid, int64_t B, int64_t H, int64_t KV, int64_t hd,
                         int64_t bs, float scale, float *out, int threads);

#endif
