// One persistent cooperative launch per decode frame of Qwen3-TTS (batch 1, one slot):
// 15 code-predictor passes (the first over 2 positions) with on-GPU sampling of codes 1..15,
// the 16-codebook embedding sum plus the text-track vector, one 28-layer talker step, the codec
// head and the code-0 draw. Phases (ops/layer.cuh) are separated by a per-instance split-phase grid
// barrier, or hand their outputs to the few blocks that read them as LL words (ops/common.cuh).
// Host interface: a C ABI (qmk_*; abi.cu adds the layout by name), loaded with ctypes by
// tts_server/engines/megakernel.py.
#include <cuda_runtime.h>

#include "ops/layer.cuh"
#include "ops/producer.cuh"

using namespace qmk;

namespace {

// Block-level: talker processors + draw of code 0, then the slot's bookkeeping (thread 0).
__device__ void sample_code0(const QmkState& st, int slot, int commit, SampleSmem& sm, const int* codes) {
  const QmkSampling sp = st.samp[slot];
  const int nsamp = st.n_sampled[slot];
  talker_process(sm.l, st.logits, st.seen + (size_t)slot * QMK_VT, sp.repetition_penalty, nsamp,
                 st.min_new_tokens, st.eos, st.suppress_start, QMK_VT);
  const SampleParams p{sp.do_sample, sp.temperature, sp.top_k, sp.top_p};
  const int code = block_sample(sm.l, QMK_VT, p, sp.seed, (uint32_t)nsamp, 0u, sm);
  if (threadIdx.x == 0) {
    int32_t* o = st.out + (size_t)slot * QMK_OUT_WORDS;
    if (codes != nullptr)
      for (int k = 0; k < QMK_GROUPS; ++k) o[k] = codes[k];
    o[16] = code;
    o[17] = code == st.eos;
    if (commit) {
      st.code0[slot] = code;
      st.n_sampled[slot] = nsamp + 1;
      st.seen[(size_t)slot * QMK_VT + code] = 1;
    }
  }
}

}  // namespace

// Threads per block: the compute threads, plus the producer warpgroup (ops/producer.cuh).
// Registers per thread after setmaxnreg (sm_90a): the producer needs few, the compute threads get
// the rest.
constexpr int LAUNCH_THREADS = QMK_LAUNCH_THREADS;
constexpr int PRODUCER_REGS = 40;
// The launch gives every thread LAUNCH_REGS (a multiple of 8); setmaxnreg.inc waits until the
// pool that the producers' dec frees can cover it, so the compute count must fit in that pool.
constexpr int LAUNCH_REGS = 65536 / LAUNCH_THREADS / 8 * 8;
constexpr int COMPUTE_REGS =
    (LAUNCH_REGS * LAUNCH_THREADS - PRODUCER_REGS * QMK_PRODUCER_THREADS) / QMK_THREADS / 8 * 8;
static_assert(COMPUTE_REGS <= 256 && PRODUCER_REGS >= 24, "setmaxnreg range");

__global__ void __launch_bounds__(LAUNCH_THREADS, 1)
    qmk_frame_kernel(const __grid_constant__ QmkState st, const __grid_constant__ QmkModel model, int slot, int flags) {
  // The weight table is a kernel parameter (constant bank): each phase reads its layer's pointers
  // before its barrier wait, and from global memory that read waited on HBM (the weight stream
  // evicts the table from L2), before the poll could even start.
  const QmkModel* m = &model;
  __shared__ Smem sm;
  __shared__ float red32[NW];
  __shared__ float red[RED_FLOATS];
  __shared__ float xown[QMK_MAX_T][ROWS_H_MAX];
  __shared__ __align__(16) float xres[QMK_MAX_T][QMK_H];
  __shared__ int flag;
  __shared__ int codes[QMK_GROUPS];
  __shared__ __align__(16) AttnStatic astat;
  extern __shared__ uint4 stage[];  // [STAGE_BYTES / 16]: slots X | Y
  __shared__ __align__(8) uint64_t mbar[NSLOTS];
  __shared__ __align__(8) uint64_t empty[NSLOTS];
  __shared__ __align__(8) uint64_t pace;
  if (threadIdx.x == 0) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&pace)) : "memory");
  Stage sg{{stage, stage + X_BYTES / 16}, mbar, empty, 0u, st.sync, st.timeout_ns};
  sg.init();  // every thread (producers included) passes its __syncthreads
  // Nothing to stream when the frame is a barrier benchmark or the talker's context is full.
  const bool no_frame = (flags & QMK_FLAG_BARRIER_BENCH) || (!(flags & QMK_FLAG_CP_ONLY) && st.pos[slot] >= st.max_pos);
  if (threadIdx.x >= QMK_THREADS) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(PRODUCER_REGS));
#endif
    if (!no_frame && threadIdx.x == QMK_THREADS) {
      Producer p;
      p.init(sg, &pace);
      p.run(&model, !(flags & QMK_FLAG_TALKER_ONLY), !(flags & QMK_FLAG_CP_ONLY));
    }
    return;
  }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(COMPUTE_REGS));
