"""kvctl bench sampler: the step's sampled rows drawn together (kvd's `draw_tokens`) beside the
same draw with every cut row's vocabulary sorted whole (no top-k window: kvd's draw before the
window), and beside the rows drawn one at a time on the host, as kvd drew them before (each row's
logits copied there, then its own ops), timed in one process on the same logits.

Rows of `--vocab` logits (Llama 3's 128,256 by default), shaped by `--logits`: `zipf` (the r-th
likeliest token's logit is -1.1 ln r, in a random order: a long tail under a few likely tokens, as
a model's next-token distribution; top_p 0.95 at temperature 0.7 keeps 108 tokens, at temperature
1.0 40,720) or `normal` (independent, standard deviation 2.5: a flat distribution whose nucleus at
temperature 0.7 holds 3,260 tokens, the window's worst case). `--batch` of them at once, under a
chat-like mix of settings: half `temperature 0.7, top_p 0.95`, half `temperature 1.0` alone (or
every row one of those, `--mix`; or `penalties`: every row at top_p 0.95 with OpenAI's frequency and
presence penalties and a repetition penalty, over a prompt of 1,000 ids and a reply of 200 so far,
each row's controls applied together by `adjust_rows` on one side and row by row by
`adjust_logits` on the other, as kvd applied them before). Each batch is timed `--repeats` times
per path, interleaved, and the median kept. The batched draw takes the same tokens with or without
the window; the row-by-row path draws others (its randomness is used differently) from the same
weights; the report checks that every batched token is one the row keeps.

On a GPU the row-by-row path paid a copy to the host and a sync for every row: that is the
figure this bench is for. On a CPU both run on the host, and the gain is the ops saved.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import struct
import time

import typer
from rich.console import Console
from rich.table import Table

from .errors import UserError

MIXES = ("mixed", "top-p", "plain", "penalties")
SHAPES = ("zipf", "normal")
ZIPF_EXPONENT = 1.1
PENALISED_PROMPT, PENALISED_OUTPUT = 1_000, 200  # ids each penalised row has seen (--mix penalties)


def per_row_draws(scores, draws) -> list[int]:
    """kvd's draws before they were batched: each row alone on the host (sampling_scores copies it
    there), a softmax and a multinomial with a generator seeded from the draw's step."""
    import torch

    from kvctl.daemon.engine.sampling import sampling_scores

    tokens = []
    for row, draw in zip(scores, draws):
        digest = hashlib.sha256(b"kvctl/sample/v1" + struct.pack("<QQQ", draw.seed, draw.sample_index,
                                                                  draw.step)).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        probs = torch.softmax(sampling_scores(row, draw.params), dim=-1)
        tokens.append(int(torch.multinomial(probs, 1, generator=generator)))
    return tokens


def _params(mix: str, rows: int):
    from kvctl.daemon.engine.sampling import SamplingParams

    nucleus, plain = SamplingParams(temperature=0.7, top_p=0.95), SamplingParams(temperature=1.0)
    if mix == "penalties":
        return [SamplingParams(temperature=0.7, top_p=0.95, frequency_penalty=0.5, presence_penalty=0.5,
                               repetition_penalty=1.1)] * rows
    if mix == "top-p":
        return [nucleus] * rows
    if mix == "plain":
        return [plain] * rows
    return [nucleus if i % 2 == 0 else plain for i in range(rows)]


def shaped_logits(shape: str, batch: int, vocab: int, generator):
    """`batch` rows of `vocab` logits shaped as `--logits` says (module docstring), on the host."""
    import torch

    if shape == "normal":
        return torch.randn(batch, vocab, generator=generator) * 2.5
    ranks = torch.rand(batch, vocab, generator=generator).argsort(dim=-1) + 1  # each row's own order
    return -ZIPF_EXPONENT * ranks.double().log().float()


