"""The batched codec step against the per-stream and whole-sequence oracles (tiny codec, CPU):
exactness over 600+ frames, bitwise batch / slot / bucket invariance, priming, reset; GPU tests
(graph path == eager path, bucket invariance, fp32 exactness) are marked `gpu`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from test_codec_streaming import TOL, _codes, _make_decoder
from tts_server.codec import StreamingCodecDecoder
from tts_server.codec.batched import BatchedCodecDecoder
from tts_server.codec.offline import decode_full


@pytest.fixture(scope="module")
def dec():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield _make_decoder()
    torch.set_num_threads(threads)


def _run(bd, slot, codes) -> np.ndarray:
    """codes [T, 16] through one slot, alone in each step -> [T * 1920]."""
    return np.concatenate([bd.step([slot], codes[i : i + 1]) for i in range(codes.shape[0])], 1)[0]


def _together(bd, slots, codes) -> np.ndarray:
    """codes [S, T, 16], all streams advancing together -> [S, T * 1920]."""
    return np.concatenate([bd.step(slots, codes[:, i]) for i in range(codes.shape[1])], 1)


def test_exact_against_oracles_over_640_frames(dec):
    n = 640
    c = torch.stack([_codes(n, seed=10), _codes(n, seed=11), _codes(n, seed=12)])  # [3, T, 16]
    bd = BatchedCodecDecoder(dec, 4)
    out = _together(bd, [2, 0, 3], c)
    sd = StreamingCodecDecoder(dec)
    st = sd.new_state()
    oracle = torch.cat([sd.decode(st, c[0, i : i + 1]) for i in range(n)]).numpy()
    errs = [np.abs(out[i] - decode_full(dec, c[i]).numpy()).max() for i in range(3)]
    err_oracle = np.abs(out[0] - oracle).max()
    print(f"\nbatched vs whole-sequence: {max(errs):.2e}, vs streaming oracle: {err_oracle:.2e}")
    assert out.dtype == np.float32 and out.shape == (3, n * 1920)
    assert bd.num_frames(2) == n and bd.num_frames(1) == 0
    assert max(errs) < TOL and err_oracle < TOL
    assert np.abs(out[0] - out[1]).max() > 0.1  # streams differ, so the bound means something


def test_bitwise_batch_slot_and_bucket_invariance(dec):
    n = 90  # past the 72-frame window, so the K/V ring wraps
    a, others = _codes(n, seed=40), torch.stack([_codes(n, seed=41 + i) for i in range(6)])
    bd = BatchedCodecDecoder(dec, 8, buckets=(1, 2, 4, 8))
    alone = _run(bd, 0, a)
    for slot in range(8):
        bd.reset(slot)
    mixed = _together(bd, [5, 1, 7, 2, 0], torch.cat([others[:4], a[None]]))[-1]  # B=5 -> bucket 8
    assert np.array_equal(mixed, alone)
    # join late and leave early: the batch around `a` changes every few frames
    for slot in range(8):
        bd.reset(slot)
    out, live = [], [3]
    for i in range(n):
        extra = [s for s in (6, 4, 1, 0, 2, 5) if (i // 7 + s) % 3]
        slots = extra + live
        cc = torch.cat([others[: len(extra), i], a[i : i + 1]])
        out.append(bd.step(slots, cc)[-1])
    assert np.array_equal(np.concatenate(out), alone)


def test_priming_with_reference_codes(dec):
    ref, new = _codes(150, seed=20), _codes(120, seed=21)
    full = decode_full(dec, torch.cat([ref, new])).numpy()
    bd = BatchedCodecDecoder(dec, 3)
    bd.step([1], new[:1])  # leave stale state in the slot: reset must clear it
    bd.reset(1, ref_codes=ref)
    assert bd.num_frames(1) == 150
    out = _together(bd, [2, 1], torch.stack([_codes(120, seed=22), new]))[1]
    err = np.abs(out - full[150 * 1920 :]).max()
    print(f"\npriming: max abs err {err:.2e}")
    assert err < TOL


def test_snapshot_restores_a_primed_slot_bitwise(dec):
    """A slot restored from another slot's snapshot (taken after priming with reference frames)
    continues with exactly the bytes the primed slot gives, and priming does change them."""
    ref, new = _codes(40, seed=23), _codes(12, seed=24)
    bd = BatchedCodecDecoder(dec, 3)
    bd.reset(0, ref_codes=ref)
    snap = bd.snapshot(0)
    primed = _run(bd, 0, new)
    bd.step([2], new[:1])  # stale state the restore must overwrite
    bd.restore(2, snap)
    assert bd.num_frames(2) == 40
    assert np.array_equal(_run(bd, 2, new), primed)
    bd.reset(1)
    assert not np.array_equal(_run(bd, 1, new), primed)
    assert sum(t.numel() * t.element_size() for t in snap) == bd.slot_state_bytes


def test_reset_gives_fresh_bytes(dec):
    a = _codes(30, seed=60)
    bd = BatchedCodecDecoder(dec, 2)
    first = _run(bd, 1, a)
    bd.reset(1)
    assert np.array_equal(_run(bd, 1, a), first)


def test_corrupted_state_is_detected(dec):
    a = _codes(100, seed=70)
    ref = decode_full(dec, a).numpy()
    bd = BatchedCodecDecoder(dec, 2)
    head = _run(bd, 0, a[:80])
    bd._kc[-1][0] += 0.5 * torch.randn(bd._kc[-1][0].shape, generator=torch.Generator().manual_seed(1))
    tail = _run(bd, 0, a[80:])
    err = np.abs(np.concatenate([head, tail]) - ref).max()
    assert np.abs(head - ref[: 80 * 1920]).max() < TOL
    assert err > 100 * TOL


def test_bad_calls_rejected(dec):
    bd = BatchedCodecDecoder(dec, 2)
    with pytest.raises(ValueError):
        bd.step([0, 0], torch.zeros(2, 16, dtype=torch.long))  # duplicate slot
    with pytest.raises(ValueError):
        bd.step([2], torch.zeros(1, 16, dtype=torch.long))  # out of range
    with pytest.raises(ValueError):
        bd.step([0], torch.zeros(2, 16, dtype=torch.long))  # shape
    with pytest.raises(ValueError):
        BatchedCodecDecoder(dec, 4, buckets=(1, 2))  # largest bucket below max_slots


def test_memory_estimate_covers_state(dec):
    bd = BatchedCodecDecoder(dec, 5)
    est = BatchedCodecDecoder.memory_bytes(dec.config, 5, torch.float32)
    assert bd.buckets == [1, 2, 4, 8]
    assert bd.state_bytes <= est
    assert BatchedCodecDecoder.memory_bytes(dec, 5, torch.float32) == est


# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu_dec(dec):
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    return _make_decoder().cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_graph_equals_eager_and_buckets_are_invariant(gpu_dec, dtype):
    n = 80
    a, others = _codes(n, seed=80), torch.stack([_codes(n, seed=81 + i) for i in range(20)])
    graph = BatchedCodecDecoder(gpu_dec, 32, dtype=dtype)
    eager = BatchedCodecDecoder(gpu_dec, 32, dtype=dtype, use_graphs=False)
    alone = _run(graph, 0, a)
    assert np.array_equal(_run(eager, 9, a), alone)
    for slot in range(32):
        graph.reset(slot)
    mixed = _together(graph, list(range(11, 31)) + [31], torch.cat([others, a[None]]))[-1]  # bucket 32
    assert np.array_equal(mixed, alone)


@pytest.mark.gpu
def test_gpu_fp32_exact(gpu_dec):
    n = 640
    c = _codes(n, seed=90)
    ref = decode_full(gpu_dec, c).cpu().numpy()
    bd = BatchedCodecDecoder(gpu_dec, 2, dtype=torch.float32)
    err = np.abs(_run(bd, 1, c) - ref).max()
    print(f"\nGPU fp32 batched vs whole-sequence: {err:.2e}")
    assert err < TOL


# ------------------------------------------------------------------------------------------------
_INTERPRETED = r"""
import json, sys, numpy as np, torch
import triton.language as tl
import tts_server.codec.triton_kernels as TK

