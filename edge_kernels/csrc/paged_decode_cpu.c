/* Paged decode attention on the CPU: one query per row reads its live K/V slots in place.
 *
 * The torch path (capsule/llm/paged_attention.py) copies every block of a row's table out of
 * the block-major pool per layer (index_select), then SDPA reads the copy: the K/V bytes move
 * three times. Here each (row, kv head) reads its keys once (scores), then its values once
 * (weighted sum), straight from the pool through the block table. No Python API: loaded with
 * ctypes by edge_kernels/cpu_library.py; edge_kernels/paged_decode_cpu.py checks every argument
 * first. decode_layer_cpu.c calls it after RoPE and the K/V write.
 *
 * Semantics: edge_kernels/paged_decode.py's (the Triton kernel): GQA (query head h reads kv
 * head h / G), keys at slots 0..seq_len-1 of the row's table minus the holes slot_valid marks,
 * scores scaled by `scale`, softmax in fp32. Sums run in a fixed order (16 lanes, then the lanes
 * in order), so a result does not depend on the batch, the thread count or the other rows.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "paged_decode_cpu.h"
#include "parallel.h"
#include "vec16.h"

#define MAX_HEADS 256  /* query heads (the caller checks) */
#define MAX_CHUNKS 16  /* head size / 16 (the caller checks: at most 256) */

typedef struct {
    const float *q;                 /* (B, H, hd) */
    const void *k, *v;              /* the layer's K and V of block 0, slot 0, head 0 */
    int bf16;                       /* 1: K/V are bfloat16, 0: float32 */
    int64_t blk_stride, slot_stride, head_stride;   /* in elements of the pool; hd is contiguous */
    const int64_t *tables;          /* (B, nb) */
    const int64_t *seq_lens;        /* (B,) */
    const uint8_t *valid;           /* (NB, bs) or NULL */
    int64_t B, H, KV, hd, bs, nb;
    float scale;
    float *out;                     /* (B, H, hd) */
    int64_t first, step;            /* this worker's units: first, first + step, ... */
    int status;                     /* 0, or -1 when malloc failed */
} job_t;

/* exp(x) for x <= 0 (scores minus their max), 0 below -87: Cephes' expf polynomial on 16
 * lanes (round to nearest by the 1.5 * 2^23 trick, 2^n built in the exponent bits). ~2 ulp. */
static inline v16 exp16(v16 x) {
    v16i dead = x < -87.0f;
    const v16 floor87 = (v16){0} - 87.0f;
    v16 xc = (v16)(((v16i)x & ~dead) | ((v16i)floor87 & dead));
    v16 n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    v16 r = xc - n * 0.693359375f + n * 2.12194440e-4f;
    v16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    v16 two = (v16)((__builtin_convertvector(n, v16i) + 127) << 23);
    return (v16)((v16i)(p * two) & ~dead);
}

/* 16 K/V elements at element offset `off` of the pool as fp32: the pool's fp32 floats, or its
 * bfloat16 halves (the top 16 bits of an fp32: widened exactly, by a shift) */
static inline __attribute__((always_inline)) v16 kv16(const void *base, int64_t off, const int bf16) {
    if (bf16) {
        v16u16 h;
        memcpy(&h, (const uint16_t *)base + off, sizeof h);
        return (v16)(__builtin_convertvector(h, v16i) << 16);
    }
    return load16((const float *)base + off);
}

static inline void prefetch_row(const void *base, int64_t off, int64_t elems, const int bf16) {
    const char *row = (const char *)base + off * (bf16 ? 2 : 4);
    for (int64_t b = 0; b < elems * (bf16 ? 2 : 4); b += 64) __builtin_prefetch(row + b);
}

/* One row's kv heads k0..k1-1 (all of them unless the batch is smaller than the threads):
 * each slot's (k1 - k0, hd) keys are read once, contiguously, then the values likewise. A kv
 * head's keys (values) are loaded and widened once into registers for its G query heads, not
 * once per query head: bf16 pools widen a third as often at G = 3, and AVX2's clone does not
 * reload every chunk per head (~1.5x and ~2x fewer ns a slot, the same bits). Scratch: scores (H, Sp) with Sp = nb * bs rounded up to 16,
 * part (H, 16) and acc (H, hd / 16) vectors. Inlined into one copy per head size and pool
 * dtype below: with hd and bf16 constants the loops over hd unroll and the loads specialize. */
