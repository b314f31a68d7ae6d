// The batched code-predictor kernel: one persistent cooperative launch makes the 15 code-predictor
// passes of a decode frame (codes 1..15) for every stream of a step, B = 1..256. Every per-stream
// value is computed by the same arithmetic whatever B is and whichever rows share the launch
// (gemm.cuh, rows.cuh, sample.cuh), so a stream's codes are bitwise batch-invariant.
// The talker step that ends the frame stays in the batched engine's graphs (frame.py `advance`).
// Host interface: a C ABI loaded with ctypes (tts_server/engines/batched/cuda_cp.py).
#ifndef QBK_EMU
#include <cuda_runtime.h>
#endif
#include <stddef.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include <string>
#include <type_traits>
#include <vector>

#include "gemm.cuh"
#include "params.h"
#include "rows.cuh"
#include "sample.cuh"

#define QBK_ABI_VERSION 1

using namespace qbk;

namespace {

// Register-path weights of the phase's first task are loaded before the grid barrier (they do not
// depend on the previous phase); then the product runs.
__device__ __noinline__ bool product(const Gemm& g, Grid& grid, uint8_t* smem) {
  WFrag wf;
  if (g.reg && global_warp() < g.ntasks()) reg_load_w(g, global_warp(), wf);
  if (!grid.sync()) return false;
  if (g.reg) reg_run(g, wf);
  else smem_dispatch(g, smem);
  return true;
}

// The draw of pass `pass` for every stream (a warp each), then the next pass's input rows
// (codebook pass + 1's embedding of the drawn code, RMSNorm) by the block that drew them.
__device__ __noinline__ void phase_sample(const QbkParams& P, int pass, int B, int np, float* red, int* codes,
                                         uint8_t* smem) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int m = blockIdx.x * WARPS + warp;
  if (m < B) {
    const int64_t slot = P.rows[m];
    const int64_t ns = P.num_slots;
    float* xs = reinterpret_cast<float*>(smem) + warp * VC;  // this warp's logits
    const size_t ps = (size_t)B * VC;
    for (int i = 0; i < SV; ++i) {
      const size_t off = (size_t)m * VC + lane + 32 * i;
      float v = __ldcg(P.parts + off);
      for (int p = 1; p < np; ++p) v += __ldcg(P.parts + p * ps + off);
      xs[lane + 32 * i] = v;
      if (P.dump != nullptr) P.dump[m * P.dump_stride + pass * P.dump_pass + lane + 32 * i] = v;
    }
    const Draw dr{P.ints[P.f_do_sample * ns + slot], P.floats[P.f_temperature * ns + slot],
                  P.ints[P.f_top_k * ns + slot],     P.floats[P.f_top_p * ns + slot],
                  P.seed[slot],                       (int64_t)P.ints[P.f_n_sampled * ns + slot],
                  pass + 1};
    bool finite;
    int code = warp_sample(xs, dr, finite);
    code = code < 0 ? 0 : code >= VC ? VC - 1 : code;
    if (lane == 0) {
      int32_t* o = P.out + m * P.out_stride;
      o[pass + 1] = code;
      const int32_t f = __ldcg(P.flags + m) | (finite ? 0 : 1 << pass);
      P.flags[m] = f;
      if (pass + 1 == P.num_passes) o[P.out_err] = f;
      codes[warp] = code;
    }
  }
  if (pass + 1 == P.num_passes) return;
  __syncthreads();
  const int d = threadIdx.x * 4;
  for (int w = 0; w < WARPS; ++w) {
    const int mm = blockIdx.x * WARPS + w;
    if (mm >= B) break;
    const float4 x = ld_bf4(P.emb + ((size_t)pass * VC + codes[w]) * H + d);
    *reinterpret_cast<float4*>(P.x + (size_t)mm * H + d) = x;
    norm_store(P, mm, x, P.in_norm[0], red);
  }
}

}  // namespace

