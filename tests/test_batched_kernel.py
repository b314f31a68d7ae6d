"""The batched frame kernels (csrc/batched/, tts_server/engines/batched/cuda_frame.py): the
code-predictor half (`predict`) and the talker step (`advance`).

On the CPU: the same kernel source built against the SIMT emulator (tools/simt/simt.h, `make -C
csrc emu`), driven through the class the engine uses, against the engine's own reference frame
(FrameStep.predict / advance over ops_ref: fp64 products) and TorchEngine, for bitwise batch
invariance (B, row, register vs shared-memory products) and inside a decoding engine. The
emulator adds the products of an mma in k order, so these check the kernels' logic and index
math, not a GPU's rounding; the `gpu` tests at the end run the CUDA build on a device."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tts_server.engines.batched import checks
from tts_server.engines.batched.cuda_frame import BatchedKernelLibrary, CudaFrame, barrier_phases
from tts_server.engines.batched.engine import BatchedEngine
from tts_server.engines.batched.state import CODE0, N_SAMPLED
from tts_server.engines.contract import Admission, SamplingConfig, StepPlan

ROOT = Path(__file__).resolve().parents[1]
H = 1024


def _make(*args: str) -> None:
    r = subprocess.run(["make", *args], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]


@pytest.fixture(scope="module")
def emu_lib() -> BatchedKernelLibrary:
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler to build the emulated kernel")
    _make("-C", str(ROOT / "csrc"), "emu")
    return BatchedKernelLibrary(ROOT / "csrc" / "build" / "emu" / "libqwen_batched.so")


@pytest.fixture(scope="module")
def small_weights():
    """0.6B shapes with one talker and one code-predictor layer (the kernel takes 1..5)."""
    return checks.random_weights("cpu", layers=(1, 1))


def _engine(w, streams: int, max_positions: int = 64, **kw) -> BatchedEngine:
    kw.setdefault("num_blocks", streams * (max_positions // 64 + 1) + 1)
    return BatchedEngine(w, max_streams=streams, max_positions=max_positions, dump_logits=True, use_graphs=False, **kw)


def _predictor(eng: BatchedEngine, lib: BatchedKernelLibrary, **kw) -> CudaFrame:
    return CudaFrame(eng.p, eng.state, eng.kv, eng.frame, eng.max_positions, lib=lib, **kw)


def _fill(eng: BatchedEngine, n: int, sampling: list[SamplingConfig], seed: int = 0) -> None:
    """Slots 0..n-1 with random past hidden states and codes 0 (all the predict half reads), on
    the engine's device."""
    dev = eng.device
    g = torch.Generator(device=dev).manual_seed(seed)
    eng.state.admit_many(list(range(n)), sampling, [10] * n, [torch.zeros(0, H)] * n, [torch.zeros(H)] * n,
                         torch.randn(n, H, generator=g, device=dev), [0] * n)
    eng.state.ints[CODE0, :n] = torch.randint(0, 2048, (n,), generator=g, dtype=torch.int32, device=dev)
    eng.state.ints[N_SAMPLED, :n] = torch.randint(1, 40, (n,), generator=g, dtype=torch.int32, device=dev)


def _reference(eng: BatchedEngine, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    eng.frame.predict(torch.arange(n))
    return eng.frame.out[:n].clone(), eng.frame.dump[:n].clone()


def _kernel(eng: BatchedEngine, cp: CudaFrame, slots: list[int], bpad: int | None = None):
    eng.frame.out.fill_(-7)
    eng.frame.dump.fill_(float("nan"))
    cp.predict(torch.tensor(slots, dtype=torch.int64), len(slots), bpad)
    cp.check()
    return eng.frame.out.clone(), eng.frame.dump.clone()


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.double() - want.double()).norm(dim=-1) / want.double().norm(dim=-1)).max())


def test_emulator_selftest():
    """The emulator itself: mma.sync fragments vs a matrix product, shuffles, votes, barriers,
    deferred cp.async copies, grid polling, deadlock detection."""
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    _make("-C", str(ROOT / "tools" / "simt"), "selftest")
    r = subprocess.run([str(ROOT / "tools" / "simt" / "build" / "selftest")], capture_output=True, text=True)
    assert r.returncode == 0 and "all passed" in r.stdout, r.stdout + r.stderr


