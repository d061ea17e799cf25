// ggml's block types, read in place from a GGUF file (weights/quant.py, KIND_QT matrices).
//
// Each block is decoded on the fly into what every type shares: int8 codes q[QK] and, per
// sub-block of 16 weights, an fp32 scale and an fp32 offset, so that
//     w[i] = sc[i / 16] * q[i] + mn[i / 16]          (mn = 0 for types without a minimum)
// with the same values GGUF's reference dequantization gives (gguf-py's `quants.py`): every scale
// below is a product of an fp16 value and a small integer, exact in fp32, so sc * q rounds once,
// as the reference's does. One decoder per type; the products over the decoded block are shared:
//   fast:  int8 activations per group of 32 (simd.h's ss_quantize_row) x int8 codes, per-16 scales;
//   exact: fp32 activations.
// F16 and BF16 rows are widened to fp32 and multiplied with fp32 activations on both paths.
// Q5_0, Q5_1, Q5_K, IQ4_NL, IQ4_XS and Q6_K are re-blocked at load into planar rows of the same size (QT_R_*, below),
// which the fast path multiplies in registers as simd.h's q4 kernel does its layout.
#pragma once
#include <alloca.h>

#include "simd.h"

enum {
    QT_F16 = 1, QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q5_0 = 6, QT_Q5_1 = 7, QT_Q8_0 = 8, QT_Q2_K = 10,
    QT_Q3_K = 11, QT_Q4_K = 12, QT_Q5_K = 13, QT_Q6_K = 14, QT_IQ4_NL = 20, QT_IQ4_XS = 23, QT_BF16 = 30,
    // the lattice, ternary and MXFP4 types (iqtypes.h)
    QT_IQ2_XXS = 16, QT_IQ2_XS = 17, QT_IQ3_XXS = 18, QT_IQ1_S = 19, QT_IQ3_S = 21, QT_IQ2_S = 22, QT_IQ1_M = 29,
    QT_TQ1_0 = 34, QT_TQ2_0 = 35, QT_MXFP4 = 39,
    // ours: Q5_0, Q5_1, Q5_K, IQ4_NL, IQ4_XS and Q6_K re-blocked at load (weights/quant.py), 100 + the ggml
    // type; same bytes per row as the ggml blocks, laid out by planes so the products read them as the
    // 4-bit kernels read theirs (see qt_rb_q8_row, qt_rb6_q8_row)
    QT_R_Q5_0 = 106, QT_R_Q5_1 = 107, QT_R_Q5_K = 113, QT_R_Q6_K = 114, QT_R_IQ4_NL = 120, QT_R_IQ4_XS = 123,
    // ours: lattice and ternary types whose every block is a 4-bit code into 16 values with a per-32 scale
    // d (ls - 32), re-encoded at load into IQ4_XS's planes with their own 16 values (4.25 bits a weight;
    // quant_matvec.c's ss_reencode, exact), and MXFP4 into IQ4_NL's (4.5); the IQ4 kernels multiply them
    QT_R_IQ2_XXS = 116, QT_R_IQ3_XXS = 118, QT_R_IQ1_S = 119, QT_R_IQ3_S = 121, QT_R_TQ1_0 = 134, QT_R_TQ2_0 = 135,
    QT_R_MXFP4 = 139,
    // ours: the types whose every weight is one of 16 values times a per-16 integer scale and a per-256 fp16 d
    // (IQ2_XS, IQ2_S, IQ1_M: 2 l + 1; Q3_K: its 8 codes -4..3, sc - 32), re-encoded at load into the per-16 IQ
    // planes (4.56 bits a weight; qt_rb16 below, exact)
    QT_R_IQ2_XS = 117, QT_R_IQ2_S = 122, QT_R_IQ1_M = 129, QT_R_Q3_K = 111,
    // and Q2_K (codes 0..3, sc & 15, minus dmin (sc >> 4)): the same planes plus per-16 minimums (5.12 bits)
    QT_R_Q2_K = 110,
};

#define QT_MAX 256   // the largest block (the K-quants' super-block)

typedef struct {
    int8_t q[QT_MAX];
    float sc[QT_MAX / 16], mn[QT_MAX / 16];
} QTBlock;

// where a decoder writes: codes q[QK], per-16 scales sc[QK/16] and offsets mn[QK/16]
typedef struct {
    int8_t *q;
    float *sc, *mn;
} QTOut;

// weights per block (0: not a block type we read)
static inline int qt_block(int t) {
    switch (t) {
    case QT_F16: case QT_BF16: return 1;
    case QT_Q4_0: case QT_Q4_1: case QT_Q5_0: case QT_Q5_1: case QT_Q8_0: case QT_IQ4_NL: return 32;
    case QT_R_Q5_0: case QT_R_Q5_1: case QT_R_IQ4_NL: return 32;
    case QT_R_Q5_K: case QT_R_Q6_K: case QT_R_IQ4_XS: return 256;
    case QT_R_IQ2_XXS: case QT_R_IQ3_XXS: case QT_R_IQ1_S: case QT_R_IQ3_S: case QT_R_TQ1_0: case QT_R_TQ2_0: return 256;
    case QT_R_MXFP4: return 32;
    case QT_R_IQ2_XS: case QT_R_IQ2_S: case QT_R_IQ1_M: case QT_R_Q3_K: case QT_R_Q2_K: return 256;
    case QT_Q2_K: case QT_Q3_K: case QT_Q4_K: case QT_Q5_K: case QT_Q6_K: case QT_IQ4_XS: return 256;
    case QT_IQ2_XXS: case QT_IQ2_XS: case QT_IQ2_S: case QT_IQ3_XXS: case QT_IQ3_S: case QT_IQ1_S: case QT_IQ1_M:
    case QT_TQ1_0: case QT_TQ2_0: return 256;
    case QT_MXFP4: return 32;
    default: return 0;
    }
}

static inline int qt_bytes(int t) {
    switch (t) {
    case QT_F16: case QT_BF16: return 2;
    case QT_Q4_0: return 18; case QT_Q4_1: return 20; case QT_Q5_0: return 22; case QT_Q5_1: return 24;
    case QT_Q8_0: return 34; case QT_IQ4_NL: return 18;
    case QT_R_Q5_0: return 22; case QT_R_Q5_1: return 24; case QT_R_IQ4_NL: return 18; case QT_R_Q6_K: return 210;
    case QT_R_IQ4_XS: return 136; case QT_R_Q5_K: return 176;
    case QT_R_IQ2_XXS: case QT_R_IQ3_XXS: case QT_R_IQ1_S: case QT_R_IQ3_S: case QT_R_TQ1_0: case QT_R_TQ2_0: return 136;
    case QT_R_MXFP4: return 18;
    case QT_R_IQ2_XS: case QT_R_IQ2_S: case QT_R_IQ1_M: case QT_R_Q3_K: return 146;
    case QT_R_Q2_K: return 164;
    case QT_Q2_K: return 84; case QT_Q3_K: return 110; case QT_Q4_K: return 144; case QT_Q5_K: return 176;
    case QT_Q6_K: return 210; case QT_IQ4_XS: return 136;
    case QT_IQ2_XXS: return 66; case QT_IQ2_XS: return 74; case QT_IQ2_S: return 82; case QT_IQ3_XXS: return 98;
    case QT_IQ3_S: return 110; case QT_IQ1_S: return 50; case QT_IQ1_M: return 56; case QT_TQ1_0: return 54;
    case QT_TQ2_0: return 66; case QT_MXFP4: return 17;
    default: return 0;
    }
}

static inline int qt_has_min(int t) {
    return t == QT_Q4_1 || t == QT_Q5_1 || t == QT_Q2_K || t == QT_Q4_K || t == QT_Q5_K || t == QT_R_Q5_1 || t == QT_R_Q5_K ||
           t == QT_R_Q2_K;
}

// the re-encoded types of IQ4_XS's layout (and MXFP4 of IQ4_NL's)
static inline int qt_rb_xs(int t) {
    return t == QT_R_IQ4_XS || t == QT_R_IQ2_XXS || t == QT_R_IQ3_XXS || t == QT_R_IQ1_S || t == QT_R_IQ3_S ||
           t == QT_R_TQ1_0 || t == QT_R_TQ2_0;
}
// the re-encoded types of the per-16 IQ planes (qt_rb6_q8_row's and qt_rb6_rows8's, as Q6_K's)
static inline int qt_rb16(int t) {
    return t == QT_R_IQ2_XS || t == QT_R_IQ2_S || t == QT_R_IQ1_M || t == QT_R_Q3_K || t == QT_R_Q2_K;
}
// the layout whose kernels multiply t's rows: IQ4_XS's or IQ4_NL's for the re-encoded types, else t itself
static inline int qt_rb_layout(int t) { return qt_rb_xs(t) ? QT_R_IQ4_XS : t == QT_R_MXFP4 ? QT_R_IQ4_NL : t; }
// rows the IQ4 kernels multiply (IQ4_NL's or IQ4_XS's layout, the re-encoded types included)
static inline int qt_rb_iq4(int t) { return qt_rb_layout(t) == QT_R_IQ4_NL || qt_rb_layout(t) == QT_R_IQ4_XS; }

static inline int qt_rb(int t) {
    const int l = qt_rb_layout(t);
    return l == QT_R_Q5_0 || l == QT_R_Q5_1 || l == QT_R_Q5_K || l == QT_R_IQ4_NL || l == QT_R_IQ4_XS;
}

// IEEE half -> float, exactly (subnormals included), without relying on F16C
static inline float qt_f16(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);   // one instruction (the portable ss_half_to_f32 costs ~10 cycles a block)
#elif defined(SS_NEON)
    return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0);
#endif
    return ss_half_to_f32(h);
}

static inline float qt_bf16(const uint8_t *p) {
    const uint32_t bits = (uint32_t)(p[0] | (p[1] << 8)) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static const int8_t QT_KVALUES[16] __attribute__((aligned(16))) = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// What an IQ4-layout row's codes index: 16 values, and dk, the power of two its fp16 d is multiplied by (the
// re-encoded types keep the file's d: IQ2_XXS's scale is d / 8 (2 l + 1), IQ3_XXS's d / 4 (2 l + 1), IQ1_S's
// d / 8 (2 s + 1), the 8 of IQ1's 8 g +- 1 included). Values ascending, unused entries 0: the signed grid values
// of IQ2 (8, 25, 43), IQ3_XXS (4 .. 52, 62), IQ3_S (odd 1 .. 15); IQ1_S's 8 g +- 1; ternary -1, 0, 1 (and 2,
// which TQ2_0's two bits can hold); MXFP4 as its codes are.
typedef struct {
    int8_t v[16] __attribute__((aligned(16)));
    float dk;
} QTValues;
static const QTValues QT_VALUES_IQ4 = {{-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113}, 1.f};
static const QTValues QT_VALUES_IQ2 = {{-43, -25, -8, 8, 25, 43}, 0.125f};
static const QTValues QT_VALUES_IQ3XXS = {{-62, -52, -44, -36, -28, -20, -12, -4, 4, 12, 20, 28, 36, 44, 52, 62}, 0.25f};
static const QTValues QT_VALUES_IQ3S = {{-15, -13, -11, -9, -7, -5, -3, -1, 1, 3, 5, 7, 9, 11, 13, 15}, 1.f};
static const QTValues QT_VALUES_IQ1 = {{-9, -7, -1, 1, 7, 9}, 0.125f};
static const QTValues QT_VALUES_TERNARY = {{-1, 0, 1, 2}, 1.f};
static const QTValues QT_VALUES_Q3 = {{-4, -3, -2, -1, 0, 1, 2, 3}, 1.f};   // Q3_K's codes
static const QTValues QT_VALUES_Q2 = {{0, 1, 2, 3}, 1.f};                    // Q2_K's
static const QTValues QT_VALUES_MXFP4 = {{0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12}, 1.f};
static inline const QTValues *qt_kv(int t) {
    switch (t) {
    case QT_R_IQ2_XXS: case QT_R_IQ2_XS: case QT_R_IQ2_S: return &QT_VALUES_IQ2;
    case QT_R_IQ3_XXS: return &QT_VALUES_IQ3XXS;
    case QT_R_IQ3_S: return &QT_VALUES_IQ3S;
    case QT_R_IQ1_S: case QT_R_IQ1_M: return &QT_VALUES_IQ1;
    case QT_R_TQ1_0: case QT_R_TQ2_0: return &QT_VALUES_TERNARY;
    case QT_R_MXFP4: return &QT_VALUES_MXFP4;
    case QT_R_Q3_K: return &QT_VALUES_Q3;
    case QT_R_Q2_K: return &QT_VALUES_Q2;
    default: return &QT_VALUES_IQ4;
    }
}

// the 6-bit scales and mins of a Q4_K / Q5_K super-block (12 bytes -> 8 + 8)
static inline void qt_k_scales(const uint8_t *s, int sc[8], int mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
}

// the 16 signed 6-bit scales of a Q3_K super-block
static inline void qt_q3k_scales(const uint8_t *s, int sc[16]) {
    for (int i = 0; i < 16; i++) {
        const int lo = (i < 8 ? s[i] : s[i - 8] >> 4) & 15;
        const int hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        sc[i] = (lo | (hi << 4)) - 32;
    }
}

#if defined(SS_AVX2)
// AVX2 pieces of the decoders: 32 codes per register
AI __m256i qt_nibbles(const uint8_t *p16) {   // 16 bytes -> [low nibbles, high nibbles]
    const __m128i raw = _mm_loadu_si128((const __m128i *)p16), m4 = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
}
AI __m256i qt_bits(uint32_t x) {   // bit i of x -> byte i: 0xFF or 0
    const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x), shuf);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}
AI __m256i qt_field(__m256i v, int shift, int mask) {   // (v >> shift) & mask, per byte
    return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8((char)mask));
}
AI void qt_store(int8_t *q, __m256i v) { _mm256_storeu_si256((__m256i *)q, v); }
#endif

