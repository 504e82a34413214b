"""`kvctl adr ...` and `kvctl db ...`: decision records and store upkeep, no daemon needed.

They open the database in the state directory: --state-dir, else KVD_STATE_DIR, else the store of
the kvd that kvctl reaches over its Unix socket, else the daemon's default (`$XDG_STATE_HOME/kvd`).
"""

from __future__ import annotations

import getpass
import json
import os
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from .errors import UserError
from .outputs import is_sqlite, read_text, refuse_clobber
from .tables import when

adr_app = typer.Typer(help="Architecture decision records (append-only, in the SQLite store).",
                      no_args_is_help=True)
db_app = typer.Typer(help="The SQLite store: backup, restore, integrity check, pruning.", no_args_is_help=True)

STATE_DIR = typer.Option(None, "--state-dir", help="State directory holding kvd.sqlite3 (KVD_STATE_DIR; default: the "
                         "running kvd's).")
AS_JSON = typer.Option(False, "--json", help="Print JSON.")


def running_daemon_store(ctx: typer.Context | None) -> Path | None:
    """The store of the kvd this kvctl reaches over its Unix socket (`--socket`, KVD_SOCKET or the
    default), as that daemon names it; None when no daemon answers there, or when kvctl is pointed
    at one over TCP, whose files lie on another machine. A daemon that answers without naming it
    (an error, an older kvd) is reported on stderr, so the fallback is never silent."""
    from .client import Client

    options = (ctx.find_root().obj if ctx else None) or {}
    if options.get("url") or os.environ.get("KVD_URL"):
        typer.echo("note: kvd is reached over TCP, so its store is on its own machine: this is the store "
                   "on this one (--state-dir or KVD_STATE_DIR names another)", err=True)
        return None
    try:
        client = Client(options.get("socket"), timeout=10.0)
        path = client.get("/admin/config").get("store_path")
    except UserError as exc:
        if "not reachable" in str(exc):
            named = options.get("socket") or os.environ.get("KVD_SOCKET")
            if named:  # the operator meant that daemon: say whose store this is instead
                typer.echo(f"note: no kvd answers at {named}, so this is the store in the default state "
                           f"directory (--state-dir or KVD_STATE_DIR names another)", err=True)
            return None
        typer.echo(f"note: kvd at {options.get('socket') or os.environ.get('KVD_SOCKET') or 'its default socket'} "
                   f"did not say where its store is ({exc})", err=True)
        return None
    if not path:
        typer.echo("note: the kvd kvctl reaches does not name its store (an older kvd?)", err=True)
    return Path(path) if path else None


def open_store(ctx: typer.Context | None, state_dir: str | None, create: bool = False):
    """The store in `state_dir` (else KVD_STATE_DIR, else the running kvd's, else kvd's default).
    Only commands that write (`create`) may start a new one: a reader pointed at a folder
    without one (a typo, the wrong user's default) is told so, not shown an empty store it has
    just created."""
    from kvctl.daemon.default_paths import default_state_dir
    from kvctl.daemon.store import Store, StoreError

    from .client import LOCK_HOLDERS, STORE_WRITE_WAIT_S

    chosen = state_dir or os.environ.get("KVD_STATE_DIR")
    path = Path(chosen) / "kvd.sqlite3" if chosen else running_daemon_store(ctx)
    if path is None:
        path = Path(default_state_dir()) / "kvd.sqlite3"
    if not create and not path.is_file():
        raise UserError(f"state_dir: no kvd.sqlite3 in {str(path.parent)!r}; give kvd's state directory "
                        "(--state-dir or KVD_STATE_DIR)")
    def waiting() -> None:
        typer.echo(f"waiting for the write lock of {str(path)!r}: another process holds it ({LOCK_HOLDERS}?); "
                   f"kvctl waits up to {STORE_WRITE_WAIT_S} s", err=True)

    try:
        return Store(path, on_wait=waiting)
    except (StoreError, OSError) as exc:
        raise UserError(str(exc)) from None


