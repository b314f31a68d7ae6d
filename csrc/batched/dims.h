// Compile-time dimensions of the batched code-predictor kernel (Qwen3-TTS-12Hz-0.6B code predictor:
// 5 layers of the talker's layer shape, 15 heads of 2048 codes). Every size the kernel uses comes
// from here, so another model size is a rebuild with other numbers (the 1.7B code predictor keeps
// these; its talker-to-predictor projection is not implemented: the engine keeps the Triton path
// when the weights carry one).
#pragma once
#include <stdint.h>

namespace qbk {

constexpr int H = 1024;          // hidden size
constexpr int NH = 16;           // query heads
constexpr int NKV = 8;           // key/value heads (GQA 2:1)
constexpr int HD = 128;          // head dim
constexpr int QD = NH * HD;      // 2048
constexpr int KVD = NKV * HD;    // 1024
constexpr int QKV = QD + 2 * KVD;  // 4096 fused q|k|v rows
constexpr int I = 3072;          // SwiGLU intermediate
constexpr int LAYERS = 5;        // code-predictor layers (at most; tests build smaller models)
constexpr int TLAYERS = 28;      // talker layers (at most)
constexpr int VC = 2048;         // codes per codebook (head rows)
constexpr int VT = 3072;         // talker vocabulary (codec_embedding rows)
constexpr int GROUPS = 16;       // codebooks per frame
constexpr int PASSES = GROUPS - 1;  // code-predictor passes per frame
constexpr int POS = GROUPS;      // code-predictor positions per frame (2 + 14)

constexpr int THREADS = 256;     // one block per SM, 8 warps
constexpr int WARPS = THREADS / 32;
constexpr int MAX_ROWS = 256;    // streams per launch
constexpr int KMAX = I;          // widest GEMM input (down_proj)
constexpr int NMAX = 2 * I;      // widest GEMM output (gate|up)

// The fixed reduction unit of every product: K is cut into pieces of PIECE columns; a piece is one
// chain of mma.sync over its 16-column slices, and the pieces are added left to right. Neither
// depends on the batch, so neither does any output bit (csrc/batched/README.md).
constexpr int PIECE = 256;
constexpr int CHUNK = 64;        // columns per shared-memory pipeline stage (4 per piece)
constexpr int STAGES = 4;        // shared-memory pipeline depth
constexpr int MAX_RB = 128, MAX_TB = 64;  // largest shared-memory tile: rows x tokens
constexpr int STAGE_BYTES = MAX_RB * CHUNK * 2 + MAX_TB * 2 * CHUNK * 2;
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES;  // the pipeline's (and the draws' logits) share
constexpr int SMEM_TOTAL = SMEM_BYTES + 128;       // + block sums, the barrier flag, drawn codes
constexpr int REG_MAX_M = 64;    // the register path takes at most this many rows
constexpr int REG_STAGE_BYTES = 16 * PIECE * 2;  // a warp's first register-path task: 16 rows x PIECE
static_assert(WARPS * REG_STAGE_BYTES <= SMEM_BYTES, "register path: every warp's first task staged");

// Talker attention: a stream's keys in chunks of whole 64-key units, at most MAXCH chunks (the
// chunking depends on the stream's own length only); each chunk's softmax state is merged in
// chunk order.
constexpr int ATT_UNIT = 64;
constexpr int MAXCH = 16;
constexpr int APART = HD + 4;    // floats of one chunk's state per q head: o[HD], max, sum (16-byte rows)

// Words of the sync buffer (zeroed by the host before every launch).
constexpr int SYNC_BAR = 0, SYNC_ERR = 32, SYNC_WORDS = 64;
constexpr int ERR_TIMEOUT = 1;

static_assert(H % PIECE == 0 && QD % PIECE == 0 && I % PIECE == 0, "K: whole pieces");
static_assert(PIECE % CHUNK == 0 && CHUNK == 64, "pipeline stage: 64 columns");
static_assert(H == 4 * THREADS, "row phases: 4 dims per thread");
static_assert(HD == 128 && NH == 2 * NKV, "attention: 4 dims per lane, 2 q heads per kv head");
static_assert(VC % 32 == 0 && VT % 32 == 0, "sampling: whole logits per lane");
constexpr int KEPT_MAX = 256;     // a draw's list of kept ids (more: scored in place)
static_assert(WARPS * (VT + KEPT_MAX) * 4 <= SMEM_BYTES, "sampling: a warp's logits and kept ids in shared memory");
static_assert(QKV % 16 == 0 && I % 16 == 0 && VC % 16 == 0, "rows: whole 16-row tiles");
static_assert(QKV % 128 == 0 && H % 128 == 0 && (2 * I) % 128 == 0 && VC % 128 == 0 && VT % 128 == 0,
              "shared-memory path: whole 128-row tiles");

}  // namespace qbk