#include "iqtypes.h"

// Decode one block of type t at p (qt_block(t) weights).
AI void qt_unpack(const int t, const uint8_t *p, const QTOut *o) {
    switch (t) {
    case QT_Q4_0: case QT_Q4_1: case QT_IQ4_NL: {
        const float d = qt_f16(p);
        const uint8_t *qs = p + (t == QT_Q4_1 ? 4 : 2);
#if defined(SS_AVX2)
        const __m256i nib = qt_nibbles(qs);
        if (t == QT_IQ4_NL)
            qt_store(o->q, _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)QT_KVALUES)), nib));
        else
            qt_store(o->q, t == QT_Q4_0 ? _mm256_sub_epi8(nib, _mm256_set1_epi8(8)) : nib);
        if (0)
#endif
        for (int j = 0; j < 16; j++) {
            const int lo = qs[j] & 15, hi = qs[j] >> 4;
            if (t == QT_IQ4_NL) o->q[j] = QT_KVALUES[lo], o->q[j + 16] = QT_KVALUES[hi];
            else if (t == QT_Q4_0) o->q[j] = (int8_t)(lo - 8), o->q[j + 16] = (int8_t)(hi - 8);
            else o->q[j] = (int8_t)lo, o->q[j + 16] = (int8_t)hi;
        }
        o->sc[0] = o->sc[1] = d;
        o->mn[0] = o->mn[1] = t == QT_Q4_1 ? qt_f16(p + 2) : 0.f;
        break;
    }
    case QT_Q5_0: case QT_Q5_1: {
        const int off = t == QT_Q5_1 ? 2 : 0;
        const float d = qt_f16(p);
        uint32_t qh;
        memcpy(&qh, p + 2 + off, 4);
        const uint8_t *qs = p + 6 + off;
        const int bias = t == QT_Q5_0 ? 16 : 0;
#if defined(SS_AVX2)
        const __m256i v = _mm256_or_si256(qt_nibbles(qs), _mm256_and_si256(qt_bits(qh), _mm256_set1_epi8(16)));
        qt_store(o->q, _mm256_sub_epi8(v, _mm256_set1_epi8((char)bias)));
        if (0)
#endif
        for (int j = 0; j < 16; j++) {
            o->q[j] = (int8_t)(((qs[j] & 15) | (((qh >> j) & 1) << 4)) - bias);
            o->q[j + 16] = (int8_t)(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - bias);
        }
        o->sc[0] = o->sc[1] = d;
        o->mn[0] = o->mn[1] = t == QT_Q5_1 ? qt_f16(p + 2) : 0.f;
        break;
    }
    case QT_Q8_0: {
        memcpy(o->q, p + 2, 32);
        o->sc[0] = o->sc[1] = qt_f16(p);
        o->mn[0] = o->mn[1] = 0.f;
        break;
    }
    case QT_Q2_K: {   // scales[16] qs[64] d dmin
        const uint8_t *sc = p, *qs = p + 16;
        const float d = qt_f16(p + 80), dmin = qt_f16(p + 82);
        // element 128h + 32j + l: bits 2j..2j+1 of byte 32h + l (loops shaped so they vectorize)
        for (int h = 0; h < 2; h++) {
#if defined(SS_AVX2)
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * h));
            for (int j = 0; j < 4; j++) qt_store(o->q + 128 * h + 32 * j, qt_field(v, 2 * j, 3));
            continue;
#endif
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 32; l++) o->q[128 * h + 32 * j + l] = (int8_t)((qs[32 * h + l] >> (2 * j)) & 3);
        }
        for (int i = 0; i < 16; i++) {
            o->sc[i] = d * (float)(sc[i] & 15);
            o->mn[i] = -(dmin * (float)(sc[i] >> 4));
        }
        break;
    }
    case QT_Q3_K: {   // hmask[32] qs[64] scales[12] d
        const uint8_t *hm = p, *qs = p + 32;
        const float d = qt_f16(p + 108);
        int sc[16];
        qt_q3k_scales(p + 96, sc);
        // element 128h + 32j + l: low bits as Q2_K, high bit = bit 4h + j of hmask[l] (0 means -4)
        for (int h = 0; h < 2; h++) {
#if defined(SS_AVX2)
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * h));
            const __m256i hv = _mm256_loadu_si256((const __m256i *)hm);
            for (int j = 0; j < 4; j++) {
                const __m256i lo = qt_field(v, 2 * j, 3), hb = qt_field(hv, 4 * h + j, 1);
                qt_store(o->q + 128 * h + 32 * j, _mm256_sub_epi8(_mm256_add_epi8(lo, _mm256_slli_epi16(hb, 2)), _mm256_set1_epi8(4)));
            }
            continue;
#endif
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 32; l++) {
                    const int lo = (qs[32 * h + l] >> (2 * j)) & 3, hb = (hm[l] >> (4 * h + j)) & 1;
                    o->q[128 * h + 32 * j + l] = (int8_t)(lo - 4 + 4 * hb);
                }
        }
        for (int i = 0; i < 16; i++) o->sc[i] = d * (float)sc[i], o->mn[i] = 0.f;
        break;
    }
    case QT_Q4_K: case QT_Q5_K: {   // d dmin scales[12] (qh[32]) qs[128]
        const float d = qt_f16(p), dmin = qt_f16(p + 2);
        int sc[8], mn[8];
        qt_k_scales(p + 4, sc, mn);
        const uint8_t *qh = p + 16, *qs = p + (t == QT_Q5_K ? 48 : 16);
        // element 64c + 32half + l: nibble `half` of byte 32c + l (Q5_K: plus bit 2c + half of qh[l])
#if defined(SS_AVX2)
        const __m256i hv = _mm256_loadu_si256((const __m256i *)qh);
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            __m256i lo = _mm256_and_si256(v, _mm256_set1_epi8(15)), hi = qt_field(v, 4, 15);
            if (t == QT_Q5_K) {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(qt_field(hv, 2 * c, 1), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(qt_field(hv, 2 * c + 1, 1), 4));
            }
            qt_store(o->q + 64 * c, lo);
            qt_store(o->q + 64 * c + 32, hi);
        }
        if (0)
#endif
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++) {
                o->q[64 * c + l] = (int8_t)(qs[32 * c + l] & 15);
                o->q[64 * c + 32 + l] = (int8_t)(qs[32 * c + l] >> 4);
            }
#if defined(SS_AVX2)
        if (0)
#endif
        if (t == QT_Q5_K)
            for (int s = 0; s < 8; s++)
                for (int l = 0; l < 32; l++) o->q[32 * s + l] = (int8_t)(o->q[32 * s + l] | (((qh[l] >> s) & 1) << 4));
        for (int i = 0; i < 16; i++) {
            o->sc[i] = d * (float)sc[i >> 1];
            o->mn[i] = -(dmin * (float)mn[i >> 1]);
        }
        break;
    }
    case QT_Q6_K: {   // ql[128] qh[64] scales[16] d
        const uint8_t *ql = p, *qh = p + 128;
        const int8_t *sc = (const int8_t *)(p + 192);
        const float d = qt_f16(p + 208);
        // element 128h + 32j + l: nibble j / 2 of ql[64h + 32(j % 2) + l], bits 2j.. of qh[32h + l]
#if defined(SS_AVX2)
        for (int h = 0; h < 2; h++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
            const __m256i b = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
            const __m256i c = _mm256_loadu_si256((const __m256i *)(qh + 32 * h)), m4 = _mm256_set1_epi8(15);
            const __m256i k32 = _mm256_set1_epi8(32);
            int8_t *q = o->q + 128 * h;
            qt_store(q, _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(a, m4), _mm256_slli_epi16(qt_field(c, 0, 3), 4)), k32));
            qt_store(q + 32, _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(b, m4), _mm256_slli_epi16(qt_field(c, 2, 3), 4)), k32));
            qt_store(q + 64, _mm256_sub_epi8(_mm256_or_si256(qt_field(a, 4, 15), _mm256_slli_epi16(qt_field(c, 4, 3), 4)), k32));
            qt_store(q + 96, _mm256_sub_epi8(_mm256_or_si256(qt_field(b, 4, 15), _mm256_slli_epi16(qt_field(c, 6, 3), 4)), k32));
        }
        if (0)
#endif
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 32; l++) {
                const int a = ql[64 * h + l], b = ql[64 * h + 32 + l], c = qh[32 * h + l];
                int8_t *q = o->q + 128 * h + l;
                q[0] = (int8_t)(((a & 15) | ((c & 3) << 4)) - 32);
                q[32] = (int8_t)(((b & 15) | (((c >> 2) & 3) << 4)) - 32);
                q[64] = (int8_t)(((a >> 4) | (((c >> 4) & 3) << 4)) - 32);
                q[96] = (int8_t)(((b >> 4) | (((c >> 6) & 3) << 4)) - 32);
            }
        for (int i = 0; i < 16; i++) o->sc[i] = d * (float)sc[i], o->mn[i] = 0.f;
        break;
    }
    case QT_IQ4_XS: {   // d scales_h(u16) scales_l[4] qs[128]
        const float d = qt_f16(p);
        const int sh = p[2] | (p[3] << 8);
        const uint8_t *sl = p + 4, *qs = p + 8;
        for (int s = 0; s < 8; s++) {
            const int ls = (((sl[s >> 1] >> (4 * (s & 1))) & 15) | (((sh >> (2 * s)) & 3) << 4)) - 32;
            o->sc[2 * s] = o->sc[2 * s + 1] = d * (float)ls;
            o->mn[2 * s] = o->mn[2 * s + 1] = 0.f;
#if defined(SS_AVX2)
            qt_store(o->q + 32 * s, _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)QT_KVALUES)),
                                                        qt_nibbles(qs + 16 * s)));
            continue;
#endif
            for (int l = 0; l < 16; l++) {
                o->q[32 * s + l] = QT_KVALUES[qs[16 * s + l] & 15];
                o->q[32 * s + 16 + l] = QT_KVALUES[qs[16 * s + l] >> 4];
            }
        }
        break;
    }
    default:
        if (qt_iq_type(t)) qt_unpack_iq(t, p, o->q, o->sc, o->mn);
        else memset(o->q, 0, (size_t)qt_block(t));
    }
}

// -- Q5_0, Q5_1, Q5_K, IQ4_NL and IQ4_XS re-blocked at load (QT_R_*) -----------------------------------
// A row of K = 32 G weights (G even) keeps the ggml blocks' bytes, by planes:
//   codes  16 G bytes: groups in pairs, 32 bytes per pair; byte j holds the low 4 bits of element j of
//          the pair's first group (low nibble) and of its second group (high nibble);
//   high   (Q5 only) 4 G bytes, the codes' fifth bits: groups in fours, 16 bytes per four; bit i of
//          byte j is element j of group i, bit 4 + i element j + 16; the last two groups when G % 4
//          is 2: 4 bytes each, ggml's qh (bit j = element j);
//   d      2 G bytes: the groups' fp16 scales;  m (Q5_1 only) 2 G bytes: their fp16 minimums.
// IQ4_XS (K = 256 S, G = 8 S): the codes plane, then per super-block its 8 header bytes as ggml has
// them (fp16 d, scales_h, scales_l[4]): group g = 8 s + i of super-block s has scale d (ls_i - 32).
// Q5_K (K = 256 S): the codes and high planes as Q5's (the codes plane is ggml's qs, block after
// block), then per super-block 16 bytes: its 6-bit scales sc and minimums mn rearranged, byte i
// (sc_i & 15) | (mn_i & 15) << 4 for i < 8, then a u16 whose bits 2i, 2i + 1 are sc_i >> 4 and one
// for mn_i >> 4 (eight of each decoded by one variable shift), then ggml's fp16 d and dmin: group i's
// weight d sc_i c - dmin mn_i.
// Codes are ggml's: Q5 5-bit unsigned (Q5_0's weight d (c - 16), Q5_1's d c + m), IQ4_NL and IQ4_XS
// a 4-bit index into QT_KVALUES. A group's codes are one 32-byte register: a nibble mask or shift and,
// for Q5, one shift and mask of the four-group high-bit register (no per-group bit spreading).
AI int qt_rb_q5(int t) { return t == QT_R_Q5_0 || t == QT_R_Q5_1 || t == QT_R_Q5_K; }
AI const uint8_t *qt_rb_scales(int t, const uint8_t *w, int G) { return w + (qt_rb_q5(t) ? 20 : 16) * G; }

// the 6-bit scale ls - 32 of sub-block i of an IQ4_XS header h (d, scales_h, scales_l[4])
AI int qt_xs_ls(const uint8_t *h, int i) {
    const int sh = h[2] | (h[3] << 8);
    return (((h[4 + (i >> 1)] >> (4 * (i & 1))) & 15) | (((sh >> (2 * i)) & 3) << 4)) - 32;
}

// Q5_K: the 6-bit scale (which = 0) or minimum (1) of group i of a super-block's rearranged header h
AI int qt_r5k_field(const uint8_t *h, int i, int which) {
    const int hi = h[8 + 2 * which] | (h[9 + 2 * which] << 8);
    return ((h[i] >> (4 * which)) & 15) | (((hi >> (2 * i)) & 3) << 4);
}

// the fp32 scale of group g of a re-blocked row (exact: an fp16 value times a 6-bit integer)
AI float qt_rb_scale(const int t, const uint8_t *w, int G, int g) {
    if (t == QT_R_IQ4_XS) {
        const uint8_t *h = w + 16 * G + 8 * (g / 8);
        return qt_f16(h) * (float)qt_xs_ls(h, g & 7);
    }
    if (t == QT_R_Q5_K) {
        const uint8_t *h = w + 20 * G + 2 * (g & ~7);   // 16 bytes per super-block
        return qt_f16(h + 12) * (float)qt_r5k_field(h, g & 7, 0);
    }
    return qt_f16(qt_rb_scales(t, w, G) + 2 * g);
}

