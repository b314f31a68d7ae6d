"""Torch-free contract between the gRPC layer and the engine worker.

The rpc package converts wire messages into `SynthesisRequest`s and streams back the
`AudioChunk`s and the final `StreamEnd` that the worker produces.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np


class InvalidRequest(ValueError):
    """A request the server cannot serve as asked; `field` names the offending field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message

    def __reduce__(self):  # pickled across the engine process's pipe
        return type(self), (self.field, self.message)


class Overloaded(RuntimeError):
    """No stream slot or queue place is free."""


class ShuttingDown(RuntimeError):
    """The server is draining and takes no new work."""


class EngineFailure(RuntimeError):
    """The decode engine as a whole is broken (a hung step, a device fault): every stream on it
    fails, health goes NOT_SERVING and the process exits for its supervisor to restart it."""


class StreamFailure(RuntimeError):
    """The engine failed one stream (e.g. non-finite logits); the others carry on."""


class Unsupported(RuntimeError):
    """The loaded engine or model cannot serve this kind of request."""


class IdleText(RuntimeError):
    """A StreamSynthesize context got no text and no `end` for --idle-text-timeout-s."""


class FinishReason(enum.Enum):
    EOS = "eos"
    MAX_LENGTH = "max_length"
    CANCELLED = "cancelled"
    ERROR = "error"
    IDLE_TIMEOUT = "idle_timeout"


def default_max_duration_s(text: str) -> float:
    """Runaway guard when the request sets none: about 3x a slow speaking rate.
    CJK characters (one syllable each) count 0.3 s, other characters 0.1 s, plus 2 s."""
    wide = sum(1 for ch in text if ord(ch) >= 0x2E80)
    return 2.0 + 0.3 * wide + 0.1 * (len(text) - wide)


@dataclass(frozen=True)
class SamplingConfig:
    """Per-stream sampling settings (qwen-tts generate's names and defaults)."""

    do_sample: bool = True
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    subtalker_do_sample: bool = True
    subtalker_temperature: float = 0.9
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class ReferenceAudio:
    """Decoded reference speech for voice cloning (Base models)."""

    samples: np.ndarray  # [n] float32 mono
    sample_rate: int
    transcript: str  # empty: x-vector-only cloning; else in-context (ICL) cloning


@dataclass(frozen=True)
class SynthesisRequest:
    request_id: str
    text: str
    voice: str | None  # CustomVoice speaker (lower case), None for Base models
    language: str  # a model language name or "auto"
    sampling: SamplingConfig
    max_frames: int  # runaway guard: at most this many 80 ms frames
    output_sample_rate: int
    reference: ReferenceAudio | None = None
    # StreamSynthesize: `text` is empty and arrives through StreamHandle.push_text; the prompt
    # uses the streaming-text layout and the stream waits whenever its text track runs dry
    incremental: bool = False
    max_frames_from_text: bool = False  # incremental: cap max_frames by the final text's length
    non_streaming: bool | None = None  # qwen-tts's non_streaming_mode; None: the model's default


@dataclass(frozen=True)
class TextEvent:
    """StreamSynthesize input for one context: a "text" delta, a "flush" (value: its id) or "end"."""

    kind: str
    value: str = ""


@dataclass(frozen=True)
class WordTiming:
    """A word whose first token entered the talker at `sample_offset` (output rate) of the audio."""

    word: str
    sample_offset: int


@dataclass(frozen=True)
class FlushAck:
    """All text before flush `flush_id` has entered the talker."""

    flush_id: str


@dataclass
class AudioChunk:
    samples: np.ndarray  # [n] float32 in [-1, 1] at the request's output_sample_rate
    sample_offset: int  # index of samples[0] in the utterance, at the output rate
    num_frames: int  # codec frames this chunk completes
    sequence_number: int
    timings: dict | None = None  # first chunk only: server-side breakdown of the first audio (ms)


@dataclass
class StreamEnd:
    finish_reason: FinishReason
    num_frames: int
    num_samples: int  # at the output rate
    error: BaseException | None = None


@dataclass(frozen=True)
class ModelInfo:
    """What the loaded model offers; the rpc layer validates requests against it."""

    name: str
    model_type: str  # custom_voice | base | voice_design
    model_size: str
    is_synthetic: bool
    warning: str
    engine: str
    device: str
    dtype: str
    sample_rate: int
    frame_rate: float
    voices: tuple[str, ...]
    default_voice: str | None
    languages: tuple[str, ...]  # accepted names besides "auto"
    voice_languages: dict = field(default_factory=dict)  # voice -> languages (may be empty)

    @property
    def requires_reference(self) -> bool:
        return self.model_type == "base"
