"""Batch-invariant ops of the batched decode engine: Triton kernels on CUDA tensors (or on CPU
under TRITON_INTERPRET=1), the plain-torch references of ops_ref.py otherwise. Same signatures."""

from __future__ import annotations

import os

import torch

from . import ops_ref

PREFILL_QB = 16  # prefill_attention: rows per query block (consecutive rows of one prompt)


def _use_triton(t: torch.Tensor) -> bool:
    """Triton for CUDA tensors, and for CPU tensors when the Triton interpreter is on."""
    if t.is_cuda:
        return True
    return os.environ.get("TRITON_INTERPRET") == "1"


def _kernels():
    from . import triton_ops  # imported lazily: Triton reads TRITON_INTERPRET at @jit time

    return triton_ops


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32, w [N, K] bf16 (nn.Linear layout) -> [M, N] fp32. With fp16 matrices (params.
    gemm_dtype) x is rounded once to fp16, so x may also come as fp16 (see rms_norm)."""
    if _use_triton(x):
        return _kernels().linear(x, w)
    return ops_ref.linear(x, w)


def linear_parts(x: torch.Tensor, w: torch.Tensor, x_shift: int = 0) -> torch.Tensor:
    """`linear` as partial products [SPLIT, M, N] fp32 (the fixed K pieces) whose in-order sum is
    `linear(x, w)` bitwise; SPLIT is 1 for the references. For a consumer that sums them itself.
    x_shift: x holds the input times 2^-x_shift (swiglu's fp16 output), and the products come back
    times 2^x_shift (powers of two: exact, so the same as the unscaled input's products)."""
    if _use_triton(x):
        return _kernels().linear_parts(x, w, x_shift)
    return (ops_ref.linear(x, w) * 2.0 ** x_shift)[None]


# swiglu's fp16 output is the product times 2^-MLP_SHIFT: silu(gate) * up reaches ~1.4e5 in the real
# Qwen3-TTS 0.6B code predictor (its block 2; CrispASR's fp16 port, their issue 38), past fp16's
# 65504; scaled, fp16 holds values up to ~4.2e6 (30x that) at full precision down to ~3.9e-3 and
# below it an absolute step of 2^-18 (~3.8e-6) in the unscaled units
MLP_SHIFT = 6


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
           out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [M, K] fp32, w_* [I, K] bf16 -> silu(x @ w_gate.T) * (x @ w_up.T) [M, I] fp32; out_dtype
    fp16 (for a down projection with fp16 matrices): that times 2^-MLP_SHIFT, rounded once to
    nearest even (`linear_parts(..., x_shift=MLP_SHIFT)` undoes the scale)."""
    if _use_triton(x):
        return _kernels().swiglu(x, w_gate, w_up, out_dtype, MLP_SHIFT if out_dtype == torch.float16 else 0)
    out = ops_ref.swiglu(x, w_gate, w_up)
    return (out * 2.0 ** -MLP_SHIFT).to(out_dtype) if out_dtype == torch.float16 else out


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [M, D] fp32, w [D] -> w.float() * (x * rsqrt(mean(x^2) + eps)) [M, D] fp32; out_dtype
    fp16: rounded once to nearest even, as a product with fp16 matrices rounds an fp32 input, for
    such products (the product's bits are the same from fp16 x, and it reads half the bytes). On
    a GPU the fp16 variant is a kernel of its own whose sum of squares may add in another order
    than the fp32 variant's (Triton lays the row out for the fp16 store), so a caller keeps one
    out_dtype per call site, never one that depends on the batch."""
    if _use_triton(x):
        return _kernels().rms_norm(x, w, eps, out_dtype)
    return ops_ref.rms_norm(x, w, eps).to(out_dtype)


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One query per row. q [B, NH, HD] fp32; k_pool/v_pool [NUM_BLOCKS, NKV, BLOCK, HD] bf16|fp32;
    block_table [B, MAX_BLOCKS] int32; seq_lens [B] int32 -> [B, NH, HD] fp32 (GQA: head h reads
    kv head h // (NH // NKV); rows with seq_len 0 give zeros); out_dtype fp16: rounded once to
    nearest even, for an o_proj with fp16 matrices (as rms_norm's out_dtype)."""
    if _use_triton(q):
        return _kernels().paged_attention(q, k_pool, v_pool, block_table, seq_lens, scale, out_dtype)
    return ops_ref.paged_attention(q, k_pool, v_pool, block_table, seq_lens, scale).to(out_dtype)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
                      pos: torch.Tensor, qrow: torch.Tensor, qn: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a step's prompt rows over their prompts' own fp32 K/V. q [N, NH, HD]
    fp32; k/v [S, NKV, BLOCK, HD] fp32; table [N, MAX_BLOCKS] int32; pos [N] int32; qrow/qn [Q]
    int32 query blocks of consecutive rows of one prompt (`prefill.query_blocks`) -> [N, NH, HD]:
    row r over positions 0..pos[r] of its table; rows in no query block give zeros. A row's bits
    depend on its own prompt only (the query blocks are the prompt's)."""
    if _use_triton(q):
        return _kernels().prefill_attention(q, k, v, table, pos, qrow, qn, scale)
    return ops_ref.prefill_attention(q, k, v, table, pos, qrow, qn, scale)


def talker_process_(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor,
                    n_sampled: torch.Tensor, eos: int, suppress_start: int,
                    min_new_tokens: int, rows: torch.Tensor | None = None) -> None:
    """In place on logits [B, V] fp32; seen [B, V] uint8, or [S, V] with rows [B] (row b's seen ids
    are seen[rows[b]]: no gathered copy); penalty [B] fp32; n_sampled [B] int32: repetition penalty
    over seen ids, ids [suppress_start, V) -> -inf except eos, eos -> -inf while n_sampled <
    min_new_tokens (as model/sampler.py)."""
    if _use_triton(logits):
        return _kernels().talker_process_(logits, seen, penalty, n_sampled, eos, suppress_start,
                                          min_new_tokens, rows)
    return ops_ref.talker_process_(logits, seen if rows is None else seen[rows], penalty, n_sampled, eos,
                                   suppress_start, min_new_tokens)


def draws_in_triton(t: torch.Tensor) -> bool:
    """Whether the draws of tensors like t run as Triton kernels (which can take frame_noise's
    noise); the reference's make their own."""
    return _use_triton(t)


def frame_noise(rows: torch.Tensor, seed: torch.Tensor, ints: torch.Tensor, nsamp_field: int,
                noise: torch.Tensor, nv0: int, nv: int) -> None:
    """The Gumbel noise of a frame's draws for slots rows into noise (tk_sample.frame_noise: [:, 0]
    the talker's draw over nv0 ids, [:, s] the code predictor's pass s - 1 over nv), for draws
    that run as Triton kernels (draws_in_triton)."""
    assert _use_triton(rows), "frame_noise: for the Triton draws"
    _kernels().frame_noise(rows, seed, ints, nsamp_field, noise, nv0, nv)


def sample_tokens(logits: torch.Tensor, do_sample: torch.Tensor, temperature: torch.Tensor,
                  top_k: torch.Tensor, top_p: torch.Tensor, seed: torch.Tensor,
                  counter: torch.Tensor, stream: int, embed: torch.Tensor | None = None, into: tuple | None = None,
                  early: bool = False, noise: torch.Tensor | None = None):
    """logits [B, V] fp32, or `linear_parts`' partial products [P, B, V] (summed in part order,
    as `linear` sums them); do_sample/top_k [B] int32; temperature/top_p [B] fp32; seed/counter
    [B] int64; stream int -> (codes [B] int32 in [0, V), finite [B] bool). finite is False where
    the row holds a NaN or +inf or is all -inf (-inf masks from talker_process_ are fine).
    embed: a [V', H] table (V' >= V); then (codes, finite, embed[codes] [B, H] fp32), the
    lookup done in the same launch. into: (out [>= B, C] int32, col, err_col, bit): also
    out[:B, col] = codes and out[:B, err_col] |= 1 << bit where a row is not finite. early: the
    caller wrote do_sample, seed and counter at least two launches before this one, so that under
    PDL the draw makes its noise before it waits for the logits (the same codes either way).
    noise (with early): this draw's rows of frame_noise's output, loaded instead of made (the same
    values; the reference makes its own)."""
    if _use_triton(logits):
        return _kernels().sample_tokens(logits, do_sample, temperature, top_k, top_p, seed,
                                        counter, stream, embed, into, early, noise)
    return ops_ref.sample_tokens(logits, do_sample, temperature, top_k, top_p, seed, counter,
                                 stream, embed, into)


def warm_up(device: torch.device, dtypes: tuple = (torch.bfloat16,)) -> None:
    """Compile the GEMM tiles of every row-count bucket, for matrices of each of `dtypes`, before
    serving (CUDA only)."""
    if device.type == "cuda":
        _kernels().warm_up(device, dtypes, MLP_SHIFT)
