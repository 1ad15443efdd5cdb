"""First-sight metadata kept on disk: the meta cache's entries beside the artifacts, so that a
second process records a known signature without its meta kernel or its layout run (Note [Meta
entries on disk])."""

from __future__ import annotations

import atexit
import json
import platform
import threading
import time

import torch
import xxhash

from . import _signatures
from ._log import log
from fuser.window import ARITY

# Note [Meta entries on disk]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# At first sight each op signature runs its meta kernel and then the op itself for eager's layouts
# (Note [Eager layouts] in _meta): on a warm restart of a small training step that was most of the
# first step's time the library adds (the MLP of benchmarks/warm_restart.py: 35-140 ms of metadata
# of a 180-460 ms first step at load 3-4). The answer is a function of the meta cache's key (Note
# [Meta cache key]) and of the torch build and machine, so it is kept in the persistent store and
# read back by the next process:
# - what is kept: the output metadata of a signature that records (a ``tuple`` entry: per output
#   shape, strides and dtype, or None for an alias; the outputs' bytes; whether it returns a list),
#   never a ``_Failed``, ``_Raises``, ``_Resizes`` or ``_Warns`` entry (those run the op, or raise, at each
#   sight, and are rare), nor one whose first sight gave a once-a-process kernel warning (Note
#   [Kernel warnings]: a later process issues it at its own first sight, which a disk hit would skip). The signature id is made afresh in each process, from the same
#   structure as ``_compute_meta``'s, so a region key is the one a first sight gives;
# - the key: a canonical JSON text of the meta cache's key (the op by name; per argument its
#   geometry and dtype, numbers with their type, 1, 1.0 and True apart) and the default dtype. A
#   signature with anything else in it (an object we do not model) is not kept;
# - one entry of the store holds a table of them, under a key and a fingerprint of what else can
#   change an answer: this format, our own source (``fuser._library.library_digest``: a bug of
#   ours fixed is a table not read), torch's version and commit, the machine, the CPU capability
#   torch dispatches to, and whether oneDNN is there and on (a channels_last convolution's output
#   layout is the kernel's choice). Only the ``cpu`` target keeps entries: another device's
#   layouts depend on its model and libraries, which the fingerprint does not name;
# - trust: the table is JSON read from the store (Note [Cache trust] in neff_cache.access: only
#   the user can write it; checksum and fingerprint checked by ``ArtifactStore.get``) and is data
#   only: a dtype is looked up by name among torch's dtypes, never evaluated. An entry that is not
#   exactly what this code writes (a wrong type, a shape and strides of different lengths, a
#   negative size, an output where the op returns an alias) is ignored and computed as at first
#   sight; a table that does not parse is ignored whole. Counted (``cache_info()``);
# - when: the table is read once per store, at the first meta-cache miss (the store is opened
#   then, not at the first flush); the entries this process computed are added to it at a flush
#   that follows new ones (at most every ``_WRITE_EVERY_S``) and at exit: a write is one store
#   entry (~1-5 ms). Two processes writing at once may lose each other's new entries: they are
#   computed again, never wrong.
FORMAT = 1
_WRITE_EVERY_S = 2.0
_MAX_KEPT = 1 << 14  # entries in one table: a program with ever new shapes does not grow it without bound
_DTYPES = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_NUMBER_TYPES = {int: "int", float: "float", bool: "bool", complex: "complex"}
STATS = {"disk_hits": 0, "disk_ignored": 0, "written": 0}
_NEW = [0]  # entries added since the last write, in any table: the flush's one check
_WRITTEN_AT = [0.0]


class _Unencodable(Exception):
    pass


def _enc(v):
    """The canonical JSON value of one part of a meta-cache key (raises ``_Unencodable``)."""
    c = v.__class__
    if v is None or c is str:
        return v
    if c is bool:
        return {"b": v}
    if c is int:
        return {"i": v}
    if c is float:
        return {"f": repr(v)}
    if c is complex:
        return {"c": [repr(v.real), repr(v.imag)]}
    if c is tuple or c is torch.Size:
        return [_enc(x) for x in v]
    if c is torch.dtype:
        return {"d": str(v)}
    if c is torch.device:
        return {"D": str(v)}
    if c is torch.memory_format:
        return {"m": str(v)}
    if c is torch.layout:
        return {"l": str(v)}
    if c is type and v in _NUMBER_TYPES:
        return {"T": _NUMBER_TYPES[v]}
    raise _Unencodable(c.__name__)


def key_text(f, sig, ksig, dtype) -> str | None:
    """The canonical text of a meta-cache key (Note [Meta entries on disk]); None if it holds a
    value not modelled here."""
    try:
        return json.dumps([str(f.func), _enc(tuple(sig)), _enc(ksig), str(dtype)], separators=(",", ":"))
    except _Unencodable:
        return None


def fingerprint() -> str:
    from fuser._library import library_digest

    mkldnn = torch.backends.mkldnn
    return json.dumps({"format": FORMAT, "library": library_digest(), "torch": torch.__version__,
                       "git": torch.version.git_version,
                       "machine": platform.machine(), "cpu": torch.backends.cpu.get_cpu_capability(),
                       "mkldnn": [mkldnn.is_available(), bool(mkldnn.enabled)]}, sort_keys=True)


