"""Logging set-up: human-readable text (default) or one JSON object per line (`--log-format json`,
via python-json-logger) for log pipelines. Every record carries `request_id`: the RPC's id
while a Synthesize call is being handled (a context variable), or the one a log call passes in
`extra`. Request text and reference audio are never logged at INFO or above; only their sizes.
"""

from __future__ import annotations

import contextvars
import logging

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id_var.get()
        return True


def json_formatter() -> logging.Formatter:
    from pythonjsonlogger.json import JsonFormatter

    return JsonFormatter("{asctime}{levelname}{name}{message}{request_id}", style="{",
                         rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
                         timestamp=False)


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    if fmt not in ("text", "json"):
        raise ValueError(f"log format {fmt!r}: choose text or json")
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(json_formatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
