#!/usr/bin/env python
"""Megakernel evidence on a CUDA device: correctness against an fp32 reference and benchmarks.

  python scripts/bench_kernel.py --bench            # copy GB/s, talker / CP / frame µs, torch ratio
  python scripts/bench_kernel.py --check            # teacher-forced logits + greedy parity
  python scripts/bench_kernel.py --sanitize-frame   # one frame on random weights (compute-sanitizer)

The model is the full-size synthetic Qwen3-TTS 0.6B (seeded random weights through the qwen-tts
classes, exactly the weights of build_synthetic(SYNTHETIC_NAMES["synthetic"])) in bf16;
`--model random` uses plain random tensors of the same shapes (no qwen-tts needed).
Results go to --out (JSON) and a short table is printed last.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import fields, is_dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tts_server.engines.contract import Prompt, SamplingConfig, decode_until_eos  # noqa: E402
from tts_server.testing.audio_stubs import stub_audio_modules  # noqa: E402,F401 (kernel_variants.sh)
from tts_server.model.weights import (CodecIds, DecodeWeights, LayerWeights, LMConfig,  # noqa: E402
                                      LMWeights, decode_weights)


def stack_bytes(L, layers: int, vocab: int) -> int:
    """bf16 weight bytes one pass of a stack reads (csrc layout L): per layer q|k|v, o_proj,
    gate/up/down and four norms, then the final norm and the head."""
    per_layer = L.QKV * L.H + L.H * L.QD + 3 * L.I * L.H + 2 * L.H + 2 * L.HD
    return (layers * per_layer + L.H + vocab * L.H) * 2



def synthetic_weights(name: str = "synthetic", device: str = "cuda") -> DecodeWeights:
    """The decode weights of build_synthetic(SYNTHETIC_NAMES[name]) in bf16 on `device` (same seed
    and construction order, without the tokenizer and the speech codec)."""
    stub_audio_modules()
    from tts_server.model.synthetic import SYNTHETIC_NAMES, build_tts_model

    model = build_tts_model(SYNTHETIC_NAMES[name])
    model.talker.model.text_embedding = None  # 311 M params the decode loop never reads
    model = model.to(device=device, dtype=torch.bfloat16).eval()
    return decode_weights(model)


def random_weights(device: str = "cuda", seed: int = 0) -> DecodeWeights:
    """Seeded random tensors with the 0.6B decode shapes (no qwen-tts needed)."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def t(*shape, std=0.02, mean=0.0):
        return (torch.randn(*shape, generator=g) * std + mean).to(device, torch.bfloat16)

    def lm(n):
        cfg = LMConfig(n, 1024, 16, 8, 128, 3072, 1e-6, 1e6)
        layers = tuple(LayerWeights(t(1024, std=0.1, mean=1), t(2048, 1024), t(1024, 1024), t(1024, 1024),
                                    t(128, std=0.1, mean=1), t(128, std=0.1, mean=1), t(1024, 2048),
                                    t(1024, std=0.1, mean=1), t(3072, 1024), t(3072, 1024), t(1024, 3072))
                       for _ in range(n))
        return LMWeights(cfg, layers, t(1024, std=0.1, mean=1))

    ids = CodecIds(vocab_size=3072, eos=2150, pad=2148, bos=2149, suppress_start=2048,
                   num_code_groups=16, predictor_vocab_size=2048)
    return DecodeWeights(lm(28), t(3072, 1024), t(3072, 1024), lm(5),
                         tuple(t(2048, 1024) for _ in range(15)), tuple(t(2048, 1024) for _ in range(15)),
                         None, ids)


def to_fp32(obj):
    """Deep copy of a weights dataclass with every tensor in fp32."""
    if isinstance(obj, torch.Tensor):
        return obj.float()
    if isinstance(obj, tuple):
        return tuple(to_fp32(o) for o in obj)
    if is_dataclass(obj):
        return replace(obj, **{f.name: to_fp32(getattr(obj, f.name)) for f in fields(obj)})
    return obj


