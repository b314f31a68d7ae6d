"""Plain-tensor views of a qwen-tts model's decode weights (no copies).

The torch reference engine and the CUDA megakernel both read the decode-time weights
through these dataclasses, so neither depends on qwen-tts module internals.
Layout: every projection is an `nn.Linear` weight, shape [out_features, in_features].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LMConfig:
    """Shape of one Qwen3 decoder stack (talker or code predictor)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float


@dataclass(frozen=True)
class LayerWeights:
    """One pre-norm Qwen3 decoder layer with per-head q/k RMSNorm and SwiGLU."""

    input_norm: torch.Tensor  # [H]
    q_proj: torch.Tensor  # [num_heads*head_dim, H]
    k_proj: torch.Tensor  # [num_kv_heads*head_dim, H]
    v_proj: torch.Tensor  # [num_kv_heads*head_dim, H]
    q_norm: torch.Tensor  # [head_dim]
    k_norm: torch.Tensor  # [head_dim]
    o_proj: torch.Tensor  # [H, num_heads*head_dim]
    post_norm: torch.Tensor  # [H]
    gate_proj: torch.Tensor  # [I, H]
    up_proj: torch.Tensor  # [I, H]
    down_proj: torch.Tensor  # [H, I]


@dataclass(frozen=True)
class LMWeights:
    config: LMConfig
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor  # [H]


@dataclass(frozen=True)
class CodecIds:
    """Special codec-track ids and the talker's sampling masks."""

    vocab_size: int  # talker codec vocabulary (3072)
    eos: int  # 2150
    pad: int
    bos: int
    suppress_start: int  # ids in [suppress_start, vocab_size) except eos are never sampled
    num_code_groups: int  # 16
    predictor_vocab_size: int  # 2048
    min_new_tokens: int = 2  # EOS is masked for the first two code-0 samples


@dataclass(frozen=True)
class DecodeWeights:
    """Everything one decode frame (talker step + 15 predictor passes) reads."""

    talker: LMWeights
    codec_embedding: torch.Tensor  # [3072, H] talker input table (code 0 and specials)
    codec_head: torch.Tensor  # [3072, H] code-0 logits
    predictor: LMWeights
    predictor_embeddings: tuple[torch.Tensor, ...]  # 15 x [2048, H]: codebooks 1..15 inputs
    predictor_heads: tuple[torch.Tensor, ...]  # 15 x [2048, Hp]: logits of codebooks 1..15
    predictor_in_proj: tuple[torch.Tensor, torch.Tensor] | None  # (W [Hp, H], b [Hp]); None = identity
    ids: CodecIds


def _lm_config(cfg) -> LMConfig:
    return LMConfig(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
        num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
        head_dim=getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads),
        intermediate_size=cfg.intermediate_size, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=float(cfg.rope_theta),
    )


def _layer(layer) -> LayerWeights:
    a, m = layer.self_attn, layer.mlp
    return LayerWeights(
        input_norm=layer.input_layernorm.weight, q_proj=a.q_proj.weight, k_proj=a.k_proj.weight,
        v_proj=a.v_proj.weight, q_norm=a.q_norm.weight, k_norm=a.k_norm.weight,
        o_proj=a.o_proj.weight, post_norm=layer.post_attention_layernorm.weight,
        gate_proj=m.gate_proj.weight, up_proj=m.up_proj.weight, down_proj=m.down_proj.weight,
    )


def decode_weights(model) -> DecodeWeights:
    """Views of `Qwen3TTSForConditionalGeneration` weights needed per decode frame."""
    talker = model.talker
    tcfg = talker.config
    cp = talker.code_predictor
    proj = cp.small_to_mtp_projection
    in_proj = None if isinstance(proj, torch.nn.Identity) else (proj.weight, proj.bias)
    ids = CodecIds(
        vocab_size=tcfg.vocab_size, eos=tcfg.codec_eos_token_id, pad=tcfg.codec_pad_id,
        bos=tcfg.codec_bos_id, suppress_start=tcfg.vocab_size - 1024,
        num_code_groups=tcfg.num_code_groups, predictor_vocab_size=cp.config.vocab_size,
    )
    return DecodeWeights(
        talker=LMWeights(_lm_config(tcfg), tuple(_layer(l) for l in talker.model.layers),
                         talker.model.norm.weight),
        codec_embedding=talker.model.codec_embedding.weight,
        codec_head=talker.codec_head.weight,
        predictor=LMWeights(_lm_config(cp.config), tuple(_layer(l) for l in cp.model.layers),
                            cp.model.norm.weight),
        predictor_embeddings=tuple(e.weight for e in cp.model.codec_embedding),
        predictor_heads=tuple(h.weight for h in cp.lm_head),
        predictor_in_proj=in_proj,
        ids=ids,
    )
