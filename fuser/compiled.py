"""Compiled regions: a window becomes one functional FX graph, compiled once, reused by key.
Nodes that must not be compiled run alone between compiled pieces of it (``fuser.partition``).

Tiers (DESIGN.md "Adaptivity"): a window structure seen for the first time runs by replay; once
its key has been seen ``hot_after`` times it is compiled and every later window with the same key
runs the compiled region. A region that fails to compile or run is blacklisted for its key and
replayed; the program never sees a compiler error or a wrong value.

Note [Region key]
The in-memory key is the window's structure as recorded (``Window.sigs``: per node the id of its
op signature, which covers the op, input shapes/strides/dtypes/devices and scalar arguments, and
its dataflow refs), which values are still observable (live placeholders), and which real inputs
are written. It is exact (a tuple compared in full on a hit) and costs nothing to build at
flush. That structure is hashed once per flush: it finds its scalar ``_Group`` (Note [Scalar
lifting]), and the region is keyed by that group object (hashed by identity), the lifted
positions and the baked scalar values. (A group dropped from ``_GROUPS`` leaves its regions
unreachable; they age out of the LRU, and the structure starts a new group.) The persistent,
process-independent key (for neff_cache) is a digest of the compiled graph's code and input
metadata plus the backend fingerprint, computed only on a compile.
"""

from __future__ import annotations

import atexit
import ctypes
import itertools
import json
import logging
import os
import queue
import struct
import threading
import time
import traceback
from collections import Counter, OrderedDict
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from itertools import compress as _compress

import torch
import xxhash

from . import partition
from .backends._common import (
    BackendCompileError, decode_torch_value, encode_torch_value, pack_sections, restrided, unpack_sections,
)
from .partition import is_check
from .replay import ReplayError, _bind, as_recorded, mark_needed, read_liveness, replay_window
from .window import ALIAS, VIEW, Out, Window

log = logging.getLogger("adaptive_eager.fuser")

FORMAT = 5  # bump when Program's encoding or the artifact packing changes

_untyped_storage = torch._C.TensorBase.untyped_storage
# a lifted scalar's 0-dim input (Note [Scalar lifting]): torch.tensor's argument parsing and type
# inference cost twice as much, per scalar per run (AdamW lifts 2 per parameter)
_scalar_tensor = torch.scalar_tensor
# ``_profiler._is_profiler_enabled`` is a module flag torch.profiler sets on start and clears on stop
# (``_run_on_profiler_start``): one attribute read, so a run pays ~nothing while no profiler records.
_profiler = torch.autograd.profiler
_record_function = torch.autograd.profiler.record_function
_REGION_IDS = itertools.count(1)


class RegionStats:
    """Counters the tracer folds into ``metrics()``."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.regions_compiled = 0
        self.compile_seconds = 0.0
        self.cache_hits_memory = 0
        self.cache_misses = 0
        self.replayed_regions = 0
        self.compiled_runs = 0
        self.blacklisted = 0
        self.compile_failures = 0
        self.cache_hits_disk = 0
        self.waited_for_other_process = 0
        self.recompiles: Counter[str] = Counter()
        self.not_compiled: Counter[str] = Counter()  # why a window stayed on replay
        self.not_dynamic: Counter[str] = Counter()  # why a varying shape stayed per-shape
        self.run_alone: Counter[str] = Counter()  # nodes of compiled regions run outside compiled code

    def as_dict(self) -> dict:
        return {
            "corrupt_entries": sum(s.corrupt_entries + s.incompatible_entries for s in list(_STORES.values())),
            "regions_compiled": self.regions_compiled,
            "compile_seconds": round(self.compile_seconds, 3),
            "cache_hits_memory": self.cache_hits_memory,
            "cache_misses": self.cache_misses,
            "replayed_regions": self.replayed_regions,
            "compiled_runs": self.compiled_runs,
            "recompiles": dict(self.recompiles),
            "blacklisted": self.blacklisted,
            "compile_failures": self.compile_failures,
            "compiles": self.regions_compiled,
            "cache_hits_disk": self.cache_hits_disk,
            "waited_for_other_process": self.waited_for_other_process,
            "not_compiled": dict(self.not_compiled),
            "not_dynamic": dict(self.not_dynamic),
            "run_alone": dict(self.run_alone),
        }


STATS = RegionStats()


class _Entry:
    __slots__ = ("seen", "run", "n_live", "mutated", "inplace", "blacklisted", "future", "lifted_inputs", "group",
                 "program", "pkey", "other_process", "counts", "region", "shape_class", "shape", "dynamic")

    def __init__(self):
        # short id for logs and the profiler: pkey[:8] once the persistent key is known
        self.region = f"{next(_REGION_IDS):08x}"
        self.shape_class: _ShapeClass | None = None  # Note [Dynamic shapes]
        # this structure's sizes and int arguments, in class order; None: not routed to a symbolic region
        self.shape: tuple | None = None
        self.dynamic = False  # a symbolic region (the compile of a _ShapeClass)
        self.future = None  # a compile in flight
        self.seen = 0
        self.run = None  # the loaded compiled callable
        self.n_live = 0
        self.mutated: tuple[int, ...] = ()
        self.inplace = False  # the compiled region writes ``mutated`` itself (Note [In-place regions])
        self.blacklisted = False
        self.lifted_inputs: list[tuple[int, torch.dtype]] = []  # (index in Window.scalars, dtype)
        self.group = None
        self.program: Program | None = None
        self.pkey: str | None = None  # persistent key (Program.digest), computed at first sight
        self.other_process = False  # another process holds the compile claim for pkey
        self.counts = (0, 0)  # (ops computed, ops dead) of this structure, for metrics()


class RegionCache:
    """In-memory LRU of regions by key (Note [Region key])."""

    def __init__(self, max_entries: int = 1024):
        self.entries: OrderedDict = OrderedDict()
        self.max_entries = max_entries
        self._last: _Entry | None = None  # the entry the last get returned: the most recent one

    def get(self, key) -> _Entry:
        e = self.entries.get(key)
        if e is None:
            e = self.entries[key] = _Entry()
            if len(self.entries) > self.max_entries:
                self.entries.popitem(last=False)
        elif e is not self._last:
            # move_to_end hashes and compares the key again (a whole window's signature); a loop
            # that hits one region every flush finds it last already. Only get inserts or moves
            # entries, each a distinct object, so an entry found that is ``_last`` is the last one.
            self.entries.move_to_end(key)
        self._last = e
        return e

    def clear(self) -> None:
        self.entries.clear()
        self._last = None


CACHE = RegionCache()


def _inputs_alias(window: Window) -> bool:
    """Whether a written real input shares storage with another real input.

    The graph treats each slot as its own buffer; two slots over one storage with a write through
    one of them (``p`` and ``p.view(-1)``) cannot be expressed, so such windows are replayed.
    """
    if not window.mutated:
        return False
    seen: dict[int, int] = {}
    mutated_storages = set()
    for slot, t in enumerate(window.real_inputs):
        sid = _untyped_storage(t)._cdata
        if slot in window.mutated:
            mutated_storages.add(sid)
        seen[sid] = seen.get(sid, 0) + 1
    return any(seen[s] > 1 for s in mutated_storages)


LIFT_AFTER = 2  # a float argument that changed this many times becomes a runtime input


class _Group:
    """What windows of one structure (scalar values aside) have shown: Note [Scalar lifting]."""

    __slots__ = ("last", "changes", "lifted", "unliftable", "keep")

    def __init__(self):
        self.last: tuple | None = None
        self.changes: Counter[int] = Counter()
        self.lifted: tuple[int, ...] = ()
        self.unliftable = False  # the compiled graph could not take these floats as inputs
        self.keep: list[bool] | None = None  # per scalar: not lifted (the baked ones), for compress


_GROUPS: OrderedDict = OrderedDict()


def _scalar_key(structure, scalars: list) -> tuple:
    """The part of a region key that scalar values contribute, after lifting the ones that vary."""
    group = _GROUPS.get(structure)
    if group is None:
        group = _GROUPS[structure] = _Group()
        if len(_GROUPS) > CACHE.max_entries:
            _GROUPS.popitem(last=False)
    values = tuple(scalars)
    last = group.last
    baked = None
    if last is not None and values != last and len(values) == len(last) and not group.unliftable:
        if group.lifted:  # the lifted values change every window: look further only if others do
            keep = _keep(group, len(values))
            baked = tuple(_compress(values, keep))
            changed = baked != tuple(_compress(last, keep))
        else:
            changed = True
        if changed:
            lifted = set(group.lifted)
            for i, (a, b) in enumerate(zip(values, last)):
                if a != b and i not in lifted:
                    group.changes[i] += 1
                    if group.changes[i] >= LIFT_AFTER:
                        lifted.add(i)
            if len(lifted) != len(group.lifted):
                group.lifted = tuple(sorted(lifted))
                group.keep = baked = None
                _recompile("scalar_lifted", None)
    group.last = values
    if not group.lifted:
        return (group, (), values)
    if baked is None:
        baked = tuple(_compress(values, _keep(group, len(values))))
    return (group, group.lifted, baked)


def _keep(group: _Group, n: int) -> list[bool]:
    """Per scalar of the group's windows: whether it is baked (not lifted), for ``compress``."""
    keep = group.keep
    if keep is None or len(keep) != n:
        lifted = set(group.lifted)
        keep = group.keep = [i not in lifted for i in range(n)]
    return keep


