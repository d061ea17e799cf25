// Checks simd.h's row kernels against plain double-precision loops, for a cross-compiled build that
// runs under qemu-user (tests/kernels/test_isa_builds.py). Prints the ISA and "ok", or the first
// mismatch; exit status 0 only when every check passes.
#include <stdio.h>
#include <stdlib.h>

#include "../../slipstream/kernels/cpu/qtypes.h"
#include "../../slipstream/kernels/cpu/ops.h"

static unsigned rng = 12345;
static float frand(void) { rng = rng * 1103515245u + 12345u; return ((rng >> 8) & 0xFFFF) / 32768.0f - 1.0f; }
static int irand(int lo, int hi) { rng = rng * 1103515245u + 12345u; return lo + (int)((rng >> 8) % (unsigned)(hi - lo + 1)); }

static int close_to(double got, double want, double tol, const char *what, int i) {
    if (fabs(got - want) <= tol * (1.0 + fabs(want))) return 1;
    printf("mismatch %s[%d]: got %.9g want %.9g\n", what, i, got, want);
    return 0;
}

// qtypes.h: every block type's products (fast and exact) against double loops over its decoding
static int check_qtypes(void) {
    static const int types[] = {QT_Q4_0, QT_Q4_1, QT_Q5_0, QT_Q5_1, QT_Q8_0, QT_Q2_K, QT_Q3_K, QT_Q4_K,
                                QT_Q5_K, QT_Q6_K, QT_IQ4_NL, QT_IQ4_XS, QT_F16, QT_BF16};
    // byte offsets of the fp16 scale fields per type (first: d, may be negative; second: a min scale)
    static const uint16_t halves[] = {0x2E66, 0x2A66, 0xAE66, 0x3266};
    enum { K = 512, R = 3 };
    static uint8_t w[K * 4];
    static float x[R][K], xd[R][K / 32], xs[R][K / 32], wf[K], out[MAX_ROWS];
    static int8_t xq[R][K];
    int ok = 1;
    for (int r = 0; r < R; r++) {
        for (int i = 0; i < K; i++) x[r][i] = frand() * 2.0f;
        ss_quantize_row(x[r], K, xq[r], xd[r], xs[r]);
    }
    for (unsigned ti = 0; ti < sizeof(types) / sizeof(types[0]); ti++) {
        const int t = types[ti], QK = qt_block(t), BB = qt_bytes(t), nblk = K / QK;
        int f0 = -1, f1 = -1;
        switch (t) {
        case QT_Q4_0: case QT_Q5_0: case QT_Q8_0: case QT_IQ4_NL: case QT_IQ4_XS: f0 = 0; break;
        case QT_Q4_1: case QT_Q5_1: case QT_Q4_K: case QT_Q5_K: f0 = 0, f1 = 2; break;
        case QT_Q2_K: f0 = 80, f1 = 82; break;
        case QT_Q3_K: f0 = 108; break;
        case QT_Q6_K: f0 = 208; break;
        }
        for (int i = 0; i < nblk * BB; i++) w[i] = (uint8_t)irand(0, 255);
        if (t == QT_F16 || t == QT_BF16)   // sane values: small exponents only
            for (int i = 0; i < K; i++) w[2 * i + 1] = (uint8_t)((t == QT_F16 ? 0x30 : 0x3D) | (w[2 * i + 1] & 0x83));
        for (int b = 0; b < nblk && f0 >= 0; b++) {
            const uint16_t h = halves[irand(0, 3)], hm = halves[irand(0, 1)];
            memcpy(w + b * BB + f0, &h, 2);
            if (f1 >= 0) memcpy(w + b * BB + f1, &hm, 2);
        }
        qt_dequant_row(t, w, K, wf);
        double want[R] = {0}, wantq[R] = {0};
        for (int r = 0; r < R; r++)
            for (int i = 0; i < K; i++) {
                want[r] += (double)wf[i] * x[r][i];
                wantq[r] += (double)wf[i] * xq[r][i] * xd[r][i / 32];
            }
        double scale = 1e-3;
        for (int r = 0; r < R; r++) scale = fmax(scale, fabs(want[r]));
        float xsum[R][K / 32];
        for (int r = 0; r < R; r++) ss_group_sums(x[r], K, xsum[r]);
        qt_f_row(t, w, K, x[0], xsum[0], R, out);
        for (int r = 0; r < R; r++) ok &= close_to(out[r] / scale, want[r] / scale, 1e-4, "qt_f", t);
        if (t == QT_F16 || t == QT_BF16) continue;
        qt_q8_row(t, w, K, xq[0], xd[0], xs[0], R, out);
        for (int r = 0; r < R; r++) ok &= close_to(out[r] / scale, wantq[r] / scale, 1e-4, "qt_q8", t);
        if (t != QT_Q5_0 && t != QT_Q5_1 && t != QT_Q5_K && t != QT_IQ4_NL && t != QT_IQ4_XS && t != QT_Q6_K) continue;
        // re-blocked as at load (QT_R_*): the same weights, the same products; over the first KR
        // weights too (G % 4 == 2: the last pair's path; Q5_K, Q6_K and IQ4_XS: whole super-blocks only)
        for (int KR = K; KR >= K - 64; KR -= QK == 256 ? 256 : 64) {
            static uint8_t rw[K * 4];
            static float rf[K];
            if (t == QT_Q6_K) qt_rb6_pack_row(w, KR, rw);
            else qt_rb_pack_row(t, w, KR, rw);
            qt_dequant_row(100 + t, rw, KR, rf);
            for (int i = 0; i < KR && ok; i++)
                if (memcmp(&rf[i], &wf[i], 4)) { printf("mismatch re-blocked decode t%d i%d\n", t, i); ok = 0; }
            double wr[R] = {0}, wrq[R] = {0}, sr = 1e-3;
            for (int r = 0; r < R; r++) {
                for (int i = 0; i < KR; i++) {
                    wr[r] += (double)wf[i] * x[r][i];
                    wrq[r] += (double)wf[i] * xq[r][i] * xd[r][i / 32];
                }
                sr = fmax(sr, fabs(wr[r]));
            }
            // rows of KR: the activations' row stride is KR (rows packed again)
            static int8_t rq[R * K];
            static float rx[R * K], rd[R * K / 32], rs[R * K / 32], rsum[R * K / 32];
            for (int r = 0; r < R; r++) {
                memcpy(rx + r * KR, x[r], sizeof(float) * KR);
                ss_quantize_row(rx + r * KR, KR, rq + r * KR, rd + r * (KR / 32), rs + r * (KR / 32));
                ss_group_sums(rx + r * KR, KR, rsum + r * (KR / 32));
            }
            qt_f_row(100 + t, rw, KR, rx, rsum, R, out);
            for (int r = 0; r < R; r++) ok &= close_to(out[r] / sr, wr[r] / sr, 1e-4, "qt_f re-blocked", t);
            qt_q8_row(100 + t, rw, KR, rq, rd, rs, R, out);
            for (int r = 0; r < R; r++) ok &= close_to(out[r] / sr, wrq[r] / sr, 1e-4, "qt_q8 re-blocked", t);
        }
    }
    return ok;
}

