"""``repair``: rebuild a damaged cache directory, keeping every artifact that can be kept."""

from __future__ import annotations

import os
import shutil
import sqlite3
from typing import Any

import diskcache
from diskcache.core import DBNAME, MODE_BINARY, MODE_RAW

from neff_cache._disk import _CONTROL, _SELECT_ROWS_AFTER, _damage, _DiskBackend, _read_only_connection
from neff_cache.entries import _STORED_KEY_PATTERN, _integrity_problem, _parse_meta
from neff_cache.store import BYTES_PER_MB, ORPHAN_GRACE_S


def repair(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Rebuild what is damaged in the cache at ``directory``, keeping every artifact that can be kept.

    A damaged control database is recreated (it holds only claims and counters). A damaged index is
    set aside as ``cache.db.damaged`` and rebuilt from the rows SQLite can still read, keeping each
    artifact whose checksum verifies and each remembered failure. Then files no row names are
    removed (Note [Orphaned files] in neff_cache.store). Returns ``index`` and ``control`` ("sound" or "rebuilt"),
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

