// The batched kernels (one persistent cooperative launch each) and what both share: the phase
// sequencing helper around a product, and the launch-wide shared-memory carve-up.
#pragma once
#include "gemm.cuh"
#include "params.h"
#include "rows.cuh"

// Codes 1..15 of rows[0..B) (csrc/batched/predict.cu); rows B..Bpad-1 of out get codes 0.
__global__ void qbk_predict_kernel(const __grid_constant__ QbkParams P, int B, int Bpad);
// The talker step of rows[0..B) after their codes (csrc/batched/advance.cu).
__global__ void qbk_advance_kernel(const __grid_constant__ QbkParams P, int B);

namespace qbk {

// A product phase: register-path weights of the warp's first task are loaded before the grid
// barrier (they do not depend on the previous phase); then the product runs.
// The register path: this warp's first task's weights are copied into its 8 KB of shared memory
// while the block waits at the barrier (issued after its arrival, so that the issue does not
// delay it; each lane copies the fragments it will read, so it waits for its own copies only).
__device__ __noinline__ inline bool product_reg(const Gemm& g, Grid& grid, uint8_t* smem) {
  uint4* st = reinterpret_cast<uint4*>(smem + (threadIdx.x >> 5) * REG_STAGE_BYTES) + (threadIdx.x & 31);
#if QBK_ISSUE_AFTER_ARRIVE
  grid.arrive();  // also: the block's previous phase is done with shared memory
  if (global_warp() < g.ntasks()) reg_stage_w(g, global_warp(), st);
  cp_async_commit();
#else
  __syncthreads();  // the block's previous phase is done with shared memory
  if (global_warp() < g.ntasks()) reg_stage_w(g, global_warp(), st);
  cp_async_commit();
  grid.arrive();
#endif
  if (!grid.wait()) return false;
  cp_async_wait<0>();
  reg_run(g, st);
  return true;
}

__device__ __noinline__ inline bool product_smem(const Gemm& g, Grid& grid, uint8_t* smem) {
  if (!grid.sync()) return false;
  smem_dispatch(g, smem);
  return true;
}

// The barrier that makes the product's inputs visible, then the product.
__device__ __forceinline__ bool product(const Gemm& g, Grid& grid, uint8_t* smem) {
  return g.reg ? product_reg(g, grid, smem) : product_smem(g, grid, smem);
}

struct Misc {
  float* red;   // [WARPS]
  int* flag;
  int* codes;   // [WARPS]
  __device__ explicit Misc(uint8_t* smem)
      : red(reinterpret_cast<float*>(smem + SMEM_BYTES)), flag(reinterpret_cast<int*>(smem + SMEM_BYTES + 32)),
        codes(reinterpret_cast<int*>(smem + SMEM_BYTES + 64)) {}
};

}  // namespace qbk