// the fp32 offset of group g (Q5_1: m, Q5_K: -dmin mn, as ggml's d sc c - dmin mn; else 0)
AI float qt_rb_offset(const int t, const uint8_t *w, int G, int g) {
    if (t == QT_R_Q5_1) return qt_f16(qt_rb_scales(t, w, G) + 2 * G + 2 * g);
    if (t == QT_R_Q5_K) {
        const uint8_t *h = w + 20 * G + 2 * (g & ~7);
        return -(qt_f16(h + 14) * (float)qt_r5k_field(h, g & 7, 1));
    }
    return 0.f;
}

#if defined(SS_AVX2)
// four groups' 4-bit codes (64 bytes of the nibble plane) -> one byte per code: c[0] = low nibbles of
// bytes 0-31, c[1] their high nibbles, c[2], c[3] the same for bytes 32-63
AI void qt_rb_nibbles4(const uint8_t *p, __m256i m4, __m256i c[4]) {
    const __m256i v0 = _mm256_loadu_si256((const __m256i *)p), v1 = _mm256_loadu_si256((const __m256i *)(p + 32));
    c[0] = _mm256_and_si256(v0, m4), c[1] = _mm256_and_si256(_mm256_srli_epi16(v0, 4), m4);
    c[2] = _mm256_and_si256(v1, m4), c[3] = _mm256_and_si256(_mm256_srli_epi16(v1, 4), m4);
}
// the fifth bits of four groups' codes (16 bytes of the high plane) -> 16 or 0 per code byte
AI void qt_rb_high4(const uint8_t *p, __m256i h[4]) {
    const __m128i x = _mm_loadu_si128((const __m128i *)p);
    const __m256i v = _mm256_set_m128i(_mm_srli_epi16(x, 4), x), m = _mm256_set1_epi8(16);
    h[0] = _mm256_and_si256(_mm256_slli_epi16(v, 4), m);
    h[1] = _mm256_and_si256(_mm256_slli_epi16(v, 3), m);
    h[2] = _mm256_and_si256(_mm256_slli_epi16(v, 2), m);
    h[3] = _mm256_and_si256(_mm256_slli_epi16(v, 1), m);
}
#endif

// signed int8 codes and per-32 fp32 scales and offsets of a re-blocked row: the same values as
// qt_unpack gives for the ggml blocks it came from (Q5_0's codes c - 16, IQ4_NL's looked up)
AI void qt_rb_unpack_row(const int t0, const uint8_t *w, int K, int8_t *q, float *sc, float *mn) {
    const QTValues *kvt = qt_kv(t0);
    const int t = qt_rb_layout(t0), G = K / 32, G4 = G & ~3;
    const uint8_t *hb = w + 16 * G;
    if (t == QT_R_IQ4_XS || t == QT_R_Q5_K) {   // per super-block: its fp16 scales widened once
        for (int g0 = 0; g0 < G; g0 += 8) {
            const uint8_t *h = t == QT_R_IQ4_XS ? hb + g0 : w + 20 * G + 2 * g0;
            const float d = qt_f16(t == QT_R_IQ4_XS ? h : h + 12) * kvt->dk, dm = t == QT_R_Q5_K ? qt_f16(h + 14) : 0.f;
            for (int i = 0; i < 8; i++) {
                sc[g0 + i] = d * (float)(t == QT_R_IQ4_XS ? qt_xs_ls(h, i) : qt_r5k_field(h, i, 0));
                mn[g0 + i] = t == QT_R_Q5_K ? -(dm * (float)qt_r5k_field(h, i, 1)) : 0.f;
            }
        }
    } else {
        for (int g = 0; g < G; g++) {
            sc[g] = qt_rb_scale(t, w, G, g);
            mn[g] = qt_rb_offset(t, w, G, g);
        }
    }
    int g0 = 0;
#if defined(SS_AVX2)
    // four groups per step, as the fast product reads them
    const __m256i m4 = _mm256_set1_epi8(15), kv = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kvt->v));
    for (; g0 + 4 <= G; g0 += 4) {
        __m256i c[4];
        qt_rb_nibbles4(w + 16 * g0, m4, c);
        __m256i h[4];
        if (qt_rb_q5(t)) qt_rb_high4(hb + 4 * g0, h);
        for (int j = 0; j < 4; j++) {
            if (!qt_rb_q5(t)) c[j] = _mm256_shuffle_epi8(kv, c[j]);
            else if (t == QT_R_Q5_0) c[j] = _mm256_sub_epi8(_mm256_or_si256(c[j], h[j]), _mm256_set1_epi8(16));
            else c[j] = _mm256_or_si256(c[j], h[j]);
            qt_store(q + 32 * (g0 + j), c[j]);
        }
    }
#endif
    for (int g = g0; g < G; g++) {
        const uint8_t *pb = w + 32 * (g / 2);
        const int shift = 4 * (g & 1);
        int8_t *o = q + 32 * (int64_t)g;
#if defined(SS_AVX2)
        const __m256i v = _mm256_loadu_si256((const __m256i *)pb);
        __m256i c = qt_field(v, shift, 15);
        if (!qt_rb_q5(t)) {
            qt_store(o, _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kvt->v)), c));
            continue;
        }
        uint32_t qh;   // the last pair (G % 4 == 2): the groups before it went four at a time above
        memcpy(&qh, hb + 4 * g, 4);
        c = _mm256_or_si256(c, _mm256_slli_epi16(_mm256_and_si256(qt_bits(qh), _mm256_set1_epi8(1)), 4));
        qt_store(o, t == QT_R_Q5_0 ? _mm256_sub_epi8(c, _mm256_set1_epi8(16)) : c);
        continue;
#endif
        for (int j = 0; j < 32; j++) {
            const int c = (pb[j] >> shift) & 15;
            if (!qt_rb_q5(t)) {
                o[j] = kvt->v[c];
                continue;
            }
            const int h = g < G4 ? (hb[16 * (g / 4) + (j & 15)] >> ((g & 3) + 4 * (j >> 4))) & 1
                                 : (hb[4 * g + j / 8] >> (j % 8)) & 1;
            o[j] = (int8_t)((c | (h << 4)) - (t == QT_R_Q5_0 ? 16 : 0));
        }
    }
}

// one row of ggml blocks (t: Q5_0, Q5_1, IQ4_NL, K = 32 G with G even; Q5_K, IQ4_XS, K = 256 S) ->
// the re-blocked row (same bytes)
static inline void qt_rb_pack_row(const int t, const uint8_t *src, int K, uint8_t *dst) {
    const int G = K / 32, G4 = G & ~3, BB = qt_bytes(t), off = t == QT_Q5_1 ? 2 : 0;
    const int q5 = t == QT_Q5_0 || t == QT_Q5_1 || t == QT_Q5_K;
    uint8_t *hb = dst + 16 * G, *dh = dst + (q5 ? 20 : 16) * G;
    memset(dst, 0, (size_t)(K / qt_block(t)) * BB);
    for (int g = 0; g < G; g++) {
        const uint8_t *b = src + (int64_t)g * BB, *qs = b + (q5 ? 6 + off : 2);
        uint32_t qh = 0;
        if (t == QT_IQ4_XS) {   // sub-block g % 8 of super-block g / 8: its header copied once
            b = src + (int64_t)(g / 8) * BB;
            qs = b + 8 + 16 * (g % 8);
            if (g % 8 == 0) memcpy(hb + 8 * (g / 8), b, 8);
        } else if (t == QT_Q5_K) {   // d dmin scales[12] qh[32] qs[128]; group i = g % 8 of the block
            b = src + (int64_t)(g / 8) * BB;
            const int i = g % 8;
            for (int j = 0; j < 32; j++) qh |= (uint32_t)((b[16 + j] >> i) & 1) << j;
            uint8_t *h = dh + 2 * (g & ~7);
            if (i == 0) {
                int sc[8], mn[8];
                qt_k_scales(b + 4, sc, mn);
                memset(h, 0, 16);
                for (int k = 0; k < 8; k++) {
                    h[k] = (uint8_t)((sc[k] & 15) | ((mn[k] & 15) << 4));
                    h[8 + k / 4] |= (uint8_t)((sc[k] >> 4) << (2 * (k % 4)));
                    h[10 + k / 4] |= (uint8_t)((mn[k] >> 4) << (2 * (k % 4)));
                }
                memcpy(h + 12, b, 4);
            }
        } else {
            memcpy(dh + 2 * g, b, 2);
        }
        if (t == QT_Q5_1) memcpy(dh + 2 * G + 2 * g, b + 2, 2);
        if (t == QT_Q5_0 || t == QT_Q5_1) memcpy(&qh, b + 2 + off, 4);
        for (int j = 0; j < 32; j++) {
            const int c = t == QT_Q5_K ? (b[48 + 32 * ((g % 8) / 2) + j] >> (4 * (g & 1))) & 15
                        : j < 16 ? qs[j] & 15 : qs[j - 16] >> 4, h = (qh >> j) & 1;
            dst[32 * (g / 2) + j] |= (uint8_t)(c << (4 * (g & 1)));
            if (!q5) continue;
            if (g < G4) hb[16 * (g / 4) + (j & 15)] |= (uint8_t)(h << ((g & 3) + 4 * (j >> 4)));
            else hb[4 * g + j / 8] |= (uint8_t)(h << (j % 8));
        }
    }
}

#if defined(SS_AVX2)
AI __m128 qt_f16x4(const uint8_t *p) {   // four fp16 values -> fp32
#if defined(__F16C__)
    return _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)p));
#else
    return _mm_setr_ps(qt_f16(p), qt_f16(p + 2), qt_f16(p + 4), qt_f16(p + 6));
#endif
}


// fast product of one re-blocked row (as q4q8_row: four groups per reduction); Q5 codes are
// unsigned (u8 x s8 products), Q5_0's -16 d joins the offset term, as Q5_K's -dmin mn does (its eight
// scales and minimums decoded at each super-block's first group); IQ4_NL's and IQ4_XS's looked-up
// codes are signed (their sign moves to the activation, as q8q8_row does); IQ4_XS's four scales
// d (ls - 32) decoded from the super-block header by variable shifts
AI void qt_rb_q8_row(const int t, const QTValues *kvt, const uint8_t *w, int K, const int8_t *xq, const float *xd,
                     const float *xs, int nb, float *out) {
    const int G = K / 32, q5 = qt_rb_q5(t), mins = q5;
    const uint8_t *hb = w + 16 * G, *dh = qt_rb_scales(t, w, G), *mh = dh + 2 * G;
    // scales widened four at a time; the offset term (Q5_0: -16 d, Q5_1: m) in the same pass
    __m128 acc[MAX_ROWS], accm[MAX_ROWS];
    __m256 acc1[MAX_ROWS];
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) acc[b] = accm[b] = _mm_setzero_ps(), acc1[b] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m256i kv = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kvt->v));
    __m256 xs8 = _mm256_setzero_ps(), xm8 = xs8;   // IQ4_XS, Q5_K: the current super-block's scales (and offsets)
    int g = 0;
    for (; g + 4 <= G; g += 4) {
        __m256i wq[4];
        qt_rb_nibbles4(w + 16 * g, m4, wq);
        __m256i ws[4];
        if (q5) {
            __m256i h[4];
            qt_rb_high4(hb + 4 * g, h);
            for (int j = 0; j < 4; j++) wq[j] = _mm256_or_si256(wq[j], h[j]);
        } else {
            for (int j = 0; j < 4; j++) {
                ws[j] = _mm256_shuffle_epi8(kv, wq[j]);
                wq[j] = _mm256_sign_epi8(ws[j], ws[j]);
            }
        }
        __m128 s4;
        if (t == QT_R_IQ4_XS) {   // a super-block's eight scales at its first group, four used per step
            if (!(g & 7)) {
                const uint8_t *h = hb + g;   // 8 bytes per 8 groups
                uint32_t sl;
                memcpy(&sl, h + 4, 4);
                const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)sl), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                                    _mm256_set1_epi32(15));
                const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(h[2] | (h[3] << 8)), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                                    _mm256_set1_epi32(3));
                const __m256i ls = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
                xs8 = _mm256_mul_ps(_mm256_set1_ps(qt_f16(h) * kvt->dk), _mm256_cvtepi32_ps(ls));
            }
            s4 = g & 4 ? _mm256_extractf128_ps(xs8, 1) : _mm256_castps256_ps128(xs8);
        } else if (t == QT_R_Q5_K) {
            if (!(g & 7)) {
                const uint8_t *h = dh + 2 * g;   // 16 bytes per 8 groups
                uint32_t hh;
                memcpy(&hh, h + 8, 4);
                const __m256i b8 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)h)), m4i = _mm256_set1_epi32(15);
                const __m256i hv = _mm256_srlv_epi32(_mm256_set1_epi32((int)hh), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
                const __m256i m3 = _mm256_set1_epi32(3);
                const __m256i scv = _mm256_or_si256(_mm256_and_si256(b8, m4i), _mm256_slli_epi32(_mm256_and_si256(hv, m3), 4));
                const __m256i mnv = _mm256_or_si256(_mm256_srli_epi32(b8, 4),
                                                    _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hv, 16), m3), 4));
                xs8 = _mm256_mul_ps(_mm256_set1_ps(qt_f16(h + 12)), _mm256_cvtepi32_ps(scv));
                xm8 = _mm256_mul_ps(_mm256_set1_ps(-qt_f16(h + 14)), _mm256_cvtepi32_ps(mnv));
            }
            s4 = g & 4 ? _mm256_extractf128_ps(xs8, 1) : _mm256_castps256_ps128(xs8);
        } else {
            s4 = qt_f16x4(dh + 2 * g);
        }
        const __m128 o4 = t == QT_R_Q5_1 ? qt_f16x4(mh + 2 * g)
                        : t == QT_R_Q5_K ? (g & 4 ? _mm256_extractf128_ps(xm8, 1) : _mm256_castps256_ps128(xm8)) : s4;
        SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
            const int8_t *a = xq + (int64_t)b * K + g * 32;
            __m256i p[4];
            for (int j = 0; j < 4; j++) {
                const __m256i av = _mm256_loadu_si256((const __m256i *)(a + 32 * j));
                p[j] = ss_dot_u8s8(wq[j], q5 ? av : _mm256_sign_epi8(av, ws[j]));
            }
            acc[b] = _mm_fmadd_ps(_mm_mul_ps(s4, _mm_loadu_ps(xd + (int64_t)b * G + g)), _mm_cvtepi32_ps(ss_sum4(p)), acc[b]);
            if (mins) accm[b] = _mm_fmadd_ps(o4, _mm_loadu_ps(xs + (int64_t)b * G + g), accm[b]);
        }
    }
    for (; g < G; g += 2) {   // the last pair (G % 4 == 2)
        const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 16 * g));
        __m256i wq[2] = {_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4)}, ws[2];
        float sc[2], mo[2];
        for (int j = 0; j < 2; j++) {
            sc[j] = qt_rb_scale(t, w, G, g + j);
            mo[j] = t == QT_R_Q5_0 ? sc[j] : qt_rb_offset(t, w, G, g + j);
            if (q5) {
                uint32_t qh;
                memcpy(&qh, hb + 4 * (g + j), 4);
                wq[j] = _mm256_or_si256(wq[j], _mm256_and_si256(qt_bits(qh), _mm256_set1_epi8(16)));
            } else {
                ws[j] = _mm256_shuffle_epi8(kv, wq[j]);
                wq[j] = _mm256_sign_epi8(ws[j], ws[j]);
            }
        }
        SS_UNROLL_ROWS for (int b = 0; b < nb; b++)
            for (int j = 0; j < 2; j++) {
                const int64_t i = (int64_t)b * G + g + j;
                const __m256i av = _mm256_loadu_si256((const __m256i *)(xq + (int64_t)b * K + 32 * (g + j)));
                const __m256i p = ss_dot_u8s8(wq[j], q5 ? av : _mm256_sign_epi8(av, ws[j]));
                acc1[b] = _mm256_fmadd_ps(_mm256_set1_ps(sc[j] * xd[i]), _mm256_cvtepi32_ps(p), acc1[b]);
                if (mins) accm[b] = _mm_add_ss(accm[b], _mm_set_ss(mo[j] * xs[i]));
            }
    }
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
        const float m = hsum128(accm[b]);
        out[b] = hsum128(acc[b]) + hsum256(acc1[b]) + (t == QT_R_Q5_0 ? -16.f * m : m);
    }
}
#endif

