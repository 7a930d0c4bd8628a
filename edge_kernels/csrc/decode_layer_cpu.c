/* One decoder layer's decode attention from its projections (capsule_decode_layer): RoPE on q
 * and k, the new K/V written into the pool, then the paged decode attention
 * (paged_decode_cpu.c). Bit-identical to capsule.llm's apply_rope + write_kv + that kernel; one
 * call instead of ~30 torch operators. No Python API: loaded with ctypes by
 * edge_kernels/cpu_library.py; edge_kernels/paged_decode_cpu.py checks every argument first.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "paged_decode_cpu.h"

/* fp32 -> bfloat16 by round-to-nearest-even, as torch's Tensor.to(bfloat16) (a NaN -> 0x7FC0) */
static inline uint16_t to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if (x != x) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* rotate-half RoPE of one head: y = x * c + rotate_half(x) * s, each product and the sum
 * rounded once (no FMA), which is what torch's apply_rope computes element by element */
static inline void rope(float *y, const float *x, const float *c, const float *s, int64_t hd) {
    const int64_t half = hd / 2;
    for (int64_t i = 0; i < half; i++) y[i] = x[i] * c[i] + (-x[i + half]) * s[i];
    for (int64_t i = half; i < hd; i++) y[i] = x[i] * c[i] + x[i - half] * s[i];
}

static inline void put(void *cache, int bf16, int64_t off, const float *x, int64_t n) {
    if (bf16) {
        uint16_t *d = (uint16_t *)cache + off;
        for (int64_t i = 0; i < n; i++) d[i] = to_bf16(x[i]);
    } else {
        memcpy((float *)cache + off, x, sizeof(float) * (size_t)n);
    }
}

/* One decoder layer's decode attention from its projections: RoPE on each row's q (B, H, hd)
 * and k (B, KV, hd) (cos / sin: (B, hd), the row's position), k and v written into slot
 * slots[b] of the layer's caches, then capsule_paged_decode with the rotated q. Bit-identical
 * to capsule.llm's apply_rope + write_kv + the kernel; one call instead of ~30 torch operators.
 * q, k, v: each row's heads contiguous, rows q_row / k_row / v_row floats apart. Every write
 * lands before any row attends. The caller has checked the slots (< NB * bs) too. */
int capsule_decode_layer(const float *q, int64_t q_row, const float *k, int64_t k_row,
                         const float *v, int64_t v_row, const float *cos, const float *sin,
                         const int64_t *slots, void *kc, void *vc, int kv_bf16,
                         int64_t blk_stride, int64_t slot_stride, int64_t head_stride,
                         const int64_t *tables, int64_t nb, const int64_t *seq_lens,
                         const uint8_t *valid, int64_t B, int64_t H, int64_t KV, int64_t hd,
                         int64_t bs, float scale, float *out, int threads) {
    float *qr = (float *)malloc(sizeof(float) * (size_t)(B * H * hd + hd));
    if (!qr) return -1;
    float *kr = qr + B * H * hd;   /* one rotated key head */
    const int64_t shift = __builtin_ctzll((unsigned long long)bs), lo = bs - 1;
    for (int64_t b = 0; b < B; b++) {
        const float *c = cos + b * hd, *s = sin + b * hd;
        for (int64_t h = 0; h < H; h++) rope(qr + (b * H + h) * hd, q + b * q_row + h * hd, c, s, hd);
        const int64_t slot = slots[b];
        const int64_t at = (slot >> shift) * blk_stride + (slot & lo) * slot_stride;
        for (int64_t h = 0; h < KV; h++) {
            rope(kr, k + b * k_row + h * hd, c, s, hd);
            put(kc, kv_bf16, at + h * head_stride, kr, hd);
            put(vc, kv_bf16, at + h * head_stride, v + b * v_row + h * hd, hd);
        }
    }
    int rc = capsule_paged_decode(qr, kc, vc, kv_bf16, blk_stride, slot_stride, head_stride, tables,
                                  nb, seq_lens, valid, B, H, KV, hd, bs, scale, out, threads);
    free(qr);
    return rc;
}
