"""Speculative decoding by prompt lookup: the drafts, the cache's draft slots, and the engine
giving the replies it gives without speculation in fewer steps."""

from __future__ import annotations

import random

import pytest

from kvctl.daemon.cache import CacheFull, InvalidRequest
from kvctl.policies.speculation import NgramIndex, NgramSpeculation, parse_speculation

from .conftest import make_manager, run_prompt

PROMPT = list(range(10, 20))  # 10 tokens at block size 4: two full blocks and a partial one


def index_of(tokens, low=2, high=4):
    index = NgramIndex(low, high)
    index.extend(tokens)
    return index


# ---- drafts -----------------------------------------------------------------------------------
def test_the_longest_suffix_seen_before_proposes_what_followed_its_latest_occurrence():
    tokens = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3]
    assert index_of(tokens).propose(4) == [5, 1, 2, 3]  # [1,2,3] last came before 5, not 4
    assert index_of(tokens).propose(2) == [5, 1]
    longest = [7, 8, 9, 1, 2, 6, 0, 8, 9, 5, 7, 8, 9]  # [8,9] came last before 5; [7,8,9] before 1
    assert index_of(longest).propose(3) == [1, 2, 6]
    assert index_of(longest, high=2).propose(3) == [5, 7, 8]


def test_no_draft_without_a_match_of_the_shortest_length():
    assert index_of([1, 2, 3, 4]).propose(4) == []
    assert index_of([5, 1, 2, 1]).propose(4) == []  # [2,1] is new; [1] alone is shorter than min 2
    assert index_of([5, 1, 2, 1], low=1).propose(4) == [2, 1]
    assert index_of([1, 2, 1, 2]).propose(0) == []


def lookup_by_hand(tokens, limit, low=2, high=4):
    """The draft, found the slow way: for n from high down to low, the latest earlier occurrence
    of the last n tokens that has a token after it, and up to `limit` tokens from there."""
    for n in range(min(high, len(tokens) - 1), low - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # the occurrence must end before the last token
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + limit]
    return []


def test_drafts_equal_a_search_by_hand_and_feeding_token_by_token_changes_nothing():
    rng = random.Random(5)
    for length in (1, 2, 3, 7, 40, 200):
        for alphabet in (2, 3, 6):
            tokens = [rng.randrange(alphabet) for _ in range(length)]
            whole, piecewise = index_of(tokens), NgramIndex(2, 4)
            for token in tokens:
                piecewise.extend([token])
            assert whole.tokens == piecewise.tokens == tokens
            for limit in (1, 3, 8):
                assert whole.propose(limit) == piecewise.propose(limit) == lookup_by_hand(tokens, limit), tokens
                assert index_of(tokens, low=1, high=2).propose(limit) == lookup_by_hand(tokens, limit, 1, 2)


@pytest.mark.parametrize("value, message", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens: must be an integer from 1 to 16, got 0"),
    ({"method": "ngram"}, "num_speculative_tokens: required (draft tokens per step, 1 to 16)"),
    ({"method": "eagle", "num_speculative_tokens": 3},
     "method: kvd serves ngram (prompt lookup) only, got 'eagle'; a draft model, EAGLE or MTP head needs weights "
     "kvd does not load"),
    ({"num_speculative_tokens": 3, "prompt_lookup_mx": 2},
     "prompt_lookup_mx: not a key kvd knows (did you mean prompt_lookup_max?); it knows method, "
     "num_speculative_tokens, prompt_lookup_max, prompt_lookup_min, disable_by_batch_size"),
    ({"num_speculative_tokens": 3, "prompt_lookup_min": 5}, "prompt_lookup_min: must be at most prompt_lookup_max "
                                                            "(4), got 5"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens: must be an integer from 1 to 16, got True"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 0},
     "disable_by_batch_size: must be an integer from 1 to 1000000, got 0"),
])
def test_speculative_config_refusals_name_the_key_and_value(value, message):
    with pytest.raises(ValueError) as info:
        parse_speculation(value)
    assert str(info.value) == message


