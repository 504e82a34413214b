"""Request traces in the Mooncake format: read, validate, generate, and turn into block keys.

One JSON object per line::

    {"timestamp": 0, "input_length": 1200, "output_length": 40, "hash_ids": [0, 1, 2]}

`timestamp` is the arrival in milliseconds; `hash_ids` name the input's 512-token
blocks, chained (equal ids mean the same tokens after the same context); the
last id covers the remainder. An optional `tenant` (kvctl's extension) names whose
request it is: tenants never share blocks, so equal ids of two tenants are different
blocks, as in live traffic. At block size b, 512-token block h splits into
sub-blocks (h, 0), (h, 1), ...; their keys come from the same SHA-256 chain as
live traffic (under a namespace of its own), with the pair (h, j) standing in
for the block's token ids.

An optional `block_tokens` (kvctl's extension, a power of two from 16 to 512; absent: 512) says
how many prompt tokens each id covers: kvd saves finer ids when told to (`trace_block_tokens`),
so that a prefix shared past a 512-token boundary replays as shared up to its last whole block
rather than its last whole 512. At block size b <= B, block h splits into sub-blocks (h, j); at
b > B, one replay block covers b / B ids, keyed by them together. A trace keeps one size.

An optional `served` (kvctl's extension, in the lines kvd saves) says how kvd served the request:
`{"queued_ms", "prefill_ms", "decode_ms", "cached_tokens"}` (waiting, admission to first token,
first token to last, prompt tokens the cache gave). `kvctl bench replay --rates-from-trace` sets
its service model from them (`service_rates`). An optional `replica` (kvctl's extension, in a
fleet's trace kvd router saved) names the replica that served the request: `kvctl bench replay
--replicas N --routing recorded` sends each request where the live router did.

An optional `output_hash_ids` (kvctl's extension, in the lines kvd saves) names the whole blocks of
the prompt and output together, from the block that holds the prompt's tail, in the same chain: a
later prompt that repeats this answer (a chat's next turn) carries the same ids there, so the replay
hits the answer's cached blocks as kvd does. Without them, each output gets keys no other request
hits (`output_keys`).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Sequence

from kvctl.daemon.cache.keys import BlockKey, Namespace, block_key, validate_block_size
from kvctl.policies.tenant_map import TENANT_NAME

TRACE_BLOCK_TOKENS = 512  # the Mooncake format's; a line's `block_tokens` may say finer
TRACE_BLOCK_SIZES = (16, 32, 64, 128, 256, 512)  # what `block_tokens` may be


class TraceError(ValueError):
    """A trace line is malformed; the message names the file, line, field and value."""


@dataclass(frozen=True, slots=True)
class Served:
    """How kvd served a request, as its trace line's `served` says (kvctl's extension)."""
    queued_ms: float  # arrival to admission
    prefill_ms: float  # admission to first token: its uncached prompt tokens, in batches with others
    decode_ms: float  # first token to last
    cached_tokens: int  # prompt tokens the cache gave at admission

    def to_object(self) -> dict:
        return {"queued_ms": self.queued_ms, "prefill_ms": self.prefill_ms, "decode_ms": self.decode_ms,
                "cached_tokens": self.cached_tokens}

    @classmethod
    def parse(cls, obj: object, where: str, input_length: int) -> "Served":
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: field 'served' must be an object, got {obj!r}")
        times = []
        for name in ("queued_ms", "prefill_ms", "decode_ms"):
            value = obj.get(name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < float("inf"):
                raise TraceError(f"{where}: field 'served.{name}' must be a number >= 0, got {value!r}")
            times.append(float(value))
        cached = obj.get("cached_tokens")
        if not isinstance(cached, int) or isinstance(cached, bool) or not 0 <= cached <= input_length:
            raise TraceError(f"{where}: field 'served.cached_tokens' must be an integer from 0 to input_length "
                             f"{input_length}, got {cached!r}")
        return cls(*times, cached)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: float  # arrival, relative to the first request
    input_length: int  # prompt tokens
    output_length: int  # generated tokens
    hash_ids: tuple[int, ...]  # one id per `block_tokens` prompt tokens, chained
    tenant: str | None = None  # whose request (kvctl's extension of the format); None: the default tenant
    block_tokens: int = TRACE_BLOCK_TOKENS  # prompt tokens per id (kvctl's extension; the format's is 512)
    served: Served | None = None  # how kvd served it (kvctl's extension); None: not said (turned away)
    replica: str | None = None  # the replica that served it, in a fleet's trace (kvctl's extension)
    # its own priority (vLLM's, kvctl's extension): how far behind its tenant's place it deferred itself
    priority: int = 0
    # the max_tokens its client asked (kvctl's extension): what kvd's output reservation reserves for;
    # None: not said (a Mooncake trace), the replay's --max-tokens or the output then
    max_tokens: int | None = None
    # ids of the whole blocks of prompt and output together from the block holding the prompt's tail (kvctl's
    # extension, output_blocks_expected of them); (): not said
    output_hash_ids: tuple[int, ...] = ()

    def to_object(self) -> dict:
        """The line as a JSON object (no `tenant` for the default tenant's, no `block_tokens` at 512,
        no `served` where it is not known, no `priority` at 0, no `max_tokens` where not known)."""
        record = {"timestamp": self.timestamp_ms, "input_length": self.input_length,
                  "output_length": self.output_length, "hash_ids": list(self.hash_ids)}
        if self.tenant is not None:
            record["tenant"] = self.tenant
        if self.block_tokens != TRACE_BLOCK_TOKENS:
            record["block_tokens"] = self.block_tokens
        if self.served is not None:
            record["served"] = self.served.to_object()
        if self.replica is not None:
            record["replica"] = self.replica
        if self.priority:
            record["priority"] = self.priority
        if self.max_tokens is not None:
            record["max_tokens"] = self.max_tokens
        if self.output_hash_ids:
            record["output_hash_ids"] = list(self.output_hash_ids)
        return record

    def to_json(self) -> str:
        return json.dumps(self.to_object())


def output_blocks_expected(input_length: int, output_length: int, block_tokens: int) -> int:
    """How many `output_hash_ids` a line has: the whole blocks of its prompt and output together
    from the one that holds the prompt's tail."""
    return (input_length + output_length) // block_tokens - input_length // block_tokens


