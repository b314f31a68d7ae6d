// Single source of truth for the megakernel's dimensions and host<->device structs. The host
// (tts_server/engines/megakernel.py) does not retype them: it reads the constants, the structs'
// sizes and every field's offset from the library by name (abi.cu), fills QmkModel at those
// offsets and checks its ctypes mirrors of QmkState / QmkSampling field by field.
#pragma once
#include <stdint.h>

#define QMK_ABI_VERSION 5  // 2: weight matrices in the tensor-core layout (megakernel.py mma_layout)
                           // 3: every o_proj head-group major (megakernel.py grouped_o); opart
                           // 4: qkv and part are LL words (ops/common.cuh), ll_seq
                           // 5: the host reads this file's constants, the structs' sizes and
                           //    offsets and the phase table from the library (abi.cu), not qmk_*_size

// Qwen3-TTS-12Hz-0.6B decoder stacks (talker and code predictor share the layer shape).
#define QMK_H 1024            // hidden size
#define QMK_NH 16             // query heads
#define QMK_NKV 8             // key/value heads (GQA 2:1)
#define QMK_HD 128            // head dim
#define QMK_QD (QMK_NH * QMK_HD)     // 2048: q width
#define QMK_KVD (QMK_NKV * QMK_HD)   // 1024: k / v width
#define QMK_QKV (QMK_QD + 2 * QMK_KVD)  // 4096: fused q|k|v rows
#define QMK_I 3072            // SwiGLU intermediate
#define QMK_TALKER_LAYERS 28
#define QMK_CP_LAYERS 5
#define QMK_VT 3072           // talker codec vocabulary (codec_head rows)
#define QMK_VC 2048           // code-predictor vocabulary per codebook
#define QMK_GROUPS 16         // codebooks per frame
#define QMK_CP_POS 16         // code-predictor positions per frame (2 + 14)
#define QMK_MAX_T 2           // tokens per pass (the first CP pass covers 2 positions)

// Launch geometry: one block per SM, persistent and cooperative: 256 compute threads plus a
// producer warpgroup.
#define QMK_THREADS 256
#define QMK_WARPS (QMK_THREADS / 32)
// The launch adds a producer warpgroup that loads the weight slices (ops/producer.cuh).
#define QMK_PRODUCER_THREADS 128
#define QMK_LAUNCH_THREADS (QMK_THREADS + QMK_PRODUCER_THREADS)
#define QMK_MIN_BLOCKS 112    // smem staging is sized for grids of >= 112 blocks (H100 PCIe 114, SXM 132)
#define QMK_MAX_CHUNKS 32     // talker attention split-K chunks per kv head

// flags of qmk_frame
#define QMK_FLAG_TALKER_ONLY 1   // skip the code predictor (codes 1..15 = 0): benchmarking
#define QMK_FLAG_CP_ONLY 2       // skip the talker step: benchmarking
#define QMK_FLAG_NO_COMMIT 4     // leave the slot's state (position, code 0, history) unchanged
#define QMK_FLAG_BARRIER_BENCH 8 // only run QMK_BARRIER_BENCH_N grid barriers: benchmarking
#define QMK_FLAG_BF16_EXACT 32   // round activations to bf16 exactly where qwen-tts in bf16 does
#define QMK_FLAG_KV_FP32 64      // the talker KV cache holds fp32 (else bf16)
#define QMK_BARRIER_BENCH_N 1000

// error codes written to sync[QMK_SYNC_ERR]
#define QMK_ERR_TIMEOUT 1
#define QMK_ERR_CONTEXT_FULL 2

// sync buffer (uint32 words, zeroed by the host before every launch)
#define QMK_SYNC_BAR 0        // grid barrier arrival counter (monotonic within a launch)
#define QMK_SYNC_ERR 32       // error code (0 = ok)
#define QMK_SYNC_WORDS 128

// LL words (ops/common.cuh): flag = (ll_seq << QMK_LL_USE_BITS) | use, use = the index of the
// LL phase within the launch (up to 3 per layer: 3 x (15 x 5 + 28) < 512). qmk_frame
// advances ll_seq before every launch and zeroes the LL buffers when it wraps.
#define QMK_LL_USE_BITS 9
#define QMK_LL_SEQ_MAX ((1u << (32 - QMK_LL_USE_BITS)) - 1)

#ifdef __cplusplus
#include <cuda_bf16.h>
typedef __nv_bfloat16 qmk_bf16;
#else
typedef uint16_t qmk_bf16;
#endif

// One decoder layer. Every matrix is an nn.Linear weight [out, in] in bf16, permuted by the host
// into the tensor-core layout (ops/matvec.cuh; megakernel.py mma_layout); norms stay as they are.
typedef struct {
  const qmk_bf16* in_norm;    // [H]
  const qmk_bf16* q;          // [QD, H]
  const qmk_bf16* k;          // [KVD, H]
  const qmk_bf16* v;          // [KVD, H]
  const qmk_bf16* q_norm;     // [HD]
  const qmk_bf16* k_norm;     // [HD]
  const qmk_bf16* o;          // [NKV][H][2 * HD]: o_proj head-group major (ops/attn_oproj.cuh)
  const qmk_bf16* post_norm;  // [H]
  const qmk_bf16* gate;       // [I, H]
  const qmk_bf16* up;         // [I, H]
  const qmk_bf16* down;       // [H, I]
} QmkLayer;

