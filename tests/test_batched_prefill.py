"""Batched prefill (engines/batched/prefill_rows.py): the same function as the one-prompt PyTorch
prefill, and bitwise the same for a prompt alone or beside other prompts (CPU, tiny model)."""

from __future__ import annotations

import pytest
import torch

from tts_server.engines.batched.engine import BatchedEngine
from tts_server.engines.batched.prefill import prefill
from tts_server.engines.batched.prefill_rows import prefill_rows
from tts_server.model.weights import decode_weights


def _engine(tiny_custom, kv_dtype=torch.float32):
    return BatchedEngine(decode_weights(tiny_custom.model), max_streams=4, max_positions=96,
                         block_size=8, kv_dtype=kv_dtype)


def _run(eng, prompts: dict[int, torch.Tensor]) -> torch.Tensor:
    """Prefill {slot: embeds [L, H]} in one batch -> last hidden per prompt [A, H]."""
    xs, slots, pos, last, n = [], [], [], [], 0
    for slot, x in prompts.items():
        assert eng.kv.ensure(slot, x.shape[0])
        xs.append(x)
        slots += [slot] * x.shape[0]
        pos += list(range(x.shape[0]))
        n += x.shape[0]
        last.append(n - 1)
    eng.kv.sync()
    t = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    return prefill_rows(eng.p.talker, eng.kv, torch.cat(xs), t(slots), t(pos), t(last))


def _kv(eng, slot, length):
    blocks = eng.kv.blocks(slot)
    bs = eng.kv.block_size
    k = torch.cat([eng.kv.k[:, b] for b in blocks], dim=2)[:, :, :length]  # [layers, NKV, L, HD]
    v = torch.cat([eng.kv.v[:, b] for b in blocks], dim=2)[:, :, :length]
    assert k.shape[2] == length and bs * len(blocks) >= length
    return k, v


def test_batched_prefill_matches_the_one_prompt_prefill(tiny_custom):
    h = tiny_custom.model.talker.config.hidden_size
    x = torch.randn(21, h, generator=torch.Generator().manual_seed(0))
    a, b = _engine(tiny_custom), _engine(tiny_custom)
    got = _run(a, {2: x})[0]
    assert b.kv.ensure(2, 21)
    want = prefill(b.p.talker, x, b.kv.k, b.kv.v, torch.tensor(b.kv.blocks(2)))
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got - want).abs().max()
    for ga, wa in zip(_kv(a, 2, 21), _kv(b, 2, 21)):
        assert torch.allclose(ga, wa, rtol=1e-4, atol=1e-4)


def test_batched_prefill_is_invariant_to_the_other_prompts(tiny_custom):
    h = tiny_custom.model.talker.config.hidden_size
    g = torch.Generator().manual_seed(1)
    x, y, z = torch.randn(13, h, generator=g), torch.randn(30, h, generator=g), torch.randn(5, h, generator=g)
    alone = _engine(tiny_custom, torch.bfloat16)
    h_alone = _run(alone, {1: x})
    crowd = _engine(tiny_custom, torch.bfloat16)
    h_crowd = _run(crowd, {3: y, 0: z, 1: x})  # x last, beside longer and shorter prompts
    assert torch.equal(h_crowd[2], h_alone[0])
    for a, b in zip(_kv(crowd, 1, 13), _kv(alone, 1, 13)):
        assert torch.equal(a, b)
    other = _engine(tiny_custom, torch.bfloat16)
    assert not torch.equal(_run(other, {1: y[:13]})[0], h_alone[0])  # the check can fail


def _cuda(o):
    """Decode weights on the GPU in bf16 (the serving layout)."""
    from dataclasses import fields, is_dataclass, replace

    if isinstance(o, torch.Tensor):
        return o.to("cuda", torch.bfloat16 if o.is_floating_point() else o.dtype)
    if isinstance(o, tuple):
        return tuple(_cuda(v) for v in o)
    if is_dataclass(o):
        return replace(o, **{f.name: _cuda(getattr(o, f.name)) for f in fields(o)})
    return o