def _field(obj: dict, name: str, where: str, *, minimum: int) -> int:
    value = obj.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise TraceError(f"{where}: field {name!r} must be an integer >= {minimum}, got {value!r}")
    return value


def parse_request(obj: object, where: str) -> TraceRequest:
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    timestamp = obj.get("timestamp")
    if not isinstance(timestamp, (int, float)) or isinstance(timestamp, bool) or not 0 <= timestamp < float("inf"):
        raise TraceError(f"{where}: field 'timestamp' must be a number >= 0, got {timestamp!r}")
    input_length = _field(obj, "input_length", where, minimum=1)
    output_length = _field(obj, "output_length", where, minimum=0)
    hash_ids = obj.get("hash_ids")
    if not isinstance(hash_ids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids):
        raise TraceError(f"{where}: field 'hash_ids' must be a list of integers >= 0")
    block_tokens = obj.get("block_tokens", TRACE_BLOCK_TOKENS)
    if block_tokens not in TRACE_BLOCK_SIZES or isinstance(block_tokens, bool):
        raise TraceError(f"{where}: field 'block_tokens' must be one of {', '.join(map(str, TRACE_BLOCK_SIZES))}, "
                         f"got {block_tokens!r}")
    expected = -(-input_length // block_tokens)
    if len(hash_ids) != expected:
        raise TraceError(f"{where}: field 'hash_ids' has {len(hash_ids)} ids but input_length "
                         f"{input_length} needs {expected} (one per {block_tokens} tokens)")
    tenant = obj.get("tenant")
    if tenant is not None and not (isinstance(tenant, str) and TENANT_NAME.fullmatch(tenant)):
        raise TraceError(f"{where}: field 'tenant' must be a tenant name (letters, digits, . _ -), got {tenant!r}")
    served = None if obj.get("served") is None else Served.parse(obj["served"], where, input_length)
    replica = obj.get("replica")
    if replica is not None and not (isinstance(replica, str) and 0 < len(replica) <= 1024):
        raise TraceError(f"{where}: field 'replica' must be a replica's name (a socket or URL), got {replica!r}")
    priority = obj.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool) or priority < 0:
        raise TraceError(f"{where}: field 'priority' must be an integer >= 0 (how far the request deferred itself "
                         f"behind its tenant's place), got {priority!r}")
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                   or max_tokens < max(output_length, 1)):
        raise TraceError(f"{where}: field 'max_tokens' must be an integer >= 1 and >= output_length "
                         f"{output_length}, got {max_tokens!r}")
    output_ids = obj.get("output_hash_ids", [])
    if not isinstance(output_ids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in output_ids):
        raise TraceError(f"{where}: field 'output_hash_ids' must be a list of integers >= 0")
    expected = output_blocks_expected(input_length, output_length, block_tokens)
    if output_ids and len(output_ids) != expected:
        raise TraceError(f"{where}: field 'output_hash_ids' has {len(output_ids)} ids but input_length {input_length} "
                         f"and output_length {output_length} make {expected} whole blocks of {block_tokens} tokens "
                         "from the prompt's tail")
    return TraceRequest(float(timestamp), input_length, output_length, tuple(hash_ids), tenant, block_tokens, served,
                        replica, priority, max_tokens, tuple(output_ids))


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Load and validate a trace file; requests come back sorted by arrival (stable)."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace: no such file {str(path)!r}")
    requests: list[TraceRequest] = []
    with path.open("r", encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path.name} line {number}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
            requests.append(parse_request(obj, where))
            if requests[-1].block_tokens != requests[0].block_tokens:
                raise TraceError(f"{where}: field 'block_tokens' is {requests[-1].block_tokens} where the first "
                                 f"line's is {requests[0].block_tokens}; a trace keeps one size")
            if limit is not None and len(requests) >= limit:
                break
    if not requests:
        raise TraceError(f"trace: {str(path)!r} holds no requests")
    requests.sort(key=lambda r: r.timestamp_ms)
    return requests


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        for request in requests:
            handle.write(request.to_json() + "\n")
    tmp.replace(path)


