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

import logging
import traceback
from concurrent.futures import wait as futures_wait
from typing import NamedTuple

import torch
from neff_cache import LIMIT_EXCEEDED

from .artifacts import _result, _store, _submit, abandoned, compile_thread_stopped, finished_jobs, submit_job
from .compilable import _checks, _input_aliases, _not_compilable, derived_hold
from .compile import SIZES_ALONE, _Unverified, _compile_and_store, _failure_reason, _load, cache_fingerprint
from . import joined
from .launch import _adopt, _Mismatch, _run_checked, _run_compiled
from .replay import mark_needed, replay_window
from .program import Program
from .scalars import _LIFT_ERROR, _scalar_key, lift_cause, unlift
from .shapes import _classify, _fits, _guards_fail, _plan, _static_cause, _with_symbols
from .partition import is_check
from .stats import STATS, _recompile
from . import table
from .table import CACHE, _Entry
from .window import FlushResult, Out, Window

log = logging.getLogger("adaptive_eager.fuser")

# ``_profiler._is_profiler_enabled`` is a module flag torch.profiler sets on start and clears on stop
# (``_run_on_profiler_start``): one attribute read, so a run pays ~nothing while no profiler records.
_profiler = torch.autograd.profiler
_record_function = torch.autograd.profiler.record_function


# Note [Tiers]
# ~~~~~~~~~~~~
# A window's run is decided, then acted on. ``_decide`` reads what is known of its region (the
# entry: a loaded callable, a load or compile in flight, a memoized failure, how often it was
# seen; at first sight the store: its artifact) and returns one ``_Plan``:
#   run      the entry has its callable: run it
#   load     the store has its artifact (at first sight, or while another process compiles it)
#   dynamic  its shape class has, or is due for, a symbolic region (Note [Dynamic shapes]); a
#            window that does not fit it goes on per shape: compile or replay, as below
#   compile  it was seen ``hot_after`` times: claim its key, compile here or in a worker
#   replay   with its reason, counted in ``replay_reasons``: "cold" (not hot yet), "capture_due" (hot,
#            but the tracer marked the window ``superseded``: a capture makes its structure
#            recur no more), "loading" (its
#            artifact loads on the compile thread: ``_obtain``), "compiling" (a compile in
#            flight, here or in another process), "exiting" (the interpreter exits: Note
#            [Compile thread] in fuser.artifacts), or the entry's memoized failure
#            (``_Entry.blacklisted``: why it is never compiled; "load_failed" for an artifact
#            that did not load, evicted: Note [Artifacts from disk] in fuser.compile)
# ``_execute`` acts. It holds the one replay exit (``_replay``), the one compiled run
# (``_run_or_replay``: a run that fails while the replay succeeds means the compiled code was
# wrong for the window: blacklisted) and, with ``_obtain``, the one way a region gets its
# callable, for static and symbolic regions alike: load the store's artifact, else (unless the
# compile failed in an earlier process, Note [Remembered failures] in neff_cache.store) claim
# the key and compile. A claim another process holds means: replay, and load its artifact at a
# later sight (Note [Claim holders] in neff_cache.claims); a compile in a worker lands in the
# store the same way (Note [Background compiles]).
class _Plan(NamedTuple):
    action: str  # "run", "load", "dynamic", "compile" or "replay" (Note [Tiers])
    why: str = ""  # run: the outcome ("compiled", "loaded"); replay: the reason
    data: bytes | None = None  # load: the artifact


class _Flush:
    """What the fuser reads of one window once per run: its liveness (read by ``fuser.run_window``:
    Note [Liveness during a flush]), its written inputs, and which nodes are needed (marked at
    most once, by the first step that needs them). ``validated``: the window's ``nodes`` are the
    tracer's records, not Nodes (Note [Validated windows])."""

    __slots__ = ("window", "live", "mutated", "lifted", "counts", "validated", "derived")

    def __init__(self, window: Window, live: list[Out], validated: bool = False, derived: tuple | None = ()):
        self.window = window
        self.live = live
        self.mutated = tuple(sorted(window.mutated))
        self.derived = derived  # Note [Inputs over one memory] in fuser.compilable
        self.lifted: tuple[int, ...] = ()
        self.counts: tuple[int, int] | None = None
        self.validated = validated

    def mark(self) -> tuple[int, int]:
        """(ops computed, ops dead), marking the needed nodes the first time."""
        if self.counts is None:
            dead = mark_needed(self.window)
            self.counts = (sum(1 for n in self.window.nodes if n.needed and not n.is_view), dead)
        return self.counts


