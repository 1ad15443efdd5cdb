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
``Cache.add`` (atomic: exactly one concurrent add succeeds) and an expiry, so the claim of a
process that died lapses after ``ttl_s`` and the key is retried. Claims and the persistent event
counters live in a second cache (``<directory>/control``) with no size limit: LRU pressure from
artifacts must never evict a live claim, and ``clear()`` of artifacts must not drop them.

Note [Degrading to memory]
A directory that is read-only, full, on a broken file system or holding a damaged database must not
stop the user's program: the first storage error switches the store, for the rest of the process,
to an in-memory LRU store of the same size bound, with one WARNING that names the directory, the
error and the fix. Damage confined to one entry (unreadable value file, bad checksum) evicts that
entry only. So does a directory that someone other than the user may write (Note [Cache trust] in
``neff_cache.access``): it is never read, and the warning says what is wrong with it.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import json
import logging
import os
import re
import socket
import sqlite3
import threading
import time
import uuid
from typing import Any

import diskcache
from diskcache.core import DBNAME, MODE_BINARY, MODE_RAW
import xxhash

from neff_cache.access import SafeDisk, UnsafeEntry, UntrustedCache, open_directory

log = logging.getLogger("neff_cache")

FORMAT_VERSION = 1
SHARING = ("no", "group")  # who may write the directory besides the user: Note [Cache trust]
BYTES_PER_MB = 2**20  # sizes in MB here are MiB, as NEURON_EAGER_CACHE_SIZE_MB

_KEY_PATTERN = re.compile(r"[0-9a-f]{8,128}")
_STORED_KEY_PATTERN = re.compile(r"v(\d+)/([0-9a-f]+)")
_STORAGE_ERRORS = (OSError, sqlite3.Error, diskcache.Timeout)
_COUNTERS = ("evictions", "corrupt_entries", "incompatible_entries")
_META_FIELDS = {"fingerprint": str, "backend": str, "size": int, "checksum": str, "compile_seconds": float}

_SELECT_ENTRY = "SELECT rowid, tag, mode, filename, value FROM Cache WHERE key = ? AND raw = ?"
_RECORD_HIT = "UPDATE Cache SET access_time = ?, access_count = access_count + 1 WHERE rowid = ?"
# raw = 1: a row keyed by a pickle (never ours) could not be deleted by its key, and put would spin on it
_SELECT_LEAST_RECENTLY_USED = "SELECT key FROM Cache WHERE raw = 1 ORDER BY access_time LIMIT 1"
_SELECT_ROWS = "SELECT key, tag, store_time, access_time, access_count FROM Cache WHERE raw = 1"


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
        # Note [Reading without Cache.get]
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

    def add_claim(self, claim_key: str, owner: str, ttl_s: float) -> bool:
        return self._control.add(claim_key, owner, expire=ttl_s, retry=True)

    def claim_owner(self, claim_key: str) -> str | None:
        return self._control_value(claim_key, str)

    def release_claim(self, claim_key: str, owner: str) -> None:
        # Only the owner may release: after our claim lapsed, another process may hold the key.
        with self._control.transact(retry=True):
            if self._control_value(claim_key, str) == owner:
                self._control.delete(claim_key)

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
        self._counters: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

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

    def add_claim(self, claim_key: str, owner: str, ttl_s: float) -> bool:
        with self._lock:
            held = self._claims.get(claim_key)
            if held is not None and held[1] > time.monotonic():
                return False
            self._claims[claim_key] = (owner, time.monotonic() + ttl_s)
            return True

    def claim_owner(self, claim_key: str) -> str | None:
        with self._lock:
            held = self._claims.get(claim_key)
            return held[0] if held is not None and held[1] > time.monotonic() else None

    def release_claim(self, claim_key: str, owner: str) -> None:
        with self._lock:
            held = self._claims.get(claim_key)
            if held is not None and held[0] == owner:
                del self._claims[claim_key]

    def increment_counter(self, name: str, amount: int) -> None:
        with self._lock:
            self._counters[name] += amount

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {name: self._counters[name] for name in _COUNTERS}

    def close(self) -> None:
        pass


