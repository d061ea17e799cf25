// The small operators of a decode step (RMSNorm, RoPE, decode attention, SiLU * up), shared by the
// step executor (step.c) and their standalone entry points (decode_ops.c, which the operator tests
// call against the torch references in reference.py).
#pragma once
#include <stdlib.h>

#include "simd.h"

// out = w * x / sqrt(mean(x^2) + eps)   (RMSNorm in fp32, as HF computes it); out may alias x
static inline void ss_rmsnorm_row(const float *x, const float *w, int n, float eps, float *out) {
    const float inv = 1.0f / sqrtf(ss_sumsq(x, n) / n + eps);
    for (int i = 0; i < n; i++) out[i] = w[i] * (x[i] * inv);
}

// rotary embedding of a head's first d dims in place, with halves (HF's rotate_half); cs/sn: [d/2]
// (d < the head size: partial rotary, the other dims pass through)
static inline void ss_rope_head(float *v, const float *cs, const float *sn, int d) {
    const int h = d / 2;
    for (int i = 0; i < h; i++) {
        const float a = v[i], b = v[i + h];
        v[i] = a * cs[i] - b * sn[i];
        v[i + h] = b * cs[i] + a * sn[i];
    }
}

// -- fp16 KV rows ----------------------------------------------------------------------------------
// The KV cache holds fp32, IEEE fp16 (SSLayer.kv_type = SS_KV_F16) or int8 rows (below). fp16: K and V rounded
// (nearest, ties to even, as torch's .to(float16)) when stored and widened to fp32 in registers when read.
#if defined(SS_AVX2) && defined(__F16C__)
#define SS_F16C 1
#endif

// one float -> IEEE half, round to nearest even (overflow to inf, subnormals kept)
static inline uint16_t ss_f32_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u;
    x &= 0x7fffffffu;
    if (x >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (x > 0x7f800000u ? 0x200u : 0u));   // inf, nan
    if (x >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);   // rounds past 65504: inf
    if (x < 0x38800000u) {   // below the smallest normal half: a subnormal (or zero)
        if (x < 0x33000000u) return (uint16_t)sign;   // below half the smallest subnormal: zero
        const uint32_t e = x >> 23, m = (x & 0x7fffffu) | 0x800000u, shift = 126 - e;   // value = m * 2^(e - 150)
        uint32_t r = m >> shift;   // units of 2^-24
        const uint32_t rest = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
        if (rest > halfway || (rest == halfway && (r & 1))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = ((x >> 13) - (112u << 10));   // rebias the exponent, keep 10 mantissa bits
    const uint32_t rest = x & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (r & 1))) r++;   // a carry into the exponent is right too
    return (uint16_t)(sign | r);
}

// n floats -> fp16 (a K or V row stored into the cache)
static inline void ss_store_half_row(const float *f, uint16_t *h, int n) {
    int i = 0;
#if defined(SS_F16C)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(f + i), _MM_FROUND_TO_NEAREST_INT));
#elif defined(SS_NEON)
    for (; i + 4 <= n; i += 4) vst1_u16(h + i, vreinterpret_u16_f16(vcvt_f16_f32(vld1q_f32(f + i))));
#endif
    for (; i < n; i++) h[i] = ss_f32_to_half(f[i]);
}

// The cache's element types (SSLayer.kv_type). SS_KV_I8: int8 codes with one fp32 scale per (slot, KV head)
// row, absmax / 127, in a plane of its own ([slots][KVH], K and V each): a row of D codes is D + 4 bytes
// against fp16's 2 D, and attention multiplies by the scale once per score (K) and per weight (V), not per
// element. The codes are round(x / scale) (nearest, ties to even), as kv/blocks.py's int8_rows computes them.
#define SS_KV_F32 0
#define SS_KV_F16 1
#define SS_KV_I8 2
#define SS_KV_ESZ(et) ((et) == SS_KV_F16 ? 2 : (et) == SS_KV_I8 ? 1 : 4)