# Note [Validated windows]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# The tracer may record a window against the region of an earlier one, op by op, instead of in
# full (Note [Hot windows] in adaptive_eager._hot); it then hands it over with the entry it
# validated it against (``fuser.run_window(..., validated=entry)``). Such a window is the one a
# full recording would have keyed to that entry, but its ``nodes`` are the tracer's own records,
# not Nodes: the fuser never reads them. If its live values are those the entry returns
# (``_Entry.outputs``) and the entry has its callable, the entry runs with no key built. Else, or
# when the compiled run fails (the replay that follows needs the nodes), nothing is replayed: the
# answer is ``FlushResult.declined`` (why) and ``resume``; the tracer turns its records into Nodes
# and runs the window again with ``resume=`` (``run_resumed``), which takes up where the first run
# stopped, with the liveness it read: the windows that replay whatever their key (their reason
# again), a keyed run, or, after a failed compiled run, its replay and the blacklisting.
class _Resume(NamedTuple):
    """Where ``run_resumed`` takes up a validated window's run (Note [Validated windows])."""

    live: list  # its liveness, as read once (Note [Liveness during a flush])
    entry: _Entry | None = None  # with ``error``: the entry whose compiled run failed
    error: BaseException | None = None
    check: bool = False  # that run was the first of an artifact from disk (Note [Artifacts from disk])


def _declined(why: str, resume: _Resume) -> FlushResult:
    """A validated window not run as validated: nothing was run (Note [Validated windows])."""
    return FlushResult(0, 0, 0, "declined", None, None, why, resume)


def run(window: Window, live: list[Out], backend, options, validated: _Entry | None = None) -> FlushResult:
    """Run ``window`` (``live``: its values the program can still observe) compiled when its key
    is hot or on disk, else by replay (Note [Tiers]); ``validated``: Note [Validated windows]."""
    with table.LOCK:  # Note [One lock for the region tables] in fuser.table
        done, derived = _before_the_key(window, live, validated)
        if done is not None:
            return done
        return _run_window(_Flush(window, live, derived=derived), backend, options)


def _derived(window: Window) -> tuple | None:
    """``_input_aliases`` for a window that passed a view and writes (Note [Inputs over one memory]
    in fuser.compilable), else ()."""
    return _input_aliases(window) if window.passed and window.mutated else ()


def _before_the_key(window: Window, live: list[Out], validated: _Entry | None):
    """What ``run`` and ``run_now`` settle before a key is built: (the result, if the window replays
    whatever its key or was validated, else None; its derived inputs)."""
    derived = _derived(window)
    done = _replayed_whatever_key(window, live, validated, derived)
    if done is None and validated is not None:
        done = _run_validated(window, live, validated, derived)
    return done, derived


def run_resumed(window: Window, resume: _Resume, backend, options, now: bool) -> FlushResult:
    """The run a declined validated window takes up, its Nodes made (Note [Validated windows])."""
    with table.LOCK:
        derived = _derived(window)
        flush = _Flush(window, resume.live, derived=derived)
        if resume.error is not None:
            return _after_failed_run(resume.entry, flush, resume.error, resume.check)
        done = _replayed_whatever_key(window, resume.live, None, derived)
        if done is not None:
            return done
        return _run_keyed_now(flush) if now else _run_window(flush, backend, options)


def _replayed_whatever_key(window: Window, live: list[Out], validated: _Entry | None,
                           derived: tuple | None) -> FlushResult | None:
    """The windows replayed whatever their key: a validated one declined with that reason first;
    ``derived``: ``_input_aliases(window)`` for a window that passed a view and writes."""
    if derived is None:
        if validated is not None:
            return _declined("aliased_inputs", _Resume(live))
        return _replay_aliased(window, live)
    if window.bits:
        if validated is not None:
            return _declined("conj_or_neg_input", _Resume(live))
        return _replay_bits(window, live)
    return None


