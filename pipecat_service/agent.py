"""Example voice agent: speech-to-text -> LLM -> QwenTTSService -> audio, in the browser over
SmallWebRTC (`make agent`) or on this machine's microphone and speakers (`--local`). It talks to a
running `make serve` at TTS_ADDRESS; STT and LLM come from environment variables (README.md)."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys
from dataclasses import dataclass
from typing import Mapping

SYSTEM_PROMPT = ("You are a friendly voice assistant in a spoken conversation. Answer in one to "
                 "three short sentences of plain speech: no lists, markdown or emoji. Start by "
                 "greeting the user in one sentence.")
INSTALL_HINTS = {
    "local": "sudo apt-get install portaudio19-dev, then pip install -e '.[agent-local]'"}


class AgentSetupError(Exception):
    """Something the user must set or install first, said in words rather than a traceback."""


@dataclass(frozen=True)
class AgentConfig:
    """Where the agent's three services live, read from the environment."""

    tts_address: str
    tts_voice: str | None
    tts_language: str | None
    stt_provider: str  # "deepgram" | "openai" (OpenAI or any OpenAI-compatible server)
    stt_api_key: str
    stt_base_url: str | None
    stt_model: str | None
    llm_api_key: str
    llm_base_url: str | None
    llm_model: str

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> AgentConfig:
        def get(name: str) -> str | None:
            return (env.get(name) or "").strip() or None

        openai_key = get("OPENAI_API_KEY")
        llm_base_url = get("LLM_BASE_URL")
        if llm_base_url and not get("LLM_MODEL"):
            raise AgentSetupError(f"LLM_BASE_URL is {llm_base_url}; also set LLM_MODEL to a model "
                                  "that server offers (e.g. LLM_MODEL=llama3.2 for Ollama).")
        if not llm_base_url and not openai_key:
            raise AgentSetupError(
                "No LLM configured. Set OPENAI_API_KEY for OpenAI, or LLM_BASE_URL and LLM_MODEL "
                "for a local OpenAI-compatible server "
                "(Ollama: LLM_BASE_URL=http://localhost:11434/v1).")
        stt_base_url = get("STT_BASE_URL")
        if get("DEEPGRAM_API_KEY"):
            stt = ("deepgram", get("DEEPGRAM_API_KEY"), None, get("STT_MODEL"))
        elif stt_base_url or openai_key:
            key = get("STT_API_KEY") or openai_key or "none"
            stt = ("openai", key, stt_base_url, get("STT_MODEL"))
        else:
            raise AgentSetupError(
                "No speech-to-text configured. Set DEEPGRAM_API_KEY (Deepgram), or OPENAI_API_KEY "
                "(OpenAI transcription), or STT_BASE_URL (and STT_MODEL) for a local "
                "OpenAI-compatible transcription server.")
        return cls(tts_address=get("TTS_ADDRESS") or "127.0.0.1:50051",
                   tts_voice=get("TTS_VOICE"), tts_language=get("TTS_LANGUAGE"),
                   stt_provider=stt[0], stt_api_key=stt[1], stt_base_url=stt[2], stt_model=stt[3],
                   llm_api_key=get("LLM_API_KEY") or openai_key or "none",
                   llm_base_url=llm_base_url,
                   llm_model=get("LLM_MODEL") or "gpt-4.1-mini")


def _load(module: str, extra: str):
    """Import an optional Pipecat module, turning a missing package into a clear message."""
    try:
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - Pipecat re-raises missing packages as several types
        hint = INSTALL_HINTS.get(extra, "pip install -e '.[agent]' (the project's agent extra)")
        raise AgentSetupError(f"{module} needs packages that are not installed ({e}). "
                              f"Install them with {hint}.") from e


def build_services(cfg: AgentConfig):
    """The STT, LLM and TTS services the config names."""
    from .service import QwenTTSService

    if cfg.stt_provider == "deepgram":
        stt = _load("pipecat.services.deepgram.stt", "deepgram").DeepgramSTTService(
            api_key=cfg.stt_api_key)
    else:
        module = _load("pipecat.services.openai.stt", "openai")
        settings = module.OpenAISTTService.Settings(model=cfg.stt_model) if cfg.stt_model else None
        stt = module.OpenAISTTService(api_key=cfg.stt_api_key, base_url=cfg.stt_base_url,
                                      settings=settings)
    module = _load("pipecat.services.openai.llm", "openai")
    llm = module.OpenAILLMService(
        api_key=cfg.llm_api_key, base_url=cfg.llm_base_url,
        settings=module.OpenAILLMService.Settings(model=cfg.llm_model,
                                                  system_instruction=SYSTEM_PROMPT))
    # token mode: the LLM's tokens go to the server as they come (no sentence aggregation)
    tts = QwenTTSService(address=cfg.tts_address, voice=cfg.tts_voice, language=cfg.tts_language,
                         text_streaming=True)
    return stt, llm, tts


