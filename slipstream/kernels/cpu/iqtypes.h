// ggml's lattice and ternary types, read in place: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S
// (grids of 4 or 8 small values picked by an index, with sign bits), TQ1_0, TQ2_0 (ternary) and MXFP4.
//
// Each block decodes into qtypes.h's shared form, int8 codes and per-16 scales, with the very values of
// gguf-py's reference dequantization: the scales are fp16 (or E8M0) values times small integers, exact in
// fp32, and the codes are the grid values with their signs, so sc * q rounds once, as the reference's
// product does. IQ1's values are grid + delta with delta = +-1/8: the codes are 8 grid + -1 and the scale
// dl / 8, the same real product, rounded once.
//
// The grids are not written out here: gguf-py holds them, and kernels/cpu/iq_grids.py hands them to
// ss_set_iq_grids once per library before any such matrix is used (weights/quant.py's Linear does it).
// Included by qtypes.h (it uses its type ids and qt_f16).
#pragma once

#include <stdint.h>
#include <string.h>

// the grids as int8 values, and per sign byte the 8 byte masks (0xFF where the bit is set); one copy per
// library (weak: qtypes.h is included by more than one of its files)
typedef struct {
    int8_t iq2xxs[256][8], iq2xs[512][8], iq2s[1024][8], iq3xxs[256][4], iq3s[512][4], iq1s[2048][8];
    uint64_t sign_mask[256];
    uint8_t ksigns[128];   // a 7-bit sign index -> its 8 sign bits (the eighth makes the count even)
    int ready;
} QTGrids;
__attribute__((weak)) QTGrids qt_grids;

static inline int qt_iq_type(int t) {
    return t == QT_IQ2_XXS || t == QT_IQ2_XS || t == QT_IQ3_XXS || t == QT_IQ1_S || t == QT_IQ3_S || t == QT_IQ2_S ||
           t == QT_IQ1_M || t == QT_TQ1_0 || t == QT_TQ2_0 || t == QT_MXFP4;
}

static inline uint64_t qt_ksign_mask(int idx7) { return qt_grids.sign_mask[qt_grids.ksigns[idx7]]; }

// 8 grid bytes (all > 0) with the signs of mask m (0xFF bytes): per byte (g ^ m) + (m & 1) = -g where set;
// no byte carries into the next since no g is 0
static inline void qt_signed8(uint64_t g, uint64_t m, int8_t *q) {
    const uint64_t v = (g ^ m) + (m & 0x0101010101010101ULL);
    memcpy(q, &v, 8);
}

static inline uint64_t qt_grid8(const int8_t *row) {
    uint64_t g;
    memcpy(&g, row, 8);
    return g;
}

static inline uint64_t qt_grid4x2(const int8_t *a, const int8_t *b) {   // two 4-value entries -> 8 bytes
    uint32_t x, y;
    memcpy(&x, a, 4), memcpy(&y, b, 4);
    return (uint64_t)x | ((uint64_t)y << 32);
}

// MXFP4's E8M0 exponent as ggml's "half" scale (2^(e - 128)): the fp32 with exponent bits e - 1, or a
// subnormal for e < 2
static inline float qt_e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static const int8_t QT_MXFP4_VALUES[16] __attribute__((aligned(16))) = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

#if defined(SS_AVX2)
// AVX2: 32 codes per register. The grid entries are loaded one by one (no gathers: they are slow on Intel
// since the 2023 microcode), the signs spread from 32 bits to 32 byte masks (qt_bits)
AI __m256i qt_with_signs(__m256i v, uint32_t bits) {   // -v where the bit is set
    const __m256i m = qt_bits(bits);
    return _mm256_sub_epi8(_mm256_xor_si256(v, m), m);
}
AI __m256i qt_grid8x4(const int8_t (*g)[8], int a, int b, int c, int d) {
    return _mm256_set_epi64x((long long)qt_grid8(g[d]), (long long)qt_grid8(g[c]), (long long)qt_grid8(g[b]),
                             (long long)qt_grid8(g[a]));
}
AI uint32_t qt_grid4(const int8_t (*g)[4], int i) {
    uint32_t x;
    memcpy(&x, g[i], 4);
    return x;
}
AI __m256i qt_grid4x8(const int8_t (*g)[4], const int i[8]) {
    return _mm256_setr_epi32((int)qt_grid4(g, i[0]), (int)qt_grid4(g, i[1]), (int)qt_grid4(g, i[2]), (int)qt_grid4(g, i[3]),
                             (int)qt_grid4(g, i[4]), (int)qt_grid4(g, i[5]), (int)qt_grid4(g, i[6]), (int)qt_grid4(g, i[7]));
}
AI uint32_t qt_ksigns4(uint32_t aux) {   // four 7-bit sign indices -> 32 sign bits
    const uint8_t *k = qt_grids.ksigns;
    return (uint32_t)k[aux & 127] | (uint32_t)k[(aux >> 7) & 127] << 8 | (uint32_t)k[(aux >> 14) & 127] << 16 |
           (uint32_t)k[(aux >> 21) & 127] << 24;
}
AI __m256i qt_iq1_codes(__m256i g, __m256i delta) {   // 8 g + delta per byte, g in {-1, 0, 1}
    return _mm256_add_epi8(_mm256_and_si256(_mm256_slli_epi16(g, 3), _mm256_set1_epi8((char)0xF8)), delta);
}
#endif

