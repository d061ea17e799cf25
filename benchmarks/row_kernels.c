// In-cache speed of the CPU row kernels (kernels/cpu/simd.h, qtypes.h): one 1536 x 576 weight matrix
// (SmolLM2's gate/up shape; ~0.5-0.9 MB, it stays in L2/L3) against 1, 2, 4 and 8 activation rows.
// Prints the best of 200 passes (the least disturbed by neighbours) as multiply-accumulates per
// nanosecond and per cycle at an assumed 3 GHz, for:
//   q4 one row per pass   (the re-blocked Q4_0/Q4_1/Q4_K layout; a two-rows-per-pass variant measured
//                          faster here, in cache, but slower in the decode step, 110 vs 131 tok/s: removed)
//   q4 fp16 scales, paired  simd.h's q4p_row as the step calls it (two groups per step, the file's fp16
//                          scales, activations paired once per step). -O3, Zen 3, 2026-11-24: rows 1
//                          27-28 MAC/ns against 19-20 for q4q8_row above, rows 8 44-52 against 27-37.
//                          The same kernel pairing the activations itself (vperm2i128 per pair and
//                          row) was no faster than q4q8_row at 8 rows: the step pairs them once.
//   raw GGUF blocks through qt_q8_row (the step's path), for Q5_0, Q5_1, IQ4_NL, Q4_K, Q5_K, IQ4_XS, Q6_K,
//   and the re-blocked layouts (QT_R_*) of Q5_0, Q5_1, Q5_K, IQ4_NL, IQ4_XS and Q6_K (the 256-weight types
//   over 512 of the 576 columns: whole super-blocks).
//   Blocks decoded into registers and multiplied straight away ran 1.6-3x faster than qt_q8_row here, in
//   cache, and 2-9% slower in the decode step (benchmarks/cpu_decode.py on llama.cpp-quantized files,
//   quiet: Q5_0 85 vs 93.5 tok/s): removed. In-cache speed does not predict the streaming step.
//
//   q4 with the last G % 4 groups zero-padded into the four-group path and the min term folded into the
//   same accumulator (one horizontal sum per row): slower at every row count here (rows 1: 14.7 vs 19.9
//   MAC/ns, rows 8: 23.3 vs 24.0; 2026-11-24, loaded machine, same run): not kept.
// The kernels run with the row count as a compile-time constant (SS_BY_ROWS), as the step calls them.
//
//   gcc -O3 -march=native -o /tmp/row_kernels benchmarks/row_kernels.c -lm && /tmp/row_kernels
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "../slipstream/kernels/cpu/qtypes.h"

// keeps the compiler from dropping products whose results are never read
#define SINK(p) __asm__ volatile("" ::"r"(p) : "memory")

enum { K = 576, N = 1536, G = K / 32, REPS = 200 };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int8_t xq[8 * K];
static float xd[8 * G], xs[8 * G], out[MAX_ROWS], out1[MAX_ROWS];

static void report(const char *what, int nb, double seconds) {
    const double macs = (double)N * K * nb;
    printf("  %-28s rows %d: %6.2f MAC/ns  %5.2f MAC/cycle@3GHz\n", what, nb, macs / seconds / 1e9, macs / seconds / 3e9);
}

static void q4_rows(void) {
    uint8_t *w = malloc((size_t)N * K / 2);
    float *sc = malloc(sizeof(float) * N * G), *mn = malloc(sizeof(float) * N * G);
    for (size_t i = 0; i < (size_t)N * K / 2; i++) w[i] = (uint8_t)rand();
    for (int i = 0; i < N * G; i++) sc[i] = 0.01f, mn[i] = -0.05f;
    for (int nb = 1; nb <= 8; nb *= 2) {
        double one = 1e9;
        for (int r = 0; r < REPS; r++) {
            double t = now();
            // the row count is a compile-time constant in each call, as in the step (SS_BY_ROWS)
#define Q4Q(NB) for (int n = 0; n < N; n++) { q4q8_row(w + (size_t)n * K / 2, sc + n * G, mn + n * G, G, xq, xd, xs, NB, out); SINK(out); }
            SS_BY_ROWS(nb, Q4Q)
#undef Q4Q
            if (now() - t < one) one = now() - t;
        }
        report("q4, one row per pass", nb, one);
    }
#if defined(SS_AVX2) && defined(__F16C__)
    // as the step runs it: fp16 scales read as they are, activations paired beforehand (ss_pair_groups)
    uint16_t *sh = malloc(sizeof(uint16_t) * N * G), *mh = malloc(sizeof(uint16_t) * N * G);
    for (int i = 0; i < N * G; i++) sh[i] = 0x211f, mh[i] = 0xa666;   // ~0.01, ~-0.05
    static int8_t xp[8 * K];
    static float xe[8 * 4 * G];
    for (int b = 0; b < 8; b++) ss_pair_groups(xq + b * K, xd + b * G, K, 0, G, xp + b * K, xe + b * 4 * G);
    for (int nb = 1; nb <= 8; nb *= 2) {
        double one = 1e9;
        for (int r = 0; r < REPS; r++) {
            double t = now();
#define Q4P(NB) for (int n = 0; n < N; n++) { q4p_row(w + (size_t)n * K / 2, sh + n * G, mh + n * G, 1, G, xp, xd, xe, xs, NB, out); SINK(out); }
            SS_BY_ROWS(nb, Q4P)
#undef Q4P
            if (now() - t < one) one = now() - t;
        }
        report("q4, fp16 scales, paired", nb, one);
    }
#endif
}