# Note [One lock for the region tables]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Threads with the mode on share this module's tables (CACHE and its entries, _GROUPS, _CLASSES,
# _FAMILIES, _PENDING, _JOBS, _STORES, STATS, the compile queue), and update them in several
# steps: ``_describe`` sets an entry's ``program`` before its ``pkey`` (a second thread claimed the
# key ``None`` and died), ``_collect`` publishes ``run`` before ``lifted_inputs`` and ``inplace``,
# ``_scalar_key`` reads a group's lifted positions apart from its ``keep`` mask (a key whose baked
# values miss a lifted float: a region hit with the wrong constants). So a window's run holds
# ``_LOCK`` from its key to its last write-back.
# One lock rather than tables per thread: threads that train one structure (data-parallel
# threads, one model per thread) then share its regions' compiles, artifact loads and compiled
# code instead of paying each once per thread; a single thread pays one uncontended acquire per
# flush, well under a microsecond (benchmarks/flush_cost.py, a 1000-op window hitting its region,
# five runs each on a loaded 2-core machine: median 6.08 ms before, 5.99 ms after, runs spread
# over 1 ms). Windows of different threads run one at a time: on a CPU target their host work
# is serialized by the GIL anyway, and on CUDA a compiled region only enqueues kernels. What
# takes long without work of ours is waited for outside the lock, a compile or an artifact load
# in flight (``_collect``): a thread waiting for its compile lets the others replay and run.
_LOCK = threading.Lock()


def run(window: Window, backend, options) -> tuple[int, int, int]:
    """Run ``window`` (after ``mark_needed``) compiled when its key is hot or on disk, else by
    replay; return the launches made. Leaves ``window.outcome`` and ``window.region``."""
    with _LOCK:  # Note [One lock for the region tables]
        return _run_window(window, backend, options)


def _run_window(window: Window, backend, options) -> tuple[int, int, int]:
    live = read_liveness(window)  # the region's outputs
    mutated = tuple(sorted(window.mutated))
    if not live and not mutated and not _checks(window):
        window.outcome = "dead"
        return 0, 0, len(window.nodes)  # nothing observable: every op is dead
    wait = not options.async_compile
    structure = (tuple(window.sigs), tuple(o.uid for o in live), mutated)
    group, lifted, baked = _scalar_key(structure, window.scalars)
    entry = CACHE.get((group, lifted, baked))  # the group stands for the structure: Note [Region key]
    entry.group = group
    if entry.future is not None and (wait or entry.future.done()):
        _collect(entry)
    window.region = entry.region
    if entry.run is not None:
        STATS.cache_hits_memory += 1
        window.outcome = "compiled"
        return _run_or_replay(entry, window, live)
    return _miss(entry, window, live, mutated, lifted, backend, options, wait)


def _miss(entry: _Entry, window: Window, live: list[Out], mutated, lifted, backend, options, wait: bool):
    entry.seen += 1
    if entry.blacklisted:
        return _replay(window)
    if entry.future is not None:
        return _replay(window, "compiling")
    if entry.other_process:
        poll_jobs()
    if entry.seen == 1 or entry.other_process:
        # A region compiled by an earlier run or another process is used at first sight.
        reason = _not_compilable(window)
        if reason is not None:
            STATS.not_compiled[reason] += 1
            entry.blacklisted = True
            return _replay(window)
        store = _store(options)
        if entry.program is None:
            _describe(entry, window, live, mutated, lifted, backend)
        data = store.get(entry.pkey, fingerprint=backend.fingerprint())
        if data is None and entry.other_process and _abandoned(entry, store):
            entry.other_process = False  # compiled below, by this process
        if data is not None:
            entry.other_process = False
            entry.future = _submit(_load, data, backend, store, entry.pkey, False)
            if not wait:
                # the first load in a process imports Inductor (~1-2 s): replay meanwhile
                return _replay(window, "compiling")
            _collect(entry)
            if entry.run is not None:
                window.outcome = "loaded"
                return _run_or_replay(entry, window, live)
    if entry.shape is not None and entry.shape_class.dynamic_ok and getattr(backend, "dynamic_shapes", False):
        done = _run_dynamic(entry, window, live, backend, options, wait)
        if done is not None:
            return done
    if entry.seen >= options.hot_after and not entry.blacklisted and not entry.other_process:
        STATS.cache_misses += 1
        store = _store(options)
        if entry.program is None:
            _describe(entry, window, live, mutated, lifted, backend)
        if _failed_before(entry, store, backend):
            return _replay(window)
        if not store.claim(entry.pkey):
            # another process is compiling this region: replay meanwhile, pick it up from disk
            if not entry.other_process:
                STATS.waited_for_other_process += 1
            entry.other_process = True
            return _replay(window, "compiling")
        cause = _static_cause(entry)
        if cause is not None:
            _recompile(cause, entry.region)
        if wait:
            _compile_here(entry, backend, store)
            entry.program = None
            if entry.run is not None:
                window.outcome = "compiled"
                return _run_or_replay(entry, window, live)
        else:
            _submit_job(entry, backend, store, options)
            return _replay(window, "compiling")
    return _replay(window)


def _describe(entry: _Entry, window: Window, live: list[Out], mutated, lifted, backend) -> None:
    """What a compile needs (the Program and its persistent key), built once per structure."""
    dead = mark_needed(window)
    entry.counts = (sum(1 for n in window.nodes if n.needed and not n.is_view), dead)
    entry.program = Program.from_window(window, live, mutated, lifted,
                                        inplace=getattr(backend, "writes_inputs", False))
    entry.pkey = entry.program.digest(backend.fingerprint())
    entry.region = entry.pkey[:8]
    entry.n_live, entry.mutated = len(live), mutated
    window.region = entry.region
    _classify(entry)


def _compile_here(entry: _Entry, backend, store) -> None:
    """Compile ``entry.program`` in this process and wait for it (Note [Compile thread])."""
    if _profiler._is_profiler_enabled:
        with _record_function("adaptive_eager.compile"):
            entry.future = _submit(_compile_and_store, entry.program, backend, store, entry.pkey)
            _collect(entry)
    else:
        entry.future = _submit(_compile_and_store, entry.program, backend, store, entry.pkey)
        _collect(entry)


def _recompile(cause: str, region: str | None) -> None:
    STATS.recompiles[cause] += 1
    if log.isEnabledFor(logging.INFO):
        log.info("adaptive_eager: recompiling region %s: %s", region or "(new key)", cause)


# Note [Dynamic shapes]
# ~~~~~~~~~~~~~~~~~~~~~
# The exact key (Note [Region key]) holds every shape, so a loop over batch sizes would compile each
# region once per size. On an exact-key miss (never on a hit: a hit costs what it always did), the
# structure's Program is split into a *shape class* (everything but the ints: ops, dataflow,
# dtypes, devices, floats, live outputs, written inputs, lifted floats) and a *shape* (the ints:
# input sizes and strides and every int argument, in one fixed order). Once a class has shown two
# shapes, the positions that differ are explained by symbols: each varying input dimension whose
# values (across the shapes seen) form a new column is a symbol; a varying int argument must be a
# fixed multiple of a symbol (``x.view(B, -1)``, ``mean``'s ``div(grad, B * 10)``); an input with a
# symbolic dimension must be contiguous. Anything else (a size that is B - 1, a strided input) is
# counted in ``STATS.not_dynamic`` and the class stays per-shape, as before.
# The class is then compiled once symbolically (``Program.dims``/``_Sym`` arguments, make_fx with a
# ShapeEnv whose symbols are exactly those dims, Inductor with the graph's ShapeEnv). The artifact is
# used for a new shape only if (a) every non-symbolic position equals the class's value, every
# symbolic argument is its multiple of its symbol, symbolic inputs are contiguous and every symbol is
# >= 2 (ShapeEnv specializes 0 and 1), (b) the guards Inductor recorded (e.g. ``s0 <= 4096``) hold for
# the window's inputs, and (c) at its first run for that exact key, every output's shape, stride
# and dtype equal the placeholders the program already holds (checked before anything is written;
# a mismatch replays). The exact key is then registered with the symbolic callable, so its next
# window is a plain hit. A failed symbolic compile blacklists only the class's symbolic entry.
# The symbolic Program's persistent key leaves out the hint sizes, so another process that sees the
# same varying dims loads it from the store.
SHAPE_CLASSES_MAX = 1024
MAX_SHAPES = 8  # shapes remembered per class (only their differences matter)


