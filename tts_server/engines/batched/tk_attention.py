"""Batch-invariant attention in Triton. Decode: paged attention with fixed-size position splits per
(row, kv head), combined in split order; the split size depends on the page size only, never on B or
the context. Prefill: causal attention of a step's prompts by query blocks of one prompt."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import pdl
from .ops import PREFILL_QB


_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# the prefill attention's dots: fp32 accuracy on tensor cores (3 tf32 products); the interpreter
# has no tf32, so there exact fp32
PRECISION: tl.constexpr = tl.constexpr("ieee" if _INTERPRET else "tf32x3")

# (positions per split, num_warps) by KV element size; from the pool's dtype alone, never from B
# or the context. A split is one tile of whole pages; splits are merged in order. OVERRIDE: sweeps.
CONFIG = {2: (64, 4), 4: (64, 4)}
OVERRIDE: dict[int, tuple[int, int]] = {}


def attn_config(kv_bytes: int, block: int) -> tuple[int, int]:
    """-> (pages per split, num_warps)."""
    pos, warps = OVERRIDE.get(kv_bytes) or CONFIG[kv_bytes]
    return max(1, triton.cdiv(pos, block)), warps


@triton.jit
def _attn_split_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, len_ptr, m_ptr, l_ptr, acc_ptr, scale,
                       MAX_BLOCKS, NSPLIT, NKV: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr,
                       PPS: tl.constexpr, HD: tl.constexpr, HD_P2: tl.constexpr, GDC: tl.constexpr):
    pdl.enter(GDC)
    # program (b, kv head, split): positions [split*PPS*BLOCK, +PPS*BLOCK) of row b for the G query
    # heads of this kv head -> partial max m, sum l, unnormalised acc [HD] per query head.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    n = tl.load(len_ptr + b)
    start = sp * PPS * BLOCK
    if start >= n:
        return
    j = tl.arange(0, PPS * BLOCK)
    pos = start + j
    pmask = pos < n
    page = tl.load(bt_ptr + b * MAX_BLOCKS + sp * PPS + j // BLOCK, mask=pmask, other=0)
    d = tl.arange(0, HD_P2)
    dmask = d < HD
    row_off = ((page.to(tl.int64) * NKV + kvh) * BLOCK + j % BLOCK) * HD
    kvmask = pmask[:, None] & dmask[None, :]
    k = tl.load(k_ptr + row_off[:, None] + d[None, :], mask=kvmask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + row_off[:, None] + d[None, :], mask=kvmask, other=0.0).to(tl.float32)
    for g in tl.static_range(G):
        h = kvh * G + g
        q = tl.load(q_ptr + (b * NKV * G + h) * HD + d, mask=dmask, other=0.0)
        s = tl.sum(k * q[None, :], axis=1) * scale
        s = tl.where(pmask, s, float("-inf"))
        m = tl.max(s, axis=0)
        p = tl.exp(s - m)
        o = ((b * NKV * G + h) * NSPLIT + sp)
        tl.store(m_ptr + o, m)
        tl.store(l_ptr + o, tl.sum(p, axis=0))
        tl.store(acc_ptr + o * HD + d, tl.sum(p[:, None] * v, axis=0), mask=dmask)


@triton.jit
def _attn_combine_kernel(m_ptr, l_ptr, acc_ptr, len_ptr, out_ptr, NH, NSPLIT,
                         SPLIT_LEN: tl.constexpr, HD: tl.constexpr, HD_P2: tl.constexpr, GDC: tl.constexpr):
    pdl.enter(GDC)
    # program (b, h): the used splits of row b, head h, merged in split order -> out [HD]
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(len_ptr + b)
    used = (n + SPLIT_LEN - 1) // SPLIT_LEN
    d = tl.arange(0, HD_P2)
    dmask = d < HD
    base = (b * NH + h) * NSPLIT
    m = tl.full((), float("-inf"), tl.float32)
    l = tl.zeros((), tl.float32)
    acc = tl.zeros((HD_P2,), tl.float32)
    for s in range(0, used):
        ms = tl.load(m_ptr + base + s)
        m_new = tl.maximum(m, ms)
        a_old = tl.exp(m - m_new)
        a_new = tl.exp(ms - m_new)
        l = l * a_old + tl.load(l_ptr + base + s) * a_new
        acc = acc * a_old + tl.load(acc_ptr + (base + s) * HD + d, mask=dmask, other=0.0) * a_new
        m = m_new
    out = tl.where(used > 0, acc / tl.where(used > 0, l, 1.0), 0.0)
    tl.store(out_ptr + (b * NH + h) * HD + d, out, mask=dmask)


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, NH, HD] fp32; k_pool/v_pool [NUM_BLOCKS, NKV, BLOCK, HD]; block_table [B, MAX_BLOCKS]
    int32; seq_lens [B] int32 -> [B, NH, HD] fp32. Grid fixed by (B, NKV, MAX_BLOCKS)."""
    b, nh, hd = q.shape
    nkv, block = k_pool.shape[1], k_pool.shape[2]
    max_blocks = block_table.shape[1]
    assert q.dtype == torch.float32 and k_pool.is_contiguous() and v_pool.is_contiguous()
    assert block & (block - 1) == 0 and nh % nkv == 0, (block, nh, nkv)
    pps, warps = attn_config(k_pool.element_size(), block)
    nsplit = triton.cdiv(max_blocks, pps)
    q = q.contiguous()
    bt = block_table.contiguous()
    lens = seq_lens.contiguous()
    m = torch.empty((b, nh, nsplit), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty((b, nh, nsplit, hd), dtype=torch.float32, device=q.device)
    out = torch.empty((b, nh, hd), dtype=torch.float32, device=q.device)
    hd_p2 = triton.next_power_of_2(hd)
    _attn_split_kernel[(b, nkv, nsplit)](q, k_pool, v_pool, bt, lens, m, l, acc, float(scale),
                                         max_blocks, nsplit, NKV=nkv, G=nh // nkv, BLOCK=block,
                                         PPS=pps, HD=hd, HD_P2=hd_p2, num_warps=warps, **pdl.kw())
    _attn_combine_kernel[(b, nh)](m, l, acc, lens, out, nh, nsplit, SPLIT_LEN=pps * block, HD=hd,
                                  HD_P2=hd_p2, num_warps=1, **pdl.kw())
    return out


# ---- prefill: causal attention of a step's prompts over their own fp32 K/V ---------------------


@triton.jit
def _prefill_attn_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, pos_ptr, qrow_ptr, qn_ptr, out_ptr, scale,
                         MAX_BLOCKS, NKV: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr,
                         QB: tl.constexpr, HD: tl.constexpr, GDC: tl.constexpr):
    pdl.enter(GDC)
    # program (query block, query head): rows qrow..qrow+qn-1 of ONE prompt (they share its block
    # table); keys walked page by page from position 0 with an online softmax; the dots on tensor
    # cores at fp32 accuracy (tf32x3). A row's bits depend on its prompt alone: the query block, its
    # rows and the pages walked are the prompt's (a page past a row's position is fully masked and
    # leaves its state unchanged).
    qb = tl.program_id(0)
    h = tl.program_id(1)
    nq = tl.load(qn_ptr + qb)
    if nq == 0:
        return
    kvh = h // G
    r0 = tl.load(qrow_ptr + qb)
    i = tl.arange(0, QB)
    rmask = i < nq
    rows = r0 + i
    posr = tl.load(pos_ptr + rows, mask=rmask, other=0)
    npages = tl.max(posr, axis=0) // BLOCK + 1
    d = tl.arange(0, HD)
    j = tl.arange(0, BLOCK)
    q = tl.load(q_ptr + (rows[:, None] * (NKV * G) + h) * HD + d[None, :], mask=rmask[:, None], other=0.0)
    m = tl.full((QB,), float("-inf"), tl.float32)
    l = tl.zeros((QB,), tl.float32)
    acc = tl.zeros((QB, HD), tl.float32)
    for pg in range(0, npages):
        page = tl.load(bt_ptr + r0 * MAX_BLOCKS + pg).to(tl.int64)
        off = ((page * NKV + kvh) * BLOCK + j) * HD
        k = tl.load(k_ptr + off[:, None] + d[None, :])
        v = tl.load(v_ptr + off[:, None] + d[None, :])
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [QB, BLOCK]
        s = tl.where((pg * BLOCK + j)[None, :] <= posr[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m = m_new
    tl.store(out_ptr + (rows[:, None] * (NKV * G) + h) * HD + d[None, :], acc / l[:, None],
             mask=rmask[:, None])


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
                      pos: torch.Tensor, qrow: torch.Tensor, qn: torch.Tensor, scale: float) -> torch.Tensor:
    """q [N, NH, HD] fp32 (rows of a step's prompts); k/v [S, NKV, BLOCK, HD] fp32 (the prompts'
    scratch blocks); table [N, MAX_BLOCKS] int32 (each row's prompt's blocks); pos [N] int32 (the
    row's position in its prompt); qrow/qn [Q] int32: query blocks (first row, rows; qn 0: unused),
    each inside one prompt -> [N, NH, HD] fp32: row r attends over positions 0..pos[r]; rows in no
    query block are zeros. Grid fixed by (Q, NH)."""
    n, nh, hd = q.shape
    nkv, block = k.shape[1], k.shape[2]
    assert q.dtype == k.dtype == v.dtype == torch.float32 and k.is_contiguous() and v.is_contiguous()
    assert hd & (hd - 1) == 0 and block >= 16 and nh % nkv == 0, (hd, block, nh, nkv)
    out = torch.zeros_like(q)
    _prefill_attn_kernel[(qrow.shape[0], nh)](q.contiguous(), k, v, table.contiguous(), pos, qrow, qn, out,
                                               float(scale), table.shape[1], NKV=nkv, G=nh // nkv, BLOCK=block,
                                               QB=PREFILL_QB, HD=hd, num_warps=4, **pdl.kw())
    return out
