// Matrix products over GGUF-packed weights for CPU decode: y[b, n] = sum_k x[b, k] * W[n, k].
//
// Weights stay in ggml's own block layout (one row = K/32 blocks); each block is widened to fp32
// in registers and multiplied with fp32 activations, accumulating in fp32. Per block the maths is
// d * sum(q * x) + m * sum(x), i.e. the fp32 product over GGUF's dequantized weights d*q + m, up
// to summation order. Rows of activations are processed 8 at a time so each weight row, once
// fetched, serves every activation row from L1 (prefill reuses the decode kernel).
//
// Block formats (bytes per 32 weights):
//   FMT_Q4_0  (18): fp16 d, 16 bytes of nibbles; w = d * (q - 8)
//   FMT_Q4_1  (20): fp16 d, fp16 m, nibbles;     w = d * q + m
//   FMT_Q8_0  (34): fp16 d, 32 int8;             w = d * q
//   FMT_Q4_F32 (24): fp32 d, fp32 m, nibbles;    w = d * q + m   (Q4_K re-blocked at load)
// Nibbles: byte j of a block holds element j (low 4 bits) and element j + 16 (high 4 bits).
// If accumulate != 0 the result is added to y (fuses the residual add).
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

enum { FMT_Q4_0 = 2, FMT_Q4_1 = 3, FMT_Q8_0 = 8, FMT_Q4_F32 = 100 };
#define CHUNK 8

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline int block_bytes(int fmt) {
    switch (fmt) {
    case FMT_Q4_0: return 18;
    case FMT_Q4_1: return 20;
    case FMT_Q8_0: return 34;
    default: return 24;
    }
}

// One weight row against up to CHUNK activation rows (x rows are K apart, results go to out[b]).
static inline __attribute__((always_inline)) void row_dot(
    const int fmt, const uint8_t *row, int G, const float *x, int K, const float *xs, int nb,
    float *out) {
    __m512 acc[CHUNK], acc2[CHUNK];
    float macc[CHUNK];
    for (int b = 0; b < nb; b++) { acc[b] = _mm512_setzero_ps(); acc2[b] = _mm512_setzero_ps(); macc[b] = 0.f; }
    const int bsz = block_bytes(fmt);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    for (int g = 0; g < G; g++) {
        const uint8_t *blk = row + (int64_t)g * bsz;
        __m512 w0, w1, dv;
        float m = 0.f;
        if (fmt == FMT_Q8_0) {
            dv = _mm512_set1_ps(f16(blk));
            w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2))));
            w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18))));
        } else {
            const uint8_t *qs;
            if (fmt == FMT_Q4_F32) {
                float d; memcpy(&d, blk, 4); memcpy(&m, blk + 4, 4);
                dv = _mm512_set1_ps(d); qs = blk + 8;
            } else {
                dv = _mm512_set1_ps(f16(blk));
                if (fmt == FMT_Q4_1) m = f16(blk + 2);
                qs = blk + (fmt == FMT_Q4_1 ? 4 : 2);
            }
            __m128i p = _mm_loadu_si128((const __m128i *)qs);
            __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(p, low4));
            __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(p, 4), low4));
            if (fmt == FMT_Q4_0) {
                const __m512i eight = _mm512_set1_epi32(8);
                lo = _mm512_sub_epi32(lo, eight);
                hi = _mm512_sub_epi32(hi, eight);
            }
            w0 = _mm512_cvtepi32_ps(lo);
            w1 = _mm512_cvtepi32_ps(hi);
        }
        for (int b = 0; b < nb; b++) {
            const float *xg = x + (int64_t)b * K + g * 32;
            __m512 t = _mm512_mul_ps(w0, _mm512_loadu_ps(xg));
            t = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xg + 16), t);
            if (g & 1) acc2[b] = _mm512_fmadd_ps(dv, t, acc2[b]);
            else acc[b] = _mm512_fmadd_ps(dv, t, acc[b]);
            if (fmt == FMT_Q4_1 || fmt == FMT_Q4_F32) macc[b] += m * xs[(int64_t)b * G + g];
        }
    }
    for (int b = 0; b < nb; b++) out[b] = _mm512_reduce_add_ps(_mm512_add_ps(acc[b], acc2[b])) + macc[b];
}

static void matvec_fmt(const int fmt, const float *x, int B, int K, const uint8_t *w, int N,
                       float *y, int accumulate, const float *xs) {
    const int G = K / 32;
    const int64_t row_bytes = (int64_t)G * block_bytes(fmt);
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const uint8_t *row = w + n * row_bytes;
        for (int b0 = 0; b0 < B; b0 += CHUNK) {
            int nb = B - b0 < CHUNK ? B - b0 : CHUNK;
            float out[CHUNK];
            const float *xb = x + (int64_t)b0 * K, *xsb = xs + (int64_t)b0 * G;
            // constant format and row count per case: the compiler unrolls and keeps accumulators in registers
#define ROWS(F) switch (nb) { \
            case 1: row_dot(F, row, G, xb, K, xsb, 1, out); break; \
            case 2: row_dot(F, row, G, xb, K, xsb, 2, out); break; \
            case 3: row_dot(F, row, G, xb, K, xsb, 3, out); break; \
            case 4: row_dot(F, row, G, xb, K, xsb, 4, out); break; \
            case 5: row_dot(F, row, G, xb, K, xsb, 5, out); break; \
            case 6: row_dot(F, row, G, xb, K, xsb, 6, out); break; \
            case 7: row_dot(F, row, G, xb, K, xsb, 7, out); break; \
            default: row_dot(F, row, G, xb, K, xsb, 8, out); break; }
            switch (fmt) {
            case FMT_Q4_0: ROWS(FMT_Q4_0); break;
            case FMT_Q4_1: ROWS(FMT_Q4_1); break;
            case FMT_Q8_0: ROWS(FMT_Q8_0); break;
            default: ROWS(FMT_Q4_F32); break;
            }
#undef ROWS
            for (int b = 0; b < nb; b++) {
                float *yo = y + (int64_t)(b0 + b) * N + n;
                *yo = accumulate ? *yo + out[b] : out[b];
            }
        }
    }
}

// xs: caller-provided scratch of B * K/32 floats (group sums of x, for the "+ m" part).
void gguf_matvec(int fmt, const float *x, int B, int K, const uint8_t *w, int N, float *y,
                 int accumulate, float *xs) {
    const int G = K / 32;
    for (int b = 0; b < B; b++)
        for (int g = 0; g < G; g++) {
            float s = 0.f;
            for (int j = 0; j < 32; j++) s += x[(int64_t)b * K + g * 32 + j];
            xs[(int64_t)b * G + g] = s;
        }
    matvec_fmt(fmt, x, B, K, w, N, y, accumulate, xs);
}
