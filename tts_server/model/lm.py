"""Functional Qwen3 decoder stack over `LMWeights`, with a fixed-size slot KV cache.

Math as qwen-tts: pre-norm layers, RMSNorm in fp32 cast back before the weight multiply,
per-head q/k RMSNorm before rotate-half RoPE, GQA, SwiGLU. Used by the talker (persistent
per-stream KV rows) and the code predictor (per-frame scratch KV).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .weights import LayerWeights, LMConfig, LMWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> [..., D], as Qwen3TTSRMSNorm."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, cfg: LMConfig, dtype: torch.dtype):
    """positions [B, T] int -> cos, sin [B, T, head_dim] (fp32 math, cast to dtype)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, device=positions.device,
                                                      dtype=torch.int64).float() / d))
    freqs = positions.float()[..., None] * inv_freq  # [B, T, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D], cos/sin [B, T, D]."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + _rotate_half(x) * sin


class KVCache:
    """K/V rows per slot: k, v [num_slots, num_layers, num_kv_heads, max_positions, head_dim]."""

    def __init__(self, cfg: LMConfig, num_slots: int, max_positions: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_slots, cfg.num_layers, cfg.num_kv_heads, max_positions, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_positions = max_positions


def _attention_layer(x, lw: LayerWeights, cfg: LMConfig, cos, sin, cache: KVCache, layer: int,
                     slots: torch.Tensor, positions: torch.Tensor, num_keys: int) -> torch.Tensor:
    """x [B, T, H] at positions [B, T] of `slots` [B]; attends to keys 0..num_keys-1 of each
    slot, masked causally by position. Writes this step's K/V into the cache."""
    b, t, _ = x.shape
    h = rms_norm(x, lw.input_norm, cfg.rms_norm_eps)
    q = F.linear(h, lw.q_proj).view(b, t, cfg.num_heads, cfg.head_dim)
    k = F.linear(h, lw.k_proj).view(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = F.linear(h, lw.v_proj).view(b, t, cfg.num_kv_heads, cfg.head_dim)
    q = rms_norm(q, lw.q_norm, cfg.rms_norm_eps).transpose(1, 2)  # [B, nh, T, D]
    k = rms_norm(k, lw.k_norm, cfg.rms_norm_eps).transpose(1, 2)  # [B, nkv, T, D]
    v = v.transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    slot_idx = slots[:, None, None].expand(b, cfg.num_kv_heads, t)
    head_idx = torch.arange(cfg.num_kv_heads, device=x.device)[None, :, None].expand(b, -1, t)
    pos_idx = positions[:, None, :].expand(b, cfg.num_kv_heads, t)
    cache.k[:, layer][slot_idx, head_idx, pos_idx] = k
    cache.v[:, layer][slot_idx, head_idx, pos_idx] = v
    keys = cache.k[slots, layer, :, :num_keys]  # [B, nkv, K, D]
    values = cache.v[slots, layer, :, :num_keys]
    key_pos = torch.arange(num_keys, device=x.device)
    mask = key_pos[None, None, :] <= positions[:, :, None]  # [B, T, K]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None],
                                         scale=cfg.head_dim ** -0.5, enable_gqa=True)
    out = out.transpose(1, 2).reshape(b, t, cfg.num_heads * cfg.head_dim)
    x = x + F.linear(out, lw.o_proj)
    h = rms_norm(x, lw.post_norm, cfg.rms_norm_eps)
    return x + F.linear(F.silu(F.linear(h, lw.gate_proj)) * F.linear(h, lw.up_proj), lw.down_proj)


def lm_forward(weights: LMWeights, x: torch.Tensor, cache: KVCache, slots: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
    """Run the stack over x [B, T, H] at positions [B, T] (ascending per row) of `slots` [B].
    Returns the final-normed hidden states [B, T, H]."""
    cfg = weights.config
    cos, sin = rope_cos_sin(positions, cfg, x.dtype)
    num_keys = int(positions.max()) + 1
    for i, lw in enumerate(weights.layers):
        x = _attention_layer(x, lw, cfg, cos, sin, cache, i, slots, positions, num_keys)
    return rms_norm(x, weights.final_norm, cfg.rms_norm_eps)