#endif
  Grid g{st.sync, st.timeout_ns, 0u, st.ll_seq << QMK_LL_USE_BITS, 0u};
#if QMK_TRACE
  g.tep = 0;
  {
    const int G = gridDim.x, b = blockIdx.x;
    const int slot3 = b == 0 ? 0 : b == G / 2 ? 1 : b == G - 1 ? 2 : -1;
    g.tr = (st.dump != nullptr && slot3 >= 0) ? reinterpret_cast<uint32_t*>(st.dump) + slot3 * QMK_TRACE_EPOCHS * QMK_TRACE_MARKS
                                               : nullptr;
    g.t0 = clock64();
  }
#endif
  const Ctx c{st, m, sm, red32, red, xown, xres, &flag, codes, g, (flags & QMK_FLAG_BF16_EXACT) != 0, sg, astat};
  const int commit = !(flags & QMK_FLAG_NO_COMMIT);
  if (flags & QMK_FLAG_BARRIER_BENCH) {
    for (int i = 0; i < QMK_BARRIER_BENCH_N; ++i)
      if (!g.sync_all(&flag)) return;
    return;
  }
  const int pos = st.pos[slot];
  const int nsamp = st.n_sampled[slot];
  const QmkSampling sp = st.samp[slot];
  if (no_frame) {  // the context is full (barrier benchmarks returned above)
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicCAS(st.sync + QMK_SYNC_ERR, 0u, (uint32_t)QMK_ERR_CONTEXT_FULL);
    return;
  }
  if (threadIdx.x < QMK_GROUPS) codes[threadIdx.x] = threadIdx.x == 0 ? st.code0[slot] : 0;
  bsync();

  if (!(flags & QMK_FLAG_TALKER_ONLY)) {
    const size_t lstride = (size_t)QMK_NKV * QMK_CP_POS * QMK_HD;
    const SampleParams sub{sp.sub_do_sample, sp.sub_temperature, sp.sub_top_k, sp.sub_top_p};
    for (int k = 0; k < TALKER_STACK; ++k) {  // the code predictor's passes (ops/schedule.cuh)
      const Stack sk = frame_stack(m, k);
      bool ok;
      if (k == 0) {  // [past_hidden, codec_embedding(code0)] at positions 0, 1
        const Input in{1, {nullptr, m->codec_emb + (size_t)codes[0] * QMK_H}, st.past_hidden + (size_t)slot * QMK_H,
                       nullptr};
        ok = run_stack<2, float, true>(c, sk.layers, sk.nlayers, in, 0, st.cp_k, st.cp_v, lstride, QMK_CP_POS,
                                       m->inv_freq_cp);
        ok = ok && head_phase(c, sk.norm, sk.rows, 1, nullptr, 0);
      } else {  // codec_embedding[k-1](code k) at position k+1
        const Input in{1, {m->cp_emb[k - 1] + (size_t)codes[k] * QMK_H, nullptr}, nullptr, nullptr};
        ok = run_stack<1, float, true>(c, sk.layers, sk.nlayers, in, k + 1, st.cp_k, st.cp_v, lstride, QMK_CP_POS,
                                       m->inv_freq_cp);
        ok = ok && head_phase(c, sk.norm, sk.rows, 0, nullptr, k);
      }
      if (!ok) return;
      // Every block draws the same code from the same logits: no extra barrier before the next pass.
      // The temperature is applied as the logits are loaded.
      const bool scale = sub.do_sample && sub.temperature != 1.0f;
      for (int i = threadIdx.x; i < QMK_VC; i += NT) {
        const float v = __ldcg(st.logits + i);
        sm.sa.l[i] = scale ? v / sub.temperature : v;
      }
      bsync();
      const int code = block_sample(sm.sa.l, QMK_VC, sub, sp.seed, (uint32_t)nsamp, (uint32_t)(k + 1), sm.sa, true);
      if (threadIdx.x == 0) codes[k + 1] = code;
      bsync();
    }
  }
  if (flags & QMK_FLAG_CP_ONLY) {
    if (blockIdx.x == 0 && threadIdx.x == 0)
      for (int k = 0; k < QMK_GROUPS; ++k) st.out[(size_t)slot * QMK_OUT_WORDS + k] = codes[k];
    return;
  }

  const int ts = st.text_step[slot];
  const qmk_bf16* text = ts < st.n_trailing[slot] ? st.trailing + ((size_t)slot * st.max_trailing + ts) * QMK_H
                                                  : st.pad_embed + (size_t)slot * QMK_H;
  const size_t lstride = (size_t)QMK_NKV * st.max_pos * QMK_HD;
  const size_t sstride = lstride * QMK_TALKER_LAYERS;
  const Input in{2, {nullptr, nullptr}, nullptr, text};
  const Stack sk = frame_stack(m, TALKER_STACK);
  bool ok;
  if (flags & QMK_FLAG_KV_FP32) {
    float* kk = static_cast<float*>(st.kv_k) + slot * sstride;
    float* vv = static_cast<float*>(st.kv_v) + slot * sstride;
    ok = run_stack<1, float, false>(c, sk.layers, sk.nlayers, in, pos, kk, vv, lstride, st.max_pos, m->inv_freq_talker);
  } else {
    qmk_bf16* kk = static_cast<qmk_bf16*>(st.kv_k) + slot * sstride;
    qmk_bf16* vv = static_cast<qmk_bf16*>(st.kv_v) + slot * sstride;
    ok = run_stack<1, qmk_bf16, false>(c, sk.layers, sk.nlayers, in, pos, kk, vv, lstride, st.max_pos, m->inv_freq_talker);
  }
  if (!ok) return;
  if (!head_phase(c, sk.norm, sk.rows, 0, commit ? st.past_hidden + (size_t)slot * QMK_H : nullptr, TALKER_STACK))
    return;
  if (blockIdx.x != 0) return;
  sample_code0(st, slot, commit, sm.sa, codes);
  if (commit && threadIdx.x == 0) {
    st.pos[slot] = pos + 1;
    st.text_step[slot] = ts + 1;
  }
}

