// Weight-only quantized matrix x vector products for CPU decode (batch 1..8).
//
// Weights stay packed in memory; each 32-element group is expanded to fp32 in registers and
// multiplied with fp32 activations, accumulating in fp32. The maths is exactly
// y[b,n] = sum_k x[b,k] * (d[n,g] * q[n,k] + m[n,g]), i.e. what a fp32 matmul over the
// dequantized weights computes, up to summation order.
//
// Layouts (row-major over output rows n, groups g of 32 inputs):
//   q4: uint8 qs[N][K/2]; in each group byte j holds element j (low nibble) and j+16 (high nibble).
//   q8: int8 qs[N][K]; gs (16 or 32) inputs share a scale.
//   d, m: float32 [N][K/gs]; m may be NULL (symmetric formats).
// If accumulate != 0 the result is added to y (fuses the residual add).
#include <stdint.h>
#include <string.h>
#include <math.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define MAXB 8

// sums of x over each group, used for the "+ m" part: sum_k m*x_k = m * sum_k x_k
static void group_sums(const float *x, int K, int gs, float *out) {
    for (int g = 0; g < K / gs; g++) {
        float s = 0.f;
        for (int j = 0; j < gs; j++) s += x[g * gs + j];
        out[g] = s;
    }
}

void q4_matvec(const float *x, int B, int K, const uint8_t *qs, const float *d, const float *m,
               int N, float *y, int accumulate) {
    const int G = K / 32;
    float xs[MAXB][K / 32 + 1];
    for (int b = 0; b < B; b++) group_sums(x + (int64_t)b * K, K, 32, xs[b]);
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const uint8_t *row = qs + (int64_t)n * (K / 2);
        const float *dn = d + (int64_t)n * G, *mn = m + (int64_t)n * G;
        float out[MAXB];
#ifdef __AVX512F__
        __m512 acc[MAXB];
        for (int b = 0; b < B; b++) acc[b] = _mm512_setzero_ps();
        const __m128i low4 = _mm_set1_epi8(0x0F);
        for (int g = 0; g < G; g++) {
            __m128i packed = _mm_loadu_si128((const __m128i *)(row + g * 16));
            __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(packed, low4)));
            __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(packed, 4), low4)));
            __m512 dv = _mm512_set1_ps(dn[g]);
            for (int b = 0; b < B; b++) {
                const float *xg = x + (int64_t)b * K + g * 32;
                __m512 t = _mm512_mul_ps(lo, _mm512_loadu_ps(xg));
                t = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xg + 16), t);
                acc[b] = _mm512_fmadd_ps(dv, t, acc[b]);
            }
        }
        for (int b = 0; b < B; b++) out[b] = _mm512_reduce_add_ps(acc[b]);
#else
        for (int b = 0; b < B; b++) {
            const float *xb = x + (int64_t)b * K;
            float s = 0.f;
            for (int g = 0; g < G; g++) {
                float t = 0.f;
                for (int j = 0; j < 16; j++) {
                    uint8_t v = row[g * 16 + j];
                    t += (float)(v & 15) * xb[g * 32 + j] + (float)(v >> 4) * xb[g * 32 + 16 + j];
                }
                s += dn[g] * t;
            }
            out[b] = s;
        }
#endif
        for (int b = 0; b < B; b++) {
            float s = out[b];
            for (int g = 0; g < G; g++) s += mn[g] * xs[b][g];
            float *yo = y + (int64_t)b * N + n;
            *yo = accumulate ? *yo + s : s;
        }
    }
}

void q8_matvec(const float *x, int B, int K, const int8_t *qs, const float *d, const float *m,
               int gs, int N, float *y, int accumulate) {
    const int G = K / gs;
    float xs[MAXB][K / 16 + 1];
    if (m)
        for (int b = 0; b < B; b++) group_sums(x + (int64_t)b * K, K, gs, xs[b]);
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const int8_t *row = qs + (int64_t)n * K;
        const float *dn = d + (int64_t)n * G;
        float out[MAXB];
#ifdef __AVX512F__
        __m512 acc[MAXB];
        for (int b = 0; b < B; b++) acc[b] = _mm512_setzero_ps();
        for (int g = 0; g < G; g++) {
            __m512 dv = _mm512_set1_ps(dn[g]);
            for (int j = 0; j < gs; j += 16) {
                __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + g * gs + j))));
                w = _mm512_mul_ps(w, dv);
                for (int b = 0; b < B; b++)
                    acc[b] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + (int64_t)b * K + g * gs + j), acc[b]);
            }
        }
        for (int b = 0; b < B; b++) out[b] = _mm512_reduce_add_ps(acc[b]);
#else
        for (int b = 0; b < B; b++) {
            const float *xb = x + (int64_t)b * K;
            float s = 0.f;
            for (int g = 0; g < G; g++) {
                float t = 0.f;
                for (int j = 0; j < gs; j++) t += (float)row[g * gs + j] * xb[g * gs + j];
                s += dn[g] * t;
            }
            out[b] = s;
        }
#endif
        for (int b = 0; b < B; b++) {
            float s = out[b];
            if (m) {
                const float *mn = m + (int64_t)n * G;
                for (int g = 0; g < G; g++) s += mn[g] * xs[b][g];
            }
            float *yo = y + (int64_t)b * N + n;
            *yo = accumulate ? *yo + s : s;
        }
    }
}