static inline __attribute__((always_inline))
void unit_impl(const job_t *j, int64_t b, int64_t k0, int64_t k1, float *scores, v16 *part,
               v16 *acc, const int64_t hd, const int bf16) {
    const int64_t G = j->H / j->KV, bs = j->bs, h0 = k0 * G, h1 = k1 * G, C = hd / LANES;
    const int64_t len = j->seq_lens[b], Sp = (j->nb * bs + LANES - 1) / LANES * LANES;
    const int64_t *table = j->tables + b * j->nb;
    const float *q = j->q + b * j->H * hd;
    float *out = j->out + b * j->H * hd;
    const int64_t hs = j->head_stride, row = (k1 - k0) * hs, ahead = 8;  /* prefetch distance */
    /* bs is a power of two (the caller checks): no division per slot */
    const int64_t shift = __builtin_ctzll((unsigned long long)bs), lo = bs - 1;
    /* element offset of slot s's kv head 0 in the layer */
#define SLOT(s) (table[(s) >> shift] * j->blk_stride + ((s) & lo) * j->slot_stride)

    /* pass 1: scores, 16 slots at a time */
    for (int64_t s0 = 0; s0 < len; s0 += LANES) {
        int64_t n = len - s0 < LANES ? len - s0 : LANES;
        for (int64_t i = 0; i < n; i += 2) {   /* two slots per q load (a lone last one: twice) */
            int64_t s = s0 + i, two = i + 1 < n;
            if (s + ahead < len) prefetch_row(j->k, SLOT(s + ahead) + k0 * hs, row, bf16);
            if (two && s + 1 + ahead < len) prefetch_row(j->k, SLOT(s + 1 + ahead) + k0 * hs, row, bf16);
            const int64_t r0 = SLOT(s), r1 = two ? SLOT(s + 1) : r0;
            for (int64_t kvh = k0; kvh < k1; kvh++) {
                /* the two slots' keys, read (and widened) once for the kv head's G queries */
                v16 ka[MAX_CHUNKS], kb[MAX_CHUNKS];
                for (int64_t c = 0; c < C; c++) {
                    ka[c] = kv16(j->k, r0 + kvh * hs + c * LANES, bf16);
                    kb[c] = kv16(j->k, r1 + kvh * hs + c * LANES, bf16);
                }
                for (int64_t h = kvh * G; h < (kvh + 1) * G; h++) {
                    const float *qh = q + h * hd;
                    v16 qc = load16(qh), a0 = qc * ka[0], a1 = qc * kb[0];
                    for (int64_t c = 1; c < C; c++) {
                        qc = load16(qh + c * LANES);
                        a0 += qc * ka[c];
                        a1 += qc * kb[c];
                    }
                    part[(h - h0) * LANES + i] = a0;
                    if (two) part[(h - h0) * LANES + i + 1] = a1;
                }
            }
        }
        for (int64_t h = h0; h < h1; h++) {
            for (int64_t i = n; i < LANES; i++) part[(h - h0) * LANES + i] = (v16){0};
            store16(scores + h * Sp + s0, reduce16(part + (h - h0) * LANES) * j->scale);
            for (int64_t i = n; i < LANES; i++) scores[h * Sp + s0 + i] = -INFINITY;
        }
        if (j->valid)   /* holes of a memory region: never read */
            for (int64_t i = 0; i < n; i++) {
                int64_t s = s0 + i;
                if (!j->valid[table[s >> shift] * bs + (s & lo)])
                    for (int64_t h = h0; h < h1; h++) scores[h * Sp + s] = -INFINITY;
            }
    }
    /* softmax per head over the padded length (the pad is -inf: p = 0) */
    const int64_t lp = (len + LANES - 1) / LANES * LANES;
    float inv[MAX_HEADS];
    for (int64_t h = h0; h < h1; h++) {
        float *sc = scores + h * Sp;
        v16 mx = load16(sc);
        for (int64_t s = LANES; s < lp; s += LANES) {
            v16 x = load16(sc + s);
            mx = (v16)(((v16i)x & (x > mx)) | ((v16i)mx & ~(x > mx)));
        }
        float t[LANES], m = -INFINITY;
        store16(t, mx);
        for (int l = 0; l < LANES; l++) m = t[l] > m ? t[l] : m;
        if (m == -INFINITY) m = 0.0f;   /* no readable slot: every p is 0, the output 0 */
        v16 sm = {0};
        for (int64_t s = 0; s < lp; s += LANES) {
            v16 e = exp16(load16(sc + s) - m);
            store16(sc + s, e);
            sm += e;
        }
        float sum = lane_sum(sm);
        inv[h] = sum > 0.0f ? 1.0f / sum : 0.0f;
        for (int64_t c = 0; c < C; c++) acc[(h - h0) * C + c] = (v16){0};
    }
    /* pass 2: the weighted values, four slots at a time from slot 0 (((p0 v0 + p1 v1) +
     * (p2 v2 + p3 v3)) added to the head's sum), the last len % 4 one by one. A masked slot
     * (p == 0) is skipped, never multiplied, so a hole's bytes (never written) cannot reach
     * the output: a head whose group holds one goes one by one. Each head's sum runs in this
     * order whether its kv head's values are read once for all G heads (every p of the group
     * non-zero) or once per head. */
    int64_t s = 0;
    for (; s + 4 <= len; s += 4) {
        int64_t r[4];
        for (int i = 0; i < 4; i++) {
            if (s + i + ahead < len) prefetch_row(j->v, SLOT(s + i + ahead) + k0 * hs, row, bf16);
            r[i] = SLOT(s + i);
        }
        for (int64_t kvh = k0; kvh < k1; kvh++) {
            const int64_t o0 = r[0] + kvh * hs, o1 = r[1] + kvh * hs, o2 = r[2] + kvh * hs,
                          o3 = r[3] + kvh * hs, hk = kvh * G;
            int full = 1;   /* every head of the group has four readable slots */
            for (int64_t h = hk; h < hk + G; h++) {
                const float *ph = scores + h * Sp + s;
                full &= ph[0] != 0.0f && ph[1] != 0.0f && ph[2] != 0.0f && ph[3] != 0.0f;
            }
            if (full) {   /* each value chunk read (and widened) once for the G heads */
                for (int64_t c = 0; c < C; c++) {
                    const v16 v0 = kv16(j->v, o0 + c * LANES, bf16), v1 = kv16(j->v, o1 + c * LANES, bf16),
                              v2 = kv16(j->v, o2 + c * LANES, bf16), v3 = kv16(j->v, o3 + c * LANES, bf16);
                    for (int64_t h = hk; h < hk + G; h++) {
                        const float *ph = scores + h * Sp + s;
                        acc[(h - h0) * C + c] += (v0 * ph[0] + v1 * ph[1]) + (v2 * ph[2] + v3 * ph[3]);
                    }
                }
                continue;
            }
            for (int64_t h = hk; h < hk + G; h++) {   /* each head by itself, as above */
                const float *ph = scores + h * Sp + s;
                v16 *o = acc + (h - h0) * C;
                if (ph[0] != 0.0f && ph[1] != 0.0f && ph[2] != 0.0f && ph[3] != 0.0f) {
                    for (int64_t c = 0; c < C; c++)
                        o[c] += (kv16(j->v, o0 + c * LANES, bf16) * ph[0] + kv16(j->v, o1 + c * LANES, bf16) * ph[1])
                              + (kv16(j->v, o2 + c * LANES, bf16) * ph[2] + kv16(j->v, o3 + c * LANES, bf16) * ph[3]);
                    continue;
                }
                const int64_t os[4] = {o0, o1, o2, o3};
                for (int i = 0; i < 4; i++)
                    if (ph[i] != 0.0f)
                        for (int64_t c = 0; c < C; c++) o[c] += kv16(j->v, os[i] + c * LANES, bf16) * ph[i];
            }
        }
    }
    for (; s < len; s++) {
        const int64_t r0 = SLOT(s);
        for (int64_t kvh = k0; kvh < k1; kvh++) {
            for (int64_t h = kvh * G; h < (kvh + 1) * G; h++) {
                float p = scores[h * Sp + s];
                if (p == 0.0f) continue;
                v16 *o = acc + (h - h0) * C;
                for (int64_t c = 0; c < C; c++) o[c] += kv16(j->v, r0 + kvh * hs + c * LANES, bf16) * p;
            }
        }
    }
#undef SLOT
    for (int64_t h = h0; h < h1; h++)
        for (int64_t c = 0; c < C; c++) store16(out + h * hd + c * LANES, acc[(h - h0) * C + c] * inv[h]);
}

