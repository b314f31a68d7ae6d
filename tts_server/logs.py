"""Logging set-up: human-readable text (default) or one JSON object per line (`--log-format json`,
via python-json-logger) for log pipelines. Every record carries `request_id`: the RPC's id
while a Synthesize call is being handled (a context variable), or the one a log call passes in
`extra`. Request text and reference audio are never logged at INFO or above; only their sizes.
Timestamps are ISO 8601 in UTC; Python warnings and what imported libraries print while being
imported go through the same handler, so `--log-format json` writes JSON lines only.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import logging
import os
import sys
import tempfile
import threading

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def iso_utc(created: float) -> str:
    """2026-11-24T23:25:08.388Z: ISO 8601, UTC, milliseconds."""
    t = datetime.datetime.fromtimestamp(created, tz=datetime.timezone.utc)
    return t.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class UtcFormatter(logging.Formatter):
    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return iso_utc(record.created)


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id_var.get()
        return True


def json_formatter() -> logging.Formatter:
    from pythonjsonlogger.json import JsonFormatter

    class UtcJsonFormatter(JsonFormatter):
        def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
            return iso_utc(record.created)

    # pid: the server process, its engine process and extra RPC processes share one stderr
    return UtcJsonFormatter("{asctime}{levelname}{name}{message}{request_id}{process}", style="{",
                            rename_fields={"asctime": "time", "levelname": "level",
                                           "name": "logger", "process": "pid"}, timestamp=False)


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    if fmt not in ("text", "json"):
        raise ValueError(f"log format {fmt!r}: choose text or json")
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(json_formatter() if fmt == "json" else UtcFormatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.captureWarnings(True)  # warnings.warn() from libraries: a log record, not raw stderr
    if fmt == "json":  # a crash, too, is one JSON record (its traceback in `exc_info`)
        sys.excepthook = _log_uncaught
        threading.excepthook = lambda a: _log_uncaught(a.exc_type, a.exc_value, a.exc_traceback,
                                                       a.thread)
    # The `sox` package (imported by qwen-tts's unused 25 Hz tokenizer) warns that the sox binary
    # is missing; nothing here calls sox.
    logging.getLogger("sox").setLevel(logging.ERROR)


def _log_uncaught(kind, value, tb, thread=None) -> None:
    if kind is SystemExit:
        return
    where = f" in thread {thread.name}" if thread is not None else ""
    logging.getLogger("tts_server").critical("uncaught %s%s: %s", kind.__name__, where, value,
                                             exc_info=(kind, value, tb))


@contextlib.contextmanager
def quiet_imports(logger: str = "tts_server.imports"):
    """Captures what the process writes to stdout and stderr (file descriptors 1 and 2, so child
    shells too) while the block runs, and logs it at DEBUG (at ERROR if the block raised): qwen-tts
    prints a flash-attn banner and its sox dependency runs `sox -h` through a shell when imported."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    failed = True
    with tempfile.TemporaryFile(mode="w+b") as sink:
        try:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            yield
            failed = False
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            sink.seek(0)
            text = sink.read().decode(errors="replace").strip()
            if text:
                logging.getLogger(logger).log(logging.ERROR if failed else logging.DEBUG,
                                              "output while importing: %s", text)