def test_cuda_and_emulated_builds_report_the_same_parameter_block(emu_lib):
    """Both builds of csrc/batched have the same fields at the same offsets and the same dims, so
    what the CPU tests fill is what the GPU gets."""
    _make("-C", str(ROOT / "csrc"), "check")
    cuda = BatchedKernelLibrary(ROOT / "csrc" / "build" / "check" / "libqwen_batched.so")
    assert cuda.fields == emu_lib.fields and cuda.params_size == emu_lib.params_size
    assert {k: v for k, v in cuda.consts.items() if k != "EMULATED"} == \
           {k: v for k, v in emu_lib.consts.items() if k != "EMULATED"}
    assert (cuda.EMULATED, emu_lib.EMULATED) == (0, 1)


def test_a_missing_field_is_named(emu_lib):
    with pytest.raises(ValueError, match="missing.*reg_max_m"):
        emu_lib.pack({k: 0 for k in emu_lib.fields if k != "reg_max_m"})


@pytest.mark.parametrize("b, reg_max_m, greedy", [(3, 16, True), (3, 0, True), (5, 16, False), (5, 0, False)])
def test_matches_the_reference_predict(emu_lib, small_weights, b, reg_max_m, greedy):
    """Three passes of b streams through the register (reg_max_m 16) or the shared-memory product
    path (0): each pass's logits within 1e-4 of the fp64 reference, the same codes (greedy, and
    sampled with top-k / top-p variants), no error bits."""
    eng = _engine(small_weights, 8)
    samp = [SamplingConfig(seed=i, subtalker_do_sample=not greedy, subtalker_top_k=(50, 0, 7)[i % 3],
                           subtalker_top_p=(1.0, 0.8, 0.95)[i % 3]) for i in range(b)]
    _fill(eng, b, samp, seed=b)
    want_codes, want_logits = _reference(eng, b)
    cp = _predictor(eng, emu_lib, reg_max_m=reg_max_m)
    cp.num_passes = 3
    codes, logits = _kernel(eng, cp, list(range(b)))
    assert torch.equal(codes[:b, :4], want_codes[:b, :4]), (codes[:b, :4], want_codes[:b, :4])
    assert (codes[:b, 4:16] == 0).all() and (codes[:b, 17] == 0).all()
    assert _rel_err(logits[:b, :3, :2048], want_logits[:b, :3, :2048]) < 1e-4


def test_full_code_predictor_one_stream(emu_lib):
    """The full shapes end to end: 5 layers, all 15 passes, one stream."""
    w = checks.random_weights("cpu", layers=(1, 5), seed=3)
    eng = _engine(w, 2)
    _fill(eng, 1, [SamplingConfig(seed=5)])
    want_codes, want_logits = _reference(eng, 1)
    codes, logits = _kernel(eng, _predictor(eng, emu_lib), [0])
    assert torch.equal(codes[0, :16], want_codes[0, :16]) and codes[0, 17] == 0
    assert _rel_err(logits[0, :15, :2048], want_logits[0, :15, :2048]) < 1e-4


def test_batch_invariance_is_bitwise(emu_lib, small_weights):
    """One stream in another row of launches of B = 1, 3, 7, 12 with other neighbours, through
    every product schedule (registers; shared memory over all of K or split by pieces, several
    tiles): bitwise the same logits (every pass) and codes."""
    eng = _engine(small_weights, 12)
    _fill(eng, 12, [SamplingConfig(seed=100 + i) for i in range(12)], seed=1)
    cp = _predictor(eng, emu_lib)
    cp.num_passes = 2
    target, ref = 5, None
    for b, regm, split, tile in ((1, 16, 0, 0), (1, 0, 1, 0), (1, 0, 2, 0), (3, 16, 0, 0), (3, 0, 2, 5),
                                 (7, 16, 0, 0), (7, 0, 1, 4), (12, 64, 0, 0), (12, 0, 2, 6), (12, 0, 1, 1)):
        cp.reg_max_m, cp.split_mode, cp.tile = regm, split, tile
        others = [s for s in range(12) if s != target][(3 * b) % 4:][: b - 1]
        row = b // 2
        codes, logits = _kernel(eng, cp, others[:row] + [target] + others[row:])
        got = (codes[row, :18].clone(), logits[row, :2, :2048].clone())
        ref = ref or got
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (b, regm, split, tile)


