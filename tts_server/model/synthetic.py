"""Seeded random-weight Qwen3-TTS models for running without downloaded weights.

`synthetic` is the full-size 12Hz-0.6B architecture, `synthetic-tiny` a small config for
tests, `synthetic-base` / `synthetic-tiny-base` their voice-cloning (Base) variants. They
are built through qwen-tts's own classes, so everything downstream is the real code path;
only the weights are random, so **the audio they produce is noise**.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

SYNTHETIC_WARNING = (
    "SYNTHETIC MODEL: weights are seeded random numbers, so the audio is noise. Speed, "
    "streaming and the API are real; point --model at a Qwen3-TTS snapshot for speech."
)

# Codec-track ids of the released 12Hz checkpoints.
CODEC_IDS = dict(
    codec_pad_id=2148, codec_bos_id=2149, codec_eos_token_id=2150, codec_think_id=2154,
    codec_nothink_id=2155, codec_think_bos_id=2156, codec_think_eos_id=2157,
)
LANGUAGE_IDS = {
    "english": 2050, "german": 2053, "spanish": 2054, "chinese": 2055, "japanese": 2058,
    "french": 2061, "korean": 2064, "russian": 2069, "italian": 2070, "portuguese": 2071,
    # Dialect ids of this synthetic model (the released ids are not published in our sources).
    "beijing_dialect": 2074, "sichuan_dialect": 2075,
}
# Synthetic CustomVoice speakers: name -> codec id; one dialect speaker exercises that rule.
SPEAKER_IDS = {"vivian": 3000, "ryan": 3001, "aiden": 3002, "eric": 3003}
SPEAKER_DIALECTS = {"vivian": False, "ryan": False, "aiden": False, "eric": "sichuan_dialect"}

GENERATION_DEFAULTS = dict(
    do_sample=True, repetition_penalty=1.05, temperature=0.9, top_p=1.0, top_k=50,
    subtalker_dosample=True, subtalker_temperature=0.9, subtalker_top_p=1.0, subtalker_top_k=50,
    max_new_tokens=8192,
)


@dataclass(frozen=True)
class SyntheticSpec:
    """Which synthetic model to build."""

    size: str  # "full" | "tiny"
    model_type: str  # "custom_voice" | "base"
    seed: int = 0


SYNTHETIC_NAMES = {
    "synthetic": SyntheticSpec("full", "custom_voice"),
    "synthetic-base": SyntheticSpec("full", "base"),
    "synthetic-tiny": SyntheticSpec("tiny", "custom_voice"),
    "synthetic-tiny-base": SyntheticSpec("tiny", "base"),
}


def _lm_dims(size: str) -> dict:
    if size == "full":
        return dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                    num_key_value_heads=8, head_dim=128)
    return dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16)


def tts_config(spec: SyntheticSpec):
    """The `Qwen3TTSConfig` of a synthetic model (released 0.6B values when size is full)."""
    from qwen_tts.core.models import Qwen3TTSConfig

    full = spec.size == "full"
    dims = _lm_dims(spec.size)
    predictor = dict(
        vocab_size=2048, num_hidden_layers=5 if full else 2, rms_norm_eps=1e-6,
        rope_theta=1_000_000, max_position_embeddings=65536, num_code_groups=16, **dims,
    )
    custom = spec.model_type == "custom_voice"
    talker = dict(
        vocab_size=3072, num_hidden_layers=28 if full else 2, rms_norm_eps=1e-6,
        rope_theta=1_000_000, max_position_embeddings=32768,
        rope_scaling={"mrope_section": [24, 20, 20] if full else [4, 2, 2],
                      "interleaved": True, "rope_type": "default"},
        text_vocab_size=151936, text_hidden_size=2048 if full else 32, num_code_groups=16,
        codec_language_id=dict(LANGUAGE_IDS),
        spk_id=dict(SPEAKER_IDS) if custom else {},
        spk_is_dialect=dict(SPEAKER_DIALECTS) if custom else {},
        code_predictor_config=predictor, **CODEC_IDS, **dims,
    )
    speaker_encoder = dict(enc_dim=dims["hidden_size"])
    if not full:
        speaker_encoder.update(enc_channels=[32, 32, 32, 32, 96], enc_attention_channels=16,
                               enc_se_channels=16)
    return Qwen3TTSConfig(
        talker_config=talker, speaker_encoder_config=speaker_encoder, tokenizer_type="qwen3_tts_tokenizer_12hz",
        tts_model_size="0b6", tts_model_type=spec.model_type,
    )


def codec_config(size: str):
    """The `Qwen3TTSTokenizerV2Config` (12.5 Hz speech tokenizer) of a synthetic model."""
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2Config,
    )

    if size == "full":
        decoder = dict(codebook_size=2048, codebook_dim=512, latent_dim=1024, hidden_size=512,
                       intermediate_size=1024, head_dim=64, num_attention_heads=16,
                       num_key_value_heads=16, num_hidden_layers=8, sliding_window=72,
                       decoder_dim=1536)
        encoder: dict = {}  # MimiConfig defaults: 12.5 Hz, 32 quantizers of 2048
    else:
        decoder = dict(codebook_size=2048, codebook_dim=32, latent_dim=64, hidden_size=32,
                       intermediate_size=64, head_dim=16, num_attention_heads=2,
                       num_key_value_heads=2, num_hidden_layers=2, sliding_window=72,
                       decoder_dim=48)
        encoder = dict(hidden_size=32, num_filters=4, num_residual_layers=1, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                       intermediate_size=64, codebook_dim=32, num_quantizers=16,
                       upsample_groups=32, vector_quantization_hidden_dimension=32)
    decoder.update(rope_theta=10000, rms_norm_eps=1e-5, layer_scale_initial_scale=0.01,
                   num_quantizers=16, upsample_rates=(8, 5, 4, 3), upsampling_ratios=(2, 2))
    return Qwen3TTSTokenizerV2Config(encoder_config=encoder, decoder_config=decoder,
                                     encoder_valid_num_quantizers=16)


@torch.no_grad()
def randomize_codebooks(codec_model: torch.nn.Module, generator: torch.Generator) -> None:
    """Give every RVQ codebook random entries (qwen-tts initialises them to zero, which makes
    every code decode to the same waveform)."""
    tensors = list(codec_model.named_parameters()) + list(codec_model.named_buffers())
    for name, buf in tensors:
        if name.endswith("embedding_sum"):
            buf.copy_(torch.randn(buf.shape, generator=generator))
        elif name.endswith("cluster_usage"):
            buf.fill_(1.0)


@torch.no_grad()
def set_output_level(codec_model: torch.nn.Module, generator: torch.Generator,
                     target_rms: float = 0.1) -> None:
    """Scale the decoder's last conv so random codes decode to audible noise of about
    `target_rms` (with the default init the waveform is ~1e-6, i.e. silence)."""
    decoder = codec_model.decoder
    codes = torch.randint(0, decoder.config.codebook_size, (1, decoder.config.num_quantizers, 16),
                          generator=generator)
    rms = decoder(codes).pow(2).mean().sqrt().item()
    last = decoder.decoder[-1].conv
    last.weight.mul_(target_rms / max(rms, 1e-12))


def _seeded_tts_model(spec: SyntheticSpec):
    """Seed the global RNG with spec.seed and construct the model from it (fp32, CPU)."""
    from qwen_tts.core.models import Qwen3TTSForConditionalGeneration

    torch.manual_seed(spec.seed)
    cfg = tts_config(spec)
    cfg._attn_implementation = "sdpa"
    return Qwen3TTSForConditionalGeneration(cfg)


def build_tts_model(spec: SyntheticSpec):
    """The same random-weight `Qwen3TTSForConditionalGeneration` as `build_synthetic(spec).model`,
    without the speech and text tokenizers; the global RNG is left as it was."""
    rng_state = torch.random.get_rng_state()
    try:
        return _seeded_tts_model(spec)
    finally:
        torch.random.set_rng_state(rng_state)


def build_synthetic(spec: SyntheticSpec, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Build a `qwen_tts.Qwen3TTSModel` with seeded random weights and the offline tokenizer."""
    from qwen_tts import Qwen3TTSModel, Qwen3TTSTokenizer
    from qwen_tts.core.models import Qwen3TTSProcessor
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model
    from transformers import EncodecFeatureExtractor

    from .text_tokenizer import build_qwen_tokenizer

    rng_state = torch.random.get_rng_state()
    try:
        model = _seeded_tts_model(spec)
        codec = Qwen3TTSTokenizerV2Model(codec_config(spec.size))
        gen = torch.Generator().manual_seed(spec.seed + 1)
        randomize_codebooks(codec, gen)
        set_output_level(codec, gen)
    finally:
        torch.random.set_rng_state(rng_state)
    model = model.to(device=device, dtype=dtype).eval()
    codec = codec.to(device=device).eval()  # the codec stays fp32, as released

    speech_tokenizer = Qwen3TTSTokenizer()
    speech_tokenizer.model = codec
    speech_tokenizer.config = codec.config
    speech_tokenizer.device = torch.device(device)
    speech_tokenizer.feature_extractor = EncodecFeatureExtractor(feature_size=1, sampling_rate=24000)
    model.load_speech_tokenizer(speech_tokenizer)
    model.load_generate_config(copy.deepcopy(GENERATION_DEFAULTS))
    processor = Qwen3TTSProcessor(tokenizer=build_qwen_tokenizer())
    return Qwen3TTSModel(model=model, processor=processor, generate_defaults=model.generate_config)


