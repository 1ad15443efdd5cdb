"""The writable backend: entries, claims and counters on diskcache, and SQLite read directly.

Note [Storage layout]
One diskcache row per artifact, keyed ``v{format_version}/{key}``. The row's value is the artifact
(diskcache keeps values of 32 KB and more in a file of their own, smaller ones inline in SQLite);
its ``tag`` column holds the metadata as JSON (fingerprint, backend, size, checksum, compile
seconds); diskcache's own columns give the creation time (``store_time``), the last use
(``access_time``, which the least-recently-used policy evicts by) and the hit count
(``access_count``). Data and metadata are written by one ``Cache.set``: diskcache writes the value
file first and then inserts the row in one SQLite transaction, so another process sees the old
entry or the complete new one, never a torn one. A format bump changes the key prefix, so a new
version never reads an old entry; old entries age out through LRU like any unused entry.

Note [Reading without Cache.get]
Under the least-recently-used policy ``Cache.get`` holds SQLite's write lock while it reads the
value file, which queues every reader of every process behind one file read, and it never counts
hits (``access_count`` is only kept by the least-frequently-used policy). A read therefore selects
the row, reads the value with ``Disk.fetch`` outside any lock, verifies it, and then records the
use with one autocommit UPDATE. Listing entries must not count as a use either, so it also reads
the rows directly. Both go through diskcache's ``_sql``/``_sql_retry`` (private in diskcache 5.6),
which keeps diskcache's per-thread connection, its pragmas and its reconnect after ``fork``.

Note [Eviction is counted]
diskcache culls inside ``set`` without saying what it removed, and ``Cache.cull`` removes ten
entries at a time (ten compiled regions where one would do). The cache is opened with
``cull_limit=0`` so ``set`` never culls; ``put`` then deletes least-recently-used entries one by one
until diskcache's volume estimate fits the limit, so every eviction is counted and logged.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sqlite3
import time
import urllib.parse

import diskcache
from diskcache.core import DBNAME, MODE_BINARY, MODE_RAW

from neff_cache.access import _VALUE_NAME, SafeDisk, UnsafeEntry, open_directory

log = logging.getLogger("neff_cache")

_COUNTERS = ("evictions", "corrupt_entries", "incompatible_entries", "orphans_removed")
_SWEEP_EVERY_S = 3600.0
_HEX_DIR = re.compile(r"[0-9a-f]{2}")
_CONTROL = "control"

_SELECT_ENTRY = "SELECT rowid, tag, mode, filename, value FROM Cache WHERE key = ? AND raw = ?"
_RECORD_HIT = "UPDATE Cache SET access_time = ?, access_count = access_count + 1 WHERE rowid = ?"
# raw = 1: a row keyed by a pickle (never ours) could not be deleted by its key, and put would spin on it
_SELECT_LEAST_RECENTLY_USED = "SELECT key FROM Cache WHERE raw = 1 ORDER BY access_time LIMIT 1"
_SELECT_ROWS = "SELECT key, tag, store_time, access_time, access_count FROM Cache WHERE raw = 1"
_SELECT_FAILURE = (
    "SELECT value, mode FROM Cache WHERE key = ? AND raw = 1 AND (expire_time IS NULL OR expire_time > ?)"
)
_DELETE_FAILURES = "DELETE FROM Cache WHERE raw = 1 AND key LIKE 'fail/%'"
_SELECT_FILENAMES = "SELECT filename FROM Cache WHERE filename IS NOT NULL"
_SELECT_COUNTERS = "SELECT key, value FROM Cache WHERE raw = 1 AND key LIKE 'count/%'"
_ROW_COLUMNS = "key, raw, store_time, expire_time, access_time, access_count, tag, size, mode, filename, value"
_SELECT_ROWS_AFTER = f"SELECT rowid, {_ROW_COLUMNS} FROM Cache WHERE rowid > ? ORDER BY rowid"
_INSERT_ROW = f"INSERT OR IGNORE INTO Cache ({_ROW_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"


@dataclasses.dataclass(frozen=True)
class _Row:
    """One stored entry as the backends report it: the stored key and diskcache-level facts."""

    stored_key: str
    meta_text: str | None
    created: float
    last_used: float
    hits: int


def _read_only_connection(path: str) -> sqlite3.Connection:
    """``path`` opened read-only: Note [Read-only caches] in neff_cache._memory. Raises sqlite3.Error if it cannot be read."""
    quoted = urllib.parse.quote(os.path.abspath(path))
    try:
        connection = sqlite3.connect(f"file:{quoted}?mode=ro", uri=True)
        connection.execute("SELECT count(*) FROM sqlite_master").fetchall()
        return connection
    except sqlite3.OperationalError:
        # A WAL database needs its -shm file, which a read-only directory may lack: read the
        # database file as it is (immutable: nobody can be writing a directory nobody can write).
        connection = sqlite3.connect(f"file:{quoted}?immutable=1", uri=True)
        connection.execute("SELECT count(*) FROM sqlite_master").fetchall()
        return connection


def _damage(path: str) -> str | None:
    """What SQLite's quick check finds wrong with the database at ``path`` (None: sound or absent)."""
    if not os.path.exists(path):
        return None
    try:
        connection = _read_only_connection(path)
        try:
            found = [row[0] for row in connection.execute("PRAGMA quick_check").fetchall()]
        finally:
            connection.close()
    except sqlite3.OperationalError:
        return None  # locked or unreadable right now: not evidence of damage
    except sqlite3.DatabaseError as error:
        return str(error)
    return None if found == ["ok"] else "; ".join(found)[:300]


