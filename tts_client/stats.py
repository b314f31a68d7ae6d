"""Benchmark statistics: percentiles, playback underruns from chunk arrival traces, per-level
aggregates, and their rendering as a table and a one-line summary. Pure Python, no gRPC."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

CODEBOOKS_PER_FRAME = 16  # codec tokens per 80 ms frame in the 12 Hz Qwen3-TTS models


def percentile(values, q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between order statistics
    (numpy's default, Hyndman-Fan type 7); None for no values."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def underruns(arrivals_s, durations_s, preroll_s: float = 0.0) -> tuple[int, float]:
    """(count, total stall seconds) for a player that starts `preroll_s` after the first chunk
    arrives and plays in real time. An underrun is each chunk that arrives after everything
    received before it has finished playing; playback resumes the moment that chunk arrives."""
    if not arrivals_s:
        return 0, 0.0
    played_until = arrivals_s[0] + preroll_s  # when the buffered audio runs out
    count, stall = 0, 0.0
    for t, d in zip(arrivals_s, durations_s):
        if t > played_until + 1e-9:
            count += 1
            stall += t - played_until
        played_until = max(played_until, t) + d
    return count, stall


@dataclass
class RequestRecord:
    """One request of one system at one concurrency level (times in ms unless named _s)."""

    system: str  # "grpc" / "http" (closed loop), "grpc-rps" / "http-rps" (open loop) or "qwen-tts"
    concurrency: float  # concurrent clients, or requests per second for "grpc-rps"
    index: int  # position in the workload schedule (same text and seed at every level)
    text_id: str
    language: str
    num_chars: int
    max_duration_s: float
    status: str = "OK"  # "OK" or a gRPC status code name
    error: str = ""
    start_s: float = 0.0  # send time, from the start of the level
    end_s: float = 0.0
    ttfc_ms: float | None = None  # client-side: send -> first audio bytes
    server_ttfc_ms: float | None = None
    wall_ms: float = 0.0
    audio_s: float = 0.0
    rtf: float | None = None  # client wall time / audio seconds
    server_rtf: float | None = None
    num_frames: int = 0
    num_chunks: int = 0
    finish_reason: str = ""  # "eos", "max_length", "cancelled" or ""
    underruns: int = 0  # at the run's pre-roll
    stall_ms: float = 0.0
    underruns_no_preroll: int = 0  # a player that starts at the first chunk
    stall_ms_no_preroll: float = 0.0  # ...and its total stall
    lag_ms: float = 0.0  # open loop: actual send time - scheduled arrival (the load generator's lag)
    first_audio: dict = field(default_factory=dict)  # server-side breakdown of the TTFC (ms)
    chunk_arrival_ms: list[float] = field(default_factory=list)
    chunk_audio_ms: list[float] = field(default_factory=list)

    def add_trace(self, arrivals_s, durations_s, wall_s: float, preroll_s: float = 0.0) -> None:
        """Fill the client-side metrics from the chunk arrival trace."""
        self.wall_ms = wall_s * 1000
        self.chunk_arrival_ms = [round(t * 1000, 3) for t in arrivals_s]
        self.chunk_audio_ms = [round(d * 1000, 3) for d in durations_s]
        self.num_chunks = len(arrivals_s)
        self.audio_s = round(sum(durations_s), 6)
        self.ttfc_ms = arrivals_s[0] * 1000 if arrivals_s else None
        self.rtf = wall_s / self.audio_s if self.audio_s else None
        self.underruns, stall = underruns(arrivals_s, durations_s, preroll_s)
        self.stall_ms = stall * 1000
        self.underruns_no_preroll, stall0 = underruns(arrivals_s, durations_s, 0.0)
        self.stall_ms_no_preroll = stall0 * 1000


def aggregate(records: list[RequestRecord]) -> dict:
    """Per-level aggregates of one system at one concurrency; rates use the level's wall time
    (first send to last completion)."""
    ok = [r for r in records if r.status == "OK"]
    wall_s = max((r.end_s for r in records), default=0.0) - min((r.start_s for r in records), default=0.0)
    audio_s, frames = sum(r.audio_s for r in ok), sum(r.num_frames for r in ok)
    first = records[0] if records else RequestRecord("", 0, 0, "", "", 0, 0.0)
    out = dict(system=first.system, concurrency=first.concurrency, num_requests=len(records),
               num_ok=len(ok), wall_s=wall_s, audio_s=audio_s,
               errors=dict(Counter(r.status for r in records if r.status != "OK")),
               finish_reasons=dict(Counter(r.finish_reason for r in ok)))
    for name in ("ttfc_ms", "server_ttfc_ms", "rtf", "server_rtf"):
        vals = [getattr(r, name) for r in ok]
        for q in (50, 95, 99):
            out[f"{name}_p{q}"] = percentile(vals, q)
    out["underrun_rate"] = sum(r.underruns > 0 for r in ok) / len(ok) if ok else None
    out["underrun_rate_no_preroll"] = (sum(r.underruns_no_preroll > 0 for r in ok) / len(ok)
                                       if ok else None)
    out["underruns_mean"] = sum(r.underruns for r in ok) / len(ok) if ok else None
    out["stall_ms_p95"] = percentile([r.stall_ms for r in ok], 95)
    out["stall_ms_max"] = max((r.stall_ms for r in ok), default=None)
    out["stall_ms_no_preroll_p95"] = percentile([r.stall_ms_no_preroll for r in ok], 95)
    out["stall_ms_no_preroll_max"] = max((r.stall_ms_no_preroll for r in ok), default=None)
    out["lag_ms_p95"] = percentile([r.lag_ms for r in records], 95)
    # first audio outside the server's own timer: the call reaching its handler (connection,
    # HTTP/2, the server's accept loop) and the first chunk reaching the client. Growing with
    # load while the server's part does not points at the RPC layer, not the engine.
    outside = [r.ttfc_ms - r.server_ttfc_ms for r in ok if r.ttfc_ms is not None and r.server_ttfc_ms is not None]
    for q in (50, 95):
        out[f"outside_server_ms_p{q}"] = percentile(outside, q)
    for part in ("queue_ms", "prepare_ms", "prefill_ms", "first_frame_ms", "first_decode_ms", "write_ms"):
        out[f"first_audio_{part}_p50"] = percentile([r.first_audio.get(part) for r in ok], 50)
    out["peak_in_flight"] = peak_in_flight(records)
    out["audio_s_per_s"] = audio_s / wall_s if wall_s > 0 else None
    out["frames_per_s"] = frames / wall_s if wall_s > 0 else None
    out["codec_tokens_per_s"] = frames * CODEBOOKS_PER_FRAME / wall_s if wall_s > 0 else None
    return out


def peak_in_flight(records: list[RequestRecord]) -> int:
    """The most requests open at one moment (send to last byte)."""
    events = sorted([(r.start_s, 1) for r in records] + [(r.end_s, -1) for r in records])
    peak = now = 0
    for _, d in events:
        now += d
        peak = max(peak, now)
    return peak


def capacity(levels: list[dict], system: str) -> float | None:
    """The largest level of `system` whose requests all succeeded with zero underruns (at the
    run's pre-roll), below the first level that failed; None if even the first failed."""
    best = None
    for a in sorted((x for x in levels if x["system"] == system), key=lambda x: x["concurrency"]):
        if a["num_ok"] != a["num_requests"] or a["num_ok"] == 0 or a["underrun_rate"]:
            break
        best = a["concurrency"]
    return best


def compare(server: dict, baseline: dict) -> dict:
    """Baseline / server ratios (> 1 means the server is better) for one concurrency level."""
    def ratio(a, b):
        return a / b if a is not None and b else None

    return dict(concurrency=server["concurrency"], num_requests=baseline["num_ok"],
                ttfc_p50_ratio=ratio(baseline["ttfc_ms_p50"], server["ttfc_ms_p50"]),
                rtf_p50_ratio=ratio(baseline["rtf_p50"], server["rtf_p50"]),
                throughput_ratio=ratio(server["audio_s_per_s"], baseline["audio_s_per_s"]))


def summarize(records: list[RequestRecord]) -> tuple[list[dict], list[dict]]:
    """(aggregates per (system, concurrency), server-first; baseline comparisons). Each comparison
    uses only the server's records for the requests the baseline ran at that concurrency."""
    keys = sorted({(r.system, r.concurrency) for r in records}, key=lambda k: (k[0] == "qwen-tts", k))
    levels = [aggregate([r for r in records if (r.system, r.concurrency) == k]) for k in keys]
    comparisons = []
    for base in (x for x in levels if x["system"] == "qwen-tts"):
        c = base["concurrency"]
        ran = {r.index for r in records if r.system == base["system"] and r.concurrency == c}
        same = [r for r in records if r.system == "grpc" and r.concurrency == c and r.index in ran]
        if same:
            comparisons.append(compare(aggregate(same), base))
    return levels, comparisons


def _fmt(v, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def format_table(levels: list[dict]) -> str:
    """A fixed-width table, one row per (system, concurrency)."""
    head = (f"{'system':<9}{'c|rps':>6}{'ok/n':>9}{'TTFC p50':>10}{'p95':>8}{'p99':>8}{'srv p50':>9}"
            f"{'RTF p50':>9}{'p95':>7}{'underrun':>9}{'@0ms':>6}{'stall max':>10}{'@0ms':>6}{'xRT agg':>9}"
            f"{'frames/s':>10}{'tok/s':>8}  errors")
    rows = [head, "-" * len(head)]
    for a in levels:
        errors = ",".join(f"{k}:{v}" for k, v in a["errors"].items()) or "-"
        rate = None if a["underrun_rate"] is None else 100 * a["underrun_rate"]
        rate0 = None if a["underrun_rate_no_preroll"] is None else 100 * a["underrun_rate_no_preroll"]
        rows.append(
            f"{a['system']:<9}{a['concurrency']:>6g}{a['num_ok']:>5}/{a['num_requests']:<3}"
            f"{_fmt(a['ttfc_ms_p50']):>10}{_fmt(a['ttfc_ms_p95']):>8}{_fmt(a['ttfc_ms_p99']):>8}"
            f"{_fmt(a['server_ttfc_ms_p50']):>9}{_fmt(a['rtf_p50'], '.3f'):>9}{_fmt(a['rtf_p95'], '.2f'):>7}"
            f"{_fmt(rate, '.0f') + '%':>9}{_fmt(rate0, '.0f') + '%':>6}{_fmt(a['stall_ms_max']):>10}"
            f"{_fmt(a.get('stall_ms_no_preroll_max')):>6}{_fmt(a['audio_s_per_s'], '.2f'):>9}"
            f"{_fmt(a['frames_per_s'], '.1f'):>10}{_fmt(a['codec_tokens_per_s'], '.0f'):>8}  {errors}")
    return "\n".join(rows)


def summary_line(label: str, levels: list[dict], comparisons: list[dict]) -> str:
    """One line for BENCHMARKS.md: per level TTFC p50/p95, RTF p50, aggregate x RT, underruns."""
    parts = [label]
    for a in levels:
        rate = None if a["underrun_rate"] is None else 100 * a["underrun_rate"]
        key = "rps" if a["system"].endswith("-rps") else "c"
        parts.append(f"{a['system']} {key}={a['concurrency']:g}: TTFC p50 {_fmt(a['ttfc_ms_p50'])} ms "
                     f"p95 {_fmt(a['ttfc_ms_p95'])} ms, RTF p50 {_fmt(a['rtf_p50'], '.3f')}, "
                     f"{_fmt(a['audio_s_per_s'], '.2f')}x RT agg, underruns {_fmt(rate)}%"
                     + (f", errors {sum(a['errors'].values())}" if a["errors"] else ""))
    for c in comparisons:
        parts.append(f"vs qwen-tts c={c['concurrency']} (n={c['num_requests']}): TTFC "
                     f"{_fmt(c['ttfc_p50_ratio'], '.1f')}x lower, "
                     f"RTF {_fmt(c['rtf_p50_ratio'], '.1f')}x lower")
    return " | ".join(parts)
