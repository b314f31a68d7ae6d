"""Prefill embeddings for one request, built exactly as qwen-tts `generate` builds them.

Layout (0.6B models): role block P(<|im_start|> assistant \\n); codec prefix
[think|nothink, think_bos, (lang), think_eos, (speaker), pad, bos] summed with tts_pad.../tts_bos;
then the text part, in streaming-text or non-streaming mode, or the ICL block for voice clones.
P(x) = text_projection(text_embedding(x)); C(c) = the talker's codec embedding.
`build_many` builds a step's prompts together: each row planned on the host, all materialised
with a few gathers and one addition, bitwise equal to `build` one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from . import embed_rows

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
    # (key, n): embeds[:n] is a function of `key` alone, bitwise (the role rows and the codec
    # prefix: the same for every prompt of one voice and language), so a batched prefill may
    # compute those rows' K/V once for all prompts with this key; None: nothing shared
    shared: tuple[tuple, int] | None = None


@dataclass
class VoiceClone:
    """Speaker information for a Base model (from qwen-tts create_voice_clone_prompt)."""

    speaker_embedding: torch.Tensor  # [H] x-vector
    ref_codes: torch.Tensor | None = None  # [R, 16] reference frames (ICL mode), else None
    ref_ids: torch.Tensor | None = None  # [1, n] tokenized "<|im_start|>assistant\n{ref}<|im_end|>\n"


@dataclass
class PromptItem:
    """What `build` takes, for `build_many`."""

    input_ids: torch.Tensor | list[int]  # [1, T] on the CPU, or the T ids as a list (no tensor to make)
    language: str = "auto"
    speaker: str | None = None
    clone: VoiceClone | None = None
    non_streaming: bool = False

    def ids_tensor(self) -> torch.Tensor:
        """input_ids as `build` takes them, [1, T]."""
        ids = self.input_ids
        return ids if isinstance(ids, torch.Tensor) else torch.tensor([ids], dtype=torch.long)


_NO_CODEC, _XVEC = -1, -2  # PlannedRows.codec entries: no codec addend; the clone's x-vector


@dataclass
class PlannedRows:
    """A prompt as table rows (from `PromptBuilder.plan`): embeds row i = P(text[i]), plus
    C(codec[i]) when codec[i] >= 0 (the x-vector when _XVEC); trailing rows = P(trailing)."""

    text: list[int]
    codec: list[int]
    xvec: torch.Tensor | None  # the clone's x-vector, for the _XVEC row
    trailing: list[int]
    shared: int = 0  # leading rows that are a function of their (text, codec) ids alone

    def shared_key(self) -> tuple[tuple, int] | None:
        """Prompt.shared for these rows: keyed by the ids of the shared rows (equal ids, equal
        embeddings: `materialise` builds each row from its own ids)."""
        n = self.shared
        return ((tuple(self.text[:n]), tuple(self.codec[:n])), n) if n else None


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


class _Staging:
    """Host -> device copies of a step's index lists through reused pinned buffers. The copy
    used to be a blocking one from pageable memory, which (CUDA's API synchronization rules)
    first waits for the work queued on the stream, here the previous frame's talker step; from
    pinned memory it is only queued behind that work. (Not measured on its own.) A buffer is
    reused only after its last copy ran (an event; long done by then, `slots` steps later)."""

    def __init__(self, slots: int = 4):
        self._bufs: list[tuple[torch.Tensor, torch.cuda.Event] | None] = [None] * slots
        self._next = 0

    def to_device(self, values, device: torch.device) -> torch.Tensor:
        """values: ints (a list, or an int64 numpy array) -> a long tensor on `device`."""
        host = torch.from_numpy(np.asarray(values, dtype=np.int64))
        if device.type != "cuda":
            return host.to(device)
        i, self._next = self._next, (self._next + 1) % len(self._bufs)
        slot = self._bufs[i]
        if slot is not None:
            slot[1].synchronize()
        if slot is None or slot[0].numel() < host.numel():
            slot = (torch.empty(max(4096, 2 * host.numel()), dtype=torch.long, pin_memory=True),
                    torch.cuda.Event())
        buf = slot[0][:host.numel()]
        buf.copy_(host)
        out = buf.to(device, non_blocking=True)
        slot[1].record()
        self._bufs[i] = slot
        return out


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
        self._staging = _Staging()
        self._codec_weight = self.talker.get_input_embeddings().weight  # its dtype / device follow .to()
        # the ids `plan` uses, read once: a transformers config's attribute access costs ~2 µs
        # each, a dozen per prompt
        c, cfg = self.tcfg, self.cfg
        self._tts_ids = (cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id)
        self._prefix_ids = (c.codec_nothink_id, c.codec_think_bos_id, c.codec_think_eos_id, c.codec_think_id)
        self._codec_pad_bos = (c.codec_pad_id, c.codec_bos_id)
        self._spk_id, self._language_ids, self._dialects = c.spk_id, c.codec_language_id, c.spk_is_dialect

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
        lang_id = None if lang == "auto" else self._language_ids[lang]
        if lang in ("chinese", "auto") and speaker:
            dialect = self._dialects[speaker.lower()]
            if dialect is not False:
                lang_id = self._language_ids[dialect]
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
        bos, eos, pad = self._fixed("text", self._tts_ids).chunk(3, dim=1)  # 3 x [1, 1, H]
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

    @torch.inference_mode()
    def build_many(self, items: Sequence[PromptItem]) -> list[Prompt]:
        """`build` of every item, bitwise the same, with a handful of device ops for all of them
        (rows planned on the host, see `plan`); raises what `build` raises for a bad item."""
        return self.materialise([self.plan(item) for item in items])

    def _plannable(self) -> bool:
        """Rows can be gathered: a text table on the codec table's device and in its dtype (else
        `build` would mix dtypes or devices, and only `build` knows how)."""
        w = self._codec_weight
        t = self.text_table
        return t is not None and t.dtype == w.dtype and t.device == w.device

    def plan(self, item: PromptItem) -> Prompt | PlannedRows:
        """`build(item)` as host-side row indices for `materialise`; no device work. Layouts
        without a plan (ICL clones, no text table, ids not on the CPU, an x-vector of the wrong
        size) come back built, by `build`. Raises what `build` raises for a bad item."""
        clone, ids = item.clone, item.input_ids
        if (not self._plannable() or (isinstance(ids, torch.Tensor) and ids.device.type != "cpu")
                or (clone is not None and (clone.ref_codes is not None
                                           or clone.speaker_embedding.numel() != self.text_table.shape[1]))):
            return self.build(item.ids_tensor(), item.language, item.speaker, clone, item.non_streaming)
        if isinstance(ids, torch.Tensor):
            ids = ids[0].tolist()
        bos, eos, pad = self._tts_ids
        if clone is not None:
            speaker = [_XVEC]
        else:
            speaker = [self._spk_id[item.speaker.lower()]] if item.speaker else []
        lang_id = self.language_id(item.language, None if clone is not None else item.speaker)
        nothink, think_bos, think_eos, think = self._prefix_ids
        codec_pad, codec_bos = self._codec_pad_bos
        prefix = [nothink, think_bos, think_eos] if lang_id is None else [think, think_bos, lang_id, think_eos]
        codec = prefix + speaker + [codec_pad, codec_bos]
        # role rows alone, then the head: pad... bos over the codec prefix (as in `build`)
        text = ids[:3] + [pad] * (len(codec) - 2) + [bos]
        adds = [_NO_CODEC] * len(ids[:3]) + codec[:-1]
        shared = len(text) if clone is None else 0  # a clone's x-vector row is its own
        if item.non_streaming:
            body = ids[3:-5] + [eos]
            text += body + [pad]
            adds += [codec_pad] * len(body) + [codec_bos]
            trailing = [pad]
        else:
            first = ids[3:4]
            text += first
            adds += [codec_bos] * len(first)
            trailing = ids[4:-5] + [eos]
        return PlannedRows(text, adds, clone.speaker_embedding if clone is not None else None, trailing, shared)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile `materialise`'s row kernel before serving (its first launch compiles it, ~0.1 s
        that the first request would otherwise wait for; its row counts are not specialized, so
        one compile serves every prompt)."""
        codec_table = self._codec_weight
        if self.text_table is not None and embed_rows.usable(self.text_table, codec_table):
            idx = torch.zeros(4, dtype=torch.long, device=self.text_table.device)  # one row of each kind
            embed_rows.embed_rows(self.text_table, codec_table, idx, 1, 1)

    @torch.inference_mode()
    def materialise(self, plans: Sequence[Prompt | PlannedRows]) -> list[Prompt]:
        """The prompts of `plan`s (built ones pass through): one index copy to the device, a
        gather of every text row, one of every codec row, the x-vectors placed by index, one
        addition, and a selection keeping rows without a codec addend as gathered (no `+ 0`).
        Each prompt's embeds/trailing are views of two step-wide tensors."""
        rows = [p for p in plans if isinstance(p, PlannedRows)]
        if not rows:
            return list(plans)
        text, adds, trailing, xpos, xvecs = [], [], [], [], []
        for r in rows:
            if r.xvec is not None:
                xpos.append(len(text) + r.codec.index(_XVEC))
                xvecs.append(r.xvec)
            text += r.text
            adds += r.codec
            trailing += r.trailing
        n, m = len(text), len(trailing)
        table = self.text_table
        codec = np.array(adds, dtype=np.int64)
        idx = self._staging.to_device(np.concatenate((  # the one host -> device copy
            np.array(text + trailing, dtype=np.int64), np.maximum(codec, 0), codec != _NO_CODEC,
            np.array(xpos, dtype=np.int64))), table.device)
        codec_table = self._codec_weight
        if not xvecs and embed_rows.usable(table, codec_table):  # the same bits in one launch
            embeds, trail = embed_rows.embed_rows(table, codec_table, idx, n, m)
        else:
            text_idx, trailing_idx, codec_idx, has_codec, xpos_idx = idx.split([n, m, n, n, len(xpos)])
            t_rows = table[text_idx]  # [n, H]
            c_rows = self.talker.get_input_embeddings()(codec_idx)  # [n, H]
            if xvecs:
                xv = torch.stack([x.reshape(-1).to(table.device) for x in xvecs]).to(table.dtype)
                c_rows = c_rows.index_copy(0, xpos_idx, xv)
            embeds = torch.where(has_codec.bool()[:, None], t_rows + c_rows, t_rows)  # text + codec, as `build`
            trail = table[trailing_idx]  # [m, H], apart: it outlives the prefill
        pad_embed = self._fixed("text", self._tts_ids)[0, 2]
        out, e0, t0 = [], 0, 0
        for p in plans:
            if isinstance(p, PlannedRows):
                out.append(Prompt(embeds=embeds.narrow(0, e0, len(p.text)),
                                  trailing=trail.narrow(0, t0, len(p.trailing)), pad_embed=pad_embed,
                                  shared=p.shared_key()))
                e0, t0 = e0 + len(p.text), t0 + len(p.trailing)
            else:
                out.append(p)
        return out

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
