"""Exact stateful streaming decode for the Qwen3-TTS 12 Hz codec: carries the transformer's
sliding-window K/V, every causal conv's input history and every transposed conv's overlap tail,
so decoding in pieces of any size gives the samples of one full-sequence decode."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from qwen_tts.core.tokenizer_12hz import modeling_qwen3_tts_tokenizer_v2 as qm

__all__ = ["CodecState", "StreamingCodecDecoder"]


class CodecState:
    """Per-stream decoder state. Callers only read `num_frames`; the rest is internal.

    kv: per transformer layer (K, V), each [1, H_kv, window - 1, D]: the post-RoPE keys/values of
    the last window - 1 frames (slots of frames before 0 are zeros and masked out).
    conv: per stateful conv slot, [1, C, h] (causal conv input history) or [1, C_out, K - s]
    (transposed conv overlap tail, bias excluded).
    All buffers are allocated once by `new_state` and updated in place (fixed size per stream).
    """

    __slots__ = ("num_frames", "kv", "conv")

    def __init__(self, kv: list, conv: list):
        self.num_frames = 0
        self.kv = kv
        self.conv = conv

    @property
    def nbytes(self) -> int:
        """Bytes currently held by the state's tensors."""
        tensors = [t for pair in self.kv for t in pair] + list(self.conv)
        return sum(t.numel() * t.element_size() for t in tensors)