def make_prompt(seed: int, length: int = 12, n_trailing: int = 8, device: str = "cuda",
                hidden: int = 1024) -> Prompt:
    g = torch.Generator(device="cpu").manual_seed(1000 + seed)
    r = lambda *s: (torch.randn(*s, generator=g) * 0.02).to(device, torch.bfloat16)  # noqa: E731
    return Prompt(embeds=r(length, hidden), trailing=r(n_trailing, hidden), pad_embed=r(hidden))


def talker_processed(logits: torch.Tensor, seen: set[int], n_sampled: int, ids: CodecIds,
                     penalty: float) -> torch.Tensor:
    """HF talker processors on fp32 logits (penalty, EOS min-new-tokens mask, suppression)."""
    from tts_server.model.sampler import repetition_penalty_, talker_mask_

    out = logits.float().clone()
    mask = torch.zeros_like(out, dtype=torch.bool)
    mask[list(seen)] = True
    repetition_penalty_(out, mask, penalty)
    talker_mask_(out, n_sampled, ids.eos, ids.suppress_start, ids.min_new_tokens)
    return out


class Fp32Reference:
    """The same math in fp32 (lm.lm_forward over fp32 copies of the bf16 weights), teacher forced
    with the kernel's codes: returns each pass's logits. dtype=bfloat16 gives the qwen-tts bf16
    computation (rounding where the bf16 model rounds) for the bf16-vs-fp32 comparison."""

    def __init__(self, w: DecodeWeights, max_positions: int, dtype: torch.dtype = torch.float32):
        from tts_server.model.lm import KVCache

        self.w = to_fp32(w) if dtype == torch.float32 else w
        self.dtype = dtype
        dev = w.codec_head.device
        self.cache = KVCache(self.w.talker.config, 1, max_positions, dtype, dev)
        self.cp_cache = KVCache(self.w.predictor.config, 1, 16, dtype, dev)
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)
        self.dev = dev

    @torch.inference_mode()
    def prefill(self, prompt: Prompt) -> torch.Tensor:
        from tts_server.model.lm import lm_forward

        n = prompt.embeds.shape[0]
        pos = torch.arange(n, device=self.dev)[None]
        x = prompt.embeds.to(self.dtype)[None]
        self.past = lm_forward(self.w.talker, x, self.cache, self.slot, pos)[0, -1]
        self.pos = n
        return F.linear(self.past, self.w.codec_head).float()

    @torch.inference_mode()
    def frame(self, codes, text: torch.Tensor):
        """codes [16] of this frame -> (cp logits [15, 2048], talker logits [3072])."""
        from tts_server.model.lm import lm_forward

        w = self.w
        codes = [int(c) for c in codes]
        x = torch.stack((self.past, w.codec_embedding[codes[0]]))[None]
        cp = []
        for k in range(15):
            start = 0 if k == 0 else k + 1
            pos = torch.arange(start, start + x.shape[1], device=self.dev)[None]
            h = lm_forward(w.predictor, x, self.cp_cache, self.slot, pos)[0, -1]
            cp.append(F.linear(h, w.predictor_heads[k]))
            x = w.predictor_embeddings[k][codes[k + 1]][None, None]
        rows = [w.codec_embedding[codes[0]]] + [w.predictor_embeddings[k][codes[k + 1]] for k in range(15)]
        e = (torch.stack(rows).sum(0) + text.to(self.dtype))[None, None]  # qwen-tts: cat(...).sum(1) + text
        pos = torch.tensor([[self.pos]], device=self.dev)
        self.past = lm_forward(w.talker, e, self.cache, self.slot, pos)[0, 0]
        self.pos += 1
        return torch.stack(cp).float(), F.linear(self.past, w.codec_head).float()


