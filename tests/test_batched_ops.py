"""Batched decode ops: torch references against model/sampler.py, the Triton kernels (CPU through the
Triton interpreter in a subprocess, or CUDA) against the references, and bitwise batch invariance."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tts_server.engines.batched import ops_ref
from tts_server.model.sampler import repetition_penalty_, talker_mask_, warp

ROOT = Path(__file__).resolve().parents[1]
LIN_TOL = 2e-5     # linear / swiglu: max |err| / max |ref| against fp64 on the same (bf16) weights
F32_TOL = 2e-6     # rms_norm / attention over fp32 KV (CUDA cores)
TC_TOL = 1e-5      # attention over bf16 KV on tensor cores: q and the softmax weights as 2 bf16 parts (~4e-6)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double().cpu() - ref.double().cpu()).abs().max() / ref.double().abs().max())


# ---------------------------------------------------------------- cases shared by CPU and GPU
def gemm_case(m: int, k: int, n: int, seed: int, dev: str):
    g = _gen(seed)
    x = torch.randn(m, k, generator=g)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    w2 = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    return x.to(dev), w.to(dev), w2.to(dev)


def attn_case(b: int, nh: int, nkv: int, hd: int, block: int, max_blocks: int, lens, seed: int,
              dev: str, kv_dtype=torch.bfloat16):
    g = _gen(seed)
    num_blocks = b * max_blocks + 3
    q = torch.randn(b, nh, hd, generator=g)
    kp = torch.randn(num_blocks, nkv, block, hd, generator=g).to(kv_dtype)
    vp = torch.randn(num_blocks, nkv, block, hd, generator=g).to(kv_dtype)
    bt = torch.randperm(num_blocks, generator=g)[: b * max_blocks].view(b, max_blocks).int()
    return (q.to(dev), kp.to(dev), vp.to(dev), bt.to(dev),
            torch.tensor(lens, dtype=torch.int32).to(dev))


def sample_case(b: int, v: int, seed: int, dev: str):
    g = _gen(seed)
    logits = torch.randn(b, v, generator=g) * 3
    do_sample = (torch.rand(b, generator=g) < 0.8).int()
    temp = 0.5 + torch.rand(b, generator=g)
    top_k = torch.randint(0, v + 5, (b,), generator=g).int()
    top_p = torch.where(torch.rand(b, generator=g) < 0.5, torch.ones(b), 0.3 + 0.7 * torch.rand(b, generator=g))
    seeds = torch.randint(-2 ** 62, 2 ** 62, (b,), generator=g)
    counter = torch.randint(0, 2 ** 40, (b,), generator=g)
    return [t.to(dev) for t in (logits, do_sample, temp, top_k, top_p, seeds, counter)]


def _rows_in_batches(make_batch, run, sizes, seed: int):
    """Run `run` on batches of each size holding the same row at a random position among random
    neighbours; returns the target row's outputs per size (tuples of tensors)."""
    g = _gen(seed)
    outs = []
    for m in sizes:
        pos = int(torch.randint(0, m, (1,), generator=g))
        res = run(*make_batch(m, pos, int(torch.randint(0, 2 ** 30, (1,), generator=g))))
        res = res if isinstance(res, tuple) else (res,)
        outs.append(tuple(r[pos].cpu() for r in res))
    return outs


def _place(target: torch.Tensor, m: int, pos: int, fill: torch.Tensor) -> torch.Tensor:
    """fill [m, ...] with row `pos` replaced by target [...]."""
    fill = fill.clone()
    fill[pos] = target
    return fill


def check_accuracy(ops, dev: str) -> dict:
    """Kernels against the references; returns the measured errors (asserts the tolerances)."""
    res = {}
    for (m, k, n) in [(5, 96, 40), (3, 2500, 24), (17, 64, 80)]:  # 2500: split-K path
        x, w, w2 = gemm_case(m, k, n, m + k, dev)
        res[f"linear_{m}x{k}x{n}"] = _rel(ops.linear(x, w), ops_ref.linear(x.cpu(), w.cpu()))
        res[f"swiglu_{m}x{k}x{n}"] = _rel(ops.swiglu(x, w, w2),
                                          ops_ref.swiglu(x.cpu(), w.cpu(), w2.cpu()))
    for key, val in res.items():
        assert val < LIN_TOL, (key, val)
    x = torch.randn(6, 200, generator=_gen(1)).to(dev)
    wn = torch.randn(200, generator=_gen(2)).bfloat16().to(dev)
    res["rms_norm"] = _rel(ops.rms_norm(x, wn, 1e-6), ops_ref.rms_norm(x.cpu(), wn.cpu(), 1e-6))
    assert res["rms_norm"] < F32_TOL
    for kv in (torch.bfloat16, torch.float32):
        case = attn_case(4, 4, 2, 32, 8, 7, [0, 1, 13, 56], 3, dev, kv)
        out = ops.paged_attention(*case, 0.17)
        ref = ops_ref.paged_attention(*[c.cpu() for c in case], 0.17)
        assert torch.equal(out[0].cpu(), torch.zeros_like(out[0].cpu()))
        res[f"attention_{str(kv)[6:]}"] = _rel(out, ref)
        assert res[f"attention_{str(kv)[6:]}"] < (TC_TOL if kv == torch.bfloat16 else F32_TOL)
        # fp16 out (for an o_proj with fp16 matrices): the merge is per element, so the same
        # value rounded to nearest even
        out16 = ops.paged_attention(*case, 0.17, torch.float16)
        assert out16.dtype == torch.float16 and torch.equal(out16, out.half()), kv
    return res


