"""Stand-ins for the audio libraries qwen_tts imports at module level (librosa, soundfile, sox)
but never calls on the decode path; for benchmark scripts on machines where they do not import
(the GPU image: soundfile lacks cffi)."""

from __future__ import annotations

import importlib.machinery
import sys
import types


def stub_audio_modules() -> None:
    """Register empty modules for each of them that cannot be imported; keep the real ones."""
    for top, subs in (("librosa", ("filters",)), ("soundfile", ()), ("sox", ())):
        names = (top,) + tuple(f"{top}.{s}" for s in subs)
        try:
            for name in names:
                __import__(name)
            continue
        except Exception:  # noqa: BLE001 - missing, or present but broken
            for name in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
                del sys.modules[name]
        for name in names:
            mod = types.ModuleType(name)
            mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=name == top)
            mod.__path__ = []
            mod.mel = None
            sys.modules[name] = mod
        for s in subs:
            setattr(sys.modules[top], s, sys.modules[f"{top}.{s}"])
