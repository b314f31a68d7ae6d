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
__device__ __noinline__ inline bool product(const Gemm& g, Grid& grid, uint8_t* smem) {
  WFrag wf;
  if (g.reg && global_warp() < g.ntasks()) reg_load_w(g, global_warp(), wf);
  if (!grid.sync()) return false;
  if (g.reg) reg_run(g, wf);
  else smem_dispatch(g, smem);
  return true;
}

// Past the pipeline's stages (which the draws also use for their logits): block sums, the
// barrier flag, a block's drawn codes.
struct Misc {
  float* red;   // [WARPS]
  int* flag;
  int* codes;   // [WARPS]
  __device__ explicit Misc(uint8_t* smem)
      : red(reinterpret_cast<float*>(smem + SMEM_BYTES)), flag(reinterpret_cast<int*>(smem + SMEM_BYTES + 32)),
        codes(reinterpret_cast<int*>(smem + SMEM_BYTES + 64)) {}
};

}  // namespace qbk
