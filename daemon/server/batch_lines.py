"""A batch's input file read and checked (OpenAI's Batch API format), and the order kvd serves
its lines in.

Each line is a JSON object: `custom_id` (a string, unique in the file), `method` "POST", `url`
the batch's endpoint, and `body` the request that endpoint takes. A file with a line that is
not so fails the batch as a whole before any line is served, each fault named by its line number
(OpenAI's `errors` list), as OpenAI's validation does.

kvd serves the lines in the order of their prompts, not of the file: lines that begin alike (a
shared system prompt, a shared document) come one after another, so the prefix cache computes
what they share once while it is held, rather than once per line wherever the file scattered
them. The output file is written in the input's order all the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
MOST_LINES = 50_000  # OpenAI's most requests in one batch
ERRORS_LISTED = 20  # a file's faults named at most (the count says how many more)


@dataclass(frozen=True)
class BatchLine:
    number: int  # in the input file, from 1
    custom_id: str
    body: dict


def read_lines(content: bytes, endpoint: str, most: int = MOST_LINES) -> tuple[list[BatchLine], list[dict]]:
    """The lines of a batch input file for `endpoint`, and the faults found (OpenAI's error
    objects: code, message, param, line); lines are returned only where there is no fault."""
    lines: list[BatchLine] = []
    faults: list[dict] = []
    seen: dict[str, int] = {}

    def fault(code: str, message: str, number: int | None, param: str | None = None) -> None:
        faults.append({"code": code, "message": message, "param": param, "line": number})

    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        fault("invalid_json_line", f"the file is not UTF-8 text (byte {exc.start})", None)
        return [], faults
    rows = [(n, row) for n, row in enumerate(text.splitlines(), start=1) if row.strip()]
    if not rows:
        fault("empty_file", "the file has no request in it", None)
        return [], faults
    if len(rows) > most:
        fault("too_many_requests", f"a batch holds at most {most:,} requests, the file has {len(rows):,}", None)
        return [], faults
    for number, row in rows:
        try:
            line = json.loads(row)
        except ValueError:
            fault("invalid_json_line", f"line {number} is not JSON", number)
            continue
        problem = _problem(line, endpoint)
        if problem is not None:
            fault(problem[0], f"line {number}: {problem[1]}", number, problem[2])
            continue
        custom_id = line["custom_id"]
        if custom_id in seen:
            fault("duplicate_custom_id", f"line {number}: custom_id {custom_id!r} is the custom_id of line "
                                         f"{seen[custom_id]} too; each request's must be its own", number,
                  "custom_id")
            continue
        seen[custom_id] = number
        lines.append(BatchLine(number, custom_id, line["body"]))
    if faults:
        kept = faults[:ERRORS_LISTED]
        if len(faults) > ERRORS_LISTED:
            kept.append({"code": "too_many_errors", "message": f"{len(faults) - ERRORS_LISTED:,} more lines have "
                                                               "faults too", "param": None, "line": None})
        return [], kept
    return lines, []


def _problem(line: Any, endpoint: str) -> tuple[str, str, str | None] | None:
    """(code, what is wrong, param) of one line, or None."""
    if not isinstance(line, dict):
        return "invalid_request", "must be a JSON object with custom_id, method, url and body", None
    extra = sorted(set(line) - {"custom_id", "method", "url", "body"})
    if extra:
        return "invalid_request", f"unknown field {extra[0]!r}: a line has custom_id, method, url and body", extra[0]
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 512:
        return "invalid_request", f"custom_id must be a string of 1 to 512 characters, got {custom_id!r}", "custom_id"
    if line.get("method") != "POST":
        return "invalid_request", f"method must be 'POST', got {line.get('method')!r}", "method"
    if line.get("url") != endpoint:
        return "invalid_url", f"url must be the batch's endpoint {endpoint!r}, got {line.get('url')!r}", "url"
    body = line.get("body")
    if not isinstance(body, dict):
        return "invalid_request", f"body must be a JSON object, got {type(body).__name__}", "body"
    if body.get("stream"):
        return "invalid_request", "body.stream: a batch's answers are written to its output file, not streamed; " \
                                  "leave stream out", "body.stream"
    if body.get("background"):
        return "invalid_request", "body.background: a batch's requests are served while their caller is away " \
                                  "already; leave background out", "body.background"
    return None


def prompt_order(lines: list[BatchLine]) -> list[BatchLine]:
    """`lines` in the order kvd serves them: by their prompt's text (a chat's messages, a
    completion's prompt, a response's instructions then input), so lines that begin alike are
    neighbours; the file's order where prompts are equal."""
    def prompt_of(line: BatchLine) -> str:
        body = line.body
        if "messages" in body or "prompt" in body:
            given = body.get("messages", body.get("prompt"))
        else:
            given = [body.get("instructions") or "", body.get("input")]
        return given if isinstance(given, str) else json.dumps(given, ensure_ascii=False)

    return sorted(lines, key=lambda line: (prompt_of(line), line.number))
