"""A per-stream stand-in with the batched codec's interface (reset / step) over the streaming
oracle: one eager decode per slot and frame. Used until codec/batched.py serves every device."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .streaming import StreamingCodecDecoder


class PerStreamCodec:
    def __init__(self, decoder, max_slots: int):
        self.oracle = StreamingCodecDecoder(decoder)
        self.sample_rate = self.oracle.sample_rate
        self.samples_per_frame = self.oracle.samples_per_frame
        self.max_slots = max_slots
        self.capture_s = 0.0
        self.graph_memory_bytes = 0
        self._states: dict[int, object] = {}

    def reset(self, slot: int, ref_codes=None) -> None:
        state = self.oracle.new_state()
        if ref_codes is not None:
            self.oracle.decode(state, torch.as_tensor(ref_codes))  # left context only
        self._states[slot] = state

    def step(self, slots: Sequence[int], codes) -> np.ndarray:
        """codes [B, 16] -> float32 [B, samples_per_frame]: one frame per slot."""
        codes = torch.as_tensor(np.asarray(codes))
        rows = [self.oracle.decode(self._states[s], codes[i:i + 1]) for i, s in enumerate(slots)]
        if not rows:
            return np.zeros((0, self.samples_per_frame), np.float32)
        return torch.stack([r.reshape(-1) for r in rows]).float().cpu().numpy()
