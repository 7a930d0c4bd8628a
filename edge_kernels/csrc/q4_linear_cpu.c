/* A linear layer over Q4_0 / Q4_1 weights on the CPU: y (M, N) = x (M, K) . W^T, where
 * W[n, 32 b + e] = d[n, b] * q + m[n, b], q the 4-bit code: the low nibble of byte e of block b's
 * 16 bytes for e < 16, the high nibble of byte e - 16 otherwise (the GGUF layout, kept as is).
 *
 * Why: torch's int4 kernel runs on bf16 activations and bf16 scales (~8 significant bits). This
 * one rounds each 32-block of activations to int16 on a scale of its own (~256x finer), takes
 * the code x activation products in int32 (exact: a lane's sum stays below 2^24, so it is exact
 * in fp32 too), and scales in fp32:
 *   y[n] = sum_b (sum_e q[n,b,e] xq[b,e]) * d[n,b] * sx[b]  +  sum_b m[n,b] * xsum[b]
 * where xsum is the block's fp32 activation sum (the offsets need no activation rounding).
 *
 * Order (a row's output is the same bits whatever M, the threads or the ISA): the blocks go in
 * quads. A quad's 128 products land in 16 int32 lanes, lane 4c + t holding block c's elements
 * 4t .. 4t + 3 and 16 + 4t .. 16 + 4t + 3 (what AVX-512's vpmaddwd / vpdpwssd give over the
 * quad's bytes read as words, with no shuffles); each lane adds (float(lane) * d) * sx to its
 * fp32 accumulator, quad after quad (a last quad of fewer blocks: the missing ones are zero
 * weights and zero scales); the 16 lanes are summed as vec16.h's tree, then the offset term
 * (blocks in order) is added. The AVX-512 (+VNNI), AVX2 and portable paths compute exactly these
 * operations. No fused multiply-add (setup.py passes -ffp-contract=off). No Python API: loaded
 * with ctypes by edge_kernels/cpu_library.py; q4_linear_cpu.py checks every argument first.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "parallel.h"
#include "q4_linear_cpu.h"
#include "vec16.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define Q4_X86 1
#endif

#define QBLOCK 32        /* weights per (d, m) */
#define QUAD 128         /* int16 activations of a quad of blocks: four planes of 32 (A, B, C, D) */
#define ROWS 16          /* outputs reduced together (one v16 of sums) */
#define XROWS 4          /* rows of x per pass over the weights */
#define MTILE 64         /* rows of x per sweep of a worker's weights (a prefill chunk): their int16
                            copy (~74 KB at K = 576) stays in L2 while the weights stream past */
#define XQ_MAX 32767.0f
#define PREFETCH 4096    /* bytes ahead in the weights (rows are contiguous): from DRAM, 4 KB
                            ahead cut a 120-matrix decode stack by ~10 % here; 1 KB did less */

typedef struct job job_t;
typedef void (*groups_fn)(const job_t *);

struct job {
    groups_fn groups;       /* the matmul path (pick) */
    const int16_t *xq;      /* (M, Q, 128): per quad, planes A, B, C, D (xq_slot) */
    const float *sx;        /* (M, Q, 16): block c's scale in lanes 4c .. 4c + 3 */
    const float *xsum;      /* (M, nb) */
    const uint8_t *nib;     /* (N, K / 2) */
    const float *d;         /* (N, nb) */
    const float *mt;        /* (nb, N): the offsets, transposed so 16 outputs load at once */
    float *y;               /* (M, N) */
    const float *x;         /* (M, K), for the quantizing workers */
    int64_t M, N, K, g0, g1;    /* matmul: groups of ROWS outputs g0 .. g1 - 1; quantize: x rows */
};

typedef float acc_t[XROWS][ROWS];