class _Hole:
    """An int of a Program in its shape-class key."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "#"


_HOLE = _Hole()


class _ShapeClass:
    __slots__ = ("shapes", "where", "pattern", "reps", "dims", "dyn_slots", "base", "sym", "compiled",
                 "dynamic_ok", "family")

    def __init__(self, where: list, family):
        self.shapes: list[tuple] = []  # distinct shapes seen
        self.where = where  # per shape position: ("size"|"stride", slot, dim) or None for an argument
        self.pattern: list | None = None  # per position: None (fixed), "contiguous", or (symbol, factor)
        self.reps: list[tuple[int, int]] = []  # symbol k -> its (slot, dim)
        self.dims: list[tuple[int, int, int]] = []
        self.dyn_slots: set[int] = set()
        self.base: tuple | None = None
        self.sym: _Entry | None = None  # the symbolic region
        self.compiled = 0  # static compiles of this class
        self.dynamic_ok = True
        self.family = family  # the class key with dtypes erased: tells a "new_dtype" recompile


_CLASSES: OrderedDict = OrderedDict()
_FAMILIES: dict = {}  # dtype-erased class key -> the class that compiled first


def _shape_key(program: Program, erase_dtypes: bool = False):
    """(class key, shape, where): Note [Dynamic shapes]. The walk order is ``_with_symbols``'s."""
    values: list[int] = []
    where: list = []

    def walk(x):
        t = type(x)
        if t is int:
            values.append(x)
            where.append(None)
            return _HOLE
        if t is list or t is tuple:
            return (t, tuple(walk(v) for v in x))
        if t is dict:
            return (dict, tuple((k, walk(v)) for k, v in x.items()))
        if t is _Ref:
            return ("%", x.uid)
        if t is _In:
            return ("in", x.slot)
        if t is _Lifted:
            return ("lifted", x.index)
        if erase_dtypes and t is torch.dtype:
            return "dtype"
        return x

    ops = tuple((func, walk(args), walk(kwargs), tuple(None if o is None else (o[0], o[1], walk(o[2])) for o in outs))
                for func, args, kwargs, outs in program.ops)
    inputs = []
    for slot, (shape, stride, dtype, device) in enumerate(program.inputs):
        for d, n in enumerate(shape):
            values.append(n)
            where.append(("size", slot, d))
        for d, n in enumerate(stride):
            values.append(n)
            where.append(("stride", slot, d))
        inputs.append((len(shape), "dtype" if erase_dtypes else dtype, device))
    key = (ops, tuple(inputs), tuple(program.live), tuple(program.mutated), tuple(program.lifted))
    return key, tuple(values), where


def _classify(entry: _Entry) -> None:
    """File the structure's shape under its class (at first sight of an exact key only)."""
    try:
        key, shape, where = _shape_key(entry.program)
        cls = _CLASSES.get(key)
    except TypeError:  # an unhashable argument: no class, per-shape as before
        STATS.not_dynamic["unhashable_argument"] += 1
        return
    if cls is None:
        cls = _CLASSES[key] = _ShapeClass(where, None)
        if len(_CLASSES) > SHAPE_CLASSES_MAX:
            _CLASSES.popitem(last=False)
    entry.shape_class = cls
    entry.shape = shape
    if shape not in cls.shapes and len(cls.shapes) < MAX_SHAPES:
        cls.shapes.append(shape)
        if cls.pattern is not None and cls.sym is None:
            cls.pattern = None  # not compiled yet: plan again with the new shape


def _static_cause(entry: _Entry) -> str | None:
    """Why a static compile of ``entry`` is a recompile: its class compiled another shape
    ("new_shape"), or the same program with other dtypes compiled ("new_dtype")."""
    cls = entry.shape_class
    if cls is None:
        return None
    cls.compiled += 1
    if cls.compiled > 1 or cls.sym is not None:
        return "new_shape"
    if cls.family is None and entry.program is not None:
        try:
            cls.family = _shape_key(entry.program, erase_dtypes=True)[0]
            first = _FAMILIES.setdefault(cls.family, cls)
        except TypeError:
            return None
        if first is not cls:
            return "new_dtype"
    return None


def _contiguous(shape) -> tuple:
    strides, n = [], 1
    for d in reversed(shape):
        strides.append(n)
        n *= d
    return tuple(reversed(strides))


def _plan(cls: _ShapeClass) -> str | None:
    """Explain the positions that vary between the class's shapes by symbols; the reason not, or None."""
    columns = list(zip(*cls.shapes))
    varying = [i for i, col in enumerate(columns) if len(set(col)) > 1]
    pattern: list = [None] * len(columns)
    symbols: dict[tuple, int] = {}
    reps, dims = [], []
    for i in varying:
        w = cls.where[i]
        if w is not None and w[0] == "size":
            k = symbols.get(columns[i])
            if k is None:
                k = symbols[columns[i]] = len(reps)
                reps.append((w[1], w[2]))
            dims.append((w[1], w[2], k))
            pattern[i] = (k, 1)
    if not reps:
        return "no_varying_input_size"
    dyn_slots = {slot for slot, _, _ in dims}
    for i, w in enumerate(cls.where):
        if w is not None and w[0] == "stride" and w[1] in dyn_slots:
            pattern[i] = "contiguous"
    for i in varying:
        w = cls.where[i]
        if w is not None:
            if w[0] == "stride" and w[1] not in dyn_slots:
                return "varying_stride"
            continue
        col = columns[i]
        for column, k in symbols.items():
            if column[0] and col[0] % column[0] == 0:
                factor = col[0] // column[0]
                if factor >= 1 and all(a == factor * b for a, b in zip(col, column)):
                    pattern[i] = (k, factor)
                    break
        else:
            return "derived_size"
    for shape in cls.shapes:
        for slot in dyn_slots:
            sizes = [shape[i] for i, w in enumerate(cls.where) if w is not None and w[0] == "size" and w[1] == slot]
            strides = [shape[i] for i, w in enumerate(cls.where) if w is not None and w[0] == "stride" and w[1] == slot]
            if tuple(strides) != _contiguous(sizes):
                return "non_contiguous_input"
    cls.pattern, cls.reps, cls.dims, cls.dyn_slots, cls.base = pattern, reps, dims, dyn_slots, cls.shapes[0]
    return None


def _fits(cls: _ShapeClass, shape: tuple) -> str | None:
    """Whether the symbolic region of ``cls`` computes ``shape`` (its guards aside); else why not."""
    pattern, where = cls.pattern, cls.where
    values = []
    for slot, d in cls.reps:
        i = where.index(("size", slot, d))
        values.append(shape[i])
    if min(values) < 2:
        return "size_0_or_1"
    base = cls.base
    for i, p in enumerate(pattern):
        if p is None:
            if shape[i] != base[i]:
                return "other_fixed_size"
        elif p != "contiguous" and shape[i] != p[1] * values[p[0]]:
            return "other_size_relation"
    for slot in cls.dyn_slots:
        sizes = [shape[i] for i, w in enumerate(where) if w is not None and w[0] == "size" and w[1] == slot]
        strides = [shape[i] for i, w in enumerate(where) if w is not None and w[0] == "stride" and w[1] == slot]
        if tuple(strides) != _contiguous(sizes):
            return "non_contiguous_input"
    return None


def _with_symbols(program: Program, cls: _ShapeClass) -> Program:
    """``program`` with the class's symbolic ints as ``_Sym`` arguments and its dims symbolic."""
    pattern = iter(cls.pattern)

    def walk(x):
        t = type(x)
        if t is int:
            p = next(pattern)
            return _Sym(*p) if type(p) is tuple else x
        if t is list:
            return [walk(v) for v in x]
        if t is tuple:
            return tuple(walk(v) for v in x)
        if t is dict:
            return {k: walk(v) for k, v in x.items()}
        return x

    ops = [(func, walk(args), walk(kwargs), [None if o is None else (o[0], o[1], walk(o[2])) for o in outs])
           for func, args, kwargs, outs in program.ops]
    return Program(ops, program.inputs, program.live, program.mutated, program.lifted, program.scalars,
                   cls.reps, cls.dims, default_dtype=program.default_dtype)