def _replay_bits(window: Window, live: list[Out]) -> FlushResult:
    """A window with a real input holding the conjugate or negative bit: replayed, whatever its
    key (Note [Conjugate and negative bits] in fuser.compilable)."""
    STATS.not_compiled["conj_or_neg_input"] += 1
    return _replay(_Flush(window, live), "conj_or_neg_input", None)


def _replay_aliased(window: Window, live: list[Out]) -> FlushResult:
    """A window that writes memory it also reads through an input the graph cannot make from the
    written one (Note [Inputs over one memory] in fuser.compilable): replayed, whatever its key."""
    STATS.not_compiled["aliased_inputs"] += 1
    return _replay(_Flush(window, live), "aliased_inputs", None)


def _run_validated(window: Window, live: list[Out], entry: _Entry, derived: tuple) -> FlushResult:
    """A window the tracer validated against ``entry`` (Note [Validated windows]): if its live
    values are those the region returns, the region runs without a key; else declined."""
    if entry.derived != derived:  # not in the tracer's template: Note [Inputs over one memory] in fuser.compilable
        if window.passed or not derived_hold(entry.derived, window):
            return _declined("aliased_inputs", _Resume(live))
        derived = entry.derived
    outputs = entry.outputs
    if entry.run is not None and not entry.forgotten and len(live) == len(outputs) and all(
            o.uid == u for o, u in zip(live, outputs)):
        STATS.cache_hits_memory += 1
        entry.group.last = tuple(window.scalars)  # as ``_scalar_key`` keeps it (the baked values are equal)
        return _run_or_replay(entry, _Flush(window, live, validated=True, derived=derived), "compiled")
    return _declined("liveness" if entry.run is not None and not entry.forgotten else "region",
                     _Resume(live))


def run_now(window: Window, live: list[Out], validated: _Entry | None = None) -> FlushResult:
    """``run`` for a flush that must not wait for another thread (Note [Flush at a fork] in
    adaptive_eager._mode): compiled if its region's callable is in memory, else replayed
    ("fork"); no compile, load, store access or background job, and no wait for one in flight."""
    with table.LOCK:
        done, derived = _before_the_key(window, live, validated)
        if done is not None:
            return done
        return _run_keyed_now(_Flush(window, live, derived=derived))


def _run_keyed_now(flush: _Flush) -> FlushResult:
    window = flush.window
    entry = _entry_of(flush)
    if entry is None:
        return FlushResult(0, 0, len(window.nodes), "dead", None)
    if flush.derived is None:
        return _replay_aliased(window, flush.live)
    if entry.run is not None:
        STATS.cache_hits_memory += 1
        return _run_or_replay(entry, flush, "compiled", join=False)
    return _replay(flush, "fork", entry.region)


def _entry_of(flush: _Flush) -> _Entry | None:
    """The region entry of ``flush``'s window (Note [Region key]); None when nothing of it is
    observable (every op is dead)."""
    window = flush.window
    if not flush.live and not flush.mutated and not _checks(window):
        return None
    structure = (tuple(window.sigs), tuple(o.uid for o in flush.live), flush.mutated)
    if flush.derived:  # which inputs share memory is not in the signature: Note [Inputs over one memory]
        structure += (flush.derived,)
    group, flush.lifted, baked = _scalar_key(structure, window.scalars, window)
    entry = CACHE.get((group, flush.lifted, baked))  # the group stands for the structure: Note [Region key]
    entry.group = group
    if entry.outputs is None:
        entry.outputs = structure[1]
    if flush.derived:
        entry.derived = flush.derived  # part of its structure: the hot path compares it (``_run_validated``)
    elif entry.derived:  # found at the first sight of a window that passed no view: Note [Inputs over one memory]
        flush.derived = entry.derived if derived_hold(entry.derived, window) else None
    return entry


