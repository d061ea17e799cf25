// The fast path's q4 and q8 products on AVX-512 VNNI CPUs: one arithmetic, two kernels, bitwise alike.
//
// The arithmetic: each group of 32 codes gets its exact int32 sum against the activation row's int8 codes,
// then per output (weight row n, activation row m), the even groups in order into one sum and the odd
// groups into another,
//     acc[g % 2] = fma(float(sum) * d[m][g], sc[n][g], acc[g % 2]);  acc[g % 2] = fma(mn[n][g], s[m][g], acc[g % 2])
// (mn: q4 only), and the output is acc[0] + acc[1]. Two sums, because the tiles multiply groups in pairs
// and keep a pair's two groups in neighbouring lanes (amx_epilogue).
// The kernels:
//   * AMX tiles (Sapphire Rapids and later), for 6+ (q4) or 2+ (q8) activation rows, 16 weight rows at a
//     time. Why: at batch 8 the paired AVX-512 kernels are bound by their two vector ports (~26
//     multiply-adds per cycle); one tile multiply does 16 weight rows x 8 activation rows x 32 codes in ~16
//     cycles. Per group, the weights are the A operand (q4 rows unpacked to codes 0-15, four groups per
//     64-byte load; q8 rows read in place), the activation codes the B operand (VNNI order: row j of B holds
//     codes 4j..4j+3 of every activation row; amx_prep), C = 16 x 8 int32 sums, scaled by amx_epilogue.
//   * The vector twin (twin_rows_*), for every other row (one row, fewer rows than the tiles take, rows past
//     a range's last block of 16; every row on VNNI CPUs without AMX): 512-bit vpdpbusd over four groups of
//     a row, the partial sums reduced and transposed so that lanes are weight rows, the same fp32 sequence.
//     By default those rows now go to simd.h's 8-row kernels (q4i_rows8, q8i_rows8 with eo = 1: the same
//     arithmetic, bitwise, and faster at one row); the twin stays for ss_set_rows8(0).
// So a row's result never depends on what shares its step (speculative verification, prompt chunks beside
// decode rows), as with the paired kernels on other CPUs. The exact path never comes here. The weights keep
// the layout every kernel reads (simd.h: q4 rows of K/2 bytes, group g at bytes 16g..16g+15, byte j =
// element j (low nibble) and j + 16 (high nibble)); the scales are read from a tile-ordered copy of their
// planes where the loader made one (tile_scales).
#pragma once
#include <stdlib.h>

#include "simd.h"

// SS_TWIN: the vector twin (and the scale reading it shares with the tiles) needs 512-bit VNNI; SS_AMX adds
// the tiles. On an AVX-512 VNNI machine without AMX every fast q4/q8 product runs on the twin.
#if defined(SS_AVX512) && defined(__AVX512VNNI__)
#define SS_TWIN 1
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define SS_AMX 1   // the tiles' code is below; defined here so the twin's row threshold can ask for it
#endif
#include <cpuid.h>   // x86 only: here, not above (Arm builds include this file too)

SS_SHARED int twin_usable = 1;   // ss_set_twin; SLIPSTREAM_TWIN=0 at load: the AVX2 builds' kernels instead
__attribute__((constructor)) static void twin_default(void) {
    const char *env = getenv("SLIPSTREAM_TWIN");
    if (env && env[0] == '0') twin_usable = 0;
}

// AMD's CPU family by CPUID (0 on other vendors)
static unsigned amd_family(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return 0;
    const int amd = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;   // "AuthenticAMD"
    if (!amd || !__get_cpuid(1, &a, &b, &c, &d)) return 0;
    const unsigned base = (a >> 8) & 0xf;
    return base == 0xf ? base + ((a >> 20) & 0xff) : base;
}
// Whether the twin beats the 8-row kernels from 2 activation rows on: AMD family 0x19 (Zen 4) and later, by CPUID.
// Zen 5 (0x1A) runs 512-bit vpdpbusd at the 256-bit one's instruction rate (twice the multiply-adds per cycle:
// full-width vector units); Zen 4 runs it as double-pumped halves and Sapphire Rapids on one 512-bit port against
// two 256-bit ones (half the rate), yet on Zen 4 twin16 still wins from 2 rows (below). A timing probe at load (16
// independent chains of each width, best of 5) was tried first: in fresh processes on the Zen 5 EPYC it read
// 1.08-2.73x for the 512-bit pass while the host's other tenants shared the cores' vector units, and so chose the
// slow path in up to 3 starts of 4; the CPU's identity does not change with the neighbours.
// Only speed depends on it: the twin and the 8-row kernels give the same bits (below).
static int twin_from_two_rows(void) { return amd_family() >= 0x19; }

// Activation rows from which the fast path's q4/q8 products run on the 512-bit twin instead of the 8-row
// kernels (same bits): 2 where 512-bit vpdpbusd is wide (the Zen 5 EPYC's steps, step_ab.py --setting twin-rows: 2 rows
// 0.90x, 4 rows 0.89x, 8 rows 0.80-0.84x, a 512-token prompt chunk 0.89x; 1 row on a par), else
// TWIN_FROM_ROWS_NARROW (on the Sapphire Rapids Xeon the twin is 1.05x slower at 1 row, the tiles take 6+ rows);
// 2 on Zen 4 too (AMD family 0x19 with AVX-512: double-pumped 512-bit units), where twin16
// beats the 8-row kernels from 2 rows (the Zen 4 EPYC, default model, step_ab.py --setting twin-rows --prefetch 6 2,
// two threads: 2 rows 0.931x, 0.967x, 0.943x, 0.924x; 4 rows 0.891-0.934x, 0.873x; one thread: 2 rows 1.046x slower,
// 4 rows 0.967x). At one row it is on a par with two threads (0.983-1.027x) and 1.10x slower on one, so that row
// stays on the 8-row kernels.
// SLIPSTREAM_TWIN_ROWS=N at load, or ss_set_twin_rows(N), sets it.
SS_SHARED int twin_from_rows = -1;
// Where 512-bit vpdpbusd is not wide: with AMX (the Sapphire Rapids Xeon) the tiles take the batches and the twin
// never; without it (the Emerald Rapids Xeon, model 207, whose hypervisor reports no AMX) the twin16 products
// from 6 rows (step_ab.py --setting twin-rows --prefetch 9 2, default model: batch 8 0.88x, 0.89x, 0.87x,
// batch 6 0.93x, batch 4 on a par, batch 2 1.16x slower, a 512-token chunk 1.07x in one noisy pair) and the
// 16-row IQ kernels (kernel_rate.py --rows 8: IQ4_XS, IQ2_XS, Q3_K 1.3-1.6x faster) take them.
// Which of the two holds is asked of the kernel at load (amx_on): a build with AMX whose kernel refuses the tile
// state, or SLIPSTREAM_AMX=0, is a build without tiles.
#define TWIN_FROM_ROWS_TILES (MAX_ROWS + 1)
#define TWIN_FROM_ROWS_NARROW 6
#ifdef SS_AMX
static inline int amx_on(void);
#endif
static int twin_rows_narrow(void) {
#ifdef SS_AMX
    return amx_on() ? TWIN_FROM_ROWS_TILES : TWIN_FROM_ROWS_NARROW;
#else
    return TWIN_FROM_ROWS_NARROW;
#endif
}
// Activation rows from which the IQ4 layouts and the per-16 IQ planes multiply 16 weight rows at a time
// (qt_rbnl_rows16, qt_rb16_rows16) rather than 8 (the same bits): no tiles take these types, so AMX does not
// enter into it. 2 on every CPU measured: the Zen 5 EPYC (wide 512-bit vpdpbusd: as its twin_from_rows); on the
// Sapphire Rapids Xeon (with AMX) one core's rate at 2, 4, 6, 8 rows 1.12-1.25x, 1.13-1.23x, 1.20-1.33x,
// 1.23-1.33x (IQ4_XS, IQ2_XS, Q3_K, kernel_rate.py) and an IQ4 file's step at batch 2, 4, 8 0.96x, 0.93x, 0.92x
// (step_ab.py --setting iq16-rows), and the Emerald Rapids Xeon's 8-row rate 1.3-1.6x. SLIPSTREAM_IQ16_ROWS=N at
// load, or ss_set_iq16_rows(N), sets it.
#define IQ16_FROM_ROWS 2
SS_SHARED int iq16_from_rows = -1;
// whether those rows take the twin with lanes = weight rows (twin16_rows_*, the default) or the reducing one
// (twin_rows_*): ss_set_twin16, SLIPSTREAM_TWIN16=0 at load (A/B; the same bits)
SS_SHARED int twin16_usable = 1;
__attribute__((constructor)) static void twin_rows_default(void) {
    const char *env = getenv("SLIPSTREAM_TWIN_ROWS");
    twin_from_rows = env && *env ? atoi(env) : twin_from_two_rows() ? 2 : twin_rows_narrow();
    const char *iq = getenv("SLIPSTREAM_IQ16_ROWS");
    iq16_from_rows = iq && *iq ? atoi(iq) : IQ16_FROM_ROWS;
    const char *t16 = getenv("SLIPSTREAM_TWIN16");
    if (t16 && t16[0] == '0') twin16_usable = 0;
}

