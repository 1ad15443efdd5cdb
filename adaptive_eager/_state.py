"""Per-thread state: one thread's mode, its open window and its options; the states with the mode
on, in any thread; the owner's side of Note [Reads from other threads]."""

from __future__ import annotations

import threading

import torch
from fuser.window import Window
from torch._ops import _len_torch_dispatch_stack_pre_dispatch

from . import _gc
from ._hot import expect_hot
from ._log import _apply_log_level
from ._meta import _META_CACHES
from ._metrics import METRICS
from ._period import Periodicity
from .config import Options

_default_dtype = torch.get_default_dtype
# Inductor's own CPU allocator: (shape tuple, stride tuple, dtype), no argument parsing and no
# dispatch. A placeholder is allocated per recorded op: 0.47 us against empty_strided's 1.1 us.
_empty_strided_cpu = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
_empty_strided_cpu = getattr(_empty_strided_cpu, "_empty_strided_cpu", None)

class TracerState:
    """What one thread's adaptive eager holds: its mode, its open window and its options."""

    def __init__(self, options: Options):
        self.window = Window(self)
        self.mode = None  # its LazyMode (``_mode``) while the mode is on
        self.depth = 0
        self.periodicity: Periodicity | None = None
        self.thread = threading.current_thread()
        # the owner's busy stretches, another thread's claim on the window, the window being run
        # (Note [Reads from other threads])
        self.busy = 0
        self.claim: threading.Event | None = None
        self.claim_lock = threading.Lock()
        self.running: Window | None = None
        self.aside = None  # a compiled call runs with the mode off the stack (Note [User torch.compile] in _compile)
        self.hot_prev = None  # the template of the last window that ran compiled (Note [Hot windows] in _hot)
        self.small = 0  # positions of a small window run eagerly so far (Note [Small windows run eagerly] in _hot)
        # the mode parked between captured calls: the stack's depth with it on, else 0; the chances
        # to park so far (Note [The mode parked between captured calls])
        self.parked = 0
        self.parks = 0
        self.theirs = False  # the program's own compiled code ran under the mode (Note [User torch.compile] in _compile)
        # the default dtype the open window's ops were recorded under, and that dtype's meta cache
        # (Note [Meta cache key])
        self.dtype = _default_dtype()
        self.meta_cache = _META_CACHES.setdefault(self.dtype, {})
        self.set_options(options)

    def set_options(self, options: Options) -> None:
        if self.parked:  # the options may stop what parked it (Note [The mode parked between captured calls])
            unpark(self)
        self.options = options
        window = self.window
        if window.hot is not None and window.nodes:
            window.hot.demote(window, "options")
        expect_hot(self)  # the options decide the regions (backend, cuts): Note [Hot windows]
        self.target = options.device
        # is_cpu / is_cuda are attribute reads; ``t.device.type`` builds a device object per call
        self.target_attr = {"cpu": "is_cpu", "cuda": "is_cuda"}.get(options.device)
        self.scalar_fast_path = options.device == "cpu"
        # one device object for the whole window unless the type has several devices (cuda:0/1)
        self.device_varies = options.device != "cpu"
        # ``_record`` keys its meta cache by device too, except on a CPU target (one device)
        self.device_in_key = self.target_attr is None or options.device != "cpu"
        self.device = torch.device(options.device)
        # how a placeholder is allocated: Inductor's CPU allocator (specs
        # hold plain tuples), or None for ``empty_strided`` on the op's device
        self.alloc_cpu = _empty_strided_cpu if options.device == "cpu" else None
        if self.periodicity is None or self.periodicity.cap != options.window:
            self.periodicity = Periodicity(options.window)
        self.cut_at = next_cut(self)  # Note [Period detection]
        _apply_log_level(options.log)
        self.max_bytes = int(options.window_mb * 2**20)
        if self.mode is not None:
            self.sync_gc()

    def sync_gc(self) -> None:
        """This tracer's gc threshold request, fitting its window (Note [GC threshold])."""
        _gc.hold(self, self.options.window)


_tls = threading.local()


def current_state() -> TracerState | None:
    return getattr(_tls, "state", None)


# The states with the mode on, in any thread: replaced whole (never changed in place) under
# ``_states_lock``, so a reader iterates it without a lock.
_STATES: tuple[TracerState, ...] = ()
_states_lock = threading.Lock()