// -- Q6_K re-blocked at load (QT_R_Q6_K) ----------------------------------------------------------------
// A row of K = 256 S weights (G = 8 S groups of 32, in the weights' own order) keeps the 210 bytes per
// 256 of ggml's blocks, by planes: the codes' low 4 bits as QT_R_Q5's (16 G bytes, pairs of groups);
// their top 2 bits, groups in fours, 32 bytes per four (bits 2i, 2i + 1 of byte j: element j of group i);
// per super-block the 16 int8 sub-block scales, each group's first sub-block's in bytes 0-7 and its
// second's in bytes 8-15 (so one byte shuffle spreads a group's two scales over its products), then the
// fp16 super-block scales. Codes are 6-bit unsigned: w = d sc (c - 32).
// The per-16 IQ planes (qt_rb16: IQ2_XS, IQ2_S, IQ1_M, Q3_K, Q2_K re-encoded at load, quant_matvec.c's ss_reencode)
// are the same without the top-two-bits plane: the codes plane (4-bit indices into the type's 16 values, qt_kv),
// then the int8 sub-block scales (2 l + 1; Q3_K's sc - 32, Q2_K's sc & 15) at 16 G as Q6_K's are at 24 G, then the
// fp16 d at 18 G:
// w = d dk sc v[c], 146 bytes per 256 weights. Q2_K's (QT_R_Q2_K) then add its int8 sub-block minimums at 18 G + G / 4
// (arranged as the scales) and its fp16 dmin at 20 G + G / 4: w = d sc v[c] - dmin mn, 164 bytes per 256.
AI int qt_rb6_scales_at(int t, int G) { return (qt_rb16(t) ? 16 : 24) * G; }
AI int64_t qt_rb16_mins_at(int G) { return 18 * (int64_t)G + G / 4; }
AI void qt_rb6_unpack(const int t, const uint8_t *w, int K, int blk, const QTOut *o) {
    const int G = K / 32, iq = qt_rb16(t);
    const uint8_t *hi = w + 16 * G, *scb = w + qt_rb6_scales_at(t, G) + 16 * blk;
    const float d = qt_f16(w + qt_rb6_scales_at(t, G) + 2 * G + 2 * blk) * qt_kv(t)->dk;
    for (int i = 0; i < 8; i++) {
        o->sc[2 * i] = d * (float)(int8_t)scb[i];
        o->sc[2 * i + 1] = d * (float)(int8_t)scb[8 + i];
        o->mn[2 * i] = o->mn[2 * i + 1] = 0.f;
    }
    if (t == QT_R_Q2_K) {
        const uint8_t *mb = w + qt_rb16_mins_at(G) + 16 * blk;
        const float dmin = qt_f16(w + qt_rb16_mins_at(G) + 2 * G + 2 * blk);
        for (int i = 0; i < 8; i++) o->mn[2 * i] = -(dmin * (float)(int8_t)mb[i]), o->mn[2 * i + 1] = -(dmin * (float)(int8_t)mb[8 + i]);
    }
#if defined(SS_AVX2)
    if (iq) {
        const __m256i m4 = _mm256_set1_epi8(15), kv = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)qt_kv(t)->v));
        for (int qd = 0; qd < 2; qd++) {
            __m256i c[4];
            qt_rb_nibbles4(w + 128 * blk + 64 * qd, m4, c);
            for (int j = 0; j < 4; j++) qt_store(o->q + 128 * qd + 32 * j, _mm256_shuffle_epi8(kv, c[j]));
        }
        return;
    }
    const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30), k32 = _mm256_set1_epi8(32);
    for (int qd = 0; qd < 2; qd++) {
        const uint8_t *pb = w + 128 * blk + 64 * qd;
        const __m256i v0 = _mm256_loadu_si256((const __m256i *)pb), v1 = _mm256_loadu_si256((const __m256i *)(pb + 32));
        const __m256i h = _mm256_loadu_si256((const __m256i *)(hi + 64 * blk + 32 * qd));
        int8_t *q = o->q + 128 * qd;
        qt_store(q, _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(v0, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m30)), k32));
        qt_store(q + 32, _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v0, 4), m4),
                                                         _mm256_and_si256(_mm256_slli_epi16(h, 2), m30)), k32));
        qt_store(q + 64, _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(v1, m4), _mm256_and_si256(h, m30)), k32));
        qt_store(q + 96, _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v1, 4), m4),
                                                         _mm256_and_si256(_mm256_srli_epi16(h, 2), m30)), k32));
    }
    if (0)
#endif
    for (int gi = 0; gi < 8; gi++) {
        const int g = 8 * blk + gi;
        const uint8_t *pb = w + 32 * (g / 2), *hb = hi + 32 * (g / 4);
        for (int j = 0; j < 32; j++) {
            const int lo = (pb[j] >> (4 * (g & 1))) & 15;
            o->q[32 * gi + j] = iq ? qt_kv(t)->v[lo] : (int8_t)((lo | (((hb[j] >> (2 * (g & 3))) & 3) << 4)) - 32);
        }
    }
}

// block blk of a row of type t (the re-blocked Q6_K's planes, the per-16 IQ planes, or ggml's blocks)
AI void qt_unpack_at(const int t, const uint8_t *w, int K, int blk, const QTOut *o) {
    if (t == QT_R_Q6_K || qt_rb16(t)) qt_rb6_unpack(t, w, K, blk, o);
    else qt_unpack(t, w + (int64_t)blk * qt_bytes(t), o);
}

// one row of Q6_K blocks (K = 256 S) -> the re-blocked row (same bytes)
static inline void qt_rb6_pack_row(const uint8_t *src, int K, uint8_t *dst) {
    const int G = K / 32;
    uint8_t *hi = dst + 16 * G;
    memset(dst, 0, (size_t)210 * (K / 256));
    QTBlock u;
    for (int blk = 0; blk < K / 256; blk++) {
        const uint8_t *b = src + (int64_t)blk * 210;
        qt_unpack(QT_Q6_K, b, &(QTOut){u.q, u.sc, u.mn});
        for (int gi = 0; gi < 8; gi++) {
            const int g = 8 * blk + gi;
            for (int j = 0; j < 32; j++) {
                const int c = u.q[32 * gi + j] + 32;
                dst[32 * (g / 2) + j] |= (uint8_t)((c & 15) << (4 * (g & 1)));
                hi[32 * (g / 4) + j] |= (uint8_t)((c >> 4) << (2 * (g & 3)));
            }
            dst[24 * G + 16 * blk + gi] = b[192 + 2 * gi];
            dst[24 * G + 16 * blk + 8 + gi] = b[192 + 2 * gi + 1];
        }
        memcpy(dst + 26 * G + 2 * blk, b + 208, 2);
    }
}

#if defined(SS_AVX2)
// fast product of one re-blocked Q6_K row: codes - 32 signed (their sign moves to the activation), each
// group's two sub-block scales applied in the integer sums (vpmaddwd), four groups per reduction. The same
// arithmetic for every number of rows, so a row's result does not depend on the rows beside it: from 2 rows
// on this used to accumulate lane-wise and from 3 to take the decoded-block path (batch 1 and batch 2 rows
// then differed, and the K-quant file's batch-8 step was 1.28x slower: docs/BENCHMARKS.md).
// The per-16 IQ planes (t: qt_rb16) the same way, their codes looked up (one byte shuffle) instead of built from
// two planes: every qt_kv table's |v| <= 64 (fixed constants: IQ2's 43 the largest), so a madd's int16 pairs stay exact.
AI void qt_rb6_q8_row(const int t, const QTValues *kvt, const uint8_t *w, int K, const int8_t *xq, const float *xd,
                      int nb, float *out) {
    const int G = K / 32, iq = qt_rb16(t), mins = t == QT_R_Q2_K;
    const uint8_t *hi = w + 16 * G, *scb = w + qt_rb6_scales_at(t, G), *dh = scb + 2 * G;
    const uint8_t *mnb = w + qt_rb16_mins_at(G), *dmh = mnb + 2 * G;   // Q2_K's minimums
    __m128 acc[MAX_ROWS], accm[MAX_ROWS];
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) acc[b] = accm[b] = _mm_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30), k32 = _mm256_set1_epi8(32), ones = _mm256_set1_epi8(1);
    const __m256i kv = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)kvt->v));
    for (int sb = 0; sb < K / 256; sb++) {
        const __m128 dv = _mm_set1_ps(qt_f16(dh + 2 * sb) * kvt->dk);
        const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(scb + 16 * sb)));
        const __m128 ndm = mins ? _mm_set1_ps(-qt_f16(dmh + 2 * sb)) : dv;
        const __m256i m16 = mins ? _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(mnb + 16 * sb))) : s16;
        for (int qd = 0; qd < 2; qd++) {
            const int g = 8 * sb + 4 * qd;
            __m256i ws[4];
            if (iq) {
                qt_rb_nibbles4(w + 16 * g, m4, ws);
                for (int j = 0; j < 4; j++) ws[j] = _mm256_shuffle_epi8(kv, ws[j]);
            } else {
                const __m256i v0 = _mm256_loadu_si256((const __m256i *)(w + 16 * g));
                const __m256i v1 = _mm256_loadu_si256((const __m256i *)(w + 16 * g + 32));
                const __m256i h = _mm256_loadu_si256((const __m256i *)(hi + 8 * g));
                ws[0] = _mm256_or_si256(_mm256_and_si256(v0, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m30));
                ws[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v0, 4), m4), _mm256_and_si256(_mm256_slli_epi16(h, 2), m30));
                ws[2] = _mm256_or_si256(_mm256_and_si256(v1, m4), _mm256_and_si256(h, m30));
                ws[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(h, 2), m30));
                for (int j = 0; j < 4; j++) ws[j] = _mm256_sub_epi8(ws[j], k32);
            }
            __m256i wa[4], sp[4], mp[4];
            for (int j = 0; j < 4; j++) {
                wa[j] = _mm256_sign_epi8(ws[j], ws[j]);
                const int gi = 4 * qd + j;
                const __m256i ctl = _mm256_set1_epi16((short)((2 * gi) | ((2 * gi + 1) << 8)));
                sp[j] = _mm256_shuffle_epi8(s16, ctl);
                if (mins) mp[j] = _mm256_shuffle_epi8(m16, ctl);
            }
            SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
                const int8_t *a = xq + (int64_t)b * K + g * 32;
                __m256i p[4], pm[4];
                for (int j = 0; j < 4; j++) {
                    const __m256i ar = _mm256_loadu_si256((const __m256i *)(a + 32 * j));
                    p[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(wa[j], _mm256_sign_epi8(ar, ws[j])), sp[j]);
                    if (mins) pm[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(ones, ar), mp[j]);   // mn x the per-16 sums
                }
                const __m128 xd4 = _mm_loadu_ps(xd + (int64_t)b * G + g);
                acc[b] = _mm_fmadd_ps(_mm_mul_ps(dv, xd4), _mm_cvtepi32_ps(ss_sum4(p)), acc[b]);
                if (mins) accm[b] = _mm_fmadd_ps(_mm_mul_ps(ndm, xd4), _mm_cvtepi32_ps(ss_sum4(pm)), accm[b]);
            }
        }
    }
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) out[b] = hsum128(acc[b]) + (mins ? hsum128(accm[b]) : 0.f);
}

