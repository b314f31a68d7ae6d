"""Talker prefill into the slots' KV blocks: `prefill` (one prompt, plain PyTorch fp32 over the bf16
weights, optionally through PrefillGraphs) and `prefill_rows_fp32_attention` (all of a step's prompts
as rows of the batch-invariant ops, attending over fp32 K/V)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ...model.lm import apply_rope, rope_cos_sin
from . import pdl
from .ops import PREFILL_QB
from .params import StackParams


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] fp32 -> [..., D] fp32 (as ops.rms_norm)."""
    return w.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [L, K] fp32 @ w [N, K] (bf16, upcast) -> [L, N] fp32."""
    return x @ w.float().T


def write_blocks(pool: torch.Tensor, blocks: torch.Tensor, t: torch.Tensor) -> None:
    """pool [num_blocks, NKV, BS, HD]; blocks [nb] long; t [NKV, L, HD] with L <= nb * BS:
    position i goes to block blocks[i // BS], offset i % BS."""
    nkv, n, hd = t.shape
    bs = pool.shape[2]
    nb = blocks.numel()
    padded = t.new_zeros(nkv, nb * bs, hd)
    padded[:, :n] = t
    pool[blocks] = padded.view(nkv, nb, bs, hd).transpose(0, 1).to(pool.dtype)


@torch.inference_mode()
def prefill(p: StackParams, x: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
            blocks: torch.Tensor, last: torch.Tensor | None = None) -> torch.Tensor:
    """x [L, H] fp32 prompt embeddings; k_pool / v_pool [layers, num_blocks, NKV, BS, HD];
    blocks [ceil(L / BS)] long: the slot's blocks. Writes K/V of positions 0..L-1 and returns
    the final-normed hidden state [H] fp32 of position `last` ([1] long; default L - 1)."""
    cfg = p.cfg
    n, nh, nkv, hd, eps = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    cos, sin = rope_cos_sin(torch.arange(n, device=x.device)[None], cfg, torch.float32)  # [1, L, HD]
    for i in range(cfg.num_layers):
        h = _rms(x, p.in_norm[i], eps)
        qkv = _mm(h, p.wqkv[i])
        q, k, v = qkv.split((nh * hd, nkv * hd, nkv * hd), dim=-1)
        q = _rms(q.reshape(n, nh, hd), p.q_norm[i], eps).transpose(0, 1)[None]  # [1, NH, L, HD]
        k = _rms(k.reshape(n, nkv, hd), p.k_norm[i], eps).transpose(0, 1)[None]
        v = v.reshape(n, nkv, hd).transpose(0, 1)[None]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        write_blocks(k_pool[i], blocks, k[0])
        write_blocks(v_pool[i], blocks, v[0])
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=hd ** -0.5, enable_gqa=True)
        x = x + _mm(att[0].transpose(0, 1).reshape(n, nh * hd), p.wo[i])
        h = _rms(x, p.post_norm[i], eps)
        x = x + _mm(F.silu(_mm(h, p.gate[i])) * _mm(h, p.up[i]), p.down[i])
    return _rms(x[-1] if last is None else x.index_select(0, last)[0], p.final_norm, eps)


# prefill graphs of up to this many rows are captured with programmatic dependent launch (pdl.py;
# the bits are the same). Same-process A/B on an H100 (scripts/gpu_pdl_ab.py pfN variants,
# benchmarks/results/h100-pdl-prefill-rows-ab-5895bb8.json): a 100-row prompt's admission with its
# first frame 6.21 ms with PDL up to 64 rows, 5.90-5.97 with it up to 128-512; admissions of 16
# and 64 prompts (1,024- and 4,096-row buckets) 0.3-0.9 ms slower with PDL in every bucket.
PDL_MAX_ROWS = pdl.max_rows("PREFILL", 512)


