"""Import contracts: the client side never pulls in the server or torch; rpc stays torch-free."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _imported_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return set(out.stdout.split())


@pytest.mark.parametrize("module", ["tts_client.client", "tts_client.cli", "tts_client.audio",
                                    "tts_client.text_stream", "tts_client.text_bench"])
def test_client_imports_neither_server_nor_torch(module):
    mods = _imported_after(f"import {module}")
    assert not {m for m in mods if m.split(".")[0] in ("tts_server", "torch", "qwen_tts")}


def test_rpc_layer_is_torch_free():
    mods = _imported_after("import tts_server.rpc.server, tts_server.rpc.convert")
    assert "torch" not in mods and "qwen_tts" not in mods


def test_http_layer_is_torch_free():
    mods = _imported_after("import tts_server.http.server, tts_server.audio_formats")
    assert "torch" not in mods and "qwen_tts" not in mods