def _run_window(flush: _Flush, backend, options) -> FlushResult:
    entry = _entry_of(flush)
    if entry is None:
        return FlushResult(0, 0, len(flush.window.nodes), "dead", None)  # nothing observable: every op is dead
    if flush.derived is None:
        return _replay_aliased(flush.window, flush.live)
    wait = not options.async_compile
    if entry.future is not None and (wait or entry.future.done()):
        _collect(entry)
    return _execute(_decide(entry, flush, backend, options), entry, flush, backend, options, wait)


def _decide(entry: _Entry, flush: _Flush, backend, options) -> _Plan:
    """What to do with this window of ``entry``'s region (Note [Tiers])."""
    if entry.run is not None:
        STATS.cache_hits_memory += 1
        return _Plan("run", "compiled")
    entry.seen += 1
    if entry.blacklisted:
        return _Plan("replay", entry.blacklisted)
    if entry.future is not None:
        return _Plan("replay", _in_flight(entry))
    if entry.other_process:
        poll_jobs()
        if entry.blacklisted:  # its background compile failed
            return _Plan("replay", entry.blacklisted)
    if entry.seen == 1 or entry.other_process:
        # A region compiled by an earlier run or another process is used at first sight.
        if not flush.derived and flush.window.mutated:
            # a window that passed no view is checked here only: Note [Inputs over one memory]
            aliases = _input_aliases(flush.window)
            if aliases is None:
                STATS.not_compiled["aliased_inputs"] += 1
                entry.blacklisted = "aliased_inputs"
                return _Plan("replay", "aliased_inputs")
            entry.derived = flush.derived = aliases
        reason = _not_compilable(flush.window)
        if reason is not None:
            STATS.not_compiled[reason] += 1
            entry.blacklisted = reason
            return _Plan("replay", reason)
        if entry.program is None and not _describe(entry, flush, backend):
            return _Plan("replay", entry.blacklisted)
        store = _store(options)
        data = store.get(entry.pkey, fingerprint=cache_fingerprint(backend))
        if data is not None:
            return _Plan("load", data=data)
        if entry.other_process and abandoned(entry.pkey, store):
            entry.other_process = False  # compiled below, by this process
    if flush.window.superseded and not entry.other_process and entry.seen >= options.hot_after:
        return _Plan("replay", "capture_due")  # Note [Windows a capture supersedes] in adaptive_eager._capture
    if (entry.shape is not None and entry.shape_class.dynamic_ok and not flush.derived
            and (getattr(backend, "dynamic_shapes", False) or getattr(backend, "sizes_alone", False))):  # a shape class does not tell derived inputs apart (Note [Inputs over one memory])
        return _Plan("dynamic")
    return _per_shape(entry, options)


def _per_shape(entry: _Entry, options) -> _Plan:
    if entry.other_process:
        return _Plan("replay", "compiling")  # by another process: picked up from the store later
    if entry.seen < options.hot_after:
        return _Plan("replay", "cold")
    return _Plan("compile")


def _execute(plan: _Plan, entry: _Entry, flush: _Flush, backend, options, wait: bool) -> FlushResult:
    """Act on ``plan`` (Note [Tiers])."""
    action = plan.action
    if action == "dynamic":
        done = _run_dynamic(entry, flush, backend, options, wait)
        if done is not None:
            return done
        plan = _per_shape(entry, options)
        action = plan.action
    if action == "run":
        return _run_or_replay(entry, flush, plan.why)
    if action == "replay":
        return _replay(flush, plan.why, entry.region)
    if compile_thread_stopped():  # the interpreter is exiting (Note [Compile thread] in fuser.artifacts)
        return _replay(flush, "exiting", entry.region)
    store = _store(options)
    if action == "compile":
        STATS.cache_misses += 1
        if entry.program is None and not _describe(entry, flush, backend):
            return _replay(flush, entry.blacklisted, entry.region)
    elif not wait:
        return _replay_then_load(entry, flush, store, backend, options, plan.data)
    _obtain(entry, store, backend, options, wait, plan.data)
    if entry.run is not None:
        return _run_or_replay(entry, flush, "loaded" if action == "load" else "compiled")
    return _replay(flush, entry.blacklisted or _in_flight(entry), entry.region)


