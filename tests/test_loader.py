"""The real loading path: a snapshot folder in the released layout, loaded through qwen-tts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tts_server.engines.contract import SamplingConfig
from tts_server.engines.torch_ref import TorchEngine
from tts_server.model.loader import load_model
from tts_server.model.prompt import PromptBuilder
from tts_server.model.synthetic import save_release_layout
from tts_server.model.weights import decode_weights


@pytest.fixture(scope="module")
def snapshot(tiny_custom, tmp_path_factory):
    path = tmp_path_factory.mktemp("Qwen3-TTS-12Hz-0.6B-CustomVoice-synthetic")
    save_release_layout(tiny_custom, path)
    return path


def test_snapshot_has_release_layout(snapshot):
    names = {p.name for p in snapshot.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "speech_tokenizer",
            "tokenizer_config.json"} <= names
    assert {"config.json", "model.safetensors", "preprocessor_config.json"} <= {
        p.name for p in (snapshot / "speech_tokenizer").iterdir()}
    cfg = json.loads((snapshot / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_tts" and cfg["tts_model_type"] == "custom_voice"
    assert cfg["talker_config"]["codec_eos_token_id"] == 2150


def test_loaded_snapshot_equals_the_saved_model(tiny_custom, snapshot):
    loaded = load_model(str(snapshot), device="cpu", dtype="float32")
    assert not loaded.is_synthetic and loaded.model_type == "custom_voice"
    assert loaded.speakers == ["aiden", "eric", "ryan", "vivian"]
    saved = dict(tiny_custom.model.state_dict())
    for name, tensor in loaded.model.state_dict().items():
        assert torch.equal(tensor, saved[name]), name
    codec_saved = dict(tiny_custom.model.speech_tokenizer.model.state_dict())
    for name, tensor in loaded.model.speech_tokenizer.model.state_dict().items():
        assert torch.equal(tensor, codec_saved[name]), name
    assert loaded.tts.generate_defaults["top_k"] == 50
    text = "<|im_start|>assistant\nLoad me back.<|im_end|>\n<|im_start|>assistant\n"
    assert (loaded.tts.processor.tokenizer(text)["input_ids"]
            == tiny_custom.processor.tokenizer(text)["input_ids"])
    # the same greedy codes from both
    codes = []
    for tts in (tiny_custom, loaded.tts):
        ids = tts._tokenize_texts([text])[0]
        engine = TorchEngine(decode_weights(tts.model), max_streams=1, max_positions=256)
        engine.prefill(0, PromptBuilder(tts.model).build(ids, "english", "ryan", non_streaming=True),
                       SamplingConfig(do_sample=False, subtalker_do_sample=False))
        codes.append(np.stack([engine.step([0])[0].codes for _ in range(4)]))
    np.testing.assert_array_equal(codes[0], codes[1])


def test_missing_folder_is_a_clear_error(tmp_path):
    from tts_server.memory_plan import StartupError

    with pytest.raises(StartupError, match="neither a folder nor a hub id"):
        load_model(str(tmp_path / "nope" / "deeper"), device="cpu")
