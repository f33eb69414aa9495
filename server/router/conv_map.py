"""Which model holds each named stream (``X-Conversation-Id``), as the router knows it.

Contracts:

- A named request is *pending* (``ConvMap.begin``) from the moment its model is known (an
  unknown model is a 400 before anything is recorded) until its instance answers
  (``settle``). Only an answer that opened the stream (``accepted``) is remembered; a
  refusal (400, 429, 5xx) leaves what was remembered before as it was.
- Remembered ids are kept per owner (API key digest, ``""`` without keys), each owner's
  bounded by ``per_owner`` (least recently accepted first out): one key's requests never
  evict another key's ids. Owners are the configured keys (and ``""``): a fixed set.
- ``variants`` answers from a sorted index (a binary search per named id, then only the
  matching ids), never a scan of every entry: a lookup costs ``O(ids * log n + matches)``.
- A stop (``forget``) drops the remembered id and marks its pending requests stopped: one
  still waiting for its model ends (``wanted`` turns False), and one its instance accepts
  afterwards is stopped there too (``settle`` says so).

Everything here runs on the router's event loop: no locks."""

from __future__ import annotations

import bisect
import collections
from dataclasses import dataclass

# Ids remembered per API key: an instance keeps at most --streams-per-key (16) of a key's
# streams, so this covers dozens of instances; one key's flood evicts only its own.
MAP_MAX = 1024
SEP = "::"  # llama-server's web UI names a stream per model: "<id>::<model>"


@dataclass(eq=False)
class Pending:
    """A named request on its way to its instance (``ConvMap.begin``)."""

    owner: str
    conv_id: str
    model: str
    ticket: int  # increasing: a later request of the same id has a larger one
    stopped: bool = False  # a stop came while it was on its way


class OwnerIds:
    """One owner's remembered ids: least recently accepted first, and sorted for prefix
    searches (both hold the same ids)."""

    def __init__(self) -> None:
        self.recent: collections.OrderedDict[str, tuple[str, int]] = collections.OrderedDict()
        self.ordered: list[str] = []

    def put(self, conv_id: str, model: str, ticket: int) -> None:
        if conv_id in self.recent:
            self.recent.move_to_end(conv_id)
        else:
            bisect.insort(self.ordered, conv_id)
        self.recent[conv_id] = (model, ticket)

    def pop(self, conv_id: str) -> None:
        if self.recent.pop(conv_id, None) is not None:
            del self.ordered[bisect.bisect_left(self.ordered, conv_id)]

    def pop_oldest(self) -> str:
        conv_id = next(iter(self.recent))
        self.pop(conv_id)
        return conv_id

    def named(self, rid: str) -> list[str]:
        """``rid`` itself and every ``rid::...``, from the sorted ids."""
        out: list[str] = []
        i = bisect.bisect_left(self.ordered, rid)
        if i < len(self.ordered) and self.ordered[i] == rid:
            out.append(rid)
        prefix = rid + SEP
        j = bisect.bisect_left(self.ordered, prefix, lo=i)
        while j < len(self.ordered) and self.ordered[j].startswith(prefix):
            out.append(self.ordered[j])
            j += 1
        return out


def covering(rids: list[str]) -> list[str]:
    """The distinct ``rids`` that no other of them covers (``a`` covers ``a::b``: each id
    ``a::b`` names is one ``a`` names too), so that no remembered id is visited twice."""
    wanted = set(rids)
    out = []
    for rid in dict.fromkeys(rids):
        cut = rid.find(SEP)
        while cut != -1 and rid[:cut] not in wanted:
            cut = rid.find(SEP, cut + 1)
        if cut == -1:
            out.append(rid)
    return out


class ConvMap:
    """(owner, conversation id) -> the model whose instance holds the stream (see the
    module doc for the rules)."""

    def __init__(self, per_owner: int = MAP_MAX) -> None:
        self.per_owner = per_owner
        self.owners: dict[str, OwnerIds] = {}
        self.pending: dict[tuple[str, str], list[Pending]] = {}
        self.tickets = 0

    def begin(self, owner: str, conv_id: str, model: str) -> Pending:
        """A named request for ``model`` (known to the router) is on its way."""
        self.tickets += 1
        p = Pending(owner, conv_id, model, self.tickets)
        self.pending.setdefault((owner, conv_id), []).append(p)
        return p

    def wanted(self, p: Pending) -> bool:
        """Whether ``p`` is still its id's latest request and no stop came since."""
        mine = self.pending.get((p.owner, p.conv_id), [])
        return not p.stopped and bool(mine) and mine[-1] is p

    def settle(self, p: Pending, accepted: bool) -> bool:
        """``p``'s instance answered: remember it when it ``accepted`` the stream (and no
        later request of the id was accepted first). True when the instance accepted a
        stream that a stop meant to end (the caller stops it there): no other request of
        the id is on its way or remembered."""
        key = (p.owner, p.conv_id)
        mine = self.pending.get(key, [])
        if p in mine:
            mine.remove(p)
        if not mine:
            self.pending.pop(key, None)
        if not accepted:
            return False
        ids = self.owners.get(p.owner)
        if p.stopped:
            return not mine and (ids is None or p.conv_id not in ids.recent)
        self._remember(p)
        return False

    def _remember(self, p: Pending) -> None:
        ids = self.owners.setdefault(p.owner, OwnerIds())
        held = ids.recent.get(p.conv_id)
        if held is not None and held[1] > p.ticket:
            return  # a later request of the id was accepted already
        ids.put(p.conv_id, p.model, p.ticket)
        while len(ids.recent) > self.per_owner:
            ids.pop_oldest()

    def get(self, owner: str, conv_id: str) -> str | None:
        """The model of the id's latest request on its way, else of the remembered one."""
        for p in reversed(self.pending.get((owner, conv_id), [])):
            if not p.stopped:
                return p.model
        return self.get_remembered(owner, conv_id)

    def models(self, owner: str, conv_id: str) -> set[str]:
        """Every model that may hold the id's stream: its requests' on their way (not
        stopped) and the remembered one."""
        out = {p.model for p in self.pending.get((owner, conv_id), []) if not p.stopped}
        held = self.get_remembered(owner, conv_id)
        return out | {held} if held else out

    def get_remembered(self, owner: str, conv_id: str) -> str | None:
        ids = self.owners.get(owner)
        held = ids.recent.get(conv_id) if ids is not None else None
        return held[0] if held else None

    def forget(self, owner: str, conv_id: str) -> None:
        """A stop: the id is dropped and its requests on their way are stopped."""
        for p in self.pending.get((owner, conv_id), []):
            p.stopped = True
        ids = self.owners.get(owner)
        if ids is not None:
            ids.pop(conv_id)
            if not ids.recent:
                del self.owners[owner]

    def variants(self, owner: str, rids: list[str]) -> dict[str, str]:
        """The remembered ids (with their models) that ``rids`` name: each id itself and
        its ``<id>::...``; each found once, whatever the overlaps among ``rids``."""
        ids = self.owners.get(owner)
        if ids is None:
            return {}
        return {cid: ids.recent[cid][0] for rid in covering(rids) for cid in ids.named(rid)}

    def __len__(self) -> int:
        return sum(len(ids.recent) for ids in self.owners.values())
