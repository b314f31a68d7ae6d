"""The code predictor's five layers of a pass for one or two streams in one persistent launch
(csrc/small/cp_layers.cu, `libqwen_small.so`, `make kernel`), with the Triton graphs' bits.

At B <= 2 a frame is a chain of ~830 short launches; each code-predictor layer is seven of them
(four products, the attention, two residual + RMSNorm). This kernel runs a pass's first norm and
layers (passes 2..15: one position, one row a stream) in one launch whose products stream their
weights through shared memory ahead of use and hand their outputs to the next product as flagged
words, with no grid barrier (csrc/batched/README.md, "The plan"; BENCHMARKS.md, sessions 37-40).
Its arithmetic is the Triton kernels' (each product piece one mma.sync chain in the same order,
the RMSNorms and the attention written out from their Triton 3.6 PTX), so a stream's codes do not
depend on which path ran. That holds for the Triton version it was written against:
`FrameStep.use_small_kernel` compares the two bitwise at start-up, and the engine serves with the
graphs alone when they differ.

The kernel is built for the 0.6B code predictor's shapes (hidden 1024, 16 q / 8 kv heads of 128,
intermediate 3072, fp16 matrices, the down projection's input scaled by 2^-ops.MLP_SHIFT) and
reads tiled copies of the matrices (`tile`: +157 MB). Its talker variant (`TalkerKernel`, the 0.6B
talker has the same layer shapes) runs the talker's 28 layers of a step of one stream in one
launch, the decode attention over the paged pool included (+0.9 GB of tiled copies; session 45,
H200: a B = 1 frame 2.49 -> 2.31 ms)."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from . import ops, pdl
from .params import StackParams

CSRC = Path(__file__).resolve().parents[3] / "csrc"
LIB_NAME = "libqwen_small.so"
ABI = 6
# rows a launch takes (qsk_max_rows) and serves: one. Inside a frame a pass's five layers took 116 µs
# in the 9-warp kernel against ~121 for the Triton launches at one row, but 136 against ~127 at two
# (H200, session 40: scripts/gpu_small_timeline.py); built for one row (7 consumer warps: no
# register spills) and with the down parts summed where they are made, a B = 1 frame went 2.82 ->
# 2.50 ms (session 41). So steps of one stream run through it (it also makes the pass's first norm,
# another launch less), larger steps through the graphs.
MAX_ROWS = 1
SERVE_ROWS = MAX_ROWS
SHAPE = dict(hidden_size=1024, num_heads=16, num_kv_heads=8, head_dim=128, intermediate_size=3072)
UNIT_COLS = 512  # a tiled unit's columns (csrc/small/common.cuh UC)


def library_path() -> Path:
    return Path(os.environ.get("QSK_LIB", CSRC / LIB_NAME))


def tile(w: torch.Tensor) -> torch.Tensor:
    """[N][K] -> the kernel's tiled copy: [N/16][K/512][16][512], each row's 16-byte chunks at
    chunk ^ (row & 7) (a 16 KB unit is one bulk copy, and ldmatrix reads it without bank
    conflicts)."""
    n, k = w.shape
    t = w.view(n // 16, 16, k // UNIT_COLS, UNIT_COLS).permute(0, 2, 1, 3).reshape(n // 16, k // UNIT_COLS, 16, 64, 8)
    r = torch.arange(16, device=w.device)[:, None]
    j = torch.arange(64, device=w.device)[None, :] ^ (r & 7)
    return t[:, :, r, j, :].contiguous()


class LayerArgs(ctypes.Structure):
    """cp_layers.cu's Layer."""
    _fields_ = [("w", ctypes.c_void_p * 5), ("post", ctypes.c_void_p), ("nxt", ctypes.c_void_p),
                ("qn", ctypes.c_void_p), ("kn", ctypes.c_void_p), ("kpool", ctypes.c_void_p),
                ("vpool", ctypes.c_void_p)]