/* Where element e (0..31) of block c (0..3) of a quad sits among its 128 activations. The 64
 * weight bytes of a quad, read as 32 little-endian words, give per word (bytes 2k, 2k+1 of
 * block c): plane A = w & 15 (element 2k), B = (w >> 4) & 15 (2k + 16), C = (w >> 8) & 15
 * (2k + 1), D = w >> 12 (2k + 17); no byte shuffles. Activations are laid out likewise. */
static inline int xq_slot(int c, int e) {
    const int hi = e >= 16, f = e - 16 * hi, k = f / 2;
    return 32 * (2 * (f & 1) + hi) + 8 * c + k;
}

/* one block of one x row -> int16 codes and scale (and the fp32 sum), into quad slot c */
static void quantize_block(const float *v, int16_t *quad, float *sx16, float *sum, int c) {
    float amax = 0.0f, s = 0.0f;
    int finite = 1;
    for (int e = 0; e < QBLOCK; e++) {
        const float a = fabsf(v[e]);
        finite &= isfinite(v[e]) != 0;
        amax = a > amax ? a : amax;
        s = s + v[e];
    }
    *sum = s;
    float scale = 0.0f;
    if (!finite) {
        scale = NAN;                      /* a non-finite input gives a non-finite output */
    } else if (amax > 0.0f) {
        const float inv = XQ_MAX / amax;  /* |v * inv| <= 32767 + a few ulp: rounds in range */
        scale = amax / XQ_MAX;
        for (int e = 0; e < QBLOCK; e++) quad[xq_slot(c, e)] = (int16_t)lrintf(v[e] * inv);
    }
    for (int l = 0; l < 4; l++) sx16[4 * c + l] = scale;
}

static void quantize_rows(const job_t *j) {
    const int64_t K = j->K, nb = K / QBLOCK, Q = (nb + 3) / 4;
    for (int64_t m = j->g0; m < j->g1; m++)
        for (int64_t b = 0; b < nb; b++)
            quantize_block(j->x + m * K + b * QBLOCK, (int16_t *)j->xq + (m * Q + b / 4) * QUAD,
                           (float *)j->sx + (m * Q + b / 4) * 16, (float *)j->xsum + m * nb + b, (int)(b & 3));
}

/* The weights of quad q of a row: its 64 bytes and 4 scales, or for a last quad of fewer than
 * 4 blocks a zero-padded copy (the missing blocks are zero weights of zero scale: their lanes
 * add (0 * 0) * 0 on every path). */
static inline __attribute__((always_inline))
int quad_weights(const uint8_t *w, const float *dr, int64_t nb, int64_t q, uint8_t tw[64], float td[4],
                 const uint8_t **wq, const float **dq) {
    if (4 * q + 4 <= nb) {
        *wq = w + 64 * q;
        *dq = dr + 4 * q;
        return 0;
    }
    const int blocks = (int)(nb - 4 * q);
    memset(tw, 0, 64);
    memcpy(tw, w + 64 * q, (size_t)(16 * blocks));
    for (int c = 0; c < 4; c++) td[c] = c < blocks ? dr[4 * q + c] : 0.0f;
    *wq = tw;
    *dq = td;
    return 1;
}

/* one quad (64 weight bytes wq, scales dq) into acc, lanes as the header says: the reference.
 * Word k (bytes 2k, 2k + 1) feeds lane k / 2. */
static inline __attribute__((always_inline))
void quad_portable(const job_t *j, const uint8_t *wq, const float *dq, int64_t q, int64_t m0, int64_t mm,
                   acc_t acc) {
    const int64_t Q = (j->K / QBLOCK + 3) / 4;
    for (int64_t m = 0; m < mm; m++) {
        const int16_t *xp = j->xq + ((m0 + m) * Q + q) * QUAD;
        const float *sp = j->sx + ((m0 + m) * Q + q) * 16;
        int32_t lane[16] = {0};
        for (int k = 0; k < 32; k++) {
            const int32_t wd = wq[2 * k] | (wq[2 * k + 1] << 8);
            lane[k >> 1] += (wd & 15) * xp[k] + ((wd >> 4) & 15) * xp[32 + k]
                          + ((wd >> 8) & 15) * xp[64 + k] + (wd >> 12) * xp[96 + k];
        }
        for (int i = 0; i < 16; i++) acc[m][i] = acc[m][i] + ((float)lane[i] * dq[i / 4]) * sp[i];
    }
}

