// Where a batch-8 q4 tile product's time goes on an AMX CPU, and a variant that was tried and not kept.
//
// The step's q4 products at 8 activation rows (kernels/cpu/amx.h, amx_rows_q4) run ~60 cycles per block of 16
// weight rows x 8 rows x one group of 32 codes. This file times that kernel against a variant with the roles
// of the tile operands swapped: the activations as A (read in place, no B operand to build), the weights as B
// in VNNI order (unpacked and transposed 16 x 16 dwords in registers), so that a sum tile's row is one
// activation row with lanes = weight rows and the epilogue needs no permutes (cvt, mul, fma, fma per vector,
// the scales' broadcasts from memory). Both give the same bits (checked below). Compiled with one of
//   -DNO_UNPACK  the variant skips unpacking its weights (stale operands: wrong results, timing only)
//   -DNO_EPI     the variant skips its epilogue
//   -DFAKE_C     the epilogue reads a buffer the tiles never store to (no tile-store -> load dependency)
//   -DFAKE_B     the tiles load B from a buffer the vector units never store to (no store -> tile-load hazard)
// the variant's time splits into tile operations, unpacking and epilogue:
//
//   gcc -O3 -march=native -o /tmp/amx_breakdown benchmarks/amx_breakdown.c -lm && /tmp/amx_breakdown
//   for f in -DNO_EPI -DNO_UNPACK "-DNO_EPI -DNO_UNPACK" -DFAKE_C -DFAKE_B; do
//     gcc -O3 -march=native $f -o /tmp/amx_breakdown benchmarks/amx_breakdown.c -lm && /tmp/amx_breakdown; done
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../slipstream/kernels/cpu/ops.h"
#include "../slipstream/kernels/cpu/amx.h"

#ifndef SS_AMX
int main(void) { puts("this build has no AMX (needs -march with amx-tile and amx-int8)"); return 0; }
#else
// the variant: q4 tiles with the activations as A and the weights as B (transposed in registers)
// tile registers: C 0-3 (nb rows x 16 int32), A 4-5 (nb rows x 32 codes), B 6-7 (8 quads x 16 rows x 4)
static SSTileCfg amxt_cfg[9];
static void amxt_cfg_init(void) {
    for (int nb = 1; nb <= 8; nb++) {
        SSTileCfg *c = &amxt_cfg[nb];
        memset(c, 0, sizeof *c);
        c->palette = 1;
        for (int t = 0; t < 4; t++) c->colsb[t] = 64, c->rows[t] = nb;
        for (int t = 4; t < 6; t++) c->colsb[t] = 32, c->rows[t] = nb;
        for (int t = 6; t < 8; t++) c->colsb[t] = 64, c->rows[t] = 8;
    }
}
// groups g..g+3 of 16 q4 rows from w as four B operands at buf + 512 i: row q of group i = codes 4q..4q+3 of the
// 16 weight rows (q < 4: low nibbles of the group's dword q; q >= 4: high nibbles of dword q - 4)
AI void amxt_unpack(const uint8_t *w, int64_t row_bytes, int g, int G, uint8_t *buf) {
#ifdef NO_UNPACK
    return;
#endif
    const int ng = G - g < 4 ? G - g : 4;
    const __mmask64 k = ng == 4 ? ~0ULL : (1ULL << (16 * ng)) - 1;
    __m512i r[16], t[16];
    for (int n = 0; n < 16; n++) r[n] = _mm512_maskz_loadu_epi8(k, w + n * row_bytes + 16 * g);
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    // r[4 i + j], 128-bit lane L: dword 4 L + j (group L's dword j) of rows 4 i .. 4 i + 3
    const __m512i m4 = _mm512_set1_epi8(15);
    for (int j = 0; j < 4; j++) {
        const __m512i v0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), v1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
        const __m512i v2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44), v3 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
        const __m512i T[4] = {_mm512_shuffle_i32x4(v0, v2, 0x88), _mm512_shuffle_i32x4(v0, v2, 0xDD),
                              _mm512_shuffle_i32x4(v1, v3, 0x88), _mm512_shuffle_i32x4(v1, v3, 0xDD)};
        for (int L = 0; L < ng; L++) {
            _mm512_store_si512(buf + 512 * L + 64 * j, _mm512_and_si512(T[L], m4));
            _mm512_store_si512(buf + 512 * L + 64 * (4 + j), _mm512_and_si512(_mm512_srli_epi16(T[L], 4), m4));
        }
    }
}

