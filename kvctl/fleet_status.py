"""`kvctl status` pointed at `kvd router`: one row per replica (what the router sent there, how
current its view is, the replica's cache, hits, queue and latency) and the fleet's prefix hits.

The router's `/admin/status` carries each replica's own status (`replica_status`) beside the
router's books (`replicas`); this renders the two side by side. kvd decides; kvctl presents.
"""

from __future__ import annotations

from rich.console import Console, Group
from rich.markup import escape
from rich.measure import Measurement
from rich.text import Text

from .client import LOCK_HOLDERS, STORE_WRITE_WAIT_S
from .gc_status import gc_line
from .software_status import difference_line, router_version_line
from .tls_status import tls_text
from .gpu_status import gpu_label, gpu_line
from .tables import compact_table, duration, fit_cells, keep_whole, seconds, size, when


def is_fleet(data: dict) -> bool:
    """Whether a status answer is a router's (a fleet) rather than one kvd's."""
    return "replica_status" in data


WRITE_WAIT_SHOWN_S = 1.0  # a store write waiting longer than this is shown by kvctl status


def step_failures_line(failures: dict) -> str:
    """How many engine steps failed, the latest's error and what it stopped, and how many of the
    last steps in a row failed (kvd's log has each traceback)."""
    steps = failures["total"]
    line = (f"{steps:,} step{'s' if steps != 1 else ''} failed; the latest at {when(failures['last_at'])}: "
            f"{failures['last_error']} ({failures['last_stopped']:,} in flight stopped, each answered 500)")
    if failures["in_a_row"] > 1:
        line += f"; the last {failures['in_a_row']:,} steps all failed"
    return line


def store_trouble(status: dict) -> list[tuple[str, Text]]:
    """(what, a line) for each trouble with a kvd's SQLite store its status reports: its file
    replaced under it (writes refused until a restart), a rollback it has not stored, periodic
    jobs failing, audit records only in its log."""
    store = status.get("store") or {}  # an older kvd does not say
    lines = []
    if not store.get("file_ok", True):
        lines.append(("store", Text("its file was replaced under kvd: pins, rollouts and records are refused until "
                                    "kvd restarts and opens the one there", style="bold red")))
    rollout = store.get("unstored_rollback")
    if rollout is not None:
        kept = store.get("unstored_rollback_kept")
        lines.append(("rollout", Text(f"kvd rolled rollout {rollout} back on a stop condition and the store has not "
                                      "taken that yet: " + (f"{kept} keeps it meanwhile (a restart keeps it rolled "
                                                            "back)" if kept else "a restart before it does resumes "
                                                            "the rollout"), style="bold red")))
    waiting, longest = store.get("waiting_writes") or 0, store.get("longest_write_wait_seconds") or 0.0
    if waiting and longest >= WRITE_WAIT_SHOWN_S:
        lines.append(("writes", Text(f"{waiting} waiting {longest:.0f} s for the store's write lock (another process "
                                     f"holds it: {LOCK_HOLDERS}?); after {STORE_WRITE_WAIT_S} s each fails",
                                     style="yellow")))
    failing = store.get("failing_jobs")
    if failing:
        lines.append(("jobs", Text(f"failing now: {', '.join(failing)} (kvd's log says why; each is tried again)",
                                   style="yellow")))
    lost = store.get("audit_write_failures")
    if lost:
        lines.append(("audit", Text(f"{lost:,} record{'s' if lost != 1 else ''} the store could not take "
                                    f"{'are' if lost != 1 else 'is'} only in kvd's log", style="yellow")))
    return lines


FRESH_START_S = 3600.0  # a replica up less than this is named under the fleet's table, with its start
PHASE_NAMES = {"tiers": "tiers (disk scan)"}  # a start's phases as kvctl names them


def cohort_text(rollout: dict) -> str:
    """A running or paused rollout's settings and cohort share (its summary in a status answer)."""
    settings = ", ".join(f"{name} {value}" for name, value in rollout["settings"].items())
    return f"{settings} for {rollout['fraction']:.0%} of traffic ({rollout['policy'] or 'unnamed'}"


