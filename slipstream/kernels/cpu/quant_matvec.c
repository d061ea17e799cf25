// Matrix products over 4-bit and 8-bit packed weights for CPU decode: y[b, n] = sum_k x[b, k] W[n, k].
//
// Weights are kept in a compute layout derived from ggml's blocks of 32 (see weights/quant.py):
//   q4: uint8 qs[N][K/2] (in each group byte j holds element j in its low nibble and element
//       j + 16 in its high nibble), float32 scale[N][K/32] and min[N][K/32]: w = scale * q + min
//       (Q4_0, Q4_1 and Q4_K all map onto it without changing a single weight);
//   q8: int8 qs[N][K], float32 scale[N][K/32]: w = scale * q (Q8_0).
// The row kernels, one per instruction set, are simd.h's exact (fp32-activation) products.
// Activations and accumulation are fp32, so the result is the fp32 product over GGUF's own
// dequantized weights up to summation order. Per group the maths is
// scale * sum(q * x) + min * sum(x); the min part is one short dot per row at the end.
// Separate fp32 scales (rather than ggml's interleaved fp16 headers) halve the instructions per
// group: on our CPUs these kernels are bound by instructions, not bytes, since the weights of a
// small model sit in the last-level cache.
//
// Activation rows are processed up to 8 at a time with the accumulators in registers, so a weight
// row fetched once serves the whole chunk (prefill uses the same kernels).
// If accumulate != 0 the result is added to y (fuses the residual add).
#include <stdint.h>

#include "ops.h"
#include "qtypes.h"

int ss_parallel_threads(void);   // step.c: the team's size once configured

#define CHUNK MAX_ROWS
#define q4_row(row, sc, mn, G, x, K, xs, nb, out) q4f_row(row, sc, mn, G, x, K, xs, nb, out)
#define q8_row(row, sc, G, x, K, nb, out) q8f_row(row, sc, G, x, K, nb, out)

// A switch over the chunk size so each case is compiled with a constant row count.
#define BY_CHUNK(nb, CALL) switch (nb) { \
    case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; \
    case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; default: CALL(8); break; }

static inline void store(float *y, int N, int n, int b0, int nb, const float *out, int accumulate) {
    for (int b = 0; b < nb; b++) {
        float *yo = y + (int64_t)(b0 + b) * N + n;
        *yo = accumulate ? *yo + out[b] : out[b];
    }
}

// xs: caller-provided scratch of B * K/32 floats
void q4_matvec(const float *x, int B, int K, const uint8_t *qs, const float *scale, const float *min,
               int N, float *y, int accumulate, float *xs) {
    const int G = K / 32;
    for (int b = 0; b < B; b++)
        for (int g = 0; g < G; g++) {
            float s = 0.f;
            for (int j = 0; j < 32; j++) s += x[(int64_t)b * K + g * 32 + j];
            xs[(int64_t)b * G + g] = s;
        }
#pragma omp parallel for schedule(static) num_threads(ss_parallel_threads())
    for (int n = 0; n < N; n++) {
        const uint8_t *row = qs + (int64_t)n * (K / 2);
        const float *sc = scale + (int64_t)n * G, *mn = min + (int64_t)n * G;
        for (int b0 = 0; b0 < B; b0 += CHUNK) {
            const int nb = B - b0 < CHUNK ? B - b0 : CHUNK;
            float out[CHUNK];
            const float *xb = x + (int64_t)b0 * K, *xsb = xs + (int64_t)b0 * G;
#define Q4(NB) q4_row(row, sc, mn, G, xb, K, xsb, NB, out)
            BY_CHUNK(nb, Q4)
#undef Q4
            store(y, N, n, b0, nb, out, accumulate);
        }
    }
}

void q8_matvec(const float *x, int B, int K, const int8_t *qs, const float *scale, int N, float *y,
               int accumulate) {
    const int G = K / 32;
#pragma omp parallel for schedule(static) num_threads(ss_parallel_threads())
    for (int n = 0; n < N; n++) {
        const int8_t *row = qs + (int64_t)n * K;
        const float *sc = scale + (int64_t)n * G;
        for (int b0 = 0; b0 < B; b0 += CHUNK) {
            const int nb = B - b0 < CHUNK ? B - b0 : CHUNK;
            float out[CHUNK];
            const float *xb = x + (int64_t)b0 * K;
#define Q8(NB) q8_row(row, sc, G, xb, K, NB, out)
            BY_CHUNK(nb, Q8)
#undef Q8
            store(y, N, n, b0, nb, out, accumulate);
        }
    }
}

