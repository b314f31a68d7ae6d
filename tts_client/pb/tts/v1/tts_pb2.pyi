from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AudioEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AUDIO_ENCODING_UNSPECIFIED: _ClassVar[AudioEncoding]
    AUDIO_ENCODING_PCM_S16LE: _ClassVar[AudioEncoding]
    AUDIO_ENCODING_FLOAT32_LE: _ClassVar[AudioEncoding]
    AUDIO_ENCODING_MULAW: _ClassVar[AudioEncoding]
    AUDIO_ENCODING_ALAW: _ClassVar[AudioEncoding]
    AUDIO_ENCODING_OGG_OPUS: _ClassVar[AudioEncoding]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_MAX_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
    FINISH_REASON_IDLE_TIMEOUT: _ClassVar[FinishReason]
AUDIO_ENCODING_UNSPECIFIED: AudioEncoding
AUDIO_ENCODING_PCM_S16LE: AudioEncoding
AUDIO_ENCODING_FLOAT32_LE: AudioEncoding
AUDIO_ENCODING_MULAW: AudioEncoding
AUDIO_ENCODING_ALAW: AudioEncoding
AUDIO_ENCODING_OGG_OPUS: AudioEncoding
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_MAX_LENGTH: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_ERROR: FinishReason
FINISH_REASON_IDLE_TIMEOUT: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "repetition_penalty", "seed", "greedy", "subtalker_temperature", "subtalker_top_k", "subtalker_top_p")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    GREEDY_FIELD_NUMBER: _ClassVar[int]
    SUBTALKER_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SUBTALKER_TOP_K_FIELD_NUMBER: _ClassVar[int]
    SUBTALKER_TOP_P_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    seed: int
    greedy: bool
    subtalker_temperature: float
    subtalker_top_k: int
    subtalker_top_p: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., greedy: _Optional[bool] = ..., subtalker_temperature: _Optional[float] = ..., subtalker_top_k: _Optional[int] = ..., subtalker_top_p: _Optional[float] = ...) -> None: ...

class VoiceCloneReference(_message.Message):
    __slots__ = ("audio", "transcript")
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    audio: bytes
    transcript: str
    def __init__(self, audio: _Optional[bytes] = ..., transcript: _Optional[str] = ...) -> None: ...

