"""tts-bench statistics on synthetic arrival traces with known answers: percentiles, underrun
accounting, per-level aggregates, and the seeded workload schedule."""

from __future__ import annotations

import numpy as np
import pytest

from tts_client.stats import (CODEBOOKS_PER_FRAME, RequestRecord, aggregate, compare, format_table,
                              percentile, summarize, summary_line, underruns)
from tts_client.workloads import BUILTIN, load_text_file, schedule, spoken_seconds


def test_percentile_known_values():
    xs = list(range(1, 101))
    assert percentile(xs, 50) == pytest.approx(50.5)
    assert percentile(xs, 95) == pytest.approx(95.05)
    assert percentile(xs, 99) == pytest.approx(99.01)
    assert percentile(xs, 0) == 1 and percentile(xs, 100) == 100
    assert percentile([30, 10, 20], 50) == 20  # order does not matter
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None and percentile([None, None], 50) is None
    assert percentile([1, None, 3], 50) == 2  # missing values are skipped


def test_percentile_matches_numpy_linear():
    xs = np.random.default_rng(0).lognormal(size=37)
    for q in (1, 25, 50, 90, 95, 99):
        assert percentile(xs.tolist(), q) == pytest.approx(np.percentile(xs, q), rel=1e-12)


def test_no_underrun_when_chunks_arrive_ahead_of_playback():
    # playback runs out at 0.18, 0.26, 0.34; every chunk is earlier
    assert underruns([0.10, 0.15, 0.20], [0.08, 0.08, 0.08]) == (0, 0.0)
    # a chunk arriving exactly when the buffer runs dry is not a stall
    assert underruns([0.0, 0.08, 0.16], [0.08, 0.08, 0.08]) == (0, 0.0)
    assert underruns([], []) == (0, 0.0)
    assert underruns([5.0], [0.08]) == (0, 0.0)  # a single chunk never stalls (TTFC is separate)


def test_underruns_count_and_stall_time():
    # 1-, 2-, 4-, 5-frame chunks: runs dry at 0.13 (next at 0.20: 70 ms stall), then at 0.36
    # (next at 0.25: fine), then at 0.68 (next at 0.70: 20 ms stall)
    count, stall = underruns([0.05, 0.20, 0.25, 0.70], [0.08, 0.16, 0.32, 0.40])
    assert count == 2 and stall == pytest.approx(0.09)


def test_preroll_absorbs_jitter():
    arrivals, durations = [0.05, 0.20, 0.25, 0.70], [0.08, 0.16, 0.32, 0.40]
    assert underruns(arrivals, durations, preroll_s=0.1) == (0, 0.0)
    count, stall = underruns(arrivals, durations, preroll_s=0.05)  # dry at 0.18 and 0.68
    assert count == 2 and stall == pytest.approx(0.02 + 0.02)
    # chunks that arrive during the pre-roll just fill the buffer
    assert underruns([0.0, 0.01, 0.4], [0.08, 0.08, 0.08], preroll_s=0.5) == (0, 0.0)


def test_steady_slow_stream_stalls_on_every_chunk():
    # one 80 ms frame every 100 ms (RTF 1.25): each later chunk waits 20 ms
    arrivals = [0.1 * (i + 1) for i in range(10)]
    count, stall = underruns(arrivals, [0.08] * 10)
    assert count == 9 and stall == pytest.approx(9 * 0.02)


def _record(system="grpc", c=1, index=0, status="OK", arrivals=(0.1, 0.3), durations=(0.08, 0.16),
            start=0.0, frames=3, reason="max_length"):
    rec = RequestRecord(system, c, index, "t", "english", 10, 0.24, status=status, start_s=start,
                        num_frames=frames if status == "OK" else 0, finish_reason=reason)
    wall = arrivals[-1] if status == "OK" else 0.05
    rec.end_s = start + wall
    rec.add_trace(list(arrivals) if status == "OK" else [], list(durations) if status == "OK" else [], wall)
    return rec


def test_record_metrics_from_trace():
    rec = _record(arrivals=(0.1, 0.3), durations=(0.08, 0.16))
    assert rec.ttfc_ms == pytest.approx(100) and rec.audio_s == pytest.approx(0.24)
    assert rec.rtf == pytest.approx(0.3 / 0.24) and rec.num_chunks == 2
    assert rec.underruns == 1 and rec.stall_ms == pytest.approx(120)  # dry at 0.18, next at 0.30
    assert rec.chunk_arrival_ms == [100.0, 300.0] and rec.chunk_audio_ms == [80.0, 160.0]
    assert rec.underruns_no_preroll == 1 and rec.stall_ms_no_preroll == pytest.approx(120)
    rec.add_trace([0.1, 0.3], [0.08, 0.16], 0.3, preroll_s=0.2)  # plays from 0.3: the second chunk is in time
    assert rec.underruns == 0 and rec.stall_ms == 0
    assert rec.underruns_no_preroll == 1 and rec.stall_ms_no_preroll == pytest.approx(120)
    a = aggregate([rec])
    assert a["stall_ms_max"] == 0 and a["stall_ms_no_preroll_max"] == pytest.approx(120)