def test_padding_rows_and_a_failing_stream(emu_lib, small_weights):
    """A non-finite stream fails alone (an error bit for each pass, as the reference sets them;
    its draws are the reference's draws over zeroed logits) and the bucket's padding rows get codes
    0 and no error; the healthy stream's bits are those it has alone."""
    eng = _engine(small_weights, 4)
    _fill(eng, 2, [SamplingConfig(seed=1), SamplingConfig(seed=2)])
    eng.state.past_hidden[1, 7] = float("nan")
    cp = _predictor(eng, emu_lib)
    eng.frame.predict(torch.arange(2))  # the reference's error bits for the same state
    assert eng.frame.out[1, 17] & 0b11 == 0b11
    cp.num_passes = 2
    alone_codes, alone_logits = _kernel(eng, cp, [0])
    codes, logits = _kernel(eng, cp, [0, 1], bpad=4)
    assert torch.equal(codes[0], alone_codes[0]) and torch.equal(logits[0, :2, :2048], alone_logits[0, :2, :2048])
    want_codes, _ = _reference(eng, 2)
    assert codes[1, 17] == 0b11 and torch.equal(codes[1, :3], want_codes[1, :3])
    assert (codes[2:4, :16] == 0).all() and (codes[2:4, 17] == 0).all()


def test_a_barrier_timeout_ends_the_launch_and_raises(emu_lib, small_weights):
    """Every block leaves at its next grid barrier once one wait times out; check() raises for
    that half only."""
    import struct

    eng = _engine(small_weights, 2)
    _fill(eng, 1, [SamplingConfig(seed=1)])
    cp = _predictor(eng, emu_lib)
    struct.pack_into("<q", cp.buf, emu_lib.fields["timeout_ns"][0], 0)
    cp.predict(torch.tensor([0]), 1)
    with pytest.raises(RuntimeError, match="batched predict kernel: a grid barrier wait exceeded"):
        cp.check()
    cp.check("advance")  # the other half's word is clear


# ---- the talker step ------------------------------------------------------------------------------
def _admitted(w, lengths: list[int], kv_dtype=torch.bfloat16, greedy: bool = False, max_positions: int = 128):
    """An engine with len(lengths) prefilled streams (prompts of those lengths) and their first
    frame's codes in frame.out (the reference predict)."""
    eng = _engine(w, len(lengths), max_positions=max_positions, kv_dtype=kv_dtype)
    adm = tuple(Admission(i, checks.random_prompt(40 + i, n, H, n_trailing=2),
                          checks.GREEDY if greedy else SamplingConfig(seed=70 + i, top_k=(50, 0, 9)[i % 3],
                                                                      top_p=(1.0, 0.9, 1.0)[i % 3]))
                for i, n in enumerate(lengths))
    out = eng.run(StepPlan(admit=adm))
    assert not out.failed
    eng.frame.predict(torch.arange(len(lengths)))
    return eng


def _talker_state(eng: BatchedEngine, n: int):
    s = eng.state
    return (s.ints[:, :n].clone(), s.past_hidden[:n].clone(), s.seen[:n].clone(), eng.kv.k.clone(), eng.kv.v.clone(),
            eng.frame.out[:n].clone(), eng.frame.dump[:n, 15].clone())


def _restore(eng: BatchedEngine, n: int, st) -> None:
    s = eng.state
    s.ints[:, :n], s.past_hidden[:n], s.seen[:n] = st[0], st[1], st[2]
    eng.kv.k.copy_(st[3])
    eng.kv.v.copy_(st[4])
    eng.frame.out[:n] = st[5]


