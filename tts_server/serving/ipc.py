"""The pipe between the server's process and its engine process (`--engine-process`): batches of
small tuples, pickled, over one Unix socket (multiprocessing.connection framing).

Each side sends from one thread that takes everything queued since its last send (so a step's
hundreds of audio chunks cross in a few messages, not one each) and receives on another, so
neither side ever blocks the other on a full socket buffer. An urgent item (a request, a
stream's first audio) put while that thread has nothing to do is written by the caller itself,
without waiting: one thread wake-up less on the way to first audio (whatever the socket does not
take at once, the thread writes).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import struct
import threading
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Callable

log = logging.getLogger(__name__)

INLINE_MAX_BYTES = 1 << 16  # an urgent item larger than this is written by the thread
INLINE_GAP_S = 0.0005  # urgent items closer together than this (a burst) go through the thread too


class Outbox:
    """Items put from any thread, sent as lists by the outbox's own thread; `put(item, urgent=True)`
    writes the item from the caller's thread when nothing is queued or being sent (one
    non-blocking write; a burst of urgent items still goes through the thread).

    `shared`: an earlier Outbox whose thread sends this one's items too (one thread and one lock
    for all the pipes of a process). The engine process has a pipe per RPC process. With a
    sending and a receiving thread per pipe (eight beside the engine thread for 4 RPC processes),
    1 step in 10 of 256 streams spent 19-24 ms or more after its codec (posting the chunks), 4-5
    with one RPC process, and throughput fell 10%; with one thread each way it was 9-17 ms and
    throughput matched one RPC process's (two H100 hosts, BENCHMARKS.md session 27)."""

    def __init__(self, conn: Connection, name: str, shared: "Outbox | None" = None):
        self._conn = conn
        self._items: list = []
        self._rest = b""  # the tail of a message an urgent write left: the thread writes it first
        self._busy = False  # a send is in progress (the thread's or an urgent caller's)
        self._last_inline = 0.0
        self._closed = False
        try:  # the same socket on a second descriptor, for non-blocking writes
            self._sock = socket.socket(fileno=os.dup(conn.fileno()))
        except OSError:  # not a socket: every item through the thread
            self._sock = None
        if shared is None:
            self._cond = threading.Condition()
            self._group = [self]
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()
        else:
            with shared._cond:
                if all(b._closed for b in shared._group):
                    raise RuntimeError("the shared outbox's thread has ended")
                self._cond, self._group, self._thread = shared._cond, shared._group, shared._thread
                self._group.append(self)

    def put(self, item, urgent: bool = False) -> None:
        with self._cond:
            if self._closed:
                return
            now = time.monotonic() if urgent else 0.0
            if not (urgent and self._sock is not None and not self._busy and not self._items
                    and not self._rest and now - self._last_inline >= INLINE_GAP_S):
                self._items.append(item)
                self._cond.notify_all()
                return
            self._busy, self._last_inline = True, now
        data, sent = b"", 0
        try:
            body = ForkingPickler.dumps([item])
            data = struct.pack("!i", len(body)) + bytes(body)  # multiprocessing.connection's framing
            if len(body) <= INLINE_MAX_BYTES:  # (a larger one is all left to the thread, pickled)
                try:
                    sent = self._sock.send(data, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                except OSError as e:  # the other side is gone: its reader says so
                    log.debug("pipe send failed: %r", e)
                    data = b""
                    with self._cond:
                        self._closed = True
                        self._items = []
        finally:
            with self._cond:
                self._busy = False
                if sent < len(data):
                    self._rest = data[sent:]
                self._cond.notify_all()

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then stop (the connection stays open; a shared thread ends with
        the last of its outboxes)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            while self._pending() or self._busy:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    break
                self._cond.wait(left)
        if all(b._closed for b in self._group):
            self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._sock is not None:
            self._sock.close()

    def _pending(self) -> bool:
        return bool(self._items or self._rest)

    def _run(self) -> None:
        group = self._group
        while True:
            with self._cond:
                while True:
                    work = [b for b in group if not b._busy and b._pending()]
                    if work or all(b._closed and not b._pending() and not b._busy for b in group):
                        break
                    self._cond.wait()
                if not work:
                    self._cond.notify_all()  # (close() waiters)
                    return
                taken = []
                for b in work:
                    taken.append((b, b._items, b._rest))
                    b._items, b._rest, b._busy = [], b"", True
            for b, items, rest in taken:
                try:
                    if rest:
                        b._sock.sendall(rest)
                    if items:
                        b._conn.send(items)
                except (OSError, ValueError) as e:  # the other side is gone: its reader says so
                    log.debug("pipe send failed: %r", e)
                    with self._cond:
                        b._closed = True  # later puts are dropped, not kept
                        b._items = []
                with self._cond:
                    b._busy = False
                    self._cond.notify_all()


def receive(conn: Connection, on_batch: Callable[[list], None], on_eof: Callable[[], None],
            name: str) -> threading.Thread:
    """A daemon thread that calls on_batch(items) per message and on_eof() once the pipe ends."""
    return receive_many([(conn, on_batch, on_eof)], name)


def receive_many(pipes: list[tuple[Connection, Callable[[list], None], Callable[[], None]]],
                 name: str) -> threading.Thread:
    """Several pipes (conn, on_batch, on_eof) read by one daemon thread, as `receive` reads one:
    the engine process reads every RPC process's pipe with one thread instead of one each (see
    Outbox's `shared`). A pipe whose on_batch raises is treated as ended (its on_eof runs)."""

    def run() -> None:
        live = {conn: (on_batch, on_eof) for conn, on_batch, on_eof in pipes}
        while live:
            # one pipe: a blocking recv, without a poll before every message
            for conn in (list(live) if len(live) == 1 else wait(list(live))):
                on_batch, on_eof = live[conn]
                try:
                    items = conn.recv()
                except (EOFError, OSError):
                    del live[conn]
                    on_eof()
                    continue
                try:
                    on_batch(items)
                except Exception:  # noqa: BLE001 - a failed message ends this pipe (its on_eof runs)
                    log.exception("%s: a message failed; the pipe is closed", name)
                    del live[conn]
                    on_eof()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


class LoopReader:
    """`receive` on an asyncio loop instead of a thread: the loop reads the socket when it is
    readable (no reader thread to wake and no hand-over to the loop: the RPC process's chunks
    reach their handlers one thread hop sooner) and calls on_batch(items) per message there,
    without blocking on a message that has not fully arrived; on_eof() runs on a thread of its
    own once the pipe ends (it may wait)."""

    READ_BYTES = 1 << 20

    def __init__(self, conn: Connection, loop, on_batch: Callable[[list], None], on_eof: Callable[[], None],
                 name: str):
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))
        self._loop, self._on_batch, self._on_eof, self._name = loop, on_batch, on_eof, name
        self._buf = bytearray()
        # reads land here: a recv(READ_BYTES) allocates (mmap) and frees READ_BYTES per call,
        # ~25 us more per read than recv_into (this repo's CPU), on the loop's thread
        self._chunk = memoryview(bytearray(self.READ_BYTES))
        loop.add_reader(self._sock.fileno(), self._readable)

    def close_soon(self) -> None:
        """`close` from any thread (nothing when the loop has closed)."""
        try:
            self._loop.call_soon_threadsafe(self.close)
        except RuntimeError:  # that loop has closed
            pass

    def close(self) -> None:
        """Stop reading (on the loop's thread), without on_eof."""
        if self._sock.fileno() >= 0:
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()

    def _readable(self) -> None:
        try:
            n = self._sock.recv_into(self._chunk, self.READ_BYTES, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = 0
        if not n:
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            threading.Thread(target=self._on_eof, name=self._name, daemon=True).start()
            return
        buf = self._buf
        buf += self._chunk[:n]
        start, bodies = 0, []
        while True:  # multiprocessing.connection's framing: !i length (-1: then a !Q length)
            if len(buf) - start < 4:
                break
            n, head = struct.unpack_from("!i", buf, start)[0], 4
            if n == -1:
                if len(buf) - start < 12:
                    break
                n, head = struct.unpack_from("!Q", buf, start + 4)[0], 12
            if len(buf) - start < head + n:
                break
            bodies.append(bytes(buf[start + head:start + head + n]))
            start += head + n
        del buf[:start]  # (before the callbacks: a failing one must not see its message again)
        for body in bodies:
            try:
                self._on_batch(ForkingPickler.loads(body))
            except Exception:  # noqa: BLE001 - one bad batch; the pipe goes on
                log.exception("%s: a message from the pipe failed", self._name)


def die_with_parent() -> None:
    """Linux: SIGKILL this process when the thread that started it ends, however it ends."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