// Dequantize to dense fp32 [N][K] (w = scale * q + min), for prefill: with many activation rows a
// BLAS matrix product over the widened weights beats the matvec kernels, whose inner loop is
// built for few rows. Same expression as GGUF's reference dequantization.
void q4_dequant(const uint8_t *qs, const float *scale, const float *min, int N, int K, float *out) {
    const int64_t groups = (int64_t)N * (K / 32);
#pragma omp parallel for schedule(static) num_threads(ss_parallel_threads())
    for (int64_t i = 0; i < groups; i++) {
        const float d = scale[i], m = min[i];
        float *o = out + i * 32;
        // d * q is exact (a 4-bit integer times an fp16-sized scale): one rounding, as in GGUF
#ifdef __AVX512F__
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + i * 16)));
        const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);
        _mm512_storeu_ps(o, _mm512_add_ps(_mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15)))), mv));
        _mm512_storeu_ps(o + 16, _mm512_add_ps(_mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4))), mv));
        continue;
#endif
        for (int j = 0; j < 16; j++) {
            const uint8_t v = qs[i * 16 + j];
            o[j] = d * (float)(v & 15) + m;
            o[j + 16] = d * (float)(v >> 4) + m;
        }
    }
}

void q8_dequant(const int8_t *qs, const float *scale, int N, int K, float *out) {
    const int64_t groups = (int64_t)N * (K / 32);
#pragma omp parallel for schedule(static) num_threads(ss_parallel_threads())
    for (int64_t i = 0; i < groups; i++) {
#ifdef __AVX512F__
        const __m512 d = _mm512_set1_ps(scale[i]);
        for (int j = 0; j < 32; j += 16)
            _mm512_storeu_ps(out + i * 32 + j, _mm512_mul_ps(d, _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + i * 32 + j))))));
#else
        for (int j = 0; j < 32; j++) out[i * 32 + j] = scale[i] * (float)qs[i * 32 + j];
#endif
    }
}

// Q5_0, Q5_1, Q5_K, IQ4_NL, IQ4_XS or Q6_K blocks (qtype: the ggml type) of n rows of K weights ->
// the re-blocked rows of qtypes.h's QT_R_* layouts (K a multiple of 64, of 256 for the K-quants and
// IQ4_XS; same bytes per row)
void ss_reblock(int qtype, const uint8_t *src, int64_t n, int K, uint8_t *dst) {
    const int64_t row = (int64_t)K / qt_block(qtype) * qt_bytes(qtype);
#pragma omp parallel for schedule(static) num_threads(ss_parallel_threads())
    for (int64_t r = 0; r < n; r++) {
        if (qtype == QT_Q6_K) qt_rb6_pack_row(src + r * row, K, dst + r * row);
        else qt_rb_pack_row(qtype, src + r * row, K, dst + r * row);
    }
}

