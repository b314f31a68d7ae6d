"""The codec decoder rewritten for the batched step: every conv, transposed conv and linear as one
GEMM weight [taps*Cin, N] (prepared once, in the serving dtype), plus the slot-pooled state
layout (which stage carries how many input samples of history)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from qwen_tts.core.tokenizer_12hz import modeling_qwen3_tts_tokenizer_v2 as qm

__all__ = ["Gemm", "Plan", "build_plan"]


@dataclass
class Gemm:
    """One GEMM stage. hist > 0: causal, the last `hist` input samples of each slot are carried
    in state tensor `state` ([S, hist, Cin]); up > 1: a transposed conv whose N = up * Cout
    columns are the `up` output phases (the output reshapes to [B, L*up, Cout] for free).
    Every SnakeBeta runs once, in the epilogue of the GEMM that produces its input (`post`), so
    histories hold the activated samples that the conv consumes."""

    w: torch.Tensor  # [taps*Cin, N]
    bias: torch.Tensor | None = None  # [N] fp32
    taps: int = 1
    dil: int = 1
    hist: int = 0
    state: int = -1
    up: int = 1
    scale: torch.Tensor | None = None  # [N] fp32 (LayerScale / ConvNeXt gamma)
    act: int = 0  # 1 = exact GELU
    post: tuple | None = None  # the consumer's SnakeBeta (exp(alpha), 1/(exp(beta)+1e-9)) [Cout]
    raw: bool = True  # whether the output before `post` is needed (residuals)

    @property
    def cin(self) -> int:
        return self.w.shape[0] // self.taps


@dataclass
class Plan:
    tables: torch.Tensor  # [Q, codebook, latent_in] fp32, projected RVQ tables
    table_bias: torch.Tensor | None
    pre_conv: Gemm
    input_proj: Gemm
    layers: list  # per layer: dict(norm1, qkv, o, norm2, gate_up, down)
    norm: tuple  # (weight fp32, eps)
    output_proj: Gemm
    upsample: list  # per stage: (tconv Gemm, convnext dict)
    conv0: Gemm
    blocks: list  # per block: (tconv Gemm, [(conv1 Gemm, conv2 Gemm)] * 3)
    final: Gemm
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    window: int = 0
    states: list = field(default_factory=list)  # (hist, Cin) per carried conv
    rotary: object = None


def _f32(t):
    return None if t is None else t.detach().to(torch.float32).clone()


def _snake(act: qm.SnakeBeta) -> tuple:
    a = act.alpha.detach().double()
    b = act.beta.detach().double()
    return a.exp().float(), (1.0 / (b.exp() + act.no_div_by_zero)).float()


class _Builder:
    def __init__(self, dtype):
        self.dtype = dtype
        self.states: list[tuple[int, int]] = []

    def _carry(self, g: Gemm) -> Gemm:
        if g.hist:
            g.state = len(self.states)
            self.states.append((g.hist, g.cin))
        return g

    def linear(self, lin: torch.nn.Linear, **kw) -> Gemm:
        return Gemm(lin.weight.detach().t().contiguous().to(self.dtype), _f32(lin.bias), **kw)

    def conv(self, mod: qm.Qwen3TTSTokenizerV2CausalConvNet, **kw) -> Gemm:
        c = mod.conv
        if mod.stride != 1 or c.groups != 1:
            raise NotImplementedError("strided or grouped causal conv")
        k, d = c.kernel_size[0], c.dilation[0]
        w = c.weight.detach().permute(2, 1, 0).reshape(k * c.in_channels, c.out_channels)
        return self._carry(Gemm(w.contiguous().to(self.dtype), _f32(c.bias), taps=k, dil=d,
                                hist=mod.padding, **kw))

    def tconv(self, mod: qm.Qwen3TTSTokenizerV2CausalTransConvNet, **kw) -> Gemm:
        c = mod.conv
        k, s = c.kernel_size[0], c.stride[0]
        w = c.weight.detach()  # [Cin, Cout, K]
        if k == s:  # out[m*s + r] = x[m] W[:, :, r]
            taps = [w]
        elif k == 2 * s and mod.right_pad == s and c.padding[0] == 0:
            taps = [w[:, :, s:], w[:, :, :s]]  # x[m-1] W[:, :, s + r] + x[m] W[:, :, r]
        else:
            raise NotImplementedError("transposed conv with kernel other than s or 2s")
        g = torch.stack(taps).permute(0, 1, 3, 2)  # [taps, Cin, s, Cout]
        wg = g.reshape(len(taps) * c.in_channels, s * c.out_channels).contiguous()
        bias = None if c.bias is None else _f32(c.bias).repeat(s)
        return self._carry(Gemm(wg.to(self.dtype), bias, taps=len(taps), hist=len(taps) - 1,
                                up=s, **kw))


def _tables(dec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-codebook lookup tables already projected by their group's output conv (the
    projection is linear, so the 16-way sum can be taken after it), built in float64."""
    q = dec.quantizer
    tabs, bias = [], None
    for rvq in (q.rvq_first, q.rvq_rest):
        proj = rvq.output_proj
        for layer in rvq.vq.layers:
            cb = layer._codebook
            emb = cb.embedding_sum.double() / cb.cluster_usage.double().clamp(min=cb.epsilon)[:, None]
            po = layer.project_out
            if isinstance(po, torch.nn.Linear):
                emb = emb @ po.weight.double().t() + (0 if po.bias is None else po.bias.double())
            if isinstance(proj, torch.nn.Conv1d):
                emb = emb @ proj.weight.double()[:, :, 0].t()
            tabs.append(emb.float())
        if isinstance(proj, torch.nn.Conv1d) and proj.bias is not None:
            bias = proj.bias.float() if bias is None else bias + proj.bias.float()
    return torch.stack(tabs), bias


