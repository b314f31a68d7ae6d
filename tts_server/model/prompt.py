"""Prefill embeddings for one request, built exactly as qwen-tts `generate` builds them.

Layout (0.6B models): role block P(<|im_start|> assistant \\n); codec prefix
[think|nothink, think_bos, (lang), think_eos, (speaker), pad, bos] summed with tts_pad.../tts_bos;
then the text part, in streaming-text or non-streaming mode, or the ICL block for voice clones.
P(x) = text_projection(text_embedding(x)); C(c) = the talker's codec embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Without a vocabulary table, text-track vectors are projected in blocks of this many rows aligned
# to their track index, so a vector's value does not depend on how the text arrived (a GEMM's rows
# depend on its row count).
TRACK_BLOCK = 16


@dataclass
class Prompt:
    """A stream's prefill, as qwen-tts builds it."""

    embeds: torch.Tensor  # [L, H] talker input embeddings of the prefill positions
    trailing: torch.Tensor  # [N, H] pending text-track vectors, consumed one per step
    pad_embed: torch.Tensor  # [H] text-track vector once `trailing` is exhausted (tts_pad)


@dataclass
class VoiceClone:
    """Speaker information for a Base model (from qwen-tts create_voice_clone_prompt)."""

    speaker_embedding: torch.Tensor  # [H] x-vector
    ref_codes: torch.Tensor | None = None  # [R, 16] reference frames (ICL mode), else None
    ref_ids: torch.Tensor | None = None  # [1, n] tokenized "<|im_start|>assistant\n{ref}<|im_end|>\n"


def project_vocabulary(model, chunk: int = 8192) -> torch.Tensor:
    """P(x) = text_projection(text_embedding(x)) for every text token id -> [V, H] in the model's
    dtype, on its device. P acts on each position alone, so a prompt's text rows are then plain
    rows of this table: no GEMM per request, and the same bits whatever else is admitted with it
    (computed once, in fixed chunks, so the table itself does not depend on traffic)."""
    talker = model.talker
    emb = talker.get_text_embeddings()
    rows = []
    with torch.inference_mode():
        for start in range(0, emb.num_embeddings, chunk):
            ids = torch.arange(start, min(start + chunk, emb.num_embeddings), device=talker.device)
            rows.append(talker.text_projection(emb(ids)))
    return torch.cat(rows)