__global__ void __launch_bounds__(THREADS, 1) qbk_predict_kernel(const __grid_constant__ QbkParams P, int B, int Bpad) {
  QBK_DYNAMIC_SMEM(smem);
  float* red = reinterpret_cast<float*>(smem + SMEM_BYTES);  // [WARPS]
  int* flag = reinterpret_cast<int*>(smem + SMEM_BYTES + 32);
  int* codes = reinterpret_cast<int*>(smem + SMEM_BYTES + 64);  // [WARPS]
  Grid grid{P.sync + SYNC_BAR, P.sync + SYNC_ERR, (uint64_t)P.timeout_ns, 0u, flag};
  const int nlayers = (int)P.num_layers;
  const int regm = (int)P.reg_max_m;
  phase_init(P, B, Bpad, red);
  for (int pass = 0; pass < P.num_passes; ++pass) {
    const int R = pass == 0 ? 2 : 1, M = B * R;
    for (int L = 0; L < nlayers; ++L) {
      const Gemm gq = make_gemm(P.wqkv[L], nullptr, QKV, QKV, H, M, 0, 1, P.hs, P.parts, regm);
      if (!product(gq, grid, smem) || !grid.sync()) return;
      phase_attention(P, L, pass, B, R, gq.nparts());
      const Gemm go = make_gemm(P.wo[L], nullptr, H, H, QD, M, 0, 1, P.hs, P.parts, regm);
      if (!product(go, grid, smem) || !grid.sync()) return;
      phase_residual(P, M, go.nparts(), P.post_norm[L], red);
      const Gemm gu = make_gemm(P.gate[L], P.up[L], I, 2 * I, H, M, 0, 1, P.hs, P.parts, regm);
      if (!product(gu, grid, smem) || !grid.sync()) return;
      phase_swiglu(P, M, gu.nparts());
      const Gemm gd = make_gemm(P.down[L], nullptr, H, H, I, M, 0, 1, P.hs, P.parts, regm);
      if (!product(gd, grid, smem) || !grid.sync()) return;
      phase_residual(P, M, gd.nparts(), L + 1 < nlayers ? P.in_norm[L + 1] : P.final_norm, red);
    }
    // pass 0's head reads position 1 of each stream (hs rows 1, 3, 5, ...)
    const Gemm gh = make_gemm(P.head[pass], nullptr, VC, VC, H, B, pass == 0 ? 1 : 0, R, P.hs, P.parts, regm);
    if (!product(gh, grid, smem) || !grid.sync()) return;
    phase_sample(P, pass, B, gh.nparts(), red, codes, smem);
  }
}