// activation rows from which the tiles beat the twin (batch steps in process, step_ab.py --setting amx: q4
// tiles at 4 rows 1.125x the twin's step, at 6 rows 0.95x, at 8 rows 0.81x; q8 in cache: at 2 rows on a par,
// at 4 rows 1.7x faster)
#define AMX_MIN_ROWS_Q4 6
#define AMX_MIN_ROWS_Q8 2
#ifndef AMX_PF_BLOCKS
#define AMX_PF_BLOCKS 2   // blocks of 16 weight rows prefetched ahead
#endif
#ifndef TWIN_PF_BLOCKS
#define TWIN_PF_BLOCKS 1   // for the twin (step_ab.py, batch 1: 1 block 1.01x the paired kernels' step, 2 1.04x, 4 1.10x)
#endif

// The scales (and offsets) of rows n.. (live of them; the others read row n's or 0) for groups g4.. (ng of them;
// the others 0), lanes = rows: sw[i][r] is row r's scale of group g4 + i. Q4_0 (no min plane, mn NULL on a q4
// matrix): offsets -8 x scales; q8 (q4 = 0): none. st/mt: the planes as [N/16][G][16] (weights/quant.py builds
// them where ss_tile_planes says so; NULL: read the [N][G] planes, gathered)
static const uint16_t twin_by_group[2][32] __attribute__((aligned(64))) = {   // lane l: row l % 16, group l / 16 (+2)
    {0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61},
    {2, 6, 10, 14, 18, 22, 26, 30, 34, 38, 42, 46, 50, 54, 58, 62, 3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47, 51, 55, 59, 63},
};
AI void twin_half4(const uint16_t *p, int G, float out[4][16]) {   // 16 rows x 4 fp16 values of a plane at p
    // each row's 8 bytes copied through a general register (load and store ports only: the vector units
    // are this kernel's bottleneck, and a gather of them cost a third of the batch-1 product)
    _Alignas(64) uint64_t rows[16];
    for (int r = 0; r < 16; r++) memcpy(&rows[r], p + (int64_t)r * G, 8);
    const __m512i lo = _mm512_load_si512(rows), hi = _mm512_load_si512(rows + 8);
    for (int h = 0; h < 2; h++) {
        const __m512i v = _mm512_permutex2var_epi16(lo, _mm512_load_si512(twin_by_group[h]), hi);
        _mm512_store_ps(out[2 * h], _mm512_cvtph_ps(_mm512_castsi512_si256(v)));
        _mm512_store_ps(out[2 * h + 1], _mm512_cvtph_ps(_mm512_extracti64x4_epi64(v, 1)));
    }
}
//
// A Q4_K matrix's compact copy (half & 2; weights/quant.py, Linear.kq): per block of 16 rows, its groups' 6-bit
// scales [G][16] (bytes) then its super-blocks' fp16 d [G/8][16] in st, the 6-bit mins and dmin likewise in mt:
// 20 G bytes per 16 rows instead of the fp32 planes' 64 G. d x scale and -(dmin x min) are exact in fp32, so
// the lanes hold the very values of the planes (gguf.py's _q4k_linear).
AI __m512 tile_k_lanes(const uint8_t *blk, int G, int g) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 16 * (int64_t)G + 32 * (g >> 3))));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 16 * g)))), d);
}
AI void tile_scales(const void *sc, const void *mn, const void *st, const void *mt, int half, int q4, int G, int64_t n,
                    int live, int g4, int ng, float sw[4][16], float mw[4][16]) {
    if ((half & 2) && (n & 15) == 0) {   // a Q4_K matrix's compact copy
        const uint8_t *bs = (const uint8_t *)st + (n >> 4) * 20 * (int64_t)G, *bm = (const uint8_t *)mt + (n >> 4) * 20 * (int64_t)G;
        const __m512i sign = _mm512_set1_epi32((int)0x80000000);
        for (int i = 0; i < 4; i++) {
            __m512 v = _mm512_setzero_ps(), o = _mm512_setzero_ps();
            if (i < ng) {   // the offsets negated by their sign bit, as -(dmin x min) is (a zero included)
                v = tile_k_lanes(bs, G, g4 + i);
                o = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(tile_k_lanes(bm, G, g4 + i)), sign));
            }
            _mm512_store_ps(sw[i], v), _mm512_store_ps(mw[i], o);
        }
        return;
    }
    if (half & 2) {   // rows from n off a block of 16: each lane from its own block of the compact copy (sc and mn
                      // then hold the 6-bit scales, not planes; the rows past `live` read row n's)
        for (int r = 0; r < 16; r++) {
            const int64_t row = n + (r < live ? r : 0), at = (row >> 4) * 20 * (int64_t)G;
            const int lane = (int)(row & 15);
            const uint8_t *bs = (const uint8_t *)st + at, *bm = (const uint8_t *)mt + at;
            for (int i = 0; i < 4; i++) {
                const int g = g4 + i;
                const float d = ss_half_to_f32(((const uint16_t *)(bs + 16 * (int64_t)G + 32 * (g >> 3)))[lane]);
                const float dmin = ss_half_to_f32(((const uint16_t *)(bm + 16 * (int64_t)G + 32 * (g >> 3)))[lane]);
                sw[i][r] = i >= ng ? 0.f : d * (float)bs[16 * g + lane];
                mw[i][r] = i >= ng ? 0.f : -(dmin * (float)bm[16 * g + lane]);
            }
        }
        return;
    }
    half &= 1;   // from here on: whether the [N][G] planes (and a plain tile-ordered copy) are fp16
    if (st && (n & 15) == 0) {   // the planes' tile-ordered copy: a group's 16 rows side by side
        const int64_t at = ((n >> 4) * G + g4) * 16;
        for (int i = 0; i < 4; i++) {
            __m512 v = _mm512_setzero_ps(), o = _mm512_setzero_ps();
            if (i < ng) {
                v = half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)st + at + 16 * i)))
                         : _mm512_loadu_ps((const float *)st + at + 16 * i);
                o = !q4 ? o : !mt ? _mm512_mul_ps(v, _mm512_set1_ps(-8.f))
                  : half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)mt + at + 16 * i)))
                         : _mm512_loadu_ps((const float *)mt + at + 16 * i);
            }
            _mm512_store_ps(sw[i], v), _mm512_store_ps(mw[i], o);
        }
        return;
    }
    if (live == 16 && ng == 4) {
        const int64_t o = n * G + g4;
        if (half) {
            twin_half4((const uint16_t *)sc + o, G, sw);
            if (q4 && mn) twin_half4((const uint16_t *)mn + o, G, mw);
        } else {
            const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                    _mm512_set1_epi32(G));
            for (int i = 0; i < 4; i++) {
                _mm512_store_ps(sw[i], _mm512_i32gather_ps(rows, (const float *)sc + o + i, 4));
                if (q4 && mn) _mm512_store_ps(mw[i], _mm512_i32gather_ps(rows, (const float *)mn + o + i, 4));
            }
        }
        if (q4 && !mn)
            for (int i = 0; i < 4; i++) _mm512_store_ps(mw[i], _mm512_mul_ps(_mm512_load_ps(sw[i]), _mm512_set1_ps(-8.f)));
        return;
    }
    for (int i = 0; i < 4; i++)
        for (int r = 0; r < 16; r++) {
            const int64_t e = ((n + (r < live ? r : 0)) * G + g4 + i) * (half ? 2 : 4);   // byte offset
            const float v = i >= ng ? 0.f : q4p_scale1((const char *)sc + e, half, 0);
            sw[i][r] = v;
            mw[i][r] = !q4 || i >= ng ? 0.f : mn ? q4p_scale1((const char *)mn + e, half, 0) : -8.f * v;
        }
}

