"""The requests kvd served lately, as a Mooncake trace (`kvctl trace save`).

`kvctl bench replay` picks a block size, an eviction policy and tier sizes from a trace; this
gives it the operator's own traffic instead of a synthetic one. kvd keeps the last
`trace_requests` (default 10,000) finished requests (served, cancelled or turned away), each
as its arrival, prompt and output lengths, tenant, how kvd served it (`served`: its waiting,
prefill and decode times and the tokens the cache gave, for `kvctl bench replay
--rates-from-trace`), and one id per 512-token prompt block, chained as the format asks (equal
ids: the same tokens after the same context). With `trace_block_tokens` finer (16 to 256), one
id per that many tokens, marked on each line (`block_tokens`, kvctl's extension): a prefix shared
past a 512-token boundary then replays as shared up to its last whole block, for the price of
more ids (a 40k-token prompt at 64: 625). Each line also names the whole blocks of its prompt and
output together, from the block holding the prompt's tail, in the same chain (`output_hash_ids`,
kvctl's extension): a chat's next turn, which repeats the answer, carries those ids, so a replay
hits the answer's cached blocks there as kvd did.

Never the tokens: a block's id is an HMAC-SHA256 chain under a key, cut to 64 bits; a saved
trace numbers them again 0, 1, 2, ... in order of first appearance. So a trace cannot be tested
against a guessed prompt. Tenants start their chains apart, as their cache blocks are. A request
served in explicit prompt cache mode mixes its own nonce into its chain from the first trace block
that reaches past its marked prefix (its cache blocks' own hashing, PrefixHasher's `private`): a
replay finds no other request's ids there, as kvd found no other request's blocks.

The key is drawn when kvd starts and never shown, so two kvd processes' ids never meet, unless
the operator gives the replicas of a fleet one `trace_key_file`: then equal prompts get equal ids
on every replica, and kvd router merges the replicas' traces into the fleet's
(daemon/server/fleet_trace.py), for `kvctl bench replay --replicas N --routing ...`.
"""

from __future__ import annotations

import hmac
import os
import re
import threading
from array import array
from collections import deque
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

from kvctl.daemon.replay.trace import TRACE_BLOCK_TOKENS, Served, TraceRequest

from .auth import read_private_file

KEY_BYTES = 32  # the least a trace_key_file holds: `head -c 32 /dev/urandom`

# kvd router names each request it forwards in this header: its id for the request, which try at it
# this is, and when the router first chose a replica for it (Unix time). A request a replica turned
# away (429, 503) and the router then sent to another is in both replicas' traces, and the fleet's
# trace keeps its last try alone; the lines are put in the order the router routed them, on its one
# clock (fleet_trace.py). "9f86d081884c7d65/2/1764561600.123456".
ROUTER_ATTEMPT_HEADER = "X-KVD-Router-Attempt"
_ROUTER_ATTEMPT = re.compile(r"([0-9a-f]{16})/([1-9][0-9]{0,3})/([0-9]{1,11}(?:\.[0-9]{1,6})?)")


class RouterAttempt(NamedTuple):
    """kvd router's name for one try at a request (ROUTER_ATTEMPT_HEADER)."""

    request: str  # 16 hex digits, the same on every try
    attempt: int  # 1 for the first replica asked, 2 for the next, ...
    arrival: float  # when the router first chose a replica for the request, Unix time

    def header(self) -> str:
        return f"{self.request}/{self.attempt}/{self.arrival:.6f}"

    @classmethod
    def parse(cls, value: str) -> "RouterAttempt":
        """From the header's value; a ValueError naming the header and the value when it is not
        what kvd router sends."""
        match = _ROUTER_ATTEMPT.fullmatch(value)
        if match is None:
            raise ValueError(f"{ROUTER_ATTEMPT_HEADER}: invalid value {value[:80]!r}; kvd router sends its id of "
                             f"the request (16 lowercase hex digits), the try (1 to 9999) and when it routed the "
                             f"request (Unix seconds), '/' between, e.g. 9f86d081884c7d65/2/1764561600.123456")
        return cls(match.group(1), int(match.group(2)), float(match.group(3)))

    def to_object(self) -> dict:
        return {"request": self.request, "try": self.attempt, "arrival": self.arrival}

    @classmethod
    def from_object(cls, obj: dict) -> "RouterAttempt":
        return cls(obj["request"], obj["try"], obj["arrival"])


class Held(NamedTuple):
    """What kvd holds of a finished request."""

    arrival: float  # a clock reading
    prompt: int  # prompt tokens
    output: int  # output tokens (the longest of its samples)
    ids: tuple[int, ...]  # keyed block ids
    tenant: str
    served: Served | None  # None: turned away before a first token
    routed: RouterAttempt | None = None  # kvd router's name for the request; None: not sent by a router
    priority: int = 0  # its own priority (vLLM's): how far behind its tenant's place it deferred itself
    max_tokens: int | None = None  # the max_tokens it asked (what kvd reserves output blocks for)
    output_ids: tuple[int, ...] = ()  # keyed ids of the whole blocks of prompt and output from the prompt's tail