// Q6_K over 8 weight rows at once, as simd.h's q4i_rows8 does q4: per group the 8 rows' code bytes are
// transposed in registers so that 32-bit lane r holds 4 codes of weight row r, an activation row's matching 4
// codes are broadcast, and the group's exact int32 sums come out with lanes = weight rows (no horizontal sums;
// the one-row qt_rb6_q8_row spends two thirds more vector operations per multiply-add at 8 activation rows).
// The 6-bit codes stay unsigned (0..63, maddubs' unsigned operand: no sign trick), each sub-block of 16 scaled
// in the integer sums (vpmaddwd), and the -32 offset comes off as -32 x the scales x the activation's per-16
// code sums xh. Per (weight row n, activation row m), in group order:
//     acc = fma(float(sum_g), d_n x xd[m][g], acc),  sum_g = sum over the group of sc (c - 32) x  (exact)
// so a row's result is the same alone and in a batch (a row past the range's end may repeat the last one).
// w[r]: weight row r (the re-blocked planes); xh [nb][K / 16]: the activation rows' per-16 code sums (int16).
// pf: 8 x 210 K / 256 bytes (the next block of 8 rows) prefetched into L2, 210 bytes per group.
// int16 partial sums are exact: 4 products of 63 x 127 per lane (32004).
// The per-16 IQ planes (t: qt_rb16) the same way: their looked-up values v + 64 as the unsigned codes (|v| <= 64:
// 21..107 for IQ2's), the 64 taken off as Q6_K's 32 is, and one madd per maddubs (2 products of up to 128 x 127
// per int16 lane; 4 would overflow), or on VNNI builds each sub-block's 16 codes summed by vpdpbusd in int32 and
// multiplied by its scale there (vpmulld; 1.35x the rate on Zen 5): the same integer sums either way. d is the file's times
// the type's power of two dk.
AI void qt_rb6_rows8(const int t, const QTValues *kvt, const uint8_t *const w[8], int K, const int8_t *xq,
                     const float *xd, const int16_t *xh, int nb, const char *pf, __m256 out[MAX_ROWS]) {
    const int G = K / 32, iq = qt_rb16(t), mins = t == QT_R_Q2_K, off_shift = iq ? 6 : 5, row_pf = qt_bytes(t);
    const int64_t scb = qt_rb6_scales_at(t, G);
    __m256 acc[MAX_ROWS];
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) acc[b] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
    const __m256i lut = _mm256_add_epi8(_mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)kvt->v)), _mm256_set1_epi8(64));
    _Alignas(32) int8_t codes[4][8][32];   // four groups' codes, lanes = rows (read from L1 by the products)
    for (int sb = 0; sb < G / 8; sb++) {
        _Alignas(16) uint16_t dh[8];
        for (int r = 0; r < 8; r++) memcpy(&dh[r], w[r] + scb + 2 * (int64_t)G + 2 * sb, 2);
#if defined(__F16C__)
        const __m256 d8 = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)dh));
#else
        const __m256 d8 = _mm256_setr_ps(qt_f16((const uint8_t *)&dh[0]), qt_f16((const uint8_t *)&dh[1]), qt_f16((const uint8_t *)&dh[2]),
                                         qt_f16((const uint8_t *)&dh[3]), qt_f16((const uint8_t *)&dh[4]), qt_f16((const uint8_t *)&dh[5]),
                                         qt_f16((const uint8_t *)&dh[6]), qt_f16((const uint8_t *)&dh[7]));
#endif
        const __m256 d8k = iq ? _mm256_mul_ps(d8, _mm256_set1_ps(kvt->dk)) : d8;
        __m256i T[4];   // the sub-block scales: T[k] bytes i = group 4k + i's first (k < 2) or second (k >= 2) scale
        rows8_t16(w, scb + 16 * sb, T);
        __m256i Tm[4];   // Q2_K: its minimums as T, and -dmin, lanes = rows
        __m256 ndm8 = d8k;
        if (mins) {
            rows8_t16(w, qt_rb16_mins_at(G) + 16 * sb, Tm);
            float nd[8];
            for (int r = 0; r < 8; r++) nd[r] = -qt_f16(w[r] + qt_rb16_mins_at(G) + 2 * (int64_t)G + 2 * sb);
            ndm8 = _mm256_loadu_ps(nd);
        }
        for (int h4 = 0; h4 < 2; h4++) {
            const int g0 = 8 * sb + 4 * h4;
            if (iq) {   // decode four groups: the nibble plane's two pairs, looked up
                __m256i L[8];
                for (int p = 0; p < 2; p++) {
                    rows8_t16(w, 16 * (int64_t)(g0 + 2 * p), L), rows8_t16(w, 16 * (int64_t)(g0 + 2 * p) + 16, L + 4);
                    for (int j = 0; j < 8; j++) {
                        _mm256_store_si256((__m256i *)codes[2 * p][j], _mm256_shuffle_epi8(lut, _mm256_and_si256(L[j], m4)));
                        _mm256_store_si256((__m256i *)codes[2 * p + 1][j],
                                           _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(L[j], 4), m4)));
                    }
                }
            } else {   // decode four groups: the low-nibble plane (two pairs of groups) and the top-two-bits plane
                __m256i L[8], H[8];
                rows8_t16(w, 16 * (int64_t)G + 8 * (int64_t)g0, H), rows8_t16(w, 16 * (int64_t)G + 8 * (int64_t)g0 + 16, H + 4);
                for (int p = 0; p < 2; p++) {
                    rows8_t16(w, 16 * (int64_t)(g0 + 2 * p), L), rows8_t16(w, 16 * (int64_t)(g0 + 2 * p) + 16, L + 4);
                    for (int j = 0; j < 8; j++) {
                        const __m256i lo = _mm256_and_si256(L[j], m4), hi = _mm256_and_si256(_mm256_srli_epi16(L[j], 4), m4);
                        const __m256i h0 = _mm256_and_si256(p ? H[j] : _mm256_slli_epi16(H[j], 4), m30);
                        const __m256i h1 = _mm256_and_si256(p ? _mm256_srli_epi16(H[j], 2) : _mm256_slli_epi16(H[j], 2), m30);
                        _mm256_store_si256((__m256i *)codes[2 * p][j], _mm256_or_si256(lo, h0));
                        _mm256_store_si256((__m256i *)codes[2 * p + 1][j], _mm256_or_si256(hi, h1));
                    }
                }
            }
            for (int i = 0; i < 4; i++) {
                const int g = g0 + i;
                if (pf)
                    for (int o = 0; o < row_pf; o += 64) __builtin_prefetch(pf + row_pf * (int64_t)g + o, 0, 2);
                // the rows' two scales as int16: (sa, sa), (sb, sb) and (sa, sb) per lane
                const __m256i ctl = _mm256_setr_epi8(-128, i, -128, i, -128, 4 + i, -128, 4 + i, -128, 8 + i, -128, 8 + i,
                                                     -128, 12 + i, -128, 12 + i, -128, i, -128, i, -128, 4 + i, -128, 4 + i,
                                                     -128, 8 + i, -128, 8 + i, -128, 12 + i, -128, 12 + i);
                const __m256i ra = _mm256_shuffle_epi8(T[h4], ctl), rb = _mm256_shuffle_epi8(T[2 + h4], ctl);
                const __m256i sa = _mm256_srai_epi16(ra, 8), sbv = _mm256_srai_epi16(rb, 8);
                const __m256i sab = _mm256_srai_epi16(_mm256_blend_epi16(ra, rb, 0xAA), 8);
#ifdef SS_VNNI
                const __m256i sa32 = _mm256_srai_epi32(ra, 24), sb32 = _mm256_srai_epi32(rb, 24);   // as int32 lanes
#endif
                const __m256i mab = mins ? _mm256_srai_epi16(_mm256_blend_epi16(_mm256_shuffle_epi8(Tm[h4], ctl),
                                                                                 _mm256_shuffle_epi8(Tm[2 + h4], ctl), 0xAA), 8)
                                         : sab;
                const __m256i *q = (const __m256i *)codes[i];
                SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
                    __m256i x[8];
                    rows8_bcast(xq + (int64_t)b * K + 32 * (int64_t)g, x);
                    __m256i s;
                    if (iq) {
#ifdef SS_VNNI
                        // each sub-block's codes summed in int32 (vpdpbusd), then times its scale: the same integer
                        const __m256i z = _mm256_setzero_si256();
                        __m256i e0 = z, e1 = z;
                        for (int j = 0; j < 4; j++) e0 = SS_DPBUSD(e0, _mm256_load_si256(q + j), x[j]);
                        for (int j = 4; j < 8; j++) e1 = SS_DPBUSD(e1, _mm256_load_si256(q + j), x[j]);
                        s = _mm256_add_epi32(_mm256_mullo_epi32(e0, sa32), _mm256_mullo_epi32(e1, sb32));
#else
                        __m256i e[8];
                        for (int j = 0; j < 8; j++) e[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_load_si256(q + j), x[j]), j < 4 ? sa : sbv);
                        s = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(e[0], e[1]), _mm256_add_epi32(e[2], e[3])),
                                             _mm256_add_epi32(_mm256_add_epi32(e[4], e[5]), _mm256_add_epi32(e[6], e[7])));
#endif
                    } else {
                    const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_load_si256(q + 0), x[0]), _mm256_maddubs_epi16(_mm256_load_si256(q + 1), x[1]));
                    const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_load_si256(q + 2), x[2]), _mm256_maddubs_epi16(_mm256_load_si256(q + 3), x[3]));
                    const __m256i p2 = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_load_si256(q + 4), x[4]), _mm256_maddubs_epi16(_mm256_load_si256(q + 5), x[5]));
                    const __m256i p3 = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_load_si256(q + 6), x[6]), _mm256_maddubs_epi16(_mm256_load_si256(q + 7), x[7]));
                    s = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(p0, sa), _mm256_madd_epi16(p1, sa)),
                                         _mm256_add_epi32(_mm256_madd_epi16(p2, sbv), _mm256_madd_epi16(p3, sbv)));
                    }
                    int32_t hv;
                    memcpy(&hv, xh + (int64_t)b * (K / 16) + 2 * (int64_t)g, 4);
                    const __m256i off = _mm256_sll_epi32(_mm256_madd_epi16(sab, _mm256_set1_epi32(hv)), _mm_cvtsi32_si128(off_shift));
                    const __m256 f = _mm256_mul_ps(d8k, _mm256_broadcast_ss(xd + (int64_t)b * G + g));
                    acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(s, off)), f, acc[b]);
                    if (mins)   // - dmin x (the minimums x the per-16 code sums), exact in int32
                        acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(mab, _mm256_set1_epi32(hv))),
                                                 _mm256_mul_ps(ndm8, _mm256_broadcast_ss(xd + (int64_t)b * G + g)), acc[b]);
                }
            }
        }
    }
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) out[b] = acc[b];
}