class _Libdevice:  # the interpreter has no libdevice: the tl equivalents, looked up at call time
    sin = staticmethod(lambda x: tl.sin(x)); cos = staticmethod(lambda x: tl.cos(x))
    rsqrt = staticmethod(lambda x: tl.rsqrt(x)); erf = staticmethod(lambda x: tl.erf(x))

TK.libdevice = _Libdevice
sys.path.insert(0, "tests")
from test_codec_streaming import _codes, _make_decoder
from tts_server.codec.batched import BatchedCodecDecoder
from tts_server.codec.offline import decode_full

dec = _make_decoder()
codes = torch.stack([_codes(3, seed=10), _codes(3, seed=11)])  # [2, 3, 16]
ref = [decode_full(dec, codes[i]).numpy() for i in range(2)]
bd = BatchedCodecDecoder(dec, 4)
bd._triton = True  # the Triton kernels (interpreted) instead of the torch references
out = np.concatenate([bd.step([3, 0], codes[:, i]) for i in range(3)], 1)
print(json.dumps([float(np.abs(out[i] - ref[i]).max()) for i in range(2)]))
"""


def test_triton_kernels_interpreted_match_whole_sequence():
    """The GPU path's kernels (GEMM with history, SwiGLU and SnakeBeta epilogues, depthwise conv,
    RoPE attention, norms) run under Triton's CPU interpreter through 3 frames of two streams."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", _INTERPRETED], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    errs = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"\ninterpreted Triton path vs whole-sequence: {errs}")
    assert max(errs) < TOL


