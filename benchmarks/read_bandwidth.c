// Read bandwidth by working-set size, one thread against two: a streaming read (512-bit loads, L2 prefetch 8 KB
// ahead) of a buffer of N MB, best of 8 passes. On the 2-core Xeon the default model's ~96 MB of weights per
// token fit the host's L3; what one thread streams against two bounds what one core can decode (the busy
// neighbour's share, docs/BENCHMARKS.md).
//
//   gcc -O2 -march=native -fopenmp -o /tmp/read_bw benchmarks/read_bandwidth.c
//   for mb in 8 32 96 256 1024; do OMP_NUM_THREADS=1 /tmp/read_bw $mb; OMP_NUM_THREADS=2 /tmp/read_bw $mb; done
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <omp.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){ size_t mb=atoi(argv[1]); size_t n=mb<<20; char*b=aligned_alloc(64,n); memset(b,1,n);
 double best=1e9; __m512i acc=_mm512_setzero_si512();
 for(int r=0;r<8;r++){ double t=now();
 #pragma omp parallel
 { __m512i a=_mm512_setzero_si512();
 #pragma omp for
 for(size_t i=0;i<n;i+=256){ _mm_prefetch(b+i+8192,_MM_HINT_T1);_mm_prefetch(b+i+8192+64,_MM_HINT_T1);_mm_prefetch(b+i+8192+128,_MM_HINT_T1);_mm_prefetch(b+i+8192+192,_MM_HINT_T1);
 a=_mm512_or_si512(a,_mm512_load_si512(b+i)); a=_mm512_or_si512(a,_mm512_load_si512(b+i+64));a=_mm512_or_si512(a,_mm512_load_si512(b+i+128));a=_mm512_or_si512(a,_mm512_load_si512(b+i+192));}
 _Pragma("omp critical") acc=_mm512_or_si512(acc,a);}
 double dt=now()-t; if(dt<best)best=dt;}
 int o[16]; _mm512_storeu_si512(o,acc); printf("%zu MB threads %d: %.1f GB/s (%d)\n",mb,omp_get_max_threads(),n/best/1e9,o[0]);}