// Into L2, the scales and mins of the block of 16 rows from n (contiguous in either layout: the tile-ordered
// copy when there is one, which is what the kernels then read)
AI void amx_prefetch_scales(const void *sc, const void *mn, const void *st, const void *mt, int half, int G, int64_t n) {
    const int compact = st && (half & 2), tiles = compact || (st && (n & 15) == 0);   // compact: sc holds no planes
    const int64_t esz = (half & 1) ? 2 : 4, at = compact ? (n >> 4) * 20 * (int64_t)G : n * G * esz;
    const int64_t len = compact ? 20 * (int64_t)G : 16 * G * esz;
    const char *s = (const char *)(tiles ? st : sc), *m = (const char *)(tiles ? mt : mn);
    for (int64_t o = 0; o < len; o += 64) {
        __builtin_prefetch(s + at + o, 0, 2);
        if (m) __builtin_prefetch(m + at + o, 0, 2);
    }
}

// Into L2, for the block of 16 rows from n (a later block than the one being multiplied): the codes of
// groups g..g+3 of rows r0..r1 and, with g = 0 and r0 = 0, the block's scales and mins
AI void amx_prefetch_later(const void *wq, const void *sc, const void *mn, const void *st, const void *mt, int half,
                           int q4, int G, int64_t row_bytes, int64_t n, int g, int r0, int r1) {
    const uint8_t *nx = (const uint8_t *)wq + n * row_bytes + (q4 ? 16 : 32) * (int64_t)g;
    for (int r = r0; r < r1; r++) {
        __builtin_prefetch(nx + r * row_bytes, 0, 2);
        if (!q4) __builtin_prefetch(nx + r * row_bytes + 64, 0, 2);
    }
    if (g == 0 && r0 == 0) amx_prefetch_scales(sc, mn, st, mt, half, G, n);
}

// Into L2, for the block of 16 rows from n (a later block than the one being multiplied): part `part` of `parts` of
// its lines in address order (its rows are one run of bytes), and its scales with part 0. A kernel spreads a block's
// parts over its steps: a burst of 16 prefetches holds the L1's fill buffers at once and stalls what follows. Against
// one line per row and quad of groups (amx_prefetch_later; a row's 64 bytes of a quad straddle two lines where rows are
// not 64-byte multiples, K = 576 among them), amx_kernels.c's tiles at 8 rows: q4 in cache 1.07-1.15x, L3-sized 1.06x,
// DRAM-sized 1.09-1.11x (two at once 1.09x), q8 1.02-1.05x
AI void amx_prefetch_part(const void *wq, const void *sc, const void *mn, const void *st, const void *mt, int half,
                          int64_t row_bytes, int G, int64_t n, int part, int parts) {
    const char *ahead = (const char *)wq + n * row_bytes;
    const int64_t lines = 16 * row_bytes / 64, per = (lines + parts - 1) / parts;
    for (int64_t l = part * per; l < (part + 1) * per && l < lines; l++) __builtin_prefetch(ahead + 64 * l, 0, 2);
    if (part == 0) amx_prefetch_scales(sc, mn, st, mt, half, G, n);
}

// a thread's scratch of at least `need` bytes, 64-byte aligned, grown (never shrunk) on demand
AI void *amx_scratch(void **buf, int64_t *cap, int64_t need) {
    if (need > *cap) {
        free(*buf);
        *buf = aligned_alloc(64, (size_t)((need + 63) / 64 * 64));
        *cap = need;
    }
    return *buf;
}

#endif

#ifdef SS_AMX
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) SSTileCfg;

// tile registers (macros: the intrinsics paste their number into the instruction): two sums in flight,
// two weight and two activation operands taken in turn
#define T_C0 0
#define T_C1 1
#define T_A0 4
#define T_A1 5
#define T_B0 6
#define T_B1 7

// -1: not asked yet; 0: off (the kernel refused the tile state, SLIPSTREAM_AMX=0, or ss_set_amx(0)); 1: on
SS_SHARED int amx_usable = -1;

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
// One multiply takes a PAIR of groups (64 codes) at full tile size: A = 16 weight rows x 64 codes (groups g
// and g+1 side by side, as the rows hold them), B = block-diagonal: its columns 0-7 are the activation rows'
// codes of group g (code quads 0-7, zero for quads 8-15), columns 8-15 those of group g+1 (zero for quads
// 0-7). C's row r then holds weight row r's sums of group g against the 8 activation rows, then of group g+1.
// The columns interleave: column 2m is activation row m against group g, 2m + 1 against group g+1, so C's
// row r holds the pair's sums side by side per activation row. Half of B's bytes are zeros, but a
// 16 x 16 x 64 multiply costs the tile unit what the 16 x 8 x 32 one of a single group did (the same 16 A
// rows go through), so each group costs half the tile time.
static const SSTileCfg amx_cfg = {
    .palette = 1,
    .colsb = {[T_C0] = 64, [T_C1] = 64, [T_A0] = 64, [T_A1] = 64, [T_B0] = 64, [T_B1] = 64},
    .rows = {[T_C0] = 16, [T_C1] = 16, [T_A0] = 16, [T_A1] = 16, [T_B0] = 16, [T_B1] = 16},
};