def rollout_lines(statuses: list[dict]) -> list[Text]:
    """The rollouts running or paused behind the router: a fleet rollout once, with the replicas
    that run it (and those that answer without it), and a replica's own rollout under its name."""
    answering = [s for s in statuses if "error" not in s]
    fleets: dict[str, list[tuple[str, dict]]] = {}
    lines = []
    for status in answering:
        rollout = status.get("rollout")
        if not rollout:
            continue
        if rollout.get("fleet"):
            fleets.setdefault(rollout["fleet"], []).append((status["replica"], rollout))
        else:
            lines.append(Text(f"{status['replica']} rollout {rollout['id']} {rollout['state']}: "
                              f"{cohort_text(rollout)}; kvctl --socket REPLICA rollout status {rollout['id']})"))
    for fleet, rows in fleets.items():
        states = sorted({rollout["state"] for _, rollout in rows})
        names = {name for name, _ in rows}
        without = [s["replica"] for s in answering if s["replica"] not in names]
        text = Text(f"fleet rollout {fleet} {' and '.join(states)}: {cohort_text(rows[0][1])}; kvctl rollout status "
                    f"{fleet}) at {', '.join(name for name, _ in rows)}")
        if without:
            text.append(f"; not at {', '.join(without)}", style="yellow")
        lines.append(text)
    return lines


def before_load(start: dict) -> float | None:
    """Seconds of a start (`/admin/status` start) before the load: imports, settings."""
    ready = start["ready_after_seconds"]
    return None if ready is None else max(0.0, ready - start["load_seconds"])


def fresh_start(status: dict) -> str | None:
    """'started 2m ago, ready 6.00 s after its process began (tiers (disk scan) 4.51 s)' for a replica
    up less than FRESH_START_S (a rolling restart's progress, and what each start cost); None
    otherwise, or from an older kvd that does not say."""
    start, uptime = status.get("start"), status.get("uptime_seconds")
    if not start or uptime is None or uptime >= FRESH_START_S:
        return None
    parts, early = dict(start["phases"]), before_load(start)
    if early is not None:
        parts["before the load"] = early
    longest = max(parts.items(), key=lambda item: item[1], default=None)
    part = f" ({PHASE_NAMES.get(longest[0], longest[0])} {seconds(longest[1])} of it)" if longest else ""
    ready = seconds(start["ready_after_seconds"])
    return f"started {duration(uptime)} ago, ready {ready} after its process began{part}"


def _view(book: dict) -> Text:
    if book.get("draining"):  # drained by an operator, or leaving the fleet
        return Text(book["draining"], style="yellow")
    if book.get("resting"):  # passed over unasked (resting_line says until when)
        return Text("not asked", style="red")
    if book.get("failing"):  # passed over: its answers fail (failing_line says until when)
        return Text("failing", style="red")
    view = book.get("view")
    if view is None:
        return Text("asks")
    if view["synced"]:
        return Text("follows", style="green")
    return Text("asks (feed down)" if view.get("feed_error") else "asks (syncing)", style="yellow")


def resting_line(book: dict, view: str) -> Text:
    """Why requests pass a replica over unasked, and when they ask it again (policies/unanswered.py)."""
    rest, count = book["resting"], book["resting"]["unanswered_in_a_row"]
    poll = "its load poll answers, or " if view == "events" else ""
    return Text.assemble((f"{book['replica']} not asked: ", "red"),
                         f"{count:,} question{'' if count == 1 else 's'} in a row unanswered (last error: "
                         f"{book.get('last_error') or '-'}); requests ask it again once {poll}in "
                         f"{seconds(rest['seconds_left'])}")


def failing_line(book: dict) -> Text:
    """Why requests pass a replica over as its answers fail, and when they go there again."""
    failing = book["failing"]
    return Text.assemble((f"{book['replica']} passed over: ", "red"),
                         f"its last {failing['failed_in_a_row']:,} answers were failures of its own (last error: "
                         f"{book.get('last_error') or '-'}); requests go there again in "
                         f"{seconds(failing['seconds_left'])}")


def given_up_line(book: dict, after: float) -> Text:
    """The requests a replica had that the router stopped waiting for, as it went silent for `after` s."""
    count = book["given_up"]
    return Text.assemble((f"{book['replica']} given up: ", "red"),
                         f"{count:,} request{'' if count == 1 else 's'} it had, as it answered nothing for {after:g} s "
                         f"(last error: {book.get('last_error') or '-'}); each a 504, or a stream's error event")


def prompts(count: int) -> str:
    return f"{count:,} prompt" + ("" if count == 1 else "s")