#if defined(SS_AVX512) && defined(SS_VNNI)
// rows8_bcast for the 16-row kernels: x[j] = codes 4j..4j+3 of an activation row's group in every 32-bit lane
AI void rows16_bcast(const int8_t *a, __m512i x[8]) {
    for (int j = 0; j < 8; j++) {
        int32_t v;
        memcpy(&v, a + 4 * j, 4);
        x[j] = _mm512_set1_epi32(v);
    }
}
// qt_rb6_rows8's VNNI arithmetic for the per-16 IQ planes over 16 weight rows at once, lanes = rows of 512-bit
// registers, for CPUs whose 512-bit vpdpbusd runs at the 256-bit one's rate (amx.h's twin_from_rows), as
// qt_rbnl_rows16 is for the IQ4 layouts. The integer sum per (group, row) is the 8-row kernel's (the 64 of the
// unsigned codes taken off each sub-block's sum before its scale instead of after: the same integer), and the fp32
// operations are its own, so the bits are the same. w[16] rows (a row past the range's end may repeat the last);
// pf: the next block of 16 rows, pf_group bytes of it per group.
AI void qt_rb16_rows16(const int t, const QTValues *kvt, const uint8_t *const w[16], int K, const int8_t *xq,
                       const float *xd, const int16_t *xh, int nb, const char *pf, int64_t pf_group, __m512 out[MAX_ROWS]) {
    const int G = K / 32, mins = t == QT_R_Q2_K;
    const int64_t scb = 16 * (int64_t)G;
    __m512 acc[MAX_ROWS];
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) acc[b] = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(15);
    const __m512i lut = _mm512_broadcast_i32x4(_mm_add_epi8(_mm_load_si128((const __m128i *)kvt->v), _mm_set1_epi8(64)));
    for (int sb = 0; sb < G / 8; sb++) {
        uint16_t dh[16];
        for (int r = 0; r < 16; r++) memcpy(&dh[r], w[r] + scb + 2 * (int64_t)G + 2 * sb, 2);
        const __m512 dk = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)dh)), _mm512_set1_ps(kvt->dk));
        __m512i T[4], Tm[4];   // as qt_rb6_rows8's T (and Q2_K's Tm), rows 0-7 and 8-15 joined: T[k] byte 4 r + i = row
                               // r's scale of group 4 (k & 1) + i
        __m512 ndm = dk;
        for (int pl = 0; pl < 1 + mins; pl++) {
            const int64_t at = (pl ? qt_rb16_mins_at(G) : scb) + 16 * sb;
            __m256i lo[4], hi[4];
            rows8_t16(w, at, lo), rows8_t16(w + 8, at, hi);
            for (int k = 0; k < 4; k++) (pl ? Tm : T)[k] = _mm512_inserti64x4(_mm512_castsi256_si512(lo[k]), hi[k], 1);
        }
        if (mins) {
            uint16_t mh[16];
            for (int r = 0; r < 16; r++) memcpy(&mh[r], w[r] + qt_rb16_mins_at(G) + 2 * (int64_t)G + 2 * sb, 2);
            ndm = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)mh)));
        }
        for (int gp = 0; gp < 8; gp += 2) {
            __m512i L[8];   // the pair's code bytes, lanes = rows
            {
                const int64_t at = 16 * (int64_t)(8 * sb + gp);
                __m256i lo[8], hi[8];
                rows8_t16(w, at, lo), rows8_t16(w, at + 16, lo + 4), rows8_t16(w + 8, at, hi), rows8_t16(w + 8, at + 16, hi + 4);
                for (int jj = 0; jj < 8; jj++) L[jj] = _mm512_inserti64x4(_mm512_castsi256_si512(lo[jj]), hi[jj], 1);
            }
            for (int e = 0; e < 2; e++) {
                const int i = gp + e, g = 8 * sb + i;
                if (pf)
                    for (int64_t o = (pf_group * g + 63) & ~(int64_t)63; o < pf_group * (g + 1); o += 64) __builtin_prefetch(pf + o, 0, 2);
                __m512i c[8];
                for (int jj = 0; jj < 8; jj++)
                    c[jj] = _mm512_shuffle_epi8(lut, _mm512_and_si512(e ? _mm512_srli_epi16(L[jj], 4) : L[jj], m4));
                // group i's two sub-block scales, sign-extended to int32 lanes
                const __m512i sa = _mm512_srai_epi32(_mm512_slli_epi32(T[i >> 2], 24 - 8 * (i & 3)), 24);
                const __m512i sbv = _mm512_srai_epi32(_mm512_slli_epi32(T[2 + (i >> 2)], 24 - 8 * (i & 3)), 24);
                // Q2_K: the two minimums as int16 pairs (0..15: no sign to extend), for one madd per row
                const __m512i mab = mins ? _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(Tm[i >> 2], 8 * (i & 3)), _mm512_set1_epi32(255)),
                                                           _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(Tm[2 + (i >> 2)], 8 * (i & 3)),
                                                                                              _mm512_set1_epi32(255)), 16))
                                         : sa;
                SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
                    __m512i x[8];
                    rows16_bcast(xq + (int64_t)b * K + 32 * (int64_t)g, x);
                    const int16_t *h = xh + (int64_t)b * (K / 16) + 2 * (int64_t)g;
                    const __m512i z = _mm512_setzero_si512();
                    const __m512i e0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, c[0], x[0]), c[1], x[1]), c[2], x[2]), c[3], x[3]);
                    const __m512i e1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, c[4], x[4]), c[5], x[5]), c[6], x[6]), c[7], x[7]);
                    const __m512i s = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_sub_epi32(e0, _mm512_set1_epi32(64 * h[0])), sa),
                                                       _mm512_mullo_epi32(_mm512_sub_epi32(e1, _mm512_set1_epi32(64 * h[1])), sbv));
                    acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dk, _mm512_set1_ps(xd[(int64_t)b * G + g])), acc[b]);
                    if (mins) {   // qt_rb6_rows8's minimum term, the same integer
                        int32_t hv;
                        memcpy(&hv, h, 4);
                        const __m512i mm = _mm512_madd_epi16(mab, _mm512_set1_epi32(hv));
                        acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mm), _mm512_mul_ps(ndm, _mm512_set1_ps(xd[(int64_t)b * G + g])), acc[b]);
                    }
                }
            }
        }
    }
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) out[b] = acc[b];
}
#endif

// Q5_0, Q5_1 and Q5_K (re-blocked) over 8 weight rows at once, as q4i_rows8: the 5-bit codes unsigned (0..31),
// transposed in registers to lanes = weight rows, four groups at a time (the nibble plane's two pairs and the
// high plane's four; a last pair of groups when G % 4 == 2 decoded per row and transposed). Per (weight row n,
// activation row m), in group order (q4i_rows8's arithmetic):
//     acc = fma(float(sum) * xd[m][g], s[n][g], acc);  acc = fma(o[n][g], xs[m][g], acc)
// sum the group's exact integer sum of c x; s = d (Q5_0, Q5_1) or d x the 6-bit scale (Q5_K); o = -16 d (Q5_0),
// m (Q5_1) or -(dmin x the 6-bit minimum) (Q5_K), the planes' very values. int16 partial sums are exact: 8
// products of 31 x 127 per lane (31496). pf: 8 row_bytes bytes (the next block of 8 rows), spread over the groups.
AI void qt8_half4(const uint8_t *const w[8], int64_t off, __m256 v[4]) {   // 4 fp16 of 8 rows -> 4 x 8 fp32 lanes = rows
    __m128i d[8];
    for (int r = 0; r < 8; r++) d[r] = _mm_loadl_epi64((const __m128i *)(w[r] + off));
    const __m128i x01 = _mm_unpacklo_epi16(d[0], d[1]), x23 = _mm_unpacklo_epi16(d[2], d[3]);
    const __m128i x45 = _mm_unpacklo_epi16(d[4], d[5]), x67 = _mm_unpacklo_epi16(d[6], d[7]);
    const __m128i y0 = _mm_unpacklo_epi32(x01, x23), y1 = _mm_unpackhi_epi32(x01, x23);   // rows 0-3: groups 0,1 | 2,3
    const __m128i z0 = _mm_unpacklo_epi32(x45, x67), z1 = _mm_unpackhi_epi32(x45, x67);   // rows 4-7
    const __m128i g[4] = {_mm_unpacklo_epi64(y0, z0), _mm_unpackhi_epi64(y0, z0), _mm_unpacklo_epi64(y1, z1),
                          _mm_unpackhi_epi64(y1, z1)};
    for (int i = 0; i < 4; i++) {
#if defined(__F16C__)
        v[i] = _mm256_cvtph_ps(g[i]);
#else
        _Alignas(16) uint16_t h[8];
        _mm_store_si128((__m128i *)h, g[i]);
        v[i] = _mm256_setr_ps(ss_half_to_f32(h[0]), ss_half_to_f32(h[1]), ss_half_to_f32(h[2]), ss_half_to_f32(h[3]),
                              ss_half_to_f32(h[4]), ss_half_to_f32(h[5]), ss_half_to_f32(h[6]), ss_half_to_f32(h[7]));
#endif
    }
}
AI __m256 qt8_f16_lanes(__m256i v) {   // the low 16 bits of each 32-bit lane, as fp16 -> fp32
    const __m256i p = _mm256_packus_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_setzero_si256());
    const __m128i h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(p, 0x08));
#if defined(__F16C__)
    return _mm256_cvtph_ps(h);
#else
    _Alignas(16) uint16_t u[8];
    _mm_store_si128((__m128i *)u, h);
    return _mm256_setr_ps(ss_half_to_f32(u[0]), ss_half_to_f32(u[1]), ss_half_to_f32(u[2]), ss_half_to_f32(u[3]),
                          ss_half_to_f32(u[4]), ss_half_to_f32(u[5]), ss_half_to_f32(u[6]), ss_half_to_f32(u[7]));
#endif
}
// the fp16 values of groups g0 .. g0 + ng - 1 (ng 4, or a last 2) of 8 rows, 2 bytes per group from byte `off` of
// each row, as fp32 lanes = rows: four at a time, a last pair from the last four (the pair before it among them)
AI void qt8_half_groups(const uint8_t *const w[8], int64_t off, int G, int g0, int ng, __m256 v[4]) {
    if (ng == 4) {
        qt8_half4(w, off + 2 * (int64_t)g0, v);
    } else if (G >= 4) {
        __m256 t[4];
        qt8_half4(w, off + 2 * (int64_t)(G - 4), t);
        v[0] = t[2], v[1] = t[3];
    } else {
        for (int e = 0; e < ng; e++) {
            float h[8];
            for (int r = 0; r < 8; r++) h[r] = qt_f16(w[r] + off + 2 * (g0 + e));
            v[e] = _mm256_loadu_ps(h);
        }
    }
}
AI void qt_rb5_rows8(const int t, const uint8_t *const w[8], int K, const int8_t *xq, const float *xd, const float *xs,
                     int nb, const char *pf, int64_t pf_group, __m256 out[MAX_ROWS]) {
    const int G = K / 32, G4 = G & ~3;
    __m256 acc[MAX_ROWS];
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) acc[b] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(15), m10 = _mm256_set1_epi8(16);
#ifndef SS_VNNI
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    _Alignas(32) int8_t codes[4][8][32];   // four groups' codes, lanes = rows
    __m256 s4[4], o4[4];
    __m256i T[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
    // T: Q5_K's current super-block headers of the 8 rows, lanes = rows (set at each super-block's first group)
    for (int g0 = 0; g0 < G; g0 += 4) {
        const int ng = g0 < G4 ? 4 : G - g0;   // 4, or the last pair
        if (ng == 4) {
            __m256i L[8], H[4];
            rows8_t16(w, 16 * (int64_t)G + 4 * (int64_t)g0, H);
            for (int p = 0; p < 2; p++) {
                rows8_t16(w, 16 * (int64_t)(g0 + 2 * p), L), rows8_t16(w, 16 * (int64_t)(g0 + 2 * p) + 16, L + 4);
                for (int j = 0; j < 8; j++) {
                    const __m256i h = H[j & 3];
                    for (int e = 0; e < 2; e++) {   // group g0 + 2p + e: nibble e of the pair's byte, bit i (or 4 + i)
                        const int i = 2 * p + e;
                        const __m256i lo = e ? _mm256_and_si256(_mm256_srli_epi16(L[j], 4), m4) : _mm256_and_si256(L[j], m4);
                        const __m256i hb = j < 4 ? _mm256_slli_epi16(h, 4 - i) : _mm256_srli_epi16(h, i);
                        _mm256_store_si256((__m256i *)codes[i][j], _mm256_or_si256(lo, _mm256_and_si256(hb, m10)));
                    }
                }
            }
        } else {   // G % 4 == 2: the last pair of groups, their fifth bits as ggml's qh (4 bytes per row and group)
            __m256i L[8];
            rows8_t16(w, 16 * (int64_t)g0, L), rows8_t16(w, 16 * (int64_t)g0 + 16, L + 4);
            for (int e = 0; e < 2; e++) {
                uint32_t qh[8];
                for (int r = 0; r < 8; r++) memcpy(&qh[r], w[r] + 16 * (int64_t)G + 4 * (int64_t)(g0 + e), 4);
                const __m256i v = _mm256_loadu_si256((const __m256i *)qh);   // lane r: row r's 32 fifth bits
                for (int j = 0; j < 8; j++) {
                    // bits 4j..4j+3 to bit 4 of bytes 0..3 (one multiply: the four shifted copies do not overlap)
                    const __m256i nib = _mm256_and_si256(_mm256_srli_epi32(v, 4 * j), _mm256_set1_epi32(15));
                    const __m256i hb = _mm256_and_si256(_mm256_mullo_epi32(nib, _mm256_set1_epi32(0x02040810)), m10);
                    const __m256i lo = e ? _mm256_and_si256(_mm256_srli_epi16(L[j], 4), m4) : _mm256_and_si256(L[j], m4);
                    _mm256_store_si256((__m256i *)codes[e][j], _mm256_or_si256(lo, hb));
                }
            }
        }
        // the groups' scales and offsets, lanes = rows
        if (t == QT_R_Q5_K) {
            if (!(g0 & 7)) rows8_t16(w, 20 * (int64_t)G + 2 * (int64_t)g0, T);
            const __m256 d = qt8_f16_lanes(T[3]), dm = qt8_f16_lanes(_mm256_srli_epi32(T[3], 16));
            const __m256i f4 = _mm256_set1_epi32(15), f2 = _mm256_set1_epi32(3);
            for (int e = 0; e < ng; e++) {
                const int i = (g0 & 7) + e;
                const __m256i lowb = _mm256_srli_epi32(T[i >> 2], 8 * (i & 3));
                const __m256i sc = _mm256_or_si256(_mm256_and_si256(lowb, f4), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(T[2], 2 * i), f2), 4));
                const __m256i mn = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(lowb, 4), f4),
                                                   _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(T[2], 16 + 2 * i), f2), 4));
                s4[e] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
                o4[e] = _mm256_xor_ps(_mm256_mul_ps(dm, _mm256_cvtepi32_ps(mn)), _mm256_set1_ps(-0.f));
            }
        } else {
            qt8_half_groups(w, 20 * (int64_t)G, G, g0, ng, s4);
            if (t == QT_R_Q5_1) qt8_half_groups(w, 22 * (int64_t)G, G, g0, ng, o4);
            if (t == QT_R_Q5_0)
                for (int e = 0; e < ng; e++) o4[e] = _mm256_mul_ps(s4[e], _mm256_set1_ps(-16.f));
        }
        for (int e = 0; e < ng; e++) {
            const int g = g0 + e;
            if (pf)   // the lines that start in this group's share of the block: each line once
                for (int64_t o = (pf_group * g + 63) & ~(int64_t)63; o < pf_group * (g + 1); o += 64) __builtin_prefetch(pf + o, 0, 2);
            const __m256i *q = (const __m256i *)codes[e];
            SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
                __m256i x[8];
                rows8_bcast(xq + (int64_t)b * K + 32 * (int64_t)g, x);
#ifdef SS_VNNI
                const __m256i sum = rows8_dot(q, x);   // q: the aligned codes buffer
#else
                __m256i p[2];
                for (int hq = 0; hq < 2; hq++) {
                    const __m256i *qq = q + 4 * hq;
                    const __m256i a01 = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_load_si256(qq), x[4 * hq]),
                                                         _mm256_maddubs_epi16(_mm256_load_si256(qq + 1), x[4 * hq + 1]));
                    const __m256i a23 = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_load_si256(qq + 2), x[4 * hq + 2]),
                                                         _mm256_maddubs_epi16(_mm256_load_si256(qq + 3), x[4 * hq + 3]));
                    p[hq] = _mm256_madd_epi16(_mm256_add_epi16(a01, a23), ones);
                }
                const __m256i sum = _mm256_add_epi32(p[0], p[1]);
