"""kvctl route: where each routing policy would send a prompt across several kvd replicas, and why.

Each replica says how much of the prompt its device cache holds and how busy it is, in one call
(`/admin/route-facts`, what `kvd router` asks too); the routers of `kvctl.policies.routing` — the ones `kvctl bench replay
--replicas` compares on a trace — choose from those facts. A what-if for operators: nothing is
sent to any replica but the two questions.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from kvctl.policies.routing import ROUTING_POLICIES, facts_from_answer, make_router

from .option_lists import parse_names
from .client import Client
from .errors import KvdUnavailable, UserError
from .command_kit import client_for, prompt_body
from .tables import compact_table

GIVE_REPLICAS = "replica: give two or more (--replica SOCKET_OR_URL, repeated)"
ONE_SHOT_POLICIES = tuple(p for p in ROUTING_POLICIES if p != "round_robin")  # a turn means nothing once


def replica_client(ctx: typer.Context, spec: str) -> Client:
    """A socket path, or an http(s):// URL (with the --token-file of the command line)."""
    options = ctx.find_root().obj or {}
    if spec.startswith(("http://", "https://")):
        return Client(url=spec, token_file=options.get("token_file"), ca_file=options.get("ca_file"),
                      client_cert=options.get("client_cert"))
    return Client(socket=spec)


def ask(client, spec: str, prompt: dict, tenant: str | None) -> dict:
    """What one replica knows of the prompt and of its own load; `error` when it cannot say."""
    try:
        known = client.post("/admin/route-facts", {**prompt, "tenant": tenant})
    except KvdUnavailable as exc:
        return {"replica": spec, "error": str(exc)}
    facts = facts_from_answer(known)
    return {"replica": spec, **known, "wait_seconds": facts.wait_seconds,
            "wait_from": "queue age" if known["predicted_wait_seconds"] is None else "predicted"}


