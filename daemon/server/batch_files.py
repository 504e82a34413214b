"""The files OpenAI's Files API keeps (`/v1/files`), as the Batch API uses them: a batch's input
(purpose "batch") and what kvd writes back (its output and errors, "batch_output").

Each file is two files in `state_dir/files`: `<id>.data` (the bytes) and `<id>.json` (whose it
is, its name, purpose, size and time), each written whole (whole_file.py) with the data first, so
a crash leaves a file listed whole or not at all (a data file with no record beside it is
removed at the next start). Each tenant lists, reads and deletes its own files only.

What they may take (`FileBudgets`, read anew at each upload so a reload applies at once):
`files_store_bytes` for every tenant's files together, and `tenant_files_bytes` for one
tenant's. An upload that would go over either is refused whole, before a byte of it is kept;
nothing kept is ever removed for room. What kvd writes (a batch's output) is always kept, and
counted, so a tenant whose outputs took it to its budget uploads again once it deletes some.
"""

from __future__ import annotations

import json
import math
import shutil
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO, Callable

from kvctl.daemon.whole_file import write_json_whole, write_whole

from .calls import ServiceError
from .whole_numbers import whole_number

EXPIRY_SECONDS = (3600, 2_592_000)  # OpenAI's shortest and longest expires_after: 1 h, 30 d
FREE_SOME = "delete files no longer needed (DELETE /v1/files/ID), or ask kvd's operator for more room"
PURPOSES = ("batch",)  # what a caller may upload a file for
WRITTEN_PURPOSES = ("batch_output",)  # what kvd writes files for


class FileError(ServiceError):
    """A request about files that cannot be met: `status` (400, 404, 409, or 507 where kvd's store
    of files has no room), `param` the field at fault, `code` the error's code where it has one;
    kvd's app answers it in OpenAI's error shape, as any ServiceError."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(status, message, param, code)


@dataclass(frozen=True)
class FileBudgets:
    """The bytes files may take: `store` every tenant's together (files_store_bytes), `tenants`
    one tenant's where tenant_files_bytes names it (`*`: each tenant it does not name)."""

    store: int
    tenants: tuple[tuple[str, int], ...] = ()

    def of(self, tenant: str) -> int | None:
        """`tenant`'s own budget (None: only `store` bounds its files)."""
        named = dict(self.tenants)
        return named.get(tenant, named.get("*"))


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


def across_fleet(elsewhere: int) -> str:
    """Where a tenant's files at the fleet's other replicas count: what its budget's refusal says."""
    return f" across the fleet ({elsewhere:,} at kvd router's other replicas)" if elsewhere else ""


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
        whole = whole_number(seconds) if isinstance(seconds, str) else None
    if whole is None or not least <= whole <= most:
        raise FileError(f"{param}.seconds: must be a whole number from {least} to {most:,} (1 hour to 30 days), "
                        f"got {seconds!r}", f"{param}.seconds")
    return whole


