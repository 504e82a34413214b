"""Tables for an operator's terminal: compact enough for 80 columns, and never cutting the ids
that an operator copies into the next command (`kvctl unpin`, `kvctl swap`, `kvctl evict`).

    table = compact_table("prefix", "tenant", "size")
    ...add rows...
    keep_whole(table, 0)   # the prefix id column: its full width, never wrapped or cut
"""

from __future__ import annotations

import time

from rich.console import Group
from rich.table import Table
from rich.text import Text

from kvctl.daemon.server.byte_sizes import format_bytes as size  # noqa: F401 (kvctl's tables use it)
from kvctl.daemon.server.durations import format_duration as duration  # noqa: F401 (kvctl's tables use it)


def compact_table(*headers: str, title: str | None = None) -> Table:
    """A table with no border and one space between columns; the header is underlined."""
    return Table(*headers, title=title, box=None, collapse_padding=True, pad_edge=False,
                 header_style="bold underline")


def keep_whole(table: Table, *columns: int) -> None:
    """Give each of `columns` the width of its longest cell and never wrap it (call after adding
    the rows): the other columns wrap instead."""
    for index in columns:
        column = table.columns[index]
        column.no_wrap = True
        column.min_width = max([len(line) for cell in column.cells for line in str(cell).splitlines()]
                               + [len(str(column.header))])


def fit_cells(table: Table, *columns: int, words: tuple[int, ...] = ()) -> None:
    """Give each of `columns` at least the width of its longest cell, and each of `words` that of
    its longest word (call after adding the rows), so a narrow terminal never cuts a figure to
    "1,436…" or a word to "follo…": headers and the cells of `words` wrap at their spaces instead."""
    for index in (*columns, *words):
        column = table.columns[index]
        pieces = [str(cell) for cell in column.cells] if index in columns else \
            [word for cell in column.cells for word in str(cell).split()]
        column.min_width = max(len(piece) for piece in [*pieces, *str(column.header).split(), ""])


def count(n: int) -> str:
    """A count for a narrow column: whole below 100,000 (99,999), else three significant figures
    and k, M, B or T (123k, 1.23M, 45.6B): six characters at most, so a fleet's figures fit an
    80-column table. `--json` has them whole."""
    if n < 100_000:
        return f"{n:,}"
    for power, suffix in ((1, "k"), (2, "M"), (3, "B"), (4, "T")):
        value = n / 1000 ** power
        text = f"{value:.2f}" if value < 9.995 else f"{value:.1f}" if value < 99.95 else f"{value:.0f}"
        if float(text) < 1000 or suffix == "T":
            return text + suffix
    raise AssertionError("unreachable")


def seconds(value: float | None) -> str:
    """A duration for a status line: 12.5 ms, 1.50 s; '-' when unknown."""
    return "-" if value is None else (f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s")


def when(at: float | None) -> str:
    """A Unix time as local date and time to the second: 2026-11-30 04:17:44; '-' when unknown."""
    return "-" if at is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


def by_replica(rows: list[dict], view) -> Group:
    """kvd router's answer of each replica's report (`{"replicas": [{"replica", "report" or
    "error"}]}`): each under its name, as `view(report)` draws it; one that did not answer says why."""
    parts: list = []
    for row in rows:
        if "report" in row:
            parts += [Text(f"replica {row['replica']}", style="bold"), view(row["report"]), Text("")]
        else:
            parts += [Text(f"replica {row['replica']}: no answer ({row.get('error')})", style="yellow"), Text("")]
    return Group(*parts)
