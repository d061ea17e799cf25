// How far ahead to prefetch a streamed q4 matrix for the AVX2 8-row kernel (simd.h q4i_rows8): a 28 MB matrix
// (98304 x 576, fp16 tile-ordered scales) at 1 and 8 activation rows, prefetch 0 to 128 rows ahead, best of 5, one thread.
//   gcc -O3 -march=native -Islipstream/kernels/cpu -o /tmp/pfb benchmarks/avx2_stream_prefetch.c -lm && /tmp/pfb
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "simd.h"
enum { N = 98304, K = 576, G = K / 32 };
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int argc, char **argv) {
    uint8_t *w = aligned_alloc(64, (size_t)N * K / 2); uint16_t *st = aligned_alloc(64, (size_t)N * G * 2), *mt = aligned_alloc(64, (size_t)N * G * 2);
    int8_t *xq = aligned_alloc(64, 8 * K); float xd[8 * G], xs[8 * G];
    for (size_t i = 0; i < (size_t)N * K / 2; i++) w[i] = rand();
    for (size_t i = 0; i < (size_t)N * G; i++) st[i] = 0x2000 + (rand() & 255), mt[i] = 0x2000 + (rand() & 255);
    for (int i = 0; i < 8 * K; i++) xq[i] = (rand() % 255) - 127;
    for (int i = 0; i < 8 * G; i++) xd[i] = 0.01f, xs[i] = 1.f;
    int dists[] = {0, 8, 16, 32, 64, 128};
    float sink = 0;
    for (int nb = 1; nb <= 8; nb *= 8)
    for (int di = 0; di < 6; di++) {
        int D = dists[di]; double best = 1e9;
        for (int rep = 0; rep < 5; rep++) {
            double t0 = now();
            for (int n = 0; n < N; n += 8) {
                const uint8_t *ws[8]; for (int r = 0; r < 8; r++) ws[r] = w + (int64_t)(n + r) * K / 2;
                __m256 out[8];
                const int64_t at = (int64_t)(n / 16) * G * 16 + n % 16;
                const char *pf = D && n + D + 8 <= N ? (const char *)w + (int64_t)(n + D) * K / 2 : NULL;
                if (pf) { const char *ps = (const char *)(st + (int64_t)((n + D) / 16) * G * 16); if (((n + D) & 15) == 0) for (int o = 0; o < 32 * G; o += 64) __builtin_prefetch(ps + o, 0, 2), __builtin_prefetch((const char *)(mt + (int64_t)((n + D) / 16) * G * 16) + o, 0, 2); }
#define QI(NB) q4i_rows8(ws, st + at, mt + at, 1, 16, G, xq, xd, xs, NB, pf, 0, out)
                SS_BY_ROWS(nb, QI); for (int b = 0; b < nb; b++) sink += _mm256_cvtss_f32(out[b]);
            }
            double dt = now() - t0; if (dt < best) best = dt;
        }
        double bytes = (double)N * K / 2 + 4.0 * N * G;
        printf("nb %d D %3d rows (%6d B): %6.1f MAC/ns %5.1f GB/s\n", nb, D, D * (K / 2 + 4 * G), (double)N * K * nb / best * 1e-9, bytes / best * 1e-9);
    }
    return sink == 12345;
}