static inline __attribute__((always_inline))
void row_portable1(const job_t *j, const uint8_t *w, const float *dr, int64_t m0, int64_t mm, acc_t acc) {
    const int64_t nb = j->K / QBLOCK, Q = (nb + 3) / 4;
    uint8_t tw[64];
    float td[4];
    for (int64_t q = 0; q < Q; q++) {
        const uint8_t *wq;
        const float *dq;
        quad_weights(w, dr, nb, q, tw, td, &wq, &dq);
        quad_portable(j, wq, dq, q, m0, mm, acc);
    }
}

static inline __attribute__((always_inline))
void row_portable(const job_t *j, const uint8_t *w, const float *dr, int64_t m0, int64_t mm, acc_t *acc, int R) {
    for (int r = 0; r < R; r++) row_portable1(j, w + r * j->K / 2, dr + r * j->K / QBLOCK, m0, mm, acc[r]);
}

#ifdef Q4_X86
/* AVX-512: a quad is one register of 32 words; MADD4(acc, a, b, c, d, x) adds the four planes'
 * pair products to 16 int32 lanes (vpdpwssd where the CPU has VNNI, vpmaddwd + vpaddd else). */
#define ROW_AVX512(NAME, TARGET, MADD4)                                                              \
__attribute__((target(TARGET), always_inline)) static inline                                        \
void NAME(const job_t *j, const uint8_t *w, const float *dr, int64_t m0, const int64_t mm, acc_t *acc, \
          const int R) {                                                                             \
    const int64_t nb = j->K / QBLOCK, Q = (nb + 3) / 4, half = j->K / 2;                             \
    const __m512i low4 = _mm512_set1_epi16(0x0F);                                                    \
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);         \
    __m512 a[2][XROWS];                                                                              \
    for (int r = 0; r < R; r++)                                                                      \
        for (int64_t m = 0; m < mm; m++) a[r][m] = _mm512_setzero_ps();                              \
    for (int64_t q = 0; q < Q; q++) {                                                                \
        /* a last quad of fewer blocks: masked loads, the missing blocks zero weights and scales */ \
        const int blocks = nb - 4 * q < 4 ? (int)(nb - 4 * q) : 4;                                   \
        const __mmask32 wmask = (__mmask32)(0xFFFFFFFFull >> (32 - 8 * blocks));                     \
        const __mmask16 dmask = (__mmask16)((1u << blocks) - 1);                                     \
        for (int r = 0; r < R; r++) {                                                                \
            _mm_prefetch((const char *)(w + r * half + 64 * q + PREFETCH), _MM_HINT_T0);            \
            const __m512i wv = _mm512_maskz_loadu_epi16(wmask, w + r * half + 64 * q);               \
            const __m512i pa = _mm512_and_si512(wv, low4);                                           \
            const __m512i pb = _mm512_and_si512(_mm512_srli_epi16(wv, 4), low4);                     \
            const __m512i pc = _mm512_and_si512(_mm512_srli_epi16(wv, 8), low4);                     \
            const __m512i pd = _mm512_srli_epi16(wv, 12);                                            \
            const __m512 dv = _mm512_permutexvar_ps(spread, _mm512_maskz_loadu_ps(dmask, dr + r * nb + 4 * q)); \
            for (int64_t m = 0; m < mm; m++) {                                                       \
                const int16_t *xp = j->xq + ((m0 + m) * Q + q) * QUAD;                               \
                __m512i lane = _mm512_setzero_si512();                                               \
                MADD4(lane, pa, pb, pc, pd, xp);                                                     \
                const __m512 s = _mm512_loadu_ps(j->sx + ((m0 + m) * Q + q) * 16);                   \
                a[r][m] = _mm512_add_ps(a[r][m], _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(lane), dv), s)); \
            }                                                                                        \
        }                                                                                            \
    }                                                                                                \
    for (int r = 0; r < R; r++)                                                                      \
        for (int64_t m = 0; m < mm; m++) _mm512_storeu_ps(acc[r][m], a[r][m]);                       \
}

