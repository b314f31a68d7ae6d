// The hardware primitives the batched kernel uses, in one place: on a GPU the PTX below; with
// QBK_EMU (a host build for tests, tools/simt/simt.h) the emulator's versions of the same
// operations, so that one kernel source runs on both.
#pragma once
#include <stdint.h>

#ifdef QBK_EMU
#include "../../tools/simt/simt.h"
// The block's dynamic shared memory.
#define QBK_DYNAMIC_SMEM(name) uint8_t* name = simt::block_smem()
#else
#include <cuda_bf16.h>
#define QBK_DYNAMIC_SMEM(name) extern __shared__ __align__(128) uint8_t name[]

namespace qbk {

__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Grid-barrier arrival (release) and poll (acquire), gpu scope.
__device__ __forceinline__ void red_release_add(uint32_t* p, uint32_t v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// D += A(16 x 16 bf16, row) B(16 x 8 bf16, col), fp32 (PTX fragment layout of m16n8k16).
__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 16 bytes global -> shared, asynchronous (src_bytes 0: zero-fill), L2 only.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

}  // namespace qbk
#endif
