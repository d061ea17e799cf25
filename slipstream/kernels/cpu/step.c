// The whole decode step of a Llama-family model as one native call: a persistent team of threads
// runs a table of tile tasks (runtime/cpu_plan.py builds and validates it) linked by event counters.
//
// This is the CPU twin of the GPU megakernel (DESIGN.md, engine layer step 4). Tasks are taken in
// their topological order from one ticket counter; a task first waits until its event counter has
// reached its count, runs, then adds one to the event it signals. Because a task only waits on events
// signalled by tasks earlier in the order, any number of threads (one included) completes the table.
// There is no fork/join barrier between operators: a thread that finishes its part of the QKV product
// moves straight on to attention heads whose inputs are ready. Waiting spins briefly and then sleeps on
// a futex, so a neighbour process that takes a core slows the step down instead of stalling it: the
// threads that run keep taking tickets.
//
// Buffers, weights and the KV cache are owned by Python (torch tensors); this file owns only the
// threads and a per-thread scratch for attention scores.
#define _GNU_SOURCE
#include <limits.h>
#include <stdio.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <alloca.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "step.h"

// -- products over a tile of weight rows -------------------------------------------------------------
// Weight rows are prefetched into L2 this many bytes ahead of the row being multiplied (within the
// matrix, past the task's own tile): the hardware prefetchers alone leave the product waiting on
// DRAM, compute and memory taking turns. 32 KB measured best on the Zen 3 EPYC (AVX2) with the one-row
// paired kernels (2026-11-24); with the 8-row kernels, which also prefetch the next block of 8 rows, the
// same machine kind measured 4-8 KB best: 32 KB 1.20x slower at batch 1 and 1.09x at batch 8 (step_ab.py,
// 2026-12-02), so AMD CPUs without AVX-512 (Zen 2/3, 512 KB L2) start at 8 KB; the AVX-512 ones (Zen 4/5,
// 1 MB L2) keep 32 KB. On the Sapphire Rapids Xeon (2 MB L2, whose own streamer runs further ahead) 8-16 KB
// measured best, 32 KB 4-5% slower at batch 1 and 8 (step_ab.py, 2026-11-25): Intel CPUs start at 12 KB.
// ss_set_prefetch changes it (0: off).
static int pf_bytes = 32768;
void ss_set_prefetch(int bytes) { pf_bytes = bytes > 0 ? bytes : 0; }
#if defined(__x86_64__) || defined(__i386__)
__attribute__((constructor)) static void pf_default(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_is("intel")) pf_bytes = 12288;
    else if (__builtin_cpu_is("amd") && !__builtin_cpu_supports("avx512f")) pf_bytes = 8192;
}
#endif
#if defined(SS_AVX2) && defined(__F16C__)
enum { q4_half_direct = 1 };   // fp16 q4 scales go to q4p_row as they are
#else
enum { q4_half_direct = 0 };
#endif
#if defined(SS_AVX2)
// The 8 weight rows from n's scales and offsets gathered from the [N][G] planes as fp32 [G][8] (q4i_rows8,
// q8i_rows8; a q8 matrix's offsets come out as -8 x its scales, unread),
// rows past `live` repeating the last live row's: for blocks that do not start on a multiple of 8, where the
// loader made no tile-ordered copy, and for Q4_K's 6-bit scales (widened a row at a time into rs and rm,
// [G] each). The same values as the copy's and as the planes'.
static void rows8_gather(const SSMat *m, int n, int live, int G, int half, float *sc8, float *mn8, float *rs, float *rm) {
    const int k6 = m->qtype == Q4_K6;
    for (int r = 0; r < 8; r++) {
        const int64_t row = n + (r < live ? r : live - 1);
        if (k6) {
            ss_k6_row((const uint8_t *)m->scale + row * G, (const uint8_t *)m->min + row * G, m->kdm + row * (G / 4), G, rs, rm);
            for (int g = 0; g < G; g++) sc8[8 * g + r] = rs[g], mn8[8 * g + r] = rm[g];
            continue;
        }
        for (int g = 0; g < G; g++) {
            const int64_t e = row * G + g;
            const float s = half ? ss_half_to_f32(((const uint16_t *)m->scale)[e]) : m->scale[e];
            sc8[8 * g + r] = s;
            mn8[8 * g + r] = !m->min ? -8.f * s : half ? ss_half_to_f32(((const uint16_t *)m->min)[e]) : m->min[e];
        }
    }
}

// ss_set_rows8: bit 0 the q4 products, bit 1 the q8 ones, bit 2 Q6_K's (and the per-16 IQ planes'), bit 3 Q5_K's, bit 4 Q5_0's and Q5_1's, bit 5
// IQ4_NL's and IQ4_XS's; a kind without its bit goes back to q4p_row / q8p_row / qt_rb6_q8_row / qt_rb_q8_row (A/B).
// Batch 1 comes first, so a bit is on by default only where its 8-row kernel costs nothing there (step_ab.py on
// the re-quantized default model; docs/BENCHMARKS.md, 2026-11-29 and 2026-12-01):
//   bit 4 (Q5_0, Q5_1) on AVX-512 builds: batch 1 0.96-1.00x, batch 8 0.74x (the Zen 5 EPYC); AVX2 builds (16 vector
//     registers for the fifth bits' decoding) 1.04-1.12x slower at batch 1 though 0.70-0.82x at batch 8; and off on
//     Zen 4 (AMD family 0x19, double-pumped 512-bit units: batch 1 1.069-1.099x slower in four runs, batch 2 1.01x,
//     batch 8 0.87x; the Zen 4 EPYC, 2026-12-03), by CPUID at load;
//   bit 3 (Q5_K) likewise off on Zen 4: batch 1 1.043-1.071x slower in four runs, batch 8 0.67x (a Q5_K_M file of
//     kquant_model.py);
//   bit 5 (IQ4_NL, IQ4_XS) on VNNI builds (AVX-512 VNNI, AVX-VNNI): batch 1 0.92-1.07x (median 1.04x), batch 8
//     0.73-0.76x, prompt chunks 0.91-0.96x; plain
//     AVX2 (maddubs: the signed codes' sign trick and a madd per dword) 1.09-1.11x slower at batch 1, 0.90-0.93x at 8.
#if defined(SS_AVX512)
#define SS_ROWS8_DEFAULT 63
#elif defined(SS_VNNI)
#define SS_ROWS8_DEFAULT 47
#else
#define SS_ROWS8_DEFAULT 15
#endif
int rows8_usable = SS_ROWS8 ? SS_ROWS8_DEFAULT : 0;
// SLIPSTREAM_ROWS8 at load: 0 the one-row kernels for every kind; a number, that ss_set_rows8 mask (A/B runs)
__attribute__((constructor)) static void rows8_default(void) {
#if defined(SS_TWIN)
    if (amd_family() == 0x19) rows8_usable &= ~(8 | 16);   // Zen 4: Q5_K's and Q5_0/Q5_1's (above)
#endif
    const char *env = getenv("SLIPSTREAM_ROWS8");
    if (env && env[0] >= '0' && env[0] <= '9') rows8_usable = SS_ROWS8 ? atoi(env) & 63 : 0;
}
// Into L2, once per 16 rows: the tile-ordered scales (and mins) of the block of 16 that holds row nx, `len`
// bytes per block (the 8-row kernels prefetch the block pf_rows ahead of the one they multiply)
static inline void rows8_prefetch_tiles(const SSMat *m, int64_t nx, int64_t len) {
    if (!m->scale_t || nx >= m->n || (nx >> 4) == ((nx - 8) >> 4)) return;
    const int64_t at = (nx >> 4) * len;
    for (int64_t o = 0; o < len; o += 64) {
        __builtin_prefetch((const char *)m->scale_t + at + o, 0, 2);
        if (m->min_t) __builtin_prefetch((const char *)m->min_t + at + o, 0, 2);
    }
}



// Rows [n0, n1) of a q4 matrix (fp32 or fp16 scales) on the fast path, 8 weight rows at a time (simd.h,
// q4i_rows8), against up to MAX_ROWS activation rows
__attribute__((noinline)) static void q4i_rows(const SSMat *m, int n0, int n1, int nb, const SSAct *x, float *y,
                                              int ystride, int accumulate, int half, int pf_rows, int eo) {
    const int K = m->k, G = K / 32;
    const int64_t row_bytes = K / 2;
    float *sc8 = alloca(sizeof(float) * 8 * G), *mn8 = alloca(sizeof(float) * 8 * G);
    float *rs = alloca(sizeof(float) * G), *rm = alloca(sizeof(float) * G);
    const int k6 = m->qtype == Q4_K6;
    const int compact = k6 && m->tile_k && m->scale_t && F16C_BUILD;   // Q4_K's compact tile copy
    for (int n = n0; n < n1; n += 8) {
        const int live = n1 - n < 8 ? n1 - n : 8;
        if (pf_rows && k6 && !compact && n + pf_rows < m->n) {   // the 6-bit scales: a row's G bytes (and G mins) and its d, dmin
            const int64_t r = n + pf_rows;
            for (int64_t o = 0; o < 8 * (int64_t)G; o += 64) {
                __builtin_prefetch((const uint8_t *)m->scale + r * G + o, 0, 2);
                __builtin_prefetch((const uint8_t *)m->min + r * G + o, 0, 2);
            }
            for (int64_t o = 0; o < 8 * (int64_t)(G / 4) * 2; o += 64) __builtin_prefetch((const char *)(m->kdm + r * (G / 4)) + o, 0, 2);
        }
        if (pf_rows) rows8_prefetch_tiles(m, n + pf_rows, compact ? 20 * (int64_t)G : 16 * (int64_t)G * (half ? 2 : 4));
        const uint8_t *w[8];
        for (int r = 0; r < 8; r++) w[r] = (const uint8_t *)m->q + (int64_t)(n + (r < live ? r : live - 1)) * row_bytes;
        // the scales: the tile-ordered copy read in place (fp16 or fp32, 16 rows per group), or gathered
        const void *sc = sc8, *mn = mn8;
        int64_t ss = 8;
        int sh = 0;
        if (compact && (n & 7) == 0) {
            const int64_t at = (int64_t)(n >> 4) * 20 * G;
            sc = (const char *)m->scale_t + at, mn = (const char *)m->min_t + at;
            ss = n & 8, sh = 2;
        } else if (m->scale_t && !k6 && (n & 7) == 0 && (half ? F16C_BUILD : 1)) {
            const int64_t at = (int64_t)(n >> 4) * G * 16 + (n & 8);
            const int64_t esz = half ? 2 : 4;
            sc = (const char *)m->scale_t + at * esz, mn = m->min_t ? (const char *)m->min_t + at * esz : NULL;
            ss = 16, sh = half;
        } else {
            rows8_gather(m, n, live, G, half, sc8, mn8, rs, rm);
        }
        const char *pf = pf_rows && n + pf_rows + 8 <= m->n ? (const char *)m->q + (int64_t)(n + pf_rows) * row_bytes : NULL;
        __m256 out[MAX_ROWS];
#define Q4I(NB) q4i_rows8(w, sc, mn, sh, ss, G, x->q, x->d, x->s, NB, pf, eo, out)
        SS_BY_ROWS(nb, Q4I)
#undef Q4I
        rows8_store(m, out, nb, n, live, y, ystride, accumulate);
    }
}

