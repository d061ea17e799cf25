// In-cache speed and agreement of the AMX tile products (kernels/cpu/amx.h) against the paired AVX-512
// kernels (simd.h's q4p_row, q8p_row) and the vector twins (twin_rows_*, twin16_rows_*, which the step runs where
// there are no tiles): a 1536 x 576 matrix (SmolLM2's gate/up
// shape) against 2, 4 and 8 activation rows, q4 with fp16 scales and mins and q8 with fp16 scales.
// Prints the best of 200 passes as multiply-accumulates per nanosecond, and the largest relative
// difference between the two kernels' outputs (they differ by fp32 rounding only).
//
//   gcc -O3 -march=native -o /tmp/amx_kernels benchmarks/amx_kernels.c -lm && /tmp/amx_kernels
// With -DN_ROWS=98304 -DPASSES=10 the matrix (28 MB as q4) no longer fits in L2: the speed the step sees.
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "../slipstream/kernels/cpu/ops.h"
#include "../slipstream/kernels/cpu/amx.h"

#ifndef SS_AMX
int main(void) { puts("this build has no AMX (needs -march with amx-tile and amx-int8)"); return 0; }
#else
#ifndef N_ROWS
#define N_ROWS 1536   // -DN_ROWS=98304 -DPASSES=10: a 28 MB q4 matrix, streamed from L3 as in the step
#endif
#ifndef PASSES
#define PASSES 200
#endif
enum { N = N_ROWS, K = 576, G = K / 32 };

static unsigned rng = 7;
static float frand(void) { rng = rng * 1103515245u + 12345u; return ((rng >> 8) & 0xFFFF) / 32768.0f - 1.0f; }
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

int main(void) {
    if (!amx_on()) { puts("the kernel refused the tile state (arch_prctl)"); return 1; }
    static uint8_t w4[N * K / 2];
    static int8_t w8[N * K];
    static uint16_t sc[N * G], mn[N * G], st[N * G], mt[N * G];   // st, mt: the planes tile-ordered [N/16][G][16]
    static float x[8][K], xd[8][G], xs[8][G], xe[8][4 * G], ya[8 * N], yb[8 * N], yt[8 * N], y16[8 * N];
    static int8_t xq[8][K], xp[8][K];
    for (int i = 0; i < N * K / 2; i++) w4[i] = (uint8_t)(rand() & 255);
    for (int i = 0; i < N * K; i++) w8[i] = (int8_t)(rand() % 255 - 127);
    for (int i = 0; i < N * G; i++) sc[i] = ss_f32_to_half(0.01f + 0.02f * (frand() + 1)), mn[i] = ss_f32_to_half(-0.1f * (frand() + 1));
    for (int n = 0; n < N; n++)
        for (int g = 0; g < G; g++) st[((n / 16) * G + g) * 16 + n % 16] = sc[n * G + g], mt[((n / 16) * G + g) * 16 + n % 16] = mn[n * G + g];
    for (int m = 0; m < 8; m++) {
        for (int k = 0; k < K; k++) x[m][k] = frand();
        ss_quantize_row(x[m], K, xq[m], xd[m], xs[m]);
        ss_pair_groups(xq[m], xd[m], K, 0, G, xp[m], xe[m]);
    }
    for (int q4 = 1; q4 >= 0; q4--)
        for (int nb = 1; nb <= 8; nb *= 2) {
            double best_a = 1e9, best_p = 1e9, best_t = 1e9, best_16 = 1e9;
            for (int p = 0; p < PASSES; p++) {
                double t0 = now();
                const AmxAct a = amx_prep(&xq[0][0], &xd[0][0], &xs[0][0], K, nb);
                amx_rows(q4 ? (const void *)w4 : (const void *)w8, sc, q4 ? mn : NULL, st, q4 ? mt : NULL, 1, q4, K, 0, N / 16, &a, nb,
                         NULL, ya, N, 0, 1, N);
                double t1 = now();
                for (int n = 0; n < N; n++) {
                    float out[MAX_ROWS];
#define ROW(NB) if (q4) q4p_row(w4 + (int64_t)n * K / 2, sc + n * G, mn + n * G, 1, G, &xp[0][0], &xd[0][0], &xe[0][0], &xs[0][0], NB, out); \
                else q8p_row(w8 + (int64_t)n * K, sc + n * G, 1, G, &xp[0][0], &xd[0][0], &xe[0][0], NB, out);
                    SS_BY_ROWS(nb, ROW)
                    for (int m = 0; m < nb; m++) yb[m * N + n] = out[m];
                }
                double t2 = now();
                if (q4) twin_rows_q4(w4, sc, mn, st, mt, 1, K, 0, N, &xq[0][0], &xd[0][0], &xs[0][0], nb, NULL, yt, N, 0, 1, N);
                else twin_rows_q8(w8, sc, st, 1, K, 0, N, &xq[0][0], &xd[0][0], nb, NULL, yt, N, 0, 1, N);
                double t3 = now();
                if (q4) twin16_rows_q4(w4, sc, mn, st, mt, 1, K, 0, N, &xq[0][0], &xd[0][0], &xs[0][0], nb, NULL, y16, N, 0, 1, N);
                else twin16_rows_q8(w8, sc, st, 1, K, 0, N, &xq[0][0], &xd[0][0], nb, NULL, y16, N, 0, 1, N);
                const double t4 = now();
                if (t4 - t3 < best_16) best_16 = t4 - t3;
                if (t1 - t0 < best_a) best_a = t1 - t0;
                if (t2 - t1 < best_p) best_p = t2 - t1;
                if (t3 - t2 < best_t) best_t = t3 - t2;
            }
            double worst = 0;
            for (int m = 0; m < nb; m++)
                for (int n = 0; n < N; n++) {
                    double d = fabs(ya[m * N + n] - yb[m * N + n]) / (1e-3 + fabs(yb[m * N + n]));
                    if (d > worst) worst = d;
                }
            const double macs = (double)N * K * nb;
            int same = memcmp(ya, yt, sizeof(float) * nb * N) == 0 && memcmp(ya, y16, sizeof(float) * nb * N) == 0;
            // and with the [N][G] planes only (gathered): the same bits
            if (q4) twin_rows_q4(w4, sc, mn, NULL, NULL, 1, K, 0, N, &xq[0][0], &xd[0][0], &xs[0][0], nb, NULL, yt, N, 0, 1, N);
            else twin_rows_q8(w8, sc, NULL, 1, K, 0, N, &xq[0][0], &xd[0][0], nb, NULL, yt, N, 0, 1, N);
            same = same && memcmp(ya, yt, sizeof(float) * nb * N) == 0;
            printf("%s rows %d: AMX %6.1f MAC/ns   paired %6.1f MAC/ns   (%.2fx)   max rel diff %.2g   twin %6.1f, twin16 %6.1f MAC/ns (%s)\n",
                   q4 ? "q4" : "q8", nb, macs / best_a * 1e-9, macs / best_p * 1e-9, best_p / best_a, worst,
                   macs / best_t * 1e-9, macs / best_16 * 1e-9, same ? "bitwise the tiles'" : "DIFFERS from the tiles");
        }
    return 0;
}
#endif
