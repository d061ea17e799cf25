// Batched fast-path products on Intel AMX tiles (Sapphire Rapids and later): q4 and q8 matrices against
// 2 to 8 activation rows, 16 weight rows at a time.
//
// Why: at batch 8 the AVX-512 paired kernels are bound by their two vector ports (~26 multiply-adds
// per cycle), so a batch-8 step costs ~2.2 batch-1 steps. One tile multiply (tdpbusd) does 16 weight
// rows x 8 activation rows x 32 codes in ~16 cycles, and what is left is the per-group scaling.
//
// The layout stays the one every other kernel reads (simd.h: q4 rows of K/2 bytes, group g at bytes
// 16g..16g+15, byte j = element j (low nibble) and j + 16 (high nibble)). Per group, the weights are the
// tiles' A operand and the activations their B operand:
//   A_lo = 16 rows x 16 low nibbles, A_hi = 16 rows x 16 high nibbles (unpacked four groups at a time:
//          one 64-byte load per row), q8: A = 16 rows x 32 codes read in place (row stride K);
//   B    = the activation codes of the group, four at a time across the 8 rows (VNNI order: row j of B
//          holds codes 4j..4j+3 of every activation row), built once per call (amx_prep);
//   C    = 16 x 8 exact int32 sums, scaled in fp32 as every fast kernel does:
//          y[n][m] += sc[n][g] d[m][g] C[n][m] + mn[n][g] s[m][g].
// A row's result therefore matches the paired AVX-512 kernel's to fp32 rounding (the int32 sums are the
// same; the order of the fp32 additions is not), not bitwise: the batched fast path on AMX machines
// depends on the batch by rounding. The exact path and batch 1 never come here.
#pragma once
#include <stdlib.h>

#include "simd.h"

#if defined(SS_AVX512) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define SS_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

// activation rows from which the tiles beat the paired kernels (benchmarks/amx_kernels.c, in cache: q4 at 2
// rows 0.68x, at 4 rows 1.22x; q8 at 2 rows 1.0x, at 4 rows 1.8x)
#define AMX_MIN_ROWS_Q4 4
#define AMX_MIN_ROWS_Q8 2
#ifndef AMX_PF_BLOCKS
#define AMX_PF_BLOCKS 2   // blocks of 16 weight rows prefetched ahead
#endif

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) SSTileCfg;

// tile registers (macros: the intrinsics paste their number into the instruction): four sums in flight,
// two weight and two activation operands taken in turn
#define T_C0 0
#define T_C1 1
#define T_C2 2
#define T_C3 3
#define T_A0 4
#define T_A1 5
#define T_B0 6
#define T_B1 7

// -1: not asked yet; 0: off (the kernel refused the tile state, SLIPSTREAM_AMX=0, or ss_set_amx(0)); 1: on
static int amx_usable = -1;