def _args_type(layers: int, name: str) -> type:
    """cp_layers.cu's ArgsT<layers>."""
    fields = [("L", LayerArgs * layers), ("nl", ctypes.c_int), ("M", ctypes.c_int), ("x0", ctypes.c_void_p),
              ("h0", ctypes.c_void_p), ("nrm0", ctypes.c_void_p), ("cos", ctypes.c_void_p),
              ("sin", ctypes.c_void_p), ("pos", ctypes.c_uint),
              ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("words", ctypes.c_void_p),
              ("sync", ctypes.c_void_p), ("out_h", ctypes.c_void_p), ("timeout_ns", ctypes.c_ulonglong),
              ("smem", ctypes.c_int), ("xbytes", ctypes.c_int),
              ("qkv_g", ctypes.c_void_p), ("att_g", ctypes.c_void_p), ("dbg_o", ctypes.c_void_p),
              ("dbg_inner", ctypes.c_void_p), ("dbg_down", ctypes.c_void_p), ("dbg_r", ctypes.c_void_p),
              ("dbg_h", ctypes.c_void_p), ("t0s", ctypes.c_void_p), ("trace", ctypes.c_void_p),
              ("table", ctypes.c_void_p), ("lens", ctypes.c_void_p), ("ml", ctypes.c_void_p),
              ("accb", ctypes.c_void_p), ("iflags", ctypes.c_void_p), ("msplit", ctypes.c_int),
              ("x_out", ctypes.c_void_p), ("d_out", ctypes.c_void_p)]
    return type(name, (ctypes.Structure,), {"_fields_": fields, "__doc__": f"cp_layers.cu's ArgsT<{layers}>."})


Args = _args_type(8, "Args")  # the code predictor's (qsk_*)
TALKER_LAYERS = 28
TArgs = _args_type(TALKER_LAYERS, "TArgs")  # the talker's (qtk_*)


def tiled_bytes(cfg) -> int:
    """Device bytes of the tiled fp16 copies (SmallKernel.nbytes), for the memory plan."""
    h, q, kv, i = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return cfg.num_layers * ((q + 2 * kv) * h + h * q + 3 * h * i) * 2 + 4 * (1 << 20)  # + words, sync


def load(path: Path | None = None) -> ctypes.CDLL:
    """The library, its ABI checked (OSError / RuntimeError if missing or another version)."""
    lib = ctypes.CDLL(str(path or library_path()))
    if (lib.qsk_abi_version() != ABI or lib.qsk_args_size() != ctypes.sizeof(Args)
            or lib.qtk_args_size() != ctypes.sizeof(TArgs)):
        raise RuntimeError(f"{path or library_path()}: ABI {lib.qsk_abi_version()} (args "
                           f"{lib.qsk_args_size()} B), expected {ABI} ({ctypes.sizeof(Args)} B); rebuild: make kernel")
    from . import tk_gemm  # (Triton)

    graphs = tk_gemm.sub_cols("linear", 4096, 1024, True)
    if lib.qsk_sub_cols() != graphs:  # the sub-pieces are part of every product's bits
        raise RuntimeError(f"{path or library_path()}: built with QSK_SUB={lib.qsk_sub_cols()}, the graphs sum "
                           f"sub-pieces of {graphs} columns (TTS_GEMM_SUB); rebuild: make kernel")
    for pre in ("qsk", "qtk"):
        getattr(lib, f"{pre}_words_len").restype = ctypes.c_longlong
        getattr(lib, f"{pre}_setup").argtypes = [ctypes.c_void_p, ctypes.c_int]
        getattr(lib, f"{pre}_run").argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.qsk_error_string.restype = ctypes.c_char_p
    return lib


def unsupported(sp: StackParams, heads, max_layers: int = 8) -> str | None:
    """Why this code predictor (or, max_layers TALKER_LAYERS, talker) cannot use the kernel (None:
    it can)."""
    cfg = sp.cfg
    for key, want in SHAPE.items():
        if getattr(cfg, key) != want:
            return f"{key} {getattr(cfg, key)} (the kernel is built for {want})"
    if cfg.num_layers > max_layers:
        return f"{cfg.num_layers} layers (at most {max_layers})"
    mats = [*sp.wqkv, *sp.wo, *sp.gate, *sp.up, *sp.down, *heads]
    if any(w.dtype != torch.float16 for w in mats):
        return "matrices not fp16"
    if ops.MLP_SHIFT != 6:
        return f"MLP_SHIFT {ops.MLP_SHIFT} (the kernel scales by 2^-6)"
    return None