def disaggregated_line(books: list[dict], outcomes: dict) -> Text:
    """Which replicas compute prompts and which decode, and how the requests' prefills went."""
    roles: dict[str, list[str]] = {}
    for book in books:
        roles.setdefault(book.get("role", "both"), []).append(book["replica"])
    where = "; ".join(f"{what} at {', '.join(roles[role])}" for role, what in (
        ("prefill", "prefill"), ("decode", "decode"), ("both", "decode and whole requests")) if role in roles)
    failed = outcomes.get("prefill_failed", 0) + outcomes.get("no_prefill_replica", 0)
    local = outcomes.get("local", 0)
    return Text.assemble(
        "disaggregated prefill and decode: ", where, f"; {prompts(outcomes.get('transferred', 0))} passed through "
        "Redis", f", {local:,} computed where they decoded (little to compute there)" if local else "",
        (f", {failed:,} computed whole where they decoded: no prefill replica did them (kvd router's log says why)",
         "yellow") if failed else "")


def queue_limit_line(data: dict) -> Text | None:
    """What the replicas' max_queue_wait changed at the router since it started: replicas passed over
    for a predicted wait past their limit, and queue timeouts no other replica was in time for
    (kvd_router_passed_over_total, kvd_router_timeouts_not_rerouted_total); None when nothing."""
    passed = [(r["replica"], r["passed_over"]) for r in data.get("replicas", []) if r.get("passed_over")]
    unsent = data.get("timeouts_not_rerouted") or 0
    if not passed and not unsent:
        return None
    parts = []
    if passed:
        parts.append("passed over " + ", ".join(f"{name} {count:,}x" for name, count in passed)
                     + " (a predicted wait past its max_queue_wait)")
    if unsent:
        parts.append(f"{unsent:,} queue timeout{'s' if unsent != 1 else ''} with no other replica in time "
                     "(the caller got the 503)")
    return Text("queue limits: " + "; ".join(parts), style="yellow")


def reservation_text(reservation: dict) -> str:
    """The output reservation policy and what it left unwritten: `p95: 4.4% of the blocks finished
    requests held were reserved and never written (120 of 2,730)`; with none finished, the policy."""
    finished, unused = reservation["finished_blocks"], reservation["unused_blocks"]
    if not finished:
        return f"{reservation['policy']} (no request has finished yet)"
    return (f"{reservation['policy']}: {unused / finished:.1%} of the blocks finished requests held were reserved "
            f"and never written ({unused:,} of {finished:,})")