// Rows [n0, n1) of a q8 matrix (fp32 or fp16 scales) on the fast path, 8 weight rows at a time (simd.h,
// q8i_rows8), against up to MAX_ROWS activation rows; scales as q4i_rows
__attribute__((noinline)) static void q8i_rows(const SSMat *m, int n0, int n1, int nb, const SSAct *x, float *y,
                                              int ystride, int accumulate, int half, int pf_rows, int eo) {
    const int K = m->k, G = K / 32;
    float *sc8 = alloca(sizeof(float) * 8 * G), *mn8 = alloca(sizeof(float) * 8 * G);
    for (int n = n0; n < n1; n += 8) {
        const int live = n1 - n < 8 ? n1 - n : 8;
        if (pf_rows) rows8_prefetch_tiles(m, n + pf_rows, 16 * (int64_t)G * (half ? 2 : 4));
        const int8_t *w[8];
        for (int r = 0; r < 8; r++) w[r] = (const int8_t *)m->q + (int64_t)(n + (r < live ? r : live - 1)) * K;
        const void *sc = sc8;
        int64_t ss = 8;
        int sh = 0;
        if (m->scale_t && (n & 7) == 0 && (half ? F16C_BUILD : 1)) {
            sc = (const char *)m->scale_t + ((int64_t)(n >> 4) * G * 16 + (n & 8)) * (half ? 2 : 4);
            ss = 16, sh = half;
        } else {
            rows8_gather(m, n, live, G, half, sc8, mn8, NULL, NULL);   // mn8: unread (q8 has no offsets)
        }
        const char *pf = pf_rows && n + pf_rows + 8 <= m->n ? (const char *)m->q + (int64_t)(n + pf_rows) * K : NULL;
        __m256 out[MAX_ROWS];
#define Q8I(NB) q8i_rows8(w, sc, sh, ss, G, x->q, x->d, NB, pf, eo, out)
        SS_BY_ROWS(nb, Q8I)
#undef Q8I
        rows8_store(m, out, nb, n, live, y, ystride, accumulate);
    }
}
#endif

// Rows [n0, n1) of a q4 or q8 matrix against up to MAX_ROWS activation rows: one loop nest per (kind,
// path, row count), in a function of its own. Inlined into mat_rows' one row loop with every other
// kernel, GCC kept the kernels' constants live across all of them and spilled them (perf annotate of
// the batch-8 step: stack reloads among the hottest instructions); a call per row instead cost the
// batch-1 step 3-5%. mat_rows brings more rows than MAX_ROWS here MAX_ROWS at a time. fp16 scales:
// read as they are by the AVX2 paired products (F16C), widened per row for the others.
__attribute__((noinline)) static void q_rows(const SSMat *m, int n0, int n1, int nb, const SSAct *x, float *y,
                                             int ystride, int accumulate, int exact, int half, int pf_rows,
                                             int64_t code_bytes, int64_t scale_bytes) {
    const int K = m->k, G = K / 32;
    const float *xf = x->f, *xd = x->d, *xs = x->s;
    const int8_t *xq = x->q;
    const int64_t sstep = (int64_t)G * (half ? 2 : 4);   // bytes of scales per row
    const int k6 = m->kind == KIND_Q4 && m->qtype == Q4_K6;   // a Q4_K matrix's 6-bit scales, widened per row
    float *scb = alloca(sizeof(float) * G), *mnb = alloca(sizeof(float) * G);
#define QR_PREFETCH(n)                                                                             \
    if (pf_rows && (n) + pf_rows < m->n) {                                                          \
        const int64_t r = (n) + pf_rows;                                                            \
        const char *c = (const char *)m->q + r * code_bytes;                                        \
        for (int64_t o = 0; o < code_bytes; o += 64) __builtin_prefetch(c + o, 0, 2);              \
        __builtin_prefetch((const char *)m->scale + r * scale_bytes, 0, 2);                         \
        if (m->min) __builtin_prefetch((const char *)m->min + r * scale_bytes, 0, 2);               \
        if (k6) __builtin_prefetch(m->kdm + r * (G / 4), 0, 2);                                     \
    }
#define QR_STORE(n, NB)                                                                            \
    for (int b = 0; b < (NB); b++) {                                                                \
        float *yo = y + (int64_t)b * ystride + (n);                                                 \
        const float v = m->bias ? out[b] + m->bias[n] : out[b];                                     \
        *yo = accumulate ? *yo + v : v;                                                             \
    }
#define QR_SCALES(n)   /* the row's scales (and mins) as fp32 */                                  \
    const float *sc = scb, *mn = m->min ? mnb : NULL;                                               \
    if (k6) {                                                                                       \
        QR_K6(n);                                                                                   \
    } else if (half) {                                                                              \
        ss_f16_row((const uint16_t *)m->scale + (int64_t)(n) * G, scb, G);                          \
        if (m->min) ss_f16_row((const uint16_t *)m->min + (int64_t)(n) * G, mnb, G);                \
    } else {                                                                                        \
        sc = (const float *)m->scale + (int64_t)(n) * G;                                            \
        if (m->min) mn = (const float *)m->min + (int64_t)(n) * G;                                  \
    }                                                                                               \
    if (!m->min && m->kind == KIND_Q4) {   /* Q4_0: no min plane, the offset is -8 x the scale */  \
        for (int g_ = 0; g_ < G; g_++) mnb[g_] = -8.f * sc[g_];                                    \
        mn = mnb;                                                                                   \
    }
#define QR_K6(n) ss_k6_row((const uint8_t *)m->scale + (int64_t)(n) * G, (const uint8_t *)m->min + (int64_t)(n) * G, \
                         m->kdm + (int64_t)(n) * (G / 4), G, scb, mnb)
#define QR_LOOP(NB, BODY)                                                                          \
    for (int n = n0; n < n1; n++) {                                                                 \
        float out[MAX_ROWS];                                                                        \
        QR_PREFETCH(n)                                                                              \
        BODY                                                                                        \
        QR_STORE(n, NB)                                                                             \
    }
#define W4(n) ((const uint8_t *)m->q + (int64_t)(n) * (K / 2))
#define W8(n) ((const int8_t *)m->q + (int64_t)(n) * K)
#define Q4F(NB) QR_LOOP(NB, QR_SCALES(n) q4f_row(W4(n), sc, mn, G, xf, K, xs, NB, out);)
#define Q8F(NB) QR_LOOP(NB, QR_SCALES(n) q8f_row(W8(n), sc, G, xf, K, NB, out);)
#define Q4Q(NB) QR_LOOP(NB, QR_SCALES(n) q4q8_row(W4(n), sc, mn, G, xq, xd, xs, NB, out);)
#define Q8Q(NB) QR_LOOP(NB, QR_SCALES(n) q8q8_row(W8(n), sc, G, xq, xd, NB, out);)
#if defined(SS_AVX2)
#define Q4P(NB) QR_LOOP(NB, if (k6) { QR_K6(n); q4p_row(W4(n), scb, mnb, 0, G, x->p, xd, x->e, xs, NB, out); } else        \
                                q4p_row(W4(n), (const char *)m->scale + n * sstep, m->min ? (const char *)m->min + n * sstep : NULL, \
                                        half, G, x->p, xd, x->e, xs, NB, out);)
#define Q8P(NB) QR_LOOP(NB, q8p_row(W8(n), (const char *)m->scale + n * sstep, half, G, x->p, xd, x->e, NB, out);)
    if (!exact && m->kind == KIND_Q4 && rows8_on(m) && x->q) {
        q4i_rows(m, n0, n1, nb, x, y, ystride, accumulate, half, pf_rows, 0);
        return;
    }
    if (!exact && m->kind == KIND_Q8 && rows8_on(m) && x->q) {
        q8i_rows(m, n0, n1, nb, x, y, ystride, accumulate, half, pf_rows, 0);
        return;
    }
    if (!exact && SS_Q4_PAIRS && x->p && (!half || q4_half_direct)) {
        if (m->kind == KIND_Q4) { SS_BY_ROWS(nb, Q4P) } else { SS_BY_ROWS(nb, Q8P) }
        return;
    }
#undef Q8P
#undef Q4P
#endif
    if (exact) {
        if (m->kind == KIND_Q4) { SS_BY_ROWS(nb, Q4F) } else { SS_BY_ROWS(nb, Q8F) }
    } else {
        if (m->kind == KIND_Q4) { SS_BY_ROWS(nb, Q4Q) } else { SS_BY_ROWS(nb, Q8Q) }
    }
#undef Q8Q
#undef Q4Q
#undef Q8F
#undef Q4F
#undef W8
#undef W4
#undef QR_LOOP
#undef QR_K6
#undef QR_SCALES
#undef QR_STORE
#undef QR_PREFETCH
}