def save_release_layout(tts, path) -> None:
    """Save a `Qwen3TTSModel` in the folder layout of the released Hugging Face snapshots:
    config.json, model.safetensors, generation_config.json, tokenizer files and a
    speech_tokenizer/ folder with its own config, weights and preprocessor config."""
    import json
    from pathlib import Path

    import inspect

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tts.model.save_pretrained(str(path))
    # transformers serialises the speaker-encoder sub-config with generic PretrainedConfig keys
    # its __init__ does not accept; the released config.json holds only its own fields.
    config_file = path / "config.json"
    cfg = json.loads(config_file.read_text())
    se_cls = type(tts.model.config.speaker_encoder_config)
    allowed = set(inspect.signature(se_cls.__init__).parameters) - {"self"}
    cfg["speaker_encoder_config"] = {k: v for k, v in cfg["speaker_encoder_config"].items()
                                     if k in allowed}
    config_file.write_text(json.dumps(cfg, indent=2))
    tts.processor.save_pretrained(str(path))
    (path / "generation_config.json").write_text(json.dumps(tts.model.generate_config, indent=2))
    st = tts.model.speech_tokenizer
    st.model.save_pretrained(str(path / "speech_tokenizer"))
    st.feature_extractor.save_pretrained(str(path / "speech_tokenizer"))
