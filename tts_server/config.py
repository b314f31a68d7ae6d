"""Server configuration: one frozen dataclass, filled from the command line."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    model: str = "synthetic"  # synthetic[-tiny][-base], a local snapshot folder, or a hub id
    engine: str = "auto"  # auto | torch | megakernel
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16 | float16
    max_streams: int = 8  # concurrent synthesis streams (engine slots)
    max_queue: int = 0  # requests waiting for a slot beyond max_streams
    max_positions: int = 4096  # talker context per stream (prompt + frames)
    max_text_chars: int = 2000
    max_duration_s: float = 300.0  # upper bound of a request's audio
    chunk_frames: tuple[int, ...] = (1, 2, 4, 8)  # frames per chunk: first chunks small, then the last value
    grace_period_s: float = 10.0  # SIGTERM drain time
    default_voice: str | None = None  # CustomVoice speaker when a request names none
    seed: int | None = None  # base seed for requests without one (None: random)
    tls_cert: str | None = None  # PEM server certificate (chain); with tls_key enables TLS
    tls_key: str | None = None  # PEM private key
    auth_token: str | None = None  # when set, every RPC but health needs "authorization: Bearer <token>"