// a token's row of KV head kvh in a cache of [slots][KVH][D] elements of type et
#define SS_KV_ROW(cache, et, slot, KVH, kvh, D) \
    ((const char *)(cache) + ((int64_t)(slot) * (KVH) + (kvh)) * (int64_t)(D) * SS_KV_ESZ(et))

// n floats -> int8 codes and their scale (absmax / 127; 0 and zero codes for a row of zeros)
static inline void ss_store_i8_row(const float *f, int8_t *q, int n, float *scale) {
    float amax = 0.f;
    for (int i = 0; i < n; i++) amax = fmaxf(amax, fabsf(f[i]));
    const float s = amax / 127.0f;
    *scale = s;
    for (int i = 0; i < n; i++) {
        const float c = s > 0.f ? nearbyintf(f[i] / s) : 0.f;
        q[i] = (int8_t)(c > 127.f ? 127.f : c < -127.f ? -127.f : c);
    }
}

// n int8 codes -> floats (the scale applied by the caller)
static inline void ss_i8_row(const int8_t *q, float *f, int n) {
    for (int i = 0; i < n; i++) f[i] = (float)q[i];
}

// K or V of one token stored at its slot (type et; scales: the int8 cache's plane, else unused)
static inline void ss_kv_store(void *cache, float *scales, int et, int64_t slot, int KVH, int kvh, int D,
                               const float *v) {
    char *dst = (char *)SS_KV_ROW(cache, et, slot, KVH, kvh, D);
    if (et == SS_KV_I8) ss_store_i8_row(v, (int8_t *)dst, D, scales + slot * KVH + kvh);
    else if (et == SS_KV_F16) ss_store_half_row(v, (uint16_t *)dst, D);
    else memcpy(dst, v, sizeof(float) * D);
}

// One query head against its n cached keys (cache rows [slot][KVH][D], kv head kvh, elements of type et;
// ksc, vsc: the int8 cache's scale planes, else unused):
// out[D] = softmax(s) . v with s = q . k * scale, or cap * tanh(s / cap) when cap > 0 (Gemma 2's
// soft-capping); p: scratch of n floats. ml (if not NULL): the scores' max and the sum of exp(s - max),
// what it takes to merge this result with another part of the same context's (ss_attend_merge).
// An int8 row's score is (q . codes) x its K scale x scale; its value weight p x inv x its V scale.
static inline void ss_attend(const float *q, const void *kcache, const void *vcache, int et, const float *ksc,
                             const float *vsc, int KVH, int kvh, int D, const int64_t *slots, int64_t n, float scale,
                             float cap, float *p, float *out, float *ml) {
    float row[et ? D : 1];
#define SS_ROW(cache, j) (et == SS_KV_F16 ? (ss_f16_row((const uint16_t *)SS_KV_ROW(cache, et, slots[j], KVH, kvh, D), row, D), \
                                           (const float *)row)                                                              \
                          : et == SS_KV_I8 ? (ss_i8_row((const int8_t *)SS_KV_ROW(cache, et, slots[j], KVH, kvh, D), row, D), \
                                           (const float *)row)                                                              \
                                         : (const float *)SS_KV_ROW(cache, 0, slots[j], KVH, kvh, D))
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        p[j] = et == SS_KV_I8 ? ss_dot(q, SS_ROW(kcache, j), D) * ksc[slots[j] * KVH + kvh] * scale
                              : ss_dot(q, SS_ROW(kcache, j), D) * scale;
        if (cap > 0.f) p[j] = cap * tanhf(p[j] / cap);
        if (p[j] > mx) mx = p[j];
    }
    const float sum = ss_exp_shift(p, n, mx);
    const float inv = 1.0f / sum;
    if (ml) ml[0] = mx, ml[1] = sum;
    memset(out, 0, sizeof(float) * D);
    for (int64_t j = 0; j < n; j++)
        ss_axpy(out, et == SS_KV_I8 ? p[j] * inv * vsc[slots[j] * KVH + kvh] : p[j] * inv, SS_ROW(vcache, j), D);