def generate_trace(requests: int = 600, *, seed: int = 0, system_prompts: int = 8,
                   mean_interarrival_ms: float = 250.0, noisy_fraction: float = 0.0) -> list[TraceRequest]:
    """A deterministic synthetic trace with the reuse patterns of real traffic.

    Three kinds of request, mixed: (1) a shared system prompt (one of
    `system_prompts`, Zipf-popular) followed by a unique question; (2) a turn of
    a multi-turn conversation, whose prompt is the previous turn's prompt plus
    new text; (3) a one-off document with no reuse. Arrivals are Poisson.

    `noisy_fraction` > 0 makes it two tenants' traffic: that fraction of the requests
    are tenant "noisy"'s one-off documents (no reuse at all), the rest tenant "quiet"'s
    mix above: a noisy neighbour, for `kvd serve --tenant-cache-shares`.
    """
    if not 0 <= noisy_fraction < 1:
        raise ValueError(f"noisy_fraction: must be in [0, 1), got {noisy_fraction!r}")
    if requests < 1:
        raise ValueError(f"requests: must be >= 1, got {requests!r}")
    rng = random.Random(seed)
    next_id = 0

    def fresh(count: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + count))
        next_id += count
        return ids

    systems = [fresh(rng.randint(1, 4)) for _ in range(system_prompts)]
    weights = [1.0 / (rank + 1) for rank in range(system_prompts)]
    conversations: list[list[int]] = []  # hash ids of the full blocks of open conversations
    out: list[TraceRequest] = []
    clock = 0.0
    for _ in range(requests):
        clock += rng.expovariate(1.0 / mean_interarrival_ms)
        if noisy_fraction and rng.random() < noisy_fraction:
            ids = fresh(rng.randint(1, 8))
            length = TRACE_BLOCK_TOKENS * (len(ids) - 1) + rng.randint(16, TRACE_BLOCK_TOKENS)
            out.append(TraceRequest(round(clock, 3), length, rng.randint(8, 256), tuple(ids), "noisy"))
            continue
        kind = rng.random()
        if kind < 0.5:
            system = rng.choices(systems, weights)[0]
            ids = system + fresh(rng.randint(1, 2))
            length = TRACE_BLOCK_TOKENS * (len(ids) - 1) + rng.randint(16, TRACE_BLOCK_TOKENS)
        elif kind < 0.8:
            if conversations and rng.random() < 0.7:
                previous = conversations.pop(rng.randrange(len(conversations)))
                ids = previous + fresh(rng.randint(1, 2))
            else:
                ids = rng.choices(systems, weights)[0] + fresh(rng.randint(1, 3))
            length = TRACE_BLOCK_TOKENS * (len(ids) - 1) + rng.randint(16, TRACE_BLOCK_TOKENS)
            # The next turn extends this context: its full blocks are reused.
            full = ids if length % TRACE_BLOCK_TOKENS == 0 else ids[:-1]
            if len(full) < 48:
                conversations.append(full)
        else:
            ids = fresh(rng.randint(1, 8))
            length = TRACE_BLOCK_TOKENS * (len(ids) - 1) + rng.randint(16, TRACE_BLOCK_TOKENS)
        out.append(TraceRequest(round(clock, 3), length, rng.randint(8, 256), tuple(ids),
                                "quiet" if noisy_fraction else None))
    return out


