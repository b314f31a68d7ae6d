// Micro-probe (issue 3, round 7): can the frame kernel's grid run as thread
// block clusters, and what does an exchange inside a cluster cost while the weights stream?
//   1. cudaOccupancyMaxActiveClusters for cluster sizes 2..16 at the kernel's shape (384 threads,
//      one block per SM through ~225 KB of shared memory), and whether a launch with both the
//      cooperative and the cluster-dimension attributes is accepted;
//   2. the round trip of an all-to-all exchange inside a cluster: every CTA pushes 1 KB into every
//      other CTA's shared memory (st.shared::cluster) and arrives on that CTA's mbarrier
//      (release.cluster); each waits on its own (acquire.cluster). Timed with and without a weight
//      stream (thread 256 of every block copying 16 KB bulk pieces from HBM, one in flight, as the
//      kernel's producer does), against the same exchange through L2 (LL-style 64-bit words
//      {value, flag} stored to global memory and polled).
// Results (H100 SXM) and what they decided: csrc/PERF_LOG.md, round 7.
// Build and run: make probes && tools/probes/build/cluster_probe
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                        \
  do {                                                                               \
    cudaError_t e_ = (x);                                                            \
    if (e_ != cudaSuccess) {                                                         \
      printf("%s: %s\n", #x, cudaGetErrorString(e_));                                \
      exit(1);                                                                       \
    }                                                                                \
  } while (0)

constexpr int NT = 256, LAUNCH = 384;
constexpr int DYN = 200 * 1024;        // dynamic smem: with the static part, one block per SM
constexpr int PIECE = 16384;
constexpr int MSG = 1024;              // bytes pushed to every peer per round
constexpr int MAXC = 16;
constexpr int LL_CLUSTERS = 80;        // >= blocks / 2

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t cluster_size() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t mapa(uint32_t a, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
  return r;
}
__device__ __forceinline__ bool try_wait_cluster(uint32_t a, uint32_t par) {
  uint32_t ok;
  asm volatile(
      "{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
      : "=r"(ok)
      : "r"(a), "r"(par)
      : "memory");
  return ok != 0;
}
__device__ __forceinline__ bool try_wait(uint32_t a, uint32_t par) {
  uint32_t ok;
  asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
               : "=r"(ok)
               : "r"(a), "r"(par)
               : "memory");
  return ok != 0;
}

// mode 0: DSMEM exchange inside the cluster; 1: the same exchange through L2 (LL words).
// stream: thread 256 streams 16 KB pieces until the compute threads are done.
__global__ void __launch_bounds__(LAUNCH, 1)
    probe(int iters, int mode, int stream, const char* src, size_t src_bytes, uint64_t* ll, unsigned long long* res) {
  extern __shared__ __align__(128) unsigned char dyn[];
  __shared__ __align__(8) uint64_t bar[2], pace;  // bar[round & 1]: peers run at most one round ahead
  __shared__ __align__(16) float inbox[MAXC][MSG / 4];
  __shared__ volatile int done;
  const uint32_t cs = cluster_size(), me = cluster_rank();
  if (threadIdx.x == 0) {
    for (int i = 0; i < 2; ++i)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(&bar[i])), "r"(cs - 1) : "memory");
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&pace)) : "memory");
    done = 0;
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");
  if (threadIdx.x >= NT) {
    if (threadIdx.x == NT && stream) {
      const size_t per = src_bytes / gridDim.x / PIECE * PIECE;
      const char* base = src + per * blockIdx.x;
      uint32_t par = 0;
      size_t off = 0;
      unsigned long long bytes = 0;
      while (!done) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(&pace)), "r"(PIECE) : "memory");
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                smem_u32(dyn) + (uint32_t)(off % (DYN - PIECE + 1) / PIECE * PIECE)),
            "l"(base + off), "r"(PIECE), "r"(smem_u32(&pace))
            : "memory");
        while (!try_wait(smem_u32(&pace), par)) {
        }
        par ^= 1u;
        off = (off + PIECE) % per;
        bytes += PIECE;
      }
      res[blockIdx.x * 4 + 2] = bytes;
    }
    return;  // the CTA (and its shared memory) lives on with its compute threads
  }
  asm volatile("bar.sync 1, %0;" ::"n"(NT) : "memory");
  uint32_t par = 0;  // parity of bar[0] and bar[1]'s next completion (both advance every 2 rounds)
  unsigned long long t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  const uint32_t flag_base = 1u;
  for (int it = 0; it < iters; ++it) {
    const uint32_t f = flag_base + it;
    if (mode == 0) {
      // push MSG bytes to every peer: warp w serves peers w, w + 8 (lane = 32 B of the message)
      const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
      for (uint32_t p = w; p < cs; p += NT / 32) {
        if (p == me) continue;
        const uint32_t dst = mapa(smem_u32(&inbox[me][lane * 8]), p);
        const float v = (float)(it + lane);
        asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %1, %1, %1};" ::"r"(dst), "f"(v) : "memory");
        asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %1, %1, %1};" ::"r"(dst + 16), "f"(v) : "memory");
        __syncwarp();
        if (lane == 0)
          asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(
                           mapa(smem_u32(&bar[it & 1]), p))
                       : "memory");
      }
      if (threadIdx.x == 0)
        while (!try_wait_cluster(smem_u32(&bar[it & 1]), par)) {
        }
      if (it & 1) par ^= 1u;
      asm volatile("bar.sync 1, %0;" ::"n"(NT) : "memory");
    } else {
      // the same pattern through L2: every CTA publishes MSG / 4 LL words per peer, each peer
      // polls the words addressed to it
      // double-buffered by round parity: a peer one round ahead writes the other buffer
      const uint32_t cl = blockIdx.x / cs;
      uint64_t* buf = ll + (size_t)(it & 1) * (LL_CLUSTERS * MAXC * MAXC * (MSG / 4));
      uint64_t* mine = buf + ((size_t)cl * MAXC + me) * MAXC * (MSG / 4);
      for (int i = threadIdx.x; i < (int)cs * (MSG / 4); i += NT) {
        const uint64_t word = ((uint64_t)f << 32) | __float_as_uint((float)it);
        asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(mine + i), "l"(word) : "memory");
      }
      // poll: thread t reads word t of every peer's block addressed to me
      for (uint32_t p = 0; p < cs; ++p) {
        if (p == me || threadIdx.x >= MSG / 4) continue;
        const uint64_t* src_w = buf + ((size_t)cl * MAXC + p) * MAXC * (MSG / 4) + me * (MSG / 4) + threadIdx.x;
        uint64_t w;
        do {
          asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(w) : "l"(src_w) : "memory");
        } while ((uint32_t)(w >> 32) != f);
      }
      asm volatile("bar.sync 1, %0;" ::"n"(NT) : "memory");
    }
  }
  unsigned long long t1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  if (threadIdx.x == 0) {
    res[blockIdx.x * 4] = t1 - t0;
    done = 1;
  }
  // no CTA may leave while a peer can still write into its shared memory
  asm volatile("bar.sync 1, %0;" ::"n"(NT) : "memory");
}