#undef SS_ROW
}

// cache rows ahead that attention asks for (ss_set_attn_prefetch)
static int ss_attn_pf __attribute__((unused)) = 32;
#define SS_PREFETCH ss_attn_pf

#if defined(SS_AVX2)
// four 8-lane partial sums -> their four totals
AI __m128 ss_hsum4_ps(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// eight cache elements as floats (fp16 widened in the register: F16C's vcvtph2ps)
AI __m256 ss_kv_load8(const char *row, int d, int et) {
    if (et == SS_KV_I8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + d))));
#if defined(SS_F16C)
    if (et == SS_KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + d)));
#endif
    return _mm256_loadu_ps((const float *)row + d);
}


// scores of HB query heads (q, D apart; HB <= 3) against four keys, D % 8 == 0: 4 HB accumulators, each key
// vector loaded (and widened) once for all the heads
AI void ss_scores_hx4(const float *q, const int HB, const char *const k[4], int D, const int et, __m128 *s) {
    __m256 a[3][4];
    for (int h = 0; h < HB; h++)
        for (int j = 0; j < 4; j++) a[h][j] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
        for (int j = 0; j < 4; j++) {
            const __m256 kv = ss_kv_load8(k[j], d, et);
            for (int h = 0; h < HB; h++) a[h][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + d), kv, a[h][j]);
        }
    }
    for (int h = 0; h < HB; h++) s[h] = ss_hsum4_ps(a[h][0], a[h][1], a[h][2], a[h][3]);
}

// out[h][d0 .. d0 + 8 W) = sum_i p[h][i] v_i[...] for HB heads (HB <= 3, W <= 4: 12 accumulators): each value
// vector loaded (and widened) once for all the heads; p rows n apart, outputs D apart, scaled by inv[h]
AI void ss_values_hx(const float *p, int64_t n, const int HB, const void *vcache, const int et, int KVH, int kvh,
                     int D, const int64_t *slots, int d0, const int W, const float *inv, float *out) {
    __m256 acc[3][4];
    for (int h = 0; h < HB; h++)
        for (int t = 0; t < W; t++) acc[h][t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i++) {
        const char *v = SS_KV_ROW(vcache, et, slots[i], KVH, kvh, D);
        if (i + SS_PREFETCH < n) {   // the row SS_PREFETCH ahead: the cache's rows are scattered over slots
            const char *ahead = SS_KV_ROW(vcache, et, slots[i + SS_PREFETCH], KVH, kvh, D) + d0 * SS_KV_ESZ(et);
            for (int o = 0; o < 8 * W * SS_KV_ESZ(et); o += 64) _mm_prefetch(ahead + o, _MM_HINT_T0);
        }
        __m256 vv[4];
        for (int t = 0; t < W; t++) vv[t] = ss_kv_load8(v, d0 + 8 * t, et);
        for (int h = 0; h < HB; h++) {
            const __m256 pi = _mm256_broadcast_ss(p + h * n + i);
            for (int t = 0; t < W; t++) acc[h][t] = _mm256_fmadd_ps(pi, vv[t], acc[h][t]);
        }
    }
    for (int h = 0; h < HB; h++) {
        const __m256 s = _mm256_set1_ps(inv[h]);
        for (int t = 0; t < W; t++) _mm256_storeu_ps(out + h * D + d0 + 8 * t, _mm256_mul_ps(acc[h][t], s));
    }
}

