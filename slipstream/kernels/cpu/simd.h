// Row kernels shared by the decode step (step.c) and the standalone products (quant_matvec.c), one
// branch per instruction set, chosen when the library is compiled for this CPU (build.py):
//   SS_AVX512  AVX-512F/BW/VL (VNNI's vpdpbusd where present)
//   SS_AVX2    AVX2 + FMA (AVX-VNNI's vpdpbusd where present)
//   SS_NEON    AArch64 Advanced SIMD (the dot-product extension's sdot where present)
//   otherwise  portable C, same maths
//
// Weight layouts (weights/quant.py): groups of 32 weights along K.
//   q4:  uint8 qs[N][K/2], group g = bytes 16g..16g+15, byte j = element j (low nibble) and element
//        j + 16 (high nibble); fp32 scale[N][K/32], min[N][K/32]: w = scale * q + min.
//   q8:  int8 qs[N][K], fp32 scale[N][K/32]: w = scale * q.
//   f32: float w[N][K].
// Two kinds of products:
//   exact: fp32 activations: per group scale * sum(q * x) + min * sum(x) (up to summation order,
//          the fp32 product over GGUF's dequantized weights; what transformers computes);
//   fast:  activations quantized per group of 32 to int8 (ggml's Q8 blocks: d = max|x| / 127,
//          q = round(x / d)), integer dot products per group, scaled in fp32:
//          scale * d * sum(qw * qx) + min * d * sum(qx).
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SS_AVX512 1
#define SS_AVX2 1   // the 256-bit kernels are used for the integer products on AVX-512 too
#elif defined(__AVX2__) && defined(__FMA__)
#define SS_AVX2 1
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define SS_NEON 1
#endif

#if defined(SS_AVX2)
#include <immintrin.h>
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SS_VNNI 1
#define SS_DPBUSD(acc, a, b) _mm256_dpbusd_epi32(acc, a, b)
#elif defined(__AVXVNNI__)
#define SS_VNNI 1
#define SS_DPBUSD(acc, a, b) _mm256_dpbusd_avx_epi32(acc, a, b)
#endif
#elif defined(SS_NEON)
#include <arm_neon.h>
#endif

#define AI static inline __attribute__((always_inline))

#if defined(SS_AVX2)
// A q4 byte's high nibble as a code 0..15. Where the CPU has GFNI, one affine byte transform (result bit i =
// source bit i + 4 for i < 4, else 0) instead of a 16-bit shift and a mask: the same codes with one operation
// fewer on the vector ports (the AMX tiles' unpack at 8 rows: amx_kernels.c q4 in cache 218 -> 236 MAC/ns)
#define SS_GF_HI4 0x1020408000000000LL
AI __m256i ss_hi4_256(__m256i v, __m256i m4) {
#if defined(__GFNI__)
    (void)m4;
    return _mm256_gf2p8affine_epi64_epi8(v, _mm256_set1_epi64x(SS_GF_HI4), 0);
#else
    return _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
#endif
}
#if defined(SS_AVX512)
AI __m512i ss_hi4_512(__m512i v, __m512i m4) {
#if defined(__GFNI__)
    (void)m4;
    return _mm512_gf2p8affine_epi64_epi8(v, _mm512_set1_epi64(SS_GF_HI4), 0);
#else
    return _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
#endif
}
#endif
#endif
// A mutable setting that more than one of the library's units reads (step.c, step_qt.c): one definition shared by
// all (weak: the header that holds it is included by each), hidden from the library's exports
#define SS_SHARED __attribute__((weak, visibility("hidden")))
// Loops over the activation rows are unrolled in full, so each row's accumulator stays in a register:
// inside the step's large product function GCC otherwise kept them in a stack array, a load and a
// store per update (seen with perf annotate: the hottest instruction of the batch-8 step).
#define SS_UNROLL_ROWS _Pragma("GCC unroll 8")
#define MAX_ROWS 8   // activation rows that share one pass over a weight row
#ifndef SS_ROWS8
#define SS_ROWS8 1   // the step's AVX2 q4/q8 products 8 weight rows at a time (q4i_rows8, q8i_rows8); 0: as below
#endif
#ifndef SS_Q4_PAIRS
#define SS_Q4_PAIRS 1   // the step's AVX2 q4 products through q4p_row (paired activations); 0: q4q8_row
#endif

// -- which path this build runs --------------------------------------------------------------------
static inline const char *ss_isa_name(void) {
#if defined(SS_AVX512) && defined(SS_VNNI)
    return "avx512-vnni";
#elif defined(SS_AVX512)
    return "avx512";
#elif defined(SS_AVX2) && defined(SS_VNNI)
    return "avx2-vnni";
#elif defined(SS_AVX2)
    return "avx2";
#elif defined(SS_NEON) && defined(__ARM_FEATURE_DOTPROD)
    return "neon-dotprod";
#elif defined(SS_NEON)
    return "neon";
#else
    return "portable";
#endif
}

// -- float helpers ---------------------------------------------------------------------------------
#if defined(SS_AVX2)
AI float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#if defined(SS_AVX2)
AI float hsum128(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// 8 int32 partial sums of u8 x s8 products over 32 bytes (4 products per lane)
AI __m256i ss_dot_u8s8(__m256i u, __m256i s) {
#ifdef SS_VNNI
    return SS_DPBUSD(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// the four groups' 8-lane partial sums p[0..3] -> one total per group
AI __m128i ss_sum4(const __m256i p[4]) {
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}
#endif

// IEEE half -> float, exactly (subnormals included), in plain C (no F16C or NEON needed)
AI float ss_half_to_f32(uint16_t h) {
    const uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    uint32_t bits;
    float f;
    if (e == 0) {
        f = (float)m * 0x1p-24f;
        memcpy(&bits, &f, 4);
        bits |= s;
    } else if (e == 31) {
        bits = s | 0x7f800000u | (m << 13);
    } else {
        bits = s | ((e + 112) << 23) | (m << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
}

// n fp16 values -> fp32 (fp16 KV-cache rows; the q4/q8 layouts' scales when stored in half precision)
AI void ss_f16_row(const uint16_t *h, float *f, int n) {
    int i = 0;
#if defined(SS_AVX2) && defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#elif defined(SS_NEON)
    for (; i + 4 <= n; i += 4) vst1q_f32(f + i, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h + i))));
#endif
    for (; i < n; i++) f[i] = ss_half_to_f32(h[i]);
}

// A Q4_K row's fp32 scales and offsets (sc[g] = d x scale6[g], mn[g] = -(dmin x min6[g]), exact in fp32: the
// very values gguf.py's _q4k_linear computes) from its 6-bit scales and mins [G] and its super-blocks' fp16 d
// and dmin [G/8][2] (Linear.kq): a row's 2.5 G bytes of scales instead of the fp32 planes' 8 G
AI void ss_k6_row(const uint8_t *sc6, const uint8_t *mn6, const uint16_t *dm, int G, float *sc, float *mn) {
    for (int s = 0; s < G / 8; s++) {
        const float d = ss_half_to_f32(dm[2 * s]), dmin = ss_half_to_f32(dm[2 * s + 1]);
#if defined(SS_AVX2)
        const __m256 six = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sc6 + 8 * s))));
        const __m256 mix = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(mn6 + 8 * s))));
        _mm256_storeu_ps(sc + 8 * s, _mm256_mul_ps(_mm256_set1_ps(d), six));
        _mm256_storeu_ps(mn + 8 * s, _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(dmin), mix), _mm256_set1_ps(-0.f)));
