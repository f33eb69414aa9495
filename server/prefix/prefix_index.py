"""One prefix index over the cache tiers (issue 27): a radix tree of token sequences.

Each tier registers where a state lives as a typed holder (a subclass of ``Held``: a RAM
entry, a disk file, an entry queued for the disk writer) under the tokens it holds; a
lookup walks the prompt down the tree once and returns a ``Match`` from which each tier's
rule picks its entry (``Match.best``: ARCHITECTURE §7's rule, written once). Its cost grows with
the prompt's length over the edges' lengths and with the number of records (below) on the
prompt's path, not with the number of entries.

Keys. One tree per key: today the tenant (tiers/tenancy.py; another tenant's entries match
nothing), and any hashable value works, so an adapter set can join it later as
``(tenant, adapters)``.

Tree invariants (``check_integrity`` checks them all):
- every node but a root has a non-empty edge, and its parent's ``children`` holds it under
  the edge's first token; ``depth`` is the parent's depth plus the edge's length;
- a holder sits on the node whose path is exactly its tokens (its length is that depth);
- no node but a root is empty (no holder, no child), and none but a root has no holder and
  a single child (such edges are merged): removal leaves no dead nodes;
- per tier, every node keeps the holders of its whole subtree sorted by their tier's order
  (``Held.order``: insertion for RAM, (mtime, name) for disk files, queue order after all
  files) and the *records* among them: the holders shorter than every earlier one.

Why records. The rule takes, in order, every entry that improves both f_keep = m / len and
f_sim = m / len(prompt) over the best so far (m: what it shares with the prompt). An entry
e is never taken when an earlier entry f shares at least as much (m_f >= m_e) and is no
longer (len_f <= len_e): f is either taken first, and then e's f_sim cannot beat it, or it
is refused by a best that refuses e too. The entries sharing at least m_e tokens are one
subtree of the prompt's path, so only that subtree's records can be taken; running the rule
in order over the records on the path gives exactly the linear scan's choice. Records are
few for lengths in no particular order (about the logarithm of the entries); at worst, when
every entry is shorter than all before it, all of them are, and the rule is then a pass
over them with no LCP computed.

Threading: one lock guards the tree; every public method takes it, none calls out while
holding it. A ``Match`` is a snapshot: it stays valid after the lock is released (the disk
tier's scanner and writer threads change the tree while the engine thread looks things up).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol

from .items import PromptItem, common_prefix


def shared_prefix(
    key: Hashable,
    tokens: Sequence[PromptItem],
    prompt_key: Hashable,
    prompt: Sequence[PromptItem],
) -> int:
    """What ``tokens`` held under ``key`` share of ``prompt`` asked under ``prompt_key``:
    their common items within one key, nothing across keys. The index's matching rule,
    for the holders it does not index: the slots and in-flight prefills, which the locator
    scans (server.kv.locator)."""
    return common_prefix(tokens, prompt) if key == prompt_key else 0


@dataclass(eq=False)
class Held:
    """Where one state lives. Subclasses name the tier (``TIER``) and carry the state's
    owner; ``key`` is the tree it lives in (the tenant), ``order`` its place in its tier's
    order (comparable within a tier, and across tiers that one rule scans together).
    Compared by identity."""

    TIER: ClassVar[str] = ""
    key: Hashable
    order: tuple


@dataclass(frozen=True)
class Hit:
    """A rule's choice: the holder and how many prompt tokens it holds (its LCP)."""

    held: Any  # the subclass of Held the tier registered
    n_lcp: int
    n_tokens: int  # the holder's length

    @property
    def f_keep(self) -> float:
        return self.n_lcp / self.n_tokens


