"""Fidelity against the qwen-tts package itself: prefill embeddings and greedy codes.

The oracle is qwen-tts's own `Qwen3TTSForConditionalGeneration.generate` on the same tiny
fp32 model; its prefill is captured where it enters the talker's HF `generate`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tts_server.engines.contract import SamplingConfig, decode_until_eos
from tts_server.engines.torch_ref import TorchEngine
from tts_server.model.prompt import PromptBuilder, VoiceClone, project_vocabulary
from tts_server.model.weights import decode_weights

TEXT = "Hello world, this is a fidelity test of the talker."
GREEDY = SamplingConfig(do_sample=False, subtalker_do_sample=False)
PREFILL_TOL = 1e-6  # fp32, same ops in the same order: measured 0.0


def _reference(tts, max_new_tokens: int, **generate_kwargs):
    """Run qwen-tts generate greedily; return (codes [F, 16], prefill embeds [L, H], trailing)."""
    model = tts.model
    captured = {}
    original = model.talker.generate

    def spy(*args, **kwargs):
        captured["embeds"] = kwargs["inputs_embeds"][0].clone()
        captured["trailing"] = kwargs["trailing_text_hidden"][0].clone()
        return original(*args, **kwargs)

    model.talker.generate = spy
    try:
        codes, _ = model.generate(max_new_tokens=max_new_tokens, do_sample=False,
                                  subtalker_dosample=False, **generate_kwargs)
    finally:
        del model.talker.generate
    return codes[0].numpy(), captured["embeds"], captured["trailing"]


def _ours(tts, prompt, num_frames: int) -> np.ndarray:
    engine = TorchEngine(decode_weights(tts.model), max_streams=2, max_positions=512)
    engine.prefill(1, prompt, GREEDY)
    return decode_until_eos(engine, 1, num_frames)


def _ids(tts, text):
    return tts._tokenize_texts([tts._build_assistant_text(text)])[0]


def _builder(tts, table: bool) -> PromptBuilder:
    """The per-request text projection, or (as GPU servers run it) the precomputed vocabulary table."""
    return PromptBuilder(tts.model, project_vocabulary(tts.model) if table else None)


def _check(tts, prompt, ref_codes, ref_embeds, ref_trailing, max_new_tokens):
    assert prompt.embeds.shape == ref_embeds.shape
    assert (prompt.embeds - ref_embeds).abs().max().item() <= PREFILL_TOL
    assert prompt.trailing.shape == ref_trailing.shape
    assert (prompt.trailing - ref_trailing).abs().max().item() <= PREFILL_TOL
    # max_new_tokens code-0 samples complete max_new_tokens - 1 frames (or fewer on EOS).
    ours = _ours(tts, prompt, max_new_tokens - 1)
    assert ours.shape == ref_codes.shape
    np.testing.assert_array_equal(ours, ref_codes)


@pytest.mark.parametrize("table", [False, True], ids=["projected", "vocab-table"])
@pytest.mark.parametrize("non_streaming", [True, False], ids=["non-streaming-text", "streaming-text"])
@pytest.mark.parametrize("language,speaker", [("english", "ryan"), ("auto", "aiden"),
                                              ("chinese", "eric")])
def test_custom_voice_prefill_and_greedy_codes(tiny_custom, non_streaming, language, speaker, table):
    ids = _ids(tiny_custom, TEXT)
    codes, embeds, trailing = _reference(tiny_custom, 24, input_ids=[ids], languages=[language],
                                         speakers=[speaker], non_streaming_mode=non_streaming)
    prompt = _builder(tiny_custom, table).build(ids, language, speaker, non_streaming=non_streaming)
    _check(tiny_custom, prompt, codes, embeds, trailing, 24)


@pytest.mark.parametrize("table", [False, True], ids=["projected", "vocab-table"])
@pytest.mark.parametrize("icl", [False, True], ids=["x-vector-only", "icl"])
def test_base_voice_clone_prefill_and_greedy_codes(tiny_base, reference_audio, icl, table):
    tts = tiny_base
    ref_text = "This is the reference transcript."
    item = tts.create_voice_clone_prompt(ref_audio=reference_audio, ref_text=ref_text if icl else None,
                                         x_vector_only_mode=not icl)[0]
    ids = _ids(tts, TEXT)
    ref_ids = tts._tokenize_texts([tts._build_ref_text(ref_text)])[0] if icl else None
    vcp = tts._prompt_items_to_voice_clone_prompt([item])
    codes, embeds, trailing = _reference(tts, 20, input_ids=[ids], languages=["english"],
                                         voice_clone_prompt=vcp, ref_ids=[ref_ids],
                                         non_streaming_mode=False)
    clone = VoiceClone(speaker_embedding=item.ref_spk_embedding,
                       ref_codes=item.ref_code if icl else None, ref_ids=ref_ids)
    prompt = _builder(tts, table).build(ids, "english", clone=clone, non_streaming=False)
    if icl:
        assert item.ref_code.shape[0] > 10  # the ICL block really holds reference frames
    _check(tts, prompt, codes, embeds, trailing, 20)


def test_fidelity_check_can_fail(tiny_custom):
    """A wrong speaker changes the prefill and the codes: the comparison above is sensitive."""
    ids = _ids(tiny_custom, TEXT)
    codes, embeds, _ = _reference(tiny_custom, 12, input_ids=[ids], languages=["english"],
                                  speakers=["ryan"], non_streaming_mode=True)
    prompt = PromptBuilder(tiny_custom.model).build(ids, "english", "vivian", non_streaming=True)
    assert (prompt.embeds - embeds).abs().max().item() > 1e-3
    assert not np.array_equal(_ours(tiny_custom, prompt, 11), codes)


def test_batched_steps_equal_single_stream_steps(tiny_custom):
    """Streams advanced together (different lengths and positions) get the codes they get alone."""
    builder = PromptBuilder(tiny_custom.model)
    texts = ["Short one.", "A somewhat longer sentence, with a comma and more words in it."]
    prompts = [builder.build(_ids(tiny_custom, t), "english", "ryan", non_streaming=True)
               for t in texts]
    alone = [_ours(tiny_custom, p, 10) for p in prompts]
    engine = TorchEngine(decode_weights(tiny_custom.model), max_streams=4, max_positions=512)
    engine.prefill(3, prompts[0], GREEDY)
    engine.prefill(0, prompts[1], GREEDY)
    together = {0: [], 3: []}
    for _ in range(10):
        for r in engine.step([3, 0]):
            together[r.slot].append(r.codes)
    for got, want in ((together[3], alone[0]), (together[0], alone[1])):
        n = min(len(want), len(got))
        np.testing.assert_array_equal(np.stack(got)[:n], want[:n])