def _run_dynamic(entry: _Entry, window: Window, live: list[Out], backend, options, wait: bool):
    """Run ``window`` with its class's symbolic region (compiling it when due); None: per-shape."""
    cls = entry.shape_class
    sym = cls.sym
    if sym is None:
        if len(cls.shapes) < 2 or entry.program is None:
            return None
        if any(is_check(op[0]) for op in entry.program.ops):
            # a split region compiles per shape (Note [Partitions])
            STATS.not_dynamic["run_alone"] += 1
            cls.dynamic_ok = False
            return None
        if cls.pattern is None:
            why = _plan(cls)
            if why is not None:
                STATS.not_dynamic[why] += 1
                cls.dynamic_ok = False
                return None
        if _fits(cls, entry.shape) is not None:
            return None  # not a window to take the hints from (a size of 1): per-shape meanwhile
        sym = cls.sym = _Entry()
        sym.dynamic = True
        sym.program = _with_symbols(entry.program, cls)
        sym.pkey = sym.program.digest(backend.fingerprint())
        sym.region = sym.pkey[:8]
        sym.n_live, sym.mutated, sym.counts = entry.n_live, entry.mutated, entry.counts  # Note [Derived entries]
    outcome = "compiled"
    if sym.future is not None and (wait or sym.future.done()):
        _collect(sym)
    if sym.run is None and not sym.blacklisted and sym.future is None:
        store = _store(options)
        if sym.other_process:
            poll_jobs()
        data = store.get(sym.pkey, fingerprint=backend.fingerprint())
        if data is None and sym.other_process and _abandoned(sym, store):
            sym.other_process = False  # compiled below, by this process
        if data is not None:
            sym.other_process = False
            sym.future = _submit(_load, data, backend, store, sym.pkey, True)
            if wait:
                _collect(sym)
                outcome = "loaded"
        elif not sym.other_process and not _failed_before(sym, store, backend):
            if not store.claim(sym.pkey):
                sym.other_process = True
                STATS.waited_for_other_process += 1
            else:
                _recompile("dynamic", sym.region)
                if wait:
                    _compile_here(sym, backend, store)
                else:
                    _submit_job(sym, backend, store, options)
    if sym.blacklisted:
        entry.shape = None
        return None
    if sym.run is None:
        return _replay(window, "compiling")
    why = _fits(cls, entry.shape) or _guards_fail(sym.run, window)
    if why is not None:
        STATS.not_dynamic[why] += 1
        entry.shape = None  # this exact key goes per-shape
        return None
    window.region = sym.region
    try:
        launched = _run_checked(sym, entry, window, live)
    except _Mismatch as e:
        STATS.not_dynamic["output_mismatch"] += 1
        log.info("adaptive_eager: region %s does not fit a shape it was routed: %s", sym.region, e)
        entry.shape = None
        return _replay(window)
    except Exception as e:  # noqa: BLE001 - never the program's problem: replay
        # as in _run_or_replay: a replay that raises too means the data is at fault (eager's
        # error, the symbolic region stays); one that succeeds means the region was wrong here
        done = _replay(window)
        _blacklist(sym, f"run failed: {type(e).__name__}: {e}")
        entry.shape = None  # the class goes per-shape
        return done
    # registered (``_run_checked`` adopted the region): this exact key's next window is a plain hit
    window.outcome = outcome
    return (launched, *entry.counts)


def _guards_fail(run, window: Window) -> str | None:
    code = getattr(run, "guards", None)
    if code is None:
        return None
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    try:
        ok = eval(code, SYMPY_INTERP, {"L": {f"t{i}": t for i, t in enumerate(window.real_inputs)}})
    except Exception:  # noqa: BLE001 - a guard it cannot evaluate: do not use the region
        return "guard_error"
    return None if ok else "guards"


class _Mismatch(Exception):
    """A symbolic region's output is not what the recorded placeholder says (Note [Dynamic shapes])."""


def _run_checked(sym: _Entry, entry: _Entry, window: Window, live: list[Out]) -> int:
    """``_run_compiled`` for the first window of an exact key on a symbolic region: every output's
    metadata is checked against the program's placeholders before anything is written. Then the
    exact key takes the symbolic region's callable (``_adopt``)."""
    inputs = _inputs(sym, window)
    with as_recorded():
        outs = sym.run(inputs)
        if len(outs) != sym.n_live + len(sym.mutated):
            raise _Mismatch(f"{len(outs)} outputs for {sym.n_live + len(sym.mutated)}")
        real = window.real_inputs
        restride = []
        for i, (o, r) in enumerate(zip(live, outs)):
            shape, stride, dtype = tuple(o.meta[0]), tuple(o.meta[1]), o.meta[2]
            if tuple(r.shape) != shape or r.dtype != dtype:
                raise _Mismatch(f"output {tuple(r.shape)} {r.dtype} for placeholder {shape} {dtype}")
            if tuple(r.stride()) != stride:
                restride.append((i, shape, stride))
        for slot, r in zip(sym.mutated, outs[sym.n_live:]):
            if r.shape != real[slot].shape or r.dtype != real[slot].dtype:
                raise _Mismatch(f"written input {slot}: {tuple(r.shape)} for {tuple(real[slot].shape)}")
        if restride:
            # Inductor does not always keep eager's layout for symbolic outputs (a transposed
            # result comes back contiguous): this exact key's callable copies those outputs into
            # eager's layout, so the program sees eager strides.
            STATS.not_dynamic["restrided_output"] += 1
            sym_run = restrided(sym.run, restride)
            outs = sym_run.fix(outs)
        else:
            sym_run = sym.run
        launched = _write(sym, window, live, outs) + len(restride)
    _adopt(entry, sym, sym_run)
    return launched


def _adopt(entry: _Entry, source: _Entry, run) -> None:
    """Register ``run`` (``source``'s compiled callable, or a wrapper of it) as ``entry``'s.

    Note [Derived entries]
    An entry's ``run`` is called, and its outputs written, by what the compile of ``run`` decided,
    not by the program the entry was recorded with: which scalars it takes (``lifted_inputs``), how
    many outputs are live values (``n_live``), which inputs follow them (``mutated``), and whether
    the kernels write those inputs themselves (``inplace``: a symbolic region never does, the static
    program of the same window may). An entry that takes a callable it did not compile takes all
    of these with it, here; one that compiles or loads its own gets the compile's answers with
    ``run`` (``_collect``), and ``n_live``/``mutated`` from its program (``_describe``). A symbolic
    region starts from the structure of the entry that made it (``_run_dynamic``): its class key
    holds the live outputs and written inputs, so they are the same for every exact key it serves.
    """
    entry.run = run
    entry.lifted_inputs = source.lifted_inputs
    entry.n_live, entry.mutated = source.n_live, source.mutated
    entry.inplace = source.inplace
    entry.region = source.region


# Note [Background compiles]
# With async_compile, a hot region is compiled in a worker *process* (neff_cache.CompileJobs),
# never a thread of this process: Inductor saves and restores the global RNG state around a
# compile, which would rewind the random numbers the program draws meanwhile. The program keeps
# replaying; the artifact lands in the store, and the region's next window loads it.
_JOBS: dict = {}
_PENDING: dict = {}  # persistent key -> entry waiting for a background compile


def _jobs(store, options):
    from neff_cache import CompileJobs

    jobs = _JOBS.get(id(store))
    if jobs is None:
        jobs = _JOBS[id(store)] = CompileJobs(store, max_workers=1, finish_after_exit_s=options.compile_after_exit_s)
    return jobs


def _submit_job(entry: _Entry, backend, store, options) -> None:
    store.release(entry.pkey)  # CompileJobs claims the key itself
    payload = json.dumps({"backend": backend.name, "device": options.device, "key": entry.pkey,
                          "program": entry.program.to_bytes().decode()}).encode()
    try:
        submitted = _jobs(store, options).submit(
            entry.pkey, "fuser.compiled:compile_job", payload, fingerprint=backend.fingerprint(), backend=backend.name
        )
    except Exception as e:  # noqa: BLE001 - an unserializable argument: compile synchronously instead
        log.info("adaptive_eager: compiling in this process: %s", e)
        _compile_here(entry, backend, store)
        return
    entry.other_process = True  # picked up from the store at a later sight
    _PENDING[entry.pkey] = entry
    if not submitted:
        STATS.waited_for_other_process += 1


def poll_jobs() -> None:
    """Collect finished background compiles (their artifacts are then in the store)."""
    for jobs in _JOBS.values():
        for result in jobs.poll():
            entry = _PENDING.pop(result.key, None)
            STATS.compile_seconds += result.seconds
            if result.ok:
                STATS.regions_compiled += 1
                log.info("adaptive_eager: compiled region %s in a worker process in %.2fs (key %s)", result.key[:8],
                         result.seconds, result.key)
            elif entry is None:
                STATS.compile_failures += 1
            else:
                entry.other_process = False
                _compile_failed(entry, result.failure or result.error.splitlines()[0], "background compile failed")


def _abandoned(entry: _Entry, store) -> bool:
    """Whether the compile of ``entry`` that this process waits for will never land: no job of ours
    runs it and nobody holds its claim (its holder failed or died: Note [Claim holders] in
    neff_cache.store), so this process compiles it."""
    return entry.pkey not in _PENDING and not store.is_claimed(entry.pkey)


def _failed_before(entry: _Entry, store, backend) -> bool:
    """Whether compiling ``entry`` failed in an earlier process (Note [Remembered failures] in
    neff_cache.store); if so it is handled as that failure was, without compiling again."""
    reason = store.failure(entry.pkey, fingerprint=backend.fingerprint())
    if reason is None:
        return False
    _compile_failed(entry, reason, f"compile failed in an earlier process (remembered in {store.directory})",
                    attempted=False)
    return True


def _replay(window: Window, outcome: str = "replayed") -> tuple[int, int, int]:
    window.outcome = outcome
    STATS.replayed_regions += 1
    dead = mark_needed(window)
    launched = replay_window(window)
    return launched, sum(1 for n in window.nodes if n.needed and not n.is_view), dead