#else
        for (int j = 0; j < 8; j++) {
            sc[8 * s + j] = d * (float)sc6[8 * s + j];
            mn[8 * s + j] = -(dmin * (float)mn6[8 * s + j]);
        }
#endif
    }
}

// sum a[i] * b[i]
AI float ss_dot(const float *a, const float *b, int n) {
    int i = 0;
    float s = 0.f;
#if defined(SS_AVX512)
    if (n >= 16) {
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
        for (i = 16; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
        s = _mm512_reduce_add_ps(acc);
    }
#elif defined(SS_AVX2)
    if (n >= 8) {
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
        for (i = 8; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
        s = hsum256(acc);
    }
#elif defined(SS_NEON)
    if (n >= 4) {
        float32x4_t acc = vmulq_f32(vld1q_f32(a), vld1q_f32(b));
        for (i = 4; i + 4 <= n; i += 4) acc = vfmaq_f32(acc, vld1q_f32(a + i), vld1q_f32(b + i));
        s = vaddvq_f32(acc);
    }
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

// -- exp over vectors (Cephes' polynomial: e^x = 2^n e^r, |r| <= ln2/2; ~1 ulp in fp32) -------------------
#if defined(SS_AVX2)
AI __m256 ss_exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3365f)), _mm256_set1_ps(88.3762f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    // 2^n: n + 127 in the exponent field (n is within [-126, 128) after the clamp; 2^128 saturates)
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#elif defined(SS_NEON)
AI float32x4_t ss_exp128(float32x4_t x) {
    x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(-87.3365f)), vdupq_n_f32(88.3762f));
    const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));
    r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
    float32x4_t p = vdupq_n_f32(1.9875691500e-4f);
    p = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), p, r);
    p = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), p, r);
    p = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.f)), p, vmulq_f32(r, r));
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    return vmulq_f32(p, vreinterpretq_f32_s32(e));
}
#endif

// The largest of x[0..n) and -inf, as `m = x[i] > m ? x[i] : m` from m = -inf gives it (NaNs never win):
// one compare per element in a dependent chain took ~8% of a batch-8 step's attention (4 cycles each)
AI float ss_max(const float *x, int64_t n) {
    int64_t i = 0;
    float m = -INFINITY;
#if defined(SS_AVX2)
    __m256 a = _mm256_set1_ps(-INFINITY), b = a;
    for (; i + 16 <= n; i += 16) {   // max_ps(x, m): x where x > m, else m (a NaN x leaves m)
        a = _mm256_max_ps(_mm256_loadu_ps(x + i), a);
        b = _mm256_max_ps(_mm256_loadu_ps(x + i + 8), b);
    }
    a = _mm256_max_ps(b, a);
    _Alignas(32) float lanes[8];
    _mm256_store_ps(lanes, a);
    for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
#elif defined(SS_NEON)
    float32x4_t a = vdupq_n_f32(-INFINITY);
    for (; i + 4 <= n; i += 4) {
        const float32x4_t v = vld1q_f32(x + i);
        a = vbslq_f32(vcgtq_f32(v, a), v, a);   // v where v > a (a NaN v leaves a)
    }
    float lanes[4];
    vst1q_f32(lanes, a);
    for (int j = 0; j < 4; j++) m = lanes[j] > m ? lanes[j] : m;
#endif
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

// x[i] = exp(x[i] - shift); returns the sum of the results
AI float ss_exp_shift(float *x, int64_t n, float shift) {
    int64_t i = 0;
    float sum = 0.f;
#if defined(SS_AVX2)
    const __m256 sh = _mm256_set1_ps(shift);
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 e = ss_exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), sh));
        _mm256_storeu_ps(x + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    sum = hsum256(acc);
#elif defined(SS_NEON)
    const float32x4_t sh = vdupq_n_f32(shift);
    float32x4_t acc = vdupq_n_f32(0.f);
    for (; i + 4 <= n; i += 4) {
        const float32x4_t e = ss_exp128(vsubq_f32(vld1q_f32(x + i), sh));
        vst1q_f32(x + i, e);
        acc = vaddq_f32(acc, e);
    }
    sum = vaddvq_f32(acc);
#endif
    for (; i < n; i++) {
        x[i] = expf(x[i] - shift);
        sum += x[i];
    }
    return sum;
}

// sum x[i] * x[i]
AI float ss_sumsq(const float *x, int n) { return ss_dot(x, x, n); }

// o[i] += w * v[i]
AI void ss_axpy(float *o, float w, const float *v, int n) {
    int i = 0;
#if defined(SS_AVX2)
    const __m256 wv = _mm256_set1_ps(w);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(o + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(o + i)));
#elif defined(SS_NEON)
    const float32x4_t wv = vdupq_n_f32(w);
    for (; i + 4 <= n; i += 4) vst1q_f32(o + i, vfmaq_f32(vld1q_f32(o + i), wv, vld1q_f32(v + i)));
#endif
    for (; i < n; i++) o[i] += w * v[i];
}

// -- activation quantization (fast path) -------------------------------------------------------------
// x[K] -> q[K] int8, d[K/32] (scale), s[K/32] (d * sum of the group's codes)
AI void ss_quantize_row(const float *x, int K, int8_t *q, float *d, float *s) {
    const int G = K / 32;
    for (int g = 0; g < G; g++) {
        const float *xg = x + g * 32;
        int8_t *qg = q + g * 32;
#if defined(SS_AVX2)
        __m256 v[4];
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 mx = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(xg + 8 * j);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float dg = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
        const __m256 idv = _mm256_set1_ps(id);
        __m256i i32[4];
        for (int j = 0; j < 4; j++) i32[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], idv));  // nearest-even
        const __m256i tot = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
        __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(tot), _mm256_extracti128_si256(tot, 1));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
        _mm256_storeu_si256((__m256i *)qg, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        d[g] = dg;
        s[g] = dg * (float)_mm_cvtsi128_si32(t4);
#else
        float amax = 0.f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xg[j]));
        const float dg = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
        int sum = 0;
        for (int j = 0; j < 32; j++) {
            const int v = (int)nearbyintf(xg[j] * id);   // round half to even (default mode)
            qg[j] = (int8_t)v;
            sum += v;
        }
        d[g] = dg;
        s[g] = dg * (float)sum;
#endif
    }
}

