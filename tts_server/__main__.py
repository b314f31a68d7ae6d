"""`tts-server`: load a model and serve TextToSpeechService over gRPC."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import faulthandler
import logging
import os
import sys
import time

from tts_client.helpfmt import ArgumentParser

from . import aio, preflight
from .config import ServerConfig
from .memory_plan import StartupError
from .logs import quiet_imports, setup_logging

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class _ServerParser(ArgumentParser):
    """One-line usage errors; with --log-format json among the arguments, a JSON log record (so
    that stderr carries JSON lines only, as for every other start-up mistake)."""

    def parse_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_args(args, namespace)

    def error(self, message: str):
        argv = getattr(self, "_argv", [])
        wants_json = "--log-format=json" in argv or any(
            a == "--log-format" and b == "json" for a, b in zip(argv, argv[1:]))
        if wants_json:
            setup_logging("INFO", "json")
            logging.getLogger("tts_server").critical("cannot start: %s (see %s --help)", message, self.prog)
            self.exit(2)
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    d = ServerConfig()
    p = _ServerParser(prog="tts-server", description=__doc__)
    p.add_argument("--host", default=d.host,
                   help="listen address (0.0.0.0 or :: for every interface)")
    p.add_argument("--port", type=int, default=d.port, help="gRPC port (0: any free port)")
    p.add_argument("--model", default=d.model,
                   help="synthetic | synthetic-tiny | synthetic-base | synthetic-tiny-base | a local "
                        "Qwen3-TTS snapshot folder | a Hugging Face hub id (default: synthetic, "
                        "random weights = noise)")
    p.add_argument("--engine", default=d.engine, choices=["auto", "batched", "torch", "megakernel"],
                   help="decode engine (default auto: batched on CUDA, torch on CPU; megakernel: "
                        "one launch per stream and frame, lowest single-stream latency, no batching)")
    p.add_argument("--frame-kernel", default=d.frame_kernel, choices=["triton", "cuda-predict", "cuda"],
                   help="how the batched engine runs a frame: graphs of Triton kernels (default), or "
                        "persistent CUDA launches for all streams (csrc/batched/, built by make "
                        "kernel): the code-predictor half only (cuda-predict) or both halves (cuda). "
                        "Experimental: batch-invariant on an H100 but slower than the default at every "
                        "batch size (BENCHMARKS.md, session 15)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=d.engine_process,
                   help="run the model and engines in a child process, fed over a socket pair, so "
                        "that their Python and the RPC event loop's do not take turns on one GIL "
                        "(default: on when serving on a GPU, where it starts 256 streams' first "
                        "audio ~1.5x sooner; off on the CPU)")
    p.add_argument("--early-codec", action=argparse.BooleanOptionalAction, default=d.early_codec,
                   help="queue each step's codec on the frame's codes on the GPU as soon as the frame "
                        "is launched, instead of after they reach the host (the same bytes; batched "
                        "engine only; on by default: first audio ~0.3-0.5 ms sooner on an H100)")
    p.add_argument("--event-loop", default=d.event_loop, choices=aio.CHOICES,
                   help="the gRPC/HTTP servers' event loop: uvloop (less CPU per call) or asyncio's; "
                        "auto (default): uvloop where installed")
    p.add_argument("--rpc-processes", type=_count_or_auto, default=None, metavar="N|auto",
                   help="gRPC servers on --port, each a process of its own (the kernel spreads "
                        "client connections over them), so that call set-up and chunk writes use "
                        "several cores; with the engine process only. auto (default): on a GPU "
                        f"with the engine process one per {CORES_PER_RPC_PROCESS} CPU cores, at most "
                        f"{MAX_AUTO_RPC_PROCESSES} (a 256-call burst's first audio with no model "
                        "at all, p95 on an H100 host: 153-215 ms through one RPC process, ~50 ms "
                        "through four); else 1")
    p.add_argument("--device", default=d.device, help="auto | cpu | cuda | cuda:N (auto: cuda when "
                   "torch sees a GPU)")
    p.add_argument("--devices", default=d.devices,
                   help="GPUs to serve on, one engine each: 0,1,... or all (default: the first "
                        "GPU); requests go to the least-loaded engine with a free slot")
    p.add_argument("--dtype", default=d.dtype, choices=preflight.DTYPES,
                   help="model weights' dtype (auto: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--max-streams", type=int, default=d.max_streams,
                   help="concurrent streams (engine slots); default: on a GPU as many as fit in "
                        "memory up to 256, else 8. Checked against free device memory at start-up")
    p.add_argument("--max-queue", type=int, default=d.max_queue,
                   help="requests that may wait for a free stream (default: --max-streams); "
                        "beyond: RESOURCE_EXHAUSTED")
    p.add_argument("--max-positions", type=int, default=d.max_positions,
                   help="talker context per stream, prompt + frames (default %(default)s: "
                        "about 5 minutes of audio)")
    p.add_argument("--max-queue-wait-s", type=float, default=d.max_queue_wait_s,
                   help="a queued request gets RESOURCE_EXHAUSTED after waiting this long")
    p.add_argument("--max-buffer-s", type=float, default=d.max_buffer_s,
                   help="audio seconds a stream may run ahead of a slow client before it pauses")
    p.add_argument("--player-preroll-ms", type=float, default=d.player_preroll_ms,
                   help="audio a client's player buffers before playing (default %(default)g): new "
                        "requests are admitted only as fast as every running stream keeps that "
                        "much ahead, and in a burst of new calls, streams whose players are still "
                        "pre-rolling sit out admission steps; lower it for players with a smaller "
                        "jitter buffer (0: a player that plays the first byte at once)")
    p.add_argument("--idle-text-timeout-s", type=float, default=d.idle_text_timeout_s,
                   help="end a StreamSynthesize context that got no text and no end for this long")
    p.add_argument("--stall-timeout-s", type=float, default=d.stall_timeout_s,
                   help="end a stream whose client has read nothing for this long")
    p.add_argument("--watchdog-s", type=float, default=d.watchdog_s,
                   help="an engine step hung this long: health NOT_SERVING, exit status 70 (0: off)")
    p.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                   help="largest request message (reference audio included); larger: "
                        "RESOURCE_EXHAUSTED")
    p.add_argument("--metrics-port", type=int, default=9464,
                   help="Prometheus /metrics on --host:PORT (0: any free port, -1: off)")
    p.add_argument("--http-port", type=int, default=8000,
                   help="OpenAI-compatible HTTP speech API (POST /v1/audio/speech) on --host:PORT, "
                        "same engine, limits, auth and TLS as gRPC (0: any free port, -1: off)")
    p.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="text, or one JSON object per line on stderr (nothing else is written)")
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                   help="least severe level logged")
    p.add_argument("--inject-fault", help=argparse.SUPPRESS)  # tests only: testing/faults.py
    p.add_argument("--max-text-chars", type=int, default=d.max_text_chars,
                   help="longest request text in characters; longer: INVALID_ARGUMENT")
    p.add_argument("--max-duration-s", type=float, default=d.max_duration_s,
                   help="largest max_duration_s a request may ask for")
    p.add_argument("--chunk-frames", default=",".join(map(str, d.chunk_frames)),
                   help="frames (80 ms each) per audio chunk, first chunks first; the last value "
                        "repeats")
    p.add_argument("--grace-period-s", type=float, default=d.grace_period_s,
                   help="on SIGTERM: health NOT_SERVING, new calls refused, in-flight streams get "
                        "this long to finish")
    p.add_argument("--drain-delay-s", type=float, default=d.drain_delay_s,
                   help="on SIGTERM: health NOT_SERVING at once but new calls still taken this long, "
                        "so that load balancers polling health stop sending first; then the "
                        "--grace-period-s drain (default 0; behind a proxy: above its check "
                        "interval x fall count)")
    p.add_argument("--default-voice", default=None,
                   help="voice of requests that name none (default: the model's first voice)")
    p.add_argument("--tls-cert", help="PEM certificate chain; with --tls-key serves TLS "
                   "(default: plaintext)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert (default: none)")
    p.add_argument("--auth-token-file",
                   help="require 'authorization: Bearer <token>' on every RPC but health; the token "
                        "is this file's first line (default: $TTS_AUTH_TOKEN if set, else no auth)")
    return p


def _chunk_frames(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise StartupError(f"--chunk-frames must be comma-separated frame counts such as 1,2,4,8, "
                           f"got {text}") from None


# --rpc-processes auto: a burst of 256 calls, no model (scripts/cpu_frontend_profile.py on a
# 16-core H100 host, BENCHMARKS.md session 27): first audio p95 153-215 ms with one RPC
# process, 89-99 with two, 50-52 with four; the engine process keeps cores for its own threads
CORES_PER_RPC_PROCESS = 4
MAX_AUTO_RPC_PROCESSES = 4


def _count_or_auto(text: str) -> int | None:
    if text.strip().lower() == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or auto, got {text!r}") from None


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def resolve_rpc_processes(config: ServerConfig) -> ServerConfig:
    """--rpc-processes auto -> a number: serving on a GPU with the engine process, one RPC
    process per CORES_PER_RPC_PROCESS usable cores, 1 to MAX_AUTO_RPC_PROCESSES; otherwise 1
    (a CPU engine, whose own pace bounds a burst, keeps the cores)."""
    if config.rpc_processes is not None:
        return config
    n = 1
    if uses_engine_process(config) and serves_on_gpu(config):
        n = max(1, min(MAX_AUTO_RPC_PROCESSES, usable_cores() // CORES_PER_RPC_PROCESS))
    return dataclasses.replace(config, rpc_processes=n)


def parse_args(argv=None) -> ServerConfig:
    """The server's configuration from the command line; sets up logging. Raises StartupError
    (one line) for an unreadable token file or a malformed --chunk-frames."""
    a = build_parser().parse_args(argv)
    setup_logging(a.log_level, a.log_format)
    token = os.environ.get("TTS_AUTH_TOKEN") or None
    if a.auth_token_file:
        token = preflight.read_token_file(a.auth_token_file)
    return ServerConfig(
        host=a.host, port=a.port, model=a.model, engine=a.engine, frame_kernel=a.frame_kernel, device=a.device,
        devices=a.devices,
        dtype=a.dtype,
        max_streams=a.max_streams, max_queue=a.max_queue, max_positions=a.max_positions,
        max_text_chars=a.max_text_chars,
        max_duration_s=a.max_duration_s,
        chunk_frames=_chunk_frames(a.chunk_frames),
        grace_period_s=a.grace_period_s, drain_delay_s=a.drain_delay_s, default_voice=a.default_voice,
        tls_cert=a.tls_cert, tls_key=a.tls_key, auth_token=token,
        max_queue_wait_s=a.max_queue_wait_s, max_buffer_s=a.max_buffer_s,
        player_preroll_ms=a.player_preroll_ms,
        stall_timeout_s=a.stall_timeout_s, watchdog_s=a.watchdog_s,
        idle_text_timeout_s=a.idle_text_timeout_s,
        max_request_bytes=a.max_request_bytes, metrics_port=a.metrics_port, http_port=a.http_port,
        engine_process=a.engine_process, rpc_processes=a.rpc_processes, early_codec=a.early_codec, event_loop=a.event_loop, log_level=a.log_level, log_format=a.log_format,
        inject_fault=a.inject_fault)


def serves_on_gpu(config: ServerConfig) -> bool:
    """--device cuda[:N] or --devices, or --device auto on a machine where torch sees a GPU."""
    if config.device.startswith("cuda") or config.devices:
        return True
    if config.device != "auto":
        return False
    import torch

    return torch.cuda.is_available()


def uses_engine_process(config: ServerConfig) -> bool:
    """--engine-process as given, else on when the server's device is a GPU or there are
    several RPC processes."""
    if config.engine_process is not None:
        return config.engine_process
    return config.several_rpc_processes or serves_on_gpu(config)


async def _serve(config: ServerConfig) -> int:
    from .rpc.server import TTSServer

    log = logging.getLogger("tts_server")
    auto = config.rpc_processes is None
    config = resolve_rpc_processes(config)
    if auto and config.rpc_processes > 1:
        log.info("--rpc-processes auto: %d (%d usable CPU cores)", config.rpc_processes, usable_cores())
    if uses_engine_process(config):
        from .serving.remote import RemoteWorker

        proc, conns = RemoteWorker.spawn(config)  # from the main thread: see spawn()
        worker = await asyncio.to_thread(RemoteWorker.connect, proc, conns[0],
                                         config.rpc_processes == 1)
        worker.spare_pipes = conns[1:]  # the extra RPC processes' (started once we listen)
        worker.start()
        info = worker.info
    elif config.rpc_processes > 1:
        raise StartupError(f"--rpc-processes {config.rpc_processes} needs the engine process; "
                           "drop --no-engine-process")
    else:
        with quiet_imports():  # qwen-tts's import-time banner and its unused sox dependency's noise
            import qwen_tts  # noqa: F401
        from .app import build_app

        app = await asyncio.to_thread(build_app, config)
        worker, info = app.worker, app.info
    # no full collection over the model's objects stops every stream mid-burst
    log.info("%d start-up objects frozen out of the garbage collector", aio.freeze_start_up_objects())
    log.info("model %s (%s, %s) engine=%s device=%s dtype=%s voices=%s", info.name,
             info.model_type, info.model_size, info.engine, info.device, info.dtype,
             ",".join(info.voices) or "(clone from reference)")
    if info.is_synthetic:
        log.warning("!" * 20 + " " + info.warning + " " + "!" * 20)
    took = time.monotonic() - _STARTED[0]
    if info.device.startswith("cuda"):
        # most of a first start on a machine is Triton compiling the kernels (BENCHMARKS.md)
        log.info("start-up took %.0f s; the compiled Triton kernels are cached in %s for the next start "
                 "(keep that folder across restarts, e.g. a volume in a container)", took, triton_cache_dir(),
                 extra={"startup_s": round(took, 1)})
    else:
        log.info("start-up took %.0f s", took, extra={"startup_s": round(took, 1)})
    if config.watchdog_s > 0:
        # Backstop for a hang the Python watchdog cannot act on (a thread holding the GIL): the
        # watchdog thread re-arms this on every poll; if it stops polling, faulthandler dumps
        # every thread's stack and exits the process.
        worker.watchdog_tick = lambda: faulthandler.dump_traceback_later(
            config.watchdog_s + 30.0, exit=True)
    return await TTSServer(worker, info, config).serve_forever()


_STARTED = [time.monotonic()]  # main() sets it again: start-up is timed from there


def triton_cache_dir() -> str:
    """Where Triton keeps compiled kernels: TRITON_CACHE_DIR, else .triton/cache under TRITON_HOME
    or the home folder (triton.knobs.cache.dir, without importing Triton here)."""
    home = os.environ.get("TRITON_HOME") or os.path.expanduser("~")
    return os.environ.get("TRITON_CACHE_DIR") or os.path.join(home, ".triton", "cache")


def main(argv=None) -> None:
    _STARTED[0] = time.monotonic()
    if os.environ.get("TTS_GIL_SWITCH_MS"):  # experiments only: Python's 5 ms default measured best
        sys.setswitchinterval(float(os.environ["TTS_GIL_SWITCH_MS"]) / 1e3)  # (scripts/gpu_gil_ab.sh)
    try:
        config = parse_args(argv)
        preflight.check(config)
        code = aio.run(_serve(config), config.event_loop)
    except StartupError as e:
        logging.getLogger("tts_server").critical("cannot start: %s", e)
        raise SystemExit(2) from None
    faulthandler.cancel_dump_traceback_later()
    if code:
        logging.shutdown()
        os._exit(code)  # the engine thread may be stuck in a device call; do not join it


if __name__ == "__main__":
    main()