def _run_or_replay(entry: _Entry, window: Window, live: list[Out]) -> tuple[int, int, int]:
    check = type(entry.run) is _Unverified  # Note [Artifacts from disk]
    try:
        if _profiler._is_profiler_enabled:
            with _record_function(f"adaptive_eager.region[{entry.region}]"):
                launched = _run_compiled(entry, window, live, check)
        else:
            launched = _run_compiled(entry, window, live, check)
    except Exception as e:  # never the program's problem: replay
        # Replay raises eager's own error when the data is at fault (an index out of range, a
        # singular matrix's check): the region is sound and stays. If replay succeeds, the
        # compiled code was wrong for this window: blacklist it.
        done = _replay(window)
        if check:
            entry.run.store.discard(entry.pkey, f"its first run failed: {type(e).__name__}: {e}")
        _blacklist(entry, f"run failed: {type(e).__name__}: {e}")
        return done
    if check:
        entry.run = entry.run.run
    return (launched, *entry.counts)


def _checks(window: Window) -> bool:
    """Whether the window has ops that exist only to raise (Note [Partitions])."""
    return any(is_check(n.func) for n in window.nodes if not n.is_view)


def _not_compilable(window: Window) -> str | None:
    if _inputs_alias(window):
        return "aliased_inputs"
    if _writes_overlapping(window):
        return "overlapping_write"
    return None


def _compile_failed(entry: _Entry, reason: str, what: str, attempted: bool = True) -> None:
    """``entry``'s compile failed with ``reason`` (``_failure_reason``), in this process or, when not
    ``attempted`` here, in an earlier one."""
    if reason.startswith(_LIFT_ERROR):
        # The floats cannot be graph inputs: from now on windows of this structure are keyed by
        # their values (each value compiles once it is hot) instead.
        log.info("adaptive_eager: float arguments stay compile-time constants: %s", reason)
        STATS.not_compiled["unliftable_scalars"] += 1
        entry.blacklisted = True
        if entry.group is not None:
            entry.group.unliftable = True
            entry.group.lifted = ()
            entry.group.keep = None
        return
    if attempted:
        STATS.compile_failures += 1
    else:
        STATS.not_compiled["failed_before"] += 1
    _blacklist(entry, f"{what}: {reason}")


_WRITES: dict = {}  # OpOverload -> the positions (and keyword names) of the arguments it writes


def _writes_overlapping(window: Window) -> bool:
    """Whether a node writes through a tensor whose elements share memory (a dimension of stride 0:
    ``x[0].expand(3, 4).fill_(2)``, which eager allows for ``fill_`` and ``zero_``). The functional
    graph makes that one value per element and writes them back through the expand's inverse, which
    sums them (``fill_(2)`` of a 3-row expand stored 6), so such windows replay. Eager refuses the
    other ops that would write so (Note [Overlapping writes] in adaptive_eager._tracer)."""
    for node in window.nodes:
        if not node.mutates or node.is_view:
            continue
        positions = _WRITES.get(node.func)
        if positions is None:
            positions = _WRITES[node.func] = tuple(
                a.name if a.kwarg_only else i for i, a in enumerate(node.func._schema.arguments)
                if a.alias_info is not None and a.alias_info.is_write)
        for p in positions:
            arg = node.kwargs.get(p) if type(p) is str else (node.args[p] if p < len(node.args) else None)
            for x in (arg if type(arg) in (list, tuple) else (arg,)):
                meta = x.meta if type(x) is Out else (x.shape, x.stride()) if isinstance(x, torch.Tensor) else None
                if meta is not None and any(st == 0 and n > 1 for n, st in zip(meta[0], meta[1])):
                    return True
    return False


def _blacklist(entry: _Entry, why: str) -> None:
    entry.run = None
    entry.blacklisted = True
    STATS.blacklisted += 1
    log.warning("adaptive_eager: a region was blacklisted and will be replayed: %s", why)


def _run_compiled(entry: _Entry, window: Window, live: list[Out], check: bool = False) -> int:
    # Only the call can fail (a compiled kernel's check, e.g. an out-of-range index); nothing is
    # written before it returns, so a failure leaves the window intact for replay, which raises
    # eager's own error. ``check``: the outputs' metadata is checked first (Note [Artifacts from disk]).
    inputs = _inputs(entry, window)
    with as_recorded():
        outs = entry.run(inputs)
        if check:
            _check_outputs(entry, window, live, outs)
        return _write(entry, window, live, outs)


def _inputs(entry: _Entry, window: Window) -> list[torch.Tensor]:
    """What ``entry.run`` takes: the real inputs by slot, then the lifted floats (Note [Scalar lifting])."""
    inputs = list(window.real_inputs)
    if entry.lifted_inputs:
        scalars = window.scalars
        inputs += [_scalar_tensor(scalars[i], dtype=dt) for i, dt in entry.lifted_inputs]
    return inputs


def _write(entry: _Entry, window: Window, live: list[Out], outs) -> int:
    """Bind a compiled run's outputs and write back the inputs it does not write itself; return
    the launches (the run and its copies). Called under ``as_recorded``."""
    copies = 0
    for o, r in zip(live, outs):
        copies += _bind(o, r)
    # unless the kernels wrote parameters, optimizer state and buffers in place (their version
    # counters were bumped when the in-place ops were recorded, as eager bumps them)
    if not entry.inplace:
        real = window.real_inputs
        for slot, r in zip(entry.mutated, outs[entry.n_live:]):
            real[slot].copy_(r)  # write-back of parameters, optimizer state, buffers
        copies += len(entry.mutated)  # the copies are launches too
    STATS.compiled_runs += 1
    return 1 + copies


# Note [Artifacts from disk]
# An artifact read from the store passed its checksum, which proves only that whoever wrote it
# computed one (Note [Cache trust] in neff_cache.access). Loading checks its structure (Note
# [Artifact container], the key it was packed for, the backend's own format, a symbolic region's
# shape guards); an artifact that fails is evicted from the store (counted in corrupt_entries)
# and the region is replayed in this process. A static region loaded from disk is also
# ``_Unverified`` until its first run succeeds: the count, shapes, strides and dtypes of its
# outputs must be the placeholders' before anything is written, else the window is replayed and
# the artifact evicted. (A symbolic region's outputs are checked at each shape's first run:
# ``_run_checked``.) No check catches an artifact edited to compute other values with the same
# metadata: within the cache's trust boundary, that is the writer's power.
class _Unverified:
    """A static region's callable from disk, until its first run (Note [Artifacts from disk])."""

    __slots__ = ("run", "store")

    def __init__(self, run, store):
        self.run = run
        self.store = store  # where it came from: evicted from there if it fails

    def __call__(self, inputs):
        return self.run(inputs)


def _check_outputs(entry: _Entry, window: Window, live: list[Out], outs) -> None:
    n = entry.n_live + (0 if entry.inplace else len(entry.mutated))
    if len(outs) != n:
        raise _Mismatch(f"{len(outs)} outputs for {n}")
    for o, r in zip(live, outs):
        if (tuple(r.shape), tuple(r.stride()), r.dtype) != (tuple(o.meta[0]), tuple(o.meta[1]), o.meta[2]):
            raise _Mismatch(f"output {tuple(r.shape)} {tuple(r.stride())} {r.dtype} for placeholder "
                            f"{tuple(o.meta[0])} {tuple(o.meta[1])} {o.meta[2]}")
    real = window.real_inputs
    for slot, r in zip(entry.mutated, outs[entry.n_live:]):
        if r.shape != real[slot].shape or r.dtype != real[slot].dtype:
            raise _Mismatch(f"written input {slot}: {tuple(r.shape)} {r.dtype} for {tuple(real[slot].shape)} "
                            f"{real[slot].dtype}")


class _Ref:
    """A value produced inside the program (an ``Out.uid``)."""

    __slots__ = ("uid",)

    def __init__(self, uid: int):
        self.uid = uid

    def __repr__(self) -> str:
        return f"%{self.uid}"


class _In:
    """A real input of the program, by slot."""

    __slots__ = ("slot",)

    def __init__(self, slot: int):
        self.slot = slot

    def __repr__(self) -> str:
        return f"in{self.slot}"