// Groups [g0, g1) of a row of K int8 codes q, copied into p paired as q4p_row reads them: groups 2i
// and 2i+1 become [2i: 0-15 | 2i+1: 0-15] [2i: 16-31 | 2i+1: 16-31]; an odd last group stays as it
// is. Each group's two halves have their own places, so tiles of a row may pair their groups apart.
// e[4g..4g+3] = d[g] (the group scales as q4p_row's lanes want them).
AI void ss_pair_groups(const int8_t *q, const float *d, int K, int g0, int g1, int8_t *p, float *e) {
    const int G = K / 32;
    for (int g = g0; g < g1; g++) {
        e[4 * g] = e[4 * g + 1] = e[4 * g + 2] = e[4 * g + 3] = d[g];
        if (g == G - 1 && (G & 1)) {
            memcpy(p + g * 32, q + g * 32, 32);
            continue;
        }
        const int base = (g & ~1) * 32 + (g & 1) * 16;
        memcpy(p + base, q + g * 32, 16);
        memcpy(p + base + 32, q + g * 32 + 16, 16);
    }
}

// sum_g mn[g] * xs[g] (the 4-bit formats' offset term; xs = the activation's per-group sums)
AI float ss_min_term(const float *mn, const float *xs, int G) { return ss_dot(mn, xs, G); }

// -- fast products: int8 activations ------------------------------------------------------------------
// out[b] = sum_k W[n, k] * X[b, k] for one weight row and nb activation rows (row stride K for xq,
// G for xd and xs).
#if defined(SS_AVX2)
// The AVX2 q4 product, two groups per step. A 32-byte load holds groups g and g+1 (16 bytes each);
// its low nibbles are elements 0-15 of both, its high nibbles elements 16-31, so the activations'
// 16-byte halves are paired the same way across the two 128-bit lanes, once per step when the
// activation is written (ss_pair_groups), not per weight row. The two u8 x s8
// products of a pair then sum in int16 (|sum| <= 4 * 15 * 128) and one madd widens them: 8 lanes,
// four per group, scaled by [s_g x4 | s_g+1 x4]. Fewer instructions per group than decoding each
// group to 32 codes and reducing four groups horizontally (benchmarks/row_kernels.c). Scales and
// mins are fp32 or (half) fp16, read in the loop; the min term rides in the same accumulator.
AI __m256 q4p_scales8(const void *s, int half, int g) {
#if defined(__F16C__)
    if (half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)s + g)));
#endif
    return _mm256_loadu_ps((const float *)s + g);
}
AI __m256 q4p_scales2(const void *s, int half, int g) {   // [s_g, s_g+1, 0...]
#if defined(__F16C__)
    if (half) {
        int32_t v;
        memcpy(&v, (const uint16_t *)s + g, 4);
        return _mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(v)));
    }
#endif
    return _mm256_castps128_ps256(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)((const float *)s + g))));
}
AI float q4p_scale1(const void *s, int half, int g) {
#if defined(__F16C__)
    if (half) return _cvtsh_ss(((const uint16_t *)s)[g]);
#endif
    return ((const float *)s)[g];
}
// groups g, g+1 of a paired activation row a (ss_pair_groups) against the pair's nibbles: 8 int32 lanes,
// four per group
AI __m256i q4p_pair(__m256i lo, __m256i hi, const int8_t *a) {
    const __m256i a0 = _mm256_loadu_si256((const __m256i *)a), a1 = _mm256_loadu_si256((const __m256i *)(a + 32));
#ifdef SS_VNNI   // four products per int32 lane, all of one group: two instructions for the pair
    return SS_DPBUSD(SS_DPBUSD(_mm256_setzero_si256(), lo, a0), hi, a1);
#endif
    const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, a0), _mm256_maddubs_epi16(hi, a1));
    return _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
}
// xp, xe: the rows' paired codes and their scales four times each ([nb][K], [nb][4G]: ss_pair_groups);
// xd: the plain scales (an odd last group's); xs: the per-group sums (the min term). mn NULL: Q4_0, whose
// offsets are -8 x the scales (exactly: a power of two), so it needs no min plane
AI void q4p_row(const uint8_t *w, const void *sc, const void *mn, int half, int G, const int8_t *xp,
                const float *xd, const float *xe, const float *xs, int nb, float *out) {
    const int K = G * 32;
    __m256 acc[MAX_ROWS];   // one chain per row, the same whatever nb: a row's result never depends on its neighbours
    float tail[MAX_ROWS];
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) acc[b] = _mm256_setzero_ps(), tail[b] = 0.f;
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m256i i01 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), i23 = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
    const __m256i i45 = _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5), i67 = _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7);
    int g = 0;
    for (; g + 8 <= G; g += 8) {
        const __m256 s8 = q4p_scales8(sc, half, g);
        const __m256 m8 = mn ? q4p_scales8(mn, half, g) : _mm256_mul_ps(s8, _mm256_set1_ps(-8.f));
        _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) {   // one pair at a time: few live registers at 8 rows
            const __m256i idx = j == 0 ? i01 : j == 1 ? i23 : j == 2 ? i45 : i67;
            const __m256i r = _mm256_loadu_si256((const __m256i *)(w + (g + 2 * j) * 16));
            const __m256i lo = _mm256_and_si256(r, m4), hi = ss_hi4_256(r, m4);
            const __m256 sp = _mm256_permutevar8x32_ps(s8, idx);
            SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
                const __m256 d = _mm256_loadu_ps(xe + (int64_t)b * 4 * G + (g + 2 * j) * 4);
                const __m256 p = _mm256_cvtepi32_ps(q4p_pair(lo, hi, xp + (int64_t)b * K + (g + 2 * j) * 32));
                acc[b] = _mm256_fmadd_ps(_mm256_mul_ps(sp, d), p, acc[b]);
            }
        }
        SS_UNROLL_ROWS for (int b = 0; b < nb; b++) acc[b] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(xs + (int64_t)b * G + g), acc[b]);
    }
    for (; g + 2 <= G; g += 2) {
        const __m256 sp = _mm256_permutevar8x32_ps(q4p_scales2(sc, half, g), i01);
        const __m128 m2 = mn ? _mm256_castps256_ps128(q4p_scales2(mn, half, g))
                             : _mm_mul_ps(_mm256_castps256_ps128(q4p_scales2(sc, half, g)), _mm_set1_ps(-8.f));
        const __m256i r = _mm256_loadu_si256((const __m256i *)(w + g * 16));
        const __m256i lo = _mm256_and_si256(r, m4), hi = ss_hi4_256(r, m4);
        SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
            const __m256 d = _mm256_loadu_ps(xe + (int64_t)b * 4 * G + g * 4);
            acc[b] = _mm256_fmadd_ps(_mm256_mul_ps(sp, d), _mm256_cvtepi32_ps(q4p_pair(lo, hi, xp + (int64_t)b * K + g * 32)), acc[b]);
            tail[b] += hsum128(_mm_mul_ps(m2, _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(xs + (int64_t)b * G + g)))));
        }
    }
    if (g < G) {   // an odd last group: left unpaired (natural order) by ss_pair_groups
        const __m128i raw = _mm_loadu_si128((const __m128i *)(w + g * 16)), m4x = _mm_set1_epi8(15);
        const __m256i wq = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4x), _mm_and_si128(raw, m4x));
        const float s = q4p_scale1(sc, half, g), m = mn ? q4p_scale1(mn, half, g) : -8.f * s;
        SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
            const __m256i p = ss_dot_u8s8(wq, _mm256_loadu_si256((const __m256i *)(xp + (int64_t)b * K + g * 32)));
            tail[b] += s * xd[(int64_t)b * G + g] * hsum256(_mm256_cvtepi32_ps(p)) + m * xs[(int64_t)b * G + g];
        }
    }
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) out[b] = hsum256(acc[b]) + tail[b];
}

