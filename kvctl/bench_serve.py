"""`kvctl bench serve`: drive a running kvd with a workload, beside a transformers baseline.

kvd is driven over its API with streaming completions, chats or responses (TTFT and
inter-token times are taken as chunks arrive). Under `--api responses` each turn of a
multi-turn conversation continues the last by `previous_response_id`: kvd holds the
conversation, and the client sends only the new message. Under `--api conversations` each
conversation is made first (`POST /v1/conversations`, untimed) and every turn names it. The
baseline runs the same requests on the same checkpoint with the `transformers` library in this
process, batched `--concurrency` at a time with its own KV cache, and the report shows kvd ÷
baseline for every figure.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .bench_figures import RequestRecord, across_runs, engine_figures, figures, ratios, served_figures
from .errors import KvdUnavailable, UserError
from .outputs import is_png, refuse_clobber
from .records_cmd import open_store, save_run
from .workloads import BenchRequest, from_trace, multi_turn, shared_prefix


API_PATHS = {"completions": "v1/completions", "chat": "v1/chat/completions", "responses": "v1/responses",
             "conversations": "v1/responses"}
KEPT_APIS = ("responses", "conversations")  # kvd holds the conversation: a turn sends only its new message
TEXT_EVENTS = ("response.output_text.delta", "response.reasoning_text.delta")  # a response's tokens as they come
ENDED_EVENTS = ("response.completed", "response.incomplete")  # the whole response, with its usage
TURNS = 4  # multi-turn: turns per conversation


def build_workload(spec: str, *, requests: int | None, max_tokens: int, time_scale: float, seed: int,
                   block_tokens: int, groups: int = 4, system_tokens: int = 1024,
                   question_tokens: int = 32, chat: bool = False) -> list[BenchRequest]:
    """The requests of a workload. shared-prefix and multi-turn make exactly `requests` (default 32
    and 16): the question-major shared-prefix list and the conversations' turns are cut at that
    count, so 30 requests over 4 groups give two groups 7 questions and two 8."""
    if spec == "shared-prefix":
        wanted = requests or 32
        return shared_prefix(groups=groups, system_tokens=system_tokens, questions=-(-wanted // groups),
                             question_tokens=question_tokens, max_tokens=max_tokens, seed=seed, chat=chat)[:wanted]
    if spec == "multi-turn":
        wanted = requests or 16
        return multi_turn(conversations=-(-wanted // TURNS), turns=TURNS, max_tokens=max_tokens, seed=seed,
                          chat=chat)[:wanted]
    if spec.startswith("trace:") and chat:
        raise UserError("api: a trace's prompts are token ids; drive it with --api completions")
    if spec.startswith("trace:"):
        try:
            return from_trace(spec[len("trace:"):], time_scale=time_scale, limit=requests,
                              block_tokens=block_tokens, max_tokens=max_tokens)
        except ValueError as exc:
            raise UserError(str(exc)) from None
    raise UserError(f"workload: unknown value {spec!r}; use shared-prefix, multi-turn or trace:FILE")


def request_body(request: BenchRequest, index: int, api: str, previous: str | None,
                 stateless: bool = False) -> tuple[str, dict]:
    """The path and body of one request: token ids to /v1/completions, messages to
    /v1/chat/completions, or under `api` "responses" the last message as `input` (the system
    message as `instructions`), continuing the response `previous` (the id of the turn before);
    under "conversations", the same continuing the conversation `previous` (its id). `stateless`
    (responses): the whole conversation as `input`, kept by no one (`store: false`), as a client
    that keeps its own sends it."""
    common = {"ignore_eos": True, "seed": index, "temperature": 0.0, "stream": True}
    if api == "responses" and stateless:
        messages = request.messages
        body = {"input": messages[1:] if messages[0]["role"] == "system" else messages,
                "max_output_tokens": request.max_tokens, "store": False, **common}
        if messages[0]["role"] == "system":
            body["instructions"] = messages[0]["content"]
        return API_PATHS[api], body
    if api in KEPT_APIS:
        messages = request.messages
        body = {"input": messages[-1]["content"], "max_output_tokens": request.max_tokens, **common}
        if messages[0]["role"] == "system":
            body["instructions"] = messages[0]["content"]
        if previous is not None:
            body["previous_response_id" if api == "responses" else "conversation"] = previous
        return API_PATHS[api], body
    asked = {"prompt": request.prompt} if request.messages is None else {"messages": request.messages}
    body = {**asked, "max_tokens": request.max_tokens, **common, "stream_options": {"include_usage": True}}
    return API_PATHS["completions" if request.messages is None else "chat"], body


def read_chunk(chunk: dict, record: RequestRecord, now: float) -> str | None:
    """What one streamed chunk says, into `record`: a completion's or chat's tokens (token_ids)
    and usage, or a response's events (its text deltas, one token each, and its usage at the
    end). Returns a response's id where the chunk names it (response.created)."""
    kind = chunk.get("type")
    if kind is None:  # a completion's or a chat's chunk
        for choice in chunk.get("choices", []):
            record.token_times += [now] * len(choice.get("token_ids") or [])
        usage = chunk.get("usage")
        if usage:
            # absent where kvd reports it to admins only (report_cached_tokens): not known
            record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            # a chat's prompt is known here only as the server's template rendered it
            record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
        return None
    if kind in TEXT_EVENTS:
        record.token_times.append(now)
    elif kind in ENDED_EVENTS:
        usage = chunk["response"]["usage"]
        record.cached_tokens = usage["input_tokens_details"]["cached_tokens"]
        record.prompt_tokens = usage["input_tokens"]
        # a delta that carried more than one token (the client fell behind): the rest came by its time
        last = record.token_times[-1] if record.token_times else now
        record.token_times += [last] * max(0, usage["output_tokens"] - len(record.token_times))
    elif kind == "response.created":
        return chunk["response"]["id"]
    return None