#define X512(xp, i) _mm512_loadu_si512((xp) + 32 * (i))
#define MADD4_BW(lane, pa, pb, pc, pd, xp)                                                           \
    lane = _mm512_add_epi32(_mm512_add_epi32(_mm512_madd_epi16(pa, X512(xp, 0)), _mm512_madd_epi16(pb, X512(xp, 1))), \
                            _mm512_add_epi32(_mm512_madd_epi16(pc, X512(xp, 2)), _mm512_madd_epi16(pd, X512(xp, 3))))
#define MADD4_VNNI(lane, pa, pb, pc, pd, xp)                                                         \
    lane = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_dpwssd_epi32(          \
        lane, pa, X512(xp, 0)), pb, X512(xp, 1)), pc, X512(xp, 2)), pd, X512(xp, 3))

ROW_AVX512(row_avx512, "avx512f,avx512bw", MADD4_BW)
ROW_AVX512(row_avx512vnni, "avx512f,avx512bw,avx512vnni", MADD4_VNNI)

/* AVX2: a quad is two registers of 16 words (blocks 0-1: lanes 0-7, blocks 2-3: lanes 8-15) */
__attribute__((target("avx2"), always_inline)) static inline
void row_avx2_1(const job_t *j, const uint8_t *w, const float *dr, int64_t m0, const int64_t mm, acc_t acc) {
    const int64_t nb = j->K / QBLOCK, Q = (nb + 3) / 4;
    const __m256i low4 = _mm256_set1_epi16(0x0F);
    uint8_t tw[64];
    float td[4];
    __m256 a[XROWS][2];
    for (int64_t m = 0; m < mm; m++) a[m][0] = a[m][1] = _mm256_setzero_ps();
    for (int64_t q = 0; q < Q; q++) {
        const uint8_t *wq;
        const float *dq;
        quad_weights(w, dr, nb, q, tw, td, &wq, &dq);
        for (int h = 0; h < 2; h++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(wq + 32 * h));
            const __m256i pa = _mm256_and_si256(wv, low4);
            const __m256i pb = _mm256_and_si256(_mm256_srli_epi16(wv, 4), low4);
            const __m256i pc = _mm256_and_si256(_mm256_srli_epi16(wv, 8), low4);
            const __m256i pd = _mm256_srli_epi16(wv, 12);
            const __m256 dv = _mm256_set_ps(dq[2 * h + 1], dq[2 * h + 1], dq[2 * h + 1], dq[2 * h + 1],
                                            dq[2 * h], dq[2 * h], dq[2 * h], dq[2 * h]);
            for (int64_t m = 0; m < mm; m++) {
                const int16_t *xp = j->xq + ((m0 + m) * Q + q) * QUAD + 16 * h;
#define X256(i) _mm256_loadu_si256((const __m256i *)(xp + 32 * (i)))
                const __m256i lane = _mm256_add_epi32(
                    _mm256_add_epi32(_mm256_madd_epi16(pa, X256(0)), _mm256_madd_epi16(pb, X256(1))),
                    _mm256_add_epi32(_mm256_madd_epi16(pc, X256(2)), _mm256_madd_epi16(pd, X256(3))));
#undef X256
                const __m256 s = _mm256_loadu_ps(j->sx + ((m0 + m) * Q + q) * 16 + 8 * h);
                a[m][h] = _mm256_add_ps(a[m][h], _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(lane), dv), s));
            }
        }
    }
    for (int64_t m = 0; m < mm; m++) {
        _mm256_storeu_ps(acc[m], a[m][0]);
        _mm256_storeu_ps(acc[m] + 8, a[m][1]);
    }
}