def load_trace_key(path: str | Path) -> bytes:
    """The secret in `trace_key_file` (its bytes as they are): refused, naming the file, when it
    cannot be read, is open to every user on the machine, or is shorter than KEY_BYTES."""
    key = read_private_file(path, "trace_key_file")
    if len(key) < KEY_BYTES:
        raise ValueError(f"trace_key_file: {str(path)!r} holds {len(key)} bytes; a key needs at least "
                         f"{KEY_BYTES} (e.g. head -c {KEY_BYTES} /dev/urandom > {path})")
    return key


def key_id(key: bytes) -> str:
    """A name for the key that says nothing of it: equal on replicas that share one."""
    return hmac.digest(key, b"kvd-trace/key-id", "sha256")[:8].hex()


def numbered(held: Sequence[Held], default_tenant: str | None = None,
             block_tokens: int = TRACE_BLOCK_TOKENS) -> list[TraceRequest]:
    """Trace lines for `held` (in arrival order, ids of `block_tokens` tokens each): timestamps in
    ms from the first arrival, block ids numbered from 0 in order of first appearance. A request of
    `default_tenant` carries no tenant field, as a single-tenant trace has none."""
    numbers: dict[int, int] = {}
    out = []
    for line in held:
        renumbered = tuple(numbers.setdefault(i, len(numbers)) for i in line.ids)
        output_ids = tuple(numbers.setdefault(i, len(numbers)) for i in line.output_ids)
        out.append(TraceRequest(round((line.arrival - held[0].arrival) * 1000.0, 3), line.prompt, line.output,
                                renumbered, None if line.tenant == default_tenant else line.tenant, block_tokens,
                                line.served, priority=line.priority, max_tokens=line.max_tokens,
                                output_hash_ids=output_ids))
    return out


def served(metrics) -> Served | None:
    """How a finished request was served, from its RequestMetrics (None: no first token)."""
    if metrics.admitted is None or metrics.first_token is None:
        return None
    last = metrics.token_times[-1] if metrics.token_times else metrics.first_token
    return Served(round((metrics.admitted - metrics.arrival) * 1000.0, 3),
                  round((metrics.first_token - metrics.admitted) * 1000.0, 3),
                  round((last - metrics.first_token) * 1000.0, 3), metrics.cached_tokens)


def chained_block_ids(key: bytes, tenant: str, prompt: Sequence[int],
                      block_tokens: int = TRACE_BLOCK_TOKENS, adapter: str = "") -> tuple[int, ...]:
    """One 64-bit id per `block_tokens` tokens of `prompt` (the last covers the remainder), each
    an HMAC of the previous block's digest and this block's token ids. Under a LoRA adapter
    (`adapter`, its name) the chain starts elsewhere: its blocks are not the model's."""
    return sequence_block_ids(key, tenant, prompt, (), block_tokens, adapter)[0]


def sequence_block_ids(key: bytes, tenant: str, prompt: Sequence[int], output: Sequence[int],
                       block_tokens: int = TRACE_BLOCK_TOKENS, adapter: str = "",
                       own: tuple[int, bytes] | None = None) -> tuple[tuple[int, ...], ...]:
    """(`chained_block_ids` of `prompt`, the ids of the whole blocks of `prompt` and `output` together
    from the block holding the prompt's tail): the chain a later prompt that repeats the output
    carries. The prompt's tokens are hashed once for both. `own`: (the first token the request
    hashed as its own, its nonce): from the first block that reaches past that token, the chain is
    the request's alone."""
    seed = tenant.encode("utf-8") + (b"\0lora\0" + adapter.encode("utf-8") if adapter else b"")
    digest = hmac.digest(key, b"kvd-trace/v1\0" + seed, "sha256")
    tokens = memoryview(array("q", [*prompt, *output]).tobytes())
    step, prompt_bytes = block_tokens * 8, len(prompt) * 8
    own_from = None if own is None else own[0] * 8

    def before(end: int) -> bytes:  # the digest a block ending at byte `end` extends
        nonlocal digest, own_from
        if own_from is not None and end > own_from:
            digest, own_from = hmac.digest(key, digest + b"kvd-trace/own\0" + own[1], "sha256"), None
        return digest

    ids = []
    whole = prompt_bytes - prompt_bytes % step
    for start in range(0, whole, step):
        digest = hmac.digest(key, before(start + step) + tokens[start:start + step], "sha256")
        ids.append(int.from_bytes(digest[:8], "big"))
    if whole < prompt_bytes:  # the prompt's tail: its last id covers the rest
        tail = hmac.digest(key, before(prompt_bytes) + tokens[whole:prompt_bytes], "sha256")
        ids.append(int.from_bytes(tail[:8], "big"))
    output_ids = []
    for start in range(whole, len(tokens) - len(tokens) % step, step):
        digest = hmac.digest(key, before(start + step) + tokens[start:start + step], "sha256")
        output_ids.append(int.from_bytes(digest[:8], "big"))
    return tuple(ids), tuple(output_ids)


