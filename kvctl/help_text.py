"""Help text that wraps to the terminal: Typer keeps a docstring's single line breaks, so a
paragraph written at 100 columns comes out ragged at 80. `reflow_help` joins them (a paragraph
whose lines are indented, an example or a table, stays as written). `keep_names_whole` keeps
Typer's help tables from cutting an option's name at 80 columns. Nothing here imports torch:
kvd's CLI uses it too."""

from __future__ import annotations

import inspect


def reflow(doc: str) -> str:
    """A docstring with each paragraph's lines joined into one."""
    paragraphs = inspect.cleandoc(doc).split("\n\n")
    out = []
    for paragraph in paragraphs:
        lines = paragraph.split("\n")
        if paragraph.startswith("\b") or any(line.startswith((" ", "\t")) for line in lines):
            out.append(paragraph)
        else:
            out.append(" ".join(line.strip() for line in lines))
    return "\n\n".join(out)


def reflow_help(app) -> None:
    """Reflow the docstring of every command of a Typer app and of its groups (a group's own, its
    callback's, too: `kvctl tiers --help`), in place."""
    callback = app.registered_callback
    for info in [*app.registered_commands, *([callback] if callback is not None else [])]:
        if info.callback is not None and info.callback.__doc__:
            info.callback.__doc__ = reflow(info.callback.__doc__)
    for group in app.registered_groups:
        reflow_help(group.typer_instance)


def keep_names_whole() -> None:
    """Have Typer's help keep option names whole (`names_whole`), set up when help is first shown:
    importing Typer's rich help at every start would cost each kvctl call 12 ms."""
    from typer import core

    for command_class in (core.TyperCommand, core.TyperGroup):
        shown = command_class.format_help
        if getattr(shown, "keeps_names_whole", False):
            continue

        def format_help(self, ctx, formatter, _shown=shown):
            names_whole()
            return _shown(self, ctx, formatter)

        format_help.keeps_names_whole = True
        command_class.format_help = format_help


def names_whole() -> None:
    """Typer's help tables cut a long option's name at 80 columns ("--prefetch-timeout-per-1k-tok…",
    "--no-allow-uncalib…"): an operator copying it gets a flag that does not exist. From here on
    an option's `--no-` form goes below its name, in the same column, not in a column of its own
    that every row pays for; the names' columns are as wide as their widest name and never wrap;
    the help column wraps, folding a word longer than itself rather than cutting it."""
    from rich.table import Table
    from rich.text import Text
    from typer import rich_utils

    if getattr(rich_utils.Table, "keeps_names_whole", False):
        return

    def plain(cell) -> str:
        return getattr(cell, "plain", str(cell))

    class NamesWhole(Table):
        keeps_names_whole = True

        def add_row(self, *cells, **kwargs):
            # an options row: [required,] long names, short names, --no- long, --no- short, type, help
            if len(cells) in (6, 7):
                head, (long, short, no_long, no_short, *rest) = cells[:len(cells) - 6], cells[len(cells) - 6:]
                if plain(no_long) or plain(no_short):
                    long = Text("\n").join([Text.from_markup(x) if isinstance(x, str) else x
                                            for x in (long, no_long) if plain(x)])
                    short = Text("\n").join([Text.from_markup(x) if isinstance(x, str) else x
                                             for x in (short, no_short) if plain(x)])
                    no_long = no_short = ""
                cells = (*head, long, short, no_long, no_short, *rest)
            return super().add_row(*cells, **kwargs)

        def __rich_console__(self, console, options):
            for column in self.columns[:-1]:
                column.no_wrap = True
                column.min_width = max((len(line) for cell in column.cells for line in plain(cell).splitlines()),
                                       default=0)
            if self.columns:
                self.columns[-1].overflow = "fold"
            yield from super().__rich_console__(console, options)

    rich_utils.Table = NamesWhole