def render_fleet_status(data: dict, console: Console | None = None) -> Group:
    books = {r["replica"]: r for r in data.get("replicas", [])}
    table = compact_table("replica", "sent", "open", "view", "blocks", "hits", "waiting", "running", "wait",
                          "TTFT p50", title=f"fleet behind kvd router: {data['routing']} routing, "
                                            f"{data.get('view', 'ask')} view, {len(data['replica_status'])} replicas")
    for column in table.columns[1:]:
        column.justify = "right"
    prompt = hit = 0
    preempted = recomputed = 0
    reserved = {"policies": set(), "finished_blocks": 0, "unused_blocks": 0}  # the replicas' summed (reservation_text)
    down = []  # (replica, why): under the table, whole, where a cell would fold it into a column
    troubles = []  # a replica's store trouble, under the table too
    restarts = []  # replicas started within the hour: when, and how long their start took
    gpus = []  # the GPU each replica runs on: which replica is which GPU of a host
    for status in data["replica_status"]:
        book = books.get(status["replica"], {})
        name = escape(status["replica"])  # a path or URL, never markup
        sent, open_ = f"{book.get('sent', 0):,}", f"{book.get('open', 0):,}"
        if "error" in status:
            table.add_row(name, sent, open_, _view(book), Text("down", style="red"), "", "", "", "", "")
            if not book.get("resting"):  # (resting: its line under the table says why, and when it is asked)
                down.append((status["replica"], status["error"]))
            continue
        troubles += [Text.assemble(f"{status['replica']} {what}: ", line) for what, line in store_trouble(status)]
        failures = status.get("step_failures")  # its engine steps that raised (an older kvd does not say)
        if failures and failures["total"]:
            troubles.append(Text.assemble(f"{status['replica']} engine failures: ",
                                          (step_failures_line(failures), "red")))
        fresh = fresh_start(status)
        if fresh:
            restarts.append(Text(f"{status['replica']} {fresh}"))
        gpus += [Text(f"{status['replica']} on {gpu_label(gpu)}, {gpu_line(gpu)}") for gpu in status.get("gpu") or []]
        blocks = status["blocks"]["device"]
        used = blocks["total"] - blocks["free"]
        tokens = status["tokens"]
        prompt, hit = prompt + tokens["prompt"], hit + tokens["hit"]
        preempted, recomputed = preempted + status.get("preemptions", 0), recomputed + tokens.get("recomputed", 0)
        if status.get("reservation"):  # (an older kvd does not say)
            reserved["policies"].add(status["reservation"]["policy"])
            reserved["finished_blocks"] += status["reservation"]["finished_blocks"]
            reserved["unused_blocks"] += status["reservation"]["unused_blocks"]
        queue = status["queue"]
        ttft = ((status.get("latency") or {}).get("ttft_seconds") or {}).get("p50")
        table.add_row(name, sent, open_, _view(book), f"{used:,}/{blocks['total']:,}",
                      f"{tokens['hit_ratio']:.1%}", f"{queue['waiting']:,}", f"{queue['running']:,}",
                      seconds(queue.get("predicted_wait_seconds")), seconds(ttft))
    keep_whole(table, 0)  # the name `kvctl fleet drain` takes
    fit_cells(table, 1, 2, *range(4, len(table.columns)), words=(3,))  # figures whole; views, headers wrap
    summary = Text(f"fleet prefix hits: {hit:,} of {prompt:,} prompt tokens"
                   + (f" ({hit / prompt:.1%})" if prompt else ""))
    reasons = [Text.assemble((f"{replica} down: ", "red"), str(why)) for replica, why in down]
    reasons += [resting_line(book, data.get("view", "ask")) for book in data.get("replicas", []) if book.get("resting")]
    reasons += [failing_line(book) for book in data.get("replicas", []) if book.get("failing")]
    after = data.get("silent_give_up_seconds", 30)  # (absent from an older router, which gave up after 30 s)
    reasons += [given_up_line(book, after) for book in data.get("replicas", []) if book.get("given_up")]
    router = ([Text.assemble("kvd router's garbage collector: ", gc_line(data["gc"]))]
              if (data.get("gc") or {}).get("watching") else [])  # kvd router (absent from an older one)
    if data.get("disaggregated") is not None:  # prefill replicas (absent from an older router)
        router.append(disaggregated_line(data["replicas"], data["disaggregated"]))
    limits = queue_limit_line(data)
    if limits is not None:
        router.append(limits)
    replies = data.get("reply_ids")  # the chat replies' ids its events view weighs with (absent from an older one)
    if replies and replies["replies"]:
        router.append(Text(f"kvd router's reply ids: {replies['replies']:,} chat replies kept in "
                           f"{size(replies['bytes'])} of {size(replies['budget_bytes'])}, to weigh a next turn as "
                           "the replica prompts it" + (f"; {replies['dropped']:,} let go for room"
                                                       if replies["dropped"] else "")))
    router += rollout_lines(data["replica_status"])
    watch = data.get("fleet_rollout_watch")  # (absent from an older router)
    if watch and watch.get("error"):
        router.append(Text(f"kvd router's fleet rollout watch: its latest check failed ({watch['error']}; "
                           f"{watch['failures']:,} so far; its log has each): it tries again every "
                           f"{watch['every_seconds']:g} s", style="red"))
    if data.get("tls"):  # the router's own TCP front (daemon/server/tls.py)
        router.append(Text.assemble("kvd router's TLS: ", tls_text(data["tls"])))
    if reserved["policies"]:  # what preemption cost the fleet, and what its reservations leave unwritten
        router.append(Text(f"fleet preemptions: {preempted:,} ({recomputed:,} tokens computed again); reservation "
                           + reservation_text({**reserved, "policy": " and ".join(sorted(reserved["policies"]))})))
    # where the answering replicas differ in software, weights or formats (an older router does not say)
    differences = [difference_line(d) for d in data.get("differences") or ()]
    behind = router_version_line(data)  # the router on another kvd than a replica
    if behind is not None:
        differences.append(behind)
    group = Group(table, *reasons, *differences, *troubles, *restarts, *gpus, *router, summary)
    if console is not None:  # wider than the terminal rather than a figure cut to "1,436…"
        needed = Measurement.get(console, console.options, table).minimum
        console.print(group, width=max(console.width, needed), crop=False)
    return group
