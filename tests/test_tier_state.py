"""A stateful test of blocks moving between the device pool, host slots and disk segments:
after every step the cache audit passes, every copy of a block in every tier holds that block's
content, nothing is left moving once writes finish, and restores never break the chain."""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter

import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule  # noqa: E402

from kvctl.daemon.cache import KVCacheManager, Namespace, chain_keys  # noqa: E402
from kvctl.daemon.cache.events import EventLog  # noqa: E402
from kvctl.daemon.cache.tiers import (BlockLayout, DiskTier, HostTier, TieredCache,  # noqa: E402
                                      decode_block)
from kvctl.daemon.model.llama import LayerCache  # noqa: E402
from kvctl.policies.tiering import TieringPolicy  # noqa: E402

from .tier_fixtures import content, same  # noqa: E402

BLOCK = 4
LAYOUT = BlockLayout((torch.float16, torch.int8), BLOCK, 1, 4, "")
SPACE = b"s" * 32
NS = Namespace(block_size=BLOCK)
PROMPTS = [[p * 100 + i for i in range(BLOCK * 3)] for p in range(6)]


class TierMachine(RuleBasedStateMachine):
    HOST_SHARES: tuple = ()  # tenant_cache_shares of the host tier

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvctl-tier-machine-")
        self.manager = KVCacheManager(6, BLOCK)
        shape = (6, BLOCK, 1, 4)
        self.caches = [LayerCache(torch.zeros(shape, dtype=d), torch.zeros(shape, dtype=d))
                       for d in LAYOUT.layer_dtypes]
        self.tiers = TieredCache(self.caches, LAYOUT, SPACE, host=HostTier(3 * LAYOUT.block_bytes, LAYOUT),
                                 disk=DiskTier(self.dir, 8 * LAYOUT.payload_bytes, LAYOUT, SPACE),
                                 policy=TieringPolicy(mode="always"))
        self.manager.pool.on_evict = lambda victims: self.tiers.on_device_evict(victims, lambda root: 0)
        self.events = EventLog(key_limit=1 << 30)  # every change, to replay against the books
        self.manager.pool.events = self.tiers.host.events = self.tiers.disk.events = self.events
        self.n = 0
        self.tiers.host.set_tenant_shares(self.HOST_SHARES)

    def _write(self, block_ids, keys):
        for block_id, key in zip(block_ids, keys):
            for cache, (k, v) in zip(self.caches, content(LAYOUT, key)):
                cache.k[block_id] = k
                cache.v[block_id] = v

    @rule(p=st.integers(0, len(PROMPTS) - 1))
    def run_prompt(self, p):
        """Admit, restore what a lower tier holds, compute the rest, release."""
        keys = chain_keys(NS, PROMPTS[p])
        hits = len(self.manager.pool.match(keys))
        run, _ = self.tiers.available_run(keys[hits:])
        if run:
            self.tiers.restore_into(self.manager, keys, hits, run, "default")
        self.n += 1
        seq = f"s{self.n}"
        admission = self.manager.admit(seq, keys, len(PROMPTS[p]), 0)
        self.manager.append(seq, len(PROMPTS[p]) - admission.hit_tokens)
        table = self.manager.block_table(seq)
        self._write(table[admission.hit_blocks:], keys[admission.hit_blocks:])
        self.manager.release(seq)

    @rule(p=st.integers(0, len(PROMPTS) - 1))
    def fetch_from_disk(self, p):
        keys = chain_keys(NS, PROMPTS[p])
        hits = len(self.manager.pool.match(keys))
        job = self.tiers.fetch_now(keys[hits:], timeout=10)
        if job is not None:
            self.tiers.finish_prefetch(job)

    @rule(p=st.integers(0, len(PROMPTS) - 1))
    def operator_evict(self, p):
        keys = chain_keys(NS, PROMPTS[p])
        self.manager.evict_prefix(keys)
        self.tiers.flush()
        self.tiers.drop(keys)

    @rule()
    def finish_writes(self):
        assert self.tiers.flush(10)
        assert self.tiers.inflight == {}

    @invariant()
    def books_balance_and_every_copy_is_right(self):
        self.manager.audit()
        for block in self.manager.pool.blocks:
            if block.key is not None:
                stored = [(c.k[block.block_id], c.v[block.block_id]) for c in self.caches]
                assert same(stored, content(LAYOUT, block.key))
        host = self.tiers.host
        assert len(set(host.index.values())) == len(host.index) <= host.num_slots
        assert host.tenant_blocks == Counter(host._tenant(key) for key in host.index)  # the shares' books
        order = list(host.index)  # each tenant's LRU order is the global one, and the stamps follow it
        assert {t: list(entries) for t, entries in host._by_tenant.items()} == {
            t: [k for k in order if host._tenant(k) == t] for t in host.tenant_blocks}
        assert [host._stamp[k] for k in order] == sorted(host._stamp.values()) and len(host._stamp) == len(order)
        assert len(host._free) + len(host.index) == host.num_slots  # no slot lost or counted twice
        for key, slot in host.index.items():
            assert same([(k[0], v[0]) for k, v in host.read_slots([slot])], content(LAYOUT, key))
        disk = self.tiers.disk
        with disk.lock:  # the writer thread publishes and evicts segments under this lock
            assert disk.used_bytes <= disk.capacity_bytes
            for key in list(disk.index):
                assert same(decode_block(disk.read(key), LAYOUT, SPACE, key), content(LAYOUT, key))
        assert self.tiers.staged == {} and not self.tiers._protected

    @invariant()
    def replaying_the_event_log_gives_every_tier_its_keys(self):
        with self.tiers.disk.lock:  # the writer thread changes disk's index and logs it under this lock
            held: dict[str, set] = {"device": set(), "host": set(), "disk": set()}
            for event in self.events.since(0).events:
                (held[event.tier].update if event.kind == "stored" else held[event.tier].difference_update)(event.keys)
            assert held == {"device": set(self.manager.pool._index), "host": set(self.tiers.host.index),
                            "disk": set(self.tiers.disk.index)}

    def teardown(self):
        self.tiers.close()
        shutil.rmtree(self.dir, ignore_errors=True)