class _Agg:
    """One tier's holders in a node's subtree: sorted by order, and the records among them
    (each shorter than every earlier holder; so their lengths strictly decrease). Records
    are tuples, replaced whole when they change (rarely: a new shortest holder, or a record
    leaving), so a Match takes them without copying."""

    __slots__ = ("keys", "items", "rec_keys", "rec")

    def __init__(self) -> None:
        self.keys: list[tuple] = []
        self.items: list[tuple[Held, int]] = []  # (holder, length), parallel to keys
        self.rec_keys: tuple[tuple, ...] = ()
        self.rec: tuple[tuple[Held, int], ...] = ()

    def copy(self) -> _Agg:
        a = _Agg()
        a.keys, a.items = list(self.keys), list(self.items)
        a.rec_keys, a.rec = self.rec_keys, self.rec
        return a

    def add(self, h: Held, n: int) -> None:
        i = bisect.bisect_left(self.keys, h.order)
        self.keys.insert(i, h.order)
        self.items.insert(i, (h, n))
        r = bisect.bisect_left(self.rec_keys, h.order)
        if r > 0 and self.rec[r - 1][1] <= n:
            return  # an earlier holder is no longer: not a record
        end = r
        while end < len(self.rec) and self.rec[end][1] >= n:
            end += 1  # later records no shorter than h are records no more
        self.rec_keys = (*self.rec_keys[:r], h.order, *self.rec_keys[end:])
        self.rec = (*self.rec[:r], (h, n), *self.rec[end:])

    def remove(self, h: Held) -> None:
        i = bisect.bisect_left(self.keys, h.order)
        while self.items[i][0] is not h:
            i += 1
        del self.keys[i], self.items[i]
        r = bisect.bisect_left(self.rec_keys, h.order)
        if r >= len(self.rec) or self.rec[r][0] is not h:
            return
        # holders between h and the next record may be records now
        bound = self.rec[r - 1][1] if r > 0 else None
        stop = self.rec_keys[r + 1] if r + 1 < len(self.rec) else None
        fresh: list[tuple[Held, int]] = []
        for j in range(i, len(self.items)):
            item = self.items[j]
            if stop is not None and item[0].order >= stop:
                break
            if bound is None or item[1] < bound:
                fresh.append(item)
                bound = item[1]
        self.rec_keys = (*self.rec_keys[:r], *(x[0].order for x in fresh), *self.rec_keys[r + 1 :])
        self.rec = (*self.rec[:r], *fresh, *self.rec[r + 1 :])


class _Node:
    __slots__ = ("edge", "depth", "parent", "children", "held", "aggs")

    def __init__(self, edge: list[PromptItem], depth: int, parent: _Node | None) -> None:
        self.edge = edge
        self.depth = depth
        self.parent = parent
        self.children: dict[PromptItem, _Node] = {}
        self.held: list[Held] = []
        self.aggs: dict[str, _Agg] = {}


class SlotBaseline(NamedTuple):
    """The state of the slot being loaded into, which a tier's entry must beat (ARCHITECTURE
    §7): how many items of the prompt it holds (``n_shared``; 0 when it holds another
    tenant's tokens: the locator's ``Match.held``) and how many it holds in all."""

    n_shared: int = 0
    n_tokens: int = 0

    @property
    def f_keep(self) -> float:
        return self.n_shared / self.n_tokens if self.n_tokens else -1.0


# One tier's records of one subtree, snapshot: their orders, and (holder, length) pairs
Records = tuple[tuple[tuple, ...], tuple[tuple[Held, int], ...]]


@dataclass
class Match:
    """A prompt walked down one key's tree: for each point of its path that tokens hang
    off, how many prompt tokens the holders below it share at least (``m``: exactly, for
    those not below the next point) and each tier's records of that subtree. A snapshot:
    the tree may change after it was taken."""

    index: PrefixIndex
    n_prompt: int
    points: list[tuple[int, dict[str, Records]]]

    def beating(self, tiers: Iterable[str], slot: SlotBaseline) -> Hit | None:
        """``best`` starting from the slot's own state."""
        if self.n_prompt == 0:
            return None
        return self.best(tiers, slot.f_keep, slot.n_shared / self.n_prompt)

    def best(self, tiers: Iterable[str], best_keep: float, best_sim: float) -> Hit | None:
        """ARCHITECTURE §7's load rule over ``tiers`` (scanned together, in their holders'
        order): in order, take every holder that beats the best so far on both f_keep and
        f_sim, starting from the slot's own (``best_keep``, ``best_sim``); never one
        sharing less than a quarter of itself with the prompt ("don't trash large
        prompts"). The last one taken, or None.

        Each step finds the next holder taken: in every records list (m fixed, lengths
        decreasing, so f_keep increasing along it) the first after the last taken that
        passes, by two bisections; the earliest of those is next. A holder also sits in
        the records of the points above its own, with a smaller m there; at the same place
        its own (larger) m goes first, and whenever the smaller passes the larger does, so
        those copies never change the choice. Steps: at most one per distinct m."""
        n_prompt = self.n_prompt
        if n_prompt == 0:
            return None
        lists = [(m, per[t]) for m, per in self.points if m > 0 for t in tiers if t in per]
        best: Hit | None = None
        pos: tuple | None = None
        while True:
            pick: tuple[tuple, int, int, Held, int] | None = None  # (order, -m, m, h, n)
            for m, (keys, recs) in lists:
                if not m / n_prompt > best_sim:
                    continue
                j = _first_taken(recs, m, best_keep)
                if pos is not None:
                    j = max(j, bisect.bisect_right(keys, pos))
                if j < len(recs) and (pick is None or (keys[j], -m) < pick[:2]):
                    pick = (keys[j], -m, m, *recs[j])
            if pick is None:
                return best
            pos, _, m, h, n = pick
            best_keep, best_sim = m / n, m / n_prompt
            best = Hit(h, m, n)


