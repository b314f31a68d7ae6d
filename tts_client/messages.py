"""Message fields that Synthesize's request and StreamSynthesize's context config share."""

from __future__ import annotations


def set_sampling_and_reference(msg, *, seed: int | None, greedy: bool, sampling: dict,
                               reference_audio: bytes | None, reference_text: str = "") -> None:
    """Fill msg.sampling (only when something was asked for, so unset means the model's
    defaults) and msg.reference; msg is a SynthesizeRequest or a ContextConfig."""
    if seed is not None or greedy or sampling:
        msg.sampling.greedy = greedy
        if seed is not None:
            msg.sampling.seed = seed
        for name, value in sampling.items():
            if value is not None:
                setattr(msg.sampling, name, value)
    if reference_audio:
        msg.reference.audio = reference_audio
        msg.reference.transcript = reference_text