// The lattice and ternary types whose blocks are, weight for weight, a 4-bit code into 16 values with a
// per-32 scale d dk (ls - 32), d the file's fp16 (IQ2_XXS: dk = 1/8, ls - 32 = 2 l + 1; IQ3_XXS: 1/4; IQ1_S:
// 1/8, the values 8 g +- 1; IQ3_S: 1, 1 + 2 s; TQ1_0, TQ2_0: 1, 1) -> IQ4_XS blocks of those codes (qtypes.h's
// qt_kv(QT_R_*): the values and dk), re-blocked (QT_R_*); MXFP4 -> IQ4_NL blocks (its scale as an fp16, its
// codes as they are). Every weight keeps its value: a block where that does not hold (a code outside the 16,
// MXFP4's exponent out of fp16's range) makes the whole call return 0, and the caller keeps the file's blocks. n rows of K weights (K a multiple of
// 256, of 64 for MXFP4); dst: n rows of K / 256 x 136 bytes (MXFP4: K / 32 x 18). Returns 1 when done.
// The types whose scale is per 16 weights, d dk (2 l + 1) (IQ2_XS, IQ2_S: dk = 1/8; IQ1_M: 1/8, the values 8 g +- 1;
// Q3_K: d (sc - 32), dk = 1, the codes -4..3), go into the per-16 IQ planes instead (qtypes.h's qt_rb16: codes, int8
// scales, the file's fp16 d; 146 bytes per 256); Q2_K (d (sc & 15) c - dmin (sc >> 4), the codes 0..3) with its
// minimums and dmin too (164 bytes per 256). The tables' values are all within +-64 (the kernels' bound; qtypes.h).
AI int int_of(float v, float unit, int *out) {   // v = unit x an integer of int8's range, exactly
    const float m = unit != 0.f ? v / unit : 0.f;
    if (!(m == m && fabsf(m) < 128.f) || (float)(int)m != m) return 0;   // not NaN (an inf or NaN unit), in range
    *out = (int)m;
    return 1;
}
static int reencode16_row(int qtype, const QTValues *vals, const int8_t *code_of, const uint8_t *row, int K, uint8_t *o) {
    const int G = K / 32, BB = qt_bytes(qtype), q2 = qtype == QT_Q2_K;
    const int64_t mins_at = qt_rb16_mins_at(G);
    memset(o, 0, (size_t)K / 256 * (size_t)qt_bytes(100 + qtype));
    for (int b = 0; b < K / 256; b++) {
        const uint8_t *p = row + (int64_t)b * BB;
        QTBlock u;
        qt_unpack(qtype, p, &(QTOut){u.q, u.sc, u.mn});
        // IQ1_M keeps its fp16 d in the top nibbles of its four scale words (the decoder's d)
        uint16_t h;
        if (qtype == QT_IQ1_M) {
            uint16_t s4[4];
            memcpy(s4, p + 48, 8);
            h = (uint16_t)((s4[0] >> 12) | ((s4[1] >> 8) & 0xf0) | ((s4[2] >> 4) & 0xf00) | (s4[3] & 0xf000));
        } else {
            memcpy(&h, p + (qtype == QT_Q3_K ? 108 : q2 ? 80 : 0), 2);
        }
        const float dx = qt_f16((const uint8_t *)&h) * vals->dk;   // exact: a power of two
        memcpy(o + 18 * G + 2 * b, &h, 2);
        const float dmin = q2 ? qt_f16(p + 82) : 0.f;
        if (q2) memcpy(o + mins_at + 2 * G + 2 * b, p + 82, 2);
        for (int s = 0; s < 16; s++) {   // sub-block s: group 8 b + s / 2, its first (s even) or second half
            int m, mn = 0;
            if (!int_of(u.sc[s], dx, &m)) return 0;
            if (dx == 0.f && memcmp(&(float){dx * (float)m}, &u.sc[s], 4)) m = -1;   // d = +-0: the zero's sign (Q3_K's sc - 32 < 0)
            if (memcmp(&(float){dx * (float)m}, &u.sc[s], 4)) return 0;   // the very bits, zeros' signs included
            if (q2 && (!int_of(-u.mn[s], dmin, &mn) || memcmp(&(float){-(dmin * (float)mn)}, &u.mn[s], 4))) return 0;
            const int at = 16 * b + (s & 1) * 8 + s / 2;
            o[16 * G + at] = (uint8_t)(int8_t)m;
            if (q2) o[mins_at + at] = (uint8_t)(int8_t)mn;
            const int g = 8 * b + s / 2;
            for (int l = 0; l < 16; l++) {
                const int c = code_of[(uint8_t)u.q[16 * s + l]];
                if (c < 0) return 0;
                o[32 * (g / 2) + 16 * (s & 1) + l] |= (uint8_t)(c << (4 * (g & 1)));
            }
        }
    }
    return 1;
}

