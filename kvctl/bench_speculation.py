"""kvctl bench speculation: the same requests through kvd's engine with speculative decoding
(prompt lookup, `speculative_config`) and without, side by side in one process.

Each configuration runs the same prompts `--repeats` times, interleaved, and the fastest run of
each is kept. Reported for both: output tokens per second, engine steps, time per output token
(a request's decode time over its tokens after the first), end-to-end latency, and for the
speculative run the acceptance rate and tokens a drafted step gave. Replies must not change,
greedy or (`--temperature`, seeded) sampled: the report counts the replies that equal the
baseline's token for token.

`--prediction reply` gives each request of the speculative run a prediction of its reply (OpenAI's
Predicted Outputs, `prediction` on a chat): the baseline's reply itself, as an editor sends the file
it asks to have edited; `--prediction edited`: that reply with a tenth of it, a third of the way in,
replaced by other tokens, as an edit leaves a file. The prediction is given as token ids (a real
client sends text, which a real model's replies tokenize back to).

The built-in prompts are the kinds prompt lookup is for (code to edit, a passage to quote from,
JSON to extend). The demo checkpoint's random weights make it repeat itself, which flatters
prompt lookup: give `--model DIR` and `--prompts FILE` for the figures of a real model on your
own traffic.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from .errors import UserError

PROMPTS = (
    "Rename the function total to sum_prices everywhere in this code:\n\n"
    "def total(prices):\n    result = 0\n    for price in prices:\n        result += price\n    return result\n\n"
    "def report(prices):\n    print('total', total(prices))\n    return total(prices)\n",
    "Quote the sentence about eviction from this text. The cache keeps blocks of sixteen tokens. "
    "When the cache is full, the least recently used block that no request holds is evicted first. "
    "Pinned blocks are never evicted.",
    'Add a third user to this JSON: {"users": [{"name": "ada", "role": "admin", "active": true}, '
    '{"name": "grace", "role": "user", "active": true}]}',
    "Continue the list: step 1: read the block table; step 2: gather the keys; step 3: score the queries;",
)


def _prompts(path: Optional[Path]) -> list[str]:
    if path is None:
        return list(PROMPTS)
    try:
        text = path.read_text()
    except OSError as exc:
        raise UserError(f"prompts: cannot read {str(path)!r}: {exc.strerror}") from None
    lines = [line for line in text.splitlines() if line.strip()]
    try:
        prompts = [json.loads(line) if line.lstrip().startswith('"') else line for line in lines]
    except ValueError as exc:
        raise UserError(f"prompts: {str(path)!r} has a line that starts as JSON text but is not: {exc}") from None
    if not prompts:
        raise UserError(f"prompts: {str(path)!r} holds no prompt (one a line, as text or a JSON string)")
    return prompts


PREDICTIONS = ("none", "reply", "edited")


def edited(reply: list[int], vocab_size: int) -> list[int]:
    """`reply` with a tenth of it (one token at least), a third of the way in, replaced by tokens it
    does not have there (`--prediction edited`)."""
    start, length = len(reply) // 3, max(1, len(reply) // 10)
    return reply[:start] + [(t + 1) % vocab_size for t in reply[start:start + length]] + reply[start + length:]


def _run(loaded, prompt_ids: list[list[int]], max_tokens: int, concurrency: int, speculation,
         temperature: float = 0.0, predictions: list[list[int]] | None = None) -> dict:
    """One pass: every prompt through a fresh engine, `concurrency` at a time; `predictions`: each
    request's prediction of its reply."""
    from dataclasses import replace

    from kvctl.daemon.engine.engine import Engine, EngineSettings
    from kvctl.daemon.engine.sampling import SamplingParams

    longest = max(len(p) for p in prompt_ids) + max_tokens
    blocks = concurrency * -(-longest // 16) + 8
    engine = Engine(loaded, EngineSettings(num_blocks=blocks, block_size=16, max_running=concurrency,
                                           speculation=speculation))
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=0, ignore_eos=True)
    started = time.perf_counter()
    requests = [engine.add_request(p, params if predictions is None else replace(params, prediction=tuple(guess)))
                for p, guess in zip(prompt_ids, predictions or [None] * len(prompt_ids))]
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    wall = time.perf_counter() - started
    tokens = sum(len(r.sequences[0].output_ids) for r in requests)
    per_token = [(r.metrics.token_times[-1] - r.metrics.first_token) / (len(r.metrics.token_times) - 1)
                 for r in requests if len(r.metrics.token_times) > 1]
    e2e = sorted(r.metrics.token_times[-1] - r.metrics.arrival for r in requests)
    return {"seconds": wall, "steps": steps, "output_tokens": tokens, "output_tokens_per_second": tokens / wall,
            "time_per_output_token_s": sum(per_token) / len(per_token) if per_token else None,
            "e2e_p50_s": e2e[len(e2e) // 2], "replies": [r.sequences[0].output_ids for r in requests],
            "speculation": engine.speculator.stats.describe(),
            "prediction": None if predictions is None else engine.speculator.predicted.describe()}


def measure(loaded, prompts: list[str], max_tokens: int, concurrency: int, speculation, repeats: int,
            temperature: float = 0.0, prediction: str = "none") -> dict:
    """Baseline and speculative passes, interleaved; the fastest of each. `prediction`: what the
    speculative run's requests are given as a prediction of their replies (PREDICTIONS)."""
    prompt_ids = [loaded.tokenizer.encode(p) for p in prompts]
    best: dict[str, dict] = {}
    guesses = None
    for _ in range(repeats):
        for name, spec in (("baseline", None), ("speculative", speculation)):
            run = _run(loaded, prompt_ids, max_tokens, concurrency, spec, temperature,
                       guesses if name == "speculative" else None)
            if name == "baseline" and guesses is None and prediction != "none":  # (the same each pass)
                guesses = [reply if prediction == "reply" else edited(reply, loaded.config.vocab_size)
                           for reply in run["replies"]]
            if name not in best or run["seconds"] < best[name]["seconds"]:
                best[name] = run
    base, fast = best["baseline"], best["speculative"]
    same = sum(a == b for a, b in zip(base.pop("replies"), fast.pop("replies")))
    base.pop("speculation")
    base.pop("prediction")
    ratio = {key: fast[key] / base[key] for key in ("output_tokens_per_second", "time_per_output_token_s",
                                                    "e2e_p50_s", "steps")
             if base.get(key) and fast.get(key) is not None}
    return {"settings": {"requests": len(prompts), "max_tokens": max_tokens, "concurrency": concurrency,
                         "temperature": temperature, "repeats": repeats,
                         "speculative_config": None if speculation is None else speculation.describe(),
                         "prediction": prediction},
            "baseline": base, "speculative": fast, "ratio": ratio, "identical_replies": same}


def speculation_command(
    ctx: typer.Context,
    speculative_config: str = typer.Option(
        '{"method": "ngram", "num_speculative_tokens": 4}', "--speculative-config",
        help="The speculation to measure, as kvd serve takes it."),
    model: Optional[str] = typer.Option(None, "--model", help="Checkpoint folder (default: the demo checkpoint)."),
    prompts_file: Optional[Path] = typer.Option(
        None, "--prompts", help="Prompts, one a line (text, or a JSON string for one with newlines)."),
    max_tokens: int = typer.Option(128, "--max-tokens", help="Tokens generated per request."),
    concurrency: int = typer.Option(1, help="Requests in the batch at once (1: latency, as one user sees it)."),
    temperature: float = typer.Option(0.0, help="Sampling temperature (0: greedy); sampled requests are seeded."),
    repeats: int = typer.Option(3, help="Passes of each configuration, interleaved (the fastest is kept)."),
    prediction: str = typer.Option("none", "--prediction", help="Each speculative request's prediction of its "
                                   "reply (OpenAI's Predicted Outputs): none, reply (the baseline's reply) or "
                                   "edited (that reply with a tenth of it changed)."),
    save: bool = typer.Option(False, "--save", help="Store the result so an ADR can cite it (run:ID)."),
    state_dir: Optional[str] = typer.Option(None, "--state-dir", help="Where the store lives (KVD_STATE_DIR)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Decoding with speculative decoding beside the same requests without it.

    With --prediction, the speculative run's requests also carry a prediction of their replies
    (OpenAI's Predicted Outputs), drafted ahead; --speculative-config none measures it alone.

    Example: kvctl bench speculation --speculative-config '{"num_speculative_tokens": 6}' --concurrency 4;
    kvctl bench speculation --prediction edited --speculative-config none
    """
    from kvctl.daemon.config import ConfigError, resolve, speculation_of

    for name, value in (("max-tokens", max_tokens), ("concurrency", concurrency), ("repeats", repeats)):
        if value < 1:
            raise typer.BadParameter(f"{name}: must be >= 1, got {value}")
    try:
        speculation = speculation_of(resolve({"speculative_config": speculative_config}, env={}).speculative_config)
    except ConfigError as exc:
        raise UserError(str(exc)) from None
    if prediction not in PREDICTIONS:
        raise typer.BadParameter(f"prediction: must be none, reply or edited, got {prediction!r}")
    if speculation is None and prediction == "none":
        raise UserError("speculative_config: give a speculation to measure, e.g. '{\"num_speculative_tokens\": 4}', "
                        "or a --prediction")
    if not 0 <= temperature <= 100:
        raise typer.BadParameter(f"temperature: must be between 0 and 100, got {temperature}")
    prompts = _prompts(prompts_file)
    from kvctl.daemon.model.demo import ensure_demo_checkpoint
    from kvctl.daemon.model.llama import load_model

    with tempfile.TemporaryDirectory(prefix="kvctl-bench-spec-") as scratch:
        loaded = load_model(model or ensure_demo_checkpoint(Path(scratch)))
        document = measure(loaded, prompts, max_tokens, concurrency, speculation, repeats, temperature, prediction)
    document["model"] = model or "demo"
    from .records_cmd import save_and_show

    save_and_show(ctx, state_dir, "bench_speculation", document, save, as_json, render)


def render(document: dict, console: Console | None = None) -> None:
    console = console or Console()
    base, fast, ratio = document["baseline"], document["speculative"], document["ratio"]
    settings = document["settings"]
    table = Table("", "without", "with speculation", "ratio",
                  title=f"{settings['requests']} "
                        + ("greedy" if not settings.get("temperature") else f"temperature {settings['temperature']:g}")
                        + f" requests of {settings['max_tokens']} tokens, "
                        f"{settings['concurrency']} at a time ({document.get('model', 'demo')}; best of "
                        f"{settings['repeats']})")

    def ms(value):
        return "-" if value is None else f"{value * 1000:.2f} ms"

    table.add_row("output tokens/s", f"{base['output_tokens_per_second']:,.0f}",
                  f"{fast['output_tokens_per_second']:,.0f}", f"{ratio.get('output_tokens_per_second', 0):.2f}")
    table.add_row("time per output token", ms(base["time_per_output_token_s"]), ms(fast["time_per_output_token_s"]),
                  f"{ratio['time_per_output_token_s']:.2f}" if "time_per_output_token_s" in ratio else "-")
    table.add_row("end-to-end p50", ms(base["e2e_p50_s"]), ms(fast["e2e_p50_s"]), f"{ratio['e2e_p50_s']:.2f}")
    table.add_row("engine steps", f"{base['steps']:,}", f"{fast['steps']:,}", f"{ratio['steps']:.2f}")
    console.print(table)
    config, lines = settings["speculative_config"], []
    for figures, name in ((fast["speculation"], None if config is None else
                           f"ngram, up to {config['num_speculative_tokens']} draft tokens"),
                          (fast.get("prediction"), None if settings.get("prediction", "none") == "none" else
                           "each request given " + ("its reply" if settings["prediction"] == "reply" else
                                                    "its reply edited") + " as a prediction")):
        if name is not None:
            lines.append(f"{name}: " + ("no draft was made" if not figures["drafts"] else
                         f"{figures['accepted_tokens']:,} of {figures['draft_tokens']:,} drafted tokens kept "
                         f"({figures['acceptance_rate']:.0%}), {figures['mean_accepted_length']:.2f} tokens a "
                         "drafted step"))
    console.print("; ".join(lines) + f"; replies identical to the baseline's: {document['identical_replies']} of "
                  f"{settings['requests']}", markup=False)
    if document.get("run_id"):
        console.print(f"saved as run:{document['run_id']}")
