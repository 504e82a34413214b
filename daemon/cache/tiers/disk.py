"""The disk tier: segment files of block payloads under the state directory.

One transfer group is one segment file, written as `NAME.tmp`, fsynced, then renamed to
`NAME.kvseg`; only then are its blocks indexed (visible). A crash leaves either no file, a
`.tmp` (removed on the next start) or a whole segment. The directory entry itself is synced
at most once a second and on close: losing a rename to a power cut loses a cache entry,
never serves a torn one.

On start `scan()` checks every segment by its payloads' headers (`_check_segments`: small
payloads' segments read whole with the kernel reading ahead, large ones' a header at a time on
several threads): payloads of this space and layout are indexed; segments with a damaged
header, a truncated payload, or payloads written for another model, tokenizer, format or scale
set, are moved to `quarantine/` and counted. The bodies are not read at start (that was 1 s a
GiB on a 2-core VM, so minutes before a large tier's kvd served): each payload's XXH3-64 is
checked when it is read, as a Redis payload's is, and a block that fails is dropped as
`corrupt` and is a miss. Eviction is LRU by segment.

Tenant shares (`tenant_cache_shares`, as on the device, the host and Redis): with shares set,
each segment holds one tenant's blocks (the writer splits a group by tenant), and when room is
needed the least recently used segment of the tenant most over its share of the tier's bytes goes
first (counting what that tenant is writing now), before the least recently used of all. A
tenant flooding the disk then recycles its own segments, not a quiet tenant's.

What is set aside counts against the tier's bytes: it is kept (a foreign segment comes back when
the daemon runs its model again, a rollback; a corrupt one is there to be looked at) only while
there is room, and goes, oldest first, before any live segment is evicted. A model upgrade
therefore never leaves the folder holding more than `capacity_bytes`.

The filesystem bounds the tier too: a tier configured larger than the filesystem has room for
holds what fits, and leaves free at least `min(1 GiB, 5 % of the filesystem)` for everything else
there (the state directory's SQLite store, logs), as nginx's `proxy_cache_path min_free` does.
Before each write, segments go (least recently used first, counted as `filesystem`) until the
write fits in that room as well as in `capacity_bytes`; so a filesystem that other files fill
shrinks the tier, rather than failing its writes.

`spaces.json` beside them names each space whose blocks the folder held (spaces.py), so what was
set aside can be told apart by model revision and evicted by it (`purge_spaces`).
"""

from __future__ import annotations

import errno
import itertools
import logging
import mmap
import os
import threading
import time
from collections import Counter, OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

from kvctl.daemon.folder_claim import FolderTaken, claim_folder
from kvctl.daemon.whole_file import sync_folder
from kvctl.policies.tenant_shares import share_blocks, share_of

from .payload import (PEEK_BYTES, BlockLayout, BlockMeta, MetaBook, PayloadError, check_header, header_scanner,
                      header_span, payload_length, peek_space, verify_payload)
from .spaces import SpaceBook
from .vectored import write_vectored

log = logging.getLogger("kvd.tiers")

SUFFIX = ".kvseg"


class SegmentShort(OSError):
    """A segment file shorter than kvd wrote it: cut short outside kvd, or a failing disk."""


HEAD_READ = 4096  # bytes the start scan reads at each payload's start: its header, with room to spare
READ_WHOLE_BELOW = 256 << 10  # payloads smaller than this: the scan reads the segment whole, in one read
READ_AHEAD = 16  # segments of small payloads the kernel is asked to read ahead of the scan (WILLNEED)
SCAN_THREADS = 8  # segments the start scan reads at once (a disk answers several small reads at a time)
FREE_RESERVE_BYTES = 1 << 30  # the free space the tier leaves on its filesystem: at most this,
FREE_RESERVE_FRACTION = 0.05  # and at most this fraction of the filesystem's size


def _open_ahead(path: Path) -> int | OSError:
    """A segment opened, its bytes asked of the disk now (the kernel reads them meanwhile)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        return exc
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass  # a hint only
    return fd


def _read_into(fd: int, view: memoryview) -> int:
    """Read from the file's start into `view` until it is full or the file ends; bytes read."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], got)
        if not n:
            break  # shorter than it was a moment ago: the headers' walk says where it ends
        got += n
    return got