AI void amx_configure(void) { _tile_loadconfig(&amx_cfg); }

// The activation side of one call: B tiles and per-group scales for up to 8 rows (rows past nb are zero).
typedef struct {
    int32_t *b;   // [(G + 1) / 2][16 code quads][16 columns]: B of group pair p at b + 256 p (see amx_cfg)
    float *d;     // [(G + 1) / 2][8 rows][2]: the rows' scales d[m][g] of pair p's groups, lane 2m + g % 2
    float *s;     // likewise the rows' sums s[m][g] (d x sum of codes)
} AmxAct;

static __thread void *amx_buf;
static __thread int64_t amx_cap;

static AmxAct amx_prep(const int8_t *xq, const float *xd, const float *xs, int K, int nb) {
    const int G = K / 32, P = (G + 1) / 2;
    char *buf = amx_scratch(&amx_buf, &amx_cap, (int64_t)P * (1024 + 128));
    AmxAct a = {(int32_t *)buf, (float *)(buf + (int64_t)P * 1024), NULL};
    a.s = a.d + (int64_t)P * 16;
    const __mmask8 live = (__mmask8)((1u << nb) - 1);   // rows past nb read as zero
    const __m256i rows = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(K / 4));
    const __m256i grow = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(G));
    const __m256i zero = _mm256_setzero_si256();
    for (int g = 0; g < 2 * P; g++) {
        const int h = g & 1;   // group g's quads are B's rows 8h..8h+7, its columns 2m + h; the others zero
        int32_t *b = a.b + 256 * (g >> 1) + 128 * h;
        for (int j = 0; j < 8; j++) {   // code quad j of group g, across the rows, zero-extended to 64 bits
            const __m256i q = g < G ? _mm256_mmask_i32gather_epi32(zero, live, rows, xq + 32 * g + 4 * j, 4) : zero;
            const __m512i wide = _mm512_cvtepu32_epi64(q);
            _mm512_store_si512(b + 16 * j, h ? _mm512_slli_epi64(wide, 32) : wide);
        }
        const __m256 d = g < G ? _mm256_mmask_i32gather_ps(_mm256_setzero_ps(), live, grow, xd + g, 4) : _mm256_setzero_ps();
        const __m256 sm = g < G ? _mm256_mmask_i32gather_ps(_mm256_setzero_ps(), live, grow, xs + g, 4) : _mm256_setzero_ps();
        float *dp = a.d + 16 * (g >> 1) + h, *sp = a.s + 16 * (g >> 1) + h;
        _Alignas(32) float dv[8], sv[8];
        _mm256_store_ps(dv, d), _mm256_store_ps(sv, sm);
        for (int m = 0; m < 8; m++) dp[2 * m] = dv[m], sp[2 * m] = sv[m];
    }
    return a;
}

// acc[r] (weight row r: lane 2m + h is activation row m's sum of the pair's even (h = 0) or odd group) +=
// the scaled sums of pair p in c (C: row r = [m: group g, group g+1] for m = 0..7); sw, mw: [4][16] the
// block's scales and offsets of four groups (tile_scales), the pair's first at index i. A weight row's two
// scales side by side are one 64-bit broadcast load, so every operation here is on all 16 lanes and none
// is a per-row permute.
static const int32_t amx_pair_lo[16] __attribute__((aligned(64))) = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
static const int32_t amx_pair_hi[16] __attribute__((aligned(64))) = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
AI __m512 amx_bcast_pair(const float *p) { return _mm512_castpd_ps(_mm512_set1_pd(*(const double *)p)); }
AI void amx_epilogue(__m512 acc[16], const int32_t *c, const AmxAct *a, int p, const float (*sw)[16],
                     const float (*mw)[16], int i, int q4) {
    _Alignas(64) float ws[32], ms[32];   // row r's scales (offsets) of the pair's two groups at 2r, 2r + 1
    const __m512i lo = _mm512_load_si512(amx_pair_lo), hi = _mm512_load_si512(amx_pair_hi);
    const __m512 w0 = _mm512_load_ps(sw[i]), w1 = _mm512_load_ps(sw[i + 1]);
    _mm512_store_ps(ws, _mm512_permutex2var_ps(w0, lo, w1)), _mm512_store_ps(ws + 16, _mm512_permutex2var_ps(w0, hi, w1));
    if (q4) {
        const __m512 o0 = _mm512_load_ps(mw[i]), o1 = _mm512_load_ps(mw[i + 1]);
        _mm512_store_ps(ms, _mm512_permutex2var_ps(o0, lo, o1)), _mm512_store_ps(ms + 16, _mm512_permutex2var_ps(o0, hi, o1));
    }
    // read back from memory: seeing the stores, GCC would otherwise take each broadcast from the register
    // (a move, an unpack or extract, and a register broadcast: three shuffles on the one port that does them)
    __asm__ volatile("" : : "r"(ws), "r"(ms) : "memory");
    const __m512 d = _mm512_load_ps(a->d + 16 * p), s = _mm512_load_ps(a->s + 16 * p);
    for (int r = 0; r < 16; r++) {
        const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * r)), d);
        acc[r] = _mm512_fmadd_ps(v, amx_bcast_pair(ws + 2 * r), acc[r]);
        if (q4) acc[r] = _mm512_fmadd_ps(amx_bcast_pair(ms + 2 * r), s, acc[r]);
    }
}

// Groups g..g+3 (those below G) of 16 q4 rows as codes 0..15, row r at buf + 128 r: a row's 64 bytes
// (16 per group) become [g low nibbles 16 | g high nibbles 16 | g+1 low | g+1 high] ..., each group's 32
// codes in order (a pair of groups: 64 bytes, one A row)
AI void amx_unpack(const uint8_t *w, int64_t row_bytes, int g, int G, uint8_t *buf) {
    const __m512i m4 = _mm512_set1_epi8(15);
    const __m512i mix0 = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), mix1 = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    const int ng = G - g < 4 ? G - g : 4;
    const __mmask64 k = ng == 4 ? ~0ULL : (1ULL << (16 * ng)) - 1;
    for (int r = 0; r < 16; r++) {
        const __m512i raw = _mm512_maskz_loadu_epi8(k, w + r * row_bytes + 16 * g);
        const __m512i lo = _mm512_and_si512(raw, m4), hi = ss_hi4_512(raw, m4);
        _mm512_store_si512(buf + 128 * r, _mm512_permutex2var_epi64(lo, mix0, hi));
        _mm512_store_si512(buf + 128 * r + 64, _mm512_permutex2var_epi64(lo, mix1, hi));
    }
}

