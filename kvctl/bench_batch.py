"""kvctl bench batch: the same requests through a running kvd as a batch (`/v1/batches`) and as a
client sends them, side by side.

The requests are questions about documents (`--documents` of about `--document-tokens` tokens,
`--questions` each), in a shuffled order, as a file of work gathered from many places comes.
First the baseline: a client sends them in that order, kvd's `batch_concurrency` at a time (the
same number as the batch's). Then the batch: the same file uploaded and served by kvd, which
serves the requests in the order of their prompts. Every unpinned block is evicted before each
run, so neither is served from the other's cache; `--repeats` runs of each, in turn, the fastest
of each kept. Reported for both: wall time, requests a
second, prompt tokens and those the prefix cache served, and the replies that are the same
(greedy: all of them should be).

A prefix cache that holds every document keeps them all whatever the order: the difference shows
where it holds fewer than the documents in flight over a stretch of the file (`kvd serve
--num-blocks 256` on the defaults), as a busy fleet's cache does.
"""

from __future__ import annotations

import json
import random
import time

import typer
from rich.console import Console
from rich.table import Table

from .errors import UserError

WORDS = ("block", "cache", "prefix", "token", "tier", "evict", "pin", "tenant", "replica", "queue", "decode",
         "prefill", "page", "table", "hash", "store", "disk", "host", "device", "scale")


def workload(documents: int, questions: int, words: int, max_tokens: int, seed: int) -> list[dict]:
    """The batch's lines, in the shuffled order of the file (a chat each: a document of `words`
    words, a question)."""
    rng = random.Random(seed)
    texts = [f"Document {d}. " + " ".join(rng.choice(WORDS) for _ in range(words)) for d in range(documents)]
    rows = [{"custom_id": f"d{d}-q{q}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "messages": [{"role": "system", "content": texts[d]},
                     {"role": "user", "content": f"Question {q}: which word comes {q + 1}th?"}],
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}
        for d in range(documents) for q in range(questions)]
    rng.shuffle(rows)
    return rows