def test_aggregate_rates_errors_and_underrun_rate():
    recs = [_record(index=0, arrivals=(0.1, 0.15), start=0.0),  # no underrun
            _record(index=1, arrivals=(0.1, 0.3), start=0.5),  # one underrun, ends at 0.8
            _record(index=2, status="RESOURCE_EXHAUSTED", start=0.2)]
    a = aggregate(recs)
    assert a["num_requests"] == 3 and a["num_ok"] == 2
    assert a["errors"] == {"RESOURCE_EXHAUSTED": 1} and a["finish_reasons"] == {"max_length": 2}
    assert a["wall_s"] == pytest.approx(0.8)
    assert a["audio_s_per_s"] == pytest.approx(0.48 / 0.8)
    assert a["frames_per_s"] == pytest.approx(6 / 0.8)
    assert a["codec_tokens_per_s"] == pytest.approx(6 * CODEBOOKS_PER_FRAME / 0.8)
    assert a["underrun_rate"] == pytest.approx(0.5) and a["underruns_mean"] == pytest.approx(0.5)
    assert a["ttfc_ms_p50"] == pytest.approx(100) and a["server_ttfc_ms_p50"] is None
    assert a["rtf_p50"] == pytest.approx((0.15 + 0.3) / 2 / 0.24)


def test_aggregate_first_audio_outside_the_server():
    """Client TTFC minus the server's own, over the records that have both."""
    recs = [_record(index=i, arrivals=(t / 1000, 0.3), start=0.0) for i, t in enumerate((40, 60, 200))]
    for r, srv in zip(recs, (30.0, 50.0, None)):
        r.server_ttfc_ms = srv
    a = aggregate(recs)
    assert a["outside_server_ms_p50"] == pytest.approx(10) and a["outside_server_ms_p95"] == pytest.approx(10)
    assert aggregate(recs[2:])["outside_server_ms_p50"] is None


def test_summarize_compares_on_the_same_requests():
    recs = [_record(index=i, arrivals=(0.05, 0.1)) for i in range(4)]
    recs += [_record("qwen-tts", index=i, arrivals=(0.5,), durations=(0.24,)) for i in range(2)]
    levels, comparisons = summarize(recs)
    assert [(x["system"], x["concurrency"]) for x in levels] == [("grpc", 1), ("qwen-tts", 1)]
    (c,) = comparisons
    assert c["num_requests"] == 2 and c["ttfc_p50_ratio"] == pytest.approx(10.0)
    assert c["rtf_p50_ratio"] == pytest.approx(5.0)
    assert compare(levels[0], levels[1])["ttfc_p50_ratio"] == pytest.approx(10.0)
    table = format_table(levels)
    assert "qwen-tts" in table and "TTFC p50" in table and len(table.splitlines()) == 4
    line = summary_line("label", levels, comparisons)
    assert "\n" not in line and line.startswith("label | grpc c=1: TTFC p50 50 ms")
    assert "TTFC 10.0x lower" in line


def test_schedule_is_seeded_and_capped():
    a = schedule(BUILTIN, 40, seed=3, max_duration_s=2.0)
    assert a == schedule(BUILTIN, 40, seed=3, max_duration_s=2.0)
    assert [r.utterance for r in a] != [r.utterance for r in schedule(BUILTIN, 40, 4, 2.0)]
    assert [r.seed for r in a] == [3 + i for i in range(40)]
    assert {r.utterance for r in a} == set(BUILTIN)  # cycles through every sentence
    assert max(r.max_frames for r in a) == 25 and min(r.max_frames for r in a) >= 1
    short = next(r for r in a if r.utterance.text_id == "it-short")
    assert short.max_frames == int(np.ceil(spoken_seconds(short.utterance.text) * 12.5)) < 25
    assert a[0].max_duration_s() == pytest.approx(a[0].max_frames / 12.5)


def test_builtin_workload_is_varied():
    langs = {u.language for u in BUILTIN}
    assert len(langs) >= 8 and "english" in langs and "chinese" in langs
    lengths = [len(u.text) for u in BUILTIN]
    assert min(lengths) < 25 and max(lengths) > 300
    assert len({u.text_id for u in BUILTIN}) == len(BUILTIN)


def test_text_file(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("# comment\nHello there.\n\nGerman\tGuten Tag.\n", encoding="utf-8")
    us = load_text_file(str(p))
    assert [(u.language, u.text) for u in us] == [("auto", "Hello there."), ("german", "Guten Tag.")]
