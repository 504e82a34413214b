"""The cache manager under a sliding window (every layer of the model slides one): a sequence
gives back the blocks before its window as it goes (they stay cached), holds at most
`window_blocks`, reserves no more than that, and takes from a prefix hit only the blocks the
next token's window reaches."""

from __future__ import annotations

import pytest

from kvctl.daemon.cache import CacheFull, InvalidRequest, Namespace, chain_keys
from kvctl.daemon.cache.manager import DROPPED

from .conftest import make_manager

NS = Namespace(block_size=4)
PROMPT = list(range(10, 20))  # 10 tokens: two full blocks and a partial one
D = DROPPED


def sliding(num_blocks=12, window=6, step_tokens=4, **kwargs):
    """Block size 4, a window of 6 tokens, prompt chunks of 4: at most ceil((6 - 1 + 4) / 4) + 2 = 5
    blocks a sequence."""
    return make_manager(num_blocks, 4, window=window, step_tokens=step_tokens, **kwargs)


def prefill_in_chunks(m, seq_id, tokens, reserve, chunk=4):
    """Admit and write a prompt `chunk` tokens a step, sliding after each step as the engine does."""
    admission = m.admit_tokens(seq_id, NS, tokens, reserve)
    done = admission.hit_tokens
    while done < len(tokens):
        n = min(chunk, len(tokens) - done)
        m.append(seq_id, n)
        done += n
        m.slide(seq_id, done)
    return admission


def test_a_window_caps_the_reservation_at_the_blocks_a_sequence_holds_at_once():
    m = sliding()
    assert m.window_blocks == 5
    admission = m.admit_tokens("r1", NS, PROMPT, reserve_tokens=30)  # 40 tokens: 10 blocks without a window
    assert (admission.hit_blocks, admission.reserved_blocks) == (0, 5)
    assert m.state_counts() == {"free": 7, "reserved": 5, "active": 0, "shared": 0, "cached": 0, "pinned": 0}
    assert m.peak_blocks(40) == 5 and m.peak_blocks(12) == 3
    assert make_manager(12, 4).peak_blocks(40) == 10  # no window: every block at once


def test_blocks_before_the_window_go_back_cached_and_the_reservation_is_topped_up():
    """After 10 tokens the next one (position 10) attends to 5..10: block 0 (tokens 0-3) goes
    back, indexed, and one block is reserved again, so the sequence still holds 5."""
    m = sliding()
    m.admit_tokens("r1", NS, PROMPT, reserve_tokens=30)
    m.append("r1", 4)
    assert m.slide("r1", 4) == 0
    m.append("r1", 4)
    assert m.slide("r1", 8) == 0  # position 8 attends to 3..8: block 0 still
    assert (m.block_table("r1"), m.sequence("r1").reserve) == ([0, 1], [4, 3, 2])
    m.append("r1", 2)
    assert m.slide("r1", 10) == 1
    seq = m.sequence("r1")
    assert (m.block_table("r1"), seq.reserve, seq.dropped, seq.held_blocks) == ([D, 1, 2], [5, 4, 3], 1, 2)
    assert m.state_counts() == {"free": 6, "reserved": 3, "active": 2, "shared": 0, "cached": 1, "pinned": 0}
    assert m.pool.policy.order() == [0] and m.pool.blocks[0].key is not None
    for token in range(20, 29):  # decode nine tokens, sliding after each
        m.append_tokens("r1", [token])
        m.slide("r1", m.sequence("r1").num_tokens)
    assert m.block_table("r1") == [D, D, D, 3, 4]  # 19 tokens: position 19 attends to 14..19
    assert m.sequence("r1").reserve == [7, 6, 5]
    assert m.pool.policy.order() == [0, 1, 2]  # given back oldest first: LRU evicts them first
    m.audit()
    assert m.release("r1") == 5  # two held, three reserved
    # blocks 0-3 full and indexed stay cached; the partial block 4 and the reservation are free
    assert m.state_counts() == {"free": 8, "reserved": 0, "active": 0, "shared": 0, "cached": 4, "pinned": 0}
    m.audit()