// The AVX2 q4 product over 8 weight rows at once (every activation row count takes it: one arithmetic, so a
// row's result never depends on what shares its step). Per group, the 8 rows' 16 code bytes are transposed
// in registers so that 32-bit lane r holds 4 bytes of weight row r (low nibbles: elements 4c..4c+3, high:
// 16+4c..16+4c+3); an activation row's matching 4 codes, broadcast to every lane, then multiply all 8 weight
// rows at once, and the group's exact int32 sums come out with lanes = weight rows: no horizontal sums. The
// transpose and the nibble unpacking are shared by the activation rows (at batch 8 about 1/8 of the work;
// the paired q4p_row spends ~1.6x the vector operations per multiply-add). Per (weight row n, activation
// row m), in group order:
//     acc = fma(float(sum) * d[m][g], sc[n][g], acc);  acc = fma(mn[n][g], s[m][g], acc)
// w[r]: weight row r's codes (rows past a range's end may repeat its last row: lanes never mix);
// sc8, mn8: the rows' scales and offsets, group g's 8 at sc8 + g * ss (elements), fp16 (half = 1, needs
// F16C) or fp32 (half = 0); mn8 NULL: Q4_0's -8 x the scales. half = 2: a Q4_K matrix's compact tile copy
// (weights/quant.py _tile_k; its 16-row block's bytes at sc8 and mn8, these 8 rows `ss` lanes into it):
// d x the 6-bit scale and -(dmin x the 6-bit min), exact in fp32, the planes' very values.
// xq [nb][K], xd and xs [nb][G]: the activation rows' codes, scales and per-group sums. out[m]: lane r =
// row r against row m. pf: 128 G bytes to prefetch into L2 (a later block of 8 rows' codes), two lines per
// group, spread so as not to fill the L1's miss buffers at once.
// int16 partial sums are exact: 16 products of |u4 x s8| <= 15 x 127 per lane (30480).
AI __m256 q4i_scales8(const void *p, int half, int64_t at) {
#if defined(__F16C__)
    if (half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + at)));
#endif
    return _mm256_loadu_ps((const float *)p + at);
}
#if defined(__F16C__)
AI __m256 q4i_k6_lanes(const uint8_t *blk, int G, int g, int64_t h) {   // d x scale of group g, rows h..h+7
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * (int64_t)G + 32 * (g >> 3) + 2 * h)));
    const __m128i b = _mm_loadl_epi64((const __m128i *)(blk + 16 * (int64_t)g + h));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), d);
}
#endif
// 16 bytes at `off` of 8 rows -> c[j]: bytes 4j..4j+3 of every row, 32-bit lane r = row r (a 4 x 4 dword
// transpose in each 128-bit half: lanes 0-3 rows 0-3, lanes 4-7 rows 4-7); the 8-row kernels' code transpose
AI void rows8_t16(const uint8_t *const w[8], int64_t off, __m256i c[4]) {
    const __m256i a0 = _mm256_loadu2_m128i((const __m128i *)(w[4] + off), (const __m128i *)(w[0] + off));
    const __m256i a1 = _mm256_loadu2_m128i((const __m128i *)(w[5] + off), (const __m128i *)(w[1] + off));
    const __m256i a2 = _mm256_loadu2_m128i((const __m128i *)(w[6] + off), (const __m128i *)(w[2] + off));
    const __m256i a3 = _mm256_loadu2_m128i((const __m128i *)(w[7] + off), (const __m128i *)(w[3] + off));
    const __m256i t0 = _mm256_unpacklo_epi32(a0, a1), t1 = _mm256_unpackhi_epi32(a0, a1);
    const __m256i t2 = _mm256_unpacklo_epi32(a2, a3), t3 = _mm256_unpackhi_epi32(a2, a3);
    c[0] = _mm256_unpacklo_epi64(t0, t2), c[1] = _mm256_unpackhi_epi64(t0, t2);
    c[2] = _mm256_unpacklo_epi64(t1, t3), c[3] = _mm256_unpackhi_epi64(t1, t3);
}
// an activation row's 32 codes of a group as 8 registers, x[j] = codes 4j..4j+3 in every 32-bit lane
AI void rows8_bcast(const int8_t *a, __m256i x[8]) {
    for (int j = 0; j < 8; j++) {
        int32_t v;
        memcpy(&v, a + 4 * j, 4);
        x[j] = _mm256_set1_epi32(v);
    }
}
#ifdef SS_VNNI
// a group's exact int32 sums, lanes = weight rows: q[j] the 8 rows' codes 4j..4j+3 (unsigned), x[j] an activation
// row's matching codes broadcast (rows8_bcast); two chains of four, as every 8-row VNNI kernel sums them
AI __m256i rows8_dot(const __m256i *q, const __m256i x[8]) {
    const __m256i z = _mm256_setzero_si256();
    const __m256i e = SS_DPBUSD(SS_DPBUSD(SS_DPBUSD(SS_DPBUSD(z, q[0], x[0]), q[1], x[1]), q[2], x[2]), q[3], x[3]);
    const __m256i f = SS_DPBUSD(SS_DPBUSD(SS_DPBUSD(SS_DPBUSD(z, q[4], x[4]), q[5], x[5]), q[6], x[6]), q[7], x[7]);
    return _mm256_add_epi32(e, f);
}
#endif
// one group g of q4i_rows8 into acc[0..nb)
AI void q4i_group(const uint8_t *const w[8], const void *sc8, const void *mn8, int half, int64_t ss, int G,
                  const int8_t *xq, const float *xd, const float *xs, int nb, const char *pf, int g, __m256 *acc) {
    const int K = 32 * G;
    const __m256i m4 = _mm256_set1_epi8(15);
#ifndef SS_VNNI
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    __m256i c[4];   // c[j]: code bytes 4j..4j+3 of every row
    rows8_t16(w, 16 * (int64_t)g, c);
    __m256i q[8];   // q[j]: elements 4j..4j+3 of every row
    for (int j = 0; j < 4; j++)
        q[j] = _mm256_and_si256(c[j], m4), q[4 + j] = ss_hi4_256(c[j], m4);
    if (pf) __builtin_prefetch(pf + 128 * (int64_t)g, 0, 2), __builtin_prefetch(pf + 128 * (int64_t)g + 64, 0, 2);
    __m256 s8, o8;
#if defined(__F16C__)
    if (half == 2) {   // Q4_K's compact copy; the offsets negated by their sign bit, as -(dmin x min) is
        s8 = q4i_k6_lanes((const uint8_t *)sc8, G, g, ss);
        o8 = _mm256_xor_ps(q4i_k6_lanes((const uint8_t *)mn8, G, g, ss), _mm256_set1_ps(-0.f));
    } else
#endif
    {
        s8 = q4i_scales8(sc8, half, g * ss);
        o8 = mn8 ? q4i_scales8(mn8, half, g * ss) : _mm256_mul_ps(s8, _mm256_set1_ps(-8.f));
    }
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
        __m256i x[8];
        rows8_bcast(xq + (int64_t)b * K + 32 * (int64_t)g, x);
#ifdef SS_VNNI
        const __m256i sum = rows8_dot(q, x);
#else
        const __m256i p01 = _mm256_add_epi16(_mm256_maddubs_epi16(q[0], x[0]), _mm256_maddubs_epi16(q[1], x[1]));
        const __m256i p23 = _mm256_add_epi16(_mm256_maddubs_epi16(q[2], x[2]), _mm256_maddubs_epi16(q[3], x[3]));
        const __m256i p45 = _mm256_add_epi16(_mm256_maddubs_epi16(q[4], x[4]), _mm256_maddubs_epi16(q[5], x[5]));
        const __m256i p67 = _mm256_add_epi16(_mm256_maddubs_epi16(q[6], x[6]), _mm256_maddubs_epi16(q[7], x[7]));
        const __m256i sum = _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(p01, p23), _mm256_add_epi16(p45, p67)), ones);