#endif
                const __m256 tq = _mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_broadcast_ss(xd + (int64_t)b * G + g));
                acc[b] = _mm256_fmadd_ps(tq, s4[e], acc[b]);
                acc[b] = _mm256_fmadd_ps(o4[e], _mm256_broadcast_ss(xs + (int64_t)b * G + g), acc[b]);
            }
        }
    }
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) out[b] = acc[b];
}

// IQ4_NL and IQ4_XS (re-blocked) over 8 weight rows at once, as qt_rb5_rows8: four groups at a time (the nibble
// plane's two pairs; a last pair when G % 4 == 2, IQ4_NL only), the 4-bit indices transposed to lanes = weight
// rows and looked up (one byte shuffle per 32 codes, shared by the activation rows). The looked-up values
// k (-127..113) are signed; the two products:
//   VNNI (vpdpbusd sums u8 x s8 in int32, no int16 step): k + 128 as the unsigned operand, the 128 taken off as
//     an offset, -128 s x the activation's group sums xs (as Q5_0's -16 d);
//   AVX2 (maddubs, whose int16 pairs would overflow at 241 x 127): |k| x the activation with k's sign, a madd per
//     dword, no offset.
// Per (weight row n, activation row m), in group order: acc = fma(float(sum) * xd[m][g], s[n][g], acc) (and the
// offset's fma on VNNI); s = d (IQ4_NL) or d x (ls - 32) (IQ4_XS), the planes' very values. Either way the
// group's integer sum is exact; the fp32 order is one for every activation row count.
AI void qt_rbnl_rows8(const int t, const QTValues *kvt, const uint8_t *const w[8], int K, const int8_t *xq, const float *xd,
                      const float *xs, int nb, const char *pf, int64_t pf_group, __m256 out[MAX_ROWS]) {
    const int G = K / 32, G4 = G & ~3;
    __m256 acc[MAX_ROWS];
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) acc[b] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m256i kv = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kvt->v));
#ifdef SS_VNNI
    const __m256i lut = _mm256_xor_si256(kv, _mm256_set1_epi8((char)0x80));   // k + 128, unsigned
#else
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    __m256 s4[4];
    __m256i H0 = _mm256_setzero_si256(), H1 = _mm256_setzero_si256();   // IQ4_XS: the 8 rows' super-block headers
    for (int g0 = 0; g0 < G; g0 += 4) {
        const int ng = g0 < G4 ? 4 : G - g0;   // 4, or the last pair
        if (t == QT_R_IQ4_XS) {   // G % 8 == 0: always four groups; the header of groups 8s..8s+7 at 16 G + 8 s
            if (!(g0 & 7)) {
                int32_t a[8], c[8];
                for (int r = 0; r < 8; r++) {
                    const uint8_t *h = w[r] + 16 * (int64_t)G + (g0 / 8) * 8;
                    memcpy(&a[r], h, 4), memcpy(&c[r], h + 4, 4);
                }
                H0 = _mm256_loadu_si256((const __m256i *)a), H1 = _mm256_loadu_si256((const __m256i *)c);
            }
            const __m256 d = _mm256_mul_ps(qt8_f16_lanes(H0), _mm256_set1_ps(kvt->dk));
            const __m256i f4 = _mm256_set1_epi32(15), f2 = _mm256_set1_epi32(3);
            for (int e = 0; e < 4; e++) {   // ls = scales_l nibble i | (scales_h bits 2i, 2i + 1) << 4
                const int i = (g0 & 7) + e;
                const __m256i ls = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(H1, 4 * i), f4),
                                                   _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(H0, 16 + 2 * i), f2), 4));
                s4[e] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32))));
            }
        } else {
            qt8_half_groups(w, 16 * (int64_t)G, G, g0, ng, s4);
        }
        __m256i L[8];   // the current pair's code bytes, lanes = rows (transposed once for both groups)
        for (int e = 0; e < ng; e++) {
            const int g = g0 + e;
            if (pf)   // the lines that start in this group's share of the block: each line once
                for (int64_t o = (pf_group * g + 63) & ~(int64_t)63; o < pf_group * (g + 1); o += 64) __builtin_prefetch(pf + o, 0, 2);
            // the group's codes in registers (nibble e & 1 of its pair's bytes)
            if (!(e & 1)) rows8_t16(w, 16 * (int64_t)g, L), rows8_t16(w, 16 * (int64_t)g + 16, L + 4);
            __m256i c[8];
            for (int jj = 0; jj < 8; jj++)
                c[jj] = _mm256_and_si256((e & 1) ? _mm256_srli_epi16(L[jj], 4) : L[jj], m4);
#ifdef SS_VNNI
            for (int jj = 0; jj < 8; jj++) c[jj] = _mm256_shuffle_epi8(lut, c[jj]);
            const __m256 o4 = _mm256_mul_ps(s4[e], _mm256_set1_ps(-128.f));
#else
            __m256i a[8];
            for (int jj = 0; jj < 8; jj++) c[jj] = _mm256_shuffle_epi8(kv, c[jj]), a[jj] = _mm256_abs_epi8(c[jj]);
#endif
            SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
                __m256i x[8];
                rows8_bcast(xq + (int64_t)b * K + 32 * (int64_t)g, x);
#ifdef SS_VNNI
                const __m256i sum = rows8_dot(c, x);
#else
                __m256i p2[2];
                for (int hq = 0; hq < 2; hq++) {   // a madd per dword: |k| x 127 twice fills an int16
                    __m256i d4[4];
                    for (int jj = 0; jj < 4; jj++) {
                        const int j = 4 * hq + jj;
                        d4[jj] = _mm256_madd_epi16(_mm256_maddubs_epi16(a[j], _mm256_sign_epi8(x[j], c[j])), ones);
                    }
                    p2[hq] = _mm256_add_epi32(_mm256_add_epi32(d4[0], d4[1]), _mm256_add_epi32(d4[2], d4[3]));
                }
                const __m256i sum = _mm256_add_epi32(p2[0], p2[1]);
#endif
                const __m256 tq = _mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_broadcast_ss(xd + (int64_t)b * G + g));
                acc[b] = _mm256_fmadd_ps(tq, s4[e], acc[b]);
#ifdef SS_VNNI
                acc[b] = _mm256_fmadd_ps(o4, _mm256_broadcast_ss(xs + (int64_t)b * G + g), acc[b]);
#endif
            }
        }
    }
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) out[b] = acc[b];
}

#if defined(SS_AVX512) && defined(SS_VNNI)
// qt_rbnl_rows8's VNNI arithmetic over 16 weight rows at once, lanes = rows of 512-bit registers (the same
// operations lane for lane, so the same bits): for CPUs whose 512-bit vpdpbusd runs at the 256-bit one's rate
// (amx.h's twin_from_rows), where the IQ4 layouts' batches and prompt chunks otherwise ran at half the q4 twin's
// rate. The code bytes are rows8_t16's transposes of rows 0-7 and 8-15, joined; w[16] rows (a row past the
// range's end may repeat the last); pf: the next block of 16 rows, pf_group bytes of it per group.
AI void qt_rbnl_rows16(const int t, const QTValues *kvt, const uint8_t *const w[16], int K, const int8_t *xq,
                       const float *xd, const float *xs, int nb, const char *pf, int64_t pf_group,
                       __m512 out[MAX_ROWS]) {
    const int G = K / 32, G4 = G & ~3;
    __m512 acc[MAX_ROWS];
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) acc[b] = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(15);
    const __m512i lut = _mm512_broadcast_i32x4(_mm_xor_si128(_mm_load_si128((const __m128i *)kvt->v), _mm_set1_epi8((char)0x80)));
    for (int g0 = 0; g0 < G; g0 += 4) {
        const int ng = g0 < G4 ? 4 : G - g0;
        __m512 s4[4];
        if (t == QT_R_IQ4_XS) {   // the header of groups 8 s .. 8 s + 7 at 16 G + 8 s of each row
            int32_t a[16], c[16];
            for (int r = 0; r < 16; r++) {
                const uint8_t *h = w[r] + 16 * (int64_t)G + (g0 / 8) * 8;
                memcpy(&a[r], h, 4), memcpy(&c[r], h + 4, 4);
            }
            const __m512i H0 = _mm512_loadu_si512(a), H1 = _mm512_loadu_si512(c);
            const __m512 d = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(H0)), _mm512_set1_ps(kvt->dk));
            const __m512i f4 = _mm512_set1_epi32(15), f2 = _mm512_set1_epi32(3);
            for (int e = 0; e < 4; e++) {
                const int i = (g0 & 7) + e;
                const __m512i ls = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(H1, 4 * i), f4),
                                                   _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(H0, 16 + 2 * i), f2), 4));
                s4[e] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(ls, _mm512_set1_epi32(32))));
            }
        } else {   // IQ4_NL's layout: each group's fp16 scale at 16 G + 2 g
            for (int e = 0; e < ng; e++) {
                uint16_t h[16];
                for (int r = 0; r < 16; r++) memcpy(&h[r], w[r] + 16 * (int64_t)G + 2 * (g0 + e), 2);
                s4[e] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
            }
        }
        __m512i L[8];
        for (int e = 0; e < ng; e++) {
            const int g = g0 + e;
            if (pf)
                for (int64_t o = (pf_group * g + 63) & ~(int64_t)63; o < pf_group * (g + 1); o += 64) __builtin_prefetch(pf + o, 0, 2);
            if (!(e & 1)) {
                __m256i lo[8], hi[8];
                rows8_t16(w, 16 * (int64_t)g, lo), rows8_t16(w, 16 * (int64_t)g + 16, lo + 4);
                rows8_t16(w + 8, 16 * (int64_t)g, hi), rows8_t16(w + 8, 16 * (int64_t)g + 16, hi + 4);
                for (int jj = 0; jj < 8; jj++) L[jj] = _mm512_inserti64x4(_mm512_castsi256_si512(lo[jj]), hi[jj], 1);
            }
            __m512i c[8];
            for (int jj = 0; jj < 8; jj++)
                c[jj] = _mm512_shuffle_epi8(lut, _mm512_and_si512((e & 1) ? _mm512_srli_epi16(L[jj], 4) : L[jj], m4));
            const __m512 o4 = _mm512_mul_ps(s4[e], _mm512_set1_ps(-128.f));
            SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
                __m512i x[8];
                rows16_bcast(xq + (int64_t)b * K + 32 * (int64_t)g, x);
                const __m512i z = _mm512_setzero_si512();
                const __m512i e0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, c[0], x[0]), c[1], x[1]), c[2], x[2]), c[3], x[3]);
                const __m512i e1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, c[4], x[4]), c[5], x[5]), c[6], x[6]), c[7], x[7]);
                const __m512 tq = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(e0, e1)), _mm512_set1_ps(xd[(int64_t)b * G + g]));
                acc[b] = _mm512_fmadd_ps(tq, s4[e], acc[b]);
                acc[b] = _mm512_fmadd_ps(o4, _mm512_set1_ps(xs[(int64_t)b * G + g]), acc[b]);
            }
        }
    }
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) out[b] = acc[b];
}
#endif

// xh[b][s]: the sum of activation row b's 16 codes of sub-block s (qt_rb6_rows8's offset term)
AI void qt_code_sums16(const int8_t *xq, int K, int nb, int16_t *xh) {
    for (int b = 0; b < nb; b++)
        for (int s = 0; s < K / 16; s++) {
            int t = 0;
            for (int j = 0; j < 16; j++) t += xq[(int64_t)b * K + 16 * s + j];
            xh[(int64_t)b * (K / 16) + s] = (int16_t)t;
        }
}
#endif

// -- fast product: one weight row of block type t against nb int8 activation rows ------------------
// xs: the activation's per-32 sums (d * sum of codes), for the offsets of types whose minimum is
// per 32 weights; Q2_K's per-16 minimum sums the codes itself
// Types whose scale (and minimum) is shared by 32 weights: a whole row is decoded first, then
// multiplied by the 8-bit layout's kernels (four groups per reduction), plus the offset term.
AI int qt_per32(const int t) {
    return t != QT_Q2_K && t != QT_Q3_K && t != QT_Q6_K && t != QT_R_Q6_K && t != QT_IQ2_XS && t != QT_IQ2_S && t != QT_IQ1_M &&
           !qt_rb16(t);
}

AI void qt_unpack_row32(const int t, const uint8_t *w, int K, int8_t *q, float *sc, float *mn) {
    if (qt_rb(t)) {
        qt_rb_unpack_row(t, w, K, q, sc, mn);
        return;
    }
    const int QK = qt_block(t), BB = qt_bytes(t);
    float sc16[QT_MAX / 16], mn16[QT_MAX / 16];
    for (int blk = 0; blk < K / QK; blk++) {
        qt_unpack(t, w + (int64_t)blk * BB, &(QTOut){q + (int64_t)blk * QK, sc16, mn16});
        for (int c = 0; c < QK / 32; c++) sc[blk * (QK / 32) + c] = sc16[2 * c], mn[blk * (QK / 32) + c] = mn16[2 * c];
    }
}