// Linux hands out the 8 KB tile state only to processes that ask for it (arch_prctl, 5.16 and later)
static int amx_request(void) {
    enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
    const char *env = getenv("SLIPSTREAM_AMX");
    if (env && env[0] == '0') return 0;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

static inline int amx_on(void) {
    if (amx_usable < 0) amx_usable = amx_request();   // benign race: every thread computes the same
    return amx_usable;
}

// The tile shapes, a constant: built on the stack, GCC dropped its field stores once the function was
// inlined (it does not see ldtilecfg read them) and the first tile load faulted.
static const SSTileCfg amx_cfg = {
    .palette = 1,
    // 16 weight rows x 8 int32 sums (C0-C3), 16 weight rows x 32 codes (A0, A1), 8 code quads x 8 rows (B0, B1)
    .colsb = {[T_C0] = 32, [T_C1] = 32, [T_C2] = 32, [T_C3] = 32, [T_A0] = 32, [T_A1] = 32, [T_B0] = 32, [T_B1] = 32},
    .rows = {[T_C0] = 16, [T_C1] = 16, [T_C2] = 16, [T_C3] = 16, [T_A0] = 16, [T_A1] = 16, [T_B0] = 8, [T_B1] = 8},
};

AI void amx_configure(void) { _tile_loadconfig(&amx_cfg); }

// The activation side of one call: B tiles and per-group scales for up to 8 rows (rows past nb are zero).
typedef struct {
    int32_t *b;   // [G][8 code quads][8 rows]: B of group g at b + 64 g (lo half: quads 0-3, hi: 4-7)
    float *d;     // [G][16]: the rows' scales d[m][g], twice (two weight rows share a vector)
    float *s;     // [G][16]: the rows' sums s[m][g] (d x sum of codes), twice
} AmxAct;

static __thread void *amx_buf;
static __thread int64_t amx_cap;

static AmxAct amx_prep(const int8_t *xq, const float *xd, const float *xs, int K, int nb) {
    const int G = K / 32;
    const int64_t need = (int64_t)G * (256 + 128);
    if (need > amx_cap) {
        free(amx_buf);
        amx_buf = aligned_alloc(64, (size_t)((need + 63) / 64 * 64));
        amx_cap = need;
    }
    AmxAct a = {(int32_t *)amx_buf, (float *)((char *)amx_buf + (int64_t)G * 256), NULL};
    a.s = a.d + (int64_t)G * 16;
    const __mmask8 live = (__mmask8)((1u << nb) - 1);   // rows past nb read as zero
    const __m256i rows = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(K / 4));
    const __m256i grow = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(G));
    for (int g = 0; g < G; g++) {
        for (int j = 0; j < 8; j++)   // code quad j of group g, across the rows
            _mm256_store_si256((__m256i *)(a.b + 64 * g + 8 * j),
                               _mm256_mmask_i32gather_epi32(_mm256_setzero_si256(), live, rows, xq + 32 * g + 4 * j, 4));
        const __m256 d = _mm256_mmask_i32gather_ps(_mm256_setzero_ps(), live, grow, xd + g, 4);
        const __m256 sm = _mm256_mmask_i32gather_ps(_mm256_setzero_ps(), live, grow, xs + g, 4);
        _mm512_store_ps(a.d + 16 * g, _mm512_insertf32x8(_mm512_castps256_ps512(d), d, 1));
        _mm512_store_ps(a.s + 16 * g, _mm512_insertf32x8(_mm512_castps256_ps512(sm), sm, 1));
    }
    return a;
}

