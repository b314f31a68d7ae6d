#!/usr/bin/env python
"""One c = 1 request's hand-overs between the server's processes and threads, as a table
(session 25, BENCHMARKS.md). Three steps:

  python3 scripts/c1_hops.py instrument TREE   # adds marks to a COPY of a tree (edits its files!)
  # serve from that copy with HOP_DIR=<dir> (each process appends <dir>/hops-PID.log), run c = 1
  python3 scripts/c1_hops.py table DIR [CLIENT.json]   # p50 of each hop over the requests
  python3 scripts/c1_hops.py client ADDRESS N CLIENT.json  # c = 1 calls with the client's send and
                                                           # first-audio times, for `table`

On a GPU (both trees instrumented on the device's copy, then the same-host A/B):
  python3 scripts/c1_hops.py instrument .base && python3 scripts/c1_hops.py instrument . &&
  BASE=.base BASE_ENV=HOP_DIR=/tmp/hb NEW_ENV=HOP_DIR=/tmp/hn BASE_ARGS="--max-streams 32"
  NEW_ARGS="--max-streams 32" ROUNDS=4 STREAMS=0 bash scripts/gpu_server_ab.sh;
  python3 scripts/c1_hops.py table /tmp/hb; python3 scripts/c1_hops.py table /tmp/hn
The marks are CLOCK_MONOTONIC (one clock for every process of the host); the anchors are lines of
the serving code, so `instrument` fails loudly when they move.
"""

import collections
import glob
import json
import os
import statistics
import sys

ORDER = ["S_start", "R_submit", "E_recv_submit", "L_enqueued", "L_woke", "L_step", "L_prepared", "L_run",
         "L_codec", "E_post", "R_recv_a", "R_deliver", "S_got", "S_written"]


HOP_MODULE = """import os, time
_f = None


def mark(name, sid=None):
    global _f
    if _f is None:
        _f = open(os.path.join(os.environ.get("HOP_DIR", "/tmp"), f"hops-{os.getpid()}.log"), "a", buffering=1)
    _f.write(f"{time.monotonic():.7f} {name} {sid}\\n")
"""
M = "from .. import _hop; _hop.mark"
EDITS = {  # file -> (anchor, replacement) pairs
    "tts_server/serving/engine_process.py": [
        ("        if isinstance(event, AudioChunk) and event.samples.dtype == np.float32:\n",
         "        if isinstance(event, AudioChunk) and event.samples.dtype == np.float32:\n"
         "            if event.sequence_number == 0:\n                %s('E_post', self.sid)\n" % M),
        ("    def _submit(self, sid: int, request, submitted_at: float) -> None:\n",
         "    def _submit(self, sid: int, request, submitted_at: float) -> None:\n        %s('E_recv_submit', sid)\n" % M)],
    "tts_server/serving/remote.py": [
        ('            if kind == "a":\n                handle = self._handles.get(item[1])',
         '            if kind == "a":\n                if item[5] == 0:\n                    %s("R_recv_a", item[1])\n'
         '                handle = self._handles.get(item[1])' % M),
        ('        """On the event loop: an event from the engine."""\n',
         '        """On the event loop: an event from the engine."""\n'
         '        if isinstance(event, AudioChunk) and event.sequence_number == 0:\n            %s("R_deliver", self.sid)\n' % M),
        ('        self._outbox.put(("submit", handle.sid',
         '        %s("R_submit", handle.sid)\n        self._outbox.put(("submit", handle.sid' % M)],
    "tts_server/rpc/servicer.py": [
        ("                if isinstance(event, AudioChunk):\n                    data =",
         "                if isinstance(event, AudioChunk):\n                    if num_chunks == 0:\n"
         "                        %s('S_got', 0)\n                    data =" % M),
        ("                    handle.mark_sent(event.samples.shape[0])\n                    if num_chunks == 0:\n"
         "                        now = time.monotonic()",
         "                    handle.mark_sent(event.samples.shape[0])\n                    if num_chunks == 0:\n"
         "                        now = time.monotonic()\n                        %s('S_written', 0)" % M),
        ("    async def _synthesize(self, request, context, request_id: str):\n        t0 = time.monotonic()",
         "    async def _synthesize(self, request, context, request_id: str):\n        t0 = time.monotonic()\n"
         "        %s('S_start', 0)" % M)],
    "tts_server/serving/loop.py": [
        ('        stream.timings["queue_ms"] = (now - handle.submitted_at) * 1e3  # submitted -> this step',
         '        stream.timings["queue_ms"] = (now - handle.submitted_at) * 1e3  # submitted -> this step\n'
         '        %s("L_prepared", 0)' % M),
        ("        step.t_codec = time.monotonic()", "        step.t_codec = time.monotonic()\n        %s('L_codec', 0)" % M),
        ("            self._outstanding += 1\n            self._incoming.append(handle)",
         "            self._outstanding += 1\n            %s('L_enqueued', 0)\n            self._incoming.append(handle)" % M),
        ("                self._kicked = False\n                if self._stopping",
         "                self._kicked = False\n                if self._incoming:\n                    %s('L_woke', 0)\n"
         "                if self._stopping" % M),
        ("    def _step(self, plan) -> None:\n        t0 = time.monotonic()",
         "    def _step(self, plan) -> None:\n        t0 = time.monotonic()\n        if plan.admit:\n            %s('L_step', 0)" % M),
        ("            out = self.engine.run(StepPlan(",
         "            if admitted:\n                %s('L_run', 0)\n            out = self.engine.run(StepPlan(" % M)],
}