def measure(vocab: int, batches: list[int], device: str, repeats: int, mix: str, shape: str = "zipf") -> dict:
    """Median milliseconds per batch of each path, per batch size, on `device`."""
    import torch

    from kvctl.daemon.engine.logits import RowTokens, adjust_logits, adjust_rows
    from kvctl.daemon.engine.sampling import WINDOW, Draw, draw_tokens, sampling_scores

    def timed(call) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        call()
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - began) * 1000

    generator = torch.Generator().manual_seed(0)
    rows = []
    for batch in batches:
        logits = shaped_logits(shape, batch, vocab, generator).to(device)
        draws = [Draw(p, seed=i, sample_index=0, step=0) for i, p in enumerate(_params(mix, batch))]
        seen = [RowTokens(d.params, torch.randint(0, vocab, (PENALISED_OUTPUT,), generator=generator).tolist(),
                          torch.randint(0, vocab, (PENALISED_PROMPT,), generator=generator).unique().to(device))
                for d in draws] if mix == "penalties" else None

        def adjusted_together():  # the step's copy of its rows, as the engine makes it
            return logits if seen is None else adjust_rows(logits.clone(), seen, set())

        def adjusted_alone():
            if seen is None:
                return logits
            return torch.stack([adjust_logits(logits[i], r.params, r.prompt, r.output, set())
                                for i, r in enumerate(seen)])

        batched, whole, alone = [], [], []
        for repeat in range(repeats + 1):  # the first of each is a warm-up, not kept
            draws = [Draw(d.params, d.seed, 0, repeat) for d in draws]
            took = (timed(lambda: draw_tokens(adjusted_together(), draws)),
                    timed(lambda: draw_tokens(adjusted_together(), draws, window=vocab)),
                    timed(lambda: per_row_draws(adjusted_alone(), draws)))
            if repeat:
                for kept_times, ms in zip((batched, whole, alone), took):
                    kept_times.append(ms)
        scores = adjusted_together()
        tokens = draw_tokens(scores, draws)
        kept = all(sampling_scores(scores[i], d.params)[t] > float("-inf")
                   for i, (t, d) in enumerate(zip(tokens, draws)))
        rows.append({"batch": batch, "batched_ms": statistics.median(batched),
                     "whole_sort_ms": statistics.median(whole), "per_row_ms": statistics.median(alone),
                     "speedup": statistics.median(alone) / statistics.median(batched), "tokens_kept": kept,
                     # the window's tokens against the whole sort's, drawn at the same u
                     "same_as_sorted_whole": tokens == draw_tokens(scores, draws, window=vocab)})
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return {"device": device, "device_name": name, "vocab": vocab, "mix": mix, "logits": shape, "repeats": repeats,
            "window": WINDOW, "threads": torch.get_num_threads(), "rows": rows}


def sampler_command(
    vocab: int = typer.Option(128_256, "--vocab", help="Logits per row (Llama 3's vocabulary by default)."),
    batch: str = typer.Option("1,16,64,256", "--batch", help="Rows drawn at once, comma-separated."),
    device: str = typer.Option("auto", "--device", help="auto (cuda where there is one), cpu or cuda."),
    repeats: int = typer.Option(5, "--repeats", help="Timed runs of each path per batch (the median is kept)."),
    mix: str = typer.Option("mixed", "--mix", help="mixed (half top_p 0.95), top-p, plain (temperature alone) "
                            "or penalties (top_p 0.95 and frequency, presence and repetition penalties)."),
    logits: str = typer.Option("zipf", "--logits", help="zipf (a model's long tail under a few likely tokens) "
                               "or normal (flat: a nucleus of thousands of tokens)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """The step's sampled rows drawn together, beside the same draw with each row sorted whole, and
    beside the rows drawn one at a time as before.

    Example: kvctl bench sampler --batch 1,64,256 --device cuda
    """
    if vocab < 2:
        raise UserError(f"vocab: must be >= 2, got {vocab}")
    try:
        batches = [int(b) for b in batch.split(",")]
    except ValueError:
        raise UserError(f"batch: expected numbers separated by commas, got {batch!r}") from None
    if not batches or min(batches) < 1:
        raise UserError(f"batch: each must be >= 1, got {batch!r}")
    if repeats < 1:
        raise UserError(f"repeats: must be >= 1, got {repeats}")
    if mix not in MIXES:
        raise UserError(f"mix: must be one of {', '.join(MIXES)}, got {mix!r}")
    if logits not in SHAPES:
        raise UserError(f"logits: must be one of {', '.join(SHAPES)}, got {logits!r}")
    if device not in ("auto", "cpu", "cuda"):
        raise UserError(f"device: must be auto, cpu or cuda, got {device!r}")
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise UserError("device: cuda asked for, but torch sees no CUDA device")
    result = measure(vocab, batches, device, repeats, mix, logits)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    table = Table(title=f"sampled rows of {vocab:,} {logits} logits on {result['device_name']} "
                        f"({mix}; median of {repeats})")
    for column in ("batch", "batched ms", "sorted whole ms", "row by row ms", "speedup", "tokens kept"):
        table.add_column(column, justify="right")
    for row in result["rows"]:
        table.add_row(f"{row['batch']:,}", f"{row['batched_ms']:.2f}", f"{row['whole_sort_ms']:.2f}",
                      f"{row['per_row_ms']:.2f}", f"{row['speedup']:.1f}x", "yes" if row["tokens_kept"] else "NO")
    Console().print(table)
    differ = [f"{row['batch']:,}" for row in result["rows"] if not row["same_as_sorted_whole"]]
    typer.echo("The window drew the whole sort's tokens in every batch." if not differ else
               f"The window drew other tokens than the whole sort in the batch of {', '.join(differ)} "
               "(a rounding at a top_p edge, or a fault: check with the tests on this device).")