def _check(lib: ctypes.CDLL, ret: int, what: str) -> None:
    """A qsk_* / qtk_* return code as an exception."""
    if ret == -1:
        raise ValueError(f"small-batch kernel {what}: arguments out of range")
    if ret == -2:
        raise RuntimeError(f"small-batch kernel {what}: not enough shared memory on this device")
    if ret:
        raise RuntimeError(f"small-batch kernel {what}: {lib.qsk_error_string(-ret).decode()}")


def _grid(lib: ctypes.CDLL, dev: torch.device) -> int:
    """The launch's blocks on `dev`: qsk_grid's (one an SM, a multiple of 4, an SM left to the kernel
    before it), or TTS_SMALL_BLOCKS (A/Bs: a multiple of 4 from 64 to one an SM)."""
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    blocks = int(lib.qsk_grid(sms))
    if blocks < 0:
        raise RuntimeError(f"{sms} multiprocessors: too few for the small-batch kernel (64 at least)")
    want = os.environ.get("TTS_SMALL_BLOCKS", str(blocks))
    if not want.isdigit() or int(want) % 4 or not 64 <= int(want) <= sms:
        raise RuntimeError(f"TTS_SMALL_BLOCKS={want}: a multiple of 4 in 64..{sms // 4 * 4}")
    return int(want)


def _pdl() -> int:
    """Whether a launch now is a programmatic dependent of the kernel before it: inside
    pdl.scope(True) (the frame graphs), unless TTS_SMALL_PDL=0."""
    return int(pdl.active() and os.environ.get("TTS_SMALL_PDL", "1") != "0")


def _tile_layers(sp: StackParams) -> list:
    """Each layer's tiled copies of q|k|v, o_proj, gate, up and down (the Layer struct's w order)."""
    return [[tile(w) for w in (sp.wqkv[i], sp.wo[i], sp.gate[i], sp.up[i], sp.down[i])]
            for i in range(sp.cfg.num_layers)]


def _launch(lib: ctypes.CDLL, run, a, blocks: int, dev: torch.device) -> None:
    """One launch through qsk_run / qtk_run (`run`) on dev's current stream, a programmatic
    dependent where _pdl() says so."""
    with torch.cuda.device(dev):
        stream = torch.cuda.current_stream().cuda_stream
        _check(lib, run(ctypes.byref(a), blocks, ctypes.c_void_p(stream), _pdl()), "launch")


def _fill_layers(base, sp: StackParams, tiled: list, kpools: torch.Tensor, vpools: torch.Tensor) -> None:
    """base.L[i] (the Layer structs) from the stack's tiled matrices, norms and layer i's K / V."""
    n = sp.cfg.num_layers
    for i in range(n):
        L = base.L[i]
        for j, t in enumerate(tiled[i]):
            L.w[j] = t.data_ptr()
        L.post = sp.post_norm[i].data_ptr()
        L.nxt = (sp.in_norm[i + 1] if i + 1 < n else sp.final_norm).data_ptr()
        L.qn, L.kn = sp.q_norm[i].data_ptr(), sp.k_norm[i].data_ptr()
        L.kpool, L.vpool = kpools[i].data_ptr(), vpools[i].data_ptr()


