"""Wire messages <-> the torch-free api types, with validation that names the bad field."""

from __future__ import annotations

import dataclasses
import io
import math
import re
import secrets
import uuid
from dataclasses import dataclass

import numpy as np
from google.protobuf import empty_pb2
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

from tts_client.pb.tts.v1 import tts_pb2

from ..api import (AudioChunk, FinishReason, InvalidRequest, ModelInfo, ReferenceAudio,
                   SamplingConfig, StreamEnd, SynthesisRequest, default_max_duration_s)
from ..audio_formats import FORMATS, AudioEncoder, s16
from ..config import ServerConfig

MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 8000, 48000
MIN_REFERENCE_S, MAX_REFERENCE_S = 0.5, 30.0
MAX_TRANSCRIPT_CHARS = 2000
# Language tags (BCP-47 primary subtag) -> model language names.
LANGUAGE_TAGS = {
    "en": "english", "zh": "chinese", "de": "german", "es": "spanish", "ja": "japanese",
    "fr": "french", "ko": "korean", "ru": "russian", "it": "italian", "pt": "portuguese",
}
FINISH_REASONS = {FinishReason.EOS: tts_pb2.FINISH_REASON_EOS,
                  FinishReason.MAX_LENGTH: tts_pb2.FINISH_REASON_MAX_LENGTH,
                  FinishReason.CANCELLED: tts_pb2.FINISH_REASON_CANCELLED}


# encodings that go through a stream encoder (audio_formats), as the HTTP API's formats of that name
ENCODED = {tts_pb2.AUDIO_ENCODING_MULAW: FORMATS["mulaw"], tts_pb2.AUDIO_ENCODING_ALAW: FORMATS["alaw"],
           tts_pb2.AUDIO_ENCODING_OGG_OPUS: FORMATS["opus"]}
ENCODINGS = (tts_pb2.AUDIO_ENCODING_UNSPECIFIED, tts_pb2.AUDIO_ENCODING_PCM_S16LE,
             tts_pb2.AUDIO_ENCODING_FLOAT32_LE, *ENCODED)


REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:/-]{1,128}")


@dataclass(frozen=True)
class MalformedRequest:
    """What the request deserializer returns for bytes that are not a SynthesizeRequest, so the
    handler can answer INVALID_ARGUMENT naming the field (grpc would say UNKNOWN)."""

    field: str
    message: str


def _bad_utf8_field(data: bytes, descriptor, prefix: str = "") -> str | None:
    """The path of the first string field in `data` (wire bytes of `descriptor`'s message) that
    is not valid UTF-8, found by reading the fields as unknown fields of an empty message."""
    try:
        fields = UnknownFieldSet(empty_pb2.Empty.FromString(data))
    except DecodeError:
        return None
    for f in fields:
        fd = descriptor.fields_by_number.get(f.field_number)
        if fd is None or f.wire_type != 2:
            continue
        if fd.type == FieldDescriptor.TYPE_STRING:
            try:
                f.data.decode("utf-8")
            except UnicodeDecodeError:
                return prefix + fd.name
        elif fd.type == FieldDescriptor.TYPE_MESSAGE:
            found = _bad_utf8_field(f.data, fd.message_type, f"{prefix}{fd.name}.")
            if found:
                return found
    return None


def _parse(message_type, data: bytes):
    """A request deserializer that never raises: the message, or a MalformedRequest naming the
    field that is not valid UTF-8 (or the request as a whole)."""
    try:
        return message_type.FromString(data)
    except DecodeError:
        field = _bad_utf8_field(data, message_type.DESCRIPTOR)
        if field:
            return MalformedRequest(field, "is not valid UTF-8")
        return MalformedRequest("request", f"is not a valid {message_type.DESCRIPTOR.full_name} message")


def parse_synthesize_request(data: bytes) -> tts_pb2.SynthesizeRequest | MalformedRequest:
    """Request deserializer for Synthesize that never raises."""
    return _parse(tts_pb2.SynthesizeRequest, data)


# Unicode's Cc (C0, DEL, C1: fixed by the standard) and Cs (surrogates) characters but tab, LF and
# CR, as one character class: a search instead of a Python loop over every character (~55 us for
# a 185-character request on the CI machine, in the RPC process's per-call intake)
_CONTROL_RE = re.compile("[" + "".join(
    f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in ((0x00, 0x08), (0x0B, 0x0C), (0x0E, 0x1F), (0x7F, 0x9F),
                                              (0xD800, 0xDFFF))) + "]")


