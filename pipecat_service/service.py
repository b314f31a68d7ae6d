"""QwenTTSService: a Pipecat TTS service that streams Qwen3-TTS audio from the gRPC server through
the generated grpc.aio stub of `tts_client`: one `Synthesize` call per sentence, or (token mode)
the LLM's text as it comes over one `StreamSynthesize` call, with word timings."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
import grpc
from loguru import logger
from pipecat.frames.frames import ErrorFrame, Frame, TTSAudioRawFrame, TTSStoppedFrame
from pipecat.processors.frame_processor import FrameProcessorSetup
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import TextAggregationMode, TTSService
from pipecat.transcriptions.language import Language
from pipecat.utils.errors import ErrorCategory
from pipecat.utils.types import NOT_GIVEN, NotGiven

from tts_client.client import TTSClient, build_request
from tts_client.pb.tts.v1 import tts_pb2
from tts_client.text_stream import context_config

from .token_stream import TokenStream, status_code

Code = grpc.StatusCode
# Worth another attempt when no audio has arrived yet (a retry after audio would repeat it).
RETRYABLE_CODES = frozenset({Code.UNAVAILABLE, Code.RESOURCE_EXHAUSTED})
ERROR_CATEGORIES = {
    Code.UNAVAILABLE: ErrorCategory.CONNECTIVITY,
    Code.DEADLINE_EXCEEDED: ErrorCategory.CONNECTIVITY,
    Code.RESOURCE_EXHAUSTED: ErrorCategory.RATE_LIMIT,
    Code.UNAUTHENTICATED: ErrorCategory.AUTHENTICATION,
    Code.PERMISSION_DENIED: ErrorCategory.AUTHORIZATION,
    Code.NOT_FOUND: ErrorCategory.INVALID_REQUEST,
    Code.FAILED_PRECONDITION: ErrorCategory.INVALID_REQUEST,
    Code.UNIMPLEMENTED: ErrorCategory.INVALID_REQUEST,
    Code.INTERNAL: ErrorCategory.SERVER,
    Code.UNKNOWN: ErrorCategory.SERVER,
    Code.DATA_LOSS: ErrorCategory.SERVER,
}


def _not_given():
    return field(default_factory=lambda: NOT_GIVEN)


@dataclass
class QwenTTSSettings(TTSSettings):
    """Runtime-updatable settings (send a `TTSUpdateSettingsFrame(delta=QwenTTSSettings(...))`).

    `voice` and `language` as in ListVoices (None: the server's default voice, "auto");
    sampling fields left None take the model's defaults; `seed` fixes each sentence's random
    stream; `max_duration_s` caps each sentence's audio (None: derived from the text).
    """

    temperature: float | None | NotGiven = _not_given()
    top_k: int | None | NotGiven = _not_given()
    top_p: float | None | NotGiven = _not_given()
    repetition_penalty: float | None | NotGiven = _not_given()
    seed: int | None | NotGiven = _not_given()
    greedy: bool | NotGiven = _not_given()
    max_duration_s: float | None | NotGiven = _not_given()


class QwenTTSService(TTSService):
    """Streams each sentence from a Qwen3-TTS server as `TTSAudioRawFrame`s while it decodes.

    The channel opens in `setup()` and closes on stop, cancel or cleanup. Audio is requested
    at the pipeline's output sample rate, so nothing is resampled here. An interruption
    cancels the running RPC, which stops the server's work on it. gRPC errors become
    non-fatal `ErrorFrame`s; UNAVAILABLE and RESOURCE_EXHAUSTED are retried with backoff
    while no audio has arrived.

    Token mode (`text_streaming=True`): no sentence aggregation; every LLM token goes to the
    server at once over one StreamSynthesize call (one server context per turn, ended by the
    turn's end), so the audio starts before the LLM's reply does. An interruption cancels the
    context on the server. The server's word timings become `TTSTextFrame`s timed to playback.
    """

    Settings = QwenTTSSettings
    _settings: Settings

    # Reconnect soon after a refused connection, so that a retry can find a restarted server.
    CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 100),
                       ("grpc.min_reconnect_backoff_ms", 100),
                       ("grpc.max_reconnect_backoff_ms", 2000),
                       # a connection of its own: grpc otherwise gives every service of an agent
                       # process (one per call) the same one, and a server's RPC processes
                       # (--rpc-processes) each take whole connections
                       ("grpc.use_local_subchannel_pool", 1))

    def __init__(self, *, address: str = "127.0.0.1:50051", voice: str | None = None,
                 language: Language | str | None = None, settings: Settings | None = None,
                 tls: bool = False, credentials: grpc.ChannelCredentials | None = None,
                 metadata: Sequence[tuple[str, str]] = (), timeout_s: float | None = 120.0,
                 max_retries: int = 2, retry_backoff_s: float = 0.25, text_streaming: bool = False,
                 **kwargs):
        """Configure the service; nothing connects before `setup()`.

        Args:
            address: "host:port" of a running `tts-server`.
            voice, language: shorthands for the same settings fields; `settings` wins.
            settings: a (partial) QwenTTSSettings applied over the defaults.
            tls: use TLS with the system's root certificates (ignored when `credentials`).
            credentials: explicit channel credentials (e.g. `grpc.ssl_channel_credentials(...)`).
            metadata: sent with every call, e.g. `(("authorization", "Bearer <token>"),)`.
            timeout_s: deadline of one sentence's stream (None: no deadline).
            max_retries, retry_backoff_s: retries of a retryable failure before any audio,
                waiting retry_backoff_s, then twice that, and so on (sentence mode).
            text_streaming: token mode over StreamSynthesize (see the class docstring); its
                call has no deadline unless timeout_s is given explicitly per turn.
            **kwargs: passed to `TTSService` (sample_rate, stop_frame_timeout_s, name, ...).
        """
        defaults = self.Settings(model=None, voice=voice, language=_language_value(language),
                                 temperature=None, top_k=None, top_p=None,
                                 repetition_penalty=None, seed=None, greedy=False,
                                 max_duration_s=None)
        if settings is not None:
            defaults.apply_update(settings)
            defaults.language = _language_value(defaults.language)
        # Every failure here is reported as an error already; counting the silent sentences
        # it leaves would also write the service off for good after a brief server outage.
        kwargs.setdefault("max_consecutive_zero_audio_contexts", 0)
        if text_streaming:  # tokens as they come; word timings make the TTSTextFrames
            kwargs.setdefault("text_aggregation_mode", TextAggregationMode.TOKEN)
            kwargs.setdefault("push_text_frames", False)
        super().__init__(push_start_frame=True, push_stop_frames=True, settings=defaults, **kwargs)
        self._tokens = (TokenStream(self._on_stream_message, self._on_stream_failure, None)
                        if text_streaming else None)
        self._address = address
        self._credentials = credentials or (grpc.ssl_channel_credentials() if tls else None)
        self._metadata = tuple(metadata)
        self._timeout_s = timeout_s
        self._max_retries = max_retries
        self._retry_backoff_s = retry_backoff_s
        self._client: TTSClient | None = None
        self._call: tuple[str, grpc.aio.UnaryStreamCall] | None = None  # (context id, call)
        self._num_requests = 0
        self._asked_contexts: set[str] = set()  # contexts run_tts was called for
        self._reported_contexts: set[str] = set()  # contexts whose failure was pushed already

    @property
    def address(self) -> str:
        return self._address

    def can_generate_metrics(self) -> bool:
        return True

    def language_to_service_language(self, language: Language) -> str:
        return _language_value(language)

    async def setup(self, setup: FrameProcessorSetup):
        await super().setup(setup)
        self._client = TTSClient(self._address, credentials=self._credentials,
                                 metadata=self._metadata, options=list(self.CHANNEL_OPTIONS))

    async def stop(self, frame):
        await super().stop(frame)
        await self._close()

    async def cancel(self, frame):
        await super().cancel(frame)
        await self._close()

    async def cleanup(self):
        await super().cleanup()
        await self._close()

    async def _close(self) -> None:
        """Idempotent teardown: cancel the running call, close the channel."""
        self._cancel_call()
        if self._tokens is not None:
            await self._tokens.close()
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    def _cancel_call(self, context_id: str | None = None) -> None:
        if self._call is not None and context_id in (None, self._call[0]):
            self._call[1].cancel()
            self._call = None

    async def on_audio_context_interrupted(self, context_id: str):
        # The interruption has already cancelled run_tts (whose `finally` cancels the call);
        # this also covers a generator that was suspended at a yield when that happened.
        self._cancel_call(context_id)
        self._forget(context_id)
        if self._tokens is not None:
            await self._tokens.cancel(context_id)
        await super().on_audio_context_interrupted(context_id)

    async def flush_audio(self, context_id: str | None = None):
        """Token mode: the turn's text is complete, so its server context gets `end`."""
        if self._tokens is not None:
            await self._tokens.end(context_id or self.get_active_audio_context_id())

    async def _record_context_audio_outcome(self, context_id: str, received_audio: bool):
        # Pipecat 1.14 reports every context that completes without audio as an error of its
        # own (after stop_frame_timeout_s). A sentence whose failure this service has pushed
        # already would get a second ErrorFrame, and so would one Pipecat never sent here
        # because the service was unusable at the time (a later settings update made it usable
        # again before the context ended). (A private hook: pipecat-ai is pinned.)
        asked, reported = context_id in self._asked_contexts, context_id in self._reported_contexts
        self._forget(context_id)
        if not received_audio and (reported or not asked):
            return
        await super()._record_context_audio_outcome(context_id, received_audio)

    async def _push_sequencer_frames(self, frames: list[Frame], context_id: str | None):
        # Pipecat 1.14 in token mode buffers word timings until their sentence is complete,
        # then "promotes" it and replays them, and queues the replayed frames behind the audio
        # context's pending items. A later word's timing already queued there is processed
        # after the promotion, finds its sentence ready and goes out first: the transcript and
        # the conversation context got 'token' before 'Sure,' (a test forces that timing). Sent
        # at once, the replayed words precede every word processed after them. Each carries its
        # own playback time (pts), which the output transport keeps. (A private hook:
        # pipecat-ai is pinned.)
        if self._tokens is None:
            await super()._push_sequencer_frames(frames, context_id)
            return
        for f in frames:
            await self.push_frame(f)

    def _forget(self, context_id: str) -> None:
        self._asked_contexts.discard(context_id)
        self._reported_contexts.discard(context_id)

    async def _report(self, context_id: str, error: ErrorFrame) -> None:
        """Pushes `error` upstream now (rather than yielding it into the audio context, so that
        a verdict of "unusable" applies before the next sentence is sent), once per sentence."""
        self._reported_contexts.add(context_id)
        await self.push_error_frame(error)

    def _classify_error(self, exception: Exception) -> ErrorCategory | None:
        if not isinstance(exception, grpc.aio.AioRpcError):
            return None
        if exception.code() == Code.INVALID_ARGUMENT:
            # The server names the bad field first. Rejected text concerns this sentence
            # only; any other field comes from settings and would fail every sentence until
            # a settings update (which makes the service usable again).
            field_name = (exception.details() or "").split(":", 1)[0]
            if field_name == "text":
                return ErrorCategory.APPLICATION
            return ErrorCategory.INVALID_REQUEST
        return ERROR_CATEGORIES.get(exception.code())

    def _build_request(self, text: str, request_id: str):
        s = self._settings
        sampling = {name: getattr(s, name) for name in
                    ("temperature", "top_k", "top_p", "repetition_penalty")
                    if getattr(s, name) is not None}
        return build_request(text, voice=s.voice or "", language=s.language or "",
                             sample_rate_hz=self.sample_rate, seed=s.seed, greedy=bool(s.greedy),
                             max_duration_s=s.max_duration_s or 0.0, request_id=request_id,
                             **sampling)

    # ---- token mode ---------------------------------------------------------------------
    def _context_config(self, context_id: str):
        s = self._settings
        self._num_requests += 1
        sampling = {name: getattr(s, name) for name in
                    ("temperature", "top_k", "top_p", "repetition_penalty")
                    if getattr(s, name) is not None}
        return context_config(voice=s.voice or "", language=s.language or "",
                              sample_rate_hz=self.sample_rate, seed=s.seed, greedy=bool(s.greedy),
                              max_duration_s=s.max_duration_s or 0.0,
                              request_id=f"{context_id[:8]}.{self._num_requests}", **sampling)

    async def _on_stream_message(self, msg) -> None:
        """One StreamSynthesize response, routed to its Pipecat audio context."""
        cid, kind = msg.context_id, msg.WhichOneof("content")
        if kind == "done":
            self._tokens.done(cid)
        if not self.audio_context_available(cid):
            return  # interrupted: its audio is not played
        if kind == "audio":
            await self.append_to_audio_context(cid, TTSAudioRawFrame(
                audio=msg.audio.audio, sample_rate=msg.audio.sample_rate_hz, num_channels=1,
                context_id=cid))
        elif kind == "words":
            rate = self.sample_rate
            await self.add_word_timestamps([(w.word, w.sample_offset / rate) for w in msg.words.words], cid)
        elif kind == "done":
            done = msg.done
            if done.error_code and done.finish_reason != tts_pb2.FINISH_REASON_CANCELLED:
                code = status_code(done.error_code)
                if code == Code.INVALID_ARGUMENT:  # text: this turn only; a setting: every turn
                    category = (ErrorCategory.APPLICATION if done.error_message.startswith("text")
                                else ErrorCategory.INVALID_REQUEST)
                else:
                    category = ERROR_CATEGORIES.get(code, ErrorCategory.SERVER)
                self._reported_contexts.add(cid)
                await self.push_error(f"{self}: context {cid} failed: {code.name if code else done.error_code}: "
                                      f"{done.error_message}", category=category)
            await self.append_to_audio_context(cid, TTSStoppedFrame(context_id=cid))
            await self.remove_audio_context(cid)

    async def _on_stream_failure(self, error: Exception, context_ids: list[str]) -> None:
        """The StreamSynthesize call broke: its open contexts end with an error (the next turn
        opens a new call)."""
        code = error.code() if isinstance(error, grpc.aio.AioRpcError) else None
        detail = error.details() if isinstance(error, grpc.aio.AioRpcError) else repr(error)
        for cid in context_ids:
            if self.audio_context_available(cid):
                self._reported_contexts.add(cid)
                await self.push_error(f"{self}: stream failed ({code.name if code else 'error'}): {detail}",
                                      exception=error)
                await self.append_to_audio_context(cid, TTSStoppedFrame(context_id=cid))
                await self.remove_audio_context(cid)

    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        """Yields audio frames as the server streams them; errors are pushed as ErrorFrames.
        Token mode: sends the text and yields None (the audio arrives on the receive task)."""
        self._asked_contexts.add(context_id)
        if self._client is None:
            await self._report(context_id, ErrorFrame(
                error=f"{self}: no channel to {self._address} (setup() not run)"))
            return
        if self._tokens is not None:
            try:
                await self._tokens.send_text(self._client, context_id, text,
                                             lambda: self._context_config(context_id))
                await self.start_tts_usage_metrics(text)
            except (TypeError, ValueError) as e:
                self._reported_contexts.add(context_id)
                await self.push_error(f"{self}: bad settings: {e}", exception=e,
                                      category=ErrorCategory.INVALID_REQUEST)
            except grpc.aio.AioRpcError as e:
                await self._report(context_id, ErrorFrame(
                    error=f"{self}: stream failed: {e.code().name}: {e.details()}", exception=e))
            yield None
            return
        self._num_requests += 1
        request_id = f"{context_id[:8]}.{self._num_requests}"
        try:
            request = self._build_request(text, request_id)
        except (TypeError, ValueError) as e:
            self._reported_contexts.add(context_id)
            await self.push_error(f"{self}: bad settings for {request_id}: {e}", exception=e,
                                  category=ErrorCategory.INVALID_REQUEST)
            return
        await self.start_tts_usage_metrics(text)
        for attempt in range(self._max_retries + 1):
            call = self._client.stream(request, timeout=self._timeout_s)
            self._call = (context_id, call)
            num_chunks = 0
            try:
                async for msg in call:
                    if msg.HasField("audio"):
                        num_chunks += 1
                        yield TTSAudioRawFrame(msg.audio.audio,
                                               msg.audio.sample_rate_hz or self.sample_rate, 1,
                                               context_id=context_id)
                return
            except grpc.aio.AioRpcError as e:
                error = f"Qwen TTS {e.code().name} for {request_id}: {e.details()}"
                if num_chunks == 0 and e.code() in RETRYABLE_CODES and attempt < self._max_retries:
                    delay = self._retry_backoff_s * 2 ** attempt
                    logger.warning(f"{self}: {error}; retrying in {delay:.2f} s")
                    await self._call_event_handler("on_connection_error", error)
                    await asyncio.sleep(delay)
                    continue
                await self._report(context_id, ErrorFrame(error=error, exception=e))
                return
            finally:
                call.cancel()
                if self._call is not None and self._call[1] is call:
                    self._call = None


def _language_value(language: Language | str | None) -> str | None:
    return language.value if isinstance(language, Language) else language
