// The batched talker step: one persistent cooperative launch advances every stream of a step by
// the talker step that ends its frame (after the code-predictor kernel, predict.cu, made the
// frame's 16 codes): the frame's input row, 28 layers over the paged KV pool, the final norm (the
// slot's next past_hidden), the codec head and the code-0 draw, and the slot's state commit.
// Same arithmetic for every B, so a stream's bits are batch-invariant (gemm.cuh, talker.cuh).
#include "kernels.h"
#include "talker.cuh"

using namespace qbk;

__global__ void __launch_bounds__(THREADS, 1) qbk_advance_kernel(const __grid_constant__ QbkParams P, int B) {
  QBK_DYNAMIC_SMEM(smem);
  const Misc ms(smem);
  Grid grid{P.sync + SYNC_BAR, P.sync + SYNC_ERR, (uint64_t)P.timeout_ns, 0u, ms.flag,
            P.trace != nullptr ? P.trace + 2 * (size_t)P.trace_events * blockIdx.x : nullptr, (uint32_t)P.trace_events};
  const int regm = (int)P.reg_max_m, sm = (int)P.split_mode, nl = (int)P.t_num_layers;
  phase_talker_input(P, B, ms.red);
  for (int L = 0; L < nl; ++L) {
    const Gemm gq = make_gemm(P.t_wqkv[L], nullptr, QKV, QKV, H, B, 0, 1, P.hs, P.parts, regm, sm);
    if (!product(gq, grid, smem) || !grid.sync()) return;
    phase_talker_attention(P, L, B, gq.nparts());
    if (!grid.sync()) return;
    phase_talker_combine(P, B);
    const Gemm go = make_gemm(P.t_wo[L], nullptr, H, H, QD, B, 0, 1, P.hs, P.parts, regm, sm);
    if (!product(go, grid, smem) || !grid.sync()) return;
    phase_residual(P, B, go.nparts(), P.t_post_norm[L], ms.red);
    const Gemm gu = make_gemm(P.t_gate[L], P.t_up[L], I, 2 * I, H, B, 0, 1, P.hs, P.parts, regm, sm);
    if (!product(gu, grid, smem) || !grid.sync()) return;
    phase_swiglu(P, B, gu.nparts());
    const Gemm gd = make_gemm(P.t_down[L], nullptr, H, H, I, B, 0, 1, P.hs, P.parts, regm, sm);
    if (!product(gd, grid, smem) || !grid.sync()) return;
    const bool last = L + 1 == nl;  // the final norm is the slot's next past_hidden
    phase_residual(P, B, gd.nparts(), last ? P.t_final_norm : P.t_in_norm[L + 1], ms.red, last);
  }
  const Gemm gh = make_gemm(P.codec_head, nullptr, VT, VT, H, B, 0, 1, P.hs, P.parts, regm, sm);
  if (!product(gh, grid, smem) || !grid.sync()) return;
  phase_talker_draw(P, B, gh.nparts(), smem);
}
