"""The shape of kvd's and kvd router's log lines (`--log-format`): text for the journal, or one JSON
object a line for a log pipeline (Loki, Elasticsearch, Vector), with the fields a record carries
(`extra={"fields": {...}}`: a request's line, the engine's summary) as the object's own."""

from __future__ import annotations

import datetime
import json
import logging

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonLines(logging.Formatter):
    """`{"ts", "level", "logger", "message", ...fields, "exception"}` on one line. `ts` is UTC,
    RFC 3339 with milliseconds; a field never replaces one of the four."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
                .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        for key, value in (getattr(record, "fields", None) or {}).items():
            line.setdefault(key, value)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, ensure_ascii=False)


def handler_for(log_format: str, stream) -> logging.Handler:
    """A handler writing `stream` in `log_format`; ValueError naming the option otherwise."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format: must be text or json (got {log_format!r})")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonLines() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    return handler
