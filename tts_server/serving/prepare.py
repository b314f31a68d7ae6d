"""Turn a `SynthesisRequest` into engine inputs: tokenize, clone the voice, build the prefill.

Tokenizing is CPU work without torch (`text_ids`, done when a request is submitted, off the engine
thread); the rest runs on the engine thread, one request at a time (`prepare`) or a step's
admissions together (`prepare_many`: their prompts in a few device ops). Voice-clone prompts (speaker embedding, reference
codes, tokenized transcript) are cached by a hash of the reference's content, so a repeated
reference costs no encoder work."""

from __future__ import annotations

import collections
import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..api import ReferenceAudio, SynthesisRequest
from ..model.loader import LoadedModel
from ..model.prompt import Prompt, PromptBuilder, PromptItem, VoiceClone


@dataclass
class Prepared:
    prompt: Prompt
    ref_codes: torch.Tensor | None  # [R, 16]: primes the codec state (ICL), audio discarded
    voice_key: str | None = None  # the reference's content hash (voice clones)


class RequestPreparer:
    """`prepare` runs on the engine thread (it calls the model's embedding tables and encoders);
    `text_ids` on any thread."""

    def __init__(self, loaded: LoadedModel, max_cached_voices: int = 64):
        self.tts = loaded.tts
        self.max_cached_voices = max_cached_voices
        self._voices: collections.OrderedDict[str, VoiceClone] = collections.OrderedDict()
        self.voice_cache_hits = 0
        self.builder = PromptBuilder(loaded.model, loaded.text_table)
        # qwen-tts wrapper defaults: CustomVoice/VoiceDesign put all text in the prefill,
        # voice cloning streams the text in alongside the codec frames.
        self.non_streaming = loaded.model_type != "base"
        self._tokenizer = loaded.tts.processor.tokenizer
        self._tokenizer_lock = threading.Lock()  # HF fast tokenizers are not safe across threads
        # A fast tokenizer's __call__ runs its Rust backend's encode (special tokens added, no
        # truncation or padding: it switches them off first) inside its own Python; calling the
        # backend gives the same ids, text_ids 101 -> 65 us for an English sentence on the CI
        # machine. Every request pays it on the engine process's pipe thread, which shares the
        # GIL with the engine thread: `encode_batch` of one text (the same ids, the same time)
        # releases the GIL while its Rust code runs, where `encode` holds it (burst of calls:
        # ~256 x 50 us the engine thread would otherwise wait for).
        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        if backend is not None and backend.truncation is None and backend.padding is None:
            self._encode = lambda text: backend.encode_batch([text], add_special_tokens=True)[0].ids
        else:
            self._encode = lambda text: self._tokenizer(text)["input_ids"]

    def text_ids(self, text: str) -> list[int]:
        """The request text's prompt ids, as qwen-tts tokenizes them (its processor calls this
        tokenizer); any thread, no torch."""
        with self._tokenizer_lock:
            return self._encode(self.tts._build_assistant_text(text))

    def _ids(self, text: str) -> torch.Tensor:
        with self._tokenizer_lock:
            return torch.tensor([self._encode(text)], dtype=torch.long)  # [1, T] on the CPU

    def _item(self, req: SynthesisRequest, text_ids: list[int] | None) -> tuple[PromptItem, str | None]:
        """The builder's input for a request, and its voice key (voice clones)."""
        if text_ids is None:
            text_ids = self.text_ids(req.text)
        key, clone = self._voice(req.reference) if req.reference is not None else (None, None)
        non_streaming = self.non_streaming if req.non_streaming is None else req.non_streaming
        # the ids as a list: the builder plans from it (a tensor only where it must build)
        return PromptItem(text_ids, req.language, req.voice, clone, non_streaming), key

    @staticmethod
    def _prepared(prompt: Prompt, item: PromptItem, key: str | None) -> Prepared:
        return Prepared(prompt, item.clone.ref_codes if item.clone is not None else None, key)

    @torch.inference_mode()
    def prepare(self, req: SynthesisRequest, text_ids: list[int] | None = None) -> Prepared:
        """text_ids: `text_ids(req.text)` when the caller has them already."""
        item, key = self._item(req, text_ids)
        prompt = self.builder.build(item.ids_tensor(), item.language, item.speaker, clone=item.clone,
                                    non_streaming=item.non_streaming)
        return self._prepared(prompt, item, key)

    @torch.inference_mode()
    def prepare_many(self, reqs: Sequence[SynthesisRequest],
                     text_ids_list: Sequence[list[int] | None] | None = None) -> list[Prepared | Exception]:
        """`prepare` of each request, bitwise the same prompts, built together (`build_many`).
        A request's own failure (a bad reference, an unknown voice, ...) is its entry, the
        exception object; the others are prepared. Should the step-wide device work fail, every
        request planned into it gets that exception."""
        if text_ids_list is None:
            text_ids_list = [None] * len(reqs)
        out: list[Prepared | Exception | None] = [None] * len(reqs)
        planned = []  # (position, item, voice key, plan)
        for i, (req, text_ids) in enumerate(zip(reqs, text_ids_list, strict=True)):
            try:
                item, key = self._item(req, text_ids)
                planned.append((i, item, key, self.builder.plan(item)))
            except Exception as e:  # noqa: BLE001 - this request's own error
                out[i] = e
        try:
            prompts = self.builder.materialise([p for *_, p in planned])
        except Exception as e:  # noqa: BLE001 - the shared work failed: each planned request's error
            prompts = [e] * len(planned)
        for (i, item, key, _), prompt in zip(planned, prompts):
            out[i] = prompt if isinstance(prompt, Exception) else self._prepared(prompt, item, key)
        return out

    def _voice(self, ref: ReferenceAudio) -> tuple[str, VoiceClone]:
        """The reference's content hash and voice-clone prompt, from the cache when the same
        audio and transcript came before (least recently used entries go first)."""
        h = hashlib.sha256(ref.samples.tobytes())
        h.update(f"|{ref.sample_rate}|{ref.samples.dtype}|".encode() + ref.transcript.encode())
        key = h.hexdigest()
        if key in self._voices:
            self._voices.move_to_end(key)
            self.voice_cache_hits += 1
            return key, self._voices[key]
        icl = bool(ref.transcript)
        item = self.tts.create_voice_clone_prompt(
            ref_audio=(ref.samples, ref.sample_rate), ref_text=ref.transcript or None,
            x_vector_only_mode=not icl)[0]
        clone = VoiceClone(
            speaker_embedding=item.ref_spk_embedding,
            ref_codes=item.ref_code if icl else None,
            ref_ids=self._ids(self.tts._build_ref_text(ref.transcript)) if icl else None)
        self._voices[key] = clone
        if len(self._voices) > self.max_cached_voices:
            self._voices.popitem(last=False)
        return key, clone
