"""StreamSynthesize: one bidirectional call, many contexts whose text arrives in pieces.

The reader validates each message and routes it to its context (config submits a stream to the
engine worker; text, flush and end go to its handle; cancel cancels it); one forwarder task per
context turns the worker's events into responses. A bad message ends only its context (its
`done` carries INVALID_ARGUMENT naming the field); a message without a context id or content
ends the call. No model work happens here."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from tts_client.pb.tts.v1 import tts_pb2

from ..api import (AudioChunk, EngineFailure, FinishReason, FlushAck, IdleText, InvalidRequest,
                   Overloaded, ShuttingDown, SynthesisRequest, TextEvent, Unsupported, WordTiming)
from . import convert

log = logging.getLogger(__name__)

MAX_OPEN_CONTEXTS = 4  # per call: enough for a barge-in (the next opens while the last cancels)

try:  # raised by context.write when the call has already ended on the client's side
    from grpc._cython.cygrpc import ExecuteBatchError as WRITE_FAILED
except ImportError:  # pragma: no cover - other grpcio builds
    WRITE_FAILED = ()


class Abort(Exception):
    """Raised inside a handler (Synthesize or StreamSynthesize) to end the whole call with `code`."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


def error_of(e: BaseException, what: str = "context") -> tuple[grpc.StatusCode, str]:
    """The status of a request refused at submission, a stream the engine ended with `e`, or a
    failed context (reported in its `done`); `what` names it in the log of an unexpected error."""
    if isinstance(e, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    if isinstance(e, Overloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
    if isinstance(e, IdleText):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(e)
    if isinstance(e, Unsupported):
        return grpc.StatusCode.UNIMPLEMENTED, str(e)
    if isinstance(e, (EngineFailure, ShuttingDown)):
        return grpc.StatusCode.UNAVAILABLE, str(e)
    log.error("%s failed: %r", what, e)
    return grpc.StatusCode.INTERNAL, f"synthesis failed: {e}"


@dataclass
class _Context:
    cid: str
    req: SynthesisRequest
    handle: object  # serving.streams.StreamHandle
    encoding: int
    chars: int = 0
    has_text: bool = False
    ended: bool = False  # the client sent `end`
    cancelled: bool = False
    error: tuple[grpc.StatusCode, str] | None = None
    first_text_at: float | None = None
    task: asyncio.Task | None = None


class StreamSession:
    def __init__(self, servicer, context):
        self.worker, self.info, self.config = servicer.worker, servicer.info, servicer.config
        self.metrics = servicer.metrics
        self.stalls = servicer.stalls
        self.call = context
        self.open: dict[str, _Context] = {}
        self.finished: set[str] = set()  # ids whose `done` went out (a late cancel is no error)
        self._lock = asyncio.Lock()  # one write at a time on the call
        self._stalled: str | None = None
        self._reader: asyncio.Task | None = None

    async def run(self, requests) -> None:
        self._reader = asyncio.current_task()
        try:
            async for msg in requests:
                await self._on_message(msg)
            for c in list(self.open.values()):  # half-close: contexts without `end` are cancelled
                if not c.ended:
                    c.cancelled = True
                    c.handle.cancel()
            await asyncio.gather(*[c.task for c in list(self.open.values())], return_exceptions=True)
        except asyncio.CancelledError:
            if self._stalled is not None:
                raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self._stalled) from None
            raise
        finally:
            for c in list(self.open.values()):
                c.handle.cancel()
                if c.task is not None:
                    c.task.cancel()

    # ---- requests -------------------------------------------------------------------------
    async def _on_message(self, msg) -> None:
        if isinstance(msg, convert.MalformedRequest):
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"{msg.field}: {msg.message}")
        cid = msg.context_id
        if not convert.CONTEXT_ID_RE.fullmatch(cid):
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                        "context_id: must be 1-128 characters of A-Z a-z 0-9 . _ : / -")
        kind = msg.WhichOneof("content")
        if kind is None:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                        "content: set one of config, text, flush, end, cancel")
        c = self.open.get(cid)
        if kind == "config":
            if c is not None:
                return self._fail(c, InvalidRequest("config", f"context {cid!r} already has a config"))
            return await self._open(cid, msg.config)
        if c is None:
            if kind == "cancel" and cid in self.finished:
                return
            why = (InvalidRequest(kind, f"context {cid!r} has ended") if cid in self.finished else
                   InvalidRequest("config", f"unknown context {cid!r}: its first message must be config"))
            return await self._write_done(cid, None, why)
        if c.cancelled or c.error is not None:
            return  # ending already
        if kind == "cancel":
            c.cancelled = True
            c.handle.cancel()
            return
        if c.ended:
            return self._fail(c, InvalidRequest(kind, f"context {cid!r} already got end"))
        if kind == "text":
            self._text(c, msg.text)
        elif kind == "flush":
            c.handle.push_text(TextEvent("flush", msg.flush.flush_id))
        elif not c.has_text:
            self._fail(c, InvalidRequest("text", "must not be empty or whitespace only (end came first)"))
        else:
            c.ended = True
            c.handle.push_text(TextEvent("end"))

    def _text(self, c: _Context, text: str) -> None:
        limit = self.config.max_text_chars
        c.chars += len(text)
        try:
            convert.check_text(text, "text")
            if c.chars > limit:
                raise InvalidRequest("text", f"{c.chars} characters in all exceeds the limit of {limit}")
        except InvalidRequest as e:
            return self._fail(c, e)
        if c.first_text_at is None:
            c.first_text_at = time.monotonic()
        c.has_text = c.has_text or bool(text.strip())
        c.handle.push_text(TextEvent("text", text))

    async def _open(self, cid: str, config) -> None:
        if len(self.open) >= MAX_OPEN_CONTEXTS:
            return await self._write_done(cid, None, Overloaded(
                f"at most {MAX_OPEN_CONTEXTS} contexts may be open on one call"))
        try:
            req = convert.to_context_request(config, cid, self.info, self.config)
            handle = self.worker.submit(req, asyncio.get_running_loop())
        except (InvalidRequest, Overloaded, ShuttingDown, EngineFailure, Unsupported) as e:
            return await self._write_done(cid, None, e)
        c = _Context(cid, req, handle, config.encoding or tts_pb2.AUDIO_ENCODING_PCM_S16LE)
        self.open[cid] = c
        c.task = asyncio.create_task(self._forward(c))

    def _fail(self, c: _Context, e: Exception) -> None:
        """End one context with an error; its forwarder writes the `done`."""
        log.info("context %s: %s", c.cid, e)
        c.error = error_of(e)
        c.handle.cancel()

    # ---- responses ------------------------------------------------------------------------
    async def _forward(self, c: _Context) -> None:
        rate, num_chunks, ttfc_ms, end = c.req.output_sample_rate, 0, 0.0, None
        try:
            async for ev in c.handle:
                dropped = c.cancelled or c.error is not None
                if isinstance(ev, AudioChunk):
                    if not dropped:
                        await self._write(convert.stream_chunk_message(c.cid, ev, rate, c.encoding))
                        if num_chunks == 0:
                            ttfc_ms = (time.monotonic() - c.first_text_at) * 1e3
                            self.metrics.ttfc.observe(ttfc_ms / 1e3)
                        num_chunks += 1
                    c.handle.mark_sent(ev.samples.shape[0])
                elif isinstance(ev, WordTiming):
                    if not dropped:
                        await self._write(tts_pb2.StreamSynthesizeResponse(context_id=c.cid, words=tts_pb2.WordTimings(
                            words=[tts_pb2.WordTiming(word=ev.word, sample_offset=ev.sample_offset)])))
                elif isinstance(ev, FlushAck):
                    if not dropped:
                        await self._write(tts_pb2.StreamSynthesizeResponse(
                            context_id=c.cid, flush_ack=tts_pb2.FlushAck(flush_id=ev.flush_id)))
                else:
                    end = ev
            error = c.error
            if error is None and end.finish_reason in (FinishReason.ERROR, FinishReason.IDLE_TIMEOUT):
                error = error_of(end.error)
            wall_ms = (time.monotonic() - (c.first_text_at or time.monotonic())) * 1e3
            self.metrics.audio_seconds.inc(end.num_samples / rate)
            log.info("context %s done: %s, %d frames, ttfc %.1f ms%s", c.cid, end.finish_reason.value,
                     end.num_frames, ttfc_ms, f" ({error[1]})" if error else "",
                     extra={"request_id": c.req.request_id, "finish_reason": end.finish_reason.value})
            await self._write_done(c.cid, end, error, ttfc_ms, wall_ms, num_chunks, rate)
        except asyncio.CancelledError:
            c.handle.cancel()
        except Exception:  # noqa: BLE001 - a bug here must not leave the context running
            log.exception("context %s: forwarding failed", c.cid)
            c.handle.cancel()
        finally:
            if self.open.get(c.cid) is c:
                del self.open[c.cid]
                self.finished.add(c.cid)

    async def _write_done(self, cid, end, error, ttfc_ms=0.0, wall_ms=0.0, num_chunks=0, rate=1) -> None:
        if isinstance(error, BaseException):
            error = error_of(error)
        code = error[0].name if error else "OK"
        self.metrics.requests.labels(code=code).inc()
        await self._write(convert.done_message(
            cid, end, rate, ttfc_ms, wall_ms, num_chunks,
            (error[0].value[0], error[1]) if error else None))
        self.finished.add(cid)

    async def _write(self, message) -> None:
        stall = self.config.stall_timeout_s
        async with self._lock:
            try:
                await self.stalls.run(self.call.write(message))
            except WRITE_FAILED:
                raise asyncio.CancelledError() from None  # the client hung up
            except TimeoutError:
                self._stalled = f"client read nothing for {stall:g} s; call ended"
                for c in list(self.open.values()):
                    c.handle.cancel()
                if self._reader is not None:
                    self._reader.cancel()
                raise asyncio.CancelledError() from None
