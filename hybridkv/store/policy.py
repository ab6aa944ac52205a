"""Which entries a capacity-bound store keeps: admission and eviction, with no model in sight.

An entry is a key, a kind ("kv-block" or "state"), its bytes, the prefill compute it saves when it
is used (any unit: FLOPs or seconds; the caller's cost model says), how often it was used and when.
Entries may depend on one other entry (`parent`): a KV block on the block before it, a state
checkpoint on the KV block it ends. A store that keeps a dependent without its parent holds bytes no
prefix can reach, so every entry's priority is kept at least that of its dependents (a path is
valued by its most valuable entry), and eviction takes the lowest priority first, deepest first on
ties: what is evicted is always a leaf.

Two rules set the priority:

- `lru`: the time of last use (a counter the caller advances per request);
- `value`: Greedy-Dual-Size-Frequency, `clock + uses × saved / bytes`, where `clock` is the
  priority of the last entry evicted: compute saved per byte held, aged so that an entry not used
  for a while falls below newer ones.

Admission is the same for both: a new entry of priority P may evict only entries of priority below P;
when those cannot make room it is refused and nothing is evicted. Under `lru` every older entry is
below P (plain LRU); under `value` an entry that saves little per byte cannot push out entries that
save more.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

RULES = ("lru", "value")
KV_BLOCK, STATE = "kv-block", "state"


class Entry:
    __slots__ = ("key", "kind", "nbytes", "saved", "uses", "priority", "rank", "parent", "dependents", "depth")

    def __init__(self, key, kind: str, nbytes: int, saved: float, rank: float, parent: Entry | None) -> None:
        self.key, self.kind, self.nbytes, self.saved, self.rank, self.parent = key, kind, nbytes, saved, rank, parent
        self.uses = 1
        self.priority = 0.0
        self.dependents = 0
        self.depth = 0  # entries it depends on, through its parents

    def density(self) -> float:
        """Compute saved per byte held, counting every use so far."""
        return self.uses * self.saved / self.nbytes if self.nbytes else math.inf


class PolicyStore:
    """The bookkeeping of a store of `capacity` bytes (math.inf: unbounded) under `rule`.

    `now` is the caller's clock for `lru` (e.g. the request index). `on_evict(victims, priority)` is
    called with the entries one admission evicted and the priority of the entry admitted.
    """

    def __init__(self, capacity: float, rule: str = "lru", on_evict: Callable | None = None) -> None:
        if rule not in RULES:
            raise ValueError(f"unknown rule {rule!r} (known: {', '.join(RULES)})")
        self.capacity, self.rule, self.on_evict = capacity, rule, on_evict
        self.entries: dict = {}
        self.used = 0
        self.clock = 0.0  # value: the priority of the last entry evicted
        self.now = 0.0  # lru: the caller's time
        self._heap: list = []
        self._seq = 0
        self.bytes_written = 0
        self.evicted = 0
        self.refused = 0
        self._bounded = capacity != math.inf  # an unbounded store never evicts: no heap to keep

    def _push(self, entry: Entry) -> None:
        heap = self._heap
        if len(heap) > 4 * len(self.entries) + 4096:  # mostly stale records: rebuild (in place)
            heap[:] = [(e.priority, -e.depth, e.rank, i, e) for i, e in enumerate(self.entries.values())]
            self._seq = len(heap)
            heapq.heapify(heap)
        self._seq += 1
        heapq.heappush(heap, (entry.priority, -entry.depth, entry.rank, self._seq, entry))

    def __contains__(self, key) -> bool:
        return key in self.entries

    def _own_priority(self, entry: Entry) -> float:
        return self.now if self.rule == "lru" else self.clock + entry.density()

    def _raise(self, entry: Entry, priority: float) -> None:
        """Set `entry`'s priority to at least `priority`, and its ancestors' with it."""
        while entry is not None and entry.priority < priority:
            entry.priority = priority
            if self._bounded:
                self._push(entry)
            entry = entry.parent

    def use(self, key) -> None:
        """A hit read the entry: count the use and raise its priority (and its ancestors')."""
        entry = self.entries[key]
        entry.uses += 1
        self._raise(entry, self._own_priority(entry))

    def use_all(self, keys) -> None:
        """`use` each key in turn (the same result, with less overhead per key)."""
        entries, bounded, push, lru = self.entries, self._bounded, self._push, self.rule == "lru"
        for key in keys:
            entry = entries[key]
            entry.uses += 1
            if lru:
                priority = self.now
            else:
                nbytes = entry.nbytes
                priority = self.clock + (entry.uses * entry.saved / nbytes if nbytes else math.inf)
            while entry is not None and entry.priority < priority:
                entry.priority = priority
                if bounded:
                    push(entry)
                entry = entry.parent

    def put(self, key, kind: str, nbytes: int, saved: float, parent=None, rank: float = 0.0) -> bool:
        """Admit a new entry (its `parent` key must be held, or None); False when it is refused.
        `rank` breaks priority ties: lower is evicted first (give deeper entries a lower rank)."""
        return self.put_chain([(key, kind, nbytes, saved, rank)], parent) == 1

    def put_chain(self, items: list[tuple], parent=None) -> int:
        """Admit a chain of new entries, each (key, kind, nbytes, saved, rank) depending on the one
        before it and the first on `parent` (held, or None), root first; stops at the first refused.
        Each is admitted at the highest priority of itself and the entries after it, so the chain
        never outranks its own ancestors. Returns how many were admitted."""
        entries, bounded, capacity = self.entries, self._bounded, self.capacity
        up = entries[parent] if parent is not None else None
        for item in items:
            if item[0] in entries:
                raise ValueError(f"{item[0]!r} is held already")
        # each entry's priority: the highest own priority of itself and the entries after it
        priorities = [0.0] * len(items)
        best = -math.inf
        lru, now, clock = self.rule == "lru", self.now, self.clock
        for i in range(len(items) - 1, -1, -1):
            if lru:
                own = now
            else:
                nbytes = items[i][2]
                own = clock + (items[i][3] / nbytes if nbytes else math.inf)  # one use
            if own > best:
                best = own
            priorities[i] = best
        if up is not None and items:
            self._raise(up, priorities[0])  # the path it extends is worth at least as much
        admitted = 0
        push = self._push
        for (key, kind, nbytes, saved, rank), priority in zip(items, priorities, strict=True):
            if nbytes > capacity or (self.used + nbytes > capacity and not self._make_room(nbytes, priority)):
                self.refused += 1
                break
            entry = Entry(key, kind, nbytes, saved, rank, up)
            entry.priority = priority
            if up is not None:
                entry.depth = up.depth + 1
                up.dependents += 1
            if bounded:
                push(entry)
            entries[key] = entry
            self.used += nbytes
            self.bytes_written += nbytes
            admitted += 1
            up = entry
        return admitted

    def discard(self, key) -> None:
        """Forget `key` (removed from outside the rule: deleted, found corrupt). Its dependents stay
        held, depending on nothing a lookup can reach, until the rule evicts them."""
        entry = self.entries.pop(key, None)
        if entry is None:
            return
        self.used -= entry.nbytes
        if entry.parent is not None:
            entry.parent.dependents -= 1
        entry.parent = None

    def _make_room(self, nbytes: int, below: float) -> bool:
        victims, freed, heap, entries = [], 0, self._heap, self.entries
        while self.used - freed + nbytes > self.capacity and heap:
            priority, _, _, _, entry = heap[0]
            if entries.get(entry.key) is not entry or priority != entry.priority:
                heapq.heappop(heap)  # a stale record: the entry was re-prioritised or is gone
                continue
            if priority >= below:
                break
            heapq.heappop(heap)
            if entry.dependents:  # cannot happen while dependents never outrank their parent
                raise AssertionError(f"{entry.key!r} would be evicted before its dependents")
            victims.append(entry)
            freed += entry.nbytes
            if entry.parent is not None:
                entry.parent.dependents -= 1
            del entries[entry.key]
        if self.used - freed + nbytes > self.capacity:
            for entry in victims:  # refused: put every victim back as it was
                entries[entry.key] = entry
                if entry.parent is not None:
                    entry.parent.dependents += 1
                self._push(entry)
            return False
        self.used -= freed
        self.evicted += len(victims)
        if victims:
            if self.rule == "value":
                self.clock = max(self.clock, victims[-1].priority)
            if self.on_evict is not None:
                self.on_evict(victims, below)
        return True