// the per-16 IQ planes (qtypes.h qt_rb16: IQ2_XS, IQ2_S, IQ1_M re-encoded at load), built directly with random
// codes, odd sub-block scales and fp16 d: the decoding, both products (every build, Arm included) and, on AVX2,
// the 8-row kernel bit for bit against its integer sums (as check_q6_rows8)
static int check_rb16(void) {
    static const int types[] = {QT_R_IQ2_XS, QT_R_IQ1_M, QT_R_Q3_K, QT_R_Q2_K};
    enum { S = 3, K = 256 * S, G = K / 32, R = 3 };
    static uint8_t w[8][164 * S];
    static float x[MAX_ROWS][K], xd[MAX_ROWS * G], xs[MAX_ROWS * G], wf[K], out[MAX_ROWS], xsum[MAX_ROWS * G];
    static int8_t xq[MAX_ROWS * K];
    int ok = 1;
    for (int m = 0; m < MAX_ROWS; m++) {
        for (int i = 0; i < K; i++) x[m][i] = frand() * (m == 2 ? 0.f : 2.f);
        ss_quantize_row(x[m], K, xq + m * K, xd + m * G, xs + m * G);
        ss_group_sums(x[m], K, xsum + m * G);
    }
    for (unsigned ti = 0; ti < sizeof(types) / sizeof(types[0]); ti++) {
        const int t = types[ti], q2 = t == QT_R_Q2_K;
        const int64_t ma = qt_rb16_mins_at(G);   // Q2_K's minimums, then its dmin
        const QTValues *kv = qt_kv(t);
        int nv = 16;
        while (nv > 1 && kv->v[nv - 1] == 0) nv--;   // the table's used entries
        for (int r = 0; r < 8; r++) {
            for (int i = 0; i < 16 * G; i++) w[r][i] = (uint8_t)(irand(0, nv - 1) | irand(0, nv - 1) << 4);
            for (int i = 0; i < 2 * G; i++) w[r][16 * G + i] = (uint8_t)(int8_t)(2 * irand(-16, 15) + 1);
            for (int s = 0; s < S; s++) {
                const uint16_t h = (uint16_t)(0x2800 + irand(0, 0x3FF) + (irand(0, 1) << 15));
                memcpy(&w[r][18 * G + 2 * s], &h, 2);
            }
            if (!q2) continue;
            for (int i = 0; i < 2 * G; i++) w[r][ma + i] = (uint8_t)irand(0, 15);
            for (int s = 0; s < S; s++) {
                const uint16_t h = (uint16_t)(0x2400 + irand(0, 0x3FF) + (irand(0, 1) << 15));
                memcpy(&w[r][ma + 2 * G + 2 * s], &h, 2);
            }
        }
        for (int r = 0; r < 8; r++) {   // decoding: w = d dk sc v[c]
            qt_dequant_row(t, w[r], K, wf);
            for (int i = 0; i < K && ok; i++) {
                const int g = i / 32, j = i % 32, s = g / 8, c = (w[r][32 * (g / 2) + j] >> (4 * (g & 1))) & 15;
                uint16_t h;
                memcpy(&h, &w[r][18 * G + 2 * s], 2);
                const int at = 16 * s + (j >= 16 ? 8 : 0) + g % 8;
                const float sc = ss_half_to_f32(h) * kv->dk * (float)(int8_t)w[r][16 * G + at];
                float want = sc * (float)kv->v[c];
                if (q2) {
                    memcpy(&h, &w[r][ma + 2 * G + 2 * s], 2);
                    want = want + -(ss_half_to_f32(h) * (float)(int8_t)w[r][ma + at]);
                }
                if (memcmp(&want, &wf[i], 4)) { printf("mismatch rb16 decode t%d row %d i%d: %g want %g\n", t, r, i, wf[i], want); ok = 0; }
            }
            double want[R] = {0}, wantq[R] = {0}, scale = 1e-3;
            for (int m = 0; m < R; m++) {
                for (int i = 0; i < K; i++) want[m] += (double)wf[i] * x[m][i], wantq[m] += (double)wf[i] * xq[m * K + i] * xd[m * G + i / 32];
                scale = fmax(scale, fabs(want[m]));
            }
            qt_f_row(t, w[r], K, x[0], xsum, R, out);
            for (int m = 0; m < R; m++) ok &= close_to(out[m] / scale, want[m] / scale, 1e-4, "rb16 qt_f", t);
            qt_q8_row(t, w[r], K, xq, xd, xs, R, out);
            for (int m = 0; m < R; m++) ok &= close_to(out[m] / scale, wantq[m] / scale, 1e-4, "rb16 qt_q8", t);
        }
#if defined(SS_AVX2)
        static int16_t xh[MAX_ROWS * K / 16];
        qt_code_sums16(xq, K, MAX_ROWS, xh);
        const uint8_t *p[8];
        for (int r = 0; r < 8; r++) p[r] = w[r];
        for (int nb = 1; nb <= MAX_ROWS; nb++) {
            __m256 o8[MAX_ROWS];
#define R16(NB) if (q2) qt_rb6_rows8(QT_R_Q2_K, kv, p, K, xq, xd, xh, NB, NULL, o8); else qt_rb6_rows8(QT_R_IQ2_XS, kv, p, K, xq, xd, xh, NB, NULL, o8);
            SS_BY_ROWS(nb, R16)
#undef R16
            for (int m = 0; m < nb; m++) {
                float got[8];
                _mm256_storeu_ps(got, o8[m]);
                for (int r = 0; r < 8; r++) {
                    float acc = 0.f;
                    for (int g = 0; g < G; g++) {
                        int sum = 0, msum = 0;
                        for (int j = 0; j < 32; j++) {
                            const int c = (w[r][32 * (g / 2) + j] >> (4 * (g & 1))) & 15, at = 16 * (g / 8) + (j >= 16 ? 8 : 0) + g % 8;
                            sum += (int8_t)w[r][16 * G + at] * kv->v[c] * xq[m * K + 32 * g + j];
                            if (q2) msum += (int8_t)w[r][ma + at] * xq[m * K + 32 * g + j];
                        }
                        uint16_t h;
                        memcpy(&h, &w[r][18 * G + 2 * (g / 8)], 2);
                        acc = fmaf((float)sum, ss_half_to_f32(h) * kv->dk * xd[m * G + g], acc);
                        if (q2) {
                            memcpy(&h, &w[r][ma + 2 * G + 2 * (g / 8)], 2);
                            acc = fmaf((float)msum, -ss_half_to_f32(h) * xd[m * G + g], acc);
                        }
                    }
                    if (got[r] != acc) {
                        printf("rb16 rows8 t%d nb %d row %d act %d: %.9g want %.9g\n", t, nb, r, m, got[r], acc);
                        ok = 0;
                    }
                }
            }
        }
#endif
    }
    return ok;
}

