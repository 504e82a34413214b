"""The cache event log: order, chains, filters, the bound and its gap, waking a waiter; and the
events the device pool logs for each way a key enters or leaves its index."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvctl.daemon.cache.events import EventLog, chain_runs
from kvctl.daemon.cache.keys import Namespace, chain_keys
from kvctl.daemon.cache.manager import KVCacheManager
from kvctl.daemon.cache.pool import BlockPool
from kvctl.policies.eviction import LRUEviction


@dataclass
class B:
    key: bytes
    parent: bytes | None
    depth: int
    tenant: str | None = "default"


def k(n: int) -> bytes:
    return bytes([n]) * 32


def test_chain_runs_split_where_a_block_does_not_extend_the_one_before():
    blocks = [B(k(1), None, 0), B(k(2), k(1), 1), B(k(3), k(2), 2),  # one chain
              B(k(9), k(2), 2),  # a sibling of k(3): a new run from k(2)
              B(k(4), k(9), 3, "acme"),  # same chain, other tenant: a new run
              B(k(6), k(5), 5)]  # a gap in depth: a new run
    assert chain_runs(blocks) == [((k(1), k(2), k(3)), None, 0, "default"), ((k(9),), k(2), 2, "default"),
                                  ((k(4),), k(9), 3, "acme"), ((k(6),), k(5), 5, "default")]


def test_events_come_in_order_with_their_fields():
    log = EventLog(clock=lambda: 100.0)
    log.stored("device", [B(k(1), None, 0), B(k(2), k(1), 1)])
    log.removed("device", [k(2)], "capacity")
    log.stored("host", [B(k(2), k(1), 1)])
    page = log.since(0)
    assert [e.to_json() for e in page.events] == [
        {"seq": 1, "at": 100.0, "kind": "stored", "tier": "device", "keys": [k(1).hex(), k(2).hex()],
         "parent": None, "depth": 0, "tenant": "default"},
        {"seq": 2, "at": 100.0, "kind": "removed", "tier": "device", "keys": [k(2).hex()], "reason": "capacity"},
        {"seq": 3, "at": 100.0, "kind": "stored", "tier": "host", "keys": [k(2).hex()],
         "parent": k(1).hex(), "depth": 1, "tenant": "default"}]
    assert (page.next_seq, page.oldest_seq, page.gap) == (3, 1, False)
    assert log.since(3).events == [] and log.since(3).next_seq == 3
    log.removed("host", [], "operator")  # nothing removed: no event
    assert log.seq == 3


def test_the_events_held_leave_the_garbage_collectors_books_and_read_back_whole():
    """A serving kvd holds up to DEFAULT_KEY_LIMIT keys of events: as objects, 131,072 one-block
    events cost every whole-heap collection 16 ms (scripts/gc-heap-census --event-log). The log
    holds plain tuples, which the collector stops tracking once it has seen them."""
    import gc

    log = EventLog(clock=lambda: 100.0)
    log.stored("device", [B(k(1), None, 0)])
    log.removed("device", [k(1)], "capacity")
    gc.collect()
    gc.collect()  # the keys' tuple leaves first, the event's after it
    assert not any(gc.is_tracked(held) for held in log._events)
    removed = log.since(1).events[0]
    assert (removed.seq, removed.kind, removed.tier, removed.keys, removed.reason) == (
        2, "removed", "device", (k(1),), "capacity")


def test_a_filtered_read_moves_past_what_it_filters_and_a_limit_stops_early():
    log = EventLog()
    for n in range(1, 7):
        (log.removed("host", [k(n)], "capacity") if n % 2 else log.removed("device", [k(n)], "operator"))
    page = log.since(0, tiers=("device",))
    assert [e.seq for e in page.events] == [2, 4, 6] and page.next_seq == 6
    page = log.since(0, limit=2, kinds=("removed",), tiers=("host",))
    assert [e.seq for e in page.events] == [1, 3] and page.next_seq == 3  # seq 4 not looked at yet
    page = log.since(page.next_seq, limit=2, tiers=("host",))
    assert [e.seq for e in page.events] == [5] and page.next_seq == 6


def test_the_bound_drops_the_oldest_events_and_a_reader_behind_it_is_told():
    log = EventLog(key_limit=4)
    log.removed("device", [k(1), k(2)], "capacity")  # seq 1
    log.removed("device", [k(3), k(4)], "capacity")  # seq 2
    log.removed("device", [k(5)], "capacity")  # seq 3: 5 keys held, over 4, so seq 1 goes
    page = log.since(0)
    assert [e.seq for e in page.events] == [2, 3] and page.gap and page.oldest_seq == 2
    assert not log.since(1).gap  # it read seq 1 already: nothing lost to it
    assert log.dropped_events == 1
    log.removed("device", [k(n) for n in range(10, 20)], "operator")  # bigger than the bound: kept alone
    assert [e.seq for e in log.since(0).events] == [4]


def test_a_seq_this_stream_never_reached_reads_as_a_gap_from_the_start():
    log = EventLog()
    log.removed("device", [k(1)], "operator")
    page = log.since(50)  # the consumer's seq came from the daemon's previous run
    assert page.gap and [e.seq for e in page.events] == [1]
    assert EventLog().stream_id != log.stream_id


def test_a_waiter_is_woken_once_by_the_next_event_and_not_registered_when_one_is_there():
    log = EventLog()
    woken = []
    assert log.notify_after(0, lambda: woken.append(log.seq))
    log.removed("device", [k(1)], "operator")
    log.removed("device", [k(2)], "operator")
    assert woken == [1]
    assert not log.notify_after(1, lambda: woken.append("late"))  # seq 2 exists: read it now

    def broken():
        raise RuntimeError("event loop is closed")
    log.notify_after(2, broken)
    log.removed("device", [k(3)], "operator")  # a dead waiter does not break the producer
    assert log.seq == 3


def test_stopping_wakes_every_waiter_and_lets_none_wait_after_while_events_are_still_logged():
    log = EventLog()
    woken = []
    assert log.notify_after(0, lambda: woken.append("first")) and log.notify_after(0, lambda: woken.append("second"))
    log.stop_waits()
    assert woken == ["first", "second"] and log.stopping
    assert not log.notify_after(0, lambda: woken.append("late"))
    log.removed("device", [k(1)], "operator")  # the shutdown's own moves are still logged
    assert log.seq == 1 and woken == ["first", "second"]


def test_the_log_refuses_a_bound_that_is_not_a_positive_integer():
    with pytest.raises(ValueError, match="key_limit: expected a positive integer, got 0"):
        EventLog(key_limit=0)


# ---- the device pool ---------------------------------------------------------------------------
NS = Namespace(block_size=4)


def logged_manager(num_blocks: int) -> tuple[KVCacheManager, EventLog]:
    manager = KVCacheManager(num_blocks, 4, policy="lru")
    log = EventLog(clock=lambda: 0.0)
    manager.pool.events = log
    return manager, log


def run(manager: KVCacheManager, seq: str, tokens: list[int], written: int | None = None) -> list[bytes]:
    keys = chain_keys(NS, tokens)
    admission = manager.admit(seq, keys, len(tokens), 0)
    manager.append(seq, len(tokens) - admission.hit_tokens)
    manager.release(seq, written)
    return keys


def shape(log: EventLog, since: int = 0) -> list[tuple]:
    return [(e.kind, e.tier, e.keys, e.reason if e.kind == "removed" else (e.parent, e.depth))
            for e in log.since(since).events]


def test_the_pool_logs_each_chain_it_indexes_and_each_key_it_evicts_with_the_reason():
    manager, log = logged_manager(3)
    a = run(manager, "a", list(range(12)))  # three full blocks: the whole pool
    b = run(manager, "b", list(range(8)) + [90, 91, 92, 93])  # shares two blocks with a
    assert shape(log) == [("stored", "device", tuple(a), (None, 0)),
                          ("removed", "device", (a[2],), "capacity"),  # the only evictable leaf a left
                          ("stored", "device", (b[2],), (a[1], 2))]
    seq = log.seq
    report = manager.evict_prefix(b)
    assert report.evicted_blocks == 3
    assert shape(log, seq) == [("removed", "device", (b[2], b[1], b[0]), "operator")]
    assert manager.pool.num_indexed == 0


def test_blocks_indexed_by_a_step_that_never_ran_are_logged_as_unwritten():
    manager, log = logged_manager(8)
    keys = run(manager, "a", list(range(12)), written=4)  # preempted: only its first block computed
    assert shape(log) == [("stored", "device", tuple(keys), (None, 0)),
                          ("removed", "device", (keys[1],), "unwritten"),
                          ("removed", "device", (keys[2],), "unwritten")]
    assert manager.pool.num_indexed == 1


def test_a_pool_without_a_log_logs_nothing_and_works_the_same():
    pool = BlockPool(2, LRUEviction())
    assert pool.events is None
    ids = pool.allocate(2, 0.0)
    pool.insert_many(ids, [k(1), k(2)], 0, 2, 0.0)
    assert pool.num_indexed == 2


def test_the_newest_events_come_oldest_first_with_the_seq_to_read_on_from():
    log = EventLog()
    for n in range(1, 6):
        log.removed("host" if n % 2 else "device", [k(n)], "capacity")
    page = log.last(2, tiers=("host",))
    assert [e.seq for e in page.events] == [3, 5] and page.next_seq == 5 and page.oldest_seq == 1
    assert [e.seq for e in log.last(10).events] == [1, 2, 3, 4, 5]
    assert log.last(3, kinds=("stored",)).events == []


def test_a_large_change_is_several_events_that_each_pick_up_where_the_last_ended(monkeypatch):
    import kvctl.daemon.cache.events as events

    monkeypatch.setattr(events, "EVENT_KEYS", 2)
    log = EventLog()
    chain = [B(k(1), None, 0), B(k(2), k(1), 1), B(k(3), k(2), 2), B(k(4), k(3), 3), B(k(5), k(4), 4)]
    log.stored("disk", chain)
    log.removed("disk", [k(1), k(2), k(3)], "capacity")
    assert [(e.kind, e.keys, e.parent, e.depth, e.reason) for e in log.since(0).events] == [
        ("stored", (k(1), k(2)), None, 0, None), ("stored", (k(3), k(4)), k(2), 2, None),
        ("stored", (k(5),), k(4), 4, None),
        ("removed", (k(1), k(2)), None, None, "capacity"), ("removed", (k(3),), None, None, "capacity")]


def test_a_key_filter_follows_one_block_by_the_leading_hex_digits_of_its_key():
    from kvctl.daemon.cache.events import KeyPrefix

    log = EventLog()
    a, b = bytes.fromhex("9d34" + "76" * 30), bytes.fromhex("9d3e" + "00" * 30)
    log.stored("device", [B(a, None, 0)])
    log.stored("device", [B(b, None, 0)])
    log.removed("device", [b, a], "capacity")
    log.stored("host", [B(a, None, 0)])
    assert [e.seq for e in log.since(0, key=KeyPrefix.parse("9d34")).events] == [1, 3, 4]
    assert [e.seq for e in log.since(0, key=KeyPrefix.parse("9D347")).events] == [1, 3, 4]  # odd: a half byte
    assert [e.seq for e in log.since(0, key=KeyPrefix.parse("9d3e0")).events] == [2, 3]
    assert log.since(0, key=KeyPrefix.parse("9d340")).events == []
    assert [e.seq for e in log.last(2, key=KeyPrefix.parse(a.hex())).events] == [3, 4]
    for bad in ("9d3", "9d3g", "", "0" * 65):
        with pytest.raises(ValueError, match=f"key: expected 4 to 64 hex digits of a block key, got {bad!r}"):
            KeyPrefix.parse(bad)


def test_a_removal_needs_a_known_reason():
    with pytest.raises(ValueError, match="reason: unknown value 'lru'; use capacity, tenant_share, filesystem, "
                                         "operator, corrupt, unwritten, gone"):
        EventLog().removed("device", [k(1)], "lru")
