"""Load a Qwen3-TTS model: a synthetic name, a local Hugging Face snapshot, or a hub id.

Real checkpoints go through qwen-tts's own `Qwen3TTSModel.from_pretrained`, which reads the
snapshot layout (config.json, model.safetensors, generation_config.json, tokenizer files,
speech_tokenizer/).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from ..memory_plan import StartupError
from .synthetic import SYNTHETIC_NAMES, SYNTHETIC_WARNING, build_synthetic

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    name: str
    tts: object  # qwen_tts.Qwen3TTSModel
    is_synthetic: bool
    device: torch.device
    dtype: torch.dtype
    # P(x) for every text token id (model/prompt.py project_vocabulary), built on GPUs at start-up
    text_table: torch.Tensor | None = None

    @property
    def model(self):
        return self.tts.model

    @property
    def model_type(self) -> str:
        return self.model.tts_model_type

    @property
    def speakers(self) -> list[str]:
        return sorted(s.lower() for s in self.model.config.talker_config.spk_id)

    @property
    def languages(self) -> list[str]:
        return [l for l in self.model.get_supported_languages() if l != "auto"]

    @property
    def warning(self) -> str:
        return SYNTHETIC_WARNING if self.is_synthetic else ""


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def load_model(name: str, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if name in SYNTHETIC_NAMES:
        log.warning(SYNTHETIC_WARNING)
        tts = build_synthetic(SYNTHETIC_NAMES[name], dtype=dt, device=str(dev))
        return LoadedModel(name, tts, True, dev, dt)
    from qwen_tts import Qwen3TTSModel

    name = os.path.expanduser(name)
    if not os.path.isdir(name) and (name.startswith((os.sep, ".")) or name.count("/") != 1):
        raise StartupError(f"--model {name}: neither a folder nor a hub id (org/name)")
    try:
        tts = Qwen3TTSModel.from_pretrained(name, dtype=dt, device_map=str(dev),
                                            attn_implementation="sdpa")
    except OSError as e:
        where = "folder" if os.path.isdir(name) else "hub id (is the network reachable?)"
        reason = " ".join(str(e).split())  # one line
        raise StartupError(f"--model {name}: could not load it as a {where}: {reason}") from None
    tts.model.eval()
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2Model,
    )

    if not isinstance(tts.model.speech_tokenizer.model, Qwen3TTSTokenizerV2Model):
        raise StartupError(f"--model {name}: only the 12 Hz speech tokenizer models are supported")
    return LoadedModel(name, tts, False, dev, dt)