def _check_text(text: str, field: str = "text") -> None:
    m = _CONTROL_RE.search(text)
    if m is not None:
        raise InvalidRequest(field, f"contains control character U+{ord(m.group()):04X} at index {m.start()}")


def _language(value: str, info: ModelInfo) -> str:
    lang = value.strip().lower().replace("_", "-")
    if lang in ("", "auto"):
        return "auto"
    if lang in info.languages:
        return lang
    name = LANGUAGE_TAGS.get(lang.split("-")[0])
    if name in info.languages:
        return name
    raise InvalidRequest("language", f'unsupported language "{value}"; use auto or one of '
                                     f"{', '.join(info.languages)} (or a BCP-47 tag such as en)")


def _sampling(msg: tts_pb2.SamplingParams, has: bool) -> SamplingConfig:
    d = SamplingConfig()
    if not has:
        return SamplingConfig(seed=secrets.randbits(63))

    def pick(name, default):
        return getattr(msg, name) if msg.HasField(name) else default

    temperature, top_k, top_p = pick("temperature", d.temperature), pick("top_k", d.top_k), pick("top_p", d.top_p)
    rep = pick("repetition_penalty", d.repetition_penalty)
    st, sk, sp = (pick("subtalker_temperature", d.subtalker_temperature),
                  pick("subtalker_top_k", d.subtalker_top_k), pick("subtalker_top_p", d.subtalker_top_p))
    for name, value in (("temperature", temperature), ("subtalker_temperature", st)):
        if not (math.isfinite(value) and 0.0 < value <= 100.0):
            raise InvalidRequest(f"sampling.{name}", f"must be in (0, 100], got {value}")
    for name, value in (("top_k", top_k), ("subtalker_top_k", sk)):
        if value < 0:
            raise InvalidRequest(f"sampling.{name}", f"must be >= 0 (0 disables), got {value}")
    for name, value in (("top_p", top_p), ("subtalker_top_p", sp)):
        if not (math.isfinite(value) and 0.0 < value <= 1.0):
            raise InvalidRequest(f"sampling.{name}", f"must be in (0, 1], got {value}")
    if not (math.isfinite(rep) and 0.0 < rep <= 10.0):
        raise InvalidRequest("sampling.repetition_penalty", f"must be in (0, 10], got {rep}")
    seed = msg.seed if msg.HasField("seed") else secrets.randbits(63)
    if seed >= 2**63:  # the engines' seeds are 63-bit: a larger one would alias a smaller one's audio
        raise InvalidRequest("sampling.seed", f"must be in [0, 2^63), got {seed}")
    return SamplingConfig(do_sample=not msg.greedy, temperature=temperature, top_k=top_k,
                          top_p=top_p, repetition_penalty=rep, subtalker_do_sample=not msg.greedy,
                          subtalker_temperature=st, subtalker_top_k=sk, subtalker_top_p=sp, seed=seed)


def _reference(msg: tts_pb2.VoiceCloneReference) -> ReferenceAudio:
    import soundfile

    try:
        samples, rate = soundfile.read(io.BytesIO(msg.audio), dtype="float32", always_2d=True)
    except Exception as e:  # noqa: BLE001 - libsndfile's reason goes back to the client
        raise InvalidRequest("reference.audio", f"not a readable WAV/FLAC/OGG file ({e})") from None
    samples = samples.mean(axis=1)
    seconds = samples.shape[0] / rate
    if not MIN_REFERENCE_S <= seconds <= MAX_REFERENCE_S:
        raise InvalidRequest("reference.audio", f"{seconds:.2f} s long; must be "
                                                f"{MIN_REFERENCE_S}-{MAX_REFERENCE_S} s")
    if not np.isfinite(samples).all():
        raise InvalidRequest("reference.audio", "contains NaN or infinite samples")
    transcript = msg.transcript.strip()
    if len(transcript) > MAX_TRANSCRIPT_CHARS:
        raise InvalidRequest("reference.transcript", f"{len(transcript)} characters exceeds the "
                                                     f"limit of {MAX_TRANSCRIPT_CHARS}")
    _check_text(transcript, "reference.transcript")
    return ReferenceAudio(samples=np.ascontiguousarray(samples), sample_rate=int(rate),
                          transcript=transcript)


def request_id_of(msg) -> str:
    """The request's own `request_id` when it is a valid one, else a generated id: what logs and
    the `x-request-id` metadata carry, also for a request that is refused."""
    given = getattr(msg, "request_id", "")
    return given if given and REQUEST_ID_RE.fullmatch(given) else uuid.uuid4().hex[:16]