// ss_attend_heads' vector body, specialised for the cache's element type (et a constant)
AI void ss_attend_heads_avx2(const float *q, int nh, const void *kcache, const void *vcache, const int et,
                               const float *ksc, const float *vsc,
                             int KVH, int kvh, int D, const int64_t *slots, int64_t n, float scale, float cap,
                             float *p, float *out, float *ml) {
    const __m128 sc = _mm_set1_ps(scale);
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const char *k[4];
        for (int t = 0; t < 4; t++) k[t] = SS_KV_ROW(kcache, et, slots[j + t], KVH, kvh, D);
        const __m128 ks = et == SS_KV_I8 ? _mm_setr_ps(ksc[slots[j] * KVH + kvh], ksc[slots[j + 1] * KVH + kvh],
                                                       ksc[slots[j + 2] * KVH + kvh], ksc[slots[j + 3] * KVH + kvh])
                                         : _mm_setzero_ps();
        for (int t = 0; t < 4 && j + SS_PREFETCH + t < n; t++) {   // the keys SS_PREFETCH rows ahead
            const char *ahead = SS_KV_ROW(kcache, et, slots[j + SS_PREFETCH + t], KVH, kvh, D);
            for (int o = 0; o < D * SS_KV_ESZ(et); o += 64) _mm_prefetch(ahead + o, _MM_HINT_T0);
        }
        for (int h = 0; h < nh; h += 3) {   // the heads three at a time (a group of 4: 3 + 1)
            __m128 sv[3];
            const int hb = nh - h < 3 ? nh - h : 3;
            if (hb == 3) ss_scores_hx4(q + h * D, 3, k, D, et, sv);
            else if (hb == 2) ss_scores_hx4(q + h * D, 2, k, D, et, sv);
            else ss_scores_hx4(q + h * D, 1, k, D, et, sv);
            for (int t = 0; t < hb; t++) _mm_storeu_ps(p + (h + t) * n + j, _mm_mul_ps(et == SS_KV_I8 ? _mm_mul_ps(sv[t], ks) : sv[t], sc));
        }
    }
    for (; j < n; j++) {
        const char *k = SS_KV_ROW(kcache, et, slots[j], KVH, kvh, D);
        for (int h = 0; h < nh; h++) {
            __m256 acc = _mm256_setzero_ps();
            for (int d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + d), ss_kv_load8(k, d, et), acc);
            p[h * n + j] = et == SS_KV_I8 ? hsum256(acc) * ksc[slots[j] * KVH + kvh] * scale : hsum256(acc) * scale;
        }
    }
    float inv[nh];   // 1 / each head's softmax sum
    for (int h = 0; h < nh; h++) {
        float *ph = p + h * n;
        if (cap > 0.f)
            for (int64_t i = 0; i < n; i++) ph[i] = cap * tanhf(ph[i] / cap);
        const float mx = ss_max(ph, n);
        const float sum = ss_exp_shift(ph, n, mx);
        inv[h] = 1.0f / sum;
        if (ml) ml[2 * h] = mx, ml[2 * h + 1] = sum;
        if (et == SS_KV_I8)   // the value weights take the V rows' scales: the codes then sum as they are
            for (int64_t i = 0; i < n; i++) ph[i] *= vsc[slots[i] * KVH + kvh];
    }
    for (int h = 0; h < nh; h += 3) {   // the values: 32 output dims of up to three heads per pass over them
        const int hb = nh - h < 3 ? nh - h : 3;
        for (int d0 = 0; d0 < D; d0 += 32) {
            const int w = D - d0 < 32 ? (D - d0) / 8 : 4;
#define SS_VAL(HB, W) ss_values_hx(p + h * n, n, HB, vcache, et, KVH, kvh, D, slots, d0, W, inv + h, out + h * D)
#define SS_VAL_W(HB) do { if (w == 4) SS_VAL(HB, 4); else if (w == 3) SS_VAL(HB, 3); \
                          else if (w == 2) SS_VAL(HB, 2); else SS_VAL(HB, 1); } while (0)
            if (hb == 3) SS_VAL_W(3);
            else if (hb == 2) SS_VAL_W(2);
            else SS_VAL_W(1);
#undef SS_VAL_W
#undef SS_VAL
        }
    }
}
#endif

#if defined(SS_AVX512) && defined(SS_F16C)
// The same on 512-bit vectors, D % 16 == 0: half the multiply-adds of the 256-bit body, and the values'
// 64 output dims of up to four heads in one pass over them (the 256-bit body passes over the values once per
// 32 dims). Scores: eight keys against up to three heads in 24 accumulators, reduced eight at a time.
AI __m512 ss_kv_load16(const char *row, int d, const int et) {
    if (et == SS_KV_I8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + d))));
    if (et == SS_KV_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + d)));
    return _mm512_loadu_ps((const float *)row + d);
}