class StreamingCodecDecoder:
    """Frame-exact streaming front end for a shared, read-only `Qwen3TTSTokenizerV2Decoder`.

    Reuses the decoder's modules and weights; only the stateful forward logic is re-implemented.
    Construct it after the decoder's weights are final (the normalised RVQ tables are cached here;
    they are rebuilt automatically if the decoder moves to another device). On CUDA, exactness
    needs fp32 convs: set `torch.backends.cudnn.allow_tf32 = False` (PyTorch's default is True).
    A decode call that raises leaves its state half-updated: discard that state.
    """

    def __init__(self, decoder):
        self.decoder = decoder
        cfg = decoder.config
        self.samples_per_frame = int(decoder.total_upsample)
        self.sample_rate = int(getattr(cfg, "output_sample_rate", None) or 24000)
        tr = decoder.pre_transformer
        attn = tr.layers[0].self_attn
        self.window = int(cfg.sliding_window)
        if self.window < 2:
            raise NotImplementedError("sliding window < 2 frames")
        self.num_kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(attn.head_dim)
        self.kv_groups = int(attn.num_key_value_groups)
        self.num_quantizers = int(cfg.num_quantizers)
        self._slot: dict[int, int] = {}
        self._slot_shapes: list[tuple[int, int]] = []
        for mod in decoder.modules():
            if isinstance(mod, qm.Qwen3TTSTokenizerV2CausalConvNet):
                if mod.stride != 1:
                    raise NotImplementedError("strided causal conv is not streamable here")
                shape = (mod.conv.in_channels, mod.padding)
            elif isinstance(mod, qm.Qwen3TTSTokenizerV2CausalTransConvNet):
                k, s = mod.conv.kernel_size[0], mod.conv.stride[0]
                if mod.right_pad != k - s or mod.conv.padding[0] != 0 or k < s:
                    raise NotImplementedError("unexpected transposed conv geometry")
                shape = (mod.conv.out_channels, k - s)
            else:
                continue
            if shape[1] == 0:  # k=1 convs and k=s transposed convs carry nothing
                continue
            self._slot[id(mod)] = len(self._slot_shapes)
            self._slot_shapes.append(shape)
        self._tables: torch.Tensor | None = None

    # ----------------------------------------------------------------------------------------
    @property
    def _param(self) -> torch.Tensor:
        return self.decoder.pre_conv.conv.weight

    def new_state(self) -> CodecState:
        """A fresh state: empty K/V, zero conv histories and tails (= the decoder's zero padding)."""
        p = self._param
        shape = (1, self.num_kv_heads, self.window - 1, self.head_dim)
        with torch.inference_mode():
            kv = [(torch.zeros(shape, device=p.device, dtype=p.dtype),
                   torch.zeros(shape, device=p.device, dtype=p.dtype))
                  for _ in self.decoder.pre_transformer.layers]
            conv = [torch.zeros(1, c, h, device=p.device, dtype=p.dtype) for c, h in self._slot_shapes]
        return CodecState(kv, conv)

    @torch.inference_mode()
    def decode(self, state: CodecState, codes: torch.Tensor) -> torch.Tensor:
        """codes [T, Q] int64 (any device) -> float32 audio [T * samples_per_frame] on the
        decoder's device; advances `state` by T frames."""
        if codes.dim() != 2 or codes.shape[1] != self.num_quantizers or codes.shape[0] < 1:
            raise ValueError(f"codes must be [T>=1, {self.num_quantizers}], got {tuple(codes.shape)}")
        dec = self.decoder
        t = codes.shape[0]
        x = self._quantize(codes.to(self._param.device, torch.long))  # [1, Cq, T]
        x = self._conv(dec.pre_conv, x, state)  # [1, latent, T]
        x = self._transformer(x.transpose(1, 2), state).transpose(1, 2)  # [1, latent, T]
        for blocks in dec.upsample:
            for block in blocks:
                x = self._run(block, x, state)
        for block in dec.decoder:
            x = self._run(block, x, state)  # ends as [1, 1, T * samples_per_frame]
        state.num_frames += t
        return x.clamp(min=-1, max=1).reshape(-1)

    # ----------------------------------------------------------------------------------------
    def _rvq_tables(self) -> torch.Tensor:
        """[Q, codebook_size, dim] normalised (and projected-out) codebook tables, cached."""
        p = self._param
        if self._tables is None or self._tables.device != p.device:
            q = self.decoder.quantizer
            layers = list(q.rvq_first.vq.layers) + list(q.rvq_rest.vq.layers)
            if p.device.type == "cuda" and (torch.backends.cudnn.allow_tf32
                                            or torch.backends.cuda.matmul.allow_tf32):
                warnings.warn("TF32 is enabled: streaming and one-piece codec decode will differ "
                              "by ~1e-3 (set torch.backends.cudnn.allow_tf32 = False)", stacklevel=3)
            with torch.inference_mode():
                tabs = []
                for layer in layers:
                    cb = layer._codebook
                    emb = cb.embedding_sum / cb.cluster_usage.clamp(min=cb.epsilon)[:, None]
                    tabs.append(layer.project_out(emb))
                self._tables = torch.stack(tabs).to(p.dtype)
        return self._tables

    def _quantize(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [T, Q] -> summed, projected RVQ embeddings [1, codebook_dim, T] (as
        SplitResidualVectorQuantizer.decode: semantic codebook and the rest projected apart)."""
        q = self.decoder.quantizer
        tabs = self._rvq_tables()
        idx = torch.arange(tabs.shape[0], device=codes.device)[:, None]
        emb = tabs[idx, codes.t()]  # [Q, T, dim]
        n = q.n_q_semantic
        first = emb[:n].sum(0).t()[None]  # [1, dim, T]
        out = q.rvq_first.output_proj(first)
        if emb.shape[0] > n:
            out = out + q.rvq_rest.output_proj(emb[n:].sum(0).t()[None])
        return out

    def _run(self, mod, x: torch.Tensor, st: CodecState) -> torch.Tensor:
        """One decoder stage, [1, C, L] -> [1, C', L']."""
        if isinstance(mod, qm.Qwen3TTSTokenizerV2CausalConvNet):
            return self._conv(mod, x, st)
        if isinstance(mod, qm.Qwen3TTSTokenizerV2CausalTransConvNet):
            return self._tconv(mod, x, st)
        if isinstance(mod, qm.SnakeBeta):
            return mod(x)
        if isinstance(mod, qm.Qwen3TTSTokenizerV2DecoderDecoderBlock):
            for sub in mod.block:
                x = self._run(sub, x, st)
            return x
        if isinstance(mod, qm.Qwen3TTSTokenizerV2DecoderDecoderResidualUnit):
            h = self._conv(mod.conv1, mod.act1(x), st)
            return self._conv(mod.conv2, mod.act2(h), st) + x
        if isinstance(mod, qm.Qwen3TTSTokenizerV2ConvNeXtBlock):
            h = self._conv(mod.dwconv, x, st).transpose(1, 2)  # [1, L, C]
            h = mod.pwconv2(mod.act(mod.pwconv1(mod.norm(h))))
            return x + (mod.gamma * h).transpose(1, 2)
        raise NotImplementedError(f"no streaming rule for {type(mod).__name__}")

    def _conv(self, mod, x: torch.Tensor, st: CodecState) -> torch.Tensor:
        """Causal conv (stride 1): [1, Cin, L] -> [1, Cout, L], history = last (k-1)*d inputs."""
        h = mod.padding
        if h == 0:
            return mod.conv(x)
        slot = self._slot[id(mod)]
        xc = torch.cat((st.conv[slot], x), dim=2)  # [1, Cin, h + L]
        st.conv[slot].copy_(xc[:, :, -h:])
        return mod.conv(xc)

    def _tconv(self, mod, x: torch.Tensor, st: CodecState) -> torch.Tensor:
        """Causal transposed conv (kernel K, stride s, right-trimmed by K - s): [1, Cin, L] ->
        [1, Cout, L*s]; the K - s samples that spill into the next call are carried."""
        conv = mod.conv
        s = conv.stride[0]
        y = F.conv_transpose1d(x, conv.weight, None, stride=s)  # [1, Cout, (L-1)*s + K]
        n = x.shape[2] * s
        slot = self._slot.get(id(mod))
        if slot is not None:
            tail = st.conv[slot]
            y[:, :, : tail.shape[2]] += tail
            tail.copy_(y[:, :, n:])
        y = y[:, :, :n]
        return y if conv.bias is None else y + conv.bias[:, None]

    def _transformer(self, x: torch.Tensor, st: CodecState) -> torch.Tensor:
        """Sliding-window transformer with carried K/V: [1, T, latent] -> [1, T, latent]."""
        tr = self.decoder.pre_transformer
        t, w = x.shape[1], self.window
        pos = torch.arange(st.num_frames, st.num_frames + t, device=x.device)[None]
        h = tr.input_proj(x)  # [1, T, hidden]
        cos, sin = tr.rotary_emb(h, pos)  # [1, T, D]
        c = w - 1  # cached slots; key j sits at position num_frames - c + j
        mask = None
        if t > 1 or st.num_frames < c:
            qi = torch.arange(t, device=x.device)[:, None]
            kj = torch.arange(c + t, device=x.device)[None]
            first = max(c - st.num_frames, 0)  # slots before position 0 hold no frame
            mask = (kj <= qi + c) & (kj >= qi) & (kj >= first)  # [T, c + T], True = attend
        for i, layer in enumerate(tr.layers):
            a = layer.self_attn
            y = layer.input_layernorm(h)
            q = a.q_proj(y).view(1, t, -1, self.head_dim).transpose(1, 2)  # [1, H, T, D]
            k = a.k_proj(y).view(1, t, -1, self.head_dim).transpose(1, 2)  # [1, Hkv, T, D]
            v = a.v_proj(y).view(1, t, -1, self.head_dim).transpose(1, 2)
            q, k = qm.apply_rotary_pos_emb(q, k, cos, sin)
            k_all = torch.cat((st.kv[i][0], k), dim=2)  # [1, Hkv, c + T, D]
            v_all = torch.cat((st.kv[i][1], v), dim=2)
            st.kv[i][0].copy_(k_all[:, :, -c:])
            st.kv[i][1].copy_(v_all[:, :, -c:])
            if self.kv_groups > 1:
                k_all = k_all.repeat_interleave(self.kv_groups, dim=1)
                v_all = v_all.repeat_interleave(self.kv_groups, dim=1)
            o = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=a.scaling)
            o = a.o_proj(o.transpose(1, 2).reshape(1, t, -1))  # [1, T, hidden]
            h = h + layer.self_attn_layer_scale(o)
            h = h + layer.mlp_layer_scale(layer.mlp(layer.post_attention_layernorm(h)))
        return tr.output_proj(tr.norm(h))
