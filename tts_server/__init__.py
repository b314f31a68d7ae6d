"""Streaming gRPC inference server for Qwen3-TTS."""

__version__ = "0.1.0"
