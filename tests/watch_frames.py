"""`kvctl ... --watch` driven over a list of answers: what the watch showed last, and how many it fetched."""

from __future__ import annotations


def watch_frames(frames: list[dict], render, width: int = 120) -> tuple[int, str]:
    """Run `watch_status` over `frames` (one fetch each; Ctrl-C after the last) with `render`:
    (answers fetched, the text of the latest picture)."""
    from rich.console import Console

    from kvctl.status_view import watch_status

    fetched = []

    def fetch():
        fetched.append(frames[len(fetched)])
        return fetched[-1]

    def sleep(_):
        if len(fetched) == len(frames):
            raise KeyboardInterrupt

    console = Console(record=True, width=width)
    watch_status(fetch, console, sleep=sleep, render=render)
    return len(fetched), console.export_text()
