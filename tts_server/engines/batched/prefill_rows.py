"""Batched talker prefill: every prompt token of every admission is one row through the same
batch-invariant ops as a decode step. Each row writes its K/V at its slot's position and attends
over its own slot's positions 0..pos (paged attention with the row's slot's block table), so a
prompt's K/V and last hidden state are bitwise the same alone or beside any other prompts."""

from __future__ import annotations

import torch

from ...model.lm import rope_cos_sin
from .frame import paged_attend, stack_forward
from .kv_pool import PagedKV
from .params import StackParams


@torch.inference_mode()
def prefill_rows(sp: StackParams, kv: PagedKV, x: torch.Tensor, slots: torch.Tensor,
                 pos: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """x [N, H] fp32: the prompt embeddings of all admissions, concatenated; slots [N] long: each
    row's slot (its blocks must be allocated and synced to `kv.table`); pos [N] int: the row's
    position in its prompt; last [A] long: the row index of each prompt's last token.
    Writes K/V of every row into the pool; returns the final-normed hidden states [A, H] fp32.
    The same code as a decode step's talker (frame.FrameStep._talker), with a row per token."""
    pos = pos.to(torch.int32)
    cos, sin = rope_cos_sin(pos[:, None], sp.cfg, torch.float32)
    cos, sin = cos[:, 0], sin[:, 0]  # [N, HD]
    table = kv.table[slots]  # [N, MAX_BLOCKS] int32
    blk = table.gather(1, (pos // kv.block_size).long()[:, None])[:, 0].long()
    off = (pos % kv.block_size).long()
    hidden = stack_forward(x, sp, paged_attend(sp, cos, sin, kv.k, kv.v, blk, off, table, pos + 1))
    return hidden[last]
