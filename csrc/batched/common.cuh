// Device helpers of the batched kernel: the grid barrier (bounded), L2 loads of data other blocks
// wrote in this launch, fixed-order block sums, the bf16 hi/lo split and the mma.
#pragma once
#include <stdint.h>

#include "arch.cuh"
#include "dims.h"

namespace qbk {

// Grid barrier over a per-launch counter (zeroed by the host before the launch): epoch e is
// complete at e x gridDim arrivals. Thread 0 arrives with a release and polls with an acquire
// after the block barrier, so every write before it is visible to every block after it (readers
// of such data use L2 loads, ldcg). A wait longer than timeout_ns, or another block's error,
// makes it return false in every thread; the caller leaves.
struct Grid {
  uint32_t* bar;
  uint32_t* err;
  uint64_t timeout_ns;
  uint32_t epoch;
  int* flag;  // shared
  uint64_t* trace;   // optional: barrier e's arrival and exit times of this block at [e][0..1]
  uint32_t trace_events;

  // The two halves of sync(): work between them (loads that need nothing of the other blocks)
  // overlaps the wait.
  __device__ void arrive() {
    __syncthreads();
    if (threadIdx.x == 0) {
      if (trace != nullptr && epoch < trace_events) trace[2 * epoch] = globaltimer();
      epoch += 1;
      red_release_add(bar, 1u);
    }
  }

  __device__ bool wait() {
    if (threadIdx.x == 0) {
      const uint32_t target = epoch * gridDim.x;
      const uint64_t t0 = globaltimer();
      int bad = 0;
      for (uint32_t spin = 1;; ++spin) {
        if (ld_acquire(bar) >= target) break;
        if ((spin & 63u) == 0) {
          if (*(volatile uint32_t*)err != 0) { bad = 1; break; }
          if (globaltimer() - t0 > timeout_ns) {
            atomicCAS(err, 0u, (uint32_t)ERR_TIMEOUT);
            bad = 1;
            break;
          }
        }
      }
      *flag = bad;
      if (trace != nullptr && epoch - 1 < trace_events) trace[2 * (epoch - 1) + 1] = globaltimer();
    }
    __syncthreads();
    return *flag == 0;
  }

  __device__ bool sync() {
    arrive();
    return wait();
  }
};

__device__ __forceinline__ float4 ldcg4(const float* p) { return __ldcg(reinterpret_cast<const float4*>(p)); }
__device__ __forceinline__ uint4 ldcg16(const void* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); }
__device__ __forceinline__ uint4 ldg16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

__device__ __forceinline__ int global_warp() { return blockIdx.x * WARPS + (threadIdx.x >> 5); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum of every thread's v over the block, in a fixed order (warp trees, then warps 0..7), the
// same value in every thread. red: shared [WARPS].
__device__ __forceinline__ float block_sum(float v, float* red) {
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float s = red[0];
#pragma unroll
  for (int w = 1; w < WARPS; ++w) s += red[w];
  __syncthreads();
  return s;
}

__device__ __forceinline__ uint32_t pack_bf2(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);  // a in the low half
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ float lo_bf(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float hi_bf(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }
__device__ __forceinline__ float rbf(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// 4 consecutive bf16 (8-byte aligned) as fp32.
__device__ __forceinline__ float4 ld_bf4(const __nv_bfloat16* p) {
  const uint2 r = __ldg(reinterpret_cast<const uint2*>(p));
  return make_float4(lo_bf(r.x), hi_bf(r.x), lo_bf(r.y), hi_bf(r.y));
}

// fp32 x -> hi = bf16(x), lo = bf16(x - hi): 4 values into the hi and lo rows of a product input
// (hs row layout: [part][KMAX]).
__device__ __forceinline__ void split_store4(__nv_bfloat16* hi_row, __nv_bfloat16* lo_row, int d, float4 v) {
  const float h0 = rbf(v.x), h1 = rbf(v.y), h2 = rbf(v.z), h3 = rbf(v.w);
  *reinterpret_cast<uint2*>(hi_row + d) = make_uint2(pack_bf2(h0, h1), pack_bf2(h2, h3));
  *reinterpret_cast<uint2*>(lo_row + d) = make_uint2(pack_bf2(v.x - h0, v.y - h1), pack_bf2(v.z - h2, v.w - h3));
}

// The two mma of one 32-column block of a piece (gemm.cuh): wg / wg8 are 8 weight columns of rows g
// and g + 8, xv 8 input columns of the lane's (token, part) row.
__device__ __forceinline__ void mma_k32(float (&d)[4], const uint4 wg, const uint4 wg8, const uint4 xv) {
  mma16816(d, wg.x, wg8.x, wg.y, wg8.y, xv.x, xv.y);
  mma16816(d, wg.z, wg8.z, wg.w, wg8.w, xv.z, xv.w);
}

}  // namespace qbk
