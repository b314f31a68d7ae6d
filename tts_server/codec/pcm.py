"""Streaming resampling of decoded audio to the requested output rate (soxr)."""

from __future__ import annotations

import numpy as np
import soxr


class StreamResampler:
    """Resamples consecutive float32 chunks as one continuous signal; identity at equal rates."""

    def __init__(self, in_rate: int, out_rate: int):
        self.in_rate, self.out_rate = in_rate, out_rate
        self._stream = (None if in_rate == out_rate
                        else soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32", quality="HQ"))

    def __call__(self, samples: np.ndarray, last: bool = False) -> np.ndarray:
        """samples [n] float32 -> [m] float32 at out_rate (m varies per call; sums match)."""
        if self._stream is None:
            return samples.astype(np.float32, copy=False)
        out = self._stream.resample_chunk(samples.astype(np.float32, copy=False), last=last)
        return np.clip(out, -1.0, 1.0)
