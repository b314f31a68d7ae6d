"""Start-up checks that need no model: each start-up mistake ends the server at once with one
line naming the flag (port taken, model folder that is not a Qwen3-TTS snapshot, CUDA or the
kernel library missing, half a TLS pair, unreadable files, nonsense numbers), not with a
traceback after the model has loaded."""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import ssl

from .config import ServerConfig
from .memory_plan import StartupError

DTYPES = ("auto", "float32", "bfloat16", "float16")
SYNTHETIC_MODELS = ("synthetic", "synthetic-base", "synthetic-tiny", "synthetic-tiny-base")
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def check(config: ServerConfig) -> None:
    """Raises StartupError with a one-line message for the first mistake found."""
    check_numbers(config)
    check_tls(config.tls_cert, config.tls_key)
    check_model(config.model)
    check_device(config.engine, config.device, config.dtype)
    check_frame_kernel(config)
    check_devices(config)
    check_port(config.host, config.port)
    if config.http_port is not None and config.http_port >= 0:
        check_http(config)
    check_event_loop(config.event_loop)


def check_event_loop(name: str) -> None:
    from . import aio

    if not aio.available(name):
        raise StartupError(f"--event-loop {name}: uvloop is not installed (pip install uvloop), "
                           "or --event-loop auto to use it only where it is")


def check_http(config: ServerConfig) -> None:
    """The HTTP API's libraries are installed and its port is free (and not --port)."""
    import importlib.util

    for module in ("aiohttp", "av"):
        if importlib.util.find_spec(module) is None:
            raise StartupError(f"--http-port {config.http_port}: the HTTP API needs {module} "
                               "(pip install -e '.[server]'), or --http-port -1 to run without it")
    if config.http_port > 0:
        if config.http_port == config.port:
            raise StartupError(f"--http-port {config.http_port} is also --port; give the HTTP API "
                               "its own port (or -1 to turn it off)")
        check_port(config.host, config.http_port, "--http-port")


def _at_least(flag: str, value, low, what: str = "") -> None:
    if value is not None and value < low:
        raise StartupError(f"{flag} must be at least {low}{what}, got {value:g}")


def check_numbers(c: ServerConfig) -> None:
    for flag, value, low in (("--max-streams", c.max_streams, 1), ("--max-queue", c.max_queue, 0),
                             ("--max-positions", c.max_positions, 64),
                             ("--max-text-chars", c.max_text_chars, 1),
                             ("--max-request-bytes", c.max_request_bytes, 1024),
                             ("--grace-period-s", c.grace_period_s, 0),
                             ("--drain-delay-s", c.drain_delay_s, 0),
                             ("--watchdog-s", c.watchdog_s, 0),
                             ("--player-preroll-ms", c.player_preroll_ms, 0),
                             ("--rpc-processes", c.rpc_processes, 1)):
        _at_least(flag, value, low)
    for flag, value in (("--max-queue-wait-s", c.max_queue_wait_s),
                        ("--max-buffer-s", c.max_buffer_s), ("--stall-timeout-s", c.stall_timeout_s),
                        ("--idle-text-timeout-s", c.idle_text_timeout_s),
                        ("--max-duration-s", c.max_duration_s)):
        if not value > 0:  # also NaN
            raise StartupError(f"{flag} must be a positive number of seconds, got {value:g}")
    if not 0 <= c.port <= 65535:
        raise StartupError(f"--port must be 0-65535 (0: any free port), got {c.port}")
    if c.metrics_port is not None and not -1 <= c.metrics_port <= 65535:
        raise StartupError(f"--metrics-port must be 0-65535, 0 for any free port or -1 for off, "
                           f"got {c.metrics_port}")
    if not c.chunk_frames or min(c.chunk_frames) < 1:
        raise StartupError(f"--chunk-frames must be positive frame counts such as 1,2,4,8, got "
                           f"{','.join(map(str, c.chunk_frames)) or 'nothing'}")


def _readable(flag: str, path: str) -> None:
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise StartupError(f"{flag} {path}: {e.strerror.lower()}") from None


def check_tls(cert: str | None, key: str | None) -> None:
    if not cert and not key:
        return
    if not (cert and key):
        given, missing = ("--tls-cert", "--tls-key") if cert else ("--tls-key", "--tls-cert")
        raise StartupError(f"{given} needs {missing} too (TLS takes a certificate chain and its "
                           f"private key)")
    for flag, path, marker, what in (("--tls-cert", cert, b"-----BEGIN CERTIFICATE-----",
                                      "PEM certificate"),
                                     ("--tls-key", key, b"PRIVATE KEY-----", "PEM private key")):
        _readable(flag, path)
        with open(path, "rb") as f:
            if marker not in f.read():
                raise StartupError(f"{flag} {path}: no {what} in this file")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=b"")
    except ssl.SSLError:
        raise StartupError(f"--tls-key {key} is not the private key of --tls-cert {cert} (or it "
                           f"is encrypted: the server needs an unencrypted key)") from None