def teacher_forced(w: DecodeWeights, frames: int, seed: int = 0, greedy: bool = False,
                   precision: str = "fp32", bf16_torch: bool = False, length: int = 12) -> dict:
    """Kernel frames (sampling, seeded) vs the fp32 reference fed the kernel's codes, from a
    prompt of `length` positions. With bf16_torch, the qwen-tts bf16 computation is measured
    against the same fp32 reference too."""
    from tts_server.engines.megakernel import MegakernelEngine

    torch.backends.cuda.matmul.allow_tf32 = False
    prompt = make_prompt(seed, length=length, n_trailing=8)
    eng = MegakernelEngine(w, max_streams=1, max_positions=length + frames + 64, dump_logits=True, precision=precision)
    ref = Fp32Reference(w, length + frames + 64)
    r16 = Fp32Reference(w, length + frames + 64, torch.bfloat16) if bf16_torch else None
    t16_err = []
    s = SamplingConfig(do_sample=not greedy, subtalker_do_sample=not greedy, seed=seed)
    eng.prefill(0, prompt, s)
    ref.prefill(prompt)
    if r16 is not None:
        r16.prefill(prompt)
    seen = {int(eng.code0[0])}
    cp_err, cp_top1, t_err, t_top1 = [], [], [], []
    for f in range(frames):
        res = eng.step([0])[0]
        kl = eng.dump.clone()
        text = prompt.trailing[f] if f < prompt.trailing.shape[0] else prompt.pad_embed
        rcp, rt = ref.frame(res.codes, text)
        if r16 is not None:
            bcp, bt = r16.frame(res.codes, text)
            t16_err += ((bcp - rcp).norm(dim=1) / rcp.norm(dim=1)).tolist() + [float((bt - rt).norm() / rt.norm())]
        kcp = kl[:15, :2048]
        cp_err += ((kcp - rcp).norm(dim=1) / rcp.norm(dim=1)).tolist()
        cp_top1 += (kcp.argmax(1) == rcp.argmax(1)).tolist()
        if f == 0:
            first = ((kcp - rcp).norm(dim=1) / rcp.norm(dim=1)).tolist() + [float((kl[15] - rt).norm() / rt.norm())]
            print("frame 0 rel err per pass:", [f"{e:.2e}" for e in first], flush=True)
        t_err.append(float((kl[15] - rt).norm() / rt.norm()))
        kp = talker_processed(kl[15], seen, f + 1, w.ids, s.repetition_penalty)
        rp = talker_processed(rt, seen, f + 1, w.ids, s.repetition_penalty)
        t_top1.append(bool(kp.argmax() == rp.argmax()))
        seen.add(int(eng.out[0, 16]))
        if res.next_is_eos:
            break
    allerr = np.array(cp_err + t_err)
    extra = {}
    if t16_err:
        e = np.array(t16_err)
        extra = dict(torch_bf16_rel_err_median=float(np.median(e)), torch_bf16_rel_err_max=float(e.max()))
    return dict(precision=precision, frames=len(t_err), **extra, steps=len(allerr), rel_err_median=float(np.median(allerr)),
                rel_err_p99=float(np.quantile(allerr, 0.99)), rel_err_max=float(allerr.max()),
                cp_rel_err_max=float(max(cp_err)), talker_rel_err_max=float(max(t_err)),
                top1=float(np.mean(cp_top1 + t_top1)), cp_top1=float(np.mean(cp_top1)),
                talker_top1=float(np.mean(t_top1)))


def greedy_e2e(w: DecodeWeights, prompts: int, frames: int, precision: str = "fp32") -> dict:
    """Greedy codes of the megakernel vs the PyTorch reference engine (TorchEngine) run over fp32
    copies of the weights (precision fp32) or over the bf16 weights (precision bf16)."""
    from tts_server.engines.megakernel import MegakernelEngine
    from tts_server.engines.torch_ref import TorchEngine

    torch.backends.cuda.matmul.allow_tf32 = False
    wref = to_fp32(w) if precision == "fp32" else w
    s = SamplingConfig(do_sample=False, subtalker_do_sample=False)
    out = []
    for p in range(prompts):
        prompt = make_prompt(100 + p, n_trailing=10)
        runs = []
        for eng in (MegakernelEngine(w, max_streams=1, max_positions=frames + 64, precision=precision),
                    TorchEngine(wref, max_streams=1, max_positions=frames + 64)):
            eng.prefill(0, prompt, s)
            runs.append(decode_until_eos(eng, 0, frames))
            del eng
        a, b = runs
        n = min(len(a), len(b))
        same = (a[:n] == b[:n]).all(1)
        first_diff = int(np.argmin(same)) if not same.all() else n
        out.append(dict(prompt=p, frames=n, identical_frames=first_diff, all_identical=bool(same.all())))
    del wref
    return dict(precision=precision, prompts=out)