def instrument(root: str) -> None:
    with open(os.path.join(root, "tts_server/_hop.py"), "w") as f:
        f.write(HOP_MODULE)
    for path, pairs in EDITS.items():
        p = os.path.join(root, path)
        s = open(p).read()
        for a, b in pairs:
            assert a in s, f"{path}: anchor not found: {a[:60]!r}"
            s = s.replace(a, b, 1)
        with open(p, "w") as f:
            f.write(s)
    print("instrumented", root)


def table(d: str, client_json: str | None = None) -> None:
    ev = []
    for f in glob.glob(f"{d}/hops-*.log"):
        for line in open(f):
            t, name, _ = line.split()
            ev.append((float(t), name))
    ev.sort()
    reqs, cur = [], None
    for t, name in ev:  # a request: its handler's start, then the first of each mark after it
        if name == "S_start":
            cur = {"S_start": t}
            reqs.append(cur)
        elif cur is not None and name not in cur:
            cur[name] = t
    order = [k for k in ORDER if any(k in r for r in reqs)]
    rows = collections.defaultdict(list)
    for r in reqs[4:]:  # (the warm-up requests out)
        if all(k in r for k in order):
            for a, b in zip(order, order[1:]):
                rows[(a, b)].append((r[b] - r[a]) * 1e3)
    print(d, "requests", len(reqs))
    for (a, b), v in rows.items():
        print(f"  {a:>14} -> {b:<14} p50 {statistics.median(v):7.3f} ms")
    if client_json:  # client times: send -> S_start, S_written -> first audio at the client
        starts = [r for r in reqs if "S_start" in r and "S_written" in r]
        a, b, tot = [], [], []
        for t0, t1 in json.load(open(client_json)):
            r = min(starts, key=lambda r: abs(r["S_start"] - t0))
            if 0 < r["S_start"] - t0 < 0.05:
                a.append((r["S_start"] - t0) * 1e3)
                b.append((t1 - r["S_written"]) * 1e3)
                tot.append((t1 - t0) * 1e3)
        print(f"  client send -> S_start p50 {statistics.median(a):.3f} ms; S_written -> client first audio "
              f"p50 {statistics.median(b):.3f} ms; client TTFC p50 {statistics.median(tot):.3f} ms (n={len(a)})")


def client(addr: str, n: int, out: str) -> None:
    import asyncio
    import time

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tts_client.client import TTSClient, build_request
    from tts_client.workloads import ENGLISH

    async def run():
        texts = [u.text for u in ENGLISH]
        recs = []
        async with TTSClient(addr) as c:
            for i in range(n):
                req = build_request(texts[i % len(texts)], seed=i, max_duration_s=0.5)
                t0, first = time.monotonic(), None
                async for msg in c.stream(req):
                    if first is None and msg.HasField("audio"):
                        first = time.monotonic()
                recs.append((t0, first))
                await asyncio.sleep(0.02)
        json.dump(recs, open(out, "w"))

    asyncio.run(run())


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "instrument":
        instrument(*args)
    elif cmd == "table":
        table(*args)
    elif cmd == "client":
        client(args[0], int(args[1]), args[2])
    else:
        raise SystemExit(__doc__)