def _first_taken(recs: Sequence[tuple[Held, int]], m: int, best_keep: float) -> int:
    """The first index in ``recs`` (lengths strictly decreasing) whose f_keep = m / length
    is at least a quarter and beats ``best_keep``; len(recs) when none (bisection: the
    test is false, then true, along the list)."""
    lo, hi = 0, len(recs)
    while lo < hi:
        mid = (lo + hi) // 2
        f_keep = m / recs[mid][1]
        if f_keep >= 0.25 and f_keep > best_keep:
            hi = mid
        else:
            lo = mid + 1
    return lo


class IndexListener(Protocol):
    """Told of the holders that come and go (``PrefixIndex.listener``)."""

    def added(self, h: Held, tokens: Sequence[PromptItem]) -> None: ...

    def discarded(self, h: Held) -> None: ...


class PrefixIndex:
    """The radix tree (see the module's docstring). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._roots: dict[Hashable, _Node] = {}
        self._where: dict[int, tuple[Held, _Node]] = {}  # id(holder) -> its node
        # Told of every holder added (with its tokens) and discarded, after the tree changed
        # and outside its lock, on the thread that changed it (KV events: kv_events/kv_events.py)
        self.listener: IndexListener | None = None

    def __len__(self) -> int:
        return len(self._where)

    # ---- changes ------------------------------------------------------------------

    def add(self, h: Held, tokens: Sequence[PromptItem]) -> None:
        """Register ``h`` as holding ``tokens`` (at least one); a holder is added once."""
        if not tokens:
            raise ValueError("a holder holds at least one token")
        with self._lock:
            if id(h) in self._where:
                raise ValueError("holder already indexed")
            root = self._roots.get(h.key)
            if root is None:
                root = self._roots[h.key] = _Node([], 0, None)
            node = self._descend(root, tokens)
            node.held.append(h)
            self._where[id(h)] = (h, node)
            n = len(tokens)
            x: _Node | None = node
            while x is not None:
                agg = x.aggs.get(h.TIER)
                if agg is None:
                    agg = x.aggs[h.TIER] = _Agg()
                agg.add(h, n)
                x = x.parent
        if self.listener is not None:
            self.listener.added(h, tokens)

    def _descend(self, root: _Node, tokens: Sequence[PromptItem]) -> _Node:
        """The node whose path is ``tokens``, made (splitting an edge) if need be."""
        node, d = root, 0
        while d < len(tokens):
            c = node.children.get(tokens[d])
            if c is None:
                leaf = _Node(list(tokens[d:]), len(tokens), node)
                node.children[tokens[d]] = leaf
                return leaf
            k = common_prefix(c.edge, tokens[d : d + len(c.edge)])
            if k < len(c.edge):
                c = self._split(c, k)
            node, d = c, d + k
        return node

    @staticmethod
    def _split(c: _Node, k: int) -> _Node:
        """Cut ``c``'s edge after ``k`` tokens; returns the new node in between."""
        parent = c.parent
        assert parent is not None
        mid = _Node(c.edge[:k], parent.depth + k, parent)
        mid.aggs = {t: a.copy() for t, a in c.aggs.items()}  # the same subtree
        parent.children[c.edge[0]] = mid
        c.edge = c.edge[k:]
        c.parent = mid
        mid.children[c.edge[0]] = c
        return mid

    def discard(self, h: Held) -> bool:
        """Forget ``h``; False when it was not indexed. Nodes left empty are removed and
        edges left without a branch merged."""
        with self._lock:
            got = self._where.pop(id(h), None)
            if got is None:
                return False
            node = got[1]
            node.held.remove(h)
            x: _Node | None = node
            while x is not None:
                agg = x.aggs[h.TIER]
                agg.remove(h)
                if not agg.keys:
                    del x.aggs[h.TIER]
                x = x.parent
            self._prune(node, h.key)
        if self.listener is not None:
            self.listener.discarded(h)
        return True

    def _prune(self, node: _Node, key: Hashable) -> None:
        while node.parent is not None and not node.held and not node.children:
            parent = node.parent
            del parent.children[node.edge[0]]
            node = parent
        if node.parent is None:
            if not node.children and not node.held:
                del self._roots[key]
            return
        if not node.held and len(node.children) == 1:
            self._merge(node)

    @staticmethod
    def _merge(node: _Node) -> None:
        """``node`` holds nothing and has one child: the child takes its edge."""
        (child,) = node.children.values()
        parent = node.parent
        assert parent is not None
        child.edge = node.edge + child.edge
        child.parent = parent
        parent.children[child.edge[0]] = child

    # ---- lookups ------------------------------------------------------------------

    def match(self, key: Hashable, prompt: Sequence[PromptItem]) -> Match:
        """Walk ``prompt`` down ``key``'s tree once (see ``Match``)."""
        points: list[tuple[int, dict[str, Records]]] = []
        with self._lock:
            node = self._roots.get(key)
            d = 0
            while node is not None:
                points.append((d, _records(node)))
                if d >= len(prompt):
                    break
                c = node.children.get(prompt[d])
                if c is None:
                    break
                k = common_prefix(c.edge, prompt[d : d + len(c.edge)])
                if k < len(c.edge):  # the prompt leaves (or ends) inside c's edge
                    points.append((d + k, _records(c)))
                    break
                node, d = c, d + k
        return Match(self, len(prompt), points)

    def _walk(
        self, key: Hashable, tokens: Sequence[PromptItem]
    ) -> tuple[list[_Node], _Node | None]:
        """The nodes ``tokens`` pass through whole, and the subtree of the holders that
        start with ``tokens`` (None when no holder does). Under the lock."""
        node = self._roots.get(key)
        passed: list[_Node] = []
        d = 0
        while node is not None:
            passed.append(node)
            if d >= len(tokens):
                return passed, node
            c = node.children.get(tokens[d])
            if c is None:
                return passed, None
            k = common_prefix(c.edge, tokens[d : d + len(c.edge)])
            if d + k == len(tokens):
                return passed + ([c] if k == len(c.edge) else []), c
            if k < len(c.edge):
                return passed, None
            node, d = c, d + k
        return passed, None

    def covers(self, tier: str, key: Hashable, tokens: Sequence[PromptItem]) -> bool:
        """Some holder of ``tier`` under ``key`` holds ``tokens`` or more that start with
        them."""
        with self._lock:
            _, sub = self._walk(key, tokens)
            return sub is not None and tier in sub.aggs

    def prefixes_of(self, tier: str, key: Hashable, tokens: Sequence[PromptItem]) -> list[Any]:
        """Holders of ``tier`` under ``key`` whose tokens ``tokens`` start with (``tokens``
        themselves included), in their tier's order."""
        with self._lock:
            passed, _ = self._walk(key, tokens)
            out = [h for x in passed for h in x.held if tier == h.TIER]
        return sorted(out, key=lambda h: h.order)

    def below(self, h: Held) -> list[Any]:
        """The other holders of ``h``'s tier whose tokens start with ``h``'s (its node's
        subtree, ``h`` left out), in order; [] when ``h`` is not indexed."""
        with self._lock:
            got = self._where.get(id(h))
            agg = None if got is None else got[1].aggs.get(h.TIER)
            return [] if agg is None else [x for x, _ in agg.items if x is not h]

    def count(self, tier: str) -> int:
        """Holders of ``tier`` under every key."""
        with self._lock:
            return sum(len(r.aggs[tier].keys) for r in self._roots.values() if tier in r.aggs)

    def holders(self, tier: str) -> list[Any]:
        """Every holder of ``tier``, per key in order (for integrity checks and tests)."""
        with self._lock:
            return [
                h for r in self._roots.values() if tier in r.aggs for h, _ in r.aggs[tier].items
            ]

    def path_of(self, h: Held) -> list[PromptItem] | None:
        """The tokens ``h`` is registered under (None when it is not): for integrity
        checks, which compare them with their entries' tokens."""
        with self._lock:
            got = self._where.get(id(h))
            if got is None:
                return None
            parts: list[list[PromptItem]] = []
            x: _Node | None = got[1]
            while x is not None:
                parts.append(x.edge)
                x = x.parent
        return [t for e in reversed(parts) for t in e]

    def edges(self, key: Hashable) -> list[tuple[int, list[PromptItem], int]]:
        """``key``'s tree, depth first in token order: (depth, edge, holders here) per
        node below the root (for tests and debugging)."""
        out: list[tuple[int, list[PromptItem], int]] = []
        with self._lock:
            root = self._roots.get(key)
            todo = [] if root is None else [root]
            while todo:
                node = todo.pop()
                if node.parent is not None:
                    out.append((node.depth, list(node.edge), len(node.held)))
                todo.extend(
                    node.children[t] for t in sorted(node.children, key=_item_order, reverse=True)
                )
        return out

    # ---- integrity ----------------------------------------------------------------

    def check_integrity(self) -> list[str]:
        """Checks every invariant of the module's docstring; returns the problems."""
        problems: list[str] = []
        with self._lock:
            seen = 0
            for key, root in self._roots.items():
                if not root.children and not root.held:
                    problems.append(f"key {key!r}: empty root kept")
                todo = [root]  # iterative: a path may pass thousands of branches
                while todo:
                    node = todo.pop()
                    seen += _check_node(node, problems, self._where)
                    todo.extend(node.children.values())
            if seen != len(self._where):
                problems.append(f"{len(self._where)} holders registered, {seen} in the tree")
        return problems