def save_and_show(ctx: typer.Context, state_dir: str | None, kind: str, document: dict, save: bool, as_json: bool,
                  render) -> None:
    """A bench command's end: with `--save`, store the run (`save_run`); then print the document as
    JSON with `--json`, else `render(document)`."""
    if save:
        save_run(ctx, state_dir, kind, document)
    if as_json:
        typer.echo(json.dumps(document, indent=2))
        return
    render(document)


def save_run(ctx: typer.Context | None, state_dir: str | None, kind: str, document: dict) -> None:
    """`--save`: store a bench run, its id in document["run_id"]. A store that cannot take it costs
    no figure: run_id is None, the command prints its figures as always, then says why the run was
    not stored and exits 1."""
    from kvctl.daemon.store import StoreError

    try:
        document["run_id"] = open_store(ctx, state_dir, create=True).save_run(kind, document)
    except (UserError, StoreError) as exc:
        document["run_id"] = None
        message = f"--save: {exc}; the figures shown were not stored"
        if ctx is None:
            raise UserError(message) from None

        def say_so() -> None:
            typer.echo(f"error: {message}", err=True)
            raise typer.Exit(1)

        ctx.call_on_close(say_so)


def _records(ctx: typer.Context | None, state_dir: str | None, create: bool = False):
    from kvctl.daemon.records import Records

    return Records(open_store(ctx, state_dir, create))


def _guard(fn, *args, **kwargs):
    from kvctl.daemon.records import RecordError
    from kvctl.daemon.store import StoreError

    try:
        return fn(*args, **kwargs)
    except (RecordError, StoreError) as exc:  # StoreError: a write the store cannot take (full, read-only)
        raise UserError(str(exc)) from None


def _show(adr, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(adr.as_dict(), indent=2))
    else:
        from rich.markdown import Markdown  # (markdown-it: loaded for this command only)

        Console().print(Markdown(adr.markdown()))


@adr_app.command("new")
def adr_new(ctx: typer.Context, title: str = typer.Option(..., "--title", help="One line: what is decided."),
            from_file: Optional[Path] = typer.Option(None, "--from-file", help="Markdown with ## sections."),
            edit: bool = typer.Option(False, "--edit", help="Write the record in $EDITOR."),
            author: str = typer.Option(None, help="Who writes it (default: the login name)."),
            state_dir: Optional[str] = STATE_DIR, as_json: bool = AS_JSON) -> None:
    """Record a proposed decision with context, alternatives, evidence (run:ID) and the rest.

    Example: kvctl adr new --title "Block size 32 for chat traffic" --from-file adr.md
    """
    from kvctl.daemon.records import FIELDS, HEADINGS, parse_markdown

    if from_file and edit:
        raise UserError("give --from-file or --edit, not both")
    text = ""
    if from_file:
        text = read_text(from_file, "from_file")
    elif edit:
        template = f"# {title}\n\n" + "\n".join(f"## {HEADINGS[f]}\n\n" for f in FIELDS)
        text = typer.edit(template) or ""
    parsed_title, fields = _guard(parse_markdown, text)
    adr = _guard(_records(ctx, state_dir, create=True).new, parsed_title or title, fields, author or getpass.getuser())
    _show(adr, as_json) if as_json else Console().print(f"ADR {adr.id} recorded (proposed): {adr.title}")