class RequestTrace:
    """A bounded record of the last `capacity` finished requests (kvd's `trace_requests`; at 64 bits
    a block, a 40k-token prompt holds 640 bytes); `observe` is an EngineService.on_finished observer.
    `key` None: one drawn here, kvd's own; `shared`: the key came from a trace_key_file;
    `block_tokens`: prompt tokens per id (kvd's `trace_block_tokens`)."""

    def __init__(self, capacity: int, key: bytes | None = None, *, shared: bool = False,
                 block_tokens: int = TRACE_BLOCK_TOKENS) -> None:
        self.capacity, self.block_tokens = capacity, block_tokens
        self._key = key if key is not None else os.urandom(KEY_BYTES)
        self.shared = shared and key is not None
        self.key_id = key_id(self._key)
        self._held: deque[Held] = deque(maxlen=capacity)
        self._lock = threading.Lock()  # observed on the engine's side, read by the API's
        self.observed = 0

    def resize(self, capacity: int) -> None:
        """Keep `capacity` requests from now on, the newest of those held (a reload)."""
        with self._lock:
            self.capacity, self._held = capacity, deque(self._held, maxlen=capacity)

    def observe(self, request, cache_block_size: int | None = None) -> None:
        """Keep a finished request's line. `cache_block_size`: the cache's, which a request served in
        explicit prompt cache mode counts the blocks it hashed as its own in (SamplingParams.cache_private)."""
        if self.capacity == 0:  # `trace_requests: 0`: nothing kept, nothing hashed
            return
        output = max((s.output_ids for s in request.sequences), key=len, default=[])  # (the longest sample's)
        private = request.params.extra.get("cache_private")  # (sampling.CACHE_PRIVATE: it would import torch)
        own = None if private is None or cache_block_size is None else (private[0] * cache_block_size, private[1])
        ids, output_ids = sequence_block_ids(self._key, request.tenant, request.prompt_ids, output, self.block_tokens,
                                             request.adapter, own)
        record = Held(request.metrics.arrival, len(request.prompt_ids), len(output), ids,
                      request.tenant, served(request.metrics), request.params.extra.get("router"),
                      request.params.extra.get("priority", 0), request.params.max_tokens, output_ids)
        with self._lock:
            self._held.append(record)
            self.observed += 1

    def held(self, last: int | None = None) -> list[Held]:
        """The held requests (the `last` to arrive, if given) in arrival order."""
        with self._lock:
            held = sorted(self._held, key=lambda r: r.arrival)
        return held[len(held) - last:] if last is not None and last < len(held) else held

    def requests(self, last: int | None = None, default_tenant: str | None = None) -> list[TraceRequest]:
        """The held requests (the `last` to arrive, if given) as trace lines (`numbered`)."""
        return numbered(self.held(last), default_tenant, self.block_tokens)

    def report(self, last: int | None = None, default_tenant: str | None = None, *, keyed: bool = False,
               unix_time: Callable[[float], float] | None = None) -> dict:
        """`GET /admin/trace`: the trace's lines as objects, what kvd keeps, and its key: `shared`
        (a trace_key_file) or `own`, and `key_id`, equal where the key is. `unix_time` reads an
        arrival as Unix time (`started_at`: the first line's). `keyed` (for kvd router, which
        merges replicas' traces): each line's Unix `arrival`, its tenant, its block ids as keyed
        (16 hex digits each) rather than numbered, and `router` (RouterAttempt: the router's id of
        the request, the try, the router's arrival) where a router sent it."""
        held = self.held(last)
        body = {"capacity": self.capacity, "observed": self.observed, "block_tokens": self.block_tokens,
                "key": "shared" if self.shared else "own", "key_id": self.key_id,
                "started_at": unix_time(held[0].arrival) if held and unix_time is not None else None}
        if not keyed:
            return {**body, "requests": [r.to_object() for r in numbered(held, default_tenant, self.block_tokens)]}
        if unix_time is None:
            raise ValueError("keyed: needs unix_time, for arrivals other hosts can read")
        return {**body, "requests": [
            {"arrival": unix_time(line.arrival), "input_length": line.prompt, "output_length": line.output,
             "keyed_ids": [f"{i:016x}" for i in line.ids], "tenant": line.tenant,
             "served": None if line.served is None else line.served.to_object(),
             **({} if line.routed is None else {"router": line.routed.to_object()}),
             **({"priority": line.priority} if line.priority else {}),
             **({"max_tokens": line.max_tokens} if line.max_tokens is not None else {}),
             **({"keyed_output_ids": [f"{i:016x}" for i in line.output_ids]} if line.output_ids else {})}
            for line in held]}