// Every weight one frame reads (device table, built by the host as int64 pointers in this order).
typedef struct {
  QmkLayer talker[QMK_TALKER_LAYERS];
  QmkLayer cp[QMK_CP_LAYERS];
  const qmk_bf16* talker_norm;             // [H]
  const qmk_bf16* cp_norm;                 // [H]
  const qmk_bf16* codec_emb;               // [VT, H] talker input table (code 0)
  const qmk_bf16* codec_head;              // [VT, H]
  const qmk_bf16* cp_emb[QMK_GROUPS - 1];  // 15 x [VC, H]: codebooks 1..15 inputs
  const qmk_bf16* cp_head[QMK_GROUPS - 1]; // 15 x [VC, H]: codebooks 1..15 logits
  const float* inv_freq_talker;            // [HD/2] fp32, theta^(-2j/HD) as qwen-tts computes it
  const float* inv_freq_cp;                // [HD/2]
} QmkModel;

// Per-slot sampling settings (qwen-tts names).
typedef struct {
  int32_t do_sample;
  int32_t top_k;
  float temperature;
  float top_p;
  float repetition_penalty;
  int32_t sub_do_sample;
  int32_t sub_top_k;
  float sub_temperature;
  float sub_top_p;
  int32_t pad0;
  uint64_t seed;
} QmkSampling;

// Engine instance state: per-slot device arrays plus this instance's scratch and sync words.
// Passed by value to the kernel; nothing lives in process-wide globals.
typedef struct {
  // per slot
  void* kv_k;              // [slots][TALKER_LAYERS][NKV][max_pos][HD] bf16, or fp32 with KV_FP32
  void* kv_v;              // same
  int32_t* pos;            // [slots] next talker position (= cached positions)
  int32_t* code0;          // [slots] pending code 0
  int32_t* n_sampled;      // [slots] code-0 samples drawn so far
  int32_t* text_step;      // [slots] index into trailing
  int32_t* n_trailing;     // [slots]
  float* past_hidden;      // [slots][H] talker final-normed hidden that produced code0
  qmk_bf16* trailing;      // [slots][max_trailing][H] pending text-track vectors
  qmk_bf16* pad_embed;     // [slots][H]
  uint8_t* seen;           // [slots][VT] code-0 ids drawn (repetition penalty)
  const QmkSampling* samp; // [slots]
  int32_t* out;            // [slots][QMK_OUT_WORDS]: 16 codes, next code 0, next_is_eos
  // instance scratch
  // activations are fp32 (bf16-exact values under QMK_FLAG_BF16_EXACT)
  uint64_t* x;             // [MAX_T][H] LL words: the residual stream after each layer
  uint64_t* qkv;           // [MAX_T][QKV] LL words: q|k|v linear outputs
  float* opart;            // [NKV][MAX_T][H] o_proj partial sums per kv-head group
  float* act;              // [MAX_T][I]
  float* logits;           // [VT]
  uint64_t* part;          // [MAX_T * NH][MAX_CHUNKS][HD + 2] LL words: split-K attention partials
  float* cp_k;             // [CP_LAYERS][NKV][CP_POS][HD]
  float* cp_v;             // same
  uint32_t* sync;          // [SYNC_WORDS]
  float* dump;             // optional [GROUPS][VT]: every pass's logits (tests); null = off
  int32_t max_pos;
  int32_t max_trailing;
  int32_t num_slots;
  int32_t eos;             // 2150
  int32_t suppress_start;  // 2048
  int32_t min_new_tokens;  // 2
  float eps;               // rms_norm_eps (1e-6)
  uint32_t ll_seq;         // LL flag sequence, advanced by qmk_frame (0: the LL buffers get zeroed)
  uint64_t timeout_ns;     // bounded spin: a barrier wait longer than this reports QMK_ERR_TIMEOUT
} QmkState;

#define QMK_OUT_WORDS 18

// Elements of the instance scratch buffers of QmkState (the host allocates them flat; qmk_frame
// zeroes the LL ones).
#define QMK_X_WORDS (QMK_MAX_T * QMK_H)
#define QMK_QKV_WORDS (QMK_MAX_T * QMK_QKV)
#define QMK_PART_WORDS (QMK_MAX_T * QMK_NH * QMK_MAX_CHUNKS * (QMK_HD + 2))
#define QMK_OPART_FLOATS (QMK_NKV * QMK_MAX_T * QMK_H)
#define QMK_ACT_FLOATS (QMK_MAX_T * QMK_I)
#define QMK_CP_KV_FLOATS (QMK_CP_LAYERS * QMK_NKV * QMK_CP_POS * QMK_HD)

#ifdef __cplusplus
static_assert(sizeof(QmkLayer) == 11 * 8, "QmkLayer: 11 pointers");
static_assert(sizeof(QmkModel) == (11 * (QMK_TALKER_LAYERS + QMK_CP_LAYERS) + 4 + 30 + 2) * 8,
              "QmkModel: flat table of int64 pointers");
static_assert(sizeof(QmkSampling) == 48, "QmkSampling layout");
static_assert(sizeof(QmkState) == 23 * 8 + 8 * 4 + 8, "QmkState layout");
static_assert(QMK_H % 256 == 0 && QMK_QD % 256 == 0 && QMK_I % 256 == 0,
              "matvec units are 256 columns (32 lanes x 16 bytes)");
static_assert(QMK_HD == 128, "attention keeps 4 dims per lane");
static_assert(QMK_NH == 2 * QMK_NKV, "attention items pair 2 q heads per kv head");
static_assert(QMK_CP_POS == QMK_GROUPS, "CP positions: 2 + 14");
static_assert(3 * ((QMK_GROUPS - 1) * QMK_CP_LAYERS + QMK_TALKER_LAYERS) < (1 << QMK_LL_USE_BITS),
              "LL flags: every LL phase of a launch has its own number");
#endif
