"""Architecture decision records, kept append-only in the store.

A record has a title and the fields below; each edit adds a revision, nothing is rewritten.
Its status moves proposed -> accepted | rejected, and accepted -> superseded (by another
record). Evidence cites stored runs by id (`run:12`), which must exist.

Markdown form (for --from-file and export): a `# Title` line, then `## Field` sections.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field

from .store import Store

FIELDS = ("context", "alternatives", "evidence", "assumptions", "decision", "rollout_plan",
          "reversal_trigger", "unresolved_risks")
HEADINGS = {f: f.replace("_", " ").capitalize() for f in FIELDS}
STATUSES = ("proposed", "accepted", "rejected", "superseded")
RUN_REF = re.compile(r"\brun:(\d+)\b")
NOT_WRITTEN = "(not written yet)"  # what an empty section shows; read back as empty
EXPORTED_TITLE = re.compile(r"^ADR \d+: ")  # the prefix `markdown()` puts before the title


class RecordError(ValueError):
    """An ADR operation that cannot be done; the message names the record and the rule."""


@dataclass
class Adr:
    id: int
    status: str
    title: str
    fields: dict[str, str]
    revision: int
    created_at: float
    updated_at: float
    author: str
    superseded_by: int | None
    rollouts: list[dict] = field(default_factory=list)  # the rollouts that carry it out: id, state, fraction

    def as_dict(self) -> dict:
        return {"id": self.id, "status": self.status, "title": self.title, "revision": self.revision,
                "created_at": self.created_at, "updated_at": self.updated_at, "author": self.author,
                "superseded_by": self.superseded_by, "fields": self.fields,
                "evidence_runs": [int(x) for x in RUN_REF.findall(self.fields.get("evidence", ""))],
                "rollouts": self.rollouts}

    def markdown(self) -> str:
        # list items, each on its own line when rendered; not sections, so that an exported record
        # stays valid --from-file input
        lines = [f"# ADR {self.id}: {self.title}", "",
                 f"- Status: {self.status}" + (f" (superseded by ADR {self.superseded_by})" if self.superseded_by else ""),
                 f"- Revision: {self.revision}, by {self.author}"]
        if self.rollouts:
            lines.append("- Rollouts: " + ", ".join(f"{r['id']} ({r['state']}, cohort {r['fraction']:.0%})"
                                                    for r in self.rollouts))
        lines.append("")
        for name in FIELDS:
            lines += [f"## {HEADINGS[name]}", "", self.fields.get(name, "").strip() or NOT_WRITTEN, ""]
        return "\n".join(lines)


def parse_markdown(text: str) -> tuple[str | None, dict[str, str]]:
    """Title (from '# ...') and fields (from '## Heading' sections); unknown headings are refused.

    Reads back what `Adr.markdown()` writes (`adr export`): the 'ADR N: ' before the title is
    dropped and a section that says it is not written yet is empty, so an exported record edited
    and given to `adr edit --from-file` changes only what was written."""
    title, fields, current = None, {}, None
    by_heading = {h.lower(): f for f, h in HEADINGS.items()}
    for line in text.splitlines():
        if line.startswith("## "):
            heading = line[3:].strip().lower()
            if heading not in by_heading:
                raise RecordError(f"adr: unknown section {line[3:].strip()!r}; use "
                                  f"{', '.join(HEADINGS.values())}")
            current = by_heading[heading]
            fields[current] = ""
        elif line.startswith("# ") and title is None and current is None:
            title = EXPORTED_TITLE.sub("", line[2:].strip())
        elif current is not None:
            fields[current] += line + "\n"
    return title, {k: "" if v.strip() == NOT_WRITTEN else v.strip() for k, v in fields.items()}


class Records:
    def __init__(self, store: Store) -> None:
        self.store = store

    def _check_evidence(self, fields: dict[str, str]) -> None:
        for ref in RUN_REF.findall(fields.get("evidence", "")):
            if self.store.get_run(int(ref)) is None:
                raise RecordError(f"evidence: run:{ref} is not a stored run (kvctl bench ... --save stores one)")

    def new(self, title: str, fields: dict[str, str], author: str) -> Adr:
        if not title or not title.strip():
            raise RecordError("title: must not be empty")
        unknown = sorted(set(fields) - set(FIELDS))
        if unknown:
            raise RecordError(f"adr: unknown field {unknown[0]!r}")
        self._check_evidence(fields)
        now = time.time()
        with self.store.write() as conn:
            adr_id = conn.execute("INSERT INTO adrs (created_at, status) VALUES (?, 'proposed')", (now,)).lastrowid
            conn.execute("INSERT INTO adr_revisions (adr_id, revision, at, author, title, body) "
                         "VALUES (?, 1, ?, ?, ?, ?)", (adr_id, now, author, title.strip(), json.dumps(fields)))
        self.store.audit(actor=author, tenant="-", action="adr.new", target=f"adr:{adr_id}", result="ok")
        return self.get(adr_id)

    def edit(self, adr_id: int, title: str | None, fields: dict[str, str], author: str) -> Adr:
        """A new revision with the given fields changed; the old one stays."""
        current = self.get(adr_id)
        if current.status in ("rejected", "superseded"):
            raise RecordError(f"adr {adr_id}: is {current.status}; write a new record instead")
        merged = {**current.fields, **fields}
        self._check_evidence(merged)
        with self.store.write() as conn:
            conn.execute("INSERT INTO adr_revisions (adr_id, revision, at, author, title, body) "
                         "VALUES (?, ?, ?, ?, ?, ?)", (adr_id, current.revision + 1, time.time(), author,
                                                     title or current.title, json.dumps(merged)))
        self.store.audit(actor=author, tenant="-", action="adr.edit", target=f"adr:{adr_id}", result="ok",
                         detail={"revision": current.revision + 1})
        return self.get(adr_id)

    def get(self, adr_id: int) -> Adr:
        row = self.store.read_one("SELECT id, created_at, status, superseded_by FROM adrs WHERE id = ?", (adr_id,))
        if row is None:
            raise RecordError(f"adr {adr_id}: no such record")
        rev = self.store.read_one(
            "SELECT revision, at, author, title, body FROM adr_revisions WHERE adr_id = ? "
            "ORDER BY revision DESC LIMIT 1", (adr_id,))
        rollouts = [{"id": r[0], "state": r[1], "fraction": r[2]} for r in self.store.read(
            "SELECT id, state, fraction FROM rollouts WHERE adr_id = ? ORDER BY id", (adr_id,))]
        return Adr(id=row[0], status=row[2], title=rev[3], fields=json.loads(rev[4]), revision=rev[0],
                   created_at=row[1], updated_at=rev[1], author=rev[2], superseded_by=row[3], rollouts=rollouts)

    def revisions(self, adr_id: int) -> list[dict]:
        self.get(adr_id)
        rows = self.store.read("SELECT revision, at, author, title FROM adr_revisions WHERE adr_id = ? "
                               "ORDER BY revision", (adr_id,))
        return [{"revision": r[0], "at": r[1], "author": r[2], "title": r[3]} for r in rows]

    def list(self, status: str | None = None) -> list[Adr]:
        if status is not None and status not in STATUSES:
            raise RecordError(f"status: unknown value {status!r}; use {', '.join(STATUSES)}")
        ids = [r[0] for r in self.store.read(
            "SELECT id FROM adrs" + (" WHERE status = ?" if status else "") + " ORDER BY id",
            (status,) if status else ())]
        return [self.get(i) for i in ids]

    def _transition(self, adr_id: int, to: str, allowed_from: tuple[str, ...], author: str,
                    superseded_by: int | None = None) -> Adr:
        with self.store.write() as conn:
            row = conn.execute("SELECT status FROM adrs WHERE id = ?", (adr_id,)).fetchone()
            if row is None:
                raise RecordError(f"adr {adr_id}: no such record")
            if row[0] not in allowed_from:
                raise RecordError(f"adr {adr_id}: cannot become {to} from {row[0]} "
                                  f"(only from {' or '.join(allowed_from)})")
            conn.execute("UPDATE adrs SET status = ?, superseded_by = ? WHERE id = ?", (to, superseded_by, adr_id))
        self.store.audit(actor=author, tenant="-", action=f"adr.{to}", target=f"adr:{adr_id}", result="ok",
                         detail={"superseded_by": superseded_by} if superseded_by else {})
        return self.get(adr_id)

    def accept(self, adr_id: int, author: str) -> Adr:
        """Accept a proposed record; one that does not say what is decided cannot be."""
        if not self.get(adr_id).fields.get("decision", "").strip():
            raise RecordError(f"adr {adr_id}: has no Decision section to accept; add one first "
                              f"(kvctl adr edit {adr_id} --from-file F with a '## Decision' section)")
        return self._transition(adr_id, "accepted", ("proposed",), author)

    def reject(self, adr_id: int, author: str) -> Adr:
        return self._transition(adr_id, "rejected", ("proposed",), author)

    def supersede(self, adr_id: int, by: int, author: str) -> Adr:
        if adr_id == by:
            raise RecordError(f"adr {adr_id}: cannot supersede itself")
        self.get(by)
        return self._transition(adr_id, "superseded", ("accepted", "proposed"), author, superseded_by=by)