// Weight rows [n0, n0 + 16 blocks) of a q4 (q4 = 1) or q8 matrix against the prepared activation rows:
// y[m * ystride + n] (=|+=) W[n] . X[m] (+ bias[n]) for m < nb.
// Pair p's product goes to sum tile p % 2, is stored one pair later and scaled the pair after that
// (amx_epilogue), so the tile unit works while the vector units scale, and a tile store reaches the vector
// loads that read it a pair after it was issued.
// pf: prefetch the next block of 16 rows (within n_all rows) while this one multiplies: the hardware
// prefetchers alone do not follow 16 rows read 64 bytes at a time (the step's batch-8 gate/up products
// took as long as on the vector kernels without it).
AI void amx_rows_of(const void *wq, const void *sc, const void *mn, const void *st, const void *mt, int half,
                    const int q4, int K, int64_t n0,
                    int blocks, const AmxAct *a, int nb, const float *bias, float *y, int ystride,
                    int accumulate, int pf, int64_t n_all) {
    const int G = K / 32, P = (G + 1) / 2;
    const int64_t row_bytes = q4 ? K / 2 : K;
    // q4: 16 rows x 4 groups of 32 codes (0..15), unpacked four groups ahead: tile loads of data that
    // vector stores have just written wait for the stores to drain (perf: the hottest instruction)
    _Alignas(64) uint8_t abuf[2][16 * 128];
    _Alignas(64) uint8_t odd[16 * 64];        // q8 with G odd: the last group's rows, zero-padded to a pair
    _Alignas(64) int32_t cbuf[2][16 * 16];    // sums stored one pair before they are read
    _Alignas(64) float sw[2][4][16], mw[2][4][16], out[16 * 16];   // scales of two blocks of 4 groups
    const __m512i pick_m = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    if (!q4 && (G & 1)) memset(odd, 0, sizeof odd);
    amx_configure();
    for (int blk = 0; blk < blocks; blk++) {
        const int64_t n = n0 + 16 * (int64_t)blk;
        const uint8_t *w = (const uint8_t *)wq + n * row_bytes;
        __m512 acc[16];
        for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
#define AMX_STORE_C(p) if ((p) & 1) _tile_stored(T_C1, cbuf[1], 64); else _tile_stored(T_C0, cbuf[0], 64);
#define AMX_SCALE(p) amx_epilogue(acc, cbuf[(p) & 1], a, (p), (const float (*)[16])sw[((p) >> 1) & 1], \
                                  (const float (*)[16])mw[((p) >> 1) & 1], 2 * ((p) & 1), q4)
        if (q4) amx_unpack(w, row_bytes, 0, G, abuf[0]);
        // one pair of groups of the block (the loop below runs it four at a time)
#define AMX_PAIR(PP) do { const int p = (PP); \
            const int g = 2 * p, i = p & 1;   /* groups g, g+1: the i-th pair of the block of four groups from g - 2i */ \
            /* the block AMX_PF_BLOCKS ahead, a P-th of it per pair (the default model's batch-8 step in process on a */ \
            /* par with one line per row and quad: 0.996x, 1.004x; batch 6 1.011x) */ \
            if (pf && n + 16 * (AMX_PF_BLOCKS + 1) <= n_all) \
                amx_prefetch_part(wq, sc, mn, st, mt, half, row_bytes, G, n + 16 * AMX_PF_BLOCKS, p, P); \
            if (i == 0) { \
                const int ng = G - g < 4 ? G - g : 4; \
                tile_scales(sc, mn, st, mt, half, q4, G, n, 16, g, ng, sw[(p >> 1) & 1], mw[(p >> 1) & 1]); \
                if (q4 && g + 4 < G) amx_unpack(w, row_bytes, g + 4, G, abuf[((p >> 1) + 1) & 1]); \
            } \
            const void *A = q4 ? (const void *)(abuf[(p >> 1) & 1] + 64 * i) : (const void *)(w + 32 * g); \
            int64_t astride = q4 ? 128 : row_bytes; \
            if (!q4 && g + 1 == G) {   /* q8, the last group alone: its 32 bytes would end past the row */ \
                for (int r = 0; r < 16; r++) memcpy(odd + 64 * r, w + r * row_bytes + 32 * g, 32); \
                A = odd, astride = 64; \
            } \
            if (p & 1) { \
                _tile_loadd(T_A1, A, astride); \
                _tile_loadd(T_B1, a->b + 256 * p, 64); \
                _tile_zero(T_C1); \
                if (q4) _tile_dpbusd(T_C1, T_A1, T_B1); else _tile_dpbssd(T_C1, T_A1, T_B1); \
            } else { \
                _tile_loadd(T_A0, A, astride); \
                _tile_loadd(T_B0, a->b + 256 * p, 64); \
                _tile_zero(T_C0); \
                if (q4) _tile_dpbusd(T_C0, T_A0, T_B0); else _tile_dpbssd(T_C0, T_A0, T_B0); \
            } \
            /* the sums of pair p - 1 stored, those of p - 2 (stored a pair ago: a tile store reaches the */ \
            /* vector loads late) scaled while this pair multiplies */ \
            if (p >= 1) AMX_STORE_C(p - 1) \
            if (p >= 2) AMX_SCALE(p - 2); \
        } while (0)
        {   // four pairs at a time, the double buffers' period: their indices, the tile registers and the pipeline's
            // parities fold to constants (with K a run-time value the one-pair loop kept them in memory: the tiles at
            // 8 rows in cache, K = 576, 1053 -> 922 cycles per block of 16 rows, the last pairs by a switch a further
            // ~3%); the same operations in the same order
            int p4 = 0;
            for (; p4 + 4 <= P; p4 += 4) { AMX_PAIR(p4); AMX_PAIR(p4 + 1); AMX_PAIR(p4 + 2); AMX_PAIR(p4 + 3); }
            switch (P - p4) {   /* the last one to three pairs, p4 a multiple of four: their parities fold too */
            case 3: AMX_PAIR(p4); AMX_PAIR(p4 + 1); AMX_PAIR(p4 + 2); break;
            case 2: AMX_PAIR(p4); AMX_PAIR(p4 + 1); break;
            case 1: AMX_PAIR(p4); break;
            default: break;
            }
        }
#undef AMX_PAIR
        AMX_STORE_C(P - 1)
        if (P >= 2) AMX_SCALE(P - 2);
        AMX_SCALE(P - 1);
