"""tts-bench end to end: a short run against the loopback tiny server (the JSON names other tools
rely on), and a self-started server with the qwen-tts baseline, reaped afterwards."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tts_client import bench

RECORD_KEYS = {"ttfc_ms", "rtf", "audio_s", "underruns", "status", "server_ttfc_ms", "finish_reason"}
LEVEL_KEYS = {"ttfc_ms_p50", "ttfc_ms_p95", "ttfc_ms_p99", "rtf_p50", "underrun_rate", "audio_s_per_s",
              "frames_per_s", "codec_tokens_per_s", "errors"}


async def test_short_run_against_loopback_server(tiny_server, tmp_path, capsys):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["--address", tiny_server, "--concurrency", "1,2", "--requests", "3", "--warmup", "1",
            "--max-duration", "0.48", "--json", str(out), "--plot", str(png), "--no-progress"]
    # the server lives on this test's event loop; the CLI runs its own loop in a thread
    assert await asyncio.to_thread(bench.main, argv) == 0
    result = json.loads(out.read_text())
    records, levels = result["records"], result["levels"]
    assert len(records) == 6 and all(RECORD_KEYS <= r.keys() for r in records)
    assert all(r["status"] == "OK" and r["system"] == "grpc" for r in records)
    for r in records:
        assert 0 < r["ttfc_ms"] <= r["wall_ms"] and r["server_ttfc_ms"] > 0
        assert r["audio_s"] == pytest.approx(r["num_frames"] * 0.08) and r["num_frames"] <= 6
        assert r["rtf"] == pytest.approx(r["wall_ms"] / 1000 / r["audio_s"])
        assert r["finish_reason"] in ("eos", "max_length") and r["underruns"] >= 0
    assert [(x["system"], x["concurrency"]) for x in levels] == [("grpc", 1), ("grpc", 2)]
    assert all(LEVEL_KEYS <= x.keys() and x["num_ok"] == 3 for x in levels)
    assert levels[0]["ttfc_ms_p50"] <= levels[0]["ttfc_ms_p95"] <= levels[0]["ttfc_ms_p99"]
    assert result["server"]["model"] == "synthetic-tiny" and result["voice"]
    text = capsys.readouterr().out
    assert "TTFC p50" in text and "summary: " in text and result["summary"] in text
    if png.exists():  # matplotlib is optional
        assert png.read_bytes()[:4] == b"\x89PNG"


async def test_open_loop_poisson_run_reports_capacity_and_first_audio(tiny_server, tmp_path, capsys):
    out = tmp_path / "rps.json"
    argv = ["--address", tiny_server, "--concurrency", "", "--rps", "2", "--requests", "4",
            "--warmup", "0", "--max-duration", "0.4", "--workload", "english", "--fixed-duration",
            "--json", str(out), "--no-progress"]
    assert await asyncio.to_thread(bench.main, argv) == 0
    result = json.loads(out.read_text())
    records = result["records"]
    assert [r["system"] for r in records] == ["grpc-rps"] * 4
    assert all(r["status"] == "OK" and r["num_frames"] == 5 for r in records)  # fixed 0.4 s each
    assert all(r["text_id"].startswith("en") for r in records)
    # the arrivals are spread out (Poisson at 2/s), not sent at once
    starts = sorted(r["start_s"] for r in records)
    assert starts[-1] - starts[0] > 0.2
    for r in records:
        assert set(r["first_audio"]) >= {"queue_ms", "prefill_ms", "first_frame_ms", "first_decode_ms"}
        parts = {k: v for k, v in r["first_audio"].items() if k != "prepare_ms"}  # inside prefill_ms
        assert r["first_audio"]["prepare_ms"] <= r["first_audio"]["prefill_ms"]
        assert sum(parts.values()) <= r["server_ttfc_ms"] + 1.0
        assert r["lag_ms"] >= 0 and r["underruns_no_preroll"] >= r["underruns"]
    level = result["levels"][0]
    assert level["concurrency"] == 2 and level["peak_in_flight"] >= 1
    assert "rps" in result["summary"] and "capacity" in result["summary"]
    assert set(result["capacity"]) == {"grpc-rps"}
    assert "first audio p50 at rps=2" in capsys.readouterr().out


@pytest.mark.slow
def test_self_started_server_with_baseline(tmp_path, monkeypatch):
    started = []

    class Spy(bench.ServerProcess):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            started.append(self)

    monkeypatch.setattr(bench, "ServerProcess", Spy)
    out = tmp_path / "bench.json"
    argv = ["--model", "synthetic-tiny", "--engine", "torch", "--concurrency", "1", "--requests", "2",
            "--warmup", "0", "--max-duration", "0.24", "--baseline", "qwen-tts",
            "--baseline-requests", "1", "--json", str(out), "--no-progress"]
    assert bench.main(argv) == 0
    assert len(started) == 1 and started[0].proc.poll() is not None  # stopped and reaped
    result = json.loads(out.read_text())
    base = [r for r in result["records"] if r["system"] == "qwen-tts"]
    assert len(base) == 1 and base[0]["status"] == "OK" and base[0]["index"] == 0
    assert base[0]["ttfc_ms"] == pytest.approx(base[0]["wall_ms"])  # not streaming
    assert base[0]["num_frames"] <= 3 and base[0]["underruns"] == 0
    (cmp,) = result["comparisons"]
    assert cmp["concurrency"] == 1 and cmp["num_requests"] == 1 and cmp["ttfc_p50_ratio"] > 0
    assert "vs qwen-tts c=1" in result["summary"]


async def test_grpc_and_http_in_the_same_run(tiny_custom, tmp_path, capsys):
    from http_helpers import start_server, stop_servers

    started = []
    base, address, _, _ = await start_server(tiny_custom, started)
    out = tmp_path / "both.json"
    argv = ["--address", address, "--http-url", base, "--transport", "both", "--concurrency", "2",
            "--rps", "3", "--requests", "3", "--warmup", "1", "--max-duration", "0.48",
            "--json", str(out), "--no-progress"]
    try:
        assert await asyncio.to_thread(bench.main, argv) == 0
    finally:
        await stop_servers(started)
    result = json.loads(out.read_text())
    records = result["records"]
    by = {s: sorted((r for r in records if r["system"] == s), key=lambda r: r["index"])
          for s in ("grpc", "http", "grpc-rps", "http-rps")}
    assert all(len(v) == 3 and all(r["status"] == "OK" for r in v) for v in by.values())
    # the same requests (texts, seeds, caps) give the same audio through either door
    assert [r["audio_s"] for r in by["http"]] == [r["audio_s"] for r in by["grpc"]]
    for r in by["http"] + by["http-rps"]:
        assert 0 < r["ttfc_ms"] <= r["wall_ms"] and r["num_frames"] <= 6
    assert set(result["capacity"]) == {"grpc", "grpc-rps", "http", "http-rps"}
    assert "http c=" in result["summary"] and "http rps=" in result["summary"]


async def test_closed_loop_level_over_load_processes(tiny_server, tmp_path):
    """--processes 2: the level's streams come from two load processes that start together; the
    records merge as one level of that concurrency."""
    out = tmp_path / "procs.json"
    argv = ["--address", tiny_server, "--concurrency", "4", "--requests", "4", "--warmup", "0",
            "--processes", "2", "--max-duration", "0.32", "--fixed-duration", "--json", str(out),
            "--no-progress"]
    assert await asyncio.to_thread(bench.main, argv) == 0
    result = json.loads(out.read_text())
    records = result["records"]
    assert [r["index"] for r in records] == [0, 1, 2, 3]
    assert all(r["status"] == "OK" and r["concurrency"] == 4 and r["num_frames"] == 4 for r in records)
    starts = [r["start_s"] for r in records]
    assert max(starts) - min(starts) < 0.5  # one start for both processes
    assert [(x["system"], x["concurrency"], x["num_ok"]) for x in result["levels"]] == [("grpc", 4, 4)]


async def test_http_closed_loop_level_over_load_processes(tiny_custom, tmp_path):
    """--processes 2 through the HTTP API: the level's requests come from two load processes that
    start together, and merge as one level."""
    from http_helpers import start_server, stop_servers

    started = []
    base, address, _, _ = await start_server(tiny_custom, started, max_streams=4)
    out = tmp_path / "http-procs.json"
    argv = ["--address", address, "--http-url", base, "--transport", "http", "--concurrency", "4",
            "--requests", "4", "--warmup", "0", "--processes", "2", "--max-duration", "0.32",
            "--fixed-duration", "--json", str(out), "--no-progress"]
    try:
        assert await asyncio.to_thread(bench.main, argv) == 0
    finally:
        await stop_servers(started)
    records = json.loads(out.read_text())["records"]
    assert [(r["system"], r["index"], r["status"], r["num_frames"]) for r in records] == \
        [("http", i, "OK", 4) for i in range(4)]
    starts = [r["start_s"] for r in records]
    assert max(starts) - min(starts) < 0.5  # one start for both processes


async def test_waiting_for_a_server_sees_it_soon_after_a_long_start():
    """A server that listens only after 12 s (a GPU server compiles and captures for minutes) is
    seen SERVING within ~1 s of its start: gRPC's own reconnect backoff (1 s growing 1.6x, up to
    120 s) had the waiting channel's next try 2.5-4.6 s late here (3 runs), ~2 min late after 200 s."""
    port = bench.free_port()
    started = []

    async def late_server():
        await asyncio.sleep(12)
        server = grpc.aio.server()
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        started.append(time.monotonic())
        return server

    task = asyncio.create_task(late_server())
    try:
        assert await bench.wait_for_serving(f"127.0.0.1:{port}", 40)
        seen = time.monotonic()
    finally:
        server = await task
        await server.stop(None)
    assert seen - started[0] < 2.0, f"SERVING seen {seen - started[0]:.1f} s after the server started"


async def test_waiting_for_a_server_stops_when_it_exits_or_times_out():
    port = bench.free_port()
    with pytest.raises(RuntimeError, match="gone"):
        await bench.wait_for_serving(f"127.0.0.1:{port}", 10, lambda: "gone")
    t0 = time.monotonic()
    assert not await bench.wait_for_serving(f"127.0.0.1:{port}", 1.5)
    assert time.monotonic() - t0 < 5
