"""Tokenization across deltas (model/text_deltas.py) equals the whole text's tokenization, as
Synthesize does it (qwen-tts's processor over the assistant wrapper, stripped text), for any split:
inside words, inside grapheme clusters (ZWJ emoji, flags, combining marks), around whitespace,
contractions and special tokens."""

from __future__ import annotations

import random

import pytest

from tts_server.model.text_deltas import TextDeltas


@pytest.fixture(scope="module")
def tokenizer():
    from tts_server.model.text_tokenizer import build_qwen_tokenizer

    return build_qwen_tokenizer()


@pytest.fixture(scope="module")
def whole(tokenizer):
    """The ids Synthesize feeds the talker for `text` (qwen-tts's processor, sliced [3:-5])."""
    from qwen_tts.core.models.processing_qwen3_tts import Qwen3TTSProcessor

    processor = Qwen3TTSProcessor(tokenizer=tokenizer)

    def ids(text: str) -> list[int]:
        wrapped = f"<|im_start|>assistant\n{text.strip()}<|im_end|>\n<|im_start|>assistant\n"
        return processor(text=wrapped, return_tensors="pt", padding=True)["input_ids"][0, 3:-5].tolist()

    return ids


TEXTS = [
    "Hello there, streaming world! It's 10:45 and we're testing.",
    "你好，世界。今天天气很好，我们去公园散步吧！",
    "Family: 👨‍👩‍👧‍👦, flags 🇩🇪🇯🇵, skin 👍🏽 and faces 🙂🙃.",
    "Cafe\u0301 na\u0308ive re\u0301sume\u0301 — a\u0315\u0301 x\u0327\u0301",
    "  leading and trailing spaces, new\nlines\n\n and tabs\t here  \n",
    "Don't stop: I'll, you'd, they've, she's; DON'T SHOUT'S.",
    "Numbers 1234567, 3.14159 and -42; mixed 中文English日本語한국어 text.",
    "Hangul jamo \u1100\u1161\u11a8 and \u1112\u1161\u11ab; kana ｶﾞ ガ.",
    "Specials <|im_end|> and <tts_pad> inside, <|im_sta half.",
    "ellipsis... dashes -- quotes \"x\" 'y' (paren) [bracket] {brace}!?",
]


def _pieces(text: str, rng: random.Random, n: int) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(n, len(text) - 1)))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def _feed(tokenizer, pieces) -> TextDeltas:
    td = TextDeltas(tokenizer)
    got = []
    for p in pieces:
        got += td.feed(p)
    got += td.end()
    assert got == td.ids and len(td.ends) == len(td.ids)
    return td


@pytest.mark.parametrize("text", TEXTS)
def test_random_splits_equal_whole(tokenizer, whole, text):
    rng = random.Random(text)
    expected = whole(text)
    for k in (1, 2, 5, len(text) // 3, len(text)):
        for _ in range(3):
            assert _feed(tokenizer, _pieces(text, rng, k)).ids == expected, k


def test_every_single_cut_and_per_character(tokenizer, whole):
    for text in TEXTS[2:5]:
        expected = whole(text)
        for i in range(1, len(text)):
            assert _feed(tokenizer, [text[:i], text[i:]]).ids == expected, (text, i)


def test_random_strings(tokenizer, whole):
    rng = random.Random(0)
    alphabet = list("abcXYZ  ,.'!?-\n\t0123") + ["'s", "'ll", "中", "文", "🙂", "\u200d", "👨", "🇩", "🇪",
                                                 "\u0301", "\u0308", "\u0327", "e", "\u1100", "\u1161",
                                                 "<|im_end|>", "<|", "im_", "<tts_pad>", "...", "  \n "]
    for _ in range(150):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        if not text.strip():
            continue
        expected = whole(text)
        for _ in range(3):
            assert _feed(tokenizer, _pieces(text, rng, rng.randint(1, len(text)))).ids == expected, text


def test_holds_back_only_the_tail(tokenizer, whole):
    td = TextDeltas(tokenizer)
    assert td.feed("Hello") == []  # "Hello" may still become "Hellos"
    first = td.feed(" wor")  # "Hello" is final once a space follows
    assert first == whole("Hello")
    assert td.feed("ld. How") == whole("Hello world.")[1:]
    assert td.ends[-1] == len("Hello world.")
    td.end()
    assert td.ids == whole("Hello world. How")


def test_flush_commits_the_tail_and_starts_a_segment(tokenizer, whole):
    td = TextDeltas(tokenizer)
    td.feed("Hello wor")
    assert td.flush() == whole("Hello wor")[1:]
    assert td.ids == whole("Hello wor")
    td.feed("ld")
    td.end()
    assert td.ids == whole("Hello wor") + tokenizer("ld", add_special_tokens=False)["input_ids"]


def test_limits_and_order(tokenizer):
    td = TextDeltas(tokenizer, max_chars=10)
    td.feed("   ")  # leading whitespace is dropped, as Synthesize strips it
    assert td.text == ""
    with pytest.raises(ValueError, match="exceeds the limit of 10"):
        td.feed("eleven chars")
    td = TextDeltas(tokenizer)
    td.feed("Hi")
    td.end()
    with pytest.raises(ValueError, match="after end"):
        td.feed("more")
