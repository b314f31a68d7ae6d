// Micro-probe (issue 3): how long a grid-barrier release (a gpu-scope release fence + the arrival
// add) takes on an SM that has a weight slice in flight, per way of loading that slice. Every
// block (one per SM) streams its own 64 KB slices from a large HBM buffer (so HBM is as busy as in
// the megakernel), waits DELAY cycles (a phase's compute), stores a few outputs, then thread 0
// times its release with clock64. Build and run: make probes && tools/probes/build/fence_probe
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

constexpr int NT = 256;
constexpr int SLICE = 64 * 1024;

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

enum Load { L_NONE, L_BULK_CLUSTER, L_BULK_CTA, L_CPASYNC_W47, L_LDG_W47, L_PREFETCH_L2, L_BULK_4x16, NLOAD };
enum Rel { R_RED_RELEASE, R_FENCE_RELAXED, R_RELAXED_ONLY, R_ST_RELEASE, R_RED_RELEASE_W4, NREL };
static const char* LN[] = {"none", "bulk shared::cluster (as now)", "bulk shared::cta", "cp.async 16B, warps 4-7",
                           "ld.global.nc, warps 4-7", "bulk prefetch.L2", "bulk x4 16KB"};
static const char* RN[] = {"red.release.gpu", "fence.acq_rel.gpu + red.relaxed", "red.relaxed only (unsafe)",
                           "st.release.gpu", "red.release.gpu by warp 4"};

__global__ void __launch_bounds__(NT, 1) probe(const uint4* __restrict__ src, size_t nslices, uint32_t* ctr, float* out,
                                               unsigned long long* res, int iters, int delay, int load, int rel) {
  extern __shared__ __align__(128) uint4 slot[];
  __shared__ __align__(8) uint64_t mbar;
  __shared__ uint32_t sink;
  const int b = blockIdx.x, G = gridDim.x, w = threadIdx.x >> 5;
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&mbar)) : "memory");
    sink = 0;
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncthreads();
  uint32_t parity = 0;
  unsigned long long acc = 0, tot = 0;
  uint32_t x = 0;
  for (int it = 0; it < iters; ++it) {
    const uint4* s = src + ((size_t)(it * G + b) % nslices) * (SLICE / 16);
    const unsigned long long start = clock64();
    const bool bulk = load == L_BULK_CLUSTER || load == L_BULK_CTA || load == L_BULK_4x16;
    if (threadIdx.x == 0) {
      if (bulk) asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(&mbar)), "r"(SLICE) : "memory");
      if (load == L_BULK_CLUSTER)
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_u32(slot)),
                     "l"(s), "r"(SLICE), "r"(smem_u32(&mbar)) : "memory");
      if (load == L_BULK_CTA)
        asm volatile("cp.async.bulk.shared::cta.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_u32(slot)),
                     "l"(s), "r"(SLICE), "r"(smem_u32(&mbar)) : "memory");
      if (load == L_BULK_4x16)
        for (int q = 0; q < 4; ++q)
          asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                           smem_u32(slot) + q * (SLICE / 4)),
                       "l"(s + q * (SLICE / 64)), "r"(SLICE / 4), "r"(smem_u32(&mbar)) : "memory");
      if (load == L_PREFETCH_L2)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(s), "r"(SLICE) : "memory");
    }
    if (load == L_CPASYNC_W47 && w >= 4) {
      const int t = threadIdx.x - 128;
      for (int q = 0; q < SLICE / 16 / 128; ++q)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(slot + q * 128 + t)), "l"(s + q * 128 + t) : "memory");
      asm volatile("cp.async.commit_group;" ::: "memory");
    }
    uint4 r[16];
    if (load == L_LDG_W47 && w >= 4) {
      const int t = threadIdx.x - 128;
#pragma unroll
      for (int q = 0; q < 16; ++q)
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r[q].x), "=r"(r[q].y), "=r"(r[q].z), "=r"(r[q].w)
                     : "l"(s + q * 128 + t));
    }
    // the phase's compute
    if (w < 4) {
      const unsigned long long t0 = clock64();
      while (clock64() - t0 < (unsigned long long)delay) {}
      out[((size_t)b * 4 + (it & 3)) * 128 + threadIdx.x] = (float)it;  // phase outputs
    }
    asm volatile("bar.sync 1, 128;" ::: "memory");  // warps 0-3 (the loaders may still be issuing)
    const int rel_thread = rel == R_RED_RELEASE_W4 ? 128 : 0;
    if (rel_thread == 128) __syncthreads();
    if ((int)threadIdx.x == rel_thread) {
      const unsigned long long t0 = clock64();
      if (rel == R_RED_RELEASE || rel == R_RED_RELEASE_W4)
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(ctr) : "memory");
      else if (rel == R_FENCE_RELAXED)
        asm volatile("fence.acq_rel.gpu; red.relaxed.gpu.global.add.u32 [%0], 1;" ::"l"(ctr) : "memory");
      else if (rel == R_RELAXED_ONLY)
        asm volatile("red.relaxed.gpu.global.add.u32 [%0], 1;" ::"l"(ctr) : "memory");
      else
        asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(ctr + 32 + b), "r"(it) : "memory");
      // a dependent read of the clock after the fence retired
      acc += clock64() - t0;
    }
    // drain the slice before the next iteration
    if (bulk && threadIdx.x == 0) {
      uint32_t ok = 0;
      while (!ok)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(ok) : "r"(smem_u32(&mbar)), "r"(parity) : "memory");
    }
    parity ^= 1;
    if (load == L_CPASYNC_W47 && w >= 4) asm volatile("cp.async.wait_all;" ::: "memory");
    if (load == L_LDG_W47 && w >= 4) {
#pragma unroll
      for (int q = 0; q < 16; ++q) x ^= r[q].x ^ r[q].y ^ r[q].z ^ r[q].w;
    }
    __syncthreads();
    if (threadIdx.x == 0) tot += clock64() - start;
  }
  if (x == 0x12345678u) atomicAdd(&sink, 1u);
  if (threadIdx.x == (rel == R_RED_RELEASE_W4 ? 128 : 0)) res[b * 2] = acc;
  if (threadIdx.x == 0) res[b * 2 + 1] = tot;
}

