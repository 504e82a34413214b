"""The prefix tree an operator sees: runs of cached blocks between branch points."""

from __future__ import annotations

from kvctl.daemon.cache.prefix_tree import CachedBlock, PrefixTree


def k(name: str) -> bytes:
    return name.encode().ljust(32, b".")


def chain(names: str, tier: str = "device", parent: str | None = None, depth: int = 0, root: str | None = None,
          **facts) -> list[CachedBlock]:
    """Blocks named by single letters, each the child of the one before (the first of `parent`)."""
    out = []
    root = root or (names[0] if parent is None else None)
    for i, name in enumerate(names):
        before = (names[i - 1] if i else parent)
        out.append(CachedBlock(k(name), k(before) if before else None, k(root), depth + i, tier, **facts))
    return out


def shape(tree: PrefixTree) -> dict[str, tuple]:
    """node id -> (its blocks, parent node, children, start depth), by letters."""
    letter = {key: key.rstrip(b".").decode() for key in tree.node_of}
    return {letter[n.key]: ("".join(letter[x] for x in n.keys), letter.get(n.parent), sorted(letter[c] for c in n.children),
                            n.start_depth)
            for n in tree.nodes.values()}


def test_a_shared_start_is_one_node_and_each_way_on_from_it_another():
    # a b c: the shared start (a chat template and system prompt); then d e or f; under f, g or h
    blocks = chain("abc") + chain("de", parent="c", depth=3, root="a") + chain("f", parent="c", depth=3, root="a") \
        + chain("g", parent="f", depth=4, root="a") + chain("h", parent="f", depth=4, root="a")
    tree = PrefixTree(blocks)
    assert shape(tree) == {"a": ("abc", None, ["d", "f"], 0), "d": ("de", "a", [], 3), "f": ("f", "a", ["g", "h"], 3),
                           "g": ("g", "f", [], 4), "h": ("h", "f", [], 4)}
    assert tree.subtree_keys(k("f")) == [k("f"), k("g"), k("h")]  # shallowest first
    assert tree.subtree_keys(k("a"))[:3] == [k("a"), k("b"), k("c")] and len(tree.subtree_keys(k("a"))) == 8
    assert tree.path(k("g")) == [k(x) for x in "abcfg"]
    assert sorted(tree.leaf_paths(k("f"))) == [[k(x) for x in "abcfg"], [k(x) for x in "abcfh"]]
    assert tree.leaf_paths(k("d")) == [[k(x) for x in "abcde"]]


def test_an_unbranched_chain_is_one_node_and_separate_trees_stay_apart():
    tree = PrefixTree(chain("abc") + chain("xy"))
    assert shape(tree) == {"a": ("abc", None, [], 0), "x": ("xy", None, [], 0)}


def test_a_run_whose_parent_is_cached_nowhere_is_detached():
    # b was evicted everywhere: c d cannot be reached until b is computed again
    tree = PrefixTree(chain("a") + chain("cd", parent="b", depth=2, root="a"))
    assert shape(tree) == {"a": ("a", None, [], 0), "c": ("cd", None, [], 2)}
    assert tree.nodes[k("c")].detached and not tree.nodes[k("a")].detached
    assert tree.path(k("c")) == [k("c"), k("d")]


def test_copies_in_several_tiers_are_one_block_and_the_fastest_tier_names_the_node():
    blocks = chain("ab", hits=3, last_use=10.0) + chain("bc", tier="disk", parent="a", depth=1, root="a") \
        + chain("b", tier="host", parent="a", depth=1, root="a")
    tree = PrefixTree(blocks)
    [node] = tree.nodes.values()
    assert node.keys == [k("a"), k("b"), k("c")]
    assert node.tiers == {"device": 2, "disk": 2, "host": 1} and node.tier == "device"
    assert (node.hits, node.last_use) == (3, 10.0)  # what the device tracks; lower tiers add nothing
    lower = PrefixTree(chain("ab", tier="remote") + chain("ab", tier="disk"))
    [node] = lower.nodes.values()
    assert node.tier == "disk" and node.hits is None and node.last_use is None


def test_pins_and_holders_are_counted_per_node():
    blocks = chain("ab", pinned=True) + chain("c", parent="b", depth=2, root="a", in_use=True) \
        + chain("d", parent="b", depth=2, root="a")
    tree = PrefixTree(blocks)
    a, c, d = (tree.nodes[k(x)] for x in "acd")
    assert (a.pinned_blocks, a.in_use_blocks, c.pinned_blocks, c.in_use_blocks, d.in_use_blocks) == (2, 0, 0, 1, 0)


def keys(letters: str) -> list[bytes]:
    return [k(x) for x in letters]


def test_a_prompt_s_eviction_takes_its_own_blocks_and_its_reply_and_leaves_the_system_prompt_it_shares():
    # a b c: a system prompt; d e: conversation A's prompt on from it, g: A's reply; f: conversation B
    blocks = chain("abc") + chain("de", parent="c", depth=3, root="a") + chain("g", parent="e", depth=5, root="a") \
        + chain("f", parent="c", depth=3, root="a")
    tree = PrefixTree(blocks)
    assert tree.prompt_subtree(keys("abcde")) == (keys("deg"), 3)
    assert tree.prompt_subtree(keys("abcf")) == (keys("f"), 3)
    # the system prompt alone: every conversation extends it, and goes with it (as its prefix id would)
    assert tree.prompt_subtree(keys("abc")) == (keys("abcdfeg"), 0)


def test_a_conversation_alone_in_the_cache_goes_whole():
    tree = PrefixTree(chain("abcde") + chain("gh", parent="e", depth=5, root="a"))
    assert tree.prompt_subtree(keys("abcde")) == (keys("abcdegh"), 0)
    # named by its first request (a b c), the later turns (d e, g h) extend it: they go too
    assert tree.prompt_subtree(keys("abc")) == (keys("abcdegh"), 0)


def test_a_prompt_cached_only_as_far_as_another_ran_on_leaves_everything():
    # the prompt is a b c d; only a b are cached, and x, another prompt's block, goes on from b
    tree = PrefixTree(chain("abx"))
    assert tree.prompt_subtree(keys("abcd")) == ([], 2)
    assert tree.prompt_subtree(keys("pqr")) == ([], 0)  # nothing of it cached


def test_a_prompt_s_detached_blocks_go_too_and_are_judged_as_the_attached_ones():
    # a b on the device, y another prompt's block on from a; d on disk, its parent c cached nowhere
    blocks = chain("ab") + chain("y", parent="a", depth=1, root="a") \
        + chain("d", parent="c", depth=3, root="a", tier="disk")
    tree = PrefixTree(blocks)
    assert tree.prompt_subtree(keys("abcd")) == (keys("bd"), 1)