def to_request(msg: tts_pb2.SynthesizeRequest, info: ModelInfo, cfg: ServerConfig,
               request_id: str | None = None) -> SynthesisRequest:
    """Validate a SynthesizeRequest; raises InvalidRequest naming the first bad field."""
    text = msg.text.strip()
    if not text:
        raise InvalidRequest("text", "must not be empty or whitespace only")
    if len(text) > cfg.max_text_chars:
        raise InvalidRequest("text", f"{len(text)} characters exceeds the limit of {cfg.max_text_chars}")
    _check_text(text)
    if msg.request_id and not REQUEST_ID_RE.fullmatch(msg.request_id):
        raise InvalidRequest("request_id", "must be 1-128 characters of A-Z a-z 0-9 . _ : / -")
    reference = _reference(msg.reference) if msg.HasField("reference") and msg.reference.audio else None
    if info.requires_reference:
        if msg.voice:
            raise InvalidRequest("voice", "this Base model clones voices from `reference`; leave voice empty")
        if reference is None:
            raise InvalidRequest("reference", "this Base model needs reference audio to clone a voice")
        voice = None
    else:
        if reference is not None:
            raise InvalidRequest("reference", f"a {info.model_type} model does not clone voices; "
                                              "use `voice`")
        voice = (msg.voice.strip().lower() or info.default_voice)
        if voice not in info.voices:
            raise InvalidRequest("voice", f'unknown voice "{msg.voice}"; available: '
                                          f"{', '.join(info.voices)}")
    language = _language(msg.language, info)
    if msg.encoding not in ENCODINGS:
        raise InvalidRequest("encoding", f"unsupported encoding {msg.encoding}")
    fmt = ENCODED.get(msg.encoding)
    rate = msg.sample_rate_hz or (fmt and fmt.default_rate) or info.sample_rate
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise InvalidRequest("sample_rate_hz", f"{msg.sample_rate_hz} Hz is outside "
                                               f"{MIN_SAMPLE_RATE}-{MAX_SAMPLE_RATE} (0 = native)")
    if fmt is not None and fmt.rates is not None and rate not in fmt.rates:
        raise InvalidRequest("sample_rate_hz", f"{fmt.name} takes {', '.join(map(str, fmt.rates))} "
                                               f"Hz, got {rate}")
    max_s = msg.max_duration_s
    if not math.isfinite(max_s) or max_s < 0 or max_s > cfg.max_duration_s:
        raise InvalidRequest("max_duration_s", f"must be in [0, {cfg.max_duration_s}] (0 = from the "
                                               f"text length), got {max_s}")
    max_s = max_s or min(default_max_duration_s(text), cfg.max_duration_s)
    return SynthesisRequest(
        request_id=request_id or msg.request_id or uuid.uuid4().hex[:16], text=text, voice=voice,
        language=language, sampling=_sampling(msg.sampling, msg.HasField("sampling")),
        max_frames=max(1, math.floor(max_s * info.frame_rate + 1e-3)), output_sample_rate=rate,
        reference=reference)


def encoding_of(msg: tts_pb2.SynthesizeRequest) -> int:
    return msg.encoding or tts_pb2.AUDIO_ENCODING_PCM_S16LE


def encoder_for(encoding: int, rate: int, seed: int = 0) -> AudioEncoder | None:
    """The stream encoder of a G.711 or Opus request (None: PCM, converted per chunk); `seed`:
    the stream's (an Ogg stream's serial number comes from it)."""
    fmt = ENCODED.get(encoding)
    return AudioEncoder(fmt, rate, serial=seed) if fmt is not None else None


def chunk_message(chunk: AudioChunk, rate: int, encoding: int,
                  data: bytes | None = None) -> tts_pb2.SynthesizeResponse:
    """`data`: the chunk already encoded (encoder_for); else PCM from its samples."""
    if data is not None:
        pass
    elif encoding == tts_pb2.AUDIO_ENCODING_FLOAT32_LE:  # the proto promises [-1, 1] for FLOAT32 too
        data = np.clip(chunk.samples, -1.0, 1.0).astype("<f4").tobytes()
    else:
        data = s16(chunk.samples).tobytes()
    return tts_pb2.SynthesizeResponse(audio=tts_pb2.AudioChunk(
        audio=data, sample_rate_hz=rate, encoding=encoding, sequence_number=chunk.sequence_number,
        sample_offset=chunk.sample_offset, num_samples=int(chunk.samples.shape[0]),
        num_frames=chunk.num_frames))