// `a` advanced by `r` rows of K columns (a view of an activation's rows r..)
static SSAct act_rows(const SSAct *a, int64_t r, int K) {
    const int64_t G = K / 32;
    return (SSAct){a->f + r * K, a->q ? a->q + r * K : NULL, a->d ? a->d + r * G : NULL, a->s ? a->s + r * G : NULL,
                   a->p ? a->p + r * K : NULL, a->e ? a->e + r * 4 * G : NULL, a->h ? a->h + r * (K / 16) : NULL};
}

// Whether the fast path's q4/q8 products run on the twin (and tiles) where this build has them: 1 by default;
// ss_set_twin(0) (or SLIPSTREAM_TWIN=0 at load) puts them, tiles included, on the AVX2 builds' kernels and
// arithmetic instead (the 8-row kernels with one sum, or with ss_set_rows8(0) the paired ones), for A/B
// measurements. Returns the resulting state (0 on builds without the twin).
int ss_set_twin(int on) {
#ifdef SS_TWIN
    twin_usable = on != 0;
    return twin_usable;
#else
    (void)on;
    return 0;
#endif
}

// Whether the AVX2 fast path's q4 (bit 0 of `on`), q8 (bit 1), Q6_K (bit 2), Q5_K (bit 3) and Q5_0/Q5_1 (bit 4)
// products take 8 weight rows at a time (q4i_rows, q8i_rows, q6i_rows, q5i_rows: the default 15, bits 0-3) or one
// (q4p_row, q8p_row on paired activations, qt_rb6_q8_row, qt_rb_q8_row: another fp32 order), for A/B measurements;
// returns the resulting state (0 on builds without the 8-row kernels)
int ss_rows8(void) {   // the current ss_set_rows8 state, read only (tests restore it)
#if defined(SS_AVX2)
    return rows8_usable;
#else
    return 0;
#endif
}

int ss_set_rows8(int on) {
#if defined(SS_AVX2)
    rows8_usable = SS_ROWS8 ? on & 63 : 0;
    return rows8_usable;
#else
    (void)on;
    return 0;
#endif
}

// Activation rows from which the IQ4 layouts' and per-16 IQ planes' products take 16 weight rows at a time (amx.h
// iq16_from_rows; the same bits): n >= 1 sets it, 0 only reads it; returns the resulting value (0 without the twin)
int ss_set_iq16_rows(int n) {
#ifdef SS_TWIN
    if (n > 0) iq16_from_rows = n;
    return iq16_from_rows;
#else
    (void)n;
    return 0;
#endif
}

// Activation rows from which the fast path's q4/q8 products take the 512-bit twin rather than the 8-row kernels on
// AVX-512 VNNI builds (amx.h twin_from_rows: the same bits, only speed differs): n >= 1 sets it, 0 only reads it;
// returns the resulting value (0 on builds without the twin)
int ss_set_twin_rows(int n) {
#ifdef SS_TWIN
    if (n > 0) twin_from_rows = n;
    return twin_from_rows;
#else
    (void)n;
    return 0;
#endif
}

// Whether the twin's rows (amx.h) take the kernel with lanes = weight rows (1, the default) or the reducing one (0), for
// A/B measurements (the same bits); returns the resulting state (0 on builds without the twin)
int ss_set_twin16(int on) {   // on < 0: only read the state
#ifdef SS_TWIN
    if (on >= 0) twin16_usable = on != 0;
    return twin16_usable;
#else
    (void)on;
    return 0;
#endif
}

// Which tile-ordered copies of the scales the loader keeps (weights/quant.py): 1 where the fast path's q4/q8
// products read them (amx.h's twin, and the tiles; Q4_K's compact copy too), 2 likewise for the AVX2 products 8
// rows at a time (q4i_rows, q8i_rows: tests tell the kernels apart by it), 0 none
int ss_tile_planes(void) {
#ifdef SS_TWIN
    return 1;
#elif defined(SS_AVX2)
    return SS_ROWS8 ? 2 : 0;   // the AVX2 8-row products (q4i_rows, q8i_rows)
#else
    return 0;
#endif
}

// Whether batched fast-path q4/q8 products run on AMX tiles (amx.h): 1 when this build and CPU have them and
// Linux granted the tile state (SLIPSTREAM_AMX=0 turns them off). ss_set_amx(0 or 1) switches them (1 only
// where they are usable) and returns the resulting state.
int ss_amx_active(void) {
#ifdef SS_AMX
    return amx_on();
#else
    return 0;
#endif
}

int ss_set_amx(int on) {
#ifdef SS_AMX
    if (!on) amx_usable = 0;
    else if (amx_usable == 0) amx_usable = amx_request();
    return amx_on();
#else
    (void)on;
    return 0;
#endif
}

// bytes of one weight row's codes (ggml blocks for KIND_QT, fp32 values for KIND_F32), and of its scales
// (and as many of its mins: q4, q8; fp16 when qtype is QT_F16)
static int64_t mat_code_bytes(const SSMat *m) {
    const int K = m->k;
    return m->kind == KIND_QT ? (int64_t)K / qt_block(m->qtype) * qt_bytes(m->qtype)
         : m->kind == KIND_Q4 ? K / 2 : m->kind == KIND_Q8 ? K : 4 * (int64_t)K;
}
static int64_t mat_scale_bytes(const SSMat *m) {
    if (m->kind == KIND_Q4 && m->qtype == Q4_K6) return m->k / 32;   // 6-bit scales (and as many mins) as bytes
    return m->kind == KIND_Q4 || m->kind == KIND_Q8 ? (int64_t)(m->k / 32) * (m->qtype == QT_F16 ? 2 : 4) : 0;
}

