"""Logging for every omni-mesh command: one format (text or JSON lines), and the request id on each line.

`configure()` is called once by the CLI from `--log-level` / `--log-format` (defaults from
OMNI_MESH_LOG_LEVEL / OMNI_MESH_LOG_FORMAT, which it also exports, so the processes `omni-mesh up`
starts log the same way). `request_id` is a context variable: the coordinator sets it per HTTP request
and a stage per piece of work, so every line logged on that request's behalf names it.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import re
import sys
import time

ENV_LEVEL = "OMNI_MESH_LOG_LEVEL"
ENV_FORMAT = "OMNI_MESH_LOG_FORMAT"
LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")

request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("omni_mesh_request_id", default=None)
#: A client's X-Request-Id becomes the request's id when it is this tame: it ends up in log lines and
#: connector keys.
_TAME = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def tame_request_id(value: str) -> bool:
    return _TAME.fullmatch(value) is not None


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id.get()
        return True


class _TextFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__(f"%(asctime)s {service} %(levelname)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        rid = getattr(record, "request_id", None)
        return f"{line} [request_id={rid}]" if rid else line


class _JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = getattr(record, "request_id", None)
        if rid:
            entry["request_id"] = rid
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def default_level() -> str:
    return os.environ.get(ENV_LEVEL, "info").lower()


def default_format() -> str:
    return os.environ.get(ENV_FORMAT, "text").lower()


def configure(service: str, level: str | None = None, fmt: str | None = None) -> None:
    """Log to stderr as `service`; replaces any handler set before (idempotent per process)."""
    level = (level or default_level()).lower()
    fmt = (fmt or default_format()).lower()
    if level not in LEVELS:
        raise ValueError(f"log level {level!r}: choose one of {', '.join(LEVELS)}")
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: choose one of {', '.join(FORMATS)}")
    os.environ[ENV_LEVEL], os.environ[ENV_FORMAT] = level, fmt  # children log the same way
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter(service) if fmt == "json" else _TextFormatter(service))
    handler.addFilter(_RequestIdFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))  # a line per poll is noise
    quiet_libraries(level)


#: What transformers and huggingface_hub read at import: their advice, warnings and progress bars.
_QUIET = {"TRANSFORMERS_VERBOSITY": "error", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def quiet_libraries(level: str) -> None:
    """transformers' and the hub's chatter (config warnings, load reports, progress bars) off below
    debug, in this process and its children (the variables are read at import, which comes later);
    a variable the user set is theirs."""
    if level == "debug":
        return
    for name, value in _QUIET.items():
        os.environ.setdefault(name, value)
    for name in ("transformers", "huggingface_hub"):
        logging.getLogger(name).setLevel(logging.ERROR)


class Sparse:
    """One logger's lines about one recurring condition, at most once per `interval_s` (a condition
    checked every 50 ms must not fill the log); the next line says how many were left out."""

    def __init__(self, logger: logging.Logger, interval_s: float = 60.0) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._next = 0.0
        self._unlogged = 0

    def log(self, level: int, message: str, *args: object, exc_info: bool = False) -> bool:
        """Log `message % args` at `level` if the interval has passed since the last line; whether it did."""
        now = time.monotonic()
        if now < self._next:
            self._unlogged += 1
            return False
        if self._unlogged:
            message += f" (and {self._unlogged} more like it since the last report)"
        self._logger.log(level, message, *args, exc_info=exc_info)
        self._next = now + self._interval_s
        self._unlogged = 0
        return True

    def warning(self, message: str, *args: object) -> bool:
        return self.log(logging.WARNING, message, *args)

    def exception(self, message: str, *args: object) -> bool:
        """At ERROR with the traceback of the exception being handled."""
        return self.log(logging.ERROR, message, *args, exc_info=True)