def batch_command(
    ctx: typer.Context,
    documents: int = typer.Option(12, "--documents", min=1, help="Documents the questions are about."),
    questions: int = typer.Option(6, "--questions", min=1, help="Questions about each document."),
    document_tokens: int = typer.Option(600, "--document-tokens", min=16, help="About this many tokens each."),
    max_tokens: int = typer.Option(8, "--max-tokens", min=1, help="Tokens each reply."),
    seed: int = typer.Option(0, "--seed", help="The documents' words and the file's order."),
    repeats: int = typer.Option(3, "--repeats", min=1, help="Runs of each, in turn; the fastest of each is kept."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """A batch (/v1/batches) beside the same requests sent by a client, on a running kvd.

    Example: kvctl bench batch --documents 12 --questions 6 (against `kvd serve --num-blocks 256`)
    """
    import asyncio  # (as it runs: kvctl's other commands start without it)

    from .command_kit import client_for

    client = client_for(ctx)
    sample = " ".join(WORDS * 10)  # (kvd's tokenizer says how many words make document_tokens)
    per_word = client.post("/tokenize", {"prompt": sample, "add_special_tokens": False})["count"] / (len(WORDS) * 10)
    rows = workload(documents, questions, max(1, round(document_tokens / per_word)), max_tokens, seed)
    concurrency = client.get("/admin/batches")["concurrency"]
    runs: dict[str, list[dict]] = {"alone": [], "batched": []}
    for _ in range(repeats):  # (in turn: a machine that slows down slows both)
        client.post("/admin/evict", {"all_unpinned": True})  # (neither is served from the other's cache)
        runs["alone"].append(asyncio.run(_sent(client, rows, concurrency)))
        client.post("/admin/evict", {"all_unpinned": True})
        runs["batched"].append(_batched(client, rows))
    alone, batched = (min(runs[kind], key=lambda run: run["seconds"]) for kind in ("alone", "batched"))
    same = sum(1 for row in rows if alone["replies"][row["custom_id"]] == batched["replies"].get(row["custom_id"]))
    document = {"settings": {"documents": documents, "questions": questions, "document_tokens": document_tokens,
                             "max_tokens": max_tokens, "seed": seed, "concurrency": concurrency,
                             "requests": len(rows), "repeats": repeats},
                "baseline": {k: v for k, v in alone.items() if k != "replies"},
                "batch": {k: v for k, v in batched.items() if k != "replies"}, "same_replies": same}
    if as_json:
        typer.echo(json.dumps(document, indent=2))
    else:
        render(document)


async def _sent(client, rows: list[dict], concurrency: int) -> dict:
    """The requests as a client sends them: in the file's order, `concurrency` at a time."""
    import asyncio

    replies, prompt, cached = {}, 0, 0
    queue = list(rows)
    began = time.perf_counter()
    async with client.async_session() as session:
        async def worker() -> None:
            nonlocal prompt, cached
            while queue:
                row = queue.pop(0)
                async with session.post("/v1/chat/completions", json=row["body"]) as answer:
                    body = await answer.json()
                if answer.status != 200:
                    raise UserError(f"kvd answered {answer.status} to a request: {body}")
                replies[row["custom_id"]] = body["choices"][0]["message"]["content"]
                prompt += body["usage"]["prompt_tokens"]
                cached += (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"seconds": time.perf_counter() - began, "prompt_tokens": prompt, "cached_tokens": cached,
            "replies": replies}


def _batched(client, rows: list[dict]) -> dict:
    """The requests as a batch: uploaded, served by kvd, its output read back."""
    content = "".join(json.dumps(row) + "\n" for row in rows).encode()
    uploaded = client.request("POST", "/v1/files", files={"file": ("bench.jsonl", content)},
                              data={"purpose": "batch"})
    began = time.perf_counter()
    batch = client.post("/v1/batches", {"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions",
                                        "completion_window": "24h", "metadata": {"made_by": "kvctl bench batch"}})
    while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(0.05)
        batch = client.get(f"/v1/batches/{batch['id']}")
    seconds = time.perf_counter() - began
    if batch["status"] != "completed" or batch["request_counts"]["failed"]:
        raise UserError(f"the batch {batch['id']} ended {batch['status']} with {batch['request_counts']}")
    output = client.http.get(f"/v1/files/{batch['output_file_id']}/content").text
    replies = {}
    for line in output.splitlines():
        answer = json.loads(line)
        replies[answer["custom_id"]] = answer["response"]["body"]["choices"][0]["message"]["content"]
    for file_id in (uploaded["id"], batch["output_file_id"]):  # (the bench leaves nothing behind)
        client.delete(f"/v1/files/{file_id}")
    usage = batch["usage"]
    return {"seconds": seconds, "prompt_tokens": usage["input_tokens"],
            "cached_tokens": usage["input_tokens_details"]["cached_tokens"], "replies": replies, "id": batch["id"]}


def render(document: dict, console: Console | None = None) -> None:
    settings, base, batch = document["settings"], document["baseline"], document["batch"]
    table = Table(title=f"bench batch: {settings['requests']} requests ({settings['documents']} documents of about "
                        f"{settings['document_tokens']} tokens, {settings['questions']} questions each, "
                        f"{settings['max_tokens']} tokens a reply), {settings['concurrency']} at a time, "
                        f"best of {settings.get('repeats', 1)}")
    table.add_column("figure")
    table.add_column("client, file order", justify="right")
    table.add_column("batch, prompt order", justify="right")
    table.add_column("batch ÷ client", justify="right")
    requests = settings["requests"]

    def row(name: str, a: float, b: float, text) -> None:
        table.add_row(name, text(a), text(b), f"{b / a:.2f}x" if a else "-")

    row("wall time", base["seconds"], batch["seconds"], lambda v: f"{v:.2f} s")
    row("requests a second", requests / base["seconds"], requests / batch["seconds"], lambda v: f"{v:.1f}")
    row("prompt tokens", base["prompt_tokens"], batch["prompt_tokens"], lambda v: f"{v:,}")
    row("served from the prefix cache", base["cached_tokens"], batch["cached_tokens"], lambda v: f"{v:,}")
    row("computed", base["prompt_tokens"] - base["cached_tokens"], batch["prompt_tokens"] - batch["cached_tokens"],
        lambda v: f"{v:,}")
    (console or Console()).print(table)
    (console or Console()).print(f"replies the same: {document['same_replies']} of {requests}")
