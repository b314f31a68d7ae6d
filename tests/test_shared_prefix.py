"""A batched prefill's shared prompt prefix (prefill.shared_rows): a step's prompts of one voice
and language compute their common leading rows (role + codec prefix) once, the other prompts'
K/V for those positions copied from the first's. Every slot's K/V, first draws and codes must be
bitwise those of the prefill without sharing (CPU: the torch references; GPU: the row graphs and
the Triton kernels), and the check must be able to fail (a prefill without the copy differs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tts_server.api import SamplingConfig
from tts_server.engines.batched import engine as engine_mod
from tts_server.engines.batched import glue
from tts_server.engines.batched.checks import step_codes
from tts_server.engines.batched.engine import BatchedEngine
from tts_server.engines.batched.prefill import shared_rows
from tts_server.engines.contract import Admission
from tts_server.model.prompt import PromptBuilder, PromptItem, VoiceClone, project_vocabulary
from tts_server.model.weights import decode_weights

TEXTS = ["Hello there, how are you today?", "The quick brown fox jumps over the lazy dog.",
         "A third sentence, a little longer than the others, with a comma.", "Short one.",
         "Numbers like 42 and 7 are read out.", "And the last of them."]
# (language, voice, non-streaming text) per prompt: four share English + ryan (two text modes)
VOICES = [("english", "ryan", True), ("english", "ryan", True), ("auto", "ryan", True),
          ("english", "ryan", False), ("english", "aiden", True), ("english", "ryan", True)]


def _prompts(tiny_custom):
    b = PromptBuilder(tiny_custom.model, project_vocabulary(tiny_custom.model))
    ids = [tiny_custom._tokenize_texts([tiny_custom._build_assistant_text(t)])[0] for t in TEXTS]
    return b, b.build_many([PromptItem(i, lang, voice, non_streaming=ns) for i, (lang, voice, ns) in zip(ids, VOICES)])


def test_prompts_of_one_voice_and_language_share_their_leading_rows(tiny_custom):
    b, prompts = _prompts(tiny_custom)
    keys = [p.shared for p in prompts]
    assert all(k is not None for k in keys)
    n = keys[0][1]
    assert n == 9  # 3 role rows + think, think_bos, language, think_eos, speaker, pad
    for i in (1, 3, 5):  # same voice and language (either text mode): same key, same rows bitwise
        assert keys[i] == keys[0]
        assert torch.equal(prompts[i].embeds[:n], prompts[0].embeds[:n])
    assert keys[2] != keys[0] and keys[2][1] == 8  # "auto": no language row
    assert keys[4] != keys[0]  # another speaker
    assert not torch.equal(prompts[4].embeds[:n], prompts[0].embeds[:n])
    skip, lead = shared_rows(prompts, 16)
    assert skip == [0, 9, 0, 9, 0, 9] and lead == [-1, 0, -1, 0, -1, 0]
    assert shared_rows(prompts, 8) is None  # a prefix longer than a KV block is not shared
    ids = tiny_custom._tokenize_texts([tiny_custom._build_assistant_text(TEXTS[0])])[0]
    h = tiny_custom.model.talker.config.hidden_size
    clone = b.build_many([PromptItem(ids, "english", None, VoiceClone(torch.randn(h)))])[0]
    assert clone.shared is None  # an x-vector row is the clone's own


def _admit_and_step(weights, prompts, share: bool, monkeypatch, frames: int = 6, copy: bool = True, **kw):
    """Admit every prompt in one step (slots in a shuffled order), then `frames` frames ->
    (codes per slot, K/V of every slot's prompt positions, past hidden after the admission)."""
    monkeypatch.setattr(engine_mod, "SHARE_PREFIX", share)
    if not copy:
        monkeypatch.setattr(glue, "copy_prefix", lambda *a: None)
    eng = BatchedEngine(weights, max_streams=8, max_positions=128, block_size=16, **kw)
    slots = [5, 0, 3, 7, 1, 2]
    admit = tuple(Admission(s, p, SamplingConfig(seed=11 + s, temperature=0.9, top_k=50))
                  for s, p in zip(slots, prompts))
    hidden = {}

    def after(f):
        if f == 0:
            hidden.update({s: eng.state.past_hidden[s].clone() for s in slots})

    codes = step_codes(eng, slots, frames, admit, on_step=after)
    kv = {}
    for s, p in zip(slots, prompts):
        n = p.embeds.shape[0]
        blocks = eng.kv.blocks(s)
        kv[s] = (torch.cat([eng.kv.k[:, b] for b in blocks], 2)[:, :, :n].cpu(),
                 torch.cat([eng.kv.v[:, b] for b in blocks], 2)[:, :, :n].cpu())
    return codes, kv, hidden


def _assert_same(a, b):
    codes_a, kv_a, hid_a = a
    codes_b, kv_b, hid_b = b
    for s in codes_a:
        np.testing.assert_array_equal(codes_a[s], codes_b[s])
        assert torch.equal(kv_a[s][0], kv_b[s][0]) and torch.equal(kv_a[s][1], kv_b[s][1]), s
        assert torch.equal(hid_a[s], hid_b[s]), s


def _differs(a, b) -> bool:
    return any(not torch.equal(a[1][s][0], b[1][s][0]) for s in a[1])


def test_shared_prefix_prefill_is_bitwise_the_unshared_one_cpu(tiny_custom, monkeypatch):
    _, prompts = _prompts(tiny_custom)
    w = decode_weights(tiny_custom.model)
    plain = _admit_and_step(w, prompts, False, monkeypatch)
    shared = _admit_and_step(w, prompts, True, monkeypatch)
    _assert_same(shared, plain)
    assert _differs(_admit_and_step(w, prompts, True, monkeypatch, frames=1, copy=False), plain)  # can fail


@pytest.mark.gpu
def test_shared_prefix_prefill_is_bitwise_the_unshared_one_gpu(tiny_custom, monkeypatch):
    """The serving path: row-graph buckets, Triton kernels, bf16 KV."""
    from test_batched_prefill import _cuda

    _, prompts = _prompts(tiny_custom)
    w = _cuda(decode_weights(tiny_custom.model))
    plain = _admit_and_step(w, prompts, False, monkeypatch)
    shared = _admit_and_step(w, prompts, True, monkeypatch)
    _assert_same(shared, plain)
    assert _differs(_admit_and_step(w, prompts, True, monkeypatch, frames=1, copy=False), plain)  # can fail