class PromptBuilder:
    """Builds `Prompt`s from token ids with the model's own embedding tables (or, when given,
    a `project_vocabulary` table for the text rows)."""

    def __init__(self, model, text_table: torch.Tensor | None = None):
        self.model = model  # qwen-tts Qwen3TTSForConditionalGeneration
        self.text_table = text_table  # [V, H] or None
        self.talker = model.talker
        self.cfg = model.config
        self.tcfg = model.config.talker_config
        # embeddings of the fixed id sequences every prompt uses (specials, role, codec prefixes,
        # speakers): computed once, so a prompt costs little beyond its own text
        self._cache: dict[tuple, torch.Tensor] = {}

    def _text(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [1, n] -> [1, n, H]."""
        if self.text_table is not None:
            return self.text_table[ids.to(self.text_table.device)]
        return self.talker.text_projection(self.talker.get_text_embeddings()(ids))

    def text_track(self, ids: list[int], start: int = 0) -> torch.Tensor:
        """P(ids) for text-track entries start..start+n-1 -> [n, H]; each computed inside its
        TRACK_BLOCK-aligned block (the other rows padded), so the whole track and the same track
        built piece by piece hold bitwise the same vectors."""
        if self.text_table is not None:  # rows of the vocabulary table: invariant already
            t = torch.tensor([ids], dtype=torch.long)
            return self._text(t)[0]
        n, blocks, spans = len(ids), [], []
        for b0 in range(start - start % TRACK_BLOCK, start + n, TRACK_BLOCK):
            block = [self.cfg.tts_pad_token_id] * TRACK_BLOCK
            lo, hi = max(b0, start), min(b0 + TRACK_BLOCK, start + n)
            block[lo - b0:hi - b0] = ids[lo - start:hi - start]
            blocks.append(block)
            spans.append((lo - b0, hi - b0))
        if not blocks:
            return self._fixed("text", (self.cfg.tts_pad_token_id,))[0, :0]
        t = torch.tensor(blocks, dtype=torch.long).to(self.talker.device)  # one copy, no sync
        return torch.cat([self._text(t[i:i + 1])[0, a:b] for i, (a, b) in enumerate(spans)])

    def eos_vector(self) -> torch.Tensor:
        """The tts_eos text-track vector [1, H] that follows the text."""
        return self._fixed("text", (self.cfg.tts_eos_token_id,))[0]

    def _fixed(self, kind: str, ids: tuple[int, ...]) -> torch.Tensor:
        """A cached `_text` ("text") or codec-embedding ("codec") of fixed ids -> [1, n, H]."""
        key = (kind, ids)
        if key not in self._cache:
            t = torch.tensor([ids], device=self.talker.device, dtype=torch.long)
            self._cache[key] = (self._text(t) if kind == "text"
                                else self.talker.get_input_embeddings()(t))
        return self._cache[key]

    def _codec(self, ids: list[int]) -> torch.Tensor:
        """codec ids -> [1, n, H]."""
        return self._fixed("codec", tuple(ids))

    def language_id(self, language: str, speaker: str | None) -> int | None:
        lang = language.lower()
        lang_id = None if lang == "auto" else self.tcfg.codec_language_id[lang]
        if lang in ("chinese", "auto") and speaker:
            dialect = self.tcfg.spk_is_dialect[speaker.lower()]
            if dialect is not False:
                lang_id = self.tcfg.codec_language_id[dialect]
        return lang_id

    @torch.inference_mode()
    def build(self, input_ids: torch.Tensor, language: str = "auto", speaker: str | None = None,
              clone: VoiceClone | None = None, non_streaming: bool = False) -> Prompt:
        """input_ids [1, T]: "<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n"."""
        c = self.tcfg
        dev = self.talker.device
        role = self._fixed("text", tuple(input_ids[0, :3].tolist()))
        track_ids = input_ids[0, 4:-5].tolist()  # while on the CPU: no device sync
        input_ids = input_ids.to(dev)
        bos, eos, pad = self._fixed("text", (self.cfg.tts_bos_token_id, self.cfg.tts_eos_token_id,
                                             self.cfg.tts_pad_token_id)).chunk(3, dim=1)  # 3 x [1, 1, H]
        if clone is not None:
            speaker_embed = clone.speaker_embedding.to(dev, pad.dtype).view(1, 1, -1)
        elif speaker:
            speaker_embed = self._codec([c.spk_id[speaker.lower()]])
        else:
            speaker_embed = None
        lang_id = self.language_id(language, None if clone is not None else speaker)
        prefix = ([c.codec_nothink_id, c.codec_think_bos_id, c.codec_think_eos_id] if lang_id is None
                  else [c.codec_think_id, c.codec_think_bos_id, lang_id, c.codec_think_eos_id])
        parts = [self._codec(prefix)]
        if speaker_embed is not None:
            parts.append(speaker_embed)
        parts.append(self._codec([c.codec_pad_id, c.codec_bos_id]))
        codec = torch.cat(parts, dim=1)  # [1, n, H]
        head = torch.cat((pad.expand(-1, codec.shape[1] - 2, -1), bos), dim=1) + codec[:, :-1]
        embeds = torch.cat((role, head), dim=1)
        text_ids = input_ids[:, 3:-5]
        if clone is not None and clone.ref_codes is not None:
            icl, trailing = self._icl(text_ids, clone, pad, eos, non_streaming)
            embeds = torch.cat((embeds, icl), dim=1)
        elif non_streaming:
            text = torch.cat((self._text(text_ids), eos), dim=1)
            text = text + self._codec([c.codec_pad_id])  # the same row at every position
            embeds = torch.cat((embeds, text, pad + self._codec([c.codec_bos_id])), dim=1)
            trailing = pad
        else:
            embeds = torch.cat((embeds, self._text(input_ids[:, 3:4]) + codec[:, -1:]), dim=1)
            trailing = torch.cat((self.text_track(track_ids)[None], eos), dim=1)
        return Prompt(embeds=embeds[0], trailing=trailing[0], pad_embed=pad[0, 0])

    def _icl(self, text_ids, clone: VoiceClone, pad, eos, non_streaming: bool):
        """The in-context block: reference text + target text over bos + reference frames."""
        c = self.tcfg
        ref_text_ids = clone.ref_ids.to(text_ids.device)[:, 3:-2]
        text = torch.cat((self._text(torch.cat((ref_text_ids, text_ids), dim=-1)), eos), dim=1)
        codes = clone.ref_codes.to(text_ids.device)  # [R, 16]
        frames = self.talker.get_input_embeddings()(codes[:, :1])  # [R, 1, H]
        cp_tables = self.talker.code_predictor.get_input_embeddings()
        rest = [cp_tables[i - 1](codes[:, i:i + 1]) for i in range(1, c.num_code_groups)]
        frames = torch.cat([frames] + rest, dim=1).sum(1).unsqueeze(0)  # [1, R, H]
        codec = torch.cat((self._codec([c.codec_bos_id]), frames), dim=1)
        n_text, n_codec = text.shape[1], codec.shape[1]
        if non_streaming:
            block = text + self._codec([c.codec_pad_id])
            return torch.cat((block, codec + pad), dim=1), pad
        if n_text > n_codec:
            return text[:, :n_codec] + codec, text[:, n_codec:]
        text = torch.cat([text] + [pad] * (n_codec - n_text), dim=1)
        return text + codec, pad
