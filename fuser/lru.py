"""A bounded table that makes what it lacks: the region LRU and the scalar groups."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, NamedTuple


class CacheInfo(NamedTuple):
    """As ``functools.lru_cache``'s: lookups that found their key, lookups that made it, the bound, the size."""

    hits: int
    misses: int
    maxsize: int
    currsize: int


class LRU:
    """``get(key)`` returns the value of ``key``, made by ``factory()`` on a miss; past
    ``max_entries`` the least recently used one is dropped."""

    __slots__ = ("entries", "factory", "max_entries", "hits", "misses", "_last")

    def __init__(self, factory: Callable[[], object], max_entries: int = 1024):
        self.entries: OrderedDict = OrderedDict()
        self.factory = factory
        self.max_entries = max_entries
        self.hits = self.misses = 0
        self._last = None  # the value the last get returned: the most recent one

    def get(self, key):
        value = self.entries.get(key)
        if value is None:
            self.misses += 1
            value = self.entries[key] = self.factory()
            if len(self.entries) > self.max_entries:
                self.entries.popitem(last=False)
        else:
            self.hits += 1
            if value is not self._last:
                # move_to_end hashes and compares the key again (a whole window's signature); a loop
                # that hits one key every flush finds it last already. Only get inserts or moves
                # entries, each a distinct object, so a value found that is ``_last`` is the last one.
                self.entries.move_to_end(key)
        self._last = value
        return value

    def cache_info(self) -> CacheInfo:
        return CacheInfo(self.hits, self.misses, self.max_entries, len(self.entries))

    def clear(self) -> None:
        self.entries.clear()
        self._last = None
        self.hits = self.misses = 0
