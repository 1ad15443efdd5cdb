"""Persistent, content-addressed store of compiled artifacts: bytes under hex-digest keys.

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

Note [Claims]
"One compile per key across processes" is a claim row ``claim/v{N}/{key}`` added with
``Cache.add`` (atomic: exactly one concurrent add succeeds) and an expiry. Claims and the
persistent event counters live in a second cache (``<directory>/control``) with no size limit: LRU
pressure from artifacts must never evict a live claim, and ``clear()`` of artifacts must not drop
them.

Note [Claim holders]
A claim records the process holding it: its host (hostname, boot id and pid namespace), pid and
start time (``/proc/<pid>/stat`` field 22, clock ticks since boot). On the holder's own host a
claim whose process is gone, is a zombie, or is another process under a reused pid (another start
time) is stale: ``claim`` takes it over at once and ``is_claimed`` says False, so a holder killed
by SIGKILL, SIGTERM or the OOM killer blocks neither new processes nor those already waiting for
it. Only a claim made on another host (a network directory) cannot be checked; it holds until its
``ttl_s``. ``hand_over`` passes a claim to another process (the compile worker that finishes a
compile after its program exited, Note [Compiles that outlive the program] in neff_cache.jobs):
the claim then belongs to that process rather than to a store instance, and ``release`` in that
process frees it.

Note [Remembered failures]
A compile that raised is remembered as a row ``fail/v{N}/{key}`` beside the artifacts, holding the
reason and the fingerprint, so that other processes replay the region instead of paying the same
failing compile. It is small, is evicted with the least-recently-used entries, and lapses after a
day, so a compiler installed or fixed meanwhile gets its chance (a new fingerprint is a new key).

Note [Read-only caches]
A cache directory this process cannot write (a read-only mount, a cache baked into a container
image and owned by root, a full disk) is still read: its index is opened with SQLite's read-only
(or, where not even the ``-shm`` file can be made, immutable) URI, hits load from it, and what this
process compiles is kept in memory on top, with one WARNING that writes are off. It passes the
same checks as a writable one (Note [Cache trust] in ``neff_cache.access``): another user's
directory is never read, since reading their artifacts means running their code.

Note [Orphaned files]
diskcache writes a large value's file before the row that names it, and removes a file after the
row is gone, so a process killed between the two leaves a file no row names: invisible to the
size bound and never removed by eviction. ``remove_orphans`` deletes value files that no row names
and that are older than ``ORPHAN_GRACE_S`` (a writer between its file and its row is younger). A
store does so at its first ``put`` (after a compile, never on the way to a cache hit) if no process
did in the last hour, within a time budget; ``prune`` and ``repair`` always do.

Note [Degrading to memory]
A directory that is read-only, full, on a broken file system or holding a damaged database must not
stop the user's program: the first storage error switches the store, for the rest of the process,
to reading the directory only (Note [Read-only caches]) if its index can still be read, else to an
in-memory LRU store of the same size bound, with one WARNING that names the directory, the error
and the fix (for a damaged database: which one, and ``python -m neff_cache repair``). Damage
confined to one entry (unreadable value file, bad checksum) evicts that entry only.
So does a directory that someone other than the user may write (Note [Cache trust] in
``neff_cache.access``): it is never read, and the warning says what is wrong with it.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import functools
import json
import logging
import os
import re
import shutil
import socket
import sqlite3
import threading
import time
import urllib.parse
import uuid
from typing import Any

import diskcache
from diskcache.core import DBNAME, MODE_BINARY, MODE_RAW
import xxhash

from neff_cache.access import _VALUE_NAME, SafeDisk, UnsafeEntry, UntrustedCache, open_directory
from neff_cache.settings import SHARING

log = logging.getLogger("neff_cache")

FORMAT_VERSION = 1
BYTES_PER_MB = 2**20  # sizes in MB here are MiB, as NEURON_EAGER_CACHE_SIZE_MB

_KEY_PATTERN = re.compile(r"[0-9a-f]{8,128}")
_STORED_KEY_PATTERN = re.compile(r"v(\d+)/([0-9a-f]+)")
_STORAGE_ERRORS = (OSError, sqlite3.Error, diskcache.Timeout)
_COUNTERS = ("evictions", "corrupt_entries", "incompatible_entries", "orphans_removed")
_FAILURE_TTL_S = 86400.0  # Note [Remembered failures]
_MAX_REASON = 2000
ORPHAN_GRACE_S = 600.0  # Note [Orphaned files]
_SWEEP_EVERY_S = 3600.0
_SWEEP_BUDGET_S = 0.25
_HEX_DIR = re.compile(r"[0-9a-f]{2}")
_CONTROL = "control"
_MAX_MEMORY_FAILURES = 4096
_META_FIELDS = {"fingerprint": str, "backend": str, "size": int, "checksum": str, "compile_seconds": float}

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


def checksum(data: bytes) -> str:
    """The integrity checksum recorded with every artifact (xxh3-128, hex)."""
    return xxhash.xxh3_128_hexdigest(data)


@functools.cache
def _host() -> str:
    """This machine and pid namespace, as claims record it (Note [Claim holders])."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot_id:
            parts.append(boot_id.read().strip())
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        pass
    return "|".join(parts)


