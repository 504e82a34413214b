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

PURPOSES = ("batch",)  # what a caller may upload a file for
WRITTEN_PURPOSES = ("batch_output",)  # what kvd writes files for


class FileError(Exception):
    """A request about files that cannot be met: `status` (400 or 404), `param` the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


@dataclass(frozen=True)
class StoredFile:
    id: str
    tenant: str
    filename: str
    purpose: str
    bytes: int
    created_at: int

    def public(self) -> dict:
        """The file object OpenAI's API answers."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "status_details": None,
                "expires_at": None}


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

    def add(self, tenant: str, filename: str, purpose: str, content: bytes, file_id: str | None = None) -> StoredFile:
        """Keep `content` for `tenant` (`file_id`: replace the file of that id, kvd's own outputs)."""
        if purpose not in PURPOSES + WRITTEN_PURPOSES:
            raise FileError(f"purpose: kvd keeps files for {', '.join(PURPOSES)}, got {purpose!r}", "purpose")
        self.folder.mkdir(parents=True, exist_ok=True)
        file_id = file_id or "file-" + uuid.uuid4().hex[:24]
        stored = StoredFile(file_id, tenant, filename, purpose, len(content), int(self.clock()))

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

    def delete(self, tenant: str, file_id: str) -> StoredFile:
        stored = self.get(tenant, file_id)
        (self.folder / f"{file_id}.json").unlink(missing_ok=True)  # unlisted first: never a record without data
        self.data_path(file_id).unlink(missing_ok=True)
        del self.files[file_id]
        return stored