// ops.h's vector exp (softmax, SiLU) against the C library's, over the range attention and SiLU meet
static int check_exp(void) {
    enum { N = 203 };
    static float x[N], g[N], u[N], out[N];
    int ok = 1;
    for (int i = 0; i < N; i++) x[i] = -100.f + 100.f * i / (N - 1), g[i] = frand() * 40.f, u[i] = frand();
    g[0] = -100.f, g[1] = 100.f;
    float want_sum = 0.f;
    for (int i = 0; i < N; i++) want_sum += expf(x[i] - 0.5f);
    static float y[N];
    memcpy(y, x, sizeof(y));
    const float sum = ss_exp_shift(y, N, 0.5f);
    for (int i = 0; i < N && ok; i++) ok &= close_to(y[i], expf(x[i] - 0.5f), 2e-6, "exp", i);
    ok &= close_to(sum, want_sum, 1e-5, "exp sum", 0);
    ss_silu_mul(g, u, N, out);
    for (int i = 0; i < N && ok; i++) ok &= close_to(out[i], g[i] / (1.0 + exp(-(double)g[i])) * u[i], 2e-6, "silu", i);
    ss_gelu_tanh_mul(g, u, N, out);
    for (int i = 0; i < N && ok; i++) {
        const double x = g[i], want = 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))) * u[i];
        ok &= close_to(out[i], want, 4e-6, "gelu_tanh", i);
    }
    return ok;
}

// ops.h's argmax (the step's greedy token) against the scalar definition: lowest index on ties, NaNs never
// win, lengths around the vector width, the maximum first, last and in the tail
static int scalar_argmax(const float *x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}
static int check_argmax(void) {
    enum { N = 203 };
    static float x[N];
    int ok = 1;
    for (int trial = 0; trial < 40 && ok; trial++) {
        const int n = 1 + irand(0, N - 1);
        for (int i = 0; i < n; i++) x[i] = (float)irand(-20, 20);   // small integers: many ties
        const int where = trial % 4;   // 0: first, 1: last, 2: in the tail, 3: random
        const int at = where == 0 ? 0 : where == 1 ? n - 1 : where == 2 ? (n & ~7) + (n % 8) / 2 : irand(0, n - 1);
        if (trial & 1) x[at < n ? at : n - 1] = 50.f;
        if (trial % 5 == 0) x[irand(0, n - 1)] = NAN;
        if (trial % 7 == 0) x[0] = NAN;
        if (trial % 9 == 0) x[irand(0, n - 1)] = -INFINITY;
        const int got = ss_argmax(x, n), want = scalar_argmax(x, n);
        if (got != want) { printf("mismatch argmax n%d trial%d: %d vs %d\n", n, trial, got, want); ok = 0; }
    }
    return ok;
}

