"""The `batched` decode engine: every slot of a step advances together in ONE CUDA-graph replay of
batch-invariant kernels (graphs per batch bucket), with ONE host copy of all results per step.
Talker KV is paged (bf16 by default); a step's admissions prefill together, every prompt token a
row of the same batch-invariant ops, through CUDA graphs of row-count buckets (prefill.py)."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import numpy as np
import torch

from ...model.weights import DecodeWeights
from ..contract import Admission, FrameResult, Prompt, SamplingConfig, StepOutput, StepPlan
from . import ops, small_kernel
from .cuda_frame import CudaFrame
from .cuda_frame import scratch_bytes as cuda_frame_scratch_bytes
from .frame import TALKER_BAD_BIT, FrameStep
from .graphs import StepGraphs, bucket_for, bucket_sizes
from .kv_pool import PagedKV
from .params import fused_bytes, prepare
from .params import gemm_dtype as default_gemm_dtype
from .prefill import PrefillGraphs, RowPrefillGraphs, capture, prefill, prefill_rows_fp32_attention, shared_rows
from .prefill_rows import prefill_rows
from .state import CODE0, DO_SAMPLE, N_SAMPLED, PENALTY, TEMPERATURE, TOP_K, TOP_P, SlotState
from .state import to_device as _to_device

FRAME_KERNELS = ("triton", "cuda-predict", "cuda")
# A step's prompts with the same leading rows (one voice and language: role + codec prefix, 8-9
# rows of a ~30-row English prompt) compute those rows' K/V once (prefill.shared_rows); the bits
# are the same either way (tests/test_shared_prefix.py). TTS_SHARE_PREFIX=0 turns it off (A/Bs).
SHARE_PREFIX = os.environ.get("TTS_SHARE_PREFIX", "1") != "0"
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)  # prompt lengths with a captured prefill graph
DEFAULT_AVG_POSITIONS = 1024  # default pool: max_streams x this many positions (or max_positions)
ROW_BUCKETS = (32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)  # prompt rows of a graph-captured prefill (steps of <= 1.5x: less padding)
# the prefill graphs' pool (activations and fp32 attention scratch of the largest bucket): measured
# on the H100 with the 0.6B shapes, 4.39 GiB for 4096 rows
ROW_GRAPH_BYTES_PER_ROW = int(1.1 * 2**20)


def row_buckets(max_streams: int) -> list[int]:
    return [n for n in ROW_BUCKETS if n <= max(ROW_BUCKETS[0], max_streams * 64)]
# graph workspaces (one shared pool for all buckets) grow with the largest bucket: measured on the
# H100 with the 0.6B shapes, 118 MiB for 256 rows and 30 MiB for 64 (~0.48 MiB per row)
GRAPH_BYTES_PER_ROW = 512 * 1024


def default_num_blocks(max_streams: int, max_positions: int, block_size: int) -> int:
    avg = min(max_positions, DEFAULT_AVG_POSITIONS)
    return max_streams * math.ceil(avg / block_size) + 1  # + the scratch block 0


def frame_error(flags: int) -> str | None:
    """The out buffer's error bitmask -> the slot's error, as TorchEngine words it."""
    if flags & ((1 << TALKER_BAD_BIT) - 1):
        k = (flags & -flags).bit_length()  # lowest bad group, 1-based
        return f"non-finite code-predictor logits (code group {k})"
    if flags >> TALKER_BAD_BIT & 1:
        return "non-finite talker logits"
    return None


class BatchedEngine:
    """DecodeEngine advancing B = 1..max_streams slots per graph replay (CPU: eager, no graphs).

    kv_dtype: talker KV type (bf16 default; fp32 is the reference mode). num_blocks: KV pool size
    in blocks of block_size positions (default: max_streams x min(max_positions, 1024) positions).
    dump_logits: keep every step's raw logits in `frame.dump` [rows, 16, V] (tests, evidence).
    fused_cp: code-predictor passes 2..15 fuse norm + RoPE + store + attention (tk_glue.py).
    prefill_graphs: prompts up to 512 positions prefill one at a time through CUDA graphs of
    length buckets; off (the default), every step's admissions prefill together as rows of the
    batch-invariant ops (prefill_rows.py), so many arrivals cost one pass over the weights.
    frame_kernel: "triton" (default): both halves of the frame are graphs of Triton kernels;
    "cuda-predict": the code-predictor half is one persistent CUDA launch (cuda_frame.py,
    csrc/batched/), the talker step a graph; "cuda": both halves are CUDA launches (no frame graphs
    to capture). The CUDA kernels are checked on the CPU emulator (tests/test_batched_kernel.py)
    and, on an H100, batch-invariant but slower than the graphs at every B (BENCHMARKS.md, session
    15), hence not the default. Each choice is batch-invariant; they give different bits. gemm_dtype: the GEMM matrices' dtype (params.gemm_dtype: fp16 on CUDA
    with the Triton frame by default, held to issue 16's accuracy bar; bf16, two activation terms,
    gives an fp32 reference's greedy codes)."""

    name = "batched"

    def __init__(self, weights: DecodeWeights, max_streams: int = 8, max_positions: int = 4096,
                 num_blocks: int | None = None, block_size: int = 64, kv_dtype: torch.dtype = torch.bfloat16,
                 max_trailing: int = 1024, dump_logits: bool = False, use_graphs: bool | None = None,
                 fused_cp: bool = True, prefill_graphs: bool = False, frame_kernel: str = "triton",
                 gemm_dtype: torch.dtype | None = None):
        if max_streams < 1 or max_positions < 2:
            raise ValueError("max_streams >= 1 and max_positions >= 2 required")
        if frame_kernel not in FRAME_KERNELS:
            raise ValueError(f"frame_kernel must be one of {', '.join(FRAME_KERNELS)}, got {frame_kernel!r}")
        if gemm_dtype is not None and gemm_dtype != torch.bfloat16 and frame_kernel != "triton":
            raise ValueError(f"frame_kernel {frame_kernel!r} reads bf16 GEMM matrices only")
        self.gemm_dtype = gemm_dtype or default_gemm_dtype(weights.codec_head.device, frame_kernel)
        self.p = prepare(weights, dtype=self.gemm_dtype)
        dev = self.device = self.p.codec_head.device
        cfg = self.p.talker.cfg
        self.max_streams, self.max_positions, self.kv_dtype = max_streams, max_positions, kv_dtype
        num_blocks = num_blocks or default_num_blocks(max_streams, max_positions, block_size)
        self.state = SlotState(max_streams, cfg.hidden_size, self.p.ids.vocab_size, max_trailing, dev)
        self.kv = PagedKV(cfg, max_streams + 1, max_positions, num_blocks, block_size, kv_dtype, dev)
        self.sizes = bucket_sizes(max_streams)
        self.frame = FrameStep(self.p, self.state, self.kv, self.sizes[-1], dump_logits, fused_cp)
        self.frame_kernel = frame_kernel
        self.cuda = (CudaFrame(self.p, self.state, self.kv, self.frame, max_positions)
                     if frame_kernel != "triton" else None)
        self.cuda_predict, self.cuda_advance = frame_kernel != "triton", frame_kernel == "cuda"
        # passes 2..15 of steps of one stream in one launch each where it gives the graphs' bits
        # ("on"), else why not ("off: ..."); TTS_SMALL_KERNEL=0 turns it off
        self.small_kernel = (self._small_kernel() if dev.type == "cuda" and frame_kernel == "triton" and fused_cp
                             else "off: not the Triton frame on a GPU")
        # the talker's layers of steps of one stream in one launch (the same kernel's talker variant)
        # where it gives the graphs' bits ("on"), else why not; TTS_TALKER_KERNEL=0 turns it off
        self.talker_kernel = (self._talker_kernel() if dev.type == "cuda" and frame_kernel == "triton"
                              else "off: not the Triton frame on a GPU")
        # the talker's decode attention split through the persistent CUDA kernel (attn_kernel.py) where
        # it gives the Triton kernel's bits on this device ("on"), else why not; TTS_ATTN_KERNEL=0 turns it
        # off. Before any graph capture: the graphs record the kernel paged_attention picks.
        self.attn_kernel = (self._attn_kernel(dev, kv_dtype) if dev.type == "cuda" and frame_kernel == "triton"
                            else "off: not the Triton frame on a GPU")
        pin = dev.type == "cuda"
        self.rows_host = torch.zeros(self.sizes[-1], dtype=torch.int64, pin_memory=pin)
        self.out_host = torch.zeros(self.frame.out.shape, dtype=torch.int32, pin_memory=pin)
        self.codes_host = torch.zeros(self.frame.out.shape, dtype=torch.int32, pin_memory=pin)  # predict's copy
        self._codes_ready = torch.cuda.Event() if dev.type == "cuda" else None
        self._predicted = torch.cuda.Event() if dev.type == "cuda" else None  # the frame's codes on the device
        self.finite_host = torch.zeros(max_streams, dtype=torch.bool, pin_memory=pin)  # admissions' first draws
        self._ev_admit = ([torch.cuda.Event(enable_timing=True) for _ in range(2)] if dev.type == "cuda" else None)
        self._one = torch.ones((), dtype=torch.uint8, device=dev)
        self.positions: dict[int, int] = {}  # active slot -> next talker position (host mirror)
        self.n_trailing: dict[int, int] = {}  # active slot -> text-track length (host mirror)
        use_graphs = dev.type == "cuda" if use_graphs is None else use_graphs
        self.rows_dev = torch.full((self.sizes[-1],), self.state.scratch, dtype=torch.int64, device=dev)
        self.graphs = (StepGraphs(self.frame, self.sizes, self.state.scratch, predict=not self.cuda_predict,
                                  rows=self.rows_dev)
                       if use_graphs and not self.cuda_advance else None)
        self.capture_s = self.graphs.capture_s if self.graphs else 0.0
        self.graph_memory_bytes = self.graphs.memory_bytes if self.graphs else 0
        self.prefill_graphs, self.prefill_graph_error = None, None
        if use_graphs and prefill_graphs:
            sizes = [n for n in PREFILL_BUCKETS if n < max_positions]
            before = torch.cuda.memory_reserved(dev)
            try:
                self.prefill_graphs = PrefillGraphs(self.p.talker, self.kv.k, self.kv.v, sizes) if sizes else None
            except RuntimeError as e:  # eager prefill still works; say why
                self.prefill_graph_error = str(e)
            torch.cuda.synchronize(dev)
            self.graph_memory_bytes += torch.cuda.memory_reserved(dev) - before
        self.row_graphs = None
        self.draw_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if dev.type == "cuda":
            # every GEMM tile of every row-count bucket (every matrix is in the engine's GEMM dtype)
            ops.warm_up(dev, (self.gemm_dtype,))
            self._warm_admissions()  # eager admission kernels compiled for every row count
            if use_graphs:
                before = torch.cuda.memory_reserved(dev)
                t0 = time.perf_counter()
                self._capture_draws()
                self.capture_s += time.perf_counter() - t0
                self.graph_memory_bytes += torch.cuda.memory_reserved(dev) - before
            if use_graphs and kv_dtype != torch.float32 and self.prefill_graphs is None:
                before = torch.cuda.memory_reserved(dev)
                t0 = time.perf_counter()
                self.row_graphs = RowPrefillGraphs(self.p.talker, self.kv, row_buckets(max_streams), max_streams)
                torch.cuda.synchronize(dev)
                self.capture_s += time.perf_counter() - t0
                self.graph_memory_bytes += torch.cuda.memory_reserved(dev) - before

    @staticmethod
    def _kernel_off(switch: str, unsupported: str | None, path: Path) -> str | None:
        """Why a hand-written kernel stays off before it is loaded: its switch set to 0, shapes it
        does not take (`unsupported`), its library not built; None: load and check it."""
        if os.environ.get(switch, "1") == "0":
            return f"off: {switch}=0"
        if unsupported:
            return f"off: {unsupported}"
        if not path.exists():
            return f"off: {path} not built (make kernel)"
        return None

    def _small_kernel(self) -> str:
        """The small-batch kernel (small_kernel.py) into the frame if it can serve here: "on", or
        "off: <why>"."""
        why = small_kernel.unsupported(self.p.predictor, self.p.predictor_heads)
        off = self._kernel_off("TTS_SMALL_KERNEL", why, small_kernel.library_path())
        if off:
            return off
        try:
            kernel = small_kernel.SmallKernel(self.p.predictor, self.frame.cp_k, self.frame.cp_v)
        except (OSError, RuntimeError, ValueError) as e:
            return f"off: {e}"
        why = self.frame.use_small_kernel(kernel)
        return "on" if why is None else f"off: {why}"

    def _talker_kernel(self) -> str:
        """The small-batch kernel's talker variant (small_kernel.TalkerKernel) into the frame if it
        can serve here: "on", or "off: <why>"."""
        why = small_kernel.talker_unsupported(self.p.talker, self.kv.k)
        off = self._kernel_off("TTS_TALKER_KERNEL", why, small_kernel.library_path())
        if off:
            return off
        try:
            kernel = small_kernel.TalkerKernel(self.p.talker, self.kv.k, self.kv.v, self.kv.max_blocks)
        except (OSError, RuntimeError, ValueError) as e:
            return f"off: {e}"
        why = self.frame.use_talker_kernel(kernel)
        return "on" if why is None else f"off: {why}"

    def _attn_kernel(self, dev: torch.device, kv_dtype: torch.dtype) -> str:
        """The persistent decode attention split (attn_kernel.py) for this device's paged_attention
        calls if it gives the Triton split's bits here: "on", or "off: <why>" (and the device's
        entry in tk_attention.CUDA_SPLIT removed)."""
        from . import attn_kernel, tk_attention

        tk_attention.CUDA_SPLIT.pop(dev.index, None)
        cfg = self.p.talker.cfg
        why = attn_kernel.unsupported(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, kv_dtype, self.kv.block_size)
        off = self._kernel_off("TTS_ATTN_KERNEL", why, attn_kernel.library_path())
        if off:
            return off
        try:
            kernel = attn_kernel.DecodeSplit(dev)
            why = attn_kernel.check(kernel)
        except (OSError, RuntimeError) as e:
            return f"off: {e}"
        finally:  # the check's pools and outputs (~0.7 GB at 256 rows) back to the device, not kept cached
            torch.cuda.empty_cache()
        if why:
            return f"off: {why}"
        tk_attention.CUDA_SPLIT[dev.index] = kernel
        return "on"

    @staticmethod
    def memory_bytes(max_streams: int, max_positions: int, weights: DecodeWeights,
                     kv_dtype: torch.dtype = torch.bfloat16, num_blocks: int | None = None,
                     block_size: int = 64, max_trailing: int = 1024, graphs: bool = True,
                     frame_kernel: str = "triton") -> int:
        """Device bytes the engine allocates beside the model's weights: KV pool, slot state,
        code-predictor scratch, fused q|k|v copies and (graphs) an estimate of the graph
        workspaces (GRAPH_BYTES_PER_ROW x the largest bucket, ROW_GRAPH_BYTES_PER_ROW x the
        largest prefill row bucket; `graph_memory_bytes` after construction is the measured value)."""
        t, c, ids = weights.talker.config, weights.predictor.config, weights.ids
        num_blocks = num_blocks or default_num_blocks(max_streams, max_positions, block_size)
        rows = bucket_sizes(max_streams)[-1]
        table = (max_streams + 1) * math.ceil(max_positions / block_size) * 4
        rope = 2 * math.ceil(max_positions / block_size) * block_size * t.head_dim * 4  # FrameStep.rope
        return (PagedKV.nbytes(t, num_blocks, block_size, kv_dtype) + table + rope
                + SlotState.nbytes(max_streams, t.hidden_size, ids.vocab_size, max_trailing)
                + FrameStep.scratch_bytes(c.num_layers, c.num_kv_heads, c.head_dim, ids.num_code_groups, rows,
                                          # the draws' noise rows: where they run as Triton kernels
                                          max(ids.vocab_size, ids.predictor_vocab_size)
                                          if ops.draws_in_triton(weights.codec_head) else 0)
                + fused_bytes(weights, default_gemm_dtype(weights.codec_head.device, frame_kernel))
                + (small_kernel.tiled_bytes(c) + small_kernel.talker_bytes(t, math.ceil(max_positions / block_size))
                   if frame_kernel == "triton" and weights.codec_head.is_cuda else 0)
                + (GRAPH_BYTES_PER_ROW * rows if graphs and frame_kernel != "cuda" else 0)
                + (ROW_GRAPH_BYTES_PER_ROW * max(row_buckets(max_streams))
                   if graphs and kv_dtype != torch.float32 else 0)
                + (cuda_frame_scratch_bytes(rows, max_positions) if frame_kernel != "triton" else 0))

    # -- DecodeEngine ---------------------------------------------------------------------
    launches_codes = True  # run() takes on_launch (the contract)

    @torch.inference_mode()
    def run(self, plan: StepPlan, on_codes=None, on_launch=None) -> StepOutput:
        """Admissions (all of the plan's prompts in one batched prefill, unless prefill_graphs
        is on), then one frame for every slot of plan.decode. on_codes (see the contract) gets
        the frames' codes while the talker step that ends the frame still runs on the device;
        on_launch, the device view of those codes as soon as their frame is launched."""
        out = StepOutput()
        t0 = time.perf_counter()
        ready = []
        for adm in plan.admit:
            try:
                if self.prefill_graphs is not None:
                    self._admit(adm)
                else:
                    self._reserve(adm)
                    ready.append(adm)
            except (ValueError, RuntimeError) as e:
                if "CUDA" in str(e):
                    raise
                self.release(adm.slot)
                out.failed[adm.slot] = str(e)
        # the admissions are launched, not waited for: their first frame's launches queue behind
        # them, and their finiteness is read once the frame's codes are on the host
        gpu = self.device.type == "cuda"
        if ready:
            if gpu:
                self._ev_admit[0].record()
            finite = self._admit_rows(ready)
            self.finite_host[:len(ready)].copy_(finite, non_blocking=True)
            if gpu:
                self._ev_admit[1].record()
        t1 = time.perf_counter()
        checked = []

        def check_admissions() -> None:
            """Once the stream has passed the first draws: failed admissions into out.failed."""
            if checked:
                return
            checked.append(True)
            for adm, ok in zip(ready, self.finite_host[:len(ready)].tolist()):
                if not ok:
                    out.failed[adm.slot] = "non-finite talker logits after prefill"
            # the admissions' device time (the device was idle when they were launched)
            out.prefill_s = (self._ev_admit[0].elapsed_time(self._ev_admit[1]) / 1e3 if ready and gpu
                             else t1 - t0)

        def early(frames: list[FrameResult]) -> None:
            check_admissions()
            if on_codes is not None:
                on_codes(StepOutput(frames=[r for r in frames if r.slot not in out.failed], failed=dict(out.failed),
                                    prefill_s=out.prefill_s, decode_s=time.perf_counter() - t0 - out.prefill_s))

        frames = self._decode([s for s in plan.decode if s not in out.failed], early, on_launch)
        if not checked:  # nothing decoded: wait for the admissions themselves
            self._sync()
            check_admissions()
        for adm in ready:
            if adm.slot in out.failed:
                self.release(adm.slot)
        out.frames = [r for r in frames if r.slot not in out.failed]
        out.decode_s = time.perf_counter() - t0 - out.prefill_s
        return out

    def extend_text(self, slot: int, vectors: torch.Tensor, eos_from: int | None = None) -> None:
        """Append text-track vectors [n, H] to an admitted slot (StreamSynthesize)."""
        start = self.n_trailing[slot]
        self.state.extend_text(slot, start, vectors, eos_from)
        self.n_trailing[slot] = start + vectors.shape[0]

    def release(self, slot: int) -> None:
        self.positions.pop(slot, None)
        self.n_trailing.pop(slot, None)
        if 0 <= slot < self.max_streams:
            self.kv.release(slot)

    @property
    def blocks_in_use(self) -> int:
        return self.kv.alloc.num_used

    # -- admissions -----------------------------------------------------------------------
    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _reserve(self, adm: Admission) -> None:
        """Check an admission and give its slot the KV blocks of its prompt."""
        slot, prompt = adm.slot, adm.prompt
        if not 0 <= slot < self.max_streams:
            raise ValueError(f"slot {slot} out of range")
        self.release(slot)
        length = prompt.embeds.shape[0]
        if length >= self.max_positions:
            raise ValueError(f"prompt of {length} positions exceeds {self.max_positions}")
        if prompt.trailing.shape[0] > self.state.max_trailing:
            raise ValueError(f"{prompt.trailing.shape[0]} pending text vectors exceed {self.state.max_trailing}")
        if not self.kv.ensure(slot, length):
            raise ValueError(f"no KV blocks left for a prompt of {length} positions")

    def _admit_rows(self, admissions: list[Admission]) -> torch.Tensor:
        """One batched prefill of every admission's prompt (prefill_rows: each token a row of the
        decode step's batch-invariant ops), then each slot's first code-0 draw, launched without
        a host wait -> finite per admission ([A] bool, on the device). With the row graphs (bf16
        KV), the admissions go in as few replays as fit the largest bucket; the first replay is
        launched before the slots' state is written, so that host work runs beside the GPU's."""
        dev = self.device
        lens = [a.prompt.embeds.shape[0] for a in admissions]
        slots = [a.slot for a in admissions]
        blocks = [self.kv.blocks(s) for s in slots] if self.kv_dtype != torch.float32 else None
        # consecutive runs, each as many as one row-graph bucket holds (a prompt's bits do not
        # depend on its neighbours, so any cut gives the same results)
        chunks = self.row_graphs.chunks(lens, [len(b) for b in blocks]) if blocks and self.row_graphs else None
        hidden = self._prefill_chunk(admissions, lens, blocks, *chunks[0]) if chunks else None
        # the slots' state (asynchronous copies from pinned memory): the first draws read it
        rows = _to_device(torch.tensor(slots, dtype=torch.long), dev)
        self.state.admit_many(slots, [a.sampling for a in admissions], lens,
                              [a.prompt.trailing for a in admissions], [a.prompt.pad_embed for a in admissions],
                              None, [a.eos_from for a in admissions], rows=rows)
        self.kv.sync()
        for a, n in zip(admissions, lens):
            self.n_trailing[a.slot] = a.prompt.trailing.shape[0]
            self.positions[a.slot] = n
        if chunks:
            finite = []
            for c, (i, j) in enumerate(chunks):
                if c:  # a bucket's output is read (the draws) before its next replay
                    hidden = self._prefill_chunk(admissions, lens, blocks, i, j)
                finite.append(self._first_draws(rows[i:j], hidden))
            return torch.cat(finite)
        if self.kv_dtype == torch.float32:
            x = torch.cat([a.prompt.embeds for a in admissions]).to(dev, torch.float32)
            rows_of = torch.repeat_interleave(torch.tensor(slots), torch.tensor(lens))
            pos = torch.cat([torch.arange(n) for n in lens])
            last = torch.tensor(np.cumsum(lens) - 1)
            hidden = prefill_rows(self.p.talker, self.kv, x, rows_of.to(dev), pos.to(dev), last.to(dev))
        else:  # the prompts attend over fp32 K/V (bf16 K/V there compounds over 28 layers: run 2)
            x, share = self._rows(admissions)
            hidden = prefill_rows_fp32_attention(self.p.talker, self.kv, x, lens, blocks, *share)
        return self._first_draws(rows, hidden)

    def _rows(self, adm: list[Admission]) -> tuple[torch.Tensor, tuple]:
        """The prefill rows of these admissions [N, H] fp32 on the device, without the shared
        prefixes that an earlier one of them computes (prefill.shared_rows), and (skip, lead) for
        them, or () when none is shared (or sharing is off: TTS_SHARE_PREFIX=0)."""
        share = shared_rows([a.prompt for a in adm], self.kv.block_size) if SHARE_PREFIX else None
        skip = share[0] if share else [0] * len(adm)
        x = torch.cat([a.prompt.embeds[k:] for a, k in zip(adm, skip)]).to(self.device, torch.float32)
        return x, (share or ())

    def _prefill_chunk(self, admissions: list[Admission], lens: list[int], blocks: list[list[int]], i: int,
                       j: int) -> torch.Tensor:
        """Admissions i..j-1 (their KV blocks in `blocks[i:j]`) through one row-graph replay, or
        the eager path when they fit no bucket (a prompt longer than the largest) -> their last
        hidden states [j - i, H]."""
        adm, ln, blocks = admissions[i:j], lens[i:j], blocks[i:j]
        x, share = self._rows(adm)
        n = self.row_graphs.bucket([a - k for a, k in zip(ln, share[0])] if share else ln, blocks)
        if n is None:
            return prefill_rows_fp32_attention(self.p.talker, self.kv, x, ln, blocks, *share)
        return self.row_graphs.run(n, x, ln, blocks, *share)

    def _first_draws(self, rows: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The admitted slots' past hidden, and code 0 of their first frame from it (rows [A] long
        on the device, hidden [A, H]; draw index 0, stream 0), all in one batch-invariant pass;
        -> finite per slot ([A] bool, on the device). With graphs: one replay of the next bucket's
        graph, the rows past A being the scratch slot (as a frame's padding), instead of ~15
        launches from Python (0.8 ms of host time on an H100 host, which one stream's first
        frame waited for: scripts/gpu_admit_timeline.py)."""
        a = rows.shape[0]
        if not self.draw_graphs:
            return self._draw(rows, hidden)
        b = bucket_for(a, self.sizes)
        graph, finite = self.draw_graphs[b]
        self._draw_rows[:a].copy_(rows)
        self._draw_rows[a:b].fill_(self.state.scratch)
        self._draw_hidden[:a].copy_(hidden)
        graph.replay()
        return finite[:a].clone()  # the next replay overwrites it

    def _capture_draws(self) -> None:
        """`_draw` as one CUDA graph per frame bucket over the engine's draw buffers (rows: the
        scratch slot until a replay's admissions fill them), without PDL."""
        dev, h = self.device, self.p.talker.cfg.hidden_size
        self._draw_rows = torch.full((self.sizes[-1],), self.state.scratch, dtype=torch.long, device=dev)
        self._draw_hidden = torch.zeros(self.sizes[-1], h, dtype=torch.float32, device=dev)
        finite = {}  # per bucket, the captured draw's output (the warm-up's are replaced)

        def fn(b):
            finite[b] = self._draw(self._draw_rows[:b], self._draw_hidden[:b])

        graphs = capture(fn, self.sizes, dev, pdl_rows=0)
        self.draw_graphs = {b: (g, finite[b]) for b, g in graphs.items()}
        torch.cuda.synchronize(dev)

    def _draw(self, rows: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """`_first_draws`' device work, launched op by op (what the draw graphs hold)."""
        s, ids = self.state, self.p.ids
        s.past_hidden[rows] = hidden
        logits = ops.linear(hidden, self.p.codec_head)  # [A, V]
        ops.talker_process_(logits, s.seen, s.floats[PENALTY, rows], s.ints[N_SAMPLED, rows], ids.eos,
                            ids.suppress_start, ids.min_new_tokens, rows)
        code, finite = ops.sample_tokens(logits, s.ints[DO_SAMPLE, rows], s.floats[TEMPERATURE, rows],
                                         s.ints[TOP_K, rows], s.floats[TOP_P, rows], s.seed[rows],
                                         torch.zeros(rows.shape[0], dtype=torch.int64, device=self.device), 0)
        s.ints[CODE0, rows] = code
        s.ints[N_SAMPLED].index_fill_(0, rows, 1)
        s.seen.index_put_((rows, code.long()), self._one)  # device values: no host copy (graph capture)
        return finite

    def _warm_admissions(self) -> None:
        """Run the admission path once for row counts of each Triton specialisation (1, a
        multiple of 16, others) so that no kernel compiles while serving (a first compile
        stalled a step for 1.9 s on the H100)."""
        h = self.p.talker.cfg.hidden_size
        g = torch.Generator().manual_seed(0)
        for lengths in ((1,), (16,), (17,), (5, 27), (64, 64, 3)):
            if len(lengths) > self.max_streams or max(lengths) >= self.max_positions:
                continue
            admit = tuple(Admission(i, Prompt(embeds=0.1 * torch.randn(n, h, generator=g),
                                              trailing=torch.zeros(1, h), pad_embed=torch.zeros(h)),
                                    SamplingConfig(seed=i))
                          for i, n in enumerate(lengths))
            self.run(StepPlan(decode=(), admit=admit))
            for a in admit:
                self.release(a.slot)

    def _admit(self, adm: Admission) -> None:
        """One admission through the prefill graphs (prefill_graphs=True)."""
        self._reserve(adm)
        slot, prompt = adm.slot, adm.prompt
        length = prompt.embeds.shape[0]
        x = prompt.embeds.to(self.device, torch.float32)
        if self.prefill_graphs is not None and self.prefill_graphs.fits(length):
            hidden = self.prefill_graphs.run(x, self.kv.blocks(slot))
        else:
            blocks = torch.tensor(self.kv.blocks(slot), dtype=torch.long).to(self.device)
            hidden = prefill(self.p.talker, x, self.kv.k, self.kv.v, blocks)
        self.state.admit(slot, adm.sampling, length, prompt.trailing, prompt.pad_embed, hidden, adm.eos_from)
        self.n_trailing[slot] = prompt.trailing.shape[0]
        rows = torch.tensor([slot], dtype=torch.long).to(self.device)
        if not bool(self._first_draws(rows, hidden[None])[0]):
            raise ValueError("non-finite talker logits after prefill")
        self.positions[slot] = length

    # -- frames ---------------------------------------------------------------------------
    def _decode(self, slots: list[int], early, on_launch=None) -> list[FrameResult]:
        if len(set(slots)) != len(slots):
            raise ValueError("a slot appears twice in one step")
        errors, live = {}, []
        bs, positions = self.kv.block_size, self.positions
        for s in slots:
            pos = positions.get(s)
            if pos is None:
                raise ValueError(f"slot {s} is not prefilled")
            if pos >= self.max_positions:
                errors[s] = "talker context is full"
            elif pos % bs == 0 and not self.kv.ensure(s, pos + 1):  # a new block only at a block edge
                errors[s] = f"no KV blocks left in the pool ({self.kv.alloc.num_blocks - 1} blocks)"
            else:
                live.append(s)
        rows, ng, eos = {}, self.p.ids.num_code_groups, self.p.ids.eos
        zeros = np.zeros(ng, dtype=np.int64)

        def results(out: np.ndarray, chunk: list[int], final: bool) -> list[FrameResult]:
            out = out.astype(np.int64)
            is_eos = (out[:, ng] == eos).tolist() if final else [False] * len(chunk)
            flags = out[:, ng + 1].tolist()
            return [FrameResult(s, out[j, :ng], is_eos[j] and not flags[j], frame_error(flags[j]) if flags[j] else None)
                    for j, s in enumerate(chunk)]

        for i in range(0, len(live), self.sizes[-1]):
            chunk = live[i:i + self.sizes[-1]]
            codes = self._step(chunk, on_launch)
            early(results(codes, chunk, False))
            for r in results(self._finish_step(len(chunk)), chunk, True):
                rows[r.slot] = r
                positions[r.slot] += 1
        return [rows[s] if s not in errors else FrameResult(s, zeros.copy(), False, errors[s]) for s in slots]

    def _step(self, chunk: list[int], on_launch=None) -> np.ndarray:
        """Launch one frame for the slots of `chunk` (<= the largest bucket) -> its code rows
        [n, 18] int32 (columns 16, 17: not final) once they are on the host; the talker step
        that ends the frame is still running (`_finish_step` waits for it). on_launch (the
        contract) gets the codes' device view once both halves are launched."""
        n = len(chunk)
        b = bucket_for(n, self.sizes) if self.graphs else n
        gpu = self.device.type == "cuda"
        self.rows_host[:n] = torch.tensor(chunk, dtype=torch.int64)
        self.rows_host[n:b] = self.state.scratch
        self.kv.sync()
        rows = self.rows_dev
        rows[:b].copy_(self.rows_host[:b], non_blocking=gpu)
        self._predict(rows, n, b)
        if gpu:
            self._predicted.record()
        self.codes_host[:b].copy_(self.frame.out[:b], non_blocking=gpu)
        if gpu:
            self._codes_ready.record()
        self._advance(rows, n, b)
        self.out_host[:b].copy_(self.frame.out[:b], non_blocking=gpu)
        if on_launch is not None:  # columns 0..15 are final after predict (advance writes 16, 17)
            on_launch(list(chunk), self.frame.out[:n, :self.p.ids.num_code_groups], self._predicted)
        if gpu:
            self._codes_ready.synchronize()
        if self.cuda_predict:
            self.cuda.check("predict")
        return self.codes_host[:n].numpy().copy()

    def _predict(self, rows: torch.Tensor, n: int, b: int) -> None:
        """The frame's code-predictor half for rows[:b] (n real, then padding) on the device."""
        if self.cuda_predict:
            self.cuda.predict(rows, n, b)
        elif self.graphs:
            self.graphs.predict[b].replay()
        else:
            self.frame.predict(rows[:b])

    def _advance(self, rows: torch.Tensor, n: int, b: int) -> None:
        """The talker step that ends the frame (after `_predict` of the same rows)."""
        if self.cuda_advance:
            self.cuda.advance(rows, n)
        elif self.graphs:
            self.graphs.advance[b].replay()
        else:
            self.frame.advance(rows[:b])

    def replay_frame(self, n: int, b: int) -> None:
        """Benchmarks: one whole frame of the rows already in rows_dev[:b] (n real), launched
        without a host wait."""
        self._predict(self.rows_dev, n, b)
        self._advance(self.rows_dev, n, b)

    def _finish_step(self, n: int) -> np.ndarray:
        """The frame launched by `_step`, complete -> out rows [n, 18] int32."""
        self._sync()
        if self.cuda is not None:
            self.cuda.check()
        return self.out_host[:n].numpy().copy()
