"""What an LRU prefix cache of other sizes would have served of the prompts kvd took: a hit
curve (a miss ratio curve turned over) from reuse distances, measured on live traffic.

Mattson's one pass: a block's reuse distance is how many other blocks were used since it was
last used, and an LRU cache of C blocks holds it exactly when that is under C, so one pass over
the traffic answers every size at once. A prompt is served its chain of full blocks up to the
first block not held, so a block counts as a hit at size C when every block of its chain up to
it is under C (the running maximum of their distances).

`look` is fed each admitted prompt's chain keys (the blocks it may take from the cache, counted);
`touch` the blocks a sequence wrote beyond those (its reply's blocks, cached as they fill, used
but not counted). Distances come from Fenwick trees over the times of each key's last use.

Memory is bounded in two parts. The `exact_keys` most recently used keys are all kept, so a
distance under `exact_keys` is exact, and so is the curve at every size up to it: the blocks a
system prompt is made of, used by every request, always are. A key that falls out of them is
kept only while sampled by its hash, as SHARDS samples (Waldspurger et al., FAST '15, fixed
size): while the top 64 bits of its SHA-256 chain key fall under a threshold, which starts above
every key and falls to the highest kept key's whenever more than `sampled_keys` are kept (that
key and those above it are let go). A use of a key from outside the recent ones counts for
1/rate uses when the key is sampled, and not at all otherwise; its distance is the recent keys
and 1/rate for each sampled key used since. What the model leaves out: pins (always held),
running sequences' blocks (held until they finish), another eviction policy than LRU, and a
sliding window (a hit needs only the window's blocks).

Beside each size, what kvd's own cache served of the same prompts (`served_tokens`), and the same
over the last 5 minutes and hour (`recent`): the counts as they stood a minute apart are kept for
an hour, so a window is the difference (reuse distances are the traffic's own, whatever the window).

Per tenant (`tenants`: how many are followed, the most recently active; daemon/engine/tenant_book.py
retires the others into one sum), the same curve split by whose prompt looked the blocks up: what
the one shared LRU cache of each size would have served each tenant. Read beside what kvd served
the tenant in fact, it says who gains from more blocks, and what shares and priorities cost or give
each tenant against plain LRU.

A few tenants are followed alone too (`follow_alone`: hit_curve_tenants, or those tenant_cache_shares
names): their own prompts' and replies' blocks in an LRU cache of their own, at shares of the
device's blocks (ALONE_FRACTIONS): what a tenant cache share of each size would serve the tenant,
to size its share by.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import OrderedDict, deque
from time import monotonic
from typing import Callable, Iterable, NamedTuple, Sequence

from kvctl.daemon.engine.tenant_book import TenantBook

SPACE = 2 ** 64  # the top 64 bits of a chain key
TIMES = (0.125, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)  # the sizes kvd reports, as multiples of its device's blocks
EXACT_KEYS = 32_768  # the most recent keys, all kept: sizes up to this many blocks are exact
SAMPLED_KEYS = 16_384  # older keys kept at most, sampled (about 15 MiB in all)
WINDOWS = (300, 3600)  # the recent windows kvd reports, in seconds
ALONE_FRACTIONS = (0.0625, 0.125, 0.25, 0.5, 0.75, 1)  # a tenant followed alone: shares of the device's blocks
MAX_ALONE = 8  # tenants followed alone at most (about 1-3 MiB each)
ALONE_EXACT_KEYS = 16_384  # a tenant alone: its most recent keys, all kept (its shares are exact up to this)
ALONE_SAMPLED_KEYS = 2_048  # and older keys kept at most, sampled (for its never-evicting size)
MARK_EVERY = 60.0  # seconds between the marks recent windows are measured from


def alone_tenants(named: Sequence[str], shares: Sequence[tuple[str, float]]) -> list[str]:
    """The tenants the curve follows alone: `named` (hit_curve_tenants), or else the first MAX_ALONE
    that tenant_cache_shares names (by name; not `*`)."""
    return list(named) if named else [tenant for tenant, _ in sorted(shares) if tenant != "*"][:MAX_ALONE]


def sizes_for(device_blocks: int, times: Sequence[float] = TIMES,
              extra: Iterable[int] = ()) -> list[tuple[str, int | None]]:
    """(label, blocks) for each multiple of `device_blocks` (at least one block) and each of `extra`
    block counts not among them (labelled with their multiple, to 3 digits), ascending, then
    ("inf", None): a cache that never evicts, whose misses are only blocks seen for the first time."""
    sizes = {max(1, round(device_blocks * t)): f"{t:g}" for t in times}
    for blocks in extra:
        sizes.setdefault(blocks, f"{blocks / device_blocks:.3g}")
    return [(label, blocks) for blocks, label in sorted(sizes.items())] + [("inf", None)]


class _Marks:
    """A Fenwick tree over times 1..span: how many keys were last used after a time."""

    def __init__(self, span: int, times: Iterable[int] = ()) -> None:
        tree, total = [0] * (span + 1), 0
        for time in times:
            tree[time] += 1
            total += 1
        for time in range(1, span + 1 if total else 0):  # built in one pass
            parent = time + (time & -time)
            if parent <= span:
                tree[parent] += tree[time]
        self.tree, self.span, self.total = tree, span, total

    def add(self, time: int, delta: int) -> None:
        tree, span = self.tree, self.span
        self.total += delta
        while time <= span:
            tree[time] += delta
            time += time & -time

    def move(self, old: int, new: int) -> None:
        """A key last used at `old` is used at `new`: one walk up from each, which stops where the
        two meet (above it, the -1 and the +1 cancel)."""
        tree, span = self.tree, self.span
        while old != new and (old <= span or new <= span):
            if old < new:
                tree[old] -= 1
                old += old & -old
            else:
                tree[new] += 1
                new += new & -new

    def after(self, time: int) -> int:
        """Marks at times after `time`."""
        tree, through = self.tree, 0
        while time > 0:
            through += tree[time]
            time -= time & -time
        return self.total - through


class TenantSnapshot(NamedTuple):
    """The tenants' counts as they stood (HitCurve.tenant_snapshot), to make figures of later."""
    rows: list[tuple[str, list[float]]]  # each tenant of the book and a copy of its row
    retired: list[float]  # the retired tenants' rows, summed
    retired_tenants: int
    # each tenant followed alone: its curve, a copy of its totals, and its counts over each recent window
    alone: dict[str, tuple[HitCurve, list[float], list[tuple[int, float, list[float]]]]]