TestTierMachine = TierMachine.TestCase
TestTierMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)


class TierMachineWithHostShares(TierMachine):
    """The same moves with a host share smaller than the host: a tenant at its share recycles its
    own entries, and a block that would put it over gets no slot (it goes down to disk)."""

    HOST_SHARES = (("*", 0.4),)


TestTierMachineWithHostShares = TierMachineWithHostShares.TestCase
TestTierMachineWithHostShares.settings = settings(max_examples=25, stateful_step_count=25, deadline=None)


class _FlakyRedis:
    """Enough of a Redis client for read_many: a pipeline whose execute fails while `up` is False."""

    def __init__(self) -> None:
        self.up, self.calls = True, 0

    def pipeline(self, transaction=False):
        client, gets = self, []

        class Pipe:
            def get(self, key):
                gets.append(key)

            def execute(self):
                client.calls += 1
                if not client.up:
                    raise ConnectionError("Error 111 connecting to 127.0.0.1:6391. Connection refused.")
                return [None] * len(gets)
        return Pipe()


def test_a_redis_outage_logs_once_when_it_starts_and_once_when_redis_answers_again(caplog):
    """Not one warning per failed call or breaker probe: an hour's outage is two lines."""
    from kvctl.daemon.cache.tiers import RemoteTier
    from kvctl.daemon.cache.tiers.remote import RemoteUnavailable
    from kvctl.policies.tiering import CircuitBreaker

    now = [100.0]
    client = _FlakyRedis()
    tier = RemoteTier("redis://127.0.0.1:6391/0", 1 << 20, b"S" * 32, client=client, clock=lambda: now[0],
                      breaker=CircuitBreaker(threshold=2, cooldown=5.0))
    with caplog.at_level("INFO", logger="kvd.tiers"):
        assert tier.read_many([b"k" * 32]) == {}
        client.up = False
        for _ in range(40):  # calls while the breaker lets them through, refusals while it is open
            with pytest.raises(RemoteUnavailable):
                tier.read_many([b"k" * 32])
            now[0] += 1.0
        client.up = True
        now[0] += 5.0  # t = 145: past the cooldown of the probe that failed at 136
        assert tier.read_many([b"k" * 32]) == {}
        assert tier.read_many([b"k" * 32]) == {}
    # failures at t = 100 and 101 open the breaker; then one probe each 5 s: t = 106, 111, ..., 136
    assert client.calls == 1 + 2 + 7 + 2
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "kvd.tiers"] == [
        ("WARNING", "tier remote failing: ConnectionError: Error 111 connecting to 127.0.0.1:6391. Connection "
                    "refused.; skipped while its breaker is open, probed every 5 s"),
        ("WARNING", "tier remote answering again after 45.0 s (9 failed calls)")]
    assert (tier.down_since, tier.failed_calls, tier.health()) == (None, 0, "ok")
