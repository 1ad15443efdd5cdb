"""The backends that keep what this process stores in memory: all of it, or on top of a directory
it cannot write.

Note [Read-only caches]
A cache directory this process cannot write (a read-only mount, a cache baked into a container
image and owned by root, a full disk) is still read: its index is opened with SQLite's read-only
(or, where not even the ``-shm`` file can be made, immutable) URI, hits load from it, and what this
process compiles is kept in memory on top, with one WARNING that writes are off. It passes the
same checks as a writable one (Note [Cache trust] in ``neff_cache.access``): another user's
directory is never read, since reading their artifacts means running their code.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sqlite3
import threading
import time
from typing import Any

from diskcache.core import DBNAME, MODE_BINARY, MODE_RAW

from neff_cache._disk import (
    _CONTROL,
    _COUNTERS,
    _SELECT_COUNTERS,
    _SELECT_ENTRY,
    _SELECT_FAILURE,
    _SELECT_FILENAMES,
    _SELECT_ROWS,
    _Row,
    _read_only_connection,
)
from neff_cache.access import SafeDisk, UnsafeEntry, open_directory

_MAX_MEMORY_FAILURES = 4096


@dataclasses.dataclass
class _MemoryEntry:
    data: bytes
    meta_text: str
    created: float
    last_used: float
    hits: int = 0


class _MemoryBackend:
    """The same interface as _DiskBackend, for this process only; see Note [Degrading to memory] in neff_cache.store."""

    def __init__(self, size_limit_bytes: int):
        self._size_limit_bytes = size_limit_bytes
        self._entries: collections.OrderedDict[str, _MemoryEntry] = collections.OrderedDict()  # LRU first
        self._bytes = 0
        self._claims: dict[str, tuple[str, float]] = {}
        self._failures: collections.OrderedDict[str, tuple[str, float]] = collections.OrderedDict()
        self._counters: collections.Counter[str] = collections.Counter()
        self._lock = threading.RLock()

    def read(self, stored_key: str) -> tuple[bytes, str, str] | None:
        with self._lock:
            entry = self._entries.get(stored_key)
            return None if entry is None else (entry.data, entry.meta_text, stored_key)

    def record_hit(self, handle: str) -> None:
        with self._lock:
            entry = self._entries.get(handle)
            if entry is not None:
                entry.last_used = time.time()
                entry.hits += 1
                self._entries.move_to_end(handle)

    def write(self, stored_key: str, data: bytes, meta_text: str) -> int:
        with self._lock:
            now = time.time()
            old = self._entries.pop(stored_key, None)
            if old is not None:
                self._bytes -= len(old.data)
            self._entries[stored_key] = _MemoryEntry(data, meta_text, created=now, last_used=now)
            self._bytes += len(data)
            evicted = 0
            while self._bytes > self._size_limit_bytes and self._entries:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= len(dropped.data)
                evicted += 1
            return evicted

    def delete(self, stored_key: str) -> bool:
        with self._lock:
            entry = self._entries.pop(stored_key, None)
            if entry is None:
                return False
            self._bytes -= len(entry.data)
            return True

    def contains(self, stored_key: str) -> bool:
        return stored_key in self._entries

    def rows(self) -> list[_Row]:
        with self._lock:
            return [
                _Row(key, entry.meta_text, entry.created, entry.last_used, entry.hits)
                for key, entry in self._entries.items()
            ]

    def add_claim(self, claim_key: str, holder: str, ttl_s: float) -> bool:
        with self._lock:
            if self.claim_holder(claim_key) is not None:
                return False
            self._claims[claim_key] = (holder, time.monotonic() + ttl_s)
            return True

    def claim_holder(self, claim_key: str) -> str | None:
        with self._lock:
            held = self._claims.get(claim_key)
            return held[0] if held is not None and held[1] > time.monotonic() else None

    def replace_claim(self, claim_key: str, expected: str, holder: str, ttl_s: float) -> bool:
        with self._lock:
            if self.claim_holder(claim_key) != expected:
                return False
            self._claims[claim_key] = (holder, time.monotonic() + ttl_s)
            return True

    def release_claim(self, claim_key: str, holders: tuple[str | None, ...]) -> None:
        with self._lock:
            held = self._claims.get(claim_key)
            if held is not None and held[0] in holders:
                del self._claims[claim_key]

    def write_failure(self, failure_key: str, record: str, ttl_s: float) -> None:
        with self._lock:
            self._failures.pop(failure_key, None)
            self._failures[failure_key] = (record, time.monotonic() + ttl_s)
            while len(self._failures) > _MAX_MEMORY_FAILURES:
                self._failures.popitem(last=False)

    def read_failure(self, failure_key: str) -> str | None:
        with self._lock:
            found = self._failures.get(failure_key)
            return found[0] if found is not None and found[1] > time.monotonic() else None

    def clear_failures(self) -> None:
        with self._lock:
            self._failures.clear()

    def sweep_due(self) -> bool:
        return False

    def remove_orphans(self, grace_s: float, deadline: float | None) -> tuple[int, int]:
        return 0, 0

    def increment_counter(self, name: str, amount: int) -> None:
        with self._lock:
            self._counters[name] += amount

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {name: self._counters[name] for name in _COUNTERS}

    def close(self) -> None:
        pass


class _ReadOnlyBackend(_MemoryBackend):
    """A directory this process cannot write: Note [Read-only caches]. Entries are read from its
    index, opened read-only; what this process stores, claims and counts stays in memory on top."""

    def __init__(self, directory: str, size_limit_bytes: int, shared: bool):
        super().__init__(size_limit_bytes)
        self._directory = directory
        # the same checks as a writable directory's (Note [Cache trust] in neff_cache.access); value files are read
        # following no symbolic link, and never unpickled
        self._disk = SafeDisk(directory)
        self._disk.access = open_directory(directory, shared)
        self._local = threading.local()
        self._hidden: set[str] = set()  # entries found bad: evicted for this process only
        self._sql(_SELECT_FILENAMES + " LIMIT 1")  # fails now, not at the first get, if unreadable

    def _sql(self, statement: str, args: tuple = (), database: str = DBNAME) -> list[tuple]:
        connections = getattr(self._local, "connections", None)
        if connections is None or self._local.pid != os.getpid():  # sqlite connections do not survive fork
            connections = self._local.connections = {}
            self._local.pid = os.getpid()
        connection = connections.get(database)
        if connection is None:
            connection = connections[database] = _read_only_connection(os.path.join(self._directory, database))
        return connection.execute(statement, args).fetchall()

    def read(self, stored_key: str) -> tuple[bytes | None, str | None, Any] | None:
        found = super().read(stored_key)
        if found is not None or stored_key in self._hidden:
            return found
        rows = self._sql(_SELECT_ENTRY, (stored_key, True))
        if not rows:
            return None
        ((_, meta_text, mode, filename, value),) = rows
        if mode not in (MODE_RAW, MODE_BINARY):
            return None, meta_text, None  # never unpickled
        try:
            data = self._disk.fetch(mode, filename, value, False)
        except (OSError, UnsafeEntry):
            return None, meta_text, None
        return (data if type(data) is bytes else None), meta_text, None

    def record_hit(self, handle: str | None) -> None:
        if handle is not None:  # an entry of this process; hits on the directory are not recorded
            super().record_hit(handle)

    def delete(self, stored_key: str) -> bool:
        deleted = super().delete(stored_key)
        if not deleted and self._sql(_SELECT_ENTRY, (stored_key, True)) and stored_key not in self._hidden:
            self._hidden.add(stored_key)
            return True
        return deleted

    def contains(self, stored_key: str) -> bool:
        if super().contains(stored_key):
            return True
        return stored_key not in self._hidden and bool(self._sql(_SELECT_ENTRY, (stored_key, True)))

    def rows(self) -> list[_Row]:
        mine = super().rows()
        shown = self._hidden | {row.stored_key for row in mine}
        return mine + [_Row(*row) for row in self._sql(_SELECT_ROWS) if row[0] not in shown]

    def read_failure(self, failure_key: str) -> str | None:
        found = super().read_failure(failure_key)
        if found is None:
            rows = self._sql(_SELECT_FAILURE, (failure_key, time.time()))
            found = rows[0][0] if rows and rows[0][1] == MODE_RAW and type(rows[0][0]) is str else None
        return found

    def counters(self) -> dict[str, int]:
        counts = super().counters()
        try:
            stored = dict(self._sql(_SELECT_COUNTERS, (), os.path.join(_CONTROL, DBNAME)))
        except sqlite3.Error:  # no control database (never written) or unreadable: this process's only
            return counts
        return {name: counts[name] + int(stored.get(f"count/{name}", 0)) for name in _COUNTERS}
