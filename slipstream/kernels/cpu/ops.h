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

// One query head against its n cached keys (cache rows [slot][KVH][D], kv head kvh):
// out[D] = softmax(s) . v with s = q . k * scale, or cap * tanh(s / cap) when cap > 0 (Gemma 2's
// soft-capping); p: scratch of n floats
static inline void ss_attend(const float *q, const float *kcache, const float *vcache, int KVH, int kvh, int D,
                             const int64_t *slots, int64_t n, float scale, float cap, float *p, float *out) {
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        p[j] = ss_dot(q, kcache + (slots[j] * KVH + kvh) * D, D) * scale;
        if (cap > 0.f) p[j] = cap * tanhf(p[j] / cap);
        if (p[j] > mx) mx = p[j];
    }
    const float sum = ss_exp_shift(p, n, mx);
    const float inv = 1.0f / sum;
    memset(out, 0, sizeof(float) * D);
    for (int64_t j = 0; j < n; j++) ss_axpy(out, p[j] * inv, vcache + (slots[j] * KVH + kvh) * D, D);
}

#if defined(SS_AVX2)
// four 8-lane partial sums -> their four totals
AI __m128 ss_hsum4_ps(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// scores of two query heads (q0, q1; q1 may equal q0) against four keys, D % 8 == 0
AI void ss_scores_2x4(const float *q0, const float *q1, const float *const k[4], int D, __m128 *s0, __m128 *s1) {
    __m256 a[4], b[4];
    for (int j = 0; j < 4; j++) a[j] = b[j] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
        const __m256 x0 = _mm256_loadu_ps(q0 + d), x1 = _mm256_loadu_ps(q1 + d);
        for (int j = 0; j < 4; j++) {
            const __m256 kv = _mm256_loadu_ps(k[j] + d);
            a[j] = _mm256_fmadd_ps(x0, kv, a[j]);
            b[j] = _mm256_fmadd_ps(x1, kv, b[j]);
        }
    }
    *s0 = ss_hsum4_ps(a[0], a[1], a[2], a[3]);
    *s1 = ss_hsum4_ps(b[0], b[1], b[2], b[3]);
}
#endif

// The query heads q[0..nh) (D apart) that share KV head kvh, against their n cached keys: ss_attend for
// each, with every key and value row read once for all of them while in cache. The scores of four keys
// are kept in four independent accumulators (no dependent chain of FMAs and one horizontal sum per
// four keys), and each head's output stays in registers while the values stream by.
// p: scratch of nh * n floats.
static inline void ss_attend_heads(const float *q, int nh, const float *kcache, const float *vcache, int KVH,
                                   int kvh, int D, const int64_t *slots, int64_t n, float scale, float cap,
                                   float *p, float *out) {
#if defined(SS_AVX2)
    if (D % 8 == 0 && n > 0) {
        const __m128 sc = _mm_set1_ps(scale);
        int64_t j = 0;
        for (; j + 4 <= n; j += 4) {
            const float *k[4];
            for (int t = 0; t < 4; t++) k[t] = kcache + (slots[j + t] * KVH + kvh) * D;
            for (int h = 0; h < nh; h += 2) {
                const int h1 = h + 1 < nh ? h + 1 : h;
                __m128 s0, s1;
                ss_scores_2x4(q + h * D, q + h1 * D, k, D, &s0, &s1);
                _mm_storeu_ps(p + h * n + j, _mm_mul_ps(s0, sc));
                if (h1 != h) _mm_storeu_ps(p + h1 * n + j, _mm_mul_ps(s1, sc));
            }
        }
        for (; j < n; j++)
            for (int h = 0; h < nh; h++)
                p[h * n + j] = ss_dot(q + h * D, kcache + (slots[j] * KVH + kvh) * D, D) * scale;
        for (int h = 0; h < nh; h++) {
            float *ph = p + h * n, mx = -INFINITY;
            for (int64_t i = 0; i < n; i++) {
                if (cap > 0.f) ph[i] = cap * tanhf(ph[i] / cap);
                mx = ph[i] > mx ? ph[i] : mx;
            }
            const __m256 inv = _mm256_set1_ps(1.0f / ss_exp_shift(ph, n, mx));
            float *o = out + h * D;
            for (int d0 = 0; d0 < D; d0 += 64) {   // 64 output dims in eight registers at a time
                const int w = D - d0 < 64 ? (D - d0) / 8 : 8;
                __m256 acc[8];
                for (int t = 0; t < 8; t++) acc[t] = _mm256_setzero_ps();
                for (int64_t i = 0; i < n; i++) {
                    const float *v = vcache + (slots[i] * KVH + kvh) * D + d0;
                    const __m256 pi = _mm256_broadcast_ss(ph + i);
                    if (w == 8) {
                        for (int t = 0; t < 8; t++) acc[t] = _mm256_fmadd_ps(pi, _mm256_loadu_ps(v + 8 * t), acc[t]);
                    } else {
                        for (int t = 0; t < w; t++) acc[t] = _mm256_fmadd_ps(pi, _mm256_loadu_ps(v + 8 * t), acc[t]);
                    }
                }
                for (int t = 0; t < w; t++) _mm256_storeu_ps(o + d0 + 8 * t, _mm256_mul_ps(acc[t], inv));
            }
        }
        return;
    }
#endif
    for (int h = 0; h < nh; h++) ss_attend(q + h * D, kcache, vcache, KVH, kvh, D, slots, n, scale, cap, p, out + h * D);
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
