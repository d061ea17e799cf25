// What step.c and step_qt.c share: the structures Python passes (mirrored by ctypes structures in
// runtime/cpu_team.py) and the helpers of the 8-row products. The step is compiled as more than one unit so that
// its big row kernels build in parallel (build.py); a mutable setting that both units read is defined once
// (rows8_usable here, amx.h's with SS_SHARED), never as a static that each unit would hold a copy of.
#ifndef SS_STEP_H
#define SS_STEP_H

#include "amx.h"
#include "ops.h"
#include "qtypes.h"

// -- what Python passes (mirrored by ctypes structures in runtime/cpu_team.py) ---------------------
enum { KIND_F32 = 0, KIND_Q4 = 4, KIND_Q8 = 8, KIND_QT = 16 };

// A weight matrix. Matrices of different kinds stacked by rows (a fused QKV whose V is stored in
// another type) are a chain: rows past `n` belong to `next`.
typedef struct SSMat {
    const void *q;          // codes (fp32 values for KIND_F32, ggml blocks row by row for KIND_QT)
    const float *scale;     // [N][K/32] (q4, q8); q4 of qtype Q4_K6: the 6-bit scales, uint8 [N][K/32]
    const float *min;       // [N][K/32] (q4); Q4_K6: the 6-bit mins, uint8 [N][K/32]
    const float *bias;      // [N] or NULL
    int32_t kind, n, k, qtype;   // qtype: the ggml type of KIND_QT blocks; q4/q8: how the scales are stored (Q4_*)
    const struct SSMat *next;
    const void *scale_t, *min_t; // q4, q8 on AVX-512 VNNI machines: scale and min as [N/16][K/32][16] (NULL: none)
    int32_t tile_k, pad;         // 1: scale_t/min_t hold a Q4_K matrix's compact form instead (amx.h, tile_scales)
    const uint16_t *kdm;         // Q4_K6: the super-blocks' fp16 d and dmin, [N][K/256][2]
} SSMat;
// q4/q8 scale storage (SSMat.qtype): fp32 planes, fp16 planes (QT_F16), or a Q4_K matrix's 6-bit scales and
// mins with their super-blocks' d and dmin (widened a row at a time to the planes' values: ss_k6_row)
enum { Q4_PLANES = 0, Q4_K6 = 2 };

// A mixture-of-experts FFN (Qwen2-MoE, Qwen3-MoE): p = softmax(router h), the top k kept (renormalised to sum
// 1 when norm_topk), y = sum_k p_k down_e(silu(gate_e h) * up_e h) [+ sigmoid(shared_gate h) shared(h)].
typedef struct SSMoe {
    SSMat router;                         // [E][hidden]
    SSMat shared_gate_up, shared_down;    // [2 Fs][hidden], [hidden][Fs] (n == 0: no shared expert)
    SSMat shared_gate;                    // [1][hidden]
    const SSMat *gate_up, *down;          // [E] each: [2 F][hidden] (gate rows, then up rows), [hidden][F]
    int32_t experts, topk, ffn, shared_ffn, norm_topk, pad;
} SSMoe;

typedef struct {
    SSMat qkv, o, gate_up, down;
    const float *attn_norm, *ffn_norm, *q_norm, *k_norm;
    void *kcache, *vcache;    // [slots][KVH][D] elements of type kv_type (ops.h: SS_KV_F32, SS_KV_F16, SS_KV_I8)
    // Gemma: RMSNorms of the attention and MLP outputs before their residual adds (NULL: none)
    const float *post_attn_norm, *post_ffn_norm;
    int32_t window;           // sliding-window layer: a row sees its last `window` positions (0: all)
    int32_t rope_local;       // this layer rotates with the step's local RoPE tables
    int32_t kv_type;          // SS_KV_F32, SS_KV_F16 (rounded when stored, widened when read) or SS_KV_I8
    int32_t local_slots;      // the cache is addressed through the step's local slots (Gemma's hybrid cache)
    const SSMoe *moe;         // a mixture-of-experts FFN instead of gate_up/down (NULL: dense)
    float *kscale, *vscale;   // SS_KV_I8: [slots][KVH] the K and V rows' scales (else NULL)
} SSLayer;

