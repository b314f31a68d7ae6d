"""Token sampling with qwen-tts's rules (Hugging Face logits-processor order).

Talker (code 0): repetition penalty over the stream's code-0 history -> EOS masked for the
first `min_new_tokens` samples -> suppressed ids -> temperature -> top-k -> top-p -> draw.
Code predictor (codes 1..15): temperature -> top-k -> top-p -> draw. Greedy takes the argmax
of the processed logits (as HF does with do_sample=False).
"""

from __future__ import annotations

import torch


def repetition_penalty_(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> None:
    """In place. logits [V] fp32, seen [V] bool: positive logits / penalty, negative * penalty."""
    if penalty == 1.0 or not bool(seen.any()):
        return
    vals = logits[seen]
    logits[seen] = torch.where(vals < 0, vals * penalty, vals / penalty)


def warp(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] fp32 -> logits with -inf outside the top-k / top-p set, divided by temperature."""
    if temperature != 1.0:
        logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove = cum <= (1.0 - top_p)
        remove[-1] = False
        logits = logits.masked_fill(remove.scatter(0, sorted_idx, remove), float("-inf"))
    return logits


def draw(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int, top_p: float,
         generator: torch.Generator | None) -> int:
    """One token id from logits [V] (any float dtype)."""
    logits = logits.float()
    if not do_sample:
        return int(torch.argmax(logits))
    probs = warp(logits, temperature, top_k, top_p).softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def talker_mask_(logits: torch.Tensor, num_sampled: int, eos: int, suppress_start: int,
                 min_new_tokens: int) -> None:
    """In place on logits [V]: suppress ids [suppress_start, V) except EOS, and EOS itself while
    fewer than `min_new_tokens` code-0 samples have been drawn."""
    keep = logits[eos].clone()
    logits[suppress_start:] = float("-inf")
    logits[eos] = float("-inf") if num_sampled < min_new_tokens else keep