// The scales (and offsets) of 16 rows for groups g4..g4+ng-1, as fp32 [16][4]; Q4_0 (no min plane, mn
// NULL on a q4 matrix): offsets -8 x scales; q8 (q4 = 0): no offsets.
AI void amx_scales(const void *sc, const void *mn, int half, int G, int64_t n, int g4, int ng, int q4,
                   float sw[16][4], float mw[16][4]) {
    if (ng == 4) {   // gathered into whole vectors: the epilogue's 64-byte loads then read whole stores
        // (four 16-byte stores read back as one vector wait for the stores to drain)
        const __m512 m8 = _mm512_set1_ps(-8.f);
        if (half) {   // a row's four fp16 values are one 64-bit element
            const __m512i rows = _mm512_mullo_epi64(_mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7), _mm512_set1_epi64(2 * G));
            for (int h = 0; h < 2; h++) {
                const int64_t o = (n + 8 * h) * G + g4;
                const __m512i s8 = _mm512_i64gather_epi64(rows, (const uint16_t *)sc + o, 1);
                const __m512 s0 = _mm512_cvtph_ps(_mm512_castsi512_si256(s8)), s1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(s8, 1));
                _mm512_store_ps(sw[8 * h], s0), _mm512_store_ps(sw[8 * h + 4], s1);
                if (!q4) continue;
                if (!mn) {
                    _mm512_store_ps(mw[8 * h], _mm512_mul_ps(s0, m8)), _mm512_store_ps(mw[8 * h + 4], _mm512_mul_ps(s1, m8));
                    continue;
                }
                const __m512i m = _mm512_i64gather_epi64(rows, (const uint16_t *)mn + o, 1);
                _mm512_store_ps(mw[8 * h], _mm512_cvtph_ps(_mm512_castsi512_si256(m)));
                _mm512_store_ps(mw[8 * h + 4], _mm512_cvtph_ps(_mm512_extracti64x4_epi64(m, 1)));
            }
        } else {   // lane l of vector v: row 4v + l / 4, group l % 4
            const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
            const __m512i rowq = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
            for (int v = 0; v < 4; v++) {
                const __m512i idx = _mm512_add_epi32(_mm512_mullo_epi32(rowq, _mm512_set1_epi32(G)), lane);
                const int64_t o = (n + 4 * v) * G + g4;
                const __m512 s = _mm512_i32gather_ps(idx, (const float *)sc + o, 4);
                _mm512_store_ps(sw[4 * v], s);
                if (q4) _mm512_store_ps(mw[4 * v], mn ? _mm512_i32gather_ps(idx, (const float *)mn + o, 4) : _mm512_mul_ps(s, m8));
            }
        }
        return;
    }
    for (int r = 0; r < 16; r++) {
        const int64_t o = (n + r) * G + g4;
        for (int i = 0; i < ng; i++) {
            const float s = half ? _cvtsh_ss(((const uint16_t *)sc)[o + i]) : ((const float *)sc)[o + i];
            sw[r][i] = s;
            mw[r][i] = !q4 ? 0.f : mn ? (half ? _cvtsh_ss(((const uint16_t *)mn)[o + i]) : ((const float *)mn)[o + i])
                                      : -8.f * s;
        }
    }
}

// acc[j] (weight rows 2j, 2j+1 x 8 activation rows) += the scaled sums of group g (its i-th in sw, mw) in c.
// sw and mw hold 4 rows' 4 groups per vector: one permutation gives a pair of rows' scale, 8 lanes each.
AI void amx_epilogue(__m512 acc[8], const int32_t *c, const AmxAct *a, int g, float sw[16][4],
                     float mw[16][4], int i, int q4) {
    const __m512 d = _mm512_load_ps(a->d + 16 * g), s = _mm512_load_ps(a->s + 16 * g);
    const __m512i pick0 = _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4), _mm512_set1_epi32(i));
    const __m512i pick1 = _mm512_add_epi32(pick0, _mm512_set1_epi32(8));
    for (int j = 0; j < 8; j++) {
        const __m512i pick = j & 1 ? pick1 : pick0;
        const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * j)), d);
        acc[j] = _mm512_fmadd_ps(v, _mm512_permutexvar_ps(pick, _mm512_load_ps(sw[4 * (j >> 1)])), acc[j]);
        if (q4) acc[j] = _mm512_fmadd_ps(_mm512_permutexvar_ps(pick, _mm512_load_ps(mw[4 * (j >> 1)])), s, acc[j]);
    }
}

// Groups g..g+3 (those below G) of 16 q4 rows as codes 0..15, row r at buf + 128 r: a row's 64 bytes
// (16 per group) become [g low nibbles 16 | g high nibbles 16 | g+1 low | g+1 high] ..., each group's 32
// codes in order
AI void amx_unpack(const uint8_t *w, int64_t row_bytes, int g, int G, uint8_t *buf) {
    const __m512i m4 = _mm512_set1_epi8(15);
    const __m512i mix0 = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), mix1 = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    const int ng = G - g < 4 ? G - g : 4;
    const __mmask64 k = ng == 4 ? ~0ULL : (1ULL << (16 * ng)) - 1;
    for (int r = 0; r < 16; r++) {
        const __m512i raw = _mm512_maskz_loadu_epi8(k, w + r * row_bytes + 16 * g);
        const __m512i lo = _mm512_and_si512(raw, m4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
        _mm512_store_si512(buf + 128 * r, _mm512_permutex2var_epi64(lo, mix0, hi));
        _mm512_store_si512(buf + 128 * r + 64, _mm512_permutex2var_epi64(lo, mix1, hi));
    }
}