# Note [Load after the replay]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A window whose artifact is on disk replays while the artifact loads on the compile thread
# ("loading"). The first load in a process imports Inductor: 1-4 s of Python on that thread,
# which shares the GIL with the program's, so whatever the program's thread runs meanwhile runs at
# about half speed (the switch interval hands the GIL back and forth). Started before the window's
# replay, the load slowed the very replay it was meant to hide: on a warm restart the first step's
# flush took 114-310 ms with the load switched off and 225-590 ms with it (MLP of
# benchmarks/warm_restart.py, load 3-4). So the window replays first and the load starts after
# it, also when the replay raises (the program's error: the artifact is still this structure's,
# and a later window must not find the entry seen but its artifact never asked for, which would
# compile it again). The region runs compiled no later than before: the load could not have
# finished during one replay anyway (it takes seconds, a replay milliseconds).
def _replay_then_load(entry: _Entry, flush: _Flush, store, backend, options, data: bytes) -> FlushResult:
    """The window of a region whose artifact ``data`` is on disk: replayed, then its load started
    on the compile thread (Note [Load after the replay])."""
    try:
        return _replay(flush, "loading", entry.region)
    finally:
        _obtain(entry, store, backend, options, False, data)


def _in_flight(entry: _Entry) -> str:
    """Why a window of ``entry`` replays while its callable is on the way (Note [Tiers])."""
    return "loading" if entry.future is not None and entry.loading else "compiling"


def _obtain(entry: _Entry, store, backend, options, wait: bool, data: bytes | None = None) -> None:
    """Give ``entry`` its callable (Note [Tiers]): load ``data``, its artifact from ``store``, else
    claim its key and compile it, here (``wait``) or in a worker. Afterwards ``entry.run`` is set,
    or a load or compile is in flight (``entry.future``; ``entry.other_process``: in another
    process or a worker), or the entry is blacklisted."""
    if compile_thread_stopped():  # the interpreter is exiting (Note [Compile thread] in fuser.artifacts)
        return
    if data is not None:
        entry.other_process = False
        entry.future, entry.loading = _submit(_load, data, backend, store, entry.pkey, entry.dynamic), True
        if wait:
            _collect(entry)
        # else the first load in a process imports Inductor (~1-2 s): replay meanwhile ("loading")
        return
    if _failed_before(entry, store, backend):
        return
    if not store.claim(entry.pkey):
        # another process is compiling this region: replay meanwhile, pick it up from disk
        if not entry.other_process:
            STATS.waited_for_other_process += 1
        entry.other_process = True
        return
    lifted = lift_cause(entry.group)  # at every compile of the group: Note [Scalar lifting]
    cause = "dynamic" if entry.dynamic else _static_cause(entry) or lifted
    if cause is not None:
        _recompile(cause, entry.region)
    if not wait and submit_job(entry, backend, store, options):
        return
    _compile_here(entry, backend, store)
    if not entry.dynamic:
        entry.program = None  # compiled: an exact key's program is not needed again


def _describe(entry: _Entry, flush: _Flush, backend) -> bool:
    """What a compile needs (the Program and its persistent key), built once per structure; False
    (the entry blacklisted) for a program the codec cannot describe, which has no persistent key."""
    entry.counts = flush.mark()
    program = Program.from_window(flush.window, flush.live, flush.mutated, flush.lifted,
                                  inplace=getattr(backend, "writes_inputs", False),
                                  stores_after_run=getattr(backend, "stores_after_run", False), derived=flush.derived)
    try:
        pkey = program.digest(cache_fingerprint(backend))
    except TypeError as e:
        STATS.not_compiled["unencodable_argument"] += 1
        entry.blacklisted = "unencodable_argument"
        log.info("adaptive_eager: a window is replayed, not compiled: %s", e)
        return False
    entry.program, entry.pkey = program, pkey
    entry.region = entry.pkey[:8]
    entry.n_live, entry.mutated = len(flush.live), flush.mutated
    _classify(entry)
    return True