def check_attention_program_order(ops, dev: str) -> None:
    """The decode attention's walks compute the same bits: (kv head, row) program order (large B)
    as (row, kv head), and a row's splits taken by Z programs in turn (STRIDED, Z = 1, 2, 3) as
    in runs of SPP (1, 2): the same splits, each computed alone, in another order."""
    from tts_server.engines.batched import tk_attention as ta

    case = attn_case(5, 4, 2, 32, 8, 7, [0, 1, 13, 56, 40], 11, dev, torch.bfloat16)
    before = ta.KV_MAJOR_MIN_B, ta.SPP_BY_B, ta.STRIDE_BY_B
    try:
        outs = {}
        for min_b, spp, z in ((1 << 30, 1, 0), (1, 1, 0), (1 << 30, 2, 0), (1 << 30, 1, 1), (1 << 30, 1, 2),
                              (1, 1, 3)):
            ta.KV_MAJOR_MIN_B, ta.SPP_BY_B, ta.STRIDE_BY_B = min_b, ((1 << 30, spp, 2),), ((1 << 30, z),)
            outs[(min_b, spp, z)] = ops.paged_attention(*case, 0.17)
    finally:
        ta.KV_MAJOR_MIN_B, ta.SPP_BY_B, ta.STRIDE_BY_B = before
    first = outs[(1 << 30, 1, 0)]
    for key, out in outs.items():
        assert torch.equal(first, out), key


def check_talker_process(ops, dev: str) -> None:
    g = _gen(4)
    b, v = 5, 300
    logits = torch.randn(b, v, generator=g) * 4
    seen = (torch.rand(b, v, generator=g) < 0.3).to(torch.uint8)
    pen = torch.tensor([1.05, 1.0, 1.3, 2.0, 0.9])
    nsamp = torch.tensor([0, 1, 2, 7, 1], dtype=torch.int32)
    out = logits.clone().to(dev)
    ops.talker_process_(out, seen.to(dev), pen.to(dev), nsamp.to(dev), 260, 250, 2)
    ref = logits.clone()
    ops_ref.talker_process_(ref, seen, pen, nsamp, 260, 250, 2)
    assert torch.equal(out.cpu(), ref)
    # the slots' seen table with the rows' slots (the frame's call: no gathered copy), rows repeated
    # and out of order
    table = (torch.rand(9, v, generator=g) < 0.3).to(torch.uint8)
    rows = torch.tensor([7, 0, 3, 3, 8])
    out = logits.clone().to(dev)
    ops.talker_process_(out, table.to(dev), pen.to(dev), nsamp.to(dev), 260, 250, 2, rows.to(dev))
    ref = logits.clone()
    ops_ref.talker_process_(ref, table[rows], pen, nsamp, 260, 250, 2)
    assert torch.equal(out.cpu(), ref)


def check_frame_noise(ops, dev: str) -> None:
    """ops.frame_noise makes each of a frame's draws' noise as the draw would (the reference's
    Gumbel noise for the slot's seed, counter and the draw's stream), and a draw given its rows
    draws the codes it draws without them."""
    g = _gen(11)
    slots, n_sampled, ns = 9, 2, 4
    seed = torch.randint(-2 ** 62, 2 ** 62, (slots,), generator=g)
    ints = torch.randint(0, 2 ** 31 - 1, (3, slots), generator=g).int()
    rows = torch.tensor([6, 2, 8])
    b = rows.shape[0]
    counter = ints[n_sampled, rows].long()
    noise = torch.full((b + 1, ns, 512), float("nan"), dtype=torch.float64)
    noise = noise.to(dev)
    if not ops.draws_in_triton(noise):
        return  # the reference's draws make their own noise
    ops.frame_noise(rows.to(dev), seed.to(dev), ints.to(dev), n_sampled, noise, 512, 256)
    for s, v in ((0, 512), (1, 256), (3, 256)):
        want = ops_ref.gumbel(ops_ref.row_key(seed[rows], counter, s), v)
        assert torch.allclose(noise[:b, s, :v].cpu(), want, rtol=1e-15, atol=0), s
    assert torch.isnan(noise[:b, 1:, 256:]).all() and torch.isnan(noise[b:]).all()  # nothing else written
    for s, v in ((0, 300), (2, 200)):
        logits, do_sample, temp, top_k, top_p, _, _ = sample_case(b, v, 20 + s, dev)
        do_sample = torch.ones_like(do_sample)
        args = (logits, do_sample, temp, top_k, top_p, seed[rows].to(dev), counter.to(dev), s)
        plain = ops.sample_tokens(*args, early=True)[0]
        given = ops.sample_tokens(*args, early=True, noise=noise[:b, s])[0]
        assert torch.equal(plain, given), s
        assert torch.equal(given.cpu(), ops_ref.sample_tokens(*[a.cpu() if torch.is_tensor(a) else a for a in args])[0]
                           .int()), s