// Weight rows [n0, n0 + 16 blocks) of a q4 (q4 = 1) or q8 matrix against the prepared activation rows:
// y[m * ystride + n] (=|+=) W[n] . X[m] (+ bias[n]) for m < nb.
// Group g's product goes to sum tile g % 4 and is scaled three groups later (amx_epilogue), so the
// tile unit works while the vector units scale: with one group in flight the two took turns.
// pf: prefetch the next block of 16 rows (within n_all rows) while this one multiplies: the hardware
// prefetchers alone do not follow 16 rows read 64 bytes at a time (the step's batch-8 gate/up products
// took as long as on the vector kernels without it).
AI void amx_rows_of(const void *wq, const void *sc, const void *mn, int half, const int q4, int K, int64_t n0,
                    int blocks, const AmxAct *a, int nb, const float *bias, float *y, int ystride,
                    int accumulate, int pf, int64_t n_all) {
    enum { LAG = 3 };
    const int G = K / 32;
    const int64_t row_bytes = q4 ? K / 2 : K;
    // q4: 16 rows x 4 groups of 32 codes (0..15), unpacked four groups ahead: tile loads of data that
    // vector stores have just written wait for the stores to drain (perf: the hottest instruction)
    _Alignas(64) uint8_t abuf[2][16 * 128];
    _Alignas(64) int32_t cbuf[2][16 * 8];   // sums stored one group before they are read
    _Alignas(64) float sw[2][16][4], mw[2][16][4], out[8 * 16];   // scales of two blocks of 4 groups
    const __m512i pick_m = _mm512_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120);
    amx_configure();
    for (int blk = 0; blk < blocks; blk++) {
        const int64_t n = n0 + 16 * (int64_t)blk;
        const uint8_t *w = (const uint8_t *)wq + n * row_bytes;
        __m512 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm512_setzero_ps();
#define AMX_STORE_C(t) switch ((t) & 3) { \
            case 0: _tile_stored(T_C0, cbuf[(t) & 1], 32); break; case 1: _tile_stored(T_C1, cbuf[(t) & 1], 32); break; \
            case 2: _tile_stored(T_C2, cbuf[(t) & 1], 32); break; default: _tile_stored(T_C3, cbuf[(t) & 1], 32); }