def sampling_repro(w: DecodeWeights, frames: int = 8) -> dict:
    """Same seed -> same codes; another seed -> different codes; sampling rules hold."""
    from tts_server.engines.megakernel import MegakernelEngine

    eng = MegakernelEngine(w, max_streams=3, max_positions=256)
    prompt = make_prompt(7)
    for slot, seed in ((0, 1), (1, 1), (2, 2)):
        eng.prefill(slot, prompt, SamplingConfig(seed=seed))
    codes = {0: [], 1: [], 2: []}
    for _ in range(frames):
        for r in eng.step([0, 1, 2]):
            codes[r.slot].append(r.codes)
    c = {k: np.stack(v) for k, v in codes.items()}
    ok_range = bool((c[0][:, 1:] < 2048).all() and ((c[0][:, 0] < 2048) | (c[0][:, 0] == 2150)).all())
    return dict(same_seed_identical=bool((c[0] == c[1]).all()), other_seed_differs=bool((c[0] != c[2]).any()),
                codes_in_range=ok_range, first_two_not_eos=bool((c[0][:2, 0] != 2150).all()))


def copy_gbps(nbytes: int = 2 << 30) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    ts = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    return 2 * nbytes / float(np.median(ts)) / 1e9


def time_us(fn, iters: int = 50, warm: int = 5) -> float:
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(iters):
        e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3)
    return float(np.median(ts))


def time_frame(eng, ctx: int, greedy_iters: int = 20, no_topk: bool = False) -> dict:
    """Medians (µs) of one engine's launches at context `ctx`, slot 0 left unchanged (no commit):
    talker step, code-predictor pass (CP-only launch / 15), sampled frame, greedy frame and, with
    no_topk, a sampled frame without the top-k select."""
    L = eng.L
    nc = L.FLAG_NO_COMMIT
    eng.prefill(0, make_prompt(5, length=ctx), SamplingConfig(seed=3))
    r = dict(talker_us=time_us(lambda: eng.launch(0, L.FLAG_TALKER_ONLY | nc)),
             cp_pass_us=time_us(lambda: eng.launch(0, L.FLAG_CP_ONLY | nc)) / (L.GROUPS - 1),
             frame_us=time_us(lambda: eng.launch(0, nc)))
    eng.prefill(0, make_prompt(5, length=ctx), SamplingConfig(do_sample=False, subtalker_do_sample=False))
    r["frame_greedy_us"] = time_us(lambda: eng.launch(0, nc), iters=greedy_iters)
    if no_topk:
        eng.prefill(0, make_prompt(5, length=ctx), SamplingConfig(seed=3, top_k=0, subtalker_top_k=0))
        r["frame_no_topk_us"] = time_us(lambda: eng.launch(0, nc), iters=greedy_iters)
    if eng.kernel_error():
        raise RuntimeError(f"kernel error {eng.kernel_error()}")
    return r


def barrier_us(eng) -> float:
    """One grid barrier (arrive + wait) of the engine's grid, from a launch of 1000 of them."""
    return time_us(lambda: eng.launch(0, eng.L.FLAG_BARRIER_BENCH), iters=10) / eng.L.BARRIER_BENCH_N


