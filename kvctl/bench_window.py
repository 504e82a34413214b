"""kvctl bench window: a model whose every layer slides a window, served from the same cache two
ways in one process: giving back each sequence's blocks before its window (what kvd does), and
keeping every block (as a full-attention model must, and as kvd did before).

Both passes run the same requests through the same model (attending to the same window, so the
replies must be the same token for token) and a cache of the same number of blocks. Reported for
both: output tokens per second, the most requests running at once, the most blocks held at once
(reserved, written, shared), preemptions, engine steps and time to first token. The built-in
model is the demo checkpoint with a window of `--window` tokens; `--model DIR` measures a
checkpoint whose config slides every layer (Mistral 7B v0.1's kind).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from .errors import UserError


def sliding_copy(source: Path, target: Path, window: int) -> Path:
    """A copy of a checkpoint folder whose config.json slides every layer by `window` (as Mistral 7B v0.1)."""
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file():
            shutil.copy(path, target / path.name)
    config = json.loads((source / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=window)
    config.pop("layer_types", None)
    (target / "config.json").write_text(json.dumps(config))
    return target


def prompts_for(requests: int, tokens: int, vocab: int) -> list[list[int]]:
    """`requests` distinct prompts of `tokens` token ids each (no two share a first block)."""
    return [[(7 * i + 13 * j + (j * j) % 11) % vocab for j in range(tokens)] for i in range(1, requests + 1)]


def _run(loaded, prompt_ids: list[list[int]], max_tokens: int, num_blocks: int, block_size: int,
         batch_tokens: int, release: bool) -> dict:
    """One pass through a fresh engine; the most running and held at once are read after every step."""
    from kvctl.daemon.engine.engine import Engine, EngineSettings
    from kvctl.daemon.engine.sampling import SamplingParams

    engine = Engine(loaded, EngineSettings(num_blocks=num_blocks, block_size=block_size, max_batch_tokens=batch_tokens,
                                           max_running=len(prompt_ids), release_window_blocks=release))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    requests = [engine.add_request(p, params) for p in prompt_ids]
    steps = most_running = most_held = 0
    while engine.has_work():
        engine.step()
        steps += 1
        counts = engine.cache.state_counts()
        most_running = max(most_running, engine.num_running)
        most_held = max(most_held, counts["reserved"] + counts["active"] + counts["shared"])
    wall = time.perf_counter() - started
    tokens = sum(len(r.sequences[0].output_ids) for r in requests)
    ttft = sorted(r.metrics.first_token - r.metrics.arrival for r in requests)
    return {"seconds": wall, "steps": steps, "output_tokens": tokens, "output_tokens_per_second": tokens / wall,
            "most_running": most_running, "most_blocks_held": most_held, "preemptions": engine.stats.preemptions,
            "ttft_p50_s": ttft[len(ttft) // 2], "ttft_max_s": ttft[-1],
            "blocks_given_back": engine.cache.window_released, "replies": [r.sequences[0].output_ids for r in requests]}


def measure(loaded, *, requests: int, prompt_tokens: int, max_tokens: int, num_blocks: int, block_size: int,
            batch_tokens: int) -> dict:
    """Both passes on the same requests: keeping every block first, then giving them back."""
    from kvctl.policies.admission import blocks_for_tokens, sliding_window_blocks

    config = loaded.config
    prompt_ids = prompts_for(requests, prompt_tokens, min(config.vocab_size, 256))
    keep = _run(loaded, prompt_ids, max_tokens, num_blocks, block_size, batch_tokens, release=False)
    give = _run(loaded, prompt_ids, max_tokens, num_blocks, block_size, batch_tokens, release=True)
    same = sum(a == b for a, b in zip(keep.pop("replies"), give.pop("replies")))
    ratio = {key: give[key] / keep[key] for key in ("output_tokens_per_second", "most_running", "steps",
                                                    "ttft_p50_s", "ttft_max_s") if keep[key]}
    return {"settings": {"window": config.sliding_window, "requests": requests, "prompt_tokens": prompt_tokens,
                         "max_tokens": max_tokens, "num_blocks": num_blocks, "block_size": block_size,
                         "max_batch_tokens": batch_tokens,
                         "blocks_per_sequence_whole": blocks_for_tokens(prompt_tokens + max_tokens, block_size),
                         "blocks_per_sequence_window": sliding_window_blocks(config.sliding_window, batch_tokens,
                                                                             block_size)},
            "keep_every_block": keep, "give_back": give, "ratio": ratio, "identical_replies": same}


def window_command(
    ctx: typer.Context,
    window: int = typer.Option(128, "--window", help="The demo checkpoint's sliding window, in tokens."),
    model: Optional[str] = typer.Option(
        None, "--model", help="A checkpoint whose every layer slides a window (default: the demo checkpoint)."),
    requests: int = typer.Option(8, "--requests", help="Requests, all sent at once."),
    prompt_tokens: int = typer.Option(512, "--prompt-tokens", help="Tokens in each prompt."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Tokens generated per request."),
    num_blocks: Optional[int] = typer.Option(
        None, "--num-blocks", help="Cache blocks (default: room for two whole sequences)."),
    block_size: int = typer.Option(16, "--block-size", help="Tokens per block."),
    batch_tokens: int = typer.Option(64, "--max-batch-tokens", help="kvd's max_batch_tokens (prompt chunk budget)."),
    save: bool = typer.Option(False, "--save", help="Store the result so an ADR can cite it (run:ID)."),
    state_dir: Optional[str] = typer.Option(None, "--state-dir", help="Where the store lives (KVD_STATE_DIR)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """A sliding-window model giving back the blocks its windows passed, beside the same cache keeping them.

    Example: kvctl bench window --window 256 --requests 16 --prompt-tokens 1024
    """
    for name, value in (("window", window), ("requests", requests), ("prompt-tokens", prompt_tokens),
                        ("max-tokens", max_tokens), ("max-batch-tokens", batch_tokens)):
        if value < 1:
            raise typer.BadParameter(f"{name}: must be >= 1, got {value}")
    if block_size not in (8, 16, 32, 64, 128, 256):
        raise typer.BadParameter(f"block-size: must be 8, 16, 32, 64, 128 or 256, got {block_size}")
    from kvctl.daemon.model.config import ModelError
    from kvctl.daemon.model.demo import ensure_demo_checkpoint
    from kvctl.daemon.model.llama import load_model
    from kvctl.policies.admission import blocks_for_tokens

    blocks = num_blocks if num_blocks is not None else 2 * blocks_for_tokens(prompt_tokens + max_tokens, block_size)
    with tempfile.TemporaryDirectory(prefix="kvctl-bench-window-") as scratch:
        try:
            if model is None:
                demo = ensure_demo_checkpoint(Path(scratch) / "state")
                loaded = load_model(sliding_copy(demo, Path(scratch) / "sliding", window))
            else:
                loaded = load_model(model)
        except ModelError as exc:
            raise UserError(str(exc)) from None
        config = loaded.config
        if not config.every_layer_slides:
            slides = ("no layer slides a window" if config.sliding_window is None else
                      f"{len(config.sliding_layers)} of its {config.num_layers} layers slide a window of "
                      f"{config.sliding_window} tokens")
            raise UserError(f"model: {model!r}: {slides}; a layer that attends in full needs every block, so there is "
                            "nothing to give back")
        longest = blocks_for_tokens(prompt_tokens + max_tokens, block_size)
        if blocks < longest:
            raise UserError(f"num_blocks: {blocks} cannot hold one whole sequence ({longest} blocks), which the pass "
                            "that keeps every block needs")
        document = measure(loaded, requests=requests, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                           num_blocks=blocks, block_size=block_size, batch_tokens=batch_tokens)
    document["model"] = model or "demo"
    from .records_cmd import save_and_show

    save_and_show(ctx, state_dir, "bench_window", document, save, as_json, render)


def render(document: dict, console: Console | None = None) -> None:
    console = console or Console()
    keep, give, ratio, settings = (document["keep_every_block"], document["give_back"], document["ratio"],
                                   document["settings"])
    model = document.get("model", "demo")
    table = Table("", "keeping every block", "giving back", "ratio",
                  title=f"{settings['requests']} requests of {settings['prompt_tokens']:,} + "
                        f"{settings['max_tokens']:,} tokens, window {settings['window']:,}, "
                        f"{settings['num_blocks']:,} blocks of {settings['block_size']} ({model})")

    def ms(value):
        return f"{value * 1000:,.1f} ms"

    def ratio_of(key):
        return f"{ratio[key]:.2f}" if key in ratio else "-"

    table.add_row("output tokens/s", f"{keep['output_tokens_per_second']:,.0f}",
                  f"{give['output_tokens_per_second']:,.0f}", ratio_of("output_tokens_per_second"))
    table.add_row("most running at once", f"{keep['most_running']}", f"{give['most_running']}",
                  ratio_of("most_running"))
    table.add_row("most blocks held", f"{keep['most_blocks_held']:,}", f"{give['most_blocks_held']:,}", "")
    table.add_row("time to first token p50", ms(keep["ttft_p50_s"]), ms(give["ttft_p50_s"]), ratio_of("ttft_p50_s"))
    table.add_row("time to first token, last", ms(keep["ttft_max_s"]), ms(give["ttft_max_s"]), ratio_of("ttft_max_s"))
    table.add_row("engine steps", f"{keep['steps']:,}", f"{give['steps']:,}", ratio_of("steps"))
    table.add_row("preemptions", f"{keep['preemptions']}", f"{give['preemptions']}", "")
    console.print(table)
    console.print(f"A sequence needs {settings['blocks_per_sequence_whole']:,} blocks kept whole, at most "
                  f"{settings['blocks_per_sequence_window']:,} under its window; {give['blocks_given_back']:,} blocks "
                  f"given back (they stay cached); replies identical: {document['identical_replies']} of "
                  f"{settings['requests']}", markup=False)
    if document.get("run_id"):
        console.print(f"saved as run:{document['run_id']}")