@pytest.mark.gpu
def test_graph_captured_prefill_equals_the_eager_one_bitwise(tiny_custom):
    """RowPrefillGraphs (bf16 KV, the serving default) against the eager batched prefill: the
    same hidden states and K/V bits, a prompt alone or among others, in any bucket."""
    from tts_server.engines.batched.prefill import prefill_rows_fp32_attention

    w = _cuda(decode_weights(tiny_custom.model))
    eng = BatchedEngine(w, max_streams=4, max_positions=512, block_size=16)
    assert eng.row_graphs is not None
    h = w.talker.config.hidden_size
    g = torch.Generator().manual_seed(3)
    xs = {0: torch.randn(37, h, generator=g), 1: torch.randn(5, h, generator=g), 2: torch.randn(90, h, generator=g)}

    def prefill(slots, graphs):
        for s in slots:
            eng.release(s)
            assert eng.kv.ensure(s, xs[s].shape[0])
        eng.kv.sync()
        lens, blocks = [xs[s].shape[0] for s in slots], [eng.kv.blocks(s) for s in slots]
        x = torch.cat([xs[s] for s in slots]).cuda()
        n = eng.row_graphs.bucket(lens, blocks) if graphs else None
        out = eng.row_graphs.run(n, x, lens, blocks).clone() if n is not None else \
            prefill_rows_fp32_attention(eng.p.talker, eng.kv, x, lens, blocks)
        kv = {s: torch.cat([eng.kv.k[:, b] for b in eng.kv.blocks(s)], 2)[:, :, :xs[s].shape[0]].clone()
              for s in slots}
        return out, kv

    eager, kv_eager = prefill([0, 1, 2], graphs=False)
    graph, kv_graph = prefill([0, 1, 2], graphs=True)
    alone, kv_alone = prefill([0], graphs=True)
    assert torch.equal(graph, eager) and all(torch.equal(kv_graph[s], kv_eager[s]) for s in xs)
    assert torch.equal(alone[0], eager[0]) and torch.equal(kv_alone[0], kv_eager[0])


