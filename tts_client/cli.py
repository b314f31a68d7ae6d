"""`tts-client`: speak a sentence into a WAV file, list voices, show model info."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import grpc

from .audio import write_wav
from .client import TTSClient, build_request
from .helpfmt import ArgumentParser
from .pb.tts.v1 import tts_pb2


class UsageError(Exception):
    """A mistake in the command line found before calling the server; one line on stderr."""


def _client(a) -> TTSClient:
    creds = None
    if a.tls or a.tls_ca:
        roots = _read(a.tls_ca, "--tls-ca") if a.tls_ca else None
        creds = grpc.ssl_channel_credentials(root_certificates=roots)
    metadata = (("authorization", f"Bearer {a.token}"),) if a.token else ()
    return TTSClient(a.address, credentials=creds, metadata=metadata)


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise UsageError(f"{flag} {path}: {e.strerror.lower()}") from None


def _check_output(path: str) -> None:
    """Fails before synthesis when the WAV could not be written afterwards."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"-o {path}: is a folder; give a file name such as {path.rstrip('/')}/out.wav")
    if not os.path.isdir(folder):
        raise UsageError(f"-o {path}: the folder {os.path.dirname(path) or folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"-o {path}: the folder {os.path.dirname(path) or folder} is not writable")


def _hint(a, e: grpc.aio.AioRpcError) -> str:
    """A next step for the errors a new user meets first."""
    code = e.code()
    if code == grpc.StatusCode.UNAVAILABLE and not (a.tls or a.tls_ca):
        return (f"is a server running on {a.address}? If it serves TLS, pass --tls-ca CA.pem "
                f"(or --tls for a publicly trusted certificate)")
    if code == grpc.StatusCode.UNAVAILABLE:
        return (f"is a server running on {a.address}, and does --tls-ca hold the CA that signed "
                f"its certificate? (a plaintext server needs no --tls)")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return "pass the server's token with --token or $TTS_AUTH_TOKEN"
    return ""


async def _say(a) -> int:
    _check_output(a.output)
    ref = _read(a.reference, "--reference") if a.reference else None
    req = build_request(a.text, voice=a.voice, language=a.language, sample_rate_hz=a.sample_rate,
                        seed=a.seed, greedy=a.greedy, max_duration_s=a.max_duration,
                        reference_audio=ref, reference_text=a.reference_text,
                        encoding=(tts_pb2.AUDIO_ENCODING_FLOAT32_LE if a.float32
                                  else tts_pb2.AUDIO_ENCODING_PCM_S16LE))
    async with _client(a) as client:
        res = await client.synthesize(req, timeout=a.timeout)
    write_wav(a.output, res.samples, res.sample_rate)
    s = res.summary
    reason = tts_pb2.FinishReason.Name(s.finish_reason) if s else "?"
    print(f"wrote {a.output}: {res.audio_s:.2f} s at {res.sample_rate} Hz in "
          f"{len(res.chunk_times_s)} chunks ({reason})")
    print(f"time to first chunk: {res.ttfc_s * 1000:.1f} ms (server {s.time_to_first_chunk_ms:.1f} ms)"
          f"   real-time factor: {res.rtf:.3f} (server {s.real_time_factor:.3f})")
    return 0


async def _voices(a) -> int:
    async with _client(a) as client:
        r = await client.list_voices()
    for v in r.voices:
        print(v.name + (" (default)" if v.is_default else ""))
    if r.requires_reference:
        print("(Base model: clone a voice with --reference FILE [--reference-text TEXT])")
    print("languages: auto, " + ", ".join(r.languages))
    return 0


async def _info(a) -> int:
    async with _client(a) as client:
        print(await client.model_info())
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="tts-client", description=__doc__)
    p.add_argument("--address", default="127.0.0.1:50051", help="the server's HOST:PORT")
    p.add_argument("--token", default=os.environ.get("TTS_AUTH_TOKEN"),
                   help="bearer token (default: $TTS_AUTH_TOKEN, else none)")
    p.add_argument("--tls", action="store_true", help="connect with TLS (system roots)")
    p.add_argument("--tls-ca", help="PEM root certificate to trust (implies --tls; default: none)")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{say,voices,info}")
    s = sub.add_parser("say", help="synthesize TEXT into a WAV file", description=(
        "Synthesize TEXT into a WAV file; prints the time to first chunk and the real-time factor."))
    s.add_argument("text", help="what to say")
    s.add_argument("-o", "--output", required=True, help="the WAV file to write")
    s.add_argument("--voice", default="", help="a voice from `tts-client voices` (default: the "
                   "server's default voice)")
    s.add_argument("--language", default="", help="auto, a language name or a BCP-47 tag such "
                   "as en-US (default: auto)")
    s.add_argument("--sample-rate", type=int, default=0, help="Hz, 8000-48000; 0 = native 24000")
    s.add_argument("--seed", type=int, help="sampling seed (default: random)")
    s.add_argument("--greedy", action="store_true", help="pick the most likely code at every step")
    s.add_argument("--max-duration", type=float, default=0.0, help="seconds; 0 = from text length")
    s.add_argument("--reference", help="reference audio file to clone (Base models; default: none)")
    s.add_argument("--reference-text", default="", help="its transcript (in-context cloning)")
    s.add_argument("--float32", action="store_true", help="ask for float32 samples on the wire "
                   "(the WAV is 16-bit either way)")
    s.add_argument("--timeout", type=float, default=600.0, help="deadline of the call in seconds")
    sub.add_parser("voices", help="list the model's voices and languages",
                   description="List the model's voices and languages.")
    sub.add_parser("info", help="show the served model and limits",
                   description="Show the served model, engine and limits.")
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    fn = {"say": _say, "voices": _voices, "info": _info}[a.cmd]
    try:
        return asyncio.run(fn(a))
    except UsageError as e:
        print(f"tts-client: error: {e}", file=sys.stderr)
        return 2
    except grpc.aio.AioRpcError as e:
        hint = _hint(a, e)
        print(f"error: {e.code().name}: {e.details()}" + (f"\nhint: {hint}" if hint else ""),
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