def test_speculative_config_defaults():
    assert parse_speculation(None) is None and parse_speculation({}) is None
    assert parse_speculation({"num_speculative_tokens": 3}) == NgramSpeculation(3, 4, 2, None)
    assert parse_speculation({"num_speculative_tokens": 3, "prompt_lookup_max": 1}) == NgramSpeculation(3, 1, 1)


# ---- the cache's draft slots ----------------------------------------------------------------------
def test_a_draft_borrows_free_blocks_and_gives_them_back_whole():
    m = make_manager()
    run_prompt(m, "a", PROMPT, reserve=2)  # 12 tokens: blocks 0, 1, 2, no reservation left
    m.append_tokens("a", [50])  # the decode's own token: 11 tokens
    assert m.append_draft("a", 6) == []  # 17 tokens: two blocks more, from the free list
    seq = m.sequence("a")
    assert (m.block_table("a"), seq.num_tokens, seq.draft, seq.draft_borrowed) == ([0, 1, 2, 3, 4], 17, 6, 2)
    assert m.pool.num_indexed == 2 and m.pool.num_free == 5  # nothing of the draft is indexed
    m.audit()
    assert m.drop_draft("a") == 6
    assert (m.block_table("a"), seq.reserve, seq.num_tokens, seq.draft) == ([0, 1, 2], [], 11, 0)
    assert m.pool.num_free == 7 and m.num_reserved == 0
    m.audit()
    m.append_tokens("a", [60, 61, 62])  # three accepted: into block 2's last slot, then block 3 again
    assert m.block_table("a") == [0, 1, 2, 3] and m.pool.num_indexed == 3
    assert m.drop_draft("a") == 0
    m.audit()


def test_a_draft_within_the_reservation_leaves_it_as_it_was():
    m = make_manager()
    run_prompt(m, "a", PROMPT, reserve=10)  # 20 tokens: blocks 0-2 written, 3 and 4 reserved
    m.append_tokens("a", [50])
    reserve = list(m.sequence("a").reserve)
    m.append_draft("a", 6)
    assert m.block_table("a") == [0, 1, 2, 3, 4] and m.sequence("a").reserve == []
    m.drop_draft("a")
    assert m.sequence("a").reserve == reserve and m.num_reserved == 2 and m.block_table("a") == [0, 1, 2]
    m.append_tokens("a", [60, 61])  # the accepted tokens take the same blocks the draft had
    assert m.block_table("a") == [0, 1, 2, 3]
    m.audit()


def test_a_draft_never_evicts_a_cached_prefix_and_changes_nothing_when_refused():
    m = make_manager(num_blocks=4)
    run_prompt(m, "x", list(range(1, 9)))
    m.release("x")  # two cached blocks, two free
    run_prompt(m, "a", [40, 41, 42])
    m.append_tokens("a", [43])  # block full: a draft of 5 needs two blocks, one is free
    before = (m.state_counts(), m.block_table("a"), m.sequence("a").num_tokens, m.pool.num_indexed)
    with pytest.raises(CacheFull) as info:
        m.append_draft("a", 5)
    assert str(info.value) == "request a: needs 2 new blocks but only 1 of 4 are free or evictable"
    assert (m.state_counts(), m.block_table("a"), m.sequence("a").num_tokens, m.pool.num_indexed) == before
    m.audit()


def test_tokens_are_appended_by_id_only_once_the_draft_is_dropped():
    m = make_manager()
    run_prompt(m, "a", PROMPT, reserve=4)
    m.append_draft("a", 2)
    with pytest.raises(InvalidRequest) as info:
        m.append_tokens("a", [1])
    assert str(info.value) == "request a: 2 draft tokens at its tail; drop_draft() first"
    with pytest.raises(InvalidRequest) as info:
        m.append_draft("a", 1)
    assert str(info.value) == "request a: already holds a draft of 2 tokens"
    m.release("a", written_tokens=10)  # a sequence ended with its draft gives every block back
    assert m.state_counts()["free"] + m.state_counts()["cached"] == 10
    m.audit()