class _Lifted:
    """A float argument that the compiled region takes as a runtime input (by ``Window.scalars``
    index): Note [Scalar lifting]."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"scalar{self.index}"


class _Sym:
    """An int argument that follows a dynamic size: ``factor`` times symbol ``k`` (Note [Dynamic
    shapes]); symbol ``k`` is the size of the input dimension ``Program.dynamic[k]``."""

    __slots__ = ("k", "factor")

    def __init__(self, k: int, factor: int = 1):
        self.k = k
        self.factor = factor

    def __repr__(self) -> str:
        return f"sym{self.k}" if self.factor == 1 else f"{self.factor}*sym{self.k}"


def _sentinel(k: int) -> float:
    # a quiet NaN with a payload: anything a decomposition derives from it is a NaN without the
    # payload, so a lifted float that was transformed (not just passed along) is detected
    return struct.unpack("<d", struct.pack("<Q", 0x7FF8_0ADE_0000_0000 | k))[0]


def _sentinel_index(x) -> int | None:
    if type(x) is not float or x == x:
        return None
    bits = struct.unpack("<Q", struct.pack("<d", x))[0]
    if bits & 0xFFFF_FFFF_0000_0000 != 0x7FF8_0ADE_0000_0000:
        return -1  # a NaN that is not one of ours as passed: derived from a lifted float
    return bits & 0xFFFF_FFFF


class LiftError(Exception):
    """The graph cannot take a lifted float as an input (it was transformed, or an op needs it as a
    Python number); the region is compiled with the values baked in instead."""


_LIFT_ERROR = f"{LiftError.__module__}.{LiftError.__qualname__}:"  # how a LiftError's reason begins


# Note [In-place regions]
# A region that writes real inputs (parameters, optimizer state, BatchNorm buffers) could return
# their new values for the fuser to copy back: one extra launch and one extra pass over memory per
# written tensor (600 copies for AdamW over 200 parameters). Instead, when the backend can
# (``writes_inputs``), the graph keeps functionalization's trailing ``copy_`` into its inputs and
# the compiled kernels store the new values in place. The price: a compiled run that fails half
# way has already written some inputs, so replaying the window (the fallback for a failed run)
# would apply those updates twice. So only windows that cannot fail at run time are compiled in
# place: no op reads an integer tensor (indices, targets: the out-of-range checks) and no op exists
# only for a check (``_linalg_check_errors``). Everything else keeps the copy-back.
_INT_DTYPES = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})


def _may_raise(node) -> bool:
    """Whether ``node`` can fail depending on data (Note [In-place regions])."""
    if not node.outs:
        return True
    for a in (*node.args, *node.kwargs.values()):
        for x in (a if type(a) in (list, tuple) else (a,)):
            if type(x) is Out:
                if x.meta is not None and x.meta[2] in _INT_DTYPES:
                    return True
            elif isinstance(x, torch.Tensor) and x.dtype in _INT_DTYPES:
                return True
    return False


class Program:
    """A window as plain data: no reference to the program's tensors, so it can be compiled later,
    in another thread or process, after the window itself is gone."""

    def __init__(self, ops, inputs, live, mutated, lifted=(), scalars=(), dynamic=(), dims=(), inplace=False,
                 default_dtype=None):
        self.ops = ops  # [(func, args, kwargs, [(kind, uid, alias) per output])]
        # what ``i * 1.5`` and factories without dtype= make: a window runs under the default dtype
        # it was recorded under (Note [Meta cache key] in adaptive_eager._meta), and so is traced
        self.default_dtype = default_dtype or torch.get_default_dtype()
        self.inputs = inputs  # [(shape, stride, dtype, device)] by slot
        self.live = live  # uids of the outputs, in order
        self.mutated = mutated  # slots whose final values follow the live outputs
        self.lifted = lifted  # Window.scalars indices that are runtime inputs
        self.scalars = scalars  # their values in the window compiled from (example inputs)
        # Note [Dynamic shapes]: symbol k is the size of input dimension ``dynamic[k]`` (slot, dim);
        # ``dims`` are all the input dimensions that are symbolic, as (slot, dim, k). Inputs with a
        # symbolic dimension are contiguous; ``inputs`` holds the sizes of one window (the hints).
        self.dynamic = tuple(dynamic)
        self.dims = tuple(dims)
        # Note [In-place regions]: the compiled region writes the ``mutated`` inputs itself (the
        # graph keeps functionalization's trailing copy_ nodes) instead of returning their values
        self.inplace = bool(inplace) and not self.dims

    @classmethod
    def from_window(cls, window: Window, live: list[Out], mutated: tuple[int, ...], lifted=(),
                    inplace: bool = False) -> Program:
        slots = {id(t): s for s, t in enumerate(window.real_inputs)}
        lifted_set = set(lifted)

        def enc(a):
            if type(a) is Out:
                return _Ref(a.uid)
            if type(a) is list:
                return [enc(x) for x in a]
            if isinstance(a, torch.Tensor):
                return _In(slots[id(a)])
            return a

        ops = []
        for node in window.nodes:
            if not (node.needed or node.is_view):
                continue
            outs = [None if o is None else (o.kind, o.uid, enc(o.alias) if o.kind == ALIAS else None)
                    for o in node.outs]
            kwargs = {k: enc(v) for k, v in node.kwargs.items()} if node.kwargs else {}
            args = [enc(a) for a in node.args]
            for n, pos in enumerate(node.fpos):
                index = node.fbase + n
                if index in lifted_set:
                    if type(pos) is int:
                        args[pos] = _Lifted(index)
                    elif type(pos) is str:
                        kwargs[pos] = _Lifted(index)
                    else:
                        args[pos[0]] = list(args[pos[0]])
                        args[pos[0]][pos[1]] = _Lifted(index)
            ops.append((node.func, args, kwargs, outs))
            if inplace and _may_raise(node):
                inplace = False
        inputs = [(tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device)) for t in window.real_inputs]
        scalars = tuple(window.scalars[i] for i in lifted)
        return cls(ops, inputs, [o.uid for o in live], mutated, tuple(lifted), scalars,
                   inplace=inplace and bool(mutated))

    def to_bytes(self) -> bytes:
        """JSON (OpOverloads and torch enums do not pickle): what a compile worker process gets."""
        doc = {
            "format": FORMAT,
            "ops": [[str(func), _enc(args), _enc(kwargs), [None if o is None else [o[0], o[1], _enc(o[2])] for o in outs]]
                    for func, args, kwargs, outs in self.ops],
            "inputs": [[list(shape), list(stride), str(dtype).removeprefix("torch."), device]
                       for shape, stride, dtype, device in self.inputs],
            "live": list(self.live), "mutated": list(self.mutated), "lifted": list(self.lifted),
            "scalars": list(self.scalars),
            "dynamic": [list(d) for d in self.dynamic], "dims": [list(d) for d in self.dims],
            "inplace": self.inplace, "default_dtype": str(self.default_dtype).removeprefix("torch."),
        }
        return json.dumps(doc).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Program:
        doc = json.loads(data)
        if doc.get("format") != FORMAT:
            raise ValueError(f"program format {doc.get('format')} is not {FORMAT}")
        ops = [(_op(name), _dec(args), _dec(kwargs), [None if o is None else (o[0], o[1], _dec(o[2])) for o in outs])
               for name, args, kwargs, outs in doc["ops"]]
        inputs = [(tuple(shape), tuple(stride), getattr(torch, dtype), device) for shape, stride, dtype, device in doc["inputs"]]
        return cls(ops, inputs, doc["live"], tuple(doc["mutated"]), tuple(doc["lifted"]), tuple(doc["scalars"]),
                   [tuple(d) for d in doc.get("dynamic", ())], [tuple(d) for d in doc.get("dims", ())],
                   doc.get("inplace", False), getattr(torch, doc["default_dtype"]))

    def digest(self, fingerprint: str) -> str:
        """The persistent region key: xxh3_128 of the program's structure (ops, arguments, input
        metadata, outputs, lifted floats) and the backend fingerprint. Never tensor data; the
        same in every process (Note [Region key])."""
        if not self.dims:
            text = repr((FORMAT, fingerprint, self.ops, self.inputs, self.live, self.mutated, self.lifted,
                         self.inplace, self.default_dtype))
            return xxhash.xxh3_128_hexdigest(text.encode())
        # symbolic: the sizes of the window it was made from are only hints, so not part of the key
        symbolic = {(slot, d): f"s{k}" for slot, d, k in self.dims}
        inputs = [(tuple(symbolic.get((slot, d), n) for d, n in enumerate(shape)),
                   "contiguous" if any((slot, d) in symbolic for d in range(len(shape))) else stride, dtype, device)
                  for slot, (shape, stride, dtype, device) in enumerate(self.inputs)]
        text = repr((FORMAT, fingerprint, self.ops, inputs, self.live, self.mutated, self.lifted, self.dims,
                     self.default_dtype))
        return xxhash.xxh3_128_hexdigest(text.encode())

    def example_inputs(self) -> list[torch.Tensor]:
        return [torch.empty_strided(shape, stride, dtype=dtype, device=device)
                for shape, stride, dtype, device in self.inputs]

    def graph(self) -> torch.fx.GraphModule:
        """The program as a functional ATen graph: inputs are the real tensors by slot, outputs the
        live values followed by the final values of the written real inputs."""
        from torch.fx.experimental.proxy_tensor import make_fx
        from torch.func import functionalize

        def program(*inputs):
            env: dict[int, object] = {}

            def value(a):
                if type(a) is _Ref:
                    return env[a.uid]
                if type(a) is _In:
                    return inputs[a.slot]
                if type(a) is _Lifted:
                    return _sentinel(a.index)
                if type(a) is _Sym:
                    slot, d = self.dynamic[a.k]
                    return inputs[slot].shape[d] * a.factor
                if type(a) is list:
                    return [value(x) for x in a]
                return a

            for func, args, kwargs, outs in self.ops:
                res = func(*[value(a) for a in args], **{k: value(v) for k, v in kwargs.items()})
                results = res if isinstance(res, (tuple, list)) else (res,)
                for out, r in zip(outs, results):
                    if out is not None:
                        kind, uid, alias = out
                        env[uid] = value(alias) if kind == ALIAS else r
            if self.inplace:
                return [env[u] for u in self.live]
            return [env[u] for u in self.live] + [inputs[s] for s in self.mutated]

        decompositions = None
        if self.lifted:
            # decomposed ops take numbers as Tensor arguments (mul.Tensor(x, s)), which is what
            # lets a lifted float become a graph input
            from torch._decomp import core_aten_decompositions

            decompositions = core_aten_decompositions()
        examples = self.example_inputs()
        mode = None
        if self.dims:
            examples, mode = self._symbolic_inputs(examples)
        with torch.no_grad():
            gm = make_fx(
                functionalize(program, remove="mutations"),
                decomposition_table=decompositions,
                tracing_mode="symbolic" if self.dims else "fake",
            )(*examples)
        # functionalize writes mutated inputs back with trailing copy_ nodes; the fuser does
        # write-back itself (backends take functional graphs) and those values are outputs already.
        for n in list(gm.graph.nodes):
            if n.op == "call_function" and n.target is torch.ops.aten.copy_.default and not n.users:
                if n.args[0].op == "placeholder" and not self.inplace:
                    gm.graph.erase_node(n)
        gm.graph.eliminate_dead_code(is_impure_node=partition.keep_checks)  # Note [Partitions]
        self.lifted_inputs = self._lift(gm) if self.lifted else []
        if self.lifted_inputs:
            # the new placeholders carry a value like make_fx's: partition.split and backends read it
            from torch._guards import detect_fake_mode
            from torch._subclasses.fake_tensor import FakeTensorMode

            placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
            fake = mode or detect_fake_mode([p.meta.get("val") for p in placeholders]) or FakeTensorMode()
            for ph, (_, dtype) in zip(placeholders[len(self.inputs):], self.lifted_inputs):
                ph.meta["val"] = fake.from_tensor(torch.tensor(0.0, dtype=dtype))
        if mode is not None:
            # standalone_compile(dynamic_shapes="from_graph") finds the ShapeEnv through these
            for out in next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]:
                out.meta["example_value"] = out.meta.get("val")
        gm.recompile()
        return gm

    def _symbolic_inputs(self, examples: list[torch.Tensor]):
        """Fake inputs whose ``dims`` are symbols (sizes >= 2, the hints being this program's)."""
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

        mode = FakeTensorMode(shape_env=ShapeEnv())
        symbolic = {(slot, d) for slot, d, _ in self.dims}
        fakes = []
        for slot, t in enumerate(examples):
            sizes = [DimDynamic.DYNAMIC if (slot, d) in symbolic else DimDynamic.STATIC for d in range(t.dim())]
            fakes.append(mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes)))
        return fakes, mode

    def _lift(self, gm: torch.fx.GraphModule) -> list[tuple[int, torch.dtype]]:
        """Replace the sentinel floats by new placeholders; return (scalar index, dtype) per new
        input, in order. Raises LiftError when a sentinel cannot become a tensor input."""
        graph = gm.graph
        last_input = [n for n in graph.nodes if n.op == "placeholder"][-1]
        made: dict[tuple[int, torch.dtype], torch.fx.Node] = {}
        spec: list[tuple[int, torch.dtype]] = []
        for name, buf in list(gm.named_buffers()) + list(gm.named_parameters()):
            if buf.is_floating_point() and torch.isnan(buf).any():
                raise LiftError(f"a lifted float was folded into the constant {name}")
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            schema = getattr(node.target, "_schema", None)
            for where, arg in list(enumerate(node.args)) + list(node.kwargs.items()):
                k = _sentinel_index(arg)
                if k is None:
                    continue
                if k < 0:
                    raise LiftError(f"{node.target} uses a value derived from a lifted float")
                argument = None
                if schema is not None:
                    for a in schema.arguments:
                        if (a.name == where) if type(where) is str else (schema.arguments.index(a) == where):
                            argument = a
                alpha = where == "alpha" and node.target in (torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor)
                if not alpha and (argument is None or str(argument.type) not in ("Tensor", "Optional[Tensor]")):
                    raise LiftError(f"{node.target} needs a lifted float as a Python number")
                first = next((a for a in node.args if isinstance(a, torch.fx.Node)), None)
                other = first.meta.get("val") if first is not None else None
                dtype = torch.float64 if getattr(other, "dtype", None) is torch.float64 else torch.float32
                ph = made.get((k, dtype))
                if ph is None:
                    with graph.inserting_after(last_input):
                        ph = made[(k, dtype)] = graph.placeholder(f"lifted_{k}_{len(made)}")
                    last_input = ph
                    spec.append((k, dtype))
                if alpha:
                    # x + alpha * y with alpha an input: the Scalar alpha becomes a multiply
                    with graph.inserting_before(node):
                        scaled = graph.call_function(torch.ops.aten.mul.Tensor, (node.args[1], ph))
                    scaled.meta["val"] = node.meta.get("val")
                    node.update_arg(1, scaled)
                    node.kwargs = {k: v for k, v in node.kwargs.items() if k != "alpha"}
                elif type(where) is str:
                    node.update_kwarg(where, ph)
                else:
                    node.update_arg(where, ph)
        found = {k for k, _ in spec}
        if found != set(self.lifted):
            raise LiftError("a lifted float disappeared from the graph")
        return spec

    def lifted_examples(self) -> list[torch.Tensor]:
        values = dict(zip(self.lifted, self.scalars))
        return [_scalar_tensor(values[k], dtype=dt) for k, dt in self.lifted_inputs]




