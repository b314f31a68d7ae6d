"""The pipe between the server's process and its engine process (`--engine-process`): batches of
small tuples, pickled, over one Unix socket (multiprocessing.connection framing).

Each side sends from one thread that takes everything queued since its last send (so a step's
hundreds of audio chunks cross in a few messages, not one each) and receives on another, so
neither side ever blocks the other on a full socket buffer.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import threading
from multiprocessing.connection import Connection
from typing import Callable

log = logging.getLogger(__name__)


class Outbox:
    """Items put from any thread, sent as lists by the outbox's own thread."""

    def __init__(self, conn: Connection, name: str):
        self._conn = conn
        self._items: list = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, item) -> None:
        with self._cond:
            if not self._closed:
                self._items.append(item)
                self._cond.notify()

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then stop (the connection stays open)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._closed:
                    self._cond.wait()
                items, self._items = self._items, []
                closed = self._closed
            if items:
                try:
                    self._conn.send(items)
                except (OSError, ValueError) as e:  # the other side is gone: its reader says so
                    log.debug("pipe send failed: %r", e)
                    with self._cond:
                        self._closed = True  # later puts are dropped, not kept
                        self._items = []
                    return
            if closed:
                return


def receive(conn: Connection, on_batch: Callable[[list], None], on_eof: Callable[[], None],
            name: str) -> threading.Thread:
    """A daemon thread that calls on_batch(items) per message and on_eof() once the pipe ends."""

    def run() -> None:
        try:
            while True:
                try:
                    items = conn.recv()
                except (EOFError, OSError):
                    break
                on_batch(items)
        finally:
            on_eof()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def die_with_parent() -> None:
    """Linux: SIGKILL this process when the thread that started it ends, however it ends."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