def test_the_reservation_stops_at_what_the_sequence_was_promised():
    """A sequence near its end is not topped up past its prompt and output reservation."""
    m = sliding()
    m.admit_tokens("r1", NS, list(range(10, 26)), reserve_tokens=0)  # 16 tokens: 4 blocks promised
    assert m.sequence("r1").reserve == [3, 2, 1, 0]
    for done in (4, 8, 12, 16):
        m.append("r1", 4)
        m.slide("r1", done)
    # position 16 attends to 11..16: blocks 0 and 1 went back; nothing more is promised
    assert (m.block_table("r1"), m.sequence("r1").reserve) == ([D, D, 2, 3], [])
    m.audit()


def test_a_prefix_hit_takes_only_the_blocks_the_next_tokens_window_reaches():
    """The hit is counted whole (16 tokens) and its blocks before the window are touched, not held."""
    m = sliding()
    prefill_in_chunks(m, "r1", PROMPT + list(range(20, 28)), reserve=0)  # 18 tokens
    m.release("r1")
    before = m.pool.policy.order()
    admission = m.admit_tokens("r2", NS, PROMPT + list(range(20, 27)), 0)  # 17 tokens: 4 full blocks cached
    assert (admission.hit_blocks, admission.hit_tokens, admission.reserved_blocks) == (4, 16, 1)
    # position 16 attends to 11..16: blocks 2 and 3 held; 0 and 1 stay cached, touched as reused
    assert m.block_table("r2") == [D, D, 2, 3]
    assert [m.pool.blocks[b].hits for b in range(4)] == [1, 1, 1, 1]
    assert m.pool.policy.order() == [b for b in before if b not in (0, 1, 2, 3)] + [1, 0]
    m.audit()


def test_a_hit_is_counted_against_room_only_for_the_blocks_it_holds():
    m = sliding(num_blocks=6)
    prefill_in_chunks(m, "r1", PROMPT + list(range(20, 28)), reserve=0)  # 5 blocks written
    m.release("r1")
    assert m.state_counts()["cached"] == 4  # and one free (the partial block)
    decision = m.can_admit(chain_keys(NS, PROMPT + list(range(20, 27))), 17, 0)
    # blocks 2 and 3 held (not room for it), 0 and 1 only touched (room still): 6 - 2 available
    assert (decision.needed_blocks, decision.available_blocks) == (1, 4)


def test_fork_shares_the_held_blocks_and_the_entries_given_back():
    m = sliding()
    prefill_in_chunks(m, "r1", PROMPT, reserve=8)
    assert m.block_table("r1") == [D, 1, 2]
    m.fork("r1", "r1/1", reserve_tokens=8)
    child = m.sequence("r1/1")
    assert m.block_table("r1/1") == [D, 1, 2] and child.dropped == 1
    # 18 tokens promised: 5 entries, 2 of them still to append, and the copy of the shared tail
    assert len(child.reserve) == 2 + 1
    assert m.state_counts()["shared"] == 2
    m.append_tokens("r1/1", [99])  # copy-on-write of the partial tail block
    assert m.block_table("r1/1")[:2] == [D, 1] and m.block_table("r1/1")[2] != 2
    m.audit()
    m.release("r1")
    m.release("r1/1")
    m.audit()


def test_slide_is_checked_and_does_nothing_without_a_window():
    m = sliding()
    m.admit_tokens("r1", NS, PROMPT, 0)
    m.append("r1", 4)
    with pytest.raises(InvalidRequest, match=r"^request r1: computed_tokens must be 0\.\.4, got 5$"):
        m.slide("r1", 5)
    plain = make_manager(12, 4)
    plain.admit_tokens("r1", NS, PROMPT * 2, 0)
    plain.append("r1", 20)
    assert plain.slide("r1", 20) == 0 and DROPPED not in plain.block_table("r1")
    with pytest.raises(InvalidRequest, match=r"^window: must be a positive number of tokens or None, got 0$"):
        make_manager(12, 4, window=0)


def test_a_window_never_gives_back_the_tail_block():
    """A window of one token: position 8 attends to itself only, in a block not written yet; the
    full tail block (tokens 4-7) stays, so the table always ends in a block it holds."""
    m = sliding(window=1)
    m.admit_tokens("r1", NS, PROMPT[:8], 4)
    m.append("r1", 8)
    assert m.slide("r1", 8) == 1
    assert m.block_table("r1") == [D, 1]
    m.audit()


