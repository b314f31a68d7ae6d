"""The Triton implementations behind ops.py, gathered from tk_gemm / tk_attention / tk_sample."""

from .tk_attention import paged_attention, prefill_attention
from .tk_gemm import linear, linear_parts, rms_norm, swiglu, warm_up
from .tk_sample import frame_noise, sample_tokens, talker_process_

__all__ = ["linear", "linear_parts", "swiglu", "rms_norm", "paged_attention", "prefill_attention", "talker_process_", "sample_tokens", "frame_noise", "warm_up"]
