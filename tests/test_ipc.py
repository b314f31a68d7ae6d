"""The engine process's pipe (serving/ipc.py) over a real Unix socket pair: every item arrives
once and in order whether the outbox's thread or an urgent caller wrote it, also when the
socket is full and an urgent write is cut short (the thread writes the rest); the event loop's
reader takes messages cut anywhere across reads, and reports the pipe's end."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from multiprocessing.connection import Connection

from tts_server.serving import ipc


def _pair():
    a, b = socket.socketpair()
    return Connection(a.detach()), Connection(b.detach())


class _Spy:
    """The outbox's socket, reporting each non-blocking write (bytes taken, bytes offered)."""

    def __init__(self, sock, report):
        self._sock, self._report = sock, report

    def send(self, data, flags=0):
        n = 0
        try:
            n = self._sock.send(data, flags)
            return n
        finally:
            self._report(n, len(data))

    def __getattr__(self, name):
        return getattr(self._sock, name)


def _drain(conn: Connection, n: int, timeout: float = 20.0) -> list:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        if conn.poll(0.1):
            got.extend(conn.recv())
    return got


def test_urgent_items_are_written_by_the_caller_in_order():
    ours, theirs = _pair()
    box = ipc.Outbox(ours, "test-out")
    writer = threading.current_thread()
    sent_by = []
    box._sock = _Spy(box._sock, lambda n, size: sent_by.append(threading.current_thread()))
    try:
        box.put(("submit", 1), urgent=True)  # idle outbox: written at once, by this thread
        time.sleep(2 * ipc.INLINE_GAP_S)
        box.put(("sent", 1, 1920))  # not urgent: the thread
        for i in range(2, 50):  # a burst: after the first, through the thread, still in order
            box.put(("submit", i), urgent=True)
        got = _drain(theirs, 50)
    finally:
        box.close()
    assert got == [("submit", 1), ("sent", 1, 1920)] + [("submit", i) for i in range(2, 50)]
    assert sent_by and sent_by[0] is writer


def test_an_urgent_write_into_a_full_socket_is_finished_by_the_thread():
    ours, theirs = _pair()
    box = ipc.Outbox(ours, "test-out")
    try:
        bigs = [bytes([i]) * 60_000 for i in range(40)]  # (distinct: pickle would share one)
        for i in range(40):  # ~2.4 MB queued: more than the socket holds while nobody reads
            box.put(("a", i, bigs[i]))
        deadline = time.monotonic() + 10
        while (box._items or not box._busy) and time.monotonic() < deadline:
            time.sleep(0.01)  # the thread is blocked in a write
        assert box._busy
        # an urgent item now waits for the thread (busy): order kept
        box.put(("a", 99, b"y" * 30_000), urgent=True)
        got = _drain(theirs, 41)
        assert [g[1] for g in got] == list(range(40)) + [99]
        assert [g[2] for g in got[:40]] == bigs and got[40][2] == b"y" * 30_000
        # the outbox idle again and the socket nearly full: an urgent write is cut short, and
        # its rest follows before anything put after it
        filler = socket.socket(fileno=ours.fileno())  # the same socket, to fill its buffer
        try:
            filler.setblocking(False)
            junk = 0
            try:
                while True:
                    junk += filler.send(b"\0" * 4096)
            except BlockingIOError:
                pass
        finally:
            filler.setblocking(True)
            filler.detach()
        time.sleep(2 * ipc.INLINE_GAP_S)
        wrote = []
        box._sock = _Spy(box._sock, lambda n, size: wrote.append((n, size)))
        box.put(("a", 100, b"z" * 50_000), urgent=True)
        assert len(wrote) == 1 and wrote[0][0] < wrote[0][1]  # cut short: the thread owes the rest
        box.put(("ev", 100, "end"))
        raw = theirs._recv(junk)  # what the filler wrote (not framed)
        assert raw.getbuffer().nbytes == junk
        got = _drain(theirs, 2)
        assert got == [("a", 100, b"z" * 50_000), ("ev", 100, "end")]
    finally:
        box.close()


