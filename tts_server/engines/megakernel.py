"""The `megakernel` decode engine: one persistent CUDA launch per frame (csrc/).

The kernel library is a plain C ABI (`csrc/libqwen_megakernel.so`, built with `make -C csrc`)
loaded with ctypes; it takes raw device pointers of torch tensors and launches on torch's
current stream, so it does not depend on the torch C++ ABI. Prefill is batched PyTorch
(`model.lm.lm_forward`) writing straight into the kernel's KV layout; the prefill's code-0
draw runs on the GPU with the same sampling code as the frame kernel.

All per-stream state (KV rows, positions, pending code 0, code-0 history, text track,
sampling settings) lives in device arrays indexed by slot. Nothing of csrc/layout.h is retyped
here: the dims, flags, buffer sizes and struct offsets come from the library (csrc/abi.cu,
`Layout`), after its ABI version matches ABI_VERSION.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..model.weights import DecodeWeights, LMConfig
from .contract import FrameResult, Prompt, SamplingConfig, StepOutput, StepPlan, run_parts

CSRC = Path(__file__).resolve().parents[2] / "csrc"
LIB_NAME = "libqwen_megakernel.so"
ABI_VERSION = 5  # csrc/layout.h QMK_ABI_VERSION that this module is written against


class Layout:
    """csrc/layout.h as the library reports it (csrc/abi.cu): its constants as attributes (L.H,
    L.FLAG_NO_COMMIT, ...), struct sizes and field offsets through size() / fields(), and the
    phase table (ops/schedule.cuh) as (name, talker_only) pairs: a layer's phases, then the head."""

    def __init__(self, values: dict[str, int], phases: list[tuple[str, bool]]):
        self.values, self.phases = values, phases

    def __getattr__(self, name: str) -> int:
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(f"the megakernel library exports no constant {name!r} (csrc/abi.cu)") from None

    def size(self, name: str) -> int:
        """sizeof of a csrc/layout.h struct."""
        return self.values[f"sizeof({name})"]

    def fields(self, name: str) -> dict[str, int]:
        """Field name -> byte offset of a csrc/layout.h struct."""
        return {k.split(".", 1)[1]: v for k, v in self.values.items() if k.startswith(name + ".")}


class QmkState(ctypes.Structure):
    """ctypes mirror of csrc/layout.h QmkState (checked field by field against the library)."""

    _fields_ = [(n, ctypes.c_void_p) for n in (
        "kv_k", "kv_v", "pos", "code0", "n_sampled", "text_step", "n_trailing", "past_hidden",
        "trailing", "pad_embed", "seen", "samp", "out", "x", "qkv", "opart", "act", "logits",
        "part", "cp_k", "cp_v", "sync", "dump")] + [
        ("max_pos", ctypes.c_int32), ("max_trailing", ctypes.c_int32), ("num_slots", ctypes.c_int32),
        ("eos", ctypes.c_int32), ("suppress_start", ctypes.c_int32), ("min_new_tokens", ctypes.c_int32),
        ("eps", ctypes.c_float), ("ll_seq", ctypes.c_uint32), ("timeout_ns", ctypes.c_uint64)]


class QmkSampling(ctypes.Structure):
    """ctypes mirror of csrc/layout.h QmkSampling (qwen-tts names; checked like QmkState)."""

    _fields_ = [("do_sample", ctypes.c_int32), ("top_k", ctypes.c_int32), ("temperature", ctypes.c_float),
                ("top_p", ctypes.c_float), ("repetition_penalty", ctypes.c_float),
                ("sub_do_sample", ctypes.c_int32), ("sub_top_k", ctypes.c_int32),
                ("sub_temperature", ctypes.c_float), ("sub_top_p", ctypes.c_float), ("pad0", ctypes.c_int32),
                ("seed", ctypes.c_uint64)]


def sampling_bytes(s: SamplingConfig) -> bytes:
    """One slot's QmkSampling as bytes."""
    return bytes(QmkSampling(int(s.do_sample), int(s.top_k), s.temperature, s.top_p, s.repetition_penalty,
                             int(s.subtalker_do_sample), int(s.subtalker_top_k), s.subtalker_temperature,
                             s.subtalker_top_p, 0, s.seed & (2**64 - 1)))