def check_sampling(ops, dev: str, b: int = 48, v: int = 300) -> None:
    case = sample_case(b, v, 5, "cpu")
    case[0][3, 7] = float("nan")
    case[0][4, 9] = float("inf")
    case[0][5] = float("-inf")
    case[0][6, : v // 2] = float("-inf")  # masked entries do not make a row non-finite
    # the top-k threshold search on ties and at its ends, on flat rows (where one token more or
    # less in the kept set changes the draw): integer logits in -3..3 (k inside a run of equal
    # values; k = 1 and V - 1), values one ulp apart, one value everywhere, a wide range with +-0
    # and subnormals
    logits, do_sample, temp, top_k, top_p = case[:5]
    flat = list(range(7, 7 + 24))
    logits[flat] = torch.round(torch.randn(len(flat), v, generator=_gen(6)))
    logits[flat[-4]] = 1 + torch.randperm(v, generator=_gen(8)) * 2.0 ** -23  # one ulp apart
    logits[flat[-3]] = -1 - torch.randperm(v, generator=_gen(9)) * 2.0 ** -23
    logits[flat[-2]] = 0.5
    logits[flat[-1]] = torch.randn(v, generator=_gen(7)) * torch.logspace(-40, 30, v)
    logits[flat[-1], :3] = torch.tensor([0.0, -0.0, 1e-45])
    for i, row in enumerate(flat):
        do_sample[row], temp[row], top_p[row] = 1, 1.0, 1.0
        top_k[row] = (1, 2, 5, 17, 40, 100, v // 2, v - 1)[i % 8]
    top_k[flat[-4]], top_k[flat[-3]] = 1, 3
    codes, fin = ops.sample_tokens(*[c.to(dev) for c in case], 2)
    rcodes, rfin = ops_ref.sample_tokens(*case, 2)
    assert codes.dtype == torch.int32 and fin.dtype == torch.bool
    assert torch.equal(fin.cpu(), rfin) and not rfin[3:6].any() and rfin[6]
    assert torch.equal(codes.cpu(), rcodes), (codes.cpu() != rcodes).nonzero().flatten().tolist()
    # the noise made before the PDL wait (as the frame draws): the same codes
    ecodes, efin = ops.sample_tokens(*[c.to(dev) for c in case], 2, early=True)
    assert torch.equal(ecodes.cpu(), rcodes) and torch.equal(efin.cpu(), rfin)


def check_sampling_parts_embed(ops, dev: str, b: int = 24, v: int = 300, h: int = 40) -> None:
    """The sampler fed `linear_parts`' partial products draws what it draws from their in-order
    sum (the split sum `linear` does), clamps into [0, V), and with a table also returns the
    drawn codes' rows as fp32, bitwise; the references do the same."""
    from tts_server.engines.batched import ops_ref

    case = sample_case(b, v, 21, "cpu")
    g = _gen(22)
    parts = torch.randn(3, b, v, generator=g) * 2
    parts[1, 2, 5] = float("nan")  # a part's NaN makes the row non-finite
    summed = parts[0] + parts[1] + parts[2]  # linear's split sum: in part order
    table = (torch.randn(v + 7, h, generator=g) * 0.5).to(torch.bfloat16)
    for impl, d in ((ops, dev), (ops_ref, "cpu")):
        args = [c.to(d) for c in case[1:]]
        codes, fin = impl.sample_tokens(summed.to(d), *args, 4)
        pcodes, pfin, rows = impl.sample_tokens(parts.to(d), *args, 4, table.to(d))
        assert torch.equal(pcodes.cpu(), codes.cpu()) and torch.equal(pfin.cpu(), fin.cpu()), impl
        assert not fin.cpu()[2] and fin.cpu().sum() == b - 1
        assert rows.dtype == torch.float32 and torch.equal(rows.cpu(), table[codes.cpu().long()].float())
        assert int(codes.min()) >= 0 and int(codes.max()) < v
        out = torch.full((b + 3, 6), 7, dtype=torch.int32)
        out[:, 4] = 0b1000
        out = out.to(d)
        icodes, ifin = impl.sample_tokens(parts.to(d), *args, 4, into=(out, 2, 4, 1))
        expect = torch.full((b + 3, 6), 7, dtype=torch.int32)
        expect[:, 4] = 0b1000
        expect[:b, 2] = codes.cpu()
        expect[:b, 4] |= (~fin.cpu()).to(torch.int32) << 1
        assert torch.equal(out.cpu(), expect) and torch.equal(icodes.cpu(), codes.cpu()), impl
        if impl is ops:  # as the frame draws: partial products, a table, into, the noise made early
            out[:, 2] = 7
            ecodes, efin, erows = impl.sample_tokens(parts.to(d), *args, 4, table.to(d), into=(out, 2, 4, 1),
                                                     early=True)
            assert torch.equal(ecodes.cpu(), codes.cpu()) and torch.equal(erows.cpu(), rows.cpu())
            assert torch.equal(out.cpu(), expect)


def check_predict_inputs(dev: str) -> None:
    """glue.predict_inputs' kernel against its torch form, bitwise."""
    from tts_server.engines.batched import glue

    g = _gen(31)
    ns, h, v = 9, 40, 50
    ints = torch.randint(0, v, (10, ns), generator=g, dtype=torch.int32)
    floats = torch.rand(5, ns, generator=g)
    seed = torch.randint(-2 ** 62, 2 ** 62, (ns,), generator=g)
    past = torch.randn(ns, h, generator=g)
    emb = torch.randn(v, h, generator=g).to(torch.bfloat16)
    rows = torch.tensor([4, 0, 8, 4, 2])
    outs = []
    for d, fn in ((dev, glue.predict_inputs), ("cpu", glue.predict_inputs_torch)):
        out = torch.full((7, 18), 5, dtype=torch.int32)
        args = [t.to(d) for t in (rows, ints, floats, seed, past, emb)] + [out.to(d)]
        got = fn(*args, (7, 8), (3, 4), 1, 2, 17)
        outs.append([t.cpu() for t in got] + [args[-1].cpu()])
    for a, b in zip(*outs):
        assert a.dtype == b.dtype and torch.equal(a, b)


def check_invariance(ops, dev: str, sizes=(1, 3, 17, 64)) -> None:
    """Each op's target row is bit-identical in every batch size / position."""
    k, n, v = 64, 48, 300
    tx, tw, tw2 = gemm_case(1, k, n, 11, dev)
    x_rows = lambda m, pos, s: (_place(tx[0], m, pos, gemm_case(m, k, n, s, dev)[0]),)
    checks = {
        "linear": (x_rows, lambda x: ops.linear(x, tw)),
        "swiglu": (x_rows, lambda x: ops.swiglu(x, tw, tw2)),
        "rms_norm": (x_rows, lambda x: ops.rms_norm(x, tw[0], 1e-6)),
    }
    nh, nkv, hd, blk, mb = 4, 2, 32, 8, 9
    tq, kp, vp, tbt, _ = attn_case(1, nh, nkv, hd, blk, mb, [50], 12, dev)

    def attn_rows(m, pos, s):
        g = _gen(s)
        q = _place(tq[0], m, pos, torch.randn(m, nh, hd, generator=g).to(dev))
        bt = torch.randint(0, kp.shape[0], (m, mb), generator=g).int().to(dev)
        lens = torch.randint(0, mb * blk + 1, (m,), generator=g).int().to(dev)
        bt[pos], lens[pos] = tbt[0], 50
        return q, bt, lens

    checks["paged_attention"] = (attn_rows, lambda q, bt, lens: ops.paged_attention(q, kp, vp, bt, lens, 0.2))
    target = sample_case(1, v, 13, dev)
    target[1][0] = 1  # sampled

    def sample_rows(m, pos, s):
        return tuple(_place(t[0], m, pos, f) for t, f in zip(target, sample_case(m, v, s, dev)))

    def talker_then_sample(lg, ds, tp, tk, pp, sd, ct):
        lg = lg.clone()
        m = lg.shape[0]
        seen = (lg > 2).to(torch.uint8)  # a function of the row itself
        ops.talker_process_(lg, seen, torch.full((m,), 1.05, device=lg.device),
                            torch.full((m,), 3, dtype=torch.int32, device=lg.device), 290, 280, 2)
        return (lg,) + ops.sample_tokens(lg, ds, tp, tk, pp, sd, ct, 0)

    checks["talker_process_+sample_tokens"] = (sample_rows, talker_then_sample)
    for name, (make, run) in checks.items():
        outs = _rows_in_batches(make, run, sizes, seed=len(name))
        for o in outs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(outs[0], o)), name


def prefill_attn_case(lens, nh: int, nkv: int, hd: int, block: int, seed: int, dev: str):
    """Rows of prompts of these lengths (concatenated) over their own scratch blocks, as
    prefill.rows_plan lays them out -> (q, k, v, table, pos, qrow, qn) on dev."""
    from tts_server.engines.batched.prefill import rows_plan

    g = _gen(seed)
    nb = [-(-n // block) for n in lens]
    blocks = [list(range(sum(nb[:a]), sum(nb[:a + 1]))) for a in range(len(lens))]
    plan = rows_plan(list(lens), blocks, block)
    k = torch.zeros(sum(nb), nkv, block, hd)
    v = torch.zeros(sum(nb), nkv, block, hd)
    for a, n in enumerate(lens):  # only the prompt's own positions hold K/V (the rest stay 0)
        for p in range(n):
            k[blocks[a][p // block], :, p % block] = torch.randn(nkv, hd, generator=g)
            v[blocks[a][p // block], :, p % block] = torch.randn(nkv, hd, generator=g)
    q = torch.randn(sum(lens), nh, hd, generator=g)
    return [t.to(dev) for t in (q, k, v, plan["table"], plan["pos"], plan["qrow"], plan["qn"])]


def check_prefill_attention(ops, dev: str) -> float:
    """Against the reference, and every prompt's rows bitwise the same alone as among others."""
    lens = (1, 17, 40, 16, 3, 70)
    case = prefill_attn_case(lens, 4, 2, 32, 16, 7, dev)
    out = ops.prefill_attention(*case, 0.2)
    ref = ops_ref.prefill_attention(*[c.cpu() for c in case], 0.2)
    err = _rel(out, ref)
    assert err < F32_TOL, err
    start = 0
    for a, n in enumerate(lens):
        alone = prefill_attn_case((n,), 4, 2, 32, 16, 7, dev)
        # the same prompt's q/k/v as inside the crowd
        rows = slice(start, start + n)
        nb = -(-n // 16)
        first = sum(-(-m // 16) for m in lens[:a])
        alone[0] = case[0][rows].clone()
        alone[1] = case[1][first:first + nb].clone()
        alone[2] = case[2][first:first + nb].clone()
        got = ops.prefill_attention(*alone, 0.2)
        assert torch.equal(got, out[rows]), (a, n)
        start += n
    return err


def check_split_sum_fused(ops, dev: str, shapes=((64, 2048), (48, 3072))) -> None:
    """add_rms over a split GEMM's partial products (summed inside add_rms) is bitwise add_rms over
    the GEMM's own summed output, and the partials really are several where K is split."""
    from tts_server.engines.batched import glue

    for n, k in shapes:
        for m in (1, 3, 17):
            g = _gen(m + k)
            h, x = torch.randn(m, k, generator=g).to(dev), torch.randn(m, n, generator=g).to(dev)
            w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16().to(dev)
            nw = torch.rand(n, generator=g).to(dev)
            parts = ops.linear_parts(h, w)
            assert parts.dim() == 3 and (parts.shape[0] > 1) == ops._use_triton(h), parts.shape  # split on Triton
            got = glue.add_rms(x, parts, nw, 1e-6)
            want = glue.add_rms(x, ops.linear(h, w), nw, 1e-6)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (n, k, m)


def check_advance_glue(dev: str) -> None:
    """glue.advance_inputs / advance_commit (one launch each) are bitwise their torch forms: the
    gathers, the input row (code 0's embedding + 15 groups' + the text track, both of its
    branches, fp32 adds in order), the KV addresses, the RoPE rows; the commit's state, padding
    rows at the scratch slot changing nothing but `seen`."""
    from tts_server.engines.batched import glue

    g = _gen(31)
    ns, h, v, k, mt, mb, bs = 9, 40, 50, 15, 6, 8, 4
    fields = (0, 1, 2, 3, 4, 9)  # POS, CODE0, N_SAMPLED, TEXT_STEP, N_TRAILING, EOS_FROM
    ints = torch.randint(0, v, (10, ns), generator=g, dtype=torch.int32)
    ints[0] = torch.randint(0, mb * bs - 1, (ns,), generator=g, dtype=torch.int32)
    # text step vs vectors given (of 6 at most): before, at and past the end
    ints[3] = torch.tensor([0, 2, 5, 7, 2, 9, 3, 0, 4], dtype=torch.int32)
    ints[4] = torch.tensor([3, 3, 6, 6, 2, 2, 1, 1, 5], dtype=torch.int32)
    floats = torch.rand(5, ns, generator=g)
    seed = torch.randint(-2 ** 62, 2 ** 62, (ns,), generator=g)
    emb = torch.randn(v, h, generator=g).to(torch.bfloat16)
    tables = torch.randn(k, v, h, generator=g).to(torch.bfloat16)
    out = torch.randint(0, v, (7, 18), generator=g, dtype=torch.int32)
    trailing = torch.randn(ns, mt, h, generator=g).to(torch.bfloat16)
    pad = torch.randn(ns, h, generator=g).to(torch.bfloat16)
    table = torch.randint(0, 100, (ns, mb), generator=g, dtype=torch.int32)
    rope = torch.randn(mb * bs, 2, 16, generator=g)  # [positions, (cos, sin), HD]
    rows = torch.tensor([4, 0, 8, 2, 6, 8, 8])  # slot 8: the scratch slot (graph padding)
    res = []
    for d, fn in ((dev, glue.advance_inputs), ("cpu", glue.advance_inputs_torch)):
        args = [t.to(d) for t in (rows, ints, floats, seed, emb, tables, out[:, 1:16], trailing, pad, table)]
        res.append([t.cpu() for t in fn(*args, bs, rope.to(d), (0, 5, 6), (0, 1, 2), fields)])
    for a, b in zip(*res):
        assert a.dtype == b.dtype and torch.equal(a, b), (a, b)
    assert res[1][4].tolist() != [-1] * 7 and -1 in res[1][4].tolist()  # the EOS gate both ways
    hidden = torch.randn(7, h, generator=g)
    codes = torch.randint(0, v, (7,), generator=g, dtype=torch.int32)
    states = []
    for d, fn in ((dev, glue.advance_commit), ("cpu", glue.advance_commit_torch)):
        past = torch.randn(ns, h, generator=_gen(5))
        st = [t.clone().to(d) for t in (ints, past, torch.zeros(ns, v, dtype=torch.uint8))]
        fn(rows.to(d), codes.to(d), hidden.to(d), *st, 8, fields[:4])
        states.append([t.cpu() for t in st])
    for a, b in zip(*states):
        assert torch.equal(a, b)
    new_ints, past, seen = states[1]
    assert torch.equal(new_ints[:4, 8], torch.zeros(4, dtype=torch.int32))
    assert torch.equal(new_ints[0, 4], ints[0, 4] + 1) and int(new_ints[1, 4]) == int(codes[0])
    assert torch.equal(past[4], hidden[0]) and int(seen.sum()) == len(set(zip(rows.tolist(), codes.tolist())))


def check_gemm_big(dev: str) -> None:
    """tk_gemm.gemm_big (x split once, the K pieces summed in the program) is `_gemm`'s value bit
    for bit, for every talker product, with bf16 and fp16 matrices (CPU: a small tile; GPU: the
    many-row route of `_gemm` where it has a tile for the shape, else gemm_big's default tile)."""
    from tts_server.engines.batched import tk_gemm

    g = _gen(7)
    for dtype, terms in ((torch.bfloat16, 2), (torch.float16, 0)):
        shapes = (("linear", 4096, 1024), ("linear", 1024, 2048), ("swiglu", 3072, 1024), ("linear", 1024, 3072))
        if dev == "cpu":  # narrow matrices (the interpreter is slow), K of 1, 2 and 3 pieces
            shapes = (("linear", 64, 1024), ("linear", 32, 2048), ("swiglu", 48, 1024), ("linear", 32, 3072))
        for kind, n, k in shapes:
            m = 37 if dev == "cpu" else 2 * tk_gemm.big_m_min_rows(terms) + 5
            x = torch.randn(m, k, generator=g).to(dev)
            w = (torch.randn(n, k, generator=g) * 0.03).to(dev, dtype)
            w2 = (torch.randn(n, k, generator=g) * 0.03).to(dev, dtype) if kind == "swiglu" else None
            if dev == "cpu":  # `_gemm`'s own tile: the interpreter's dots (numpy) round by their shapes
                bm, bn, _, warps, stages = tk_gemm.config(kind, n, k, m)[:5]
                got = tk_gemm.gemm_big(x, w, w2, tile=(bm, bn, warps, stages))
            elif (kind, n, k) in tk_gemm.big_m_tiles(terms):
                got = tk_gemm._gemm(x, w, w2)  # routed through gemm_big
            else:
                assert dtype == torch.float16, "every bf16 talker product has a many-row tile"
                got = tk_gemm.gemm_big(x, w, w2)
            saved = tk_gemm.BIG_M_MIN_ROWS, tk_gemm.BIG_M_FP16_MIN_ROWS
            tk_gemm.BIG_M_MIN_ROWS = tk_gemm.BIG_M_FP16_MIN_ROWS = 1 << 30
            try:
                want = tk_gemm._gemm(x, w, w2)
            finally:
                tk_gemm.BIG_M_MIN_ROWS, tk_gemm.BIG_M_FP16_MIN_ROWS = saved
            assert torch.equal(got, want), (dtype, kind, n, k, (got - want).abs().max())


def check_copy_prefix(dev: str) -> None:
    """glue.copy_prefix (a shared prompt prefix's per-layer copy between scratch blocks): the
    kernel equals the torch loop; positions past n and other blocks are untouched."""
    from tts_server.engines.batched import glue

    g = _gen(13)
    k, v = torch.randn(6, 2, 16, 32, generator=g), torch.randn(6, 2, 16, 32, generator=g)
    src, dst, n = (torch.tensor(t, dtype=torch.int32) for t in ([0, 0, 4, 0], [3, 5, 1, 0], [9, 16, 1, 0]))
    want_k, want_v = k.clone(), v.clone()
    for s_, d_, c in zip(src.tolist(), dst.tolist(), n.tolist()):
        want_k[d_, :, :c], want_v[d_, :, :c] = k[s_, :, :c], v[s_, :, :c]
    gk, gv = k.clone().to(dev), v.clone().to(dev)
    glue.copy_prefix(gk, gv, src.to(dev), dst.to(dev), n.to(dev))
    assert torch.equal(gk.cpu(), want_k) and torch.equal(gv.cpu(), want_v)
    assert not torch.equal(want_k, k)


def run_all(dev: str, sizes=(1, 3, 17, 64)) -> dict:
    from tts_server.engines.batched import ops

    res = check_accuracy(ops, dev)
    res["prefill_attention"] = check_prefill_attention(ops, dev)
    check_advance_glue(dev)
    check_split_sum_fused(ops, dev, ((64, 2048), (48, 3072)) if dev == "cpu" else ((1024, 2048), (1024, 3072)))
    check_gemm_big(dev)
    check_gemm_fp16(dev)
    check_gemm_sub(dev)
    check_mlp_fp16_scaled(dev)
    check_norms_fp16(dev)
    if dev != "cpu":  # the interpreter's dots round by their shapes, so only a GPU can say
        check_gemm_buckets(dev)
    check_copy_prefix(dev)
    check_attention_program_order(ops, dev)
    check_talker_process(ops, dev)
    check_frame_noise(ops, dev)
    check_sampling(ops, dev)
    check_sampling_parts_embed(ops, dev)
    check_predict_inputs(dev)
    check_invariance(ops, dev, sizes)
    return res


def check_gemm_fp16(dev: str) -> None:
    """fp16 matrices (the TTS_GEMM_DTYPE=fp16 experiment): x rounded once to fp16, one dot with
    fp32 sums, as an fp64 product of the same fp16 values (linear with K pieces, and SwiGLU); a
    row's bits are the same alone and among 63 others (another tile bucket)."""
    from tts_server.engines.batched import tk_gemm

    for swiglu, k, n in ((False, 2048, 128), (True, 256, 96)):
        x, w, w2 = gemm_case(64, k, n, 21 + k, dev)
        w, w2 = w.half(), (w2.half() if swiglu else None)
        out = tk_gemm._gemm(x, w, w2)
        xh = x.half().double()
        ref = xh @ w.double().T
        if swiglu:
            ref = torch.nn.functional.silu(ref) * (xh @ w2.double().T)
        assert _rel(out, ref) < LIN_TOL, (swiglu, _rel(out, ref))
        assert torch.equal(tk_gemm._gemm(x[5:6], w, w2)[0], out[5]), swiglu
        # x rounded to fp16 by its producer (the frame's norms): the same bits, from every path
        x16 = x.half()
        assert torch.equal(tk_gemm._gemm(x16, w, w2), out), swiglu
        assert torch.equal(tk_gemm.gemm_big(x16, w, w2), out), swiglu
        if not swiglu:
            assert torch.equal(tk_gemm.linear_parts(x16, w), tk_gemm.linear_parts(x, w))


def check_gemm_sub(dev: str) -> None:
    """With TTS_GEMM_SUB=256 (opt-in) the layers' products with fp16 matrices (tk_gemm.SUB_SHAPES)
    sum each K piece as sub-pieces of 256 columns, each from zero, added in order: every partial
    product equals, bitwise, the in-order fp32 sum of the same product over each sub-piece's
    columns alone (one chain from zero, BLOCK_K steps as the piece's), and differs from one chain a
    piece (TTS_GEMM_SUB=0, the default), so the order is really in force; gate|up's too (against
    the one-chain order). CPU: narrow matrices given the layers' sub-piece rule (the interpreter is
    slow)."""
    from tts_server.engines.batched import tk_gemm

    shapes = (("linear", 4096, 1024), ("linear", 1024, 2048), ("linear", 1024, 3072), ("swiglu", 3072, 1024))
    if dev == "cpu":  # K of 1 and 2 pieces (the default tile's 1,024-column chunks), 2 x 64 steps
        shapes = (("linear", 32, 1024), ("linear", 32, 2048), ("swiglu", 32, 1024))
    saved = set(tk_gemm.SUB_SHAPES)
    tk_gemm.SUB_SHAPES |= set(shapes)
    old = os.environ.pop("TTS_GEMM_SUB", None)
    try:
        for kind, n, k in shapes:
            m = 5
            x, w, w2 = gemm_case(m, k, n, 40 + n + k, dev)
            w, w2 = (w * 4).half(), ((w2 * 4).half() if kind == "swiglu" else None)
            assert tk_gemm.sub_cols(kind, n, k, True) == tk_gemm.SUB_COLS == 0, (kind, n, k)  # the default
            one = tk_gemm.linear_parts(x, w) if kind == "linear" else tk_gemm.swiglu(x, w, w2)
            os.environ["TTS_GEMM_SUB"] = "256"
            sub = tk_gemm.sub_cols(kind, n, k, True)
            got = tk_gemm.linear_parts(x, w) if kind == "linear" else tk_gemm.swiglu(x, w, w2)
            os.environ.pop("TTS_GEMM_SUB")
            assert sub == 256 and got.shape == one.shape and not torch.equal(got, one), (kind, n, k)
            if kind == "swiglu":
                continue
            bm, bn, bk, warps, stages, chunk, _ = tk_gemm.config(kind, n, k, m, fp16=True)
            split, k_per = tk_gemm._pieces(False, k, chunk, bk)
            assert got.shape[0] == split and k_per % sub == 0
            tk_gemm.OVERRIDE["linear"] = (bm, bn, bk, warps, stages, 1 << 30, 0)
            try:
                for p in range(split):
                    want = torch.zeros(m, n, device=dev)
                    for c in range(p * k_per, (p + 1) * k_per, sub):
                        want = want + tk_gemm.linear(x[:, c:c + sub].contiguous(), w[:, c:c + sub].contiguous())
                    assert torch.equal(got[p], want), (kind, n, k, p)
            finally:
                tk_gemm.OVERRIDE.pop("linear")
    finally:
        tk_gemm.SUB_SHAPES.clear()
        tk_gemm.SUB_SHAPES |= saved
        os.environ.pop("TTS_GEMM_SUB", None)
        if old is not None:
            os.environ["TTS_GEMM_SUB"] = old


def check_mlp_fp16_scaled(dev: str) -> None:
    """The MLP with fp16 matrices: swiglu's fp16 output is its fp32 value times 2^-shift rounded
    once (bitwise, also past fp16's range unscaled, and through the many-row kernel), and the down
    projection's partial products of that row with x_shift are the unshifted ones times 2^shift
    (bitwise); a row's bits are the same alone."""
    from tts_server.engines.batched import ops, tk_gemm

    shift = ops.MLP_SHIFT
    x, wg, wu = gemm_case(40, 256, 96, 31, dev)
    wg, wu = (wg * 150).half(), (wu * 150).half()  # products past 65504, as the real code predictor's
    full = tk_gemm._gemm(x, wg, wu)
    assert full.abs().max() > 65504
    y = tk_gemm.swiglu(x, wg, wu, torch.float16, shift)
    assert y.dtype == torch.float16 and torch.equal(y, (full * 2.0 ** -shift).half())
    bm, bn, _, warps, stages = tk_gemm.config("swiglu", 96, 256, 40)[:5]
    assert torch.equal(tk_gemm.gemm_big(x, wg, wu, tile=(bm, bn, warps, stages), shift=-shift,
                                        out_dtype=torch.float16), y)
    _, wd, _ = gemm_case(40, 96, 128, 32, dev)
    wd = wd.half()
    parts = tk_gemm.linear_parts(y, wd, shift)
    assert torch.equal(parts, tk_gemm.linear_parts(y, wd) * 2.0 ** shift)
    assert torch.equal(tk_gemm.linear_parts(y[7:8], wd, shift)[:, 0], parts[:, 7])
    assert torch.equal(ops.linear_parts(y, wd, shift), parts)


def check_norms_fp16(dev: str) -> None:
    """rms_norm and add_rms with an fp16 output: the norm rounded to nearest even, as the products
    with fp16 matrices round their input. In the interpreter that is the fp32 variant's value
    rounded; a GPU's fp16 variant is its own compiled kernel whose sum of squares may add in
    another order, so there within half an fp16 ulp of the fp32 variant (plus its own rounding)."""
    from tts_server.engines.batched import tk_glue, tk_gemm

    g = _gen(8)
    x = (torch.randn(64, 1024, generator=g) * 3).to(dev)
    parts = torch.randn(3, 64, 1024, generator=g).to(dev)
    w = (1 + torch.randn(1024, generator=g) / 4).to(dev)

    def rounded(h16, h32):
        assert h16.dtype == torch.float16
        if dev == "cpu":
            assert torch.equal(h16, h32.half())
        else:  # rtne: |error| <= 2^-11 relative (rtz or no rounding would break it)
            assert bool(((h16.double() - h32.double()).abs() <= h32.double().abs() * 2 ** -11 * 1.001 + 2 ** -26).all())

    rounded(tk_gemm.rms_norm(x, w, 1e-6, torch.float16), tk_gemm.rms_norm(x, w, 1e-6))
    s32, h32 = tk_glue.add_rms(x, parts, w, 1e-6)
    s16, h16 = tk_glue.add_rms(x, parts, w, 1e-6, torch.float16)
    assert torch.equal(s16, s32)
    rounded(h16, h32)


def check_gemm_buckets(dev: str) -> None:
    """Every tuned product, with bf16 and with fp16 matrices (x fp32, and x fp16 for fp16
    matrices): a row's bits are the same in every row-count bucket's tile (BY_M, BY_M_FP16,
    BY_M_X16), so a stream's output does not depend on the batch."""
    from tts_server.engines.batched import tk_gemm

    rows = sorted({1, 300, *tk_gemm.WARM_ROWS} - {513})
    for (kind, n, k) in tk_gemm.TUNED:
        for dtype in (torch.bfloat16, torch.float16):
            x, w, w2 = gemm_case(max(rows), k, n, 5 + n + k, dev)
            w, w2 = w.to(dtype), (w2.to(dtype) if kind == "swiglu" else None)
            want = tk_gemm._gemm(x, w, w2)
            for m in rows:
                got = tk_gemm._gemm(x[:m], w, w2)
                assert torch.equal(got, want[:m]), (kind, n, k, dtype, m, tk_gemm.config(
                    kind, n, k, m, fp16=dtype == torch.float16))
                if dtype == torch.float16:  # x rounded by its producer: BY_M_X16's tiles
                    got = tk_gemm._gemm(x[:m].half(), w, w2)
                    assert torch.equal(got, want[:m]), (kind, n, k, "x16", m, tk_gemm.config(
                        kind, n, k, m, fp16=True, x16=True))


# ---------------------------------------------------------------- CPU: references vs sampler.py
def test_ref_talker_process_matches_sampler():
    g = _gen(0)
    b, v = 6, 128
    logits = torch.randn(b, v, generator=g) * 3
    seen = torch.rand(b, v, generator=g) < 0.25
    pen = torch.tensor([1.05, 1.0, 1.5, 1.05, 2.0, 1.1])
    nsamp = torch.tensor([0, 1, 2, 3, 0, 9], dtype=torch.int32)
    out = logits.clone()
    ops_ref.talker_process_(out, seen.to(torch.uint8), pen, nsamp, 100, 96, 2)
    for i in range(b):
        row = logits[i].clone()
        repetition_penalty_(row, seen[i], float(pen[i]))
        talker_mask_(row, int(nsamp[i]), 100, 96, 2)
        assert torch.equal(out[i], row), i


def test_ref_warp_matches_sampler():
    logits, _, temp, top_k, top_p, _, _ = sample_case(64, 200, 1, "cpu")
    out = ops_ref.warp_rows(logits, temp, top_k, top_p)
    for i in range(64):
        ref = warp(logits[i], float(temp[i]), int(top_k[i]), float(top_p[i]))
        assert torch.equal(torch.isinf(out[i]), torch.isinf(ref)), i
        kept = ~torch.isinf(ref)
        torch.testing.assert_close(out[i][kept], ref[kept], rtol=0, atol=0)


def test_ref_greedy_is_argmax_first_index():
    logits, ds, temp, top_k, top_p, seed, ctr = sample_case(32, 50, 2, "cpu")
    logits[:, 10] = logits.max(-1).values + 1  # ties: the first index wins
    logits[:, 20] = logits[:, 10]
    codes, _ = ops_ref.sample_tokens(logits, torch.zeros_like(ds), temp, top_k, top_p, seed, ctr, 0)
    assert torch.equal(codes.long(), torch.argmax(logits, -1)) and (codes == 10).all()


def test_ref_sampling_distribution_and_keys():
    """Draws over 40000 counters follow softmax(warped logits) and stay inside top-k / top-p."""
    v, n = 12, 40000
    logits = torch.linspace(-2, 2, v)[torch.randperm(v, generator=_gen(3))]
    for temp, top_k, top_p in [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.6)]:
        rows = logits.expand(n, v).contiguous()
        args = (torch.ones(n, dtype=torch.int32), torch.full((n,), temp),
                torch.full((n,), top_k, dtype=torch.int32), torch.full((n,), top_p))
        codes, fin = ops_ref.sample_tokens(rows, *args, torch.full((n,), 77, dtype=torch.int64),
                                           torch.arange(n, dtype=torch.int64), 1)
        want = warp(logits, temp, top_k, top_p).softmax(-1)
        freq = torch.bincount(codes.long(), minlength=v).double() / n
        assert fin.all() and (freq[want == 0] == 0).all()
        # max |freq - p| <= 5 sigma of a binomial proportion (sigma <= 0.0025 at n = 40000)
        assert (freq - want.double()).abs().max() < 5 * (0.25 / n) ** 0.5, (freq, want)
        again, _ = ops_ref.sample_tokens(rows, *args, torch.full((n,), 77, dtype=torch.int64),
                                         torch.arange(n, dtype=torch.int64), 1)
        other, _ = ops_ref.sample_tokens(rows, *args, torch.full((n,), 78, dtype=torch.int64),
                                         torch.arange(n, dtype=torch.int64), 1)
        stream, _ = ops_ref.sample_tokens(rows, *args, torch.full((n,), 77, dtype=torch.int64),
                                          torch.arange(n, dtype=torch.int64), 2)
        assert torch.equal(again, codes)
        assert (other != codes).float().mean() > 0.3 and (stream != codes).float().mean() > 0.3


def test_ref_attention_matches_dense_sdpa():
    q, kp, vp, bt, lens = attn_case(3, 4, 2, 16, 4, 5, [3, 20, 9], 4, "cpu", torch.float32)
    out = ops_ref.paged_attention(q, kp, vp, bt, lens, 0.25)
    for b, n in enumerate(lens.tolist()):
        k = kp[bt[b].long()].permute(1, 0, 2, 3).reshape(2, -1, 16)[:, :n].repeat_interleave(2, 0)
        v = vp[bt[b].long()].permute(1, 0, 2, 3).reshape(2, -1, 16)[:, :n].repeat_interleave(2, 0)
        ref = torch.nn.functional.scaled_dot_product_attention(q[b][:, None], k, v, scale=0.25)
        torch.testing.assert_close(out[b], ref[:, 0], rtol=1e-5, atol=1e-6)


def test_gemm_tiles_keep_each_rows_reduction_order():
    """The tile may follow M, but what fixes an element's reduction order (BLOCK_K, the K chunks,
    the x terms) must not: same for every M, per tuned shape, and every tile divides into its shape."""
    from tts_server.engines.batched import tk_gemm

    for (kind, n, k), tuned in tk_gemm.TUNED.items():
        for fp16, x16, table in ((False, False, tk_gemm.BY_M), (True, False, tk_gemm.BY_M_FP16),
                                 (True, True, tk_gemm.BY_M_X16)):
            bounds = [b for b, _ in table.get((kind, n, k), ())]
            assert bounds == sorted(bounds), (kind, n, k)
            for m in sorted({1, 2, 3, 16, 17, 31, 33, 64, 65, 128, 129, 256, 4096, *bounds}):
                cfg = tk_gemm.config(kind, n, k, m, fp16=fp16, x16=x16)
                assert (cfg[2], cfg[5], cfg[6]) == (tuned[2], tuned[5], tuned[6]), (kind, n, k, m, cfg)
                assert n % cfg[1] == 0 and cfg[0] in (16, 32, 64, 128), (kind, n, k, m, cfg)
                # warm_up compiles one row count per bucket: every bucket must have one
                assert any(tk_gemm.config(kind, n, k, r, fp16=fp16, x16=x16) == cfg for r in tk_gemm.WARM_ROWS), \
                    (kind, n, k, m, fp16, x16)
            assert tk_gemm.config(kind, n, k, fp16=fp16, x16=x16) == tuned
    for table in (tk_gemm.BY_M, tk_gemm.BY_M_FP16, tk_gemm.BY_M_X16):
        assert set(table) <= set(tk_gemm.TUNED)


# ---------------------------------------------------------------- kernels: interpreter / GPU
def test_triton_kernels_in_interpreter():
    """All kernels on CPU through TRITON_INTERPRET=1 (a subprocess, so no other module sees it)."""
    code = ("import json, sys; sys.path.insert(0, 'tests'); import test_batched_ops as t; "
            "print('RESULT', json.dumps(t.run_all('cpu')))")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    errors = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert max(errors.values()) < LIN_TOL and "prefill_attention" in errors, errors


@pytest.mark.gpu
def test_triton_kernels_gpu():
    run_all("cuda", sizes=(1, 3, 17, 64, 256))


@pytest.mark.gpu
def test_sampling_gpu_matches_reference_many_rows():
    from tts_server.engines.batched import ops

    for v in (2048, 3072):
        case = sample_case(4096, v, v, "cpu")
        codes, fin = ops.sample_tokens(*[c.cuda() for c in case], 5)
        rcodes, rfin = ops_ref.sample_tokens(*case, 5)
        assert torch.equal(fin.cpu(), rfin)
        assert torch.equal(codes.cpu(), rcodes), int((codes.cpu() != rcodes).sum())