def read_token_file(path: str) -> str:
    """The bearer token: the file's first line."""
    _readable("--auth-token-file", path)
    with open(path, encoding="utf-8", errors="replace") as f:
        token = f.readline().strip()
    if not token:
        raise StartupError(f"--auth-token-file {path}: the first line is empty")
    return token


def check_model(model: str) -> None:
    """A synthetic name, a Qwen3-TTS snapshot folder, or something shaped like a hub id."""
    if model in SYNTHETIC_MODELS:
        return
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        if _HUB_ID.match(model) and not model.startswith("."):
            return  # a hub id: the loader downloads it (its errors name the id)
        raise StartupError(f"--model {model}: no such folder, and not a hub id (org/name) or one "
                           f"of {', '.join(SYNTHETIC_MODELS)}")
    if not os.path.isdir(path):
        raise StartupError(f"--model {model}: not a folder (a Qwen3-TTS snapshot is a folder with "
                           f"config.json and speech_tokenizer/)")
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise StartupError(f"--model {model}: not a Qwen3-TTS snapshot (config.json: "
                           f"{getattr(e, 'strerror', None) or e})") from None
    if model_type != "qwen3_tts":
        raise StartupError(f"--model {model}: not a Qwen3-TTS snapshot (config.json has model_type "
                           f"{model_type!s}, expected qwen3_tts)")
    if not os.path.isdir(os.path.join(path, "speech_tokenizer")):
        raise StartupError(f"--model {model}: the snapshot lacks its speech_tokenizer/ folder "
                           f"(download the whole repository)")


def check_device(engine: str, device: str, dtype: str) -> None:
    if not _DEVICE.match(device):
        raise StartupError(f"--device must be auto, cpu, cuda or cuda:N, got {device}")
    if dtype not in DTYPES:
        raise StartupError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype}")
    wants_cuda = device.startswith("cuda") or engine in ("batched", "megakernel")
    if not wants_cuda:
        return
    if device == "cpu":
        raise StartupError(f"--engine {engine} runs on a CUDA GPU only; use --engine torch with "
                           f"--device cpu")
    import torch

    what = f"--device {device}" if device.startswith("cuda") else f"--engine {engine}"
    if not torch.cuda.is_available():
        raise StartupError(f"{what} needs a CUDA GPU, and torch sees none (torch {torch.__version__}, "
                           f"CUDA build {torch.version.cuda or 'none'}); use --engine torch "
                           f"--device cpu to run on the CPU")
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        raise StartupError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s)")
    if engine == "megakernel":
        from .engines import megakernel

        if not os.path.exists(os.environ.get("QMK_LIB", megakernel.CSRC / megakernel.LIB_NAME)):
            raise StartupError("--engine megakernel: the kernel library is not built; build it "
                               "with `make kernel` (needs nvcc), or use --engine batched")


def check_frame_kernel(config: ServerConfig) -> None:
    """--frame-kernel cuda / cuda-predict: the batched engine on a GPU, with its library built."""
    k = config.frame_kernel
    if k == "triton":
        return
    if config.engine in ("torch", "megakernel") or config.device == "cpu":
        raise StartupError(f"--frame-kernel {k} is a batched-engine option on a CUDA GPU; drop it or use "
                           f"--engine batched")
    import torch

    if not torch.cuda.is_available():
        raise StartupError(f"--frame-kernel {k} needs a CUDA GPU, and torch sees none")
    from .engines.batched import cuda_frame

    if not os.path.exists(os.environ.get("QBK_LIB", cuda_frame.CSRC / cuda_frame.LIB_NAME)):
        raise StartupError(f"--frame-kernel {k}: the batched kernel library is not built; build it with "
                           "`make kernel` (needs nvcc), or use --frame-kernel triton")


def check_devices(config: ServerConfig) -> None:
    """--devices names GPUs that exist, each once (see devices.resolve_placements)."""
    if config.devices is None:
        return
    import torch

    from .devices import resolve_placements

    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    placements = resolve_placements(config.device, config.devices, num_gpus)
    if len(placements) > 1 and config.engine == "megakernel":
        raise StartupError("--engine megakernel serves one GPU; use --engine batched with --devices")


def check_port(host: str, port: int, flag: str = "--port") -> None:
    """The gRPC (or HTTP) port is free on `host` (grpc itself would only say 'Failed to bind')."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise StartupError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpc binds
            try:
                s.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise StartupError(f"{flag} {port}: already in use on {host} (another "
                                       f"tts-server?); pick a free one or {flag} 0") from None
                if e.errno == errno.EADDRNOTAVAIL:
                    raise StartupError(f"--host {host}: not an address of this machine") from None
                if e.errno == errno.EACCES:
                    raise StartupError(f"{flag} {port}: permission denied (ports below 1024 need "
                                       f"privileges)") from None
                raise StartupError(f"--host {host} {flag} {port}: cannot listen ({e.strerror})") from None