// eight 16-lane partial sums -> their eight totals (lane j: a[j]'s)
AI __m256 ss_hsum8x16(const __m512 a[8]) {
    __m512 s[4];
    for (int i = 0; i < 4; i++)   // quarters 0-1: a[2i] folded in half, 2-3: a[2i + 1]
        s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // quarter k: a[k]'s four partials (u0), a[4 + k]'s (u1)
    const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(s[0], s[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(s[0], s[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(s[2], s[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(s[2], s[3], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 w = _mm512_add_ps(_mm512_unpacklo_ps(u0, u1), _mm512_unpackhi_ps(u0, u1));
    const __m512 z = _mm512_add_ps(w, _mm512_permute_ps(w, _MM_SHUFFLE(1, 0, 3, 2)));   // quarter k: a[k], a[4 + k]
    const __m512i pick = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castps512_ps256(_mm512_permutexvar_ps(pick, z));
}

// scores of HB query heads (q, D apart; HB <= 3) against eight keys
AI void ss_scores_hx8(const float *q, const int HB, const char *const k[8], int D, const int et, __m256 *s) {
    __m512 a[3][8];
    for (int h = 0; h < HB; h++)
        for (int j = 0; j < 8; j++) a[h][j] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16)
        for (int j = 0; j < 8; j++) {
            const __m512 kv = ss_kv_load16(k[j], d, et);
            for (int h = 0; h < HB; h++) a[h][j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * D + d), kv, a[h][j]);
        }
    for (int h = 0; h < HB; h++) s[h] = ss_hsum8x16(a[h]);
}

// out[h][d0 .. d0 + 16 W) = inv[h] sum_i p[h][i] v_i[...] for HB heads (HB <= 4, W <= 4: 16 accumulators)
AI void ss_values_hx16(const float *p, int64_t n, const int HB, const void *vcache, const int et, int KVH, int kvh,
                       int D, const int64_t *slots, int d0, const int W, const float *inv, float *out) {
    __m512 acc[4][4];
    for (int h = 0; h < HB; h++)
        for (int t = 0; t < W; t++) acc[h][t] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i++) {
        const char *v = SS_KV_ROW(vcache, et, slots[i], KVH, kvh, D);
        if (i + SS_PREFETCH < n) {
            const char *ahead = SS_KV_ROW(vcache, et, slots[i + SS_PREFETCH], KVH, kvh, D) + d0 * SS_KV_ESZ(et);
            for (int o = 0; o < 16 * W * SS_KV_ESZ(et); o += 64) _mm_prefetch(ahead + o, _MM_HINT_T0);
        }
        __m512 vv[4];
        for (int t = 0; t < W; t++) vv[t] = ss_kv_load16(v, d0 + 16 * t, et);
        for (int h = 0; h < HB; h++) {
            const __m512 pi = _mm512_set1_ps(p[h * n + i]);
            for (int t = 0; t < W; t++) acc[h][t] = _mm512_fmadd_ps(pi, vv[t], acc[h][t]);
        }
    }
    for (int h = 0; h < HB; h++) {
        const __m512 s = _mm512_set1_ps(inv[h]);
        for (int t = 0; t < W; t++) _mm512_storeu_ps(out + h * D + d0 + 16 * t, _mm512_mul_ps(acc[h][t], s));
    }
}

AI void ss_attend_heads_avx512(const float *q, int nh, const void *kcache, const void *vcache, const int et,
                               const float *ksc, const float *vsc,
                               int KVH, int kvh, int D, const int64_t *slots, int64_t n, float scale, float cap,
                               float *p, float *out, float *ml) {
    const __m256 sc = _mm256_set1_ps(scale);
    const int row_bytes = D * SS_KV_ESZ(et);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const char *k[8];
        for (int t = 0; t < 8; t++) k[t] = SS_KV_ROW(kcache, et, slots[j + t], KVH, kvh, D);
        __m256 ks = _mm256_setzero_ps();
        if (et == SS_KV_I8) {
            float kk[8];
            for (int t = 0; t < 8; t++) kk[t] = ksc[slots[j + t] * KVH + kvh];
            ks = _mm256_loadu_ps(kk);
        }
        for (int t = 0; t < 8 && j + SS_PREFETCH + t < n; t++) {   // the keys SS_PREFETCH rows ahead
            const char *ahead = SS_KV_ROW(kcache, et, slots[j + SS_PREFETCH + t], KVH, kvh, D);
            for (int o = 0; o < row_bytes; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T0);
        }
        for (int h = 0; h < nh; h += 3) {
            __m256 sv[3];
            const int hb = nh - h < 3 ? nh - h : 3;
            if (hb == 3) ss_scores_hx8(q + h * D, 3, k, D, et, sv);
            else if (hb == 2) ss_scores_hx8(q + h * D, 2, k, D, et, sv);
            else ss_scores_hx8(q + h * D, 1, k, D, et, sv);
            for (int t = 0; t < hb; t++)
                _mm256_storeu_ps(p + (h + t) * n + j, _mm256_mul_ps(et == SS_KV_I8 ? _mm256_mul_ps(sv[t], ks) : sv[t], sc));
        }
    }
    for (; j < n; j++) {
        const char *k = SS_KV_ROW(kcache, et, slots[j], KVH, kvh, D);
        for (int h = 0; h < nh; h++) {
            __m512 acc = _mm512_setzero_ps();
            for (int d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * D + d), ss_kv_load16(k, d, et), acc);
            p[h * n + j] = et == SS_KV_I8 ? _mm512_reduce_add_ps(acc) * ksc[slots[j] * KVH + kvh] * scale
                                          : _mm512_reduce_add_ps(acc) * scale;
        }
    }
    float inv[nh];
    for (int h = 0; h < nh; h++) {
        float *ph = p + h * n;
        if (cap > 0.f)
            for (int64_t i = 0; i < n; i++) ph[i] = cap * tanhf(ph[i] / cap);
        const float mx = ss_max(ph, n);
        const float sum = ss_exp_shift(ph, n, mx);
        inv[h] = 1.0f / sum;
        if (ml) ml[2 * h] = mx, ml[2 * h + 1] = sum;
        if (et == SS_KV_I8)   // the value weights take the V rows' scales: the codes then sum as they are
            for (int64_t i = 0; i < n; i++) ph[i] *= vsc[slots[i] * KVH + kvh];
    }
    for (int h = 0; h < nh; h += 4) {   // the values: 64 output dims of up to four heads per pass over them
        const int hb = nh - h < 4 ? nh - h : 4;
        for (int d0 = 0; d0 < D; d0 += 64) {
            const int w = D - d0 < 64 ? (D - d0) / 16 : 4;
#define SS_VAL(HB, W) ss_values_hx16(p + h * n, n, HB, vcache, et, KVH, kvh, D, slots, d0, W, inv + h, out + h * D)
#define SS_VAL_W(HB) do { if (w == 4) SS_VAL(HB, 4); else if (w == 3) SS_VAL(HB, 3); \
                          else if (w == 2) SS_VAL(HB, 2); else SS_VAL(HB, 1); } while (0)
            if (hb == 4) SS_VAL_W(4);
            else if (hb == 3) SS_VAL_W(3);
            else if (hb == 2) SS_VAL_W(2);
            else SS_VAL_W(1);
#undef SS_VAL_W
#undef SS_VAL
        }
    }
}
#endif

// The query heads q[0..nh) (D apart) that share KV head kvh, against their n cached keys (rows of
// fp32, fp16 or int8 elements, et; ksc, vsc: the int8 rows' scales): ss_attend for each, with every key and value row read once for all of them while
// in cache. The 256-bit body (AVX2, or head sizes not a multiple of 16): scores of four keys against up to
// three heads in 4 x 3 independent accumulators (no dependent chain of FMAs, one horizontal sum per four keys,
// each key vector loaded and widened once for the three); values: 32 output dims of up to three heads stay in
// registers while the values stream by, each value vector loaded and widened once for them. The 512-bit body
// (AVX-512, head sizes a multiple of 16): eight keys by three heads, and 64 dims of four heads (above).
// p: scratch of nh * n floats; ml (if not NULL): [nh][2] each head's score max and exp-sum (see ss_attend).
static inline void ss_attend_heads(const float *q, int nh, const void *kcache, const void *vcache, int et,
                                   const float *ksc, const float *vsc, int KVH, int kvh, int D, const int64_t *slots,
                                   int64_t n, float scale, float cap, float *p, float *out, float *ml) {
#if defined(SS_AVX512) && defined(SS_F16C)
    if (D % 16 == 0 && n > 0) {
        if (et == SS_KV_F16) ss_attend_heads_avx512(q, nh, kcache, vcache, SS_KV_F16, ksc, vsc, KVH, kvh, D, slots, n, scale, cap, p, out, ml);
        else if (et == SS_KV_I8) ss_attend_heads_avx512(q, nh, kcache, vcache, SS_KV_I8, ksc, vsc, KVH, kvh, D, slots, n, scale, cap, p, out, ml);
        else ss_attend_heads_avx512(q, nh, kcache, vcache, SS_KV_F32, ksc, vsc, KVH, kvh, D, slots, n, scale, cap, p, out, ml);
        return;
    }
#endif
#if defined(SS_AVX2)
    if (D % 8 == 0 && n > 0) {
#if defined(SS_F16C)
        if (et == SS_KV_F16) {
            ss_attend_heads_avx2(q, nh, kcache, vcache, SS_KV_F16, ksc, vsc, KVH, kvh, D, slots, n, scale, cap, p, out, ml);
            return;
        }
#endif
        if (et == SS_KV_I8) {
            ss_attend_heads_avx2(q, nh, kcache, vcache, SS_KV_I8, ksc, vsc, KVH, kvh, D, slots, n, scale, cap, p, out, ml);
            return;
        }
        if (et == SS_KV_F32) {
            ss_attend_heads_avx2(q, nh, kcache, vcache, SS_KV_F32, ksc, vsc, KVH, kvh, D, slots, n, scale, cap, p, out, ml);
            return;
        }
    }
#endif
    for (int h = 0; h < nh; h++)
        ss_attend(q + h * D, kcache, vcache, et, ksc, vsc, KVH, kvh, D, slots, n, scale, cap, p, out + h * D,
                  ml ? ml + 2 * h : NULL);
}

// Attention results of S parts of one context merged (flash-decoding's combine): part s holds nh heads'
// outputs part[s][nh][D], each normalised over its own keys, and ml[s][nh][2] their score max and exp-sum;
// out[nh][D] is what one pass over the whole context gives (up to rounding). Parts in order, s = 0..S-1.
static inline void ss_attend_merge(const float *part, const float *ml, int S, int nh, int D, float *out) {
    for (int h = 0; h < nh; h++) {
        float mx = -INFINITY, total = 0.f, w[S];
        for (int s = 0; s < S; s++) mx = ml[(s * nh + h) * 2] > mx ? ml[(s * nh + h) * 2] : mx;
        for (int s = 0; s < S; s++) {
            w[s] = ml[(s * nh + h) * 2 + 1] * expf(ml[(s * nh + h) * 2] - mx);
            total += w[s];
        }
        float *o = out + h * D;
        memset(o, 0, sizeof(float) * D);
        for (int s = 0; s < S; s++) ss_axpy(o, w[s] / total, part + ((int64_t)s * nh + h) * D, D);
    }
}

// The index of the largest of x[0..n), the lowest on ties; NaNs never win (as `x[i] > x[best]` from
// best = 0). The scalar loop's compare chain took ~75 us over a 49,152-entry vocabulary, serial at the
// end of the step; the vector pass finds the maximum and then its first index (NaNs: the scalar loop).
static inline int ss_argmax(const float *x, int n) {
#if defined(SS_AVX2)
    if (n >= 16) {
        __m256 mx = _mm256_loadu_ps(x), nan = _mm256_cmp_ps(mx, mx, _CMP_UNORD_Q);
        int i = 8;
        for (; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_loadu_ps(x + i);
            mx = _mm256_max_ps(mx, v);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, mx);
        float m = lanes[0];
        for (int j = 1; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
        for (; i < n; i++) {
            if (x[i] != x[i]) nan = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
            m = x[i] > m ? x[i] : m;
        }
        if (!_mm256_movemask_ps(nan)) {
            const __m256 mv = _mm256_set1_ps(m);
            for (int k = 0; k + 8 <= n; k += 8) {
                const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + k), mv, _CMP_EQ_OQ));
                if (hit) return k + __builtin_ctz((unsigned)hit);
            }
            for (int k = n & ~7; k < n; k++)
                if (x[k] == m) return k;
        }
    }
