// Micro-probe (issue 3): the latency of an L2 *hit* on every SM while all SMs stream weights from
// HBM, per way and depth of streaming. Warp 1 of each block walks a pointer chase over a small
// L2-resident buffer (ld.global.cg, each load depends on the last) while the block streams; we
// report the mean latency of one chase step and the aggregate streaming rate.
// Build and run: make probes && tools/probes/build/latency_probe
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

constexpr int NT = 256;
constexpr int SLOT = 64 * 1024;
constexpr int CHASE = 1024;  // uint32 words per block (32 lines of 128 B)

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_wait(uint64_t* mbar, uint32_t parity) {
  uint32_t ok = 0;
  while (!ok)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(ok) : "r"(smem_u32(mbar)), "r"(parity) : "memory");
}

// mode: 0 none; 1 bulk piece = bytes, one at a time; 2 bulk, two pieces of `bytes` in flight;
// 3 ld.global by warps 4-7, `bytes` per round (in flight) then consumed
__global__ void __launch_bounds__(NT, 1) probe(const uint4* __restrict__ src, size_t nslices, const uint32_t* chase,
                                               unsigned long long* res, int total_kb, int mode, int bytes) {
  extern __shared__ __align__(128) uint4 slot[];
  __shared__ __align__(8) uint64_t mbar[2];
  __shared__ volatile int done;
  const int b = blockIdx.x, w = threadIdx.x >> 5;
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&mbar[0])) : "memory");
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&mbar[1])) : "memory");
    done = 0;
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncthreads();
  const size_t total = (size_t)total_kb * 1024;
  const char* base = reinterpret_cast<const char*>(src) + ((size_t)b * total) % (nslices * SLOT);
  if (w == 1) {  // the chase
    if ((threadIdx.x & 31) == 0) {
      const uint32_t* c = chase + (size_t)b * CHASE;
      uint32_t idx = 0;
      unsigned long long steps = 0, cyc = 0;
      while (!done) {
        const unsigned long long t0 = clock64();
#pragma unroll 1
        for (int i = 0; i < 16; ++i) idx = __ldcg(c + idx);
        cyc += clock64() - t0;
        steps += 16;
      }
      res[b * 3] = cyc;
      res[b * 3 + 1] = steps + (idx == 0xffffffffu);
    }
    return;
  }
  const unsigned long long start = clock64();
  if (mode == 1 || mode == 2) {
    if (threadIdx.x == 0) {
      uint32_t par[2] = {0, 0};
      const int n = (int)(total / bytes), inflight = mode;
      for (int i = 0; i < n + inflight; ++i) {
        if (i >= inflight) { mbar_wait(&mbar[i % 2 * (inflight - 1)], par[i % 2 * (inflight - 1)]); par[i % 2 * (inflight - 1)] ^= 1; }
        if (i < n) {
          const int s = i % 2 * (inflight - 1);
          asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(&mbar[s])), "r"(bytes) : "memory");
          asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                           smem_u32(slot) + s * (SLOT / 2)), "l"(base + (size_t)i * bytes), "r"(bytes), "r"(smem_u32(&mbar[s])) : "memory");
        }
      }
    }
  } else if (mode == 3 && w >= 4) {
    const int t = threadIdx.x - 128;
    const int per = bytes / (128 * 16);  // loads per thread per round (<= 16)
    uint32_t x = 0;
    for (size_t off = 0; off < total; off += bytes) {
      uint4 r[16];
#pragma unroll
      for (int q = 0; q < 16; ++q)
        if (q < per)
          asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r[q].x), "=r"(r[q].y), "=r"(r[q].z), "=r"(r[q].w)
                       : "l"(base + off + ((size_t)q * 128 + t) * 16));
#pragma unroll
      for (int q = 0; q < 16; ++q)
        if (q < per) x ^= r[q].x ^ r[q].y ^ r[q].z ^ r[q].w;
    }
    if (x == 0x12345u) res[0] = 1;
  } else if (mode == 0 && threadIdx.x == 0) {
    while (clock64() - start < 2000000ull) {}
  }
  asm volatile("bar.sync 1, 224;" ::: "memory");  // warps 0, 2-7
  if (threadIdx.x == 0) { res[b * 3 + 2] = clock64() - start; done = 1; }
}

int main() {
  int sms = 0, clk = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CK(cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0));
  const size_t bytes = (size_t)2 << 30;
  uint4* src;
  uint32_t* chase;
  unsigned long long* res;
  CK(cudaMalloc(&src, bytes));
  CK(cudaMemset(src, 1, bytes));
  CK(cudaMalloc(&chase, (size_t)sms * CHASE * 4));
  uint32_t* h = (uint32_t*)malloc((size_t)sms * CHASE * 4);
  for (int b = 0; b < sms; ++b)  // a cycle over 32 lines (stride 32 words = 128 B), shuffled
    for (int i = 0; i < 32; ++i) h[b * CHASE + ((i * 7) % 32) * 32] = (((i + 1) * 7) % 32) * 32;
  CK(cudaMemcpy(chase, h, (size_t)sms * CHASE * 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&res, sms * 3 * 8));
  CK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, SLOT));
  unsigned long long* r = (unsigned long long*)malloc(sms * 3 * 8);
  struct M { const char* name; int mode, bytes; } ms[] = {
      {"no stream", 0, 0},           {"bulk 64 KB pieces, 1 in flight", 1, 65536},
      {"bulk 32 KB x 1", 1, 32768},  {"bulk 16 KB x 1", 1, 16384},
      {"bulk 8 KB x 1", 1, 8192},    {"bulk 16 KB x 2", 2, 16384},
      {"bulk 8 KB x 2", 2, 8192},    {"ld.global 32 KB/round (4 warps)", 3, 32768},
      {"ld.global 16 KB/round", 3, 16384}, {"ld.global 8 KB/round", 3, 8192}};
  printf("SMs %d; L2-hit chase latency per step while every SM streams %d MB\n", sms, 4);
  printf("%-34s %12s %10s\n", "stream", "hit ns", "GB/s");
  for (const M& m : ms) {
    for (int rep = 0; rep < 2; ++rep) {
      cudaEvent_t e0, e1;
      CK(cudaEventCreate(&e0));
      CK(cudaEventCreate(&e1));
      CK(cudaEventRecord(e0));
      probe<<<sms, NT, SLOT>>>(src, bytes / SLOT, chase, res, 4096, m.mode, m.bytes);
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      CK(cudaGetLastError());
      float ms_;
      CK(cudaEventElapsedTime(&ms_, e0, e1));
      CK(cudaMemcpy(r, res, sms * 3 * 8, cudaMemcpyDeviceToHost));
      double cyc = 0, steps = 0;
      for (int b = 0; b < sms; ++b) { cyc += r[b * 3]; steps += r[b * 3 + 1]; }
      const double ns = cyc / steps / (clk / 1e6);
      const double gbs = m.mode == 0 ? 0 : (double)sms * 4096 * 1024 / (ms_ * 1e-3) / 1e9;
      if (rep == 1) printf("%-34s %12.0f %10.0f\n", m.name, ns, gbs);
    }
  }
  return 0;
}
