"""The talker's decode attention split as one persistent launch (csrc/attn/decode_split.cu,
`libqwen_attn.so`, `make kernel`), with the Triton split kernel's bits.

The Triton split kernel (`tk_attention._attn_split_tc_kernel`) walks K/V at ~2.9-3.5 TB/s on an
H200 whatever its occupancy: its programs are short and keep too few loads in flight. This kernel
runs a few blocks an SM that loop over every used (row, split, kv head) with a cp.async pipeline
across items (BENCHMARKS.md, session 43: B = 16 / 64 / 256 split 13.3 / 42.7 / 150.4 -> 10.1 /
39.5 / 137.9 µs a layer). Its arithmetic is the Triton kernel's (the same mma.sync chains, masks,
exp and reduction orders, written from its Triton 3.6 PTX), so m, l and acc of every split are the
same bits and the merge (`_attn_combine_kernel`) is shared. That holds for the Triton version it
was written against: `BatchedEngine` checks the two bitwise at start-up (`check`) and serves with
Triton alone where they differ. On by default; TTS_ATTN_KERNEL=0 turns it off. In the engine's
frames (H200, session 44; launched with PDL inside pdl.scope as the Triton kernels are): B = 16 /
64 / 128 / 256 3.81 / 4.56 / 6.39 / 10.28 -> 3.74 / 4.51 / 6.21 / 10.02 ms; with K / V read under an L2
evict_first policy (session 45) 3.72 / 4.44 / 6.08 / 9.97 ms.

Shapes: bf16 pools of 64-position pages with one page a split, 8 kv heads of 128 and 2 query heads a
kv head (the 0.6B and 1.7B talkers), fp32 q, 1..256 rows."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from . import pdl

CSRC = Path(__file__).resolve().parents[3] / "csrc"
LIB_NAME = "libqwen_attn.so"
ABI = 2
MAX_ROWS, NKV, G, HD, PAGE = 256, 8, 2, 128, 64
# the smallest step it serves: measured faster from B = 16 (the smallest B timed); below, Triton
MIN_ROWS = 16


def library_path() -> Path:
    return Path(os.environ.get("QDA_LIB", CSRC / LIB_NAME))


def load(path: Path | None = None) -> ctypes.CDLL:
    """The library, its ABI checked; OSError / RuntimeError with what to do."""
    lib = ctypes.CDLL(str(path or library_path()))
    if lib.qda_abi_version() != ABI:
        raise RuntimeError(f"{LIB_NAME}: ABI {lib.qda_abi_version()}, expected {ABI}; rebuild: make kernel")
    lib.qda_grid.argtypes = [ctypes.POINTER(ctypes.c_int)]
    lib.qda_split.argtypes = ([ctypes.c_void_p] * 8 + [ctypes.c_float] + [ctypes.c_int] * 4
                             + [ctypes.c_void_p, ctypes.c_int])
    return lib


def unsupported(num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype, block_size: int) -> str | None:
    """Why the kernel cannot serve these talker shapes, or None."""
    if kv_dtype != torch.bfloat16:
        return f"{kv_dtype} KV (bf16 only)"
    if (num_kv_heads, head_dim) != (NKV, HD) or num_heads != G * num_kv_heads:
        return f"{num_heads} / {num_kv_heads} heads of {head_dim} ({G * NKV} / {NKV} of {HD} only)"
    if block_size != PAGE:
        return f"KV pages of {block_size} positions ({PAGE} only)"
    return None


class DecodeSplit:
    """The split on one device: m, l, acc of every used split, as _attn_split_tc_kernel writes them."""

    def __init__(self, device: torch.device, lib: ctypes.CDLL | None = None):
        self.lib = lib or load()
        device = torch.device(device)
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        out = (ctypes.c_int * 4)()
        with torch.cuda.device(self.device):
            self._check(self.lib.qda_grid(out), "grid")
        if out[0] < 1:
            raise RuntimeError(f"{LIB_NAME}: no block fits an SM")
        self.blocks_per_sm, self.sms, self.registers, self.spill_bytes = out[0], out[1], out[2], out[3]
        self.grid = out[0] * out[1]

    @staticmethod
    def _check(err: int, what: str) -> None:
        if err:
            raise RuntimeError(f"{LIB_NAME}: {what} failed (cudaError {err})")

    def serves(self, q: torch.Tensor, k_pool: torch.Tensor, pages_per_split: int) -> bool:
        """Whether this call is one the kernel takes (else the caller runs Triton)."""
        b, nh, hd = q.shape
        return (q.device == self.device and MIN_ROWS <= b <= MAX_ROWS and k_pool.dtype == torch.bfloat16
                and tuple(k_pool.shape[1:]) == (NKV, PAGE, HD) and nh == G * NKV and hd == HD and pages_per_split == 1)

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                 lens: torch.Tensor, m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, scale: float) -> None:
        """q [B, 16, 128] fp32, pools [N, 8, 64, 128] bf16, table [B, MAX_BLOCKS] int32, lens [B] int32
        (all contiguous) -> m, l [B, 16, NSPLIT], acc [B, 16, NSPLIT, 128] fp32 at the used splits, on
        the current stream (graph-capturable), with PDL inside pdl.scope(True) as the Triton kernels."""
        b, max_blocks, nsplit = q.shape[0], table.shape[1], m.shape[2]
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._check(self.lib.qda_split(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), table.data_ptr(),
                                       lens.data_ptr(), m.data_ptr(), l.data_ptr(), acc.data_ptr(), float(scale),
                                       b, max_blocks, nsplit, self.grid, ctypes.c_void_p(stream), int(pdl.active())),
                    "launch")


def check(kernel: DecodeSplit, seed: int = 5) -> str | None:
    """None if the kernel gives the Triton split kernel's m, l and acc bitwise on this device
    (steps of 16, 64 and 256 rows; lengths that end inside a page, on its edge and past many pages;
    pages shuffled, pool slots past each row's end NaN); else what differs."""
    from . import tk_attention as ta

    dev = kernel.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    max_blocks = 64
    for b in (MIN_ROWS, 64, MAX_ROWS):
        edges = [1, 63, 64, 65, 500, 4096][: b // 16]
        lengths = edges + torch.randint(1, 700, (b - len(edges),), generator=gen, device=dev).tolist()
        need = [-(-n // PAGE) for n in lengths]
        pool_pages = sum(need) + 1
        kp = torch.randn(pool_pages, NKV, PAGE, HD, device=dev, generator=gen).bfloat16()
        vp = torch.randn(pool_pages, NKV, PAGE, HD, device=dev, generator=gen).bfloat16()
        perm = torch.randperm(pool_pages - 1, device=dev, generator=gen) + 1
        table = torch.zeros(b, max_blocks, dtype=torch.int32, device=dev)
        at = 0
        for i, (n, k) in enumerate(zip(lengths, need)):
            table[i, :k] = perm[at:at + k].int()
            last, used = int(perm[at + k - 1]), n - (k - 1) * PAGE
            kp[last, :, used:] = float("nan")  # past the row's end: read as zeros or the bits show it
            vp[last, :, used:] = float("nan")
            at += k
        q = torch.randn(b, G * NKV, HD, device=dev, generator=gen)
        lens = torch.tensor(lengths, dtype=torch.int32, device=dev)
        if not kernel.serves(q, kp, ta.split_geometry(kp, max_blocks)[0]):
            return f"it does not take a {b}-row step here"
        outs = []
        for use in (None, kernel):
            m = torch.full((b, G * NKV, max_blocks), float("nan"), device=dev)
            l = torch.full_like(m, float("nan"))
            acc = torch.full((b, G * NKV, max_blocks, HD), float("nan"), device=dev)
            ta.split_into(q, kp, vp, table, lens, m, l, acc, 0.088, cuda=use)
            outs.append((m, l, acc))
        torch.cuda.synchronize(dev)
        for name, x, y in zip(("m", "l", "acc"), outs[0], outs[1]):
            same = x.view(torch.int32) == y.view(torch.int32)
            if not bool(same.all()):
                return f"its {name} differs from Triton's at {b} rows ({int((~same).sum())} of {same.numel()} values)"
    return None
