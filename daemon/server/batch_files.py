"""The files OpenAI's Files API keeps (`/v1/files`), as the Batch API uses them: a batch's input
(purpose "batch") and what kvd writes back (its output and errors, "batch_output").

Each file is two files in `state_dir/files`: `<id>.data` (the bytes) and `<id>.json` (whose it
is, its name, purpose, size and time), each written whole (whole_file.py) with the data first, so
a crash leaves a file listed whole or not at all (a data file with no record beside it is
removed at the next start). Each tenant lists, reads and deletes its own files only.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from kvctl.daemon.whole_file import write_json_whole, write_whole

from .calls import ServiceError

EXPIRY_SECONDS = (3600, 2_592_000)  # OpenAI's shortest and longest expires_after: 1 h, 30 d
PURPOSES = ("batch",)  # what a caller may upload a file for
WRITTEN_PURPOSES = ("batch_output",)  # what kvd writes files for


class FileError(ServiceError):
    """A request about files that cannot be met: `status` (400, 404 or 409), `param` the field at
    fault; kvd's app answers it in OpenAI's error shape, as any ServiceError."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(status, message, param)


@dataclass(frozen=True)
class StoredFile:
    id: str
    tenant: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    expires_at: int | None = None  # removed once past (expires_after); None: kept until deleted

    def public(self) -> dict:
        """The file object OpenAI's API answers."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "status_details": None,
                "expires_at": self.expires_at}


def expiry_seconds(expires_after, param: str = "expires_after") -> int | None:
    """The seconds after its making a file is removed, from OpenAI's `{"anchor": "created_at",
    "seconds": N}` (None: never); FileError naming the field at fault."""
    if expires_after is None:
        return None
    if not isinstance(expires_after, dict) or set(expires_after) - {"anchor", "seconds"}:
        raise FileError(f"{param}: must be an object of anchor and seconds, got {expires_after!r}", param)
    if expires_after.get("anchor") != "created_at":
        raise FileError(f"{param}.anchor: must be 'created_at', got {expires_after.get('anchor')!r}",
                        f"{param}.anchor")
    seconds, (least, most) = expires_after.get("seconds"), EXPIRY_SECONDS
    if isinstance(seconds, int) and not isinstance(seconds, bool):
        whole = seconds
    else:  # (a form's field: text)
        whole = int(seconds) if isinstance(seconds, str) and seconds.strip().isdigit() else None
    if whole is None or not least <= whole <= most:
        raise FileError(f"{param}.seconds: must be a whole number from {least} to {most:,} (1 hour to 30 days), "
                        f"got {seconds!r}", f"{param}.seconds")
    return whole


class FileStore:
    """The files of every tenant, kept in `folder` across restarts."""

    def __init__(self, folder: str | Path, clock: Callable[[], float] = time.time) -> None:
        self.folder = Path(folder)
        self.clock = clock
        self.files: dict[str, StoredFile] = {}
        if self.folder.is_dir():
            self._load()

    def _load(self) -> None:
        for record in sorted(self.folder.glob("file-*.json")):
            try:
                stored = StoredFile(**json.loads(record.read_text()))
            except (OSError, ValueError, TypeError):
                continue  # (not one kvd wrote whole: left for an operator to look at)
            if self.data_path(stored.id).exists():
                self.files[stored.id] = stored
        for data in self.folder.glob("file-*.data"):  # written, but its record was not: never listed
            if data.stem not in self.files:
                data.unlink(missing_ok=True)

    def data_path(self, file_id: str) -> Path:
        return self.folder / f"{file_id}.data"

    def add(self, tenant: str, filename: str, purpose: str, content: bytes, file_id: str | None = None,
            expires_in: int | None = None) -> StoredFile:
        """Keep `content` for `tenant` (`file_id`: replace the file of that id, kvd's own outputs;
        `expires_in`: seconds until it is removed, expiry_seconds)."""
        if purpose not in PURPOSES + WRITTEN_PURPOSES:
            raise FileError(f"purpose: kvd keeps files for {', '.join(PURPOSES)}, got {purpose!r}", "purpose")
        self.folder.mkdir(parents=True, exist_ok=True)
        file_id = file_id or "file-" + uuid.uuid4().hex[:24]
        now = int(self.clock())
        stored = StoredFile(file_id, tenant, filename, purpose, len(content), now,
                            None if expires_in is None else now + expires_in)

        def fill(tmp: Path) -> None:
            tmp.write_bytes(content)

        write_whole(self.data_path(file_id), fill)
        write_json_whole(self.folder / f"{file_id}.json", asdict(stored))
        self.files[file_id] = stored
        return stored

    def get(self, tenant: str, file_id: str, param: str = "file_id") -> StoredFile:
        """`tenant`'s file `file_id`; a 404 FileError where it has none of that id."""
        stored = self.files.get(file_id) if isinstance(file_id, str) else None
        if stored is None or stored.tenant != tenant:
            raise FileError(f"{param}: no file {file_id!r} is kept here", param, 404)
        return stored

    def content(self, tenant: str, file_id: str) -> bytes:
        return self.data_path(self.get(tenant, file_id).id).read_bytes()

    def listed(self, tenant: str, purpose: str | None = None) -> list[StoredFile]:
        """`tenant`'s files, the latest first."""
        return sorted([f for f in list(self.files.values()) if f.tenant == tenant and purpose in (None, f.purpose)],
                      key=lambda f: (f.created_at, f.id), reverse=True)

    def expire(self, keep: Callable[[StoredFile], bool]) -> list[StoredFile]:
        """Remove the files past their expires_at but those `keep` holds (a running batch's input,
        removed once it has ended); the files removed."""
        now = self.clock()
        gone = [f for f in list(self.files.values())
                if f.expires_at is not None and f.expires_at <= now and not keep(f)]
        for stored in gone:
            self.delete(stored.tenant, stored.id)
        return gone

    def delete(self, tenant: str, file_id: str) -> StoredFile:
        stored = self.get(tenant, file_id)
        (self.folder / f"{file_id}.json").unlink(missing_ok=True)  # unlisted first: never a record without data
        self.data_path(file_id).unlink(missing_ok=True)
        self.files.pop(file_id, None)
        return stored
