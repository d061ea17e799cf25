// The KV cache's layout for decode attention's reads: one thread reads every KV head's fp16 rows (head size 64,
// 3 KV heads, K and V) of N cached slots in 30 layers, one head at a time as the step's attention tasks do, from
// the slot-major layout ([slot][head][dim], mode 0, the cache's) or head-major within blocks of 16 slots
// ([block][head][16][dim], mode 1), with software prefetch PF rows ahead (0: none; T1=1 in the environment:
// into L2), in 4 KB pages or (a fourth argument 1) huge pages. Prints GB/s, best of 7 passes after evicting caches.
//
//   gcc -O2 -march=native -o /tmp/kv_layout benchmarks/kv_layout.c
//   for m in 0 1; do /tmp/kv_layout 4000 $m 32; done      # N MODE PF [HUGE]
#include <immintrin.h>
#ifndef __AVX512F__
#error "kv_layout.c reads the cache with 512-bit vectors: build it on an AVX-512 CPU (-march=native there)"
#endif
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
enum {L=30, KVH=3, D=64, BS=16};
// read n 128-byte rows (fp16 head rows) at base + off(i), accumulate
static __m512 acc;
static inline void rd(const char *p){ acc=_mm512_add_ps(acc,_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)));
 acc=_mm512_add_ps(acc,_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p+32))));
 acc=_mm512_add_ps(acc,_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p+64))));
 acc=_mm512_add_ps(acc,_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p+96))));}
int main(int argc,char**argv){
  int N=atoi(argv[1]); int mode=atoi(argv[2]); int pf=atoi(argv[3]); int huge=argc>4?atoi(argv[4]):0; int t1=getenv("T1")!=0;
  size_t per=(size_t)N*KVH*D*2; size_t tot=per*L*2;
  char*buf=mmap(0,tot+(1<<21),PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);
  if(huge) madvise(buf,tot,MADV_HUGEPAGE); else madvise(buf,tot,MADV_NOHUGEPAGE);
  memset(buf,1,tot);
  char*flush=malloc(256<<20); 
  int64_t*slots=malloc(8*N); for(int i=0;i<N;i++) slots[i]=i;
  double best=1e9;
  for(int rep=0;rep<7;rep++){
    memset(flush,rep,256<<20);
    double t=now();
    for(int l=0;l<L;l++){
      char*K=buf+per*2*l, *V=K+per;
      for(int h=0;h<KVH;h++){
        for(int c=0;c<2;c++){ char*C=c?V:K;
        for(int i=0;i<N;i++){
          const char*p; const char*q=0;
          if(mode==0){ p=C+(slots[i]*KVH+h)*D*2; if(pf&&i+pf<N) q=C+(slots[i+pf]*KVH+h)*D*2; }
          else { int64_t s=slots[i]; p=C+(((s/BS)*KVH+h)*BS+s%BS)*D*2; if(pf&&i+pf<N){int64_t s2=slots[i+pf]; q=C+(((s2/BS)*KVH+h)*BS+s2%BS)*D*2;} }
          if(q){if(t1){_mm_prefetch(q,_MM_HINT_T1);_mm_prefetch(q+64,_MM_HINT_T1);}else{_mm_prefetch(q,_MM_HINT_T0);_mm_prefetch(q+64,_MM_HINT_T0);}}
          rd(p);
        }}
      }
    }
    double dt=now()-t; if(dt<best)best=dt;
  }
  float o[16]; _mm512_storeu_ps(o,acc);
  printf("N=%d mode=%s pf=%d huge=%d: %.2f ms, %.2f GB/s (%g)\n",N,mode?"headmajor":"slotmajor",pf,huge,best*1e3,tot/best/1e9,o[0]);
}