#endif
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

// out[i] = silu(g[i]) * u[i]
static inline void ss_silu_mul(const float *g, const float *u, int n, float *out) {
    int i = 0;
#if defined(SS_AVX2)
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 den = _mm256_add_ps(one, ss_exp256(_mm256_xor_ps(gv, sign)));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
    }
#elif defined(SS_NEON)
    for (; i + 4 <= n; i += 4) {
        const float32x4_t gv = vld1q_f32(g + i);
        const float32x4_t den = vaddq_f32(vdupq_n_f32(1.f), ss_exp128(vnegq_f32(gv)));
        vst1q_f32(out + i, vmulq_f32(vdivq_f32(gv, den), vld1q_f32(u + i)));
    }
#endif
    for (; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

// out[i] = gelu_tanh(g[i]) * u[i]: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) (Gemma's GLU, as torch's
// gelu(approximate="tanh")); tanh(z) = 1 - 2 / (exp(2z) + 1)
static inline void ss_gelu_tanh_mul(const float *g, const float *u, int n, float *out) {
    const float c = 0.7978845608028654f, a = 0.044715f;
    int i = 0;
#if defined(SS_AVX2)
    const __m256 cv = _mm256_set1_ps(c), av = _mm256_set1_ps(a), one = _mm256_set1_ps(1.f),
                 two = _mm256_set1_ps(2.f), half = _mm256_set1_ps(0.5f);
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 z = _mm256_mul_ps(cv, _mm256_fmadd_ps(_mm256_mul_ps(av, x), _mm256_mul_ps(x, x), x));
        const __m256 e = ss_exp256(_mm256_mul_ps(two, z));
        const __m256 th = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one)));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(half, _mm256_mul_ps(x, _mm256_add_ps(one, th))),
                                                _mm256_loadu_ps(u + i)));
    }
#elif defined(SS_NEON)
    for (; i + 4 <= n; i += 4) {
        const float32x4_t x = vld1q_f32(g + i);
        const float32x4_t z = vmulq_n_f32(vfmaq_f32(x, vmulq_n_f32(x, a), vmulq_f32(x, x)), c);
        const float32x4_t e = ss_exp128(vmulq_n_f32(z, 2.f));
        const float32x4_t th = vsubq_f32(vdupq_n_f32(1.f), vdivq_f32(vdupq_n_f32(2.f), vaddq_f32(e, vdupq_n_f32(1.f))));
        vst1q_f32(out + i, vmulq_f32(vmulq_n_f32(vmulq_f32(x, vaddq_f32(vdupq_n_f32(1.f), th)), 0.5f), vld1q_f32(u + i)));
    }
#endif
    for (; i < n; i++) {
        const float x = g[i];
        out[i] = 0.5f * x * (1.f + tanhf(c * (x + a * x * x * x))) * u[i];
    }
}
