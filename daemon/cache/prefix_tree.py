"""The cached prefixes as an operator sees them: the nodes of a compressed prefix tree.

Blocks are chained (each key hashes its parent's), so the cached blocks of one namespace form
a tree. Many prompts share their first block (a chat template, a common system prompt), so
grouping by first block would show one "prefix" per tenant. Instead, as a radix tree does, a
node is a run of blocks without a branch: a node starts at a tree's first block, after a block
with two or more cached children, or at a block whose parent is cached nowhere (a detached run:
no request can reach it until its parent is computed again); it ends at a block with no child or
with several. A node's id is its first block's key, so it names that block and everything that
extends it: evicting a node takes its subtree and leaves the prefix it branches from to its
siblings.

Pure bookkeeping over plain data: the callers gather what each tier holds (`CachedBlock`),
under their own locks, and this module only groups it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

TIER_ORDER = ("device", "moving", "host", "disk", "remote")  # fastest first


@dataclass(slots=True)
class CachedBlock:
    """One cached copy of a block: where it is and what is known of it there. A snapshot, which
    nothing changes once made (not frozen: a frozen dataclass takes six times as long to make, and
    a listing makes one a cached block)."""

    key: bytes
    parent: bytes | None  # the previous block's key; None for a chain's first block
    root: bytes  # the chain's first block's key (names the tree)
    depth: int  # 0 for the first block
    tier: str  # one of TIER_ORDER
    tenant: str | None = None  # whose namespace it was hashed under; None where not known
    hits: int | None = None  # admissions that reused it; None where not tracked (lower tiers)
    last_use: float | None = None  # clock reading of its latest use; None where not tracked
    pinned: bool = False
    in_use: bool = False
    own: bool = False  # a running request's own (explicit prompt cache mode: BlockPool's Block.own)


@dataclass(slots=True)
class PrefixNode:
    """A run of cached blocks between branch points (see the module docstring)."""

    key: bytes  # its first block's key: the node's id
    root: bytes
    parent: bytes | None  # id of the node it branches from; None for a tree's first node or a detached one
    start_depth: int  # depth of its first block: it covers tokens from start_depth * block_size
    tenant: str | None = None
    keys: list[bytes] = field(default_factory=list)  # its blocks, first to last
    tiers: dict[str, int] = field(default_factory=dict)  # blocks per tier (a block may be in two)
    hits: int | None = None
    last_use: float | None = None
    pinned_blocks: int = 0
    in_use_blocks: int = 0
    private_blocks: int = 0  # blocks a running request hashed as its own (CachedBlock.own)
    children: list[bytes] = field(default_factory=list)  # ids of the nodes that branch from its end

    @property
    def end_depth(self) -> int:
        return self.start_depth + len(self.keys) - 1

    @property
    def detached(self) -> bool:
        """Its first block's parent is cached nowhere, so no request reaches it."""
        return self.start_depth > 0 and self.parent is None

    @property
    def tier(self) -> str:
        """The fastest tier holding any of its blocks."""
        return min(self.tiers, key=TIER_ORDER.index)


