"""The kept replies' ids on disk across a restart (reply_ids.py), where the cache outlives kvd.

A disk or Redis tier keeps the cache's blocks through a restart, the blocks of each reply among
them. Without its ids a conversation's next turn after the restart would read the reply as text
and miss those blocks. So kvd writes the ids as it stops and reads them back as it starts:
`reply_ids.sqlite3` in the state directory (mode 0600), one row a reply (its key, tenant,
tokenizer and ids as little-endian 32-bit integers, each tenant's least recently used first),
written aside and renamed over the old file, so a crash leaves the old file or the new one. Read
back, only the replies of the tokenizer now served are kept, within `reply_ids_bytes`. A file
that cannot be read is set aside with a warning: the replies are read as text, as after any loss.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import sys
from array import array
from pathlib import Path

from kvctl.daemon.whole_file import write_whole

from .reply_ids import ReplyIds

log = logging.getLogger("kvd")

FILE_NAME = "reply_ids.sqlite3"
SCHEMA = "CREATE TABLE replies (rank INTEGER PRIMARY KEY, key TEXT, tenant TEXT, tokenizer TEXT, ids BLOB)"


def _little_endian(ids: array) -> bytes:
    if sys.byteorder == "big":
        ids = array("i", ids)
        ids.byteswap()
    return ids.tobytes()


def _from_little_endian(blob: bytes) -> array:
    ids = array("i")
    ids.frombytes(blob)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids


def save_reply_ids(replies: ReplyIds, state_dir: str | Path) -> int:
    """Writes every kept reply to `state_dir`'s file, replacing it whole; how many. OSError or
    sqlite3.Error where it cannot (the old file stays)."""
    rows = replies.kept_in_order()

    def fill(aside: Path) -> None:
        with sqlite3.connect(aside) as db:
            db.execute(SCHEMA)
            db.executemany("INSERT INTO replies (key, tenant, tokenizer, ids) VALUES (?, ?, ?, ?)",
                           ((key, tenant, space, _little_endian(ids)) for key, tenant, space, ids in rows))
        db.close()

    write_whole(Path(state_dir) / FILE_NAME, fill, errors=(OSError, sqlite3.Error), mode=0o600)
    return len(rows)


def load_reply_ids(replies: ReplyIds, state_dir: str | Path, tokenizer: str) -> int:
    """Keeps the replies `state_dir`'s file holds for `tokenizer` (its digest); how many. None
    there: 0. One that cannot be read is renamed `.unreadable` and logged; 0."""
    path = Path(state_dir) / FILE_NAME
    if not path.is_file() or not replies.keeps:
        return 0
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            rows = [(key, tenant, space, _from_little_endian(blob)) for key, tenant, space, blob in db.execute(
                "SELECT key, tenant, tokenizer, ids FROM replies WHERE tokenizer = ? ORDER BY rank", (tokenizer,))]
        db.close()
    except (sqlite3.Error, ValueError, TypeError) as exc:  # (not SQLite, another schema, a torn blob)
        aside = path.with_name(path.name + ".unreadable")
        os.replace(path, aside)
        log.warning("%s could not be read (%s): set aside as %s; chat replies sent back are read as text "
                    "until kvd keeps them again", path, exc, aside.name)
        return 0
    return replies.restore(rows)