@adr_app.command("edit")
def adr_edit(ctx: typer.Context, adr_id: int = typer.Argument(..., help="ADR id."),
             from_file: Path = typer.Option(..., "--from-file", help="Markdown with the sections to change."),
             author: str = typer.Option(None, help="Who edits (default: the login name)."),
             state_dir: Optional[str] = STATE_DIR, as_json: bool = AS_JSON) -> None:
    """Add a revision; earlier revisions stay as they were.

    Example: kvctl adr edit 3 --from-file adr-3-evidence.md
    """
    from kvctl.daemon.records import parse_markdown

    title, fields = _guard(parse_markdown, read_text(from_file, "from_file"))
    adr = _guard(_records(ctx, state_dir).edit, adr_id, title, fields, author or getpass.getuser())
    _show(adr, as_json) if as_json else Console().print(f"ADR {adr.id} is at revision {adr.revision}")


@adr_app.command("list")
def adr_list(ctx: typer.Context, status: Optional[str] = typer.Option(None, help="proposed, accepted, rejected, superseded."),
             state_dir: Optional[str] = STATE_DIR, as_json: bool = AS_JSON) -> None:
    """Every record, optionally of one status.

    Example: kvctl adr list --status accepted
    """
    adrs = _guard(_records(ctx, state_dir).list, status)
    if as_json:
        typer.echo(json.dumps([a.as_dict() for a in adrs], indent=2))
        return
    table = Table("id", "status", "title", "revision", "author")
    for a in adrs:
        table.add_row(str(a.id), a.status + (f" by {a.superseded_by}" if a.superseded_by else ""), a.title,
                      str(a.revision), a.author)
    Console().print(table if adrs else "no records")


@adr_app.command("show")
def adr_show(ctx: typer.Context, adr_id: int = typer.Argument(..., help="ADR id."), state_dir: Optional[str] = STATE_DIR,
             as_json: bool = AS_JSON) -> None:
    """One record, latest revision.

    Example: kvctl adr show 3
    """
    _show(_guard(_records(ctx, state_dir).get, adr_id), as_json)


def _transition(ctx: typer.Context, method: str, adr_id: int, state_dir, as_json, **kwargs) -> None:
    records = _records(ctx, state_dir)
    adr = _guard(getattr(records, method), adr_id, author=getpass.getuser(), **kwargs)
    _show(adr, as_json) if as_json else Console().print(f"ADR {adr.id} is {adr.status}")


@adr_app.command("accept")
def adr_accept(ctx: typer.Context, adr_id: int = typer.Argument(..., help="ADR id."), state_dir: Optional[str] = STATE_DIR,
               as_json: bool = AS_JSON) -> None:
    """Accept a proposed record.

    Example: kvctl adr accept 3
    """
    _transition(ctx, "accept", adr_id, state_dir, as_json)


@adr_app.command("reject")
def adr_reject(ctx: typer.Context, adr_id: int = typer.Argument(..., help="ADR id."), state_dir: Optional[str] = STATE_DIR,
               as_json: bool = AS_JSON) -> None:
    """Reject a proposed record.

    Example: kvctl adr reject 4
    """
    _transition(ctx, "reject", adr_id, state_dir, as_json)


@adr_app.command("supersede")
def adr_supersede(ctx: typer.Context, adr_id: int = typer.Argument(..., help="ADR id."),
                  by: int = typer.Option(..., "--by", help="The record that replaces it."),
                  state_dir: Optional[str] = STATE_DIR, as_json: bool = AS_JSON) -> None:
    """Mark a record superseded by another.

    Example: kvctl adr supersede 3 --by 7
    """
    _transition(ctx, "supersede", adr_id, state_dir, as_json, by=by)


