"""Evidence for the batched engine, shared by its GPU tests and scripts/gpu_batched_engine.py:
batch invariance, greedy codes vs TorchEngine, teacher-forced logits vs an fp32 reference."""

from __future__ import annotations

from dataclasses import fields, is_dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from ...api import SamplingConfig
from ...model.lm import KVCache, lm_forward
from ...model.prompt import Prompt
from ...model.weights import CodecIds, DecodeWeights, LayerWeights, LMConfig, LMWeights
from ..contract import Admission, StepPlan
from .engine import BatchedEngine

GREEDY = SamplingConfig(do_sample=False, subtalker_do_sample=False)


def bf16_rounded(obj, dtype: torch.dtype = torch.float32):
    """Deep copy of a weights dataclass / prompt with every tensor rounded to bf16 and stored in
    `dtype`: the fp32 reference computes over exactly the values the engine reads."""
    if isinstance(obj, torch.Tensor):
        return obj.to(torch.bfloat16).to(dtype)
    if isinstance(obj, tuple):
        return tuple(bf16_rounded(o, dtype) for o in obj)
    if is_dataclass(obj):
        return replace(obj, **{f.name: bf16_rounded(getattr(obj, f.name), dtype) for f in fields(obj)})
    return obj


def random_weights(device="cuda", seed: int = 0, layers: tuple[int, int] = (28, 5)) -> DecodeWeights:
    """Seeded random bf16 tensors with the 0.6B decode shapes (no qwen-tts needed): matrices
    N(0, 0.02), norm weights N(1, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    h, nh, nkv, hd, inter = 1024, 16, 8, 128, 3072

    def t(*shape, std=0.02, mean=0.0):
        return (torch.randn(*shape, generator=g) * std + mean).to(device, torch.bfloat16)

    def stack(n):
        norm = lambda d: t(d, std=0.1, mean=1.0)  # noqa: E731
        return LMWeights(LMConfig(n, h, nh, nkv, hd, inter, 1e-6, 1e6), tuple(
            LayerWeights(norm(h), t(nh * hd, h), t(nkv * hd, h), t(nkv * hd, h), norm(hd), norm(hd),
                         t(h, nh * hd), norm(h), t(inter, h), t(inter, h), t(h, inter)) for _ in range(n)), norm(h))

    ids = CodecIds(vocab_size=3072, eos=2150, pad=2148, bos=2149, suppress_start=2048, num_code_groups=16,
                   predictor_vocab_size=2048)
    return DecodeWeights(stack(layers[0]), t(3072, h), t(3072, h), stack(layers[1]),
                         tuple(t(2048, h) for _ in range(15)), tuple(t(2048, h) for _ in range(15)), None, ids)


def random_prompt(seed: int, length: int, hidden: int, n_trailing: int = 8, device="cpu",
                  std: float = 0.02) -> Prompt:
    """A prompt of bf16-exact random vectors (fp32 tensors)."""
    g = torch.Generator().manual_seed(1000 + seed)
    r = lambda *s: (torch.randn(*s, generator=g) * std).bfloat16().float().to(device)  # noqa: E731
    return Prompt(embeds=r(length, hidden), trailing=r(n_trailing, hidden), pad_embed=r(hidden))


def mixed_lengths(b: int) -> list[int]:
    """Talker contexts of b benchmark streams: pairs symmetric about 500 (every even prefix has
    mean 500; B = 1 gets 500)."""
    return [500 + (1 if i % 2 == 0 else -1) * ((i // 2) * 197 % 490) for i in range(b)]


def digest(eng, codes: dict[int, np.ndarray]) -> str:
    """sha256 of step_codes' codes (slot order) and those slots' past hidden states: two trees
    (or two launch settings) giving the same digest computed the same bits."""
    import hashlib

    dig = hashlib.sha256()
    for s in sorted(codes):
        dig.update(np.ascontiguousarray(codes[s]).tobytes())
    dig.update(eng.state.past_hidden[sorted(codes)].float().cpu().numpy().tobytes())
    return dig.hexdigest()


def step_codes(eng, slots: list[int], frames: int, admit: tuple = (), on_step=None) -> dict[int, np.ndarray]:
    """Run `frames` steps of `slots` (admissions in the first); -> slot -> codes [F, 16]."""
    got = {s: [] for s in slots}
    for f in range(frames):
        out = eng.run(StepPlan(decode=tuple(slots), admit=admit if f == 0 else ()))
        assert not out.failed, out.failed
        for r in out.frames:
            assert r.error is None, (r.slot, r.error)
            got[r.slot].append(r.codes)
        if on_step is not None:
            on_step(f)
    return {s: np.stack(v) for s, v in got.items()}


def invariance(eng: BatchedEngine, prompt: Prompt, sampling: SamplingConfig, sizes=(1, 3, 17, 64),
               frames: int = 64, neighbour_len=(5, 40)) -> dict:
    """One stream placed in a different slot and row of steps with B in `sizes` (random
    neighbours, other prompts and seeds): are its codes and (with dump_logits) its raw logits
    bitwise those of B = 1? Each B admits afresh, so the engine is reused."""
    hidden = eng.p.talker.cfg.hidden_size
    ref_codes, ref_logits, res = None, None, {}
    for b in sizes:
        for s in list(eng.positions):
            eng.release(s)
        slot = (7 * b + 3) % eng.max_streams
        others = [s for s in range(eng.max_streams) if s != slot][: b - 1]
        row = b // 2
        order = others[:row] + [slot] + others[row:]
        rng = np.random.default_rng(b)
        admit = [Admission(slot, prompt, sampling)] + [
            Admission(s, random_prompt(500 + 97 * b + s, int(rng.integers(*neighbour_len)), hidden,
                                       device=eng.device), SamplingConfig(seed=int(rng.integers(1 << 30))))
            for s in others]
        logits = []
        on_step = None
        if eng.frame.dump is not None:
            on_step = lambda f: logits.append(eng.frame.dump[row].clone())  # noqa: E731
        codes = step_codes(eng, order, frames, tuple(admit), on_step)[slot]
        lg = torch.stack(logits) if logits else None
        if ref_codes is None:
            ref_codes, ref_logits = codes, lg
        res[b] = dict(slot=slot, row=row, codes_equal=bool(np.array_equal(codes, ref_codes)))
        if lg is not None:
            res[b].update(logits_equal=bool(torch.equal(lg, ref_logits)),
                          logits_max_abs_diff=float((lg - ref_logits).abs().max()))
    for s in list(eng.positions):
        eng.release(s)
    return res


def greedy_vs_torch(eng: BatchedEngine, ref, prompts: list[Prompt], frames: int, batch: int = 1) -> list[dict]:
    """Greedy codes of each prompt from TorchEngine `ref` (alone) and from `eng` alone and inside
    a step of `batch` slots (neighbours sampled) -> per prompt: frames identical from the start."""
    from ..contract import decode_until_eos

    hidden = eng.p.talker.cfg.hidden_size
    out = []
    for i, p in enumerate(prompts):
        want = decode_until_eos(ref, 0, frames, p, GREEDY)
        ref.release(0)
        alone = decode_until_eos(eng, 0, frames, p, GREEDY)
        eng.release(0)
        row = dict(prompt=i, frames=len(want), alone=_same_prefix(alone, want))
        if batch > 1:
            target = batch // 2
            admit = [Admission(s, random_prompt(900 + s, 10 + s % 30, hidden, device=eng.device),
                               SamplingConfig(seed=s)) for s in range(batch) if s != target]
            admit.append(Admission(target, p, GREEDY))
            got = step_codes(eng, list(range(batch)), len(want), tuple(admit))[target]
            row["in_batch"] = _same_prefix(got, want)
            for s in range(batch):
                eng.release(s)
        out.append(row)
    return out


def _same_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Number of leading frames on which a and b agree."""
    n = min(len(a), len(b))
    same = (a[:n] == b[:n]).all(1)
    return n if same.all() else int(np.argmin(same))


