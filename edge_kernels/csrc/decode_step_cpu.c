/* A whole decode step of a model whose every layer is int4 (Q4 nibbles, q4_linear_cpu.c) or every
 * layer fp32 (f32_linear_cpu.c), in one call: for each layer, RMSNorm, q|k|v, RoPE + the K/V
 * write + paged attention (decode_layer_cpu.c), o and the residual, RMSNorm, gate|up, SwiGLU, down
 * and the residual; then the final RMSNorm. Replaces the decoder's Python loop over the layers
 * (~40 torch operators a layer) for one query per row: SmolLM2 int4 at ctx 512 went 19.4 -> 16.0
 * ms a token at one thread, 12 -> 7 at two; fp32 at 500 tokens 46.9 -> 39.9 and 26.0 -> 21.3.
 *
 * Numerics (fixed, whatever the threads or the SIMD path): RMSNorm sums squares in 16 lanes then
 * vec16.h's tree, r = 1 / sqrtf(sum / D + eps), h = w * (x * r) (transformers' order); SwiGLU is
 * g / (1 + expf(-g)) * u; biases and residuals are single fp32 adds. Not torch's summation order:
 * the step's own, as its matmuls are (a capsule binds them: int4_activations, decode_step). No
 * Python API: loaded with ctypes by edge_kernels/cpu_library.py; edge_kernels/decode_step_cpu.py
 * checks every argument.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "f32_linear_cpu.h"
#include "paged_decode_cpu.h"
#include "q4_linear_cpu.h"
#include "vec16.h"

/* one matrix (N, K): int4 in q4_linear_cpu.c's layout, or (nib NULL) fp32 row blocks */
typedef struct {
    const uint8_t *nib;     /* (N, K / 2) */
    const float *d;         /* (N, K / 32) */
    const float *mt;        /* (K / 32, N) */
    f32_parts_t f32;        /* when nib is NULL */
    const float *bias;      /* (N,) or NULL */
} mat_t;

/* one layer's weights (decode_step_cpu.py's ctypes Structure mirrors it) */
typedef struct {
    const float *in_norm, *post_norm;   /* (D,) each */
    mat_t qkv, o, gate_up, down;     /* (H + 2 KV) hd x D, D x H hd, 2 I x D, D x I */
} layer_t;

/* the model's shape and the step's rows (decode_step_cpu.py's Structure mirrors it) */
typedef struct {
    int64_t L, D, I, H, KV, hd;
    float eps, scale;
    const float *final_norm;            /* (D,) */
    /* the pool (NB, L, 2, bs, KV, hd) as element strides: block, layer, k -> v */
    void *pool;
    int kv_bf16;
    int64_t blk_stride, layer_stride, kv_stride, bs;
    /* the rows: B of them, each one new token */
    int64_t B, nb;
    const float *cos, *sin;             /* (B, hd) */
    const int64_t *slots, *tables, *seq_lens;   /* (B,), (B, nb), (B,) */
    const uint8_t *valid;               /* (NB, bs) or NULL */
} step_t;

static void rms_norm(const float *x, const float *w, int64_t D, float eps, float *h) {
    v16 lanes = (v16){0};
    int64_t i = 0;
    for (; i + LANES <= D; i += LANES) {
        const v16 v = load16(x + i);
        lanes = lanes + v * v;
    }
    float ss = lane_sum(lanes);
    for (; i < D; i++) ss = ss + x[i] * x[i];   /* a width not a multiple of 16: the tail in order */
    const float r = 1.0f / sqrtf(ss / (float)D + eps);
    for (int64_t k = 0; k < D; k++) h[k] = w[k] * (x[k] * r);
}

static int matmul(const mat_t *m, const float *x, int64_t M, int64_t N, int64_t K, float *y, int threads) {
    const int rc = m->nib ? capsule_q4_linear(x, M, m->nib, m->d, m->mt, N, K, y, threads, 0)
                          : capsule_f32_linear(x, M, &m->f32, K, y, threads);
    if (rc == 0 && m->bias)
        for (int64_t r = 0; r < M; r++)
            for (int64_t n = 0; n < N; n++) y[r * N + n] = y[r * N + n] + m->bias[n];
    return rc;
}

/* x (B, D): the rows' embeddings in, overwritten (the residual stream); out (B, D): the final
 * normed hidden states. Returns 0, or the linears' / the attention's error (-1 threads,
 * -2 memory). The caller has checked every array, index and shape (decode_step_cpu.py). */
int capsule_decode_step(const layer_t *layers, const step_t *s, float *x, float *out, int threads) {
    const int64_t B = s->B, D = s->D, I = s->I, H = s->H, KV = s->KV, hd = s->hd;
    const int64_t nqkv = (H + 2 * KV) * hd, esize = s->kv_bf16 ? 2 : 4;
    const int64_t scratch = nqkv > 2 * I ? nqkv : 2 * I;
    float *buf = malloc(sizeof(float) * (size_t)(B * (D + scratch + H * hd + I + D)));
    if (!buf) return -2;
    float *h = buf, *wide = h + B * D, *att = wide + B * scratch, *act = att + B * H * hd, *y = act + B * I;
    int rc = 0;
    for (int64_t l = 0; l < s->L && rc == 0; l++) {
        const layer_t *w = layers + l;
        for (int64_t b = 0; b < B; b++) rms_norm(x + b * D, w->in_norm, D, s->eps, h + b * D);
        rc = matmul(&w->qkv, h, B, nqkv, D, wide, threads);                    /* (B, (H + 2 KV) hd) */
        if (rc) break;
        char *kc = (char *)s->pool + l * s->layer_stride * esize;
        rc = capsule_decode_layer(wide, nqkv, wide + H * hd, nqkv, wide + (H + KV) * hd, nqkv, s->cos, s->sin,
                                  s->slots, kc, kc + s->kv_stride * esize, s->kv_bf16, s->blk_stride, KV * hd, hd,
                                  s->tables, s->nb, s->seq_lens, s->valid, B, H, KV, hd, s->bs, s->scale, att,
                                  threads);                                    /* (B, H hd) */
        if (rc) break;
        rc = matmul(&w->o, att, B, D, H * hd, y, threads);
        if (rc) break;
        for (int64_t k = 0; k < B * D; k++) x[k] = x[k] + y[k];
        for (int64_t b = 0; b < B; b++) rms_norm(x + b * D, w->post_norm, D, s->eps, h + b * D);
        rc = matmul(&w->gate_up, h, B, 2 * I, D, wide, threads);              /* (B, 2 I): g | u */
        if (rc) break;
        for (int64_t b = 0; b < B; b++)
            for (int64_t k = 0; k < I; k++) {
                const float g = wide[b * 2 * I + k], u = wide[b * 2 * I + I + k];
                act[b * I + k] = g / (1.0f + expf(-g)) * u;
            }
        rc = matmul(&w->down, act, B, D, I, y, threads);
        if (rc) break;
        for (int64_t k = 0; k < B * D; k++) x[k] = x[k] + y[k];
    }
    if (rc == 0)
        for (int64_t b = 0; b < B; b++) rms_norm(x + b * D, s->final_norm, D, s->eps, out + b * D);
    free(buf);
    return rc;
}
