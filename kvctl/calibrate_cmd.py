"""`kvctl calibrate`: have kvd calibrate a quantised cache format and report its quality."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from .option_lists import parse_int_list
from .errors import UserError
from .command_kit import client_for


def read_prompts(path: Path) -> list:
    prompts = []
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise UserError(f"prompts: cannot read {str(path)!r} ({exc.strerror})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"prompts: {path.name} line {number} is not JSON") from None
        if isinstance(item, dict) and isinstance(item.get("text"), str):
            prompts.append(item["text"])
        elif isinstance(item, dict) and isinstance(item.get("tokens"), list):
            prompts.append(item["tokens"])
        elif isinstance(item, str):
            prompts.append(item)
        elif isinstance(item, dict) and ("text" in item or "tokens" in item):
            field, want = ("text", "a string") if "text" in item else ("tokens", "a list of token ids")
            raise UserError(f"prompts: {path.name} line {number}: '{field}' must be {want}, "
                            f"got {json.dumps(item[field])[:40]}")
        else:
            raise UserError(f"prompts: {path.name} line {number} needs a 'text' or 'tokens' field")
    if len(prompts) < 2:
        raise UserError("prompts: give at least two (half calibrate, half are held out)")
    return prompts


def calibrate_command(
    ctx: typer.Context,
    dtype: str = typer.Option("fp8_e4m3", help="fp8_e4m3 (or fp8), fp8_e5m2 or int8."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="JSONL of {'text'} or {'tokens'}; "
                                                                 "default: a built-in set."),
    max_tokens: int = typer.Option(16, help="Greedy tokens compared per held-out prompt."),
    max_kl: float = typer.Option(0.01, help="Quality target: worst slice's mean KL (nats)."),
    margin: float = typer.Option(1.0, help="Outlier margin, 1 to 100: scale = absmax x margin / format max."),
    slices: str = typer.Option("512,2048", help="Context-length slices for the report."),
    if_older_than: Optional[str] = typer.Option(None, help="No-op if a calibration newer than this exists (7d)."),
    apply: bool = typer.Option(False, "--apply", help="Make it the active scale set if it meets the target."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Calibrate a quantised cache: scales from measured maxima, quality by context slice, layer ranking.

    Example: kvctl calibrate --dtype fp8_e4m3 --max-kl 0.005 --apply --if-older-than 7d
    """
    from kvctl.daemon.server.durations import parse_duration

    try:
        older = parse_duration(if_older_than) if if_older_than else None
    except ValueError:
        raise UserError(f"if_older_than: invalid value {if_older_than!r}; use 12h, 7d") from None
    body = {"dtype": dtype, "max_tokens": max_tokens, "max_kl": max_kl, "margin": margin,
            "slices": parse_int_list("slices", [slices]), "if_older_than": older, "apply": apply,
            "prompts": read_prompts(prompts) if prompts else None}
    console = Console(stderr=True)
    with console.status("calibrating: measuring maxima, deriving scales, evaluating slices, ranking layers"):
        data = client_for(ctx).post("/admin/calibrate", body)
    if as_json:
        typer.echo(json.dumps(data, indent=2))
    elif data.get("skipped"):
        Console().print(f"skipped: {data['reason']}")
    else:
        table = Table("slice (tokens)", "prompts", "KL", "top-1 agreement", "greedy match", "ppl change",
                      title=f"calibration {data['calibration_id']}: {data['dtype']}, margin {data['margin']}")
        for r in data["slices"]:
            table.add_row(f"<= {r['max_context']}", str(r["prompts"]), f"{r['kl']:.2e}",
                          f"{r['top1_agreement']:.1%}", f"{r['greedy_match_len']:.1f}", f"{r['ppl_delta']:+.2%}")
        Console().print(table)
        Console().print("layer sensitivity (KL with one layer quantised): "
                        + ", ".join(f"{i}: {v:.1e}" for i, v in enumerate(data["layer_sensitivity"])))
        Console().print(f"recommended keep_layers_unquantised: {data['recommended_keep_layers'] or 'none'}; "
                        f"meets max_kl {data['max_kl']}: {'yes' if data['meets_target'] else 'no'}")
        if data.get("applied"):
            Console().print(f"applied ({data['takes_effect']})")
    if data.get("refused"):
        Console(stderr=True).print(data["refused"])
        raise typer.Exit(3)