#define AMX_SCALE(p) amx_epilogue(acc, cbuf[(p) & 1], a, (p), sw[((p) >> 2) & 1], mw[((p) >> 2) & 1], (p) & 3, q4)
        if (q4) amx_unpack(w, row_bytes, 0, G, abuf[0]);
        for (int g = 0; g < G; g++) {
            const int i = g & 3;
            if (i == 0) {
                const int ng = G - g < 4 ? G - g : 4;
                if (pf && n + 16 * (AMX_PF_BLOCKS + 1) <= n_all) {   // a later block's same 4 groups
                    const uint8_t *nx = w + 16 * AMX_PF_BLOCKS * row_bytes + (q4 ? 16 : 32) * (int64_t)g;
                    for (int r = 0; r < 16; r++) {
                        __builtin_prefetch(nx + r * row_bytes, 0, 2);
                        if (!q4) __builtin_prefetch(nx + r * row_bytes + 64, 0, 2);
                    }
                    if (g == 0) {   // and its scales and mins, contiguous
                        const int64_t esz = half ? 2 : 4, at = (n + 16 * AMX_PF_BLOCKS) * G * esz;
                        for (int64_t o = 0; o < 16 * G * esz; o += 64) {
                            __builtin_prefetch((const char *)sc + at + o, 0, 2);
                            if (mn) __builtin_prefetch((const char *)mn + at + o, 0, 2);
                        }
                    }
                }
                amx_scales(sc, mn, half, G, n, g, ng, q4, sw[(g >> 2) & 1], mw[(g >> 2) & 1]);
                if (q4 && g + 4 < G) amx_unpack(w, row_bytes, g + 4, G, abuf[((g >> 2) + 1) & 1]);
            }
            const void *A = q4 ? (const void *)(abuf[(g >> 2) & 1] + 32 * i) : (const void *)(w + 32 * g);
            const int64_t astride = q4 ? 128 : row_bytes;
            if (g & 1) {
                _tile_loadd(T_A1, A, astride);
                _tile_loadd(T_B1, a->b + 64 * g, 32);
            } else {
                _tile_loadd(T_A0, A, astride);
                _tile_loadd(T_B0, a->b + 64 * g, 32);
            }
#define AMX_DP(C) if (g & 1) { if (q4) _tile_dpbusd(C, T_A1, T_B1); else _tile_dpbssd(C, T_A1, T_B1); } \
                  else { if (q4) _tile_dpbusd(C, T_A0, T_B0); else _tile_dpbssd(C, T_A0, T_B0); }
            switch (i) {
            case 0: _tile_zero(T_C0); AMX_DP(T_C0) break;
            case 1: _tile_zero(T_C1); AMX_DP(T_C1) break;
            case 2: _tile_zero(T_C2); AMX_DP(T_C2) break;
            default: _tile_zero(T_C3); AMX_DP(T_C3)
            }
#undef AMX_DP
            // the sums of group g - LAG stored, those of g - LAG - 1 (stored a group ago: a tile store
            // reaches the vector loads late) scaled while this group multiplies
            if (g >= LAG) AMX_STORE_C(g - LAG)
            if (g > LAG) AMX_SCALE(g - LAG - 1);
        }
        for (int p = G > LAG ? G - LAG : 0; p <= G; p++) {
            if (p < G) AMX_STORE_C(p)
            if (p > 0 && p - 1 >= G - LAG - 1) AMX_SCALE(p - 1);
        }
#undef AMX_SCALE
#undef AMX_STORE_C
        for (int j = 0; j < 8; j++) _mm512_store_ps(out + 16 * j, acc[j]);
        const __m512 b16 = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
        for (int m = 0; m < nb; m++) {   // activation row m's 16 results: lanes m and 8 + m of the pairs
            float *yo = y + (int64_t)m * ystride + n;
            __m512 v = _mm512_add_ps(_mm512_i32gather_ps(pick_m, out + m, 4), b16);
            if (accumulate) v = _mm512_add_ps(_mm512_loadu_ps(yo), v);
            _mm512_storeu_ps(yo, v);
        }
    }
    _tile_release();
}
// one copy per kind, so the group loop has no branch on it
__attribute__((noinline)) static void amx_rows_q4(const void *wq, const void *sc, const void *mn, int half, int K,
                                                  int64_t n0, int blocks, const AmxAct *a, int nb, const float *bias,
                                                  float *y, int ystride, int accumulate, int pf, int64_t n_all) {
    amx_rows_of(wq, sc, mn, half, 1, K, n0, blocks, a, nb, bias, y, ystride, accumulate, pf, n_all);
}
__attribute__((noinline)) static void amx_rows_q8(const void *wq, const void *sc, int half, int K, int64_t n0,
                                                  int blocks, const AmxAct *a, int nb, const float *bias, float *y,
                                                  int ystride, int accumulate, int pf, int64_t n_all) {
    amx_rows_of(wq, sc, NULL, half, 0, K, n0, blocks, a, nb, bias, y, ystride, accumulate, pf, n_all);
}
static void amx_rows(const void *wq, const void *sc, const void *mn, int half, int q4, int K, int64_t n0,
                     int blocks, const AmxAct *a, int nb, const float *bias, float *y, int ystride,
                     int accumulate, int pf, int64_t n_all) {
    if (q4) amx_rows_q4(wq, sc, mn, half, K, n0, blocks, a, nb, bias, y, ystride, accumulate, pf, n_all);
    else amx_rows_q8(wq, sc, half, K, n0, blocks, a, nb, bias, y, ystride, accumulate, pf, n_all);
}
#endif
