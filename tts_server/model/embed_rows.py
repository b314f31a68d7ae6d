"""A step's prompt rows in one launch (CUDA, Triton): `PromptBuilder.materialise`'s gathers, the
codec addition and the text-track rows, which are six PyTorch launches otherwise (0.7 ms of host
time on an H100 host before one stream's prefill could start: scripts/gpu_worker_timeline.py).
Bitwise the torch path's: a text row is a copy of its table row, an addition is the two bf16
(fp16, fp32) values added in fp32 and rounded once to nearest even, as PyTorch adds two bf16
tensors (finite embeddings: the hand rounding of bf16 does not keep NaN payloads)."""

from __future__ import annotations

import os

import torch

try:  # the GPU path; CPU-only installs use materialise's torch ops
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the install
    triton = None

HAS_TRITON = triton is not None

if HAS_TRITON:

    # N, M: row counts that change with every request (not specialized: no compile while serving)
    @triton.jit(do_not_specialize=["N", "M"])
    def _embed_rows_kernel(text_ptr, codec_ptr, idx_ptr, out_ptr, trail_ptr, N, M, H,
                           BF16: tl.constexpr, BLOCK_H: tl.constexpr):
        # idx [N + M + N + N] int64: text ids, trailing ids, codec ids, has-codec flags;
        # program r < N: out[r] = text[t] (+ codec[c] where has); r >= N: trail[r - N] = text[t']
        r = tl.program_id(0)
        cols = tl.arange(0, BLOCK_H)
        mask = cols < H
        t = tl.load(idx_ptr + r)
        row = tl.load(text_ptr + t * H + cols, mask=mask)
        if r < N:
            has = tl.load(idx_ptr + N + M + N + r)
            if has != 0:
                c = tl.load(idx_ptr + N + M + r)
                add = tl.load(codec_ptr + c * H + cols, mask=mask)
                total = row.to(tl.float32) + add.to(tl.float32)
                if BF16:  # rounded to nearest even by hand: the interpreter's cast truncates
                    bits = total.to(tl.uint32, bitcast=True)
                    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
                    row = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
                else:
                    row = total.to(row.dtype)
            tl.store(out_ptr + r * H + cols, row, mask=mask)
        else:
            tl.store(trail_ptr + (r - N) * H + cols, row, mask=mask)


def usable(text_table: torch.Tensor, codec_table: torch.Tensor) -> bool:
    """Whether `embed_rows` can serve these tables (CUDA, or the Triton interpreter on the CPU)."""
    on = text_table.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    return (HAS_TRITON and on and text_table.dtype == codec_table.dtype and text_table.is_contiguous()
            and codec_table.is_contiguous() and text_table.shape[1] == codec_table.shape[1])


def embed_rows(text_table: torch.Tensor, codec_table: torch.Tensor, idx: torch.Tensor, n: int,
               m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """text_table [V, H], codec_table [Vc, H] (one dtype); idx [n + m + n + n] int64 on their
    device: n text ids, m trailing ids, n codec ids (any valid id where unused), n has-codec flags
    (0/1) -> (embeds [n, H], trailing [m, H]) in the tables' dtype."""
    h = text_table.shape[1]
    out = torch.empty(n, h, dtype=text_table.dtype, device=text_table.device)
    trail = torch.empty(m, h, dtype=text_table.dtype, device=text_table.device)
    if n + m:
        _embed_rows_kernel[(n + m,)](text_table, codec_table, idx, out, trail, n, m, h,
                                     BF16=text_table.dtype == torch.bfloat16,
                                     BLOCK_H=triton.next_power_of_2(h), num_warps=4)
    return out, trail
