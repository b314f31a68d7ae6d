"""The start-up memory plan: fit or exit with one line saying how many streams fit."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tts_server.memory_plan import GiB, StartupError, plan_streams


def need(n):  # 1 GiB of weights-side state plus 100 MiB per stream
    return GiB + n * 100 * 2**20


def test_default_is_what_fits_up_to_the_target():
    assert plan_streams(need, free_bytes=80 * GiB, requested=None).max_streams == 256
    small = plan_streams(need, free_bytes=13 * GiB, requested=None)
    assert small.max_streams == small.max_fit == 102  # (13 - 2 - 1) GiB / 100 MiB


def test_a_request_that_fits_is_kept():
    plan = plan_streams(need, free_bytes=80 * GiB, requested=300)
    assert plan.max_streams == 300 and plan.max_fit >= 300


def test_too_many_streams_fail_with_the_number_that_fits():
    with pytest.raises(StartupError, match=r"--max-streams 900 does not fit: .* up to 788 streams fit"):
        plan_streams(need, free_bytes=80 * GiB, requested=900)
    with pytest.raises(StartupError, match="not even one stream fits"):
        plan_streams(need, free_bytes=2 * GiB, requested=None)


@pytest.mark.parametrize("args,message", [
    (["--max-streams", "0"], "--max-streams must be at least 1, got 0"),
    (["--max-queue", "-1"], "--max-queue must be at least 0, got -1"),
    (["--max-positions", "10"], "--max-positions must be at least 64, got 10"),
])
def test_nonsense_limits_are_refused_before_loading(args, message):
    res = subprocess.run([sys.executable, "-m", "tts_server", *args], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2 and message in res.stderr
    assert "Traceback" not in res.stderr