def summary_message(end: StreamEnd, request_id: str, rate: int, ttfc_ms: float, wall_ms: float,
                    num_chunks: int, first_audio: dict | None = None) -> tts_pb2.SynthesizeResponse:
    audio_s = end.num_samples / rate
    return tts_pb2.SynthesizeResponse(summary=tts_pb2.SynthesisSummary(
        first_audio=tts_pb2.FirstAudioTimings(**(first_audio or {})),
        finish_reason=FINISH_REASONS.get(end.finish_reason, tts_pb2.FINISH_REASON_UNSPECIFIED),
        num_frames=end.num_frames, audio_seconds=audio_s, time_to_first_chunk_ms=ttfc_ms,
        wall_ms=wall_ms, real_time_factor=(wall_ms / 1000.0 / audio_s) if audio_s > 0 else 0.0,
        request_id=request_id, num_chunks=num_chunks))


# ---- StreamSynthesize -------------------------------------------------------------------------
CONTEXT_ID_RE = REQUEST_ID_RE
check_text = _check_text


def parse_stream_request(data: bytes) -> tts_pb2.StreamSynthesizeRequest | MalformedRequest:
    """Request deserializer for StreamSynthesize that never raises."""
    return _parse(tts_pb2.StreamSynthesizeRequest, data)


def to_context_request(msg: tts_pb2.ContextConfig, context_id: str, info: ModelInfo,
                       cfg: ServerConfig) -> SynthesisRequest:
    """Validate a context's config (SynthesizeRequest's checks, fields named `config.*`)."""
    if msg.encoding == tts_pb2.AUDIO_ENCODING_OGG_OPUS:
        raise InvalidRequest("config.encoding", "OGG_OPUS is one file per call: use Synthesize; "
                             "a context streams PCM_S16LE, FLOAT32_LE, MULAW or ALAW")
    if msg.HasField("reference") and msg.reference.transcript.strip():
        raise InvalidRequest("config.reference.transcript", "in-context cloning needs the whole text "
                             "before synthesis; leave the transcript empty (speaker-embedding cloning)")
    one_shot = tts_pb2.SynthesizeRequest(
        text="-", voice=msg.voice, language=msg.language, encoding=msg.encoding,
        sample_rate_hz=msg.sample_rate_hz, max_duration_s=msg.max_duration_s,
        request_id=msg.request_id or context_id)
    if msg.HasField("sampling"):
        one_shot.sampling.CopyFrom(msg.sampling)
    if msg.HasField("reference"):
        one_shot.reference.CopyFrom(msg.reference)
    try:
        req = to_request(one_shot, info, cfg)
    except InvalidRequest as e:
        raise InvalidRequest(f"config.{e.field}", str(e).split(": ", 1)[1]) from None
    max_s = msg.max_duration_s or cfg.max_duration_s
    return dataclasses.replace(req, text="", incremental=True, max_frames_from_text=not msg.max_duration_s,
                               max_frames=max(1, math.floor(max_s * info.frame_rate + 1e-3)))


def stream_chunk_message(context_id: str, chunk: AudioChunk, rate: int, encoding: int):
    data = None
    if encoding in ENCODED:  # G.711 (Opus is refused for contexts): each sample on its own
        encoder = encoder_for(encoding, rate)
        data = encoder.encode(chunk.samples) + encoder.finish()
    audio = chunk_message(chunk, rate, encoding, data).audio
    return tts_pb2.StreamSynthesizeResponse(context_id=context_id, audio=audio)


def done_message(context_id: str, end: StreamEnd | None, rate: int, ttfc_ms: float, wall_ms: float,
                 num_chunks: int, error: tuple[int, str] | None = None):
    """A context's last message; `error` (a google.rpc.Code value, message) for a failed one."""
    reasons = {**FINISH_REASONS, FinishReason.ERROR: tts_pb2.FINISH_REASON_ERROR,
               FinishReason.IDLE_TIMEOUT: tts_pb2.FINISH_REASON_IDLE_TIMEOUT}
    frames, samples = (end.num_frames, end.num_samples) if end is not None else (0, 0)
    reason = end.finish_reason if end is not None else FinishReason.ERROR
    if error is not None and reason is not FinishReason.IDLE_TIMEOUT:
        reason = FinishReason.ERROR
    audio_s = samples / rate
    return tts_pb2.StreamSynthesizeResponse(context_id=context_id, done=tts_pb2.ContextDone(
        finish_reason=reasons[reason], num_frames=frames, audio_seconds=audio_s,
        time_to_first_chunk_ms=ttfc_ms, wall_ms=wall_ms,
        real_time_factor=(wall_ms / 1000.0 / audio_s) if audio_s > 0 else 0.0, num_chunks=num_chunks,
        error_code=error[0] if error else 0, error_message=error[1] if error else ""))