// ---- host ABI ----------------------------------------------------------------------------------
namespace {

struct Field {
  std::string name;
  size_t offset;
  char kind;  // 'p' pointer, 'i' int64, 'd' double
};

template <typename T>
constexpr char kind_of() {
  return std::is_pointer<T>::value ? 'p' : std::is_same<T, double>::value ? 'd' : 'i';
}

const std::vector<Field>& fields() {
  static const std::vector<Field> f = [] {
    std::vector<Field> v;
#define QBK_F(t, n) v.push_back({#n, offsetof(QbkParams, n), kind_of<t>()});
#define QBK_A(t, n, k) \
  for (int i = 0; i < (k); ++i) v.push_back({std::string(#n "[") + std::to_string(i) + "]", offsetof(QbkParams, n) + i * sizeof(t), kind_of<t>()});
    QBK_PARAM_FIELDS(QBK_F, QBK_A)
#undef QBK_F
#undef QBK_A
    return v;
  }();
  return f;
}

struct Const {
  const char* name;
  long long value;
};
const Const kConsts[] = {
    {"H", H}, {"NH", NH}, {"NKV", NKV}, {"HD", HD}, {"I", I}, {"LAYERS", LAYERS}, {"VC", VC}, {"VT", VT},
    {"GROUPS", GROUPS}, {"POS", POS}, {"MAX_ROWS", MAX_ROWS}, {"KMAX", KMAX}, {"NMAX", NMAX}, {"PIECE", PIECE},
    {"REG_MAX_M", REG_MAX_M}, {"SYNC_WORDS", SYNC_WORDS}, {"SYNC_ERR", SYNC_ERR}, {"ERR_TIMEOUT", ERR_TIMEOUT},
    {"THREADS", THREADS}, {"SMEM_BYTES", SMEM_TOTAL}, {"PASSES", PASSES},
#ifdef QBK_EMU
    {"EMULATED", 1},
#else
    {"EMULATED", 0},
#endif
    // product outputs per row of M: the register path's K / PIECE parts of the widest (gate|up)
    {"PARTS_REG_PER_ROW", (long long)(H / PIECE) * NMAX}, {"PARTS_SMEM_PER_ROW", NMAX},
    {"sizeof(QbkParams)", (long long)sizeof(QbkParams)},
};

}  // namespace

extern "C" {

int qbk_abi_version() { return QBK_ABI_VERSION; }
int qbk_param_count() { return (int)fields().size(); }
const char* qbk_param_name(int i) { return fields().at(i).name.c_str(); }
long long qbk_param_offset(int i) { return (long long)fields().at(i).offset; }
int qbk_param_kind(int i) { return fields().at(i).kind; }
int qbk_const_count() { return (int)(sizeof(kConsts) / sizeof(kConsts[0])); }
const char* qbk_const_name(int i) { return kConsts[i].name; }
long long qbk_const_value(int i) { return kConsts[i].value; }

static bool bad_args(const QbkParams& p, int B, int Bpad, int blocks) {
  return B < 1 || Bpad < B || Bpad > p.max_rows || p.max_rows > MAX_ROWS || blocks < 1 || p.reg_max_m < 0 ||
         p.reg_max_m > REG_MAX_M || p.num_layers < 1 || p.num_layers > LAYERS || p.num_passes < 1 ||
         p.num_passes > PASSES;
}

#ifdef QBK_EMU
// The emulator (tools/simt/simt.h): QBK_EMU_BLOCKS blocks (default 2); the launch runs to its end
// on the calling thread.
int qbk_grid_size(int, int* blocks) {
  const char* e = getenv("QBK_EMU_BLOCKS");
  *blocks = e != nullptr && atoi(e) > 0 ? atoi(e) : 2;
  return 0;
}

int qbk_predict(const void* params, int B, int Bpad, int blocks, void*) {
  QbkParams p;
  memcpy(&p, params, sizeof p);
  if (bad_args(p, B, Bpad, blocks)) return 1;
  memset(p.sync, 0, SYNC_WORDS * sizeof(uint32_t));
  try {
    simt::launch(blocks, THREADS, SMEM_TOTAL, [&] { qbk_predict_kernel(p, B, Bpad); });
  } catch (const std::exception& e) {
    fprintf(stderr, "qbk_predict (emulated): %s\n", e.what());
    return 2;
  }
  return 0;
}

const char* qbk_error_string(int code) {
  return code == 0 ? "no error" : code == 1 ? "invalid argument" : "emulated launch failed (deadlock)";
}
#else
// Blocks for `device`: one per SM, checked co-resident with the kernel's shared memory. Returns a
// cudaError_t (0 = ok).
int qbk_grid_size(int device, int* blocks) {
  cudaDeviceProp prop;
  cudaError_t e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess) return e;
  if (!prop.cooperativeLaunch) return cudaErrorNotSupported;
  e = cudaFuncSetAttribute(qbk_predict_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_TOTAL);
  if (e != cudaSuccess) return e;
  int per_sm = 0;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, qbk_predict_kernel, THREADS, SMEM_TOTAL);
  if (e != cudaSuccess) return e;
  if (per_sm < 1) return cudaErrorCooperativeLaunchTooLarge;
  *blocks = prop.multiProcessorCount;
  return cudaSuccess;
}

// The code-predictor half of one frame for rows[0..B) (params: a QbkParams the host filled by
// name), rows B..Bpad-1 of `out` zeroed (a graph bucket's padding), on `stream`: zero the sync
// words, then one cooperative launch. A wait past the timeout lands in sync[SYNC_ERR].
int qbk_predict(const void* params, int B, int Bpad, int blocks, void* stream) {
  QbkParams p;
  memcpy(&p, params, sizeof p);
  if (bad_args(p, B, Bpad, blocks)) return cudaErrorInvalidValue;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t e = cudaFuncSetAttribute(qbk_predict_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_TOTAL);
  if (e != cudaSuccess) return e;
  e = cudaMemsetAsync(p.sync, 0, SYNC_WORDS * sizeof(uint32_t), s);
  if (e != cudaSuccess) return e;
  void* args[] = {&p, &B, &Bpad};
  return cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(qbk_predict_kernel), dim3(blocks), dim3(THREADS),
                                     args, SMEM_TOTAL, s);
}

const char* qbk_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }
#endif

}  // extern "C"
