"""An extra RPC process (`tts-server --rpc-processes N`): the same gRPC server on the same port
(SO_REUSEPORT: the kernel spreads connections over the processes), so that call set-up and chunk
writes, which cost ~2 ms of event-loop time per call in grpc.aio, run on several cores; and the
HTTP API on the server's HTTP port, the same way.

Started by the server process (serving/remote.py) as `python -m tts_server.serving.frontend FD`,
the ServerConfig pickled on stdin; FD is its pipe to the engine process. It has no metrics port
of its own: its calls' series go to the server process every 0.5 s. It drains on
SIGTERM / SIGINT as the server does, and exits 70 if the engine process goes.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
from multiprocessing.connection import Connection

from .. import aio
from ..logs import setup_logging
from ..memory_plan import StartupError
from .ipc import die_with_parent
from .remote import RemoteWorker

CALLS_PERIOD_S = 0.5


def _send_calls(worker: RemoteWorker) -> None:
    while True:
        time.sleep(CALLS_PERIOD_S)
        worker.send(("calls", worker.metrics.calls_snapshot()))


def main() -> None:
    die_with_parent()
    config = pickle.load(sys.stdin.buffer)
    setup_logging(config.log_level, config.log_format)
    from ..rpc.server import TTSServer

    try:
        worker = RemoteWorker.connect(None, Connection(int(sys.argv[1])), exact_admission=False)
    except StartupError as e:
        logging.getLogger("tts_server").critical("RPC process: cannot start: %s", e)
        raise SystemExit(2) from None
    threading.Thread(target=_send_calls, args=(worker,), name="tts-rpc-calls", daemon=True).start()
    # as the server process: no full collection over the imports stops this process's calls
    logging.getLogger("tts_server").info("RPC process: %d start-up objects frozen out of the garbage "
                                         "collector", aio.freeze_start_up_objects())

    async def serve() -> int:  # (grpc.aio binds its server to the loop it is made in)
        worker.start()  # the engine's events read on this loop
        return await TTSServer(worker, worker.info, config).serve_forever()

    code = aio.run(serve(), config.event_loop)
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    main()