def _register(st: TracerState) -> int:
    """Add ``st``; answers how many states of ended threads were dropped (``_prune``): each held
    the reader patches installed (``_mode.activate`` removes them). Waits for a trace of another
    thread to end (Note [Traces beside other threads] in ``_capture``)."""
    global _STATES
    with _trace_lock, _states_lock:
        kept = _prune(_STATES)
        dropped = len(_STATES) - len(kept)
        _STATES = (*kept, st)
        st.cut_at = next_cut(st)  # Note [The mode parked between captured calls]: 1 while another is parked
    return dropped


def _unregister(st: TracerState) -> None:
    global _STATES
    with _states_lock:
        _STATES = tuple(s for s in _STATES if s is not st)


_trace_lock = threading.RLock()  # held by a trace of ours, and by a thread turning the mode on

# Note [The mode parked between captured calls]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Once a training step is hot, its forward and optimizer step run as captured calls (Note
# [Captured modules] in _capture) and the few ops between them (the loss, the backward's seed,
# ``zero_grad``, ``loss.item()``) form small windows that run eagerly (Note [Small windows run
# eagerly] in _hot). Each of those ops still crossed the dispatch mode, and so did what autograd
# runs after a captured backward (each ``AccumulateGrad``'s ``detach``) and the profiler ranges of
# ``Optimizer.step`` and ``zero_grad``: 14 crossings a step on the rnn workload, at 4 us each (an
# empty ``TorchDispatchMode``'s cost), the gap to ``torch.compile`` (benchmarks/RESULTS.md).
# So when a captured call returns (``park``: ``_capture._run``, ``_optim._step``) and the window
# open then is empty and armed with a small template, the mode leaves the dispatch stack until
# the next captured call starts (``unpark``: ``nn.Module.__call__``, ``Optimizer.step``) or the
# program turns it off or changes its options. Meanwhile every op runs eagerly, as it would in
# that small window: nothing of this thread is pending while its window is empty, so each input is
# real, and the values, errors, warnings and random numbers are eager's. A backward started then
# runs with no mode at all (the engine restores the mode stack of the ``backward()`` call in each
# node), its captured graph as before. ``metrics()["parked"]`` counts the stretches.
# - Only a small template whose window, the last time it was armed and ops came, ran its ops
#   (``Template.parkable``): the stretch was that window. What a parked stretch does is not seen,
#   so every ``_CHECK_EVERY``-th chance is recorded as usual: an op that is not the template's next
#   one unsets ``parkable`` (``_hot.run_small``), and the stretch is recorded from then on, until
#   its ops are the small window's again.
# - Only while no other live thread has the mode on, and only with our mode on top of the stack
#   (not beside a pre-dispatch mode): a thread with the mode parked is a thread without it, which
#   does not see another thread's pending values (Note [Reads from other threads] in _threads). A
#   thread turning the mode on while another one is parked ends each of its windows after one op
#   (``next_cut``) until no other is parked: none of its values is pending when an op returns.
#   The parked thread, at its next captured call, sees it and parks no more.
# - Not once the program's own compiled code ran under the mode (Note [User torch.compile] in
#   _compile): its guards and compiled autograd's cache saw the mode on, and a call made with it
#   parked compiled their graphs again (tests/test_user_compile.py).
# - Neither inside a backward: the engine runs each node with the mode stack of the ``backward()``
#   call and puts the caller's back after it, so a push or pop there would not last. A module
#   called there (a checkpoint's recomputation, compiled autograd's trace) runs as it would with
#   the mode off.
# - A mode the program enters while ours is parked stays above ours when ours comes back.
_CHECK_EVERY = 31  # prime: each of a step's captured calls gets its turn


def next_cut(st: TracerState) -> int:
    """Where ``st``'s window ends (Note [Period detection]): after one op while another live thread
    has its mode parked (Note [The mode parked between captured calls])."""
    for s in _STATES:
        if s.parked and s is not st and s.thread.is_alive():
            return 1
    return st.periodicity.next_cut()


def park(st: TracerState) -> None:
    """A captured call returns: the mode leaves the stack if the stretch ahead is small (Note [The
    mode parked between captured calls])."""
    window = st.window
    hot = window.hot
    if (hot is None or not hot.parkable or window.nodes or st.small or st.parked or st.theirs
            or _graph_task() != -1):
        return
    st.parks += 1
    if st.parks % _CHECK_EVERY == 0:
        return
    n = _len_dispatch_stack()
    if not n or _dispatch_mode_at(n - 1) is not st.mode or _len_torch_dispatch_stack_pre_dispatch():
        return
    with _states_lock:
        if not _alone(st):
            return
        _pop_dispatch_stack(None)
        st.parked = n
    METRICS.parked += 1


