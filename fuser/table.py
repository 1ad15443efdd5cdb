"""The region table: every window structure's entry (``_Entry``: its compiled callable, or why it
has none, and what a compile needs), kept in an LRU by region key (Note [Region key] in
``fuser.regions``), and the one lock that guards the fuser's tables. The tiers that fill and use
it are ``fuser.regions``."""

from __future__ import annotations

import itertools
import os
import threading

import torch

from .lru import LRU
from .program import Program
from .scalars import GROUPS
from .shapes import _CLASSES, _FAMILIES, _ShapeClass

_REGION_IDS = itertools.count(1)


class _Entry:
    __slots__ = ("seen", "run", "n_live", "mutated", "inplace", "blacklisted", "future", "lifted_inputs", "group",
                 "program", "pkey", "other_process", "counts", "region", "shape_class", "shape", "dynamic",
                 "outputs", "forgotten", "loading", "derived", "__weakref__")

    def __init__(self):
        # short id for logs and the profiler: pkey[:8] once the persistent key is known
        self.region = f"{next(_REGION_IDS):08x}"
        self.shape_class: _ShapeClass | None = None  # Note [Dynamic shapes]
        # this structure's sizes and int arguments, in class order; None: not routed to a symbolic region
        self.shape: tuple | None = None
        self.dynamic = False  # a symbolic region (the compile of a _ShapeClass)
        self.future = None  # a compile in flight
        self.loading = False  # ``future`` is a load of the store's artifact, not a compile (Note [Tiers])
        self.seen = 0
        self.run = None  # the loaded compiled callable
        self.n_live = 0
        self.mutated: tuple[int, ...] = ()
        self.derived: tuple = ()  # Note [Inputs over one memory] in fuser.compilable
        self.inplace = False  # the compiled region writes ``mutated`` itself (Note [In-place regions])
        self.blacklisted: str | None = None  # why it is never compiled (a memoized failure: Note [Tiers])
        self.lifted_inputs: list[tuple[int, torch.dtype]] = []  # (index in Window.scalars, dtype)
        self.group = None
        self.program: Program | None = None
        self.pkey: str | None = None  # persistent key (Program.digest), computed at first sight
        self.other_process = False  # another process holds the compile claim for pkey
        self.counts = (0, 0)  # (ops computed, ops dead) of this structure, for metrics()
        # uids of the values this structure's windows return (the live values of its key): what a
        # window validated against it must return to run it (Note [Validated windows] in fuser.regions)
        self.outputs: tuple[int, ...] | None = None
        # dropped from the tables by ``cache_clear``: no window runs validated against it any more,
        # and the tracer arms no window with it (it reads this; ``__weakref__``: it keeps its own
        # table of entries, weakly)
        self.forgotten = False


CACHE = LRU(_Entry)  # in-memory regions by key (Note [Region key] in fuser.regions)


def cache_clear() -> None:
    """Forget the regions, shape classes and scalar groups in memory (``fuser.cache_clear``)."""
    with LOCK:
        for entry in CACHE.entries.values():
            entry.forgotten = True
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
# ``LOCK`` from its key to its last write-back.
# One lock rather than tables per thread: threads that train one structure (data-parallel
# threads, one model per thread) then share its regions' compiles, artifact loads and compiled
# code instead of paying each once per thread; a single thread pays one uncontended acquire per
# flush, well under a microsecond (benchmarks/flush_cost.py, a 1000-op window hitting its region,
# five runs each on a loaded 2-core machine: median 6.08 ms before, 5.99 ms after, runs spread
# over 1 ms). Windows of different threads run one at a time: on a CPU target their host work
# is serialized by the GIL anyway, and on CUDA a compiled region only enqueues kernels. What
# takes long without work of ours is waited for outside the lock, a compile or an artifact load
# in flight (``_collect``): a thread waiting for its compile lets the others replay and run.
LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    """A forked child has only the forking thread: no compile thread (``artifacts._submit`` starts
    the child's own), and no lock held by another thread. Compiles and loads in flight belong to
    the parent; the child's entries start them again when due (Note [Worker processes] in
    adaptive_eager._mode)."""
    global LOCK
    LOCK = threading.Lock()
    for entry in [*CACHE.entries.values(), *(c.sym for c in _CLASSES.values() if c.sym is not None)]:
        entry.future = None


os.register_at_fork(after_in_child=_after_fork_in_child)
