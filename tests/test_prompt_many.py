"""`PromptBuilder.build_many` and `RequestPreparer.prepare_many`: a step's prompts built together
are bit for bit the prompts `build` makes one at a time (what else is admitted in the same step
must not change a stream's audio), and one request's error stays that request's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tts_server.api import ReferenceAudio, SynthesisRequest
from tts_server.engines.contract import SamplingConfig
from tts_server.model.loader import LoadedModel
from tts_server.model.prompt import Prompt, PromptBuilder, PromptItem, VoiceClone, project_vocabulary
from tts_server.model.synthetic import SYNTHETIC_NAMES, build_synthetic
from tts_server.serving.prepare import Prepared, RequestPreparer

LONG = " ".join(["A much longer sentence, with commas, numbers like 1234 and more words in it."] * 6)
TEXTS = ["", "Hi.", "Hello world, this is a batched prompt test.", LONG]
REF_TEXT = "This is the reference transcript."
_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns: -0.0 and 0.0 (or two NaNs) differ here, unlike under ==."""
    return t.contiguous().view(_INT[t.element_size()])


def _same(a: Prompt, b: Prompt) -> bool:
    return all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(_bits(x), _bits(y))
               for x, y in ((a.embeds, b.embeds), (a.trailing, b.trailing), (a.pad_embed, b.pad_embed)))


def _ids(tts, text: str) -> torch.Tensor:
    return tts._tokenize_texts([tts._build_assistant_text(text)])[0]


def _built(builder: PromptBuilder, item: PromptItem) -> Prompt:
    return builder.build(item.input_ids, item.language, item.speaker, clone=item.clone,
                         non_streaming=item.non_streaming)


def _batched(prompt: Prompt, step: list[Prompt]) -> bool:
    """Whether `prompt` is a view of the step-wide tensor (not a `build` fallback)."""
    ptr = prompt.embeds.untyped_storage().data_ptr()
    return sum(p.embeds.untyped_storage().data_ptr() == ptr for p in step) > 1


def _table(model) -> torch.Tensor:
    """The vocabulary table with -0.0 planted in every fifth column: a row taken as is must
    keep it, where an added zero would turn it into 0.0."""
    table = project_vocabulary(model).clone()
    table[:, ::5] = -0.0
    return table


def _clone(tts, wav, sr, icl: bool) -> VoiceClone:
    item = tts.create_voice_clone_prompt(ref_audio=(wav, sr), ref_text=REF_TEXT if icl else None,
                                         x_vector_only_mode=not icl)[0]
    return VoiceClone(item.ref_spk_embedding, item.ref_code if icl else None,
                      tts._tokenize_texts([tts._build_ref_text(REF_TEXT)])[0] if icl else None)