def _process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot), or None if no such process is alive.
    Without /proc (macOS), "" for any live process: liveness by pid only."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
    except OSError:
        if os.path.exists("/proc/self/stat"):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return ""
    # The command name (field 2) is in parentheses and may hold spaces and parentheses itself.
    fields = text[text.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):  # exited, not yet reaped
        return None
    return fields[19].decode()


def _holder(pid: int, owner: str | None) -> str | None:
    """The claim value naming process ``pid`` (None if it is not alive); ``owner`` names the store
    instance, None for a claim that belongs to the process (Note [Claim holders])."""
    start = _process_start(pid)
    if start is None:
        return None
    return json.dumps({"owner": owner, "host": _host(), "pid": pid, "start": start}, sort_keys=True)


def _stale(held: str) -> bool:
    """Whether the claim value ``held`` names a process of this host that is gone."""
    try:
        holder = json.loads(held)
        host, pid, start = holder["host"], holder["pid"], holder["start"]
    except (ValueError, TypeError, KeyError):
        return False  # not a holder record (an older version's claim): it lapses with its ttl
    return host == _host() and type(pid) is int and _process_start(pid) != start


def _read_only_connection(path: str) -> sqlite3.Connection:
    """``path`` opened read-only: Note [Read-only caches]. Raises sqlite3.Error if it cannot be read."""
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
    """Entries, claims and counters on diskcache; see Note [Storage layout] and Note [Claims].
    Raises UntrustedCache for a directory others may write (Note [Cache trust])."""

    def __init__(self, directory: str, size_limit_bytes: int, shared: bool = False):
        access = open_directory(directory, shared)
        control = os.path.join(directory, "control")
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
        """True for one opener per directory per ``_SWEEP_EVERY_S`` (Note [Orphaned files])."""
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
        other (a pickle, a file, another type) is deleted unread (Note [No pickle])."""
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


@dataclasses.dataclass
class _MemoryEntry:
    data: bytes
    meta_text: str
    created: float
    last_used: float
    hits: int = 0


class _MemoryBackend:
    """The same interface as _DiskBackend, for this process only; see Note [Degrading to memory]."""

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
        # the same checks as a writable directory's (Note [Cache trust]); value files are read
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


def _is_disk_full(error: BaseException) -> bool:
    return (isinstance(error, OSError) and error.errno == errno.ENOSPC) or "disk is full" in str(error)


def _is_damaged_database(error: BaseException) -> bool:
    # OperationalError is a locked, read-only or missing database; the other DatabaseErrors are damage.
    return isinstance(error, sqlite3.DatabaseError) and not isinstance(error, sqlite3.OperationalError)


class ArtifactStore:
    """Compiled artifacts under hex-digest keys, on disk, shared by every process on the machine.

    ``get`` verifies the checksum (and the compiler fingerprint when given) and evicts what fails;
    ``put`` writes atomically and evicts least-recently-used entries beyond ``size_limit_mb``;
    ``claim``/``release``/``wait_for`` make one process compile a key while the others wait.
    A directory that cannot be used, or that someone else may write, degrades the store to memory
    with one WARNING. ``shared="group"`` accepts a directory its group may write, for users who
    trust each other (Note [Cache trust] in ``neff_cache.access``). Thread-safe;
    after ``fork`` the child reconnects by itself (diskcache checks the process id).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        size_limit_mb: float = 4096,
        format_version: int = FORMAT_VERSION,
        shared: str = "no",
    ):
        if not size_limit_mb > 0:
            raise ValueError(f"size_limit_mb must be positive, got {size_limit_mb!r}")
        if type(format_version) is not int or format_version < 1:
            raise ValueError(f"format_version must be an integer >= 1, got {format_version!r}")
        if shared not in SHARING:
            raise ValueError(f"shared must be one of {', '.join(SHARING)}, got {shared!r}")
        self.directory = os.path.abspath(os.path.expanduser(os.fspath(directory)))
        self.shared = shared
        self.format_version = format_version
        self.size_limit_bytes = int(size_limit_mb * BYTES_PER_MB)
        # Counted for this instance; stats() reports the totals of every process (persistent).
        self.evictions = 0
        self.corrupt_entries = 0
        self.incompatible_entries = 0
        self.orphans_removed = 0
        self._warned: set[str] = set()
        self._degrade_lock = threading.Lock()
        self._instance_id = uuid.uuid4().hex[:12]
        self._backend: _DiskBackend | _MemoryBackend
        try:
            self._backend = _DiskBackend(self.directory, self.size_limit_bytes, shared == "group")
        except UntrustedCache as error:
            self._backend = _MemoryBackend(self.size_limit_bytes)
            log.warning(
                "not using the compiled-artifact cache at %s: %s; whoever can write it could run code in this "
                "process, so artifacts are kept in memory for this process only. To fix it, %s.",
                self.directory,
                error,
                error.fix,
            )
        except _STORAGE_ERRORS as error:
            self._backend = self._fallback(error)
        self._sweep_checked = False  # Note [Orphaned files]

    # ----------------------------------------------------------------------------- artifacts

    def put(self, key: str, data: bytes, *, fingerprint: str, backend: str, compile_seconds: float) -> None:
        """Store ``data`` under ``key`` with its metadata, replacing any entry with that key."""
        stored_key = self._stored_key(key)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"artifact for key {key} must be bytes, got {type(data).__name__}")
        data = bytes(data)
        meta_text = json.dumps(
            {
                "fingerprint": str(fingerprint),
                "backend": str(backend),
                "size": len(data),
                "checksum": checksum(data),
                "compile_seconds": float(compile_seconds),
            }
        )
        evicted = self._call(lambda store: store.write(stored_key, data, meta_text))
        if not self._sweep_checked:
            self._sweep_checked = True
            self._remove_orphans_when_due()
        if evicted:
            self._count("evictions", evicted)
            log.info(
                "evicted %d least-recently-used artifact(s) from %s to stay under its size "
                "limit of %.0f MB (raise NEURON_EAGER_CACHE_SIZE_MB to keep more)",
                evicted,
                self.directory,
                self.size_limit_bytes / BYTES_PER_MB,
            )

    def get(self, key: str, *, fingerprint: str | None = None) -> bytes | None:
        """The verified artifact under ``key``, or None if absent, corrupt or for another fingerprint.

        A corrupt, truncated or unreadable entry, or one whose fingerprint differs from
        ``fingerprint`` (when given), is evicted and counted so that the caller recompiles it.
        """
        stored_key = self._stored_key(key)
        found = self._call(lambda store: store.read(stored_key))
        if found is None:
            return None
        data, meta_text, handle = found
        meta = _parse_meta(meta_text)
        problem = _integrity_problem(data, meta)
        if problem is not None:
            self._evict_bad_entry(stored_key, "corrupt_entries", problem)
            return None
        if fingerprint is not None and meta["fingerprint"] != fingerprint:
            self._evict_bad_entry(
                stored_key,
                "incompatible_entries",
                f"compiled for fingerprint {meta['fingerprint']!r}, this process has {fingerprint!r}",
            )
            return None
        self._call(lambda store: store.record_hit(handle))
        return data

    def discard(self, key: str, problem: str) -> None:
        """Evict the entry under ``key``, which passed its checksum but does not load or run
        (``problem`` says how); counted and warned as a corrupt entry."""
        self._evict_bad_entry(self._stored_key(key), "corrupt_entries", problem)

    def contains(self, key: str) -> bool:
        """True if an entry is stored under ``key`` (not verified, not counted as a use)."""
        stored_key = self._stored_key(key)
        return self._call(lambda store: store.contains(stored_key))

    def put_failure(self, key: str, reason: str, *, fingerprint: str, backend: str) -> None:
        """Remember that compiling ``key`` failed with ``reason``: Note [Remembered failures]."""
        failure_key = "fail/" + self._stored_key(key)
        record = json.dumps({"reason": str(reason)[:_MAX_REASON], "fingerprint": str(fingerprint),
                             "backend": str(backend), "time": time.time()})
        self._call(lambda store: store.write_failure(failure_key, record, _FAILURE_TTL_S))

    def failure(self, key: str, *, fingerprint: str | None = None) -> str | None:
        """Why compiling ``key`` failed, if a failure is remembered (for ``fingerprint``, when given)."""
        failure_key = "fail/" + self._stored_key(key)
        record = _parse_meta(self._call(lambda store: store.read_failure(failure_key)))
        if record is None or not isinstance(record.get("reason"), str):
            return None
        if fingerprint is not None and record.get("fingerprint") != fingerprint:
            return None
        return record["reason"]

    def entries(self) -> list[dict[str, Any]]:
        """Metadata of every stored entry of every format version, most recently used first.

        Each dict has: key, format_version, backend, fingerprint, size, checksum, compile_seconds,
        created, last_used (epoch seconds) and hits. Fields an entry does not record are None.
        """
        described = [_describe(row) for row in self._call(lambda store: store.rows())]
        described = [entry for entry in described if entry is not None]
        described.sort(key=lambda entry: entry["last_used"], reverse=True)
        return described

    def stats(self) -> dict[str, Any]:
        """Totals over all entries: entries, bytes, hits, oldest/newest creation time, a
        per-backend breakdown, and the evictions / corrupt / incompatible entries of all processes."""
        listed = self.entries()
        per_backend: dict[str, dict[str, int]] = {}
        for entry in listed:
            totals = per_backend.setdefault(str(entry["backend"]), {"entries": 0, "bytes": 0, "hits": 0})
            totals["entries"] += 1
            totals["bytes"] += entry["size"] or 0
            totals["hits"] += entry["hits"]
        created = [entry["created"] for entry in listed]
        return {
            "directory": self.directory,
            "in_memory": self.in_memory,
            "read_only": self.read_only,
            "format_version": self.format_version,
            "size_limit_bytes": self.size_limit_bytes,
            "entries": len(listed),
            "bytes": sum(entry["size"] or 0 for entry in listed),
            "hits": sum(entry["hits"] for entry in listed),
            "oldest": min(created, default=None),
            "newest": max(created, default=None),
            "backends": per_backend,
            **self._call(lambda store: store.counters()),
        }

    def clear(self) -> list[dict[str, Any]]:
        """Remove every entry and every remembered failure; returns the metadata of the entries."""
        self._call(lambda store: store.clear_failures())
        return self._remove(self.entries())

    def prune(
        self, max_size_mb: float | None = None, older_than_s: float | None = None
    ) -> list[dict[str, Any]]:
        """Remove entries unused for more than ``older_than_s`` seconds, then least-recently-used
        entries until their total size is at most ``max_size_mb``; returns those removed."""
        if max_size_mb is None and older_than_s is None:
            raise ValueError("prune needs max_size_mb and/or older_than_s")
        for name, value in (("max_size_mb", max_size_mb), ("older_than_s", older_than_s)):
            if value is not None and not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")
        oldest_first = self.entries()[::-1]
        doomed: list[dict[str, Any]] = []
        if older_than_s is not None:
            cutoff = time.time() - older_than_s
            doomed = [entry for entry in oldest_first if entry["last_used"] < cutoff]
            oldest_first = oldest_first[len(doomed) :]
        if max_size_mb is not None:
            excess = sum(entry["size"] or 0 for entry in oldest_first) - max_size_mb * BYTES_PER_MB
            for entry in oldest_first:
                if excess <= 0:
                    break
                doomed.append(entry)
                excess -= entry["size"] or 0
        self.remove_orphans()
        return self._remove(doomed)

    def remove_orphans(self, *, grace_s: float = ORPHAN_GRACE_S, budget_s: float | None = None) -> tuple[int, int]:
        """Delete files no entry names, left by processes killed mid-write (Note [Orphaned files]);
        within ``budget_s`` seconds when given. Returns (files, bytes) removed."""
        deadline = None if budget_s is None else time.monotonic() + budget_s
        files, freed = self._call(lambda store: store.remove_orphans(grace_s, deadline))
        if files:
            self._count("orphans_removed", files)
            log.info("removed %d orphaned file(s) (%.1f MB) from %s, left by processes killed while writing",
                     files, freed / BYTES_PER_MB, self.directory)
        return files, freed

    # ------------------------------------------------------------------------------- claims

    def claim(self, key: str, *, ttl_s: float = 900.0) -> bool:
        """True if the caller should compile ``key``: it now holds the key's claim and no artifact is
        stored. The claim of a process that is gone is taken over (Note [Claim holders]); one that
        cannot be checked lapses after ``ttl_s`` seconds. Call ``release`` when the artifact is
        stored or the compile failed."""
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s!r}")
        stored_key = self._stored_key(key)
        claim_key, mine = f"claim/{stored_key}", self._holder()
        if not self._call(lambda store: store.add_claim(claim_key, mine, ttl_s)):
            held = self._call(lambda store: store.claim_holder(claim_key))
            if held is None or not _stale(held):
                return False
            if not self._call(lambda store: store.replace_claim(claim_key, held, mine, ttl_s)):
                return False  # another process took it over first
            log.info("took over the compile claim on %s from process %s, which is gone", key, json.loads(held)["pid"])
        if self._call(lambda store: store.contains(stored_key)):
            # Another process stored it between the caller's miss and this claim.
            self.release(key)
            return False
        return True

    def release(self, key: str) -> None:
        """Give up this store's claim on ``key``, or a claim handed over to this process; a claim
        held by another process is left alone."""
        claim_key = f"claim/{self._stored_key(key)}"
        holders = (self._holder(), _holder(os.getpid(), None))
        self._call(lambda store: store.release_claim(claim_key, holders))

    def hand_over(self, key: str, pid: int, *, ttl_s: float = 900.0) -> bool:
        """Pass this store's claim on ``key`` to process ``pid`` for ``ttl_s`` more seconds; False if
        this store does not hold it or ``pid`` is not alive (Note [Claim holders])."""
        claim_key, mine, theirs = f"claim/{self._stored_key(key)}", self._holder(), _holder(pid, None)
        return theirs is not None and self._call(lambda store: store.replace_claim(claim_key, mine, theirs, ttl_s))

    def is_claimed(self, key: str) -> bool:
        """True if a live process holds an unexpired claim on ``key`` (Note [Claim holders])."""
        claim_key = f"claim/{self._stored_key(key)}"
        held = self._call(lambda store: store.claim_holder(claim_key))
        return held is not None and not _stale(held)

    def wait_for(self, key: str, timeout_s: float, *, fingerprint: str | None = None) -> bytes | None:
        """Wait up to ``timeout_s`` for another process to store ``key``; returns the artifact, or
        None on timeout or as soon as nobody holds the claim any more (the compile failed or its
        process died), in which case the caller may ``claim`` and compile it itself."""
        deadline = time.monotonic() + timeout_s
        interval_s = 0.005
        while True:
            data = self.get(key, fingerprint=fingerprint)
            if data is not None:
                return data
            if not self.is_claimed(key):
                # The winner stores before it releases: look once more for an artifact that landed
                # between the get above and the claim check.
                return self.get(key, fingerprint=fingerprint)
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                return None
            time.sleep(min(interval_s, remaining_s))
            interval_s = min(interval_s * 2, 0.1)

    # ---------------------------------------------------------------------------- lifecycle

    @property
    def in_memory(self) -> bool:
        """True once the store has degraded to memory (see Note [Degrading to memory])."""
        return type(self._backend) is _MemoryBackend

    @property
    def read_only(self) -> bool:
        """True when the directory is read but not written (see Note [Read-only caches])."""
        return type(self._backend) is _ReadOnlyBackend

    def close(self) -> None:
        """Close this thread's database connections; the store reopens them if used again."""
        self._backend.close()

    def __enter__(self) -> ArtifactStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = "memory" if self.in_memory else "disk, read-only" if self.read_only else "disk"
        return f"ArtifactStore({self.directory!r}, format_version={self.format_version}, on {where})"

    # ------------------------------------------------------------------------------ helpers

    def _stored_key(self, key: str) -> str:
        if type(key) is not str or _KEY_PATTERN.fullmatch(key) is None:
            raise ValueError(f"neff_cache keys are lowercase hex digests of 8 to 128 digits, got {key!r}")
        return f"v{self.format_version}/{key}"

    def _owner(self) -> str:
        # The pid is read on every call so that a forked child never passes for its parent.
        return f"{socket.gethostname()}:{os.getpid()}:{self._instance_id}"

    def _holder(self) -> str:
        return _holder(os.getpid(), self._owner())

    def _call(self, operation):
        backend = self._backend
        try:
            return operation(backend)
        except _STORAGE_ERRORS as error:
            if type(backend) is _MemoryBackend:
                raise
            with self._degrade_lock:
                if self._backend is backend:
                    self._backend = self._fallback(error, read_only=type(backend) is _DiskBackend)
            return operation(self._backend)

    def _fallback(self, error: BaseException, read_only: bool = True) -> _MemoryBackend:
        """The backend after ``error`` from the directory: read-only if its index can still be read
        (Note [Read-only caches]), else memory (Note [Degrading to memory]); warns once."""
        if read_only and not _is_damaged_database(error) and os.path.exists(os.path.join(self.directory, DBNAME)):
            try:
                backend = _ReadOnlyBackend(self.directory, self.size_limit_bytes, self.shared == "group")
            except (*_STORAGE_ERRORS, UntrustedCache):
                pass
            else:
                fix = ("free space on that disk" if _is_disk_full(error) else f"make {self.directory} writable")
                log.warning(
                    "the compiled-artifact cache at %s cannot be written (%s: %s); its artifacts are used, "
                    "but what this process compiles is kept in memory only. To keep new compiles, %s or "
                    "set NEURON_EAGER_CACHE_DIR to a writable directory.",
                    self.directory, type(error).__name__, error, fix,
                )
                return backend
        self._warn_degraded(error)
        return _MemoryBackend(self.size_limit_bytes)

    def _warn_degraded(self, error: BaseException) -> None:
        if _is_disk_full(error):
            fix = "free space on that disk or set NEURON_EAGER_CACHE_DIR to a directory with free space"
        elif _is_damaged_database(error):
            fix = self._repair_advice()
        else:
            fix = f"set NEURON_EAGER_CACHE_DIR to a writable directory (or make {self.directory} writable)"
        log.warning(
            "cannot use the compiled-artifact cache at %s (%s: %s); artifacts are kept in "
            "memory for this process only, so every new process compiles them again. To fix it, %s.",
            self.directory,
            type(error).__name__,
            error,
            fix,
        )

    def _repair_advice(self) -> str:
        """What to do about a database error: names the database that is damaged, and the fix that
        keeps every artifact that can be kept (deleting the index would drop them all)."""
        index, control = os.path.join(self.directory, DBNAME), os.path.join(self.directory, _CONTROL, DBNAME)
        repair = f"run `python -m neff_cache repair --cache-dir {self.directory}`"
        index_damage, control_damage = _damage(index), _damage(control)
        if index_damage is not None:
            return (f"{repair}: the index {index} is damaged ({index_damage}); repair rebuilds it from the "
                    "rows that can still be read and keeps every artifact whose checksum verifies")
        if control_damage is not None:
            return (f"{repair}: {control}, which holds only compile claims and counters, is damaged "
                    f"({control_damage}); no artifact is lost (deleting {os.path.dirname(control)} also works)")
        return (f"{repair} if it happens again: SQLite finds both databases sound now, so the error may "
                "have been passing (do not delete them: the index is what finds the artifacts)")

    def _remove_orphans_when_due(self) -> None:
        try:
            due = self._backend.sweep_due()
        except _STORAGE_ERRORS:
            return  # the first real operation finds out what is wrong, and warns
        if due:
            self.remove_orphans(budget_s=_SWEEP_BUDGET_S)

    def _evict_bad_entry(self, stored_key: str, counter: str, problem: str) -> None:
        self._call(lambda store: store.delete(stored_key))
        self._count(counter, 1)
        kind = "corrupt" if counter == "corrupt_entries" else "incompatible"
        message = "evicted %s artifact %s from %s (%s); it will be compiled again"
        if kind in self._warned:
            log.debug(message, kind, stored_key, self.directory, problem)
            return
        self._warned.add(kind)
        log.warning(
            message + "; further %s entries are logged at DEBUG and counted in stats()['%s']",
            kind,
            stored_key,
            self.directory,
            problem,
            kind,
            counter,
        )

    def _count(self, counter: str, amount: int) -> None:
        setattr(self, counter, getattr(self, counter) + amount)
        self._call(lambda store: store.increment_counter(counter, amount))

    def _remove(self, doomed: list[dict[str, Any]]) -> list[dict[str, Any]]:
        removed = []
        for entry in doomed:
            stored_key = f"v{entry['format_version']}/{entry['key']}"
            if self._call(lambda store: store.delete(stored_key)):
                removed.append(entry)
        return removed