def _compile_here(entry: _Entry, backend, store) -> None:
    """Compile ``entry.program`` in this process and wait for it (Note [Compile thread])."""
    entry.loading = False
    if _profiler._is_profiler_enabled:
        with _record_function("adaptive_eager.compile"):
            entry.future = _submit(_compile_and_store, entry.program, backend, store, entry.pkey)
            _collect(entry)
    else:
        entry.future = _submit(_compile_and_store, entry.program, backend, store, entry.pkey)
        _collect(entry)



def _run_dynamic(entry: _Entry, flush: _Flush, backend, options, wait: bool) -> FlushResult | None:
    """Run the window with its class's symbolic region (obtaining it when due); None: per shape."""
    cls = entry.shape_class
    sym = cls.sym
    if sym is None:
        if len(cls.shapes) < 2 or entry.program is None:
            return None
        symbolic = getattr(backend, "dynamic_shapes", False)
        if symbolic and any(is_check(op[0]) for op in entry.program.ops):
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
        sym.program = _with_symbols(entry.program, cls, sizes_alone=not symbolic)
        sym.pkey = sym.program.digest(cache_fingerprint(backend))
        sym.region = sym.pkey[:8]
        sym.n_live, sym.mutated, sym.counts = entry.n_live, entry.mutated, entry.counts  # Note [Derived entries]
    outcome = "compiled"
    if sym.future is not None and (wait or sym.future.done()):
        _collect(sym)
    if sym.run is None and not sym.blacklisted and sym.future is None:
        if sym.other_process:
            poll_jobs()
        if not sym.blacklisted:
            store = _store(options)
            data = store.get(sym.pkey, fingerprint=cache_fingerprint(backend))
            if data is None and sym.other_process and abandoned(sym.pkey, store):
                sym.other_process = False  # compiled below, by this process
            if data is not None or not sym.other_process:
                _obtain(sym, store, backend, options, wait, data)
                outcome = "loaded" if data is not None else outcome
    if sym.blacklisted:
        entry.shape = None
        return None
    if sym.run is None:
        return _replay(flush, _in_flight(sym), entry.region)
    why = _fits(cls, entry.shape) or _guards_fail(sym.run, flush.window)
    if why is not None:
        STATS.not_dynamic[why] += 1
        entry.shape = None  # this exact key goes per-shape
        return None
    try:
        launched, sym_run = _run_checked(sym, flush.window, flush.live)
    except _Mismatch as e:
        STATS.not_dynamic["output_mismatch"] += 1
        log.info("adaptive_eager: region %s does not fit a shape it was routed: %s", sym.region, e)
        entry.shape = None
        return _replay(flush, "output_mismatch", sym.region)
    except Exception as e:  # noqa: BLE001 - never the program's problem: replay
        # as in _run_or_replay: a replay that raises too means the data is at fault (eager's
        # error, the symbolic region stays); one that succeeds means the region was wrong here
        done = _replay(flush, "run_failed", sym.region)
        _blacklist(sym, f"run failed: {type(e).__name__}: {e}", "run_failed")
        entry.shape = None  # the class goes per-shape
        return done
    _adopt(entry, sym, sym_run)  # registered: this exact key's next window is a plain hit
    return FlushResult(launched, *entry.counts, outcome, sym.region)


def poll(entry: _Entry, backend, options, load_now: bool = False) -> None:
    """Give a region kept outside ``CACHE`` (a joined region, Note [Joined runs] in fuser.joined, or
    a captured graph, adaptive_eager._capture) its callable, as ``_decide`` and ``_execute`` give a
    window's region theirs: at its first call load its artifact (``load_now``: waiting for the
    load) or compile it (here or in a worker), later take what landed."""
    if entry.blacklisted or entry.run is not None:
        return
    wait = not options.async_compile
    fingerprint = cache_fingerprint(backend)
    if not entry.seen:
        entry.seen = 1
        store = _store(options)
        data = store.get(entry.pkey, fingerprint=fingerprint)
        _obtain(entry, store, backend, options, wait or (load_now and data is not None), data)
    elif entry.future is not None and (wait or entry.future.done()):
        _collect(entry)
    elif entry.other_process:
        poll_jobs()
        if not entry.blacklisted:
            store = _store(options)
            data = store.get(entry.pkey, fingerprint=fingerprint)
            if data is not None or abandoned(entry.pkey, store):
                entry.other_process = False
                _obtain(entry, store, backend, options, wait, data)
    if entry.future is not None and entry.future.done():
        _collect(entry)