def _store_case(dev: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(3)
    sk, sv = torch.randn(5, 2, 16, 32, generator=g), torch.randn(5, 2, 16, 32, generator=g)
    kp = torch.zeros(9, 2, 16, 32, dtype=dtype)
    vp = torch.zeros(9, 2, 16, 32, dtype=dtype)
    return [t.to(dev) for t in (sk, sv, kp, vp, torch.tensor([3, -1, 7, 0, -1]))]


def test_store_blocks_rounds_into_the_pool_and_skips_padding():
    from tts_server.engines.batched import glue

    for dtype in (torch.bfloat16, torch.float32):
        sk, sv, kp, vp, dst = _store_case("cpu", dtype)
        glue.store_blocks(sk, sv, kp, vp, dst)
        for s, d in ((0, 3), (2, 7), (3, 0)):
            assert torch.equal(kp[d], sk[s].to(dtype)) and torch.equal(vp[d], sv[s].to(dtype))
        assert kp[[1, 2, 4, 5, 6, 8]].abs().sum() == 0 and vp[[1, 2, 4, 5, 6, 8]].abs().sum() == 0


@pytest.mark.gpu
def test_store_blocks_kernel_equals_torch_bitwise():
    from tts_server.engines.batched import glue

    for dtype in (torch.bfloat16, torch.float32):
        want = _store_case("cpu", dtype)
        glue.store_blocks(*want)
        got = _store_case("cuda", dtype)
        glue.store_blocks(*got)  # the Triton kernel
        assert torch.equal(got[2].cpu(), want[2]) and torch.equal(got[3].cpu(), want[3])


def test_prefill_row_inputs_lay_out_each_prompt_and_pad():
    """stage_rows (the row graphs' pinned inputs, and rows_plan's) against the layout written out
    row by row: each prompt's rows over its own scratch blocks, positions from 0, query blocks of
    <= PREFILL_QB rows inside one prompt; the padding the graphs expect beyond them."""
    import numpy as np

    from tts_server.engines.batched.ops import PREFILL_QB
    from tts_server.engines.batched.prefill import max_query_blocks, rows_plan, stage_rows

    lens, bs = [37, 5, 16, 90], 16
    blocks = [[4, 9, 2], [7], [11], [3, 5, 6, 8, 10, 12]]  # a slot may hold more blocks than it needs
    table, pos, last, dst, qrow, qn, base = [], [], [], [], [], [], 0
    for n, bl in zip(lens, blocks):
        own = list(range(base, base + len(bl))) + [0] * (6 - len(bl))  # 6: the widest prompt's
        start = len(pos)
        table += [own] * n
        pos += list(range(n))
        last.append(start + n - 1)
        dst += bl
        qrow += list(range(start, start + n, PREFILL_QB))
        qn += [min(PREFILL_QB, n - r) for r in range(0, n, PREFILL_QB)]
        base += len(bl)
    plan = rows_plan(lens, blocks, bs)
    for k, want in dict(table=table, pos=pos, last=last, dst=dst, qrow=qrow, qn=qn).items():
        assert plan[k].tolist() == want, k

    n, a = 256, 8
    cols, nblk, nq, rows = -(-n // bs), -(-n // bs) + a + 1, max_query_blocks(n, a, PREFILL_QB), sum(lens)
    views = dict(table=np.full((n, cols), 99, np.int32), pos=np.full(n, 99, np.int32), last=np.full(a, 99, np.int32),
                 dst=np.full(nblk, 99, np.int32), qrow=np.full(nq, 99, np.int32), qn=np.full(nq, 99, np.int32))
    stage_rows(views, lens, blocks, nblk - 1)
    assert views["table"][:rows, :6].tolist() == table
    assert (views["table"][:rows, 6:] == nblk - 1).all() and (views["table"][rows:] == nblk - 1).all()
    assert views["pos"].tolist() == pos + [0] * (n - rows)
    assert views["last"].tolist() == last + [0] * (a - 4)
    assert views["dst"].tolist() == dst + [-1] * (nblk - len(dst))
    assert views["qrow"][:len(qrow)].tolist() == qrow and views["qn"].tolist() == qn + [0] * (nq - len(qn))


@pytest.mark.gpu
def test_admissions_past_the_largest_row_bucket_replay_in_chunks_bitwise(tiny_custom):
    """A step whose prompts exceed the largest row-graph bucket prefills in several replays (no
    eager fallback): every slot's past hidden, first code 0, K/V and
    finiteness are bitwise those of the same prompt admitted alone."""
    from tts_server.api import SamplingConfig
    from tts_server.engines.batched.state import CODE0
    from tts_server.engines.contract import Admission, Prompt, StepPlan

    eng = BatchedEngine(_cuda(decode_weights(tiny_custom.model)), max_streams=4, max_positions=512, block_size=16)
    h = tiny_custom.model.talker.config.hidden_size
    g = torch.Generator().manual_seed(5)
    prompts = {s: Prompt(embeds=torch.randn(n, h, generator=g), trailing=torch.zeros(1, h), pad_embed=torch.zeros(h))
               for s, n in ((0, 100), (1, 120), (2, 90))}
    admits = [Admission(s, p, SamplingConfig(seed=s + 10, do_sample=True)) for s, p in prompts.items()]
    assert sum(p.embeds.shape[0] for p in prompts.values()) > eng.row_graphs.max_rows

    def admit(adms):
        for a in adms:
            eng.release(a.slot)
            assert eng.kv.ensure(a.slot, a.prompt.embeds.shape[0])
        cuts = eng.row_graphs.chunks([a.prompt.embeds.shape[0] for a in adms], [len(eng.kv.blocks(a.slot)) for a in adms])
        assert cuts == ([(0, 2), (2, 3)] if len(adms) == 3 else [(0, 1)])
        out = eng.run(StepPlan(decode=(), admit=tuple(adms)))
        assert not out.failed
        return {a.slot: (eng.state.past_hidden[a.slot].clone(), int(eng.state.ints[CODE0, a.slot]),
                         torch.cat([eng.kv.k[:, b] for b in eng.kv.blocks(a.slot)], 2).clone()) for a in adms}

    together = admit(admits)
    for a in admits:
        alone = admit([a])[a.slot]
        assert torch.equal(alone[0], together[a.slot][0]) and alone[1] == together[a.slot][1]
        assert torch.equal(alone[2], together[a.slot][2])
    assert not torch.equal(together[0][0], together[1][0])  # the check can fail


def test_row_graph_chunks_are_the_greedy_runs_that_fit_a_bucket():
    """RowPrefillGraphs.chunks (one pass over running totals) cuts prompts where the greedy use of
    `bucket` would: every run fits a bucket and could not take the next prompt; a prompt that fits
    none alone is a run of its own."""
    import random

    from tts_server.engines.batched.prefill import RowPrefillGraphs

    rg = object.__new__(RowPrefillGraphs)  # the bucket limits only; no graphs (CPU)
    bs, max_prompts = 16, 6
    rg.sizes = [32, 64, 128, 256]
    rg.bufs = {n: dict(a=min(max_prompts, n), cols=-(-n // bs), nblk=-(-n // bs) + min(max_prompts, n) + 1)
               for n in rg.sizes}
    rnd = random.Random(4)
    for _ in range(200):
        lens = [rnd.choice((3, 17, 40, 90, 130, 300)) for _ in range(rnd.randint(1, 12))]
        nblocks = [-(-n // bs) + rnd.choice((0, 0, 1)) for n in lens]
        blocks = [list(range(nb)) for nb in nblocks]
        want, i = [], 0
        while i < len(lens):
            j = i + 1
            while j < len(lens) and rg.bucket(lens[i:j + 1], blocks[i:j + 1]) is not None:
                j += 1
            want.append((i, j))
            i = j
        assert rg.chunks(lens, nblocks) == want, (lens, nblocks)


def test_prefill_row_inputs_with_a_shared_prefix():
    """stage_rows with skip / lead (prefill.shared_rows): a prompt that shares its first positions
    with an earlier one has rows from that position on (positions from skip, query blocks from its
    first row), and a copy of those positions from the earlier prompt's first scratch block."""
    import numpy as np

    from tts_server.engines.batched.ops import PREFILL_QB
    from tts_server.engines.batched.prefill import max_query_blocks, rows_plan, stage_rows

    lens, bs = [5, 37, 30, 90], 16
    skip, lead = [0, 0, 9, 9], [-1, -1, 1, 1]
    blocks = [[7], [4, 9, 2], [11, 1], [3, 5, 6, 8, 10, 12]]
    table, pos, last, qrow, qn, base = [], [], [], [], [], 0
    for n, k, bl in zip(lens, skip, blocks):
        own = list(range(base, base + len(bl))) + [0] * (6 - len(bl))
        start = len(pos)
        table += [own] * (n - k)
        pos += list(range(k, n))
        last.append(start + n - k - 1)
        qrow += list(range(start, start + n - k, PREFILL_QB))
        qn += [min(PREFILL_QB, n - k - r) for r in range(0, n - k, PREFILL_QB)]
        base += len(bl)
    # scratch blocks: prompt 0 has 0, prompt 1 1..3, prompt 2 4..5, prompt 3 6..11
    want = dict(table=table, pos=pos, last=last, qrow=qrow, qn=qn, cp_src=[1, 1, 0, 0], cp_dst=[4, 6, 0, 0],
                cp_n=[9, 9, 0, 0])
    plan = rows_plan(lens, blocks, bs, skip, lead)
    for k, w in want.items():
        assert plan[k].tolist() == w, k
    n, a = 256, 8
    cols, nblk, nq, rows = -(-n // bs), -(-n // bs) + a + 1, max_query_blocks(n, a, PREFILL_QB), len(pos)
    views = dict(table=np.full((n, cols), 99, np.int32), pos=np.full(n, 99, np.int32), last=np.full(a, 99, np.int32),
                 dst=np.full(nblk, 99, np.int32), qrow=np.full(nq, 99, np.int32), qn=np.full(nq, 99, np.int32),
                 cp_src=np.full(a, 99, np.int32), cp_dst=np.full(a, 99, np.int32), cp_n=np.full(a, 99, np.int32))
    stage_rows(views, lens, blocks, nblk - 1, skip, lead)
    assert views["pos"].tolist() == pos + [0] * (n - rows)
    assert views["cp_src"].tolist() == [1, 1] + [0] * (a - 2) and views["cp_n"].tolist() == [9, 9] + [0] * (a - 2)
    assert views["cp_dst"].tolist() == [4, 6] + [0] * (a - 2)
    stage_rows(views, lens, blocks, nblk - 1)  # no sharing: no copies left from the last step
    assert views["cp_n"].tolist() == [0] * a and views["pos"][:lens[0]].tolist() == list(range(lens[0]))


def test_prefill_row_inputs_prompt_by_prompt_equal_the_numpy_layout():
    """stage_rows fills few prompts' inputs prompt by prompt (_stage_few) and many with whole-array
    numpy (_stage_many): the same views for random prompts, blocks and shared prefixes, from
    views holding another step's values."""
    import random

    import numpy as np

    from tts_server.engines.batched import prefill as pf
    from tts_server.engines.batched.ops import PREFILL_QB

    n, bs, a = 512, 16, 12
    cols, nq = -(-n // bs), pf.max_query_blocks(n, a, PREFILL_QB)
    nblk = cols + a + 1
    sizes = dict(table=n * cols, pos=n, last=a, dst=nblk, qrow=nq, qn=nq, cp_src=a, cp_dst=a, cp_n=a)
    rnd = random.Random(7)

    def views(fill):
        v = {k: np.full(s, fill, np.int32) for k, s in sizes.items()}
        v["table"] = v["table"].reshape(n, cols)
        return v

    for trial in range(300):
        count = rnd.randint(1, a)
        lens = [rnd.randint(1, 60) for _ in range(count)]
        while sum(lens) > n:
            lens.pop()
        blocks = [[rnd.randint(1, 500) for _ in range(-(-x // bs) + rnd.choice((0, 0, 1)))] for x in lens]
        skip = lead = None
        if trial % 2:
            skip, lead, first = [0] * len(lens), [-1] * len(lens), None
            for i, x in enumerate(lens):
                if x > 9:
                    if first is None:
                        first = i
                    else:
                        skip[i], lead[i] = 9, first
        few, many = views(77), views(-5)
        pf._stage_few(few, lens, blocks, nblk - 1, skip, lead)
        pf._stage_many(many, lens, blocks, nblk - 1, skip, lead)
        for k in sizes:
            assert np.array_equal(few[k], many[k]), (k, lens, skip)


@pytest.mark.gpu
def test_gpu_admissions_launch_without_a_host_wait_and_draw_graphs_equal_eager(tiny_custom):
    """A step's admissions (prefill replay, slot state, first draws) are launched without an
    implicit host wait (torch's sync debug mode raises on one: a pageable copy, .item(), ...), so
    the host prepares the first frame while the device prefills; and the first draws' graphs
    (one per frame bucket, scratch-slot padding) give the eager draws' bits: past hidden, code
    0, the seen row."""
    from tts_server.api import SamplingConfig
    from tts_server.engines.batched.state import CODE0, N_SAMPLED
    from tts_server.engines.contract import Admission, Prompt, StepPlan

    eng = BatchedEngine(_cuda(decode_weights(tiny_custom.model)), max_streams=4, max_positions=512, block_size=16)
    assert sorted(eng.draw_graphs) == eng.sizes
    h = tiny_custom.model.talker.config.hidden_size
    g = torch.Generator().manual_seed(9)
    admits = tuple(Admission(s, Prompt(embeds=torch.randn(n, h, generator=g).cuda(), trailing=torch.zeros(2, h).cuda(),
                                       pad_embed=torch.zeros(h).cuda()),
                             SamplingConfig(seed=s + 3, do_sample=True, temperature=1.3))
                   for s, n in ((0, 20), (2, 33), (3, 7)))

    def admit(adms):
        for a in adms:
            eng.release(a.slot)
        out = eng.run(StepPlan(decode=(), admit=adms))
        assert not out.failed
        s = eng.state
        return {a.slot: (s.past_hidden[a.slot].clone(), int(s.ints[CODE0, a.slot]), int(s.ints[N_SAMPLED, a.slot]),
                         s.seen[a.slot].clone()) for a in adms}

    graphed = admit(admits)
    draw_graphs, eng.draw_graphs = eng.draw_graphs, {}
    try:
        eager = admit(admits)
    finally:
        eng.draw_graphs = draw_graphs
    for slot, want in eager.items():
        got = graphed[slot]
        assert torch.equal(got[0], want[0]) and got[1:3] == want[1:3] and torch.equal(got[3], want[3]), slot
        assert got[2] == 1 and int(got[3].sum()) == 1
    assert len({v[1] for v in graphed.values()}) > 1 or not torch.equal(graphed[0][0], graphed[2][0])

    for a in admits:
        eng.release(a.slot)
        eng._reserve(a)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        finite = eng._admit_rows(list(admits))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert finite.tolist() == [True] * 3
    rows = torch.tensor([0], device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):  # the check can fail: `seen[rows] = 0`, as admit_many had it
            eng.state.seen[rows] = 0
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for a in admits:
        eng.release(a.slot)
