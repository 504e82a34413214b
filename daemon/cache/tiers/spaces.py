"""Block spaces by name: the model revision, tokenizer, format and scales behind a space digest.

A payload carries its space digest (the namespace without the tenant, hashed: see
`space_digest`), never the fields behind it. So each daemon records the fields of the space it
serves where its blocks go: in `spaces.json` in its disk tier's folder (`SpaceBook`) and in the
hash `kvctl:spaces` on a shared Redis (`RemoteTier.record_space`). An operator can then name
another revision's blocks by the revision: those a model upgrade set aside on disk, and those the
daemons that served it left on the shared Redis (`kvctl evict --model-revision`), and
`kvctl tiers` says whose blocks were set aside.

A record is plain JSON, written once per space; one that does not parse is skipped, never trusted.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from kvctl.daemon.whole_file import write_json_whole

RECORD_FIELDS = ("model_revision", "tokenizer_digest", "adapter_id", "position_policy", "multimodal_digest",
                 "cache_dtype", "scale_version", "block_size")
REGISTRY_KEY = b"kvctl:spaces"  # the shared Redis's hash: space digest (hex) -> record (JSON)


def space_record(namespace_fields: dict, layout_description: str) -> dict:
    """What to record of a space: its namespace's fields but the tenant, its payload layout, and
    when it was first recorded (wall-clock seconds)."""
    record = {name: namespace_fields[name] for name in RECORD_FIELDS}
    record.update({"layout": layout_description, "recorded_at": time.time()})
    return record


def parse_record(text: str | bytes) -> dict | None:
    """A record read back, or None where it is not one (it is skipped)."""
    try:
        record = json.loads(text)
    except (ValueError, UnicodeDecodeError):
        return None
    return record if is_record(record) else None


def is_record(record) -> bool:
    return isinstance(record, dict) and isinstance(record.get("model_revision"), str)


def is_space_hex(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def with_revision(records: dict[str, dict], revision: str) -> dict[str, dict]:
    """The records whose model revision starts with `revision` (hex digits)."""
    return {space: r for space, r in records.items() if r["model_revision"].startswith(revision)}


def summary(space: str, record: dict | None) -> dict:
    """A space as an operator reads it: the first 16 hex digits, and what it is where known."""
    out = {"space": space[:16]}
    if record is not None:
        out.update({k: record.get(k) for k in ("model_revision", "cache_dtype", "scale_version", "block_size")})
    return out


class SpaceBook:
    """`spaces.json` in a disk tier's folder: the record of every space whose blocks it held.
    Only the daemon holding the folder's lock writes it; each write replaces the file whole
    (written aside, fsynced, renamed), so a crash leaves the old book or the new one."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def load(self) -> dict[str, dict]:
        try:
            raw = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(raw, dict):
            return {}
        return {space: record for space, record in raw.items() if is_space_hex(space) and is_record(record)}

    def add(self, space: bytes, record: dict) -> None:
        """Record a space (kept as first recorded when it is there already)."""
        book = self.load()
        if space.hex() in book:
            return
        book[space.hex()] = record
        write_json_whole(self.path, book)
