"""Routing policies: which replica of a fleet serves a request.

A router is a small strategy fed plain facts about each replica, as its own books know them
(what it holds of this prompt, how much work it has ahead of it), and returns the replica
with the reason it chose it. It reads no clock and no network: the trace replay drives it
deterministically, and a live router feeds it from each daemon's event feed and status.

    round_robin   in turn, blind to cache and load
    least_loaded  the replica whose queue would start the request soonest
    prefix        the replica holding the longest prefix of the prompt, on its device or in its
                  lower tiers (ties: more on the device, then the less loaded), unless its wait
                  exceeds the least loaded replica's by more than `balance_seconds`: then that
                  one (cache affinity, bounded by load). A prompt no replica holds goes to its
                  home (`new_prefix="home"`): the first replica in the prompt's rendezvous order
                  (a hash of its opening and each replica's name) that is not loaded beyond a
                  bound (`cold_home`), so that several routers, and a router after a restart,
                  send a new prefix to the same replica instead of each computing it somewhere
                  else; or (`"least_loaded"`) to the least loaded, the one this router sent
                  least to among equals. A prompt is new unless some replica holds
                  `new_prefix_slack` tokens more of it than that replica: what less covers is the
                  opening every prompt shares (a chat template's)
    ttft          the least predicted time to first token: its wait, plus restoring what its
                  lower tiers hold (or computing it, if quicker), plus the prompt tokens it lacks
                  at its prefill rate (its own where measured, else `prefill_rate`): reuse,
                  tiers and load traded in one figure

A replica whose predicted wait is past its own `max_queue_wait` would hold a request that long and
then turn it away (queue_timeout), for the router to send elsewhere: `least_loaded`, `prefix` and
`ttft` pass it over while another replica would start the request in time (`queue_limits="heed"`,
the default), and choose among all as before when none would. `round_robin` stays blind. (A
request one replica turned away for its wait goes on only to a replica in time: kvd router's
`NoneInTime`, the fleet replay's re-route.)

Adding a router: implement `Router` and register it in `make_router`.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence

AFFINITY_CHARS = 256  # of a text prompt's opening that names its home (about 64 tokens)
AFFINITY_TOKENS = 64  # of a token-id prompt's
HOME_BAND_SECONDS = 0.25  # a new prefix's home is passed over when it waits this much more than the least loaded
NEW_PREFIX = ("home", "least_loaded")  # where `prefix` sends a prompt no replica holds
QUEUE_LIMITS = ("heed", "ignore")  # whether a router passes over a replica predicted past its max_queue_wait
# A prompt is a new prefix unless some replica holds at least this many more of its tokens (in all
# its tiers, or on its device) than the replica a new prefix goes to (its home, or the least
# loaded). Less is the opening every prompt shares (a chat template's: BOS, a system header, a date
# line), which one replica holds first and soon every replica: counting it sent every new
# conversation to the replica that served the first (scripts/router-pair-bench, chat: the whole
# fleet's traffic to one of two replicas). Replicas that hold a prompt equally leave it to its home.
NEW_PREFIX_SLACK_TOKENS = 128
# Disaggregated prefill and decode (kvd router --prefill): a replica that decodes computes a prompt
# itself when it would compute this many tokens of it or fewer (it holds the rest): passing a short
# prompt, or a conversation's next turn, through a prefill replica and Redis costs more than it saves.
LOCAL_PREFILL_TOKENS = 256


@dataclass(frozen=True, slots=True)
class ReplicaFacts:
    """One replica as a router sees it for one request."""

    cached_tokens: int  # leading prompt tokens its cache holds now (whole blocks)
    wait_seconds: float  # predicted wait before it could start the request
    in_flight: int = 0  # requests it is serving or queueing now
    prefill_rate: float | None = None  # prompt tokens per second it computes, where measured
    restorable_tokens: int = 0  # the prompt tokens after those that its lower tiers hold
    restore_seconds: float = 0.0  # its estimate of bringing them up (kvctl.policies.tiering.restore_seconds)
    name: str = ""  # as every router names it (a socket path or URL): its place in a prompt's home order
    # its max_queue_wait: it turns away a request that has waited this long to start; None: no limit
    max_wait_seconds: float | None = None

    @property
    def held_tokens(self) -> int:
        """Leading prompt tokens it holds in any tier."""
        return self.cached_tokens + self.restorable_tokens

    @property
    def past_limit(self) -> bool:
        """Whether its predicted wait is past its max_queue_wait: a request sent there would
        likely wait that long, then be turned away (queue_timeout: kvd turns away a request that has
        waited as long as its limit before it would start it)."""
        return self.max_wait_seconds is not None and self.wait_seconds >= self.max_wait_seconds

    def held_reason(self, prompt_tokens: int) -> str:
        lower = f" and {self.restorable_tokens} more in a lower tier" if self.restorable_tokens else ""
        return f"caches {self.cached_tokens} of its {prompt_tokens} tokens{lower}"


def facts_from_answer(answer: dict, in_flight: int = 0) -> ReplicaFacts:
    """A replica's answer to kvd's `POST /admin/route-facts` as facts. The wait is the replica's
    own prediction; before it has measured a prefill, the age of its oldest waiting request.
    `in_flight`: what the asker knows it sent there and is still open (the replica may not
    count it yet)."""
    predicted = answer["predicted_wait_seconds"]
    wait = predicted if predicted is not None else (answer["oldest_age_seconds"] if answer["waiting"] else 0.0)
    return ReplicaFacts(answer["cached_tokens"], wait, max(answer["running"] + answer["waiting"], in_flight),
                        answer["prefill_tokens_per_second"], sum((answer.get("lower_tier_tokens") or {}).values()),
                        answer.get("restore_seconds") or 0.0,
                        max_wait_seconds=answer.get("max_queue_wait_seconds"))  # absent from an older kvd


def check_queue_limits(value: str) -> None:
    """ValueError naming `queue_limits` unless it is one of QUEUE_LIMITS."""
    if value not in QUEUE_LIMITS:
        raise ValueError(f"queue_limits: unknown value {value!r}; choose from {', '.join(QUEUE_LIMITS)}")


def none_in_time(router: Router, replicas: Iterable[ReplicaFacts]) -> bool:
    """Whether a request a replica turned away for its wait (queue_timeout) should go no further:
    `router` heeds queue limits, and every replica left is predicted past its own. Then it would
    wait as long there for the same answer (kvd router's NoneInTime; the fleet replay's re-route).
    `replicas` is read only when the router heeds the limits."""
    return getattr(router, "queue_limits", "ignore") == "heed" and all(r.past_limit for r in replicas)


@dataclass(frozen=True, slots=True)
class Route:
    replica: int  # index into the facts given
    reason: str
    # indexes of the replicas passed over, their predicted wait past their max_queue_wait (the reason names them)
    passed_over: tuple[int, ...] = field(default=(), compare=False)


class Router(Protocol):
    name: str

    def choose(self, prompt_tokens: int, replicas: Sequence[ReplicaFacts], affinity: bytes | None = None) -> Route:
        """`affinity`: the prompt's `prompt_affinity`, where a router may send a new prefix home."""
        ...