def _store_key(fp: str) -> str:
    return xxhash.xxh3_128_hexdigest(("adaptive_eager meta entries\0" + fp).encode())


def _ints(x, minimum=None) -> bool:
    return type(x) is list and all(type(i) is int and (minimum is None or i >= minimum) for i in x)


def decode(f, value, sig, ksig, dtype, arity: int):
    """The meta-cache entry of a stored ``value``, exactly as ``_compute_meta`` builds it; None
    for a value that is not what ``encode`` writes (Note [Meta entries on disk])."""
    if type(value) is not list or len(value) != 3:
        return None
    raw, nbytes, returns_list = value
    if type(raw) is not list or type(nbytes) is not int or nbytes < 0 or type(returns_list) is not bool:
        return None
    specs = []
    for j, s in enumerate(raw):
        aliased = j < len(f.alias_ret) and f.alias_ret[j] is not None
        if s is None:
            specs.append(None)
            continue
        if aliased or type(s) is not list or len(s) != 3:
            return None
        shape, stride, dt = s
        if not (_ints(shape, 0) and _ints(stride) and len(shape) == len(stride)) or _DTYPES.get(dt) is None:
            return None
        specs.append((tuple(shape), tuple(stride), _DTYPES[dt]))
    specs = tuple(specs)
    eid = _signatures.structure_id((f, tuple(sig), ksig, specs, dtype))
    ARITY[eid] = arity
    return specs, nbytes, returns_list, eid


def encode(entry) -> list:
    specs, nbytes, returns_list, _ = entry
    return [[None if s is None else [list(s[0]), list(s[1]), str(s[2])] for s in specs], nbytes, returns_list]


class DiskTable:
    """The stored entries of one store and fingerprint: those read, and those this process added."""

    def __init__(self, store):
        self.store, self.fp = store, fingerprint()
        self.key = _store_key(self.fp)
        self.lock = threading.Lock()
        self.entries: dict = {}
        self.new: dict = {}
        data = None
        try:
            data = store.get(self.key, fingerprint=self.fp)
            if data is not None:
                table = json.loads(data)
                if type(table) is dict:
                    self.entries = table
                else:
                    STATS["disk_ignored"] += 1
        except (ValueError, UnicodeDecodeError) as e:
            STATS["disk_ignored"] += 1
            log.info("adaptive_eager: the stored meta entries of %s do not parse, ignored: %s", store.directory, e)

    def get(self, text: str):
        return self.entries.get(text)

    def add(self, text: str, entry) -> None:
        if len(self.entries) < _MAX_KEPT:
            value = encode(entry)
            with self.lock:
                self.entries[text] = value
                self.new[text] = value
            _NEW[0] += 1

    def write(self) -> None:
        """Add this process's new entries to the store's table (Note [Meta entries on disk])."""
        if not self.new:
            return
        with self.lock:
            new, self.new = self.new, {}
        try:
            stored = self.store.get(self.key, fingerprint=self.fp)  # another process's entries meanwhile
            table = json.loads(stored) if stored is not None else {}
            if type(table) is not dict:
                table = {}
        except (ValueError, UnicodeDecodeError):
            table = {}
        if len(table) < _MAX_KEPT:
            table.update(new)
        try:
            self.store.put(self.key, json.dumps(table, separators=(",", ":")).encode(), fingerprint=self.fp,
                           backend="meta", compile_seconds=0.0)
            STATS["written"] += len(new)
        except Exception as e:  # noqa: BLE001 - a cache: the next process computes them again
            log.info("adaptive_eager: the meta entries were not stored in %s: %s", self.store.directory, e)


_TABLES: dict = {}  # store -> DiskTable
_LOCK = threading.Lock()


def table_for(options) -> DiskTable | None:
    """The stored meta entries for ``options``' cache, read at the first call; None where entries
    are not kept (Note [Meta entries on disk])."""
    if options.device != "cpu" or options.backend == "replay":
        return None
    from fuser.artifacts import _store

    try:
        store = _store(options)
    except Exception as e:  # noqa: BLE001 - the first flush opens it again, and says what is wrong
        log.info("adaptive_eager: no meta entries from %s: %s", options.cache_dir, e)
        return None
    table = _TABLES.get(id(store))
    if table is None or table.store is not store:
        with _LOCK:
            table = _TABLES.get(id(store))
            if table is None or table.store is not store:
                if not _TABLES:
                    atexit.register(write_all)
                table = _TABLES[id(store)] = DiskTable(store)
    return table


def after_flush() -> None:
    """Called after each flush: store the new entries when there are some and the last write was
    ``_WRITE_EVERY_S`` ago (Note [Meta entries on disk])."""
    if _NEW[0] and time.monotonic() - _WRITTEN_AT[0] >= _WRITE_EVERY_S:
        write_all()


def write_all() -> None:
    _NEW[0], _WRITTEN_AT[0] = 0, time.monotonic()
    for table in list(_TABLES.values()):
        try:
            table.write()
        except Exception as e:  # noqa: BLE001 - a cache (also at exit): the next process computes them
            log.info("adaptive_eager: the meta entries were not stored in %s: %s", table.store.directory, e)


def clear() -> None:
    """Forget what was read (``cache_clear()``): the next miss reads the store again."""
    write_all()
    _TABLES.clear()
