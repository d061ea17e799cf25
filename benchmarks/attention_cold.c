// The decode step's attention pattern outside the step: ss_attend_heads (kernels/cpu/ops.h) for 8 rows x 30
// layers x 3 KV heads of SmolLM2's shape (9 query heads, head size 64, fp16 cache), each row over its own n
// contiguous slots, one layer after another as the step does (the cache, 8 x 30 x n x 768 bytes, is read
// once per pass: from L3 or memory), and again with every layer's pass over layer 0's rows (warm, in L2).
// Prints the best of 20 passes per mode as nanoseconds per (row, layer, KV head, token) and the cache's
// bytes per second. One thread; the step runs two of these beside the weights' stream.
//
//   gcc -O3 -march=native -ffp-contract=off -Islipstream/kernels/cpu -o /tmp/attention_cold benchmarks/attention_cold.c -lm
//   /tmp/attention_cold 100
//   /tmp/attention_cold 100 i8     (the int8 cache: codes and a scale per row, ops.h SS_KV_I8)
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <time.h>

#include "ops.h"

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

int main(int argc, char **argv) {
    const int n = argc > 1 ? atoi(argv[1]) : 100, LAYERS = 30, ROWS = 8, KVH = 3, D = 64, GROUP = 3;
    const int et = argc > 2 && argv[2][0] == 'i' ? SS_KV_I8 : SS_KV_F16, esz = SS_KV_ESZ(et);
    const size_t per_layer = (size_t)ROWS * n * KVH * D;   // elements of K (and of V) per layer
    char *k = malloc(esz * per_layer * LAYERS), *v = malloc(esz * per_layer * LAYERS);
    float *ks = malloc(sizeof(float) * per_layer * LAYERS / D), *vs = malloc(sizeof(float) * per_layer * LAYERS / D);
    for (size_t r = 0; r < per_layer * LAYERS / D; r++) {
        float kr[64], vr[64];
        for (int d = 0; d < D; d++) kr[d] = (float)rand() / RAND_MAX - 0.5f, vr[d] = (float)rand() / RAND_MAX - 0.5f;
        ss_kv_store(k, ks, et, (int64_t)r, 1, 0, D, kr);
        ss_kv_store(v, vs, et, (int64_t)r, 1, 0, D, vr);
    }
    int64_t *slots = malloc(sizeof(int64_t) * ROWS * n);
    for (int i = 0; i < ROWS * n; i++) slots[i] = i;
    float q[9 * 64], out[9 * 64], *p = malloc(sizeof(float) * GROUP * n);
    for (int i = 0; i < 9 * 64; i++) q[i] = 4.0f * rand() / RAND_MAX - 2.0f;
    for (int warm = 0; warm < 2; warm++) {
        double best = 1e30;
        for (int r = 0; r < 20; r++) {
            const double t = now();
            for (int L = 0; L < LAYERS; L++)
                for (int b = 0; b < ROWS; b++) {
                    const size_t off = warm ? 0 : (size_t)L * per_layer;
                    for (int kvh = 0; kvh < KVH; kvh++)
                        ss_attend_heads(q + kvh * GROUP * D, GROUP, k + off * esz, v + off * esz, et, ks + off / D,
                                        vs + off / D, KVH, kvh, D, slots + b * n,
                                        n, 0.125f, 0.f, p, out + kvh * GROUP * D, NULL);
                }
            const double dt = now() - t;
            if (dt < best) best = dt;
        }
        printf("n=%d %s %s: %.0f us per step's attention, %.1f ns per (row, layer, KV head, token), %.1f GB/s of cache\n",
               n, et == SS_KV_I8 ? "int8" : "fp16", warm ? "warm (layer 0's rows, in L2)" : "cold (every layer's rows)",
               best * 1e6, best * 1e9 / ((double)LAYERS * ROWS * KVH * n),
               2.0 * (esz * D + (et == SS_KV_I8 ? 4 : 0)) * (per_layer / D) * LAYERS / best / 1e9);
    }
    free(k), free(v), free(ks), free(vs), free(slots), free(p);
    return 0;
}
