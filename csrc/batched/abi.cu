// The C ABI of the batched kernels (loaded with ctypes by tts_server/engines/batched/cuda_frame.py):
// the parameter block by name, the dims and buffer sizes, the grid, and one launcher per kernel.
// With QBK_EMU the launchers run the kernels on the CPU emulator (tools/simt/simt.h).
#ifndef QBK_EMU
#include <cuda_runtime.h>
#endif
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <string>
#include <type_traits>
#include <vector>

#include "kernels.h"

#define QBK_ABI_VERSION 2  // 2: the talker step (qbk_advance) and its parameter fields

using namespace qbk;

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
    // product outputs per row of M: the K / PIECE parts of the widest product (gate|up)
    {"PARTS_PER_ROW", (long long)(H / PIECE) * NMAX},
    {"TLAYERS", TLAYERS}, {"MAXCH", MAXCH}, {"ATT_UNIT", ATT_UNIT},
    {"APART_PER_ROW", (long long)NKV * MAXCH * 2 * APART},
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
static bool bad_talker_args(const QbkParams& p, int B, int blocks) {
  return bad_args(p, B, B, blocks) || p.t_num_layers < 1 || p.t_num_layers > TLAYERS || p.kv_block_size < 1 ||
         p.kv_k == nullptr || p.apart == nullptr;
}

#ifdef QBK_EMU
constexpr int kInvalid = 1;

// The emulator (tools/simt/simt.h): QBK_EMU_BLOCKS blocks (default 2); the launch runs to its end
// on the calling thread.
int qbk_grid_size(int, int* blocks) {
  const char* e = getenv("QBK_EMU_BLOCKS");
  *blocks = e != nullptr && atoi(e) > 0 ? atoi(e) : 2;
  return 0;
}

extern "C++" {
// Zero the sync words, then kernel(p, rest...) on `blocks` emulated blocks.
template <class... A>
static int launch(void (*kernel)(QbkParams, A...), QbkParams& p, int blocks, void*, A... rest) {
  memset(p.sync, 0, SYNC_WORDS * sizeof(uint32_t));
  try {
    simt::launch(blocks, THREADS, SMEM_TOTAL, [&] { kernel(p, rest...); });
  } catch (const std::exception& e) {
    fprintf(stderr, "qbk (emulated): %s\n", e.what());
    return 2;
  }
  return 0;
}
}  // extern "C++"

const char* qbk_error_string(int code) {
  return code == 0 ? "no error" : code == 1 ? "invalid argument" : "emulated launch failed (deadlock)";
}
#else
constexpr int kInvalid = cudaErrorInvalidValue;

// Blocks for `device`: one per SM, checked co-resident with each kernel's shared memory. Returns
// a cudaError_t (0 = ok).
int qbk_grid_size(int device, int* blocks) {
  cudaDeviceProp prop;
  cudaError_t e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess) return e;
  if (!prop.cooperativeLaunch) return cudaErrorNotSupported;
  for (const void* k : {reinterpret_cast<const void*>(qbk_predict_kernel), reinterpret_cast<const void*>(qbk_advance_kernel)}) {
    e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_TOTAL);
    if (e != cudaSuccess) return e;
    int per_sm = 0;
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, THREADS, SMEM_TOTAL);
    if (e != cudaSuccess) return e;
    if (per_sm < 1) return cudaErrorCooperativeLaunchTooLarge;
  }
  *blocks = prop.multiProcessorCount;
  return cudaSuccess;
}

extern "C++" {
// On `stream`: zero the sync words, then one cooperative launch of kernel(p, rest...). A wait
// past the timeout lands in sync[SYNC_ERR].
template <class... A>
static int launch(void (*kernel)(QbkParams, A...), QbkParams& p, int blocks, void* stream, A... rest) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t e = cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_TOTAL);
  if (e != cudaSuccess) return e;
  e = cudaMemsetAsync(p.sync, 0, SYNC_WORDS * sizeof(uint32_t), s);
  if (e != cudaSuccess) return e;
  void* args[] = {&p, &rest...};
  return cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel), dim3(blocks), dim3(THREADS), args,
                                     SMEM_TOTAL, s);
}
}  // extern "C++"

const char* qbk_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }
#endif

// The code-predictor half of one frame for rows[0..B) (params: a QbkParams the host filled by
// name), rows B..Bpad-1 of `out` zeroed (a graph bucket's padding).
int qbk_predict(const void* params, int B, int Bpad, int blocks, void* stream) {
  QbkParams p;
  memcpy(&p, params, sizeof p);
  if (bad_args(p, B, Bpad, blocks)) return kInvalid;
  return launch(qbk_predict_kernel, p, blocks, stream, B, Bpad);
}

// The talker step of rows[0..B) (after qbk_predict made their codes).
int qbk_advance(const void* params, int B, int blocks, void* stream) {
  QbkParams p;
  memcpy(&p, params, sizeof p);
  if (bad_talker_args(p, B, blocks)) return kInvalid;
  return launch(qbk_advance_kernel, p, blocks, stream, B);
}

}  // extern "C"
