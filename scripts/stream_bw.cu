// For scripts/gpu_stream_bw.py (issue 16's small-batch kernel): how fast can one persistent block
// per SM stream weights from HBM, by method? The products prototype (products_engine.cu) read its
// weights at ~1.9 TB/s on an H200 with 1 KB bulk copies (one per weight row) and ~2.95 TB/s with one
// 16 KB copy a unit, whatever its ring depth past 8 units: this measures where that limit is.
//
// Every block streams its contiguous share of a buffer (sized far past L2) once:
//   method 0, bulk copies: issuer lanes 0..I-1 of warp 0 take ring units u = lane, lane + I, ...;
//     a unit of U bytes is filled by U / C copies of C bytes (cp.async.bulk, completing on the
//     unit's mbarrier, L2 evict-first); warp 1's lane 0 waits for each unit in order and releases
//     it (the consumer, doing nothing else); R units in the ring.
//   method 1, loads: every thread of 8 warps loads 16 bytes at a time with L loads in flight (a
//     register block, xor-folded into one word so the loads stay).
// The host times the launch with events; bytes / time is the rate.
#include <cuda_runtime.h>
#include <cstdint>

#include "../csrc/small/common.cuh"

namespace {

constexpr int MAXR = 16;

struct Args {
  const unsigned char* buf;
  unsigned long long per;  // bytes a block (a multiple of U)
  unsigned* sink;
  int method, C, U, R, I, L;
};

__device__ __forceinline__ void mbar_wait(uint32_t a, uint32_t parity) {
  while (!mbar_try(a, parity)) {
  }
}

}  // namespace

__global__ void __launch_bounds__(256, 1) stream_bw_kernel(const __grid_constant__ Args A) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) unsigned long long full[MAXR], empty[MAXR];
  const unsigned char* src = A.buf + (size_t)blockIdx.x * A.per;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (A.method == 1) {
    uint4 acc = make_uint4(0, 0, 0, 0);
    const size_t step = (size_t)blockDim.x * 16;
    for (size_t off = (size_t)threadIdx.x * 16; off < A.per; off += step * A.L) {
      uint4 v[16];
#pragma unroll
      for (int i = 0; i < 16; ++i)
        if (i < A.L && off + step * i < A.per)
          v[i] = __ldcs(reinterpret_cast<const uint4*>(src + off + step * i));
        else
          v[i] = make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int i = 0; i < 16; ++i) acc.x ^= v[i].x, acc.y ^= v[i].y, acc.z ^= v[i].z, acc.w ^= v[i].w;
    }
    if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x12345678u) A.sink[0] = 1;  // keeps the loads
    return;
  }
  if (threadIdx.x == 0) ring_init(full, empty, A.R);
  __syncthreads();
  const uint32_t n = (uint32_t)(A.per / A.U);  // units
  if (warp == 0 && lane < A.I) {
    const uint64_t policy = evict_first_policy();
    for (uint32_t i = lane; i < n; i += A.I) {
      const int u = i % A.R;
      if (i >= (uint32_t)A.R) mbar_wait(smem_u32(empty + u), ((i / A.R) - 1) & 1u);
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(full + u)),
                   "r"((uint32_t)A.U) : "memory");
      for (int c = 0; c < A.U; c += A.C)
        bulk_copy(smem_u32(smem + (size_t)u * A.U + c), src + (size_t)i * A.U + c, (uint32_t)A.C, smem_u32(full + u),
                  policy);
    }
  } else if (warp == 1 && lane == 0) {
    for (uint32_t i = 0; i < n; ++i) {
      const int u = i % A.R;
      mbar_wait(smem_u32(full + u), (i / A.R) & 1u);
      mbar_arrive(smem_u32(empty + u));
    }
  }
}

// Streams `bytes` of buf (per block: bytes / blocks, rounded down to U) once. Returns a CUDA error.
extern "C" int stream_bw_run(const void* buf, unsigned long long bytes, unsigned* sink, int blocks, int method, int C,
                             int U, int R, int I, int L, void* stream) {
  if (R > MAXR || U % C != 0 || I < 1 || I > 32 || L < 1 || L > 16) return -1;
  Args A;
  A.buf = static_cast<const unsigned char*>(buf);
  A.per = (bytes / blocks) / U * U;
  A.sink = sink;
  A.method = method, A.C = C, A.U = U, A.R = R, A.I = I, A.L = L;
  const int smem = method == 0 ? R * U : 0;
  cudaError_t e = cudaFuncSetAttribute(stream_bw_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return (int)e;
  stream_bw_kernel<<<blocks, 256, smem, (cudaStream_t)stream>>>(A);
  return (int)cudaGetLastError();
}

extern "C" unsigned long long stream_bw_per_block(unsigned long long bytes, int blocks, int U) {
  return (bytes / blocks) / U * U;
}
