"""The batched frame's code-predictor half as ONE persistent CUDA launch (csrc/batched/): the 15
passes and 15 draws of every stream of a step, B = 1..256, batch-invariant (the same bits for a
stream whatever shares its step). It replaces `FrameStep.predict`'s graph of ~700 kernels; the
talker step (`advance`) stays a graph.

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

from .params import FrameParams
from .state import CODE0, N_SAMPLED, SUB_DO_SAMPLE, SUB_TEMPERATURE, SUB_TOP_K, SUB_TOP_P, SlotState

CSRC = Path(__file__).resolve().parents[3] / "csrc"
LIB_NAME = "libqwen_batched.so"
ABI_VERSION = 1  # csrc/batched/predict.cu QBK_ABI_VERSION
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
    """Floats of the product-output buffer: the register path's K / PIECE parts of the widest
    product for at most REG_MAX_M rows, or one part for all 2 max_rows rows of the first pass."""
    r2 = 2 * max_rows
    return max(lib.PARTS_REG_PER_ROW * min(r2, lib.REG_MAX_M), lib.PARTS_SMEM_PER_ROW * r2)


def scratch_bytes(max_rows: int, lib: BatchedKernelLibrary | None = None) -> int:
    """Device bytes a CudaPredictor allocates beside the engine (the code-predictor K/V are the
    frame's own cp_k / cp_v)."""
    lib = lib or BatchedKernelLibrary()
    r2 = 2 * max_rows
    return (r2 * lib.H * 4 + r2 * 2 * lib.KMAX * 2 + parts_floats(lib, max_rows) * 4 + max_rows * 4
            + lib.SYNC_WORDS * 4)


class CudaPredictor:
    """`predict(rows, n, bpad)`: the frame's 16 codes of rows[:n] into frame.out[:n, :16] and their
    error bits into out[:n, 17] (frame.py's layout; rows n..bpad-1 of out get codes 0), and with
    a dump buffer each pass's logits into dump[:n, k]. Launched on the current stream, no host wait."""

    def __init__(self, params: FrameParams, state: SlotState, out: torch.Tensor, cp_k: torch.Tensor,
                 cp_v: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor, dump: torch.Tensor | None,
                 lib: BatchedKernelLibrary | None = None, reg_max_m: int = DEFAULT_REG_MAX_M):
        self.lib = lib or BatchedKernelLibrary()
        check_shapes(params, self.lib)
        L = self.lib
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
        self.err_host = torch.zeros(1, dtype=torch.int32, pin_memory=dev.type == "cuda")
        self.rope = (rope_cos.float().contiguous(), rope_sin.float().contiguous())
        assert tuple(self.rope[0].shape) == (L.POS, L.HD)
        blocks = ctypes.c_int(0)
        index = dev.index if dev.index is not None else (torch.cuda.current_device() if dev.type == "cuda" else 0)
        rc = L.lib.qbk_grid_size(index, ctypes.byref(blocks))
        if rc != 0:
            raise RuntimeError(f"batched kernel: no cooperative grid on {dev}: {L.error_string(rc)}")
        self.blocks = blocks.value
        sp, cfg = params.predictor, params.predictor.cfg
        ptr = lambda t: t.data_ptr()  # noqa: E731
        v: dict[str, int | float] = {}
        for name, seq in (("in_norm", sp.in_norm), ("wqkv", sp.wqkv), ("q_norm", sp.q_norm), ("k_norm", sp.k_norm),
                          ("wo", sp.wo), ("post_norm", sp.post_norm), ("gate", sp.gate), ("up", sp.up),
                          ("down", sp.down), ("head", params.predictor_heads)):
            for i, t in enumerate(seq):
                assert t.is_contiguous() and t.device == dev, name
                v[f"{name}[{i}]"] = ptr(t)
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
                 reg_max_m=reg_max_m, num_layers=cfg.num_layers, num_passes=params.num_passes)
        for name in ("in_norm", "wqkv", "q_norm", "k_norm", "wo", "post_norm", "gate", "up", "down"):
            for i in range(cfg.num_layers, L.LAYERS):  # a smaller test model's unused layers
                v[f"{name}[{i}]"] = 0
        self.buf = L.pack(v)
        self._rows_off = L.fields["rows"][0]
        self._regm_off = L.fields["reg_max_m"][0]
        self._passes_off = L.fields["num_passes"][0]
        self._keep = (params, state, out, cp_k, cp_v, dump)  # the block holds raw pointers into these

    @property
    def reg_max_m(self) -> int:
        return struct.unpack_from("<q", self.buf, self._regm_off)[0]

    @reg_max_m.setter
    def reg_max_m(self, m: int) -> None:
        if not 0 <= m <= self.lib.REG_MAX_M:
            raise ValueError(f"reg_max_m must be in 0..{self.lib.REG_MAX_M}")
        struct.pack_into("<q", self.buf, self._regm_off, m)

    @property
    def num_passes(self) -> int:
        return struct.unpack_from("<q", self.buf, self._passes_off)[0]

    @num_passes.setter
    def num_passes(self, n: int) -> None:
        """Tests and bisection: run only the first n passes (codes of later groups are 0)."""
        if not 1 <= n <= self.lib.PASSES:
            raise ValueError(f"num_passes must be in 1..{self.lib.PASSES}")
        struct.pack_into("<q", self.buf, self._passes_off, n)

    def predict(self, rows: torch.Tensor, n: int, bpad: int | None = None) -> None:
        """rows: int64 tensor (on the kernel's device) whose first n entries are the step's slots."""
        assert rows.dtype == torch.int64 and rows.device == self.x.device and rows.is_contiguous()
        bpad = n if bpad is None else bpad
        struct.pack_into("<Q", self.buf, self._rows_off, rows.data_ptr())
        stream = torch.cuda.current_stream(rows.device).cuda_stream if rows.is_cuda else None
        rc = self.lib.lib.qbk_predict(self.buf, n, bpad, self.blocks, stream)
        if rc != 0:
            raise RuntimeError(f"batched kernel launch failed: {self.lib.error_string(rc)}")
        self.err_host.copy_(self.sync[self.lib.SYNC_ERR:self.lib.SYNC_ERR + 1], non_blocking=True)

    def check(self) -> None:
        """After the launch is complete (the caller synchronized): raise if a grid wait timed out."""
        if int(self.err_host[0]):
            raise RuntimeError(f"batched kernel: a grid barrier wait exceeded {TIMEOUT_NS / 1e9:.0f} s "
                               f"(error {int(self.err_host[0])})")


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
