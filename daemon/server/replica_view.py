"""What a router knows of one replica without asking it per request: the blocks each of its tiers
holds (its event feed, applied to a snapshot), the blocks the router has just sent there and
expects it to store, and its load (polled) plus the work the router has sent since that poll.

The view is plain data fed pages of kvd's event feed, load answers and an explicit `now`; it
does no I/O (the router's follower tasks do, `kvctl.daemon.server.replica_feed`). With it a router
computes a prompt's keys itself (`kvctl.daemon.cache.keys.chain_keys` under the replica's
namespace) and weighs every replica with no call on the request's path.

    view = ReplicaView(pending_seconds=30)
    view.reset(snapshot_answer)          # GET /admin/events/snapshot
    view.apply(events_answer)            # GET /admin/events?since=view.seq; False: resnapshot
    view.note_load(route_facts_answer, asked_at=t0)   # POST /admin/route-facts with no prompt
    view.cached_tokens(keys, prompt_tokens, now)      # leading prompt tokens held, or about to be
    view.lower_run(keys[cached_blocks:limit])         # then, blocks per lower tier
    view.note_sent(keys, missing_tokens, now)         # after routing a request there
    view.facts(cached, in_flight, restorable, restore_seconds)   # ReplicaFacts for the routing policy
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from kvctl.daemon.cache.keys import Namespace
from kvctl.policies.routing import ReplicaFacts, facts_from_answer
from kvctl.policies.tiering import held_run
from kvctl.policies.tiering import restore_seconds as priced_restore

LOWER_TIERS = ("host", "disk", "remote")  # fastest first, as kvd restores from the fastest holding a block


@dataclass
class ReplicaView:
    """One replica's keys per tier, the router's pending sends there, and its load."""

    pending_seconds: float = 30.0  # how long a sent prompt's blocks count as held before the feed confirms them
    stream_id: str | None = None
    seq: int = 0  # the newest event applied; ask for the events after it
    block_size: int | None = None
    namespace: dict | None = None  # the replica's namespace fields, less the tenant
    keys: set[bytes] = field(default_factory=set)  # on its device now, as its feed says
    lower: dict[str, set[bytes]] = field(default_factory=dict)  # lower tier -> keys it holds now
    pending: dict[bytes, float] = field(default_factory=dict)  # key -> when the router stops expecting it
    load: dict | None = None  # its latest answer to route-facts
    default_tenant: str = "default"  # whom it takes a request naming no tenant for (its answer says)
    tenant_header: bool = True  # whether it serves a request under the X-KVD-Tenant it names (its answer says)
    model: str | None = None  # the model it serves (its answer says)
    adapters: dict = field(default_factory=dict)  # its LoRA adapters: name -> their id in its namespace
    chat_template: str | None = None  # digest of the chat template it renders chats with (its snapshot says)
    load_asked_at: float | None = None
    sent_since: list[tuple[float, int]] = field(default_factory=list)  # (when, prompt tokens it lacked)

    @property
    def synced(self) -> bool:
        return self.stream_id is not None

    def lose(self) -> None:
        """The feed broke (the replica went away, or answered nonsense): forget its keys until a
        new snapshot. Pending sends stay: they are the router's own books."""
        self.stream_id, self.namespace, self.block_size = None, None, None
        self.keys, self.lower = set(), {}

    # ---- the feed ------------------------------------------------------------------------------
    def reset(self, snapshot: dict) -> None:
        """Start over from `GET /admin/events/snapshot`: its keys per tier, seq, stream and namespace."""
        names = {f.name for f in fields(Namespace)} - {"tenant"}
        namespace = snapshot["namespace"]
        if set(namespace) != names:
            raise ValueError(f"snapshot.namespace: expected the fields {sorted(names)}, got {sorted(namespace)}")
        self.keys = {bytes.fromhex(k) for k in snapshot["tiers"]["device"]}
        self.lower = {tier: {bytes.fromhex(k) for k in keys} for tier, keys in snapshot["tiers"].items()
                      if tier != "device"}
        self.pending = {k: t for k, t in self.pending.items() if k not in self.keys}
        self.stream_id, self.seq = snapshot["stream_id"], int(snapshot["seq"])
        self.block_size, self.namespace = int(snapshot["block_size"]), dict(namespace)
        self.chat_template = snapshot.get("chat_template")

    def apply(self, page: dict) -> bool:
        """Apply a page of `GET /admin/events` (every tier). False, with nothing applied, when the
        view must start again from a snapshot: the replica restarted (another stream) or the page
        says events were dropped before it was read (a gap)."""
        if page["stream_id"] != self.stream_id or page["gap"]:
            return False
        for event in page["events"]:
            keys = [bytes.fromhex(k) for k in event["keys"]]
            held = self.keys if event["tier"] == "device" else self.lower.setdefault(event["tier"], set())
            if event["kind"] == "stored":
                held.update(keys)
            else:
                held.difference_update(keys)
            if event["tier"] == "device":
                for key in keys:  # stored: no longer only expected; removed: not to be expected either
                    self.pending.pop(key, None)
        self.seq = int(page["next"])
        return True

    # ---- what it holds of a prompt ------------------------------------------------------------
    def cacheable_blocks(self, prompt_tokens: int) -> int:
        """Full blocks a prompt may take from the cache (its last token is always computed), as
        the replica's cache manager counts them."""
        return max(prompt_tokens - 1, 0) // self.block_size

    def cached_tokens(self, keys: list[bytes], prompt_tokens: int, now: float) -> int:
        """Leading prompt tokens the replica holds, or will hold once what the router sent there
        is computed: whole blocks, as route-facts counts them."""
        held = 0
        for key in keys[:self.cacheable_blocks(prompt_tokens)]:
            if key not in self.keys and self.pending.get(key, float("-inf")) <= now:
                break
            held += 1
        return held * self.block_size

    def lower_run(self, keys: list[bytes]) -> dict[str, int]:
        """Blocks per lower tier of the longest run from keys[0] that its lower tiers hold, each
        counted in the fastest tier holding it (as the replica counts for route-facts)."""
        return held_run(keys, [(name, self.lower[name]) for name in LOWER_TIERS if self.lower.get(name)])

    def pending_count(self, now: float) -> int:
        """Blocks sent there that its feed has not confirmed yet, and still expected."""
        return sum(1 for until in self.pending.values() if until > now)

    def note_sent(self, keys: list[bytes], missing_tokens: int, now: float) -> None:
        """The router sent a prompt with these block keys there, lacking `missing_tokens`: count
        its blocks as held for `pending_seconds` unless the feed says otherwise, and its work as
        ahead of the next request until a load answer asked after now includes it."""
        until = now + self.pending_seconds
        for key in keys:
            if key not in self.keys:
                self.pending[key] = until
        self.sent_since.append((now, missing_tokens))
        if len(self.pending) > 4 * 65536:  # a long run of unconfirmed sends: drop the expired ones
            self.pending = {k: t for k, t in self.pending.items() if t > now}

    # ---- its load -----------------------------------------------------------------------------
    def note_load(self, answer: dict, asked_at: float) -> None:
        """A route-facts answer (its queue figures), asked at `asked_at`: sends before that are in
        it. It also names the tenant the replica takes the router's requests for when they name
        none (or name one it does not honour: a TCP front that is no trusted proxy), and its namespace: when that changed (new scales, say), prompts' keys are computed
        under the new one from now on, and what was sent under the old one is no longer expected."""
        self.load, self.load_asked_at = answer, asked_at
        self.model = answer.get("model")
        self.adapters = dict(answer.get("adapters") or {})  # its LoRA adapters: name -> id in the namespace
        self.sent_since = [(t, n) for t, n in self.sent_since if t >= asked_at]
        self.default_tenant = answer.get("tenant") or "default"
        self.tenant_header = answer.get("tenant_header", True)
        namespace = answer.get("namespace")
        if self.synced and namespace is not None and namespace != self.namespace:
            self.namespace, self.block_size = dict(namespace), int(namespace["block_size"])
            self.pending = {}

    def tenant_for(self, named: str | None) -> str:
        """The tenant the replica will serve a request under that names `named` (None: none)."""
        return named if named and self.tenant_header else self.default_tenant

    def load_age(self, now: float) -> float | None:
        return None if self.load_asked_at is None else now - self.load_asked_at

    def restore_seconds(self, run: dict[str, int]) -> float:
        """What restoring a lower-tier run costs at the read rates its latest load answer gave."""
        return priced_restore(run, self.load.get("block_bytes") or 0, self.load.get("restore_rates") or {})

    def facts(self, cached_tokens: int, in_flight: int, restorable_tokens: int = 0,
              restore_seconds: float = 0.0, tenant: str | None = None, priority: int = 0) -> ReplicaFacts:
        """The replica as the routing policy weighs it: the cached (and restorable) tokens given,
        and its polled wait lengthened by the prompt tokens sent there since, at its measured
        prefill rate. A replica whose queue goes by the longest cached prefix first (lpm) says
        what waits there by the blocks each request holds (`lpm_waiting`): what holds fewer
        blocks than this prompt would start after it, and is not waited for. One whose queue goes
        by priority says what waits there by place (`priority_waiting`) and each tenant's place
        (`tenant_places`, 0 for one not named): what waits at a worse place than `tenant`'s (as
        the replica serves it), moved back by the request's own `priority` (vLLM's: it may defer
        itself), would start after this request. One whose queue goes by priority and, within a
        place, by the longest cached prefix (priority+lpm) says both at once (`priority_lpm_waiting`):
        what waits at a worse place, or at this one holding fewer blocks than this prompt, would
        start after it. Where tenants have queue wait
        limits of their own (`tenant_queue_waits`), `tenant`'s is the limit weighed."""
        polled = facts_from_answer({**self.load, "cached_tokens": cached_tokens}, in_flight)
        rate = polled.prefill_rate
        extra = sum(n for _, n in self.sent_since)
        blocks = cached_tokens // self.block_size if self.block_size else 0
        after = sum(tokens for held, tokens in self.load.get("lpm_waiting") or () if held < blocks)
        place = (self.load.get("tenant_places") or {}).get(tenant, 0) + priority
        if self.load.get("priority_waiting") and tenant is not None:
            after += sum(tokens for waits_at, tokens in self.load["priority_waiting"] if waits_at > place)
        if self.load.get("priority_lpm_waiting") and tenant is not None:
            after += sum(tokens for waits_at, held, tokens in self.load["priority_lpm_waiting"]
                         if waits_at > place or (waits_at == place and held is not None and held < blocks))
        wait = max(polled.wait_seconds - (after / rate if rate else 0.0), 0.0) + (extra / rate if rate else 0.0)
        limit = polled.max_wait_seconds
        own = self.load.get("tenant_queue_waits") or {}
        if tenant in own:
            limit = own[tenant] or None  # (0: no limit for that tenant)
        return ReplicaFacts(cached_tokens, wait, max(polled.in_flight, in_flight), rate, restorable_tokens,
                            restore_seconds, max_wait_seconds=limit)