class _Row:
    """A row of counts (the curve's totals, a tenant's): estimated blocks by the first size that
    holds them (one slot per size, then one for none), then these, from the end."""
    LOOKED, PROMPTS, TOKENS, SERVED = -4, -3, -2, -1  # blocks looked up, prompts, their tokens, tokens kvd served
    WIDTH = 5  # the slot for blocks no size holds, and the four above


class HitCurve:
    """Estimated hit blocks of an LRU cache at each of `sizes` (blocks; None: unbounded)."""

    def __init__(self, sizes: Sequence[tuple[str, int | None]], exact_keys: int = EXACT_KEYS,
                 sampled_keys: int = SAMPLED_KEYS, tenants: int | None = None,
                 clock: Callable[[], float] = monotonic) -> None:
        for name, value in (("exact_keys", exact_keys), ("sampled_keys", sampled_keys)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a whole number of at least 1, got {value!r}")
        self.labels = [label for label, _ in sizes]
        self.sizes = [math.inf if blocks is None else blocks for _, blocks in sizes]
        if self.sizes != sorted(self.sizes):
            raise ValueError(f"sizes: must ascend, got {[blocks for _, blocks in sizes]!r}")
        self.exact_keys, self.sampled_keys = exact_keys, sampled_keys
        self.threshold = SPACE  # an older key is kept while its hash is under this
        # the counts (a row, laid out as _Row says): since the start, and as they stood a minute apart
        # for the last hour (the first as the curve began), so a recent window is their difference
        self._totals = [0.0] * (len(sizes) + _Row.WIDTH)
        self.clock = clock
        self._marks: deque[tuple[float, list[float]]] = deque([(clock(), list(self._totals))],
                                                             maxlen=int(max(WINDOWS) // MARK_EVERY) + 1)
        self._recent: OrderedDict[bytes, int] = OrderedDict()  # the most recent keys -> last use, oldest first
        self._sampled: dict[bytes, int] = {}  # older keys kept -> last use
        self._by_hash: list[tuple[int, bytes]] = []  # max-heap (negated) of the sampled keys' hashes (some stale)
        self._span = 4 * (exact_keys + sampled_keys)  # times before they are renumbered
        self._recent_marks, self._sampled_marks = _Marks(self._span), _Marks(self._span)
        self._now = 0
        # per tenant (None: not followed), rows like the totals' (the book retires the least recently active)
        self.tenants = None if tenants is None else TenantBook(tenants, width=len(self._totals))
        self.alone: dict[str, HitCurve] = {}  # tenant -> its prompts' curve in a cache of its own (follow_alone)

    @property
    def rate(self) -> float:
        """The share of older keys kept (1.0: every key, the curve is exact at every size)."""
        return self.threshold / SPACE

    @property
    def hit_blocks(self) -> list[float]:
        """Estimated hit blocks at each size: those held from it or from a smaller one."""
        return list(itertools.accumulate(self._totals[:len(self.sizes)]))

    @property
    def looked_blocks(self) -> float:
        """Estimated blocks looked up (the chains' full blocks)."""
        return self._totals[_Row.LOOKED]

    @property
    def prompts(self) -> int:
        return round(self._totals[_Row.PROMPTS])

    @property
    def prompt_tokens(self) -> int:
        """Every token of the prompts looked up, as kvd counts them."""
        return round(self._totals[_Row.TOKENS])

    @property
    def tracked(self) -> int:
        return len(self._recent) + len(self._sampled)

    def look(self, keys: Sequence[bytes], prompt_tokens: int, tenant: str | None = None,
             served_tokens: int = 0) -> None:
        """A prompt of `prompt_tokens` tokens is admitted (for `tenant`), of which kvd's cache served
        `served_tokens`; `keys` are the chain keys of the full blocks it may take from the cache,
        root first."""
        now = self.clock()
        if now - self._marks[-1][0] >= MARK_EVERY:
            self._marks.append((now, list(self._totals)))
        totals = self._totals
        rows = [totals] if tenant is None or self.tenants is None else [totals, self.tenants.row(tenant)]
        chain, looked = 0.0, 0.0  # the largest distance of the chain so far; the blocks it counts for
        sizes, use = self.sizes, self._use
        for key in keys:
            distance, weight = use(key)
            if distance > chain:
                chain = distance
            if weight:
                looked += weight
                first = bisect.bisect_right(sizes, chain)  # the first size over the chain's distance
                for row in rows:
                    row[first] += weight
        for row in rows:
            row[_Row.LOOKED] += looked
            row[_Row.PROMPTS] += 1
            row[_Row.TOKENS] += prompt_tokens
            row[_Row.SERVED] += served_tokens
        alone = self.alone.get(tenant) if tenant is not None else None
        if alone is not None:
            alone.look(keys, prompt_tokens, served_tokens=served_tokens)

    def touch(self, keys: Iterable[bytes], tenant: str | None = None) -> None:
        """Blocks a sequence (of `tenant`) wrote and the cache keeps (a reply's): used, not counted."""
        alone = self.alone.get(tenant) if tenant is not None else None
        if alone is not None:
            keys = list(keys)
            alone.touch(keys)
        for key in keys:
            self._use(key)

    def follow_alone(self, tenants: Sequence[str], device_blocks: int) -> None:
        """Follow each of `tenants` alone too, from now: its own prompts' and replies' blocks in an LRU
        cache of its own, at each of ALONE_FRACTIONS of `device_blocks` (what a tenant cache share
        that size would keep). A tenant followed already keeps its curve; one not named loses it."""
        if len(tenants) > MAX_ALONE:
            raise ValueError(f"hit_curve_tenants: at most {MAX_ALONE} tenants, got {len(tenants)}")
        self.alone = {tenant: self.alone.get(tenant) or HitCurve(
            sizes_for(device_blocks, ALONE_FRACTIONS), exact_keys=min(device_blocks, ALONE_EXACT_KEYS),
            sampled_keys=ALONE_SAMPLED_KEYS, clock=self.clock) for tenant in dict.fromkeys(tenants)}

    def figures(self, block_size: int) -> dict:
        """Plain data for /admin/status and /metrics: each size's estimated hit tokens since the
        start, what kvd served of the same prompts, and up to how many blocks the figures are exact;
        `recent`: the same over each of WINDOWS, as far back as the curve goes (`seconds`: the span
        the figures cover, within a minute of the window's)."""
        recent = [{"window": window, "seconds": seconds, **self.row_figures(row, block_size, sizes=True)}
                  for window, seconds, row in self.window_rows()]
        return {"exact_blocks": self.exact_keys, "sample_rate": self.rate, "tracked_keys": self.tracked,
                **self.row_figures(self._totals, block_size, sizes=True), "recent": recent}

    def window_rows(self) -> list[tuple[int, float, list[float]]]:
        """Each of WINDOWS: the seconds it covers (from the latest mark at least that old, or from the
        first: the curve is younger than the window) and the counts made over them (a new row)."""
        now, out = self.clock(), []
        for window in WINDOWS:
            at, then = next((mark for mark in reversed(self._marks) if now - mark[0] >= window), self._marks[0])
            out.append((window, round(now - at, 1), [a - b for a, b in zip(self._totals, then)]))
        return out

    def tenant_figures(self, block_size: int) -> dict | None:
        """Plain data for /admin/tenants (None: tenants not followed): each followed tenant's
        prompts, tokens, what kvd served it and estimated hit tokens at each size (keyed by its
        label), the same summed over the tenants retired from the book, and the tenants followed
        alone's curves (`tenant_snapshot` then `figures_of`: made outside the engine's lock)."""
        return self.figures_of(self.tenant_snapshot(), block_size)

    def tenant_snapshot(self, only: str | None = None) -> TenantSnapshot | None:
        """The tenants' counts (`only`: that tenant's alone), copied (cheap, under the engine's lock),
        for `figures_of`."""
        if self.tenants is None:
            return None
        return TenantSnapshot(self.tenants.items(only), list(self.tenants.retired), self.tenants.retired_tenants,
                              {tenant: (curve, list(curve._totals), curve.window_rows())
                               for tenant, curve in self.alone.items() if only is None or tenant == only})

    def figures_of(self, snapshot: TenantSnapshot | None, block_size: int) -> dict | None:
        """`tenant_figures` from a `tenant_snapshot` (the curves' labels and sizes never change)."""
        if snapshot is None:
            return None
        rows, retired, retired_tenants, alone = snapshot
        return {"tenants": {tenant: self.row_figures(row, block_size) for tenant, row in rows},
                "retired": {"tenants": retired_tenants, **self.row_figures(retired, block_size)},
                # the tenants followed alone: their curves in caches of their own, at these shares' sizes,
                # since they were followed and over each recent window
                "alone": {tenant: {**curve.row_figures(totals, block_size), "recent": [
                    {"window": window, "seconds": seconds, **curve.row_figures(row, block_size)}
                    for window, seconds, row in windows]} for tenant, (curve, totals, windows) in alone.items()},
                "alone_sizes": next(iter(alone.values()))[0].size_rows() if alone else []}

    def no_prompts(self, block_size: int) -> dict:
        """The figures of a tenant with no prompt counted (every count 0), by label."""
        return self.row_figures([0.0] * (len(self.sizes) + _Row.WIDTH), block_size)

    def size_rows(self) -> list[dict]:
        """Each size as plain data: its label (`times`) and blocks (None: a cache that never evicts)."""
        return [{"times": label, "blocks": None if blocks == math.inf else blocks}
                for label, blocks in zip(self.labels, self.sizes)]

    def whole_hit_tokens(self, row: list[float], label: str, block_size: int) -> int:
        """A row's (a tenant's of `tenants.items()`, or the retired ones' sum) estimated hit tokens at
        the size `label`, whole tokens rounded down: a sum of two rows never counts fewer than the two,
        so a counter that sums tenants as they retire never falls."""
        return math.floor(sum(row[:self.labels.index(label) + 1])) * block_size

    def row_figures(self, row: list[float], block_size: int, sizes: bool = False) -> dict:
        """A row's counts (the totals, a tenant's, a copy of them) as figures: hit tokens by size, as a
        list of sizes (`sizes`) or by label."""
        hits = [round(hit * block_size) for hit in itertools.accumulate(row[:len(self.sizes)])]
        out = {"prompts": round(row[_Row.PROMPTS]), "prompt_tokens": round(row[_Row.TOKENS]),
               "served_tokens": round(row[_Row.SERVED]), "looked_tokens": round(row[_Row.LOOKED] * block_size)}
        if sizes:
            out["sizes"] = [{**size, "hit_tokens": hit} for size, hit in zip(self.size_rows(), hits)]
        else:
            out["hit_tokens"] = dict(zip(self.labels, hits))
        return out

    # ---- reuse distances -------------------------------------------------------------------
    def _use(self, key: bytes) -> tuple[float, float]:
        """Use `key` now: its reuse distance (inf: first use) and what the use counts for (0:
        a key not sampled from outside the recent ones, whose distance is only known to be at
        least theirs)."""
        if self._now == self._span:
            self._renumber()
        self._now += 1
        recent, sampled = self._recent, self._sampled
        last = recent.get(key)
        if last is not None:  # one of the recent keys: the most frequent case, kept short
            distance = float(self._recent_marks.after(last))
            recent.move_to_end(key)
            recent[key] = self._now
            self._recent_marks.move(last, self._now)
            return distance, 1.0
        last = sampled.pop(key, None)
        rate = self.rate
        if last is not None:
            distance = self._recent_marks.total + self._sampled_marks.after(last) / rate
            weight = 1.0 / rate
            self._sampled_marks.add(last, -1)
        elif int.from_bytes(key[:8], "big") < self.threshold:  # a sampled key not kept was never used
            distance, weight = math.inf, 1.0 / rate
        else:  # never used, or let go: at least every recent key was used since, if it ever was
            distance, weight = float(len(recent)), 0.0
        recent[key] = self._now
        self._recent_marks.add(self._now, 1)
        if len(recent) > self.exact_keys:
            self._age(*recent.popitem(last=False))
        return distance, weight

    def _age(self, key: bytes, last: int) -> None:
        """`key` is no longer among the most recent: keep it while sampled."""
        self._recent_marks.add(last, -1)
        hashed = int.from_bytes(key[:8], "big")
        if hashed >= self.threshold:
            return
        self._sampled[key] = last
        self._sampled_marks.add(last, 1)
        heapq.heappush(self._by_hash, (-hashed, key))
        while len(self._sampled) > self.sampled_keys:  # lower the threshold to the highest kept hash
            negated, dropped = heapq.heappop(self._by_hash)
            if dropped in self._sampled:
                self.threshold = -negated
                self._sampled_marks.add(self._sampled.pop(dropped), -1)
        if len(self._by_hash) > 2 * len(self._sampled) + 64:  # keys used again since they aged: let them go
            self._by_hash = [(-int.from_bytes(k[:8], "big"), k) for k in self._sampled]
            heapq.heapify(self._by_hash)

    def _renumber(self) -> None:
        """Give the kept keys times 1..n in the order of their last use, and rebuild the trees."""
        order = sorted([*self._sampled.items(), *self._recent.items()], key=lambda item: item[1])
        for time, (key, _) in enumerate(order, 1):
            if key in self._sampled:
                self._sampled[key] = time
            else:
                self._recent[key] = time  # (the recent keys keep their order: they sort last, in it)
        self._now = len(order)
        self._recent_marks = _Marks(self._span, self._recent.values())
        self._sampled_marks = _Marks(self._span, self._sampled.values())