@adr_app.command("export")
def adr_export(ctx: typer.Context, folder: Path = typer.Argument(Path("adr"), help="Where to write the Markdown files."),
               format: str = typer.Option("md", "--format", help="md (one file per record)."),
               state_dir: Optional[str] = STATE_DIR, as_json: bool = AS_JSON) -> None:
    """Write one Markdown file per record (NNNN-title.md).

    Example: kvctl adr export docs/adr
    """
    import re

    if format != "md":
        raise UserError(f"format: unknown value {format!r}; the only format is md")
    if folder.exists() and not folder.is_dir():
        raise UserError(f"folder: {str(folder)!r} is a file; give a folder for the records")
    folder.mkdir(parents=True, exist_ok=True)
    written, removed = [], []
    for adr in _guard(_records(ctx, state_dir).list):
        slug = re.sub(r"[^a-z0-9]+", "-", adr.title.lower()).strip("-")[:60]
        path = folder / f"{adr.id:04d}-{slug}.md"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(adr.markdown())
        tmp.replace(path)
        written.append(str(path))
        for old in folder.glob(f"{adr.id:04d}-*.md"):  # this record exported under an earlier title
            if old != path and _first_line(old).startswith(f"# ADR {adr.id}: "):
                old.unlink()
                removed.append(str(old))
    typer.echo(json.dumps({"written": written, "removed": removed}, indent=2) if as_json else
               f"wrote {len(written)} records to {folder}"
               + (f"; removed {len(removed)} exported under an earlier title" if removed else ""))


def _first_line(path: Path) -> str:
    try:
        with path.open(encoding="utf-8") as handle:
            return handle.readline().rstrip("\n")
    except (OSError, UnicodeDecodeError):
        return ""


@db_app.command("backup")
def db_backup(ctx: typer.Context, destination: Path = typer.Argument(..., help="Backup file to write."),
              state_dir: Optional[str] = STATE_DIR, as_json: bool = AS_JSON) -> None:
    """A consistent copy through SQLite's backup API, safe while kvd writes.

    Example: kvctl db backup /var/backups/kvd-$(date +%F).sqlite3
    """
    store = open_store(ctx, state_dir)
    if destination.resolve() == Path(store.path).resolve():
        raise UserError(f"destination: {str(destination)!r} is the store itself; back it up elsewhere")
    refuse_clobber(destination, "destination", is_sqlite, "a SQLite database")
    path = store.backup(destination)
    typer.echo(json.dumps({"backup": str(path), "store": str(store.path)}) if as_json
               else f"backed up {store.path} to {path}")


@db_app.command("check")
def db_check(ctx: typer.Context, state_dir: Optional[str] = STATE_DIR, as_json: bool = AS_JSON) -> None:
    """Run SQLite's integrity check; exit status 1 when it finds a problem.

    Example: kvctl db check --json
    """
    store = open_store(ctx, state_dir)
    problems = store.integrity_check()
    ok = problems == ["ok"]
    document = {"ok": ok, "problems": [] if ok else problems, "schema_version": store.schema_version,
                "path": str(store.path)}
    typer.echo(json.dumps(document, indent=2) if as_json else
               (f"{store.path}: ok (schema {store.schema_version})" if ok else "\n".join(problems)))
    if not ok:
        raise typer.Exit(1)


@db_app.command("prune")
def db_prune(ctx: typer.Context,
             audit_older_than: str = typer.Option(..., "--audit-older-than",
                                                  help="Remove audit records older than this age: 90d, 12h."),
             dry_run: bool = typer.Option(False, "--dry-run", help="Count what would go; change nothing."),
             state_dir: Optional[str] = STATE_DIR, as_json: bool = AS_JSON) -> None:
    """Remove old audit records, keeping a record of the removal; safe while kvd writes.

    The audit log grows with every operator action (and every pin a TTL ends). The records from
    before the age given go 20,000 at a time, so that kvd's own writes never wait long; the first
    batch in one transaction with a `db.prune` record saying how many and who removed them. The
    file does not shrink: SQLite reuses the pages freed.

    Example: kvctl db prune --audit-older-than 365d --dry-run
    """
    from kvctl.daemon.server.durations import UNITS, parse_duration

    text = audit_older_than.strip().lower()
    try:
        if not text or text[-1] not in UNITS:  # a bare 90 (seconds) would take nearly every record
            raise ValueError
        age = parse_duration(text)
    except ValueError:
        raise UserError(f"audit_older_than: invalid value {audit_older_than!r}; give an age with its unit "
                        "(s, m, h, d): 90d, 12h") from None
    store = open_store(ctx, state_dir)
    result = _guard(store.prune_audit, time.time() - age, actor=getpass.getuser(), dry_run=dry_run)
    if as_json:
        typer.echo(json.dumps({**result, "store": str(store.path)}))
        return
    verb = "would remove" if dry_run else "removed"
    oldest = f", the oldest from {when(result['oldest_kept'])}" if result["oldest_kept"] is not None else ""
    typer.echo(f"{verb} {result['removed']:,} audit record{'s' if result['removed'] != 1 else ''} from before "
               f"{when(result['before'])} ({audit_older_than} ago) in {store.path}; {result['kept']:,} "
               f"remain{oldest}")