CLONES static void unit(const job_t *j, int64_t b, int64_t k0, int64_t k1, float *scores,
                        v16 *part, v16 *acc) {
    /* the head sizes of the models we run, unrolled; any other multiple of 16 too */
    if (j->bf16) {
        switch (j->hd) {
        case 64: unit_impl(j, b, k0, k1, scores, part, acc, 64, 1); break;
        case 128: unit_impl(j, b, k0, k1, scores, part, acc, 128, 1); break;
        default: unit_impl(j, b, k0, k1, scores, part, acc, j->hd, 1);
        }
    } else {
        switch (j->hd) {
        case 64: unit_impl(j, b, k0, k1, scores, part, acc, 64, 0); break;
        case 128: unit_impl(j, b, k0, k1, scores, part, acc, 128, 0); break;
        default: unit_impl(j, b, k0, k1, scores, part, acc, j->hd, 0);
        }
    }
}

/* Units: rows, or (row, kv head) when there are fewer rows than threads. */
static void run_units(job_t *j) {
    const int64_t per_row = j->B < j->step ? j->KV : 1, units = j->B * per_row;
    const size_t sp = (size_t)((j->nb * j->bs + LANES - 1) / LANES * LANES);
    float *scores = (float *)malloc(sizeof(float) * (size_t)j->H * sp);
    v16 *part = (v16 *)aligned_alloc(sizeof(v16), sizeof(v16) * (size_t)(j->H * LANES));
    v16 *acc = (v16 *)aligned_alloc(sizeof(v16), sizeof(float) * (size_t)(j->H * j->hd));
    if (!scores || !part || !acc) {
        j->status = -1;
    } else {
        for (int64_t u = j->first; u < units; u += j->step) {
            int64_t b = u / per_row, k0 = per_row == 1 ? 0 : u % per_row;
            unit(j, b, k0, per_row == 1 ? j->KV : k0 + 1, scores, part, acc);
        }
    }
    free(scores);
    free(part);
    free(acc);
}

