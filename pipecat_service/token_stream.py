"""Token mode of QwenTTSService: one StreamSynthesize call per service carries one server context
per Pipecat turn. LLM text goes out as it comes (no sentence aggregation); audio, word timings and
each context's end come back on a receive task and are routed into Pipecat's audio contexts."""

from __future__ import annotations

import asyncio

import grpc
from loguru import logger

from tts_client.client import TTSClient


class TokenStream:
    """The call and the contexts open on it. `on_message(msg)` and `on_failure(error, ids)` are
    the service's handlers (run on the receive task)."""

    def __init__(self, on_message, on_failure, timeout_s: float | None):
        self._on_message, self._on_failure = on_message, on_failure
        self._timeout_s = timeout_s
        self._call = None
        self._task: asyncio.Task | None = None
        self.open: set[str] = set()  # contexts configured and not yet done
        self._ended: set[str] = set()  # ...of which the text has ended

    async def send_text(self, client: TTSClient, context_id: str, text: str, config) -> None:
        """Text for `context_id`, opening the call and the context first when needed."""
        if self._call is None:
            self._call = client.text_stream(timeout=self._timeout_s)
            self._task = asyncio.create_task(self._receive(self._call))
        if context_id not in self.open:
            self.open.add(context_id)
            await self._call.open(context_id, config())
        await self._call.text(context_id, text)

    async def end(self, context_id: str | None) -> None:
        """No more text for the context (the LLM's reply is complete)."""
        if self._call is not None and context_id in self.open and context_id not in self._ended:
            self._ended.add(context_id)
            await self._call.end(context_id)

    async def cancel(self, context_id: str) -> None:
        """Stop the context on the server now (an interruption)."""
        if self._call is not None and context_id in self.open:
            self._forget(context_id)
            await self._call.cancel(context_id)

    def done(self, context_id: str) -> None:
        self._forget(context_id)

    def _forget(self, context_id: str) -> None:
        self.open.discard(context_id)
        self._ended.discard(context_id)

    async def _receive(self, call) -> None:
        try:
            async for msg in call:
                await self._on_message(msg)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                await self._on_failure(e, sorted(self.open))
        except Exception as e:  # noqa: BLE001 - a handler bug must not kill the call silently
            logger.exception("token stream receive failed")
            await self._on_failure(e, sorted(self.open))
        finally:
            if self._call is call:
                self._call = None
                self.open.clear()
                self._ended.clear()

    async def close(self) -> None:
        """Idempotent: abort the call and stop the receive task."""
        call, task, self._call, self._task = self._call, self._task, None, None
        self.open.clear()
        self._ended.clear()
        if call is not None:
            call.abort()
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass


def status_code(value: int) -> grpc.StatusCode | None:
    """A google.rpc.Code value (ContextDone.error_code) as a grpc.StatusCode."""
    return next((c for c in grpc.StatusCode if c.value[0] == value), None)