typedef struct {
    int32_t n_layers, hidden, heads, kv_heads, head_dim, ffn, vocab;
    int32_t act;              // the GLU's gate: ACT_SILU or ACT_GELU_TANH
    float eps, attn_scale;
    const SSLayer *layers;
    SSMat embed, lm_head;
    const float *norm;
    float embed_scale;        // the embedding is multiplied by it (Gemma: sqrt(hidden)); 0: not scaled
    int32_t rotary;           // dims of each head that rotate (the leading ones; Phi-3's partial rotary)
    float attn_softcap, final_softcap;   // Gemma 2: cap * tanh(x / cap) of attention scores, of logits (0: none)
    int32_t pad;
} SSModel;

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

// An activation: fp32 rows and, for the fast path, their int8 codes, per-group scales and sums.
// In the exact path `s` holds plain per-group sums of the fp32 values (the 4-bit min term).
typedef struct {
    float *f;
    int8_t *q;
    float *d, *s;
    int8_t *p;   // [rows][K] the codes paired for the AVX2 q4 product (ss_pair_groups; NULL: none)
    float *e;    // [rows][4 K/32] the scales d, each four times, for the same product (with p)
    int16_t *h;  // [rows][K/16] the codes' sums per 16 (Q6_K's 8-row product), or NULL: made where needed
} SSAct;

typedef struct {
    int32_t rows, pad;
    const int64_t *tokens;       // [rows]
    const int64_t *write_slots;  // [rows]
    const int64_t *read_slots;   // every row's context slots, concatenated
    const int64_t *starts;       // [rows + 1] into read_slots
    const float *cos, *sin;      // [rows][rotary / 2]
    float *x;                    // [rows][hidden] residual stream
    SSAct h;                     // [rows][hidden] normalised
    float *qkv;                  // [rows][(H + 2 KVH) D]
    SSAct attn;                  // [rows][H D]
    SSAct act;                   // [rows][F]
    float *logits;               // [rows][vocab]
    int64_t *next_tokens;        // [n_out] greedy tokens (OP_ARGMAX)
    int32_t n_out, pad2;         // rows whose logits are wanted (final norm, LM head, argmax)
    const int64_t *out_rows;     // [n_out] which rows, in output order
    const float *cos_local, *sin_local;   // [rows][rotary / 2] the sliding layers' RoPE tables (NULL: none)
    float *tmp;                  // [rows][hidden] O and DOWN outputs before their post-norms (Gemma)
    // mixture-of-experts layers (unused by dense models); one set, reused layer after layer
    float *router;               // [rows][E] router logits
    float *sgate;                // [rows] the shared expert's sigmoid gate
    int32_t *moe_idx;            // n_active, active[E] (ascending), off[E + 1] into the pairs, pair_row[rows * k]
    float *pair_w;               // [rows * k] each (expert, row) pair's routing weight, pairs grouped by expert
    SSAct hx;                    // [rows * k][hidden] h's rows in pair order (each expert's rows contiguous)
    SSAct eact;                  // [rows * k][F] the experts' GLU outputs, in pair order
    SSAct sact;                  // [rows][Fs] the shared expert's GLU output
    // a hybrid cache (Gemma 2/3): write_slots and read_slots as the sliding layers' parts hold them
    const int64_t *write_slots_local, *read_slots_local;
} SSStep;

typedef struct {
    int32_t op, layer, t0, t1, wait_ev, wait_count, sig_ev, aux;
} SSTask;