// y[b * ystride + n] (=|+=) W[n] . X[b] for n in [n0, n1), b < B. More than MAX_ROWS activation rows (a
// prompt chunk) go MAX_ROWS at a time against blocks of weight rows that stay in L1, so a row's result
// never depends on how many rows share the step. (Chunks against the whole tile, re-read from L2 for each,
// made the 512-token prefill 1.28x slower.)
static void mat_rows(const SSMat *m, int n0, int n1, int B, const SSAct *x, float *y, int ystride,
                     int accumulate, int exact) {
    if (B <= 0) return;   // no rows (an empty prefill chunk): SS_BY_ROWS would take 0 for 8
    while (n0 >= m->n && m->next) {   // a chain: find the part that holds row n0
        n0 -= m->n, n1 -= m->n, y += m->n;
        m = m->next;
    }
    if (n1 > m->n && m->next) {
        mat_rows(m->next, 0, n1 - m->n, B, x, y + m->n, ystride, accumulate, exact);
        n1 = m->n;
    }
    const int K = m->k, G = K / 32;
    const int half = m->kind != KIND_QT && m->qtype == QT_F16;   // q4/q8 with fp16 scales
    // the twin's and the tiles' scale reading: bit 0 fp16 [N][G] planes, bit 1 a compact Q4_K tile copy
    const int tmode = half | (m->kind == KIND_Q4 && m->tile_k && m->scale_t ? 2 : 0);
    const int64_t code_bytes = mat_code_bytes(m), scale_bytes = mat_scale_bytes(m);
    const int64_t row_bytes = m->kind == KIND_QT ? code_bytes : 0;
#ifdef SS_TWIN
    // On AVX-512 VNNI machines the fast path's q4/q8 products all follow one arithmetic (amx.h): on AMX tiles
    // from AMX_MIN_ROWS_* rows on where the CPU has them, the rest on their vector twin, bitwise the same
    // (a Q4_K matrix's 6-bit scales only through their compact tile copy: ss_mat makes one on these builds)
    const int twin = !exact && (m->kind == KIND_Q4 || m->kind == KIND_Q8) && x->q && twin_usable &&
                     (m->qtype != Q4_K6 || (m->tile_k && m->scale_t));
#ifdef SS_AMX
    const int tiles = twin && B >= (m->kind == KIND_Q4 ? AMX_MIN_ROWS_Q4 : AMX_MIN_ROWS_Q8) && amx_on();
#endif
#else
    const int twin = 0;
#endif
    if (B > MAX_ROWS) {   // blocks of weight rows (~16 KB: they stay in L1) against every chunk of MAX_ROWS rows
#if defined(SS_AVX2)
        if (!exact && x->q && !x->h && m->kind == KIND_QT && (m->qtype == QT_R_Q6_K || qt_rb16(m->qtype)) && rows8_on(m)) {
            // Q6_K's per-16 code sums once for this call's rows (a task's share of a prompt chunk), not once per
            // weight block
            SSAct xh = *x;
            xh.h = malloc(sizeof(int16_t) * (size_t)B * (K / 16));
            if (xh.h) {
                qt_code_sums16(x->q, K, B, xh.h);
                mat_rows(m, n0, n1, B, &xh, y, ystride, accumulate, exact);
                free(xh.h);
                return;
            }
        }
#endif
        // With the twin and tiles (amx.h), every chunk against the whole range instead: a tile product
        // unpacks its weights itself, and a chunk's B operand (amx_prep) is built once, not once per weight
        // block (a 512-token prompt chunk on AMX: 446 -> 334 ms, step_ab.py --prefill 512)
        int wb = twin ? n1 - n0
               : (int)(16384 / (code_bytes + 2 * scale_bytes)) > 1 ? (int)(16384 / (code_bytes + 2 * scale_bytes)) : 1;
        if (!twin && wb > 8) wb &= ~7;
#if defined(SS_AVX2)
        // rows of over 2 KB (Q6_K at K = 2816, q4 past K = 4096): still blocks of 8 rows for the 8-row kernels
        // (8 Q6_K rows at K = 2816, 18 KB, stay in a 32 KB L1), not 7 computed as 8 with their scales gathered
        if (!twin && wb < 8 && !exact && x->q && rows8_on(m)) wb = 8;
#endif
#if defined(SS_TWIN)
        // the IQ4 layouts' and per-16 IQ planes' 16-row kernels (q5i_rows, q6i_rows) where they run: blocks of 16 rows
        // (17 KB at K = 2048)
        if (!twin && !exact && x->q && m->kind == KIND_QT && rows8_on(m) && iq16_from_rows <= MAX_ROWS && twin_usable &&
            (qt_rb_iq4(m->qtype) || qt_rb16(m->qtype)))
            wb = wb < 16 ? 16 : wb & ~15;
#endif
        for (int r0 = n0, r1; r0 < n1; r0 = r1) {
            // blocks end on multiples of 8 rows (wherever n0 starts), so the 8-row kernels' blocks after the
            // first read their scales from the tile-ordered copy
            r1 = !twin && wb >= 8 && (r0 + wb) / 8 * 8 > r0 ? (r0 + wb) / 8 * 8 : r0 + wb;
            if (r1 > n1) r1 = n1;
            for (int b0 = 0; b0 < B; b0 += MAX_ROWS) {
                const SSAct xb = act_rows(x, b0, K);
                mat_rows(m, r0, r1, B - b0 < MAX_ROWS ? B - b0 : MAX_ROWS, &xb, y + (int64_t)b0 * ystride, ystride,
                         accumulate, exact);
            }
        }
        return;
    }
    const int pf_rows = pf_bytes > 0 ? (int)((pf_bytes + code_bytes + 2 * scale_bytes - 1) / (code_bytes + 2 * scale_bytes)) : 0;
#ifdef SS_TWIN
    if (twin) {
#ifdef SS_AMX
        if (tiles && n1 - n0 >= 16) {   // whole blocks of 16 weight rows on tiles, the rest on the twin
            const int blocks = (n1 - n0) / 16;
            const AmxAct xa = amx_prep(x->q, x->d, x->s, K, B);
            amx_rows(m->q, m->scale, m->min, m->scale_t, m->min_t, tmode, m->kind == KIND_Q4, K, n0, blocks, &xa, B,
                     m->bias, y, ystride, accumulate, pf_bytes > 0, m->n);
            n0 += 16 * blocks;
        }
#endif
        // the rest on the 8-row kernels in the same arithmetic (eo), bitwise the twin's and 1.05x faster at
        // batch 1 on the Sapphire Rapids Xeon (step_ab.py --setting rows8); ss_set_rows8(0): the twin
        // on CPUs with wide 512-bit vpdpbusd the twin is faster from 2 rows on (twin_from_rows)
        if (n0 < n1 && rows8_on(m) && B < twin_from_rows) {
            if (m->kind == KIND_Q4) q4i_rows(m, n0, n1, B, x, y, ystride, accumulate, half, pf_rows, 1);
            else q8i_rows(m, n0, n1, B, x, y, ystride, accumulate, half, pf_rows, 1);
        } else if (n0 < n1 && twin16_usable && m->kind == KIND_Q4)
            twin16_rows_q4(m->q, m->scale, m->min, m->scale_t, m->min_t, tmode, K, n0, n1, x->q, x->d, x->s, B, m->bias,
                           y, ystride, accumulate, pf_bytes > 0, m->n);
        else if (n0 < n1 && twin16_usable)
            twin16_rows_q8(m->q, m->scale, m->scale_t, half, K, n0, n1, x->q, x->d, B, m->bias, y, ystride, accumulate,
                           pf_bytes > 0, m->n);
        else if (n0 < n1 && m->kind == KIND_Q4)
            twin_rows_q4(m->q, m->scale, m->min, m->scale_t, m->min_t, tmode, K, n0, n1, x->q, x->d, x->s, B, m->bias, y,
                         ystride, accumulate, pf_bytes > 0, m->n);
        else if (n0 < n1)
            twin_rows_q8(m->q, m->scale, m->scale_t, half, K, n0, n1, x->q, x->d, B, m->bias, y, ystride, accumulate,
                         pf_bytes > 0, m->n);
        return;
    }
#endif
    if (m->kind == KIND_Q4 || m->kind == KIND_Q8) {
        q_rows(m, n0, n1, B, x, y, ystride, accumulate, exact, half, pf_rows, code_bytes, scale_bytes);
        return;
    }
#if defined(SS_AVX2)
    if (m->kind == KIND_QT && !exact && qt_rows(m, n0, n1, B, x, y, ystride, accumulate, pf_rows, row_bytes))
        return;
#endif
    // the rest, a weight row at a time: other ggml types (and every one in the exact path), fp32
    for (int n = n0; n < n1; n++) {
        if (pf_rows && n + pf_rows < m->n) {
            const char *c = (const char *)m->q + (int64_t)(n + pf_rows) * code_bytes;
            for (int64_t o = 0; o < code_bytes; o += 64) __builtin_prefetch(c + o, 0, 2);
        }
        float out[MAX_ROWS];
        if (m->kind == KIND_QT) {
            const uint8_t *w = (const uint8_t *)m->q + n * row_bytes;
            if (exact || m->qtype == QT_F16 || m->qtype == QT_BF16) {
#define QTF(NB) qt_f_row(m->qtype, w, K, x->f, x->s, NB, out)
                SS_BY_ROWS(B, QTF)
#undef QTF
            } else {
#define QTQ(NB) qt_q8_row(m->qtype, w, K, x->q, x->d, x->s, NB, out)
                SS_BY_ROWS(B, QTQ)
#undef QTQ
            }
        } else {
            f32_row((const float *)m->q + (int64_t)n * K, K, x->f, B, out);
        }
        for (int b = 0; b < B; b++) {
            float *yo = y + (int64_t)b * ystride + n;
            const float v = m->bias ? out[b] + m->bias[n] : out[b];
            *yo = accumulate ? *yo + v : v;
        }
    }
}

// the fast path's int8 codes (or the exact path's group sums) of columns [c0, c1) of a row
static void prepare(const SSAct *a, int row, int K, int c0, int c1, int exact) {
    const int G = K / 32;
    const float *f = a->f + (int64_t)row * K + c0;
    if (exact)
        ss_group_sums(f, c1 - c0, a->s + (int64_t)row * G + c0 / 32);
    else
    {
        ss_quantize_row(f, c1 - c0, a->q + (int64_t)row * K + c0, a->d + (int64_t)row * G + c0 / 32,
                        a->s + (int64_t)row * G + c0 / 32);
#if defined(SS_AVX2)
        if (a->p && (rows8_usable & 3) != 3)   // the paired codes: read only by the one-row kernels
            ss_pair_groups(a->q + (int64_t)row * K, a->d + (int64_t)row * G, K, c0 / 32, c1 / 32, a->p + (int64_t)row * K,
                                 a->e + (int64_t)row * 4 * G);
#endif
    }
}

// row `tok` of an embedding's per-group scales (or mins), fp32 or fp16
static void embed_scales(const SSMat *e, const float *v, int64_t tok, int G, float *out) {
    if (e->qtype == QT_F16) ss_f16_row((const uint16_t *)v + tok * G, out, G);
    else memcpy(out, v + tok * G, sizeof(float) * G);
}

static void embed_row(const SSMat *e, int64_t tok, float *out) {
    const int K = e->k, G = K / 32;
    if (e->kind == KIND_F32) {
        memcpy(out, (const float *)e->q + tok * K, sizeof(float) * K);
    } else if (e->kind == KIND_QT) {
        const int64_t row_bytes = (int64_t)K / qt_block(e->qtype) * qt_bytes(e->qtype);
        qt_dequant_row(e->qtype, (const uint8_t *)e->q + tok * row_bytes, K, out);
    } else if (e->kind == KIND_Q8) {
        const int8_t *q = (const int8_t *)e->q + tok * K;
        float *sc = alloca(sizeof(float) * G);
        embed_scales(e, e->scale, tok, G, sc);
        for (int g = 0; g < G; g++)
            for (int j = 0; j < 32; j++) out[g * 32 + j] = sc[g] * (float)q[g * 32 + j];
    } else {
        const uint8_t *q = (const uint8_t *)e->q + tok * (K / 2);
        float *sc = alloca(sizeof(float) * G), *mn = alloca(sizeof(float) * G);
        if (e->qtype == Q4_K6) {
            ss_k6_row((const uint8_t *)e->scale + tok * G, (const uint8_t *)e->min + tok * G, e->kdm + tok * (G / 4), G, sc, mn);
        } else {
            embed_scales(e, e->scale, tok, G, sc);
            if (e->min) embed_scales(e, e->min, tok, G, mn);
            else for (int g = 0; g < G; g++) mn[g] = -8.f * sc[g];   // Q4_0: no min plane
        }
        for (int g = 0; g < G; g++) {
            const float d = sc[g], m = mn[g];
            for (int j = 0; j < 16; j++) {
                out[g * 32 + j] = d * (float)(q[g * 16 + j] & 15) + m;
                out[g * 32 + 16 + j] = d * (float)(q[g * 16 + j] >> 4) + m;
            }
        }
    }
}

static __thread float *tl_scores;
static __thread int64_t tl_cap;

// row b's query heads of KV head kvh (one task: their keys and values are read while still in cache)
// Long contexts are split into parts (flash-decoding): a row's context of n tokens is attended in
// min(MAX_PARTS, n / SPLIT_TOKENS) parts, a number decided by n alone, so a row's result depends neither on
// the rows beside it nor on the team's size; below 2 * SPLIT_TOKENS it is one pass, as without parts. The
// plan gives each (row, KV head) P tasks (aux: task j | P << 8); task j attends parts j, j + P, ... and leaves
// each part's heads' outputs, score max and exp-sum in attn_part. The task that completes the last part (a
// counter per (row, KV head)) merges them in part order (ss_attend_merge), so timing never changes a result.
// What this buys: one row's long-context attention shared by the team instead of a thread per KV head.
#define SPLIT_TOKENS 256
#define MAX_PARTS 8
static float *attn_part;                   // [rows][KVH][MAX_PARTS][group][D], then [MAX_PARTS][group][2]
static int64_t attn_part_cap;
static _Atomic int32_t *attn_done;         // parts completed per (layer, row, KV head)
static int64_t attn_done_cap;

