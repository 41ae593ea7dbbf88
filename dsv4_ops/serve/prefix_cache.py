"""Host-side bookkeeping of the paged pool: which pages are free, who holds them, and which full
pages a later request may share (the prefix cache).

Pages are refcounted. A request holds every page of its block-table row; when it ends, its full
pages enter the prefix index (``publish``) and stay there, unreferenced, until a request matches
them (refcount +1) or memory pressure evicts them, least recently used and deepest first.

The index is a chain of page keys (vLLM's block hashes; at page granularity the same as a radix
tree): ``key_i = H(key_{i-1}, tokens of page i, extra_key)``. A match may only end at a page
boundary ``H`` that has a **snapshot** — the per-slot rings (window KV, compressor pending rows,
indexer compressor rows) exactly as they were when the request that computed them reached ``H``
— since positions ``>= H`` read those rings, and recomputing them would not be bit-exact
(serving_design.md §7.2). Snapshots live in their own fixed pool (``num_snapshots``) and can be
dropped alone; the pages of a prefix without one are still reachable by deeper matches.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["PageAllocator", "PrefixCache", "PageEntry", "OutOfPages"]


class OutOfPages(RuntimeError):
    """No free page and nothing evictable: the scheduler preempts or waits."""


class PageAllocator:
    """Free list + refcounts of ``num_pages`` pages; page 0 is the dummy and never handed out."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.refcount = [0] * num_pages
        self.free: list[int] = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self.free)

    def take(self) -> int:
        if not self.free:
            raise OutOfPages("no free page")
        page = self.free.pop()
        self.refcount[page] = 1
        return page

    def ref(self, page: int) -> None:
        self.refcount[page] += 1

    def unref(self, page: int) -> bool:
        """Drop one reference; True when the page became unreferenced."""
        assert self.refcount[page] > 0, f"page {page} released more often than taken"
        self.refcount[page] -= 1
        return self.refcount[page] == 0

    def give_back(self, page: int) -> None:
        assert self.refcount[page] == 0 and page != 0
        self.free.append(page)


@dataclass
class PageEntry:
    key: bytes
    parent: bytes | None
    page: int
    depth: int  # 1-based: the entry covers positions [(depth-1)*page_size, depth*page_size)
    snapshot: int | None = None  # the rings at position depth*page_size
    users: int = 0  # running requests that share this page
    tick: int = 0
    children: set = field(default_factory=set)