class SmallKernel:
    """The kernel over one code predictor's weights and the frame's code-predictor K/V cache
    (cp_k / cp_v [L][rows][NKV][16][HD] fp32: row m of a launch is row m there)."""

    def __init__(self, sp: StackParams, cp_k: torch.Tensor, cp_v: torch.Tensor, lib: ctypes.CDLL | None = None):
        self.lib = lib or load()
        self.sp, dev = sp, cp_k.device
        cfg = sp.cfg
        self.nl = cfg.num_layers
        self.tiled = _tile_layers(sp)
        self.nbytes = sum(t.numel() * t.element_size() for lw in self.tiled for t in lw)
        self.words = torch.zeros(int(self.lib.qsk_words_len()), dtype=torch.int64, device=dev)
        self.sync = torch.zeros(4, dtype=torch.int32, device=dev)  # error, epoch, blocks done
        self.blocks = _grid(self.lib, dev)
        base = Args(nl=self.nl, eps=cfg.rms_norm_eps, scale=cfg.head_dim ** -0.5, words=self.words.data_ptr(),
                    sync=self.sync.data_ptr(), timeout_ns=2_000_000_000)
        _fill_layers(base, sp, self.tiled, cp_k, cp_v)
        with torch.cuda.device(dev):  # (the kernel's shared-memory attribute is per device)
            _check(self.lib, self.lib.qsk_setup(ctypes.byref(base), self.blocks), "setup")
        self.base = base
        self.cp_k, self.cp_v = cp_k, cp_v

    def args(self, x0: torch.Tensor, h0: torch.Tensor | None, out_h: torch.Tensor, pos: int, cos: torch.Tensor,
             sin: torch.Tensor) -> Args:
        m = x0.shape[0]
        if not 1 <= m <= MAX_ROWS or (h0 is not None and h0.shape[0] != m) or out_h.shape[0] != m:
            raise ValueError(f"small-batch kernel: {m} rows (1..{MAX_ROWS})")
        for t, dt in ((x0, torch.float32), (h0, torch.float16), (out_h, torch.float16), (cos, torch.float32),
                      (sin, torch.float32)):
            if t is not None and (t.dtype != dt or not t.is_contiguous()):
                raise ValueError(f"small-batch kernel: a {t.dtype} input, {dt} contiguous expected")
        if not 1 <= pos < self.cp_k.shape[3]:
            raise ValueError(f"small-batch kernel: position {pos}")
        a = Args.from_buffer_copy(self.base)
        a.M, a.pos = m, pos
        a.x0, a.out_h, a.cos, a.sin = (t.data_ptr() for t in (x0, out_h, cos, sin))
        a.h0, a.nrm0 = (h0.data_ptr(), None) if h0 is not None else (None, self.sp.in_norm[0].data_ptr())
        return a

    def launch(self, a: Args) -> None:
        _launch(self.lib, self.lib.qsk_run, a, self.blocks, self.cp_k.device)

    def __call__(self, x0: torch.Tensor, h0: torch.Tensor | None, out_h: torch.Tensor, pos: int, cos: torch.Tensor,
                 sin: torch.Tensor) -> None:
        """One pass's layers: x0 [M, H] fp32 (the residual entering layer 0) and h0 [M, H] fp16
        (its norm; None: the kernel makes it, with the stack's first norm weights) at position pos
        (the cache holds 0..pos-1; this pass's K/V go to pos) with that position's RoPE rows cos /
        sin [HD] -> out_h [M, H] fp16, the final norm of the last layer."""
        self.launch(self.args(x0, h0, out_h, pos, cos, sin))


def talker_unsupported(sp: StackParams, k: torch.Tensor) -> str | None:
    """Why this talker and KV pool (k [L][pages][NKV][page][HD]) cannot use the kernel's talker
    variant (None: they can)."""
    why = unsupported(sp, (), TALKER_LAYERS)
    if why is None and (k.dtype != torch.bfloat16 or k.shape[3] != 64):
        why = f"a {str(k.dtype).removeprefix('torch.')} KV pool of {k.shape[3]}-position pages (the kernel takes bf16, 64)"
    return why


def talker_bytes(cfg, max_blocks: int) -> int:
    """Device bytes of TalkerKernel: the tiled copies, the words, the splits' outputs and flags."""
    per = cfg.num_layers * max_blocks * (cfg.num_heads * (2 + cfg.head_dim) + cfg.num_kv_heads) * 4
    return tiled_bytes(cfg) + per  # (tiled_bytes' 4 MB for words and sync holds the talker's 3.9 MB of words)