// before a step (one thread): room for its rows' parts, counters zeroed
static void attn_parts_reset(const SSModel *m, int rows) {
    const int64_t floats = (int64_t)rows * m->heads * MAX_PARTS * (m->head_dim + 2),
                  pairs = (int64_t)m->n_layers * rows * m->kv_heads;
    if (floats > attn_part_cap) {
        free(attn_part);
        attn_part = (float *)malloc(sizeof(float) * (size_t)floats);
        attn_part_cap = floats;
    }
    if (pairs > attn_done_cap) {
        free((void *)attn_done);
        attn_done = (_Atomic int32_t *)malloc(sizeof(int32_t) * (size_t)pairs);
        attn_done_cap = pairs;
    }
    for (int64_t i = 0; i < pairs; i++) atomic_store_explicit(&attn_done[i], 0, memory_order_relaxed);
}

static __thread float *tl_scores;
static __thread int64_t tl_cap;

// Row b's context slots in layer L (a sliding-window layer: its last `window`), *n of them
static const int64_t *attention_slots(const SSStep *s, const SSLayer *L, int b, int64_t *n) {
    const int64_t *sl = (L->local_slots ? s->read_slots_local : s->read_slots) + s->starts[b];
    *n = s->starts[b + 1] - s->starts[b];
    if (L->window > 0 && *n > L->window) {
        sl += *n - L->window;
        *n = L->window;
    }
    return sl;
}

// the parts a context of n tokens is attended in (see SPLIT_TOKENS)
static int context_parts(int64_t n) {
    return n / SPLIT_TOKENS > MAX_PARTS ? MAX_PARTS : n / SPLIT_TOKENS < 2 ? 1 : (int)(n / SPLIT_TOKENS);
}

// A task taking all of row b's KV heads, before it starts: the row's keys and values of every head into L2
// (a slot's heads are contiguous: one run of bytes per slot), so the heads' passes find them there instead
// of waiting on the cache's scattered slots a few rows ahead. Contexts in one part only (under 2 *
// SPLIT_TOKENS: what L2 holds beside the weights); the first task of the row issues them.
static void attention_prefetch_row(const SSModel *m, const SSStep *s, const SSLayer *L, int b, int aux) {
    int64_t n;
    const int64_t *sl = attention_slots(s, L, b, &n);
    if ((aux & 0xff) != 0 || context_parts(n) != 1) return;
    const int64_t row = (int64_t)m->kv_heads * m->head_dim * SS_KV_ESZ(L->kv_type);
    for (int64_t i = 0; i < n; i++) {
        const char *k = (const char *)L->kcache + sl[i] * row, *v = (const char *)L->vcache + sl[i] * row;
        for (int64_t o = 0; o < row; o += 64) {
            __builtin_prefetch(k + o, 0, 2);   // into L2
            __builtin_prefetch(v + o, 0, 2);
        }
    }
}

static void attention(const SSModel *m, const SSStep *s, const SSLayer *L, int b, int kvh, int aux, int exact) {
    const int H = m->heads, KVH = m->kv_heads, D = m->head_dim, group = H / KVH;
    const int task = aux & 0xff, tasks = aux >> 8 > 1 ? aux >> 8 : 1;
    int64_t n;
    const int64_t *sl = attention_slots(s, L, b, &n);
    const int parts = context_parts(n);
    if (parts == 1 && task > 0) return;
    const int64_t longest = (n + parts - 1) / parts;
    if (longest * group > tl_cap) {
        free(tl_scores);
        tl_cap = longest * group > 4096 ? longest * group : 4096;
        tl_scores = (float *)malloc(sizeof(float) * tl_cap);
    }
    const int h0 = kvh * group;
    const float *q = s->qkv + (int64_t)b * (H + 2 * KVH) * D + h0 * D;
    float *out = s->attn.f + (int64_t)b * H * D + h0 * D;
    if (parts == 1) {
        ss_attend_heads(q, group, L->kcache, L->vcache, L->kv_type, L->kscale, L->vscale, KVH, kvh, D, sl, n, m->attn_scale,
                        m->attn_softcap, tl_scores, out, NULL);
    } else {
        float *mine = attn_part + (int64_t)(b * KVH + kvh) * MAX_PARTS * group * (D + 2);
        float *ml = mine + (int64_t)MAX_PARTS * group * D;
        int did = 0;
        for (int part = task; part < parts; part += tasks, did++) {
            const int64_t lo = n * part / parts, hi = n * (part + 1) / parts;
            ss_attend_heads(q, group, L->kcache, L->vcache, L->kv_type, L->kscale, L->vscale, KVH, kvh, D, sl + lo, hi - lo, m->attn_scale,
                            m->attn_softcap, tl_scores, mine + (int64_t)part * group * D, ml + part * group * 2);
        }
        // release our parts; the task whose parts complete the count (acquiring everyone's) merges them
        if (did == 0 || atomic_fetch_add_explicit(&attn_done[((int64_t)(L - m->layers) * s->rows + b) * KVH + kvh], did,
                                                memory_order_acq_rel) + did != parts)
            return;
        ss_attend_merge(mine, ml, parts, group, D, out);
    }
    if (D % 32 == 0) prepare(&s->attn, b, H * D, kvh * group * D, (kvh + 1) * group * D, exact);
}

// -- mixture of experts ----------------------------------------------------------------------------------

// the router over every row: top-k experts and weights, the shared gate, then the (expert, row) pairs grouped
// by expert (experts ascending, rows ascending within one) with h's rows copied in that order
static void moe_route(const SSModel *m, const SSStep *s, const SSMoe *e, int exact) {
    const int B = s->rows, E = e->experts, K = e->topk, hid = m->hidden, G = hid / 32;
    mat_rows(&e->router, 0, E, B, &s->h, s->router, E, 0, exact);
    if (e->shared_gate.n) {
        mat_rows(&e->shared_gate, 0, 1, B, &s->h, s->sgate, 1, 0, exact);
        for (int b = 0; b < B; b++) s->sgate[b] = 1.0f / (1.0f + expf(-s->sgate[b]));
    }
    int32_t *n_active = s->moe_idx, *active = n_active + 1, *off = active + E, *pair_row = off + E + 1;
    int32_t *cnt = (int32_t *)alloca(sizeof(int32_t) * E), *sel = (int32_t *)alloca(sizeof(int32_t) * B * K);
    float *selw = (float *)alloca(sizeof(float) * B * K);
    memset(cnt, 0, sizeof(int32_t) * E);
    for (int b = 0; b < B; b++) {
        float *p = s->router + (int64_t)b * E, mx = -INFINITY, sum = 0.f;
        for (int i = 0; i < E; i++) mx = p[i] > mx ? p[i] : mx;
        for (int i = 0; i < E; i++) sum += p[i] = expf(p[i] - mx);
        for (int i = 0; i < E; i++) p[i] /= sum;
        float tot = 0.f;
        for (int j = 0; j < K; j++) {   // the k largest probabilities (lowest index on ties), largest first
            int best = -1;
            for (int i = 0; i < E; i++) {
                int taken = 0;
                for (int q = 0; q < j; q++) taken |= sel[b * K + q] == i;
                if (!taken && (best < 0 || p[i] > p[best])) best = i;
            }
            sel[b * K + j] = best;
            selw[b * K + j] = p[best];
            tot += p[best];
            cnt[best]++;
        }
        if (e->norm_topk)
            for (int j = 0; j < K; j++) selw[b * K + j] /= tot;
    }
    int n = 0, run = 0;
    for (int i = 0; i < E; i++) {
        if (!cnt[i]) continue;
        active[n] = i;
        off[n++] = run;
        const int c = cnt[i];
        cnt[i] = run;   // from here on: the expert's next free pair
        run += c;
    }
    off[n] = run;
    *n_active = n;
    for (int b = 0; b < B; b++)
        for (int j = 0; j < K; j++) {
            const int p = cnt[sel[b * K + j]]++;
            pair_row[p] = b;
            s->pair_w[p] = selw[b * K + j];
        }
    for (int p = 0; p < run; p++) {
        const int64_t b = pair_row[p];
        memcpy(s->hx.f + (int64_t)p * hid, s->h.f + b * hid, sizeof(float) * hid);
        if (exact) {
            memcpy(s->hx.s + (int64_t)p * G, s->h.s + b * G, sizeof(float) * G);
        } else {
            memcpy(s->hx.q + (int64_t)p * hid, s->h.q + b * hid, (size_t)hid);
            if (s->hx.p && s->h.p) {
                memcpy(s->hx.p + (int64_t)p * hid, s->h.p + b * hid, (size_t)hid);
                memcpy(s->hx.e + (int64_t)p * 4 * G, s->h.e + b * 4 * G, sizeof(float) * 4 * G);
            }
            memcpy(s->hx.d + (int64_t)p * G, s->h.d + b * G, sizeof(float) * G);
            memcpy(s->hx.s + (int64_t)p * G, s->h.s + b * G, sizeof(float) * G);
        }
    }
}

// a thread's gate/up outputs of a GLU task (glu_cols), or an MoE down task's sums (moe_down); floats, grown on
// demand and never shrunk; NULL if out of memory
static __thread float *gu_buf;
static __thread size_t gu_cap;
static float *gu_scratch(size_t floats) {
    if (floats > gu_cap) {
        free(gu_buf);
        gu_buf = (float *)malloc(sizeof(float) * floats);
        gu_cap = gu_buf ? floats : 0;
    }
    return gu_buf;
}