@pytest.mark.parametrize("kv_dtype, reg_max_m, greedy, lengths", [
    (torch.bfloat16, 16, False, [5, 70, 130]),
    (torch.float32, 0, True, [5, 70, 130]),
    (torch.bfloat16, 0, False, [1030]),
])
def test_talker_step_matches_the_reference(emu_lib, small_weights, kv_dtype, reg_max_m, greedy, lengths):
    """The talker step of streams with 1 to 17 64-key units of context (up to 9 chunks of 2 units)
    on the KV pool's type, through either product path: the next code 0, the state commit
    (position, code 0, draws, text step, history byte) as the reference's, past_hidden and the
    logits within 1e-4 (fp32 KV; 5e-3 with bf16 KV, where a new key's rounding can flip by one
    bf16 step), no error bit."""
    n = len(lengths)
    eng = _admitted(small_weights, lengths, kv_dtype, greedy, max_positions=1100 if max(lengths) > 200 else 256)
    before = _talker_state(eng, n)
    eng.frame.advance(torch.arange(n))
    want = _talker_state(eng, n)
    _restore(eng, n, before)
    cp = _predictor(eng, emu_lib, reg_max_m=reg_max_m)
    cp.advance(torch.arange(n), n)
    cp.check()
    got = _talker_state(eng, n)
    assert torch.equal(got[5][:, 16], want[5][:, 16]) and torch.equal(got[5][:, 17], want[5][:, 17]), (got[5], want[5])
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    bound = 1e-4 if kv_dtype == torch.float32 else 5e-3
    assert _rel_err(got[1], want[1]) < bound and _rel_err(got[6], want[6]) < bound
    # the new K/V at each stream's position (= its prompt length): within 1e-4 in fp32, within one
    # bf16 step in a bf16 pool (a ~1e-6 difference can cross a rounding boundary), plus 1e-5 of
    # the largest value (RoPE's cancellations leave small values with the large ones' error)
    tol = 2.0 ** -7 if kv_dtype == torch.bfloat16 else 1e-4
    for i, p in enumerate(lengths):
        blk, off = eng.kv.blocks(i)[p // eng.kv.block_size], p % eng.kv.block_size
        for a, b in ((got[3], want[3]), (got[4], want[4])):
            ga, wb = a[:, blk, :, off].float(), b[:, blk, :, off].float()
            assert ((ga - wb).abs() <= tol * wb.abs() + 1e-5 * wb.abs().max()).all(), (i, "new K/V")


def test_many_input_tiles(emu_lib, small_weights):
    """B = 40 (the first pass's products have 80 input rows: several shared-memory tiles of
    inputs, partial last tiles): both kernels as the reference, 2 passes (fp32 KV: no bf16
    rounding flips of the new keys, so 1e-4 holds)."""
    b = 40
    eng = _admitted(small_weights, [3 + (7 * i) % 60 for i in range(b)], torch.float32, max_positions=128)
    want_codes, want_logits = _reference(eng, b)
    before = _talker_state(eng, b)
    cp = _predictor(eng, emu_lib)
    cp.num_passes = 2
    codes, logits = _kernel(eng, cp, list(range(b)))
    assert torch.equal(codes[:b, :3], want_codes[:b, :3])
    assert _rel_err(logits[:b, :2, :2048], want_logits[:b, :2, :2048]) < 1e-4
    _restore(eng, b, before)
    eng.frame.advance(torch.arange(b))
    want = _talker_state(eng, b)
    _restore(eng, b, before)
    cp.advance(torch.arange(b), b)
    cp.check()
    got = _talker_state(eng, b)
    assert torch.equal(got[5][:, 16], want[5][:, 16]) and torch.equal(got[0], want[0])
    assert _rel_err(got[6], want[6]) < 1e-4


def test_talker_step_split_schedule_same_bits(emu_lib, small_weights):
    """The talker step's products through the shared-memory path over all of K and split into
    pieces (the consumer adds them): bitwise the same state commit, past_hidden, logits and K/V."""
    b = 3
    eng = _admitted(small_weights, [5, 70, 130], torch.bfloat16, max_positions=256)
    before = _talker_state(eng, b)
    cp = _predictor(eng, emu_lib, reg_max_m=0)
    got = []
    for split in (1, 2):
        _restore(eng, b, before)
        cp.split_mode = split
        cp.advance(torch.arange(b), b)
        cp.check()
        got.append(_talker_state(eng, b))
    assert all(torch.equal(x, y) for x, y in zip(*got))


def test_engine_frames_with_both_kernels_are_batch_invariant(emu_lib, small_weights, monkeypatch):
    """Whole engine steps with frame_kernel="cuda" (admissions, the two kernels) on the emulator:
    a stream's codes and every logit are bitwise the same alone and among neighbours, 3 frames."""
    monkeypatch.setenv("QBK_LIB", str(emu_lib.path))
    eng = BatchedEngine(small_weights, max_streams=4, max_positions=64, num_blocks=9, dump_logits=True,
                        frame_kernel="cuda")
    eng.cuda.num_passes = 2
    p = checks.random_prompt(0, 6, H)
    res = checks.invariance(eng, p, SamplingConfig(seed=9), sizes=(1, 3), frames=3, neighbour_len=(3, 8))
    assert all(r["codes_equal"] and r["logits_equal"] for r in res.values()), res


def test_greedy_codes_equal_torch_engine(emu_lib, monkeypatch):
    """End to end against the exact reference: greedy frames from an engine running both kernels
    (fp32 KV, all 15 passes, one layer per stack) equal TorchEngine's, frame for frame."""
    from tts_server.engines.contract import decode_until_eos
    from tts_server.engines.torch_ref import TorchEngine

    w = checks.random_weights("cpu", layers=(1, 1), seed=4)
    monkeypatch.setenv("QBK_LIB", str(emu_lib.path))
    eng = BatchedEngine(w, max_streams=2, max_positions=64, num_blocks=3, kv_dtype=torch.float32, frame_kernel="cuda")
    ref = TorchEngine(checks.bf16_rounded(w), max_streams=1, max_positions=64)
    p = checks.random_prompt(7, 9, H, n_trailing=3)
    want = decode_until_eos(ref, 0, 4, p, checks.GREEDY)
    got = decode_until_eos(eng, 0, 4, p, checks.GREEDY)
    assert np.array_equal(got, want), (got, want)


# ---- on a GPU: the CUDA build ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu_setup():
    _make("-C", str(ROOT / "csrc"), "libqwen_batched.so")
    w = checks.random_weights("cuda")
    eng = BatchedEngine(w, max_streams=64, max_positions=64, num_blocks=65, dump_logits=True, use_graphs=False)
    return eng, CudaFrame(eng.p, eng.state, eng.kv, eng.frame, eng.max_positions)


def _gpu_kernel(eng, cp, slots):
    cp.predict(torch.tensor(slots, dtype=torch.int64, device="cuda"), len(slots))
    torch.cuda.synchronize()
    cp.check()
    return eng.frame.out[:len(slots)].clone(), eng.frame.dump[:len(slots)].clone()


@pytest.mark.gpu
def test_gpu_kernel_matches_triton_predict(gpu_setup):
    """64 greedy streams: the kernel's pass-0 logits within 1e-4 of the Triton predict's, and
    (away from near-ties) the same 16 codes."""
    eng, cp = gpu_setup
    _fill(eng, 64, [SamplingConfig(seed=i, subtalker_do_sample=False) for i in range(64)], seed=64)
    eng.frame.predict(torch.arange(64, device="cuda"))
    want_codes, want_logits = eng.frame.out[:64].clone(), eng.frame.dump[:64].clone()
    codes, logits = _gpu_kernel(eng, cp, list(range(64)))
    assert _rel_err(logits[:, 0, :2048], want_logits[:, 0, :2048]) < 1e-4
    same = (codes[:, :16] == want_codes[:, :16]).all(1).float().mean().item()
    assert same >= 0.9, same


@pytest.mark.gpu
def test_gpu_batch_invariance_is_bitwise(gpu_setup):
    eng, cp = gpu_setup
    _fill(eng, 64, [SamplingConfig(seed=i) for i in range(64)], seed=64)
    target, ref = 5, None
    for b in (1, 3, 17, 64):
        for regm in (16, 0, 64):
            cp.reg_max_m = regm
            others = [s for s in range(64) if s != target][: b - 1]
            row = b // 2
            codes, logits = _gpu_kernel(eng, cp, others[:row] + [target] + others[row:])
            got = (codes[row].cpu(), logits[row, :15, :2048].cpu())
            ref = ref or got
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (b, regm)
    cp.reg_max_m = 16


@pytest.mark.gpu
def test_gpu_engine_frames_with_both_kernels(gpu_setup):
    """The engine with frame_kernel="cuda" on random full-size weights: bitwise invariance over 16
    frames (B 1/3/17/64, greedy and sampled) and teacher-forced fidelity with both KV types."""
    w = checks.random_weights("cuda")
    eng = BatchedEngine(w, max_streams=64, max_positions=256, dump_logits=True, frame_kernel="cuda")
    p = checks.random_prompt(0, 12, H, device="cuda")
    for s in (checks.GREEDY, SamplingConfig(seed=7)):
        res = checks.invariance(eng, p, s, sizes=(1, 3, 17, 64), frames=16)
        assert all(r["codes_equal"] and r["logits_equal"] for r in res.values()), res
    for kv in (torch.bfloat16, torch.float32):
        e2 = BatchedEngine(w, max_streams=8, max_positions=256, dump_logits=True, kv_dtype=kv, frame_kernel="cuda")
        r = checks.teacher_forced(e2, w, [checks.random_prompt(i, 12 + i, H, device="cuda") for i in range(8)], 32)
        assert r["rel_err_max"] <= 1e-2 and r["top1"] >= 0.995, r


def test_barrier_trace(emu_lib, small_weights):
    """The profiling trace (CudaFrame.set_trace): one arrival and exit per grid barrier and block,
    as many barriers as barrier_phases names for each launch, and the barrier holds: no block
    leaves barrier e before the last block has arrived at it, nor arrives at e + 1 before leaving e."""
    eng = _admitted(small_weights, [5, 70], torch.float32, False, max_positions=256)
    cp = _predictor(eng, emu_lib)
    cp.num_passes = 2
    rows = torch.arange(2)
    for half, layers in (("predict", 1), ("advance", 1)):
        names = barrier_phases(half, layers, passes=2)
        tr = torch.zeros(cp.blocks, len(names) + 3, 2, dtype=torch.int64)
        cp.set_trace(tr)
        cp.predict(rows, 2) if half == "predict" else cp.advance(rows, 2)
        cp.check()
        cp.set_trace(None)
        t = tr.numpy()
        assert (t[:, : len(names)] > 0).all() and (t[:, len(names):] == 0).all(), half
        arrive, leave = t[:, : len(names), 0], t[:, : len(names), 1]
        assert (leave >= arrive.max(axis=0)).all(), half
        assert (arrive[:, 1:] >= leave[:, :-1]).all(), half


def test_knobs_are_bounded(emu_lib, small_weights):
    """The parameter-block knobs read back what was set and refuse values outside their range,
    naming the knob (bounds from the library's constants where they have one)."""
    cp = _predictor(_engine(small_weights, 2), emu_lib)
    cp.reg_max_m, cp.split_mode, cp.tile, cp.num_passes = emu_lib.REG_MAX_M, 2, 6, 1
    assert (cp.reg_max_m, cp.split_mode, cp.tile, cp.num_passes) == (emu_lib.REG_MAX_M, 2, 6, 1)
    for name, bad in (("reg_max_m", emu_lib.REG_MAX_M + 1), ("split_mode", 3), ("tile", -1), ("num_passes", 0),
                      ("num_passes", emu_lib.PASSES + 1)):
        with pytest.raises(ValueError, match=name):
            setattr(cp, name, bad)
    assert cp.num_passes == 1
