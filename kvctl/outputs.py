"""Files at a path the operator names: those kvctl writes (a plot, a trace, a backup), and the
text files it reads (`read_text`).

kvctl often runs as root. A slip in such a path must not replace something else: a file already
there may only be overwritten when it is what the command writes (a PNG for a plot, a SQLite
database for a backup, a JSONL trace for a trace). Checked before the work that produces it.

    refuse_clobber(path, "plot", is_png, "a PNG", suffix=".png")
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from .errors import UserError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SQLITE_MAGIC = b"SQLite format 3\x00"


def is_png(head: bytes) -> bool:
    return head.startswith(PNG_MAGIC)


def is_sqlite(head: bytes) -> bool:
    return head.startswith(SQLITE_MAGIC)


def is_trace(head: bytes) -> bool:
    """A Mooncake-format JSONL trace: its first line is an object with hash_ids."""
    first = head.split(b"\n", 1)[0]
    try:
        return isinstance(row := json.loads(first), dict) and "hash_ids" in row
    except ValueError:
        return False


def refuse_clobber(path: Path, field: str, looks_right: Callable[[bytes], bool], what: str,
                   suffix: str | None = None) -> None:
    """Raise UserError naming `field` when writing `path` would replace a folder or a file that
    is not `what` (judged by `looks_right` on its first 64 KiB), or when `suffix` is given and
    the path does not end in it."""
    if suffix is not None and path.suffix.lower() != suffix:
        raise UserError(f"{field}: give a path ending in {suffix}, got {str(path)!r}")
    if path.is_dir():
        raise UserError(f"{field}: {str(path)!r} is a folder; give a file")
    if not path.exists():
        return
    try:
        with path.open("rb") as handle:
            head = handle.read(65536)
    except OSError as exc:
        raise UserError(f"{field}: cannot read {str(path)!r} ({exc.strerror})") from None
    if head and not looks_right(head):  # an empty file holds nothing to lose
        raise UserError(f"{field}: {str(path)!r} exists and is not {what}; it would be overwritten")


def read_text(path: Path, field: str, hint: str = "") -> str:
    """The UTF-8 text of an operator's file; UserError naming `field` when it cannot be read or is
    not UTF-8 text (`hint` follows that message)."""
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"{field}: cannot read {str(path)!r} ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise UserError(f"{field}: {str(path)!r} is not UTF-8 text" + (f"; {hint}" if hint else "")) from None
