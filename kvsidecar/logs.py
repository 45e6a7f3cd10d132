"""How `kvsidecar serve` writes its output: every line on stderr, in one format.

`--log-format text`: `<time> <LEVEL> <logger>: <message>`, one line each.
`--log-format json`: one JSON object per line with `ts` (ISO 8601, UTC),
`level`, `logger` and `message`, plus the record's `fields` (the start-up
line adds `instance`, `endpoint`, `pid`, `tiers`, ...).

Records below `--log-level` are dropped, except the start-up and stop lines
(`lifecycle`), which programs that start a sidecar wait for: they are always
written, at level INFO. In json, warnings and uncaught exceptions are records
too, so that every line of the output parses.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
import threading
import types
from collections.abc import Mapping
from typing import Any, TextIO

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
LOGGER = "kvsidecar"
"""The daemon's logger: every module of the sidecar logs under this name."""

_LIFECYCLE = "kvsidecar_lifecycle"
_FIELDS = "kvsidecar_fields"


def lifecycle(message: str, fields: Mapping[str, Any] | None = None) -> None:
    """Log a start-up or stop line: INFO, written whatever the level."""
    extra = {_LIFECYCLE: True, _FIELDS: dict(fields or {})}
    logging.getLogger(LOGGER).info("%s", message, extra=extra)


class _LevelOrLifecycle(logging.Filter):
    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level or bool(getattr(record, _LIFECYCLE, False))


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
        out: dict[str, Any] = {
            "ts": ts.isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update(getattr(record, _FIELDS, {}))
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure(level: str, fmt: str, stream: TextIO | None = None) -> None:
    """Send every record to `stream` (stderr) as `fmt`, dropping those below
    `level` but the lifecycle lines; replaces any handler set before."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(_LevelOrLifecycle(getattr(logging, level.upper())))
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    # Records are made at every level the handler may want; the filter decides.
    root.setLevel(min(logging.INFO, getattr(logging, level.upper())))
    if fmt == "json":
        logging.captureWarnings(True)
        sys.excepthook = _log_uncaught
        threading.excepthook = _log_uncaught_in_thread


def _log_uncaught(
    kind: type[BaseException], value: BaseException, tb: types.TracebackType | None
) -> None:
    logging.getLogger(LOGGER).critical("uncaught exception", exc_info=(kind, value, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_value is None or isinstance(args.exc_value, SystemExit):
        return
    logging.getLogger(LOGGER).critical(
        "uncaught exception in thread %s",
        args.thread.name if args.thread else "?",
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
    )