def reply_part(chunk: dict) -> tuple[str, list[int]]:
    """The reply's text and token ids one streamed completion or chat chunk carries (a response's
    text delta: its text; a response names no ids)."""
    if chunk.get("type") == "response.output_text.delta":
        return chunk.get("delta") or "", []
    text, ids = "", []
    for choice in chunk.get("choices", []):
        text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
        ids += choice.get("token_ids") or []
    return text, ids


def with_model_replies(request: BenchRequest, sent: BenchRequest, reply: tuple[str, list[int]]) -> BenchRequest:
    """A later turn as a client sends it that puts the model's own reply back: `sent` (the turn
    before, as it was sent) and its `reply` (text and ids), then this turn's own new message, in
    place of the workload's made-up reply. A chat sends the reply's text; completions its ids."""
    if request.messages is not None:
        return replace(request, messages=[*sent.messages, {"role": "assistant", "content": reply[0]},
                                          request.messages[-1]])
    return replace(request, prompt=[*sent.prompt, *reply[1], *request.said])


async def drive_kvd(session, workload: list[BenchRequest], *, concurrency: int | None,
                    rate: float | None, seed: int, tick=lambda: None, api: str | None = None,
                    replies: str = "synthetic") -> list[RequestRecord]:
    """Send every request through `session` (an aiohttp.ClientSession with kvd's base URL;
    closed loop with `concurrency` slots, or open loop at `rate`/s or at the workload's own
    arrival times) and record what came back. `api` "responses": chats as responses, each
    turn continuing the last; "conversations": each conversation made first, every turn naming
    it (None: completions or chats, as each request is). `replies` "model": a later turn sends the
    model's own replies back (`with_model_replies`), as a chat client does, instead of the
    workload's made-up ones (responses: the whole conversation each turn, `store: false`, as a
    client that keeps its own does)."""
    import asyncio

    import aiohttp

    clock = time.perf_counter
    origin = clock()
    done = [asyncio.Event() for _ in workload]
    records: list[RequestRecord | None] = [None] * len(workload)
    response_ids: list[str | None] = [None] * len(workload)  # (responses: what the next turn continues)
    conversations: list[str | None] = [None] * len(workload)  # (conversations: the one each turn names)
    sent: list[BenchRequest | None] = [None] * len(workload)  # (replies "model": each turn as it was sent)
    answered: list[tuple[str, list[int]] | None] = [None] * len(workload)  # (and the reply it got, whole)
    stateless = api == "responses" and replies == "model"  # (the client keeps the conversation, not kvd)
    slots = asyncio.Semaphore(concurrency) if concurrency else None
    arrivals = [r.arrival for r in workload]
    if rate:
        rng, t = random.Random(seed), 0.0
        for i in range(len(arrivals)):
            t += rng.expovariate(rate)
            arrivals[i] = t

    async def one(i: int, request: BenchRequest) -> None:
        if request.after is not None:
            await done[request.after].wait()
        if arrivals[i] is not None:
            await asyncio.sleep(max(0.0, origin + arrivals[i] - clock()))
        if slots:
            await slots.acquire()
        if api == "conversations":  # made before its first turn starts (the client's setup, not timed)
            conversations[i] = conversations[request.after] if request.after is not None else \
                await _new_conversation(session)
        follows = replies == "model" and request.after is not None
        if follows and answered[request.after] is not None:
            request = with_model_replies(request, sent[request.after], answered[request.after])
        sent[i] = request
        record = RequestRecord(i, clock(), prompt_tokens=len(request.prompt))
        previous = None if stateless else conversations[i] if api == "conversations" else \
            response_ids[request.after] if request.after is not None else None
        path, body = request_body(request, i, api or "", previous, stateless)
        text, ids = "", []
        try:
            if api in KEPT_APIS and not stateless and (request.after is not None or api == "conversations") \
                    and previous is None:
                record.status = "aborted"  # the turn it continues failed: there is no conversation to continue
            elif follows and answered[request.after] is None:
                record.status = "aborted"  # the turn before failed: there is no reply to send back
            else:
                async with session.post(path, json=body) as response:  # relative to the base URL
                    if response.status == 429:
                        record.status = "rejected"
                    elif response.status >= 400:
                        record.status = "aborted"
                    else:
                        async for raw in response.content:  # one line at a time
                            line = raw.decode().rstrip("\r\n")
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            chunk = json.loads(line[6:])
                            named = read_chunk(chunk, record, clock())
                            response_ids[i] = named or response_ids[i]
                            if replies == "model":  # (only where a later turn sends it back)
                                part = reply_part(chunk)
                                text, ids = text + part[0], ids + part[1]
                        record.end = clock()
                        if len(record.token_times) < request.max_tokens:
                            record.status = "aborted"
                        elif replies == "model":
                            answered[i] = (text, ids)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            record.status = "aborted"
        finally:
            if slots:
                slots.release()
            records[i] = record
            done[i].set()
            tick()

    await asyncio.gather(*(one(i, r) for i, r in enumerate(workload)))
    return records