def test_cache_full_under_a_window_changes_nothing():
    m = sliding(num_blocks=6)
    prefill_in_chunks(m, "r1", PROMPT, reserve=30)  # holds 2, reserves 3: 5 of 6
    with pytest.raises(CacheFull):
        m.admit_tokens("r2", NS, list(range(50, 60)), 0)  # needs 3 blocks, 1 left
    assert list(m._seqs) == ["r1"]
    m.audit()


def test_a_hit_needs_only_the_blocks_its_window_reaches_not_the_chain_from_the_root():
    """A sliding sequence gives its first blocks back first, so LRU evicts them first. A prompt
    that starts the same way still hits as far as the blocks the next token attends to are
    cached; a block missing inside that window ends the hit before it."""
    m = sliding()
    prompt = PROMPT + list(range(20, 30))  # 20 tokens
    prefill_in_chunks(m, "r1", prompt, reserve=0)
    m.release("r1")
    keys = chain_keys(NS, prompt)
    assert m.lookup(keys, 20) == 4  # blocks 0-3 cached
    m.pool.evict_keys(keys[:2])  # the first two blocks went
    assert m.pool.match(keys) == []  # nothing from the root
    assert m.lookup(keys, 20) == 4  # position 16 attends to 11..16: blocks 2 and 3
    admission = m.admit_tokens("r2", NS, prompt, 0)
    assert (admission.hit_blocks, admission.hit_tokens) == (4, 16)
    assert m.block_table("r2") == [D, D, 2, 3]
    m.append("r2", 4)
    m.slide("r2", 20)
    m.audit()
    m.release("r2")
    m.pool.evict_keys(keys[2:3])  # now a block inside the window of position 16 is missing
    assert m.lookup(keys, 20) == 0  # block 3 alone: position 16 would need 11..15 from block 2 as well
    plain = make_manager(12, 4)  # no window: the chain from the root, as before
    prefill_in_chunks(plain, "r1", prompt, reserve=0)
    plain.release("r1")
    plain.pool.evict_keys(keys[:1])
    assert plain.lookup(keys, 20) == 0


def test_install_window_restores_the_window_s_missing_blocks_all_or_none_and_holds_the_rest():
    """A restore under a window puts back only the blocks of keys[first:stop] the cache lacks (here
    block 2, of blocks 2 and 3): block 3, cached, is held meanwhile, so the room it makes never
    evicts it. Too little room for them all installs none; a cache without a window refuses."""
    m = sliding(num_blocks=6)
    prompt = PROMPT + list(range(20, 30))  # 20 tokens
    prefill_in_chunks(m, "r1", prompt, reserve=0)
    m.release("r1")
    keys = chain_keys(NS, prompt)
    m.pool.evict_keys(keys[:3])  # blocks 0-2 went; block 3 stays
    assert m.lookup(keys, 20) == 0  # position 16 needs block 2 as well
    block_3 = m.pool.block_of(keys[3])
    loaded = []
    assert m.install_window(keys, 2, 4, NS.tenant, lambda ks, ids: loaded.append((list(ks), ids))) == 1
    assert [ks for ks, _ in loaded] == [[keys[2]]]  # block 3 is not read again
    assert m.pool.block_of(keys[3]) == block_3 and m.pool.block_of(keys[2]) == loaded[0][1][0]
    assert [m.pool.block_of(k) for k in keys[:2]] == [None, None]  # before the window: not needed
    assert m.lookup(keys, 20) == 4
    m.audit()
    m.pool.evict_keys(keys[2:3])
    m.admit_tokens("r2", NS, list(range(50, 66)), 0)  # holds or reserves 4 of the 6 blocks
    free = m.pool.available()
    assert free == 2  # one free and the idle block 3, which a restore of blocks 1 to 3 holds
    assert m.install_window(keys, 1, 4, NS.tenant, lambda ks, ids: None) == 0  # blocks 1 and 2: none
    assert m.pool.block_of(keys[3]) == block_3 and m.pool.available() == free
    m.audit()
    with pytest.raises(InvalidRequest, match="^install_window: the cache has no sliding window"):
        make_manager(12, 4).install_window(keys, 0, 2, NS.tenant, lambda ks, ids: None)