def _is_disk_full(error: BaseException) -> bool:
    return (isinstance(error, OSError) and error.errno == errno.ENOSPC) or "disk is full" in str(error)


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
        self.format_version = format_version
        self.size_limit_bytes = int(size_limit_mb * BYTES_PER_MB)
        # Counted for this instance; stats() reports the totals of every process (persistent).
        self.evictions = 0
        self.corrupt_entries = 0
        self.incompatible_entries = 0
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
            self._backend = _MemoryBackend(self.size_limit_bytes)
            self._warn_degraded(error)

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
        """Remove every entry; returns the metadata of those removed."""
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
        return self._remove(doomed)

    # ------------------------------------------------------------------------------- claims

    def claim(self, key: str, *, ttl_s: float = 900.0) -> bool:
        """True if the caller should compile ``key``: it now holds the key's claim and no artifact is
        stored. The claim lapses after ``ttl_s`` seconds, so a process that dies does not block the
        key forever. Call ``release`` when the artifact is stored or the compile failed."""
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s!r}")
        stored_key = self._stored_key(key)
        claim_key, owner = f"claim/{stored_key}", self._owner()
        if not self._call(lambda store: store.add_claim(claim_key, owner, ttl_s)):
            return False
        if self._call(lambda store: store.contains(stored_key)):
            # Another process stored it between the caller's miss and this claim.
            self._call(lambda store: store.release_claim(claim_key, owner))
            return False
        return True

    def release(self, key: str) -> None:
        """Give up this process's claim on ``key``; a claim held by another process is left alone."""
        claim_key, owner = f"claim/{self._stored_key(key)}", self._owner()
        self._call(lambda store: store.release_claim(claim_key, owner))

    def is_claimed(self, key: str) -> bool:
        """True if some process holds an unexpired claim on ``key``."""
        claim_key = f"claim/{self._stored_key(key)}"
        return self._call(lambda store: store.claim_owner(claim_key)) is not None

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

    def close(self) -> None:
        """Close this thread's database connections; the store reopens them if used again."""
        self._backend.close()

    def __enter__(self) -> ArtifactStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = "memory" if self.in_memory else "disk"
        return f"ArtifactStore({self.directory!r}, format_version={self.format_version}, on {where})"

    # ------------------------------------------------------------------------------ helpers

    def _stored_key(self, key: str) -> str:
        if type(key) is not str or _KEY_PATTERN.fullmatch(key) is None:
            raise ValueError(f"neff_cache keys are lowercase hex digests of 8 to 128 digits, got {key!r}")
        return f"v{self.format_version}/{key}"

    def _owner(self) -> str:
        # The pid is read on every call so that a forked child never passes for its parent.
        return f"{socket.gethostname()}:{os.getpid()}:{self._instance_id}"

    def _call(self, operation):
        backend = self._backend
        try:
            return operation(backend)
        except _STORAGE_ERRORS as error:
            if type(backend) is _MemoryBackend:
                raise
            with self._degrade_lock:
                if self._backend is backend:
                    self._backend = _MemoryBackend(self.size_limit_bytes)
                    self._warn_degraded(error)
            return operation(self._backend)

    def _warn_degraded(self, error: BaseException) -> None:
        if _is_disk_full(error):
            fix = "free space on that disk or set NEURON_EAGER_CACHE_DIR to a directory with free space"
        elif isinstance(error, sqlite3.DatabaseError) and not isinstance(error, sqlite3.OperationalError):
            fix = (
                f"delete the damaged database {os.path.join(self.directory, DBNAME)} (the cache starts "
                "again empty) or set NEURON_EAGER_CACHE_DIR to another directory"
            )
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