static void worker(void *arg, int w) { run_units((job_t *)arg + w); }

/* Returns 0, or -1 when memory or a thread could not be had, or the heads are outside the
 * kernel (the caller raises). The caller has checked shapes (paged_decode_cpu.unsupported),
 * strides (in elements of the pool's dtype), block ids < NB and 1 <= seq_lens <= nb * bs.
 * kv_bf16: the pool holds bfloat16 (else float32). */
int capsule_paged_decode(const float *q, const void *k, const void *v, int kv_bf16,
                             int64_t blk_stride, int64_t slot_stride, int64_t head_stride,
                             const int64_t *tables, int64_t nb, const int64_t *seq_lens,
                             const uint8_t *valid, int64_t B, int64_t H, int64_t KV, int64_t hd,
                             int64_t bs, float scale, float *out, int threads) {
    /* the caller checked these; the registers above hold at most MAX_CHUNKS chunks a slot */
    if (hd < LANES || hd % LANES || hd > MAX_CHUNKS * LANES || H > MAX_HEADS || KV < 1 || H % KV) return -1;
    job_t base = {q, k, v, kv_bf16 != 0, blk_stride, slot_stride, head_stride, tables, seq_lens, valid,
                  B, H, KV, hd, bs, nb, scale, out, 0, 1, 0};
    if (B <= 0) return 0;   /* an empty batch: nothing to read or write */
    const int n = capsule_workers(threads, B * KV);
    job_t jobs[MAX_WORKERS];
    for (int i = 0; i < n; i++) {
        jobs[i] = base;
        jobs[i].first = i;
        jobs[i].step = n;
    }
    int status = capsule_run_workers(n, worker, jobs);
    for (int i = 0; i < n; i++) if (jobs[i].status) status = -1;
    return status;
}