def bench(w: DecodeWeights, contexts=(100, 1000), torch_frames: int = 12) -> dict:
    from tts_server.engines import megakernel as mk
    from tts_server.engines.torch_ref import TorchEngine

    res = dict(copy_gbps=copy_gbps())
    for kv in (torch.float32, torch.bfloat16):
        eng = mk.MegakernelEngine(w, max_streams=1, max_positions=max(contexts) + 64, kv_dtype=kv)
        res["blocks"] = eng.blocks
        res["barrier_us"] = barrier_us(eng)
        L = eng.L
        kv_pos = L.TALKER_LAYERS * L.KVD * 2 * kv.itemsize
        talker_bytes, cp_pass_bytes = stack_bytes(L, L.TALKER_LAYERS, L.VT), stack_bytes(L, L.CP_LAYERS, L.VC)
        for ctx in contexts:
            t = time_frame(eng, ctx)
            gbs = (talker_bytes + ctx * kv_pos) / (t["talker_us"] * 1e-6) / 1e9
            key = f"ctx{ctx}" + ("" if kv == torch.float32 else "_kvbf16")
            res[key] = dict(t, talker_gbps=gbs, talker_frac_copy=gbs / res["copy_gbps"],
                            cp_gbps=cp_pass_bytes / (t["cp_pass_us"] * 1e-6) / 1e9)
        del eng
    ref = TorchEngine(w, max_streams=1, max_positions=256)
    ref.prefill(0, make_prompt(5, length=100), SamplingConfig(seed=3))
    for _ in range(2):
        ref.step([0])
    ts = []
    for _ in range(torch_frames):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ref.step([0])
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e6)
    res["torch_frame_us_ctx100"] = float(np.median(ts))
    res["ratio_ctx100"] = res["torch_frame_us_ctx100"] / res["ctx100"]["frame_us"]
    return res


def trace_labels(L) -> list[tuple[str, str]]:
    """(stack, phase) of each trace row of one sampled frame after the first, from the library's
    phase table (csrc/ops/schedule.cuh: a layer's phases, then the head; the CP's layers skip the
    talker-only split-K phase P2). A row runs from one phase's end to the next's, so it is named
    after the phase it ends with; a P1 after a head also holds the draw of the head's code
    (SAMP+P1, counted with the head's stack), and the row after the talker's head is the code-0 draw (END)."""
    *layer, head = L.phases
    seq = []
    for stack, layers in [("cp", L.CP_LAYERS)] * (L.GROUPS - 1) + [("talker", L.TALKER_LAYERS)]:
        names = [n for n, talker_only in layer if stack == "talker" or not talker_only]
        seq += [(stack, n) for n in names * layers] + [(stack, head[0])]
    lab = [(pst, "SAMP+P1") if n == "P1" and prev == head[0] else (st, n) for (st, n), (pst, prev) in zip(seq[1:], seq)]
    return lab + [("talker", "END")]