#endif
        const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_broadcast_ss(xd + (int64_t)b * G + g));
        acc[b] = _mm256_fmadd_ps(t, s8, acc[b]);
        acc[b] = _mm256_fmadd_ps(o8, _mm256_broadcast_ss(xs + (int64_t)b * G + g), acc[b]);
    }
}
// eo: the groups alternate between two sums per output (even, odd), added at the end: the arithmetic of the
// AVX-512 VNNI builds' tiles and twin (amx.h), which these kernels then follow bitwise; 0: one sum (AVX2 builds)
AI void q4i_rows8(const uint8_t *const w[8], const void *sc8, const void *mn8, int half, int64_t ss, int G,
                  const int8_t *xq, const float *xd, const float *xs, int nb, const char *pf, const int eo,
                  __m256 out[MAX_ROWS]) {
    __m256 acc[MAX_ROWS], odd[MAX_ROWS];
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) acc[b] = _mm256_setzero_ps(), odd[b] = _mm256_setzero_ps();
    int g = 0;
    if (eo) {
        for (; g + 2 <= G; g += 2) {
            q4i_group(w, sc8, mn8, half, ss, G, xq, xd, xs, nb, pf, g, acc);
            q4i_group(w, sc8, mn8, half, ss, G, xq, xd, xs, nb, pf, g + 1, odd);
        }
        if (g < G) q4i_group(w, sc8, mn8, half, ss, G, xq, xd, xs, nb, pf, g, acc);
        SS_UNROLL_ROWS for (int b = 0; b < nb; b++) out[b] = _mm256_add_ps(acc[b], odd[b]);
        return;
    }
    for (; g < G; g++) q4i_group(w, sc8, mn8, half, ss, G, xq, xd, xs, nb, pf, g, acc);
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) out[b] = acc[b];
}

// The AVX2 q8 product over 8 weight rows at once, as q4i_rows8: per (weight row n, activation row m), in group
// order, acc = fma(float(sum) * d[m][g], sc[n][g], acc), sum the group's exact int32 sum. Two ways to the sums,
// the same integers, so a row's result never depends on the row count:
//   * two or more activation rows: the 8 rows' 32 code bytes transposed in registers (an 8 x 8 transpose of
//     dwords, 24 shuffles shared by the activation rows) so that lane r holds 4 codes of row r; per activation
//     row, its 4 matching codes broadcast, the sign trick (|w| u8 x sign(x, w) s8: maddubs takes one unsigned
//     operand) and a madd per dword (two full-range products already fill int16);
//   * one activation row: each weight row's dot product as 8 int32 partials, the 8 rows' partials then
//     reduced and transposed by horizontal adds (no transpose to share at one row).
// w, sc8, ss, half, pf: as q4i_rows8 (half 0 or 1; pf: 256 G bytes, four lines per group).
// one group g of q8i_rows8 into acc[0..nb)
AI void q8i_group(const int8_t *const w[8], const void *sc8, int half, int64_t ss, int G, const int8_t *xq,
                  const float *xd, int nb, const char *pf, int g, __m256 *acc) {
    const int K = 32 * G;
#ifndef SS_VNNI
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    const int64_t o = 32 * (int64_t)g;
    if (pf)
        for (int l = 0; l < 4; l++) __builtin_prefetch(pf + 256 * (int64_t)g + 64 * l, 0, 2);
    __m256i r[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_si256((const __m256i *)(w[i] + o));
    const __m256 s8 = q4i_scales8(sc8, half, g * ss);
    if (nb == 1) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(xq + o));
        __m256i p[8];
        for (int i = 0; i < 8; i++) {
#ifdef SS_VNNI
            p[i] = SS_DPBUSD(_mm256_setzero_si256(), _mm256_abs_epi8(r[i]), _mm256_sign_epi8(a, r[i]));
#else
            p[i] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(r[i]), _mm256_sign_epi8(a, r[i])), ones);
#endif
        }
        const __m256i q0 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
        const __m256i q1 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
        const __m256i sum = _mm256_add_epi32(_mm256_permute2x128_si256(q0, q1, 0x20), _mm256_permute2x128_si256(q0, q1, 0x31));
        const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_broadcast_ss(xd + g));
        acc[0] = _mm256_fmadd_ps(t, s8, acc[0]);
        return;
    }
    __m256i t[8], u[8], c[8], a[8];   // c[j]: code dword j of every row; a[j]: |c[j]|
    for (int i = 0; i < 4; i++)
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]), t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    for (int h = 0; h < 2; h++) {   // rows 4h..4h+3
        u[4 * h] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]), u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]), u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
    }
    for (int j = 0; j < 4; j++)
        c[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20), c[4 + j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
    for (int j = 0; j < 8; j++) a[j] = _mm256_abs_epi8(c[j]);
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
        const int8_t *x = xq + (int64_t)b * K + o;
        __m256i sum = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            int32_t v;
            memcpy(&v, x + 4 * j, 4);
            const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(v), c[j]);
#ifdef SS_VNNI
            sum = SS_DPBUSD(sum, a[j], xs);