def page_keys(tokens: Sequence[int], page_size: int, extra_key: bytes = b"") -> list[bytes]:
    """The chained key of every full page of ``tokens``."""
    keys, prev = [], extra_key
    for i in range(len(tokens) // page_size):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(b"".join(int(t).to_bytes(4, "little", signed=False) for t in tokens[i * page_size:(i + 1) * page_size]))
        prev = h.digest()
        keys.append(prev)
    return keys


class PrefixCache:
    """The index of shared full pages over a :class:`PageAllocator` and a snapshot pool."""

    def __init__(self, allocator: PageAllocator, page_size: int, num_snapshots: int, extra_key: bytes = b"",
                 enabled: bool = True) -> None:
        self.alloc, self.page_size, self.enabled = allocator, page_size, enabled
        self.extra_key = extra_key
        self.entries: dict[bytes, PageEntry] = {}
        self.free_snapshots: list[int] = list(range(num_snapshots - 1, -1, -1))
        self.snapshot_owner: dict[int, bytes] = {}
        self.evictions = 0  # pages evicted under memory pressure
        self._tick = 0

    # ------------------------------------------------------------------ lookup
    def match(self, tokens: Sequence[int], resumable=lambda pages: True) -> tuple[list[PageEntry], int | None]:
        """The longest cached prefix of ``tokens`` that ends at a snapshot, at a page count
        ``resumable`` accepts, and leaves at least one token to compute: ``(entries of its pages,
        snapshot id)``, or ``([], None)``. Takes a reference on every returned page (``release``
        gives it back)."""
        if not self.enabled:
            return [], None
        chain: list[PageEntry] = []
        for key in page_keys(tokens[: len(tokens) - 1], self.page_size, self.extra_key):
            entry = self.entries.get(key)
            if entry is None:
                break
            chain.append(entry)
        while chain and (chain[-1].snapshot is None or not resumable(len(chain))):
            chain.pop()
        if not chain:
            return [], None
        self._tick += 1
        for e in chain:
            e.tick = self._tick
            e.users += 1
            self.alloc.ref(e.page)
        return chain, chain[-1].snapshot

    def release(self, entries: Sequence[PageEntry]) -> None:
        """A request that matched ``entries`` has ended."""
        for e in entries:
            e.users -= 1
            self.alloc.unref(e.page)  # the cache's own reference keeps it from the free list

    # ------------------------------------------------------------------ insert
    def publish(self, tokens: Sequence[int], pages: Sequence[int], snapshots: dict[int, int]) -> set[int]:
        """A request ended after computing ``tokens`` (positions ``0..len-1``) into ``pages``;
        ``snapshots`` maps a page count ``d`` to the snapshot taken at position ``d*page_size``.
        Its full pages join the index (the cache takes one reference on each new one) and the
        snapshots their entries. Returns the pages and snapshots the cache did NOT adopt (already
        cached, or the cache is off), which the caller frees."""
        not_adopted = set(snapshots.values())
        if not self.enabled:
            return not_adopted
        parent = None
        self._tick += 1
        for depth, key in enumerate(page_keys(tokens, self.page_size, self.extra_key), start=1):
            entry = self.entries.get(key)
            if entry is None:
                entry = PageEntry(key, parent, pages[depth - 1], depth)
                self.alloc.ref(pages[depth - 1])
                self.entries[key] = entry
                if parent is not None:
                    self.entries[parent].children.add(key)
            entry.tick = self._tick
            snap = snapshots.get(depth)
            if snap is not None and entry.snapshot is None and entry.page == pages[depth - 1]:
                entry.snapshot = snap
                self.snapshot_owner[snap] = key
                not_adopted.discard(snap)
            parent = key
        return not_adopted

    # ------------------------------------------------------------------ memory pressure
    def take_snapshot_slot(self) -> int | None:
        """A free snapshot slot, dropping the least recently used cached snapshot if needed."""
        if not self.free_snapshots:
            victims = [self.entries[k] for k in self.snapshot_owner.values()]
            victims = [e for e in victims if e.users == 0]
            if not victims:
                return None
            self._drop_snapshot(min(victims, key=lambda e: (e.tick, -e.depth)))
        return self.free_snapshots.pop()

    def give_back_snapshot(self, snap: int) -> None:
        self.free_snapshots.append(snap)

    def _drop_snapshot(self, entry: PageEntry) -> None:
        snap = entry.snapshot
        entry.snapshot = None
        del self.snapshot_owner[snap]
        self.free_snapshots.append(snap)

    def evict_one(self) -> bool:
        """Free the least recently used unreferenced leaf page; False if there is none."""
        leaves = [e for e in self.entries.values() if e.users == 0 and not e.children]
        if not leaves:
            return False
        e = min(leaves, key=lambda e: (e.tick, -e.depth))
        if e.snapshot is not None:
            self._drop_snapshot(e)
        del self.entries[e.key]
        if e.parent is not None and e.parent in self.entries:
            self.entries[e.parent].children.discard(e.key)
        if self.alloc.unref(e.page):
            self.alloc.give_back(e.page)
        self.evictions += 1
        return True

    def take_page(self) -> int:
        """A free page, evicting cached prefixes while none is free."""
        while not self.alloc.free:
            if not self.evict_one():
                raise OutOfPages("every page is held by a running request")
        return self.alloc.take()

    @property
    def cached_pages(self) -> int:
        return len(self.entries)

    def flush(self) -> None:
        """Evict everything unreferenced (tests: pages back to their initial count)."""
        while self.evict_one():
            pass
