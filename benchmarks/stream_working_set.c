// How fast one thread streams a q4 matrix through the batch-1 fast-path kernel (amx.h's vector twin) as
// the matrix grows past what this host's shared L3 keeps for us: SmolLM2's K = 576, Q4_1-sized rows, fp16
// scales, 8 MB to 141 MB (the default model's step reads ~97 MB of weights). Prints GB/s of weights (codes
// and scales), best of 10 passes. Needs an AVX-512 VNNI build (the twin).
//
//   gcc -O3 -march=native -o /tmp/stream_ws benchmarks/stream_working_set.c -lm && /tmp/stream_ws
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "../slipstream/kernels/cpu/ops.h"
#include "../slipstream/kernels/cpu/amx.h"

#ifndef SS_TWIN
int main(void) { puts("this build has no 512-bit VNNI (the twin)"); return 0; }
#else
enum { K = 576, G = K / 32 };
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

int main(void) {
    static float x[K], xd[G], xs[G];
    static int8_t xq[K];
    for (int k = 0; k < K; k++) x[k] = (rand() % 100) / 50.f - 1;
    ss_quantize_row(x, K, xq, xd, xs);
    for (long n = 12288; n <= 393216; n *= 2) {
        uint8_t *w = aligned_alloc(64, (size_t)n * K / 2);
        uint16_t *sc = aligned_alloc(64, (size_t)n * G * 2), *mn = aligned_alloc(64, (size_t)n * G * 2);
        float *y = aligned_alloc(64, (size_t)n * 4);
        for (long i = 0; i < n * K / 2; i++) w[i] = (uint8_t)rand();
        for (long i = 0; i < n * G; i++) sc[i] = ss_f32_to_half(0.01f), mn[i] = ss_f32_to_half(-0.1f);
        double best = 1e9;
        for (int p = 0; p < 10; p++) {
            const double t0 = now();
            // the planes passed as the tile-ordered copy too: the same bytes, read in the kernels' order
            twin_rows_q4(w, sc, mn, sc, mn, 1, K, 0, n, xq, xd, xs, 1, NULL, y, (int)n, 0, 1, n);
            if (now() - t0 < best) best = now() - t0;
        }
        const double bytes = (double)n * K * 0.625;   // 4-bit codes + an fp16 scale and min per 32
        printf("%6.1f MB of weights: %5.1f GB/s\n", bytes * 1e-6, bytes / best * 1e-9);
        free(w), free(sc), free(mn), free(y);
    }
    return 0;
}
#endif
