"""One decode frame for B slots at once over device state: 15 code-predictor passes, the talker
step, both draws and the state commit. No host sync and fixed shapes for a given B, so a CUDA graph
can capture it. Every cross-row reduction goes through the batch-invariant `ops`; the glue here is
gathers, scatters, elementwise math and the row-local fused glue (glue.py)."""

from __future__ import annotations

import os
from typing import Callable

import torch
import triton

from ...model.lm import rope_cos_sin
from . import glue, ops, small_kernel
from .kv_pool import PagedKV
from .params import FrameParams, StackParams
from .state import (CODE0, DO_SAMPLE, EOS_FROM, N_SAMPLED, N_TRAILING, PENALTY, POS, SUB_DO_SAMPLE,
                    SUB_TEMPERATURE, SUB_TOP_K, SUB_TOP_P, TEMPERATURE, TEXT_STEP, TOP_K, TOP_P, SlotState)

# out[b] = 16 codes of the frame, the next code 0, an error bitmask (bit k < 15: code-predictor
# group k + 1 logits non-finite; bit 15: talker logits non-finite)
TALKER_BAD_BIT = 15
# frames of up to this many streams make their draws' Gumbel noise in one launch at the frame's start
# (FrameStep.noise), which under PDL runs while the frame's first kernel does, instead of in each
# draw before its PDL wait, where the head before it leaves ~2 µs for ~4 µs of fp64 logarithms (the
# talker's draw ~1 µs for ~8). The same values either way. H200, session 47 (gpu_pdl_ab.py's noiseN
# variants, two rounds, ms a frame): B = 1 2.251 / 2.262 -> 2.223 / 2.224 (noise4), B = 4 3.068 /
# 3.064 -> 3.036 / 3.038, B = 16 3.734 / 3.722 -> 3.704 / 3.713 (noise16), B = 64 4.442 / 4.443 ->
# 4.451 / 4.454 (noise64: slower), so on up to 16 (TTS_FRAME_NOISE_ROWS at the FrameStep's
# construction overrides the bound; 0: off).
NOISE_ROWS = 16


def noise_rows(max_rows: int) -> int:
    """The streams a frame may have to make its draws' noise at its start (FrameStep.noise's rows)."""
    return min(max_rows, int(os.environ.get("TTS_FRAME_NOISE_ROWS", NOISE_ROWS)))


def stack_forward(x: torch.Tensor, sp: StackParams, attend: Callable, final_fp32: bool = True) -> torch.Tensor:
    """All layers of a stack over rows x [M, H] fp32 -> final-normed hidden [M, H] fp32 (fp16 with
    fp16 matrices and not final_fp32). attend(layer, qkv [M, (NH + 2 NKV) HD]) stores this step's
    k/v and returns attention [M, NH, HD].
    With fp16 matrices the norms that feed products (q|k|v, gate|up) come out rounded to fp16, as
    the products would round them (half the bytes that each output tile re-reads); the final one
    too unless final_fp32 (for a caller that feeds it to an fp16 head only); and with an fp16 down
    projection the MLP's inner row is fp16 times 2^-ops.MLP_SHIFT. Each norm's dtype
    follows the matrices and the call site, never B (see ops.rms_norm)."""
    cfg = sp.cfg
    m, eps = x.shape[0], cfg.rms_norm_eps
    norm_dtype = torch.float16 if sp.wqkv[0].dtype == torch.float16 == sp.gate[0].dtype else torch.float32
    down16 = sp.down[0].dtype == torch.float16
    h = ops.rms_norm(x, sp.in_norm[0], eps, norm_dtype)
    for i in range(cfg.num_layers):
        att = attend(i, ops.linear(h, sp.wqkv[i]))
        x, h = glue.add_rms(x, ops.linear_parts(att.reshape(m, sp.q_dim), sp.wo[i]), sp.post_norm[i], eps, norm_dtype)
        last = i + 1 == cfg.num_layers
        nxt = sp.final_norm if last else sp.in_norm[i + 1]
        # with an fp16 down projection the MLP's inner row is fp16, scaled into its range (ops.MLP_SHIFT)
        inner = ops.swiglu(h, sp.gate[i], sp.up[i], torch.float16 if down16 else torch.float32)
        down = ops.linear_parts(inner, sp.down[i], ops.MLP_SHIFT if down16 else 0)
        x, h = glue.add_rms(x, down, nxt, eps, torch.float32 if last and final_fp32 else norm_dtype)
    return h


