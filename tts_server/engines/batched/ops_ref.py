"""Plain-torch references of the batched decode ops (same signatures as ops.py): the oracles of the
Triton kernels and the path CPU-only callers take. Row m of every output depends only on row m."""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32, w [N, K] (bf16) -> x @ w.T [M, N] fp32 (fp64 accumulation, one rounding)."""
    return (x.double() @ w.double().t()).float()


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32, w_* [I, K] -> silu(x @ w_gate.T) * (x @ w_up.T) [M, I] fp32."""
    xd = x.double()
    g = xd @ w_gate.double().t()
    return (g * torch.sigmoid(g) * (xd @ w_up.double().t())).float()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, D] fp32, w [D] -> w * x * rsqrt(mean(x^2) + eps) [M, D] fp32."""
    xd = x.double()
    r = torch.rsqrt(xd.square().mean(-1, keepdim=True) + eps)
    return (w.double() * (xd * r)).float()


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention over a paged KV pool (not graph-capturable: reads seq_lens on the host).
    q [B, NH, HD]; k_pool/v_pool [NUM_BLOCKS, NKV, BLOCK, HD]; block_table [B, MAX_BLOCKS] int32;
    seq_lens [B] int32 -> [B, NH, HD] fp32 (zeros where seq_len is 0)."""
    b_, nh, hd = q.shape
    nkv, blk = k_pool.shape[1], k_pool.shape[2]
    out = torch.zeros(b_, nh, hd, dtype=torch.float32, device=q.device)
    for b, n in enumerate(seq_lens.tolist()):
        if n <= 0:
            continue
        pages = block_table[b, : (n + blk - 1) // blk].long()
        k = k_pool[pages].double().permute(1, 0, 2, 3).reshape(nkv, -1, hd)[:, :n]  # [NKV, n, HD]
        v = v_pool[pages].double().permute(1, 0, 2, 3).reshape(nkv, -1, hd)[:, :n]
        k = k.repeat_interleave(nh // nkv, 0)  # [NH, n, HD]
        v = v.repeat_interleave(nh // nkv, 0)
        s = torch.einsum("hd,hnd->hn", q[b].double(), k) * scale
        out[b] = torch.einsum("hn,hnd->hd", s.softmax(-1), v).float()
    return out


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
                      pos: torch.Tensor, qrow: torch.Tensor, qn: torch.Tensor, scale: float) -> torch.Tensor:
    """ops.prefill_attention: each row of a query block over positions 0..pos of its table."""
    covered = torch.zeros(q.shape[0], dtype=torch.bool)
    for r0, n in zip(qrow.tolist(), qn.tolist()):
        covered[r0:r0 + n] = True
    covered = covered.to(q.device)
    return paged_attention(q, k, v, table, torch.where(covered, pos.to(torch.int32) + 1, 0), scale)


def talker_process_(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor,
                    n_sampled: torch.Tensor, eos: int, suppress_start: int,
                    min_new_tokens: int) -> None:
    """In place on logits [B, V] fp32 (seen [B, V] uint8, penalty [B] fp32, n_sampled [B] int32):
    repetition penalty over seen ids, ids [suppress_start, V) -> -inf except eos, eos -> -inf while
    n_sampled < min_new_tokens (model/sampler.py's repetition_penalty_ then talker_mask_)."""
    p = penalty.float()[:, None]
    pen = torch.where(logits < 0, logits * p, logits / p)
    logits.copy_(torch.where(seen.bool(), pen, logits))
    keep = logits[:, eos].clone()
    logits[:, suppress_start:] = NEG_INF
    logits[:, eos] = torch.where(n_sampled < min_new_tokens, torch.full_like(keep, NEG_INF), keep)


# ---- counter-based RNG: 32-bit integer hash, computed here in int64 with explicit wrap-around ----
_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) int64 without int64 overflow (c split in 16-bit halves)."""
    lo = (x * (c & 0xFFFF)) & _M32
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (xor-shift-multiply, 'lowbias32' constants) on int64 holding uint32."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_key(seed: torch.Tensor, counter: torch.Tensor, stream: int) -> torch.Tensor:
    """seed/counter [B] int64, stream int -> [B] int64 holding the row's uint32 key."""
    h = mix32((seed & _M32) ^ 0x9E3779B9)
    h = mix32(h ^ ((seed >> 32) & _M32))
    h = mix32(h ^ (counter & _M32))
    h = mix32(h ^ ((counter >> 32) & _M32))
    return mix32(h ^ (stream & _M32))


def gumbel(key: torch.Tensor, v: int) -> torch.Tensor:
    """key [B] (uint32 in int64), v -> Gumbel noise [B, V] fp64 from 32 hashed bits per token id."""
    tok = torch.arange(v, dtype=torch.int64, device=key.device)[None]
    r = mix32(mix32((tok + key[:, None]) & _M32) ^ key[:, None])
    u = (r.double() + 0.5) * 2.0 ** -32
    return -torch.log(-torch.log(u))


def _order_key(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> int64 keys with the same order (for the threshold searches)."""
    b = x.view(torch.int32).long()
    return torch.where(b < 0, -(b & 0x7FFFFFFF), b)


def warp_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
              top_p: torch.Tensor) -> torch.Tensor:
    """[B, V] fp32 -> temperature-scaled logits with -inf outside each row's top-k / top-p set.
    top-k keeps values >= the k-th largest (ties kept, as sampler.warp); top-p removes the smallest
    values (ties together) whose probability mass is <= 1 - top_p, never the largest."""
    b_, v = logits.shape
    s = logits / temperature[:, None]
    k = torch.where((top_k > 0) & (top_k < v), top_k, torch.full_like(top_k, v)).long()
    kth = s.sort(-1, descending=True).values.gather(1, (k - 1)[:, None])
    s = s.masked_fill(s < kth, NEG_INF)
    p = (s - s.max(-1, keepdim=True).values).double().exp()
    p = p / p.sum(-1, keepdim=True)
    srt, idx = s.sort(-1)
    ps = p.gather(1, idx)
    # mass of all values <= each value (ties included together)
    cum = ps.cumsum(-1)
    key = _order_key(srt)
    last_of_tie = torch.ones_like(key, dtype=torch.bool)
    last_of_tie[:, :-1] = key[:, 1:] != key[:, :-1]
    cum_tie = torch.where(last_of_tie, cum, torch.full_like(cum, float("inf")))
    cum_tie = cum_tie.flip(-1).cummin(-1).values.flip(-1)
    remove_sorted = cum_tie <= (1.0 - top_p.double())[:, None]
    remove_sorted &= srt < srt[:, -1:]
    remove_sorted &= (top_p < 1.0)[:, None]
    remove = torch.zeros_like(remove_sorted).scatter(1, idx, remove_sorted)
    return s.masked_fill(remove, NEG_INF)


def sample_tokens(logits: torch.Tensor, do_sample: torch.Tensor, temperature: torch.Tensor,
                  top_k: torch.Tensor, top_p: torch.Tensor, seed: torch.Tensor,
                  counter: torch.Tensor, stream: int, embed: torch.Tensor | None = None, into: tuple | None = None):
    """logits [B, V] fp32 (or partial products [P, B, V], added in order) -> (codes [B] int32 in
    [0, V), finite [B] bool) (and embed[codes] as fp32 with a table). Greedy rows: argmax (first
    among ties). Sampled rows: argmax of warped logits + Gumbel noise keyed by (seed, counter,
    stream, id). finite: no NaN / +inf in the row and not every entry -inf (masked -inf entries
    are allowed)."""
    if logits.dim() == 3:
        parts, logits = logits, logits[0]
        for p in range(1, parts.shape[0]):
            logits = logits + parts[p]
    codes, finite = _sample(logits, do_sample, temperature, top_k, top_p, seed, counter, stream)
    codes = codes.clamp(0, logits.shape[1] - 1)
    if into is not None:
        out, col, err_col, bit = into
        b = codes.shape[0]
        out[:b, col] = codes
        out[:b, err_col] |= (~finite).to(torch.int32) << bit
    if embed is not None:
        return codes, finite, embed[codes.long()].float()
    return codes, finite


def _sample(logits, do_sample, temperature, top_k, top_p, seed, counter, stream):
    v = logits.shape[1]
    finite = ~(torch.isnan(logits) | (logits == float("inf"))).any(-1) & (logits > NEG_INF).any(-1)
    safe = torch.where(finite[:, None], logits, torch.zeros_like(logits))
    greedy = safe.argmax(-1)
    score = warp_rows(safe, temperature.float(), top_k, top_p.float()).double()
    score = score + gumbel(row_key(seed.long(), counter.long(), stream), v)
    drawn = score.argmax(-1)
    codes = torch.where(do_sample != 0, drawn, greedy).to(torch.int32)
    return codes, finite