def route(ctx: typer.Context,
          text: Optional[str] = typer.Argument(None, help="Prompt text."),
          tokens: Optional[str] = typer.Option(None, "--tokens", help="Token ids, comma-separated."),
          file: Optional[Path] = typer.Option(None, "--file", help="Read the prompt text from a file."),
          messages: Optional[Path] = typer.Option(
              None, "--messages", help="A JSON file of chat messages (or a chat request's body, with its "
                                       "chat_template_kwargs and tools, or a /v1/responses request's): routed as "
                                       "/v1/chat/completions is."),
          replica: list[str] = typer.Option([], "--replica", help="A replica: its Unix socket, or an "
                                            "http(s):// URL (with --token-file). Repeat for each."),
          router: Optional[str] = typer.Option(None, "--router", help="Ask a running kvd router instead (its "
                                               "socket or URL): its own view of every replica, and where it "
                                               "would send the prompt now."),
          tenant: Optional[str] = typer.Option(None, help="Tenant namespace to look in."),
          model: Optional[str] = typer.Option(None, help="A LoRA adapter's name (lora_modules): weigh its own "
                                                         "blocks, and at kvd router only replicas serving it."),
          priority: Optional[int] = typer.Option(None, help="The request's own priority (vLLM's; 1 or more defers "
                                                 "it behind its tenant's place): under queue_order priority, the "
                                                 "wait it would get."),
          service_tier: Optional[str] = typer.Option(None, "--service-tier",
                                                     help="OpenAI's service_tier: flex defers the request further "
                                                          "under queue_order priority (the wait it would get)."),
          prompt_cache_key: Optional[str] = typer.Option(None, "--prompt-cache-key",
                                                         help="OpenAI's prompt_cache_key: a prompt no replica "
                                                              "holds goes home by it, as kvd router sends it."),
          routing: list[str] = typer.Option([",".join(ONE_SHOT_POLICIES)], "--routing",
                                            help="Policies to ask: least_loaded, prefix, ttft."),
          prefill_rate: float = typer.Option(20_000.0, help="ttft: prompt tokens per second of a replica "
                                             "that has not measured its own yet."),
          balance_seconds: float = typer.Option(2.0, help="prefix: the extra wait it accepts for a replica "
                                                "that caches more."),
          as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Where each routing policy would send a prompt across replicas, and why.

    Each replica says what it caches of the prompt and how busy it is; nothing else is sent.
    The wait is the replica's own prediction (prompt tokens ahead at its measured prefill rate),
    or, before it has measured one, the age of its oldest waiting request: "(age)".

    Example: kvctl route --file prompt.txt --replica /run/kvd-a/kvd.sock --replica /run/kvd-b/kvd.sock
    """
    if priority is not None and priority < 0:
        raise UserError(f"priority: {priority} would jump ahead of its tenant's place; a request may only defer "
                        "itself (0 or more)")
    from kvctl.daemon.server.service_tiers import TIERS

    if service_tier is not None and service_tier not in TIERS:
        raise UserError(f"service-tier: must be one of {', '.join(TIERS)}, got {service_tier!r}")
    prompt = {**prompt_body(text, tokens, file, messages), **({"model": model} if model else {}),
              **({"priority": priority} if priority else {}),
              **({"service_tier": service_tier} if service_tier == "flex" else {}),  # (any other: served as default)
              **({"prompt_cache_key": prompt_cache_key} if prompt_cache_key else {})}
    if router is not None:
        if replica:
            raise UserError("replica: give --router or --replica, not both")
        show_router_route(router_client(ctx, router, tenant), prompt, routing, as_json)
        return
    if not replica:  # kvctl pointed at kvd router (--socket, KVD_SOCKET, --url): ask it
        try:
            show_router_route(client_for(ctx, tenant), prompt, routing, as_json)
            return
        except KvdUnavailable:
            raise UserError(f"{GIVE_REPLICAS}, or --router; no kvd answers where kvctl points") from None
        except UserError as exc:
            if not str(exc).startswith("kvd answered 404"):
                raise
            raise UserError(f"{GIVE_REPLICAS}, or --router; the kvd kvctl points at is a replica, "
                            "not kvd router") from None
    if len(replica) < 2:
        raise UserError(f"{GIVE_REPLICAS}, got {len(replica)}")
    policies = parse_names("routing", routing)
    for name in policies:
        if name not in ONE_SHOT_POLICIES:
            raise UserError(f"routing: unknown value {name!r} for one prompt; choose from "
                            f"{', '.join(ONE_SHOT_POLICIES)}")
    try:
        routers = {name: make_router(name, prefill_rate=prefill_rate, balance_seconds=balance_seconds)
                   for name in policies}
    except ValueError as exc:
        raise UserError(str(exc)) from None
    answers = [ask(replica_client(ctx, spec), spec, prompt, tenant) for spec in replica]
    live = [a for a in answers if "error" not in a]
    if not live:
        raise KvdUnavailable("no replica answered: " + "; ".join(a["error"] for a in answers))
    facts = [replace(facts_from_answer(a), name=a["replica"]) for a in live]  # named as the router names them
    affinity = affinity_of(prompt)
    routes = {}
    for name, router in routers.items():
        chosen = router.choose(max(a["prompt_tokens"] for a in live), facts, affinity)
        routes[name] = {"replica": live[chosen.replica]["replica"], "reason": chosen.reason}
    data = {"replicas": answers, "routes": routes}
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    render(data, Console())


def request_body(prompt: dict) -> dict:
    """The completion's or chat's body `prompt` (prompt_body's, with its prompt_cache_key) stands for:
    a chat's with its chat_template_kwargs and tools, which its rendering and its home take."""
    if "messages" in prompt:
        asked = {k: prompt[k] for k in ("messages", "chat_template_kwargs", "tools") if k in prompt}
    else:
        asked = {"prompt": prompt["text"] if "text" in prompt else prompt["tokens"]}
    key = prompt.get("prompt_cache_key")
    return {**asked, **({"prompt_cache_key": key} if key else {})}


def affinity_of(prompt: dict) -> bytes | None:
    """Where the prompt's home is, as `kvd router` computes it (route_question.affinity_of)."""
    from kvctl.daemon.server.route_question import affinity_of as router_affinity, question_of

    return router_affinity(question_of(request_body(prompt)))


def router_client(ctx: typer.Context, spec: str, tenant: str | None) -> Client:
    """A client of the kvd router `--router` names (its socket or URL)."""
    options = ctx.find_root().obj or {}
    if spec.startswith(("http://", "https://")):
        return Client(url=spec, token_file=options.get("token_file"), tenant=tenant, ca_file=options.get("ca_file"),
                      client_cert=options.get("client_cert"))
    return Client(socket=spec, tenant=tenant)


def show_router_route(client: Client, prompt: dict, routing: list[str], as_json: bool) -> None:
    """`kvctl route` at kvd router: the router's own answer (`POST /router/route`), with the live
    policy's choice first and then each asked policy's, from the same facts."""
    body = {**request_body(prompt), "routing": parse_names("routing", routing)}  # beside the router's own policy
    data = client.post("/router/route", body)
    live = data["routing"]
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    console = Console()
    table = compact_table("replica", "from", "cached", "lower tiers", "in flight", "wait")
    for index in (2, 4, 5):
        table.columns[index].justify = "right"
    for row in data["replicas"]:
        name = escape(row["replica"]) + (f" ({row['role']})" if row.get("role") else "")  # disaggregated
        if "error" in row:
            table.add_row(name, "-", "", escape(row["error"]), "", "")
            continue
        lower = f"{row['restorable_tokens']:,} ({row['restore_seconds']:.2f} s)" if row["restorable_tokens"] else "-"
        table.add_row(name, row["source"], f"{row['cached_tokens']:,}/{data['prompt_tokens']:,}",
                      lower, str(row["in_flight"]), f"{row['wait_seconds']:.2f} s")
    console.print(table)
    choices = compact_table("routing", "replica", "why")
    for name, chosen in data["routes"].items():
        choices.add_row(name + (" (live)" if name == live else ""), escape(chosen["replica"]), escape(chosen["reason"]))
    console.print(choices)
    prefill = data.get("prefill")  # a router with prefill replicas (absent from an older one)
    if prefill:
        where = (f"at {prefill['replica']} ({prefill['reason']}), its blocks through Redis to the replica that decodes"
                 if prefill["replica"] else prefill["reason"])
        console.print(f"prefill: {escape(where)}", highlight=False)


def lower_tier(answer: dict) -> str:
    """What the replica's lower tiers hold after its device's part: 'host 512, disk 1,024 (0.02 s)'
    with the time to restore it; a replica that does not count tokens names the tier of the next block."""
    held = answer.get("lower_tier_tokens")
    if held:
        return ", ".join(f"{tier} {tokens:,}" for tier, tokens in held.items()) + \
            f" ({answer.get('restore_seconds') or 0.0:.2f} s)"
    return answer.get("lower_tier") or "-"


def render(data: dict, console: Console) -> None:
    table = compact_table("replica", "cached", "lower tier", "running", "waiting", "wait")
    for index in (1, 3, 4, 5):
        table.columns[index].justify = "right"
    for a in data["replicas"]:
        if "error" in a:
            continue
        table.add_row(escape(a["replica"]), f"{a['cached_tokens']:,}/{a['prompt_tokens']:,}", lower_tier(a),
                      str(a["running"]), str(a["waiting"]),
                      f"{a['wait_seconds']:.1f} s" + ("" if a["wait_from"] == "predicted" else " (age)"))
    console.print(table)
    for a in data["replicas"]:
        if "error" in a:
            console.print(f"[yellow]{escape(a['replica'])}: {escape(a['error'])}[/yellow]", highlight=False)
    choices = compact_table("routing", "replica", "why")
    for name, chosen in data["routes"].items():
        choices.add_row(name, escape(chosen["replica"]), escape(chosen["reason"]))
    console.print(choices)
