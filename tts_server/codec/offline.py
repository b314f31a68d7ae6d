"""One-piece codec decode through the official `Qwen3TTSTokenizerV2Decoder.forward`: the
oracle that streaming decode must reproduce (exact for any length, but recomputes everything)."""

from __future__ import annotations

import torch


@torch.inference_mode()
def decode_full(decoder, codes: torch.Tensor) -> torch.Tensor:
    """codes [T, Q] int64 (any device) -> float32 audio [T * 1920] on the decoder's device."""
    device = next(decoder.parameters()).device
    wav = decoder(codes.to(device, torch.long).t().unsqueeze(0))  # [1, 1, T * 1920]
    return wav.reshape(-1)
