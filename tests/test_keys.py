"""Prefix identity: canonical SHA-256 chains, namespaces, cross-process stability."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys

import pytest

from kvctl.daemon.cache import Namespace, PrefixHasher, block_key, chain_keys

TOKENS = list(range(1000, 1040))  # 40 tokens: two full blocks of 16 and a partial one


def test_only_full_blocks_get_keys():
    ns = Namespace(block_size=16)
    assert len(chain_keys(ns, TOKENS)) == 2
    assert chain_keys(ns, TOKENS[:15]) == []


def test_block_key_is_sha256_over_the_documented_encoding():
    parent = Namespace(block_size=4).root_key()
    tokens = [7, 8, 9, 10]
    u32 = struct.Struct("<I").pack
    token_bytes = u32(4) + b"".join(u32(t) for t in tokens)
    expected = hashlib.sha256(
        b"kvctl/block/v1" + b"\x00" + u32(32) + parent + b"\x01" + u32(len(token_bytes)) + token_bytes
        + b"\x02" + u32(0)).digest()
    assert block_key(parent, tokens) == expected


def test_encoding_is_injective_where_naive_concatenation_is_not():
    root = Namespace().root_key()
    assert block_key(root, [1, 23]) != block_key(root, [12, 3])
    assert block_key(root, [], ["ab", "c"]) != block_key(root, [], ["a", "bc"])
    assert block_key(root, [], ["1"]) != block_key(root, [], [1])
    assert block_key(root, [], [b"1"]) != block_key(root, [], ["1"])


def test_incremental_hashing_matches_whole_prompt_hashing():
    ns = Namespace(block_size=16)
    hasher = PrefixHasher(ns)
    keys = hasher.feed(TOKENS[:10]) + hasher.feed(TOKENS[10:33]) + hasher.feed(TOKENS[33:])
    assert keys == chain_keys(ns, TOKENS)
    twin = hasher.copy()
    assert twin.feed(list(range(24))) == hasher.feed(list(range(24)))


@pytest.mark.parametrize("field, value", [
    ("model_revision", "rev-b"), ("tokenizer_digest", "tok-b"), ("adapter_id", "lora-1"),
    ("position_policy", "alibi"), ("multimodal_digest", "img-1"), ("cache_dtype", "fp8_e4m3"),
    ("scale_version", "scales-2"), ("tenant", "acme"),
])
def test_every_namespace_field_changes_every_key(field, value):
    base = Namespace(block_size=16)
    other = Namespace(**{**base.describe(), field: value})
    base_keys, other_keys = chain_keys(base, TOKENS), chain_keys(other, TOKENS)
    assert not set(base_keys) & set(other_keys)


def test_block_size_is_part_of_the_namespace():
    a = chain_keys(Namespace(block_size=8), TOKENS[:16])
    b = chain_keys(Namespace(block_size=16), TOKENS[:16])
    assert a[1] != b[0]
    assert Namespace(block_size=8).root_key() != Namespace(block_size=16).root_key()


def test_equal_block_after_a_different_context_never_matches():
    ns = Namespace(block_size=4)
    first = chain_keys(ns, [1, 2, 3, 4, 9, 9, 9, 9])
    second = chain_keys(ns, [5, 6, 7, 8, 9, 9, 9, 9])
    assert first[1] != second[1]


@pytest.mark.parametrize("kwargs, message", [
    ({"block_size": 24}, "block_size: expected a power of two from 1 to 512, got 24"),
    ({"block_size": 1024}, "block_size: expected a power of two from 1 to 512, got 1024"),
    ({"block_size": 0}, "block_size: expected a power of two from 1 to 512, got 0"),
    ({"tenant": ""}, "namespace.tenant: must not be empty"),
    ({"adapter_id": 3}, "namespace.adapter_id: expected a string, got 3"),
])
def test_bad_namespace_fields_are_named(kwargs, message):
    with pytest.raises(ValueError) as info:
        Namespace(**kwargs)
    assert str(info.value) == message


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "7"])
def test_bad_token_ids_are_rejected_and_the_hasher_keeps_its_state(bad):
    hasher = PrefixHasher(Namespace(block_size=4))
    hasher.feed([1, 2])
    with pytest.raises(ValueError) as info:
        hasher.feed([3, bad])
    assert "token_ids: every id must be an integer in [0, 2**32), found" in str(info.value)
    assert repr(bad) in str(info.value)
    assert hasher.feed([3, 4]) == chain_keys(Namespace(block_size=4), [1, 2, 3, 4])


_CHILD = """
import json, sys
from kvctl.daemon.cache import Namespace, chain_keys
ns = Namespace(model_revision="rev", tokenizer_digest="tok", tenant="t1", block_size=16)
print(json.dumps([k.hex() for k in chain_keys(ns, list(range(1000, 1040)))]))
"""


def test_keys_are_identical_across_processes_whatever_pythonhashseed():
    outputs = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True,
                              text=True, check=True)
        outputs.append(json.loads(done.stdout))
    ns = Namespace(model_revision="rev", tokenizer_digest="tok", tenant="t1", block_size=16)
    assert outputs[0] == outputs[1] == [k.hex() for k in chain_keys(ns, TOKENS)]
