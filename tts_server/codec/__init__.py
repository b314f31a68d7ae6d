"""Qwen3-TTS 12 Hz codec decoding: exact stateful streaming (`streaming`) and the one-piece oracle (`offline`)."""

from .streaming import CodecState, StreamingCodecDecoder

__all__ = ["CodecState", "StreamingCodecDecoder"]