def repair(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Rebuild what is damaged in the cache at ``directory``, keeping every artifact that can be kept.

    A damaged control database is recreated (it holds only claims and counters). A damaged index is
    set aside as ``cache.db.damaged`` and rebuilt from the rows SQLite can still read, keeping each
    artifact whose checksum verifies and each remembered failure. Then files no row names are
    removed (Note [Orphaned files]). Returns ``index`` and ``control`` ("sound" or "rebuilt"),
    ``kept`` and ``dropped`` (rows of a rebuilt index), ``orphans`` and ``orphan_bytes``.
    Raises OSError or sqlite3.Error if the directory cannot be written.
    """
    directory = os.path.abspath(os.path.expanduser(os.fspath(directory)))
    done: dict[str, Any] = {"index": "sound", "control": "sound", "kept": 0, "dropped": 0}
    control = os.path.join(directory, _CONTROL)
    if _damage(os.path.join(control, DBNAME)) is not None:
        shutil.rmtree(control)
        done["control"] = "rebuilt"
    index = os.path.join(directory, DBNAME)
    salvaged = None
    if _damage(index) is not None:
        salvaged = _salvage(index)
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(index + suffix):
                os.replace(index + suffix, f"{index}.damaged{suffix}")
        done["index"] = "rebuilt"
    # Repair stores nothing, so the size limit does not matter; every open sets its own.
    backend = _DiskBackend(directory, 4096 * BYTES_PER_MB)
    try:
        if salvaged is not None:
            kept = [row for row in salvaged if _worth_keeping(directory, row)]
            backend.restore(kept)
            done["kept"], done["dropped"] = len(kept), len(salvaged) - len(kept)
        done["orphans"], done["orphan_bytes"] = backend.remove_orphans(ORPHAN_GRACE_S, None)
    finally:
        backend.close()
    return done


def _salvage(path: str) -> list[tuple]:
    """The rows of the index at ``path`` that SQLite can still read, without their rowids."""
    rows: list[tuple] = []
    try:
        connection = _read_only_connection(path)
    except sqlite3.Error:
        return rows  # not even the header reads: nothing to keep
    last, skip = 0, 1
    try:
        while skip < 2**62:
            try:
                for rowid, *row in connection.execute(_SELECT_ROWS_AFTER, (last,)):
                    rows.append(tuple(row))
                    last, skip = rowid, 1
                break
            except sqlite3.DatabaseError:
                last, skip = last + skip, skip * 2  # step over the damaged page, farther each time
    finally:
        connection.close()
    return rows


def _worth_keeping(directory: str, row: tuple) -> bool:
    key, raw, *_, tag, _size, mode, filename, value = row
    if raw != 1 or type(key) is not str:
        return False
    if key.startswith("fail/"):
        return mode == MODE_RAW and type(value) is str
    if _STORED_KEY_PATTERN.fullmatch(key) is None or mode not in (MODE_RAW, MODE_BINARY):
        return False
    try:
        data = diskcache.Disk(directory).fetch(mode, filename, value, False)
    except OSError:
        return False
    return _integrity_problem(data if type(data) is bytes else None, _parse_meta(tag)) is None


def _parse_meta(meta_text: str | None) -> dict[str, Any] | None:
    try:
        meta = json.loads(meta_text) if isinstance(meta_text, str) else None
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None


def _integrity_problem(data: bytes | None, meta: dict[str, Any] | None) -> str | None:
    if meta is None or not all(isinstance(meta.get(field), kind) for field, kind in _META_FIELDS.items()):
        return "metadata unreadable"
    if data is None:
        return "artifact file missing or unreadable"
    if len(data) != meta["size"]:
        return f"truncated: {len(data)} of {meta['size']} bytes"
    if checksum(data) != meta["checksum"]:
        return "checksum mismatch"
    return None


def _describe(row: _Row) -> dict[str, Any] | None:
    match = _STORED_KEY_PATTERN.fullmatch(row.stored_key) if type(row.stored_key) is str else None
    if match is None:
        return None  # not an artifact of any format version: leave foreign rows alone
    meta = _parse_meta(row.meta_text) or {}
    return {
        "key": match.group(2),
        "format_version": int(match.group(1)),
        "backend": meta.get("backend"),
        "fingerprint": meta.get("fingerprint"),
        "size": meta.get("size"),
        "checksum": meta.get("checksum"),
        "compile_seconds": meta.get("compile_seconds"),
        "created": row.created,
        "last_used": row.last_used,
        "hits": row.hits,
    }