_SPLIT_K = r"""
import json, torch
import triton.language as tl
import tts_server.codec.triton_kernels as TK

class _Libdevice:
    sin = staticmethod(lambda x: tl.sin(x)); erf = staticmethod(lambda x: tl.erf(x))

TK.libdevice = _Libdevice
from tts_server.codec import kernels as K

g = torch.Generator().manual_seed(0)
r = lambda *s: torch.randn(*s, generator=g)
res = {}
# a dilated 3-tap conv with every epilogue (one piece); a linear wider than one piece, with the
# SwiGLU input; a 3-tap conv of wide taps, whose pieces cut across taps; a 7-tap conv in pieces of
# whole taps
for name, (b, tout, taps, dil, cin, n, glu, act) in dict(conv=(2, 5, 3, 2, 96, 40, False, 1),
                                                         wide=(3, 1, 1, 1, K.PIECE_COLS + 64, 24, True, 0),
                                                         taps=(2, 4, 3, 3, K.PIECE_COLS + 96, 24, False, 0),
                                                         taps7=(2, 3, 7, 1, 160, 24, False, 0)).items():
    x = r(b, tout + (taps - 1) * dil, 2 * cin if glu else cin)
    w = r(taps * cin, n) * 0.05
    kw = dict(tout=tout, taps=taps, dil=dil, bias=r(n), act=act, scale=r(n), res=r(b * tout, n),
              post=(r(n).exp(), 1 / (r(n).exp() + 1e-9)), post_mod=n, glu=glu)
    outs = []
    for split in (False, True, None):  # None: the torch reference
        o = (torch.empty(b * tout, n), torch.empty(b * tout, n))
        K.gemm(x, w, o[0], out2=o[1], triton_ok=split is not None, split=split, **kw)
        outs.append(o)
    pieces = K._pieces(cin, taps, K.gemm_config(cin, n, tout, torch.float32)[2])[1]
    res[name] = dict(pieces=pieces, bitwise=all(torch.equal(u, v) for u, v in zip(outs[0], outs[1])),
                     err=max(float((u - v).abs().max()) for u, v in zip(outs[1], outs[2])))
print(json.dumps(res))
"""


def test_split_k_gives_the_unsplit_bits_interpreted():
    """A codec GEMM split into its K pieces (a program each, then the ordered sum and the same
    epilogue) gives bit for bit what one program walking every piece gives, and both match the
    torch reference (Triton's CPU interpreter)."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", _SPLIT_K], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    res = json.loads(run.stdout.strip().splitlines()[-1])
    for name, r in res.items():
        assert r["bitwise"], name
        assert r["pieces"] == (1 if name == "conv" else 2 if name in ("wide", "taps7") else 6), (name, r["pieces"])
        assert r["err"] < 1e-4, (name, r["err"])


def test_reset_many_gives_fresh_bytes_and_spares_other_slots(dec):
    a, b = _codes(30, seed=61), _codes(30, seed=62)
    bd = BatchedCodecDecoder(dec, 4)
    first = _run(bd, 1, a)
    _run(bd, 3, a)
    half = _run(bd, 0, b[:15])
    bd.reset_many([3, 1, 2])
    assert bd.num_frames(1) == bd.num_frames(3) == 0 and bd.num_frames(0) == 15
    assert np.array_equal(_run(bd, 1, a), first) and np.array_equal(_run(bd, 3, a), first)
    assert np.array_equal(np.concatenate([half, _run(bd, 0, b[15:])]), _run(BatchedCodecDecoder(dec, 1), 0, b))


def test_launch_on_an_int32_view_then_collect_gives_the_step_bytes(dec):
    """`launch` takes the engine's device view of a frame's codes (int32, inside its wider output
    rows) and `collect` returns what `step` returns from int64 host codes, frame after frame."""
    a, b = _codes(12, seed=71), _codes(12, seed=72)
    ref, new = BatchedCodecDecoder(dec, 4), BatchedCodecDecoder(dec, 4)
    for i in range(12):
        want = ref.step([3, 1], torch.stack([a[i], b[i]]))
        rows = torch.zeros(2, 18, dtype=torch.int32)  # the engine's out: 16 codes, then 2 more columns
        rows[:, :16] = torch.stack([a[i], b[i]])
        rows[:, 16:] = -7
        launched = new.launch([3, 1], rows[:, :16], None)
        assert np.array_equal(new.collect(launched), want)
    with pytest.raises(ValueError, match="codes must be"):
        new.launch([3], torch.zeros(1, 18, dtype=torch.int32))
