// libqwen_attn.so: the talker's decode attention split as one persistent launch (decode_split.cuh,
// v2 at 2 stages: 3 blocks an SM on an H200), for tts_server/engines/batched/attn_kernel.py. It
// gives the Triton split kernel's bits (the engine checks that at start-up and serves with Triton
// where it does not); the merge stays tk_attention._attn_combine_kernel.
#include "decode_split.cuh"

namespace {

constexpr int ABI = 2, STAGES = 2;
const auto kKernel = qda::attn_persist_v2_kernel<STAGES>;

}  // namespace

extern "C" int qda_abi_version() { return ABI; }

// On the current device: sets the kernel's dynamic shared memory (STAGES stages) and carveout, then
// out[0] = blocks an SM (occupancy), out[1] = SMs, out[2] = registers a thread, out[3] = spilled
// bytes a thread. The grid to launch is out[0] * out[1]. Call before qda_split on each device.
extern "C" int qda_grid(int* out) {
  cudaError_t e = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       STAGES * qda::STAGE_BYTES);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(kKernel, cudaFuncAttributePreferredSharedMemoryCarveout, (int)cudaSharedmemCarveoutMaxShared);
  int dev = 0;
  if (e == cudaSuccess) e = cudaGetDevice(&dev);
  if (e == cudaSuccess)
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&out[0], kKernel, qda::THREADS, STAGES * qda::STAGE_BYTES);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&out[1], cudaDevAttrMultiProcessorCount, dev);
  cudaFuncAttributes fa;
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&fa, kKernel);
  if (e == cudaSuccess) out[2] = fa.numRegs, out[3] = (int)fa.localSizeBytes;
  return (int)e;
}

// q [B][16][128] fp32, pools [blocks][8][64][128] bf16, table [B][max_blocks] int32, lens [B] int32 ->
// m, l [B][16][nsplit], acc [B][16][nsplit][128] fp32 for the used splits (sp < ceil(n / 64)), the
// others untouched; 1 <= B <= 256, nsplit >= max_blocks. On `stream` (a cudaStream_t; 0: the default),
// with programmatic dependent launch when pdl != 0 (it may start while its predecessor runs and waits
// for it at its top; graph-capturable).
extern "C" int qda_split(const float* q, const void* kpool, const void* vpool, const int* table, const int* lens,
                         float* m, float* l, float* acc, float scale, int batch, int max_blocks, int nsplit, int grid,
                         void* stream, int pdl) {
  if (batch < 1 || batch > qda::MAX_B || grid < 1 || max_blocks < 1 || nsplit < max_blocks)
    return (int)cudaErrorInvalidValue;
  const qda::Args a{q, static_cast<const __nv_bfloat16*>(kpool), static_cast<const __nv_bfloat16*>(vpool),
                    table, lens, m, l, acc, nullptr, scale, batch, max_blocks, nsplit, nullptr};
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(qda::THREADS);
  cfg.dynamicSmemBytes = STAGES * qda::STAGE_BYTES;
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kKernel, a);
  return (int)(e != cudaSuccess ? e : cudaGetLastError());
}
