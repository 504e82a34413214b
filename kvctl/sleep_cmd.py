"""kvctl sleep and kvctl wake: give back the memory kvd's cache (and its weights) takes, keeping
the process, its pins and its lower tiers; take it again (daemon/server/sleep_ops.py decides and
does it, as vLLM's and SGLang's sleep mode: kvctl asks and shows what happened)."""

from __future__ import annotations

from typing import Optional

import typer
from rich.console import Console

from .command_kit import client_for
from .errors import UserError
from .ops import show_fleet_answer
from .tables import seconds, size, when

ONLY = {"kv-cache": "kv_cache", "kv_cache": "kv_cache", "weights": "weights"}
ONLY_HELP = "Only this: kv-cache or weights (a trainer wakes the weights alone to update them)."


def _tags(only: str | None) -> list[str] | None:
    if only is None:
        return None
    if only not in ONLY:
        raise UserError(f"only: unknown value {only!r}; use kv-cache or weights")
    return [ONLY[only]]


def sleep_daemon(ctx: typer.Context,
                 level: int = typer.Option(1, "--level", help="1: the cache's memory (the weights to host memory on "
                                           "a GPU); 2: the weights dropped too, read again on waking."),
                 timeout: float = typer.Option(0.0, "--timeout", help="Wait up to this many seconds for the "
                                               "requests in flight; some left then: kvd stays awake (exit 2)."),
                 only: Optional[str] = typer.Option(None, "--only", help=ONLY_HELP),
                 as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Give back the memory of kvd's cache (and weights); the process, pins and lower tiers stay.

    Before the cache's memory goes, the cached blocks no lower tier holds are written to the
    first one (host, else disk, else Redis), the most reused prefixes first: waking brings the
    pinned prefixes back at once, and the rest as requests ask for them. Asleep, completions get
    503 (code asleep) and /readyz 503, so routers leave it out; what only reads goes on. vLLM's
    POST /sleep and SGLang's /release_memory_occupation do the same. Audited.

    Example: kvctl sleep --level 1 --timeout 120
    """
    if level not in (1, 2):
        raise UserError(f"level: 1 or 2, got {level}")
    if not 0 <= timeout <= 600:
        raise UserError(f"timeout: 0 to 600 seconds, got {timeout!r}")
    data = client_for(ctx).post("/admin/sleep", {"level": level, "timeout": timeout, "tags": _tags(only)})
    _show(data, as_json, asleep_text, lambda row: "asleep" if row["is_sleeping"] else "awake")


def wake_daemon(ctx: typer.Context,
                only: Optional[str] = typer.Option(None, "--only", help=ONLY_HELP),
                as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Take back the memory `kvctl sleep` gave: completions are taken again.

    The weights come back first (copied from host memory, or read from the checkpoint, which
    must not have changed meanwhile: kvd stays asleep and says so), then the cache, empty.

    Example: kvctl wake; kvctl wake --only weights
    """
    data = client_for(ctx).post("/admin/wake", {"tags": _tags(only)})
    _show(data, as_json, awake_text, lambda row: "still asleep" if row["is_sleeping"] else "awake")


def _show(data: dict, as_json: bool, text, each) -> None:
    show_fleet_answer(data, as_json, lambda d: Console().print(text(d), highlight=False), each)


WEIGHTS = {"discarded": "dropped; waking reads the checkpoint again",
           "offloaded": "moved to host memory; waking copies them back",
           "kept": "stay in host memory (kvd runs on the CPU)"}


ADAPTERS = {"offloaded": "moved to host memory; waking copies them back",
            "kept": "stay in host memory (kvd runs on the CPU)"}


def asleep_text(d: dict) -> str:
    """What `kvctl sleep` prints of kvd's answer."""
    if d.get("already"):
        return (f"asleep already: level {d['level']} since {when(d['since'])}, by {d['by']} "
                f"({', '.join(d['released']) or 'nothing'} given back)")
    lines = [f"asleep at level {d['level']}: completions get 503 until `kvctl wake`"]
    if "kv_cache" in d["released"]:
        saved = (f"{d['saved_blocks']:,} written to the {d['saved_to']} tier, {d['held_below']:,} there already, "
                 if d["saved_to"] else "no lower tier to keep them, ")
        lines.append(f"  cache    {size(d['cache_bytes'])} given back; of {d['dropped_blocks']:,} cached blocks: "
                     f"{saved}{d['discarded_blocks']:,} dropped")
    if d["weights"]:
        took = f"{size(d['weight_bytes'])} " if d["weight_bytes"] else ""
        lines.append(f"  weights  {took}{WEIGHTS[d['weights']]}")
    if d.get("adapters"):  # LoRA adapters served (an older kvd does not say)
        took = f"{size(d['adapter_bytes'])} " if d["adapter_bytes"] else ""
        lines.append(f"  adapters {took}{ADAPTERS[d['adapters']]}")
    return "\n".join(lines)


def awake_text(d: dict) -> str:
    """What `kvctl wake` prints of kvd's answer."""
    if d.get("already"):
        return "awake already: completions are taken"
    head = (f"awake after {seconds(d['asleep_seconds'])} asleep: completions are taken again" if not d["is_sleeping"]
            else f"still asleep: {', '.join(d['still_released'])} given back (`kvctl wake` takes the rest)")
    lines = [head]
    if "weights" in d["woke"]:
        took = f" in {seconds(d['weights_seconds'])}" if d.get("weights_seconds") is not None else ""
        lines.append(f"  weights  {size(d['weight_bytes'])} {d['weights']}{took}")
        if d.get("adapters"):
            lines.append(f"  adapters {size(d['adapter_bytes'])} {d['adapters']}")
    if "kv_cache" in d["woke"]:
        pins = d["pins_warming"]
        lines.append(f"  cache    {size(d['cache_bytes'])} taken again, empty: "
                     + (f"{pins:,} pinned prefix{'es' if pins != 1 else ''} warming from the lower tiers, the rest "
                        "as requests ask" if pins else "filled again as requests ask"))
    return "\n".join(lines)
