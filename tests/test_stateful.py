"""A hypothesis state machine drives the cache core and audits it after every step.

Beyond `audit()` it checks content: every indexed block a live sequence holds at
position i carries the chain key of that sequence's tokens up to block i, so a
lookup can never hand one prompt's KV to another.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvctl.daemon.cache import CacheFull, Namespace, PinBudgetExceeded, chain_keys
from kvctl.policies.admission import Verdict

from .conftest import FakeClock, make_manager

BLOCK = 4
NUM_BLOCKS = 16
BASES = [list(range(100, 124)), list(range(200, 224)), [7] * 24]
TENANTS = ["acme", "globex"]

prompts = st.builds(
    lambda base, cut, tail: BASES[base][:cut] + tail,
    st.integers(0, len(BASES) - 1), st.integers(0, 24),
    st.lists(st.integers(0, 3), min_size=0, max_size=6),
).filter(lambda p: len(p) >= 1)


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.policy = "lru"
        self.m = None
        self.seqs: dict[str, dict] = {}  # seq id -> {"ns", "prompt", "written"}
        self.counter = 0

    @rule(policy=st.sampled_from(["lru", "cost", "lfu"]))
    @precondition(lambda self: self.m is None)
    def start(self, policy):
        self.m = make_manager(NUM_BLOCKS, BLOCK, policy=policy, clock=self.clock,
                              pin_budget_blocks=6)

    def _snapshot(self):
        m = self.m
        return (m.state_counts(), {s: (m.block_table(s), list(m.sequence(s).reserve))
                                   for s in self.seqs}, m.pool.policy.order(), m.pool.num_indexed)

    def _new_id(self) -> str:
        self.counter += 1
        return f"s{self.counter}"

    @rule(prompt=prompts, reserve=st.integers(0, 10), tenant=st.sampled_from(TENANTS))
    @precondition(lambda self: self.m is not None)
    def admit(self, prompt, reserve, tenant):
        ns = Namespace(block_size=BLOCK, tenant=tenant)
        seq_id = self._new_id()
        decision = self.m.can_admit(chain_keys(ns, prompt), len(prompt), reserve, request=seq_id)
        before = self._snapshot()
        try:
            admission = self.m.admit_tokens(seq_id, ns, prompt, reserve)
        except CacheFull:
            assert decision.verdict is not Verdict.ADMIT
            assert self._snapshot() == before
            return
        assert decision.verdict is Verdict.ADMIT
        assert admission.reserved_blocks == decision.needed_blocks
        self.seqs[seq_id] = {"ns": ns, "prompt": prompt, "written": prompt[:admission.hit_tokens]}

    def _prefilling(self):
        return [s for s, v in self.seqs.items() if len(v["written"]) < len(v["prompt"])]

    def _decoding(self):
        return [s for s, v in self.seqs.items() if len(v["written"]) >= len(v["prompt"])]

    @rule(data=st.data(), chunk=st.integers(1, 9))
    @precondition(lambda self: self.m is not None and self._prefilling())
    def prefill(self, data, chunk):
        seq_id = data.draw(st.sampled_from(sorted(self._prefilling())))
        state = self.seqs[seq_id]
        n = min(chunk, len(state["prompt"]) - len(state["written"]))
        before = self._snapshot()
        try:
            self.m.append(seq_id, n)
        except CacheFull:
            assert self._snapshot() == before
            return
        state["written"] = state["prompt"][:len(state["written"]) + n]

    @rule(data=st.data(), tokens=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    @precondition(lambda self: self.m is not None and self._decoding())
    def decode(self, data, tokens):
        seq_id = data.draw(st.sampled_from(sorted(self._decoding())))
        state = self.seqs[seq_id]
        table = self.m.block_table(seq_id)
        tail = table[-1] if table else None
        shared_partial = (len(state["written"]) % BLOCK != 0
                          and self.m.pool.blocks[tail].ref_count > 1)
        before = self._snapshot()
        try:
            copies = self.m.append_tokens(seq_id, tokens)
        except CacheFull:
            assert self._snapshot() == before
            return
        if shared_partial:  # writing to a shared partial block copies it first
            assert len(copies) == 1 and copies[0][0] == tail
            assert self.m.block_table(seq_id)[len(table) - 1] == copies[0][1]
        else:
            assert copies == []
        state["written"] = state["written"] + tokens

    @rule(data=st.data(), reserve=st.integers(0, 6))
    @precondition(lambda self: self.m is not None and self._decoding())
    def fork(self, data, reserve):
        parent = data.draw(st.sampled_from(sorted(self._decoding())))
        child = self._new_id()
        before = self._snapshot()
        try:
            self.m.fork(parent, child, reserve)
        except CacheFull:
            assert self._snapshot() == before
            return
        assert self.m.block_table(child) == self.m.block_table(parent)
        p = self.seqs[parent]
        self.seqs[child] = {"ns": p["ns"], "prompt": p["prompt"], "written": list(p["written"])}

    @rule(data=st.data())
    @precondition(lambda self: self.m is not None and self.seqs)
    def finish_or_cancel(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        held = len(self.m.block_table(seq_id)) + len(self.m.sequence(seq_id).reserve)
        assert self.m.release(seq_id) == held
        assert self.m.release(seq_id) == 0  # idempotent
        del self.seqs[seq_id]

    @rule(prompt=prompts, tenant=st.sampled_from(TENANTS), ttl=st.sampled_from([None, 1.0, 5.0]))
    @precondition(lambda self: self.m is not None)
    def pin(self, prompt, tenant, ttl):
        if len(prompt) < BLOCK:
            return
        ns = Namespace(block_size=BLOCK, tenant=tenant)
        before = (len(self.m.pins.all()), self.m.pins.used(tenant))
        try:
            self.m.pin(ns, prompt, ttl=ttl, owner="test")
        except PinBudgetExceeded:
            assert (len(self.m.pins.all()), self.m.pins.used(tenant)) == before
        assert self.m.pins.used(tenant) <= 6

    @rule(data=st.data())
    @precondition(lambda self: self.m is not None and self.m.pins.all())
    def unpin(self, data):
        pin = data.draw(st.sampled_from(self.m.pins.all()))
        self.m.unpin(pin.pin_id)

    @rule(seconds=st.sampled_from([0.5, 2.0, 10.0]))
    @precondition(lambda self: self.m is not None)
    def expire(self, seconds):
        self.clock.advance(seconds)
        for pin in self.m.expire_pins():
            assert pin.expires_at is not None and pin.expires_at <= self.clock.now
        assert all(p.expires_at is None or p.expires_at > self.clock.now for p in self.m.pins.all())

    @rule(prompt=prompts, tenant=st.sampled_from(TENANTS))
    @precondition(lambda self: self.m is not None)
    def evict(self, prompt, tenant):
        keys = chain_keys(Namespace(block_size=BLOCK, tenant=tenant), prompt)
        pool = self.m.pool
        idle = [k for k in keys if pool.block_of(k) is not None
                and pool.blocks[pool.block_of(k)].ref_count == 0
                and pool.blocks[pool.block_of(k)].pin_count == 0]
        kept = [k for k in keys if k not in idle and pool.block_of(k) is not None]
        report = self.m.evict_prefix(keys)
        assert report.evicted_blocks == len(idle)
        assert report.evicted_blocks + sum(report.skipped.values()) == len(keys)
        assert all(pool.block_of(k) is None for k in idle)
        assert all(pool.block_of(k) is not None for k in kept)

    @rule(prompt=prompts, tenant=st.sampled_from(TENANTS))
    @precondition(lambda self: self.m is not None)
    def lookup(self, prompt, tenant):
        ns = Namespace(block_size=BLOCK, tenant=tenant)
        keys = chain_keys(ns, prompt)
        hits = self.m.lookup(keys)
        for position in range(hits):
            block = self.m.pool.blocks[self.m.pool.block_of(keys[position])]
            assert block.key == keys[position]
        assert hits == len(keys) or self.m.pool.block_of(keys[hits]) is None

    @invariant()
    def books_balance(self):
        if self.m is None:
            return
        self.m.audit()
        counts = self.m.state_counts()
        assert sum(counts.values()) == NUM_BLOCKS and min(counts.values()) >= 0

    @invariant()
    def indexed_blocks_hold_their_sequences_content(self):
        if self.m is None:
            return
        for seq_id, state in self.seqs.items():
            table = self.m.block_table(seq_id)
            written = state["written"]
            assert len(table) == -(-len(written) // BLOCK)
            for position, key in enumerate(chain_keys(state["ns"], written)):
                held = self.m.pool.blocks[table[position]].key
                assert held is None or held == key

    def teardown(self):
        if self.m is None:
            return
        for seq_id in list(self.seqs):
            self.m.release(seq_id)
        for pin in self.m.pins.all():
            self.m.unpin(pin.pin_id)
        self.m.audit()
        counts = self.m.state_counts()
        assert counts["free"] + counts["cached"] == NUM_BLOCKS, counts
        assert all(block.ref_count == 0 and block.pin_count == 0 for block in self.m.pool.blocks)


CacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestCacheMachine = CacheMachine.TestCase