async def _new_conversation(session) -> str | None:
    """A new conversation's id (POST /v1/conversations), or None where kvd made none."""
    import asyncio

    import aiohttp

    try:
        async with session.post("v1/conversations", json={}) as made:
            return (await made.json())["id"] if made.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError):
        return None


def run_transformers_baseline(model_dir: str, workload: list[BenchRequest], batch: int,
                              tick=lambda: None, device: str = "cpu", dtype: str | None = None) -> list[RequestRecord]:
    """The same requests through transformers' generate(), `batch` at a time (left padding), on
    kvd's device and in its dtype (`device`, `dtype` as /admin/status reports them)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList
    except ImportError:
        raise UserError("baseline: transformers is not installed (pip install transformers), "
                        "or use --baseline none") from None

    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # its weight-loading bar would break into our progress and table
    if any(r.messages is not None for r in workload):  # chats: rendered by the checkpoint's template, as kvd does
        workload = rendered_chats(model_dir, workload)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    model = model.to(device=torch.device(device),
                     dtype=getattr(torch, dtype.removeprefix("torch.")) if dtype else None)

    class StepClock(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    records: list[RequestRecord] = []
    for first in range(0, len(workload), batch):
        group = workload[first:first + batch]
        width = max(len(r.prompt) for r in group)
        steps = max(r.max_tokens for r in group)
        ids = torch.zeros((len(group), width), dtype=torch.long, device=model.device)
        mask = torch.zeros_like(ids)
        for row, request in enumerate(group):
            ids[row, width - len(request.prompt):] = torch.tensor(request.prompt)
            mask[row, width - len(request.prompt):] = 1
        step_clock = StepClock()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                           do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([step_clock]))
        for offset, request in enumerate(group):
            times = step_clock.times[:request.max_tokens]
            records.append(RequestRecord(first + offset, start, prompt_tokens=len(request.prompt),
                                         token_times=list(times), end=times[-1] if times else start))
            tick()
    return records


def rendered_chats(model_dir: str, workload: list[BenchRequest]) -> list[BenchRequest]:
    """The workload with each chat's prompt rendered by transformers' apply_chat_template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def ids(messages: list[dict]) -> list[int]:
        out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        return list(out if isinstance(out, list) else out["input_ids"])

    return [r if r.messages is None else replace(r, prompt=ids(r.messages)) for r in workload]