#else
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(a[j], xs), ones));
#endif
        }
        const __m256 tt = _mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_broadcast_ss(xd + (int64_t)b * G + g));
        acc[b] = _mm256_fmadd_ps(tt, s8, acc[b]);
    }
}
// eo: as q4i_rows8
AI void q8i_rows8(const int8_t *const w[8], const void *sc8, int half, int64_t ss, int G, const int8_t *xq,
                  const float *xd, int nb, const char *pf, const int eo, __m256 out[MAX_ROWS]) {
    __m256 acc[MAX_ROWS], odd[MAX_ROWS];
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) acc[b] = _mm256_setzero_ps(), odd[b] = _mm256_setzero_ps();
    int g = 0;
    if (eo) {
        for (; g + 2 <= G; g += 2) {
            q8i_group(w, sc8, half, ss, G, xq, xd, nb, pf, g, acc);
            q8i_group(w, sc8, half, ss, G, xq, xd, nb, pf, g + 1, odd);
        }
        if (g < G) q8i_group(w, sc8, half, ss, G, xq, xd, nb, pf, g, acc);
        SS_UNROLL_ROWS for (int b = 0; b < nb; b++) out[b] = _mm256_add_ps(acc[b], odd[b]);
        return;
    }
    for (; g < G; g++) q8i_group(w, sc8, half, ss, G, xq, xd, nb, pf, g, acc);
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) out[b] = acc[b];
}
#endif

AI void q4q8_row(const uint8_t *w, const float *sc, const float *mn, int G, const int8_t *xq,
                 const float *xd, const float *xs, int nb, float *out) {
    const int K = G * 32;
#if defined(SS_AVX2)
    // Four groups at a time: their integer dot products are reduced to one lane each (hadd) and
    // scaled by one 4-wide multiply, instead of a broadcast and a conversion per group and row.
    __m128 acc[MAX_ROWS];
    __m256 acc1[MAX_ROWS];
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) acc[b] = _mm_setzero_ps(), acc1[b] = _mm256_setzero_ps();
    const __m128i m4 = _mm_set1_epi8(15);
    int g = 0;
    for (; g + 4 <= G; g += 4) {
        __m256i wq[4];
        for (int j = 0; j < 4; j++) {
            const __m128i raw = _mm_loadu_si128((const __m128i *)(w + (g + j) * 16));
            wq[j] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
        }
        const __m128 s4 = _mm_loadu_ps(sc + g);
        SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
            const int8_t *a = xq + (int64_t)b * K + g * 32;
            __m256i p[4];
            for (int j = 0; j < 4; j++) p[j] = ss_dot_u8s8(wq[j], _mm256_loadu_si256((const __m256i *)(a + 32 * j)));
            acc[b] = _mm_fmadd_ps(_mm_mul_ps(s4, _mm_loadu_ps(xd + (int64_t)b * G + g)), _mm_cvtepi32_ps(ss_sum4(p)), acc[b]);
        }
    }
    for (; g < G; g++) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(w + g * 16));
        const __m256i wq = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
        SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(xq + (int64_t)b * K + g * 32));
            acc1[b] = _mm256_fmadd_ps(_mm256_set1_ps(sc[g] * xd[(int64_t)b * G + g]),
                                      _mm256_cvtepi32_ps(ss_dot_u8s8(wq, a)), acc1[b]);
        }
    }
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++)
        out[b] = hsum128(acc[b]) + hsum256(acc1[b]) + ss_min_term(mn, xs + (int64_t)b * G, G);
#elif defined(SS_NEON)
    float32x4_t acc[MAX_ROWS];
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) acc[b] = vdupq_n_f32(0.f);
    const uint8x16_t m4 = vdupq_n_u8(15);
    for (int g = 0; g < G; g++) {
        const uint8x16_t raw = vld1q_u8(w + g * 16);
        const int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(raw, m4)), hi = vreinterpretq_s8_u8(vshrq_n_u8(raw, 4));
        SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
            const int8_t *a = xq + (int64_t)b * K + g * 32;
            const int8x16_t a0 = vld1q_s8(a), a1 = vld1q_s8(a + 16);
#if defined(__ARM_FEATURE_DOTPROD)
            const int32x4_t p = vdotq_s32(vdotq_s32(vdupq_n_s32(0), lo, a0), hi, a1);
#else
            int16x8_t m0 = vmull_s8(vget_low_s8(lo), vget_low_s8(a0));
            m0 = vmlal_s8(m0, vget_high_s8(lo), vget_high_s8(a0));
            int16x8_t m1 = vmull_s8(vget_low_s8(hi), vget_low_s8(a1));
            m1 = vmlal_s8(m1, vget_high_s8(hi), vget_high_s8(a1));
            const int32x4_t p = vaddq_s32(vpaddlq_s16(m0), vpaddlq_s16(m1));
#endif
            acc[b] = vfmaq_n_f32(acc[b], vcvtq_f32_s32(p), sc[g] * xd[(int64_t)b * G + g]);
        }
    }
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) out[b] = vaddvq_f32(acc[b]) + ss_min_term(mn, xs + (int64_t)b * G, G);
#else
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
        const int8_t *a = xq + (int64_t)b * K;
        float acc = 0.f;
        for (int g = 0; g < G; g++) {
            int sum = 0;
            for (int j = 0; j < 16; j++) {
                const uint8_t v = w[g * 16 + j];
                sum += (v & 15) * a[g * 32 + j] + (v >> 4) * a[g * 32 + 16 + j];
            }
            acc += sc[g] * xd[(int64_t)b * G + g] * (float)sum;
        }
        out[b] = acc + ss_min_term(mn, xs + (int64_t)b * G, G);
    }
#endif
}