def o_input_dtype(sp: StackParams) -> torch.dtype:
    """The attention output's dtype: fp16 (rounded once, as the product would) when o_proj's
    matrices are fp16, for half the bytes that its output tiles re-read; else fp32."""
    return torch.float16 if sp.wo[0].dtype == torch.float16 else torch.float32


def paged_attend(sp: StackParams, cos, sin, k_pools, v_pools, blk, off, table, lens) -> Callable:
    """attend() over a paged pool: q/k norm + RoPE + k/v store at pool[blk[m], :, off[m]] (glue),
    then ops.paged_attention over table / lens."""
    cfg = sp.cfg
    nh, nkv, eps, scale = cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps, cfg.head_dim ** -0.5
    out_dtype = o_input_dtype(sp)

    def attend(i, qkv):
        q = glue.qk_rope_store(qkv, sp.q_norm[i], sp.k_norm[i], cos, sin, k_pools[i], v_pools[i], blk, off,
                               nh, nkv, eps)
        return ops.paged_attention(q, k_pools[i], v_pools[i], table, lens, scale, out_dtype)
    return attend


def _bits_differ(pairs) -> tuple[str, str] | None:
    """The first (name, got, want) whose bits differ: (name, "n of N values"), or None."""
    for name, a, b in pairs:
        same = a.view(torch.int16 if a.element_size() == 2 else torch.int32) == \
            b.view(torch.int16 if b.element_size() == 2 else torch.int32)
        if not bool(same.all()):
            return name, f"{int((~same).sum())} of {same.numel()} values"
    return None