def prompt_affinity(prompt: str | Sequence[int]) -> bytes:
    """What names a prompt's home: a digest of its opening (AFFINITY_CHARS characters of text, or
    AFFINITY_TOKENS ids). Prompts that share a system prompt share it; every router computes the
    same from the same request, with nothing of any replica's state."""
    if isinstance(prompt, str):
        opening = b"t" + prompt[:AFFINITY_CHARS].encode("utf-8", "surrogatepass")
    else:
        opening = b"i" + ",".join(str(int(t)) for t in prompt[:AFFINITY_TOKENS]).encode()
    return hashlib.sha256(b"kvctl/affinity/v1\0" + opening).digest()


def key_affinity(key: str) -> bytes:
    """What names the home of the prompts a client groups under one key (OpenAI's
    `prompt_cache_key`) in place of their openings: prompts that share more than their first
    block, or a conversation whose opening varies, go home together."""
    return hashlib.sha256(b"kvctl/affinity/v1\0k" + key.encode("utf-8", "surrogatepass")).digest()


def home_order(affinity: bytes, names: Sequence[str]) -> list[int]:
    """Indexes of `names` in the prompt's rendezvous (highest random weight) order: each name's
    weight is a hash of the affinity and the name, so removing a replica moves only the prompts
    whose home it was, and adding one takes about 1/n of them."""
    return sorted(range(len(names)), key=lambda i: hashlib.sha256(affinity + names[i].encode()).digest(),
                  reverse=True)


