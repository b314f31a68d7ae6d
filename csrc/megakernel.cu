// One persistent cooperative launch per decode frame of Qwen3-TTS (batch 1, one slot):
// 15 code-predictor passes (the first over 2 positions) with on-GPU sampling of codes 1..15,
// the 16-codebook embedding sum plus the text-track vector, one 28-layer talker step, the codec
// head and the code-0 draw. Phases are separated by a per-instance grid barrier (ops/common.cuh).
// Host interface: a C ABI (qmk_*), loaded with ctypes by tts_server/kernels/megakernel.py.
#include <cuda_runtime.h>

#include "ops/attention.cuh"
#include "ops/common.cuh"
#include "ops/matvec.cuh"
#include "ops/sampling.cuh"

using namespace qmk;

namespace {

constexpr int ROWS_MAX = (QMK_I + QMK_MIN_BLOCKS - 1) / QMK_MIN_BLOCKS;  // 48 rows of gate (and of up)
constexpr int RED_MAX = 2 * ROWS_MAX * (QMK_H / 256) * QMK_MAX_T;         // gate+up units x T
constexpr int OUT_MAX = 2 * ROWS_MAX * QMK_MAX_T;
static_assert((QMK_QKV + QMK_MIN_BLOCKS - 1) / QMK_MIN_BLOCKS * (QMK_H / 256) * QMK_MAX_T <= RED_MAX, "qkv");
static_assert((QMK_H + QMK_MIN_BLOCKS - 1) / QMK_MIN_BLOCKS * (QMK_I / 256) * QMK_MAX_T <= RED_MAX, "down");
static_assert((QMK_VT + QMK_MIN_BLOCKS - 1) / QMK_MIN_BLOCKS * (QMK_H / 256) <= RED_MAX, "head");

struct MvSmem {
  float xs[QMK_MAX_T][QMK_I];  // activations [T][K] for K <= 3072
  float red[RED_MAX];
  float out[OUT_MAX];
};
union Smem {
  MvSmem mv;
  AttnSmem at;
  SampleSmem sa;
};

// Where a stack's first layer takes its input from.
struct Input {
  int kind;                          // 0: st.x   1: one row per token   2: frame embedding sum
  const qmk_bf16* row[QMK_MAX_T];    // kind 1 (bf16 embedding rows)
  const float* frow0;                // kind 1: token 0 from an fp32 row instead (past_hidden)
  const qmk_bf16* text;              // kind 2: text-track vector
};

struct Ctx {
  const QmkState& st;
  const QmkModel* m;
  Smem& sm;
  float* red32;
  int* flag;
  int* codes;  // smem [16]: this frame's codes
  Grid& g;
  bool prefetch;  // L2 prefetch of the next phase's weights
  bool exact;     // bf16-exact rounding points (QMK_FLAG_BF16_EXACT)
};

// xs[t][0..H) = the layer input (bf16 values as fp32).
template <int T>
__device__ void load_input(const Ctx& c, const Input& in) {
  float(*xs)[QMK_I] = c.sm.mv.xs;
  for (int idx = threadIdx.x; idx < T * QMK_H; idx += NT) {
    const int t = idx / QMK_H, d = idx % QMK_H;
    float v;
    if (in.kind == 0) {
      v = __ldcg(c.st.x + t * QMK_H + d);
    } else if (in.kind == 1) {
      v = (t == 0 && in.frow0 != nullptr) ? in.frow0[d] : bf2f(in.row[t][d]);
    } else {  // qwen-tts: cat(16 embeddings).sum(1) (fp32 accumulate, one rounding) + text
      float s = bf2f(c.m->codec_emb[(size_t)c.codes[0] * QMK_H + d]);
      for (int k = 1; k < QMK_GROUPS; ++k) s += bf2f(c.m->cp_emb[k - 1][(size_t)c.codes[k] * QMK_H + d]);
      v = rnd(rnd(s, c.exact) + bf2f(in.text[d]), c.exact);
    }
    xs[t][d] = v;
  }
  __syncthreads();
}

// In place: xs[t] = w * bf16(xs[t] * rsqrt(mean(xs[t]^2) + eps)), as Qwen3TTSRMSNorm in bf16.
template <int T>
__device__ void rmsnorm_xs(const Ctx& c, const qmk_bf16* w) {
  float(*xs)[QMK_I] = c.sm.mv.xs;
#pragma unroll
  for (int t = 0; t < T; ++t) {
    float ss = 0.f;
    for (int d = threadIdx.x; d < QMK_H; d += NT) ss += xs[t][d] * xs[t][d];
    ss = block_sum(ss, c.red32);
    const float rinv = 1.0f / sqrtf(ss / (float)QMK_H + c.st.eps);
    for (int d = threadIdx.x; d < QMK_H; d += NT) xs[t][d] = rnd(bf2f(w[d]) * rnd(xs[t][d] * rinv, c.exact), c.exact);
  }
  __syncthreads();
}

// xs[t][0..n) = src[t * n + i] (written by other blocks: read through L2).
template <int T>
__device__ void load_scratch(const Ctx& c, const float* src, int n) {
  for (int idx = threadIdx.x; idx < T * n; idx += NT) c.sm.mv.xs[idx / n][idx % n] = __ldcg(src + idx);
  __syncthreads();
}

// One decoder stack over T tokens at positions p0.. (K/V cache: kc/vc + layer * lstride).
template <int T>
__device__ bool run_stack(const Ctx& c, const QmkLayer* layers, int nlayers, const Input& in0, int p0,
                          qmk_bf16* kc, qmk_bf16* vc, size_t lstride, int ld_pos, const float* inv_freq,
                          const qmk_bf16* head, int vocab) {
  const QmkState& st = c.st;
  const int G = gridDim.x, b = blockIdx.x;
  float* out = c.sm.mv.out;
  int h0, hn, i0, in_, q0, qn;  // this block's rows of the H-, I- and QKV-row matrices
  rows_of(b, G, QMK_H, h0, hn);
  rows_of(b, G, QMK_I, i0, in_);
  rows_of(b, G, QMK_QKV, q0, qn);
  for (int L = 0; L < nlayers; ++L) {
    const QmkLayer& w = layers[L];
    int r0, n;
    if (c.prefetch) block_prefetch_rows([&](int r) { return w.o + (size_t)(h0 + r) * QMK_QD; }, hn, QMK_QD);
    // P1: input RMSNorm (every block, redundantly) + q|k|v rows of this block.
    if (L == 0) {
      load_input<T>(c, in0);
      rows_of(b, G, QMK_H, r0, n);  // the rows this block owns in the residual phases
      for (int idx = threadIdx.x; idx < T * n; idx += NT)
        st.x[(idx / n) * QMK_H + r0 + idx % n] = c.sm.mv.xs[idx / n][r0 + idx % n];
    } else {
      load_input<T>(c, Input{0, {nullptr, nullptr}, nullptr, nullptr});
    }
    rmsnorm_xs<T>(c, w.in_norm);
    rows_of(b, G, QMK_QKV, r0, n);
    block_matvec<T, QMK_H>(
        [&](int r) {
          const int row = r0 + r;
          return row < QMK_QD ? w.q + (size_t)row * QMK_H
                 : row < QMK_QD + QMK_KVD ? w.k + (size_t)(row - QMK_QD) * QMK_H
                                          : w.v + (size_t)(row - QMK_QD - QMK_KVD) * QMK_H;
        },
        n, &c.sm.mv.xs[0][0], c.sm.mv.red, out);
    for (int idx = threadIdx.x; idx < n * T; idx += NT) st.qkv[(idx % T) * QMK_QKV + r0 + idx / T] = rnd(out[idx], c.exact);
    if (!c.g.sync_all(c.flag)) return false;

    // P2: q/k norm + RoPE + KV append + attention.
    if (c.prefetch) {
      block_prefetch_rows([&](int r) { return w.gate + (size_t)(i0 + r) * QMK_H; }, in_, QMK_H);
      block_prefetch_rows([&](int r) { return w.up + (size_t)(i0 + r) * QMK_H; }, in_, QMK_H);
    }
    AttnLayer a{st.qkv, kc + L * lstride, vc + L * lstride, ld_pos, w.q_norm, w.k_norm, inv_freq, st.eps,
                st.attn, st.part, st.sync + QMK_SYNC_HEAD, c.exact};
    attention_phase<T>(a, p0, c.sm.at);
    if (!c.g.sync_all(c.flag)) return false;

    // P3: o_proj + residual on this block's rows.
    if (c.prefetch) block_prefetch_rows([&](int r) { return w.down + (size_t)(h0 + r) * QMK_I; }, hn, QMK_I);
    load_scratch<T>(c, st.attn, QMK_QD);
    rows_of(b, G, QMK_H, r0, n);
    block_matvec<T, QMK_QD>([&](int r) { return w.o + (size_t)(r0 + r) * QMK_QD; }, n, &c.sm.mv.xs[0][0],
                            c.sm.mv.red, out);
    for (int idx = threadIdx.x; idx < n * T; idx += NT) {
      float* px = st.x + (idx % T) * QMK_H + r0 + idx / T;
      *px = rnd(__ldcg(px) + rnd(out[idx], c.exact), c.exact);
    }
    if (!c.g.sync_all(c.flag)) return false;

    // P4: post-attention RMSNorm + gate/up rows of this block -> SwiGLU activations.
    if (c.prefetch) {
      if (L + 1 < nlayers) {
        const QmkLayer& nx = layers[L + 1];
        block_prefetch_rows(
            [&](int r) {
              const int row = q0 + r;
              return row < QMK_QD ? nx.q + (size_t)row * QMK_H
                     : row < QMK_QD + QMK_KVD ? nx.k + (size_t)(row - QMK_QD) * QMK_H
                                              : nx.v + (size_t)(row - QMK_QD - QMK_KVD) * QMK_H;
            },
            qn, QMK_H);
      } else {
        int v0, vn;
        rows_of(b, G, vocab, v0, vn);
        block_prefetch_rows([&](int r) { return head + (size_t)(v0 + r) * QMK_H; }, vn, QMK_H);
      }
    }
    load_input<T>(c, Input{0, {nullptr, nullptr}, nullptr, nullptr});
    rmsnorm_xs<T>(c, w.post_norm);
    rows_of(b, G, QMK_I, r0, n);
    block_matvec<T, QMK_H>(
        [&](int r) { return r < n ? w.gate + (size_t)(r0 + r) * QMK_H : w.up + (size_t)(r0 + r - n) * QMK_H; },
        2 * n, &c.sm.mv.xs[0][0], c.sm.mv.red, out);
    for (int idx = threadIdx.x; idx < n * T; idx += NT) {
      const int r = idx / T, t = idx % T;
      const float gt = rnd(out[r * T + t], c.exact), up = rnd(out[(n + r) * T + t], c.exact);
      st.act[t * QMK_I + r0 + r] = rnd(rnd(gt / (1.0f + expf(-gt)), c.exact) * up, c.exact);
    }
    if (!c.g.sync_all(c.flag)) return false;

    // P5: down_proj + residual on this block's rows.
    load_scratch<T>(c, st.act, QMK_I);
    rows_of(b, G, QMK_H, r0, n);
    block_matvec<T, QMK_I>([&](int r) { return w.down + (size_t)(r0 + r) * QMK_I; }, n, &c.sm.mv.xs[0][0],
                           c.sm.mv.red, out);
    for (int idx = threadIdx.x; idx < n * T; idx += NT) {
      float* px = st.x + (idx % T) * QMK_H + r0 + idx / T;
      *px = rnd(__ldcg(px) + rnd(out[idx], c.exact), c.exact);
    }
    if (!c.g.sync_all(c.flag)) return false;
  }
  return true;
}

// Final RMSNorm of token t + head rows of this block -> st.logits (bf16-rounded, as HF's logits).
__device__ bool head_phase(const Ctx& c, const qmk_bf16* norm_w, const qmk_bf16* head, int V, int t,
                           float* hidden_out, int dump_row) {
  const int G = gridDim.x, b = blockIdx.x;
  for (int d = threadIdx.x; d < QMK_H; d += NT) c.sm.mv.xs[0][d] = __ldcg(c.st.x + t * QMK_H + d);
  __syncthreads();
  rmsnorm_xs<1>(c, norm_w);
  if (hidden_out != nullptr && b == 0)
    for (int d = threadIdx.x; d < QMK_H; d += NT) hidden_out[d] = c.sm.mv.xs[0][d];
  int r0, n;
  rows_of(b, G, V, r0, n);
  block_matvec<1, QMK_H>([&](int r) { return head + (size_t)(r0 + r) * QMK_H; }, n, &c.sm.mv.xs[0][0],
                         c.sm.mv.red, c.sm.mv.out);
  for (int r = threadIdx.x; r < n; r += NT) {
    const float v = rnd(c.sm.mv.out[r], c.exact);
    __stcg(c.st.logits + r0 + r, v);
    if (c.st.dump != nullptr) c.st.dump[dump_row * QMK_VT + r0 + r] = v;
  }
  return c.g.sync_all(c.flag);
}

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

__global__ void __launch_bounds__(QMK_THREADS, 1)
    qmk_frame_kernel(const __grid_constant__ QmkState st, const QmkModel* __restrict__ m, int slot, int flags) {
  __shared__ Smem sm;
  __shared__ float red32[NW];
  __shared__ int flag;
  __shared__ int codes[QMK_GROUPS];
  Grid g{st.sync, st.timeout_ns, 0u};
  const Ctx c{st, m, sm, red32, &flag, codes, g, !(flags & QMK_FLAG_NO_PREFETCH), (flags & QMK_FLAG_BF16_EXACT) != 0};
  const int commit = !(flags & QMK_FLAG_NO_COMMIT);
  if (flags & QMK_FLAG_BARRIER_BENCH) {
    for (int i = 0; i < QMK_BARRIER_BENCH_N; ++i)
      if (!g.sync_all(&flag)) return;
    return;
  }
  const int pos = st.pos[slot];
  const int nsamp = st.n_sampled[slot];
  const QmkSampling sp = st.samp[slot];
  if (!(flags & QMK_FLAG_CP_ONLY) && pos >= st.max_pos) {
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicCAS(st.sync + QMK_SYNC_ERR, 0u, (uint32_t)QMK_ERR_CONTEXT_FULL);
    return;
  }
  if (threadIdx.x < QMK_GROUPS) codes[threadIdx.x] = threadIdx.x == 0 ? st.code0[slot] : 0;
  __syncthreads();

  if (!(flags & QMK_FLAG_TALKER_ONLY)) {
    const size_t lstride = (size_t)QMK_NKV * QMK_CP_POS * QMK_HD;
    const SampleParams sub{sp.sub_do_sample, sp.sub_temperature, sp.sub_top_k, sp.sub_top_p};
    for (int k = 0; k < QMK_GROUPS - 1; ++k) {
      bool ok;
      if (k == 0) {  // [past_hidden, codec_embedding(code0)] at positions 0, 1
        const Input in{1, {nullptr, m->codec_emb + (size_t)codes[0] * QMK_H}, st.past_hidden + (size_t)slot * QMK_H,
                       nullptr};
        ok = run_stack<2>(c, m->cp, QMK_CP_LAYERS, in, 0, st.cp_k, st.cp_v, lstride, QMK_CP_POS, m->inv_freq_cp,
                          m->cp_head[0], QMK_VC);
        ok = ok && head_phase(c, m->cp_norm, m->cp_head[0], QMK_VC, 1, nullptr, 0);
      } else {      // codec_embedding[k-1](code k) at position k+1
        const Input in{1, {m->cp_emb[k - 1] + (size_t)codes[k] * QMK_H, nullptr}, nullptr, nullptr};
        ok = run_stack<1>(c, m->cp, QMK_CP_LAYERS, in, k + 1, st.cp_k, st.cp_v, lstride, QMK_CP_POS, m->inv_freq_cp,
                          m->cp_head[k], QMK_VC);
        ok = ok && head_phase(c, m->cp_norm, m->cp_head[k], QMK_VC, 0, nullptr, k);
      }
      if (!ok) return;
      // Every block draws the same code from the same logits: no extra barrier before the next pass.
      for (int i = threadIdx.x; i < QMK_VC; i += NT) sm.sa.l[i] = __ldcg(st.logits + i);
      __syncthreads();
      const int code = block_sample(sm.sa.l, QMK_VC, sub, sp.seed, (uint32_t)nsamp, (uint32_t)(k + 1), sm.sa);
      if (threadIdx.x == 0) codes[k + 1] = code;
      __syncthreads();
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
  if (!run_stack<1>(c, m->talker, QMK_TALKER_LAYERS, in, pos, st.kv_k + slot * sstride, st.kv_v + slot * sstride,
                    lstride, st.max_pos, m->inv_freq_talker, m->codec_head, QMK_VT))
    return;
  if (!head_phase(c, m->talker_norm, m->codec_head, QMK_VT, 0, commit ? st.past_hidden + (size_t)slot * QMK_H : nullptr,
                  QMK_GROUPS - 1))
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

int qmk_abi_version() { return QMK_ABI_VERSION; }
size_t qmk_state_size() { return sizeof(QmkState); }
size_t qmk_model_size() { return sizeof(QmkModel); }
size_t qmk_sampling_size() { return sizeof(QmkSampling); }
int qmk_sync_words() { return QMK_SYNC_WORDS; }

// Grid for `device`: one block per SM, checked co-resident. Returns a cudaError_t (0 = ok);
// cudaErrorCooperativeLaunchTooLarge when the device cannot hold the grid.
int qmk_grid_size(int device, int* blocks, int* sms) {
  cudaDeviceProp prop;
  cudaError_t e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess) return e;
  if (!prop.cooperativeLaunch) return cudaErrorNotSupported;
  int per_sm = 0;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, qmk_frame_kernel, QMK_THREADS, 0);
  if (e != cudaSuccess) return e;
  *sms = prop.multiProcessorCount;
  if (per_sm < 1 || prop.multiProcessorCount < QMK_MIN_BLOCKS) return cudaErrorCooperativeLaunchTooLarge;
  *blocks = prop.multiProcessorCount;
  return cudaSuccess;
}

// One decode frame of `slot` on `stream`: zero this instance's sync words, then one cooperative
// launch. Errors inside the kernel (barrier timeout, full context) land in st->sync[QMK_SYNC_ERR].
int qmk_frame(const QmkState* st, const QmkModel* model_dev, int slot, int flags, int blocks, void* stream) {
  if (blocks < QMK_MIN_BLOCKS || slot < 0 || slot >= st->num_slots) return cudaErrorInvalidValue;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t e = cudaMemsetAsync(st->sync, 0, QMK_SYNC_WORDS * sizeof(uint32_t), s);
  if (e != cudaSuccess) return e;
  QmkState stv = *st;
  void* args[] = {&stv, &model_dev, &slot, &flags};
  return cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(qmk_frame_kernel), dim3(blocks),
                                     dim3(QMK_THREADS), args, 0, s);
}

int qmk_sample_talker(const QmkState* st, int slot, void* stream) {
  if (slot < 0 || slot >= st->num_slots) return cudaErrorInvalidValue;
  qmk_sample_talker_kernel<<<1, QMK_THREADS, 0, static_cast<cudaStream_t>(stream)>>>(*st, slot);
  return cudaGetLastError();
}

const char* qmk_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // extern "C"
