"""Per-slot decode state in device arrays indexed by slot (the last slot is the padding scratch).

Integer and float fields are stored field-major ([fields, slots]) so that one gather by the
step's slot list yields every field as a contiguous [B] row.
"""

from __future__ import annotations

import numpy as np
import torch

from ...api import SamplingConfig

# int32 fields, rows of `ints`
POS, CODE0, N_SAMPLED, TEXT_STEP, N_TRAILING, DO_SAMPLE, TOP_K, SUB_DO_SAMPLE, SUB_TOP_K, EOS_FROM = range(10)
NUM_INTS = 10
NUM_STEP_INTS = 4  # POS..TEXT_STEP: what a frame advances
# float32 fields, rows of `floats`
TEMPERATURE, TOP_P, PENALTY, SUB_TEMPERATURE, SUB_TOP_P = range(5)
NUM_FLOATS = 5
SEED_COL, STAGED_COLS = 16, 18  # admit_many's staging rows: ints, floats' bits, pad, seed (2 words)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without a host wait: a CUDA copy goes through pinned memory (from
    pageable memory it would wait for the stream). PyTorch's caching host allocator keeps the
    pinned block until the copy has run."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class SlotState:
    """Device arrays for `num_slots` slots (+1 scratch slot at index num_slots)."""

    def __init__(self, num_slots: int, hidden: int, vocab: int, max_trailing: int,
                 device: torch.device, text_dtype: torch.dtype = torch.bfloat16):
        n = num_slots + 1
        self.scratch = num_slots
        self.max_trailing = max_trailing
        self.ints = torch.zeros(NUM_INTS, n, dtype=torch.int32, device=device)
        self.floats = torch.ones(NUM_FLOATS, n, dtype=torch.float32, device=device)
        self.seed = torch.zeros(n, dtype=torch.int64, device=device)
        self.past_hidden = torch.zeros(n, hidden, dtype=torch.float32, device=device)
        self.trailing = torch.zeros(n, max_trailing, hidden, dtype=text_dtype, device=device)
        self.pad_embed = torch.zeros(n, hidden, dtype=text_dtype, device=device)
        self.seen = torch.zeros(n, vocab, dtype=torch.uint8, device=device)

    @staticmethod
    def nbytes(num_slots: int, hidden: int, vocab: int, max_trailing: int, text_bytes: int = 2) -> int:
        n = num_slots + 1
        return n * (NUM_INTS * 4 + NUM_FLOATS * 4 + 8 + hidden * 4 + (max_trailing + 1) * hidden * text_bytes
                    + vocab)

    def admit(self, slot: int, sampling: SamplingConfig, length: int, trailing: torch.Tensor,
              pad_embed: torch.Tensor, past_hidden: torch.Tensor, eos_from: int = 0) -> None:
        """Fill `slot` for a stream whose prefill covered `length` positions (code 0 not yet drawn)."""
        self.admit_many([slot], [sampling], [length], [trailing], [pad_embed], past_hidden[None], [eos_from])

    def admit_many(self, slots: list[int], samplings: list[SamplingConfig], lengths: list[int],
                   trailings: list[torch.Tensor], pad_embeds: list[torch.Tensor], past_hidden: torch.Tensor | None,
                   eos_froms: list[int], rows: torch.Tensor | None = None) -> None:
        """`admit` for a step's admissions at once (a handful of copies for all of them, however
        many): past_hidden [A, H] (None: the caller writes it later); the other lists one entry
        per slot; rows: `slots` already on the device."""
        n_tr = [t.shape[0] for t in trailings]
        if max(n_tr) > self.max_trailing:
            raise ValueError(f"{max(n_tr)} pending text vectors exceed {self.max_trailing}")
        dev = self.ints.device
        if rows is None:
            rows = to_device(torch.tensor(slots, dtype=torch.long), dev)
        # one staging copy for the int, float and seed fields: [A, 18] int32 = ints 0..9, the
        # floats' bits 10..14, the seed's two words 16..17 (an int64 view needs an even column)
        host = np.zeros((len(slots), STAGED_COLS), dtype=np.int32)
        host[:, :NUM_INTS] = [[n, 0, 0, 0, t, int(s.do_sample), int(s.top_k), int(s.subtalker_do_sample),
                               int(s.subtalker_top_k), e] for s, n, t, e in zip(samplings, lengths, n_tr, eos_froms)]
        host[:, NUM_INTS:NUM_INTS + NUM_FLOATS] = np.asarray(
            [[s.temperature, s.top_p, s.repetition_penalty, s.subtalker_temperature, s.subtalker_top_p]
             for s in samplings], dtype=np.float32).view(np.int32)
        host[:, SEED_COL:SEED_COL + 2] = np.asarray([int(s.seed) & (2**63 - 1) for s in samplings],
                                                    dtype=np.int64)[:, None].view(np.int32)
        staged = to_device(torch.from_numpy(host), dev)
        self.ints[:, rows] = staged[:, :NUM_INTS].T
        self.floats[:, rows] = staged[:, NUM_INTS:NUM_INTS + NUM_FLOATS].view(torch.float32).T
        self.seed[rows] = staged[:, SEED_COL:SEED_COL + 2].view(torch.int64)[:, 0]
        if past_hidden is not None:
            self.past_hidden[rows] = past_hidden.to(self.past_hidden.dtype)
        if sum(n_tr):
            where = to_device(torch.stack((torch.repeat_interleave(torch.tensor(slots), torch.tensor(n_tr)),
                                           torch.cat([torch.arange(t) for t in n_tr]))), dev)
            vectors = torch.cat([t.to(dev) for t in trailings if t.shape[0]])
            self.trailing[where[0], where[1]] = vectors.to(self.trailing.dtype)
        self.pad_embed[rows] = torch.stack([p.to(dev) for p in pad_embeds]).to(self.pad_embed.dtype)
        # index_fill_ takes the value as a scalar argument; `seen[rows] = 0` would copy a CPU scalar
        # tensor from pageable memory, which waits for the stream: the prefill graph launched just
        # before (1.2 ms of one stream's first audio on an H100, scripts/gpu_admit_timeline.py)
        self.seen.index_fill_(0, rows, 0)

    def extend_text(self, slot: int, start: int, vectors: torch.Tensor, eos_from: int | None) -> None:
        """Write text-track vectors [n, H] at `start` of `slot`'s track (StreamSynthesize)."""
        n = start + vectors.shape[0]
        if n > self.max_trailing:
            raise ValueError(f"{n} pending text vectors exceed {self.max_trailing}")
        self.trailing[slot, start:n] = vectors.to(self.trailing.device, self.trailing.dtype)
        self.ints[N_TRAILING, slot] = n
        if eos_from is not None:
            self.ints[EOS_FROM, slot] = eos_from
