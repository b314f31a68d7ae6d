"""Wiring: model -> decode engine + streaming codec -> worker -> ModelInfo."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .api import ModelInfo
from .config import ServerConfig
from .serving.loop import Worker
from .model.loader import LoadedModel, load_model
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


def create_engine(name: str, loaded: LoadedModel, config: ServerConfig):
    engine = _create_engine(name, loaded, config)
    if config.inject_fault:
        from .testing.faults import FaultInjectingEngine

        log.warning("FAULT INJECTION ON (testing only): %s", config.inject_fault)
        engine = FaultInjectingEngine(engine, config.inject_fault)
    return engine


def _create_engine(name: str, loaded: LoadedModel, config: ServerConfig):
    if name == "auto":
        name = "megakernel" if loaded.device.type == "cuda" and megakernel_available() else "torch"
    weights = decode_weights(loaded.model)
    if name == "torch":
        from .engines.torch_ref import TorchEngine

        return TorchEngine(weights, config.max_streams, config.max_positions)
    if name == "megakernel":
        if loaded.device.type != "cuda":
            raise RuntimeError("--engine megakernel needs a CUDA device")
        from .engines.megakernel import MegakernelEngine

        return MegakernelEngine(weights, config.max_streams, config.max_positions)
    raise ValueError(f"unknown engine {name!r}; choose auto, torch or megakernel")


def create_codec(loaded: LoadedModel, config: ServerConfig):
    """The streaming codec: one batched decode step for every stream that made a frame."""
    from .codec.per_stream import PerStreamCodec

    return PerStreamCodec(loaded.model.speech_tokenizer.model.decoder, config.max_streams)


@dataclass
class App:
    loaded: LoadedModel
    worker: Worker
    info: ModelInfo


def build_app(config: ServerConfig, loaded: LoadedModel | None = None) -> App:
    loaded = loaded or load_model(config.model, config.device, config.dtype)
    if loaded.device.type == "cuda":
        # the codec runs in fp32; TF32 convolutions put streamed audio ~5e-3 off the exact decode
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    engine = create_engine(config.engine, loaded, config)
    codec = create_codec(loaded, config)
    voices = tuple(loaded.speakers)
    default_voice = None
    if voices:
        default_voice = (config.default_voice or voices[0]).lower()
        if default_voice not in voices:
            raise ValueError(f"--default-voice {config.default_voice!r} is not one of {voices}")
    info = ModelInfo(
        name=config.model, model_type=loaded.model_type, model_size=loaded.model.tts_model_size,
        is_synthetic=loaded.is_synthetic, warning=loaded.warning, engine=engine.name,
        device=str(loaded.device), dtype=str(loaded.dtype).removeprefix("torch."),
        sample_rate=codec.sample_rate, frame_rate=codec.sample_rate / codec.samples_per_frame, voices=voices,
        default_voice=default_voice, languages=tuple(loaded.languages))
    worker = Worker(loaded, engine, codec, config)
    worker.start()
    return App(loaded, worker, info)