def _custom_items(tts) -> list[PromptItem]:
    voices = [("english", "ryan"), ("auto", "vivian"), ("chinese", "eric"),  # eric: a dialect speaker
              ("auto", "eric"), ("english", None), ("auto", None)]
    return [PromptItem(_ids(tts, TEXTS[i % len(TEXTS)]), lang, spk, non_streaming=(i // 2) % 2 == 0)
            for i, (lang, spk) in enumerate(voices * 2)]


@pytest.fixture(scope="module")
def base_clones(tiny_base, reference_audio):
    wav, sr = reference_audio
    noise = (0.1 * np.random.default_rng(1).standard_normal(wav.size)).astype(np.float32)
    return (_clone(tiny_base, wav, sr, icl=False), _clone(tiny_base, noise, sr, icl=False),
            _clone(tiny_base, wav, sr, icl=True))


def _base_items(tts, clones) -> list[PromptItem]:
    xa, xb, icl = clones
    plan = [(xa, False), (None, True), (xb, False), (icl, False), (xa, True), (xb, True),
            (None, False), (icl, True), (xb, False), (xb, True)]
    return [PromptItem(_ids(tts, TEXTS[i % len(TEXTS)]), "english" if i % 3 else "auto", None, clone, ns)
            for i, (clone, ns) in enumerate(plan)]


def _check_step(builder: PromptBuilder, items: list[PromptItem], expect_batched: list[bool]):
    step = builder.build_many(items)
    assert len(step) == len(items)
    for i, (item, got) in enumerate(zip(items, step)):
        assert _same(got, _built(builder, item)), f"item {i} differs from build"
        assert _batched(got, step) == expect_batched[i], f"item {i}: batched path expected {expect_batched[i]}"
    return step


@pytest.mark.parametrize("table", [False, True], ids=["projected", "vocab-table"])
def test_build_many_equals_build_custom_voice(tiny_custom, table):
    b = PromptBuilder(tiny_custom.model, _table(tiny_custom.model) if table else None)
    items = _custom_items(tiny_custom)
    _check_step(b, items, [table] * len(items))  # without a text table: `build` per item


@pytest.mark.parametrize("table", [False, True], ids=["projected", "vocab-table"])
def test_items_with_ids_as_a_list_build_the_same(tiny_custom, table):
    """The preparer hands the builder its token ids as a list (no tensor to make); planned or
    built, the prompts are the tensor items' bit for bit."""
    from dataclasses import replace

    b = PromptBuilder(tiny_custom.model, _table(tiny_custom.model) if table else None)
    items = _custom_items(tiny_custom)
    lists = [replace(it, input_ids=it.input_ids[0].tolist()) for it in items]
    assert all(isinstance(it.input_ids, list) for it in lists)
    assert all(_same(g, w) for g, w in zip(b.build_many(lists), b.build_many(items)))


@pytest.mark.parametrize("table", [False, True], ids=["projected", "vocab-table"])
def test_build_many_equals_build_voice_clones(tiny_base, base_clones, table):
    """x-vector clones (two voices) and no-clone items batched; an ICL clone falls back to
    `build` in its place."""
    b = PromptBuilder(tiny_base.model, _table(tiny_base.model) if table else None)
    items = _base_items(tiny_base, base_clones)
    icl = base_clones[2]
    _check_step(b, items, [table and it.clone is not icl for it in items])


def test_build_many_equals_build_in_bfloat16(tiny_base, base_clones):
    """bf16 tables: the sums round as `build`'s do, and fp32 x-vectors are cast as `build` casts
    them; a CustomVoice model's speakers too."""
    for name, items in (("synthetic-tiny-base", _base_items(tiny_base, base_clones)),
                        ("synthetic-tiny", None)):
        tts = build_synthetic(SYNTHETIC_NAMES[name], dtype=torch.bfloat16)
        items = items or _custom_items(tts)
        b = PromptBuilder(tts.model, _table(tts.model))
        assert b.text_table.dtype == torch.bfloat16
        step = _check_step(b, items, [it.clone is None or it.clone.ref_codes is None for it in items])
        assert step[0].embeds.dtype == torch.bfloat16


def test_build_many_check_can_fail(tiny_custom):
    """The comparison sees one ulp, or a sign of zero, in one row of one prompt of the step."""
    b = PromptBuilder(tiny_custom.model, project_vocabulary(tiny_custom.model))
    items = _custom_items(tiny_custom)[:4]
    step = b.build_many(items)
    want = [_built(b, it) for it in items]
    assert all(_same(g, w) for g, w in zip(step, want))
    bumped = step[2].embeds.clone()
    bumped[5, 3] = torch.nextafter(bumped[5, 3], torch.tensor(float("inf")))
    assert not _same(Prompt(bumped, step[2].trailing, step[2].pad_embed), want[2])
    zero = step[1].trailing.clone()
    zero[0, 0] = -0.0
    signed = Prompt(step[1].embeds, zero.clone(), step[1].pad_embed)
    zero[0, 0] = 0.0
    assert not _same(signed, Prompt(step[1].embeds, zero.clone(), step[1].pad_embed))
    # a plan with another speaker materialises another prompt
    swapped = b.build_many(items[:1] + [PromptItem(items[1].input_ids, items[1].language, "ryan",
                                                   non_streaming=items[1].non_streaming)])
    assert not _same(swapped[1], want[1])


def test_build_many_raises_for_a_bad_item(tiny_custom):
    b = PromptBuilder(tiny_custom.model, project_vocabulary(tiny_custom.model))
    ok = PromptItem(_ids(tiny_custom, "Hi."), "english", "ryan")
    with pytest.raises(KeyError):
        b.build_many([ok, PromptItem(ok.input_ids, "english", "nobody")])
    assert b.build_many([]) == []


def _request(i: int, text: str, voice=None, language="english", reference=None, non_streaming=None):
    return SynthesisRequest(request_id=f"r{i}", text=text, voice=voice, language=language,
                            sampling=SamplingConfig(), max_frames=100, output_sample_rate=24000,
                            reference=reference, non_streaming=non_streaming)


def _preparer(name: str, tts) -> RequestPreparer:
    return RequestPreparer(LoadedModel(name, tts, True, torch.device("cpu"), torch.float32,
                                       text_table=_table(tts.model)))


def _check_prepared(preparer: RequestPreparer, reqs, got, errors: dict[int, type]):
    assert len(got) == len(reqs)
    for i, (req, g) in enumerate(zip(reqs, got)):
        if i in errors:
            assert isinstance(g, errors[i]), f"request {i}: {g!r}"
            with pytest.raises(errors[i]):
                preparer.prepare(req)  # the error `prepare` raises for it alone
            continue
        assert isinstance(g, Prepared), f"request {i}: {g!r}"
        want = preparer.prepare(req)
        assert _same(g.prompt, want.prompt)
        assert g.voice_key == want.voice_key
        assert (g.ref_codes is None) == (want.ref_codes is None)
        if g.ref_codes is not None:
            assert torch.equal(g.ref_codes, want.ref_codes)


def test_prepare_many_custom_voice_errors_stay_in_place(tiny_custom):
    p = _preparer("synthetic-tiny", tiny_custom)
    reqs = [_request(0, "Hello there.", "ryan"), _request(1, "An unknown voice.", "nobody"),
            _request(2, LONG, "eric", "auto", non_streaming=False), _request(3, "", "vivian", "auto"),
            _request(4, "An unknown language.", "ryan", "klingon")]
    text_ids = [p.text_ids(r.text) for r in reqs]
    text_ids[3] = None  # tokenized here
    got = p.prepare_many(reqs, text_ids)
    _check_prepared(p, reqs, got, {1: KeyError, 4: KeyError})
    assert _batched(got[0].prompt, [g.prompt for g in got if isinstance(g, Prepared)])


def test_prepare_many_voice_clones(tiny_base, reference_audio):
    """A too-short reference fails alone; x-vector and ICL clones beside it are prepared, and
    the voice cache serves a repeated reference as `prepare` does."""
    wav, sr = reference_audio
    p = _preparer("synthetic-tiny-base", tiny_base)
    xv = ReferenceAudio(wav, sr, "")
    reqs = [_request(0, "First clone.", reference=xv),
            _request(1, "Too short.", reference=ReferenceAudio(wav[:1000].copy(), sr, "")),
            _request(2, "In context.", reference=ReferenceAudio(wav, sr, REF_TEXT)),
            _request(3, "The first voice again.", reference=xv, non_streaming=True),
            _request(4, "No reference at all.")]
    got = p.prepare_many(reqs)
    assert p.voice_cache_hits == 1  # request 3 reused request 0's voice
    _check_prepared(p, reqs, got, {1: RuntimeError})
    assert got[0].voice_key == got[3].voice_key and got[2].ref_codes is not None
    assert _batched(got[0].prompt, [got[0].prompt, got[3].prompt, got[4].prompt])


@pytest.mark.gpu
def test_build_many_on_cuda_equals_build(tiny_custom):
    """On a GPU a step's indices reach the device through reused pinned buffers (`_Staging`, no
    wait for the stream's earlier work): several steps in a row, of growing and shrinking sizes
    (a buffer replaced, buffers reused after their copies), each bit for bit what `build` makes
    one prompt at a time."""
    tts = build_synthetic(SYNTHETIC_NAMES["synthetic-tiny"], device="cuda")
    b = PromptBuilder(tts.model, _table(tts.model))
    items = _custom_items(tiny_custom)
    for n in (1, len(items), 3, len(items), 2, 5, 1, len(items)):
        _check_step(b, items[:n], [n > 1] * n)


def embed_rows_vs_torch(dtype: str, device: str = "cpu") -> list:
    """materialise through the one-launch row kernel (embed_rows) and through its torch ops, for
    the same plans: per prompt, whether the two are bit for bit equal (-0.0 planted in the table);
    and the number of kernel launches. Run under TRITON_INTERPRET=1 (or with CUDA tables)."""
    from dataclasses import replace

    from tts_server.model import embed_rows

    tts = build_synthetic(SYNTHETIC_NAMES["synthetic-tiny"], dtype=getattr(torch, dtype), device=device)
    b = PromptBuilder(tts.model, _table(tts.model))
    # the ids on the CPU, as the server tokenizes them (ids on the device would take `build`)
    plans = [b.plan(replace(it, input_ids=it.input_ids.cpu())) for it in _custom_items(tts)]
    calls = []
    fn = embed_rows.embed_rows
    embed_rows.embed_rows = lambda *a: calls.append(1) or fn(*a)
    try:
        fast = b.materialise(plans)
    finally:
        embed_rows.embed_rows = fn
    usable, embed_rows.usable = embed_rows.usable, lambda *a: False
    try:
        slow = b.materialise(plans)
    finally:
        embed_rows.usable = usable
    return [_same(x, y) for x, y in zip(fast, slow)] + [len(calls)]


def test_prompt_rows_in_one_launch_equal_the_torch_ops():
    """The row kernel (`materialise` on a GPU) gives the torch path's prompts bit for bit, in bf16
    and fp32: text rows copied (a -0.0 stays), codec rows added and rounded once (Triton
    interpreter, a subprocess so that no other module sees it)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = ("import json, sys; sys.path.insert(0, 'tests'); import test_prompt_many as t; "
            "print('RESULT', json.dumps([t.embed_rows_vs_torch(d) for d in ('bfloat16', 'float32')]))")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for got in json.loads(proc.stdout.split("RESULT", 1)[1]):
        assert got[-1] == 1 and all(got[:-1]) and len(got) == 13, got


@pytest.mark.gpu
def test_prompt_rows_in_one_launch_on_cuda():
    """The row kernel on a GPU: bf16 prompts bit for bit the torch ops'."""
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("compiled kernels only")
    got = embed_rows_vs_torch("bfloat16", "cuda")
    assert got[-1] == 1 and all(got[:-1]), got


def test_text_ids_equal_the_tokenizer_call(tiny_custom):
    """RequestPreparer.text_ids calls the fast tokenizer's backend directly: the ids of the
    tokenizer's own __call__ (which qwen-tts uses) for text of every kind, special-token text in
    a request included; and with a truncating backend it falls back to __call__."""
    p = _preparer("synthetic-tiny", tiny_custom)
    texts = TEXTS + ["你好，世界。今天天气很好！", "Emoji 🙂🎉 and accents: café, naïve, Zoë.",
                     "Tabs\tand\nnew lines,   spaces  ", "<|im_end|> <|im_start|>assistant\n inside text",
                     "1234567890 " * 50, "ÄÖÜß ¿Qué? Привет мир. こんにちは", "a" * 3000]
    tok = tiny_custom.processor.tokenizer
    for text in texts:
        want = tok(tiny_custom._build_assistant_text(text))["input_ids"]
        assert p.text_ids(text) == want, text[:40]
    backend = tok.backend_tokenizer
    backend.enable_truncation(8)
    try:
        q = _preparer("synthetic-tiny", tiny_custom)
        assert q.text_ids(LONG) == tok(tiny_custom._build_assistant_text(LONG))["input_ids"]  # the __call__ path
        assert len(q.text_ids(LONG)) > 8
    finally:
        backend.no_truncation()
    assert p.text_ids(LONG) != p.text_ids(LONG[:-20])  # the check can fail


@pytest.mark.gpu
def test_the_row_kernel_is_compiled_before_serving_and_only_once():
    """PromptBuilder.warm_up (the server's start-up) compiles the row kernel; prompts of every
    length then run on that one variant (a compile while serving cost a request ~90 ms on an
    H100: scripts/gpu_c1_profile.py)."""
    from dataclasses import replace

    from tts_server.model import embed_rows

    tts = build_synthetic(SYNTHETIC_NAMES["synthetic-tiny"], dtype=torch.bfloat16, device="cuda")
    b = PromptBuilder(tts.model, _table(tts.model))
    caches = embed_rows._embed_rows_kernel.device_caches

    def variants() -> int:  # compiled kernels of every device (the cache's first field)
        return sum(len(c[0]) for c in caches.values())

    b.warm_up()  # (a variant for bf16 tables may exist already: an earlier test's)
    warm = variants()
    assert warm >= 1
    plans = [b.plan(replace(it, input_ids=it.input_ids.cpu())) for it in _custom_items(tts)]
    lengths = set()
    for k in range(len(plans)):
        for some in (plans[k:k + 1], plans[:k + 1]):
            lengths.add(sum(len(p.text) for p in some))
            b.materialise(some)
    assert len(lengths) > 8 and variants() == warm
