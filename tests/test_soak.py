"""`tts-soak` end to end, short: a self-started loopback server (in one process, and with its engine
in a process of its own) under mixed load with random cancels, then the leak checks (streams,
descriptors, memory) and a clean SIGTERM exit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("engine_process", [False, True])
def test_short_soak_passes_with_no_leaks(tmp_path, engine_process):
    report = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, "-m", "tts_client.soak", "--minutes", "0.4",
                           "--windows", "2", "--json", str(report)]
                          + (["--engine-process"] if engine_process else []),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(report.read_text())
    assert r["ok"] and r["num_unexpected"] == 0 and r["problems"] == []
    assert r["requests"] >= 20
    assert {"OK", "INVALID_ARGUMENT", "CANCELLED"} <= r["codes"].keys()
    assert r["leaks"]["streams_left"] == 0 and r["leaks"]["open_fds_growth"] <= 8
    assert r["server_exit_code"] == 0
    assert "INTERNAL" not in r["server_codes"] and r["server_codes"]["OK"] > 0
    assert len(r["windows"]) == 2 and all(w["rss_mb"] for w in r["windows"])
    if engine_process:  # the engine process's own memory and descriptors are checked too
        assert all(w["engine_rss_mb"] for w in r["windows"])
        assert r["leaks"]["engine_open_fds_growth"] <= 8 and "engine_rss_growth_mb" in r["leaks"]
    assert "SOAK PASSED" in proc.stdout