__attribute__((target("avx2"), always_inline)) static inline
void row_avx2(const job_t *j, const uint8_t *w, const float *dr, int64_t m0, const int64_t mm, acc_t *acc, int R) {
    for (int r = 0; r < R; r++) row_avx2_1(j, w + r * j->K / 2, dr + r * j->K / QBLOCK, m0, mm, acc[r]);
}
#endif

/* the offset term of outputs n0 .. n0 + n - 1 for x row m, blocks in order, into t */
static inline __attribute__((always_inline)) void offsets(const job_t *j, int64_t n0, int64_t n, int64_t m, float *t) {
    const int64_t nb = j->K / QBLOCK;
    const float *xs = j->xsum + m * nb;
    if (n == ROWS) {
        v16 s = (v16){0};
        for (int64_t b = 0; b < nb; b++) s = s + load16(j->mt + b * j->N + n0) * xs[b];
        store16(t, s);
        return;
    }
    for (int64_t r = 0; r < n; r++) {
        float s = 0.0f;
        for (int64_t b = 0; b < nb; b++) s = s + j->mt[b * j->N + n0 + r] * xs[b];
        t[r] = s;
    }
}

/* the 16 lanes of each output row reduced (vec16.h's tree), plus its offset term */
static inline __attribute__((always_inline))
void finish(const job_t *j, int64_t n0, int64_t n, int64_t m0, int64_t mm, v16 part[XROWS][ROWS]) {
    for (int64_t m = 0; m < mm; m++) {
        float t[ROWS];
        float *ym = j->y + (m0 + m) * j->N + n0;
        offsets(j, n0, n, m0 + m, t);
        if (n == ROWS) {
            store16(ym, reduce16(part[m]) + load16(t));
        } else {
            for (int64_t r = 0; r < n; r++) ym[r] = lane_sum(part[m][r]) + t[r];
        }
    }
}

/* every group of this worker, each x-row tile of it: ROW(j, w, dr, m0, mm, acc) fills the lanes */
#define GROUPS_BODY(ROW)                                                                        \
    const int64_t half = j->K / 2, nb = j->K / QBLOCK;                                          \
    for (int64_t t0 = 0; t0 < j->M; t0 += MTILE) {                                              \
      const int64_t t1 = j->M - t0 < MTILE ? j->M : t0 + MTILE;                                 \
      for (int64_t g = j->g0; g < j->g1; g++) {                                                 \
        const int64_t n0 = g * ROWS, n = j->N - n0 < ROWS ? j->N - n0 : ROWS;                   \
        for (int64_t m0 = t0; m0 < t1; m0 += XROWS) {                                          \
            const int64_t mm = t1 - m0 < XROWS ? t1 - m0 : XROWS;                               \
            v16 part[XROWS][ROWS];                                                              \
            for (int64_t r = 0; r < n; r += 2) {   /* two weight rows a pass: more to overlap */ \
                acc_t acc[2] = {{{0}}};                                                         \
                const uint8_t *w = j->nib + (n0 + r) * half;                                    \
                const float *dr = j->d + (n0 + r) * nb;                                         \
                const int R = r + 1 < n ? 2 : 1;                                                \
                switch (mm * 2 + R - 1) {   /* constant counts: the loops unroll */             \
                case 9: ROW(j, w, dr, m0, 4, acc, 2); break;                                    \
                case 8: ROW(j, w, dr, m0, 4, acc, 1); break;                                    \
                case 7: ROW(j, w, dr, m0, 3, acc, 2); break;                                    \
                case 6: ROW(j, w, dr, m0, 3, acc, 1); break;                                    \
                case 5: ROW(j, w, dr, m0, 2, acc, 2); break;                                    \
                case 4: ROW(j, w, dr, m0, 2, acc, 1); break;                                    \
                case 3: ROW(j, w, dr, m0, 1, acc, 2); break;                                    \
                default: ROW(j, w, dr, m0, 1, acc, 1); break;                                   \
                }                                                                               \
                for (int k = 0; k < R; k++)                                                     \
                    for (int64_t m = 0; m < mm; m++) part[m][r + k] = load16(acc[k][m]);        \
            }                                                                                   \
            finish(j, n0, n, m0, mm, part);                                                     \
        }                                                                                       \
      }                                                                                         \
    }

