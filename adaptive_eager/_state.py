"""Per-thread state: one thread's mode, its open window and its options; the states with the mode
on, in any thread; the owner's side of Note [Reads from other threads]."""

from __future__ import annotations

import threading

import torch
from fuser.window import Window

from . import _gc
from ._hot import expect_hot
from ._log import _apply_log_level
from ._meta import _META_CACHES
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
        # the default dtype the open window's ops were recorded under, and that dtype's meta cache
        # (Note [Meta cache key])
        self.dtype = _default_dtype()
        self.meta_cache = _META_CACHES.setdefault(self.dtype, {})
        self.set_options(options)

    def set_options(self, options: Options) -> None:
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
        self.cut_at = self.periodicity.next_cut()  # Note [Period detection]
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
    return dropped


def _unregister(st: TracerState) -> None:
    global _STATES
    with _states_lock:
        _STATES = tuple(s for s in _STATES if s is not st)


_trace_lock = threading.RLock()  # held by a trace of ours, and by a thread turning the mode on


def trace_alone(st: TracerState) -> bool:
    """Take the trace lock if no other live thread has the mode on (Note [Traces beside other
    threads] in ``_capture``); True: taken, and ``trace_done`` must follow."""
    _trace_lock.acquire()
    if all(s is st or s.mode is None or not s.thread.is_alive() for s in _STATES):
        return True
    _trace_lock.release()
    return False


def trace_done() -> None:
    _trace_lock.release()


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