@torch.no_grad()
def build_plan(dec, dtype: torch.dtype) -> Plan:
    """Prepare every weight of `dec` (a Qwen3TTSTokenizerV2Decoder) for the batched step."""
    bd = _Builder(dtype)
    tables, tbias = _tables(dec)
    tr = dec.pre_transformer
    layers = []
    for layer in tr.layers:
        a = layer.self_attn
        qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach()
        qkv_b = None
        if a.q_proj.bias is not None:
            qkv_b = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]).float()
        gu = torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]).detach()
        layers.append(dict(
            norm1=(_f32(layer.input_layernorm.weight), layer.input_layernorm.variance_epsilon),
            qkv=Gemm(qkv.t().contiguous().to(dtype), qkv_b),
            o=bd.linear(a.o_proj, scale=_f32(layer.self_attn_layer_scale.scale)),
            norm2=(_f32(layer.post_attention_layernorm.weight), layer.post_attention_layernorm.variance_epsilon),
            gate_up=Gemm(gu.t().contiguous().to(dtype)),
            down=bd.linear(layer.mlp.down_proj, scale=_f32(layer.mlp_layer_scale.scale)),
        ))
    upsample = []
    for tconv, nx in dec.upsample:
        dw = nx.dwconv
        if dw.conv.groups != dw.conv.in_channels:
            raise NotImplementedError("ConvNeXt dwconv must be depthwise")
        cx = dict(
            dw_w=_f32(dw.conv.weight[:, 0, :].t()).contiguous(),  # [K, C]
            dw_b=_f32(dw.conv.bias), dw_hist=dw.padding, dw_dil=dw.conv.dilation[0],
            norm=(_f32(nx.norm.weight), _f32(nx.norm.bias), nx.norm.eps),
            pw1=bd.linear(nx.pwconv1, act=1),
            pw2=bd.linear(nx.pwconv2, scale=_f32(nx.gamma)),
        )
        cx["dw_state"] = len(bd.states)
        bd.states.append((dw.padding, dw.conv.in_channels))
        upsample.append((bd.tconv(tconv), cx))
    blks = list(dec.decoder[1:-2])
    firsts = [_snake(b.block[0]) for b in blks] + [_snake(dec.decoder[-2])]  # each block's input act
    conv0 = bd.conv(dec.decoder[0], post=firsts[0], raw=False)
    blocks = []
    for i, blk in enumerate(blks):
        _, tconv, *units = blk.block
        tc = bd.tconv(tconv, post=_snake(units[0].act1))
        ru = []
        for k, u in enumerate(units):
            nxt = _snake(units[k + 1].act1) if k + 1 < len(units) else firsts[i + 1]
            ru.append((bd.conv(u.conv1, post=_snake(u.act2), raw=False),
                       bd.conv(u.conv2, post=nxt, raw=k + 1 < len(units))))
        blocks.append((tc, ru))
    final = bd.conv(dec.decoder[-1])
    attn = tr.layers[0].self_attn
    cfg = dec.config
    return Plan(
        tables=tables, table_bias=tbias, pre_conv=bd.conv(dec.pre_conv), input_proj=bd.linear(tr.input_proj),
        layers=layers, norm=(_f32(tr.norm.weight), tr.norm.variance_epsilon),
        output_proj=bd.linear(tr.output_proj), upsample=upsample, conv0=conv0, blocks=blocks,
        final=final, heads=int(cfg.num_attention_heads), kv_heads=int(cfg.num_key_value_heads),
        head_dim=int(attn.head_dim), window=int(cfg.sliding_window), states=bd.states,
        rotary=tr.rotary_emb)