class _DiskBackend:
    """Entries, claims and counters on diskcache; see Note [Storage layout] and Note [Claims] in
    neff_cache.claims. Raises UntrustedCache for a directory others may write (Note [Cache trust] in
    neff_cache.access)."""

    def __init__(self, directory: str, size_limit_bytes: int, shared: bool = False):
        access = open_directory(directory, shared)
        control = os.path.join(directory, _CONTROL)
        access.check(control, directory=True, create=True)
        for where in (directory, control):
            # made with our mode before SQLite makes it (its -wal and -shm files copy that mode)
            access.check(os.path.join(where, DBNAME), create=True)
            for suffix in ("-wal", "-shm"):
                access.check(os.path.join(where, DBNAME + suffix))
        self._artifacts = diskcache.Cache(
            directory,
            disk=SafeDisk,
            size_limit=size_limit_bytes,
            eviction_policy="least-recently-used",
            cull_limit=0,  # Note [Eviction is counted]
        )
        self._artifacts.disk.access = access
        try:
            self._control = diskcache.Cache(control, disk=SafeDisk, eviction_policy="none")
        except BaseException:
            self._artifacts.close()
            raise
        self._control.disk.access = access

    def read(self, stored_key: str) -> tuple[bytes | None, str | None, int] | None:
        """(data or None if the value cannot be read, metadata text, row handle), or None if absent."""
        # Note [Reading without Cache.get] (above)
        rows = self._artifacts._sql(_SELECT_ENTRY, (stored_key, True)).fetchall()
        if not rows:
            return None
        ((rowid, meta_text, mode, filename, value),) = rows
        if mode not in (MODE_RAW, MODE_BINARY):
            # Only bytes are ever put; anything else (a pickle) is foreign and is never unpickled.
            return None, meta_text, rowid
        try:
            data = self._artifacts.disk.fetch(mode, filename, value, False)
        except (OSError, UnsafeEntry):
            if stored_key not in self._artifacts:
                return None  # removed by another process between the select and the file read
            return None, meta_text, rowid
        return (data if type(data) is bytes else None), meta_text, rowid

    def record_hit(self, handle: int) -> None:
        self._artifacts._sql_retry(_RECORD_HIT, (time.time(), handle))

    def write(self, stored_key: str, data: bytes, meta_text: str) -> int:
        """Store the entry; returns how many least-recently-used entries were evicted to fit."""
        self._artifacts.set(stored_key, data, tag=meta_text, retry=True)
        evicted = 0
        while self._artifacts.volume() > self._artifacts.size_limit:
            rows = self._artifacts._sql(_SELECT_LEAST_RECENTLY_USED).fetchall()
            if not rows:
                break
            evicted += self._artifacts.delete(rows[0][0], retry=True)
        return evicted

    def delete(self, stored_key: str) -> bool:
        return self._artifacts.delete(stored_key, retry=True)

    def contains(self, stored_key: str) -> bool:
        return stored_key in self._artifacts

    def rows(self) -> list[_Row]:
        return [_Row(*row) for row in self._artifacts._sql(_SELECT_ROWS).fetchall()]

    def add_claim(self, claim_key: str, holder: str, ttl_s: float) -> bool:
        return self._control.add(claim_key, holder, expire=ttl_s, retry=True)

    def claim_holder(self, claim_key: str) -> str | None:
        return self._control_value(claim_key, str)

    def replace_claim(self, claim_key: str, expected: str, holder: str, ttl_s: float) -> bool:
        with self._control.transact(retry=True):
            if self._control_value(claim_key, str) != expected:
                return False
            self._control.set(claim_key, holder, expire=ttl_s)
            return True

    def release_claim(self, claim_key: str, holders: tuple[str | None, ...]) -> None:
        # Only the holder may release: after our claim lapsed, another process may hold the key.
        with self._control.transact(retry=True):
            if self._control_value(claim_key, str) in holders:
                self._control.delete(claim_key)

    def write_failure(self, failure_key: str, record: str, ttl_s: float) -> None:
        self._artifacts.set(failure_key, record, expire=ttl_s, retry=True)

    def read_failure(self, failure_key: str) -> str | None:
        rows = self._artifacts._sql(_SELECT_FAILURE, (failure_key, time.time())).fetchall()
        return rows[0][0] if rows and rows[0][1] == MODE_RAW and type(rows[0][0]) is str else None

    def clear_failures(self) -> None:
        self._artifacts._sql_retry(_DELETE_FAILURES)

    def sweep_due(self) -> bool:
        """True for one opener per directory per ``_SWEEP_EVERY_S`` (Note [Orphaned files] in neff_cache.store)."""
        return self._control.add("sweep/due", time.time(), expire=_SWEEP_EVERY_S, retry=True)

    def remove_orphans(self, grace_s: float, deadline: float | None) -> tuple[int, int]:
        """Delete value files no row names, older than ``grace_s``; returns (files, bytes)."""
        self._artifacts.expire(retry=True)  # expired rows (remembered failures) go first
        named = {row[0] for row in self._artifacts._sql(_SELECT_FILENAMES).fetchall()}
        return _remove_unnamed_files(self._artifacts.directory, named, grace_s, deadline)

    def restore(self, rows: list[tuple]) -> None:
        """Insert rows salvaged from a damaged index as they were (``repair``): the value files they
        name are the ones already on disk."""
        with self._artifacts.transact(retry=True):
            for row in rows:
                self._artifacts._sql(_INSERT_ROW, row)

    def increment_counter(self, name: str, amount: int) -> None:
        self._control_value(f"count/{name}", int)  # incr would fail on a foreign value: drop it first
        self._control.incr(f"count/{name}", amount, retry=True)

    def counters(self) -> dict[str, int]:
        return {name: self._control_value(f"count/{name}", int) or 0 for name in _COUNTERS}

    def _control_value(self, key: str, kind: type):
        """The value under ``key`` in control, if it has the type neff_cache stores there; any
        other (a pickle, a file, another type) is deleted unread (Note [No pickle] in neff_cache.access)."""
        try:
            value = self._control.get(key, retry=True)
            if value is None or type(value) is kind:
                return value
            found = type(value).__name__
        except UnsafeEntry as error:
            found = str(error)
        self._control.delete(key, retry=True)
        log.warning("removed a foreign value under %s from %s (%s): neff_cache never stores one there",
                    key, self._control.directory, found)
        return None

    def close(self) -> None:
        self._artifacts.close()
        self._control.close()


def _remove_unnamed_files(directory: str, named: set[str], grace_s: float, deadline: float | None) -> tuple[int, int]:
    """Remove diskcache value files under ``directory`` that no row names (``named``) and that are
    older than ``grace_s``; stops after ``deadline`` (monotonic). Returns (files, bytes) removed."""
    cutoff = time.time() - grace_s
    removed = freed = 0
    for top, subs, names in os.walk(directory):
        relative_dir = os.path.relpath(top, directory).replace(os.sep, "/")
        if relative_dir == "." or "/" not in relative_dir:
            subs[:] = [sub for sub in subs if _HEX_DIR.fullmatch(sub)]  # value files are in xx/yy/: never control/
            continue
        subs[:] = []
        for name in names:
            relative = f"{relative_dir}/{name}"
            if relative in named or _VALUE_NAME.fullmatch(relative) is None:
                continue
            path = os.path.join(top, name)
            try:
                status = os.stat(path)
                if status.st_mtime < cutoff:
                    os.remove(path)
                    removed += 1
                    freed += status.st_size
            except FileNotFoundError:
                pass  # removed by another process meanwhile
        if deadline is not None and time.monotonic() > deadline:
            break
    return removed, freed