// K here: whole blocks of 576 (512 for the 256-weight super-blocks), reported as such
static void raw_rows(int t, const char *name) {
    const int BB = qt_bytes(t), QK = qt_block(t), KB = K / QK * QK;
    const size_t row = (size_t)K / QK * BB;
    for (int b = 0; b < 8; b++)   // the activations' per-32 sums as ss_quantize_row gives them
        for (int g = 0; g < G; g++) {
            int sum = 0;
            for (int j = 0; j < 32; j++) sum += xq[b * K + 32 * g + j];
            xs[b * G + g] = xd[b * G + g] * (float)sum;
        }
    uint8_t *w = malloc(row * N);
    for (size_t i = 0; i < row * N; i++) w[i] = (uint8_t)rand();
    const uint16_t h = 0x2E66;   // a sane fp16 scale (0.1) in every block's d (and dmin / min)
    for (int n = 0; n < N; n++)
        for (int b = 0; b < K / QK; b++) {
            uint8_t *p = w + n * row + (size_t)b * BB;
            if (t == QT_Q6_K) memcpy(p + 208, &h, 2);
            else memcpy(p, &h, 2);
            if (t == QT_Q5_1 || t == QT_Q4_K || t == QT_Q5_K) memcpy(p + 2, &h, 2);
        }
    uint8_t *rw = NULL;   // Q5_0, Q5_1, Q5_K, IQ4_NL, IQ4_XS, Q6_K: also re-blocked as at load (QT_R_*)
    if (t == QT_Q5_0 || t == QT_Q5_1 || t == QT_Q5_K || t == QT_IQ4_NL || t == QT_IQ4_XS || t == QT_Q6_K) {
        rw = malloc(row * N);
        for (int n = 0; n < N; n++) {
            if (t == QT_Q6_K) qt_rb6_pack_row(w + n * row, KB, rw + n * row);
            else qt_rb_pack_row(t, w + n * row, KB, rw + n * row);
        }
    }
    for (int nb = 1; nb <= 8; nb *= 8) {
        double fused = 1e9, decoded = 1e9;
        for (int r = 0; r < REPS / 4; r++) {
            double t0 = now();
#define QTQ(NB) for (int n = 0; n < N; n++) { qt_q8_row(t, w + n * row, KB, xq, xd, xs, NB, out); SINK(out); }
            SS_BY_ROWS(nb, QTQ)
#undef QTQ
            if (now() - t0 < fused) fused = now() - t0;
            if (!qt_per32(t)) continue;
            t0 = now();
            for (int n = 0; n < N; n++) {
                int8_t q[K];
                float sc[G], mn[G];
                qt_unpack_row32(t, w + n * row, KB, q, sc, mn);
                q8q8_row(q, sc, KB / 32, xq, xd, nb, out);
                if (qt_has_min(t))
                    for (int b = 0; b < nb; b++) out[b] += ss_min_term(mn, xs + b * G, KB / 32);
            }
            if (now() - t0 < decoded) decoded = now() - t0;
        }
        char label[64];
        snprintf(label, sizeof label, "%s, qt_q8_row", name);
        report(label, nb, fused * K / KB);
        if (rw) {
            double best = 1e9;
            for (int r = 0; r < REPS / 4; r++) {
                double t0 = now();
#define RBQ(NB) for (int n = 0; n < N; n++) { qt_q8_row(100 + t, rw + n * row, KB, xq, xd, xs, NB, out1); SINK(out1); }
                SS_BY_ROWS(nb, RBQ)
#undef RBQ
                if (now() - t0 < best) best = now() - t0;
            }
            qt_q8_row(t, w + (N - 1) * row, KB, xq, xd, xs, nb, out);
            for (int b = 0; b < nb; b++)
                if (fabsf(out[b] - out1[b]) > 1e-3f * (1.f + fabsf(out[b]))) printf("  MISMATCH %g %g\n", out[b], out1[b]);
            snprintf(label, sizeof label, "%s, re-blocked", name);
            report(label, nb, best * K / KB);
        }
        if (decoded < 1e9) {
            snprintf(label, sizeof label, "%s, row decoded first", name);
            report(label, nb, decoded * K / KB);
        }
    }
}

int main(void) {
    for (int i = 0; i < 8 * K; i++) xq[i] = (int8_t)(rand() % 255 - 127);
    for (int i = 0; i < 8 * G; i++) xd[i] = 0.01f, xs[i] = 0.1f;
    printf("ISA %s, %d x %d weights\n", ss_isa_name(), N, K);
    q4_rows();
    const int types[] = {QT_Q5_0, QT_Q5_1, QT_IQ4_NL, QT_Q4_K, QT_Q5_K, QT_IQ4_XS, QT_Q6_K};
    const char *names[] = {"Q5_0", "Q5_1", "IQ4_NL", "Q4_K", "Q5_K", "IQ4_XS", "Q6_K"};
    for (int i = 0; i < 7; i++) raw_rows(types[i], names[i]);
    return 0;
}
