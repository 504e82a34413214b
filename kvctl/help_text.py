"""Help text that wraps to the terminal: Typer keeps a docstring's single line breaks, so a
paragraph written at 100 columns comes out ragged at 80. `reflow_help` joins them (a paragraph
whose lines are indented, an example or a table, stays as written). No imports beyond the
standard library: kvd's CLI uses it too."""

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
    """Reflow the docstring of every command of a Typer app and of its groups, in place."""
    for info in app.registered_commands:
        if info.callback is not None and info.callback.__doc__:
            info.callback.__doc__ = reflow(info.callback.__doc__)
    for group in app.registered_groups:
        reflow_help(group.typer_instance)
