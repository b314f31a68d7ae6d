"""The batched frame as two persistent CUDA launches (csrc/batched/): `predict` makes the 15
code-predictor passes and draws of every stream of a step (the frame's codes), `advance` the
talker step after them (28 layers over the paged KV pool, the code-0 draw, the slots' commit),
B = 1..256, batch-invariant (the same bits for a stream whatever shares its step). They replace
`FrameStep.predict`'s and `FrameStep.advance`'s graphs of ~700 and ~250 kernels.

The library is a plain C ABI (csrc/libqwen_batched.so, `make kernel`) loaded with ctypes. Nothing
of csrc/batched/ is retyped here: the parameter block is filled by field name at the offsets the
library reports (qbk_param_*), and the dims and buffer sizes come from qbk_const_*. The same
source built for the CPU (`make -C csrc emu`: tools/simt/simt.h emulates the GPU) has the same ABI
and takes CPU tensors: the CPU tests run the kernel's logic through this class.
"""

from __future__ import annotations

import ctypes
import os
import struct
from pathlib import Path

import torch

from ...model.lm import rope_cos_sin
from .kv_pool import PagedKV
from .params import FrameParams
from .state import (CODE0, DO_SAMPLE, EOS_FROM, N_SAMPLED, N_TRAILING, PENALTY, POS, SUB_DO_SAMPLE, SUB_TEMPERATURE,
                    SUB_TOP_K, SUB_TOP_P, TEMPERATURE, TEXT_STEP, TOP_K, TOP_P, SlotState)

CSRC = Path(__file__).resolve().parents[3] / "csrc"
LIB_NAME = "libqwen_batched.so"
ABI_VERSION = 2  # csrc/batched/abi.cu QBK_ABI_VERSION
DEFAULT_REG_MAX_M = 16  # products of at most this many rows take the register path (a sweep's choice)
TIMEOUT_NS = 2_000_000_000  # a grid-barrier wait longer than this ends the launch with an error


