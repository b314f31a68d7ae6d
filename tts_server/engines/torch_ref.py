"""The PyTorch reference decode engine: plain torch over `DecodeWeights`, exact to qwen-tts.

Streams in a step are batched through the code predictor and the talker (one weight read per
pass for all of them); sampling runs per stream with its own seeded generator. Every linear runs
row by row when `batch_invariant` (the default on CPU), so a stream's logits do not depend on
which other streams share the step (BLAS picks other kernels for other batch sizes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..model.lm import KVCache, lm_forward
from ..model.sampler import draw, repetition_penalty_, talker_mask_
from ..model.weights import DecodeWeights
from .contract import FrameResult, Prompt, SamplingConfig, StepOutput, StepPlan, eos_gate, run_parts


@dataclass
class _SlotState:
    sampling: SamplingConfig
    generator: torch.Generator
    trailing: torch.Tensor  # [N, H]
    pad_embed: torch.Tensor  # [H]
    seen: torch.Tensor  # [V] bool: code-0 ids drawn so far (repetition penalty)
    position: int = 0  # next talker position
    code0: int = 0  # pending code 0 of the frame being built
    past_hidden: torch.Tensor | None = None  # [H] talker hidden that produced code0
    num_sampled: int = 0  # code-0 samples drawn
    text_step: int = 0  # index into trailing
    eos_from: int = 0  # EOS masked in draws before this one (contract.Admission)


class TorchEngine:
    """DecodeEngine over plain PyTorch (CPU or CUDA, any float dtype)."""

    name = "torch"

    def __init__(self, weights: DecodeWeights, max_streams: int = 8, max_positions: int = 4096,
                 batch_invariant: bool = True):
        self.w = weights
        self.batch_invariant = batch_invariant
        self.max_streams = max_streams
        self.max_positions = max_positions
        ref = weights.codec_head
        self.device, self.dtype = ref.device, ref.dtype
        self.cache = KVCache(weights.talker.config, max_streams, max_positions, self.dtype, self.device)
        self.cp_cache = KVCache(weights.predictor.config, max_streams, weights.ids.num_code_groups,
                                self.dtype, self.device)
        self.slots: dict[int, _SlotState] = {}

    def run(self, plan: StepPlan, on_codes=None) -> StepOutput:  # no early codes (contract)
        """Admissions one by one, then the decode step: one group of all slots, or (batch
        invariant) one group per slot, so a slot computes exactly what it computes alone."""
        slots = list(plan.decode)
        return run_parts(self, plan, [[s] for s in slots] if self.batch_invariant else [slots])

    @torch.inference_mode()
    def extend_text(self, slot: int, vectors: torch.Tensor, eos_from: int | None = None) -> None:
        st = self.slots[slot]
        st.trailing = torch.cat((st.trailing, vectors.to(self.device, self.dtype)))
        if eos_from is not None:
            st.eos_from = eos_from

    @torch.inference_mode()
    def prefill(self, slot: int, prompt: Prompt, sampling: SamplingConfig, eos_from: int = 0) -> None:
        if not 0 <= slot < self.max_streams:
            raise ValueError(f"slot {slot} out of range")
        length = prompt.embeds.shape[0]
        if length >= self.max_positions:
            raise ValueError(f"prompt of {length} positions exceeds {self.max_positions}")
        gen = torch.Generator(device=self.device).manual_seed(sampling.seed)
        st = _SlotState(sampling=sampling, generator=gen,
                        trailing=prompt.trailing.to(self.device, self.dtype),
                        pad_embed=prompt.pad_embed.to(self.device, self.dtype),
                        seen=torch.zeros(self.w.ids.vocab_size, dtype=torch.bool, device=self.device),
                        eos_from=eos_from)
        x = prompt.embeds.to(self.device, self.dtype)[None]
        positions = torch.arange(length, device=self.device)[None]
        slots = torch.tensor([slot], device=self.device)
        hidden = lm_forward(self.w.talker, x, self.cache, slots, positions)[0, -1]
        st.position = length
        st.past_hidden = hidden
        st.code0 = self._sample_code0(st, F.linear(hidden, self.w.codec_head))
        self.slots[slot] = st

    def release(self, slot: int) -> None:
        self.slots.pop(slot, None)

    def _sample_code0(self, st: _SlotState, logits: torch.Tensor) -> int:
        ids, s = self.w.ids, st.sampling
        logits = logits.float().clone()
        repetition_penalty_(logits, st.seen, s.repetition_penalty)
        talker_mask_(logits, eos_gate(st.num_sampled, st.eos_from), ids.eos, ids.suppress_start,
                     ids.min_new_tokens)
        code = draw(logits, s.do_sample, s.temperature, s.top_k, s.top_p, st.generator)
        st.num_sampled += 1
        st.seen[code] = True
        return code

    def _predict_codes(self, states: list[_SlotState], failed: dict[int, str]) -> torch.Tensor:
        """Codes 1..15 for each stream's pending code 0 -> [B, 15] long. A stream whose logits
        turn non-finite is entered in `failed` (index -> reason) and gets zeros from then on."""
        w = self.w
        b = len(states)
        rows = torch.arange(b, device=self.device)
        code0 = torch.tensor([s.code0 for s in states], device=self.device)
        x = torch.stack((torch.stack([s.past_hidden for s in states]),
                         F.embedding(code0, w.codec_embedding)), dim=1)  # [B, 2, H]
        codes = torch.empty(b, w.ids.num_code_groups - 1, dtype=torch.long, device=self.device)
        for k in range(w.ids.num_code_groups - 1):
            if w.predictor_in_proj is not None:
                x = F.linear(x, *w.predictor_in_proj)
            start = 0 if k == 0 else k + 1
            positions = torch.arange(start, start + x.shape[1], device=self.device)[None].expand(b, -1)
            hidden = lm_forward(w.predictor, x, self.cp_cache, rows, positions)[:, -1]
            logits = F.linear(hidden, w.predictor_heads[k])
            finite = torch.isfinite(logits).all(-1).tolist()
            for i, st in enumerate(states):
                s = st.sampling
                if i in failed:
                    codes[i, k] = 0
                elif not finite[i]:
                    failed[i] = f"non-finite code-predictor logits (code group {k + 1})"
                    codes[i, k] = 0
                else:
                    codes[i, k] = draw(logits[i], s.subtalker_do_sample, s.subtalker_temperature,
                                       s.subtalker_top_k, s.subtalker_top_p, st.generator)
            x = F.embedding(codes[:, k], w.predictor_embeddings[k])[:, None]
        return codes

    @torch.inference_mode()
    def step(self, slots: Sequence[int]) -> list[FrameResult]:
        """One frame for each of `slots`, batched together (results in the order of `slots`)."""
        w = self.w
        full = [s for s in slots if self.slots[s].position >= self.max_positions]
        if full:
            live = [s for s in slots if s not in full]
            done = {r.slot: r for r in (self.step(live) if live else [])}
            codes = np.zeros(w.ids.num_code_groups, dtype=np.int64)
            done.update({s: FrameResult(s, codes, False, "talker context is full") for s in full})
            return [done[s] for s in slots]
        states = [self.slots[s] for s in slots]
        failed: dict[int, str] = {}  # a stream gone numerically bad fails alone
        rest = self._predict_codes(states, failed)  # [B, 15]
        code0 = torch.tensor([s.code0 for s in states], device=self.device)
        # one summation with a single rounding, as qwen-tts's cat(...).sum(1)
        x = torch.stack([F.embedding(code0, w.codec_embedding)] + [
            F.embedding(rest[:, k], w.predictor_embeddings[k]) for k in range(rest.shape[1])]).sum(0)
        text = [st.trailing[st.text_step] if st.text_step < st.trailing.shape[0] else st.pad_embed
                for st in states]
        x = (x + torch.stack(text))[:, None]  # [B, 1, H]
        positions = torch.tensor([[st.position] for st in states], device=self.device)
        slot_t = torch.tensor(list(slots), device=self.device)
        hidden = lm_forward(w.talker, x, self.cache, slot_t, positions)[:, 0]  # [B, H]
        logits = F.linear(hidden, w.codec_head)
        finite = torch.isfinite(logits).all(-1).tolist()
        rest_np = rest.cpu().numpy()
        results = []
        for i, (slot, st) in enumerate(zip(slots, states)):
            frame = np.concatenate(([st.code0], rest_np[i])).astype(np.int64)
            st.position += 1
            st.text_step += 1
            st.past_hidden = hidden[i]
            if i not in failed and not finite[i]:
                failed[i] = "non-finite talker logits"
            if i in failed:
                results.append(FrameResult(slot=slot, codes=frame, next_is_eos=False, error=failed[i]))
                continue
            st.code0 = self._sample_code0(st, logits[i])
            results.append(FrameResult(slot=slot, codes=frame, next_is_eos=st.code0 == w.ids.eos))
        return results