@db_app.command("restore")
def db_restore(ctx: typer.Context, backup: Path = typer.Argument(..., help="A backup (kvctl db backup) to put back."),
               dry_run: bool = typer.Option(False, "--dry-run", help="Check the backup and show what it holds beside "
                                            "the store; change nothing."),
               state_dir: Optional[str] = STATE_DIR, as_json: bool = AS_JSON) -> None:
    """Put a backup back in place of the store, keeping the store it replaces; kvd must be stopped.

    The backup must pass SQLite's integrity check. The replaced store is kept beside it as
    kvd.sqlite3.replaced-STAMP (with its WAL, and a rollback kvd had kept for it), so records newer
    than the backup are not lost: `kvctl db restore` of that file undoes the restore. The old WAL
    is never replayed onto the backup. The restored store records a db.restore audit record.

    Example: kvctl db restore /var/backups/kvd-2026-11-30.sqlite3 --dry-run
    """
    from kvctl.daemon.default_paths import default_state_dir
    from kvctl.daemon.store import StoreError
    from kvctl.daemon.store_restore import RestoreRefused, restore

    chosen = state_dir or os.environ.get("KVD_STATE_DIR")
    store = Path(chosen) / "kvd.sqlite3" if chosen else running_daemon_store(ctx)
    folder = store.parent if store is not None else Path(default_state_dir())
    try:
        report = restore(folder, backup, actor=getpass.getuser(), dry_run=dry_run)
    except RestoreRefused as exc:
        raise UserError(str(exc)) from None
    except (OSError, StoreError) as exc:
        raise UserError(f"restore: {exc}") from None
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    console = Console()
    table = Table(title=f"{'would restore' if dry_run else 'restored'} {report['store']} from {backup}")
    table.add_column("")
    table.add_column("the backup", justify="right")
    table.add_column("the store " + ("now" if dry_run else "it replaced"), justify="right")
    restored, replaced = report["backup"], report["replaced"] or {"counts": {}, "newest_at": None, "problem": None,
                                                                  "schema": None}
    for name in restored["counts"] | replaced["counts"]:
        table.add_row(name, _count(restored["counts"].get(name)), _count(replaced["counts"].get(name)))
    table.add_row("newest record", when(restored["newest_at"]), when(replaced["newest_at"]))
    table.add_row("schema", str(restored["schema"]), "-" if replaced["schema"] is None else str(replaced["schema"]))
    console.print(table)
    if report["replaced"] is None:
        console.print("there was no store in its place")
    elif replaced["problem"]:
        console.print(f"the store {'now' if dry_run else 'replaced'} failed its check: {replaced['problem']}")
    if (replaced["newest_at"] or 0) > (restored["newest_at"] or 0):
        console.print("the store " + ("now" if dry_run else "it replaced") + f" holds records newer than the backup "
                      f"(up to {when(replaced['newest_at'])})" + ("" if dry_run else "; they are in the kept file"))
    if report["kept_as"]:
        console.print(f"the replaced store is kept as {report['kept_as']} (kvctl db restore {report['kept_as']} "
                      "undoes this)")


def _count(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"