def trace_frame(w: DecodeWeights, lib: str, ctx: int = 100, greedy: bool = False) -> dict:
    """A QMK_TRACE build: cycle stamps of blocks 0, G/2, G-1 in every phase of one frame -> per
    phase type, mean µs of: issue (barrier arrive -> start of the barrier wait; split into fence, the
    previous phase's release until its fence passed, and pre, the code before the wait), wait (barrier spin),
    busy (barrier passed -> next arrive), and inside busy: prep (activation loads, norm, prefetch
    issue), slot (waiting for the staged weights), mv (the matvec) and epi (matvec done -> arrive:
    outputs)."""
    from tts_server.engines import megakernel as mk

    prev = os.environ.get("QMK_LIB")
    os.environ["QMK_LIB"] = str(lib)
    eng = mk.MegakernelEngine(w, max_streams=1, max_positions=ctx + 64, dump_logits=True)
    s = SamplingConfig(do_sample=False, subtalker_do_sample=False) if greedy else SamplingConfig(seed=3)
    eng.prefill(0, make_prompt(5, length=ctx), s)
    L = eng.L
    frame_us = time_us(lambda: eng.launch(0, L.FLAG_NO_COMMIT), iters=10, warm=3)
    eng.dump.zero_()
    eng.launch(0, L.FLAG_NO_COMMIT)
    torch.cuda.synchronize()
    n_words = 3 * L.TRACE_EPOCHS * L.TRACE_MARKS
    tr = eng.dump.view(-1)[:n_words].view(torch.int32).cpu().numpy().astype(np.int64)
    tr = tr.reshape(3, L.TRACE_EPOCHS, L.TRACE_MARKS)
    os.environ.pop("QMK_LIB", None)
    if prev is not None:
        os.environ["QMK_LIB"] = prev
    lab = trace_labels(L)
    n = len(lab)
    res = dict(frame_us=frame_us, epochs=n)
    total_cyc = int(tr[0, n, 0]) if n < L.TRACE_EPOCHS else 0  # block 0's last phase end
    res["cycles_last_end_b0"] = total_cyc
    us_per_cyc = frame_us / total_cyc if total_cyc > 0 else float("nan")
    res["mhz_est"] = 1.0 / us_per_cyc if total_cyc else None
    parts = ("issue", "fence", "pre", "wait", "busy", "prep", "slot", "mv", "epi")
    agg: dict = {}
    for blk in range(3):
        for e in range(1, n):
            A, W, E, S0, S1, M, R = (int(v) for v in tr[blk, e])
            A1 = int(tr[blk, e + 1, 0])
            key = "/".join(lab[e - 1])
            a = agg.setdefault(key, dict(n=0, cnt={p: [0, 0, 0] for p in parts}, **{p: [0, 0, 0] for p in parts}))
            if blk == 0:
                a["n"] += 1
            vals = dict(issue=W - A, wait=E - W, busy=A1 - E)
            if W >= R >= A > 0:
                vals.update(fence=R - A, pre=W - R)
            if S0 > 0 and S1 >= S0 and M >= S1:
                vals.update(prep=S0 - E, slot=S1 - S0, mv=M - S1, epi=A1 - M)
            elif W > 0 and E >= S1 >= S0 >= W and R == 0:  # an LL poll (ops/attention.cuh): 5 = rounds
                vals.update(prep=S0 - W, slot=S1 - S0, epi=E - S1)
                a.setdefault("rounds", [0, 0, 0])[blk] += M
            for p, v in vals.items():
                a[p][blk] += v
                a["cnt"][p][blk] += 1
    out = {}
    for key, a in agg.items():
        out[key] = dict(n=a["n"], **{f"{p}_us": [round(a[p][b] / max(a["cnt"][p][b], 1) * us_per_cyc, 3)
                                                 for b in range(3)] for p in parts})
        if "rounds" in a:  # LL poll rounds (the talker's split-K phase)
            out[key]["poll_rounds"] = [round(a["rounds"][b] / max(a["cnt"]["slot"][b], 1), 2) for b in range(3)]
    res["phases"] = out
    print(f"trace {Path(lib).stem} {'greedy' if greedy else 'sampled'} (per phase type, mean µs for blocks 0, G/2, G-1):",
          flush=True)
    for key, v in out.items():
        print(f"  {key:12s} n={v['n']:3d} " + " ".join(f"{p} {v[p + '_us']}" for p in parts)
              + (f" poll_rounds {v['poll_rounds']}" if "poll_rounds" in v else ""), flush=True)
    return res


