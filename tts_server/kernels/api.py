"""The decode-step contract between the scheduler and a decode engine.

An engine owns fixed per-stream slots (KV cache rows, positions, sampling state). The
scheduler calls `prefill` once per stream, `step` once per 80 ms frame for every active
stream, and `release` when a stream ends or is cancelled. One engine thread makes every call.

Semantics of `step` for a slot (identical to qwen-tts generate):
  1. the pending code 0 (sampled by the previous talker step or by prefill) and the talker's
     last hidden state go through the 15 code-predictor passes -> codes 1..15 of this frame;
  2. the next talker input is the sum of the 16 codebook embeddings of this frame plus the
     stream's next text-track vector (pending text, then tts_pad forever);
  3. one talker step at the stream's next position -> codec_head logits -> the next code 0,
     sampled with repetition penalty over the code-0 history, EOS masked for the first
     `min_new_tokens` samples, ids in [vocab-1024, vocab) except EOS suppressed.
The frame's 16 codes are returned with `next_is_eos`: when True the stream has ended after
this frame. `prefill` itself samples the first code 0 (EOS is always masked there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch

from ..api import SamplingConfig

__all__ = ["DecodeEngine", "FrameResult", "Prompt", "SamplingConfig", "decode_until_eos"]


@dataclass
class Prompt:
    """A stream's prefill, as qwen-tts builds it (model/prompt.py)."""

    embeds: torch.Tensor  # [L, H] talker input embeddings of the prefill positions
    trailing: torch.Tensor  # [N, H] pending text-track vectors, consumed one per step
    pad_embed: torch.Tensor  # [H] text-track vector once `trailing` is exhausted (tts_pad)


@dataclass
class FrameResult:
    slot: int
    codes: np.ndarray  # [16] int64: code 0 (talker) then codes 1..15 (code predictor)
    next_is_eos: bool  # the talker's next code 0 is EOS: this frame is the stream's last
    error: str | None = None  # this slot failed (the others in the step are valid); codes unused


def decode_until_eos(engine: "DecodeEngine", slot: int, max_frames: int) -> np.ndarray:
    """Step one prefilled slot until EOS or `max_frames`; returns its frames [F, 16]."""
    frames = []
    for _ in range(max_frames):
        result = engine.step([slot])[0]
        frames.append(result.codes)
        if result.next_is_eos:
            break
    return np.stack(frames)


class DecodeEngine(Protocol):
    """What the scheduler needs from a decode engine."""

    name: str  # "torch" or "megakernel"
    max_streams: int  # number of slots
    max_positions: int  # talker positions per slot (prefill + frames)

    def prefill(self, slot: int, prompt: Prompt, sampling: SamplingConfig) -> None:
        """Run the prompt through the talker into `slot` and sample its first code 0."""
        ...

    def step(self, slots: Sequence[int]) -> list[FrameResult]:
        """Advance each slot by one frame; results come back in the order of `slots`.
        A failure confined to one slot comes back as that slot's `error`; an exception means
        the whole step failed (a device fault leaves the engine unusable)."""
        ...

    def release(self, slot: int) -> None:
        """Forget `slot`'s stream; the slot may be prefilled again."""
        ...