class TraceKeyer:
    """Chain keys for trace requests at one block size, memoised across requests.

    The memo is keyed by (parent key, hash id), so a trace that breaks its own
    chaining contract still gets correct, distinct keys.
    """

    def __init__(self, block_size: int, namespace: Namespace | None = None) -> None:
        self.block_size = validate_block_size(block_size)
        self.namespace = namespace or Namespace(model_revision="trace-replay", block_size=block_size)
        self._roots: dict[str | None, BlockKey] = {None: self.namespace.root_key()}  # per tenant
        self._memo: dict[tuple[bytes, int], list[BlockKey]] = {}
        self._grouped: dict[tuple[bytes, tuple[int, ...]], BlockKey] = {}  # a replay block of several ids

    def _root(self, tenant: str | None) -> BlockKey:
        root = self._roots.get(tenant)
        if root is None:
            root = self._roots[tenant] = replace(self.namespace, tenant=tenant).root_key()
        return root

    def _sub_keys(self, parent: BlockKey, hash_id: int, count: int) -> list[BlockKey]:
        """Keys of the first `count` sub-blocks of trace block `hash_id` after `parent`."""
        memo_key = (parent, hash_id)
        keys = self._memo.get(memo_key)
        if keys is None:
            keys = self._memo[memo_key] = []
        while len(keys) < count:
            keys.append(block_key(keys[-1] if keys else parent, (hash_id, len(keys))))
        return keys if len(keys) == count else keys[:count]

    def keys(self, request: TraceRequest) -> list[BlockKey]:
        """Keys of every full block of the request's prompt, root first."""
        size, covered = self.block_size, request.block_tokens
        parent = self._root(request.tenant)
        keys: list[BlockKey] = []
        if size > covered:  # several ids to a replay block: the ids of each whole one, together
            group = size // covered
            for start in range(0, request.input_length // size * group, group):
                ids = request.hash_ids[start:start + group]
                memo_key = (parent, ids)
                key = self._grouped.get(memo_key)
                if key is None:
                    key = self._grouped[memo_key] = block_key(parent, ids, extra_keys=("trace-ids",))
                keys.append(key)
                parent = key
            return keys
        per_hash = covered // size
        last = len(request.hash_ids) - 1
        for position, hash_id in enumerate(request.hash_ids):
            tokens = covered if position < last else request.input_length - covered * last
            count = min(per_hash, tokens // size)
            if count == 0:
                break
            sub = self._sub_keys(parent, hash_id, count)
            keys.extend(sub)
            parent = sub[-1]
        return keys

    def output_keys(self, request: TraceRequest, index: int, prompt_keys: Sequence[BlockKey]) -> list[BlockKey]:
        """Keys of the blocks request `index`'s output makes whole, written (its last token is never
        computed), after its prompt's `prompt_keys`: by its `output_hash_ids`, in the chain a later
        prompt repeating the answer has, where the line has them and that chain runs through the
        prompt's keys; else `own_output_keys`."""
        if request.output_hash_ids:
            whole = request.input_length // request.block_tokens
            sequence = replace(request, input_length=request.input_length + request.output_length - 1,
                               hash_ids=request.hash_ids[:whole] + request.output_hash_ids, output_hash_ids=())
            keys = self.keys(sequence) if sequence.hash_ids else []
            if keys[:len(prompt_keys)] == list(prompt_keys) and len(prompt_keys) == (
                    request.input_length // self.block_size):
                return keys[len(prompt_keys):]
        return own_output_keys(request, index, prompt_keys, self.block_size)


def own_output_keys(request: TraceRequest, index: int, prompt_keys: Sequence[BlockKey],
                    block_size: int) -> list[BlockKey]:
    """Keys of the blocks request `index`'s output makes whole, written, that no other request
    hits (a trace that does not say what the output's tokens are), chained after its prompt's; none
    where the prompt has no whole block or its ids do not cover it."""
    if not prompt_keys or len(prompt_keys) != request.input_length // block_size:
        return []
    keys, parent = [], prompt_keys[-1]
    for block in range(len(prompt_keys), (request.input_length + request.output_length - 1) // block_size):
        parent = block_key(parent, (index, block), extra_keys=("replay-output",))
        keys.append(parent)
    return keys
