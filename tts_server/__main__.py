"""`tts-server`: load a model and serve TextToSpeechService over gRPC."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from .config import ServerConfig


def parse_args(argv=None) -> ServerConfig:
    d = ServerConfig()
    p = argparse.ArgumentParser(prog="tts-server", description=__doc__)
    p.add_argument("--host", default=d.host, help="listen address (default loopback only)")
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--model", default=d.model,
                   help="synthetic | synthetic-tiny | synthetic-base | a local Qwen3-TTS snapshot "
                        "folder | a Hugging Face hub id (default: synthetic, random weights = noise)")
    p.add_argument("--engine", default=d.engine, choices=["auto", "torch", "megakernel"],
                   help="decode engine (auto: megakernel on CUDA when built, else torch)")
    p.add_argument("--device", default=d.device, help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default=d.dtype, help="auto | float32 | bfloat16 | float16")
    p.add_argument("--max-streams", type=int, default=d.max_streams)
    p.add_argument("--max-queue", type=int, default=d.max_queue)
    p.add_argument("--max-text-chars", type=int, default=d.max_text_chars)
    p.add_argument("--max-duration-s", type=float, default=d.max_duration_s)
    p.add_argument("--chunk-frames", default=",".join(map(str, d.chunk_frames)),
                   help="frames per audio chunk, first chunks first (default 1,2,4,8)")
    p.add_argument("--grace-period-s", type=float, default=d.grace_period_s)
    p.add_argument("--default-voice", default=None)
    p.add_argument("--tls-cert", help="PEM certificate chain; with --tls-key serves TLS")
    p.add_argument("--tls-key", help="PEM private key")
    p.add_argument("--auth-token-file",
                   help="require 'authorization: Bearer <token>' on every RPC but health; the token "
                        "is this file's first line (or set TTS_AUTH_TOKEN)")
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    token = os.environ.get("TTS_AUTH_TOKEN") or None
    if a.auth_token_file:
        with open(a.auth_token_file) as f:
            token = f.readline().strip() or None
        if not token:
            p.error(f"--auth-token-file {a.auth_token_file}: empty")
    return ServerConfig(
        host=a.host, port=a.port, model=a.model, engine=a.engine, device=a.device, dtype=a.dtype,
        max_streams=a.max_streams, max_queue=a.max_queue, max_text_chars=a.max_text_chars,
        max_duration_s=a.max_duration_s,
        chunk_frames=tuple(int(x) for x in a.chunk_frames.split(",") if x),
        grace_period_s=a.grace_period_s, default_voice=a.default_voice,
        tls_cert=a.tls_cert, tls_key=a.tls_key, auth_token=token)


async def _serve(config: ServerConfig) -> None:
    from .app import build_app
    from .rpc.server import TTSServer

    log = logging.getLogger("tts_server")
    app = await asyncio.to_thread(build_app, config)
    info = app.info
    log.info("model %s (%s, %s) engine=%s device=%s dtype=%s voices=%s", info.name,
             info.model_type, info.model_size, info.engine, info.device, info.dtype,
             ",".join(info.voices) or "(clone from reference)")
    if info.is_synthetic:
        log.warning("!" * 20 + " " + info.warning + " " + "!" * 20)
    await TTSServer(app.worker, info, config).serve_forever()


def main(argv=None) -> None:
    config = parse_args(argv)
    asyncio.run(_serve(config))


if __name__ == "__main__":
    main()
