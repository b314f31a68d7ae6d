"""Turn a `SynthesisRequest` into engine inputs: tokenize, clone the voice, build the prefill."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..api import SynthesisRequest
from ..model.prompt import Prompt
from ..model.loader import LoadedModel
from ..model.prompt import PromptBuilder, VoiceClone


@dataclass
class Prepared:
    prompt: Prompt
    ref_codes: torch.Tensor | None  # [R, 16]: primes the codec state (ICL), audio discarded


class RequestPreparer:
    """Runs on the engine thread (it calls the model's embedding tables and encoders)."""

    def __init__(self, loaded: LoadedModel):
        self.tts = loaded.tts
        self.builder = PromptBuilder(loaded.model)
        # qwen-tts wrapper defaults: CustomVoice/VoiceDesign put all text in the prefill,
        # voice cloning streams the text in alongside the codec frames.
        self.non_streaming = loaded.model_type != "base"

    def _ids(self, text: str) -> torch.Tensor:
        return self.tts._tokenize_texts([text])[0]  # [1, T]

    @torch.inference_mode()
    def prepare(self, req: SynthesisRequest) -> Prepared:
        ids = self._ids(self.tts._build_assistant_text(req.text))
        clone = None
        if req.reference is not None:
            ref = req.reference
            icl = bool(ref.transcript)
            item = self.tts.create_voice_clone_prompt(
                ref_audio=(ref.samples, ref.sample_rate), ref_text=ref.transcript or None,
                x_vector_only_mode=not icl)[0]
            clone = VoiceClone(
                speaker_embedding=item.ref_spk_embedding,
                ref_codes=item.ref_code if icl else None,
                ref_ids=self._ids(self.tts._build_ref_text(ref.transcript)) if icl else None)
        prompt = self.builder.build(ids, req.language, req.voice, clone=clone,
                                    non_streaming=self.non_streaming)
        return Prepared(prompt, clone.ref_codes if clone is not None else None)