#undef AMX_SCALE
#undef AMX_STORE_C
        // the even groups' sum plus the odd groups' (lane 2m + 1 onto 2m), then lane 2m of each weight row
        for (int r = 0; r < 16; r++)
            _mm512_store_ps(out + 16 * r, _mm512_add_ps(acc[r], _mm512_permute_ps(acc[r], _MM_SHUFFLE(2, 3, 0, 1))));
        const __m512 b16 = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
        for (int m = 0; m < nb; m++) {   // activation row m's 16 results
            float *yo = y + (int64_t)m * ystride + n;
            __m512 v = _mm512_add_ps(_mm512_i32gather_ps(pick_m, out + 2 * m, 4), b16);
            if (accumulate) v = _mm512_add_ps(_mm512_loadu_ps(yo), v);
            _mm512_storeu_ps(yo, v);
        }
    }
    _tile_release();
}
// one copy per kind, so the group loop has no branch on it, and one for fp16 scale planes (half = 1: Q4_0, Q4_1
// and Q8_0 files), whose reading then has no branch either (K = 576 in cache, 8 rows: 1053 -> 966 cycles per block
// alone, with the four-pair loop a further ~5%)
__attribute__((noinline)) static void amx_rows_q4(const void *wq, const void *sc, const void *mn, const void *st,
                                                  const void *mt, int half, int K, int64_t n0, int blocks,
                                                  const AmxAct *a, int nb, const float *bias, float *y, int ystride,
                                                  int accumulate, int pf, int64_t n_all) {
    if (half == 1) amx_rows_of(wq, sc, mn, st, mt, 1, 1, K, n0, blocks, a, nb, bias, y, ystride, accumulate, pf, n_all);
    else amx_rows_of(wq, sc, mn, st, mt, half, 1, K, n0, blocks, a, nb, bias, y, ystride, accumulate, pf, n_all);
}
__attribute__((noinline)) static void amx_rows_q8(const void *wq, const void *sc, const void *st, int half, int K,
                                                  int64_t n0, int blocks, const AmxAct *a, int nb, const float *bias,
                                                  float *y, int ystride, int accumulate, int pf, int64_t n_all) {
    if (half == 1) amx_rows_of(wq, sc, NULL, st, NULL, 1, 0, K, n0, blocks, a, nb, bias, y, ystride, accumulate, pf, n_all);
    else amx_rows_of(wq, sc, NULL, st, NULL, half, 0, K, n0, blocks, a, nb, bias, y, ystride, accumulate, pf, n_all);
}
static void amx_rows(const void *wq, const void *sc, const void *mn, const void *st, const void *mt, int half, int q4,
                     int K, int64_t n0, int blocks, const AmxAct *a, int nb, const float *bias, float *y, int ystride,
                     int accumulate, int pf, int64_t n_all) {
    if (q4) amx_rows_q4(wq, sc, mn, st, mt, half, K, n0, blocks, a, nb, bias, y, ystride, accumulate, pf, n_all);
    else amx_rows_q8(wq, sc, st, half, K, n0, blocks, a, nb, bias, y, ystride, accumulate, pf, n_all);
}

#endif

#if defined(SS_TWIN)
// -- the tiles' twin on the vector units ---------------------------------------------------------------
// Rows the tiles do not take (a step of one row, fewer rows than AMX_MIN_ROWS_*, a range's last rows short
// of a block of 16) must give bitwise what the tiles would: a request's tokens may not depend on what
// shares its step (speculative verification rows, prompt chunks beside decode rows, batch 8 against
// batch 1). So the fast path's other q4/q8 products follow the tiles' arithmetic exactly (and on VNNI CPUs
// without AMX, all of them do): each group's int32 sum, then per output, group by group in order,
//     acc = fma(float(sum) * d, sc, acc);  acc = fma(mn, s, acc)   (q4)
// with lanes = 16 weight rows. The sums: vpdpbusd of 4 groups of a row at once (q4: low nibbles against
// the groups' codes 0-15, high nibbles against 16-31; q8: codes + 128 as unsigned bytes, less 128 x the
// group's code sum), 4 lanes per group, then reduced across lanes and transposed to lanes = rows.

// the activation side: per row m and block of 4 groups c, two 64-byte vectors (q4: [g low codes 0-15] x 4,
// [g codes 16-31] x 4; q8: the codes in order) and, for q8, each group's code sum
typedef struct {
    int8_t *v;     // [nb][C][2][64]
    int32_t *isum; // [nb][4 C]
} TwinAct;

static __thread void *twin_buf;
static __thread int64_t twin_cap;

static TwinAct twin_prep(const int8_t *xq, int K, int nb, int q4) {
    const int G = K / 32, C = (G + 3) / 4;
    char *buf = amx_scratch(&twin_buf, &twin_cap, (int64_t)nb * C * (128 + 16));
    TwinAct t = {(int8_t *)buf, (int32_t *)(buf + (int64_t)nb * C * 128)};
    const __m512i ones = _mm512_set1_epi8(1);
    for (int m = 0; m < nb; m++)
        for (int c = 0; c < C; c++) {   // four groups' 128 codes (fewer at the end: zeros)
            const int ng = G - 4 * c < 4 ? G - 4 * c : 4;
            const int8_t *x = xq + (int64_t)m * K + 128 * c;
            const __mmask64 k0 = ng >= 2 ? ~0ULL : (1ULL << (32 * ng)) - 1;
            const __mmask64 k1 = ng >= 4 ? ~0ULL : ng <= 2 ? 0 : (1ULL << (32 * (ng - 2))) - 1;
            const __m512i a = _mm512_maskz_loadu_epi8(k0, x), b = _mm512_maskz_loadu_epi8(k1, x + 64);
            int8_t *v = t.v + ((int64_t)m * C + c) * 128;
            if (q4) {   // 128-bit blocks [g0 0-15, g0 16-31, g1 0-15, g1 16-31] [g2 ..., g3 ...]
                _mm512_store_si512(v, _mm512_shuffle_i32x4(a, b, 0x88));
                _mm512_store_si512(v + 64, _mm512_shuffle_i32x4(a, b, 0xDD));
                continue;
            }
            _mm512_store_si512(v, a), _mm512_store_si512(v + 64, b);
            // each group's code sum (q8): 1 x code, four per lane, then the group's 8 lanes
            const __m512i sa = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, a);
            const __m512i sb = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, b);
            int32_t *is = t.isum + (int64_t)m * 4 * C + 4 * c;
            is[0] = _mm512_mask_reduce_add_epi32(0x00FF, sa), is[1] = _mm512_mask_reduce_add_epi32(0xFF00, sa);
            is[2] = _mm512_mask_reduce_add_epi32(0x00FF, sb), is[3] = _mm512_mask_reduce_add_epi32(0xFF00, sb);
        }
    return t;
}

// four rows' vectors r[0..3] of [group j: 4 partial sums] -> [group j: the four rows' sums]
AI __m512i twin_reduce4(__m512i a, __m512i b, __m512i c, __m512i d) {
    const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
}

// The twins' shared arithmetic: one group's exact sums s32 (lanes = 16 weight rows) into the sum of its parity,
//     acc = fma(float(s32) * d, sc, acc);  acc = fma(mn, s, acc)   (q4)
AI void twin_scale(__m512 *acc, __m512i s32, float d, __m512 sc, __m512 mn, float s, int q4) {
    const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(s32), _mm512_set1_ps(d));
    *acc = _mm512_fmadd_ps(v, sc, *acc);
    if (q4) *acc = _mm512_fmadd_ps(mn, _mm512_set1_ps(s), *acc);
}

// and their outputs: y[m * ystride + n + r] (=|+=) acc[0][m] + acc[1][m] (+ bias) for the block's `keep` lanes
AI void twin_store(__m512 acc[2][MAX_ROWS], int nb, const float *bias, int64_t n, __mmask16 keep, float *y,
                   int ystride, int accumulate) {
    const __m512 b16 = bias ? _mm512_maskz_loadu_ps(keep, bias + n) : _mm512_setzero_ps();
    for (int m = 0; m < nb; m++) {
        float *yo = y + (int64_t)m * ystride + n;
        __m512 v = _mm512_add_ps(_mm512_add_ps(acc[0][m], acc[1][m]), b16);
        if (accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(keep, yo), v);
        _mm512_mask_storeu_ps(yo, keep, v);
    }
}