def filesystem_room(path: Path) -> int | None:
    """Bytes that files under `path` may still take: the filesystem's free space (for an
    unprivileged user) less the reserve kept free, or None where the filesystem cannot say."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    reserve = min(FREE_RESERVE_BYTES, int(st.f_blocks * st.f_frsize * FREE_RESERVE_FRACTION))
    return st.f_bavail * st.f_frsize - reserve


@dataclass
class Segment:
    name: str
    size: int
    keys: tuple[bytes, ...] = ()  # a tuple of bytes: Python's collector stops tracking it (see MetaBook)
    live: int = 0
    space: bytes = b""  # the block space its payloads were written under
    tenant: str | None = None  # whose blocks it holds, when all are one tenant's (else None)


@dataclass
class ScanReport:
    segments: int = 0
    blocks: int = 0
    corrupt: int = 0  # segments set aside for a bad payload
    foreign: int = 0  # segments set aside for another space or layout
    torn: int = 0  # unfinished .tmp files removed
    readmitted: int = 0  # set-aside foreign segments that match again (a rollback), indexed
    quarantine_dropped: int = 0  # set-aside segments deleted to keep the folder within its bytes
    seconds: float = 0.0  # how long the scan took


@dataclass
class SegmentCheck:
    """What reading one segment whole and verifying its blocks found (`DiskTier.check_segment`)."""

    blocks: int = 0  # blocks verified (those still indexed in it)
    bytes: int = 0  # bytes read
    bad: list[tuple[bytes, PayloadError]] = field(default_factory=list)  # (key, why) of those that failed
    unreadable: OSError | None = None  # the read failed: gone or cut short (the index was told), or EIO


class DiskTier:
    name = "disk"

    def __init__(self, path: str | Path, capacity_bytes: int, layout: BlockLayout, space: bytes,
                 clock: Callable[[], float] = time.monotonic, record: dict | None = None) -> None:
        self.root = Path(path)
        self.segment_dir = self.root / "segments"
        self.quarantine = self.root / "quarantine"
        self.capacity_bytes, self.layout, self.space, self.clock = capacity_bytes, layout, space, clock
        if capacity_bytes < layout.payload_bytes:
            raise ValueError(f"tiers.disk.bytes: {capacity_bytes} holds no block payload of "
                             f"{layout.payload_bytes} bytes")
        self.lock = threading.RLock()
        self.index: dict[bytes, tuple[str, int, int]] = {}  # key -> (segment, offset, length)
        self.meta: MetaBook = MetaBook()
        self.segments: OrderedDict[str, Segment] = OrderedDict()  # least recently used first
        self.used_bytes = 0
        self.quarantined: OrderedDict[Path, int] = OrderedDict()  # set-aside files, oldest first -> bytes
        self.quarantine_bytes = 0
        self._aside_space: dict[Path, bytes | None] = {}  # set-aside file -> its first payload's space
        self.busy: dict[str, int] = {}  # segment -> reads in flight (never evicted meanwhile)
        self._names = itertools.count()
        self._dir_synced_at = 0.0
        self._dir_dirty = False
        self.last_fsync_seconds = 0.0  # of the latest segment write (the tiering policy's fixed cost)
        self.events = None  # an EventLog: each key indexed or dropped here is logged there
        self.shares: dict[str, int] = {}  # tenant -> bytes of its share (tenant_cache_shares); empty: none
        self.tenant_bytes: Counter[str] = Counter()  # payload bytes of indexed blocks, by tenant ("" unknown)
        self.share_evictions = 0  # blocks dropped with segments whose tenant held more than its share
        self.filesystem_evictions = 0  # blocks dropped with segments because the filesystem ran short
        self.vanished_segments = 0  # segments deleted from the folder by something other than kvd
        self.room = filesystem_room  # (path) -> bytes the filesystem can still give (tests replace it)
        self.segment_dir.mkdir(parents=True, exist_ok=True)
        self._owner = self._claim(self.root)
        self.spaces = SpaceBook(self.root / "spaces.json")
        self._record = record
        if record is not None:
            self.spaces.add(space, record)

    @staticmethod
    def _claim(root: Path):
        """Hold `root/kvd.lock` (flock) for as long as this tier lives: a second daemon on the same
        folder would delete the first one's unfinished writes at its start scan, and each would
        trim the folder to its own budget blind to the other's segments. Daemons share blocks
        through a remote tier instead."""
        try:
            return claim_folder(root, f"pid {os.getpid()}")
        except FolderTaken as taken:
            raise ValueError(f"tiers.disk.path: {str(root)!r} is in use by another kvd ({taken.holder}); give each "
                             "daemon a disk tier of its own (daemons share blocks through a remote tier)") from None

    def set_tenant_shares(self, shares) -> None:
        """(tenant, fraction) pairs as `tenant_cache_shares` gives them, as shares of this tier's
        bytes (see the module's docstring)."""
        with self.lock:
            self.shares = share_blocks(shares, self.capacity_bytes) if shares else {}

    def close(self) -> None:
        """Let another daemon (or this one, restarted) take the folder."""
        if self._owner is not None:
            self._owner.close()  # closing the file drops the flock
            self._owner = None

    # ---- start -------------------------------------------------------------------------------
    def scan(self) -> ScanReport:
        """Verify and index what is on disk (call once, before serving)."""
        report, started = ScanReport(), time.perf_counter()
        for tmp in self.segment_dir.glob("*.tmp"):
            tmp.unlink(missing_ok=True)
            report.torn += 1
        back = self._readmit()
        report.readmitted = len(back)
        paths = sorted(self.segment_dir.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime)
        fresh = [p for p in paths if p.name not in back]  # those that came back were checked as they did
        checked = dict(zip((p.name for p in fresh), self._check_segments(fresh)))
        for path in paths:
            found = back[path.name] if path.name in back else checked[path.name]
            if isinstance(found, Exception):
                kind = ("foreign" if isinstance(found, PayloadError) and found.reason in ("space", "layout", "version")
                        else "corrupt")
                setattr(report, kind, getattr(report, kind) + 1)
                self._set_aside(path, kind)
                continue
            size, metas = found
            self._publish(path.name, size, metas, self.space)
            report.segments += 1
            report.blocks += len(metas)
        with self.lock:
            self._list_quarantine()
            report.quarantine_dropped = self._shed_quarantine(0)
        report.seconds = time.perf_counter() - started
        return report

    def _readmit(self) -> dict[str, tuple[int, list]]:
        """Move set-aside foreign segments that verify under this space and layout back among the
        segments (the scan then indexes them): the model they were written for runs again.
        Returns each one's name -> (bytes, verified payloads)."""
        back = {}
        paths = sorted((self.quarantine / "foreign").glob("*" + SUFFIX))
        for path, found in zip(paths, self._check_segments(paths)):
            if isinstance(found, Exception):
                continue
            try:
                os.replace(path, self.segment_dir / path.name)
            except OSError:
                continue
            back[path.name] = found
        return back

    def _list_quarantine(self) -> None:
        files = []
        for path in self.quarantine.glob("*/*"):
            try:
                stat = path.stat()
            except OSError:
                continue
            files.append((stat.st_mtime_ns, path, stat.st_size))
        self.quarantined = OrderedDict((path, size) for _, path, size in sorted(files))
        self.quarantine_bytes = sum(self.quarantined.values())
        self._aside_space = {p: s for p, s in self._aside_space.items() if p in self.quarantined}

    def _shed_quarantine(self, incoming: int) -> int:
        """Delete set-aside files, oldest first, until `incoming` more bytes fit with them; the
        number deleted. Call under the lock."""
        dropped = 0
        while self.quarantined and self.used_bytes + self.quarantine_bytes + incoming > self.capacity_bytes:
            self._drop_oldest_aside()
            dropped += 1
        return dropped

    def _drop_oldest_aside(self) -> int:
        """Delete the oldest set-aside file; its bytes. Call under the lock."""
        path, size = self.quarantined.popitem(last=False)
        path.unlink(missing_ok=True)
        self.quarantine_bytes -= size
        self._aside_space.pop(path, None)
        return size

    def _check_segments(self, paths: list[Path]) -> Iterator[tuple[int, list[tuple[BlockMeta, int, int]]] | Exception]:
        """For each path in order: (bytes, [(chain position, offset, length)]) of a segment whose
        payloads' headers all name this space and layout and whose payloads end where the file
        does; else the error (PayloadError: which check failed; OSError: the file could not be
        read). The bodies are not read: each is verified (XXH3-64) when it is read.

        Small payloads (READ_WHOLE_BELOW): this thread reads each segment whole, one sequential
        read, into one buffer, while the kernel reads the next READ_AHEAD segments
        (POSIX_FADV_WILLNEED). Large ones: SCAN_THREADS threads, a share of the segments each, read
        a header at a time (`pread`), the disk answering several small reads at once."""
        if self.layout.payload_bytes < READ_WHOLE_BELOW:
            yield from self._check_whole_segments(paths)
            return
        shares = [paths[i::SCAN_THREADS] for i in range(min(SCAN_THREADS, len(paths)))]  # a list a thread: no
        if not shares:
            return
        with ThreadPoolExecutor(len(shares), thread_name_prefix="kvd-disk-scan") as pool:  # task a file
            found = {p: f for share, results in zip(shares, pool.map(self._check_header_reads, shares))
                     for p, f in zip(share, results)}
        yield from (found[p] for p in paths)

    def _check_whole_segments(self, paths: list[Path]) -> Iterator[tuple[int, list] | Exception]:
        """`_check_segments` for small payloads. One thread: eight that read while this one walked
        headers spent their time waiting for the GIL, and a fresh buffer per segment had cost as
        much as the read (the scan of 1 GiB of demo blocks, heap frozen: 0.78 s warm; now 0.63 s)."""
        ahead: deque[int | OSError] = deque()
        upcoming = iter(paths)
        for path in itertools.islice(upcoming, READ_AHEAD):
            ahead.append(_open_ahead(path))
        buf = bytearray()
        try:
            while ahead:
                fd = ahead.popleft()
                following = next(upcoming, None)
                if following is not None:
                    ahead.append(_open_ahead(following))
                if isinstance(fd, OSError):
                    yield fd
                    continue
                try:
                    size = os.fstat(fd).st_size
                    if len(buf) < size:
                        buf = bytearray(size)
                    got = _read_into(fd, memoryview(buf)[:size])
                except OSError as exc:
                    yield exc
                    continue
                finally:
                    os.close(fd)
                view = memoryview(buf)[:got]
                try:
                    yield got, self._check_headers(lambda offset, n: view[offset:offset + n], got)
                except PayloadError as exc:  # what the walk keeps are copies (the keys), not views of buf
                    yield exc
        finally:  # the caller stopped early: the segments opened ahead are closed
            for fd in ahead:
                if not isinstance(fd, OSError):
                    os.close(fd)

    def _check_header_reads(self, paths: list[Path]) -> list:
        return [self._check_by_headers(path) for path in paths]

    def _check_by_headers(self, path: Path) -> tuple[int, list[tuple[BlockMeta, int, int]]] | Exception:
        """`_check_segments` of one segment of large payloads: a `pread` a header."""
        try:
            with open(path, "rb") as f:
                fd = f.fileno()
                size = os.fstat(fd).st_size
                if hasattr(os, "posix_fadvise"):  # no readahead of the bodies between the headers
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                return size, self._check_headers(lambda offset, n: os.pread(fd, n, offset), size)
        except (PayloadError, OSError) as exc:
            return exc

    def _check_headers(self, read: Callable[[int, int], bytes | memoryview],
                       size: int) -> list[tuple[BlockMeta, int, int]]:
        """Walk a segment of `size` bytes payload by payload, `read(offset, n)` giving its bytes."""
        if size == 0:
            raise PayloadError("length", "empty segment")
        out, offset, want = [], 0, max(HEAD_READ, self.layout.header_bytes("int8"))
        scanner = header_scanner(self.layout, self.space)
        while offset < size:
            head = read(offset, min(want, size - offset))
            found = scanner.check(head)
            if found is not None:
                meta, total = found
            else:  # not this layout's header as it is written: which check fails, or a longer header
                span = header_span(head)
                if span > len(head) and offset + span <= size:
                    head = read(offset, span)
                meta, _, _, total = check_header(head, self.layout, self.space)
            if offset + total > size:
                raise PayloadError("length", "segment ends inside a payload")
            out.append((meta, offset, total))
            offset += total
        return out

    def _set_aside(self, path: Path, kind: str) -> None:
        target = self.quarantine / kind
        target.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(path, target / path.name)
        except OSError:
            path.unlink(missing_ok=True)

    def _space_of(self, path: Path) -> bytes | None:
        """The space of a set-aside file's first payload (read once; None: not a payload)."""
        if path not in self._aside_space:
            try:
                with open(path, "rb") as f:
                    self._aside_space[path] = peek_space(f.read(PEEK_BYTES))
            except OSError:
                self._aside_space[path] = None
        return self._aside_space[path]

    def set_aside(self) -> list[dict]:
        """What is set aside, by kind (foreign, corrupt) and, for foreign segments, by the space
        their first payload names: [{"kind", "space" (bytes or None), "segments", "bytes"}]."""
        groups: dict[tuple[str, bytes | None], list[int]] = {}
        with self.lock:
            for path, size in self.quarantined.items():
                kind = path.parent.name
                space = self._space_of(path) if kind == "foreign" else None
                group = groups.setdefault((kind, space), [0, 0])
                group[0] += 1
                group[1] += size
        return [{"kind": kind, "space": space, "segments": n, "bytes": size}
                for (kind, space), (n, size) in sorted(groups.items(), key=lambda g: -g[1][1])]

    def purge_spaces(self, spaces: set[bytes]) -> dict:
        """Delete every segment written under one of these spaces (never the one served now):
        set-aside ones (another model revision's, after an upgrade) and indexed ones (written
        before new scales were applied). Segments being read stay. Returns {"segments", "blocks",
        "bytes"}: what went."""
        spaces = spaces - {self.space}
        segments = blocks = size = 0
        with self.lock:
            for path in [p for p in self.quarantined if p.parent.name == "foreign" and self._space_of(p) in spaces]:
                path.unlink(missing_ok=True)
                freed = self.quarantined.pop(path)
                self.quarantine_bytes -= freed
                self._aside_space.pop(path, None)
                segments, size = segments + 1, size + freed
            for name in [n for n, seg in self.segments.items() if seg.space in spaces and not self.busy.get(n)]:
                segment = self.segments[name]
                blocks += sum(1 for k in segment.keys if self.index.get(k, (None,))[0] == name)
                segments, size = segments + 1, size + segment.size
                self._remove_segment(name, "operator")
        return {"segments": segments, "blocks": blocks, "bytes": size}

    # ---- write -------------------------------------------------------------------------------
    def write_group(self, items: Sequence[tuple[BlockMeta, object]], fsync: bool = True) -> int:
        """Write one segment durably and index it. Raises OSError (nothing indexed) on failure.
        A payload is bytes-like or a list of buffers (`encode_parts`). Caller evicts first so
        that the tier stays within capacity (`make_room`)."""
        with self.lock:
            items = [(m, p) for m, p in items if m.key not in self.index]
            name = f"{time.time_ns():x}-{os.getpid()}-{next(self._names)}{SUFFIX}"
        self.last_fsync_seconds = 0.0  # this write's, never an earlier one's
        if not items:
            return 0
        final = self.segment_dir / name
        tmp = final.with_suffix(".tmp")
        buffers = [b for _, p in items for b in (p if isinstance(p, list) else [p])]
        try:
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileNotFoundError:  # the folder itself was deleted under kvd: make it again, once
                self._folder_gone()
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                write_vectored(lambda chunk: os.writev(fd, chunk), buffers)
                if fsync:
                    synced = time.perf_counter()
                    os.fsync(fd)
                    self.last_fsync_seconds = time.perf_counter() - synced
            finally:
                os.close(fd)
            os.rename(tmp, final)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        offsets, offset = [], 0
        for meta, payload in items:
            length = payload_length(payload)
            offsets.append((meta, offset, length))
            offset += length
        with self.lock:
            self._publish(name, offset, offsets, self.space)
            self._dir_dirty = True
        self.sync_dir(force=False)
        return offset

    def sync_dir(self, force: bool = True) -> None:
        """fsync the segment directory (renames become durable); at most once a second unless forced."""
        now = self.clock()
        if not self._dir_dirty or (not force and now - self._dir_synced_at < 1.0):
            return
        sync_folder(self.segment_dir)
        self._dir_synced_at, self._dir_dirty = now, False

    def _publish(self, name: str, size: int, metas: Sequence[tuple[BlockMeta, int, int]], space: bytes) -> None:
        tenants = {meta.tenant or "" for meta, _, _ in metas}
        segment = Segment(name, size, space=space, tenant=tenants.pop() if len(tenants) == 1 else None)
        fresh = []
        for meta, offset, length in metas:
            if meta.key in self.index:
                continue  # an older segment holds it already
            self.index[meta.key] = (name, offset, length)
            self.meta[meta.key] = meta
            self.tenant_bytes[meta.tenant or ""] += length
            fresh.append(meta)
        segment.keys, segment.live = tuple(meta.key for meta in fresh), len(fresh)
        self.segments[name] = segment
        self.used_bytes += size
        if fresh and self.events is not None:
            self.events.stored("disk", fresh)

    def bounded_by_filesystem(self) -> tuple[int, int] | None:
        """(the filesystem's room, the most the tier can hold with it) when that is less than
        `capacity_bytes`; None when the tier's own bytes bound it (or the filesystem cannot say)."""
        room = self.room(self.segment_dir)
        if room is None:
            return None
        most = self.used_bytes + self.quarantine_bytes + max(room, 0)
        return (max(room, 0), most) if most < self.capacity_bytes else None

    def make_room(self, incoming: int, protect: Callable[[bytes], bool] = lambda k: False,
                  salvage: Callable[[Segment, bytes], None] | None = None, tenant: str | None = None) -> list[Segment]:
        """Drop segments until `incoming` more bytes (`tenant`'s, when one tenant's) fit: with tenant
        shares, the least recently used of the tenant most over its share first, then the least
        recently used of all. Returns them (their files are gone, their keys unindexed). Segments
        being read or holding a protected key stay. `salvage(segment, bytes)` sees each segment's
        bytes before its file goes (write-back)."""
        dropped = []
        room = [self.room(self.segment_dir)]  # the filesystem's, growing as segments go

        def full() -> bool:
            return self.used_bytes + self.quarantine_bytes + incoming > self.capacity_bytes

        def short() -> bool:
            return room[0] is not None and room[0] < incoming

        def movable(segment: Segment) -> bool:
            return not self.busy.get(segment.name) and not any(protect(k) for k in segment.keys if k in self.index)

        def drop(segment: Segment, reason: str) -> None:
            if salvage is not None:
                try:
                    salvage(segment, self.read_segment(segment))
                except OSError:
                    pass
            live = sum(1 for k in segment.keys if self.index.get(k, (None,))[0] == segment.name)
            if reason == "tenant_share":
                self.share_evictions += live
            elif reason == "filesystem":
                self.filesystem_evictions += live
            self._remove_segment(segment.name, reason)
            if room[0] is not None:
                room[0] += segment.size
            dropped.append(segment)

        with self.lock:
            self._shed_quarantine(incoming)  # what was set aside goes before any live segment
            while self.quarantined and short():
                room[0] += self._drop_oldest_aside()
            while self.shares and full():
                segment = self._share_victim(incoming, tenant, movable)
                if segment is None:
                    break
                drop(segment, "tenant_share")
            for segment in list(self.segments.values()):
                if not full() and not short():
                    break
                if movable(segment):
                    drop(segment, "capacity" if full() else "filesystem")
        return dropped

    def _share_victim(self, incoming: int, tenant: str | None, movable) -> Segment | None:
        """The least recently used segment that can go, among those holding only the blocks of the
        tenant most over its share (its blocks' bytes, counting `incoming` bytes as `tenant`'s), or
        None when no tenant is over or an over tenant has no such segment (the lock held)."""
        held = Counter(self.tenant_bytes)
        if tenant is not None:
            held[tenant] += incoming
        over = sorted(((bytes_ - share, name) for name, bytes_ in held.items()
                       if (share := share_of(self.shares, name)) is not None and bytes_ > share), reverse=True)
        for _, name in over:
            for segment in self.segments.values():
                if segment.tenant == name and movable(segment):
                    return segment
        return None

    def _remove_segment(self, name: str, reason: str, set_aside: bool = False) -> None:
        segment = self.segments.pop(name)
        removed = [key for key in segment.keys if self.index.get(key, (None,))[0] == name]
        for key in removed:
            self._unindex(key)
        if removed and self.events is not None:
            self.events.removed("disk", removed, reason)
        self.used_bytes -= segment.size
        if set_aside:  # kept for a look, within the tier's bytes, as the start scan keeps a corrupt one
            self._set_aside(self.segment_dir / name, "corrupt")
            self._list_quarantine()
        else:
            (self.segment_dir / name).unlink(missing_ok=True)

    def _unindex(self, key: bytes) -> tuple[str, int, int] | None:
        """Take a block off the index and its tenant's bytes (the lock held); where it was."""
        where = self.index.pop(key, None)
        meta = self.meta.pop(key, None)
        if where is not None:
            tenant = (meta.tenant if meta is not None else None) or ""
            self.tenant_bytes[tenant] -= where[2]
            if self.tenant_bytes[tenant] <= 0:
                del self.tenant_bytes[tenant]
        return where

    # ---- read --------------------------------------------------------------------------------
    def read(self, key: bytes) -> bytes | None:
        """The payload bytes of `key`, or None. Unverified: the caller decodes and verifies."""
        with self.lock:
            where = self.index.get(key)
            if where is None:
                return None
            name, offset, length = where
            self.segments.move_to_end(name)
            self.busy[name] = self.busy.get(name, 0) + 1
        failed = None
        try:
            return self._read_range(name, offset, length)
        except (OSError, ValueError) as exc:
            failed = exc
            return None
        finally:
            with self.lock:
                if failed is not None:
                    self._lost_on_read(name, failed)
                self._read_done(name)

    def read_many(self, keys: Sequence[bytes]) -> dict[bytes, memoryview]:
        """Payloads of those `keys` on disk, each segment's span read with one pread into one
        buffer (no per-block open or copy). Unverified, like `read`; missing keys are absent."""
        spans: dict[str, list[tuple[bytes, int, int]]] = {}
        with self.lock:
            for key in keys:
                where = self.index.get(key)
                if where is not None:
                    spans.setdefault(where[0], []).append((key, where[1], where[2]))
            for name in spans:
                self.segments.move_to_end(name)
                self.busy[name] = self.busy.get(name, 0) + 1
        out: dict[bytes, memoryview] = {}
        failed: list[tuple[str, Exception]] = []
        try:
            for name, entries in spans.items():
                first = min(offset for _, offset, _ in entries)
                last = max(offset + length for _, offset, length in entries)
                try:
                    view = self._read_range(name, first, last - first)
                except (OSError, ValueError) as exc:
                    failed.append((name, exc))
                    continue
                for key, offset, length in entries:
                    if offset + length - first <= len(view):
                        out[key] = view[offset - first:offset - first + length]
        finally:
            with self.lock:
                for name, exc in failed:
                    self._lost_on_read(name, exc)
                for name in spans:
                    self._read_done(name)
        return out

    def _folder_gone(self) -> None:
        """The segments folder is not there (`rm -rf` of the tier, a cleanup job): every segment
        whose file is missing is forgotten as gone, and the folder, its lock and its book of
        spaces are made again, so that writes go on. Raises OSError (no write) when another
        daemon took the folder meanwhile."""
        with self.lock:
            missing = [n for n in self.segments if not (self.segment_dir / n).exists()]
            log.warning("disk: %s is gone (deleted outside kvd?); making it again, and forgetting the %d "
                        "segments (%d blocks) that went with it", self.segment_dir, len(missing),
                        sum(self.segments[n].live for n in missing))
            for name in missing:
                self._remove_segment(name, "gone")
            self.vanished_segments += len(missing)
            self.segment_dir.mkdir(parents=True, exist_ok=True)
            if not (self.root / "kvd.lock").exists():  # the lock held is on a deleted file now
                self.close()
                try:
                    self._owner = self._claim(self.root)
                except ValueError as exc:  # the write fails as a write does: the tier is degraded
                    raise OSError(errno.EBUSY, str(exc)) from None
            if self._record is not None and not self.spaces.path.exists():
                self.spaces.add(self.space, self._record)

    def _lost_on_read(self, name: str, exc: Exception) -> None:
        """A read of segment `name` failed with `exc` (the lock held). A file gone from the folder
        (a cleanup job, an operator's rm) leaves the index as `gone`; one shorter than kvd wrote it
        is set aside as `corrupt`, as the start scan sets one aside. Either is a miss from now on,
        not a read that fails each time and marks the tier degraded. Any other error (EIO) leaves
        the segment where it is: the caller marks the tier degraded."""
        segment = self.segments.get(name)
        if segment is None:
            return
        if isinstance(exc, FileNotFoundError):
            self.vanished_segments += 1
            log.warning("disk: segment %s is gone from %s (deleted outside kvd?); its %d blocks are forgotten",
                        name, self.segment_dir, segment.live)
            self._remove_segment(name, "gone")
        elif isinstance(exc, SegmentShort):
            log.warning("disk: segment %s is shorter than kvd wrote it (cut short outside kvd, or a failing "
                        "disk?); its %d blocks are set aside in %s", name, segment.live, self.quarantine / "corrupt")
            self._remove_segment(name, "corrupt", set_aside=True)

    def _read_done(self, name: str) -> None:
        """A read of segment `name` ended (the lock held). The last one out removes the segment if
        every block of it was dropped meanwhile: `drop` leaves a segment being read, and nothing
        else would take it off the books and the disk until room is needed."""
        self.busy[name] -= 1
        if self.busy[name]:
            return
        del self.busy[name]
        segment = self.segments.get(name)
        if segment is not None and segment.live <= 0:
            self._remove_segment(name, "operator")

    def _read_range(self, name: str, offset: int, length: int) -> memoryview:
        """A read-only view of the segment's bytes, mapped straight from the page cache (no copy,
        no fresh buffer). Published segments are never modified, only unlinked, which leaves a
        live mapping intact."""
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        with open(self.segment_dir / name, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if offset + length > size:
                raise SegmentShort(f"segment {name} is shorter than its index says")
            mapped = mmap.mmap(f.fileno(), offset + length - start, offset=start, prot=mmap.PROT_READ,
                               flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        return memoryview(mapped)[offset - start:]

    def segment_names(self) -> list[str]:
        """The indexed segments, least recently used first."""
        with self.lock:
            return list(self.segments)

    def check_segment(self, name: str) -> SegmentCheck | None:
        """Read segment `name` whole and verify each block still indexed in it as a restore does
        (key, space, layout, XXH3-64); None when it is no longer indexed. It is kept from eviction
        while it is read. A file gone or cut short is forgotten or set aside as a failed read's is
        (`_lost_on_read`); the caller drops the blocks that failed."""
        with self.lock:
            segment = self.segments.get(name)
            if segment is None:
                return None
            entries = [(key, where[1], where[2]) for key in segment.keys
                       if (where := self.index.get(key)) is not None and where[0] == name]
            self.busy[name] = self.busy.get(name, 0) + 1
        check = SegmentCheck()
        try:
            view = self._read_range(name, 0, segment.size)
        except (OSError, ValueError) as exc:
            check.unreadable = exc if isinstance(exc, OSError) else OSError(str(exc))
            return check
        finally:
            with self.lock:
                if check.unreadable is not None:
                    self._lost_on_read(name, check.unreadable)
                self._read_done(name)
        check.bytes = segment.size
        for key, offset, length in entries:
            try:
                verify_payload(view[offset:offset + length], self.layout, self.space, key)
            except PayloadError as exc:
                check.bad.append((key, exc))
        check.blocks = len(entries)
        return check

    def read_segment(self, segment: Segment) -> bytes:
        return (self.segment_dir / segment.name).read_bytes()

    def drop(self, key: bytes, reason: str = "operator") -> None:
        """Forget one block (`corrupt`: a failed verification; `operator`: an eviction); the
        segment file goes when none of its blocks is left."""
        with self.lock:
            where = self._unindex(key)
            if where is None:
                return
            if self.events is not None:
                self.events.removed("disk", (key,), reason)
            segment = self.segments.get(where[0])
            if segment is not None:
                segment.live -= 1
                if segment.live <= 0 and not self.busy.get(segment.name):
                    self._remove_segment(segment.name, reason)
