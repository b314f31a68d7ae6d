// The batched code-predictor kernel: one persistent cooperative launch makes the 15 code-predictor
// passes of a decode frame (codes 1..15) for every stream of a step, B = 1..256. Every per-stream
// value is computed by the same arithmetic whatever B is and whichever rows share the launch
// (gemm.cuh, rows.cuh, sample.cuh), so a stream's codes are bitwise batch-invariant.
// The talker step that ends the frame is the second kernel (advance.cu); both are launched through
// the C ABI of abi.cu (tts_server/engines/batched/cuda_frame.py).
#include "kernels.h"
#include "sample.cuh"

using namespace qbk;

namespace {

// The draw of pass `pass` for every stream (a warp each; a block takes WARPS streams a round),
// then the next pass's input rows (codebook pass + 1's embedding of the drawn code, RMSNorm) by
// the block that drew them.
__device__ __noinline__ void phase_sample(const QbkParams& P, int pass, int B, int np, float* red, int* codes,
                                         uint8_t* smem) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool last = pass + 1 == P.num_passes;
  for (int base = blockIdx.x * WARPS; base < B; base += gridDim.x * WARPS) {
    const int m = base + warp;
    if (m < B) {
      const int64_t slot = P.rows[m];
      const int64_t ns = P.num_slots;
      float* xs = reinterpret_cast<float*>(smem) + warp * VC;  // this warp's logits
      int* kept = reinterpret_cast<int*>(smem) + WARPS * VC + warp * KEPT_MAX;
      gather_logits<VC>(P, np, B, m, pass * P.dump_pass, xs, [](int, float x) { return x; });
      const Draw dr{P.ints[P.f_do_sample * ns + slot], P.floats[P.f_temperature * ns + slot],
                    P.ints[P.f_top_k * ns + slot],     P.floats[P.f_top_p * ns + slot],
                    P.seed[slot],                       (int64_t)P.ints[P.f_n_sampled * ns + slot],
                    pass + 1};
      bool finite;
      int code = warp_sample<VC / 32>(xs, kept, dr, finite);
      code = code < 0 ? 0 : code >= VC ? VC - 1 : code;
      if (lane == 0) {
        int32_t* o = P.out + m * P.out_stride;
        o[pass + 1] = code;
        const int32_t f = __ldcg(P.flags + m) | (finite ? 0 : 1 << pass);
        P.flags[m] = f;
        if (last) o[P.out_err] = f;
        codes[warp] = code;
      }
    }
    if (last) continue;
    __syncthreads();
    const int d = threadIdx.x * 4;
    for (int w = 0; w < WARPS && base + w < B; ++w) {
      const int mm = base + w;
      const float4 x = ld_bf4(P.emb + ((size_t)pass * VC + codes[w]) * H + d);
      *reinterpret_cast<float4*>(P.x + (size_t)mm * H + d) = x;
      norm_store(P, mm, x, P.in_norm[0], red);
    }
    __syncthreads();  // the logits and codes of this round are read; the next round reuses them
  }
}

}  // namespace

__global__ void __launch_bounds__(THREADS, 1) qbk_predict_kernel(const __grid_constant__ QbkParams P, int B, int Bpad) {
  QBK_DYNAMIC_SMEM(smem);
  const Misc ms(smem);
  float* red = ms.red;
  Grid grid{P.sync + SYNC_BAR, P.sync + SYNC_ERR, (uint64_t)P.timeout_ns, 0u, ms.flag,
            P.trace != nullptr ? P.trace + 2 * (size_t)P.trace_events * blockIdx.x : nullptr, (uint32_t)P.trace_events};
  const int nlayers = (int)P.num_layers;
  const int regm = (int)P.reg_max_m, sm = (int)P.split_mode, tl = (int)P.tile;
  phase_init(P, B, Bpad, red);
  for (int pass = 0; pass < P.num_passes; ++pass) {
    const int R = pass == 0 ? 2 : 1, M = B * R;
    for (int L = 0; L < nlayers; ++L) {
      const Gemm gq = make_gemm(P.wqkv[L], nullptr, QKV, QKV, H, M, 0, 1, P.hs, P.parts, regm, sm, tl);
      if (!product(gq, grid, smem) || !grid.sync()) return;
      phase_attention(P, L, pass, B, R, gq.nparts());
      const Gemm go = make_gemm(P.wo[L], nullptr, H, H, QD, M, 0, 1, P.hs, P.parts, regm, sm, tl);
      if (!product(go, grid, smem) || !grid.sync()) return;
      phase_residual(P, M, go.nparts(), P.post_norm[L], red);
      const Gemm gu = make_gemm(P.gate[L], P.up[L], I, 2 * I, H, M, 0, 1, P.hs, P.parts, regm, sm, tl);
      if (!product(gu, grid, smem) || !grid.sync()) return;
      phase_swiglu(P, M, gu.nparts());
      const Gemm gd = make_gemm(P.down[L], nullptr, H, H, I, M, 0, 1, P.hs, P.parts, regm, sm, tl);
      if (!product(gd, grid, smem) || !grid.sync()) return;
      phase_residual(P, M, gd.nparts(), L + 1 < nlayers ? P.in_norm[L + 1] : P.final_norm, red);
    }
    // pass 0's head reads position 1 of each stream (hs rows 1, 3, 5, ...)
    const Gemm gh = make_gemm(P.head[pass], nullptr, VC, VC, H, B, pass == 0 ? 1 : 0, R, P.hs, P.parts, regm, sm, tl);
    if (!product(gh, grid, smem) || !grid.sync()) return;
    phase_sample(P, pass, B, gh.nparts(), red, ms.codes, smem);
  }
}

