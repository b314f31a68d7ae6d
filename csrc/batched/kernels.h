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

// A product phase: the grid barrier that makes its inputs visible, then the product.
// The register path: this warp's first task's weights are copied into its 8 KB of shared memory
// while the block waits at the barrier (issued after its arrival, so that the issue does not
// delay it: issued before, B = 1's predict took 4.38 ms instead of 4.15; each lane copies the
// fragments it will read, so it waits for its own copies only).
__device__ __noinline__ inline bool product_reg(const Gemm& g, Grid& grid, uint8_t* smem) {
  uint4* st = reinterpret_cast<uint4*>(smem + (threadIdx.x >> 5) * REG_STAGE_BYTES) + (threadIdx.x & 31);
  grid.arrive();  // also: the block's previous phase is done with shared memory
  if (global_warp() < g.ntasks()) reg_stage_w(g, global_warp(), st);
  cp_async_commit();
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

__device__ __forceinline__ bool product(const Gemm& g, Grid& grid, uint8_t* smem) {
  return g.reg ? product_reg(g, grid, smem) : product_smem(g, grid, smem);
}

// Past the pipeline's stages (which the draws and the register path's staging also use): block
// sums, the barrier flag, a block's drawn codes.
struct Misc {
  float* red;   // [WARPS]
  int* flag;
  int* codes;   // [WARPS]
  __device__ explicit Misc(uint8_t* smem)
      : red(reinterpret_cast<float*>(smem + SMEM_BYTES)), flag(reinterpret_cast<int*>(smem + SMEM_BYTES + 32)),
        codes(reinterpret_cast<int*>(smem + SMEM_BYTES + 64)) {}
};

}  // namespace qbk
