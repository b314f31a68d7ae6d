"""Wiring: model -> decode engine + streaming codec -> worker (one per `--devices` device,
pooled) -> ModelInfo."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from .api import ModelInfo
from .config import ServerConfig
from .devices import Placement, resolve_placements
from .memory_plan import StartupError, plan_streams
from .metrics import Metrics
from .serving import warm_up
from .serving.loop import Worker
from .serving.pool import EnginePool
from .model.loader import LoadedModel, load_model
from .model.prompt import project_vocabulary
from .model.weights import decode_weights

log = logging.getLogger(__name__)

def megakernel_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from .engines import megakernel

        return megakernel.is_available()
    except Exception as e:  # noqa: BLE001 - fall back to torch, but say why
        log.warning("megakernel engine unavailable: %s", e)
        return False


CPU_STREAMS = 8


def create_engine(name: str, loaded: LoadedModel, config: ServerConfig):
    engine = _create_engine(resolve_engine(name, loaded), loaded, config)
    if config.inject_fault:
        from .testing.faults import FaultInjectingEngine

        log.warning("FAULT INJECTION ON (testing only): %s", config.inject_fault)
        engine = FaultInjectingEngine(engine, config.inject_fault)
    return engine


def resolve_engine(name: str, loaded: LoadedModel) -> str:
    if name == "auto":
        return "batched" if loaded.device.type == "cuda" else "torch"
    if name not in ("batched", "torch", "megakernel"):
        raise StartupError(f"unknown engine {name!r}; choose auto, batched, torch or megakernel")
    if name in ("batched", "megakernel") and loaded.device.type != "cuda":
        raise StartupError(f"--engine {name} needs a CUDA device")
    return name


def plan_memory(name: str, loaded: LoadedModel, config: ServerConfig, weights) -> int:
    """The number of slots to create: --max-streams if its memory fits (else a StartupError
    that says how many fit); by default what fits on a GPU up to 256, or 8 on the CPU."""
    if loaded.device.type != "cuda" or name != "batched":
        n = config.max_streams or CPU_STREAMS
        if n < 1:
            raise StartupError(f"--max-streams must be at least 1, got {n}")
        return n
    from .codec.batched import BatchedCodecDecoder
    from .engines.batched.engine import BatchedEngine

    decoder = loaded.model.speech_tokenizer.model.decoder
    codec_dtype = codec_dtype_for(loaded)

    def need(n: int) -> int:
        return (BatchedEngine.memory_bytes(n, config.max_positions, weights, frame_kernel=config.frame_kernel)
                + BatchedCodecDecoder.memory_bytes(decoder, n, codec_dtype))

    free, _ = torch.cuda.mem_get_info(loaded.device)
    plan = plan_streams(need, free, config.max_streams)
    log.info("memory plan: %s", plan.describe())
    return plan.max_streams


def codec_dtype_for(loaded: LoadedModel) -> torch.dtype:
    return torch.bfloat16 if loaded.device.type == "cuda" else torch.float32


def _create_engine(name: str, loaded: LoadedModel, config: ServerConfig):
    weights = decode_weights(loaded.model)
    n = plan_memory(name, loaded, config, weights)
    if name == "batched":
        from .engines.batched.engine import BatchedEngine

        from .engines.batched.cuda_frame import is_available as cuda_frame_available

        if config.frame_kernel != "triton" and not cuda_frame_available():
            raise StartupError(f"--frame-kernel {config.frame_kernel}: the batched kernel library is not built "
                               "(make kernel) or there is no CUDA device")
        engine = BatchedEngine(weights, n, config.max_positions, frame_kernel=config.frame_kernel)
        log.info("batched engine: %d slots, frame kernels %s, %s GEMM matrices, graphs captured in %.1f s "
                 "(%.2f GiB); small-batch kernel %s; its talker layers %s; decode attention kernel %s", n,
                 config.frame_kernel, str(engine.gemm_dtype).removeprefix("torch."), engine.capture_s,
                 engine.graph_memory_bytes / 2**30, engine.small_kernel, engine.talker_kernel, engine.attn_kernel)
        return engine
    if name == "torch":
        from .engines.torch_ref import TorchEngine

        return TorchEngine(weights, n, config.max_positions)
    if not megakernel_available():
        raise StartupError("--engine megakernel: the kernel library is not built or the GPU cannot "
                           "hold its grid (build it with `make kernel`)")
    from .engines.megakernel import MegakernelEngine

    return MegakernelEngine(weights, n, config.max_positions)


def create_codec(loaded: LoadedModel, max_slots: int):
    """The streaming codec: one batched decode step for every stream that made a frame (bf16
    with CUDA graphs per batch bucket on a GPU, fp32 on the CPU)."""
    from .codec.batched import BatchedCodecDecoder

    codec = BatchedCodecDecoder(loaded.model.speech_tokenizer.model.decoder, max_slots,
                                dtype=codec_dtype_for(loaded))
    if codec.use_graphs:
        log.info("codec: %d slots, %s, graphs for %d batch sizes captured in %.1f s (%.2f GiB)",
                 max_slots, str(codec.dtype).removeprefix("torch."), len(codec.buckets),
                 codec.capture_s, codec.graph_memory_bytes / 2**30)
    return codec


@dataclass
class App:
    loaded: LoadedModel  # the first engine's model
    worker: Worker | EnginePool  # what the server submits to: the Worker, or a pool of several
    info: ModelInfo


def build_worker(config: ServerConfig, loaded: LoadedModel, metrics: Metrics, label: str) -> Worker:
    """One engine, its codec and the engine thread that owns them, on loaded.device."""
    if loaded.device.type == "cuda":
        # the codec runs in fp32; TF32 convolutions put streamed audio ~5e-3 off the exact decode
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        if loaded.device.index is not None:
            torch.cuda.set_device(loaded.device)  # graphs are captured on the current device
        if loaded.text_table is None:  # before the memory plan, which then counts it
            t0 = time.perf_counter()
            loaded.text_table = project_vocabulary(loaded.model)
            log.info("text projection of all %d token ids precomputed in %.1f s (%.0f MiB)",
                     loaded.text_table.shape[0], time.perf_counter() - t0,
                     loaded.text_table.numel() * loaded.text_table.element_size() / 2**20)
    engine = create_engine(config.engine, loaded, config)
    codec = create_codec(loaded, engine.max_streams)
    worker = Worker(loaded, engine, codec, config, metrics=metrics, label=label)
    if loaded.device.type == "cuda":
        worker.preparer.builder.warm_up()
    return worker


def _model_for(placement: Placement, config: ServerConfig, loaded: LoadedModel | None) -> LoadedModel:
    """A caller's model serves the placements on its own device (the CPU engines of a test share
    one read-only model); every GPU loads its own copy."""
    if loaded is not None and torch.device(placement.device) == loaded.device:
        return loaded
    return load_model(config.model, placement.device, config.dtype)


def build_app(config: ServerConfig, loaded: LoadedModel | None = None) -> App:
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = config.device if loaded is None or config.devices else str(loaded.device)
    placements = resolve_placements(device, config.devices, num_gpus)
    if len(placements) > 1 and config.engine == "megakernel":
        raise StartupError("--engine megakernel serves one GPU; use --engine batched with --devices")
    metrics = Metrics()
    workers = []
    for p in placements:
        loaded_p = _model_for(p, config, loaded)
        workers.append(build_worker(config, loaded_p, metrics, p.label))
        loaded = loaded or loaded_p
    if len(workers) > 1:
        log.info("%d engines: %s (%d slots in all)", len(workers),
                 ", ".join(f"{w.label}: {w.max_streams} slots" for w in workers),
                 sum(w.max_streams for w in workers))
    engine, codec = workers[0].engine, workers[0].codec
    voices = tuple(loaded.speakers)
    default_voice = None
    if voices:
        default_voice = (config.default_voice or voices[0]).lower()
        if default_voice not in voices:
            raise StartupError(f"--default-voice {config.default_voice}: the model has no such "
                               f"voice; choose one of {', '.join(voices)}")
    info = ModelInfo(
        name=config.model, model_type=loaded.model_type, model_size=loaded.model.tts_model_size,
        is_synthetic=loaded.is_synthetic, warning=loaded.warning, engine=engine.name,
        device=",".join(w.label for w in workers) if len(workers) > 1 else str(loaded.device),
        dtype=str(loaded.dtype).removeprefix("torch."),
        sample_rate=codec.sample_rate, frame_rate=codec.sample_rate / codec.samples_per_frame, voices=voices,
        default_voice=default_voice, languages=tuple(loaded.languages))
    worker = workers[0] if len(workers) == 1 else EnginePool(workers)
    worker.start()
    if loaded.device.type == "cuda" and warm_up.enabled():
        for w in workers:  # each engine's first request, before any user's (serving/warm_up.py)
            warm_up.run_warm_up(w, info)
    return App(loaded, worker, info)
