"""A stream's text track growing while it runs (StreamSynthesize), on the torch reference and the
batched engine (CPU): the same codes as the whole track given at admission, however the track was
split and however long the stream waited between pieces (its slot unstepped while others ran);
EOS only once the track is closed and all its text has entered; the prompt builder's text track
is bitwise the same built whole or piece by piece."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tts_server.engines.batched.checks import GREEDY, bf16_rounded
from tts_server.engines.contract import OPEN_TRACK, Admission, SamplingConfig, StepPlan
from tts_server.engines.torch_ref import TorchEngine
from tts_server.model.prompt import Prompt, PromptBuilder
from tts_server.model.weights import decode_weights

TEXT = "A stream whose text arrives while it speaks, one piece at a time."
SAMPLED = SamplingConfig(seed=11, temperature=1.2)
FRAMES = 18


@pytest.fixture(scope="module")
def weights(tiny_custom):
    return bf16_rounded(decode_weights(tiny_custom.model))


@pytest.fixture(scope="module")
def prompt(tiny_custom) -> Prompt:
    """A streaming-text prompt: ~15 text vectors then tts_eos on its track."""
    ids = tiny_custom._tokenize_texts([tiny_custom._build_assistant_text(TEXT)])[0]
    return bf16_rounded(PromptBuilder(tiny_custom.model).build(ids, "english", "ryan", non_streaming=False))


def _engine(name, weights):
    if name == "torch":
        return TorchEngine(weights, 4, 160)
    from tts_server.engines.batched.engine import BatchedEngine

    return BatchedEngine(weights, 4, 160, kv_dtype=torch.float32 if name == "batched-fp32" else torch.bfloat16)


def _run_whole(eng, prompt, sampling, frames, eos_from=None):
    m = prompt.trailing.shape[0] - 1
    out = []
    eos_from = m if eos_from is None else eos_from
    eng.run(StepPlan(admit=(Admission(0, prompt, sampling, eos_from=eos_from),)))  # prefill only
    for _ in range(frames):
        r = eng.run(StepPlan(decode=(0,))).frames[0]
        out.append(r.codes)
        if r.next_is_eos:
            break
    eng.release(0)
    return np.stack(out)


def _run_pieces(eng, prompt, sampling, frames, cuts, neighbour=True):
    """Admit with the first cuts[0] text vectors, extend by the next piece whenever the slot has
    consumed its track (stepping a sampled neighbour in slot 2 meanwhile), close at the end."""
    track, m = prompt.trailing, prompt.trailing.shape[0] - 1
    first = Prompt(prompt.embeds, track[:cuts[0]], prompt.pad_embed)
    admit = (Admission(0, first, sampling, eos_from=OPEN_TRACK),)
    if neighbour:
        admit += (Admission(2, prompt, SAMPLED),)
    eng.run(StepPlan(admit=admit))
    have, out, bounds = cuts[0], [], list(cuts[1:]) + [m + 1]
    while len(out) < frames:
        if len(out) >= have and bounds:  # dry: wait a few steps, then the next piece arrives
            for _ in range(2 if neighbour else 0):
                eng.run(StepPlan(decode=(2,)))
            nxt = bounds.pop(0)
            eng.extend_text(0, track[have:nxt], m if nxt == m + 1 else None)
            have = nxt
            continue
        r = eng.run(StepPlan(decode=(0,))).frames[0]
        out.append(r.codes)
        if r.next_is_eos:
            break
    for s in (0, 2):
        eng.release(s)
    return np.stack(out)


@pytest.mark.parametrize("name", ["torch", "batched-fp32", "batched-bf16"])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_track_fed_in_pieces_equals_whole(weights, prompt, name, sampling):
    eng = _engine(name, weights)
    m = prompt.trailing.shape[0] - 1
    assert m >= 10
    want = _run_whole(eng, prompt, sampling, FRAMES)
    for cuts in ([1, 2, 3, 9], [4, m]):
        np.testing.assert_array_equal(_run_pieces(eng, prompt, sampling, FRAMES, cuts), want, err_msg=str(cuts))


@pytest.mark.parametrize("name", ["torch", "batched-fp32"])
def test_eos_only_after_close_and_all_text(weights, prompt, name):
    """The code that greedy draws third is declared EOS: qwen-tts's rules alone (eos_from 0) end
    the stream after 2 frames; an open track never ends, and once closed only after the step that
    took the last text vector."""
    m = prompt.trailing.shape[0] - 1
    third = int(_run_whole(_engine(name, weights), prompt, GREEDY, 3, eos_from=0)[2, 0])
    ids = dataclasses.replace(weights.ids, eos=third)
    eng = _engine(name, dataclasses.replace(weights, ids=ids))
    assert len(_run_whole(eng, prompt, GREEDY, FRAMES, eos_from=0)) == 2
    gated = _run_pieces(eng, prompt, GREEDY, FRAMES + m, [3, 6], neighbour=False)
    assert len(gated) >= m, len(gated)


@pytest.mark.parametrize("table", [False, True], ids=["projected", "vocabulary-table"])
def test_prompt_text_track_is_the_same_whole_or_in_pieces(tiny_custom, table):
    """PromptBuilder.text_track: vectors projected in aligned blocks (or gathered from the
    vocabulary table), so the track built piece by piece (as StreamSynthesize does) is bitwise
    the one-shot prompt's."""
    from tts_server.model.prompt import project_vocabulary

    b = PromptBuilder(tiny_custom.model, project_vocabulary(tiny_custom.model) if table else None)
    ids = tiny_custom._tokenize_texts([tiny_custom._build_assistant_text(TEXT * 3)])[0]
    whole = b.build(ids, "english", "ryan", non_streaming=False).trailing[:-1]
    text = ids[0, 4:-5].tolist()
    for cuts in ([1, 2, 17, 18, 40], [5, 16, 32], [30]):
        parts, start = [], 0
        for end in cuts + [len(text)]:
            parts.append(b.text_track(text[start:end], start))
            start = end
        assert torch.equal(torch.cat(parts), whole)