#if defined(SS_AVX2)
// The q8 product on paired activations (as q4p_row): a group pair's weights are paired with two
// vperm2i128 per weight row (shared by every activation row), then per row two sign-trick u8 x s8
// products, widened apart (two full-range products overflow int16) and added: 8 lanes, four per group.
AI __m256i q8p_pair(__m256i ulo, __m256i slo, __m256i uhi, __m256i shi, const int8_t *a) {
    const __m256i a0 = _mm256_loadu_si256((const __m256i *)a), a1 = _mm256_loadu_si256((const __m256i *)(a + 32));
#ifdef SS_VNNI
    return SS_DPBUSD(SS_DPBUSD(_mm256_setzero_si256(), ulo, _mm256_sign_epi8(a0, slo)), uhi, _mm256_sign_epi8(a1, shi));
#else
    const __m256i ones = _mm256_set1_epi16(1);
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(ulo, _mm256_sign_epi8(a0, slo)), ones),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(uhi, _mm256_sign_epi8(a1, shi)), ones));
#endif
}
// xp, xe: paired codes and repeated scales of nb rows (ss_pair_groups); sc fp32 or (half) fp16
AI void q8p_row(const int8_t *w, const void *sc, int half, int G, const int8_t *xp, const float *xd,
                const float *xe, int nb, float *out) {
    const int K = G * 32;
    __m256 acc[MAX_ROWS];
    float tail[MAX_ROWS];
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) acc[b] = _mm256_setzero_ps(), tail[b] = 0.f;
    const __m256i i01 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), i23 = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
    const __m256i i45 = _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5), i67 = _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7);
    int g = 0;
    for (; g + 8 <= G; g += 8) {
        const __m256 s8 = q4p_scales8(sc, half, g);
        _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) {
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + (g + 2 * j) * 32));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + (g + 2 * j + 1) * 32));
            const __m256i slo = _mm256_permute2x128_si256(w0, w1, 0x20), shi = _mm256_permute2x128_si256(w0, w1, 0x31);
            const __m256i ulo = _mm256_sign_epi8(slo, slo), uhi = _mm256_sign_epi8(shi, shi);
            const __m256 sp = _mm256_permutevar8x32_ps(s8, j == 0 ? i01 : j == 1 ? i23 : j == 2 ? i45 : i67);
            SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
                const __m256 d = _mm256_loadu_ps(xe + (int64_t)b * 4 * G + (g + 2 * j) * 4);
                const __m256 p = _mm256_cvtepi32_ps(q8p_pair(ulo, slo, uhi, shi, xp + (int64_t)b * K + (g + 2 * j) * 32));
                acc[b] = _mm256_fmadd_ps(_mm256_mul_ps(sp, d), p, acc[b]);
            }
        }
    }
    for (; g + 2 <= G; g += 2) {
        const __m256 sp = _mm256_permutevar8x32_ps(q4p_scales2(sc, half, g), i01);
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + g * 32)), w1 = _mm256_loadu_si256((const __m256i *)(w + g * 32 + 32));
        const __m256i slo = _mm256_permute2x128_si256(w0, w1, 0x20), shi = _mm256_permute2x128_si256(w0, w1, 0x31);
        const __m256i ulo = _mm256_sign_epi8(slo, slo), uhi = _mm256_sign_epi8(shi, shi);
        SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
            const __m256 d = _mm256_loadu_ps(xe + (int64_t)b * 4 * G + g * 4);
            acc[b] = _mm256_fmadd_ps(_mm256_mul_ps(sp, d), _mm256_cvtepi32_ps(q8p_pair(ulo, slo, uhi, shi, xp + (int64_t)b * K + g * 32)), acc[b]);
        }
    }
    if (g < G) {   // an odd last group (left unpaired by ss_pair_groups)
        const __m256i wq = _mm256_loadu_si256((const __m256i *)(w + g * 32)), wa = _mm256_sign_epi8(wq, wq);
        const float s = q4p_scale1(sc, half, g);
        SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(xp + (int64_t)b * K + g * 32));
            tail[b] += s * xd[(int64_t)b * G + g] * hsum256(_mm256_cvtepi32_ps(ss_dot_u8s8(wa, _mm256_sign_epi8(a, wq))));
        }
    }
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) out[b] = hsum256(acc[b]) + tail[b];
}
#endif

AI void q8q8_row(const int8_t *w, const float *sc, int G, const int8_t *xq, const float *xd, int nb,
                 float *out) {
    const int K = G * 32;
#if defined(SS_AVX2)
    __m128 acc[MAX_ROWS];
    __m256 acc1[MAX_ROWS];
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) acc[b] = _mm_setzero_ps(), acc1[b] = _mm256_setzero_ps();
    int g = 0;
    for (; g + 4 <= G; g += 4) {   // as q4q8_row: four groups per reduction
        __m256i wa[4], ws[4];
        for (int j = 0; j < 4; j++) {
            ws[j] = _mm256_loadu_si256((const __m256i *)(w + (g + j) * 32));
            wa[j] = _mm256_sign_epi8(ws[j], ws[j]);   // |w| as unsigned bytes; the sign moves to a
        }
        const __m128 s4 = _mm_loadu_ps(sc + g);
        SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
            const int8_t *a = xq + (int64_t)b * K + g * 32;
            __m256i p[4];
            for (int j = 0; j < 4; j++)
                p[j] = ss_dot_u8s8(wa[j], _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(a + 32 * j)), ws[j]));
            acc[b] = _mm_fmadd_ps(_mm_mul_ps(s4, _mm_loadu_ps(xd + (int64_t)b * G + g)), _mm_cvtepi32_ps(ss_sum4(p)), acc[b]);
        }
    }
    for (; g < G; g++) {
        const __m256i wq = _mm256_loadu_si256((const __m256i *)(w + g * 32));
        const __m256i wa = _mm256_sign_epi8(wq, wq);
        SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(xq + (int64_t)b * K + g * 32));
            acc1[b] = _mm256_fmadd_ps(_mm256_set1_ps(sc[g] * xd[(int64_t)b * G + g]),
                                      _mm256_cvtepi32_ps(ss_dot_u8s8(wa, _mm256_sign_epi8(a, wq))), acc1[b]);
        }
    }
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) out[b] = hsum128(acc[b]) + hsum256(acc1[b]);
#elif defined(SS_NEON)
    float32x4_t acc[MAX_ROWS];
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) acc[b] = vdupq_n_f32(0.f);
    for (int g = 0; g < G; g++) {
        const int8x16_t w0 = vld1q_s8(w + g * 32), w1 = vld1q_s8(w + g * 32 + 16);
        SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
            const int8_t *a = xq + (int64_t)b * K + g * 32;
            const int8x16_t a0 = vld1q_s8(a), a1 = vld1q_s8(a + 16);
#if defined(__ARM_FEATURE_DOTPROD)
            const int32x4_t p = vdotq_s32(vdotq_s32(vdupq_n_s32(0), w0, a0), w1, a1);
#else
            // two products per int16 lane would overflow at 127 * 127 * 2: widen each product
            int32x4_t p = vpaddlq_s16(vmull_s8(vget_low_s8(w0), vget_low_s8(a0)));
            p = vpadalq_s16(p, vmull_s8(vget_high_s8(w0), vget_high_s8(a0)));
            p = vpadalq_s16(p, vmull_s8(vget_low_s8(w1), vget_low_s8(a1)));
            p = vpadalq_s16(p, vmull_s8(vget_high_s8(w1), vget_high_s8(a1)));
#endif
            acc[b] = vfmaq_n_f32(acc[b], vcvtq_f32_s32(p), sc[g] * xd[(int64_t)b * G + g]);
        }
    }
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) out[b] = vaddvq_f32(acc[b]);
#else
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
        const int8_t *a = xq + (int64_t)b * K;
        float acc = 0.f;
        for (int g = 0; g < G; g++) {
            int sum = 0;
            for (int j = 0; j < 32; j++) sum += w[g * 32 + j] * a[g * 32 + j];
            acc += sc[g] * xd[(int64_t)b * G + g] * (float)sum;
        }
        out[b] = acc;
    }
#endif
}

