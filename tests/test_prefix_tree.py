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
