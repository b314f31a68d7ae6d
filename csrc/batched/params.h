// The launch's parameter block, written once as an X-macro so that the struct, the host's view of
// it (qbk_param_name / qbk_param_offset: the host fills it by name, tts_server/engines/batched/
// cuda_frame.py) and the kernel cannot disagree. Every field is 8 bytes; arrays are one field per
// element ("wqkv[3]").
#pragma once
#include <stdint.h>

#include "arch.cuh"
#include "dims.h"

typedef __nv_bfloat16 qbk_bf16;

// F(type, name) a field; A(type, name, n) n fields name[0..n)
#define QBK_PARAM_FIELDS(F, A)                                                                    \
  /* code-predictor weights: matrices bf16 [out, in] (nn.Linear), norms fp32 */                   \
  A(const float*, in_norm, qbk::LAYERS)                                                           \
  A(const qbk_bf16*, wqkv, qbk::LAYERS) /* [QKV, H]: q rows, then k, then v */                    \
  A(const float*, q_norm, qbk::LAYERS)                                                            \
  A(const float*, k_norm, qbk::LAYERS)                                                            \
  A(const qbk_bf16*, wo, qbk::LAYERS) /* [H, QD] */                                               \
  A(const float*, post_norm, qbk::LAYERS)                                                         \
  A(const qbk_bf16*, gate, qbk::LAYERS) /* [I, H] */                                              \
  A(const qbk_bf16*, up, qbk::LAYERS)                                                             \
  A(const qbk_bf16*, down, qbk::LAYERS) /* [H, I] */                                              \
  F(const float*, final_norm)                                                                     \
  A(const qbk_bf16*, head, qbk::PASSES) /* [VC, H] */                                             \
  F(const qbk_bf16*, emb)       /* [PASSES][VC][H]: codebook k+1's input table */                 \
  F(const qbk_bf16*, codec_emb) /* [VT][H]: code 0's */                                           \
  F(const float*, rope_cos)     /* [POS][HD] */                                                   \
  F(const float*, rope_sin)                                                                       \
  /* slot state (tts_server/engines/batched/state.py): field-major [fields][slots] */             \
  F(int32_t*, ints)       /* the talker step commits pos, code 0, draws, text step */            \
  F(const float*, floats)                                                                         \
  F(const int64_t*, seed)                                                                         \
  F(float*, past_hidden)  /* [slots][H]: the talker step writes its final-normed hidden */        \
  F(int64_t, num_slots)        /* row length of ints / floats */                                  \
  F(int64_t, f_code0)                                                                             \
  F(int64_t, f_n_sampled)                                                                         \
  F(int64_t, f_do_sample)                                                                         \
  F(int64_t, f_top_k)                                                                             \
  F(int64_t, f_temperature)                                                                       \
  F(int64_t, f_top_p)                                                                             \
  /* the talker step's fields of the slot state (state.py) */                                     \
  F(int64_t, f_pos)                                                                               \
  F(int64_t, f_text_step)                                                                         \
  F(int64_t, f_n_trailing)                                                                        \
  F(int64_t, f_eos_from)                                                                          \
  F(int64_t, f_t_do_sample)                                                                       \
  F(int64_t, f_t_top_k)                                                                           \
  F(int64_t, f_t_temperature)                                                                     \
  F(int64_t, f_t_top_p)                                                                           \
  F(int64_t, f_penalty)                                                                           \
  F(uint8_t*, seen)             /* [slots][VT] code-0 ids drawn (repetition penalty) */           \
  F(const qbk_bf16*, trailing)  /* [slots][max_trailing][H] the text track */                     \
  F(const qbk_bf16*, pad_embed) /* [slots][H] */                                                  \
  F(int64_t, max_trailing)                                                                        \
  F(int64_t, eos)                                                                                 \
  F(int64_t, suppress_start)                                                                      \
  F(int64_t, min_new_tokens)                                                                      \
  /* talker weights (TLAYERS slots; t_num_layers used) */                                        \
  A(const float*, t_in_norm, qbk::TLAYERS)                                                        \
  A(const qbk_bf16*, t_wqkv, qbk::TLAYERS)                                                        \
  A(const float*, t_q_norm, qbk::TLAYERS)                                                         \
  A(const float*, t_k_norm, qbk::TLAYERS)                                                         \
  A(const qbk_bf16*, t_wo, qbk::TLAYERS)                                                          \
  A(const float*, t_post_norm, qbk::TLAYERS)                                                      \
  A(const qbk_bf16*, t_gate, qbk::TLAYERS)                                                        \
  A(const qbk_bf16*, t_up, qbk::TLAYERS)                                                          \
  A(const qbk_bf16*, t_down, qbk::TLAYERS)                                                        \
  F(const float*, t_final_norm)                                                                   \
  F(const qbk_bf16*, codec_head) /* [VT][H] */                                                    \
  F(const float*, t_rope_cos)    /* [max_positions][HD] */                                        \
  F(const float*, t_rope_sin)                                                                     \
  F(int64_t, t_num_layers)                                                                        \
  /* the paged talker KV pool (kv_pool.py): [layers][blocks][NKV][block_size][HD] */                \
  F(void*, kv_k)                                                                                  \
  F(void*, kv_v)                                                                                  \
  F(int64_t, kv_fp32)           /* 1: fp32 K/V, 0: bf16 */                                        \
  F(int64_t, kv_blocks)                                                                           \
  F(int64_t, kv_block_size)                                                                       \
  F(const int32_t*, block_table) /* [slots][table_stride] */                                      \
  F(int64_t, table_stride)                                                                        \
  F(float*, apart)              /* [MAX][NKV][MAXCH][2][APART] attention chunk states */          \
  F(const int64_t*, rows) /* [B] the step's slots */                                              \
  /* results */                                                                                   \
  F(int32_t*, out)        /* [rows][out_stride]: 16 codes, (next code 0), error bits */          \
  F(int64_t, out_stride)                                                                          \
  F(int64_t, out_err)     /* column of the error bits */                                         \
  F(float*, dump)         /* optional [rows][dump_stride]: pass k's logits at k * dump_pass */    \
  F(int64_t, dump_stride)                                                                         \
  F(int64_t, dump_pass)                                                                           \
  /* scratch (tts_server/engines/batched/cuda_frame.py sizes it from qbk_const_*) */                 \
  F(float*, x)            /* [2 MAX][H] residual stream */                                        \
  F(qbk_bf16*, hs)        /* [2 MAX][2][KMAX] the next product's input, hi and lo parts */        \
  F(float*, parts)        /* product outputs: [nparts][M][N] */                                   \
  F(float*, cpk)          /* [LAYERS][MAX][NKV][POS][HD] the frame's code-predictor keys */       \
  F(float*, cpv)                                                                                  \
  F(int32_t*, flags)      /* [MAX] error bits of the frame so far */                             \
  F(uint32_t*, sync)      /* [SYNC_WORDS] */                                                      \
  F(int64_t, max_rows)                                                                            \
  F(double, eps)                                                                                  \
  F(double, scale)                                                                                \
  F(int64_t, timeout_ns)                                                                          \
  F(int64_t, reg_max_m)   /* products of at most this many rows take the register path */       \
  F(int64_t, split_mode)  /* shared-memory path: 1 never split K; 0, 2 split (gemm.cuh) */ \
  F(int64_t, tile)        /* shared-memory path's tile: 0 by M, 1..6 one candidate (tuning) */ \
  F(int64_t, num_layers)  /* code-predictor layers (<= LAYERS; tests may build smaller models) */ \
  F(int64_t, num_passes)  /* passes to run (<= PASSES; later codes are 0): tests, bisection */ \
  F(uint64_t*, trace)     /* optional [blocks][trace_events][2]: each grid barrier's arrival and exit */ \
  F(int64_t, trace_events) /* (globaltimer ns, thread 0 of every block); profiling only */

#define QBK_F(t, n) t n;
#define QBK_A(t, n, k) t n[k];
struct QbkParams {
  QBK_PARAM_FIELDS(QBK_F, QBK_A)
};
#undef QBK_F
#undef QBK_A