def _enc(x):
    # JSON keeps 1, 1.0 and True apart; everything else is tagged
    if x is None or type(x) in (bool, int, float, str):
        return x
    if type(x) is list:
        return [_enc(v) for v in x]
    if type(x) is tuple:
        return {"$tuple": [_enc(v) for v in x]}
    if type(x) is dict:
        return {"$dict": {k: _enc(v) for k, v in x.items()}}
    if type(x) is _Ref:
        return {"$ref": x.uid}
    if type(x) is _In:
        return {"$in": x.slot}
    if type(x) is _Lifted:
        return {"$lifted": x.index}
    if type(x) is _Sym:
        return {"$sym": [x.k, x.factor]}
    tagged = encode_torch_value(x)
    if tagged is None:
        raise TypeError(f"cannot send {x!r} ({type(x).__name__}) to a compile worker")
    return tagged


def _dec(x):
    if type(x) is list:
        return [_dec(v) for v in x]
    if type(x) is not dict:
        return x
    ((tag, v),) = x.items()
    if tag == "$tuple":
        return tuple(_dec(e) for e in v)
    if tag == "$dict":
        return {k: _dec(e) for k, e in v.items()}
    if tag == "$ref":
        return _Ref(v)
    if tag == "$in":
        return _In(v)
    if tag == "$lifted":
        return _Lifted(v)
    if tag == "$sym":
        return _Sym(*v)
    return decode_torch_value(tag, v)


def _op(name: str):
    namespace, packet, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)


def compile_job(payload: bytes) -> bytes:
    """Compile-worker entry point (named by import path in neff_cache.CompileJobs): a serialized
    Program and backend name in, the packed artifact out."""
    import adaptive_eager

    adaptive_eager.disable()  # NEURON_EAGER=adaptive in the environment turned it on at import
    doc = json.loads(payload)
    from .backends import get_backend

    backend = get_backend(doc["backend"], doc["device"])
    program = Program.from_bytes(doc["program"].encode())
    torch.set_default_dtype(program.default_dtype)  # this process's, for tracing the program
    return _pack(*compile_program(program, backend), doc["key"])


_MAX_FAILED_OPS = 4  # ops retried alone after a failed compile before the region is given up


def compile_program(program: Program, backend) -> tuple[bytes, list, dict]:
    """Compile ``program`` with ``backend``: the artifact, the lifted float inputs it expects after
    the real inputs ((Window.scalars index, dtype) each), and how to run it: ``alone``, the nodes
    that run outside compiled code by reason (Note [Partitions]; none: the artifact is
    ``backend.load``'s, else ``partition.load``'s), and ``inplace``, whether it writes the mutated
    inputs itself (a split region never does: Note [Partitions])."""
    gm = program.graph()
    examples = program.example_inputs() + program.lifted_examples()
    failed: set = set()  # ops the backend failed on: retried alone (Note [Partitions])
    while True:
        alone = partition.alone(gm, backend, failed)
        if alone and program.inplace:
            program.inplace = False  # a split region writes back instead (Note [Partitions])
            gm = program.graph()
            continue
        try:
            if not alone:
                return backend.compile(gm, examples), program.lifted_inputs, {"alone": {}, "inplace": program.inplace}
            artifact = partition.split(gm, examples, alone, backend)
            return artifact, program.lifted_inputs, {"alone": partition.counts(alone), "inplace": False}
        except BackendCompileError as e:
            if e.inplace and program.inplace:
                # the compiled code would not write the inputs the graph writes (Inductor on torch
                # 2.11 reports no written inputs for a loop of add_ into one): write back instead
                log.info("adaptive_eager: %s; compiling with a write-back instead", e)
                program.inplace = False
                gm = program.graph()
                continue
            target = e.target
            if (not isinstance(target, torch._ops.OpOverload) or target in failed
                    or len(failed) >= _MAX_FAILED_OPS):
                raise
            log.info("adaptive_eager: %s; compiling the rest with it run alone", e)
            failed.add(target)