// rows [n0, n1) (any count), nb <= 8 activation rows: y[m * ystride + n] (=|+=) W[n] . X[m] (+ bias[n])
AI void twin_rows_of(const void *wq, const void *sc, const void *mn, const void *st, const void *mt, int half,
                     const int q4, int K, int64_t n0,
                     int64_t n1, const int8_t *xq, const float *xd, const float *xs, int nb, const float *bias,
                     float *y, int ystride, int accumulate, int pf, int64_t n_all) {
    const int G = K / 32, C = (G + 3) / 4;
    const int64_t row_bytes = q4 ? K / 2 : K;
    const TwinAct t = twin_prep(xq, K, nb, q4);
    const __m512i m4 = _mm512_set1_epi8(15), flip = _mm512_set1_epi8((char)0x80);
    _Alignas(64) float sw[4][16], mw[4][16];
    _Alignas(64) int32_t red[MAX_ROWS][4][16];   // [m][row quad][group j: 4 rows]
    for (int64_t n = n0; n < n1; n += 16) {
        const int live = n1 - n < 16 ? (int)(n1 - n) : 16;
        const __mmask16 keep = (__mmask16)((1u << live) - 1);
        __m512 acc[2][MAX_ROWS];   // the even groups' sums, the odd groups'
        for (int m = 0; m < nb; m++) acc[0][m] = acc[1][m] = _mm512_setzero_ps();
        for (int c = 0; c < C; c++) {
            const int g4 = 4 * c, ng = G - g4 < 4 ? G - g4 : 4;
            if (pf && n + 16 * (TWIN_PF_BLOCKS + 1) <= n_all)
                amx_prefetch_later(wq, sc, mn, st, mt, half, q4, G, row_bytes, n + 16 * TWIN_PF_BLOCKS, g4, 0, 16);
            tile_scales(sc, mn, st, mt, half, q4, G, n, live, g4, ng, sw, mw);
            const __mmask64 k = q4 ? (ng == 4 ? ~0ULL : (1ULL << (16 * ng)) - 1) : ~0ULL;
            for (int q = 0; q < 4; q++) {   // rows 4q..4q+3
                __m512i w0[4], w1[4];
                for (int r = 0; r < 4; r++) {
                    const int rr = 4 * q + r < live ? 4 * q + r : 0;
                    const uint8_t *p = (const uint8_t *)wq + (n + rr) * row_bytes;
                    if (q4) {
                        const __m512i raw = _mm512_maskz_loadu_epi8(k, p + 16 * g4);
                        w0[r] = _mm512_and_si512(raw, m4), w1[r] = ss_hi4_512(raw, m4);
                    } else {   // groups g4, g4+1 and g4+2, g4+3 (past G: zero codes, read as 128 after the flip)
                        const __mmask64 k0 = ng >= 2 ? ~0ULL : (1ULL << (32 * ng)) - 1;
                        const __mmask64 k1 = ng >= 4 ? ~0ULL : ng <= 2 ? 0 : (1ULL << (32 * (ng - 2))) - 1;
                        w0[r] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(k0, p + 32 * g4), flip);
                        w1[r] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(k1, p + 32 * g4 + 64), flip);
                    }
                }
                for (int m = 0; m < nb; m++) {
                    const int8_t *v = t.v + ((int64_t)m * C + c) * 128;
                    const __m512i a0 = _mm512_load_si512(v), a1 = _mm512_load_si512(v + 64);
                    __m512i part[4];
                    for (int r = 0; r < 4; r++) {
                        if (q4) {   // [group j: 4 partials]
                            part[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w0[r], a0), w1[r], a1);
                            continue;
                        }
                        const __m512i p0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w0[r], a0);
                        const __m512i p1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w1[r], a1);
                        // [g0: 8 | g1: 8], [g2 | g3] -> [group j: 4 partials]
                        part[r] = _mm512_add_epi32(_mm512_shuffle_i32x4(p0, p1, 0x88), _mm512_shuffle_i32x4(p0, p1, 0xDD));
                    }
                    _mm512_store_si512(red[m][q], twin_reduce4(part[0], part[1], part[2], part[3]));
                }
            }
            for (int m = 0; m < nb; m++) {
                // red[m][q] = [group j: rows 4q..4q+3] -> per group j, rows 0..15
                const __m512i r0 = _mm512_load_si512(red[m][0]), r1 = _mm512_load_si512(red[m][1]);
                const __m512i r2 = _mm512_load_si512(red[m][2]), r3 = _mm512_load_si512(red[m][3]);
                const __m512i t01a = _mm512_shuffle_i32x4(r0, r1, 0x44), t01b = _mm512_shuffle_i32x4(r0, r1, 0xEE);
                const __m512i t23a = _mm512_shuffle_i32x4(r2, r3, 0x44), t23b = _mm512_shuffle_i32x4(r2, r3, 0xEE);
                __m512i sums[4];
                sums[0] = _mm512_shuffle_i32x4(t01a, t23a, 0x88), sums[1] = _mm512_shuffle_i32x4(t01a, t23a, 0xDD);
                sums[2] = _mm512_shuffle_i32x4(t01b, t23b, 0x88), sums[3] = _mm512_shuffle_i32x4(t01b, t23b, 0xDD);
                const int G_ = G;
                for (int i = 0; i < ng; i++) {
                    const int g = g4 + i;
                    __m512i s32 = sums[i];
                    if (!q4) s32 = _mm512_sub_epi32(s32, _mm512_set1_epi32(128 * t.isum[(int64_t)m * 4 * C + g]));
                    // g4 is a multiple of 4: g's parity is i's
                    twin_scale(&acc[i & 1][m], s32, xd[(int64_t)m * G_ + g], _mm512_load_ps(sw[i]),
                               _mm512_load_ps(mw[i]), q4 ? xs[(int64_t)m * G_ + g] : 0.f, q4);
                }
            }
        }
        twin_store(acc, nb, bias, n, keep, y, ystride, accumulate);
    }
}

// The twin with lanes = weight rows from the start (the same arithmetic, bitwise): per group, 16 weight rows'
// codes are transposed in registers so that 32-bit lane r holds 4 codes of row r (q4: bytes 4j..4j+3 of the
// group, i.e. codes 4j..4j+3 in the low nibbles and 16+4j.. in the high ones), and each vpdpbusd takes
// one activation row's 4 matching codes as a broadcast: a group's exact sums come out for 16 rows at once,
// with no reduction across lanes. The transposes cost the same whatever the activation row count and are
// shared by all of them, so this kernel pays from 2 rows on (twin_from_rows), where the reducing twin above
// spends more on reductions than on products.
// q4 codes of rows n + r + 4L (L = 0..3, the 128-bit lanes) for group g -> w[j], lane 4L + r = bytes 4j..4j+3
AI void twin16_codes(const uint8_t *const rows[16], int64_t at, int bytes16, __m512i w[8]) {
    for (int h = 0; h < bytes16; h++) {   // q4: one 16-byte run per row; q8: two
        __m512i a[4];
        for (int r = 0; r < 4; r++) {
            __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(rows[r] + at + 16 * h)));
            v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(rows[r + 4] + at + 16 * h)), 1);
            v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(rows[r + 8] + at + 16 * h)), 2);
            a[r] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(rows[r + 12] + at + 16 * h)), 3);
        }
        const __m512i t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpackhi_epi32(a[0], a[1]);
        const __m512i t2 = _mm512_unpacklo_epi32(a[2], a[3]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
        w[4 * h + 0] = _mm512_unpacklo_epi64(t0, t2), w[4 * h + 1] = _mm512_unpackhi_epi64(t0, t2);
        w[4 * h + 2] = _mm512_unpacklo_epi64(t1, t3), w[4 * h + 3] = _mm512_unpackhi_epi64(t1, t3);
    }
}