class SynthesizeRequest(_message.Message):
    __slots__ = ("text", "voice", "language", "encoding", "sample_rate_hz", "sampling", "max_duration_s", "reference", "request_id")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    VOICE_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_DURATION_S_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    text: str
    voice: str
    language: str
    encoding: AudioEncoding
    sample_rate_hz: int
    sampling: SamplingParams
    max_duration_s: float
    reference: VoiceCloneReference
    request_id: str
    def __init__(self, text: _Optional[str] = ..., voice: _Optional[str] = ..., language: _Optional[str] = ..., encoding: _Optional[_Union[AudioEncoding, str]] = ..., sample_rate_hz: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_duration_s: _Optional[float] = ..., reference: _Optional[_Union[VoiceCloneReference, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class AudioChunk(_message.Message):
    __slots__ = ("audio", "sample_rate_hz", "encoding", "sequence_number", "sample_offset", "num_samples", "num_frames")
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    audio: bytes
    sample_rate_hz: int
    encoding: AudioEncoding
    sequence_number: int
    sample_offset: int
    num_samples: int
    num_frames: int
    def __init__(self, audio: _Optional[bytes] = ..., sample_rate_hz: _Optional[int] = ..., encoding: _Optional[_Union[AudioEncoding, str]] = ..., sequence_number: _Optional[int] = ..., sample_offset: _Optional[int] = ..., num_samples: _Optional[int] = ..., num_frames: _Optional[int] = ...) -> None: ...

class SynthesisSummary(_message.Message):
    __slots__ = ("finish_reason", "num_frames", "audio_seconds", "time_to_first_chunk_ms", "wall_ms", "real_time_factor", "request_id", "num_chunks", "first_audio")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_CHUNK_MS_FIELD_NUMBER: _ClassVar[int]
    WALL_MS_FIELD_NUMBER: _ClassVar[int]
    REAL_TIME_FACTOR_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    FIRST_AUDIO_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    num_frames: int
    audio_seconds: float
    time_to_first_chunk_ms: float
    wall_ms: float
    real_time_factor: float
    request_id: str
    num_chunks: int
    first_audio: FirstAudioTimings
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., num_frames: _Optional[int] = ..., audio_seconds: _Optional[float] = ..., time_to_first_chunk_ms: _Optional[float] = ..., wall_ms: _Optional[float] = ..., real_time_factor: _Optional[float] = ..., request_id: _Optional[str] = ..., num_chunks: _Optional[int] = ..., first_audio: _Optional[_Union[FirstAudioTimings, _Mapping]] = ...) -> None: ...

class FirstAudioTimings(_message.Message):
    __slots__ = ("queue_ms", "prefill_ms", "first_frame_ms", "first_decode_ms", "write_ms", "prepare_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_FRAME_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    WRITE_MS_FIELD_NUMBER: _ClassVar[int]
    PREPARE_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    prefill_ms: float
    first_frame_ms: float
    first_decode_ms: float
    write_ms: float
    prepare_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., first_frame_ms: _Optional[float] = ..., first_decode_ms: _Optional[float] = ..., write_ms: _Optional[float] = ..., prepare_ms: _Optional[float] = ...) -> None: ...

class SynthesizeResponse(_message.Message):
    __slots__ = ("audio", "summary")
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    audio: AudioChunk
    summary: SynthesisSummary
    def __init__(self, audio: _Optional[_Union[AudioChunk, _Mapping]] = ..., summary: _Optional[_Union[SynthesisSummary, _Mapping]] = ...) -> None: ...

class StreamSynthesizeRequest(_message.Message):
    __slots__ = ("context_id", "config", "text", "flush", "end", "cancel")
    CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FLUSH_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    context_id: str
    config: ContextConfig
    text: str
    flush: Flush
    end: End
    cancel: Cancel
    def __init__(self, context_id: _Optional[str] = ..., config: _Optional[_Union[ContextConfig, _Mapping]] = ..., text: _Optional[str] = ..., flush: _Optional[_Union[Flush, _Mapping]] = ..., end: _Optional[_Union[End, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ...) -> None: ...

class ContextConfig(_message.Message):
    __slots__ = ("voice", "language", "encoding", "sample_rate_hz", "sampling", "max_duration_s", "reference", "request_id")
    VOICE_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_DURATION_S_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    voice: str
    language: str
    encoding: AudioEncoding
    sample_rate_hz: int
    sampling: SamplingParams
    max_duration_s: float
    reference: VoiceCloneReference
    request_id: str
    def __init__(self, voice: _Optional[str] = ..., language: _Optional[str] = ..., encoding: _Optional[_Union[AudioEncoding, str]] = ..., sample_rate_hz: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_duration_s: _Optional[float] = ..., reference: _Optional[_Union[VoiceCloneReference, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class Flush(_message.Message):
    __slots__ = ("flush_id",)
    FLUSH_ID_FIELD_NUMBER: _ClassVar[int]
    flush_id: str
    def __init__(self, flush_id: _Optional[str] = ...) -> None: ...

class End(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Cancel(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StreamSynthesizeResponse(_message.Message):
    __slots__ = ("context_id", "audio", "words", "flush_ack", "done")
    CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    WORDS_FIELD_NUMBER: _ClassVar[int]
    FLUSH_ACK_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    context_id: str
    audio: AudioChunk
    words: WordTimings
    flush_ack: FlushAck
    done: ContextDone
    def __init__(self, context_id: _Optional[str] = ..., audio: _Optional[_Union[AudioChunk, _Mapping]] = ..., words: _Optional[_Union[WordTimings, _Mapping]] = ..., flush_ack: _Optional[_Union[FlushAck, _Mapping]] = ..., done: _Optional[_Union[ContextDone, _Mapping]] = ...) -> None: ...

class WordTiming(_message.Message):
    __slots__ = ("word", "sample_offset")
    WORD_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    word: str
    sample_offset: int
    def __init__(self, word: _Optional[str] = ..., sample_offset: _Optional[int] = ...) -> None: ...

class WordTimings(_message.Message):
    __slots__ = ("words",)
    WORDS_FIELD_NUMBER: _ClassVar[int]
    words: _containers.RepeatedCompositeFieldContainer[WordTiming]
    def __init__(self, words: _Optional[_Iterable[_Union[WordTiming, _Mapping]]] = ...) -> None: ...

class FlushAck(_message.Message):
    __slots__ = ("flush_id",)
    FLUSH_ID_FIELD_NUMBER: _ClassVar[int]
    flush_id: str
    def __init__(self, flush_id: _Optional[str] = ...) -> None: ...

class ContextDone(_message.Message):
    __slots__ = ("finish_reason", "num_frames", "audio_seconds", "time_to_first_chunk_ms", "wall_ms", "real_time_factor", "num_chunks", "error_code", "error_message")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_CHUNK_MS_FIELD_NUMBER: _ClassVar[int]
    WALL_MS_FIELD_NUMBER: _ClassVar[int]
    REAL_TIME_FACTOR_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    num_frames: int
    audio_seconds: float
    time_to_first_chunk_ms: float
    wall_ms: float
    real_time_factor: float
    num_chunks: int
    error_code: int
    error_message: str
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., num_frames: _Optional[int] = ..., audio_seconds: _Optional[float] = ..., time_to_first_chunk_ms: _Optional[float] = ..., wall_ms: _Optional[float] = ..., real_time_factor: _Optional[float] = ..., num_chunks: _Optional[int] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class ListVoicesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Voice(_message.Message):
    __slots__ = ("name", "languages", "is_default")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LANGUAGES_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    name: str
    languages: _containers.RepeatedScalarFieldContainer[str]
    is_default: bool
    def __init__(self, name: _Optional[str] = ..., languages: _Optional[_Iterable[str]] = ..., is_default: _Optional[bool] = ...) -> None: ...

class ListVoicesResponse(_message.Message):
    __slots__ = ("voices", "languages", "requires_reference")
    VOICES_FIELD_NUMBER: _ClassVar[int]
    LANGUAGES_FIELD_NUMBER: _ClassVar[int]
    REQUIRES_REFERENCE_FIELD_NUMBER: _ClassVar[int]
    voices: _containers.RepeatedCompositeFieldContainer[Voice]
    languages: _containers.RepeatedScalarFieldContainer[str]
    requires_reference: bool
    def __init__(self, voices: _Optional[_Iterable[_Union[Voice, _Mapping]]] = ..., languages: _Optional[_Iterable[str]] = ..., requires_reference: _Optional[bool] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model", "model_type", "model_size", "is_synthetic", "warning", "engine", "device", "dtype", "native_sample_rate_hz", "frame_rate_hz", "max_text_chars", "max_concurrent_streams", "max_duration_s", "server_version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    IS_SYNTHETIC_FIELD_NUMBER: _ClassVar[int]
    WARNING_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NATIVE_SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    FRAME_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    MAX_TEXT_CHARS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_STREAMS_FIELD_NUMBER: _ClassVar[int]
    MAX_DURATION_S_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_type: str
    model_size: str
    is_synthetic: bool
    warning: str
    engine: str
    device: str
    dtype: str
    native_sample_rate_hz: int
    frame_rate_hz: float
    max_text_chars: int
    max_concurrent_streams: int
    max_duration_s: float
    server_version: str
    def __init__(self, model: _Optional[str] = ..., model_type: _Optional[str] = ..., model_size: _Optional[str] = ..., is_synthetic: _Optional[bool] = ..., warning: _Optional[str] = ..., engine: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., native_sample_rate_hz: _Optional[int] = ..., frame_rate_hz: _Optional[float] = ..., max_text_chars: _Optional[int] = ..., max_concurrent_streams: _Optional[int] = ..., max_duration_s: _Optional[float] = ..., server_version: _Optional[str] = ...) -> None: ...