static void groups_portable(const job_t *j) { GROUPS_BODY(row_portable) }
#ifdef Q4_X86
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static void groups_avx512vnni(const job_t *j) { GROUPS_BODY(row_avx512vnni) }
__attribute__((target("avx512f,avx512bw"))) static void groups_avx512(const job_t *j) { GROUPS_BODY(row_avx512) }
__attribute__((target("avx2"))) static void groups_avx2(const job_t *j) { GROUPS_BODY(row_avx2) }
#endif

/* path 0: the widest this CPU has; 1: portable; 2: AVX2; 3: AVX-512 without VNNI; 4: AVX-512
 * with VNNI. NULL where the CPU lacks the one asked for. */
static groups_fn pick(int path) {
#ifdef Q4_X86
    const int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    const int vnni = avx512 && __builtin_cpu_supports("avx512vnni"), avx2 = __builtin_cpu_supports("avx2");
    if (path == 0) path = vnni ? 4 : avx512 ? 3 : avx2 ? 2 : 1;
    if (path == 4) return vnni ? groups_avx512vnni : NULL;
    if (path == 3) return avx512 ? groups_avx512 : NULL;
    if (path == 2) return avx2 ? groups_avx2 : NULL;
#endif
    return path <= 1 ? groups_portable : NULL;
}

static void matmul_worker(void *arg, int w) {
    const job_t *j = (const job_t *)arg + w;
    j->groups(j);
}
static void quantize_worker(void *arg, int w) { quantize_rows((const job_t *)arg + w); }

/* Returns 0; -1 when a thread could not be started, -2 when the activations' buffer could not
 * be allocated, -3 when this CPU lacks `path` (pick; the tests check every path gives the same
 * bits). The caller has checked: M, N >= 1, K a positive multiple of 32, every
 * array contiguous and of its size. */
int capsule_q4_linear(const float *x, int64_t M, const uint8_t *nib, const float *d, const float *mt,
                      int64_t N, int64_t K, float *y, int threads, int path) {
    const groups_fn groups = pick(path);
    if (!groups) return -3;
    const int64_t nb = K / QBLOCK, Q = (nb + 3) / 4;
    const size_t xq_bytes = (size_t)(M * Q * QUAD) * sizeof(int16_t);
    const size_t sx_bytes = (size_t)(M * Q * 16) * sizeof(float);
    char *buf = calloc(1, xq_bytes + sx_bytes + (size_t)(M * nb) * sizeof(float));
    if (!buf) return -2;
    job_t base = {groups, (const int16_t *)buf, (const float *)(buf + xq_bytes), (const float *)(buf + xq_bytes + sx_bytes),
                  nib, d, mt, y, x, M, N, K, 0, 0};
    job_t jobs[MAX_WORKERS];
    int n = capsule_workers(threads, M);   /* quantize: x rows split between workers */
    for (int i = 0; i < n; i++) {
        jobs[i] = base;
        jobs[i].g0 = M * i / n;
        jobs[i].g1 = M * (i + 1) / n;
    }
    int rc = capsule_run_workers(n, quantize_worker, jobs);
    if (rc == 0) {
        const int64_t G = (N + ROWS - 1) / ROWS;
        n = capsule_workers(threads, G);
        for (int i = 0; i < n; i++) {
            jobs[i] = base;
            jobs[i].g0 = G * i / n;
            jobs[i].g1 = G * (i + 1) / n;
        }
        rc = capsule_run_workers(n, matmul_worker, jobs);
    }
    free(buf);
    return rc;
}