def cold_home(replicas: Sequence[ReplicaFacts], affinity: bytes | None, band_seconds: float,
              among: Sequence[int] | None = None) -> int | None:
    """The first replica in the prompt's home order whose load is within bounds: a wait at most
    `band_seconds` over the least, and at most ceil(1.25 x the mean) + 1 requests in flight
    (consistent hashing with bounded loads). None without an affinity, or a replica without a
    name (the caller then goes by load alone), or when none is within bounds. `among`: the
    indexes it may choose (the order stays every replica's, so that a prompt's home does not move
    while another replica is passed over); None: all."""
    if affinity is None or not replicas or not all(r.name for r in replicas):
        return None
    allowed = range(len(replicas)) if among is None else set(among)
    least_wait = min(replicas[i].wait_seconds for i in allowed)
    most_in_flight = math.ceil(1.25 * sum(r.in_flight for r in replicas) / len(replicas)) + 1
    for i in home_order(affinity, [r.name for r in replicas]):
        if i in allowed and replicas[i].wait_seconds <= least_wait + band_seconds \
                and replicas[i].in_flight <= most_in_flight:
            return i
    return None


class _Spreading:
    """Counts what it sent where: among replicas equal on everything else, the one it sent
    least goes first (idle replicas would otherwise all lose to the first one, which would then
    hold every new prefix). Chooses among the replicas that would start a request in time
    (`in_time`) unless `queue_limits` is "ignore"."""

    def __init__(self, queue_limits: str = "heed") -> None:
        check_queue_limits(queue_limits)
        self.sent: dict[int, int] = {}
        self.queue_limits = queue_limits

    def in_time(self, replicas: Sequence[ReplicaFacts]) -> list[int]:
        """The indexes of the replicas it chooses among: those whose predicted wait is within
        their max_queue_wait; every one when none is (each replica then decides), or when it
        ignores the limits."""
        every = list(range(len(replicas)))
        if self.queue_limits == "ignore":
            return every
        return [i for i in every if not replicas[i].past_limit] or every

    def _load(self, replicas: Sequence[ReplicaFacts], i: int) -> tuple:
        return replicas[i].wait_seconds, replicas[i].in_flight, self.sent.get(i, 0), i

    def _least_loaded(self, replicas: Sequence[ReplicaFacts], among: Sequence[int]) -> int:
        return min(among, key=lambda i: self._load(replicas, i))

    def _send(self, index: int, reason: str, replicas: Sequence[ReplicaFacts], among: Sequence[int]) -> Route:
        """Route to `index`, the reason naming the replicas passed over for their queue limits."""
        self.sent[index] = self.sent.get(index, 0) + 1
        passed = [i for i in range(len(replicas)) if i not in among]
        if passed:
            reason += "; passed over " + ", ".join(
                f"{replicas[i].name or f'replica {i}'} (predicted wait {replicas[i].wait_seconds:.2f} s, past its "
                f"max_queue_wait {replicas[i].max_wait_seconds:g} s)" for i in passed)
        elif self.queue_limits == "heed" and all(r.past_limit for r in replicas):
            reason += "; every replica's predicted wait is past its max_queue_wait"
        return Route(index, reason, tuple(passed))


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, prompt_tokens: int, replicas: Sequence[ReplicaFacts], affinity: bytes | None = None) -> Route:
        index = self._next % len(replicas)
        self._next = index + 1
        return Route(index, "its turn")


class LeastLoaded(_Spreading):
    name = "least_loaded"

    def choose(self, prompt_tokens: int, replicas: Sequence[ReplicaFacts], affinity: bytes | None = None) -> Route:
        among = self.in_time(replicas)
        index = self._least_loaded(replicas, among)
        return self._send(index, f"shortest wait ({replicas[index].wait_seconds:.2f} s)", replicas, among)


