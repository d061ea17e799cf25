// The AVX2 fast q4 and q8 products in cache: the paired one-row kernels (simd.h q4p_row, q8p_row) against
// the 8-weight-rows kernels (q4i_rows8, q8i_rows8) the step takes by default, on SmolLM2's gate/up shape
// (1536 x 576 with fp16 scales: 1.3 MB of q4 codes, 0.9 MB of q8 ones, in L2), at 1, 2, 4 and 8 activation
// rows, best of 300 passes, one thread. Each reads the scales as the step gives them: the paired kernels the
// fp16 [N][G] planes, the 8-row ones their fp16 tile-ordered copy [N/16][G][16].
//
//   gcc -O3 -march=x86-64-v3 -Islipstream/kernels/cpu -o /tmp/avx2_rows8 benchmarks/avx2_rows8.c -lm && /tmp/avx2_rows8
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "simd.h"
enum { N = 1536, K = 576, G = K / 32 };
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(void) {
    uint8_t *w = aligned_alloc(64, N * K / 2); uint16_t *sc = aligned_alloc(64, N * G * 2), *mn = aligned_alloc(64, N*G*2);
    uint16_t *st = aligned_alloc(64, N * G * 2), *mt = aligned_alloc(64, N * G * 2);   // tile-ordered copies
    int8_t *xq = aligned_alloc(64, 8 * K), *xp = aligned_alloc(64, 8 * K); float xd[8 * G], xs[8 * G], xe[8 * 4 * G];
    for (int i = 0; i < N * K / 2; i++) w[i] = rand();
    int8_t *w8 = aligned_alloc(64, N * K);
    for (int i = 0; i < N * K; i++) w8[i] = (rand() % 255) - 127;
    for (int i = 0; i < N * G; i++) sc[i] = 0x2000 + (rand() & 255), mn[i] = 0x2000 + (rand() & 255);
    for (int n = 0; n < N; n++)
        for (int g = 0; g < G; g++) st[((n / 16) * G + g) * 16 + n % 16] = sc[n * G + g], mt[((n / 16) * G + g) * 16 + n % 16] = mn[n * G + g];
    for (int i = 0; i < 8 * K; i++) xq[i] = (rand() % 255) - 127;
    for (int i = 0; i < 8 * G; i++) xd[i] = 0.01f, xs[i] = 1.f;
    for (int b = 0; b < 8; b++) ss_pair_groups(xq + b * K, xd + b * G, K, 0, G, xp + b * K, xe + b * 4 * G);
    float sink = 0;
    for (int nb = 1; nb <= 8; nb *= 2) {
        double best_p = 1e9, best_i = 1e9;
        for (int rep = 0; rep < 300; rep++) {
            double t0 = now();
#define QP(NB) q4p_row(w + (int64_t)n * K / 2, sc + n * G, mn + n * G, 1, G, xp, xd, xe, xs, NB, out)
            for (int n = 0; n < N; n++) { float out[8]; SS_BY_ROWS(nb, QP); for (int b = 0; b < nb; b++) sink += out[b]; }
            double t1 = now();
            for (int n = 0; n < N; n += 8) {
                const uint8_t *ws[8]; for (int r = 0; r < 8; r++) ws[r] = w + (int64_t)(n + r) * K / 2;
                __m256 out[8];
                const int64_t at = (int64_t)(n / 16) * G * 16 + n % 16;
#define QI(NB) q4i_rows8(ws, st + at, mt + at, 1, 16, G, xq, xd, xs, NB, NULL, 0, out)
                SS_BY_ROWS(nb, QI); for (int b = 0; b < nb; b++) sink += _mm256_cvtss_f32(out[b]);
            }
            double t2 = now();
            if (t1 - t0 < best_p) best_p = t1 - t0;
            if (t2 - t1 < best_i) best_i = t2 - t1;
        }
        double best_p8 = 1e9, best_i8 = 1e9;
        for (int rep = 0; rep < 300; rep++) {
            double t0 = now();
#define Q8P(NB) q8p_row(w8 + (int64_t)n * K, sc + n * G, 1, G, xp, xd, xe, NB, out)
            for (int n = 0; n < N; n++) { float out[8]; SS_BY_ROWS(nb, Q8P); for (int b = 0; b < nb; b++) sink += out[b]; }
            double t1 = now();
            for (int n = 0; n < N; n += 8) {
                const int8_t *ws[8]; for (int r = 0; r < 8; r++) ws[r] = w8 + (int64_t)(n + r) * K;
                __m256 out[8];
                const int64_t at = (int64_t)(n / 16) * G * 16 + n % 16;
#define Q8I(NB) q8i_rows8(ws, st + at, 1, 16, G, xq, xd, NB, NULL, 0, out)
                SS_BY_ROWS(nb, Q8I); for (int b = 0; b < nb; b++) sink += _mm256_cvtss_f32(out[b]);
            }
            double t2 = now();
            if (t1 - t0 < best_p8) best_p8 = t1 - t0;
            if (t2 - t1 < best_i8) best_i8 = t2 - t1;
        }
        double mac = (double)N * K * nb;
        printf("rows %d: q4 paired %5.1f MAC/ns, 8 rows %5.1f (%.2fx); q8 paired %5.1f, 8 rows %5.1f (%.2fx)\n", nb,
               mac / best_p * 1e-9, mac / best_i * 1e-9, best_p / best_i, mac / best_p8 * 1e-9, mac / best_i8 * 1e-9,
               best_p8 / best_i8);
    }
    return sink == 12345;
}