int main() {
  int dev = 0, sms = 0, clk = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CK(cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, dev));
  CK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, DYN));
  CK(cudaFuncSetAttribute(probe, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  const size_t src_bytes = (size_t)2 << 30;
  char* src;
  CK(cudaMalloc(&src, src_bytes));
  CK(cudaMemset(src, 1, src_bytes));
  uint64_t* ll;
  const size_t ll_bytes = (size_t)2 * LL_CLUSTERS * MAXC * MAXC * (MSG / 4) * 8;
  CK(cudaMalloc(&ll, ll_bytes));
  unsigned long long* res;
  CK(cudaMalloc(&res, sms * 4 * sizeof(unsigned long long)));
  printf("SMs %d, SM clock %.0f MHz\n", sms, clk / 1e3);
  for (int cs : {2, 4, 8, 16}) {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute at[2];
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = cs;
    at[0].val.clusterDim.y = 1;
    at[0].val.clusterDim.z = 1;
    at[1].id = cudaLaunchAttributeCooperative;
    at[1].val.cooperative = 1;
    cfg.blockDim = dim3(LAUNCH);
    cfg.dynamicSmemBytes = DYN;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    cfg.gridDim = dim3(sms / cs * cs);
    int maxc = -1;
    cudaError_t e = cudaOccupancyMaxActiveClusters(&maxc, probe, &cfg);
    printf("cluster %2d: max active clusters %d (%s) -> %d blocks of %d SMs\n", cs, maxc, cudaGetErrorString(e),
           maxc * cs, sms);
    if (e != cudaSuccess || maxc < 1) continue;
    cfg.gridDim = dim3(maxc * cs);
    for (int coop : {0, 1}) {
      cfg.numAttrs = coop ? 2 : 1;
      for (int mode : {0, 1})
        for (int stream : {0, 1}) {
          CK(cudaMemset(ll, 0, ll_bytes));
          CK(cudaMemset(res, 0, sms * 4 * sizeof(unsigned long long)));
          const int iters = 2000;
          cudaEvent_t a, b;
          CK(cudaEventCreate(&a));
          CK(cudaEventCreate(&b));
          CK(cudaEventRecord(a));
          e = cudaLaunchKernelEx(&cfg, probe, iters, mode, stream, (const char*)src, src_bytes, ll, res);
          CK(cudaEventRecord(b));
          cudaError_t s = cudaDeviceSynchronize();
          if (e != cudaSuccess || s != cudaSuccess) {
            printf("  coop %d mode %d stream %d: launch %s, run %s\n", coop, mode, stream, cudaGetErrorString(e),
                   cudaGetErrorString(s));
            if (s != cudaSuccess) return 1;
            continue;
          }
          float ms = 0;
          CK(cudaEventElapsedTime(&ms, a, b));
          unsigned long long h[4 * 256];
          CK(cudaMemcpy(h, res, sms * 4 * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
          double cyc = 0, bytes = 0;
          const int n = maxc * cs;
          for (int i = 0; i < n; ++i) { cyc += h[i * 4]; bytes += h[i * 4 + 2]; }
          const double per_round_ns = cyc / n / iters;  // globaltimer ns
          printf("  coop %d %-5s stream %d: %.0f ns per all-to-all round (%d CTAs x %d B); stream %.0f GB/s\n", coop,
                 mode == 0 ? "DSMEM" : "L2 LL", stream, per_round_ns, cs, MSG, bytes / (ms * 1e-3) / 1e9);
        }
    }
  }
  return 0;
}