def poll_jobs() -> None:
    """Take the background compiles that failed (the others are then in the store): called when a
    region waits for one, as nothing else collects them (Note [Results are collected by poll] in
    neff_cache.jobs)."""
    for entry, result in finished_jobs():
        entry.other_process = False
        _compile_failed(entry, result.failure or result.error.splitlines()[0], "background compile failed",
                        detail=result.error)


def _failed_before(entry: _Entry, store, backend) -> bool:
    """Whether compiling ``entry`` failed in an earlier process (Note [Remembered failures] in
    neff_cache.store); if so it is handled as that failure was, without compiling again."""
    reason = store.failure(entry.pkey, fingerprint=cache_fingerprint(backend))
    if reason is None:
        return False
    _compile_failed(entry, reason, f"compile failed in an earlier process (remembered in {store.directory})",
                    attempted=False)
    return True



def _replay(flush: _Flush, reason: str, region: str | None) -> FlushResult:
    """The one replay exit (Note [Tiers]), counted by ``reason``."""
    STATS.replayed_regions += 1
    STATS.replay_reasons[reason] += 1
    computed, dead = flush.mark()
    launched = replay_window(flush.window)
    return FlushResult(launched, computed, dead, reason if reason in ("compiling", "loading") else "replayed", region)


def _run_or_replay(entry: _Entry, flush: _Flush, outcome: str, join: bool = True) -> FlushResult:
    """The one compiled run (Note [Tiers]); joined with a captured graph that reads the window's
    values when one asks (Note [Joined runs] in fuser.joined), unless ``join`` is off (a flush
    that must not start a compile)."""
    if join and joined._tls.__dict__.get("request") is not None:
        done = joined.try_joined(entry, flush, outcome)
        if done is not None:
            return done
    check = type(entry.run) is _Unverified  # Note [Artifacts from disk]
    try:
        if _profiler._is_profiler_enabled:
            with _record_function(f"adaptive_eager.region[{entry.region}]"):
                launched = _run_compiled(entry, flush.window, flush.live, check)
        else:
            launched = _run_compiled(entry, flush.window, flush.live, check)
    except Exception as e:  # never the program's problem: replay
        if flush.validated:  # its replay needs the nodes: Note [Validated windows]
            return _declined("run_failed", _Resume(flush.live, entry, e, check))
        return _after_failed_run(entry, flush, e, check)
    if check:
        entry.run = entry.run.run
    return FlushResult(launched, *entry.counts, outcome, entry.region, entry)


def _after_failed_run(entry: _Entry, flush: _Flush, e: BaseException, check: bool) -> FlushResult:
    """``entry``'s compiled run of ``flush``'s window raised ``e``: the window replays. Replay
    raises eager's own error when the data is at fault (an index out of range, a singular matrix's
    check): the region is sound and stays. If replay succeeds, the compiled code was wrong for
    this window: blacklisted."""
    done = _replay(flush, "run_failed", entry.region)
    if check:
        entry.run.store.discard(entry.pkey, f"its first run failed: {type(e).__name__}: {e}")
    _blacklist(entry, f"run failed: {type(e).__name__}: {e}", "run_failed")
    return done


