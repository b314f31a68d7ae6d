#!/usr/bin/env python
"""Issue 16 (B = 1): the talker's 28 layers in one launch of the small-batch kernel
(csrc/small/cp_layers.cu, cp_layers_kernel<true>; small_kernel.TalkerKernel), against the Triton
launches the engine makes for them (frame.stack_forward over frame.paged_attend, one row).

For each position: the same random row, pool (bf16, 64-position pages in a shuffled table) and
RoPE rows through both; checked bitwise: the final-normed hidden (the kernel's x_out / d_out
through glue.add_rms, fp32 out, as the engine would), the whole K / V pool after the step (the
new position's K / V in every layer, nothing else touched), and, to name the first difference,
each layer's attention output, residuals and normed rows against the same ops run one by one.
Then as a CUDA graph replayed at other positions (the position, table and RoPE rows from device
memory), across the epoch's wrap, and timed: the graph of the kernel + the final norm against a
graph of the Triton launches (PDL as the engine, µs; median of rounds). Writes
$OUT/talker_layers.json.

  PYTHONPATH=. python3 scripts/gpu_talker_layers.py --out $OUT [--positions 1 63 64 500 2047]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tts_server.engines.batched import checks, frame, glue, ops, pdl, small_kernel  # noqa: E402
from tts_server.engines.batched.params import prepare  # noqa: E402

PAGE = 64


def rope_rows(pos: int, hd: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = pos * inv
    cos, sin = torch.cos(ang).float(), torch.sin(ang).float()
    return torch.cat((cos, cos)).cuda(), torch.cat((sin, sin)).cuda()


def reference_layers(x, sp, cos, sin, k, v, table, pos):
    """stack_forward's ops one by one (the same calls), recording what the kernel can report."""
    cfg = sp.cfg
    eps, nh, nkv = cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads
    blk = table[:, pos // PAGE].long()
    off = torch.full((1,), pos % PAGE, dtype=torch.long, device="cuda")
    lens = torch.full((1,), pos + 1, dtype=torch.int32, device="cuda")
    rec = {"att": [], "r": [], "h": []}
    h = ops.rms_norm(x, sp.in_norm[0], eps, torch.float16)
    for i in range(cfg.num_layers):
        qkv = ops.linear(h, sp.wqkv[i])
        q = glue.qk_rope_store(qkv, sp.q_norm[i], sp.k_norm[i], cos[None], sin[None], k[i], v[i], blk, off, nh, nkv,
                               eps)
        att = ops.paged_attention(q, k[i], v[i], table, lens, cfg.head_dim ** -0.5, torch.float16)
        rec["att"].append(att.reshape(1, -1).clone())
        x, h = glue.add_rms(x, ops.linear_parts(att.reshape(1, sp.q_dim), sp.wo[i]), sp.post_norm[i], eps,
                            torch.float16)
        rec["r"].append(x.clone()), rec["h"].append(h.clone())
        last = i + 1 == cfg.num_layers
        inner = ops.swiglu(h, sp.gate[i], sp.up[i], torch.float16)
        down = ops.linear_parts(inner, sp.down[i], ops.MLP_SHIFT)
        x, h = glue.add_rms(x, down, sp.final_norm if last else sp.in_norm[i + 1], eps,
                            torch.float32 if last else torch.float16)
        rec["r"].append(x.clone()), rec["h"].append(h.clone())
    return h, rec


def triton_step(sp, x, pos, k0, v0, table):
    """The engine's Triton launches for the talker's layers of row x at position pos, over copies
    of the pools -> (final-normed hidden, K pool, V pool), and the position's RoPE rows."""
    cos, sin = rope_rows(pos, sp.cfg.head_dim, sp.cfg.rope_theta)
    kr, vr = k0.clone(), v0.clone()
    blk = table[:, pos // PAGE].long()
    off = torch.full((1,), pos % PAGE, dtype=torch.long, device="cuda")
    lens = torch.full((1,), pos + 1, dtype=torch.int32, device="cuda")
    with pdl.scope(True):
        want = frame.stack_forward(x, sp, frame.paged_attend(sp, cos[None], sin[None], kr, vr, blk, off, table, lens))
    return (want, kr, vr), (cos, sin)


def first_diff(name, got, want) -> str | None:
    for i, (g, w) in enumerate(zip(got, want)):
        if not torch.equal(g.view(torch.int32) if g.dtype == torch.float32 else g.view(torch.int16),
                           w.view(torch.int32) if w.dtype == torch.float32 else w.view(torch.int16)):
            n = int((g != w).sum())
            return f"{name}[{i}]: {n} of {g.numel()} differ (max |d| {float((g.float() - w.float()).abs().max()):.3g})"
    return None


def timed_graph(g: torch.cuda.CUDAGraph, reps=20, rounds=5) -> float:
    ts = []
    for _ in range(rounds):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1000.0 / reps)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--positions", type=int, nargs="*", default=[1, 63, 64, 65, 500, 1000, 2047])
    ap.add_argument("--max-positions", type=int, default=2048)
    a = ap.parse_args()
    torch.manual_seed(0)
    sp = prepare(checks.random_weights("cuda"), dtype=torch.float16).talker
    cfg = sp.cfg
    L, H, NKV, HD = cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim
    max_blocks = math.ceil(a.max_positions / PAGE)
    pages = max_blocks + 8
    k0 = (torch.randn(L, pages, NKV, PAGE, HD, device="cuda") * 0.5).to(torch.bfloat16)
    v0 = (torch.randn(L, pages, NKV, PAGE, HD, device="cuda") * 0.5).to(torch.bfloat16)
    table = (torch.randperm(pages - 1)[:max_blocks] + 1).to(torch.int32).cuda()[None]  # [1, max_blocks]
    kk, vk = k0.clone(), v0.clone()
    kern = small_kernel.TalkerKernel(sp, kk, vk, max_blocks)
    att_g = torch.zeros(L, sp.q_dim, dtype=torch.float16, device="cuda")
    dbg_r = torch.zeros(2 * L, H, dtype=torch.float32, device="cuda")
    dbg_h = torch.zeros(2 * L, H, dtype=torch.float16, device="cuda")
    lens = torch.zeros(1, dtype=torch.int32, device="cuda")
    x_in = torch.zeros(1, H, dtype=torch.float32, device="cuda")
    cos_b = torch.zeros(HD, dtype=torch.float32, device="cuda")
    sin_b = torch.zeros_like(cos_b)
    eps = cfg.rms_norm_eps
    res = {"device": torch.cuda.get_device_name(), "positions": {}, "ok": True}

    def kernel_step(dbg: bool):
        args = kern.args(x_in, table[0], lens, cos_b, sin_b)
        if dbg:
            args.att_g, args.dbg_r, args.dbg_h = att_g.data_ptr(), dbg_r.data_ptr(), dbg_h.data_ptr()
        kern.launch(args)
        with pdl.scope(True):
            return glue.add_rms(kern.x_out, kern.d_out[None], sp.final_norm, eps, torch.float32)[1]

    for pos in a.positions:
        x = torch.randn(1, H, device="cuda")
        (want, kr, vr), (cos, sin) = triton_step(sp, x, pos, k0, v0, table)
        k1, v1 = k0.clone(), v0.clone()
        with pdl.scope(True):
            want1, rec = reference_layers(x, sp, cos, sin, k1, v1, table, pos)
        kk.copy_(k0), vk.copy_(v0)
        x_in.copy_(x), cos_b.copy_(cos), sin_b.copy_(sin), lens.fill_(pos + 1)
        got = kernel_step(True)
        torch.cuda.synchronize()
        r = {"hidden_equal": torch.equal(got.view(torch.int32), want.view(torch.int32)),
             "reference_loop_equal": torch.equal(want1.view(torch.int32), want.view(torch.int32)),
             "k_equal": torch.equal(kk.view(torch.int16), kr.view(torch.int16)),
             "v_equal": torch.equal(vk.view(torch.int16), vr.view(torch.int16)),
             "max_abs": float((got - want).abs().max())}
        # (the last residual and norm are glue.add_rms's, checked as the hidden)
        r["first_diff"] = (first_diff("att", list(att_g[:, None]), rec["att"])
                           or first_diff("residual", list(dbg_r[:-1, None]), rec["r"][:-1])
                           or first_diff("normed", list(dbg_h[:-1, None]), rec["h"][:-1]))
        res["positions"][pos] = r
        res["ok"] &= r["hidden_equal"] and r["k_equal"] and r["v_equal"]
        print(f"pos {pos:5d}: {r}", flush=True)

    # a CUDA graph of the kernel + the final norm, replayed at other positions (device inputs)
    kk.copy_(k0), vk.copy_(v0)
    lens.fill_(a.positions[0] + 1)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kernel_step(False)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_g = kernel_step(False)
    replays = {}
    for pos in (a.positions[-1], 700, 129):
        x = torch.randn(1, H, device="cuda")
        (want, kr, vr), (cos, sin) = triton_step(sp, x, pos, k0, v0, table)
        kk.copy_(k0), vk.copy_(v0)
        x_in.copy_(x), cos_b.copy_(cos), sin_b.copy_(sin), lens.fill_(pos + 1)
        g.replay()
        torch.cuda.synchronize()
        ok = torch.equal(out_g.view(torch.int32), want.view(torch.int32)) and torch.equal(kk, kr) and torch.equal(vk, vr)
        replays[pos] = ok
        res["ok"] &= ok
    res["graph_replays_equal"] = replays
    print(f"graph replays equal: {replays}", flush=True)
    # across the epoch's wrap (0xFFFFFF00: the words and flags zeroed, the epoch back to 0)
    kern.sync[1] = 0xFFFFFF00 - 2 * 256 - (1 << 32)
    wrap = []
    pos = 500
    x = torch.randn(1, H, device="cuda")
    (want, _, _), (cos, sin) = triton_step(sp, x, pos, k0, v0, table)
    x_in.copy_(x), cos_b.copy_(cos), sin_b.copy_(sin), lens.fill_(pos + 1)
    for _ in range(4):
        kk.copy_(k0), vk.copy_(v0)
        g.replay()
        torch.cuda.synchronize()
        wrap.append((int(kern.sync[1]) & 0xFFFFFFFF, torch.equal(out_g.view(torch.int32), want.view(torch.int32))))
    res["epoch_wrap"] = wrap
    res["ok"] &= all(w[1] for w in wrap) and wrap[-1][0] < 0x1000
    print(f"epoch wrap (epoch after, equal): {wrap}", flush=True)

    # timing: the kernel's graph against a graph of the Triton launches (same inputs, PDL)
    timing = {}
    for pos in (100, 500, 1000, 2000):
        if pos >= a.max_positions:
            continue
        cos, sin = rope_rows(pos, HD, cfg.rope_theta)
        cos_b.copy_(cos), sin_b.copy_(sin), lens.fill_(pos + 1)
        blk = table[:, pos // PAGE].long()
        off = torch.full((1,), pos % PAGE, dtype=torch.long, device="cuda")
        lens_r = torch.full((1,), pos + 1, dtype=torch.int32, device="cuda")
        kr, vr = k0.clone(), v0.clone()
        tg = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s):
            with pdl.scope(True):
                frame.stack_forward(x_in, sp, frame.paged_attend(sp, cos_b[None], sin_b[None], kr, vr, blk, off,
                                                                 table, lens_r))
        torch.cuda.synchronize()
        with torch.cuda.graph(tg):
            with pdl.scope(True):
                frame.stack_forward(x_in, sp, frame.paged_attend(sp, cos_b[None], sin_b[None], kr, vr, blk, off,
                                                                 table, lens_r))
        timing[pos] = {"kernel_us": timed_graph(g), "triton_us": timed_graph(tg)}
        print(f"pos {pos}: kernel + final norm {timing[pos]['kernel_us']:.1f} µs, Triton launches "
              f"{timing[pos]['triton_us']:.1f} µs", flush=True)
    res["timing"] = timing
    # one launch with each block's hop starts and thread 0's marks (cp_layers.cu's t0s / trace): per
    # hop, the median over blocks and layers of its span and of each mark (µs from the hop's start),
    # and how long after the first block the last one starts the next hop
    hops = ["q|k|v", "attention + o_proj", "gate|up", "down"]
    res["trace"] = {}
    for pos in (100, 1000, 2000):
        if pos >= a.max_positions:
            continue
        cos, sin = rope_rows(pos, HD, cfg.rope_theta)
        cos_b.copy_(cos), sin_b.copy_(sin), lens.fill_(pos + 1)
        t0s = torch.zeros(kern.blocks, 4 * L + 1, dtype=torch.int64, device="cuda")
        trace = torch.zeros(kern.blocks, 4 * L, 8, dtype=torch.int32, device="cuda")
        args = kern.args(x_in, table[0], lens, cos_b, sin_b)
        args.t0s, args.trace = t0s.data_ptr(), trace.data_ptr()
        for _ in range(2):
            kern.launch(args)
        torch.cuda.synchronize()
        t = t0s.cpu().double().numpy() / 1e3
        tr = trace.cpu().double().numpy() / 1e3
        out = {"launch_us": float(t[:, -1].max() - t[:, 0].min())}
        for p, name in enumerate(hops):
            cols = [4 * l + p for l in range(L)]
            span = [float(statistics.median(t[:, c + 1] - t[:, c])) for c in cols]
            skew = [float(t[:, c + 1].max() - t[:, c + 1].min()) for c in cols]
            marks = {m: float(statistics.median(tr[:, cols, m].ravel())) for m in (0, 2, 3, 4, 5, 6, 7)}
            out[name] = {"span_us": statistics.median(span), "next_start_skew_us": statistics.median(skew),
                         "marks_us": marks}
        res["trace"][pos] = out
        print(f"pos {pos}: launch {out['launch_us']:.1f} µs; " + "; ".join(
            f"{n}: {out[n]['span_us']:.2f} (skew {out[n]['next_start_skew_us']:.2f}, marks "
            + " ".join(f"{m}:{v:.2f}" for m, v in out[n]["marks_us"].items()) + ")" for n in hops), flush=True)
    print("ALL EQUAL" if res["ok"] else "DIFFERENCES", flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "talker_layers.json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