// -- exact products: fp32 activations ------------------------------------------------------------------
// xs: the activation's per-group sums, [nb][G] (for the min term)
AI void q4f_row(const uint8_t *w, const float *sc, const float *mn, int G, const float *x, int K,
                const float *xs, int nb, float *out) {
#if defined(SS_AVX512)
    __m512 acc[MAX_ROWS];
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) acc[b] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi32(15);
    for (int g = 0; g < G; g++) {
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + g * 16)));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(q, low4));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
        const __m512 d = _mm512_set1_ps(sc[g]);
        SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
            const float *xg = x + (int64_t)b * K + g * 32;
            __m512 t = _mm512_mul_ps(lo, _mm512_loadu_ps(xg));
            t = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xg + 16), t);
            acc[b] = _mm512_fmadd_ps(d, t, acc[b]);
        }
    }
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) out[b] = _mm512_reduce_add_ps(acc[b]) + ss_min_term(mn, xs + (int64_t)b * G, G);
#elif defined(SS_AVX2)
    __m256 acc[MAX_ROWS];
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) acc[b] = _mm256_setzero_ps();
    const __m128i m4 = _mm_set1_epi8(15);
    for (int g = 0; g < G; g++) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(w + g * 16));
        const __m128i lo = _mm_and_si128(raw, m4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
        const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
        const __m256 d = _mm256_set1_ps(sc[g]);
        SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
            const float *xg = x + (int64_t)b * K + g * 32;
            __m256 t = _mm256_mul_ps(w0, _mm256_loadu_ps(xg));
            t = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), t);
            t = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg + 16), t);
            t = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), t);
            acc[b] = _mm256_fmadd_ps(d, t, acc[b]);
        }
    }
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) out[b] = hsum256(acc[b]) + ss_min_term(mn, xs + (int64_t)b * G, G);
#elif defined(SS_NEON)
    float32x4_t acc[MAX_ROWS];
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) acc[b] = vdupq_n_f32(0.f);
    const uint8x16_t m4 = vdupq_n_u8(15);
    for (int g = 0; g < G; g++) {
        const uint8x16_t raw = vld1q_u8(w + g * 16);
        const uint8x16_t lo = vandq_u8(raw, m4), hi = vshrq_n_u8(raw, 4);
        float32x4_t wf[8];
        const uint16x8_t l0 = vmovl_u8(vget_low_u8(lo)), l1 = vmovl_u8(vget_high_u8(lo));
        const uint16x8_t h0 = vmovl_u8(vget_low_u8(hi)), h1 = vmovl_u8(vget_high_u8(hi));
        wf[0] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(l0))); wf[1] = vcvtq_f32_u32(vmovl_u16(vget_high_u16(l0)));
        wf[2] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(l1))); wf[3] = vcvtq_f32_u32(vmovl_u16(vget_high_u16(l1)));
        wf[4] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(h0))); wf[5] = vcvtq_f32_u32(vmovl_u16(vget_high_u16(h0)));
        wf[6] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(h1))); wf[7] = vcvtq_f32_u32(vmovl_u16(vget_high_u16(h1)));
        SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
            const float *xg = x + (int64_t)b * K + g * 32;
            float32x4_t t = vmulq_f32(wf[0], vld1q_f32(xg));
            for (int j = 1; j < 8; j++) t = vfmaq_f32(t, wf[j], vld1q_f32(xg + 4 * j));
            acc[b] = vfmaq_n_f32(acc[b], t, sc[g]);
        }
    }
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) out[b] = vaddvq_f32(acc[b]) + ss_min_term(mn, xs + (int64_t)b * G, G);
#else
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
        const float *xb = x + (int64_t)b * K;
        float acc = 0.f;
        for (int g = 0; g < G; g++) {
            float t = 0.f;
            for (int j = 0; j < 16; j++) {
                const uint8_t v = w[g * 16 + j];
                t += (float)(v & 15) * xb[g * 32 + j] + (float)(v >> 4) * xb[g * 32 + 16 + j];
            }
            acc += sc[g] * t;
        }
        out[b] = acc + ss_min_term(mn, xs + (int64_t)b * G, G);
    }
#endif
}

AI void q8f_row(const int8_t *w, const float *sc, int G, const float *x, int K, int nb, float *out) {
#if defined(SS_AVX512)
    __m512 acc[MAX_ROWS];
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) acc[b] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + g * 32))));
        const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + g * 32 + 16))));
        const __m512 d = _mm512_set1_ps(sc[g]);
        SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
            const float *xg = x + (int64_t)b * K + g * 32;
            __m512 t = _mm512_mul_ps(w0, _mm512_loadu_ps(xg));
            t = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xg + 16), t);
            acc[b] = _mm512_fmadd_ps(d, t, acc[b]);
        }
    }
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) out[b] = _mm512_reduce_add_ps(acc[b]);
#elif defined(SS_AVX2)
    __m256 acc[MAX_ROWS];
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) acc[b] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m256 wf[4];
        for (int j = 0; j < 4; j++)
            wf[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + g * 32 + 8 * j))));
        const __m256 d = _mm256_set1_ps(sc[g]);
        SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
            const float *xg = x + (int64_t)b * K + g * 32;
            __m256 t = _mm256_mul_ps(wf[0], _mm256_loadu_ps(xg));
            for (int j = 1; j < 4; j++) t = _mm256_fmadd_ps(wf[j], _mm256_loadu_ps(xg + 8 * j), t);
            acc[b] = _mm256_fmadd_ps(d, t, acc[b]);
        }
    }
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) out[b] = hsum256(acc[b]);
#elif defined(SS_NEON)
    float32x4_t acc[MAX_ROWS];
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) acc[b] = vdupq_n_f32(0.f);
    for (int g = 0; g < G; g++) {
        float32x4_t wf[8];
        for (int j = 0; j < 2; j++) {
            const int8x16_t q = vld1q_s8(w + g * 32 + 16 * j);
            const int16x8_t a = vmovl_s8(vget_low_s8(q)), c = vmovl_s8(vget_high_s8(q));
            wf[4 * j + 0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(a)));
            wf[4 * j + 1] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(a)));
            wf[4 * j + 2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(c)));
            wf[4 * j + 3] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(c)));
        }
        SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
            const float *xg = x + (int64_t)b * K + g * 32;
            float32x4_t t = vmulq_f32(wf[0], vld1q_f32(xg));
            for (int j = 1; j < 8; j++) t = vfmaq_f32(t, wf[j], vld1q_f32(xg + 4 * j));
            acc[b] = vfmaq_n_f32(acc[b], t, sc[g]);
        }
    }
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) out[b] = vaddvq_f32(acc[b]);
#else
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
        const float *xb = x + (int64_t)b * K;
        float acc = 0.f;
        for (int g = 0; g < G; g++) {
            float t = 0.f;
            for (int j = 0; j < 32; j++) t += (float)w[g * 32 + j] * xb[g * 32 + j];
            acc += sc[g] * t;
        }
        out[b] = acc;
    }
#endif
}

// dense fp32 weights (F32 tensors, and F16/BF16 widened at load)
AI void f32_row(const float *w, int K, const float *x, int nb, float *out) {
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) out[b] = ss_dot(w, x + (int64_t)b * K, K);
}

// the activation's per-group sums for the exact 4-bit products' min term
AI void ss_group_sums(const float *x, int K, float *xs) {
    for (int g = 0; g < K / 32; g++) {
        float s = 0.f;
        for (int j = 0; j < 32; j++) s += x[g * 32 + j];
        xs[g] = s;
    }
}

// A switch over the row count so each case is compiled with a constant nb.
#define SS_BY_ROWS(nb, CALL) switch (nb) { \
    case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; \
    case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; default: CALL(8); break; }
