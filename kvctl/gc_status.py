"""`kvctl status`'s line on Python's garbage collector in kvd or kvd router (their status's
`gc`, made by daemon/server/gc_pauses.py)."""

from __future__ import annotations

from rich.text import Text

from .tables import seconds, when


def gc_line(gc: dict) -> Text:
    """Python's garbage collections in one process (a kvd's or kvd router's `gc` status): whether
    the start's heap is frozen, the whole-heap walks and their longest, and the pauses past
    gc_warn_seconds (yellow)."""
    collections, longest = gc["collections"], gc["longest_seconds"]
    frozen = (f"start's heap frozen ({gc['frozen_objects']:,} objects)" if gc["frozen_objects"]
              else "heap not frozen (gc_freeze off)")
    whole = (f"{collections['2']:,} whole-heap collection{'s' if collections['2'] != 1 else ''}, longest "
             f"{seconds(longest['2'])}" if collections["2"] else "no whole-heap collection yet")
    line = (f"{frozen}; {whole}; {collections['0'] + collections['1']:,} younger, longest "
            f"{seconds(max(longest['0'], longest['1']))}")
    last = gc.get("last_slow")
    if not gc.get("slow") or last is None:
        return Text(line)
    return Text(f"{line}; {gc['slow']:,} stopped every thread {seconds(gc['warn_seconds'])} or longer, the latest "
                f"{seconds(last['seconds'])} at {when(last['at'])}", style="yellow")
