"""Structured JSON logs (``log_json``): one JSON object per line, carrying the attempt id
of the attempt that logged it (a context variable the pipeline sets), so a log line, a
trace and a ledger record can be joined on ``attempt_id``."""

from __future__ import annotations

import contextvars
import json
import logging
import time

ATTEMPT_LOGGER = "service.attempts"
# The attempt being served by the current task ("" outside an attempt).
current_attempt_id: contextvars.ContextVar[str] = contextvars.ContextVar("attempt_id", default="")

# Attributes every LogRecord has; anything else passed with ``extra=`` becomes a JSON field.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        attempt_id = getattr(record, "attempt_id", "") or current_attempt_id.get()
        if attempt_id:
            out["attempt_id"] = attempt_id
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in out:
                out[key] = value if isinstance(value, (str, int, float, bool)) or value is None else str(value)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure_logging(json_lines: bool, level: int = logging.INFO) -> None:
    """Root logging for ``serve``: JSON lines when asked, else the readable default."""
    handler = logging.StreamHandler()
    if json_lines:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # One line per finished attempt (outcome, stopping reason, latency) in JSON mode.
    logging.getLogger(ATTEMPT_LOGGER).setLevel(logging.DEBUG if json_lines else logging.WARNING)
