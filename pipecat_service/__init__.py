"""Pipecat integration: `QwenTTSService` (gRPC streaming TTS) and an example voice agent."""

from .service import QwenTTSService, QwenTTSSettings

__all__ = ["QwenTTSService", "QwenTTSSettings"]
