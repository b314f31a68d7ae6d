"""Server configuration: one frozen dataclass, filled from the command line."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    model: str = "synthetic"  # synthetic[-tiny][-base], a local snapshot folder, or a hub id
    engine: str = "auto"  # auto (batched on CUDA, torch on CPU) | batched | torch | megakernel
    frame_kernel: str = "triton"  # batched engine's frame: triton (graphs) | cuda-predict | cuda (csrc/batched/)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    devices: str | None = None  # "0,1,..." or "all": one engine per GPU (None: one on `device`)
    dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16 | float16
    max_streams: int | None = None  # engine slots; None: what fits on a GPU (up to 256), 8 on CPU
    max_queue: int | None = None  # requests waiting beyond max_streams (None: max_streams); more: RESOURCE_EXHAUSTED
    max_queue_wait_s: float = 5.0  # a queued request gets RESOURCE_EXHAUSTED after this long
    max_positions: int = 4096  # talker context per stream (prompt + frames)
    max_text_chars: int = 2000
    max_duration_s: float = 300.0  # upper bound of a request's audio
    chunk_frames: tuple[int, ...] = (1, 2, 4, 8)  # frames per chunk: first chunks small, then the last value
    grace_period_s: float = 10.0  # SIGTERM drain time
    drain_delay_s: float = 0.0  # after SIGTERM: NOT_SERVING but still taking calls this long
    max_buffer_s: float = 10.0  # audio a stream may run ahead of its client before it pauses
    # audio a client's player buffers before it starts playing: admissions are scheduled so that
    # no running stream's player runs dry with this much pre-roll (what the bench's underruns assume)
    player_preroll_ms: float = 200.0
    idle_text_timeout_s: float = 10.0  # a StreamSynthesize context with no text and no end this long ends
    stall_timeout_s: float = 30.0  # a client that reads nothing for this long is cut off
    watchdog_s: float = 30.0  # an engine step or prefill running longer is a hang: exit non-zero
    max_request_bytes: int = 64 * 1024 * 1024  # a 30 s reference WAV at 48 kHz stereo float fits
    metrics_port: int | None = None  # Prometheus /metrics on host:port (0: any free port)
    http_port: int | None = None  # OpenAI-compatible HTTP API on host:port (0: any free; None/-1: off)
    default_voice: str | None = None  # CustomVoice speaker when a request names none
    seed: int | None = None  # base seed for requests without one (None: random)
    tls_cert: str | None = None  # PEM server certificate (chain); with tls_key enables TLS
    tls_key: str | None = None  # PEM private key
    auth_token: str | None = None  # when set, every RPC but health needs "authorization: Bearer <token>"
    # the engines in a process of their own, fed over a socket pair (serving/remote.py), so that
    # their Python and the RPC event loop's do not share one GIL; None: on when serving on a GPU
    engine_process: bool | None = None
    # gRPC servers on the port, each a process of its own (SO_REUSEPORT), with the engine process;
    # None: auto (the command line's default, __main__.resolve_rpc_processes: several on a GPU)
    rpc_processes: int | None = 1
    # each step's codec queued on the frame's codes on the device as soon as the frame is launched
    # (the batched engine's on_launch), not after they reach the host; the same bytes. On an H100
    # it took a c = 1 stream's first decode from 1.8 to 1.5 ms (BENCHMARKS.md, session 21).
    early_codec: bool = True
    event_loop: str = "auto"  # the servers' event loop (aio.py): auto (uvloop where installed) | uvloop | asyncio
    log_level: str = "INFO"  # (the engine process sets its logging up as the server's)
    log_format: str = "text"
    inject_fault: str | None = None  # testing only: see engine/faults.py

    @property
    def several_rpc_processes(self) -> bool:
        """More than one RPC process: they share --port and --http-port (SO_REUSEPORT), where
        one process alone keeps its ports to itself."""
        return (self.rpc_processes or 1) > 1