class PrefixAffinity(_Spreading):
    name = "prefix"

    def __init__(self, balance_seconds: float = 2.0, new_prefix: str = "home",
                 new_prefix_slack: int = NEW_PREFIX_SLACK_TOKENS, queue_limits: str = "heed") -> None:
        super().__init__(queue_limits)
        if not balance_seconds >= 0:
            raise ValueError(f"balance_seconds: must be >= 0, got {balance_seconds!r}")
        if new_prefix not in NEW_PREFIX:
            raise ValueError(f"new_prefix: unknown value {new_prefix!r}; choose from {', '.join(NEW_PREFIX)}")
        if not (isinstance(new_prefix_slack, int) and new_prefix_slack >= 0):
            raise ValueError(f"new_prefix_slack: must be a whole number of tokens >= 0, got {new_prefix_slack!r}")
        self.balance_seconds, self.new_prefix, self.new_prefix_slack = balance_seconds, new_prefix, new_prefix_slack

    def choose(self, prompt_tokens: int, replicas: Sequence[ReplicaFacts], affinity: bytes | None = None) -> Route:
        among = self.in_time(replicas)
        idle = self._least_loaded(replicas, among)
        best = min(among, key=lambda i: (-replicas[i].held_tokens, -replicas[i].cached_tokens,
                                         *self._load(replicas, i)))
        home = cold_home(replicas, affinity, HOME_BAND_SECONDS, among) if self.new_prefix == "home" else None
        target, where = (home, "its home (the first by its hash within the load bound)") if home is not None \
            else (idle, "the least loaded")
        most = replicas[best].held_tokens
        if most == 0:
            return self._send(target, f"no replica caches its prefix: {where}", replicas, among)
        ahead = max(most - replicas[target].held_tokens, replicas[best].cached_tokens - replicas[target].cached_tokens)
        if target != best and ahead < self.new_prefix_slack:  # nor more on its device: a restore costs too
            return self._send(target, f"{where}, which caches {replicas[target].held_tokens} of its tokens: no "
                                      f"replica caches {self.new_prefix_slack} more", replicas, among)
        if replicas[best].wait_seconds - replicas[idle].wait_seconds > self.balance_seconds:
            return self._send(idle, f"the replica caching most waits {replicas[best].wait_seconds:.2f} s, over "
                                    f"{self.balance_seconds:g} s more than this one", replicas, among)
        return self._send(best, replicas[best].held_reason(prompt_tokens), replicas, among)


class PredictedTTFT(_Spreading):
    name = "ttft"

    def __init__(self, prefill_rate: float, queue_limits: str = "heed") -> None:
        super().__init__(queue_limits)
        if not prefill_rate > 0:
            raise ValueError(f"prefill_rate: must be > 0, got {prefill_rate!r}")
        self.prefill_rate = prefill_rate

    def predict(self, prompt_tokens: int, facts: ReplicaFacts) -> float:
        """Its wait, then the tokens a lower tier holds (restored, or computed where that is
        quicker), then the rest computed."""
        rate = facts.prefill_rate or self.prefill_rate
        lower = min(facts.restore_seconds, facts.restorable_tokens / rate) if facts.restorable_tokens else 0.0
        return facts.wait_seconds + lower + max(prompt_tokens - facts.held_tokens, 0) / rate

    def choose(self, prompt_tokens: int, replicas: Sequence[ReplicaFacts], affinity: bytes | None = None) -> Route:
        among = self.in_time(replicas)
        index = min(among, key=lambda i: (self.predict(prompt_tokens, replicas[i]), -replicas[i].cached_tokens,
                                          *self._load(replicas, i)))
        chosen = replicas[index]
        lower = f", {chosen.restorable_tokens} in a lower tier" if chosen.restorable_tokens else ""
        return self._send(index, f"first token in {self.predict(prompt_tokens, chosen):.2f} s "
                                 f"({chosen.cached_tokens} tokens cached{lower})", replicas, among)


ROUTING_POLICIES = ("round_robin", "least_loaded", "prefix", "ttft")


def make_router(name: str, *, prefill_rate: float = 20_000.0, balance_seconds: float = 2.0,
                new_prefix: str = "home", new_prefix_slack: int = NEW_PREFIX_SLACK_TOKENS,
                queue_limits: str = "heed") -> Router:
    """A fresh router by name; an unknown name raises ValueError naming it. `queue_limits`
    (heed, ignore): whether it passes over replicas predicted past their max_queue_wait (not
    round_robin, blind to load)."""
    check_queue_limits(queue_limits)
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded(queue_limits)
    if name == "prefix":
        return PrefixAffinity(balance_seconds, new_prefix, new_prefix_slack, queue_limits)
    if name == "ttft":
        return PredictedTTFT(prefill_rate, queue_limits)
    raise ValueError(f"routing: unknown value {name!r}; choose from {', '.join(ROUTING_POLICIES)}")