class BatchedKernelLibrary:
    """The loaded library: its parameter fields (name -> (offset, kind)) and constants."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path or os.environ.get("QBK_LIB", CSRC / LIB_NAME))
        lib = ctypes.CDLL(str(self.path))
        try:
            abi = lib.qbk_abi_version()
        except AttributeError as e:
            raise RuntimeError(f"{self.path} is not the batched kernel library ({e})") from None
        if abi != ABI_VERSION:
            raise RuntimeError(f"{self.path} has batched-kernel ABI {abi}, this tts_server needs "
                               f"{ABI_VERSION}: rebuild it (make kernel)")
        lib.qbk_param_name.restype = ctypes.c_char_p
        lib.qbk_param_offset.restype = ctypes.c_longlong
        lib.qbk_const_name.restype = ctypes.c_char_p
        lib.qbk_const_value.restype = ctypes.c_longlong
        lib.qbk_error_string.restype = ctypes.c_char_p
        lib.qbk_grid_size.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        lib.qbk_predict.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        lib.qbk_advance.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        self.lib = lib
        self.fields = {lib.qbk_param_name(i).decode(): (int(lib.qbk_param_offset(i)), chr(lib.qbk_param_kind(i)))
                       for i in range(lib.qbk_param_count())}
        self.consts = {lib.qbk_const_name(i).decode(): int(lib.qbk_const_value(i))
                       for i in range(lib.qbk_const_count())}
        self.params_size = self.consts["sizeof(QbkParams)"]

    def __getattr__(self, name: str) -> int:
        try:
            return self.__dict__["consts"][name]
        except KeyError:
            raise AttributeError(f"the batched kernel library exports no constant {name!r}") from None

    def pack(self, values: dict[str, int | float]) -> ctypes.Array:
        """A QbkParams block with every field set from `values` (all of them, by name)."""
        missing = sorted(set(self.fields) - set(values))
        extra = sorted(set(values) - set(self.fields))
        if missing or extra:
            raise ValueError(f"{self.path}: parameter fields missing {missing}, unknown {extra}")
        buf = ctypes.create_string_buffer(self.params_size)
        for name, (off, kind) in self.fields.items():
            struct.pack_into({"p": "<Q", "i": "<q", "d": "<d"}[kind], buf, off, values[name])
        return buf

    def error_string(self, code: int) -> str:
        return self.lib.qbk_error_string(code).decode()


def check_shapes(p: FrameParams, lib: BatchedKernelLibrary) -> None:
    """The weights are the shapes the library was built for (ValueError naming the difference)."""
    t = p.talker.cfg
    got = (t.hidden_size, t.num_heads, t.num_kv_heads, t.head_dim, t.intermediate_size)
    if got != tuple(getattr(lib, k) for k in ("H", "NH", "NKV", "HD", "I")) or not 1 <= t.num_layers <= lib.TLAYERS:
        raise ValueError(f"the batched kernels are built for talker layers of {lib.H} hidden, {lib.NH}/{lib.NKV} "
                         f"heads of {lib.HD}, {lib.I} intermediate (1..{lib.TLAYERS} layers), got "
                         f"{t.num_layers} layers of {got}")
    c, ids = p.predictor.cfg, p.ids
    got = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
           ids.predictor_vocab_size, ids.vocab_size, ids.num_code_groups)
    want = tuple(getattr(lib, k) for k in ("H", "NH", "NKV", "HD", "I", "VC", "VT", "GROUPS"))
    if got != want:
        raise ValueError(f"the batched kernel is built for the code-predictor shapes {want} (hidden, heads, kv heads, "
                         f"head dim, intermediate, codes, talker vocabulary, groups), got {got}")
    if not 1 <= c.num_layers <= lib.LAYERS:
        raise ValueError(f"the batched kernel takes 1..{lib.LAYERS} code-predictor layers, got {c.num_layers}")
    if p.in_proj is not None:
        raise ValueError("the batched kernel has no talker-to-predictor projection (1.7B models)")
    if p.codec_head.device.type != ("cpu" if lib.EMULATED else "cuda"):
        raise ValueError(f"the {'emulated' if lib.EMULATED else 'CUDA'} batched kernel needs the weights on "
                         f"{'the CPU' if lib.EMULATED else 'a CUDA device'}, got {p.codec_head.device}")


def parts_floats(lib: BatchedKernelLibrary, max_rows: int) -> int:
    """Floats of the product-output buffer: the K / PIECE parts of the widest product (either
    path may leave its pieces to the consumer) for all 2 max_rows rows of the first pass."""
    return lib.PARTS_PER_ROW * 2 * max_rows


def scratch_bytes(max_rows: int, max_positions: int, lib: BatchedKernelLibrary | None = None) -> int:
    """Device bytes a CudaFrame allocates beside the engine (the code-predictor K/V are the
    frame's own cp_k / cp_v, the talker's the engine's pool)."""
    lib = lib or BatchedKernelLibrary()
    r2 = 2 * max_rows
    return (r2 * lib.H * 4 + r2 * 2 * lib.KMAX * 2 + parts_floats(lib, max_rows) * 4 + max_rows * 4
            + lib.SYNC_WORDS * 4 + max_rows * lib.APART_PER_ROW * 4 + 2 * max_positions * lib.HD * 4)


class _Knob:
    """An int64 field of a CudaFrame's parameter block (same name) as an attribute; a value set must
    lie in low..high (high: a number or the name of a library constant)."""

    def __init__(self, low: int, high: int | str, doc: str):
        self.low, self.high, self.__doc__ = low, high, doc

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, cf: "CudaFrame | None", owner=None):
        if cf is None:
            return self
        return struct.unpack_from("<q", cf.buf, cf.lib.fields[self.name][0])[0]

    def __set__(self, cf: "CudaFrame", value: int) -> None:
        high = getattr(cf.lib, self.high) if isinstance(self.high, str) else self.high
        if not self.low <= value <= high:
            raise ValueError(f"{self.name} must be in {self.low}..{high}, got {value}")
        struct.pack_into("<q", cf.buf, cf.lib.fields[self.name][0], value)


