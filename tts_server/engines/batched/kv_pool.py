"""Paged talker KV: a shared pool of fixed-size blocks per layer, a device block table per slot,
and the host allocator that hands blocks out as a slot's position grows and takes them back.

Block 0 is never handed out: it is the scratch block that padding rows and unused table entries
point at, so a graph replay never writes outside the pool.
"""

from __future__ import annotations

import math

import torch

from ...model.weights import LMConfig


class BlockAllocator:
    """Host-side free list of block ids 1..num_blocks-1 and each slot's blocks, in position order."""

    def __init__(self, num_blocks: int, num_slots: int):
        if num_blocks < 2:
            raise ValueError("the pool needs at least 2 blocks (block 0 is scratch)")
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks - 1, 0, -1))  # pop() hands out the lowest id first
        self.owned: list[list[int]] = [[] for _ in range(num_slots)]

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self.free)

    def grow(self, slot: int, num: int) -> list[tuple[int, int]] | None:
        """Give `slot` blocks until it owns `num`. Returns the new (index, block) pairs, or None
        (and changes nothing) when the pool cannot supply them."""
        have = self.owned[slot]
        need = num - len(have)
        if need <= 0:
            return []
        if need > len(self.free):
            return None
        new = [(len(have) + i, self.free.pop()) for i in range(need)]
        have.extend(b for _, b in new)
        return new

    def release(self, slot: int) -> None:
        self.free.extend(reversed(self.owned[slot]))
        self.owned[slot] = []


class PagedKV:
    """k, v [layers, num_blocks, NKV, block_size, HD] (kv_dtype) and block_table [slots, max_blocks]
    int32 on the device, with a host mirror that is copied over once per step when it changed."""

    def __init__(self, cfg: LMConfig, num_slots: int, max_positions: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device):
        self.block_size = block_size
        self.max_blocks = math.ceil(max_positions / block_size)
        shape = (cfg.num_layers, num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.table = torch.zeros(num_slots, self.max_blocks, dtype=torch.int32, device=device)
        pin = device.type == "cuda"
        self.table_host = torch.zeros(num_slots, self.max_blocks, dtype=torch.int32, pin_memory=pin)
        self.alloc = BlockAllocator(num_blocks, num_slots)
        self.dirty = False

    @staticmethod
    def nbytes(cfg: LMConfig, num_blocks: int, block_size: int, dtype: torch.dtype) -> int:
        per = cfg.num_layers * cfg.num_kv_heads * block_size * cfg.head_dim
        return 2 * num_blocks * per * torch.empty((), dtype=dtype).element_size()

    def ensure(self, slot: int, num_positions: int) -> bool:
        """Make room for positions 0..num_positions-1 of `slot`; False when the pool is out of blocks."""
        new = self.alloc.grow(slot, math.ceil(num_positions / self.block_size))
        if new is None:
            return False
        for j, b in new:
            self.table_host[slot, j] = b
        self.dirty |= bool(new)
        return True

    def blocks(self, slot: int) -> list[int]:
        return self.alloc.owned[slot]

    def release(self, slot: int) -> None:
        self.alloc.release(slot)
        self.table_host[slot].zero_()
        self.dirty = True

    def sync(self) -> None:
        """Copy the host block table to the device if it changed (stream-ordered, no host wait)."""
        if self.dirty:
            self.table.copy_(self.table_host, non_blocking=True)
            self.dirty = False