class TeacherForced:
    """fp32 reference (model.lm over bf16-rounded fp32 weights, batched over streams) fed the
    engine's codes: each frame's 15 code-predictor logits and the talker logits per stream."""

    def __init__(self, w: DecodeWeights, num: int, max_positions: int):
        self.w = bf16_rounded(w)
        dev = w.codec_head.device
        self.cache = KVCache(self.w.talker.config, num, max_positions, torch.float32, dev)
        self.cp_cache = KVCache(self.w.predictor.config, num, w.ids.num_code_groups, torch.float32, dev)
        self.rows = torch.arange(num, device=dev)
        self.dev = dev

    @torch.inference_mode()
    def prefill(self, i: int, prompt: Prompt) -> None:
        n = prompt.embeds.shape[0]
        pos = torch.arange(n, device=self.dev)[None]
        h = lm_forward(self.w.talker, prompt.embeds.float().to(self.dev)[None], self.cache, self.rows[i:i + 1], pos)
        if not hasattr(self, "past"):
            self.past = torch.zeros(len(self.rows), h.shape[-1], device=self.dev)
            self.pos = torch.zeros(len(self.rows), dtype=torch.long, device=self.dev)
        self.past[i], self.pos[i] = h[0, -1], n

    @torch.inference_mode()
    def frame(self, codes: torch.Tensor, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """codes [N, 16] long, text [N, H] -> (cp logits [N, 15, VC], talker logits [N, V])."""
        w, n = self.w, codes.shape[0]
        x = torch.stack((self.past, F.embedding(codes[:, 0], w.codec_embedding)), 1)
        cp = []
        for k in range(w.ids.num_code_groups - 1):
            start = 0 if k == 0 else k + 1
            pos = torch.arange(start, start + x.shape[1], device=self.dev)[None].expand(n, -1)
            h = lm_forward(w.predictor, x, self.cp_cache, self.rows, pos)[:, -1]
            cp.append(F.linear(h, w.predictor_heads[k]))
            x = F.embedding(codes[:, k + 1], w.predictor_embeddings[k])[:, None]
        e = torch.stack([F.embedding(codes[:, 0], w.codec_embedding)] + [
            F.embedding(codes[:, k + 1], w.predictor_embeddings[k]) for k in range(15)]).sum(0) + text
        self.past = lm_forward(w.talker, e[:, None], self.cache, self.rows, self.pos[:, None])[:, 0]
        self.pos += 1
        return torch.stack(cp, 1), F.linear(self.past, w.codec_head)


def teacher_forced(eng: BatchedEngine, w: DecodeWeights, prompts: list[Prompt], frames: int,
                   sampling: SamplingConfig | None = None) -> dict:
    """All prompts decoded together (one step of len(prompts) slots, sampled, seeded) with
    dump_logits; the fp32 reference is fed the engine's codes. Per-pass relative L2 error of the
    logits and top-1 agreement over every stream, pass and frame."""
    assert eng.frame.dump is not None, "needs dump_logits=True"
    n = len(prompts)
    ref = TeacherForced(w, n, max(p.embeds.shape[0] for p in prompts) + frames + 1)
    admit = tuple(Admission(i, p, replace(sampling or SamplingConfig(), seed=i)) for i, p in enumerate(prompts))
    for i, p in enumerate(prompts):
        ref.prefill(i, p)
    vc, v = w.ids.predictor_vocab_size, w.ids.vocab_size
    errs, top1 = [], []
    for f in range(frames):
        out = eng.run(StepPlan(decode=tuple(range(n)), admit=admit if f == 0 else ()))
        assert not out.failed and all(r.error is None for r in out.frames)
        codes = torch.tensor(np.stack([r.codes for r in out.frames]), device=eng.device)
        dump = eng.frame.dump[:n]
        text = torch.stack([p.trailing[f] if f < p.trailing.shape[0] else p.pad_embed for p in prompts]).float()
        rcp, rt = ref.frame(codes, text.to(eng.device))
        for got, want in ((dump[:, :15, :vc], rcp), (dump[:, 15:, :v], rt[:, None])):
            errs.append(((got - want).norm(dim=-1) / want.norm(dim=-1)).flatten())
            top1.append((got.argmax(-1) == want.argmax(-1)).flatten())
    e, t = torch.cat(errs).cpu().numpy(), torch.cat(top1).float().cpu().numpy()
    for s in range(n):
        eng.release(s)
    return dict(streams=n, frames=frames, passes=int(e.size), rel_err_median=float(np.median(e)),
                rel_err_p99=float(np.quantile(e, 0.99)), rel_err_max=float(e.max()), top1=float(t.mean()))