int main(int argc, char** argv) {
  const int iters = argc > 1 ? atoi(argv[1]) : 200;
  int dev = 0, sms = 0, clk = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CK(cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, dev));  // kHz
  const size_t bytes = (size_t)2 << 30;
  uint4* src;
  uint32_t* ctr;
  float* out;
  unsigned long long* res;
  CK(cudaMalloc(&src, bytes));
  CK(cudaMemset(src, 1, bytes));
  CK(cudaMalloc(&ctr, 4096));
  CK(cudaMalloc(&out, (size_t)sms * 4 * 128 * 4));
  CK(cudaMalloc(&res, sms * 16));
  CK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, SLICE));
  unsigned long long* h = (unsigned long long*)malloc(sms * 16);
  printf("SMs %d, clock %.0f MHz, slice %d KB, all SMs streaming\n", sms, clk / 1e3, SLICE / 1024);
  const double us_per_cyc = 1e3 / clk;
  for (int delay : {0, 1500}) {
    printf("\ndelay %d cycles (%.2f us) between the issue and the release\n", delay, delay * us_per_cyc);
    printf("%-34s %-36s %12s %12s %10s\n", "slice load", "release", "release us", "iter us", "GB/s");
    for (int l = 0; l < NLOAD; ++l)
      for (int r = 0; r < NREL; ++r) {
        if (l != L_BULK_CLUSTER && r == R_RED_RELEASE_W4) continue;
        probe<<<sms, NT, SLICE>>>(src, bytes / SLICE, ctr, out, res, 20, delay, l, r);  // warm
        cudaEvent_t e0, e1;
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
        CK(cudaEventRecord(e0));
        probe<<<sms, NT, SLICE>>>(src, bytes / SLICE, ctr, out, res, iters, delay, l, r);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        CK(cudaGetLastError());
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        CK(cudaMemcpy(h, res, sms * 16, cudaMemcpyDeviceToHost));
        double a = 0, t = 0;
        for (int b = 0; b < sms; ++b) { a += h[2 * b]; t += h[2 * b + 1]; }
        a /= (double)sms * iters;
        t /= (double)sms * iters;
        const double gbs = l == L_NONE ? 0 : (double)sms * iters * SLICE / (ms * 1e-3) / 1e9;
        printf("%-34s %-36s %12.3f %12.3f %10.0f\n", LN[l], RN[r], a * us_per_cyc, t * us_per_cyc, gbs);
      }
  }
  return 0;
}