def test_the_loop_reader_takes_messages_split_across_reads_and_reports_the_end():
    ours, theirs = _pair()
    items = [[("a", i, bytes([i % 256]) * (7 + 37_000 * (i % 5)))] for i in range(60)]
    items.append([("big", b"b" * (3 << 20))])  # larger than one read

    async def run():
        loop = asyncio.get_running_loop()
        got, ended = [], loop.create_future()
        reader = ipc.LoopReader(ours, loop, got.append,
                                lambda: loop.call_soon_threadsafe(ended.set_result, True), "test-eof")

        def write():  # a raw byte stream cut at odd places, as the socket may deliver it
            data = b"".join(
                struct.pack("!i", len(b)) + bytes(b)
                for b in (ipc.ForkingPickler.dumps(x) for x in items))
            sock = socket.socket(fileno=theirs.fileno())
            try:
                for i in range(0, len(data), 10_007):
                    sock.sendall(data[i:i + 10_007])
            finally:
                sock.detach()
            theirs.close()

        await asyncio.to_thread(write)
        await asyncio.wait_for(ended, 20)
        assert reader._sock.fileno() == -1  # closed at the end
        return got

    assert asyncio.run(run()) == items


def test_outboxes_sharing_one_thread_deliver_each_pipe_in_order_and_close_one_at_a_time():
    pairs = [_pair() for _ in range(3)]
    first = ipc.Outbox(pairs[0][0], "test-out")
    boxes = [first] + [ipc.Outbox(ours, "test-out", shared=first) for ours, _ in pairs[1:]]
    assert len({b._thread for b in boxes}) == 1  # one sending thread for the three pipes
    n = 300
    big = bytes(range(256)) * 200  # some large items, so that sends block and interleave

    def producer(i):
        for j in range(n):
            boxes[i].put(("a", i, j, big if j % 50 == 0 else b""), urgent=(j % 7 == 0))

    try:
        threads = [threading.Thread(target=producer, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        got = [_drain(theirs, n) for _, theirs in pairs]
        for t in threads:
            t.join()
        for i in range(3):  # every item once, in order, on its own pipe
            assert [(g[1], g[2]) for g in got[i]] == [(i, j) for j in range(n)]
        boxes[1].close()  # the shared thread keeps sending for the others
        assert first._thread.is_alive()
        boxes[2].put(("after", 2))
        boxes[1].put(("dropped", 1))  # closed: dropped
        assert _drain(pairs[2][1], 1) == [("after", 2)]
        assert not pairs[1][1].poll(0.2)
        boxes[0].put(("last", 0))
        boxes[0].close()
        boxes[2].close()
        assert _drain(pairs[0][1], 1) == [("last", 0)]
        first._thread.join(5)
        assert not first._thread.is_alive()  # ended with the last of its outboxes
    finally:
        for b in boxes:
            b.close(timeout=1)


def test_receive_many_reads_every_pipe_on_one_thread_and_ends_each_on_its_own():
    pairs = [_pair() for _ in range(3)]
    got = [[] for _ in pairs]
    ended = [threading.Event() for _ in pairs]
    threads_seen = set()

    def on_batch(i):
        def f(items):
            threads_seen.add(threading.current_thread())
            got[i].extend(items)
        return f

    ipc.receive_many([(ours, on_batch(i), ended[i].set) for i, (ours, _) in enumerate(pairs)], "test-in")
    for j in range(100):
        for i, (_, theirs) in enumerate(pairs):
            theirs.send([("m", i, j)])
    pairs[1][1].close()  # one pipe ends: its on_eof, the others go on
    assert ended[1].wait(10) and not ended[0].is_set() and not ended[2].is_set()
    pairs[0][1].send([("m", 0, 100)])
    deadline = time.monotonic() + 10
    while len(got[0]) < 101 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got[0] == [("m", 0, j) for j in range(101)]
    assert got[1] == [("m", 1, j) for j in range(100)] and got[2] == [("m", 2, j) for j in range(100)]
    assert len(threads_seen) == 1
    pairs[0][1].close()
    pairs[2][1].close()
    assert ended[0].wait(10) and ended[2].wait(10)
