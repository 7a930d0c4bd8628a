/* 16-lane float vectors shared by the CPU kernels (paged_decode_cpu.c, q8_linear_cpu.c): one
 * type lowered to whatever SIMD a clone has, loads / stores, and the fixed-order reductions that
 * make a sum independent of the batch, the thread count and the CPU's ISA. */
#ifndef CAPSULE_VEC16_H
#define CAPSULE_VEC16_H

#include <stdint.h>
#include <string.h>

#define LANES 16  /* partial sums per reduction: one AVX-512 register, two AVX2, four SSE */

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

/* 16 floats as one value: GCC/Clang vector extensions, lowered to whatever SIMD the clone has
 * (one AVX-512 register, two AVX2, four SSE / NEON). No fused multiply-add (setup.py passes
 * -ffp-contract=off): every clone rounds alike, so results do not depend on the CPU's ISA. */
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));
#if defined(__clang__) || __GNUC__ >= 12
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (v16i){__VA_ARGS__})
#endif

static inline v16 load16(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

/* 16 vectors of 16 partial sums (one per slot) -> one vector of the 16 slots' sums, each
 * summed as the tree (l + l+8), then + 4, + 2, + 1: a fixed order. */
static inline v16 reduce16(const v16 *p) {
    v16 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = SHUF(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + SHUF(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        b[i] = SHUF(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + SHUF(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        c[i] = SHUF(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + SHUF(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SHUF(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + SHUF(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

static inline float lane_sum(v16 v) {
    float t[LANES];
    store16(t, v);
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) t[l] = t[l] + t[l + w];
    return t[0];
}

/* n (<= 16) outputs' 16-lane partial sums -> y[0 .. n-1], each summed as the tree above: one
 * reduce16 for a full group, lane_sum each for a last partial one (the same order, so the same
 * bits either way) */
static inline void store_sums(float *y, const v16 *part, int64_t n) {
    if (n == LANES) {
        store16(y, reduce16(part));
    } else {
        for (int64_t r = 0; r < n; r++) y[r] = lane_sum(part[r]);
    }
}

#endif
