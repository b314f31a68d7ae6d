"""StreamSynthesize contexts admitted in one step build their prompts together
(`TextFeeder.prompts`, the builder's plan/materialise with a vocabulary text table, as on a GPU
server): bitwise the prompts each context gets alone, and a context's own error stays its own."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tts_server.api import SamplingConfig, SynthesisRequest, TextEvent
from tts_server.engines.contract import OPEN_TRACK
from tts_server.model.loader import LoadedModel
from tts_server.model.prompt import Prompt, project_vocabulary
from tts_server.serving.prepare import RequestPreparer
from tts_server.serving.text_feed import TextFeeder
from tts_server.serving.text_track import TextTrack

from test_prompt_many import _same

TEXTS = [("Hello there, how are", False), ("A finished sentence.", True), ("你好，世界", False)]


def _contexts(feeder: TextFeeder, voices) -> list:
    out = []
    for i, ((text, ended), voice) in enumerate(zip(TEXTS, voices)):
        req = SynthesisRequest(f"c{i}", "", voice, "auto", SamplingConfig(seed=i), 100, 24000, incremental=True)
        track = TextTrack(feeder.tokenizer)
        track.apply(TextEvent("text", text))
        if ended:
            track.apply(TextEvent("end"))
        out.append(SimpleNamespace(request=req, track=track))
    return out


def test_contexts_prompts_together_equal_alone(tiny_custom):
    loaded = LoadedModel("synthetic-tiny", tiny_custom, True, torch.device("cpu"), torch.float32)
    loaded.text_table = project_vocabulary(loaded.model)  # the GPU server's path: rows are gathers
    feeder = TextFeeder(RequestPreparer(loaded), None, 10.0, 10_000, 1920, 24000, 0.08)
    voices = ["ryan", "vivian", None]
    together = feeder.prompts(_contexts(feeder, voices))
    alone = [feeder.prompt(c) for c in _contexts(feeder, voices)]
    for (p, eos), (q, eos_alone) in zip(together, alone):
        assert _same(p.prompt, q.prompt) and eos == eos_alone
    # and both are qwen-tts's streaming-text layout as `build` makes it (tts_eos only once ended)
    for c, (p, _) in zip(_contexts(feeder, voices), together):
        ids = torch.tensor([feeder.role_ids + c.track.ids + feeder.suffix_ids])
        ref = feeder.preparer.builder.build(ids, "auto", c.request.voice, None, non_streaming=False)
        if not c.track.ended:
            ref = Prompt(embeds=ref.embeds, trailing=ref.trailing[:-1], pad_embed=ref.pad_embed)
        assert _same(p.prompt, ref)
    # really built together: the step's prompts are views of one tensor
    ptrs = {p.prompt.embeds.untyped_storage().data_ptr() for p, _ in together}
    assert len(ptrs) == 1
    # an open context has no tts_eos on its track and a closed EOS gate; an ended one has both
    assert together[0][1] == OPEN_TRACK and together[1][1] != OPEN_TRACK
    assert together[1][0].prompt.trailing.shape[0] == alone[1][0].prompt.trailing.shape[0]


def test_a_contexts_own_error_stays_its_own(tiny_custom):
    loaded = LoadedModel("synthetic-tiny", tiny_custom, True, torch.device("cpu"), torch.float32)
    loaded.text_table = project_vocabulary(loaded.model)
    feeder = TextFeeder(RequestPreparer(loaded), None, 10.0, 10_000, 1920, 24000, 0.08)
    got = feeder.prompts(_contexts(feeder, ["ryan", "no-such-voice", None]))
    assert isinstance(got[1], Exception)
    want = [feeder.prompt(c) for c in _contexts(feeder, ["ryan", "ryan", None])]
    assert _same(got[0][0].prompt, want[0][0].prompt) and _same(got[2][0].prompt, want[2][0].prompt)
