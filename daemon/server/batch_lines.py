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

A batch holds no request body in memory: each line is kept as where it lies in the input file
(`offset`, `length`) and a key to order it by (`prompt_key`), and its body is read from the file
when it is served (`read_body`). A file of 20,000 chat requests (81 MiB) is held in 15 MiB
while its batch runs, where its parsed bodies took 102 MiB (and 347 MiB to read).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, BinaryIO

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
MOST_LINES = 50_000  # OpenAI's most requests in one batch
ERRORS_LISTED = 20  # a file's faults named at most (the count says how many more)
KEY_TEXT = 256  # a prompt's first characters, kept as they are in its order key
KEY_CHUNK = 256  # ... and after them a digest of each next run of as many characters
KEY_CHUNKS = 64  # ... of so many at most (16,384 characters more: prompts alike that far are neighbours)


@dataclass(frozen=True)
class BatchLine:
    """A line of a batch's input file, as a running batch keeps it: where it lies in the file, not
    its body (read_body reads it when the line is served)."""

    number: int  # in the input file, from 1
    custom_id: str
    offset: int  # of the line's first byte in the file
    length: int  # its bytes, its end of line included
    key: tuple[str, bytes] = field(default=("", b""), compare=False, repr=False)  # prompt_key: its place in order


def read_lines(source: BinaryIO, endpoint: str, most: int = MOST_LINES) -> tuple[list[BatchLine], list[dict]]:
    """The lines of a batch input file (`source`, read from its start a line at a time) for
    `endpoint`, and the faults found (OpenAI's error objects: code, message, param, line); lines
    are returned only where there is no fault. Lines end at a newline (a carriage return before
    it is part of the end)."""
    lines: list[BatchLine] = []
    faults: list[dict] = []
    more_faults = 0
    seen: dict[str, int] = {}

    def fault(code: str, message: str, number: int | None, param: str | None = None) -> None:
        nonlocal more_faults
        if len(faults) < ERRORS_LISTED:
            faults.append({"code": code, "message": message, "param": param, "line": number})
        else:
            more_faults += 1

    source.seek(0)
    requests = sum(1 for raw in source if raw.strip())
    if not requests:
        fault("empty_file", "the file has no request in it", None)
        return [], faults
    if requests > most:
        fault("too_many_requests", f"a batch holds at most {most:,} requests, the file has {requests:,}", None)
        return [], faults
    source.seek(0)
    offset = 0
    for number, raw in enumerate(source, start=1):
        start, offset = offset, offset + len(raw)
        try:
            row = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            faults[:], more_faults = [], 0
            fault("invalid_json_line", f"the file is not UTF-8 text (byte {start + exc.start})", None)
            return [], faults
        if not row.strip():
            continue
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
        if not faults:  # (once the file is at fault, no line of it is served: none kept)
            lines.append(BatchLine(number, custom_id, start, len(raw), prompt_key(line["body"])))
    if faults:
        if more_faults:
            faults.append({"code": "too_many_errors", "message": f"{more_faults:,} more lines have faults too",
                           "param": None, "line": None})
        return [], faults
    return lines, []


def read_body(source: BinaryIO, line: BatchLine) -> dict:
    """The body of `line`, read from its input file (`source`) where read_lines found it."""
    source.seek(line.offset)
    return json.loads(source.read(line.length))["body"]


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


def prompt_text(body: dict) -> str:
    """The prompt of a line's body as text: a chat's messages, a completion's prompt, a response's
    instructions then input."""
    if "messages" in body or "prompt" in body:
        given = body.get("messages", body.get("prompt"))
    else:
        given = [body.get("instructions") or "", body.get("input")]
    return given if isinstance(given, str) else json.dumps(given, ensure_ascii=False)


def prompt_key(body: dict) -> tuple[str, bytes]:
    """What a line is served in the order of: its prompt's first KEY_TEXT characters, then an
    8-byte digest of each next KEY_CHUNK characters (KEY_CHUNKS at most). Prompts alike in their
    first characters sort as their text does; those alike further sort together, each run of
    runs alike beside the others, at a few hundred bytes a line rather than the whole prompt."""
    text = prompt_text(body)
    rest = text[KEY_TEXT:KEY_TEXT + KEY_CHUNK * KEY_CHUNKS]
    digests = b"".join(hashlib.blake2b(rest[i:i + KEY_CHUNK].encode("utf-8", "surrogatepass"), digest_size=8).digest()
                       for i in range(0, len(rest), KEY_CHUNK))
    return text[:KEY_TEXT], digests


def prompt_order(lines: list[BatchLine]) -> list[BatchLine]:
    """`lines` in the order kvd serves them: by their prompt (prompt_key), so lines that begin
    alike are neighbours; the file's order where prompts are alike."""
    return sorted(lines, key=lambda line: (line.key, line.number))