def variants(w: DecodeWeights, libs: list[str], frames: int = 16, ctx: int = 100) -> dict:
    """Build variants of the kernel (csrc/Makefile LIB=... DEFS=...) side by side: for each
    library, a short teacher-forced check (fp32 mode vs the fp32 reference) and the ctx-100
    timings (talker step, CP pass, sampled and greedy frame)."""
    from tts_server.engines import megakernel as mk

    prev = os.environ.get("QMK_LIB")
    out = {}
    for lib in [x for x in libs if "trace" in Path(x).stem]:
        try:
            out[Path(lib).stem] = trace_frame(w, lib, ctx)
            out[Path(lib).stem + "_greedy"] = trace_frame(w, lib, ctx, greedy=True)
        except Exception as e:  # noqa: BLE001
            out[Path(lib).stem] = dict(error=repr(e))
    libs = [x for x in libs if "trace" not in Path(x).stem]
    for rnd in range(2):  # two rounds: the spread between them is the noise
        for lib in libs:
            name = Path(lib).stem
            os.environ["QMK_LIB"] = str(lib)
            r = out.setdefault(name, {"lib": str(lib)})
            try:
                if rnd == 0 and frames > 0:
                    t = teacher_forced(w, frames, seed=11)
                    r.update(rel_err_max=t["rel_err_max"], top1=t["top1"])
                    # sampled codes of a few frames: identical across variants whose sampling is exact
                    e2 = mk.MegakernelEngine(w, max_streams=1, max_positions=ctx + 64)
                    e2.prefill(0, make_prompt(9, length=ctx), SamplingConfig(seed=5))
                    codes = np.stack([e2.step([0])[0].codes for _ in range(frames)])
                    r["sampled_codes_digest"] = hashlib.sha256(codes.tobytes()).hexdigest()[:16]
                    del e2
                eng = mk.MegakernelEngine(w, max_streams=1, max_positions=ctx + 64)
                r.setdefault("runs", []).append(dict(time_frame(eng, ctx, greedy_iters=30, no_topk=True),
                                                     barrier_us=barrier_us(eng)))
                del eng
            except Exception as e:  # noqa: BLE001
                r["error"] = repr(e)
            print(name, r, flush=True)
    os.environ.pop("QMK_LIB", None)
    if prev is not None:
        os.environ["QMK_LIB"] = prev
    return out


def sanitize_frame() -> None:
    """One prefill + one frame on random weights (run under compute-sanitizer)."""
    from tts_server.engines.megakernel import MegakernelEngine

    w = random_weights()
    eng = MegakernelEngine(w, max_streams=1, max_positions=128, timeout_s=120.0)
    eng.prefill(0, make_prompt(1, length=20), SamplingConfig(seed=1))
    r = eng.step([0])[0]
    torch.cuda.synchronize()
    print("sanitize frame ok:", r.codes.tolist(), r.next_is_eos, flush=True)


def env_info() -> dict:
    def sh(cmd):
        try:
            return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=30).stdout.strip()
        except Exception as e:  # noqa: BLE001
            return str(e)

    return dict(device=torch.cuda.get_device_name(), sms=torch.cuda.get_device_properties(0).multi_processor_count,
                driver=sh("nvidia-smi --query-gpu=driver_version --format=csv,noheader"),
                torch=torch.__version__,
                # QMK_COMMIT: the commit of the tree that was sent (a device copy's .git may be stale)
                commit=os.environ.get("QMK_COMMIT") or sh(f"git -C {ROOT} rev-parse --short HEAD"),
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))


