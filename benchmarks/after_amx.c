// Does vector code run slower right after AMX tile work? Times an activation quantization of 192 values (the
// step's `prepare` of one KV head's outputs) and decode attention of 3 KV heads x 3 query heads over 20 keys
// (fp16 cache, head size 64) right after (a) nothing, (b) an AMX q4 product of 96 x 576 at 8 rows, (c) the same
// product on the vector twin. Mean of 20000 rounds, one thread.
//
//   gcc -O3 -march=native -o /tmp/after_amx benchmarks/after_amx.c -lm && /tmp/after_amx
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "../slipstream/kernels/cpu/ops.h"
#include "../slipstream/kernels/cpu/amx.h"
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
enum { N = 96, K = 576, G = K / 32 };
int main(void) {
    amx_on();
    static uint8_t w4[N * K / 2]; static uint16_t sc[N * G], mn[N * G], st[N * G], mt[N * G];
    for (int i = 0; i < N * K / 2; i++) w4[i] = rand();
    for (int i = 0; i < N * G; i++) sc[i] = st[i] = ss_f32_to_half(0.01f), mn[i] = mt[i] = ss_f32_to_half(-0.1f);
    static float x[8][K], xd[8][G], xs[8][G], y[8 * N], e[4 * G]; static int8_t xq[8][K], p[K];
    for (int m = 0; m < 8; m++) { for (int k = 0; k < K; k++) x[m][k] = (rand() % 100) / 50.f - 1; ss_quantize_row(x[m], K, xq[m], xd[m], xs[m]); }
    const int D = 64, KVH = 3; enum { NK = 20 }; static uint16_t kc[NK * 3 * 64], vc[NK * 3 * 64]; int64_t slots[NK]; float q[9 * 64], out[9 * 64], sp[3 * NK];
    for (int i = 0; i < NK * 3 * 64; i++) kc[i] = vc[i] = ss_f32_to_half((rand() % 100) / 100.f);
    for (int i = 0; i < NK; i++) slots[i] = i;
    for (int i = 0; i < 9 * 64; i++) q[i] = (rand() % 100) / 100.f;
    for (int mode = 0; mode < 3; mode++) {
        double tp = 0, ta = 0; int n = 0;
        for (int r = 0; r < 20000; r++) {
            if (mode == 1) { const AmxAct a = amx_prep(&xq[0][0], &xd[0][0], &xs[0][0], K, 8);
                             amx_rows(w4, sc, mn, st, mt, 1, 1, K, 0, N / 16, &a, 8, NULL, y, N, 0, 0, N); }
            if (mode == 2) twin_rows_q4(w4, sc, mn, st, mt, 1, K, 0, N, &xq[0][0], &xd[0][0], &xs[0][0], 8, NULL, y, N, 0, 0, N);
            double t0 = now();
            ss_quantize_row(x[r & 7], 192, xq[0] + 0, xd[0], xs[0]); ss_pair_groups(xq[0], xd[0], K, 0, 6, p, e);
            double t1 = now();
            for (int h = 0; h < KVH; h++) ss_attend_heads(q + h * 3 * D, 3, kc, vc, SS_KV_F16, NULL, NULL, KVH, h, D, slots, NK, 0.125f, 0.f, sp, out + h * 3 * D, NULL);
            double t2 = now();
            tp += t1 - t0; ta += t2 - t1; n++;
        }
        printf("%s: prepare %.0f ns, attention (3 KV heads, %d keys) %.0f ns\n", mode == 0 ? "after nothing" : mode == 1 ? "after AMX" : "after twin",
               tp / n * 1e9, NK, ta / n * 1e9);
    }
}