def _item_order(x: PromptItem) -> tuple[int, int, str]:
    """Tokens in their order, then images (by identity): for listings only."""
    return (0, x, "") if isinstance(x, int) else (1, 0, repr(x.identity))


def _records(node: _Node) -> dict[str, Records]:
    """A snapshot of ``node``'s records, per tier (immutable: the tree may change under a
    Match, never these tuples)."""
    return {t: (a.rec_keys, a.rec) for t, a in node.aggs.items()}


def _check_node(node: _Node, problems: list[str], where: dict[int, tuple[Held, _Node]]) -> int:
    """Check ``node`` against its parent and children (its per-tier lists against its own
    holders and its children's lists: by induction, its whole subtree's); returns how many
    holders sit on it."""
    here = f"node at depth {node.depth}"
    if node.parent is not None:
        if not node.edge:
            problems.append(f"{here}: empty edge")
        elif node.parent.children.get(node.edge[0]) is not node:
            problems.append(f"{here}: not its parent's child under its first token")
        if node.depth != node.parent.depth + len(node.edge):
            problems.append(f"{here}: depth != parent's + edge")
        if not node.held and not node.children:
            problems.append(f"{here}: empty node kept")
        if not node.held and len(node.children) == 1:
            problems.append(f"{here}: unmerged edge (no holder, one child)")
    subtree: dict[str, list[tuple[Held, int]]] = {}
    for h in node.held:
        if where.get(id(h), (None, None))[1] is not node:
            problems.append(f"{here}: holder not registered here")
        subtree.setdefault(h.TIER, []).append((h, node.depth))
    for first, c in node.children.items():
        if c.parent is not node or (c.edge and c.edge[0] != first):
            problems.append(f"{here}: child {first} misfiled")
        for t, a in c.aggs.items():
            subtree.setdefault(t, []).extend(a.items)
    _check_aggs(node, subtree, problems)
    return len(node.held)


def _check_aggs(
    node: _Node, subtree: dict[str, list[tuple[Held, int]]], problems: list[str]
) -> None:
    here = f"node at depth {node.depth}"
    if set(subtree) != set(node.aggs):
        problems.append(f"{here}: tiers {sorted(node.aggs)} != subtree's {sorted(subtree)}")
    for t, items in subtree.items():
        a = node.aggs.get(t)
        if a is None:
            continue
        want = sorted(items, key=lambda x: x[0].order)
        if [id(h) for h, _ in want] != [id(h) for h, _ in a.items] or a.keys != [
            h.order for h, _ in want
        ]:
            problems.append(f"{here}: tier {t}: holders out of order or not the subtree's")
        rec, bound = [], None
        for h, n in want:
            if bound is None or n < bound:
                rec.append(h)
                bound = n
        if [id(h) for h in rec] != [id(h) for h, _ in a.rec] or list(a.rec_keys) != [
            h.order for h in rec
        ]:
            problems.append(f"{here}: tier {t}: records are not the subtree's")
