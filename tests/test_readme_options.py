"""The command lines the README shows name commands and options that kvctl and kvd have: a flag
renamed in the code and left in the README would send an operator to an error."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

typer = pytest.importorskip("typer")

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# the examples that run kvctl and kvd as they are: systemd units, cron lines, their README
EXAMPLES = [ROOT / "examples" / "README.md", ROOT / "examples" / "crontab", *sorted((ROOT / "examples").glob("*.service")),
            *sorted((ROOT / "examples").glob("*.timer"))]
SEPARATORS = re.compile(r"\s*(?:;|&&|\|\||\bthen\b)\s*")


def shown_lines(text: str, program: str, markdown: bool = True) -> list[str]:
    """`program ...` as a markdown file shows it: inline code spans, and lines of its code blocks
    (comments cut off), each split where a shell line chains another command; in another file
    (`markdown` false: a unit, a crontab), any line of it."""
    spans = re.findall(rf"`({program} [^`]+)`", text)
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S) if markdown else [text]:
        for line in block.splitlines():
            found = re.search(rf"(?:^|[\s/=(]){program}\s(.*)$", line.split(" #")[0])
            if found:
                spans.append(f"{program} {found.group(1).strip()}")
    return [part for span in spans for part in SEPARATORS.split(span) if part.startswith(f"{program} ")]


def unknown_options(root, line: str) -> tuple[list[str], list[str]]:
    """(the command path the line names, the --options it shows that the command and the groups
    above it do not have). Words after the command path are arguments or placeholders."""
    tokens = line.split()[1:]
    command, path, options = root, [], {"--help", *(o for p in root.params for o in (*p.opts, *p.secondary_opts))}
    for token in tokens:
        if hasattr(command, "commands") and token in command.commands:
            command = command.commands[token]
            path.append(token)
            options |= {o for p in command.params for o in (*p.opts, *p.secondary_opts)}  # (--x/--no-x: both)
    shown = {t.split("=")[0] for t in (t.strip("[]()|`,.:\\") for t in tokens)
             if re.fullmatch(r"--[a-z][a-z0-9-]*(=\S*)?", t)}
    return path, sorted(shown - options)


@pytest.mark.parametrize("program, module", [("kvctl", "kvctl.cli"), ("kvd", "kvctl.daemon.cli")])
def test_every_option_the_readme_shows_is_one_the_command_has(program, module):
    import importlib

    root = typer.main.get_command(importlib.import_module(module).app)
    lines = shown_lines(README.read_text(), program)
    assert len(lines) > 50  # the README shows many; none found would mean the search is broken
    lines += [line for path in EXAMPLES for line in shown_lines(path.read_text(), program, path.suffix == ".md")]
    wrong = []
    for line in lines:
        path, unknown = unknown_options(root, line)
        if path and unknown:
            wrong.append(f"{program} {' '.join(path)}: {', '.join(unknown)} (in: {line})")
    assert wrong == []


def test_the_check_finds_an_option_a_command_lacks():
    from kvctl.cli import app

    root = typer.main.get_command(app)
    assert unknown_options(root, "kvctl unpin --tenant T --stranded") == (["unpin"], [])
    assert unknown_options(root, "kvctl --socket S pins [--tenant T] [--owner O]") == (["pins"], ["--owner"])
    assert unknown_options(root, "kvctl bench window [--windw 128]") == (["bench", "window"], ["--windw"])
    assert shown_lines("run `kvctl pins; kvctl unpin --tenant T` then\n```bash\nsudo kvctl tiers  # see\n```\n",
                       "kvctl") == ["kvctl pins", "kvctl unpin --tenant T", "kvctl tiers"]