def capture(fn, sizes: list[int], dev: torch.device, pdl_rows: int | None = None) -> dict[int, torch.cuda.CUDAGraph]:
    """fn(n) once per size off the capture stream (compiles the kernels, warms the allocator),
    then one CUDA graph of fn(n) per size, largest first, all in one memory pool; sizes up to
    pdl_rows (None: PDL_MAX_ROWS as it is at the call) with PDL."""
    if pdl_rows is None:
        pdl_rows = PDL_MAX_ROWS
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for n in sizes:
            with pdl.scope(n <= pdl_rows):
                fn(n)
    torch.cuda.current_stream(dev).wait_stream(side)
    pool, graphs = torch.cuda.graph_pool_handle(), {}
    for n in reversed(sizes):
        graphs[n] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[n], pool=pool, stream=side), pdl.scope(n <= pdl_rows):  # on dev (see graphs.py)
            fn(n)
    return graphs


class PrefillGraphs:
    """CUDA graphs of `prefill` for prompt-length buckets (one shared memory pool). A prompt is
    zero-padded to its bucket: causal attention keeps positions < L exact; the padding's K/V land
    in the tail of the slot's last block (overwritten by its next frames) or in scratch block 0.
    Same prompt -> same bucket -> same kernels, so prefill stays deterministic."""

    def __init__(self, p: StackParams, k_pool: torch.Tensor, v_pool: torch.Tensor, sizes: list[int]):
        dev, bs = k_pool.device, k_pool.shape[3]
        self.sizes, self.bs = sizes, bs
        self.x = torch.zeros(sizes[-1], p.cfg.hidden_size, dtype=torch.float32, device=dev)
        self.blocks = torch.zeros(-(-sizes[-1] // bs), dtype=torch.long, device=dev)
        self.last = torch.zeros(1, dtype=torch.long, device=dev)
        self.hidden = torch.zeros(p.cfg.hidden_size, dtype=torch.float32, device=dev)

        def fn(n):
            self.hidden.copy_(prefill(p, self.x[:n], k_pool, v_pool, self.blocks[:-(-n // bs)], self.last))

        self.graphs = capture(fn, sizes, dev)  # warm-up writes only scratch block 0 (blocks all 0)

    def fits(self, length: int) -> bool:
        return length <= self.sizes[-1]

    def run(self, x: torch.Tensor, blocks: list[int]) -> torch.Tensor:
        """x [L, H] (L <= the largest bucket), blocks: the slot's blocks -> hidden of L - 1 [H]."""
        n = x.shape[0]
        b = next(s for s in self.sizes if s >= n)
        self.x[:n].copy_(x)
        self.x[n:b].zero_()
        nb = -(-b // self.bs)
        ids = torch.zeros(nb, dtype=torch.long)
        ids[:len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        self.blocks[:nb].copy_(ids)
        self.last.fill_(n - 1)
        self.graphs[b].replay()
        return self.hidden


def query_blocks(lens, qb: int) -> tuple[np.ndarray, np.ndarray]:
    """The prefill attention's query blocks: each prompt's rows (prompts concatenated in order) cut
    into runs of at most qb from the prompt's first row -> (first row [Q], rows [Q]) int64.
    A prompt's blocks depend on its length alone, never on the other prompts."""
    lens = np.asarray(lens, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
    nq = -(-lens // qb)
    which = np.repeat(np.arange(lens.shape[0]), nq)  # the prompt of each query block
    j = np.arange(which.shape[0]) - np.repeat(np.cumsum(nq) - nq, nq)  # its index in the prompt
    return starts[which] + qb * j, np.minimum(qb, lens[which] - qb * j)


def max_query_blocks(rows: int, prompts: int, qb: int) -> int:
    """An upper bound of len(query_blocks(lens)) for sum(lens) <= rows and len(lens) <= prompts."""
    return rows // qb + prompts


# up to this many prompts, stage_rows fills its views prompt by prompt (slice assignments: ~20 us
# for one prompt, ~80 for 8 on a 2-core CI machine); beyond, with whole-array numpy (~120-140 us
# whatever the count). One stream's first audio waits for it: the device idles until the replay.
STAGE_FEW_PROMPTS = 8


def stage_rows(views: dict[str, np.ndarray], lens: list[int], blocks: list[list[int]], pad_block: int,
               skip: list[int] | None = None, lead: list[int] | None = None) -> None:
    """Fill a batched prefill's integer inputs in place. Each prompt's tokens are rows; prompt a's
    K/V go to its own scratch blocks (numbered in order), which are copied to its slot's blocks
    `blocks[a]`: table [n, cols] (each row's scratch blocks; 0 past its prompt's own up to the
    widest prompt's, pad_block beyond and in padding rows), pos [n] (the row's position in its
    prompt; padding 0), last [A'] (each prompt's last row; padding 0), dst [S] (the pool block of
    every scratch block; padding -1), qrow / qn [Q'] (the attention's query blocks,
    `query_blocks`; padding: blocks of 0 rows). Views larger than the prompts need are padded.

    A shared prefix (`shared_rows`): prompt a has no rows for its first skip[a] positions (<= one
    block); their K/V are prompt lead[a]'s, copied each layer from lead[a]'s first scratch block
    into a's: cp_src / cp_dst / cp_n [A'] (scratch blocks and positions of each copy; n 0: none)."""
    (_stage_few if len(lens) <= STAGE_FEW_PROMPTS else _stage_many)(views, lens, blocks, pad_block, skip, lead)


def _stage_few(views, lens, blocks, pad_block, skip, lead) -> None:
    """stage_rows prompt by prompt: the same values as `_stage_many`."""
    table, pos, last, dst, qrow, qn = (views[k] for k in ("table", "pos", "last", "dst", "qrow", "qn"))
    sk = skip or [0] * len(lens)
    widest = max(len(b) for b in blocks)
    cols = table.shape[1]
    r = base = q = 0
    firsts = []  # each prompt's first scratch block
    for a, (n, bl) in enumerate(zip(lens, blocks)):
        rn, nb = n - sk[a], len(bl)
        table[r:r + rn] = [base + c if c < nb else 0 if c < widest else pad_block for c in range(cols)]
        pos[r:r + rn] = np.arange(sk[a], n)
        last[a] = r + rn - 1
        dst[base:base + nb] = bl
        for j in range(0, rn, PREFILL_QB):
            qrow[q], qn[q] = r + j, min(PREFILL_QB, rn - j)
            q += 1
        firsts.append(base)
        r, base = r + rn, base + nb
    table[r:] = pad_block
    pos[r:] = 0
    last[len(lens):] = 0
    dst[base:] = -1
    qrow[q:] = 0
    qn[q:] = 0
    if "cp_n" in views:
        views["cp_src"][:] = views["cp_dst"][:] = views["cp_n"][:] = 0
        if skip is not None:
            c = 0
            for a, k in enumerate(sk):
                if k:
                    views["cp_src"][c], views["cp_dst"][c], views["cp_n"][c] = firsts[lead[a]], firsts[a], k
                    c += 1


def _stage_many(views, lens, blocks, pad_block, skip, lead) -> None:
    """stage_rows with whole-array numpy."""
    ln = np.asarray(lens, dtype=np.int64)
    sk = np.zeros_like(ln) if skip is None else np.asarray(skip, dtype=np.int64)
    rn = ln - sk  # each prompt's rows
    rows = int(rn.sum())
    nb = np.asarray([len(x) for x in blocks], dtype=np.int64)
    base = np.concatenate(([0], np.cumsum(nb)[:-1]))
    starts = np.concatenate(([0], np.cumsum(rn)[:-1]))
    table = views["table"]
    c = np.arange(table.shape[1])
    per_prompt = np.where(c[None, :] < nb[:, None], base[:, None] + c[None, :], np.where(c < nb.max(), 0, pad_block))
    table[:rows] = np.repeat(per_prompt, rn, axis=0)
    table[rows:] = pad_block
    views["pos"][:rows] = np.arange(rows) - np.repeat(starts - sk, rn)
    views["pos"][rows:] = 0
    views["last"][:len(lens)] = starts + rn - 1
    views["last"][len(lens):] = 0
    total = int(nb.sum())
    views["dst"][:total] = [x for bl in blocks for x in bl]
    views["dst"][total:] = -1
    for k, v in zip(("qrow", "qn"), query_blocks(rn, PREFILL_QB)):
        views[k][:v.shape[0]] = v
        views[k][v.shape[0]:] = 0
    if "cp_n" in views:
        views["cp_src"][:] = views["cp_dst"][:] = views["cp_n"][:] = 0
        if skip is not None:
            sel = np.flatnonzero(sk)
            views["cp_src"][:sel.shape[0]] = base[np.asarray(lead, dtype=np.int64)[sel]]
            views["cp_dst"][:sel.shape[0]] = base[sel]
            views["cp_n"][:sel.shape[0]] = sk[sel]


def shared_rows(prompts, block_size: int) -> tuple[list[int], list[int]] | None:
    """Which prompts of one batched prefill take their first rows from an earlier prompt's K/V
    (`Prompt.shared`: the same key, the same rows, bitwise): -> (skip, lead) per prompt, the first
    prompt of each key computing its rows (skip 0, lead -1), or None when nothing is shared. Exact:
    every row's ops are the decode step's batch-invariant ones and a row attends over its own
    prompt's positions 0..pos, whatever rows its query block starts with (`prefill_attention`).
    Shared rows fit one block, and every prompt keeps a row of its own (its last hidden state)."""
    first: dict = {}
    skip, lead = [0] * len(prompts), [-1] * len(prompts)
    for a, pr in enumerate(prompts):
        if pr.shared is None:
            continue
        key, n = pr.shared
        if n > block_size or n >= pr.embeds.shape[0]:
            continue
        if key in first:
            skip[a], lead[a] = n, first[key]
        else:
            first[key] = a
    return (skip, lead) if any(skip) else None


def rows_plan(lens: list[int], blocks: list[list[int]], bs: int, skip: list[int] | None = None,
              lead: list[int] | None = None) -> dict[str, torch.Tensor]:
    """`stage_rows`'s inputs for exactly these prompts, as host tensors: table [N, max blocks]
    int32, pos [N] int32, last [A] long, dst [total blocks] long, qrow / qn [Q] int32 (and cp_src /
    cp_dst / cp_n [A] int32 with a shared prefix)."""
    rn = np.asarray(lens) - (0 if skip is None else np.asarray(skip))
    nq = int((-(-rn // PREFILL_QB)).sum())
    views = dict(table=np.empty((int(rn.sum()), max(len(b) for b in blocks)), np.int32),
                 pos=np.empty(int(rn.sum()), np.int32), last=np.empty(len(lens), np.int64),
                 dst=np.empty(sum(len(b) for b in blocks), np.int64), qrow=np.empty(nq, np.int32),
                 qn=np.empty(nq, np.int32))
    if skip is not None:
        views.update({k: np.empty(len(lens), np.int32) for k in ("cp_src", "cp_dst", "cp_n")})
    stage_rows(views, lens, blocks, 0, skip, lead)
    return {k: torch.from_numpy(v) for k, v in views.items()}


@torch.inference_mode()
def prefill_rows_core(sp: StackParams, kv, x: torch.Tensor, table: torch.Tensor, pos: torch.Tensor,
                      last: torch.Tensor, dst: torch.Tensor, qrow: torch.Tensor, qn: torch.Tensor,
                      cp_src: torch.Tensor | None = None, cp_dst: torch.Tensor | None = None,
                      cp_n: torch.Tensor | None = None) -> torch.Tensor:
    """The device part of `prefill_rows_fp32_attention` (no host values: CUDA-graph capturable).
    x [N, H] fp32; table [N, B] int32 (scratch blocks of each row); pos [N] int32; last [A] long;
    dst [S] long: the pool block each of the S scratch blocks is copied to (< 0: none); qrow / qn [Q] int32: the
    attention's query blocks (`query_blocks`); cp_src / cp_dst / cp_n [C] int32: a shared prefix's
    per-layer copies between scratch blocks (`stage_rows`; None: none) -> [A, H] fp32."""
    from . import glue, ops
    from .frame import stack_forward

    cfg, bs = sp.cfg, kv.block_size
    nh, nkv, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    blk = table.gather(1, (pos // bs).long()[:, None])[:, 0].long()
    off = (pos % bs).long()
    shape = (dst.shape[0], nkv, bs, hd)
    tk = torch.zeros(shape, dtype=torch.float32, device=x.device)
    tv = torch.zeros(shape, dtype=torch.float32, device=x.device)
    cos, sin = rope_cos_sin(pos[:, None], cfg, torch.float32)
    cos, sin = cos[:, 0], sin[:, 0]  # [N, HD]
    scale = hd ** -0.5

    def attend(i, qkv):
        q = glue.qk_rope_store(qkv, sp.q_norm[i], sp.k_norm[i], cos, sin, tk, tv, blk, off, nh, nkv, eps)
        if cp_src is not None:  # shared prefixes: their first prompt's K/V, just stored, into the others'
            glue.copy_prefix(tk, tv, cp_src, cp_dst, cp_n)
        out = ops.prefill_attention(q, tk, tv, table, pos, qrow, qn, scale)
        glue.store_blocks(tk, tv, kv.k[i], kv.v[i], dst)
        return out

    return stack_forward(x, sp, attend)[last]


def prefill_rows_fp32_attention(sp: StackParams, kv, x: torch.Tensor, lens: list[int],
                                blocks: list[list[int]], skip: list[int] | None = None,
                                lead: list[int] | None = None) -> torch.Tensor:
    """prefill_rows (every prompt token a row of the decode step's batch-invariant ops), but the
    prompts attend over fp32 K/V: each layer's K/V go to a one-layer fp32 scratch pool (the step's
    prompts only), attention reads that, and the layer's blocks are then copied, rounded to the
    pool's dtype, into the slots' blocks. Same attention precision as an fp32 prefill, the same K/V
    in the pool as the frames will read; alone or beside other prompts, bitwise the same.
    x [N, H] fp32 (the prompts concatenated); lens: each prompt's length; blocks: each prompt's slot
    blocks (>= its length) -> the final-normed hidden state of each prompt's last position [A, H].
    skip / lead (`shared_rows`): prompt a's rows in x start at position skip[a], its first skip[a]
    positions' K/V being prompt lead[a]'s."""
    plan = rows_plan(lens, blocks, kv.block_size, skip, lead)
    dev = x.device
    keys = ("table", "pos", "last", "dst", "qrow", "qn") + (("cp_src", "cp_dst", "cp_n") if skip is not None else ())
    return prefill_rows_core(sp, kv, x, *(plan[k].to(dev) for k in keys))


class RowPrefillGraphs:
    """CUDA graphs of `prefill_rows_core` for row-count buckets (one shared memory pool), so a
    step's admissions prefill in one replay instead of ~370 launches from Python. Rows past the
    step's prompts are padding: position 0 over a padding scratch block that is not stored in the
    pool (dst -1); real rows never read it. The ops are batch-invariant,
    so a prompt's K/V and hidden state are bitwise those of the eager path, in any bucket.

    A bucket's integer inputs (block tables, positions, query blocks) are views of one int32
    device buffer, filled from one pinned host buffer by one asynchronous copy: no host wait and
    a handful of launches per replay."""

    def __init__(self, sp: StackParams, kv, sizes: list[int], max_prompts: int):
        dev, bs, h = kv.k.device, kv.block_size, sp.cfg.hidden_size
        self.sizes = sizes
        self.bufs: dict[int, dict] = {}
        biggest = 0
        for n in sizes:
            a = min(max_prompts, n)
            cols = -(-n // bs)
            nblk = cols + a + 1  # every prompt's blocks, plus the padding block (last)
            nq = max_query_blocks(n, a, PREFILL_QB)
            layout = dict(table=n * cols, pos=n, last=a, dst=nblk, qrow=nq, qn=nq, cp_src=a, cp_dst=a, cp_n=a)
            ints = torch.zeros(sum(layout.values()), dtype=torch.int32, device=dev)
            b: dict = dict(x=torch.zeros(n, h, device=dev), out=torch.zeros(a, h, device=dev), ints=ints,
                           a=a, cols=cols, nblk=nblk, at={})
            o = 0
            for k, size in layout.items():
                b["at"][k] = (o, size)
                b[k] = ints[o:o + size]
                o += size
            b["table"] = b["table"].view(n, cols)
            b["table"].fill_(nblk - 1)
            b["dst"].fill_(-1)
            self.bufs[n] = b
            biggest = max(biggest, ints.numel())
        pin = dev.type == "cuda"
        self.host = torch.zeros(biggest, dtype=torch.int32, pin_memory=pin)  # the staging copy's source
        self._host_np = self.host.numpy()
        self._copied = torch.cuda.Event() if pin else None  # the last staging copy (the host buffer's reuse)

        def fn(n):
            b = self.bufs[n]
            b["out"].copy_(prefill_rows_core(sp, kv, b["x"], b["table"], b["pos"], b["last"].long(),
                                             b["dst"].long(), b["qrow"], b["qn"], b["cp_src"], b["cp_dst"],
                                             b["cp_n"]))

        self.graphs = capture(fn, sizes, dev)  # warm-up: dst all -1, so no pool block is written

    @property
    def max_rows(self) -> int:
        return self.sizes[-1]

    def _fits(self, n: int, rows: int, prompts: int, nblk: int, cols: int) -> bool:
        """Whether bucket n holds `prompts` prompts of `rows` rows in all, `nblk` blocks in all
        and at most `cols` blocks each."""
        b = self.bufs[n]
        return rows <= n and prompts <= b["a"] and nblk < b["nblk"] and cols <= b["cols"]

    def bucket(self, rows: list[int], blocks: list[list[int]]) -> int | None:
        """The smallest bucket that holds these prompts (rows each, after any shared prefix), or
        None (then prefill eagerly)."""
        need = (sum(rows), len(rows), sum(len(b) for b in blocks), max(len(x) for x in blocks))
        return next((n for n in self.sizes if self._fits(n, *need)), None)

    def chunks(self, lens: list[int], num_blocks: list[int]) -> list[tuple[int, int]]:
        """Cut prompts (lengths, blocks per prompt) into consecutive runs [i, j) that each fit a
        bucket, greedily, in one pass: the largest bucket holds every smaller one's limits. A
        prompt that fits no bucket alone is a run of its own (`bucket` -> None: eager)."""
        top = self.sizes[-1]
        cuts, i, rows, nblk, cols = [], 0, 0, 0, 0
        for j, (n, nb) in enumerate(zip(lens, num_blocks)):
            rows, nblk, cols = rows + n, nblk + nb, max(cols, nb)
            if j > i and not self._fits(top, rows, j + 1 - i, nblk, cols):
                cuts.append((i, j))
                i, rows, nblk, cols = j, n, nb, nb
        cuts.append((i, len(lens)))
        return cuts

    def _stage(self, n: int, lens: list[int], blocks: list[list[int]], skip: list[int] | None,
               lead: list[int] | None) -> None:
        """Write bucket n's integer inputs for these prompts into the pinned host buffer."""
        b = self.bufs[n]
        if self._copied is not None:
            self._copied.synchronize()  # the previous replay's copy has left the host buffer
        views = {k: self._host_np[o:o + size] for k, (o, size) in b["at"].items()}
        views["table"] = views["table"].reshape(n, b["cols"])
        stage_rows(views, lens, blocks, b["nblk"] - 1, skip, lead)  # rows_plan's layout, padded

    def run(self, n: int, x: torch.Tensor, lens: list[int], blocks: list[list[int]],
            skip: list[int] | None = None, lead: list[int] | None = None) -> torch.Tensor:
        """Prefill in bucket n (from `bucket`): x [N, H] fp32 -> hidden of each prompt's last row
        [A, H] fp32, a view of the bucket's buffer (read it before the bucket's next replay).
        skip / lead: a shared prefix (`shared_rows`; x holds prompt a's rows from skip[a])."""
        b = self.bufs[n]
        self._stage(n, lens, blocks, skip, lead)
        ints = b["ints"]
        ints.copy_(self.host[:ints.numel()], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        rows = x.shape[0]
        b["x"][:rows].copy_(x)
        b["x"][rows:].zero_()
        self.graphs[n].replay()
        return b["out"][:len(lens)]