# Note [Compile thread]
# Compiles (and artifact loads) run on a thread of their own: a flush often happens inside the
# dispatch mode's __torch_dispatch__, where Python dispatch is off for the calling thread and graph
# tracing (make_fx, functionalization) cannot work; a fresh thread has clean dispatch state. The
# thread is a daemon, so a pending compile never holds the interpreter at exit. But a daemon thread
# must not still be inside torch at exit: the interpreter ends a daemon thread that wants the GIL
# back after finalization began with pthread_exit, whose unwinding through a C++ frame that
# released the GIL (every ATen call from Python does) calls std::terminate: "terminate called
# without an active exception", and the process aborts (as a Ctrl-C during an in-process compile
# did, when the main thread left the compile running). So an atexit hook stops the thread first: it raises ``_Shutdown`` in it (at
# its next Python bytecode: a running compile unwinds, releasing its claim, and a subprocess it
# waits on is killed by ``subprocess.run``) and waits up to ``_STOP_S`` for it to end. And the
# flushing thread waits for a result in slices (``_result``): the kernel may deliver a Ctrl-C's
# SIGINT to the compile thread, which does not wake the main thread from a lock wait, so an
# unbounded wait would not raise KeyboardInterrupt until the compile ended.
_QUEUE: queue.SimpleQueue | None = None
_THREAD: threading.Thread | None = None
_PID = os.getpid()  # the process the thread runs in (a forked child has the queue, not the thread)
_STOP_S = 30.0  # longer than one step of a compile can hold the thread in C code (one g++ run)


class _Shutdown(BaseException):
    """Raised in the compile thread at interpreter exit (Note [Compile thread])."""


def _worker() -> None:
    try:
        while True:
            task = _QUEUE.get()
            if task is None:
                return
            future, fn, args = task
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 - handed to the flushing thread
                    future.set_exception(e)
                    if isinstance(e, _Shutdown):
                        return
    except _Shutdown:
        return


def _submit(fn, *args) -> Future:
    if _THREAD is None or _PID != os.getpid():
        _start_compile_thread()
    future: Future = Future()
    _QUEUE.put((future, fn, args))
    return future


def _result(future: Future):
    while True:
        try:
            return future.result(timeout=0.1)  # Note [Compile thread]: a Ctrl-C is seen within 0.1 s
        except TimeoutError:
            pass


def _start_compile_thread() -> None:
    global _QUEUE, _THREAD, _PID
    _QUEUE, _PID = queue.SimpleQueue(), os.getpid()
    _THREAD = threading.Thread(target=_worker, name="adaptive_eager_compile", daemon=True)
    _THREAD.start()
    atexit.register(_stop_compile_thread)


def _stop_compile_thread() -> None:
    """Note [Compile thread]: no thread of ours may be inside torch when the interpreter finalizes."""
    thread = _THREAD
    if thread is None or _PID != os.getpid() or not thread.is_alive():
        return
    _QUEUE.put(None)  # an idle thread ends at once; a busy one is interrupted
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(_Shutdown))
    thread.join(_STOP_S)


def _after_fork_in_child() -> None:
    """A forked child has only the forking thread: no compile thread, and no lock held by another
    thread. Compiles and loads in flight belong to the parent; the child's entries start them
    again when due (Note [Worker processes] in adaptive_eager._tracer)."""
    global _THREAD, _LOCK
    _THREAD = None  # ``_submit`` starts the child's own
    _LOCK = threading.Lock()
    for entry in [*CACHE.entries.values(), *(c.sym for c in _CLASSES.values() if c.sym is not None)]:
        entry.future = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def _pack(artifact: bytes, lifted_inputs, how: dict, key: str) -> bytes:
    """What the store holds for region ``key``: Note [Artifact container], no pickle."""
    lifted = [[i, str(dt).removeprefix("torch.")] for i, dt in lifted_inputs]
    return pack_sections({"format": FORMAT, "key": key, "lifted": lifted, **how}, [artifact])


def _unpack(data: bytes, key: str):
    """``_pack``'s parts; BackendCompileError for anything this process would not have packed for ``key``."""
    header, sections = unpack_sections(data, "artifact")
    lifted, alone, inplace = header.get("lifted"), header.get("alone"), header.get("inplace")
    problem = None
    if header.get("format") != FORMAT or header.get("key") != key or len(sections) != 1:
        problem = f"it was packed as format {header.get('format')} for key {header.get('key')!r}"
    elif type(inplace) is not bool or type(alone) is not dict or not all(
            type(k) is str and type(n) is int for k, n in alone.items()):
        problem = f"how it runs is malformed: alone={alone!r}, inplace={inplace!r}"
    elif type(lifted) is not list or not all(
            type(x) is list and len(x) == 2 and type(x[0]) is int and x[0] >= 0 and type(x[1]) is str
            and isinstance(getattr(torch, x[1], None), torch.dtype) for x in lifted):
        problem = f"its lifted inputs are malformed: {str(lifted)[:200]}"
    if problem is not None:
        raise BackendCompileError(f"artifact: not one for region {key} of format {FORMAT}: {problem}")
    return sections[0], [(i, getattr(torch, dt)) for i, dt in lifted], {"alone": alone, "inplace": inplace}


def _load_artifact(artifact: bytes, how: dict, backend):
    return partition.load(artifact, backend) if how["alone"] else backend.load(artifact)


def _load(data: bytes, backend, store, key: str, dynamic: bool):
    """Load region ``key``'s artifact from ``store``; a symbolic (``dynamic``) region's must carry
    shape guards. One that does not load is evicted (Note [Artifacts from disk])."""
    try:
        artifact, lifted_inputs, how = _unpack(data, key)
        run = _load_artifact(artifact, how, backend)
        if dynamic != (getattr(run, "guards", None) is not None):
            raise BackendCompileError(f"artifact: a {'symbolic' if dynamic else 'per-shape'} region's artifact "
                                      f"{'lacks' if dynamic else 'has'} shape guards")
    except Exception as e:
        store.discard(key, f"does not load: {type(e).__name__}: {e}")
        raise
    run = run if dynamic else _Unverified(run, store)
    return run, lifted_inputs, None, how  # None: from disk, no compile


def _compile_and_store(program: Program, backend, store, pkey: str):
    t0 = time.perf_counter()
    try:
        artifact, lifted_inputs, how = compile_program(program, backend)
        seconds = time.perf_counter() - t0
        store.put(pkey, _pack(artifact, lifted_inputs, how, pkey), fingerprint=backend.fingerprint(),
                  backend=backend.name, compile_seconds=seconds)
    except Exception as e:
        store.put_failure(pkey, _failure_reason(e), fingerprint=backend.fingerprint(), backend=backend.name)
        raise
    finally:
        store.release(pkey)
    return _load_artifact(artifact, how, backend), lifted_inputs, seconds, how


def _failure_reason(error: BaseException) -> str:
    """How a failed compile is remembered: the exception as a traceback ends with it, as a compile worker
    reports it (``JobResult.failure``), so both kinds are handled alike by ``_compile_failed``."""
    return "".join(traceback.format_exception_only(error)).strip()


_STORES: dict = {}


def _store(options):
    """The persistent artifact store of ``options.cache_dir`` (one per directory and process)."""
    from neff_cache import ArtifactStore

    where = (os.path.expanduser(options.cache_dir), options.cache_size_mb, options.cache_shared, os.getpid())
    store = _STORES.get(where)
    if store is None:
        store = _STORES[where] = ArtifactStore(where[0], size_limit_mb=options.cache_size_mb,
                                               shared=options.cache_shared)
    return store


def _collect(entry: _Entry) -> None:
    """Take a finished compile's (or load's) result, blocking if it is still running (without
    ``_LOCK``, which the caller holds: Note [One lock for the region tables])."""
    future = entry.future
    if not future.done():
        _LOCK.release()
        try:
            futures_wait((future,))
        finally:
            _LOCK.acquire()
        if entry.future is not future:
            return  # another thread waited for it too, and took the result
    entry.future = None
    try:
        entry.run, lifted_inputs, seconds, how = _result(future)
    except Exception as e:  # noqa: BLE001 - any compiler failure means: replay this key
        _compile_failed(entry, _failure_reason(e), "compile failed")
        return
    entry.lifted_inputs = lifted_inputs
    entry.inplace = how["inplace"]  # the compile's answer (Note [Partitions]), also for artifacts from disk
    STATS.run_alone.update(how["alone"])
    if seconds is None:
        STATS.cache_hits_disk += 1
        return
    STATS.compile_seconds += seconds
    STATS.regions_compiled += 1
    log.info("adaptive_eager: compiled region %s%s in %.2fs (key %s)", entry.region,
             " with dynamic shapes" if entry.dynamic else "", seconds, entry.pkey)


__all__ = ["run", "Program", "compile_program", "CACHE", "STATS", "ReplayError", "VIEW"]
