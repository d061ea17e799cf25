// The small per-layer operators of a decode step, so a step is a few native calls per layer
// instead of dozens of torch ops. Each has a torch reference in slipstream/models/llama.py
// (the eager path) that tests compare against.
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// out[r] = w * x[r] / sqrt(mean(x[r]^2) + eps)   (RMSNorm, computed in fp32 like HF's)
void rmsnorm(const float *x, const float *w, int rows, int n, float eps, float *out) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (int64_t)r * n;
        float ss = 0.f;
        for (int i = 0; i < n; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / n + eps);
        float *o = out + (int64_t)r * n;
        for (int i = 0; i < n; i++) o[i] = w[i] * (xr[i] * inv);
    }
}

static void rope_head(float *v, const float *cs, const float *sn, int d) {
    const int h = d / 2;
    for (int i = 0; i < h; i++) {
        const float a = v[i], b = v[i + h];
        v[i] = a * cs[i] - b * sn[i];
        v[i + h] = b * cs[i] + a * sn[i];
    }
}

// For each of T new tokens, in its row of qkv = [q (H*D) | k (KVH*D) | v (KVH*D)]:
// optional per-head RMSNorm of q and k (Qwen3), rotary embedding of q (in place) and k, then k and
// v stored at the token's cache slot. cs/sn: [T][D/2] cos and sin of position * inv_freq.
void rope_store(float *qkv, int T, int H, int KVH, int D, const float *cs, const float *sn,
                const float *q_norm, const float *k_norm, float eps, const int64_t *slots,
                float *kcache, float *vcache) {
    const int row = (H + 2 * KVH) * D;
    for (int t = 0; t < T; t++) {
        float *q = qkv + (int64_t)t * row, *k = q + H * D, *v = k + KVH * D;
        const float *c = cs + (int64_t)t * (D / 2), *s = sn + (int64_t)t * (D / 2);
        for (int h = 0; h < H; h++) {
            if (q_norm) rmsnorm(q + h * D, q_norm, 1, D, eps, q + h * D);
            rope_head(q + h * D, c, s, D);
        }
        float *kd = kcache + slots[t] * KVH * D, *vd = vcache + slots[t] * KVH * D;
        for (int h = 0; h < KVH; h++) {
            if (k_norm) rmsnorm(k + h * D, k_norm, 1, D, eps, k + h * D);
            rope_head(k + h * D, c, s, D);
        }
        memcpy(kd, k, sizeof(float) * KVH * D);
        memcpy(vd, v, sizeof(float) * KVH * D);
    }
}

// q . k over one head; vectorised by hand because without -ffast-math the compiler may not reorder
// a float reduction (so it would stay scalar)
static inline float dot(const float *a, const float *b, int d) {
    int i = 0;
    float s = 0.f;
#ifdef __AVX512F__
    if (d >= 16) {
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
        for (i = 16; i + 16 <= d; i += 16)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
        s = _mm512_reduce_add_ps(acc);
    }
#endif
    for (; i < d; i++) s += a[i] * b[i];
    return s;
}

// Decode attention: one query token per sequence against its cached keys.
// q: [S][H*D] (row stride q_stride floats); slots: the cache slots of every sequence's context,
// concatenated; starts[s]..starts[s+1] delimits sequence s. out: [S][H*D].
void attn_decode(const float *q, int q_stride, int S, int H, int KVH, int D, const int64_t *slots,
                 const int64_t *starts, const float *kcache, const float *vcache, float scale,
                 float *out) {
    const int group = H / KVH;
#pragma omp parallel for schedule(dynamic, 1) collapse(2)
    for (int s = 0; s < S; s++) {
        for (int h = 0; h < H; h++) {
            const int64_t n = starts[s + 1] - starts[s];
            const int64_t *sl = slots + starts[s];
            const float *qh = q + (int64_t)s * q_stride + h * D;
            const int kvh = h / group;
            float stack_buf[1024];
            float *p = n <= 1024 ? stack_buf : (float *)malloc(sizeof(float) * n);
            float mx = -INFINITY;
            for (int64_t j = 0; j < n; j++) {
                p[j] = dot(qh, kcache + (sl[j] * KVH + kvh) * D, D) * scale;
                if (p[j] > mx) mx = p[j];
            }
            float sum = 0.f;
            for (int64_t j = 0; j < n; j++) { p[j] = expf(p[j] - mx); sum += p[j]; }
            const float inv = 1.0f / sum;
            float *o = out + (int64_t)s * H * D + h * D;
            for (int i = 0; i < D; i++) o[i] = 0.f;
            for (int64_t j = 0; j < n; j++) {
                const float *vj = vcache + (sl[j] * KVH + kvh) * D;
                const float w = p[j] * inv;
                for (int i = 0; i < D; i++) o[i] += w * vj[i];
            }
            if (p != stack_buf) free(p);
        }
    }
}

// out = silu(gate) * up for gu = [gate (F) | up (F)] per row
void silu_mul(const float *gu, int rows, int F, float *out) {
    for (int r = 0; r < rows; r++) {
        const float *g = gu + (int64_t)r * 2 * F, *u = g + F;
        float *o = out + (int64_t)r * F;
        for (int i = 0; i < F; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