AI void qt_q8_row_t(const int t, const uint8_t *w, int K, const int8_t *xq, const float *xd, const float *xs,
                    int nb, float *out) {
    const int QK = qt_block(t), BB = qt_bytes(t), G = K / 32, mins = qt_has_min(t), min16 = t == QT_Q2_K || t == QT_R_Q2_K;
#if defined(SS_AVX2)
    if (qt_rb(t)) {
        qt_rb_q8_row(qt_rb_layout(t), qt_kv(t), w, K, xq, xd, xs, nb, out);
        return;
    }
#endif
    if (qt_per32(t)) {
        int8_t *q = alloca((size_t)K);
        float *sc = alloca(sizeof(float) * G), *mn = alloca(sizeof(float) * G);
        qt_unpack_row32(t, w, K, q, sc, mn);
        q8q8_row(q, sc, G, xq, xd, nb, out);
        if (mins)
            SS_UNROLL_ROWS for (int b = 0; b < nb; b++) out[b] += ss_min_term(mn, xs + (int64_t)b * G, G);
        return;
    }
    QTBlock u;
#if defined(SS_AVX2)
    __m256 acc[MAX_ROWS];
    float accm[MAX_ROWS];
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) acc[b] = _mm256_setzero_ps(), accm[b] = 0.f;
    const __m256i ones16 = _mm256_set1_epi16(1), ones8 = _mm256_set1_epi8(1);
    for (int blk = 0; blk < K / QK; blk++) {
        qt_unpack_at(t, w, K, blk, &(QTOut){u.q, u.sc, u.mn});
        for (int c = 0; c < QK / 32; c++) {
            const __m256i qv = _mm256_loadu_si256((const __m256i *)(u.q + 32 * c));
            const __m256i qa = _mm256_sign_epi8(qv, qv);
            // lanes 0-3 hold sub-block 2c, lanes 4-7 sub-block 2c + 1
            const __m256 sv = _mm256_set_m128(_mm_set1_ps(u.sc[2 * c + 1]), _mm_set1_ps(u.sc[2 * c]));
            const __m256 mv = _mm256_set_m128(_mm_set1_ps(u.mn[2 * c + 1]), _mm_set1_ps(u.mn[2 * c]));
            const int g = blk * (QK / 32) + c;
            (void)mv;
            SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
                const __m256i av = _mm256_loadu_si256((const __m256i *)(xq + (int64_t)b * K + 32 * g));
                const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(qa, _mm256_sign_epi8(av, qv)), ones16);
                const __m256 dx = _mm256_set1_ps(xd[(int64_t)b * G + g]);
                acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(sv, dx), acc[b]);
                if (min16) {
                    const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, av), ones16);
                    acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(mv, dx), acc[b]);
                } else if (mins) {
                    accm[b] += u.mn[2 * c] * xs[(int64_t)b * G + g];
                }
            }
        }
    }
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) out[b] = hsum256(acc[b]) + accm[b];
#else
    (void)xs;
    float acc[MAX_ROWS] = {0};
    for (int blk = 0; blk < K / QK; blk++) {
        qt_unpack_at(t, w, K, blk, &(QTOut){u.q, u.sc, u.mn});
        for (int s = 0; s < QK / 16; s++) {
            const int g = (blk * QK + 16 * s) / 32;
            const int8_t *qs = u.q + 16 * s;
            SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
                const int8_t *a = xq + (int64_t)b * K + blk * QK + 16 * s;
#if defined(SS_NEON) && defined(__ARM_FEATURE_DOTPROD)
                const int32_t dot = vaddvq_s32(vdotq_s32(vdupq_n_s32(0), vld1q_s8(qs), vld1q_s8(a)));
                const int32_t sum = mins ? vaddlvq_s8(vld1q_s8(a)) : 0;
#elif defined(SS_NEON)
                const int8x16_t qv = vld1q_s8(qs), av = vld1q_s8(a);
                int16x8_t m = vmull_s8(vget_low_s8(qv), vget_low_s8(av));
                int32x4_t p = vpaddlq_s16(m);
                p = vpadalq_s16(p, vmull_s8(vget_high_s8(qv), vget_high_s8(av)));
                const int32_t dot = vaddvq_s32(p);
                const int32_t sum = mins ? vaddlvq_s8(av) : 0;
#else
                int32_t dot = 0, sum = 0;
                for (int j = 0; j < 16; j++) dot += qs[j] * a[j], sum += a[j];
#endif
                const float dx = xd[(int64_t)b * G + g];
                acc[b] += dx * (u.sc[s] * (float)dot + (mins ? u.mn[s] * (float)sum : 0.f));
            }
        }
    }
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) out[b] = acc[b];
#endif
}

// one compiled body per type (the decoder's switch folds away)
#define QT_EACH_BLOCK_TYPE(X) X(QT_Q4_0) X(QT_Q4_1) X(QT_Q5_0) X(QT_Q5_1) X(QT_Q8_0) X(QT_Q2_K) X(QT_Q3_K) \
    X(QT_Q4_K) X(QT_Q5_K) X(QT_Q6_K) X(QT_IQ4_NL) X(QT_IQ4_XS) X(QT_R_Q5_0) X(QT_R_Q5_1) X(QT_R_IQ4_NL) X(QT_R_IQ4_XS) \
    X(QT_R_Q5_K) X(QT_R_Q6_K) X(QT_IQ2_XXS) X(QT_IQ2_XS) X(QT_IQ2_S) X(QT_IQ3_XXS) X(QT_IQ3_S) X(QT_IQ1_S) X(QT_IQ1_M) \
    X(QT_TQ1_0) X(QT_TQ2_0) X(QT_MXFP4) X(QT_R_IQ2_XXS) X(QT_R_IQ3_XXS) X(QT_R_IQ1_S) X(QT_R_IQ3_S) X(QT_R_TQ1_0) \
    X(QT_R_TQ2_0) X(QT_R_MXFP4) X(QT_R_IQ2_XS) X(QT_R_IQ2_S) X(QT_R_IQ1_M) X(QT_R_Q3_K) X(QT_R_Q2_K)

static void qt_q8_row(int t, const uint8_t *w, int K, const int8_t *xq, const float *xd, const float *xs, int nb,
                      float *out) {
#if defined(SS_AVX2)
    // the re-blocked types with the row count a compile-time constant (accumulators in registers)
    switch (t) {
#define QT_RB_ROWS(NB) qt_rb_q8_row(T_, qt_kv(t), w, K, xq, xd, xs, NB, out)
#define QT_RB_CASE(T) case T: { enum { T_ = T }; SS_BY_ROWS(nb, QT_RB_ROWS) } return;
    // the re-encoded types on their layout's kernels, with their own values
    case QT_R_IQ2_XXS: case QT_R_IQ3_XXS: case QT_R_IQ1_S: case QT_R_IQ3_S: case QT_R_TQ1_0: case QT_R_TQ2_0:
        { enum { T_ = QT_R_IQ4_XS }; SS_BY_ROWS(nb, QT_RB_ROWS) } return;
    case QT_R_MXFP4: { enum { T_ = QT_R_IQ4_NL }; SS_BY_ROWS(nb, QT_RB_ROWS) } return;
#define QT_RB6_ROWS(NB) qt_rb6_q8_row(T_, qt_kv(t), w, K, xq, xd, NB, out)
    QT_RB_CASE(QT_R_Q5_0) QT_RB_CASE(QT_R_Q5_1) QT_RB_CASE(QT_R_IQ4_NL) QT_RB_CASE(QT_R_IQ4_XS) QT_RB_CASE(QT_R_Q5_K)
    case QT_R_Q6_K: { enum { T_ = QT_R_Q6_K }; SS_BY_ROWS(nb, QT_RB6_ROWS) } return;
    // the per-16 IQ planes on Q6_K's kernels, with their own values
    case QT_R_IQ2_XS: case QT_R_IQ2_S: case QT_R_IQ1_M: case QT_R_Q3_K:
        { enum { T_ = QT_R_IQ2_XS }; SS_BY_ROWS(nb, QT_RB6_ROWS) } return;
    case QT_R_Q2_K: { enum { T_ = QT_R_Q2_K }; SS_BY_ROWS(nb, QT_RB6_ROWS) } return;
#undef QT_RB6_ROWS
#undef QT_RB_CASE
#undef QT_RB_ROWS
    }
#endif
    switch (t) {
#define QT_CASE(T) case T: qt_q8_row_t(T, w, K, xq, xd, xs, nb, out); break;
    QT_EACH_BLOCK_TYPE(QT_CASE)
#undef QT_CASE
    default: for (int b = 0; b < nb; b++) out[b] = 0.f;
    }
}

// -- exact product: fp32 activations -----------------------------------------------------------------
AI void qt_f_row_t(const int t, const uint8_t *w, int K, const float *x, const float *xs, int nb, float *out) {
    if (t != QT_F16 && t != QT_BF16 && qt_per32(t)) {   // xs: the activation's plain per-32 sums
        const int G = K / 32;
        int8_t *q = alloca((size_t)K);
        float *sc = alloca(sizeof(float) * G), *mn = alloca(sizeof(float) * G);
        qt_unpack_row32(t, w, K, q, sc, mn);
        q8f_row(q, sc, G, x, K, nb, out);
        if (qt_has_min(t))
            SS_UNROLL_ROWS for (int b = 0; b < nb; b++) out[b] += ss_min_term(mn, xs + (int64_t)b * G, G);
        return;
    }
    if (t == QT_F16 || t == QT_BF16) {
        SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
            const float *xb = x + (int64_t)b * K;
            int i = 0;
            float s = 0.f;
#if defined(SS_AVX2)
            __m256 acc = _mm256_setzero_ps();
            for (; i + 8 <= K; i += 8) {
                const __m128i h = _mm_loadu_si128((const __m128i *)(w + 2 * i));
                const __m256 wf = t == QT_F16 ? _mm256_cvtph_ps(h)
                                              : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
                acc = _mm256_fmadd_ps(wf, _mm256_loadu_ps(xb + i), acc);
            }
            s = hsum256(acc);
#endif
            for (; i < K; i++) s += (t == QT_F16 ? qt_f16(w + 2 * (int64_t)i) : qt_bf16(w + 2 * (int64_t)i)) * xb[i];
            out[b] = s;
        }
        return;
    }
    const int QK = qt_block(t), BB = qt_bytes(t), mins = qt_has_min(t);
    QTBlock u;
#if defined(SS_AVX2)
    __m256 acc[MAX_ROWS];
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) acc[b] = _mm256_setzero_ps();
    for (int blk = 0; blk < K / QK; blk++) {
        qt_unpack_at(t, w, K, blk, &(QTOut){u.q, u.sc, u.mn});
        for (int s = 0; s < QK / 16; s++) {
            const __m128i q16 = _mm_loadu_si128((const __m128i *)(u.q + 16 * s));
            const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q16));
            const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q16, 8)));
            const __m256 sv = _mm256_set1_ps(u.sc[s]), mv = _mm256_set1_ps(u.mn[s]);
            SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
                const float *xg = x + (int64_t)b * K + blk * QK + 16 * s;
                const __m256 x0 = _mm256_loadu_ps(xg), x1 = _mm256_loadu_ps(xg + 8);
                const __m256 tq = _mm256_fmadd_ps(w1, x1, _mm256_mul_ps(w0, x0));
                acc[b] = _mm256_fmadd_ps(tq, sv, acc[b]);
                if (mins) acc[b] = _mm256_fmadd_ps(_mm256_add_ps(x0, x1), mv, acc[b]);
            }
        }
    }
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) out[b] = hsum256(acc[b]);
#else
    float acc[MAX_ROWS] = {0};
    for (int blk = 0; blk < K / QK; blk++) {
        qt_unpack_at(t, w, K, blk, &(QTOut){u.q, u.sc, u.mn});
        for (int s = 0; s < QK / 16; s++) {
            SS_UNROLL_ROWS for (int b = 0; b < nb; b++) {
                const float *xg = x + (int64_t)b * K + blk * QK + 16 * s;
                float dot = 0.f, sum = 0.f;
                for (int j = 0; j < 16; j++) dot += (float)u.q[16 * s + j] * xg[j], sum += xg[j];
                acc[b] += u.sc[s] * dot + (mins ? u.mn[s] * sum : 0.f);
            }
        }
    }
    SS_UNROLL_ROWS for (int b = 0; b < nb; b++) out[b] = acc[b];
#endif
}

static void qt_f_row(int t, const uint8_t *w, int K, const float *x, const float *xs, int nb, float *out) {
    switch (t) {
#define QT_CASE(T) case T: qt_f_row_t(T, w, K, x, xs, nb, out); break;
    QT_EACH_BLOCK_TYPE(QT_CASE) QT_CASE(QT_F16) QT_CASE(QT_BF16)
#undef QT_CASE
    default: for (int b = 0; b < nb; b++) out[b] = 0.f;
    }
}

// one row of K weights as fp32 (the embedding table); same values as the reference dequantization
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))   // sc * q, then + mn: two roundings, as the reference
#endif
static void qt_dequant_row(int t, const uint8_t *w, int K, float *out) {
    if (t == QT_F16 || t == QT_BF16) {
        for (int i = 0; i < K; i++) out[i] = t == QT_F16 ? qt_f16(w + 2 * i) : qt_bf16(w + 2 * i);
        return;
    }
    if (qt_rb(t)) {
        const int G = K / 32;
        int8_t *q = alloca((size_t)K);
        float *sc = alloca(sizeof(float) * G), *mn = alloca(sizeof(float) * G);
        qt_rb_unpack_row(t, w, K, q, sc, mn);
        for (int i = 0; i < K; i++) {
            float v = sc[i / 32] * (float)q[i];
            if (qt_has_min(t)) v = v + mn[i / 32];
            out[i] = v;
        }
        return;
    }
    const int QK = qt_block(t), BB = qt_bytes(t);
    QTBlock u;
    for (int blk = 0; blk < K / QK; blk++) {
        qt_unpack_at(t, w, K, blk, &(QTOut){u.q, u.sc, u.mn});
        for (int i = 0; i < QK; i++) {
            float v = u.sc[i / 16] * (float)u.q[i];
            if (qt_has_min(t)) v = v + u.mn[i / 16];
            out[blk * QK + i] = v;
        }
    }
}