class KernelLibrary(ctypes.CDLL):
    """The loaded csrc library; `layout` holds what it reports about csrc/layout.h."""

    layout: Layout


def build_library(force: bool = False) -> Path:
    """Build csrc/libqwen_megakernel.so with nvcc (make -C csrc) if it is missing."""
    lib = CSRC / LIB_NAME
    if force or not lib.exists():
        subprocess.run(["make", "-C", str(CSRC)], check=True, capture_output=True)
    return lib


def read_layout(lib: ctypes.CDLL) -> Layout:
    lib.qmk_layout_name.restype = ctypes.c_char_p
    lib.qmk_layout_value.restype = ctypes.c_int64
    lib.qmk_phase_name.restype = ctypes.c_char_p
    values = {lib.qmk_layout_name(i).decode(): int(lib.qmk_layout_value(i)) for i in range(lib.qmk_layout_count())}
    phases = [(lib.qmk_phase_name(i).decode(), bool(lib.qmk_phase_talker_only(i))) for i in range(lib.qmk_phase_count())]
    return Layout(values, phases)


def check_mirror(layout: Layout, cls: type[ctypes.Structure], path: Path) -> None:
    """A ctypes mirror has the library's fields at the library's offsets, and its size."""
    want = layout.fields(cls.__name__)
    got = {name: getattr(cls, name).offset for name, _ in cls._fields_}
    if got != want or ctypes.sizeof(cls) != layout.size(cls.__name__):
        diff = sorted(set(got.items()) ^ set(want.items()))
        raise RuntimeError(f"{path}: {cls.__name__} differs from megakernel.py's mirror (field, offset: {diff}; "
                           f"size {layout.size(cls.__name__)} vs {ctypes.sizeof(cls)})")


def load_library(path: str | os.PathLike | None = None) -> KernelLibrary:
    """Load the kernel library (default csrc/libqwen_megakernel.so, or $QMK_LIB), check its ABI
    version and struct layouts, and read its layout (lib.layout). Needs no GPU."""
    path = Path(path or os.environ.get("QMK_LIB", CSRC / LIB_NAME))
    lib = KernelLibrary(str(path))
    try:
        abi = lib.qmk_abi_version()
    except AttributeError as e:
        raise RuntimeError(f"{path} is not a megakernel library ({e})") from None
    if abi != ABI_VERSION:
        raise RuntimeError(f"{path} has megakernel ABI {abi}, this tts_server needs ABI {ABI_VERSION}: "
                           "rebuild it (make kernel)")
    lib.qmk_frame.argtypes = [ctypes.POINTER(QmkState), ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_void_p]
    lib.qmk_sample_talker.argtypes = [ctypes.POINTER(QmkState), ctypes.c_int, ctypes.c_void_p]
    lib.qmk_grid_size.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
    lib.qmk_error_string.restype = ctypes.c_char_p
    lib.qmk_status_string.restype = ctypes.c_char_p
    lib.layout = read_layout(lib)
    if lib.layout.ABI_VERSION != abi:
        raise RuntimeError(f"{path}: layout ABI {lib.layout.ABI_VERSION} != qmk_abi_version {abi}")
    for cls in (QmkState, QmkSampling):
        check_mirror(lib.layout, cls, path)
    return lib


def is_available(device: int | None = None) -> bool:
    """True when CUDA is present, the library is built and loads, and the device can hold the
    cooperative grid (>= QMK_MIN_BLOCKS SMs, cooperative launch)."""
    if not torch.cuda.is_available():
        return False
    path = Path(os.environ.get("QMK_LIB", CSRC / LIB_NAME))
    if not path.exists():
        return False
    lib = load_library(path)
    blocks, sms = ctypes.c_int(0), ctypes.c_int(0)
    dev = torch.cuda.current_device() if device is None else device
    return lib.qmk_grid_size(dev, ctypes.byref(blocks), ctypes.byref(sms)) == 0


def inv_freq(cfg: LMConfig) -> torch.Tensor:
    """theta^(-2j/d) in fp32, computed on the CPU exactly as the qwen-tts rotary modules do."""
    d = cfg.head_dim
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))