class FileStore:
    """The files of every tenant, kept in `folder` across restarts."""

    def __init__(self, folder: str | Path, clock: Callable[[], float] = time.time,
                 budgets: Callable[[], FileBudgets] | None = None,
                 max_age: Callable[[], float | None] = lambda: None) -> None:
        self.folder = Path(folder)
        self.clock = clock
        self.budgets = budgets or (lambda: FileBudgets(store=2**63))
        self.max_age = max_age  # files_max_age as it is now (live on a reload); None: none
        self.expired: Counter[str] = Counter()  # files removed past their expiry since kvd started, by what set it
        self.files: dict[str, StoredFile] = {}
        self.lock = threading.Lock()  # (a budget's check and the bytes it lets in, one upload at a time)
        self.reserved: Counter[str] = Counter()  # bytes of uploads being written, by tenant
        self.refused: Counter[str] = Counter()  # uploads refused since kvd started: "tenant" or "store" budget
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

    def held(self, tenant: str | None = None) -> int:
        """Bytes `tenant`'s files take (None: every tenant's), uploads being written included."""
        kept = sum(f.bytes for f in list(self.files.values()) if tenant in (None, f.tenant))
        return kept + (sum(self.reserved.values()) if tenant is None else self.reserved[tenant])

    def over_budget(self, tenant: str, size: int, elsewhere: int = 0) -> FileError | None:
        """Why `size` more bytes of `tenant`'s would not fit (None: they would): a 400 naming its
        tenant_files_bytes, or a 507 where every tenant's together would pass files_store_bytes
        (which does not say what the others keep). `elsewhere`: the bytes its files take at the
        fleet's other replicas (kvd router says), which its budget counts too."""
        budgets = self.budgets()
        own, held = budgets.of(tenant), self.held(tenant) + elsewhere
        if own is not None and held + size > own:
            return FileError(f"file: {size:,} bytes more would take tenant {tenant}'s files to {held + size:,} "
                             f"bytes{across_fleet(elsewhere)}, over its tenant_files_bytes ({own:,} bytes); "
                             f"{FREE_SOME}", "file", code="files_budget_exceeded")
        if self.held() + size > budgets.store:
            return FileError(f"file: kvd's store of files has no room for {size:,} bytes more (files_store_bytes); "
                             f"{FREE_SOME}", "file", 507, "file_storage_full")
        return None

    def no_room_for_output(self, tenant: str, elsewhere: int = 0) -> FileError | None:
        """Why a new batch of `tenant`'s would have no room for its output (None: it has some): its
        files at its tenant_files_bytes (with `elsewhere`, as over_budget's), or every tenant's at
        files_store_bytes. (A batch's output is written whatever its size: a batch started with
        room is never refused its answers.)"""
        budgets = self.budgets()
        own, held = budgets.of(tenant), self.held(tenant) + elsewhere
        if own is not None and held >= own:
            return FileError(f"input_file_id: tenant {tenant}'s files take {held:,} bytes{across_fleet(elsewhere)}, "
                             f"its tenant_files_bytes ({own:,} bytes): a batch's output would have no room; "
                             f"{FREE_SOME}", "input_file_id", code="files_budget_exceeded")
        if self.held() >= budgets.store:
            return FileError(f"input_file_id: kvd's store of files is full (files_store_bytes): a batch's output "
                             f"would have no room; {FREE_SOME}", "input_file_id", 507, "file_storage_full")
        return None

    def add(self, tenant: str, filename: str, purpose: str, content: bytes | BinaryIO, file_id: str | None = None,
            expires_in: int | None = None, elsewhere: int = 0) -> StoredFile:
        """Keep `content` (bytes, or a file read from its start) for `tenant` (`file_id`: replace
        the file of that id, kvd's own outputs; `expires_in`: seconds until it is removed,
        expiry_seconds). An upload (a purpose callers give) over a budget is refused: FileError
        (over_budget, with `elsewhere`), nothing kept; what kvd writes is kept whatever its budgets."""
        if purpose not in PURPOSES + WRITTEN_PURPOSES:
            raise FileError(f"purpose: kvd keeps files for {', '.join(PURPOSES)}, got {purpose!r}", "purpose")
        size = len(content) if isinstance(content, bytes) else content.seek(0, 2)
        with self.lock:
            refusal = self.over_budget(tenant, size, elsewhere) if purpose in PURPOSES else None
            if refusal is not None:
                self.refused["tenant" if refusal.status == 400 else "store"] += 1
                raise refusal
            self.reserved[tenant] += size
        try:
            return self._write(tenant, filename, purpose, content, size, file_id, expires_in)
        finally:
            with self.lock:
                self.reserved[tenant] -= size
                if not self.reserved[tenant]:
                    del self.reserved[tenant]

    def _write(self, tenant: str, filename: str, purpose: str, content: bytes | BinaryIO, size: int,
               file_id: str | None, expires_in: int | None) -> StoredFile:
        self.folder.mkdir(parents=True, exist_ok=True)
        file_id = file_id or "file-" + uuid.uuid4().hex[:24]
        now = int(self.clock())
        stored = StoredFile(file_id, tenant, filename, purpose, size, now,
                            None if expires_in is None else now + expires_in)

        def fill(tmp: Path) -> None:
            if isinstance(content, bytes):
                tmp.write_bytes(content)
                return
            content.seek(0)
            with open(tmp, "wb") as out:
                shutil.copyfileobj(content, out, 2**20)  # (a MiB at a time: an upload is never held whole)

        write_whole(self.data_path(file_id), fill)
        write_json_whole(self.folder / f"{file_id}.json", asdict(stored))
        self.files[file_id] = stored
        return stored

    def tenants(self) -> dict[str, dict]:
        """Each tenant's files: how many, their bytes, and its own budget (None: files_store_bytes)."""
        budgets, rows = self.budgets(), {}
        for stored in list(self.files.values()):
            row = rows.setdefault(stored.tenant, {"files": 0, "bytes": 0, "budget": budgets.of(stored.tenant)})
            row["files"] += 1
            row["bytes"] += stored.bytes
        return dict(sorted(rows.items()))

    def get(self, tenant: str, file_id: str, param: str = "file_id") -> StoredFile:
        """`tenant`'s file `file_id`; a 404 FileError where it has none of that id."""
        stored = self.files.get(file_id) if isinstance(file_id, str) else None
        if stored is None or stored.tenant != tenant:
            raise FileError(f"{param}: no file {file_id!r} is kept here", param, 404)
        return stored

    def content(self, tenant: str, file_id: str) -> bytes:
        return self.data_path(self.get(tenant, file_id).id).read_bytes()

    def listed(self, tenant: str | None, purpose: str | None = None) -> list[StoredFile]:
        """`tenant`'s files (None: every tenant's, an operator's view), the latest first."""
        return sorted([f for f in list(self.files.values())
                       if tenant in (None, f.tenant) and purpose in (None, f.purpose)],
                      key=lambda f: (f.created_at, f.id), reverse=True)

    def expiry(self, stored: StoredFile) -> tuple[int | None, str | None]:
        """(when `stored` goes, what set that): the earlier of its own expires_at (`expires_after`)
        and its creation plus files_max_age; (None, None): it stays until deleted."""
        span = self.max_age()
        capped = None if span is None else stored.created_at + math.ceil(span)
        if capped is not None and (stored.expires_at is None or capped < stored.expires_at):
            return capped, "files_max_age"
        return stored.expires_at, None if stored.expires_at is None else "expires_after"

    def public(self, stored: StoredFile) -> dict:
        """The file object OpenAI's API answers, `expires_at` when it goes (`expiry`)."""
        return {**stored.public(), "expires_at": self.expiry(stored)[0]}

    def expire(self, keep: Callable[[StoredFile], bool]) -> list[tuple[StoredFile, str]]:
        """Remove the files past their expiry (`expiry`) but those `keep` holds (a running batch's
        input, removed once it has ended); each file removed, and what set its expiry."""
        now = self.clock()
        gone = []
        for stored in list(self.files.values()):
            at, why = self.expiry(stored)
            if at is not None and at <= now and not keep(stored):
                gone.append((stored, why))
        for stored, why in gone:
            self.delete(stored.tenant, stored.id)
            self.expired[why] += 1
        return gone

    def delete(self, tenant: str, file_id: str) -> StoredFile:
        stored = self.get(tenant, file_id)
        (self.folder / f"{file_id}.json").unlink(missing_ok=True)  # unlisted first: never a record without data
        self.data_path(file_id).unlink(missing_ok=True)
        self.files.pop(file_id, None)
        return stored