class PrefixTree:
    """The nodes of the cached blocks given, by id, with their links."""

    def __init__(self, blocks: Iterable[CachedBlock]) -> None:
        by_key: dict[bytes, CachedBlock] = {}
        copies: dict[bytes, list[CachedBlock]] = {}  # a block's further copies (in other tiers)
        for block in blocks:
            if block.key in by_key:
                copies.setdefault(block.key, []).append(block)
            else:
                by_key[block.key] = block
        children: dict[bytes, list[bytes]] = {}
        for key, block in by_key.items():
            if block.parent is not None and block.parent in by_key:
                children.setdefault(block.parent, []).append(key)
        self.nodes: dict[bytes, PrefixNode] = {}
        self.node_of: dict[bytes, bytes] = {}  # block key -> id of the node holding it
        self.depth_of: dict[bytes, int] = {}  # block key -> its depth (0: a chain's first block)
        self.own: set[bytes] = set()  # keys of the blocks a running request hashed as its own (CachedBlock.own)
        node_of, depth_of = self.node_of, self.depth_of
        for start, first in by_key.items():
            parent = first.parent
            if parent is not None and parent in by_key and len(children[parent]) == 1:
                continue  # inside a run: its node starts further up
            node = PrefixNode(key=start, root=first.root, parent=None, start_depth=first.depth,
                              tenant=first.tenant)
            keys, tiers = node.keys, node.tiers
            hits = last_use = None
            pinned = in_use = private = 0
            key = start
            while True:
                block = by_key[key]
                pinned_here = in_use_here = own_here = False
                keys.append(key)
                node_of[key] = start
                depth_of[key] = block.depth
                held = [block, *copies[key]] if key in copies else (block,)
                for tier in {c.tier for c in held} if len(held) > 1 else (block.tier,):
                    tiers[tier] = tiers.get(tier, 0) + 1
                for c in held:
                    if c.hits is not None:
                        hits = c.hits if hits is None or c.hits > hits else hits
                    if c.last_use is not None:
                        last_use = c.last_use if last_use is None or c.last_use > last_use else last_use
                    if c.tenant and not node.tenant:
                        node.tenant = c.tenant
                    pinned_here = pinned_here or c.pinned
                    in_use_here = in_use_here or c.in_use
                    own_here = own_here or c.own
                pinned += pinned_here
                in_use += in_use_here
                if own_here:
                    private += 1
                    self.own.add(key)
                below = children.get(key)
                if below is None or len(below) != 1:
                    break
                key = below[0]
            node.hits, node.last_use, node.pinned_blocks, node.in_use_blocks = hits, last_use, pinned, in_use
            node.private_blocks = private
            self.nodes[start] = node
        for node in self.nodes.values():
            parent = by_key[node.key].parent
            if parent is not None and parent in by_key:
                node.parent = node_of[parent]
                self.nodes[node.parent].children.append(node.key)

    def subtree(self, node_id: bytes) -> list[PrefixNode]:
        """The node and every node that extends it, parents before children."""
        out, todo = [], [node_id]
        while todo:
            node = self.nodes[todo.pop()]
            out.append(node)
            todo.extend(reversed(node.children))
        return out

    def subtree_keys(self, key: bytes) -> list[bytes]:
        """The block `key` (a node's id, or any block in a node) and every block that extends it,
        shallowest first (evict in reverse: deepest first). A node's id stays usable after the
        tree changes around it: a node whose sibling went merges into its parent, and its first
        block is then in the middle of that node."""
        node = self.nodes[self.node_of[key]]
        start = node.keys.index(key)
        keys = [(node.start_depth + i, k) for i, k in enumerate(node.keys) if i >= start]
        keys += [(below.start_depth + i, k) for below in self.subtree(node.key)[1:] for i, k in enumerate(below.keys)]
        return [k for _, k in sorted(keys, key=lambda pair: pair[0])]

    def prompt_subtree(self, chain: Sequence[bytes]) -> tuple[list[bytes], int]:
        """What evicting a prompt takes, given its blocks' keys (`chain`, first to last): its cached
        blocks from the last one another cached prefix extends onwards, and every block that
        extends the prompt (a reply, the turns after it), shallowest first. A block of the prompt
        that another prefix extends stays, and so does every block before it: they are shared (a
        system prompt, the template's opening). Returns (those keys, how many of the prompt's cached
        blocks stay as shared).

        Blocks are judged by what is cached: a prompt whose deepest cached block another prefix
        extends (a prompt that runs on where another one, not cached further, ran on) leaves
        nothing to take."""
        cached = [i for i, key in enumerate(chain) if key in self.node_of]
        own_from = 0
        for i in cached:
            if i + 1 < len(chain) and any(child != chain[i + 1] for child in self._children(chain[i])):
                own_from = i + 1  # another prefix goes on from here: this block, and those before, are shared
        taken: dict[bytes, None] = {}
        for i in cached:
            if i >= own_from and chain[i] not in taken:
                taken.update(dict.fromkeys(self.subtree_keys(chain[i])))
        return sorted(taken, key=self.depth_of.__getitem__), sum(1 for i in cached if i < own_from)

    def _children(self, key: bytes) -> list[bytes]:
        """The cached blocks whose parent is the block `key`."""
        node = self.nodes[self.node_of[key]]
        at = self.depth_of[key] - node.start_depth
        return [node.keys[at + 1]] if at + 1 < len(node.keys) else list(node.children)

    def path(self, key: bytes) -> list[bytes]:
        """Block keys from the tree's first block (or a detached node's) to the end of the node
        holding `key`."""
        chain: list[bytes] = []
        node: PrefixNode | None = self.nodes[self.node_of[key]]
        while node is not None:
            chain[:0] = node.keys
            node = self.nodes[node.parent] if node.parent is not None else None
        return chain

    def leaf_paths(self, key: bytes) -> list[list[bytes]]:
        """One chain of keys per leaf that extends the block `key`, each from its tree's first
        block: what a request needs to reach that leaf."""
        return [self.path(node.key) for node in self.subtree(self.node_of[key]) if not node.children]