// a thread's per-call activation code sums (q8: sum of a group's 32 codes, [nb][G])
static __thread void *twin16_buf;
static __thread int64_t twin16_cap;

AI void twin16_rows_of(const void *wq, const void *sc, const void *mn, const void *st, const void *mt, int half,
                       const int q4, int K, int64_t n0, int64_t n1, const int8_t *xq, const float *xd,
                       const float *xs, int nb, const float *bias, float *y, int ystride, int accumulate, int pf,
                       int64_t n_all) {
    const int G = K / 32, C = (G + 3) / 4;
    const int64_t row_bytes = q4 ? K / 2 : K;
    int32_t *isum = NULL;
    if (!q4) {   // q8: codes + 128 as unsigned bytes, less 128 x the activation group's code sum
        isum = (int32_t *)amx_scratch(&twin16_buf, &twin16_cap, (int64_t)nb * G * 4);
        const __m256i ones = _mm256_set1_epi8(1);
        for (int m = 0; m < nb; m++)
            for (int g = 0; g < G; g++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(xq + (int64_t)m * K + 32 * g));
                const __m256i s8 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, v);
                isum[m * G + g] = _mm512_reduce_add_epi32(_mm512_zextsi256_si512(s8));
            }
    }
    const __m512i m4 = _mm512_set1_epi8(15), flip = _mm512_set1_epi8((char)0x80);
    _Alignas(64) float sw[4][16], mw[4][16];
    for (int64_t n = n0; n < n1; n += 16) {
        const int live = n1 - n < 16 ? (int)(n1 - n) : 16;
        const __mmask16 keep = (__mmask16)((1u << live) - 1);
        const uint8_t *rows[16];
        for (int r = 0; r < 16; r++) rows[r] = (const uint8_t *)wq + (n + (r < live ? r : 0)) * row_bytes;
        __m512 acc[2][MAX_ROWS];   // the even groups' sums, the odd groups'
        for (int m = 0; m < nb; m++) acc[0][m] = acc[1][m] = _mm512_setzero_ps();
        for (int c = 0; c < C; c++) {
            const int g4 = 4 * c, ng = G - g4 < 4 ? G - g4 : 4;
            if (pf && n + 16 * (TWIN_PF_BLOCKS + 1) <= n_all)
                // a C-th of the block per quad (amx_kernels.c's twin16 at 2-8 rows against one line per row and quad:
                // q4 1.03-1.09x in cache, 1.04-1.09x L3-sized, 1.05-1.11x DRAM-sized; q8 0.96-1.01x, 1.00-1.10x,
                // 1.04-1.11x; the reducing twin above on a par or slower, so it keeps those)
                amx_prefetch_part(wq, sc, mn, st, mt, half, row_bytes, G, n + 16 * TWIN_PF_BLOCKS, c, C);
            tile_scales(sc, mn, st, mt, half, q4, G, n, live, g4, ng, sw, mw);
            for (int i = 0; i < ng; i++) {
                const int g = g4 + i;
                __m512i w[8];
                twin16_codes(rows, (int64_t)g * (q4 ? 16 : 32), q4 ? 1 : 2, w);
                if (q4) {
                    for (int j = 3; j >= 0; j--)
                        w[4 + j] = ss_hi4_512(w[j], m4), w[j] = _mm512_and_si512(w[j], m4);
                } else {
                    for (int j = 0; j < 8; j++) w[j] = _mm512_xor_si512(w[j], flip);
                }
                const __m512 scv = _mm512_load_ps(sw[i]), mnv = _mm512_load_ps(mw[i]);
                SS_UNROLL_ROWS
                for (int m = 0; m < nb; m++) {
                    const int8_t *x = xq + (int64_t)m * K + 32 * g;
                    __m512i s32 = _mm512_setzero_si512();
                    for (int j = 0; j < 4; j++) {   // q4: w[j] against codes 4j.., w[4 + j] against 16 + 4j..
                        int32_t lo, hi;
                        memcpy(&lo, x + 4 * j, 4), memcpy(&hi, x + 16 + 4 * j, 4);
                        s32 = _mm512_dpbusd_epi32(s32, w[j], _mm512_set1_epi32(lo));
                        s32 = _mm512_dpbusd_epi32(s32, w[4 + j], _mm512_set1_epi32(hi));
                    }
                    if (!q4) s32 = _mm512_sub_epi32(s32, _mm512_set1_epi32(128 * isum[m * G + g]));
                    twin_scale(&acc[g & 1][m], s32, xd[(int64_t)m * G + g], scv, mnv, q4 ? xs[(int64_t)m * G + g] : 0.f,
                               q4);
                }
            }
        }
        twin_store(acc, nb, bias, n, keep, y, ystride, accumulate);
    }
}

__attribute__((noinline)) static void twin16_rows_q4(const void *wq, const void *sc, const void *mn, const void *st,
                                                     const void *mt, int half, int K, int64_t n0, int64_t n1,
                                                     const int8_t *xq, const float *xd, const float *xs, int nb,
                                                     const float *bias, float *y, int ystride, int accumulate,
                                                     int pf, int64_t n_all) {
    twin16_rows_of(wq, sc, mn, st, mt, half, 1, K, n0, n1, xq, xd, xs, nb, bias, y, ystride, accumulate, pf, n_all);
}
__attribute__((noinline)) static void twin16_rows_q8(const void *wq, const void *sc, const void *st, int half, int K,
                                                     int64_t n0, int64_t n1, const int8_t *xq, const float *xd,
                                                     int nb, const float *bias, float *y, int ystride,
                                                     int accumulate, int pf, int64_t n_all) {
    twin16_rows_of(wq, sc, NULL, st, NULL, half, 0, K, n0, n1, xq, xd, NULL, nb, bias, y, ystride, accumulate, pf,
                   n_all);
}

__attribute__((noinline)) static void twin_rows_q4(const void *wq, const void *sc, const void *mn, const void *st,
                                                   const void *mt, int half, int K,
                                                   int64_t n0, int64_t n1, const int8_t *xq, const float *xd,
                                                   const float *xs, int nb, const float *bias, float *y,
                                                   int ystride, int accumulate, int pf, int64_t n_all) {
    twin_rows_of(wq, sc, mn, st, mt, half, 1, K, n0, n1, xq, xd, xs, nb, bias, y, ystride, accumulate, pf, n_all);
}
__attribute__((noinline)) static void twin_rows_q8(const void *wq, const void *sc, const void *st, int half, int K,
                                                   int64_t n0,
                                                   int64_t n1, const int8_t *xq, const float *xd, int nb,
                                                   const float *bias, float *y, int ystride, int accumulate,
                                                   int pf, int64_t n_all) {
    twin_rows_of(wq, sc, NULL, st, NULL, half, 0, K, n0, n1, xq, xd, NULL, nb, bias, y, ystride, accumulate, pf, n_all);
}
#endif