// simd.h's 8-weight-rows products (x86 AVX2 builds) against a plain loop over their defined arithmetic, bit
// for bit: per (weight row, activation row) each group's exact integer sum, then in group order
// acc = fma(float(sum) * d, sc, acc) and acc = fma(mn, s, acc) (q4), with eo two sums (even and odd groups)
// added at the end; fp32 and fp16 scales (the latter tile-ordered, 16 rows per group), every row count 1-8,
// odd group counts, and Q4_0's missing min plane (-8 x the scales)
static int check_rows8(void) {
#if defined(SS_AVX2)
    enum { GMAX = 19, KMAX = 32 * GMAX };
    static uint8_t w4[8][KMAX / 2];
    static int8_t w8[8][KMAX], xq[MAX_ROWS * KMAX];
    static float sc[8][GMAX], mn[8][GMAX], xd[MAX_ROWS * GMAX], xs[MAX_ROWS * GMAX], x[KMAX];
    static float sct[GMAX * 8], mnt[GMAX * 8], scn[GMAX * 8];   // [G][8]: fp32 lanes = rows
    static uint16_t sch[GMAX * 16], mnh[GMAX * 16];              // [G][16]: fp16, rows 0-7 of a block of 16
    int ok = 1;
    for (int gi = 0; gi < 3; gi++) {
        const int G = gi == 0 ? 1 : gi == 1 ? 6 : GMAX, K = 32 * G;
        for (int r = 0; r < 8; r++) {
            for (int i = 0; i < K / 2; i++) w4[r][i] = (uint8_t)irand(0, 255);
            for (int i = 0; i < K; i++) w8[r][i] = (int8_t)irand(-127, 127);
            for (int g = 0; g < G; g++) {
                const uint16_t hs = (uint16_t)(0x2000 + irand(0, 0x0FFF) + (irand(0, 1) << 15)), hm = (uint16_t)(0x2400 + irand(0, 0x0FFF));
                sch[16 * g + r] = hs, mnh[16 * g + r] = hm;
                sc[r][g] = ss_half_to_f32(hs), mn[r][g] = ss_half_to_f32(hm);
                sct[8 * g + r] = sc[r][g], mnt[8 * g + r] = mn[r][g], scn[8 * g + r] = -8.f * sc[r][g];
            }
        }
        for (int m = 0; m < MAX_ROWS; m++) {
            for (int i = 0; i < K; i++) x[i] = frand() * (m == 3 ? 0.f : 2.f);   // row 3 all zero (d = 0)
            ss_quantize_row(x, K, xq + m * K, xd + m * G, xs + m * G);
        }
        const uint8_t *p4[8];
        const int8_t *p8[8];
        for (int r = 0; r < 8; r++) p4[r] = w4[r], p8[r] = w8[r];
        for (int nb = 1; nb <= MAX_ROWS; nb++)
            for (int eo = 0; eo < 2; eo++)
                for (int variant = 0; variant < 4; variant++) {   // q4 fp32, q4 fp16 tiles, q4 without mins, q8
                    __m256 out[MAX_ROWS];
#define R8_Q4(NB) q4i_rows8(p4, variant == 1 ? (const void *)sch : sct, variant == 1 ? (const void *)mnh : variant == 2 ? NULL : mnt, \
                            variant == 1, variant == 1 ? 16 : 8, G, xq, xd, xs, NB, NULL, eo, out)
#define R8_Q8(NB) q8i_rows8(p8, sct, 0, 8, G, xq, xd, NB, NULL, eo, out)
                    if (variant < 3) { SS_BY_ROWS(nb, R8_Q4) } else { SS_BY_ROWS(nb, R8_Q8) }
#undef R8_Q8
#undef R8_Q4
                    for (int m = 0; m < nb; m++) {
                        float got[8];
                        _mm256_storeu_ps(got, out[m]);
                        for (int r = 0; r < 8; r++) {
                            float acc[2] = {0.f, 0.f};
                            for (int g = 0; g < G; g++) {
                                int sum = 0;
                                for (int j = 0; j < 32; j++) {
                                    const int code = variant == 3 ? w8[r][32 * g + j]
                                                   : j < 16 ? (w4[r][16 * g + j] & 15) : (w4[r][16 * g + j - 16] >> 4);
                                    sum += code * xq[m * K + 32 * g + j];
                                }
                                float *a = &acc[eo ? g & 1 : 0];
                                *a = fmaf((float)sum * xd[m * G + g], sc[r][g], *a);
                                if (variant < 3) *a = fmaf(variant == 2 ? scn[8 * g + r] : mn[r][g], xs[m * G + g], *a);
                            }
                            const float want = eo ? acc[0] + acc[1] : acc[0];
                            if (got[r] != want) {
                                printf("rows8 variant %d eo %d G %d nb %d row %d act %d: %.9g want %.9g\n", variant, eo, G, nb, r, m,
                                       got[r], want);
                                ok = 0;
                            }
                        }
                    }
                }
    }
    return ok;
#else
    return 1;
#endif
}

// qtypes.h's 8-weight-rows Q6_K product (x86 AVX2 builds) against a plain loop over its defined arithmetic, bit
// for bit: per (weight row, activation row) each group's exact integer sum of sc (c - 32) x, then in group order
// acc = fma(float(sum), d x xd, acc); rows re-blocked from random ggml blocks (a -128 scale among them), one and
// three super-blocks, every row count 1-8, an all-zero activation row
static int check_q6_rows8(void) {
#if defined(SS_AVX2)
    enum { SMAX = 3, KMAX = 256 * SMAX };
    static uint8_t src[8][210 * SMAX], rb[8][210 * SMAX];
    static int8_t xq[MAX_ROWS * KMAX], code[8][KMAX];
    static float xd[MAX_ROWS * KMAX / 32], xs[MAX_ROWS * KMAX / 32], x[KMAX];
    static int16_t xh[MAX_ROWS * KMAX / 16];
    int ok = 1;
    for (int S = 1; S <= SMAX; S += 2) {
        const int K = 256 * S, G = K / 32;
        for (int r = 0; r < 8; r++) {
            for (int i = 0; i < 210 * S; i++) src[r][i] = (uint8_t)irand(0, 255);
            for (int s = 0; s < S; s++) {
                const uint16_t hd = (uint16_t)(0x1800 + irand(0, 0x0FFF) + (irand(0, 1) << 15));
                memcpy(&src[r][210 * s + 208], &hd, 2);
                if (r == 2) src[r][210 * s + 192 + 5] = 0x80;
            }
            qt_rb6_pack_row(src[r], K, rb[r]);
            for (int s = 0; s < S; s++) {
                QTBlock u;
                qt_unpack(QT_Q6_K, src[r] + 210 * s, &(QTOut){u.q, u.sc, u.mn});
                memcpy(code[r] + 256 * s, u.q, 256);
            }
        }
        for (int m = 0; m < MAX_ROWS; m++) {
            for (int i = 0; i < K; i++) x[i] = frand() * (m == 3 ? 0.f : 2.f);
            ss_quantize_row(x, K, xq + m * K, xd + m * G, xs + m * G);
        }
        qt_code_sums16(xq, K, MAX_ROWS, xh);
        const uint8_t *p[8];
        for (int r = 0; r < 8; r++) p[r] = rb[r];
        for (int nb = 1; nb <= MAX_ROWS; nb++) {
            __m256 out[MAX_ROWS];
#define R6(NB) qt_rb6_rows8(QT_R_Q6_K, qt_kv(QT_R_Q6_K), p, K, xq, xd, xh, NB, NULL, out)
            SS_BY_ROWS(nb, R6)
#undef R6
            for (int m = 0; m < nb; m++) {
                float got[8];
                _mm256_storeu_ps(got, out[m]);
                for (int r = 0; r < 8; r++) {
                    float acc = 0.f;
                    for (int g = 0; g < G; g++) {
                        const uint8_t *blk = src[r] + 210 * (g / 8);
                        int sum = 0;
                        for (int j = 0; j < 32; j++) {
                            const int e = 32 * (g % 8) + j;
                            sum += (int8_t)blk[192 + e / 16] * code[r][32 * g + j] * xq[m * K + 32 * g + j];
                        }
                        uint16_t hd;
                        memcpy(&hd, blk + 208, 2);
                        acc = fmaf((float)sum, ss_half_to_f32(hd) * xd[m * G + g], acc);
                    }
                    if (got[r] != acc) {
                        printf("q6 rows8 S %d nb %d row %d act %d: %.9g want %.9g\n", S, nb, r, m, got[r], acc);
                        ok = 0;
                    }
                }
            }
        }
    }
    return ok;
#else
    return 1;
#endif
}