// Decode one block of type t at p (256 weights; MXFP4 32) into q, sc and mn (per 16 weights)
AI void qt_unpack_iq(const int t, const uint8_t *p, int8_t *q, float *sc, float *mn) {
    const int subs = t == QT_MXFP4 ? 2 : 16;
    for (int s = 0; s < subs; s++) mn[s] = 0.f;
    switch (t) {
    case QT_IQ2_XXS: {   // d, then per 32 weights: 4 grid indices (bytes), 4 x 7 sign bits + a 4-bit scale
        const float d = qt_f16(p);
        for (int ib = 0; ib < 8; ib++) {
            const uint8_t *b = p + 2 + 8 * ib;
            uint32_t aux;
            memcpy(&aux, b + 4, 4);
            sc[2 * ib] = sc[2 * ib + 1] = d * (0.5f + (float)(aux >> 28)) * 0.25f;
#if defined(SS_AVX2)
            qt_store(q + 32 * ib, qt_with_signs(qt_grid8x4(qt_grids.iq2xxs, b[0], b[1], b[2], b[3]), qt_ksigns4(aux)));
            continue;
#endif
            for (int l = 0; l < 4; l++)
                qt_signed8(qt_grid8(qt_grids.iq2xxs[b[l]]), qt_ksign_mask((aux >> (7 * l)) & 127), q + 32 * ib + 8 * l);
        }
        break;
    }
    case QT_IQ2_XS: {   // d, 32 x uint16 (9-bit grid index, 7 sign bits), 8 bytes of 4-bit scales (per 16)
        const float d = qt_f16(p);
        const uint8_t *scales = p + 66;
#if defined(SS_AVX2)
        for (int ib = 0; ib < 8; ib++) {
            uint16_t v[4];
            memcpy(v, p + 2 + 8 * ib, 8);
            const uint32_t bits = (uint32_t)qt_grids.ksigns[v[0] >> 9] | (uint32_t)qt_grids.ksigns[v[1] >> 9] << 8 |
                                  (uint32_t)qt_grids.ksigns[v[2] >> 9] << 16 | (uint32_t)qt_grids.ksigns[v[3] >> 9] << 24;
            qt_store(q + 32 * ib, qt_with_signs(qt_grid8x4(qt_grids.iq2xs, v[0] & 511, v[1] & 511, v[2] & 511, v[3] & 511), bits));
        }
        if (0)
#endif
        for (int g = 0; g < 32; g++) {
            const int v = p[2 + 2 * g] | (p[3 + 2 * g] << 8);
            qt_signed8(qt_grid8(qt_grids.iq2xs[v & 511]), qt_ksign_mask(v >> 9), q + 8 * g);
        }
        for (int s = 0; s < 16; s++) sc[s] = d * (0.5f + (float)((scales[s / 2] >> (4 * (s & 1))) & 15)) * 0.25f;
        break;
    }
    case QT_IQ2_S: {   // d, qs[32] (index low bits), signs[32], qh[8] (2 index bits per 8), scales[8]
        const float d = qt_f16(p);
        const uint8_t *qs = p + 2, *signs = p + 34, *qh = p + 66, *scales = p + 74;
#if defined(SS_AVX2)
        for (int ib = 0; ib < 8; ib++) {
            const int h = qh[ib];
            uint32_t bits;
            memcpy(&bits, signs + 4 * ib, 4);
            qt_store(q + 32 * ib, qt_with_signs(qt_grid8x4(qt_grids.iq2s, qs[4 * ib] | (h & 3) << 8, qs[4 * ib + 1] | (h & 12) << 6,
                                                           qs[4 * ib + 2] | (h & 48) << 4, qs[4 * ib + 3] | (h & 192) << 2), bits));
        }
        if (0)
#endif
        for (int g = 0; g < 32; g++) {
            const int idx = qs[g] | (((qh[g / 4] >> (2 * (g & 3))) & 3) << 8);
            qt_signed8(qt_grid8(qt_grids.iq2s[idx]), qt_grids.sign_mask[signs[g]], q + 8 * g);
        }
        for (int s = 0; s < 16; s++) sc[s] = d * (0.5f + (float)((scales[s / 2] >> (4 * (s & 1))) & 15)) * 0.25f;
        break;
    }
    case QT_IQ3_XXS: {   // d, qs[64] (one index per 4 weights), per 32 weights 4 x 7 sign bits + a 4-bit scale
        const float d = qt_f16(p);
        const uint8_t *qs = p + 2;
        for (int ib = 0; ib < 8; ib++) {
            uint32_t aux;
            memcpy(&aux, p + 66 + 4 * ib, 4);
            sc[2 * ib] = sc[2 * ib + 1] = d * (0.5f + (float)(aux >> 28)) * 0.5f;
#if defined(SS_AVX2)
            const uint8_t *e = qs + 8 * ib;
            const int idx[8] = {e[0], e[1], e[2], e[3], e[4], e[5], e[6], e[7]};
            qt_store(q + 32 * ib, qt_with_signs(qt_grid4x8(qt_grids.iq3xxs, idx), qt_ksigns4(aux)));
            continue;
#endif
            for (int l = 0; l < 4; l++) {
                const uint8_t *e = qs + 8 * ib + 2 * l;
                qt_signed8(qt_grid4x2(qt_grids.iq3xxs[e[0]], qt_grids.iq3xxs[e[1]]), qt_ksign_mask((aux >> (7 * l)) & 127),
                           q + 32 * ib + 8 * l);
            }
        }
        break;
    }
    case QT_IQ3_S: {   // d, qs[64], qh[8] (one index bit per 4 weights), signs[32], scales[4] (per 32)
        const float d = qt_f16(p);
        const uint8_t *qs = p + 2, *qh = p + 66, *signs = p + 74, *scales = p + 106;
#if defined(SS_AVX2)
        for (int ib = 0; ib < 8; ib++) {
            const uint8_t *e = qs + 8 * ib;
            const int h = qh[ib];
            const int idx[8] = {e[0] | (h & 1) << 8, e[1] | (h & 2) << 7, e[2] | (h & 4) << 6, e[3] | (h & 8) << 5,
                                e[4] | (h & 16) << 4, e[5] | (h & 32) << 3, e[6] | (h & 64) << 2, e[7] | (h & 128) << 1};
            uint32_t bits;
            memcpy(&bits, signs + 4 * ib, 4);
            qt_store(q + 32 * ib, qt_with_signs(qt_grid4x8(qt_grids.iq3s, idx), bits));
        }
        if (0)
#endif
        for (int g = 0; g < 32; g++) {
            const int e0 = 2 * g, e1 = 2 * g + 1;
            const int i0 = qs[e0] | (((qh[e0 / 8] >> (e0 & 7)) & 1) << 8), i1 = qs[e1] | (((qh[e1 / 8] >> (e1 & 7)) & 1) << 8);
            qt_signed8(qt_grid4x2(qt_grids.iq3s[i0], qt_grids.iq3s[i1]), qt_grids.sign_mask[signs[g]], q + 8 * g);
        }
        for (int ib = 0; ib < 8; ib++)
            sc[2 * ib] = sc[2 * ib + 1] = d * (float)(1 + 2 * ((scales[ib / 2] >> (4 * (ib & 1))) & 15));
        break;
    }
    case QT_IQ1_S: {   // d, qs[32] (index low bits), per 32 weights a uint16: 4 x 3 index bits, 3-bit scale, delta sign
        const float d = qt_f16(p);
        for (int ib = 0; ib < 8; ib++) {
            const int h = p[34 + 2 * ib] | (p[35 + 2 * ib] << 8);
            const float dl = d * (float)(2 * ((h >> 12) & 7) + 1);
            sc[2 * ib] = sc[2 * ib + 1] = dl * 0.125f;
            const int delta = h & 0x8000 ? -1 : 1;
#if defined(SS_AVX2)
            const uint8_t *e = p + 2 + 4 * ib;
            qt_store(q + 32 * ib, qt_iq1_codes(qt_grid8x4(qt_grids.iq1s, e[0] | (h & 7) << 8, e[1] | (h & 0x38) << 5,
                                                          e[2] | (h & 0x1C0) << 2, e[3] | (h & 0xE00) >> 1),
                                               _mm256_set1_epi8((char)delta)));
            continue;
#endif
            for (int l = 0; l < 4; l++) {
                const int8_t *g = qt_grids.iq1s[p[2 + 4 * ib + l] | (((h >> (3 * l)) & 7) << 8)];
                for (int j = 0; j < 8; j++) q[32 * ib + 8 * l + j] = (int8_t)(8 * g[j] + delta);
            }
        }
        break;
    }
    case QT_IQ1_M: {   // qs[32], qh[16] (a nibble per 8 weights: 3 index bits, delta sign), 4 x uint16 scales
        uint16_t s4[4];
        memcpy(s4, p + 48, 8);
        const uint16_t dh = (uint16_t)((s4[0] >> 12) | ((s4[1] >> 8) & 0xF0) | ((s4[2] >> 4) & 0xF00) | (s4[3] & 0xF000));
        const uint8_t db[2] = {(uint8_t)dh, (uint8_t)(dh >> 8)};
        const float d = qt_f16(db);
        for (int s = 0; s < 16; s++) sc[s] = d * (float)(2 * ((s4[s / 4] >> (3 * (s & 3))) & 7) + 1) * 0.125f;
#if defined(SS_AVX2)
        for (int ib = 0; ib < 8; ib++) {
            const int n0 = p[32 + 2 * ib], n1 = p[33 + 2 * ib];   // the four groups' nibbles
            const int nib[4] = {n0 & 15, n0 >> 4, n1 & 15, n1 >> 4};
            const int8_t *e = (const int8_t *)p + 4 * ib;
            const __m256i g = qt_grid8x4(qt_grids.iq1s, (uint8_t)e[0] | (nib[0] & 7) << 8, (uint8_t)e[1] | (nib[1] & 7) << 8,
                                         (uint8_t)e[2] | (nib[2] & 7) << 8, (uint8_t)e[3] | (nib[3] & 7) << 8);
            const long long one = 0x0101010101010101LL, minus = -1LL;
            const __m256i delta = _mm256_set_epi64x(nib[3] & 8 ? minus : one, nib[2] & 8 ? minus : one, nib[1] & 8 ? minus : one,
                                                    nib[0] & 8 ? minus : one);
            qt_store(q + 32 * ib, qt_iq1_codes(g, delta));
        }
        if (0)
#endif
        for (int g = 0; g < 32; g++) {
            const int nib = (p[32 + g / 2] >> (4 * (g & 1))) & 15;
            const int8_t *gr = qt_grids.iq1s[p[g] | ((nib & 7) << 8)];
            const int delta = nib & 8 ? -1 : 1;
            for (int j = 0; j < 8; j++) q[8 * g + j] = (int8_t)(8 * gr[j] + delta);
        }
        break;
    }
    case QT_TQ2_0: {   // qs[64]: 2 bits per weight (0, 1, 2 = -1, 0, 1), then d
        const float d = qt_f16(p + 64);
#if defined(SS_AVX2)
        for (int c = 0; c < 2; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 32 * c));
            for (int s = 0; s < 4; s++) qt_store(q + 128 * c + 32 * s, _mm256_sub_epi8(qt_field(v, 2 * s, 3), _mm256_set1_epi8(1)));
        }
        if (0)
#endif
        for (int c = 0; c < 2; c++)
            for (int s = 0; s < 4; s++)
                for (int j = 0; j < 32; j++) q[128 * c + 32 * s + j] = (int8_t)(((p[32 * c + j] >> (2 * s)) & 3) - 1);
        for (int s = 0; s < 16; s++) sc[s] = d;
        break;
    }
    case QT_TQ1_0: {   // 48 bytes of 5 trits, 4 bytes of 4 trits (base 3, scaled to a byte), then d
        static const uint8_t pow3[5] = {1, 3, 9, 27, 81};
        const float d = qt_f16(p + 52);
        for (int n = 0; n < 5; n++) {
            for (int j = 0; j < 32; j++) q[32 * n + j] = (int8_t)((((uint8_t)(p[j] * pow3[n])) * 3 >> 8) - 1);
            for (int j = 0; j < 16; j++) q[160 + 16 * n + j] = (int8_t)((((uint8_t)(p[32 + j] * pow3[n])) * 3 >> 8) - 1);
        }
        for (int n = 0; n < 4; n++)
            for (int j = 0; j < 4; j++) q[240 + 4 * n + j] = (int8_t)((((uint8_t)(p[48 + j] * pow3[n])) * 3 >> 8) - 1);
        for (int s = 0; s < 16; s++) sc[s] = d;
        break;
    }
    case QT_MXFP4: {   // an E8M0 exponent, then 16 bytes of FP4 (E2M1) codes: low nibbles first
        const float d = qt_e8m0_half(p[0]);
#if defined(SS_AVX2)
        qt_store(q, _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)QT_MXFP4_VALUES)),
                                        qt_nibbles(p + 1)));
        if (0)
#endif
        for (int j = 0; j < 16; j++) q[j] = QT_MXFP4_VALUES[p[1 + j] & 15], q[16 + j] = QT_MXFP4_VALUES[p[1 + j] >> 4];
        sc[0] = sc[1] = d;
        break;
    }
    default:
        break;
    }
}