// columns [c0, c1) of a GLU: out rows = act(x W_gate^T) * (x W_up^T) over B rows of x (K = hidden wide), quantized
// for the next product. The B rows' gate and up columns (a 512-token chunk of an 8192-wide FFN on 2 threads is
// 16 MB, past a thread's stack: alloca'd it was a segfault) go to a per-thread buffer, grown on demand and kept;
// without memory for it, passes of 8 rows on the stack (the same results: rows are computed alike in any pass)
static void glu_cols(const SSModel *m, const SSMat *gu, int F, int c0, int c1, int B, const SSAct *x, SSAct *out,
                     int exact) {
    const int w = c1 - c0;
    float *g = gu_scratch((size_t)B * w * 2);
    const int rb = g ? B : B < MAX_ROWS ? B : MAX_ROWS;
    if (!g) g = (float *)alloca(sizeof(float) * (size_t)rb * w * 2);
    float *u = g + (size_t)rb * w;
    for (int b0 = 0; b0 < B; b0 += rb) {
        const int nb = B - b0 < rb ? B - b0 : rb;
        const SSAct xb = act_rows(x, b0, m->hidden);
        mat_rows(gu, c0, c1, nb, &xb, g - c0, w, 0, exact);
        mat_rows(gu, F + c0, F + c1, nb, &xb, u - F - c0, w, 0, exact);
        for (int b = 0; b < nb; b++) {
            float *a = out->f + (int64_t)(b0 + b) * F;
            if (m->act == ACT_GELU_TANH) ss_gelu_tanh_mul(g + b * w, u + b * w, w, a + c0);
            else ss_silu_mul(g + b * w, u + b * w, w, a + c0);
            prepare(out, b0 + b, F, c0, c1, exact);
        }
    }
}

// hidden rows [n0, n1): x += sum over the active experts (ascending) of weight * down_e(eact), then the shared
// expert's gate * down_s(sact); this task owns these hidden columns of every row (no other writer)
static void moe_down(const SSModel *m, const SSStep *s, const SSMoe *e, int n0, int n1, int exact) {
    const int B = s->rows, E = e->experts, F = e->ffn, hid = m->hidden, w = n1 - n0;
    const int32_t *n_active = s->moe_idx, *active = n_active + 1, *off = active + E, *pair_row = off + E + 1;
    // the per-thread gate/up buffer (no GLU task runs inside this one): sums, then one expert's outputs
    float *acc = gu_scratch((size_t)B * w * 2), *y = acc + (size_t)B * w;
    if (!acc) {   // no memory for a few MB: nothing sensible to compute with
        fprintf(stderr, "slipstream: out of memory in an MoE layer's down products (%zu bytes)\n", sizeof(float) * (size_t)B * w * 2);
        abort();
    }
    memset(acc, 0, sizeof(float) * (size_t)B * w);
    for (int a = 0; a < *n_active; a++) {
        const int p0 = off[a], np = off[a + 1] - p0;
        const SSAct in = act_rows(&s->eact, p0, F);
        mat_rows(&e->down[active[a]], n0, n1, np, &in, y - n0, w, 0, exact);
        for (int b = 0; b < np; b++) {
            float *ar = acc + (int64_t)pair_row[p0 + b] * w;
            const float pw = s->pair_w[p0 + b];
            for (int i = 0; i < w; i++) ar[i] += pw * y[b * w + i];
        }
    }
    if (e->shared_down.n) {
        mat_rows(&e->shared_down, n0, n1, B, &s->sact, y - n0, w, 0, exact);
        for (int b = 0; b < B; b++)
            for (int i = 0; i < w; i++) acc[b * w + i] += s->sgate[b] * y[b * w + i];
    }
    for (int b = 0; b < B; b++) {
        float *x = s->x + (int64_t)b * hid + n0;
        for (int i = 0; i < w; i++) x[i] += acc[b * w + i];
    }
}

// -- prefetch while waiting -------------------------------------------------------------------------
// A task whose inputs are not ready yet (an O tile waiting for the layer's attention, a DOWN tile for the
// GATE_UP outputs) already knows its weight rows: the waiting thread prefetches the first of them into L2
// (up to wait_pf_bytes, the tile's rows in order, gate and up alike), checking the event every few KB, so
// the memory bus works while attention computes instead of idling until the next product starts.
static int wait_pf_bytes = 65536;
void ss_set_wait_prefetch(int bytes) { wait_pf_bytes = bytes > 0 ? bytes : 0; }
void ss_set_attn_prefetch(int rows) { ss_attn_pf = rows > 1 ? rows : 1; }

// prefetch rows [n0, n1) of m from row n0 on, at most `budget` bytes, while *ev < count; returns bytes issued
// (fast: the fast path's step, whose q4/q8 products on the twin and tiles read the tile-ordered copy of the
// scale planes where there is one: the bytes of rows [n0, n1) there span the same offsets as in the planes,
// 20 G bytes per 16 rows in a compact Q4_K copy)
static int64_t prefetch_rows(const SSMat *m, int n0, int n1, int64_t budget, _Atomic int32_t *ev, int32_t count,
                             int fast) {
    while (n0 >= m->n && m->next) n0 -= m->n, n1 -= m->n, m = m->next;
    if (n1 > m->n) n1 = m->n;
    const int64_t code_bytes = mat_code_bytes(m);
    int64_t scale_bytes = mat_scale_bytes(m);
    const void *sc = m->scale, *mn = m->min;
#ifdef SS_TWIN
    if (fast && twin_usable && m->scale_t) {
        sc = m->scale_t, mn = m->min_t;
        if (m->tile_k) scale_bytes = 5 * (int64_t)(m->k / 32) / 4;
    }
#else
    (void)fast;
#endif
    int64_t done = 0, since_check = 0;
    for (int n = n0; n < n1 && done < budget; n++) {
        const char *c = (const char *)m->q + (int64_t)n * code_bytes;
        for (int64_t o = 0; o < code_bytes; o += 64) __builtin_prefetch(c + o, 0, 2);
        if (scale_bytes) {
            __builtin_prefetch((const char *)sc + (int64_t)n * scale_bytes, 0, 2);
            if (mn) __builtin_prefetch((const char *)mn + (int64_t)n * scale_bytes, 0, 2);
        }
        done += code_bytes + 2 * scale_bytes;
        since_check += code_bytes + 2 * scale_bytes;
        if (since_check >= 4096) {
            since_check = 0;
            if (atomic_load_explicit(ev, memory_order_relaxed) >= count) break;
        }
    }
    return done;
}

static void prefetch_while_waiting(const SSModel *m, const SSTask *t, _Atomic int32_t *ev, int32_t count, int fast) {
    const SSLayer *L = t->layer >= 0 ? &m->layers[t->layer] : NULL;
    const int64_t budget = wait_pf_bytes;
    switch (t->op) {
    case OP_QKV: prefetch_rows(&L->qkv, t->t0 * m->head_dim, t->t1 * m->head_dim, budget, ev, count, fast); break;
    case OP_O: prefetch_rows(&L->o, t->t0, t->t1, budget, ev, count, fast); break;
    case OP_GATE_UP:
        if (prefetch_rows(&L->gate_up, t->t0, t->t1, budget / 2, ev, count, fast) >= budget / 2)
            prefetch_rows(&L->gate_up, m->ffn + t->t0, m->ffn + t->t1, budget / 2, ev, count, fast);
        break;
    case OP_DOWN: prefetch_rows(&L->down, t->t0, t->t1, budget, ev, count, fast); break;
    case OP_LM_HEAD: prefetch_rows(&m->lm_head, t->t0, t->t1, budget, ev, count, fast); break;
    default: break;
    }
}