class FrameStep:
    """Callable over a row list: `step(rows [B] long)` advances those slots one frame and writes
    out[:B] [B, 18] int32 (and dump[:B] [B, 16, V] fp32 logits when dumping). The same in two
    halves: `predict(rows)` makes the frame's 16 codes (all the audio needs), `advance(rows)` the
    talker step for the next frame; the engine replays them as two graphs so that the codes reach
    the host, and the codec, while the talker step still runs."""

    def __init__(self, params: FrameParams, state: SlotState, kv: PagedKV, max_rows: int,
                 dump_logits: bool = False, fused_cp: bool = True):
        self.p, self.s, self.kv = params, state, kv
        self.fused_cp = fused_cp  # each code-predictor pass's attention in one glue launch per layer
        cp = params.predictor.cfg
        dev = state.ints.device
        g = params.ids.num_code_groups
        assert g - 1 == TALKER_BAD_BIT, "the out buffer's error bits assume 16 code groups"
        shape = (cp.num_layers, max_rows, cp.num_kv_heads, g, cp.head_dim)
        self.cp_k = torch.zeros(shape, dtype=torch.float32, device=dev)  # row b = scratch "block" b
        self.cp_v = torch.zeros(shape, dtype=torch.float32, device=dev)
        cos, sin = rope_cos_sin(torch.arange(g, device=dev)[None], cp, torch.float32)
        self.cp_cos, self.cp_sin = cos[0], sin[0]  # [G, HD]
        self.out = torch.zeros(max_rows, g + 2, dtype=torch.int32, device=dev)
        vmax = max(params.ids.vocab_size, params.ids.predictor_vocab_size)
        self.dump = torch.zeros(max_rows, g, vmax, dtype=torch.float32, device=dev) if dump_logits else None
        self._consts: dict[int, dict] = {}
        # the talker's RoPE rows of every position [P, 2, HD] (cos, sin), made once by rope_cos_sin
        # itself (so the same values as per frame); advance_inputs copies a step's rows
        tcfg = params.talker.cfg
        cos, sin = rope_cos_sin(torch.arange(kv.max_blocks * kv.block_size, device=dev)[None], tcfg, torch.float32)
        self.rope = torch.stack((cos[0], sin[0]), 1).contiguous()
        # passes 2..15 of steps of one stream through the small-batch kernel (use_small_kernel)
        self.small: small_kernel.SmallKernel | None = None
        self.small_h = torch.zeros(small_kernel.MAX_ROWS, cp.hidden_size, dtype=torch.float16, device=dev)
        # the talker's layers of steps of one stream through the kernel's talker variant (use_talker_kernel)
        self.talker_k: small_kernel.TalkerKernel | None = None
        # the draws' Gumbel noise of frames of up to NOISE_ROWS streams, made at the frame's start
        # (ops.frame_noise) and loaded by each draw before its PDL wait: [:, 0] the talker's draw,
        # [:, k + 1] pass k's, over the draws' BLOCK_V ids
        self.nv0 = triton.next_power_of_2(params.codec_head.shape[0])
        self.nv = triton.next_power_of_2(max(h.shape[0] for h in params.predictor_heads))
        rows_n = noise_rows(max_rows)
        self.noise = torch.empty(rows_n, params.num_passes + 1, max(self.nv0, self.nv), dtype=torch.float64,
                                 device=dev) if rows_n > 0 and ops.draws_in_triton(state.ints) else None

    def use_talker_kernel(self, kernel: small_kernel.TalkerKernel) -> str | None:
        """Serve the talker's layers of steps of one stream with `kernel` if it gives this frame's
        bits here (None); else leave the graphs alone and say why. Checked bitwise (the hidden
        state and the pages written) against the launches it replaces at positions that end, fill
        and cross a split (64 positions), over pool blocks 1..3 filled at random and zeroed after
        (called before any stream is admitted: no block is in use)."""
        dev, kv = self.out.device, self.kv
        pages = min(3, kv.max_blocks, kv.k.shape[1] - 1)
        if pages < 1:
            return "the pool has no block to check it in"
        gen = torch.Generator(device=dev).manual_seed(4321)
        hcfg = self.p.talker.cfg
        table = torch.zeros(1, kv.max_blocks, dtype=torch.int32, device=dev)
        table[0, :pages] = torch.arange(1, pages + 1, dtype=torch.int32, device=dev)
        self.talker_k = None  # (the reference: the launches)
        try:
            for pos in sorted({1, 63, 64, 130, 64 * pages - 1} & set(range(1, 64 * pages))):
                kv.k[:, 1:pages + 1].normal_(generator=gen)
                kv.v[:, 1:pages + 1].normal_(generator=gen)
                before = kv.k[:, 1:pages + 1].clone(), kv.v[:, 1:pages + 1].clone()
                x = torch.randn(1, hcfg.hidden_size, device=dev, generator=gen)
                cos, sin = self.rope[pos, 0][None].contiguous(), self.rope[pos, 1][None].contiguous()
                blk = table[:, pos // kv.block_size].long()
                off = torch.full((1,), pos % kv.block_size, dtype=torch.long, device=dev)
                lens = torch.full((1,), pos + 1, dtype=torch.int32, device=dev)
                ref = self._talker(x, cos, sin, table, blk, off, lens).clone()
                ref_kv = kv.k[:, 1:pages + 1].clone(), kv.v[:, 1:pages + 1].clone()
                kv.k[:, 1:pages + 1], kv.v[:, 1:pages + 1] = before
                got = self._talker1(kernel, x, cos, sin, table, lens)
                diff = _bits_differ((("hidden", got, ref), ("K pages", kv.k[:, 1:pages + 1], ref_kv[0]),
                                     ("V pages", kv.v[:, 1:pages + 1], ref_kv[1])))
                if diff:
                    return f"its {diff[0]} differ from the graphs' at position {pos} ({diff[1]})"
        finally:
            kv.k[:, :pages + 1].zero_()
            kv.v[:, :pages + 1].zero_()
        self.talker_k = kernel
        return None

    def _talker1(self, kernel: small_kernel.TalkerKernel, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 table: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """`_talker` for one row by the kernel's launch, then the final norm (glue.add_rms, fp32 out:
        the graphs' last add_rms over the kernel's down sum, the same bits)."""
        x_out, d_out = kernel(x, table[0], lens, cos[0], sin[0])
        sp = self.p.talker
        return glue.add_rms(x_out, d_out[None], sp.final_norm, sp.cfg.rms_norm_eps, torch.float32)[1]

    def use_small_kernel(self, kernel: small_kernel.SmallKernel) -> str | None:
        """Serve passes 2..15 of steps of up to small_kernel.SERVE_ROWS streams with `kernel` if
        it gives this frame's bits here (None); else leave the graphs alone and say why. Checked
        bitwise at those row counts and every position against the launches it replaces (the
        frame's code-predictor cache is scratch: nothing lives in it between frames)."""
        dev = self.out.device
        gen = torch.Generator(device=dev).manual_seed(1234)
        table = self.p.predictor_embedding_stack[0]
        self.small = None  # (the reference: the launches)
        try:
            for m in range(1, small_kernel.SERVE_ROWS + 1):
                for k in range(1, self.p.num_passes):
                    ids = torch.randint(0, table.shape[0], (m,), device=dev, generator=gen)
                    x = self._cp_in(table[ids].float())
                    self.cp_k[:, :m].normal_(generator=gen)
                    self.cp_v[:, :m].normal_(generator=gen)
                    kv = self.cp_k[:, :m].clone(), self.cp_v[:, :m].clone()
                    ref = self._cp_stack(k, m, x, False).clone()
                    ref_kv = self.cp_k[:, :m].clone(), self.cp_v[:, :m].clone()
                    self.cp_k[:, :m], self.cp_v[:, :m] = kv
                    got = self._small_pass(kernel, k, m, x).clone()
                    diff = _bits_differ((("hidden", got, ref), ("K cache", self.cp_k[:, :m], ref_kv[0]),
                                         ("V cache", self.cp_v[:, :m], ref_kv[1])))
                    if diff:
                        return f"its {diff[0]} differs from the graphs' at {m} row(s), pass {k + 1} ({diff[1]})"
        finally:
            self.cp_k.zero_()
            self.cp_v.zero_()
        self.small = kernel
        return None

    @staticmethod
    def scratch_bytes(params_cp_layers: int, cp_kv_heads: int, cp_head_dim: int, groups: int,
                      max_rows: int, vocab: int = 0) -> int:
        """The code-predictor cache, out, and (vocab: the larger vocabulary) the draws' noise rows."""
        noise = noise_rows(max_rows) * groups * triton.next_power_of_2(vocab) * 8 if vocab else 0
        return (2 * params_cp_layers * max_rows * cp_kv_heads * groups * cp_head_dim * 4 + max_rows * (groups + 2) * 4
                + noise)

    def consts(self, b: int) -> dict:
        """Per-B index tensors of the code-predictor attention (made once, outside any capture)."""
        if b not in self._consts:
            dev = self.out.device
            rows = torch.arange(b, dtype=torch.int32, device=dev)
            self._consts[b] = dict(
                table0=rows.repeat_interleave(2)[:, None].contiguous(),  # [2B, 1]: both queries read block b
                lens0=torch.tensor([1, 2], dtype=torch.int32, device=dev).repeat(b),  # causal: 1, 2 keys
                cos0=self.cp_cos[:2].repeat(b, 1), sin0=self.cp_sin[:2].repeat(b, 1),
                blk0=torch.arange(b, device=dev).repeat_interleave(2), off0=torch.tensor([0, 1], device=dev).repeat(b),
                table=rows[:, None].contiguous(), blk=torch.arange(b, device=dev),
                lens=[torch.full((b,), k + 2, dtype=torch.int32, device=dev) for k in range(self.p.num_passes)],
                off=[torch.full((b,), k + 1, device=dev) for k in range(self.p.num_passes)])
        return self._consts[b]

    def _cp_in(self, x: torch.Tensor) -> torch.Tensor:
        if self.p.in_proj is None:
            return x
        return ops.linear(x, self.p.in_proj[0]) + self.p.in_proj[1]

    def _cp_stack(self, k: int, b: int, x: torch.Tensor, final_fp32: bool) -> torch.Tensor:
        """Pass k's layers for b streams over its input rows x ([2B, Hp] at pass 0, else [B, Hp])
        -> the final-normed hidden: the small-batch kernel's launch (passes 2..15, b <= SERVE_ROWS,
        when use_small_kernel took it) or the layers' launches."""
        first = k == 0
        if not first and self.small is not None and b <= small_kernel.SERVE_ROWS and not final_fp32:
            return self._small_pass(self.small, k, b, x)
        p, c = self.p, self.consts(b)
        sp = p.predictor
        cfg = sp.cfg
        scale = cfg.head_dim ** -0.5
        att_dtype = o_input_dtype(sp)
        cos, sin = (c["cos0"], c["sin0"]) if first else (self.cp_cos[k + 1:k + 2], self.cp_sin[k + 1:k + 2])
        if first and self.fused_cp:  # positions 0 and 1: two query rows per stream, one launch per layer
            attend = (lambda i, qkv: glue.cp_attend0(
                qkv, sp.q_norm[i], sp.k_norm[i], self.cp_cos, self.cp_sin, self.cp_k[i], self.cp_v[i],
                cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps, scale, att_dtype))
        elif first:
            attend = paged_attend(sp, cos, sin, self.cp_k, self.cp_v, c["blk0"], c["off0"], c["table0"], c["lens0"])
        elif not self.fused_cp:
            attend = paged_attend(sp, cos, sin, self.cp_k, self.cp_v, c["blk"], c["off"][k], c["table"], c["lens"][k])
        else:  # one new position per stream: norm + RoPE + store + attention in one launch
            attend = (lambda i, qkv: glue.cp_attend(
                qkv, sp.q_norm[i], sp.k_norm[i], cos, sin, self.cp_k[i], self.cp_v[i], k + 1, cfg.num_heads,
                cfg.num_kv_heads, cfg.rms_norm_eps, scale, att_dtype))
        return stack_forward(x, sp, attend, final_fp32=final_fp32)

    def _small_pass(self, kernel: small_kernel.SmallKernel, k: int, b: int, x: torch.Tensor) -> torch.Tensor:
        """Pass k (>= 1) of b streams through `kernel`, its first norm included -> the final-normed
        hidden [b, Hp] fp16 (small_h's rows)."""
        out = self.small_h[:b]
        kernel(x.contiguous(), None, out, k + 1, self.cp_cos[k + 1], self.cp_sin[k + 1])
        return out

    def _predict(self, b: int, x0: torch.Tensor, draw: tuple) -> None:
        """x0 [2B, H]: each stream's first-pass rows (positions 0, 1); draw: the streams' sampling
        settings (do_sample, temperature, top_k, top_p, seed, counter; [B] each). The 15 passes'
        codes go to out[:B, 1:16] and their error bits (pass k: bit k) into out[:B, 17]."""
        p = self.p
        err = p.ids.num_code_groups + 1
        noise = self._noise(b)
        x = self._cp_in(x0)  # [2B, Hp]
        for k in range(p.num_passes):
            first = k == 0
            # the final norm goes to the head only: fp16 when the head's matrix is
            h = self._cp_stack(k, b, x, p.predictor_heads[k].dtype != torch.float16)
            hk, head = h.view(b, 2, -1)[:, 1].contiguous() if first else h, p.predictor_heads[k]
            parts = ops.linear_parts(hk, head)  # the sampler adds them, in `linear`'s order
            if self.dump is not None:
                self.dump[:b, k, :head.shape[0]] = ops.linear(hk, head)
            more = k + 1 < p.num_passes
            # the draw into out (code, error bit), and with it the next pass's input row: the
            # drawn code's embedding
            # (early: predict_inputs wrote the draw's settings, launches before the head)
            drawn = ops.sample_tokens(parts, *draw, k + 1, p.predictor_embedding_stack[k] if more else None,
                                      into=(self.out, k + 1, err, k), early=True,
                                      noise=None if noise is None else noise[:, k + 1])
            if more:
                x = self._cp_in(drawn[2])

    def _talker(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, table: torch.Tensor, blk: torch.Tensor,
                off: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """x [B, H] fp32 with its positions' RoPE rows cos/sin [B, HD], over the slots' block tables
        [B, MAX_BLOCKS] (the new K/V at block blk [B], offset off [B]; lens = position + 1) ->
        final-normed hidden [B, H]."""
        sp, kv = self.p.talker, self.kv
        return stack_forward(x, sp, paged_attend(sp, cos, sin, kv.k, kv.v, blk, off, table, lens))

    def __call__(self, rows: torch.Tensor) -> None:
        self.predict(rows)
        self.advance(rows)

    def predict(self, rows: torch.Tensor) -> None:
        """The frame's first half: the 15 code-predictor passes -> out[:B, :16] (code 0, codes
        1..15) and out[:B, 17] (their error bits). The state is not changed: `advance` follows."""
        s, b = self.s, rows.shape[0]
        # one launch: the slots' sampling settings, code 0 into out, the first pass's rows
        ig, fg, seed, counter, x0 = glue.predict_inputs(
            rows, s.ints, s.floats, s.seed, s.past_hidden, self.p.codec_embedding, self.out,
            (SUB_DO_SAMPLE, SUB_TOP_K), (SUB_TEMPERATURE, SUB_TOP_P), CODE0, N_SAMPLED,
            self.p.ids.num_code_groups + 1)
        if self._noise(b) is not None:  # (advance, after predict of the same rows, uses it too)
            ops.frame_noise(rows, s.seed, s.ints, N_SAMPLED, self.noise, self.nv0, self.nv)
        self._predict(b, x0, (ig[0], fg[0], ig[1], fg[1], seed, counter))

    def _noise(self, b: int) -> torch.Tensor | None:
        """The draws' noise rows of a frame of b streams ([b, passes + 1, ids]), or None: each draw
        makes its own."""
        return self.noise[:b] if self.noise is not None and b <= self.noise.shape[0] else None

    def advance(self, rows: torch.Tensor) -> None:
        """The frame's second half, after `predict` of the same rows: the talker step over this
        frame's codes (out[:B, :16]) -> the next code 0 in out[:B, 16], its error bit added to
        out[:B, 17]; then the state commit."""
        p, s, kv = self.p, self.s, self.kv
        ids = p.ids
        b, g = rows.shape[0], ids.num_code_groups
        # one launch: the slots' settings, the input row (code 0's embedding + this frame's codes
        # 1..15 + the text track), the KV addresses and RoPE rows of the new position
        ig, fg, seed, counter, gate, x, table, blk, off, lens, cos, sin = glue.advance_inputs(
            rows, s.ints, s.floats, s.seed, p.codec_embedding, p.predictor_embedding_stack, self.out[:b, 1:g],
            s.trailing, s.pad_embed, kv.table, kv.block_size, self.rope, (DO_SAMPLE, TOP_K),
            (TEMPERATURE, TOP_P, PENALTY), (POS, CODE0, N_SAMPLED, TEXT_STEP, N_TRAILING, EOS_FROM))
        if self.talker_k is not None and b == 1:
            hidden = self._talker1(self.talker_k, x, cos, sin, table, lens)
        else:
            hidden = self._talker(x, cos, sin, table, blk, off, lens)
        logits = ops.linear(hidden, p.codec_head)  # [B, V]
        if self.dump is not None:
            self.dump[:b, g - 1, :logits.shape[1]] = logits
        ops.talker_process_(logits, s.seen, fg[2], gate, ids.eos, ids.suppress_start, ids.min_new_tokens, rows)
        # the draw also writes out[:B, 16] and the talker's error bit (15) into out[:B, 17]; the
        # draw index: prefill drew 0, frame f draws f + 1 (early: advance_inputs wrote its
        # settings, launches before the head)
        noise = self._noise(b)
        nxt, _ = ops.sample_tokens(logits, ig[0], fg[0], ig[1], fg[1], seed, counter, 0,
                                   into=(self.out, g, g + 1, TALKER_BAD_BIT), early=True,
                                   noise=None if noise is None else noise[:, 0])
        # commit (padding rows all point at the scratch slot, whose step fields stay 0)
        glue.advance_commit(rows, nxt, hidden, s.ints, s.past_hidden, s.seen, s.scratch,
                            (POS, CODE0, N_SAMPLED, TEXT_STEP))
