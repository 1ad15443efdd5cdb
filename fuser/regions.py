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
positions and the baked scalar values. (A group dropped from ``GROUPS`` leaves its regions
unreachable; they age out of the LRU, and the structure starts a new group.) The persistent,
process-independent key (for neff_cache) is a digest of the compiled graph's code and input
metadata plus the backend fingerprint, computed only on a compile.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
from concurrent.futures import wait as futures_wait

import torch

from .artifacts import _jobs, _result, _store, _submit, compile_jobs
from .compilable import _checks, _not_compilable
from .compile import _Unverified, _compile_and_store, _failure_reason, _load
from .launch import _Mismatch, _run_checked, _run_compiled
from .lru import LRU
from .replay import mark_needed, read_liveness, replay_window
from .program import Program
from .scalars import GROUPS, _LIFT_ERROR, _scalar_key
from .shapes import _CLASSES, _FAMILIES, _classify, _fits, _guards_fail, _plan, _static_cause, _with_symbols, _ShapeClass
from .partition import is_check
from .stats import STATS, _recompile
from .window import Out, Window

log = logging.getLogger("adaptive_eager.fuser")

# ``_profiler._is_profiler_enabled`` is a module flag torch.profiler sets on start and clears on stop
# (``_run_on_profiler_start``): one attribute read, so a run pays ~nothing while no profiler records.
_profiler = torch.autograd.profiler
_record_function = torch.autograd.profiler.record_function
_REGION_IDS = itertools.count(1)


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


CACHE = LRU(_Entry)  # in-memory regions by key (Note [Region key])


def cache_clear() -> None:
    """Forget the regions, shape classes and scalar groups in memory (``fuser.cache_clear``)."""
    with _LOCK:
        CACHE.clear()
        _CLASSES.clear()
        _FAMILIES.clear()
        GROUPS.clear()


# Note [One lock for the region tables]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Threads with the mode on share the fuser's tables (CACHE and its entries, GROUPS, _CLASSES,
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
        if entry.program is None and not _describe(entry, window, live, mutated, lifted, backend):
            return _replay(window)
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
        if entry.program is None and not _describe(entry, window, live, mutated, lifted, backend):
            return _replay(window)
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


def _describe(entry: _Entry, window: Window, live: list[Out], mutated, lifted, backend) -> bool:
    """What a compile needs (the Program and its persistent key), built once per structure; False
    (the entry blacklisted) for a program the codec cannot describe, which has no persistent key."""
    dead = mark_needed(window)
    entry.counts = (sum(1 for n in window.nodes if n.needed and not n.is_view), dead)
    program = Program.from_window(window, live, mutated, lifted, inplace=getattr(backend, "writes_inputs", False))
    try:
        pkey = program.digest(backend.fingerprint())
    except TypeError as e:
        STATS.not_compiled["unencodable_argument"] += 1
        entry.blacklisted = True
        log.info("adaptive_eager: a window is replayed, not compiled: %s", e)
        return False
    entry.program, entry.pkey = program, pkey
    entry.region = entry.pkey[:8]
    entry.n_live, entry.mutated = len(live), mutated
    window.region = entry.region
    _classify(entry)
    return True


def _compile_here(entry: _Entry, backend, store) -> None:
    """Compile ``entry.program`` in this process and wait for it (Note [Compile thread])."""
    if _profiler._is_profiler_enabled:
        with _record_function("adaptive_eager.compile"):
            entry.future = _submit(_compile_and_store, entry.program, backend, store, entry.pkey)
            _collect(entry)
    else:
        entry.future = _submit(_compile_and_store, entry.program, backend, store, entry.pkey)
        _collect(entry)



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
        launched, sym_run = _run_checked(sym, window, live)
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
    _adopt(entry, sym, sym_run)  # registered: this exact key's next window is a plain hit
    window.outcome = outcome
    return (launched, *entry.counts)



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





_PENDING: dict = {}  # persistent key -> entry waiting for a background compile


def _submit_job(entry: _Entry, backend, store, options) -> None:
    store.release(entry.pkey)  # CompileJobs claims the key itself
    payload = json.dumps({"backend": backend.name, "device": options.device, "key": entry.pkey,
                          "program": entry.program.to_bytes().decode()}).encode()
    try:
        submitted = _jobs(store, options).submit(
            entry.pkey, "fuser.compile:compile_job", payload, fingerprint=backend.fingerprint(), backend=backend.name
        )
    except Exception as e:  # noqa: BLE001 - the jobs cannot take it (shut down at exit): compile here instead
        log.info("adaptive_eager: compiling in this process: %s", e)
        _compile_here(entry, backend, store)
        return
    entry.other_process = True  # picked up from the store at a later sight
    _PENDING[entry.pkey] = entry
    if not submitted:
        STATS.waited_for_other_process += 1


def poll_jobs() -> None:
    """Collect finished background compiles (their artifacts are then in the store): called when a
    region waits for one, as nothing else collects them (Note [Results are collected by poll] in
    neff_cache.jobs)."""
    for jobs in compile_jobs():
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


def _blacklist(entry: _Entry, why: str) -> None:
    entry.run = None
    entry.blacklisted = True
    STATS.blacklisted += 1
    log.warning("adaptive_eager: a region was blacklisted and will be replayed: %s", why)



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


def _after_fork_in_child() -> None:
    """A forked child has only the forking thread: no compile thread (``artifacts._submit`` starts
    the child's own), and no lock held by another thread. Compiles and loads in flight belong to
    the parent; the child's entries start them again when due (Note [Worker processes] in
    adaptive_eager._tracer)."""
    global _LOCK
    _LOCK = threading.Lock()
    for entry in [*CACHE.entries.values(), *(c.sym for c in _CLASSES.values() if c.sym is not None)]:
        entry.future = None


os.register_at_fork(after_in_child=_after_fork_in_child)