#if defined(SS_AVX2)
enum { R8_KMAX = 768 };   // the widest row of the 8-row checks below
// out[m] (lanes = weight rows) of an 8-row kernel against its defined arithmetic, bit for bit: per (weight row r,
// activation row m) each group's exact integer sum of (code + off) x, then in group order acc = fma(float(sum) *
// xd, s, acc) and acc = fma(o, xs, acc) (s = sc[r][g], o = mn[r][g]); 1 if every output matches
static int rows8_match(const char *what, int t, int K, int nb, const __m256 out[MAX_ROWS], int8_t code[8][R8_KMAX],
                       int off, float sc[8][R8_KMAX / 32], float mn[8][R8_KMAX / 32], const int8_t *xq,
                       const float *xd, const float *xs) {
    const int G = K / 32;
    int ok = 1;
    for (int m = 0; m < nb; m++) {
        float got[8];
        _mm256_storeu_ps(got, out[m]);
        for (int r = 0; r < 8; r++) {
            float acc = 0.f;
            for (int g = 0; g < G; g++) {
                int sum = 0;
                for (int j = 0; j < 32; j++) sum += (code[r][32 * g + j] + off) * xq[m * K + 32 * g + j];
                acc = fmaf((float)sum * xd[m * G + g], sc[r][g], acc);
                acc = fmaf(mn[r][g], xs[m * G + g], acc);
            }
            if (got[r] != acc) {
                printf("%s rows8 type %d K %d nb %d row %d act %d: %.9g want %.9g\n", what, t, K, nb, r, m, got[r], acc);
                ok = 0;
            }
        }
    }
    return ok;
}
#endif

// qtypes.h's 8-weight-rows Q5_0, Q5_1 and Q5_K products (x86 AVX2 builds) against a plain loop over their defined
// arithmetic, bit for bit: per (weight row, activation row) each group's exact integer sum of c x (c the unsigned
// 5-bit code), then in group order acc = fma(float(sum) * xd, s, acc) and acc = fma(o, xs, acc), s and o the
// planes' scale and offset (Q5_0: -16 s); rows re-blocked from random ggml blocks, G % 4 of 0 and 2 (a last pair
// of groups), every row count 1-8, an all-zero activation row
static int check_q5_rows8(void) {
#if defined(SS_AVX2)
    enum { KMAX = R8_KMAX };
    static uint8_t src[8][24 * (KMAX / 32)], rb[8][24 * (KMAX / 32)];   // Q5_1: 24 bytes per 32
    static int8_t xq[MAX_ROWS * KMAX], code[8][KMAX];
    static float xd[MAX_ROWS * KMAX / 32], xs[MAX_ROWS * KMAX / 32], x[KMAX], sc[8][KMAX / 32], mn[8][KMAX / 32];
    const int types[3][2] = {{QT_Q5_0, QT_R_Q5_0}, {QT_Q5_1, QT_R_Q5_1}, {QT_Q5_K, QT_R_Q5_K}};
    int ok = 1;
    for (int ti = 0; ti < 3; ti++) {
        const int tg = types[ti][0], t = types[ti][1], BB = qt_bytes(tg), QK = qt_block(tg);
        for (int ki = 0; ki < 3; ki++) {
            const int K = tg == QT_Q5_K ? 256 * (ki + 1) : ki == 0 ? 64 : ki == 1 ? 576 : 768, G = K / 32;
            for (int r = 0; r < 8; r++) {
                for (int i = 0; i < BB * (K / QK); i++) src[r][i] = (uint8_t)irand(0, 255);
                for (int b = 0; b < K / QK; b++) {   // sane fp16 d (and m, dmin)
                    const uint16_t h0 = (uint16_t)(0x1800 + irand(0, 0x0FFF) + (irand(0, 1) << 15)), h1 = (uint16_t)(0x1C00 + irand(0, 0x0FFF));
                    memcpy(&src[r][BB * b], &h0, 2);
                    if (tg != QT_Q5_0) memcpy(&src[r][BB * b + 2], &h1, 2);
                }
                qt_rb_pack_row(tg, src[r], K, rb[r]);
                qt_rb_unpack_row(t, rb[r], K, code[r], sc[r], mn[r]);
                for (int i = 0; i < K; i++) code[r][i] = (int8_t)(code[r][i] + (t == QT_R_Q5_0 ? 16 : 0));
                if (t == QT_R_Q5_0)
                    for (int g = 0; g < G; g++) mn[r][g] = -16.f * sc[r][g];
            }
            for (int m = 0; m < MAX_ROWS; m++) {
                for (int i = 0; i < K; i++) x[i] = frand() * (m == 3 ? 0.f : 2.f);
                ss_quantize_row(x, K, xq + m * K, xd + m * G, xs + m * G);
            }
            const uint8_t *p[8];
            for (int r = 0; r < 8; r++) p[r] = rb[r];
            for (int nb = 1; nb <= MAX_ROWS; nb++) {
                __m256 out[MAX_ROWS];
#define R5(NB) do { if (t == QT_R_Q5_0) qt_rb5_rows8(QT_R_Q5_0, p, K, xq, xd, xs, NB, NULL, 0, out); \
                    else if (t == QT_R_Q5_1) qt_rb5_rows8(QT_R_Q5_1, p, K, xq, xd, xs, NB, NULL, 0, out); \
                    else qt_rb5_rows8(QT_R_Q5_K, p, K, xq, xd, xs, NB, NULL, 0, out); } while (0)
                SS_BY_ROWS(nb, R5)
#undef R5
                ok &= rows8_match("q5", t, K, nb, out, code, 0, sc, mn, xq, xd, xs);
            }
        }
    }
    return ok;
