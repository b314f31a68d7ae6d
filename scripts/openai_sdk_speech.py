"""Speak through the server's OpenAI-compatible HTTP API with the official `openai` SDK.

    python scripts/openai_sdk_speech.py "Hello there." -o hello.wav
    python scripts/openai_sdk_speech.py "Hello there." --format pcm -o - | aplay -r 24000 -f S16_LE -c 1

The audio is written as it arrives (the server streams it as it decodes); the time to the first
bytes goes to stderr."""

from __future__ import annotations

import argparse
import os
import sys
import time

from openai import OpenAI


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("text")
    p.add_argument("-o", "--output", default="speech.wav", help="file, or - for stdout")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="synthetic", help="the served model (GET /v1/models)")
    p.add_argument("--voice", default="", help="a model voice; empty: the server's default")
    p.add_argument("--format", default="wav",
                   choices=["pcm", "wav", "mp3", "opus", "flac", "aac", "mulaw", "alaw"])
    p.add_argument("--seed", type=int, default=None)
    a = p.parse_args(argv)
    client = OpenAI(base_url=a.base_url, api_key=os.environ.get("TTS_AUTH_TOKEN", "unused"))
    extra = {"seed": a.seed} if a.seed is not None else {}
    out = sys.stdout.buffer if a.output == "-" else open(a.output, "wb")
    t0 = time.monotonic()
    first = None
    with client.audio.speech.with_streaming_response.create(
            model=a.model, voice=a.voice, input=a.text, response_format=a.format,
            extra_body=extra) as response:
        for chunk in response.iter_bytes():
            if first is None and chunk:
                first = time.monotonic() - t0
            out.write(chunk)
            out.flush()
    if out is not sys.stdout.buffer:
        out.close()
    print(f"first bytes after {first * 1000:.0f} ms, done after {(time.monotonic() - t0) * 1000:.0f} ms "
          f"({response.headers.get('x-sample-rate')} Hz {a.format})", file=sys.stderr)


if __name__ == "__main__":
    main()