def check_shapes(w: DecodeWeights, L: Layout) -> None:
    for cfg, layers in ((w.talker.config, L.TALKER_LAYERS), (w.predictor.config, L.CP_LAYERS)):
        got = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
               cfg.intermediate_size)
        want = (layers, L.H, L.NH, L.NKV, L.HD, L.I)
        if got != want:
            raise ValueError(f"megakernel is built for the shapes {want} (layers, hidden, heads, kv heads, "
                             f"head dim, intermediate), got {got}")
    if w.predictor_in_proj is not None:
        raise ValueError("megakernel: predictor input projection (1.7B) not supported")
    if w.ids.vocab_size != L.VT or w.ids.predictor_vocab_size != L.VC or w.ids.num_code_groups != L.GROUPS:
        raise ValueError("megakernel: vocabulary sizes differ from csrc/layout.h")
    if w.codec_head.dtype != torch.bfloat16 or w.codec_head.device.type != "cuda":
        raise ValueError("megakernel needs bf16 weights on a CUDA device")


def grouped_o(o_proj: torch.Tensor, groups: int) -> torch.Tensor:
    """o_proj [H, NH*HD] -> head-group major [groups, H, NH*HD/groups] (groups = kv heads):
    out[g, r, c] = o_proj[r, g * NH*HD/groups + c] (csrc/ops/attn_oproj.cuh: one contiguous slice
    per block)."""
    rows, cols = o_proj.shape
    return o_proj.view(rows, groups, cols // groups).permute(1, 0, 2).contiguous()


def mma_layout(w: torch.Tensor) -> torch.Tensor:
    """A weight matrix [rows, K] (rows % 4 == 0, K % 64 == 0) in the kernel's tensor-core layout
    (csrc/ops/matvec.cuh): 4-row groups, each stored as K/64 chunks of 32 lanes x 8 bf16, lane
    16q + 4r + tq holding row r at columns 64c + 16q + 4tq + {0,1}, 64c + 32 + 16q + 4tq + {0,1},
    64c + 16q + 4tq + {2,3}, 64c + 32 + 16q + 4tq + {2,3} (its mma A fragment). A permutation:
    a block's slice of whole 4-row groups stays one contiguous range."""
    rows, k = w.shape
    if rows % 4 or k % 64:
        raise ValueError(f"mma_layout needs rows % 4 == 0 and K % 64 == 0, got {tuple(w.shape)}")
    # k = 64c + 32j + 16q + 4tq + 2e2 + e  ->  [group, c, q, r, tq, e2, j, e]
    return w.reshape(rows // 4, 4, k // 64, 2, 2, 4, 2, 2).permute(0, 2, 4, 1, 5, 6, 3, 7).contiguous()


# QmkLayer field -> (LayerWeights attribute, a matrix passed in the tensor-core layout).
LAYER_FIELDS = {"in_norm": ("input_norm", False), "q": ("q_proj", True), "k": ("k_proj", True),
                "v": ("v_proj", True), "q_norm": ("q_norm", False), "k_norm": ("k_norm", False),
                "o": ("o_proj", True), "post_norm": ("post_norm", False), "gate": ("gate_proj", True),
                "up": ("up_proj", True), "down": ("down_proj", True)}


def model_table(w: DecodeWeights, L: Layout, keep: list) -> torch.Tensor:
    """csrc/layout.h QmkModel as an int64 host tensor of device pointers, each written at the
    offset the library reports for its field (qmk_frame passes the table to the kernel by value).
    Every matrix is passed in the tensor-core layout (mma_layout: a permuted copy, ~1.05 GB for the
    0.6B model; the nn.Linear tensors stay for the PyTorch prefill), every o_proj head-group major
    first (grouped_o)."""
    table = [0] * (L.size("QmkModel") // 8)
    model, layer = L.fields("QmkModel"), L.fields("QmkLayer")
    if set(layer) != set(LAYER_FIELDS):
        raise RuntimeError(f"QmkLayer fields {sorted(layer)} differ from megakernel.py's {sorted(LAYER_FIELDS)}")

    def p(t: torch.Tensor) -> int:
        t = t.contiguous()
        keep.append(t)
        return t.data_ptr()

    def m(t: torch.Tensor) -> int:
        return p(mma_layout(t.reshape(-1, t.shape[-1])))

    def put(offset: int, ptr: int) -> None:
        table[offset // 8] = ptr

    for stack, lm in (("talker", w.talker), ("cp", w.predictor)):
        for i, lw in enumerate(lm.layers):
            for field, (attr, matrix) in LAYER_FIELDS.items():
                t = getattr(lw, attr)
                t = grouped_o(t, L.NKV) if field == "o" else t
                put(model[stack] + i * L.size("QmkLayer") + layer[field], m(t) if matrix else p(t))
    dev = w.codec_head.device
    put(model["talker_norm"], p(w.talker.final_norm))
    put(model["cp_norm"], p(w.predictor.final_norm))
    put(model["codec_emb"], p(w.codec_embedding))
    put(model["codec_head"], m(w.codec_head))
    for k in range(L.GROUPS - 1):  # arrays of pointers
        put(model["cp_emb"] + 8 * k, p(w.predictor_embeddings[k]))
        put(model["cp_head"] + 8 * k, m(w.predictor_heads[k]))
    put(model["inv_freq_talker"], p(inv_freq(w.talker.config).to(dev)))
    put(model["inv_freq_cp"], p(inv_freq(w.predictor.config).to(dev)))
    if 0 in table:
        raise RuntimeError(f"QmkModel word {table.index(0)} is not filled by megakernel.py (csrc/layout.h changed?)")
    return torch.tensor(table, dtype=torch.int64)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def prefill_fp32(w, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """Talker prefill with fp32 activations over bf16 weights (upcast one layer at a time).
    x [L, H] fp32; k_cache / v_cache [layers, NKV, max_pos, HD] bf16 (one slot). Returns the
    final-normed hidden states [L, H] fp32."""
    cfg = w.config
    n, nh, nkv, hd = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    freqs = torch.arange(n, device=x.device).float()[:, None] * inv_freq(cfg).to(x.device)[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]  # [L, 1, HD]
    eps = cfg.rms_norm_eps
    for i, lw in enumerate(w.layers):
        h = _rms(x, lw.input_norm, eps)
        q = _rope(_rms((h @ lw.q_proj.float().T).view(n, nh, hd), lw.q_norm, eps), cos, sin)
        k = _rope(_rms((h @ lw.k_proj.float().T).view(n, nkv, hd), lw.k_norm, eps), cos, sin)
        v = (h @ lw.v_proj.float().T).view(n, nkv, hd)
        k_cache[i, :, :n] = k.transpose(0, 1).to(k_cache.dtype)
        v_cache[i, :, :n] = v.transpose(0, 1).to(v_cache.dtype)
        att = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                             is_causal=True, scale=hd ** -0.5, enable_gqa=True)
        x = x + att[0].transpose(0, 1).reshape(n, nh * hd) @ lw.o_proj.float().T
        h = _rms(x, lw.post_norm, eps)
        x = x + (F.silu(h @ lw.gate_proj.float().T) * (h @ lw.up_proj.float().T)) @ lw.down_proj.float().T
    return _rms(x, w.final_norm, eps)


class MegakernelEngine:
    """DecodeEngine over the CUDA megakernel (bf16 weights on one GPU, batch 1 per launch).

    precision="fp32" (default): bf16 weights, fp32 activations, accumulation and KV cache: the
    same function as an fp32 run over the bf16 weights (greedy codes match it). precision="bf16":
    activations rounded to bf16 where qwen-tts running in bf16 rounds them, bf16 KV cache.
    kv_dtype overrides the talker KV cache type (bf16 halves its memory and bandwidth)."""

    name = "megakernel"

    def __init__(self, weights: DecodeWeights, max_streams: int = 8, max_positions: int = 4096,
                 max_trailing: int = 1024, timeout_s: float = 2.0, lib_path: str | None = None,
                 dump_logits: bool = False, precision: str = "fp32", kv_dtype: torch.dtype | None = None):
        self.lib = load_library(lib_path)
        L = self.L = self.lib.layout
        check_shapes(weights, L)
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be fp32 or bf16, not {precision!r}")
        self.precision = precision
        kv_dtype = kv_dtype or (torch.float32 if precision == "fp32" else torch.bfloat16)
        if precision == "bf16" and kv_dtype != torch.bfloat16:
            raise ValueError("precision bf16 keeps a bf16 KV cache")
        self.kv_dtype = kv_dtype
        self.base_flags = (L.FLAG_BF16_EXACT if precision == "bf16" else 0) | (
            L.FLAG_KV_FP32 if kv_dtype == torch.float32 else 0)
        self.w = weights
        self.max_streams, self.max_positions, self.max_trailing = max_streams, max_positions, max_trailing
        dev = self.device = weights.codec_head.device
        blocks, sms = ctypes.c_int(0), ctypes.c_int(0)
        err = self.lib.qmk_grid_size(dev.index or 0, ctypes.byref(blocks), ctypes.byref(sms))
        if err:
            raise RuntimeError(f"megakernel grid: {self.lib.qmk_error_string(err).decode()}")
        self.blocks, self.sms = blocks.value, sms.value
        self._keep: list = []
        self.model_host = model_table(weights, L, self._keep)
        bf, i32 = dict(dtype=torch.bfloat16, device=dev), dict(dtype=torch.int32, device=dev)
        f32, i64 = dict(dtype=torch.float32, device=dev), dict(dtype=torch.int64, device=dev)
        s = max_streams
        kv_shape = (s, L.TALKER_LAYERS, L.NKV, max_positions, L.HD)
        kv = dict(dtype=kv_dtype, device=dev)
        self.kv_k, self.kv_v = torch.zeros(kv_shape, **kv), torch.zeros(kv_shape, **kv)
        self.pos, self.code0 = torch.zeros(s, **i32), torch.zeros(s, **i32)
        self.n_sampled, self.text_step = torch.zeros(s, **i32), torch.zeros(s, **i32)
        self.n_trailing = torch.zeros(s, **i32)
        self.past_hidden = torch.zeros(s, L.H, **f32)
        self.trailing = torch.zeros(s, max_trailing, L.H, **bf)
        self.pad_embed = torch.zeros(s, L.H, **bf)
        self.seen = torch.zeros(s, L.VT, dtype=torch.uint8, device=dev)
        self.samp = torch.zeros(s, L.size("QmkSampling"), dtype=torch.uint8, device=dev)
        self.out = torch.zeros(s, L.OUT_WORDS, **i32)
        # instance scratch, flat (LL words, csrc/ops/common.cuh: {fp32 bits, flag} as int64)
        self.x, self.qkv, self.part = (torch.zeros(n, **i64) for n in (L.X_WORDS, L.QKV_WORDS, L.PART_WORDS))
        self.opart, self.act = torch.zeros(L.OPART_FLOATS, **f32), torch.zeros(L.ACT_FLOATS, **f32)
        self.logits = torch.zeros(L.VT, **f32)
        self.cp_k, self.cp_v = torch.zeros(L.CP_KV_FLOATS, **f32), torch.zeros(L.CP_KV_FLOATS, **f32)
        self.sync = torch.zeros(L.SYNC_WORDS, **i32)
        self.dump = torch.zeros(L.GROUPS, L.VT, **f32) if dump_logits else None
        ids = weights.ids
        st = QmkState()
        for name in ("kv_k", "kv_v", "pos", "code0", "n_sampled", "text_step", "n_trailing",
                     "past_hidden", "trailing", "pad_embed", "seen", "samp", "out", "x", "qkv",
                     "opart", "act", "logits", "part", "cp_k", "cp_v", "sync"):
            setattr(st, name, getattr(self, name).data_ptr())
        st.dump = self.dump.data_ptr() if self.dump is not None else None
        st.max_pos, st.max_trailing, st.num_slots = max_positions, max_trailing, s
        st.eos, st.suppress_start, st.min_new_tokens = ids.eos, ids.suppress_start, ids.min_new_tokens
        st.eps = weights.talker.config.rms_norm_eps
        st.timeout_ns = int(timeout_s * 1e9)
        self.state = st
        self.active: dict[int, int] = {}  # slot -> next talker position (host mirror)
        # lm_forward's cache interface over the kernel's KV arrays (same layout).
        self._cache = SimpleNamespace(k=self.kv_k, v=self.kv_v, max_positions=max_positions)

    # -- launches -------------------------------------------------------------------------
    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def _check(self, err: int, what: str) -> None:
        if err:
            raise RuntimeError(f"megakernel {what}: {self.lib.qmk_error_string(err).decode()}")

    def launch(self, slot: int, flags: int = 0) -> None:
        """Queue one frame for `slot` on the current stream (no host sync)."""
        self._check(self.lib.qmk_frame(ctypes.byref(self.state), self.model_host.data_ptr(), slot,
                                       flags | self.base_flags, self.blocks, self._stream()), "launch")

    def kernel_error(self) -> int:
        return int(self.sync[self.L.SYNC_ERR].item())

    # -- DecodeEngine ---------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, slot: int, prompt: Prompt, sampling: SamplingConfig) -> None:
        from ..model.lm import lm_forward

        if not 0 <= slot < self.max_streams:
            raise ValueError(f"slot {slot} out of range")
        length = prompt.embeds.shape[0]
        n_tr = prompt.trailing.shape[0]
        if length >= self.max_positions:
            raise ValueError(f"prompt of {length} positions exceeds {self.max_positions}")
        if n_tr > self.max_trailing:
            raise ValueError(f"{n_tr} pending text vectors exceed {self.max_trailing}")
        if self.precision == "bf16":  # qwen-tts in bf16, written into the kernel's KV rows
            x = prompt.embeds.to(self.device, torch.bfloat16)[None]
            positions = torch.arange(length, device=self.device)[None]
            slots = torch.tensor([slot], device=self.device)
            hidden = lm_forward(self.w.talker, x, self._cache, slots, positions)[0, -1]
            logits = F.linear(hidden, self.w.codec_head).float()
        else:
            x = prompt.embeds.to(self.device, torch.float32)
            hidden = prefill_fp32(self.w.talker, x, self.kv_k[slot], self.kv_v[slot])[-1]
            logits = hidden @ self.w.codec_head.float().T
        self.past_hidden[slot] = hidden.float()
        self.logits.copy_(logits)
        self.trailing[slot, :n_tr] = prompt.trailing.to(self.device, torch.bfloat16)
        self.pad_embed[slot] = prompt.pad_embed.to(self.device, torch.bfloat16)
        self.seen[slot].zero_()
        self.samp[slot] = torch.frombuffer(bytearray(sampling_bytes(sampling)), dtype=torch.uint8).to(self.device)
        ints = torch.tensor([length, 0, 0, n_tr], dtype=torch.int32).to(self.device)
        self.pos[slot], self.n_sampled[slot], self.text_step[slot], self.n_trailing[slot] = ints
        self._check(self.lib.qmk_sample_talker(ctypes.byref(self.state), slot, self._stream()), "sample")
        self.active[slot] = length

    def run(self, plan: StepPlan, on_codes=None) -> StepOutput:  # no early codes (contract)
        """Admissions, then one launch per decoded slot (so a slot's codes never depend on the
        others: batch invariant by construction, but with no weight sharing across slots)."""
        return run_parts(self, plan, [[s] for s in plan.decode])

    @torch.inference_mode()
    def step(self, slots: Sequence[int]) -> list[FrameResult]:
        results = []
        for slot in slots:
            if slot not in self.active:
                raise ValueError(f"slot {slot} is not prefilled")
            if self.active[slot] >= self.max_positions:
                raise RuntimeError("talker context is full")
            self.launch(slot)
            err = self.L.SYNC_ERR
            row = torch.cat((self.out[slot], self.sync[err:err + 1])).cpu().numpy()
            if row[-1]:
                raise RuntimeError(f"megakernel: {self.lib.qmk_status_string(int(row[-1])).decode()}")
            self.active[slot] += 1
            g = self.L.GROUPS  # out: GROUPS codes, the next code 0, next_is_eos
            results.append(FrameResult(slot=slot, codes=row[:g].astype(np.int64), next_is_eos=bool(row[g + 1])))
        return results

    def release(self, slot: int) -> None:
        self.active.pop(slot, None)