#else
    return 1;
#endif
}

// qtypes.h's 8-weight-rows IQ4_NL and IQ4_XS products (x86 AVX2 builds) against a plain loop over their defined
// arithmetic, bit for bit: per (weight row, activation row) each group's exact integer sum, then in group order
// acc = fma(float(sum) * xd, s, acc); on VNNI builds the sum is of (k + 128) x and acc = fma(-128 s, xs, acc)
// follows, on AVX2 it is of k x (k the looked-up code); G % 4 of 0 and 2 (IQ4_NL: a last pair, and G = 2),
// every row count 1-8, an all-zero activation row
static int check_iq4_rows8(void) {
#if defined(SS_AVX2)
    enum { KMAX = R8_KMAX };
    static uint8_t src[8][18 * (KMAX / 32)], rb[8][18 * (KMAX / 32)];   // IQ4_NL: 18 bytes per 32 (IQ4_XS 17)
    static int8_t xq[MAX_ROWS * KMAX], code[8][KMAX];
    static float xd[MAX_ROWS * KMAX / 32], xs[MAX_ROWS * KMAX / 32], x[KMAX], sc[8][KMAX / 32], mn[8][KMAX / 32];
    const int types[2][2] = {{QT_IQ4_NL, QT_R_IQ4_NL}, {QT_IQ4_XS, QT_R_IQ4_XS}};
#ifdef SS_VNNI
    const int off = 128;
#else
    const int off = 0;
#endif
    int ok = 1;
    for (int ti = 0; ti < 2; ti++) {
        const int tg = types[ti][0], t = types[ti][1], BB = qt_bytes(tg), QK = qt_block(tg);
        for (int ki = 0; ki < 3; ki++) {
            const int K = tg == QT_IQ4_XS ? 256 * (ki + 1) : ki == 0 ? 64 : ki == 1 ? 576 : 768, G = K / 32;
            for (int r = 0; r < 8; r++) {
                for (int i = 0; i < BB * (K / QK); i++) src[r][i] = (uint8_t)irand(0, 255);
                for (int b = 0; b < K / QK; b++) {   // a sane fp16 d
                    const uint16_t h0 = (uint16_t)(0x1800 + irand(0, 0x0FFF) + (irand(0, 1) << 15));
                    memcpy(&src[r][BB * b], &h0, 2);
                }
                qt_rb_pack_row(tg, src[r], K, rb[r]);
                qt_rb_unpack_row(t, rb[r], K, code[r], sc[r], mn[r]);
                for (int g = 0; g < G; g++) mn[r][g] = -(float)off * sc[r][g];   // VNNI's offset term (0 on AVX2: fma(0, xs, acc) = acc)
            }
            for (int m = 0; m < MAX_ROWS; m++) {
                for (int i = 0; i < K; i++) x[i] = frand() * (m == 3 ? 0.f : 2.f);
                ss_quantize_row(x, K, xq + m * K, xd + m * G, xs + m * G);
            }
            const uint8_t *p[8];
            for (int r = 0; r < 8; r++) p[r] = rb[r];
            for (int nb = 1; nb <= MAX_ROWS; nb++) {
                __m256 out[MAX_ROWS];
#define RNL(NB) do { if (t == QT_R_IQ4_NL) qt_rbnl_rows8(QT_R_IQ4_NL, &QT_VALUES_IQ4, p, K, xq, xd, xs, NB, NULL, 0, out); \
                     else qt_rbnl_rows8(QT_R_IQ4_XS, &QT_VALUES_IQ4, p, K, xq, xd, xs, NB, NULL, 0, out); } while (0)
                SS_BY_ROWS(nb, RNL)
#undef RNL
                ok &= rows8_match("iq4", t, K, nb, out, code, off, sc, mn, xq, xd, xs);
            }
        }
    }
    return ok;
#else
    return 1;
#endif
}