static void run_task(const SSModel *m, const SSStep *s, const SSTask *t, int exact) {
    const int B = s->rows, hid = m->hidden, H = m->heads, KVH = m->kv_heads, D = m->head_dim;
    const SSLayer *L = t->layer >= 0 ? &m->layers[t->layer] : NULL;
    switch (t->op) {
    case OP_EMBED: {
        float *x = s->x + (int64_t)t->t0 * hid;
        embed_row(&m->embed, s->tokens[t->t0], x);
        if (m->embed_scale != 0.f)
            for (int i = 0; i < hid; i++) x[i] *= m->embed_scale;
        break;
    }
    case OP_NORM: {
        const float *w = t->aux == 0 ? L->attn_norm : t->aux == 1 ? L->ffn_norm : m->norm;
        for (int b = t->t0; b < t->t1; b++) {
            const int64_t src = t->aux == 2 && s->out_rows ? s->out_rows[b] : b;
            ss_rmsnorm_row(s->x + src * hid, w, hid, m->eps, s->h.f + (int64_t)b * hid);
            prepare(&s->h, b, hid, 0, hid, exact);
        }
        break;
    }
    case OP_QKV: {
        const int row = (H + 2 * KVH) * D;
        mat_rows(&L->qkv, t->t0 * D, t->t1 * D, B, &s->h, s->qkv, row, 0, exact);
        const int local = L->rope_local && s->cos_local;
        for (int b = 0; b < B; b++) {
            const float *cs = (local ? s->cos_local : s->cos) + (int64_t)b * (m->rotary / 2);
            const float *sn = (local ? s->sin_local : s->sin) + (int64_t)b * (m->rotary / 2);
            const int64_t slot = (L->local_slots ? s->write_slots_local : s->write_slots)[b];
            for (int hd = t->t0; hd < t->t1; hd++) {
                float *v = s->qkv + (int64_t)b * row + hd * D;
                if (hd < H) {
                    if (L->q_norm) ss_rmsnorm_row(v, L->q_norm, D, m->eps, v);
                    ss_rope_head(v, cs, sn, m->rotary);
                } else if (hd < H + KVH) {
                    if (L->k_norm) ss_rmsnorm_row(v, L->k_norm, D, m->eps, v);
                    ss_rope_head(v, cs, sn, m->rotary);
                    if (slot >= 0) ss_kv_store(L->kcache, L->kscale, L->kv_type, slot, KVH, hd - H, D, v);
                } else if (slot >= 0) {
                    ss_kv_store(L->vcache, L->vscale, L->kv_type, slot, KVH, hd - H - KVH, D, v);
                }
            }
        }
        break;
    }
    case OP_ATTN:
        if (t->t1 >= 0) {
            attention(m, s, L, t->t0, t->t1, t->aux, exact);
            break;
        }
        attention_prefetch_row(m, s, L, t->t0, t->aux);   // all of the row's KV heads (cpu_plan.ALL_HEADS)
        for (int kvh = 0; kvh < KVH; kvh++) attention(m, s, L, t->t0, kvh, t->aux, exact);
        break;
    case OP_PREP:
        prepare(&s->attn, t->t0, H * D, 0, H * D, exact);
        break;
    case OP_O:
        if (L->post_attn_norm) mat_rows(&L->o, t->t0, t->t1, B, &s->attn, s->tmp, hid, 0, exact);
        else mat_rows(&L->o, t->t0, t->t1, B, &s->attn, s->x, hid, 1, exact);
        break;
    case OP_POST: {
        const float *w = t->aux == 0 ? L->post_attn_norm : L->post_ffn_norm;
        float *row = (float *)alloca(sizeof(float) * hid);
        for (int b = t->t0; b < t->t1; b++) {
            ss_rmsnorm_row(s->tmp + (int64_t)b * hid, w, hid, m->eps, row);
            float *x = s->x + (int64_t)b * hid;
            for (int i = 0; i < hid; i++) x[i] += row[i];
        }
        break;
    }
    case OP_GATE_UP:
        glu_cols(m, &L->gate_up, m->ffn, t->t0, t->t1, B, &s->h, (SSAct *)&s->act, exact);   // s: its buffers written
        break;
    case OP_DOWN:
        if (L->post_ffn_norm) mat_rows(&L->down, t->t0, t->t1, B, &s->act, s->tmp, hid, 0, exact);
        else mat_rows(&L->down, t->t0, t->t1, B, &s->act, s->x, hid, 1, exact);
        break;
    case OP_LM_HEAD:
        mat_rows(&m->lm_head, t->t0, t->t1, s->n_out, &s->h, s->logits, m->vocab, 0, exact);
        if (m->final_softcap > 0.f)
            for (int b = 0; b < s->n_out; b++)
                for (int i = t->t0; i < t->t1; i++) {
                    float *l = s->logits + (int64_t)b * m->vocab + i;
                    *l = m->final_softcap * tanhf(*l / m->final_softcap);
                }
        break;
    case OP_ROUTE:
        moe_route(m, s, L->moe, exact);
        break;
    case OP_EXPERT_GU: {
        const SSMoe *e = L->moe;
        if (t->aux >= s->moe_idx[0]) break;   // fewer experts active in this step than the plan's slots
        const int32_t *active = s->moe_idx + 1, *off = active + e->experts;
        const int p0 = off[t->aux], np = off[t->aux + 1] - p0;
        const SSAct in = act_rows(&s->hx, p0, m->hidden);
        SSAct out = act_rows(&s->eact, p0, e->ffn);
        glu_cols(m, &e->gate_up[active[t->aux]], e->ffn, t->t0, t->t1, np, &in, &out, exact);
        break;
    }
    case OP_SHARED_GU:
        glu_cols(m, &L->moe->shared_gate_up, L->moe->shared_ffn, t->t0, t->t1, B, &s->h, (SSAct *)&s->sact, exact);
        break;
    case OP_MOE_DOWN:
        moe_down(m, s, L->moe, t->t0, t->t1, exact);
        break;
    case OP_ARGMAX: {
        s->next_tokens[t->t0] = ss_argmax(s->logits + (int64_t)t->t0 * m->vocab, m->vocab);
        break;
    }
    }
}

// -- the team ------------------------------------------------------------------------------------------
#define MAX_THREADS 256

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void futex_wait(_Atomic uint32_t *addr, uint32_t val) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *addr) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

typedef struct {
    // the current job (written by the caller before it publishes a new generation)
    const SSModel *model;
    const SSStep *step;
    const SSTask *tasks;
    int32_t n_tasks, exact;
    _Atomic int32_t *events;
    // synchronisation
    _Atomic uint64_t ticket;       // generation << 32 | next task index
    _Atomic uint32_t gen;          // futex word: a new step
    _Atomic uint32_t progress;     // futex word: an event was signalled while someone slept
    _Atomic int32_t sleepers;      // threads asleep on `progress`
    _Atomic int32_t finished;      // tasks completed in this step
    _Atomic int32_t stop;
    int nthreads;                  // including the caller
    pthread_t threads[MAX_THREADS];
    int spin_wait, spin_idle;      // microseconds of spinning before sleeping (inside a step / between steps)
    pthread_mutex_t lock;          // serialises callers (one step at a time)
} Team;

// optional per-opcode profile: busy and waiting nanoseconds, summed over threads
#define N_OPS 15
static int prof_on;
static _Atomic int64_t prof_busy[N_OPS], prof_wait[N_OPS], prof_count[N_OPS];

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static Team T = {.lock = PTHREAD_MUTEX_INITIALIZER, .nthreads = 1, .spin_wait = 50, .spin_idle = 300};

static void wake_sleepers(void) {
    if (atomic_load(&T.sleepers) > 0) {
        atomic_fetch_add(&T.progress, 1);
        futex_wake_all(&T.progress);
    }
}

// until *v >= count: spin, then sleep on `progress` (re-checked after announcing the sleep)
static void wait_at_least(_Atomic int32_t *v, int32_t count) {
    if (atomic_load_explicit(v, memory_order_acquire) >= count) return;
    // spin by time, not by iterations: a pause costs 10 to 140 cycles depending on the CPU
    const int64_t until = now_ns() + (int64_t)T.spin_wait * 1000;
    for (int i = 1;; i++) {
        cpu_relax();
        if (atomic_load_explicit(v, memory_order_acquire) >= count) return;
        if ((i & 31) == 0 && now_ns() > until) break;
    }
    for (;;) {
        const uint32_t p = atomic_load(&T.progress);
        atomic_fetch_add(&T.sleepers, 1);
        if (atomic_load(v) >= count) {
            atomic_fetch_sub(&T.sleepers, 1);
            return;
        }
        futex_wait(&T.progress, p);
        atomic_fetch_sub(&T.sleepers, 1);
        if (atomic_load(v) >= count) return;
    }
}

// take tickets of generation g until the table is exhausted
static void work(uint32_t g) {
    int32_t done = 0;
    for (;;) {
        uint64_t cur = atomic_load(&T.ticket);
        if ((uint32_t)(cur >> 32) != g || (int32_t)(uint32_t)cur >= T.n_tasks) break;
        if (!atomic_compare_exchange_weak(&T.ticket, &cur, cur + 1)) continue;
        const SSTask *t = &T.tasks[(uint32_t)cur];
        const int64_t t0 = prof_on ? now_ns() : 0;
        if (t->wait_ev >= 0) {
            if (wait_pf_bytes && 
                atomic_load_explicit(&T.events[t->wait_ev], memory_order_relaxed) < t->wait_count)
                prefetch_while_waiting(T.model, t, &T.events[t->wait_ev], t->wait_count, !T.exact);
            wait_at_least(&T.events[t->wait_ev], t->wait_count);
        }
        const int64_t t1 = prof_on ? now_ns() : 0;
        run_task(T.model, T.step, t, T.exact);
        if (prof_on) {
            atomic_fetch_add(&prof_wait[t->op], t1 - t0);
            atomic_fetch_add(&prof_busy[t->op], now_ns() - t1);
            atomic_fetch_add(&prof_count[t->op], 1);
        }
        if (t->sig_ev >= 0) {
            atomic_fetch_add(&T.events[t->sig_ev], 1);
            wake_sleepers();
        }
        done++;
    }
    if (done) {
        atomic_fetch_add(&T.finished, done);
        wake_sleepers();
    }
}

static void *worker_main(void *arg) {
    (void)arg;
    uint32_t seen = atomic_load(&T.gen);
    for (;;) {
        uint32_t g;
        int i = 0, spinning = 1;
        const int64_t until = now_ns() + (int64_t)T.spin_idle * 1000;
        while ((g = atomic_load_explicit(&T.gen, memory_order_acquire)) == seen && !atomic_load(&T.stop)) {
            if (spinning) {
                cpu_relax();
                if ((++i & 31) == 0 && now_ns() > until) spinning = 0;
            } else {
                futex_wait(&T.gen, seen);
            }
        }
        if (atomic_load(&T.stop)) break;
        seen = g;
        work(g);
    }
    return NULL;
}

static void team_stop(void) {
    if (T.nthreads <= 1) return;
    atomic_store(&T.stop, 1);
    atomic_fetch_add(&T.gen, 1);
    futex_wake_all(&T.gen);
    for (int i = 1; i < T.nthreads; i++) pthread_join(T.threads[i], NULL);
    atomic_store(&T.stop, 0);
    T.nthreads = 1;
}

// Size the team (threads including the caller); spin times (microseconds) < 0 keep the current ones.
// Threads of the OpenMP regions outside the step (the eager path's products and widening): the team's size
// once one is configured, so that they too leave the cores a busy neighbour holds (the team shrinks then:
// cpu_load.py); before that OpenMP's default.
static _Atomic int par_threads;
int ss_parallel_threads(void) {
    const int n = atomic_load_explicit(&par_threads, memory_order_relaxed);
#ifdef _OPENMP
    return n > 0 ? n : omp_get_max_threads();
#else
    return n > 0 ? n : 1;
#endif
}

// the number of threads an OpenMP region of this library runs now (tests)
int ss_parallel_probe(void) {
    int n = 1;
#pragma omp parallel num_threads(ss_parallel_threads())
    {
#ifdef _OPENMP
#pragma omp single
        n = omp_get_num_threads();
#endif
    }
    return n;
}

int ss_team_configure(int nthreads, int spin_wait, int spin_idle) {
    if (nthreads < 1) nthreads = 1;
    if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
    pthread_mutex_lock(&T.lock);
    if (spin_wait >= 0) T.spin_wait = spin_wait;
    if (spin_idle >= 0) T.spin_idle = spin_idle;
    if (nthreads != T.nthreads) {
        team_stop();
        for (int i = 1; i < nthreads; i++) {
            if (pthread_create(&T.threads[i], NULL, worker_main, NULL) != 0) break;
            T.nthreads = i + 1;
        }
    }
    const int n = T.nthreads;
    atomic_store_explicit(&par_threads, n, memory_order_relaxed);
    pthread_mutex_unlock(&T.lock);
    return n;
}