class CudaFrame:
    """The frame of a step's rows in two launches on the current stream, no host wait (frame.py's
    buffers and layout):
    - `predict(rows, n, bpad)`: the frame's 16 codes of rows[:n] into frame.out[:n, :16], their
      error bits into out[:n, 17] (rows n..bpad-1 of out get codes 0), with a dump buffer each
      pass's logits into dump[:n, k];
    - `advance(rows, n)`: the talker step after them: out[:n, 16] the next code 0, bit 15 of
      out[:n, 17] its error, dump[:n, 15] the talker's logits, and the slots' state committed
      (position, code 0, draws, text step, history byte, past_hidden, the new K/V in the pool)."""

    def __init__(self, params: FrameParams, state: SlotState, kv: PagedKV, frame, max_positions: int,
                 lib: BatchedKernelLibrary | None = None, reg_max_m: int = DEFAULT_REG_MAX_M):
        self.lib = lib or BatchedKernelLibrary()
        check_shapes(params, self.lib)
        L = self.lib
        out, cp_k, cp_v, dump = frame.out, frame.cp_k, frame.cp_v, frame.dump
        dev = out.device
        self.max_rows = out.shape[0]
        if self.max_rows > L.MAX_ROWS:
            raise ValueError(f"the batched kernel takes at most {L.MAX_ROWS} rows, got {self.max_rows}")
        if not 0 <= reg_max_m <= L.REG_MAX_M:
            raise ValueError(f"reg_max_m must be in 0..{L.REG_MAX_M}")
        assert tuple(cp_k.shape) == (params.predictor.cfg.num_layers, self.max_rows, L.NKV, L.POS, L.HD)
        assert cp_k.dtype == torch.float32 and cp_v.shape == cp_k.shape
        r2 = 2 * self.max_rows
        self.x = torch.empty(r2, L.H, dtype=torch.float32, device=dev)
        self.hs = torch.empty(r2, 2, L.KMAX, dtype=torch.bfloat16, device=dev)
        self.parts = torch.empty(parts_floats(L, self.max_rows), dtype=torch.float32, device=dev)
        self.flags = torch.zeros(self.max_rows, dtype=torch.int32, device=dev)
        self.sync = torch.zeros(L.SYNC_WORDS, dtype=torch.int32, device=dev)
        # the error word after predict (0) and after advance (1), copied behind each launch
        self.err_host = torch.zeros(2, dtype=torch.int32, pin_memory=dev.type == "cuda")
        self.rope = (frame.cp_cos.float().contiguous(), frame.cp_sin.float().contiguous())
        assert tuple(self.rope[0].shape) == (L.POS, L.HD)
        tcfg = params.talker.cfg
        cos, sin = rope_cos_sin(torch.arange(max_positions, device=dev)[None], tcfg, torch.float32)
        self.t_rope = (cos[0].contiguous(), sin[0].contiguous())  # [max_positions, HD]
        self.apart = torch.empty(self.max_rows, L.APART_PER_ROW, dtype=torch.float32, device=dev)
        assert kv.k.is_contiguous() and kv.table.is_contiguous() and kv.k.dtype in (torch.bfloat16, torch.float32)
        if kv.block_size % 16:  # the talker attention's key groups never span a block
            raise ValueError(f"the batched kernel needs a KV block size that is a multiple of 16, got {kv.block_size}")
        blocks = ctypes.c_int(0)
        index = dev.index if dev.index is not None else (torch.cuda.current_device() if dev.type == "cuda" else 0)
        rc = L.lib.qbk_grid_size(index, ctypes.byref(blocks))
        if rc != 0:
            raise RuntimeError(f"batched kernel: no cooperative grid on {dev}: {L.error_string(rc)}")
        self.blocks = blocks.value
        sp, cfg, tp = params.predictor, params.predictor.cfg, params.talker
        ptr = lambda t: t.data_ptr()  # noqa: E731
        v: dict[str, int | float] = {}
        for pre, stack, size in (("", sp, L.LAYERS), ("t_", tp, L.TLAYERS)):
            for name in ("in_norm", "wqkv", "q_norm", "k_norm", "wo", "post_norm", "gate", "up", "down"):
                seq = getattr(stack, name)
                for i in range(size):  # a smaller test model leaves its unused layers null
                    t = seq[i] if i < len(seq) else None
                    assert t is None or (t.is_contiguous() and t.device == dev), name
                    v[f"{pre}{name}[{i}]"] = ptr(t) if t is not None else 0
        for i, t in enumerate(params.predictor_heads):
            assert t.is_contiguous() and t.device == dev
            v[f"head[{i}]"] = ptr(t)
        assert params.predictor_embedding_stack.is_contiguous() and params.codec_embedding.is_contiguous()
        v.update(final_norm=ptr(sp.final_norm), emb=ptr(params.predictor_embedding_stack),
                 codec_emb=ptr(params.codec_embedding), rope_cos=ptr(self.rope[0]), rope_sin=ptr(self.rope[1]),
                 ints=ptr(state.ints), floats=ptr(state.floats), seed=ptr(state.seed),
                 past_hidden=ptr(state.past_hidden), num_slots=state.ints.shape[1],
                 f_code0=CODE0, f_n_sampled=N_SAMPLED, f_do_sample=SUB_DO_SAMPLE, f_top_k=SUB_TOP_K,
                 f_temperature=SUB_TEMPERATURE, f_top_p=SUB_TOP_P, rows=0,
                 out=ptr(out), out_stride=out.stride(0), out_err=out.shape[1] - 1,
                 dump=ptr(dump) if dump is not None else 0, dump_stride=dump.stride(0) if dump is not None else 0,
                 dump_pass=dump.stride(1) if dump is not None else 0,
                 x=ptr(self.x), hs=ptr(self.hs), parts=ptr(self.parts), cpk=ptr(cp_k), cpv=ptr(cp_v),
                 flags=ptr(self.flags), sync=ptr(self.sync), max_rows=self.max_rows, eps=float(cfg.rms_norm_eps),
                 scale=float(cfg.head_dim ** -0.5), timeout_ns=TIMEOUT_NS if dev.type == "cuda" else 10**15,
                 reg_max_m=reg_max_m, split_mode=0, tile=0, num_layers=cfg.num_layers, num_passes=params.num_passes,
                 f_pos=POS, f_text_step=TEXT_STEP, f_n_trailing=N_TRAILING, f_eos_from=EOS_FROM,
                 f_t_do_sample=DO_SAMPLE, f_t_top_k=TOP_K, f_t_temperature=TEMPERATURE, f_t_top_p=TOP_P,
                 f_penalty=PENALTY, seen=ptr(state.seen), trailing=ptr(state.trailing), pad_embed=ptr(state.pad_embed),
                 max_trailing=state.max_trailing, eos=params.ids.eos, suppress_start=params.ids.suppress_start,
                 min_new_tokens=params.ids.min_new_tokens, t_final_norm=ptr(tp.final_norm),
                 codec_head=ptr(params.codec_head), t_rope_cos=ptr(self.t_rope[0]), t_rope_sin=ptr(self.t_rope[1]),
                 t_num_layers=tcfg.num_layers, kv_k=ptr(kv.k), kv_v=ptr(kv.v),
                 kv_fp32=int(kv.k.dtype == torch.float32), kv_blocks=kv.k.shape[1], kv_block_size=kv.block_size,
                 block_table=ptr(kv.table), table_stride=kv.table.stride(0), apart=ptr(self.apart),
                 trace=0, trace_events=0)
        assert state.trailing.dtype == torch.bfloat16 and state.pad_embed.dtype == torch.bfloat16
        assert state.seen.dtype == torch.uint8 and params.codec_head.is_contiguous()
        self.buf = L.pack(v)
        self._rows_off = L.fields["rows"][0]
        self._keep = (params, state, kv, frame)  # the block holds raw pointers into these

    reg_max_m = _Knob(0, "REG_MAX_M", "Products of at most this many rows take the register path (same bits either way).")
    split_mode = _Knob(0, 2, "The shared-memory path's K split: 1 never, 0 (default) and 2 wherever K has several "
                             "pieces (same bits).")
    tile = _Knob(0, 6, "Tuning: the shared-memory path's tile, 0 by M (gemm.cuh's measured rule) or 1..6 one candidate.")
    num_passes = _Knob(1, "PASSES", "Tests and bisection: run only the first passes (codes of later groups are 0).")

    def set_trace(self, trace: torch.Tensor | None) -> None:
        """Profiling: with a [blocks, events, 2] int64 tensor, every later launch writes each grid
        barrier's arrival and exit time (globaltimer ns, per block, barriers in launch order) into
        it, up to `events` barriers; None stops it."""
        if trace is not None:
            assert trace.dtype == torch.int64 and trace.is_contiguous() and trace.device == self.x.device
            assert trace.dim() == 3 and trace.shape[0] == self.blocks and trace.shape[2] == 2
        struct.pack_into("<Q", self.buf, self.lib.fields["trace"][0], trace.data_ptr() if trace is not None else 0)
        struct.pack_into("<q", self.buf, self.lib.fields["trace_events"][0], trace.shape[1] if trace is not None else 0)
        self._trace = trace

    def predict(self, rows: torch.Tensor, n: int, bpad: int | None = None) -> None:
        """rows: int64 tensor (on the kernel's device) whose first n entries are the step's slots."""
        assert rows.dtype == torch.int64 and rows.device == self.x.device and rows.is_contiguous()
        bpad = n if bpad is None else bpad
        struct.pack_into("<Q", self.buf, self._rows_off, rows.data_ptr())
        stream = torch.cuda.current_stream(rows.device).cuda_stream if rows.is_cuda else None
        rc = self.lib.lib.qbk_predict(self.buf, n, bpad, self.blocks, stream)
        if rc != 0:
            raise RuntimeError(f"batched kernel launch failed: {self.lib.error_string(rc)}")
        self.err_host[0:1].copy_(self.sync[self.lib.SYNC_ERR:self.lib.SYNC_ERR + 1], non_blocking=True)

    def advance(self, rows: torch.Tensor, n: int) -> None:
        """The talker step of rows[:n] (after `predict` of the same rows), no host wait. A launch
        error raises; a grid-barrier timeout shows in `check("advance")`."""
        assert rows.dtype == torch.int64 and rows.device == self.x.device and rows.is_contiguous()
        struct.pack_into("<Q", self.buf, self._rows_off, rows.data_ptr())
        stream = torch.cuda.current_stream(rows.device).cuda_stream if rows.is_cuda else None
        rc = self.lib.lib.qbk_advance(self.buf, n, self.blocks, stream)
        if rc != 0:
            raise RuntimeError(f"batched talker kernel launch failed: {self.lib.error_string(rc)}")
        self.err_host[1:2].copy_(self.sync[self.lib.SYNC_ERR:self.lib.SYNC_ERR + 1], non_blocking=True)

    def check(self, half: str | None = None) -> None:
        """Once the launch (`half`: "predict" or "advance"; None: both) is complete on the host's
        side: raise if one of its grid-barrier waits timed out (its results are not valid)."""
        for i, name in enumerate(("predict", "advance")):
            if half in (None, name) and int(self.err_host[i]):
                raise RuntimeError(f"batched {name} kernel: a grid barrier wait exceeded {TIMEOUT_NS / 1e9:.0f} s "
                                   f"(error {int(self.err_host[i])})")


def barrier_phases(half: str, layers: int, passes: int = 15) -> list[str]:
    """The phase that ends at each grid barrier of a `half` ("predict" or "advance") launch, in
    launch order, as predict.cu / advance.cu run them: names for `CudaFrame.set_trace`'s events."""
    if half == "predict":
        layer = ["res2", "qkv", "attn", "o", "res1", "gu", "swiglu", "down"]
        out = []
        for p in range(passes):
            for L in range(layers):
                out += (["init" if p == 0 else "sample"] if L == 0 else ["res2"]) + layer[1:]
            out += ["res2", "head"]
        return out
    layer = ["res2", "qkv", "attn", "combine", "o", "res1", "gu", "swiglu", "down"]
    out = []
    for L in range(layers):
        out += (["input"] if L == 0 else ["res2"]) + layer[1:]
    return out + ["res2", "head"]


def is_available() -> bool:
    """True when CUDA is present and the library is built and loads."""
    if not torch.cuda.is_available():
        return False
    path = Path(os.environ.get("QBK_LIB", CSRC / LIB_NAME))
    if not path.exists():
        return False
    try:
        BatchedKernelLibrary(path)
    except (OSError, RuntimeError):
        return False
    return True