// the fast q4 product at widths that exercise every step of the AVX2 kernel (8-group chunks, a pair
// after them, an odd last group), at 1-8 rows, with fp32 scales and (AVX2 + F16C) fp16 ones
static int check_q4_widths(void) {
    enum { KMAX = 1056, GMAX = KMAX / 32 };
    static uint8_t w[KMAX / 2];
    static int8_t xq[MAX_ROWS][KMAX];
    static float x[MAX_ROWS][KMAX], sc[GMAX], mn[GMAX], xd[MAX_ROWS][GMAX], xs[MAX_ROWS][GMAX];
    static uint16_t sch[GMAX], mnh[GMAX];
    const int Gs[] = {1, 2, 3, 6, 8, 9, 10, 17, 18, 24, 33};
    int ok = 1;
    for (int gi = 0; gi < (int)(sizeof Gs / sizeof Gs[0]); gi++) {
        const int G = Gs[gi], K = G * 32;
        for (int i = 0; i < K / 2; i++) w[i] = (uint8_t)irand(0, 255);
        for (int g = 0; g < G; g++) {
            // fp16-exact values, so that the fp16 and fp32 scales are the same numbers
            sch[g] = (uint16_t)(0x2000 + irand(0, 0x0fff));
            mnh[g] = (uint16_t)(0xa000 + irand(0, 0x0fff));
            sc[g] = ss_half_to_f32(sch[g]);
            mn[g] = ss_half_to_f32(mnh[g]);
        }
        for (int r = 0; r < MAX_ROWS; r++) {
            for (int i = 0; i < K; i++) x[r][i] = frand() * 3.0f;
            ss_quantize_row(x[r], K, xq[r], xd[r], xs[r]);
        }
        for (int nb = 1; nb <= MAX_ROWS; nb++) {
            float out[MAX_ROWS];
            double want[MAX_ROWS] = {0};
            for (int r = 0; r < nb; r++)
                for (int g = 0; g < G; g++) {
                    long s4 = 0, sq = 0;
                    for (int j = 0; j < 32; j++) {
                        const uint8_t b = w[g * 16 + (j & 15)];
                        s4 += (j < 16 ? (b & 15) : (b >> 4)) * xq[r][g * 32 + j];
                        sq += xq[r][g * 32 + j];
                    }
                    want[r] += (double)sc[g] * xd[r][g] * s4 + (double)mn[g] * xd[r][g] * sq;
                }
            // the kernels take rows with stride K, as the step lays them out
            static int8_t xqc[MAX_ROWS * KMAX];
            static float xdc[MAX_ROWS * GMAX], xsc[MAX_ROWS * GMAX];
            for (int r = 0; r < nb; r++) {
                memcpy(xqc + r * K, xq[r], K);
                memcpy(xdc + r * G, xd[r], sizeof(float) * G);
                memcpy(xsc + r * G, xs[r], sizeof(float) * G);
            }
            q4q8_row(w, sc, mn, G, xqc, xdc, xsc, nb, out);
            for (int r = 0; r < nb; r++) ok &= close_to(out[r], want[r], 1e-4, "q4q8 widths", G * 100 + nb);
#if defined(SS_AVX2) && defined(__F16C__)
            // the activations paired beforehand, as the step does (each row in two tiles, split at an
            // odd group when there is one); fp16 scales, then fp32
            static int8_t xp[MAX_ROWS * KMAX];
            static float xe[MAX_ROWS * 4 * GMAX];
            for (int r = 0; r < nb; r++) {
                const int cut = G / 2 | 1;
                ss_pair_groups(xqc + r * K, xdc + r * G, K, cut < G ? cut : G, G, xp + r * K, xe + r * 4 * G);
                ss_pair_groups(xqc + r * K, xdc + r * G, K, 0, cut < G ? cut : G, xp + r * K, xe + r * 4 * G);
            }
            q4p_row(w, sch, mnh, 1, G, xp, xdc, xe, xsc, nb, out);
            for (int r = 0; r < nb; r++) ok &= close_to(out[r], want[r], 1e-4, "q4q8 paired fp16", G * 100 + nb);
            q4p_row(w, sc, mn, 0, G, xp, xdc, xe, xsc, nb, out);
            for (int r = 0; r < nb; r++) ok &= close_to(out[r], want[r], 1e-4, "q4q8 paired fp32", G * 100 + nb);
            {   // Q4_0 keeps no min plane (mn NULL): the same bits as mins of -8 x the scales, fp32 and fp16
                static float m8[GMAX];
                static uint16_t m8h[GMAX];
                float with[MAX_ROWS];
                for (int g = 0; g < G; g++) m8[g] = -8.f * sc[g], m8h[g] = _cvtss_sh(-8.f * _cvtsh_ss(sch[g]), 0);
                q4p_row(w, sc, m8, 0, G, xp, xdc, xe, xsc, nb, with);
                q4p_row(w, sc, NULL, 0, G, xp, xdc, xe, xsc, nb, out);
                for (int r = 0; r < nb; r++)
                    if (out[r] != with[r]) { printf("q4p_row without mins fp32 differs (G %d nb %d)\n", G, nb); ok = 0; }
                q4p_row(w, sch, m8h, 1, G, xp, xdc, xe, xsc, nb, with);
                q4p_row(w, sch, NULL, 1, G, xp, xdc, xe, xsc, nb, out);
                for (int r = 0; r < nb; r++)
                    if (out[r] != with[r]) { printf("q4p_row without mins fp16 differs (G %d nb %d)\n", G, nb); ok = 0; }
            }
            // the q8 product on the same paired rows: codes -127..127, fp16 and fp32 scales
            static int8_t w8[KMAX];
            for (int i = 0; i < K; i++) w8[i] = (int8_t)irand(-127, 127);
            double want8[MAX_ROWS] = {0};
            for (int r = 0; r < nb; r++)
                for (int g = 0; g < G; g++) {
                    long s8 = 0;
                    for (int j = 0; j < 32; j++) s8 += w8[g * 32 + j] * xq[r][g * 32 + j];
                    want8[r] += (double)sc[g] * xd[r][g] * s8;
                }
            q8p_row(w8, sch, 1, G, xp, xdc, xe, nb, out);
            for (int r = 0; r < nb; r++) ok &= close_to(out[r], want8[r], 1e-4, "q8q8 paired fp16", G * 100 + nb);
            q8p_row(w8, sc, 0, G, xp, xdc, xe, nb, out);
            for (int r = 0; r < nb; r++) ok &= close_to(out[r], want8[r], 1e-4, "q8q8 paired fp32", G * 100 + nb);
            // a row's result never depends on the rows beside it (batches equal each prompt alone)
            float many[MAX_ROWS], one;
            q4p_row(w, sch, mnh, 1, G, xp, xdc, xe, xsc, nb, many);
            for (int r = 0; r < nb; r++) {
                q4p_row(w, sch, mnh, 1, G, xp + r * K, xdc + r * G, xe + r * 4 * G, xsc + r * G, 1, &one);
                if (one != many[r]) { printf("q4p_row row %d of %d differs alone (G %d)\n", r, nb, G); ok = 0; }
            }
            q8p_row(w8, sch, 1, G, xp, xdc, xe, nb, many);
            for (int r = 0; r < nb; r++) {
                q8p_row(w8, sch, 1, G, xp + r * K, xdc + r * G, xe + r * 4 * G, 1, &one);
                if (one != many[r]) { printf("q8p_row row %d of %d differs alone (G %d)\n", r, nb, G); ok = 0; }
            }
#endif
        }
    }
    return ok;
}

