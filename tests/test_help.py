"""--help of every console script: each flag has a description and shows its default."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from tts_client import bench, cli, soak
from tts_server import __main__ as server


def _parsers():
    for name, parser in (("tts-server", server.build_parser()), ("tts-client", cli.build_parser()),
                         ("tts-bench", bench.build_parser()), ("tts-soak", soak.build_parser())):
        yield name, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    yield f"{name} {sub_name}", sub


PARSERS = dict(_parsers())


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_every_flag_has_a_description_and_its_default(name):
    parser = PARSERS[name]
    formatter = parser._get_formatter()
    checked = 0
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if action.help == argparse.SUPPRESS:
            continue
        label = "/".join(action.option_strings) or action.dest
        assert action.help and len(action.help) > 8, f"{name} {label}: no description"
        if action.option_strings and not action.required:
            text = formatter._expand_help(action)
            assert "default" in text.lower(), f"{name} {label}: the help does not show the default: {text}"
        checked += 1
    assert checked or name in ("tts-client voices", "tts-client info")


@pytest.mark.parametrize("module,expected", [
    ("tts_server", "--max-streams"), ("tts_client.cli", "{say,voices,info}"),
    ("tts_client.bench", "--concurrency"), ("tts_client.soak", "--minutes")])
def test_help_runs_and_shows_defaults(module, expected):
    res = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    assert expected in res.stdout and "(default: " in res.stdout
    assert "(default: )" not in res.stdout and "(default: None)" not in res.stdout


def test_subcommand_help_and_one_line_usage_error():
    res = subprocess.run([sys.executable, "-m", "tts_client.cli", "say", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "the WAV file to write" in res.stdout
    assert "(default: 600.0)" in res.stdout
    res = subprocess.run([sys.executable, "-m", "tts_client.cli", "say", "hi"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "tts-client say: error: the following arguments are required: -o/--output "
        "(see tts-client say --help)"]