def _compile_failed(entry: _Entry, reason: str, what: str, attempted: bool = True, detail: str | None = None) -> None:
    """``entry``'s compile failed with ``reason`` (``_failure_reason``), in this process or, when not
    ``attempted`` here, in an earlier one. The warning is one line, once per region (a compiler's
    error can run to twenty lines in the middle of training); ``detail``, the traceback, is DEBUG."""
    if reason.startswith(_LIFT_ERROR) and entry.group is not None and unlift(entry.group, reason):
        # floats lifted before they were seen to change (an optimizer step's) that the graph needs
        # as numbers: baked from now on, the others stay inputs; this window replays, the next
        # one (a new key) compiles
        log.info("adaptive_eager: floats stay compile-time constants: %s", reason)
        entry.blacklisted = "scalars_baked"
        return
    if reason.startswith(_LIFT_ERROR):
        # The floats cannot be graph inputs: from now on windows of this structure are keyed by
        # their values (each value compiles once it is hot) instead.
        log.info("adaptive_eager: float arguments stay compile-time constants: %s", reason)
        STATS.not_compiled["unliftable_scalars"] += 1
        entry.blacklisted = "unliftable_scalars"
        if entry.group is not None:
            entry.group.unliftable = True
            entry.group.lifted = ()
            entry.group.keep = None
        return
    if entry.dynamic and SIZES_ALONE in reason.partition("\n")[0]:
        # Note [Sizes that vary, run alone] in fuser.compile: not a failure, the class compiles per size
        log.info("adaptive_eager: region %s compiles per size: %s", entry.region, reason.partition(SIZES_ALONE)[2])
        STATS.not_dynamic["sizes_alone"] += 1
        entry.blacklisted = "per_size"
        return
    over_limit = reason.startswith(LIMIT_EXCEEDED)  # Note [Compile limits] in neff_cache._worker
    if attempted:
        STATS.compile_failures += 1
    if over_limit:
        STATS.not_compiled["compile_limit"] += 1
    elif not attempted:
        STATS.not_compiled["failed_before"] += 1
    log.debug("adaptive_eager: region %s: %s: %s", entry.region, what, detail or reason)
    first_line = reason.strip().partition("\n")[0]
    _blacklist(entry, f"region {entry.region}: {what}: {first_line} "
               "(correct, only slower; NEURON_EAGER_LOG=debug prints the whole error, worth reporting)",
               "compile_limit" if over_limit else "compile_failed" if attempted else "failed_before")


def _blacklist(entry: _Entry, why: str, reason: str) -> None:
    """``entry`` is never compiled or run compiled again in this process; its windows replay,
    counted under ``reason`` in ``replay_reasons`` (``why`` is the warning's detail)."""
    entry.run = None
    entry.blacklisted = reason
    STATS.blacklisted += 1
    log.warning("adaptive_eager: a region was blacklisted and will be replayed: %s", why)


def _collect(entry: _Entry) -> None:
    """Take a finished compile's (or load's) result, blocking if it is still running (without
    ``table.LOCK``, which the caller holds: Note [One lock for the region tables] in fuser.table)."""
    future = entry.future
    if not future.done():
        table.LOCK.release()
        try:
            # in slices, as ``_result`` (Note [Compile thread]): a Ctrl-C is seen within 0.1 s, and
            # a task the thread stopped at exit never ran is not waited for
            while not futures_wait((future,), timeout=0.1).done and not compile_thread_stopped():
                pass
        finally:
            table.LOCK.acquire()
        if entry.future is not future:
            return  # another thread waited for it too, and took the result
    entry.future = None
    if compile_thread_stopped():
        return  # at exit, what the stopped thread did is not taken: the window replays (``_execute``)
    try:
        entry.run, lifted_inputs, seconds, how = _result(future)
    except Exception as e:  # noqa: BLE001 - any compiler failure means: replay this key
        if entry.loading:  # nothing was compiled: ``_load`` evicted the artifact (Note [Artifacts from disk])
            _blacklist(entry, f"region {entry.region}: its artifact from disk did not load: {type(e).__name__}: {e}",
                       "load_failed")
            return
        _compile_failed(entry, _failure_reason(e), "compile failed", detail="".join(traceback.format_exception(e)))
        return
    entry.lifted_inputs = lifted_inputs
    entry.inplace = how["inplace"]  # the compile's answer (Note [Partitions]), also for artifacts from disk
    STATS.run_alone.update(how["alone"])
    if seconds is None:
        STATS.cache_hits_disk += 1
        return
    STATS.compile_seconds += seconds
    STATS.compiles += 1
    log.info("adaptive_eager: compiled region %s%s in %.2fs (key %s)", entry.region,
             " with dynamic shapes" if entry.dynamic else "", seconds, entry.pkey)