class TalkerKernel:
    """The kernel's talker variant (cp_layers_kernel<true>): the talker's layers for one row in one
    launch, its attention over the paged pool (k / v [L][pages][NKV][64][HD] bf16; a page a split)
    with the Triton graphs' bits (FrameStep.use_talker_kernel checks them at start-up;
    scripts/gpu_talker_layers.py checks and times it); the final norm is glue.add_rms's (fp32 out)
    over (x_out, d_out)."""

    def __init__(self, sp: StackParams, k: torch.Tensor, v: torch.Tensor, max_blocks: int,
                 lib: ctypes.CDLL | None = None):
        self.lib = lib or load()
        self.sp, dev = sp, k.device
        cfg = sp.cfg
        why = talker_unsupported(sp, k)
        if why:
            raise ValueError(f"talker layers kernel: {why}")
        self.nl = cfg.num_layers
        self.tiled = _tile_layers(sp)
        self.words = torch.zeros(int(self.lib.qtk_words_len()), dtype=torch.int64, device=dev)
        self.sync = torch.zeros(4, dtype=torch.int32, device=dev)
        self.msplit = max_blocks
        nh, hd = cfg.num_heads, cfg.head_dim
        self.ml = torch.zeros(self.nl, 2, nh, max_blocks, dtype=torch.float32, device=dev)
        self.accb = torch.zeros(self.nl, nh, max_blocks, hd, dtype=torch.float32, device=dev)
        self.iflags = torch.zeros(self.nl, max_blocks, cfg.num_kv_heads, dtype=torch.int32, device=dev)
        self.x_out = torch.zeros(1, cfg.hidden_size, dtype=torch.float32, device=dev)
        self.d_out = torch.zeros(1, cfg.hidden_size, dtype=torch.float32, device=dev)
        self.blocks = _grid(self.lib, dev)
        base = TArgs(nl=self.nl, M=1, eps=cfg.rms_norm_eps, scale=cfg.head_dim ** -0.5, words=self.words.data_ptr(),
                     sync=self.sync.data_ptr(), timeout_ns=2_000_000_000, nrm0=sp.in_norm[0].data_ptr(),
                     ml=self.ml.data_ptr(), accb=self.accb.data_ptr(), iflags=self.iflags.data_ptr(),
                     msplit=max_blocks, x_out=self.x_out.data_ptr(), d_out=self.d_out.data_ptr())
        _fill_layers(base, sp, self.tiled, k, v)
        with torch.cuda.device(dev):
            _check(self.lib, self.lib.qtk_setup(ctypes.byref(base), self.blocks), "setup")
        self.base = base
        self.k = k

    def args(self, x0: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> TArgs:
        for t, dt in ((x0, torch.float32), (table, torch.int32), (lens, torch.int32), (cos, torch.float32),
                      (sin, torch.float32)):
            if t.dtype != dt or not t.is_contiguous():
                raise ValueError(f"talker layers kernel: a {t.dtype} input, {dt} contiguous expected")
        if x0.shape[0] != 1 or table.numel() < self.msplit:
            raise ValueError("talker layers kernel: one row and a table row of max_blocks pages")
        a = TArgs.from_buffer_copy(self.base)
        a.x0, a.table, a.lens, a.cos, a.sin = (t.data_ptr() for t in (x0, table, lens, cos, sin))
        return a

    def launch(self, a: TArgs) -> None:
        _launch(self.lib, self.lib.qtk_run, a, self.blocks, self.k.device)

    def __call__(self, x0: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The talker's layers for row x0 [1, H] fp32 over its table row [max_blocks] int32 at
        position lens[0] - 1 (lens [1] int32 on the device; its RoPE rows cos / sin [HD]) -> (x_out,
        d_out) [1, H] fp32: the residual entering the last add and the last down product, whose
        glue.add_rms(x_out, d_out[None], final_norm, eps, fp32) is the final-normed hidden."""
        self.launch(self.args(x0, table, lens, cos, sin))
        return self.x_out, self.d_out
