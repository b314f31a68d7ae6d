"""OpenAI's speech request (plus the peers' extensions) -> a validated `SynthesisRequest`.

The JSON body becomes a tts.v1 SynthesizeRequest and goes through the gRPC door's validation
(`rpc/convert.py`), so both doors take the same inputs within the same limits; a refusal names
this API's field (`input`, `sample_rate`, `ref_audio`, ...)."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import math
import os
from dataclasses import dataclass

from tts_client.pb.tts.v1 import tts_pb2

from ..api import InvalidRequest, ModelInfo, SynthesisRequest
from ..audio_formats import FORMATS, AudioFormat
from ..config import ServerConfig
from ..rpc import convert
from .errors import from_exception, invalid

STREAM_FORMATS = ("audio", "sse")
# gRPC request field -> this API's name, for refusals raised by rpc/convert.py
FIELD_NAMES = {
    "text": "input", "sample_rate_hz": "sample_rate", "reference": "ref_audio",
    "reference.audio": "ref_audio", "reference.transcript": "ref_text",
    "request_id": "x-request-id", "sampling.seed": "seed", "sampling.temperature": "temperature",
    "sampling.top_k": "top_k", "sampling.top_p": "top_p",
    "sampling.repetition_penalty": "repetition_penalty",
}
# OpenAI's voice names: a client written for OpenAI (Pipecat's OpenAITTSService insists on one)
# gets the server's default voice (--default-voice) unless the model has a voice of that name.
OPENAI_VOICES = frozenset(("alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin",
                           "nova", "onyx", "sage", "shimmer", "verse"))
SAMPLING = ("temperature", "top_k", "top_p", "repetition_penalty")
KNOWN_FIELDS = frozenset((
    "model", "input", "voice", "response_format", "speed", "instructions", "stream_format",
    "stream", "language", "sample_rate", "seed", "max_duration_s", "non_streaming_mode",
    "ref_audio", "ref_text") + SAMPLING)


@dataclass(frozen=True)
class SpeechRequest:
    request: SynthesisRequest
    format: AudioFormat
    stream_format: str  # audio | sse
    stream: bool  # False: the whole file in one body with its length


def served_model_ids(info: ModelInfo) -> tuple[str, ...]:
    """The names `model` may take: the served name, a folder's base name, and the hub id."""
    name = info.name.rstrip("/")
    ids = [name]
    base = os.path.basename(name)
    if base and base != name:
        ids.append(base)
    if base.startswith("Qwen3-TTS-") and f"Qwen/{base}" not in ids:
        ids.append(f"Qwen/{base}")
    return tuple(ids)


def _typed(body: dict, name: str, kinds, kind_name: str):
    value = body.get(name)
    if value is None:
        return None
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise invalid(name, f"must be {kind_name}, got {type(value).__name__}")
    return value


def _number(body: dict, name: str) -> float | None:
    value = _typed(body, name, (int, float), "a number")
    if value is not None and not math.isfinite(value):
        raise invalid(name, f"must be finite, got {value}")
    return value


def _reference_audio(value: str) -> bytes:
    """Base64 audio, bare or as a data URL (`data:audio/wav;base64,...`)."""
    if value.startswith("data:"):
        header, _, value = value.partition(",")
        if ";base64" not in header:
            raise invalid("ref_audio", "a data URL must be base64-encoded (data:audio/wav;base64,...)")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise invalid("ref_audio", "is not valid base64 (send the audio file's bytes base64-"
                                   "encoded, or as a data:audio/wav;base64,... URL)") from None


def parse(body, info: ModelInfo, config: ServerConfig, request_id: str = "") -> SpeechRequest:
    """Validate the decoded JSON body; raises APIError (400 naming the field)."""
    if not isinstance(body, dict):
        raise invalid("body", "must be a JSON object")
    for name in body:
        if name not in KNOWN_FIELDS:
            raise invalid(name, f"unknown parameter; accepted: {', '.join(sorted(KNOWN_FIELDS))}")
    model = _typed(body, "model", str, "a string")
    if model and model not in served_model_ids(info):
        raise invalid("model", f"this server serves {' / '.join(served_model_ids(info))}, "
                               f"not {model!r}")
    text = _typed(body, "input", str, "a string")
    if text is None:
        raise invalid("input", "is required")
    fmt_name = _typed(body, "response_format", str, "a string") or "mp3"
    fmt = FORMATS.get(fmt_name)
    if fmt is None:
        raise invalid("response_format", f"unsupported format {fmt_name!r}; use one of "
                                          f"{', '.join(FORMATS)}")
    speed = _number(body, "speed")
    if speed is not None and speed != 1.0:
        raise invalid("speed", f"only 1.0 is supported, got {speed}")
    if _typed(body, "instructions", str, "a string"):
        raise invalid("instructions", f"the {info.model_type} model {info.name} takes no "
                                      "instructions")
    stream_format = _typed(body, "stream_format", str, "a string") or "audio"
    if stream_format not in STREAM_FORMATS:
        raise invalid("stream_format", f"must be 'audio' or 'sse', got {stream_format!r}")
    stream = _typed(body, "stream", bool, "a boolean")
    if stream is False and stream_format == "sse":
        raise invalid("stream", "stream_format 'sse' always streams; leave stream unset or true")
    rate = _typed(body, "sample_rate", int, "an integer")
    rate = rate or fmt.default_rate or info.sample_rate
    if fmt.rates is not None and rate not in fmt.rates:
        raise invalid("sample_rate", f"{fmt.name} takes {', '.join(map(str, fmt.rates))} Hz, "
                                     f"got {rate}")
    seed = _typed(body, "seed", int, "an integer")
    if seed is not None and not 0 <= seed < 2**63:
        raise invalid("seed", f"must be in [0, 2^63), got {seed}")
    non_streaming = _typed(body, "non_streaming_mode", bool, "a boolean")
    voice = _typed(body, "voice", str, "a string") or ""
    if voice.strip().lower() in OPENAI_VOICES and voice.strip().lower() not in info.voices:
        voice = ""
    msg = tts_pb2.SynthesizeRequest(
        text=text, voice=voice,
        language=_typed(body, "language", str, "a string") or "", sample_rate_hz=rate,
        max_duration_s=_number(body, "max_duration_s") or 0.0, request_id=request_id)
    for name in SAMPLING:
        value = (_typed(body, name, int, "an integer") if name == "top_k"
                 else _number(body, name))
        if value is not None:
            setattr(msg.sampling, name, value)
    if seed is not None:
        msg.sampling.seed = seed
    ref_audio = _typed(body, "ref_audio", str, "a string")
    ref_text = _typed(body, "ref_text", str, "a string")
    if ref_audio:
        msg.reference.audio = _reference_audio(ref_audio)
        msg.reference.transcript = ref_text or ""
    elif ref_text:
        raise invalid("ref_text", "needs ref_audio (the audio this is the transcript of)")
    try:
        req = convert.to_request(msg, info, config)
    except InvalidRequest as e:
        raise from_exception(e, FIELD_NAMES) from None
    if non_streaming is not None:
        req = dataclasses.replace(req, non_streaming=non_streaming)
    return SpeechRequest(req, fmt, stream_format, stream is not False)
