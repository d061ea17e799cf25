// Standalone entry points of the decode step's small operators (ops.h), one call per operator over
// whole rows: the operator tests (tests/kernels/test_cpu_ops.py) check them against their torch
// references, so the step executor (step.c), which runs the same inline functions, is checked too.
#include <stdint.h>

#include "ops.h"

void rmsnorm(const float *x, const float *w, int rows, int n, float eps, float *out) {
    for (int r = 0; r < rows; r++) ss_rmsnorm_row(x + (int64_t)r * n, w, n, eps, out + (int64_t)r * n);
}

// For each of T new tokens, in its row of qkv = [q (H*D) | k (KVH*D) | v (KVH*D)]: optional per-head
// RMSNorm of q and k (Qwen3), rotary embedding of q (in place) and k, then k and v stored at the
// token's cache slot. cs/sn: [T][D/2] cos and sin of position * inv_freq.
void rope_store(float *qkv, int T, int H, int KVH, int D, const float *cs, const float *sn,
                const float *q_norm, const float *k_norm, float eps, const int64_t *slots,
                float *kcache, float *vcache) {
    const int row = (H + 2 * KVH) * D;
    for (int t = 0; t < T; t++) {
        float *q = qkv + (int64_t)t * row, *k = q + H * D, *v = k + KVH * D;
        const float *c = cs + (int64_t)t * (D / 2), *s = sn + (int64_t)t * (D / 2);
        for (int h = 0; h < H; h++) {
            if (q_norm) ss_rmsnorm_row(q + h * D, q_norm, D, eps, q + h * D);
            ss_rope_head(q + h * D, c, s, D);
        }
        for (int h = 0; h < KVH; h++) {
            if (k_norm) ss_rmsnorm_row(k + h * D, k_norm, D, eps, k + h * D);
            ss_rope_head(k + h * D, c, s, D);
        }
        memcpy(kcache + slots[t] * KVH * D, k, sizeof(float) * KVH * D);
        memcpy(vcache + slots[t] * KVH * D, v, sizeof(float) * KVH * D);
    }
}

// Decode attention: one query token per sequence against its cached keys.
// q: [S][H*D] (row stride q_stride floats); slots: the cache slots of every sequence's context,
// concatenated; starts[s]..starts[s+1] delimits sequence s. out: [S][H*D]. The cache's elements are
// fp32, IEEE fp16 (attn_decode_f16) or int8 codes with their rows' scales (attn_decode_i8; ksc, vsc [slots][KVH]).
// cap > 0: scores soft-capped, cap * tanh(s / cap) (Gemma 2).
static void attn_decode_any(const float *q, int q_stride, int S, int H, int KVH, int D, const int64_t *slots,
                            const int64_t *starts, const void *kcache, const void *vcache, int et, const float *ksc,
                            const float *vsc, float scale, float cap, float *out) {
    for (int s = 0; s < S; s++) {
        const int64_t n = starts[s + 1] - starts[s];
        const int group = H / KVH;
        float *p = (float *)malloc(sizeof(float) * (n > 0 ? n * group : 1));
        for (int kvh = 0; kvh < KVH; kvh++)
            ss_attend_heads(q + (int64_t)s * q_stride + kvh * group * D, group, kcache, vcache, et, ksc, vsc, KVH, kvh, D,
                            slots + starts[s], n, scale, cap, p, out + (int64_t)s * H * D + kvh * group * D, NULL);
        free(p);
    }
}

void attn_decode(const float *q, int q_stride, int S, int H, int KVH, int D, const int64_t *slots,
                 const int64_t *starts, const float *kcache, const float *vcache, float scale, float cap,
                 float *out) {
    attn_decode_any(q, q_stride, S, H, KVH, D, slots, starts, kcache, vcache, SS_KV_F32, NULL, NULL, scale, cap, out);
}

void attn_decode_f16(const float *q, int q_stride, int S, int H, int KVH, int D, const int64_t *slots,
                     const int64_t *starts, const uint16_t *kcache, const uint16_t *vcache, float scale, float cap,
                     float *out) {
    attn_decode_any(q, q_stride, S, H, KVH, D, slots, starts, kcache, vcache, SS_KV_F16, NULL, NULL, scale, cap, out);
}

void attn_decode_i8(const float *q, int q_stride, int S, int H, int KVH, int D, const int64_t *slots,
                    const int64_t *starts, const int8_t *kcache, const int8_t *vcache, const float *ksc,
                    const float *vsc, float scale, float cap, float *out) {
    attn_decode_any(q, q_stride, S, H, KVH, D, slots, starts, kcache, vcache, SS_KV_I8, ksc, vsc, scale, cap, out);
}

// rows [rows][D] of floats -> int8 codes and one scale per row (what the step stores into an int8 KV cache)
void f32_to_i8_rows(const float *x, int64_t rows, int D, int8_t *codes, float *scales) {
    for (int64_t r = 0; r < rows; r++) ss_store_i8_row(x + r * D, codes + r * D, D, scales + r);
}

// n floats -> IEEE fp16 (what the step stores into an fp16 KV cache)
void f32_to_f16(const float *x, int64_t n, uint16_t *out) {
    for (int64_t i = 0; i < n; i += 1 << 20) ss_store_half_row(x + i, out + i, n - i < (1 << 20) ? (int)(n - i) : 1 << 20);
}

// out = silu(gate) * up for gu = [gate (F) | up (F)] per row
void silu_mul(const float *gu, int rows, int F, float *out) {
    for (int r = 0; r < rows; r++)
        ss_silu_mul(gu + (int64_t)r * 2 * F, gu + (int64_t)r * 2 * F + F, F, out + (int64_t)r * F);
}

// out = gelu_tanh(gate) * up for gu = [gate (F) | up (F)] per row (Gemma's GLU)
void gelu_tanh_mul(const float *gu, int rows, int F, float *out) {
    for (int r = 0; r < rows; r++)
        ss_gelu_tanh_mul(gu + (int64_t)r * 2 * F, gu + (int64_t)r * 2 * F + F, F, out + (int64_t)r * F);
}