def unpark(st: TracerState) -> None:
    """The mode back on the stack, under the modes the program entered meanwhile; not inside a
    backward, whose nodes run with the stack of its ``backward()`` call."""
    if _graph_task() != -1:
        return
    above = [_pop_dispatch_stack(None) for _ in range(_len_dispatch_stack() - st.parked + 1)]
    _push_dispatch_stack(st.mode)
    for mode in reversed(above):
        _push_dispatch_stack(mode)
    st.parked = 0


_len_dispatch_stack = torch._C._len_torch_dispatch_stack
_pop_dispatch_stack = torch._C._pop_torch_dispatch_stack
_push_dispatch_stack = torch._C._push_on_torch_dispatch_stack
_dispatch_mode_at = torch._C._get_dispatch_stack_at
_graph_task = torch._C._current_graph_task_id  # -1 outside a backward


def trace_alone(st: TracerState) -> bool:
    """Take the trace lock if no other live thread has the mode on (Note [Traces beside other
    threads] in ``_capture``); True: taken, and ``trace_done`` must follow."""
    _trace_lock.acquire()
    if _alone(st):
        return True
    _trace_lock.release()
    return False


def trace_done() -> None:
    _trace_lock.release()


def _alone(st: TracerState) -> bool:
    """Whether no other live thread has the mode on."""
    return all(s is st or s.mode is None or not s.thread.is_alive() for s in _STATES)


def _prune(states: tuple) -> tuple:
    """Drop the states of threads that ended with the mode on, once nothing of theirs is pending
    (until then another thread may read their values: Note [Reads from other threads])."""
    kept = []
    for s in states:
        if s.thread.is_alive() or s.window.nodes or s.running is not None:
            kept.append(s)
        else:
            _gc.release(s)
    return tuple(kept)


def pending_hot_ops() -> tuple[int, int]:
    """The hot records of the windows still recording, and how many of them are launches, which
    ``METRICS`` counts when each ends (``_hot.count_hot``): what ``metrics()`` adds to ``hot_ops``
    and to ``ops_recorded``."""
    records = launches = 0
    for s in _STATES:
        window = s.window
        if window.hot is not None:
            start, end = window.hot_counted, len(window.nodes)
            records += end - start
            launches += window.hot.launches(start, end)
    return records, launches


def hot_ops_counted() -> None:
    """``reset_metrics()``: the records the open hot windows hold so far count as counted."""
    for s in _STATES:
        window = s.window
        if window.hot is not None:
            window.hot_counted = len(window.nodes)


def _on_target(st: TracerState, t: torch.Tensor) -> bool:
    attr = st.target_attr
    return getattr(t, attr) if attr is not None else t.device.type == st.target


# Note [Tensors the mode leaves alone]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Only dense (strided) tensors of the target device are recorded, probed or asked for storage.
# - Another device's tensors (torch's ``lazy`` TorchScript backend, ``meta``, XLA) are never
#   pending: their ops run as eager runs them, and nothing of the library reads their storage. A
#   raw ``lazy`` tensor (what the mode sees below functionalization) has no storage, and asking
#   for it is a segmentation fault, not an exception (pytest formatting a failing test's lazy
#   arguments: ``repr`` -> ``sync_value`` -> ``owner_of``). A factory of another device runs with
#   functionalization as the program had it (``_eager.run_untouched``).
# - A tensor of another layout on the target device (sparse COO/CSR/CSC/BSR/BSC, mkldnn) has no
#   strides and no storage of its own. It is never recorded: an op that takes one or makes one
#   (``to_sparse``, whose meta run answers a non-strided output: ``_meta``) runs eagerly, reason
#   ``sparse``, after a flush when it reads a pending value or when pending ops write anything (its
#   indices and values are dense tensors the program may have written through ``values()``). A view
#   of one (``t()``, ``crow_indices()``) is made and left unrecorded: the dense views it hands out
#   (``values()``) are real tensors, recorded as any real input from then on. The record paths
#   find such a tensor where they read its strides, which it lacks (no cost to the dense ones);
#   the rest of the library checks the device and the layout before it asks for a storage.
_strided = torch.strided


def _step_back(st: TracerState) -> None:
    """The owner starts a busy stretch while another thread claims its window: wait until no
    claim is left (its busy count stays taken on return)."""
    while True:
        st.busy -= 1
        claim = st.claim
        if claim is not None:
            claim.wait()
        st.busy += 1
        if st.claim is None:
            return
