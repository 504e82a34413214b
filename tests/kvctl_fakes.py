"""kvctl run against a kvd that is not there: every call gets the answer a test gives, so a test
checks what kvctl sends and prints for an answer (kvd's own answers are tested against kvd)."""

from __future__ import annotations

from typing import Callable

import pytest


def kvctl_answered(args: list[str], answer: dict | Callable[[str, dict | None], dict],
                   sent: list | None = None, columns: int = 200):
    """`kvctl ARGS` (typer's Result: exit_code, output) where each GET, POST or DELETE gets
    `answer` (or `answer(path, body)`); `sent` collects (path, body) of each POST."""
    from typer.testing import CliRunner

    from kvctl.cli import app as kvctl_app

    def answered(path: str, body: dict | None) -> dict:
        return answer(path, body) if callable(answer) else answer

    class Answering:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def post(self, path, body):
            if sent is not None:
                sent.append((path, body))
            return answered(path, body)

        def get(self, path, **params):
            return answered(path, None)

        delete = get

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("kvctl.command_kit.Client", Answering)
        return CliRunner().invoke(kvctl_app, args, env={"COLUMNS": str(columns)})