int main(void) {
    enum { N = 5, K = 192, G = K / 32, R = 3 };
    static uint8_t w4[N][K / 2];
    static int8_t w8[N][K], xq[R][K];
    static float sc[N][G], mn[N][G], x[R][K], xd[R][G], xs[R][G], xsum[R][G], out[MAX_ROWS];
    int ok = 1;
    for (int n = 0; n < N; n++) {
        for (int i = 0; i < K / 2; i++) w4[n][i] = (uint8_t)irand(0, 255);
        for (int i = 0; i < K; i++) w8[n][i] = (int8_t)irand(-127, 127);
        for (int g = 0; g < G; g++) { sc[n][g] = frand() * 0.1f; mn[n][g] = frand() * 0.2f; }
    }
    for (int r = 0; r < R; r++) for (int i = 0; i < K; i++) x[r][i] = frand() * 3.0f;
    for (int r = 0; r < R; r++) {
        ss_quantize_row(x[r], K, xq[r], xd[r], xs[r]);
        ss_group_sums(x[r], K, xsum[r]);
        for (int g = 0; g < G; g++) {   // the quantization itself, against its definition
            float amax = 0.f;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[r][g * 32 + j]));
            const float id = amax > 0 ? 127.f / amax : 0.f;
            int sum = 0;
            for (int j = 0; j < 32; j++) {
                const int q = (int)nearbyintf(x[r][g * 32 + j] * id);
                sum += q;
                if (q != xq[r][g * 32 + j]) { printf("mismatch quantize r%d g%d j%d\n", r, g, j); ok = 0; }
            }
            ok &= close_to(xs[r][g], (amax / 127.f) * sum, 1e-6, "xs", g);
        }
    }
    for (int n = 0; n < N; n++) {
        // fp32-activation references: w = scale * q + min over the 4-bit codes, scale * q for 8-bit
        double want4[R] = {0}, want8[R] = {0}, wantq4[R] = {0}, wantq8[R] = {0};
        for (int r = 0; r < R; r++)
            for (int g = 0; g < G; g++) {
                long s4 = 0, s8 = 0, sq = 0;
                for (int j = 0; j < 32; j++) {
                    const uint8_t b = w4[n][g * 16 + (j & 15)];
                    const int q4 = j < 16 ? (b & 15) : (b >> 4);
                    want4[r] += ((double)sc[n][g] * q4 + mn[n][g]) * x[r][g * 32 + j];
                    want8[r] += (double)sc[n][g] * w8[n][g * 32 + j] * x[r][g * 32 + j];
                    s4 += q4 * xq[r][g * 32 + j];
                    s8 += w8[n][g * 32 + j] * xq[r][g * 32 + j];
                    sq += xq[r][g * 32 + j];
                }
                wantq4[r] += (double)sc[n][g] * xd[r][g] * s4 + (double)mn[n][g] * xd[r][g] * sq;
                wantq8[r] += (double)sc[n][g] * xd[r][g] * s8;
            }
        q4f_row(w4[n], sc[n], mn[n], G, x[0], K, xsum[0], R, out);
        for (int r = 0; r < R; r++) ok &= close_to(out[r], want4[r], 1e-4, "q4f", r);
        q8f_row(w8[n], sc[n], G, x[0], K, R, out);
        for (int r = 0; r < R; r++) ok &= close_to(out[r], want8[r], 1e-4, "q8f", r);
        q4q8_row(w4[n], sc[n], mn[n], G, xq[0], xd[0], xs[0], R, out);
        for (int r = 0; r < R; r++) ok &= close_to(out[r], wantq4[r], 1e-4, "q4q8", r);
        q8q8_row(w8[n], sc[n], G, xq[0], xd[0], R, out);
        for (int r = 0; r < R; r++) ok &= close_to(out[r], wantq8[r], 1e-4, "q8q8", r);
    }
    float o[K], dd = 0;
    for (int i = 0; i < K; i++) { o[i] = x[1][i]; dd += x[0][i] * x[2][i]; }
    ok &= close_to(ss_dot(x[0], x[2], K), dd, 1e-4, "dot", 0);
    ss_axpy(o, 0.5f, x[2], K);
    for (int i = 0; i < K; i++) ok &= close_to(o[i], x[1][i] + 0.5 * x[2][i], 1e-6, "axpy", i);
    ok &= check_qtypes();
    ok &= check_rows8();
    ok &= check_q6_rows8();
    ok &= check_rb16();
    ok &= check_q5_rows8();
    ok &= check_iq4_rows8();
    ok &= check_q4_widths();
    ok &= check_exp();
    ok &= check_argmax();
    printf("%s %s\n", ss_isa_name(), ok ? "ok" : "FAILED");
    return ok ? 0 : 1;
}
