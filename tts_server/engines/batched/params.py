"""The batched engine's view of the decode weights: GEMM matrices in bf16 or fp16 (q|k|v fused),
fp32 norms.

Dims come from each stack's LMConfig, never from constants, so other model sizes load unchanged.
New memory: the fused q|k|v matrices, the stacked code-predictor tables and, with fp16 GEMMs, the
fp16 copies; every other tensor is a view when the weights are already bf16 on the engine's device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ...model.weights import CodecIds, DecodeWeights, LMConfig, LMWeights

BF16 = torch.bfloat16
FP16 = torch.float16


def gemm_dtype(device: torch.device | str, frame_kernel: str = "triton") -> torch.dtype:
    """The dtype of the GEMM matrices: fp16 on CUDA with the Triton frame kernels, else bf16;
    TTS_GEMM_DTYPE=bf16|fp16 decides instead for the Triton frame (A/Bs, the CPU interpreter's
    tests). The CUDA frame kernels (csrc/batched/) read bf16 only, whatever the variable says.

    bf16: fp32 activations enter the tensor cores as two bf16 terms (16 significant bits, two
    dots per K step). fp16: the matrices converted once (exact for bf16 values of magnitude
    2^-17..65504) and activations rounded once to fp16 (11 significant bits, one dot). On an H100
    fp16 made a B = 1 frame 14% faster and B = 256 10%, with issue 16's accuracy bar still met
    (teacher-forced top-1 99.73% against 99.79%, BENCHMARKS.md session 21); both are
    batch-invariant. The products' inputs: the normed hidden states (q|k|v, gate|up, the heads)
    and attention outputs (o_proj) as they are; the MLP's down projection takes silu(gate) * up
    times 2^-6 (ops.MLP_SHIFT), which exceeds fp16's 65504 unscaled in the real Qwen3-TTS 0.6B code
    predictor (~1.4e5 in its block 2, found by CrispASR's fp16 port, their issue 38)."""
    if frame_kernel != "triton":
        return BF16
    env = os.environ.get("TTS_GEMM_DTYPE")
    if env in ("bf16", "fp16"):
        return FP16 if env == "fp16" else BF16
    if env:
        raise ValueError(f"TTS_GEMM_DTYPE must be bf16 or fp16, got {env!r}")
    return FP16 if torch.device(device).type == "cuda" else BF16


@dataclass(frozen=True)
class StackParams:
    """One decoder stack (talker or code predictor); per-layer lists, index = layer."""

    cfg: LMConfig
    in_norm: tuple[torch.Tensor, ...]  # [H] fp32
    wqkv: tuple[torch.Tensor, ...]  # [(NH + 2 NKV) HD, H] bf16: q rows, then k, then v
    q_norm: tuple[torch.Tensor, ...]  # [HD] fp32
    k_norm: tuple[torch.Tensor, ...]  # [HD] fp32
    wo: tuple[torch.Tensor, ...]  # [H, NH HD] bf16
    post_norm: tuple[torch.Tensor, ...]  # [H] fp32
    gate: tuple[torch.Tensor, ...]  # [I, H] bf16
    up: tuple[torch.Tensor, ...]  # [I, H] bf16
    down: tuple[torch.Tensor, ...]  # [H, I] bf16 (fp16: see gemm_dtype)
    final_norm: torch.Tensor  # [H] fp32

    @property
    def q_dim(self) -> int:
        return self.cfg.num_heads * self.cfg.head_dim

    @property
    def kv_dim(self) -> int:
        return self.cfg.num_kv_heads * self.cfg.head_dim


@dataclass(frozen=True)
class FrameParams:
    """Everything one batched frame reads."""

    talker: StackParams
    predictor: StackParams
    codec_embedding: torch.Tensor  # [V, H] bf16 (talker input table: code 0)
    codec_head: torch.Tensor  # [V, H] bf16
    predictor_embedding_stack: torch.Tensor  # [G-1, VC, H] bf16: the code groups' tables, for glue.advance_inputs
    predictor_heads: tuple[torch.Tensor, ...]  # G-1 x [VC, Hp] bf16
    in_proj: tuple[torch.Tensor, torch.Tensor] | None  # (W [Hp, H] bf16, b [Hp] fp32); None = identity
    ids: CodecIds

    @property
    def num_passes(self) -> int:
        return self.ids.num_code_groups - 1


def _stack(lm: LMWeights, device, dtype: torch.dtype) -> StackParams:
    f32 = lambda t: t.to(device, torch.float32)  # noqa: E731
    mat = lambda t: t.to(device, BF16).to(dtype)  # noqa: E731 - the GEMMs' matrices
    ls = lm.layers
    return StackParams(
        cfg=lm.config,
        in_norm=tuple(f32(l.input_norm) for l in ls),
        wqkv=tuple(torch.cat((mat(l.q_proj), mat(l.k_proj), mat(l.v_proj))).contiguous() for l in ls),
        q_norm=tuple(f32(l.q_norm) for l in ls), k_norm=tuple(f32(l.k_norm) for l in ls),
        wo=tuple(mat(l.o_proj).contiguous() for l in ls), post_norm=tuple(f32(l.post_norm) for l in ls),
        gate=tuple(mat(l.gate_proj).contiguous() for l in ls), up=tuple(mat(l.up_proj).contiguous() for l in ls),
        down=tuple(mat(l.down_proj).contiguous() for l in ls), final_norm=f32(lm.final_norm))


def prepare(w: DecodeWeights, device: torch.device | str | None = None,
            dtype: torch.dtype | None = None) -> FrameParams:
    """The engine's layout of `w` on `device` (default: where the weights are), its GEMM
    matrices in `dtype` (default: `gemm_dtype(device)`)."""
    device = torch.device(device) if device is not None else w.codec_head.device
    dtype = dtype or gemm_dtype(device)
    b16 = lambda t: t.to(device, BF16).contiguous()  # noqa: E731
    mat = lambda t: b16(t).to(dtype)  # noqa: E731 - the GEMMs' matrices
    proj = None
    if w.predictor_in_proj is not None:
        proj = (mat(w.predictor_in_proj[0]), w.predictor_in_proj[1].to(device, torch.float32))
    emb = torch.stack([b16(e) for e in w.predictor_embeddings])
    return FrameParams(
        talker=_stack(w.talker, device, dtype), predictor=_stack(w.predictor, device, dtype),
        codec_embedding=b16(w.codec_embedding), codec_head=mat(w.codec_head),
        predictor_embedding_stack=emb,
        predictor_heads=tuple(mat(h) for h in w.predictor_heads), in_proj=proj, ids=w.ids)


def fused_bytes(w: DecodeWeights, dtype: torch.dtype = BF16) -> int:
    """New device bytes that `prepare` allocates beside bf16 weights (the fused q|k|v copies, the
    stacked code-predictor embedding tables and, for fp16 GEMMs, the other matrices' copies)."""
    n = sum(e.numel() for e in w.predictor_embeddings) * 2
    for lm in (w.talker, w.predictor):
        c = lm.config
        n += c.num_layers * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim * c.hidden_size * 2
        if dtype != BF16:  # o_proj, gate, up, down
            n += sum((l.o_proj.numel() + l.gate_proj.numel() + l.up_proj.numel() + l.down_proj.numel()) * 2
                     for l in lm.layers)
    if dtype != BF16:  # the heads (and the 1.7B's projection into the code predictor)
        n += (w.codec_head.numel() + sum(h.numel() for h in w.predictor_heads)) * 2
        n += w.predictor_in_proj[0].numel() * 2 if w.predictor_in_proj is not None else 0
    return n
