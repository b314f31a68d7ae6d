// Self-test of the SIMT emulator (simt.h): the mma.sync fragment layout against a plain matrix
// product, warp shuffles and votes, block barriers over shared memory, cp.async's deferred copies,
// a grid barrier polled across blocks, and deadlock detection. Exit status 0 when all pass.
//   make -C tools/simt selftest && tools/simt/build/selftest
#include <stdio.h>

#include <random>

#include "simt.h"

using namespace qbk;

static int failures = 0;
static void check(bool ok, const char* what) {
  printf("%s %s\n", ok ? "ok  " : "FAIL", what);
  failures += !ok;
}

static uint16_t bf(float f) { return __float2bfloat16_rn(f).bits; }
static float fb(uint16_t b) { return __bfloat162float(__nv_bfloat16{b}); }

int main() {
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;

  // 1. mma16816: A [16][16], B [16][8] (bf16 values), C [16][8]; fragments as PTX lays them out.
  {
    uint16_t A[16][16], B[16][8];
    float C[16][8], D[16][8];
    for (auto& r : A) for (auto& v : r) v = bf(nd(rng));
    for (auto& r : B) for (auto& v : r) v = bf(nd(rng));
    for (auto& r : C) for (auto& v : r) v = nd(rng);
    simt::launch(1, 32, 0, [&] {
      const int l = threadIdx.x, g = l >> 2, t = l & 3;
      auto pk = [](uint16_t lo, uint16_t hi) { return (uint32_t)lo | ((uint32_t)hi << 16); };
      const uint32_t a0 = pk(A[g][2 * t], A[g][2 * t + 1]), a1 = pk(A[g + 8][2 * t], A[g + 8][2 * t + 1]);
      const uint32_t a2 = pk(A[g][2 * t + 8], A[g][2 * t + 9]), a3 = pk(A[g + 8][2 * t + 8], A[g + 8][2 * t + 9]);
      const uint32_t b0 = pk(B[2 * t][g], B[2 * t + 1][g]), b1 = pk(B[2 * t + 8][g], B[2 * t + 9][g]);
      float d[4] = {C[g][2 * t], C[g][2 * t + 1], C[g + 8][2 * t], C[g + 8][2 * t + 1]};
      mma16816(d, a0, a1, a2, a3, b0, b1);
      D[g][2 * t] = d[0], D[g][2 * t + 1] = d[1], D[g + 8][2 * t] = d[2], D[g + 8][2 * t + 1] = d[3];
    });
    double worst = 0;
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 8; ++j) {
        double want = C[i][j];
        for (int k = 0; k < 16; ++k) want += (double)fb(A[i][k]) * fb(B[k][j]);
        worst = std::max(worst, std::abs(want - D[i][j]));
      }
    check(worst < 1e-4, "mma16816 = C + A B with PTX's m16n8k16 fragment layout");
  }

  // 2. shuffles and votes within each warp of a 2-warp block
  {
    int sh[64], any[64];
    simt::launch(1, 64, 0, [&] {
      const int i = threadIdx.x;
      sh[i] = __shfl_xor_sync(0xffffffffu, i * 10, 5);
      any[i] = __any_sync(0xffffffffu, i == 40);
    });
    bool ok = true;
    for (int i = 0; i < 64; ++i) ok &= sh[i] == ((i & ~31) | ((i & 31) ^ 5)) * 10 && any[i] == (i >= 32);
    check(ok, "__shfl_xor_sync and __any_sync stay within a warp");
  }

  // 3. __syncthreads orders shared-memory writes and reads across warps; blocks have their own
  {
    int out[2][128];
    simt::launch(2, 128, 128 * sizeof(int), [&] {
      int* s = reinterpret_cast<int*>(simt::block_smem());
      s[threadIdx.x] = (int)(blockIdx.x * 1000 + threadIdx.x);
      __syncthreads();
      out[blockIdx.x][threadIdx.x] = s[127 - threadIdx.x];
    });
    bool ok = true;
    for (int b = 0; b < 2; ++b)
      for (int i = 0; i < 128; ++i) ok &= out[b][i] == b * 1000 + 127 - i;
    check(ok, "__syncthreads and per-block shared memory");
  }

  // 4. cp.async: a read before wait_group sees the old bytes, after it the new ones
  {
    uint32_t src[4] = {1, 2, 3, 4}, before = 0, after = 0, zeroed = 1;
    simt::launch(1, 32, 64, [&] {
      uint32_t* s = reinterpret_cast<uint32_t*>(simt::block_smem());
      if (threadIdx.x == 0) {
        s[0] = 7;
        s[4] = 9;
        cp_async16(s, src, 16);
        cp_async16(s + 4, src, 0);
        cp_async_commit();
        before = s[0];
        cp_async_wait<0>();
        after = s[0];
        zeroed = s[4];
      }
    });
    check(before == 7 && after == 1 && zeroed == 0, "cp.async copies when its group retires (src_bytes 0: zeros)");
  }

  // 5. a grid barrier polled across blocks (the batched kernel's Grid::sync pattern)
  {
    uint32_t bar = 0;
    int seen[4] = {0, 0, 0, 0}, data[4] = {0, 0, 0, 0};
    simt::launch(4, 32, 0, [&] {
      if (threadIdx.x == 0) {
        data[blockIdx.x] = (int)blockIdx.x + 1;
        red_release_add(&bar, 1u);
        while (ld_acquire(&bar) < 4u) {
        }
        seen[blockIdx.x] = data[(blockIdx.x + 1) % 4];
      }
      __syncthreads();
    });
    check(seen[0] == 2 && seen[1] == 3 && seen[2] == 4 && seen[3] == 1, "grid barrier by polling across blocks");
  }

  // 6. a block barrier that one warp never reaches is reported, not hung
  {
    bool threw = false;
    try {
      simt::launch(1, 64, 0, [&] {
        if (threadIdx.x < 32) __syncthreads();
      });
    } catch (const std::runtime_error&) {
      threw = true;
    }
    check(threw, "a deadlocked launch throws");
  }
  printf("%s\n", failures ? "FAILED" : "all passed");
  return failures ? 1 : 0;
}