// Run one step's task table; events: n_events int32 counters (zeroed here).
void ss_step(const SSModel *model, const SSStep *step, const SSTask *tasks, int n_tasks,
             int32_t *events, int n_events, int exact) {
    pthread_mutex_lock(&T.lock);
    memset(events, 0, sizeof(int32_t) * (size_t)n_events);
    attn_parts_reset(model, step->rows);
    T.model = model;
    T.step = step;
    T.tasks = tasks;
    T.n_tasks = n_tasks;
    T.exact = exact;
    T.events = (_Atomic int32_t *)events;
    atomic_store(&T.finished, 0);
    const uint32_t g = atomic_load(&T.gen) + 1;
    atomic_store(&T.ticket, (uint64_t)g << 32);
    atomic_store_explicit(&T.gen, g, memory_order_release);
    if (T.nthreads > 1) futex_wake_all(&T.gen);
    work(g);
    wait_at_least(&T.finished, n_tasks);
    pthread_mutex_unlock(&T.lock);
}

// Turn the profile on or off (clearing it); out: [3][N_OPS] busy ns, wait ns, task count.
void ss_profile(int enable, int64_t *out) {
    for (int i = 0; i < N_OPS; i++) {
        if (out) {
            out[i] = atomic_load(&prof_busy[i]);
            out[N_OPS + i] = atomic_load(&prof_wait[i]);
            out[2 * N_OPS + i] = atomic_load(&prof_count[i]);
        }
        atomic_store(&prof_busy[i], 0);
        atomic_store(&prof_wait[i], 0);
        atomic_store(&prof_count[i], 0);
    }
    prof_on = enable;
}

// -- entry points for tests and the eager path -------------------------------------------------------
const char *ss_isa(void) { return ss_isa_name(); }

// y[B][N] = X[B][K] W^T through the same row kernels as the step (exact or fast), rows over OpenMP threads
void ss_matmul(const SSMat *m, int B, const float *x, float *y, int exact) {
    const int K = m->k, G = K / 32;
    SSAct a = {(float *)x, (int8_t *)malloc((size_t)B * K), (float *)malloc(sizeof(float) * B * G),
               (float *)malloc(sizeof(float) * B * G), (int8_t *)malloc((size_t)B * K), (float *)malloc(sizeof(float) * B * 4 * G),
               NULL};
    for (int b = 0; b < B; b++) prepare(&a, b, K, 0, K, exact);
    int N = 0, q6 = 0;   // a chain's rows, all parts; whether one runs the 8-row Q6_K kernel (which reads a.h)
    for (const SSMat *p = m; p; p = p->next) {
        N += p->n;
#if defined(SS_AVX2)
        q6 |= p->kind == KIND_QT && (p->qtype == QT_R_Q6_K || qt_rb16(p->qtype)) && rows8_on(p);
#endif
    }
#if defined(SS_AVX2)
    if (q6 && !exact && (a.h = malloc(sizeof(int16_t) * (size_t)B * (K / 16)))) qt_code_sums16(a.q, K, B, a.h);
#else
    (void)q6;
#endif
    // row tiles over OpenMP's threads (the eager path's products: prefill chunks beside decode rows)
    const int tile = 16;
#pragma omp parallel for schedule(dynamic, 1) if (N >= 4 * tile) num_threads(ss_parallel_threads())
    for (int n0 = 0; n0 < N; n0 += tile) mat_rows(m, n0, n0 + tile < N ? n0 + tile : N, B, &a, y, N, 0, exact);
    free(a.q);
    free(a.d);
    free(a.s);
    free(a.p);
    free(a.e);
    free(a.h);
}

// rows [n0, n1) of a KIND_QT matrix decoded: int8 codes q[rows][K], per-16 scales and offsets
// sc, mn [rows][K/16] (w = sc * q + mn; tests and Python's dequantize compose them)
void ss_qt_unpack(int qtype, const uint8_t *w, int n0, int n1, int K, int8_t *q, float *sc, float *mn) {
    const int QK = qt_block(qtype), BB = qt_bytes(qtype);
    const int64_t row_bytes = (int64_t)K / QK * BB;
    QTBlock u;
    for (int n = n0; n < n1; n++)
        for (int blk = 0; blk < K / QK; blk++) {
            qt_unpack(qtype, w + n * row_bytes + (int64_t)blk * BB, &(QTOut){u.q, u.sc, u.mn});
            const int64_t r = n - n0, e0 = r * K + (int64_t)blk * QK, s0 = e0 / 16;
            memcpy(q + e0, u.q, QK);
            memcpy(sc + s0, u.sc, sizeof(float) * (QK / 16));
            memcpy(mn + s0, u.mn, sizeof(float) * (QK / 16));
        }
}

// The lattice types' grids as int8 values (kernels/cpu/iq_grids.py, from gguf-py), copied once per library:
// IQ2_XXS 256 x 8, IQ2_XS 512 x 8, IQ2_S 1024 x 8, IQ3_XXS 256 x 4, IQ3_S 512 x 4, IQ1_S (and IQ1_M) 2048 x 8
void ss_set_iq_grids(const int8_t *iq2xxs, const int8_t *iq2xs, const int8_t *iq2s, const int8_t *iq3xxs,
                     const int8_t *iq3s, const int8_t *iq1s) {
    memcpy(qt_grids.iq2xxs, iq2xxs, sizeof qt_grids.iq2xxs);
    memcpy(qt_grids.iq2xs, iq2xs, sizeof qt_grids.iq2xs);
    memcpy(qt_grids.iq2s, iq2s, sizeof qt_grids.iq2s);
    memcpy(qt_grids.iq3xxs, iq3xxs, sizeof qt_grids.iq3xxs);
    memcpy(qt_grids.iq3s, iq3s, sizeof qt_grids.iq3s);
    memcpy(qt_grids.iq1s, iq1s, sizeof qt_grids.iq1s);
    for (int s = 0; s < 256; s++) {
        uint64_t m = 0;
        for (int j = 0; j < 8; j++)
            if (s >> j & 1) m |= (uint64_t)0xFF << (8 * j);
        qt_grids.sign_mask[s] = m;
    }
    for (int i = 0; i < 128; i++) qt_grids.ksigns[i] = (uint8_t)(i | (__builtin_popcount((unsigned)i) & 1) << 7);
    qt_grids.ready = 1;
}

int ss_iq_grids_ready(void) { return qt_grids.ready; }

// rows [n0, n1) of a KIND_QT matrix as fp32 (the reference dequantization's values)
void ss_qt_dequant(int qtype, const uint8_t *w, int n0, int n1, int K, float *out) {
    const int64_t row_bytes = (int64_t)K / qt_block(qtype) * qt_bytes(qtype);
#pragma omp parallel for schedule(static) num_threads(ss_parallel_threads())
    for (int n = n0; n < n1; n++) qt_dequant_row(qtype, w + n * row_bytes, K, out + (int64_t)(n - n0) * K);
}

// The same rows rounded to bf16 (to nearest, ties to even: torch's float -> bfloat16 for finite values), for
// the eager step's bf16 products (weights/quant.py, blas_mode): no fp32 copy of the matrix on the way
void ss_qt_dequant_bf16(int qtype, const uint8_t *w, int n0, int n1, int K, uint16_t *out) {
    const int64_t row_bytes = (int64_t)K / qt_block(qtype) * qt_bytes(qtype);
#pragma omp parallel num_threads(ss_parallel_threads())
    {
        float *row = malloc(sizeof(float) * (size_t)K);
#pragma omp for schedule(static)
        for (int n = n0; n < n1; n++) {
            uint16_t *o = out + (int64_t)(n - n0) * K;
            if (qtype == QT_BF16) {   // already bf16: the same bits
                memcpy(o, w + n * row_bytes, sizeof(uint16_t) * (size_t)K);
                continue;
            }
            int i = 0;
#if defined(__F16C__) && defined(__AVX2__)
            if (qtype == QT_F16) {   // fp16 -> fp32 is exact, then rounded as below, 8 or 16 at a time (qt_dequant_row's
                                     // scalar loop was the eager bf16 step's largest cost on F16 files)
                const uint16_t *h = (const uint16_t *)(w + n * row_bytes);
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
                for (; i + 16 <= K; i += 16)   // vcvtneps2bf16: to nearest, ties to even; a NaN quieted, as below
                    _mm256_storeu_si256((__m256i *)(o + i), (__m256i)_mm512_cvtneps_pbh(
                        _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i)))));
#endif
                const __m256i bias = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1), quiet = _mm256_set1_epi32(0x40);
                const __m256i absm = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
                for (; i + 8 <= K; i += 8) {
                    const __m256i u = _mm256_castps_si256(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
                    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, bias),
                                                                         _mm256_and_si256(_mm256_srli_epi32(u, 16), one)), 16);
                    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, absm), inf);
                    const __m256i v = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), quiet), nan);
                    const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0x08);
                    _mm_storeu_si128((__m128i *)(o + i), _mm256_castsi256_si128(p));
                }
                for (int j = i; j < K; j++) row[j] = qt_f16(w + n * row_bytes + 2 * j);
            } else
#endif
                qt_dequant_row(qtype, w + n * row_bytes, K, row);
            for (; i < K; i++) {
                uint32_t u;
                memcpy(&u, &row[i], 4);
                o[i] = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40)   // NaN stays NaN
                                                       : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
            }
        }
        free(row);
    }
}

// out[i] += y[i] (a product accumulated into a residual)
void ss_add_rows(float *out, const float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] += y[i];
}

// q[B][K] int8, d and s [B][K/32]: the fast path's activation quantization
void ss_quantize(const float *x, int B, int K, int8_t *q, float *d, float *s) {
    for (int b = 0; b < B; b++)
        ss_quantize_row(x + (int64_t)b * K, K, q + (int64_t)b * K, d + (int64_t)b * (K / 32), s + (int64_t)b * (K / 32));
}
