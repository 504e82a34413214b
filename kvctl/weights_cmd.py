"""kvctl update-weights: serve the weights of another checkpoint of the same model from the next
request, without a restart (daemon/server/weights_ops.py decides and does it; SGLang's
/update_weights_from_disk does the same). kvctl asks and shows what changed."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape

from .command_kit import client_for
from .errors import UserError
from .ops import show_fleet_answer
from .tables import seconds


def update_weights(ctx: typer.Context,
                   model_path: str = typer.Argument(..., help="The checkpoint folder on kvd's machine (absolute)."),
                   timeout: float = typer.Option(60.0, "--timeout", help="Wait up to this many seconds for the "
                                                 "running requests to finish on the weights before."),
                   abort_running: bool = typer.Option(False, "--abort-running", help="Cancel the running requests "
                                                      "instead of waiting for them (as their clients leaving would)."),
                   as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Serve another checkpoint's weights of the same model from the next request, without a restart.

    The folder must hold the served model (its config.json's shapes and its tokenizer); only the
    weights, and so the revision, change. Running requests finish on the weights before while new
    ones wait in the queue. The revision is part of every block key: what the weights before
    computed is dropped from the device and host memory at once, never served under the new ones
    (vLLM and SGLang need /reset_prefix_cache for that), and pins made under them are stranded.
    Until a restart: set model in kvd's config to keep it. Audited; at kvd router, every replica.

    Example: kvctl update-weights /srv/ckpt/step-1200 --timeout 120
    """
    if not 0 <= timeout <= 600:
        raise UserError(f"timeout: 0 to 600 seconds, got {timeout!r}")
    data = client_for(ctx).post("/admin/weights", {"model_path": model_path, "timeout": timeout,
                                                   "abort_running": abort_running})
    show_fleet_answer(data, as_json,
                      lambda d: Console().print(escape(updated_text(d)), highlight=False, soft_wrap=True),
                      lambda row: f"revision {row['revision'][:12]}"
                      + (f", {row['dropped_blocks']:,} blocks dropped" if row.get("updated") else " already"))


def updated_text(d: dict) -> str:
    """What `kvctl update-weights` prints of kvd's answer."""
    if not d.get("updated"):
        return f"revision {d['revision'][:12]} of {d['model_path']} is served already: nothing changed"
    revisions = d.get("revisions") or [d["revision"]]
    lines = [f"serving {d['model_path']}: revision {', '.join(r[:12] for r in revisions)} "
             f"(was {d['previous_revision'][:12]})"
             + (f", read in {seconds(d['read_seconds'])}, after {seconds(d['waited_seconds'])} waiting for running "
                "requests" if "read_seconds" in d else "")
             + (" (copied into the served tensors in place: the GPU held one set)" if d.get("in_place") else "")]
    lines.append(f"cache: {d['dropped_blocks']:,} blocks of the revision before dropped from the device, "
                 f"{d['dropped_host_blocks']:,} from host memory; disk and Redis keep theirs for `kvctl evict "
                 f"--model-revision {d['previous_revision'][:12]}`")
    stranded = d.get("stranded_pins") or []
    if stranded:
        lines.append(f"pins: {len(stranded)} stranded ({', '.join(p['pin_id'] for p in stranded)}): pin their prompts "
                     "again, then `kvctl unpin --stranded`")
    lines.append("until kvd restarts: set model in its config to keep it")
    return "\n".join(lines)