def table(r: dict) -> str:
    lines = ["| metric | value |", "|---|---|"]
    b = r.get("bench")
    if b:
        lines.append(f"| device-to-device copy | {b['copy_gbps']:.0f} GB/s |")
        lines.append(f"| grid barrier ({b['blocks']} blocks) | {b['barrier_us']:.2f} µs |")
        for key, ctx in (("ctx100", 100), ("ctx1000", 1000), ("ctx100_kvbf16", "100, bf16 KV"),
                         ("ctx1000_kvbf16", "1000, bf16 KV")):
            c = b[key]
            lines += [f"| talker step, ctx {ctx} | {c['talker_us']:.1f} µs, {c['talker_gbps']:.0f} GB/s "
                      f"({100 * c['talker_frac_copy']:.0f}% of copy) |",
                      f"| code-predictor pass, ctx {ctx} | {c['cp_pass_us']:.1f} µs ({c['cp_gbps']:.0f} GB/s) |",
                      f"| whole frame, ctx {ctx} | {c['frame_us']:.1f} µs (greedy: {c['frame_greedy_us']:.1f} µs) |"]
        lines += [f"| PyTorch reference frame, ctx 100 | {b['torch_frame_us_ctx100']:.0f} µs |",
                  f"| ratio torch / megakernel, ctx 100 | {b['ratio_ctx100']:.1f}x |"]
    for key in ("teacher_forced", "teacher_forced_bf16"):
        t = r.get(key)
        if not t:
            continue
        lines += [f"| {t['precision']} mode: teacher-forced steps ({t['frames']} frames) | {t['steps']} |",
                  f"| logits rel err median / p99 / max | {t['rel_err_median']:.2e} / {t['rel_err_p99']:.2e} / "
                  f"{t['rel_err_max']:.2e} |",
                  f"| top-1 agreement (CP / talker) | {100 * t['top1']:.2f}% ({100 * t['cp_top1']:.2f}% / "
                  f"{100 * t['talker_top1']:.2f}%) |"]
        if "torch_bf16_rel_err_max" in t:
            lines.append(f"| qwen-tts bf16 torch vs fp32: rel err median / max | {t['torch_bf16_rel_err_median']:.2e} / "
                         f"{t['torch_bf16_rel_err_max']:.2e} |")
    for key in ("greedy", "greedy_bf16"):
        g = r.get(key)
        if not g:
            continue
        for p in g["prompts"]:
            lines.append(f"| {g['precision']} mode greedy vs TorchEngine {g['precision']}, prompt {p['prompt']} | "
                         f"{p['identical_frames']}/{p['frames']} frames identical |")
    for name, v in (r.get("variants") or {}).items():
        if "phases" in v or "runs" not in v and "error" not in v:
            continue
        runs = v.get("runs", [])
        t = " / ".join(f"{x['talker_us']:.0f}, {x['cp_pass_us']:.1f}, {x['frame_us']:.0f}, {x['frame_greedy_us']:.0f}"
                       for x in runs)
        lines.append(f"| variant {name}: talker, CP pass, frame, greedy frame µs (per round) | {t} | "
                     f"rel err {v.get('rel_err_max', float('nan')):.2e}, top-1 {v.get('top1', float('nan')):.4f} "
                     f"{v.get('error', '')} |")
    sr = r.get("sampling")
    if sr:
        lines.append(f"| sampling checks | {sr} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="synthetic", choices=["synthetic", "random"])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--sanitize-frame", action="store_true")
    ap.add_argument("--variants", default="", help="comma-separated kernel libraries to compare")
    ap.add_argument("--variant-frames", type=int, default=16)
    ap.add_argument("--variant-ctx", type=int, default=100, help="talker context of the --variants timings")
    ap.add_argument("--frames", type=int, default=200)
    ap.add_argument("--greedy-frames", type=int, default=40)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    if not (a.check or a.bench or a.sanitize_frame or a.variants):
        a.bench = True  # `make bench-kernel`
    if a.sanitize_frame:
        sanitize_frame()
        return
    t0 = time.time()
    w = synthetic_weights() if a.model == "synthetic" else random_weights()
    r: dict = dict(env=env_info(), model=a.model)
    print(f"weights ready in {time.time() - t0:.0f} s", flush=True)
    stages = []
    if a.variants:
        stages.append(("variants", lambda: variants(w, a.variants.split(","), a.variant_frames, a.variant_ctx)))
    if a.check:
        stages += [("teacher_forced", lambda: teacher_forced(w, a.frames)),
                   ("teacher_forced_bf16", lambda: teacher_forced(w, a.frames // 4, precision="bf16",
                                                                  bf16_torch=True)),
                   ("greedy", lambda: greedy_e2e(w, 3, a.greedy_frames)),
                   ("greedy_bf16", lambda: greedy_e2e(w, 3, a.greedy_frames, precision="bf16")),
                   ("sampling", lambda: sampling_repro(w))]
    if a.bench:
        stages.append(("bench", lambda: bench(w)))
    for name, fn in stages:
        t1 = time.time()
        try:
            r[name] = fn()
        except Exception as e:  # noqa: BLE001  (record and go on to the next stage)
            import traceback

            traceback.print_exc()
            r[name + "_error"] = repr(e)
        print(f"{name} ({time.time() - t1:.0f} s):", r.get(name, r.get(name + "_error")), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "kernel_results.json").write_text(json.dumps(r, indent=2))
    print(json.dumps(r["env"]))
    print(table(r))


if __name__ == "__main__":
    main()