AI void amxt_epilogue(__m512 acc[8], const int32_t *c, const float *xd, const float *xs, int G, int g, int nb,
                      const float *sw16, const float *mw16) {
#ifdef NO_EPI
    return;
#endif
    const __m512 w = _mm512_load_ps(sw16), o = _mm512_load_ps(mw16);
    for (int m = 0; m < 8; m++) {
        if (m >= nb) break;
        const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * m)), _mm512_set1_ps(xd[m * G + g]));
        acc[m] = _mm512_fmadd_ps(v, w, acc[m]);
        acc[m] = _mm512_fmadd_ps(o, _mm512_set1_ps(xs[m * G + g]), acc[m]);
    }
}

__attribute__((noinline)) static void amxt_rows_q4(const void *wq, const void *sc, const void *mn, const void *st, const void *mt,
                                  int half, int K, int64_t n0, int blocks, const int8_t *xq, const float *xd,
                                  const float *xs, int nb, const float *bias, float *y, int ystride, int accumulate,
                                  int pf, int64_t n_all) {
    enum { LAG = 3 };
    const int G = K / 32;
    const int64_t row_bytes = K / 2;
    _Alignas(64) uint8_t bbuf[2][4 * 512];
    _Alignas(64) int32_t cbuf[2][8 * 16];
#ifdef FAKE_C
    static _Alignas(64) int32_t fakec[8 * 16];
#endif
    _Alignas(64) float sw[2][4][16], mw[2][4][16];
    _tile_loadconfig(&amxt_cfg[nb]);
    for (int blk = 0; blk < blocks; blk++) {
        const int64_t n = n0 + 16 * (int64_t)blk;
        const uint8_t *w = (const uint8_t *)wq + n * row_bytes;
        __m512 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm512_setzero_ps();
#define AMXT_STORE_C(t) switch ((t) & 3) { \
            case 0: _tile_stored(T_C0, cbuf[(t) & 1], 64); break; case 1: _tile_stored(T_C1, cbuf[(t) & 1], 64); break; \
            case 2: _tile_stored(T_C2, cbuf[(t) & 1], 64); break; default: _tile_stored(T_C3, cbuf[(t) & 1], 64); }
#ifdef FAKE_C
#define AMXT_SCALE(p) amxt_epilogue(acc, fakec, xd, xs, G, (p), nb, sw[((p) >> 2) & 1][(p) & 3], mw[((p) >> 2) & 1][(p) & 3])
#else
#define AMXT_SCALE(p) amxt_epilogue(acc, cbuf[(p) & 1], xd, xs, G, (p), nb, sw[((p) >> 2) & 1][(p) & 3], mw[((p) >> 2) & 1][(p) & 3])
#endif
        amxt_unpack(w, row_bytes, 0, G, bbuf[0]);
        for (int g = 0; g < G; g++) {
            const int i = g & 3;
            if (i == 0) {
                const int ng = G - g < 4 ? G - g : 4;
                if (pf && n + 16 * (AMX_PF_BLOCKS + 1) <= n_all)
                    amx_prefetch_later(wq, sc, mn, st, mt, half, 1, G, row_bytes, n + 16 * AMX_PF_BLOCKS, g, 0, 16);
                tile_scales(sc, mn, st, mt, half, 1, G, n, 16, g, ng, sw[(g >> 2) & 1], mw[(g >> 2) & 1]);
                if (g + 4 < G) amxt_unpack(w, row_bytes, g + 4, G, bbuf[((g >> 2) + 1) & 1]);
            }
#ifdef FAKE_B
            static _Alignas(64) uint8_t fakeb[512]; const uint8_t *Bp = fakeb;
#else
            const uint8_t *Bp = bbuf[(g >> 2) & 1] + 512 * i;
#endif
            if (g & 1) { _tile_loadd(T_A1, xq + 32 * g, K); _tile_loadd(T_B1, Bp, 64); }
            else { _tile_loadd(T_A0, xq + 32 * g, K); _tile_loadd(T_B0, Bp, 64); }
#define AMXT_DP(C) if (g & 1) _tile_dpbsud(C, T_A1, T_B1); else _tile_dpbsud(C, T_A0, T_B0);
            switch (i) {
            case 0: _tile_zero(T_C0); AMXT_DP(T_C0) break;
            case 1: _tile_zero(T_C1); AMXT_DP(T_C1) break;
            case 2: _tile_zero(T_C2); AMXT_DP(T_C2) break;
            default: _tile_zero(T_C3); AMXT_DP(T_C3)
            }
#undef AMXT_DP
            if (g >= LAG) AMXT_STORE_C(g - LAG)
            if (g > LAG) AMXT_SCALE(g - LAG - 1);
        }
        for (int p = G > LAG ? G - LAG : 0; p <= G; p++) {
            if (p < G) AMXT_STORE_C(p)
            if (p > 0 && p - 1 >= G - LAG - 1) AMXT_SCALE(p - 1);
        }
#undef AMXT_SCALE
#undef AMXT_STORE_C
        const __m512 b16 = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
        for (int m = 0; m < nb; m++) {
            float *yo = y + (int64_t)m * ystride + n;
            __m512 v = _mm512_add_ps(acc[m], b16);
            if (accumulate) v = _mm512_add_ps(_mm512_loadu_ps(yo), v);
            _mm512_storeu_ps(yo, v);
        }
    }
    _tile_release();
}
#ifndef NM   // matrices cycled through (-DNM=30: 13 MB, from L3 as in the step)
#define NM 1
#endif
enum { N = 1536, K = 576, G = K / 32 };
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static unsigned rng = 7;
static float frand(void) { rng = rng * 1103515245u + 12345u; return ((rng >> 8) & 0xFFFF) / 32768.0f - 1.0f; }
int main(void) {
    amx_on(); amxt_cfg_init();
    uint8_t *w4 = aligned_alloc(64, (size_t)NM * N * K / 2);
    uint16_t *sc = aligned_alloc(64, (size_t)NM * N * G * 2), *mn = aligned_alloc(64, (size_t)NM * N * G * 2);
    uint16_t *st = aligned_alloc(64, (size_t)NM * N * G * 2), *mt = aligned_alloc(64, (size_t)NM * N * G * 2);
    for (size_t i = 0; i < (size_t)NM * N * K / 2; i++) w4[i] = rand();
    for (size_t i = 0; i < (size_t)NM * N * G; i++) sc[i] = ss_f32_to_half(0.01f + 0.02f * (frand() + 1)), mn[i] = ss_f32_to_half(-0.1f * (frand() + 1));
    for (int mi = 0; mi < NM; mi++) for (int n = 0; n < N; n++) for (int g = 0; g < G; g++) {
        size_t o = (size_t)mi * N * G;
        st[o + ((n / 16) * G + g) * 16 + n % 16] = sc[o + n * G + g], mt[o + ((n / 16) * G + g) * 16 + n % 16] = mn[o + n * G + g];
    }
    static float x[8][K], xd[8][G], xs[8][G], ya[8 * N], yb[8 * N], bias[N];
    static int8_t xq[8][K];
    for (int n = 0; n < N; n++) bias[n] = frand();
    for (int m = 0; m < 8; m++) { for (int k = 0; k < K; k++) x[m][k] = frand(); ss_quantize_row(x[m], K, xq[m], xd[m], xs[m]); }
    for (int nb = 6; nb <= 8; nb++) {
        double ta = 1e9, tb = 1e9;
        for (int pass = 0; pass < 300; pass++) {
            const int mi = pass % NM; const size_t o = (size_t)mi * N;
            double t0 = now();
            const AmxAct a = amx_prep(&xq[0][0], &xd[0][0], &xs[0][0], K, nb);
            amx_rows(w4 + o * K / 2, sc + o * G, mn + o * G, st + o * G, mt + o * G, 1, 1, K, 0, N / 16, &a, nb, bias, ya, N, 0, 1, N);
            double t1 = now();
            amxt_rows_q4(w4 + o * K / 2, sc + o * G, mn + o * G, st + o * G, mt + o * G, 1, K, 0, N / 16, &xq[0][0], &xd[0][0], &xs[0][0], nb, bias, yb, N, 0, 1, N);
            double t2 = now();
            if (pass > 10) { if (t1 - t0 < ta) ta = t1 - t0; if (t2 - t1 < tb) tb = t2 - t1; }
        }
        int same = memcmp(ya, yb, sizeof(float) * nb * N) == 0;
        const double macs = (double)N * K * nb;
        const double blocks = (double)(N / 16) * G;   // blocks of 16 weight rows x nb rows x 32 codes
        printf("nb %d: current %.1f MAC/ns (%.1f ns per block), transposed %.1f MAC/ns (%.1f ns per block): %.2fx, %s\n", nb,
               macs / ta * 1e-9, ta / blocks * 1e9, macs / tb * 1e-9, tb / blocks * 1e9, ta / tb,
               same ? "bitwise equal" : "DIFFERENT bits");
    }
}
#endif
