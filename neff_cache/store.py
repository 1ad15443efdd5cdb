"""Persistent, content-addressed store of compiled artifacts: bytes under hex-digest keys.

``ArtifactStore`` runs on a backend: the directory on diskcache (``neff_cache._disk``), or memory,
for this process only or on top of a directory it cannot write (``neff_cache._memory``). Who holds
a compile claim is in ``neff_cache.claims``, what an entry records and how it is verified in
``neff_cache.entries``, and rebuilding a damaged directory in ``neff_cache.repair``.

Note [Remembered failures]
A compile that raised is remembered as a row ``fail/v{N}/{key}`` beside the artifacts, holding the
reason and the fingerprint, so that other processes replay the region instead of paying the same
failing compile. It is small, is evicted with the least-recently-used entries, and lapses after a
day, so a compiler installed or fixed meanwhile gets its chance (a new fingerprint is a new key).
The fuser keeps and reads failures, as it does artifacts, under its backend's fingerprint and a
digest of the library's own source (``fuser.compile.cache_fingerprint``, ``fuser._library``): a
failure that a bug of ours caused (a compile worker where the emulated device did not come up,
once), or an artifact a bug of our lowering made wrong, lapses with the version that fixes it.

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
to reading the directory only (Note [Read-only caches] in neff_cache._memory) if its index can still be read, else to an
in-memory LRU store of the same size bound, with one WARNING that names the directory, the error
and the fix (for a damaged database: which one, and ``python -m neff_cache repair``). Damage
confined to one entry (unreadable value file, bad checksum) evicts that entry only.
So does a directory that someone other than the user may write (Note [Cache trust] in
``neff_cache.access``): it is never read, and the warning says what is wrong with it.
"""

from __future__ import annotations

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
from diskcache.core import DBNAME

from neff_cache._disk import _CONTROL, _damage, _DiskBackend
from neff_cache._memory import _MemoryBackend, _ReadOnlyBackend
from neff_cache.access import UntrustedCache
from neff_cache.claims import _holder, _stale
from neff_cache.entries import _describe, _integrity_problem, _parse_meta, checksum
from neff_cache.settings import SHARING

log = logging.getLogger("neff_cache")

FORMAT_VERSION = 1
BYTES_PER_MB = 2**20  # sizes in MB here are MiB, as NEURON_EAGER_CACHE_SIZE_MB

_KEY_PATTERN = re.compile(r"[0-9a-f]{8,128}")
_STORAGE_ERRORS = (OSError, sqlite3.Error, diskcache.Timeout)
_FAILURE_TTL_S = 86400.0  # Note [Remembered failures]
_MAX_REASON = 2000
ORPHAN_GRACE_S = 600.0  # Note [Orphaned files]
_SWEEP_BUDGET_S = 0.25


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
        stored. The claim of a process that is gone is taken over (Note [Claim holders] in neff_cache.claims); one that
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
        this store does not hold it or ``pid`` is not alive (Note [Claim holders] in neff_cache.claims)."""
        claim_key, mine, theirs = f"claim/{self._stored_key(key)}", self._holder(), _holder(pid, None)
        return theirs is not None and self._call(lambda store: store.replace_claim(claim_key, mine, theirs, ttl_s))

    def is_claimed(self, key: str) -> bool:
        """True if a live process holds an unexpired claim on ``key`` (Note [Claim holders] in neff_cache.claims)."""
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
        """True when the directory is read but not written (see Note [Read-only caches] in neff_cache._memory)."""
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
        (Note [Read-only caches] in neff_cache._memory), else memory (Note [Degrading to memory]); warns once."""
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