enum {
    OP_EMBED = 0,     // row t0: x = embedding of its token
    OP_NORM = 1,      // rows t0..t1: h = RMSNorm(x) (aux: 0 attn, 1 ffn, 2 final: output rows, h[i] from x[out_rows[i]])
    OP_QKV = 2,       // heads t0..t1 of the fused QKV rows: product, bias, q/k norm, RoPE, KV store
    OP_ATTN = 3,      // row t0, KV head t1: attention of its query heads over the row's context (aux: task j |
                      // tasks << 8: a long context's parts are shared by the tasks; see attention())
    OP_PREP = 4,      // row t0: quantize attn (when the head size is not a multiple of 32)
    OP_O = 5,         // rows t0..t1 of Wo: x += attn Wo^T
    OP_GATE_UP = 6,   // act columns t0..t1: act = silu(h Wg^T) * (h Wu^T), quantized
    OP_DOWN = 7,      // rows t0..t1 of Wdown: x += act Wdown^T
    OP_LM_HEAD = 8,   // vocabulary rows t0..t1: logits = h Wlm^T (output rows)
    OP_ARGMAX = 9,    // output row t0: next token = argmax(logits) (lowest index on ties)
    OP_POST = 10,     // rows t0..t1: x += RMSNorm(tmp) (aux: 0 after attention, 1 after the MLP)
    OP_ROUTE = 11,    // all rows: router logits, softmax, top k (+ renormalisation), shared gate; pairs by expert
    OP_EXPERT_GU = 12,   // columns t0..t1 of the aux-th active expert: eact = silu(h We_g^T) * (h We_u^T) of its rows
    OP_SHARED_GU = 13,   // columns t0..t1 of the shared expert: sact = silu(h Ws_g^T) * (h Ws_u^T)
    OP_MOE_DOWN = 14,    // hidden rows t0..t1: x += sum over active experts of w * (eact We_d^T) [+ gate * sact Ws_d^T]
};

#if defined(SS_AVX2)
#if defined(__F16C__)
#define F16C_BUILD 1
#else
#define F16C_BUILD 0
#endif
// which kinds take the 8-row kernels (ss_set_rows8's mask; defined in step.c)
extern int rows8_usable __attribute__((visibility("hidden")));
// whether m's products run on the 8-row kernels now: its kind's ss_set_rows8 bit is on
static inline int rows8_on(const SSMat *m) {
    const int bit = m->kind == KIND_Q4 ? 1 : m->kind == KIND_Q8 ? 2 : m->kind != KIND_QT ? 0
                  : m->qtype == QT_R_Q6_K || qt_rb16(m->qtype) ? 4 : m->qtype == QT_R_Q5_K ? 8 : qt_rb_q5(m->qtype) ? 16
                  : qt_rb_iq4(m->qtype) ? 32 : 0;
    return (rows8_usable & bit) != 0;
}

// y[b * ystride + n + r] (=|+=) out[b]'s lane r (+ bias[n + r]) for the block's `live` rows
static inline void rows8_store(const SSMat *m, const __m256 *out, int nb, int n, int live, float *y, int ystride,
                               int accumulate) {
    if (live == 8) {   // a whole block: vector stores (the scalar loop below became a `rep movs` per row, ~5% of q4i_rows)
        const __m256 bias = m->bias ? _mm256_loadu_ps(m->bias + n) : _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            float *yo = y + (int64_t)b * ystride + n;
            const __m256 t = m->bias ? _mm256_add_ps(out[b], bias) : out[b];
            _mm256_storeu_ps(yo, accumulate ? _mm256_add_ps(_mm256_loadu_ps(yo), t) : t);
        }
        return;
    }
    for (int b = 0; b < nb; b++) {
        _Alignas(32) float v[8];
        _mm256_store_ps(v, out[b]);
        float *yo = y + (int64_t)b * ystride + n;
        for (int r = 0; r < live; r++) {
            const float t = m->bias ? v[r] + m->bias[n + r] : v[r];
            yo[r] = accumulate ? yo[r] + t : t;
        }
    }
}

#if defined(SS_TWIN)
// rows8_store for the 16-row kernels' blocks: lanes 0-7 of out[b], then 8-15 for the block's rows past 8
static inline void rows16_store(const SSMat *m, const __m512 *out, int nb, int n, int live, float *y, int ystride,
                                int accumulate) {
    __m256 lo[MAX_ROWS], hi[MAX_ROWS];
    for (int b = 0; b < nb; b++) lo[b] = _mm512_castps512_ps256(out[b]),
                                 hi[b] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(out[b]), 1));   // AVX512F
    rows8_store(m, lo, nb, n, live < 8 ? live : 8, y, ystride, accumulate);
    if (live > 8) rows8_store(m, hi, nb, n + 8, live - 8, y, ystride, accumulate);
}
#endif

// Rows [n0, n1) of a re-blocked matrix on the fast path (step_qt.c); 0 for the types it does not take
int qt_rows(const SSMat *m, int n0, int n1, int nb, const SSAct *x, float *y, int ystride, int accumulate, int pf_rows,
            int64_t row_bytes) __attribute__((visibility("hidden")));
#endif

#endif