// Prefill's code-0 draw from st.logits (filled by the host's batched prefill).
__global__ void __launch_bounds__(QMK_THREADS, 1) qmk_sample_talker_kernel(const __grid_constant__ QmkState st, int slot) {
  __shared__ SampleSmem sm;
  sample_code0(st, slot, 1, sm, nullptr);
}

extern "C" {

// The layout constants, struct offsets and phase names are exported by abi.cu.
int qmk_abi_version() { return QMK_ABI_VERSION; }
// Grid for `device`: one block per SM, checked co-resident. Returns a cudaError_t (0 = ok);
// cudaErrorCooperativeLaunchTooLarge when the device cannot hold the grid.
int qmk_grid_size(int device, int* blocks, int* sms) {
  cudaDeviceProp prop;
  cudaError_t e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess) return e;
  if (!prop.cooperativeLaunch) return cudaErrorNotSupported;
  e = cudaFuncSetAttribute(qmk_frame_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, STAGE_BYTES);
  if (e != cudaSuccess) return e;
  int per_sm = 0;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, qmk_frame_kernel, LAUNCH_THREADS, STAGE_BYTES);
  if (e != cudaSuccess) return e;
  *sms = prop.multiProcessorCount;
  if (per_sm < 1 || prop.multiProcessorCount < QMK_MIN_BLOCKS) return cudaErrorCooperativeLaunchTooLarge;
  *blocks = prop.multiProcessorCount;
  return cudaSuccess;
}

// One decode frame of `slot` on `stream`: advance the instance's LL sequence (zeroing its LL
// buffers when it wraps, so that no flag of an older launch can match), zero its sync words, then
// one cooperative launch. model: the weight table in host memory (passed by value as a kernel
// parameter). Errors inside the kernel (a wait or poll past the timeout, full context) land in
// st->sync[QMK_SYNC_ERR].
int qmk_frame(QmkState* st, const QmkModel* model, int slot, int flags, int blocks, void* stream) {
  if (blocks < QMK_MIN_BLOCKS || slot < 0 || slot >= st->num_slots) return cudaErrorInvalidValue;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t e = cudaFuncSetAttribute(qmk_frame_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, STAGE_BYTES);
  if (e != cudaSuccess) return e;
  if (st->ll_seq == 0 || st->ll_seq >= QMK_LL_SEQ_MAX) {
    e = cudaMemsetAsync(st->qkv, 0, (size_t)QMK_QKV_WORDS * sizeof(uint64_t), s);
    if (e == cudaSuccess) e = cudaMemsetAsync(st->part, 0, (size_t)QMK_PART_WORDS * sizeof(uint64_t), s);
    if (e == cudaSuccess) e = cudaMemsetAsync(st->x, 0, (size_t)QMK_X_WORDS * sizeof(uint64_t), s);
    if (e != cudaSuccess) return e;
    st->ll_seq = 0;
  }
  st->ll_seq += 1;
  e = cudaMemsetAsync(st->sync, 0, QMK_SYNC_WORDS * sizeof(uint32_t), s);
  if (e != cudaSuccess) return e;
  QmkState stv = *st;
  QmkModel mv = *model;
  void* args[] = {&stv, &mv, &slot, &flags};
  return cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(qmk_frame_kernel), dim3(blocks),
                                     dim3(LAUNCH_THREADS), args, STAGE_BYTES, s);
}

int qmk_sample_talker(const QmkState* st, int slot, void* stream) {
  if (slot < 0 || slot >= st->num_slots) return cudaErrorInvalidValue;
  qmk_sample_talker_kernel<<<1, QMK_THREADS, 0, static_cast<cudaStream_t>(stream)>>>(*st, slot);
  return cudaGetLastError();
}

const char* qmk_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // extern "C"