async def run_agent(transport, cfg: AgentConfig, *, greet_on_connect: bool,
                    handle_sigint: bool = True, idle_timeout_s: float | None = None) -> None:
    """Run transport in -> STT -> LLM -> TTS -> transport out until the session ends."""
    from pipecat.frames.frames import LLMRunFrame
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineParams, PipelineWorker
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.processors.aggregators.llm_response_universal import (LLMContextAggregatorPair,
                                                                       LLMUserAggregatorParams)
    from pipecat.workers.runner import WorkerRunner

    vad = _load("pipecat.audio.vad.silero", "silero").SileroVADAnalyzer()
    stt, llm, tts = build_services(cfg)
    user, assistant = LLMContextAggregatorPair(
        LLMContext(), user_params=LLMUserAggregatorParams(vad_analyzer=vad))
    pipeline = Pipeline([transport.input(), stt, user, llm, tts, transport.output(), assistant])
    worker = PipelineWorker(pipeline, idle_timeout_secs=idle_timeout_s,
                            params=PipelineParams(enable_metrics=True, enable_usage_metrics=True))

    if greet_on_connect:
        @transport.event_handler("on_client_connected")
        async def on_client_connected(transport, client):
            await worker.queue_frames([LLMRunFrame()])

        @transport.event_handler("on_client_disconnected")
        async def on_client_disconnected(transport, client):
            await worker.cancel()
    else:
        await worker.queue_frames([LLMRunFrame()])

    runner = WorkerRunner(handle_sigint=handle_sigint)
    await runner.add_workers(worker)
    await runner.run()


async def bot(runner_args) -> None:
    """Entry point of Pipecat's development runner: one browser session over SmallWebRTC."""
    from pipecat.runner.utils import create_transport
    from pipecat.transports.base_transport import TransportParams

    transport = await create_transport(runner_args, {
        "webrtc": lambda: TransportParams(audio_in_enabled=True, audio_out_enabled=True)})
    await run_agent(transport, AgentConfig.from_env(), greet_on_connect=True,
                    handle_sigint=runner_args.handle_sigint,
                    idle_timeout_s=runner_args.pipeline_idle_timeout_secs)


async def check_tts_server(address: str, timeout_s: float = 5.0) -> str:
    """One line about the TTS server at `address`; AgentSetupError when none answers."""
    import grpc

    from tts_client.client import TTSClient

    try:
        async with TTSClient(address) as client:
            info = await client.model_info(timeout=timeout_s)
    except grpc.aio.AioRpcError as e:
        raise AgentSetupError(f"No TTS server answers at {address} ({e.code().name}). Start one "
                              "with `make serve`, or set TTS_ADDRESS=host:port.") from e
    line = f"TTS server at {address}: model {info.model}, engine {info.engine} on {info.device}"
    return line + (f". WARNING: {info.warning}" if info.is_synthetic else "")


async def _run_local(cfg: AgentConfig) -> None:
    module = _load("pipecat.transports.local.audio", "local")
    transport = module.LocalAudioTransport(module.LocalAudioTransportParams(
        audio_in_enabled=True, audio_out_enabled=True))
    await run_agent(transport, cfg, greet_on_connect=False)


def required_modules(cfg: AgentConfig, local: bool) -> list[tuple[str, str]]:
    """(module, pipecat extra) pairs the agent will import for this config."""
    stt = "deepgram" if cfg.stt_provider == "deepgram" else "openai"
    transport = [("pipecat.transports.local.audio", "local")] if local else [
        ("pipecat.runner.run", "runner"), ("pipecat.transports.smallwebrtc.transport", "webrtc")]
    return [(f"pipecat.services.{stt}.stt", stt), ("pipecat.services.openai.llm", "openai"),
            ("pipecat.audio.vad.silero", "silero"), *transport]


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pipecat_service.agent", description=__doc__,
        epilog="Without --local, the options of Pipecat's development runner apply "
               "(e.g. -t webrtc --port 7860); then open http://localhost:7860/client.")
    parser.add_argument("--local", action="store_true",
                        help="use this machine's microphone and speakers instead of a browser")
    args, _ = parser.parse_known_args()
    try:
        cfg = AgentConfig.from_env()
        for module, extra in required_modules(cfg, args.local):
            _load(module, extra)
        print(asyncio.run(check_tts_server(cfg.tts_address)), flush=True)
        if args.local:
            asyncio.run(_run_local(cfg))
            return
    except AgentSetupError as e:
        sys.exit(f"agent: {e}")
    importlib.import_module("pipecat.runner.run").main(parser)


if __name__ == "__main__":
    main()