def serve_command(
    ctx: typer.Context,
    workload: str = typer.Option("shared-prefix", help="shared-prefix, multi-turn or trace:FILE."),
    api: str = typer.Option("completions", help="completions (token ids), chat (the same shapes as "
                                                "messages of text, through /v1/chat/completions), responses "
                                                "(the chats through /v1/responses; a multi-turn turn continues "
                                                "the last by previous_response_id, kvd holding the conversation "
                                                "and its replies, or with --replies model sends it whole, "
                                                "store: false; the baseline renders the workload's chats) or "
                                                "conversations (the same, each conversation made first with "
                                                "POST /v1/conversations and named by every turn)."),
    requests: Optional[int] = typer.Option(None, help="Requests (trace: the first N)."),
    concurrency: Optional[int] = typer.Option(8, help="Requests in flight (closed loop)."),
    rate: Optional[float] = typer.Option(None, help="Open loop: Poisson arrivals per second."),
    max_tokens: int = typer.Option(32, help="Output tokens per request."),
    time_scale: float = typer.Option(1.0, help="trace: multiply timestamps by this."),
    block_tokens: int = typer.Option(512, help="trace: tokens per 512-token hash block (shrink for CPUs)."),
    groups: int = typer.Option(4, help="shared-prefix: groups (system prompts)."),
    system_tokens: int = typer.Option(1024, help="shared-prefix: tokens per system prompt."),
    question_tokens: int = typer.Option(32, help="shared-prefix: tokens per question."),
    seed: int = typer.Option(0, help="Workload seed."),
    tenant: Optional[str] = typer.Option(None, help="Send the workload as this tenant (X-KVD-Tenant; on the Unix "
                                         "socket, or TCP behind a trusted proxy): run two at once as two "
                                         "tenants to watch a noisy neighbour in `kvctl tenants`."),
    repeat: int = typer.Option(1, "--repeat", help="Run it N times, kvd then the baseline each time, and "
                                                 "report each figure's median and range. shared-prefix and "
                                                 "multi-turn take fresh prompts each time (seed, seed+1, ...), "
                                                 "so every run starts cold; a trace's prompts repeat."),
    replies: str = typer.Option("synthetic", help="multi-turn: the replies a later turn sends back: synthetic "
                                "(the workload's made-up ones, the same every run) or model (kvd's own, as a chat "
                                "client sends them: a chat its text, completions its token ids; with --baseline "
                                "none). Under --api responses each turn then sends the whole conversation (store: "
                                "false), as an agent that keeps its own does; conversations always continue by "
                                "kvd's own."),
    baseline: str = typer.Option("transformers", help="transformers or none."),
    save: bool = typer.Option(False, "--save", help="Store the run in the SQLite store."),
    compare: Optional[int] = typer.Option(None, "--compare", help="Print the difference to a stored run."),
    state_dir: Optional[str] = typer.Option(None, help="Where the store lives (KVD_STATE_DIR)."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write PNG charts into this folder."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """Drive a running kvd with a workload and compare with transformers in the same run.

    Example: kvctl bench serve --workload shared-prefix --requests 32 --concurrency 8 --json
    """
    import asyncio  # (loaded by the commands that drive kvd, not at kvctl's start)

    from .client import Client

    if baseline not in ("transformers", "none"):
        raise UserError(f"baseline: unknown value {baseline!r}; use transformers or none")
    if api not in API_PATHS:
        raise UserError(f"api: unknown value {api!r}; use completions, chat, responses or conversations")
    if rate is not None and rate <= 0:
        raise UserError(f"rate: must be > 0, got {rate}")
    if concurrency is not None and concurrency < 1:
        raise UserError(f"concurrency: must be >= 1, got {concurrency}")
    if max_tokens < 1:
        raise UserError(f"max_tokens: must be >= 1, got {max_tokens}")
    if requests is not None and requests < 1:
        raise UserError(f"requests: must be >= 1, got {requests}")
    for name, value in (("groups", groups), ("system_tokens", system_tokens), ("question_tokens", question_tokens)):
        if value < 1:
            raise UserError(f"{name}: must be >= 1, got {value}")
    if repeat < 1:
        raise UserError(f"repeat: must be >= 1, got {repeat}")
    if replies not in ("synthetic", "model"):
        raise UserError(f"replies: unknown value {replies!r}; use synthetic or model")
    if replies == "model" and workload != "multi-turn":
        raise UserError(f"replies: model sends a turn's reply back in the next, and {workload} has no turns; "
                        "use --workload multi-turn")
    if replies == "model" and api == "conversations":
        raise UserError(f"replies: under --api {api} kvd keeps the conversation, and each turn continues by its "
                        "own replies already; leave --replies out")
    if replies == "model" and baseline != "none":
        raise UserError("replies: model sends kvd's own replies back, which the baseline would not have made; "
                        "use --baseline none")
    if plot is not None and plot.exists() and not plot.is_dir():
        raise UserError(f"plot: {str(plot)!r} is a file; give a folder for the charts")
    for chart in PLOT_FILES if plot is not None else ():  # they replace earlier charts, nothing else
        refuse_clobber(plot / chart, "plot", is_png, "a PNG")
    def build(run_seed: int) -> list[BenchRequest]:
        return build_workload(workload, requests=requests, max_tokens=max_tokens, time_scale=time_scale,
                              seed=run_seed, block_tokens=block_tokens, groups=groups, system_tokens=system_tokens,
                              question_tokens=question_tokens, chat=api in ("chat", *KEPT_APIS))

    previous = None
    if compare is not None:  # before the run, which takes minutes
        previous = open_store(ctx, state_dir).get_run(compare)
        if previous is None:
            raise UserError(f"compare: no stored run {compare}")
        if previous["kind"] != "bench_serve":
            raise UserError(f"compare: run {compare} is a {previous['kind']} run, not one of bench serve")
    works = [build(seed)]
    for i in range(1, repeat):  # a trace does not depend on the seed: read it once
        works.append(works[0] if workload.startswith("trace:") else build(seed + i))
    sync = Client(**_conn(ctx), tenant=tenant)
    status = sync.get("/admin/status")
    err = Console(stderr=True)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    total = sum(map(len, works)) * (2 if baseline == "transformers" else 1)
    runs, plotted = [], None
    with Progress(TextColumn("bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err,
                  transient=True, disable=not err.is_terminal) as progress:
        task = progress.add_task("bench", total=total)
        tick = lambda: progress.advance(task)  # noqa: E731
        before = status
        for i, work in enumerate(works):
            kvd_records = asyncio.run(_drive(sync, work, None if rate else concurrency, rate, seed + i, tick, api,
                                             replies))
            try:
                after = sync.get("/admin/status")
            except KvdUnavailable as exc:  # it stopped or restarted meanwhile: the client's figures stand
                err.print(f"kvd did not answer after the run ({exc}); its engine figures are left out",
                          markup=False)
                after = {}
            base_records = None
            if baseline == "transformers":
                base_records = run_transformers_baseline(status["model"]["path"], work, concurrency or 8, tick,
                                                         device=status["model"].get("device", "cpu"),
                                                         dtype=status["model"].get("dtype"))
            kvd_run = figures(kvd_records)
            served = None
            try:  # kvd's own timings of these requests, where its trace keeps them
                served = served_figures(sync.get("/admin/trace", last=len(work))["requests"])
            except (KvdUnavailable, UserError):  # gone, or a kvd without a trace (trace_requests: 0, older)
                pass
            base_run = figures(base_records) if base_records is not None else None
            runs.append({"seed": seed + i, "kvd": kvd_run, "baseline": base_run, "ratio": ratios(kvd_run, base_run),
                         "engine": engine_figures(before, after, kvd_run["seconds"]), "served": served})
            plotted = plotted or (kvd_records, base_records)
            before = after  # the baseline's run does not step the engine
    document = {
        "workload": workload,
        "settings": {"api": api, "requests": len(works[0]), "concurrency": None if rate else concurrency, "rate": rate,
                     "groups": groups, "system_tokens": system_tokens, "question_tokens": question_tokens,
                     "max_tokens": max_tokens, "seed": seed, "time_scale": time_scale,
                     "block_tokens": block_tokens, "baseline": baseline, "repeat": repeat, "tenant": tenant,
                     "replies": replies},
        **_summarise(runs, status, after),
        "model": {"name": status["model"]["name"], "revision": status["model"]["revision"]},
        "versions": _versions(),
        "served": across_runs([run["served"] for run in runs])[0],  # kvd's own timings (one run's, or medians)
    }
    if save:
        save_run(ctx, state_dir, "bench_serve", document)
    if plot is not None:
        write_plots(plot, *plotted)  # the first run's
    if as_json:
        if previous is not None:
            document["compare"] = {"run_id": compare, "kvd": previous["document"]["kvd"],
                                   "notes": comparability_notes(document, previous["document"])}
        typer.echo(json.dumps(document, indent=2))
        return
    _print_report(document, previous)


WARMTH_TOLERANCE = 0.05  # cached-token ratios further apart than this: the runs met different caches


def comparability_notes(document: dict, stored: dict) -> list[str]:
    """What makes this run and a stored one unlike, beyond the setting under test: other workload
    settings, another model revision, or a cache the earlier run had already warmed (the same
    prompts again find their prefixes cached, and every figure moves with that alone)."""
    notes = []
    ours, theirs = document["settings"], stored.get("settings", {})
    differ = [f"{k} {theirs.get(k)!r} -> {ours[k]!r}" for k in ours if k in theirs and theirs[k] != ours[k]
              and k not in ("repeat", "baseline")]
    if differ:
        notes.append("workload settings differ: " + ", ".join(differ))
    revision, earlier = document.get("model", {}).get("revision"), stored.get("model", {}).get("revision")
    if revision and earlier and revision != earlier:
        notes.append(f"model revision differs: {earlier[:12]} -> {revision[:12]}")
    now, then = document["kvd"].get("cached_token_ratio"), stored.get("kvd", {}).get("cached_token_ratio")
    if now is not None and then is not None and abs(now - then) > WARMTH_TOLERANCE:
        notes.append(f"the cache was {'warmer' if now > then else 'colder'} this time (cached-token ratio "
                     f"{then:.3f} -> {now:.3f}): the prompts' prefixes were{'' if now > then else ' not'} cached "
                     "before the run; compare runs on a freshly started kvd, or with another --seed")
    return notes


def _summarise(runs: list[dict], first_status: dict, last_status: dict) -> dict:
    """The document's figures: one run's as they are; for several, each figure's median (the
    ratios: the median of each run's own ratio, kvd and the baseline having run side by side),
    its [min, max] under `spread`, and every run under `runs`."""
    if len(runs) == 1:
        return {key: runs[0][key] for key in ("kvd", "baseline", "ratio", "engine")}
    kvd, kvd_spread = across_runs([run["kvd"] for run in runs])
    base, base_spread = across_runs([run["baseline"] for run in runs])
    ratio, ratio_spread = across_runs([run["ratio"] for run in runs])
    seconds = sum(run["kvd"]["seconds"] for run in runs)
    return {"kvd": kvd, "baseline": base, "ratio": ratio or {},
            "engine": engine_figures(first_status, last_status, seconds),
            "spread": {"kvd": kvd_spread, "baseline": base_spread, "ratio": ratio_spread}, "runs": runs}


def _conn(ctx: typer.Context) -> dict:
    options = ctx.find_root().obj or {}
    return {name: options.get(name) for name in ("socket", "url", "token_file", "ca_file", "client_cert")}


async def _drive(sync_client, work, concurrency, rate, seed, tick, api, replies="synthetic"):
    async with sync_client.async_session() as session:
        return await drive_kvd(session, work, concurrency=concurrency, rate=rate, seed=seed, tick=tick,
                               api=api if api in KEPT_APIS else None, replies=replies)


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("kvctl", "torch", "transformers", "triton"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def _fmt(value, name: str) -> str:
    if value is None:
        return "-"
    if name.endswith("_s"):
        return f"{value * 1000:.1f} ms"
    if "ratio" in name or "over" in name:
        return f"{value:.3f}"
    if name in ("rejections", "aborts"):  # counts (a median of an even number of runs may end in .5)
        return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.1f}"
    return f"{value:,.2f}"


def _print_report(document: dict, previous: dict | None) -> None:
    kvd, base, ratio = document["kvd"], document["baseline"], document["ratio"]
    cap = "up to " if document["workload"].startswith("trace:") else ""  # a trace's own lengths, capped
    title = (f"bench serve: {document['workload']}, {document['settings']['requests']} requests, "
             f"{cap}{document['settings']['max_tokens']} tokens each"
             + (", model replies" if document["settings"].get("replies") == "model" else ""))
    table = Table()
    table.add_column("figure")
    table.add_column("kvd", justify="right")
    if base is not None:
        table.add_column("transformers", justify="right")
        table.add_column("kvd ÷ baseline", justify="right")
    spread = document.get("spread")
    if spread is not None:  # --repeat: medians, with each figure's range beside them
        title += f", median of {len(document['runs'])} runs"
        table.add_column("kvd range", justify="right")
        if base is not None:
            table.add_column("ratio range", justify="right")
    if previous is not None:
        table.add_column(f"run {previous['id']}", justify="right")
        table.add_column("change", justify="right")
    names = ["output_tokens_per_second", "requests_per_second", "ttft_p50_s", "ttft_p95_s", "ttft_p99_s",
             "itl_p50_s", "itl_p95_s", "e2e_p50_s", "e2e_p95_s", "e2e_p99_s", "cached_token_ratio",
             "ttft_cached_over_uncached", "rejections", "aborts"]
    for name in names:
        row = [name, _fmt(kvd.get(name), name)]
        if base is not None:
            row += [_fmt(base.get(name), name), "-" if ratio.get(name) is None else f"{ratio[name]:.2f}x"]
        if spread is not None:
            low_high = (spread["kvd"] or {}).get(name)
            row.append("-" if low_high is None else f"{_fmt(low_high[0], name)} – {_fmt(low_high[1], name)}")
            if base is not None:
                low_high = (spread["ratio"] or {}).get(name)
                row.append("-" if low_high is None else f"{low_high[0]:.2f}x – {low_high[1]:.2f}x")
        if previous is not None:
            old = previous["document"]["kvd"].get(name)
            new = kvd.get(name)
            row += [_fmt(old, name), "-" if not old or new is None else f"{(new - old) / old:+.1%}"]
        table.add_row(*row)
    Console().print(Text(title, style="bold"))  # a line of its own: a title would wrap at the table's width
    Console().print(table)
    engine = document.get("engine")
    if engine:
        step = engine["decode_step_mean_s"]
        Console().print(f"kvd engine: busy {engine['busy_fraction']:.0%} of the run; "
                        + ", ".join(f"{n} {kind} step{'s' if n != 1 else ''}" for kind, n in engine["steps"].items() if n)
                        + ("" if step is None else f"; decode step {step * 1e3:.2f} ms mean "
                           f"(inter-token p50 {_fmt(kvd.get('itl_p50_s'), 'itl_p50_s')} at the client)"))
        if engine.get("cpus_shared_fraction"):
            Console(stderr=True).print(
                f"[yellow]kvd shared its CPUs with other busy kvd engines for {engine['cpus_shared_fraction']:.0%} "
                f"of the run (on {engine.get('threads')} intra-op thread{'s' if engine.get('threads') != 1 else ''} "
                "at its end): these figures measure a shared host[/yellow]")
    served = document.get("served")
    if served:
        ratio_said = served["prefill_cached_over_uncached"]
        Console().print(f"kvd's own timings ({served['requests']:,.0f} requests): queued p50 "
                        f"{_fmt(served['queued_p50_s'], 'queued_p50_s')}, p95 {_fmt(served['queued_p95_s'], 'queued_p95_s')}; "
                        f"admission to first token p50 {_fmt(served['prefill_p50_s'], 'prefill_p50_s')}"
                        + ("" if ratio_said is None else f", cached ÷ uncached {ratio_said:.3f}"))
        if served["queued_p50_s"] > served["prefill_p50_s"]:
            Console(stderr=True).print(
                "[yellow]requests waited in kvd's queue longer than their prefill took (p50 "
                f"{_fmt(served['queued_p50_s'], 'queued_p50_s')} against {_fmt(served['prefill_p50_s'], 'prefill_p50_s')}): "
                "the client's TTFT figures, ttft_cached_over_uncached most of all, measure that queue; kvd's own "
                "cached ÷ uncached is what the cache saves. A lower --rate (or --concurrency) measures the "
                "cache[/yellow]")
    if previous is not None:
        for note in comparability_notes(document, previous["document"]):
            Console().print(f"[yellow]not like for like: {note}[/yellow]")
    if document.get("run_id"):
        Console().print(f"stored as run {document['run_id']}")


PLOT_FILES = ("ttft.png", "throughput.png", "hit_ratio.png")  # what --plot DIR holds after a run


def write_plots(folder: Path, kvd_records: list[RequestRecord], base_records: list[RequestRecord] | None) -> None:
    try:
        import matplotlib
    except ImportError:
        raise UserError("plot: matplotlib is not installed (pip install 'kvctl[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)

    def save(fig, ax, xlabel: str, ylabel: str, name: str, legend: bool = True) -> None:
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if legend:
            ax.legend()
        fig.tight_layout()
        fig.savefig(folder / name, dpi=110)
        plt.close(fig)

    series = {"kvd": kvd_records, **({"transformers": base_records} if base_records else {})}
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, records in series.items():
        ttfts = [r.ttft * 1000 for r in records if r.ttft is not None]
        ax.hist(ttfts, bins=30, alpha=0.6, label=name)
    save(fig, ax, "time to first token (ms)", "requests", PLOT_FILES[0])
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, records in series.items():
        times = sorted(t for r in records for t in r.token_times)
        if not times:
            continue
        origin = min(r.start for r in records)
        bins = int(times[-1] - origin) + 1
        counts = [0] * bins
        for t in times:
            counts[int(t - origin)] += 1
        ax.plot(range(bins), counts, marker="o", label=name)
    save(fig, ax, "seconds", "output tokens per second", PLOT_FILES[1])
    fig, ax = plt.subplots(figsize=(7, 4))
    finished = sorted((r for r in kvd_records if r.end is not None), key=lambda r: r.end)
    cached = prompt = 0
    xs, ys = [], []
    origin = min((r.start for r in kvd_records), default=0.0)
    for r in finished:
        cached += r.cached_tokens or 0
        prompt += r.prompt_tokens
        xs.append(r.end - origin)
        ys.append(cached / prompt if prompt else 0.0)
    ax.plot(xs, ys)
    save(fig, ax, "seconds", "cached prompt tokens / prompt tokens (cumulative)", PLOT_FILES[2], legend=False)
