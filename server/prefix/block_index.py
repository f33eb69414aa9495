"""The slots' prefix index (issue 41): what each slot's KV holds, and each in-flight prompt,
kept as a path of full blocks in one trie, updated as the slot's tokens change.

A block is ``block_size`` consecutive prompt items (server.prefix.items: tokens, or an image
as one item); a trie node is one block under its parent, looked up by the block's items
(a tuple: exact, never a hash alone, so two holders share a node only when they share
every item before its end). A holder (a slot's KV, an in-flight prompt: any hashable id)
is its ``Chain``: its live items and the nodes of its full blocks, in order.

Costs: a change names how many leading items stayed (``changed(hid, items, n_keep)``): an
append costs the blocks it fills (one tuple and one dict lookup per full block, nothing in
between), a cut the blocks it removes, an assign the holder's blocks. A lookup
(``path``) walks the prompt's full blocks down the trie once; what a holder shares with
the prompt (``shared``) is then a bisection over its chain against that path plus one
item compare within the next block: independent of the number of holders and of
anything cached elsewhere.

Listeners (KV events: server/kv_events/kv_watch.py) are told of every change with the same
arguments, after the trie took it: the one record of what the slots hold. Appends that
fill no block (of the index's or a listener's size) need not be told at all: ``changed``
returns the length at which the next one must be.

Engine thread only (the slots' tokens change there, and the admission reads there).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

from .items import PromptItem

BLOCK_ITEMS = 64  # items per block: a lookup's remainder compare is at most this long


def _within(a: Sequence[PromptItem], b: Sequence[PromptItem]) -> int:
    """``common_prefix`` of two slices of at most a block: bisected over slice compares
    (a log of the block's length at C speed, where an item-by-item tail would loop)."""
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    if a[:n] == b[:n]:
        return n
    lo, hi = 1, n - 1  # a[:lo] == b[:lo] and a[:hi+1] != b[:hi+1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Node:
    __slots__ = ("parent", "items", "children", "refs")

    def __init__(self, parent: _Node | None, items: tuple[PromptItem, ...]) -> None:
        self.parent = parent
        self.items = items
        self.children: dict[tuple[PromptItem, ...], _Node] = {}
        self.refs = 0  # chains passing through this node


class Chain:
    """One holder: its items (the live sequence, read for the last partial block) and the
    trie nodes of its full blocks (``nodes[j]`` is block j)."""

    __slots__ = ("items", "nodes")

    def __init__(self) -> None:
        self.items: Sequence[PromptItem] = ()
        self.nodes: list[_Node] = []


class ChainListener(Protocol):
    """Told of each holder's changes (``BlockIndex.listeners``), as the index is; returns
    the length at which it must hear of an append next (appends below it may go untold:
    the next call's ``n_keep`` then covers them)."""

    def changed(self, hid: Hashable, items: Sequence[PromptItem], n_keep: int) -> int: ...


class Path:
    """A prompt's ``BlockIndex.path``, taken on first use and taken again whenever the trie
    changed since (a holder indexed or changed between two reads of one match)."""

    __slots__ = ("_index", "_prompt", "_gen", "_nodes")

    def __init__(self, index: BlockIndex, prompt: Sequence[PromptItem]) -> None:
        self._index = index
        self._prompt = prompt
        self._gen = -1
        self._nodes: list[_Node] = []

    def nodes(self) -> list[_Node]:
        ix = self._index
        if self._gen != ix.gen:
            self._nodes = ix.path(self._prompt)
            self._gen = ix.gen
        return self._nodes


class BlockIndex:
    """The trie (see the module's docstring)."""

    def __init__(self, block_size: int = BLOCK_ITEMS) -> None:
        if block_size <= 0:
            raise ValueError("the block size must be positive")
        self.bs = block_size
        self._root = _Node(None, ())
        self._chains: dict[Hashable, Chain] = {}
        self.listeners: list[ChainListener] = []
        # changes whenever the trie's nodes may have (a ``path`` taken before is stale)
        self.gen = 0

    def __len__(self) -> int:
        return len(self._chains)

    # ---- changes ------------------------------------------------------------------

    def changed(
        self, hid: Hashable, items: Sequence[PromptItem], n_keep: int, quiet: bool = False
    ) -> int:
        """Holder ``hid`` now holds ``items``, of which the first ``n_keep`` are the ones it
        held before (an append: its length before the appends since the last call; a cut
        to n: n; an assign: 0). Listeners are told unless ``quiet`` (an in-flight prompt:
        not in any KV). Returns the length at which an append must be told next (the end
        of the holder's next block, or sooner for a listener): appends that stay below it
        may go untold (a ``Sequence`` skips them: one compare per generated token)."""
        c = self._chains.get(hid)
        if c is None:
            c = self._chains[hid] = Chain()
        c.items = items
        bs, nodes = self.bs, c.nodes
        n_full = len(items) // bs
        if n_full != len(nodes) or n_keep < n_full * bs:  # else: within its last block
            keep = min(n_keep // bs, len(nodes), n_full)
            if keep < len(nodes):
                self._release(nodes, keep)
                self.gen += 1
            if n_full > len(nodes):
                self._grow(c, n_full)
                self.gen += 1
        tell_at = (n_full + 1) * bs
        if not quiet:
            for ls in self.listeners:
                tell_at = min(tell_at, ls.changed(hid, items, n_keep))
        return tell_at

    def drop(self, hid: Hashable) -> None:
        """Forget ``hid`` (its nodes no other holder passes through go)."""
        c = self._chains.pop(hid, None)
        if c is not None and c.nodes:
            self._release(c.nodes, 0)
            self.gen += 1

    def _grow(self, c: Chain, n_full: int) -> None:
        bs, items, nodes = self.bs, c.items, c.nodes
        node = nodes[-1] if nodes else self._root
        for j in range(len(nodes), n_full):
            blk = tuple(items[j * bs : (j + 1) * bs])
            nxt = node.children.get(blk)
            if nxt is None:
                nxt = node.children[blk] = _Node(node, blk)
            nxt.refs += 1
            nodes.append(nxt)
            node = nxt

    @staticmethod
    def _release(nodes: list[_Node], keep: int) -> None:
        """Drop ``nodes[keep:]`` (deepest first, so an emptied node has no children)."""
        for j in range(len(nodes) - 1, keep - 1, -1):
            node = nodes[j]
            node.refs -= 1
            if node.refs == 0:
                parent = node.parent
                assert parent is not None
                del parent.children[node.items]
        del nodes[keep:]

    # ---- lookups ------------------------------------------------------------------

    def path(self, prompt: Sequence[PromptItem]) -> list[_Node]:
        """The nodes of ``prompt``'s full blocks that some holder holds, from the first
        (stops at the first block no holder holds)."""
        bs, node, out = self.bs, self._root, []
        for j in range(len(prompt) // bs):
            nxt = node.children.get(tuple(prompt[j * bs : (j + 1) * bs]))
            if nxt is None:
                break
            out.append(nxt)
            node = nxt
        return out

    def shared(self, hid: Hashable, path: list[_Node], prompt: Sequence[PromptItem]) -> int:
        """How many leading items holder ``hid`` shares with ``prompt`` (``path``: its
        ``path``); 0 for an unknown holder."""
        c = self._chains.get(hid)
        if c is None:
            return 0
        nodes = c.nodes
        lo, hi = 0, min(len(nodes), len(path))
        if hi and nodes[hi - 1] is path[hi - 1]:
            lo = hi  # the usual case: one is a prefix of the other, block-wise
        while lo < hi:  # the most leading blocks in common: a prefix of both chains
            mid = (lo + hi + 1) // 2
            if nodes[mid - 1] is path[mid - 1]:
                lo = mid
            else:
                hi = mid - 1
        a, b = lo * self.bs, (lo + 1) * self.bs
        # past the common blocks they share less than a block (a whole one would be a node)
        return a + _within(c.items[a:b], prompt[a:b])

    def holds_items(self, hid: Hashable, items: Sequence[PromptItem]) -> bool:
        """``hid`` is indexed with ``items`` (the very sequence), or holds nothing and
        ``items`` is empty."""
        c = self._chains.get(hid)
        return c.items is items if c is not None else not items

    def n_nodes(self) -> int:
        """Blocks held by some holder (for tests)."""
        n, todo = 0, list(self._root.children.values())
        while todo:
            node = todo.pop()
            n += 1
            todo.extend(node.children.values())
        return n

    # ---- integrity ----------------------------------------------------------------

    def check_integrity(self) -> list[str]:
        """Every chain's nodes are its items' blocks, on one path from the root; every
        node's ``refs`` counts the chains through it; no node is held by none."""
        problems: list[str] = []
        refs: dict[int, int] = {}
        bs = self.bs
        for hid, c in self._chains.items():
            if len(c.nodes) != len(c.items) // bs:
                problems.append(f"{hid!r}: {len(c.nodes)} blocks for {len(c.items)} items")
            parent = self._root
            for j, node in enumerate(c.nodes):
                blk = tuple(c.items[j * bs : (j + 1) * bs])
                if node.items != blk or parent.children.get(blk) is not node:
                    problems.append(f"{hid!r}: block {j} is not its items' node")
                refs[id(node)] = refs.get(id(node), 0) + 1
                parent = node
        todo = list(self._root.children.values())
        while todo:
            node = todo.pop()
            if node.refs != refs.get(id(node), 0) or node.refs <= 0:
                problems.append(f"node {node.items[:3]}...: refs {node.refs}")
            todo.extend(node.children.values())
        return problems