int ss_reencode(int qtype, const uint8_t *src, int64_t n, int K, uint8_t *dst) {
    const int nl = qtype == QT_MXFP4, rt = 100 + qtype, per16 = qt_rb16(rt);
    if ((!qt_rb_xs(rt) || rt == QT_R_IQ4_XS) && rt != QT_R_MXFP4 && !per16) return 0;   // only the types above
    if (qtype != QT_MXFP4 && qtype != QT_TQ1_0 && qtype != QT_TQ2_0 && qtype != QT_Q3_K && qtype != QT_Q2_K && !qt_grids.ready)
        return 0;
    const int64_t in_row = (int64_t)K / qt_block(qtype) * qt_bytes(qtype), out_row = (int64_t)K / qt_block(rt) * qt_bytes(rt);
    const int d_at = qtype == QT_TQ1_0 ? 52 : qtype == QT_TQ2_0 ? 64 : 0;
    const QTValues *vals = qt_kv(rt);
    const int8_t *kv = vals->v;
    int8_t code_of[256];   // value -> its index among the 16 (-1: not one of them)
    memset(code_of, -1, sizeof code_of);
    for (int c = 15; c >= 0; c--) code_of[(uint8_t)kv[c]] = (int8_t)c;   // 0 of a short table: its first index
    int ok = 1;
#pragma omp parallel for schedule(static) num_threads(ss_parallel_threads()) reduction(&& : ok)
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *row = src + r * in_row;
        if (per16) {   // straight into the planes (no ggml blocks in between)
            ok = ok && reencode16_row(qtype, vals, code_of, row, K, dst + r * out_row);
            continue;
        }
        uint8_t *blocks = malloc((size_t)out_row);
        if (!blocks) {
            ok = 0;
            continue;
        }
        int good = 1;
        if (nl) {
            for (int g = 0; g < K / 32 && good; g++) {   // e8m0 + 16 code bytes -> fp16 d + the same bytes
                int zero = 1;   // every code 0 or 8 (+-0): any scale gives +0, so fp16's 0 does (an all-zero block's e = 0)
                for (int j = 0; j < 16; j++) zero &= (row[17 * g + 1 + j] & 7) == 0 && (row[17 * g + 1 + j] & 0x70) == 0;
                const float d = zero ? 0.f : qt_e8m0_half(row[17 * g]);
                const uint16_t h = ss_f32_to_half(d);
                good = qt_f16((const uint8_t *)&h) == d;
                memcpy(blocks + 18 * g, &h, 2);
                memcpy(blocks + 18 * g + 2, row + 17 * g + 1, 16);
            }
        } else {
            for (int b = 0; b < K / 256 && good; b++) {
                const uint8_t *p = row + (int64_t)b * qt_bytes(qtype);
                uint8_t *o = blocks + 136 * b;
                QTBlock u;
                qt_unpack(qtype, p, &(QTOut){u.q, u.sc, u.mn});
                const float dx = qt_f16(p + d_at) * vals->dk;   // exact: a power of two
                memset(o, 0, 136);
                memcpy(o, p + d_at, 2);
                for (int i = 0; i < 8 && good; i++) {
                    const float m = dx != 0.f ? u.sc[2 * i] / dx : 0.f;
                    good = m == m && fabsf(m) < 64.f;   // not NaN (an inf or NaN d), in range before the cast
                    const int ls = good ? (int)m + 32 : 32;
                    good = good && (float)(int)m == m && ls >= 0 && ls < 64 && dx * (float)(ls - 32) == u.sc[2 * i];
                    o[2 + i / 4] |= (uint8_t)((ls >> 4) << (2 * (i % 4)));
                    o[4 + i / 2] |= (uint8_t)((ls & 15) << (4 * (i & 1)));
                    for (int l = 0; l < 16 && good; l++) {
                        const int lo = code_of[(uint8_t)u.q[32 * i + l]], hi = code_of[(uint8_t)u.q[32 * i + 16 + l]];
                        good = lo >= 0 && hi >= 0;
                        o[8 + 16 * i + l] = (uint8_t)(lo | hi << 4);
                    }
                }
            }
        }
        if (good) qt_rb_pack_row(nl ? QT_IQ4_NL : QT_IQ4_XS, blocks, K, dst + r * out_row);
        free(blocks);
        ok = ok && good;
    }
    return ok;
}
