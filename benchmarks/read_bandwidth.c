// Read bandwidth by working-set size, one thread against two: a streaming read (512-bit loads where the CPU has AVX-512, else 256-bit; L2 prefetch 8 KB
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
#ifdef __AVX512F__   // 512-bit loads where the CPU has them, else 256-bit (two per 64-byte line)
typedef __m512i V; static inline V ld(const char*p){return _mm512_load_si512(p);} static inline V vor(V a,V b){return _mm512_or_si512(a,b);}
static inline V vzero(void){return _mm512_setzero_si512();} static inline void st(int*o,V v){_mm512_storeu_si512(o,v);}
#else
typedef __m256i V; static inline V ld(const char*p){return _mm256_or_si256(_mm256_load_si256((const __m256i*)p),_mm256_load_si256((const __m256i*)(p+32)));}
static inline V vor(V a,V b){return _mm256_or_si256(a,b);} static inline V vzero(void){return _mm256_setzero_si256();}
static inline void st(int*o,V v){_mm256_storeu_si256((__m256i*)o,v);}
#endif
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){ size_t mb=atoi(argv[1]); size_t n=mb<<20; char*b=aligned_alloc(64,n); memset(b,1,n);
 double best=1e9; V acc=vzero();
 for(int r=0;r<8;r++){ double t=now();
 #pragma omp parallel
 { V a=vzero();
 #pragma omp for
 for(size_t i=0;i<n;i+=256){ _mm_prefetch(b+i+8192,_MM_HINT_T1);_mm_prefetch(b+i+8192+64,_MM_HINT_T1);_mm_prefetch(b+i+8192+128,_MM_HINT_T1);_mm_prefetch(b+i+8192+192,_MM_HINT_T1);
 a=vor(a,ld(b+i)); a=vor(a,ld(b+i+64));a=vor(a,ld(b+i+128));a=vor(a,ld(b+i+192));}
 _Pragma("omp critical") acc=vor(acc,a);}
 double dt=now()-t; if(dt<best)best=dt;}
 int o[16]; st(o,acc); printf("%zu MB threads %d: %.1f GB/s (%d)\n",mb,omp_get_max_threads(),n/best/1e9,o[0]);}
