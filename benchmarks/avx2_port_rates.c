// Issue rates of the 8-row AVX2 kernels' instructions (simd.h q4i_group) on this core, one thread: each
// instruction alone in 8 independent chains (latency hidden), then the kernel's own mix per activation row
// and group (broadcast from memory + vpmaddubsw + vpaddw). Inline asm, so the compiler cannot fold or spill.
// Prints instructions (or mixes) per nanosecond, and the clock from a dependent chain of adds.
//
//   gcc -O2 -mavx2 -mfma -o /tmp/avx2_port_rates benchmarks/avx2_port_rates.c && /tmp/avx2_port_rates
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

// 8 independent ops `OP %%ymm15, %%ymmI, %%ymmI` (I = 0..7) per iteration
#define EIGHT(OP) OP " %%ymm15,%%ymm0,%%ymm0\n" OP " %%ymm15,%%ymm1,%%ymm1\n" OP " %%ymm15,%%ymm2,%%ymm2\n" \
                  OP " %%ymm15,%%ymm3,%%ymm3\n" OP " %%ymm15,%%ymm4,%%ymm4\n" OP " %%ymm15,%%ymm5,%%ymm5\n" \
                  OP " %%ymm15,%%ymm6,%%ymm6\n" OP " %%ymm15,%%ymm7,%%ymm7\n"
#define CLOBBER "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", \
                "xmm12", "xmm13", "xmm14", "xmm15"

static const int32_t acts[16] __attribute__((aligned(64))) = {1, 2, 3, 4, 5, 6, 7, 8};

#define TIME(label, per_iter, BODY)                                                                  \
    do {                                                                                             \
        const long n = 100000000;                                                                    \
        double best = 1e9;                                                                           \
        for (int rep = 0; rep < 3; rep++) {                                                          \
            const double t = now();                                                                  \
            for (long i = 0; i < n; i++) __asm__ volatile(BODY : : "r"(acts) : CLOBBER);            \
            const double dt = now() - t;                                                             \
            if (dt < best) best = dt;                                                                \
        }                                                                                            \
        printf("%-44s %6.2f per ns\n", label, (double)(per_iter) * n / best * 1e-9);                 \
    } while (0)

int main(void) {
    {   // the clock: four dependent adds per iteration (1 cycle each)
        const long n = 500000000;
        long x = 0;
        const double t = now();
        for (long i = 0; i < n; i++) __asm__ volatile("add $1,%0\n add $1,%0\n add $1,%0\n add $1,%0" : "+r"(x));
        printf("%-44s %6.2f GHz\n", "clock (dependent adds)", 4.0 * n / (now() - t) * 1e-9);
    }
    TIME("vpmaddubsw", 8, EIGHT("vpmaddubsw"));
    TIME("vpmaddwd", 8, EIGHT("vpmaddwd"));
    TIME("vpaddw", 8, EIGHT("vpaddw"));
    TIME("vfmadd231ps", 8, EIGHT("vfmadd231ps"));
    TIME("vcvtdq2ps (ymm15 -> 8 registers)", 8,
         "vcvtdq2ps %%ymm15,%%ymm0\n vcvtdq2ps %%ymm15,%%ymm1\n vcvtdq2ps %%ymm15,%%ymm2\n vcvtdq2ps %%ymm15,%%ymm3\n"
         "vcvtdq2ps %%ymm15,%%ymm4\n vcvtdq2ps %%ymm15,%%ymm5\n vcvtdq2ps %%ymm15,%%ymm6\n vcvtdq2ps %%ymm15,%%ymm7\n");
    TIME("vpbroadcastd ymm, m32", 8,
         "vpbroadcastd (%0),%%ymm0\n vpbroadcastd 4(%0),%%ymm1\n vpbroadcastd 8(%0),%%ymm2\n vpbroadcastd 12(%0),%%ymm3\n"
         "vpbroadcastd 16(%0),%%ymm4\n vpbroadcastd 20(%0),%%ymm5\n vpbroadcastd 24(%0),%%ymm6\n vpbroadcastd 28(%0),%%ymm7\n");
    TIME("vmovdqu ymm, m256", 8,
         "vmovdqu (%0),%%ymm0\n vmovdqu 4(%0),%%ymm1\n vmovdqu 8(%0),%%ymm2\n vmovdqu 12(%0),%%ymm3\n"
         "vmovdqu 16(%0),%%ymm4\n vmovdqu 20(%0),%%ymm5\n vmovdqu 24(%0),%%ymm6\n vmovdqu 28(%0),%%ymm7\n");
    // the two together, in separate registers: 8 vpmaddubsw (ymm0-7) and 7 vfmadd231ps (ymm8-14) per iteration
    TIME("vpmaddubsw and vfmadd231ps mixed (instructions)", 15,
         EIGHT("vpmaddubsw") "vfmadd231ps %%ymm15,%%ymm8,%%ymm8\n vfmadd231ps %%ymm15,%%ymm9,%%ymm9\n"
         "vfmadd231ps %%ymm15,%%ymm10,%%ymm10\n vfmadd231ps %%ymm15,%%ymm11,%%ymm11\n vfmadd231ps %%ymm15,%%ymm12,%%ymm12\n"
         "vfmadd231ps %%ymm15,%%ymm13,%%ymm13\n vfmadd231ps %%ymm15,%%ymm14,%%ymm14\n");
    // q4i_group's integer work per activation row and group: 8 x (broadcast 4 codes, vpmaddubsw against a
    // weight register, vpaddw into one of four sums)
#define MIX(I, OFF) "vpbroadcastd " OFF "(%0),%%ymm" I "\n vpmaddubsw %%ymm" I ",%%ymm8,%%ymm" I "\n"
    TIME("broadcast + vpmaddubsw + vpaddw (triples)", 8,
         MIX("9", "0") "vpaddw %%ymm9,%%ymm0,%%ymm0\n" MIX("10", "4") "vpaddw %%ymm10,%%ymm1,%%ymm1\n"
         MIX("11", "8") "vpaddw %%ymm11,%%ymm2,%%ymm2\n" MIX("12", "12") "vpaddw %%ymm12,%%ymm3,%%ymm3\n"
         MIX("13", "16") "vpaddw %%ymm13,%%ymm4,%%ymm4\n" MIX("14", "20") "vpaddw %%ymm14,%%ymm5,%%ymm5\n"
         MIX("9", "24") "vpaddw %%ymm9,%%ymm6,%%ymm6\n" MIX("10", "28") "vpaddw %%ymm10,%%ymm7,%%ymm7\n");
    return 0;
}
