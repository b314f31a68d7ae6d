"""`tts-client`: speak a sentence into a WAV file, list voices, show model info."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import grpc

from .audio import write_wav
from .client import TTSClient, build_request
from .pb.tts.v1 import tts_pb2


def _client(a) -> TTSClient:
    creds = None
    if a.tls or a.tls_ca:
        roots = open(a.tls_ca, "rb").read() if a.tls_ca else None
        creds = grpc.ssl_channel_credentials(root_certificates=roots)
    metadata = (("authorization", f"Bearer {a.token}"),) if a.token else ()
    return TTSClient(a.address, credentials=creds, metadata=metadata)


async def _say(a) -> int:
    ref = open(a.reference, "rb").read() if a.reference else None
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tts-client", description=__doc__)
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--token", default=os.environ.get("TTS_AUTH_TOKEN"),
                   help="bearer token (default: $TTS_AUTH_TOKEN)")
    p.add_argument("--tls", action="store_true", help="connect with TLS (system roots)")
    p.add_argument("--tls-ca", help="PEM root certificate to trust (implies --tls)")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("say", help="synthesize TEXT into a WAV file")
    s.add_argument("text")
    s.add_argument("-o", "--output", required=True)
    s.add_argument("--voice", default="")
    s.add_argument("--language", default="")
    s.add_argument("--sample-rate", type=int, default=0, help="Hz; 0 = native 24000")
    s.add_argument("--seed", type=int)
    s.add_argument("--greedy", action="store_true")
    s.add_argument("--max-duration", type=float, default=0.0, help="seconds; 0 = from text length")
    s.add_argument("--reference", help="reference audio file to clone (Base models)")
    s.add_argument("--reference-text", default="", help="its transcript (in-context cloning)")
    s.add_argument("--float32", action="store_true", help="ask for float32 samples on the wire")
    s.add_argument("--timeout", type=float, default=600.0)
    sub.add_parser("voices", help="list the model's voices and languages")
    sub.add_parser("info", help="show the served model and limits")
    a = p.parse_args(argv)
    fn = {"say": _say, "voices": _voices, "info": _info}[a.cmd]
    try:
        return asyncio.run(fn(a))
    except grpc.aio.AioRpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
