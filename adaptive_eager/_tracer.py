"""The dispatch mode: record ATen ops on the target device into a window; flush at sync points.

Hot path: ``LazyMode.__torch_dispatch__`` -> ``_record``. It does no pytree walking, builds no
strings, and pays one dict lookup for the op's facts and one for its output metadata.
See Note [Placeholders] and Note [Out kinds] in ``fuser.window`` for what a pending value is.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sys
import threading
import time
import warnings
import weakref

import torch
import torch.autograd.profiler as _profiler
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import fuser
from fuser.window import ALIAS, FRESH, OUTS_PER_NODE, VIEW, Node, Out, Window, where

from . import _gc, _ops
from ._metrics import METRICS
from ._period import Periodicity
from ._ops import ALLOC, BATCH_NORM, RANDOM_FILL, RANDOM_NEW, RECORD, VIEW as VIEW_OP, facts_for
from .config import Options
from .errors import AdaptiveEagerError  # noqa: F401  (re-exported)

log = logging.getLogger("adaptive_eager")

_Tensor = torch.Tensor
_empty_strided = torch.empty_strided
# Inductor's own CPU allocator: (shape tuple, stride tuple, dtype), no argument parsing and no
# dispatch. A placeholder is allocated per recorded op: 0.47 us against empty_strided's 1.1 us.
_empty_strided_cpu = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
_empty_strided_cpu = getattr(_empty_strided_cpu, "_empty_strided_cpu", None)
_weakref = weakref.ref
_free_weak_ref = torch.UntypedStorage._free_weak_ref
_getframe = sys._getframe
_copy_ = torch.ops.aten.copy_.default
_untyped_storage = torch._C.TensorBase.untyped_storage  # unpatched (adaptive_eager._patches)
_storage_use_count = torch._C._storage_Use_Count
_FAILED = object()  # meta-cache marker: this signature cannot be recorded
_DECLINED = object()  # _record's answer for an op it does not defer (None is a valid op result)
_SCALAR = object()  # _record's answer for an op to run now (Note [Scalar fast path])


def _dense(t: torch.Tensor) -> bool:
    from torch._prims_common import is_non_overlapping_and_dense_or_false

    return is_non_overlapping_and_dense_or_false(t)


# ---------------------------------------------------------------------------------------------
# Source locations (for errors raised when the window runs)

_LIB_DIRS = tuple(
    os.path.dirname(m.__file__) + os.sep for m in (torch, fuser, sys.modules[__name__.rsplit(".", 1)[0]])
)
# id(code object) -> whether it is torch's or this library's code. Keyed by id: a code object
# hashes its bytecode, constants and names on every lookup (0.2-0.5 us for an optimizer's loop
# function), and the record path looks up every frame between the op and the user's line (AdamW's
# single-tensor step: 8 frames, 4.6 us per recorded op). ``_lib_codes_seen`` keeps each code
# object alive, so its id is never reused for another.
_is_lib_code: dict[int, bool] = {}
_lib_codes_seen: list = []


def _user_source(depth: int):
    """(code, line) of the innermost frame outside torch and this library: the user's line."""
    # frames below ``depth`` are this function and its record-path callers, down to the mode's
    # ``__torch_dispatch__``: always library code. On a thread with fewer frames (autograd's
    # device threads run backward ops from C++) there is no user's line.
    try:
        f = _getframe(depth)
    except ValueError:
        return None
    while f is not None:
        code = f.f_code
        lib = _is_lib_code.get(id(code))
        if lib is None:
            _lib_codes_seen.append(code)
            lib = _is_lib_code[id(code)] = code.co_filename.startswith(_LIB_DIRS)
        if not lib:
            return code, f.f_lineno
        f = f.f_back
    return None


# ---------------------------------------------------------------------------------------------
# Per-thread state


class TracerState:
    """What one thread's adaptive eager holds: its mode, its open window and its options."""

    def __init__(self, options: Options):
        self.window = Window(self)
        self.mode: LazyMode | None = None
        self.depth = 0
        self.periodicity: Periodicity | None = None
        self.thread = threading.current_thread()
        # Note [Reads from other threads]: the owner's busy stretches, another thread's claim on
        # the window, the window being run
        self.busy = 0
        self.claim: threading.Event | None = None
        self.claim_lock = threading.Lock()
        self.running: Window | None = None
        self.set_options(options)

    def set_options(self, options: Options) -> None:
        self.options = options
        self.target = options.device
        # is_cpu / is_cuda are attribute reads; ``t.device.type`` builds a device object per call
        self.target_attr = {"cpu": "is_cpu", "cuda": "is_cuda"}.get(options.device)
        self.scalar_fast_path = options.device == "cpu"
        # one device object for the whole window unless the type has several devices (cuda:0/1)
        self.device_varies = options.device != "cpu"
        # ``_record`` keys its meta cache by device too, except on a CPU target (one device)
        self.device_in_key = self.target_attr is None or options.device != "cpu"
        self.device = torch.device(options.device)
        # how a placeholder is allocated on the record fast path: Inductor's CPU allocator (specs
        # hold plain tuples), or None for ``empty_strided`` on the op's device
        self.alloc_cpu = _empty_strided_cpu if options.device == "cpu" else None
        self.max_ops = options.window
        if self.periodicity is None or self.periodicity.cap != options.window:
            self.periodicity = Periodicity(options.window)
        self.cut_at = self.periodicity.next_cut()  # Note [Period detection]
        _apply_log_level(options.log)
        self.max_bytes = int(options.window_mb * 2**20)
        if self.mode is not None:
            self.sync_gc()

    def sync_gc(self) -> None:
        """Hold or drop this tracer's gc threshold request to match its options (Note [GC threshold])."""
        if self.options.tune_gc:
            _gc.hold(self, self.options.window)
        else:
            _gc.release(self)


_tls = threading.local()


def current_state() -> TracerState | None:
    return getattr(_tls, "state", None)


# The states with the mode on, in any thread: replaced whole (never changed in place) under
# ``_states_lock``, so a reader iterates it without a lock.
_STATES: tuple[TracerState, ...] = ()
_states_lock = threading.Lock()


def _register(st: TracerState) -> None:
    global _STATES
    with _states_lock:
        _STATES = (*_prune(_STATES), st)


def _unregister(st: TracerState) -> None:
    global _STATES
    with _states_lock:
        _STATES = tuple(s for s in _STATES if s is not st)


def _prune(states: tuple) -> tuple:
    """Drop the states of threads that ended with the mode on, once nothing of theirs is pending
    (until then another thread may read their values: Note [Reads from other threads])."""
    kept = []
    for s in states:
        if s.thread.is_alive() or s.window.nodes or s.running is not None:
            kept.append(s)
        else:
            _gc.release(s)
            from . import _patches

            _patches.uninstall()
    return tuple(kept)


def _on_target(st: TracerState, t: torch.Tensor) -> bool:
    attr = st.target_attr
    return getattr(t, attr) if attr is not None else t.device.type == st.target


# ---------------------------------------------------------------------------------------------
# Flush


_CUTS = ("window_cap", "period")


def flush(st: TracerState, reason: str) -> None:
    """Run the open window (if any) and bind every live result into the program's tensors.

    For the thread that owns ``st``; a read in another thread runs it with ``_flush_for_reader``."""
    if not st.window.nodes and st.claim is None:
        return
    st.busy += 1  # Note [Reads from other threads]
    if st.claim is not None and st.busy == 1:
        _step_back(st)
    try:
        _run(st, reason)
    finally:
        st.busy -= 1


def _run(st: TracerState, reason: str) -> None:
    """``flush``'s work, by whichever thread may touch ``st``'s window now."""
    window = st.window
    if not window.nodes or getattr(_tls, "running", None) is not None:
        # nothing pending, or this thread is running a window: its ops read every value they
        # use when it was real, and the fuser is not reentrant (Note [Reads from other threads])
        return
    st.running = window  # before the swap: a reader in another thread always finds the window
    st.window = Window(st)  # first: anything the run triggers must not see the old window
    _tls.running = window
    try:
        _run_window(st, window, reason)
    finally:
        _tls.running = st.running = None


def _run_window(st: TracerState, window: Window, reason: str) -> None:
    window.closed = True
    ran = False
    site = None
    try:
        per = st.periodicity
        per.on_flush(len(window.nodes), window.sigs, reason in _CUTS, _op_ids)
        st.cut_at = per.next_cut()
        METRICS.flushes[reason] += 1
        METRICS.windows += 1
        site = _user_source(2)  # the line that triggered the flush
        METRICS.flush_sites[(reason, site)] += 1
        with (_profiler.record_function("adaptive_eager.flush") if _profiler._is_profiler_enabled
              else contextlib.nullcontext()), _disable_current_modes():
            launched, materialized, eliminated = fuser.run_window(window, st.options)
        ran = True  # ``Window.live`` is read: Note [Window release]
        METRICS.launches += launched
        METRICS.ops_materialized += materialized
        METRICS.ops_eliminated += eliminated
    except fuser.ReplayError as e:
        _poison(window)
        raise _user_error(e, reason) from e.error
    except BaseException as e:
        # Ctrl-C, an internal error, a cache the OS refuses: not the program's error, and it goes
        # on as it is (KeyboardInterrupt stays KeyboardInterrupt), but the values are settled first
        _poison(window)
        e.add_note(f"[adaptive_eager] raised while running the window flushed ({reason}) at {where(site)}; "
                   f"the values it had not computed hold NaN (0 for integers and bools).")
        raise
    finally:
        if log.isEnabledFor(logging.INFO):
            log.info("flush (%s): %d ops, region %s %s; triggered at %s", reason, len(window.nodes),
                     getattr(window, "region", None) or "-", getattr(window, "outcome", None) or "replayed",
                     where(site))
        if not ran:
            window.live = list(window.fresh)  # unread: any of them may be marked on a live tensor
        _release(window)


def _poison(window: Window) -> None:
    """A window failed: the values its later ops would have made were never computed. Eager
    would not have run those lines at all; make what the program holds of them unmistakable (NaN,
    or 0 for integers and bools) instead of leaving uninitialized memory. A value is computed once
    the run bound it (``Out.value``), in replay and compiled regions alike."""
    with _disable_current_modes(), torch.no_grad():
        for o in window.fresh:
            if o.value is not None or fuser.value_is_dead(o):
                continue
            t = fuser.placeholder_of(o)
            if t.numel():
                t.fill_(float("nan") if (t.is_floating_point() or t.is_complex()) else 0)


_log_configured = False


def _apply_log_level(level: str) -> None:
    """NEURON_EAGER_LOG / log=: the level of the ``adaptive_eager`` loggers. With no logging set
    up by the program, records go to stderr; a program's own logging configuration is kept."""
    global _log_configured
    if level == "warning" and not _log_configured:
        return  # the default: leave the program's logging alone
    _log_configured = True
    root = logging.getLogger("adaptive_eager")
    root.setLevel(getattr(logging, level.upper()))
    if level != "warning" and not root.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s] %(levelname)s: %(message)s"))
        root.addHandler(handler)


def _release(window: Window) -> None:
    """Unmark the tensors that outlive ``window`` and drop what their Outs hold; free the storage
    handles. The rest goes with the window, by reference counting: Note [Window release]."""
    free = _free_weak_ref
    for o in window.fresh:
        free(o.storage)
    for outs in (window.live, window.others):
        for o in outs:
            # unmarked, the Out is reachable only from the window (a real tensor's mark was the
            # one cycle: tensor -> Out -> tensor), and goes with it
            ref = o.ref
            t = ref() if ref is not None else o.tensor
            if t is not None:
                d = t.__dict__
                if d.get("_ae") is o:
                    del d["_ae"]
            o.value = o.storage = None  # an exception's traceback may keep the window's nodes
    window.fresh.clear()
    window.live.clear()
    window.others.clear()
    window.nodes.clear()
    window.real_inputs.clear()


def _user_error(e: fuser.ReplayError, reason: str) -> BaseException:
    err, node = e.error, e.node
    msg = (
        f"{err}\n[adaptive_eager] raised by {node.func}, recorded at {node.where()}; it ran when the "
        f"window was flushed ({reason}). Eager would have raised at that line; values recorded after it "
        f"were never computed (they hold NaN). To run eagerly, leave the adaptive_eager() context, set "
        f"NEURON_EAGER=eager, or in Jupyter use %adaptive_eager off."
    )
    try:
        new = type(err)(msg)
    except Exception:  # exception types with a custom constructor keep their own message
        err.add_note(msg)
        return err
    return new


# ---------------------------------------------------------------------------------------------
# Reads from other threads

# Note [Reads from other threads]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The mode is per thread; the values it hands out are not. A logging thread calls ``float(loss)``,
# a queue's feeder thread pickles a batch (``torch.multiprocessing``, DataLoader workers), a second
# training thread reads a tensor the first one wrote. Whichever thread reads a pending value must
# see its eager value, so it runs the owner's window first.
# - Finding the owner: a mark names its window's recorder (``t._ae.win.owner``, Note [Window
#   release]); a real tensor written by a pending in-place op (a parameter, a view of one) is in
#   the ``written`` storages of a state with the mode on (``_STATES``). A value stays pending while
#   its window runs (``TracerState.running``), so a third thread waits for the run instead of
#   reading memory half written. ``owner_of`` answers both, and ``is_lazy`` is true in every thread.
# - Excluding the owner: a window swapped out from under ``_record`` would lose the op being
#   recorded, so the owner's *busy* stretches (each dispatch and each flush: ``TracerState.busy``)
#   and another thread's run of its window never overlap. The reader sets ``TracerState.claim``
#   and waits for the owner to be idle; the owner, starting a busy stretch under a claim, steps
#   back until the claim is gone (``_step_back``). That is Dekker's protocol on two attributes (the
#   owner writes ``busy`` then reads ``claim``, the reader writes ``claim`` then reads ``busy``):
#   under the GIL those reads and writes are sequentially consistent, so the two never both go
#   ahead. The owner pays an increment, a decrement and one read per op; a lock would cost more
#   per op and be no fairer (a loop releasing and re-acquiring it wins against the waiting reader
#   almost every time, where a claim stops the owner at its next op).
# - No deadlock: a thread waits for another's window only outside its own busy stretches and
#   outside any run. The record path, meeting a value pending in another thread (``_Elsewhere``),
#   undoes what it registered, ends its busy stretch, runs that window, and records the op again.
#   A run never starts another flush (``_tls.running``): the ops of the running window read their
#   values when those were real (recording them met no other thread's pending mark, or ran that
#   window first), and the fuser is not reentrant.
# - Not covered: ATen ops on a pending value in a thread *without* the mode (``t + 1``,
#   ``torch.cat``, a module's forward there). Dispatch modes are per thread and a plain tensor has
#   no ``__torch_function__``, so no Python sees those ops: they read the placeholder's memory.
#   Every Python-level read is covered (``item``, ``float``/``int``, ``tolist``, ``numpy``,
#   ``repr``/``print``/formatting, pickling and ``torch.save``, ``copy.deepcopy``, storage and
#   ``data_ptr`` access, and so ``torch.multiprocessing``'s sharing), as is any op in a thread
#   with the mode on. A value used by ATen ops in a plain thread must be handed over after one of
#   those reads, or after ``adaptive_eager.sync()`` in the owning thread.


class _Elsewhere(Exception):
    """The record path met a value pending in another thread's window: ``args`` are that window's
    state and the tensor (Note [Reads from other threads])."""


def _holds(st: TracerState, token) -> bool:
    """Whether ``token`` is of ``st``'s open window or of the window it is running."""
    if token is st.window.token:
        return True
    running = st.running
    return running is not None and token is running.token


def pending_mark(o) -> bool:
    """Whether mark ``o`` is of a window still pending in its owner (open or running), any
    thread's; else it is a mark left behind, and its tensor is real."""
    owner = o.win.owner
    return owner is not None and _holds(owner, o.win)


def _check_elsewhere(t, o) -> None:
    if pending_mark(o):
        raise _Elsewhere(o.win.owner, t)


def owner_of(t) -> TracerState | None:
    """The state whose window holds ``t``'s pending value, any thread's; None when ``t`` is real."""
    o = getattr(t, "_ae", None)
    if o is not None and pending_mark(o):
        return o.win.owner
    sid = None
    for st in _STATES:
        written = st.window.written
        running = st.running
        if running is not None:
            written = written | running.written
        if written:
            if sid is None:
                try:
                    sid = _untyped_storage(t)._cdata
                except (RuntimeError, NotImplementedError):  # no storage: no pending op writes it
                    return None
            if sid in written:
                return st
    return None


def sync_value(t, reason: str, other_threads_only: bool = False) -> None:
    """Before ``t``'s memory is read outside the dispatcher: run the window it is pending in,
    whichever thread's. ``other_threads_only``: the read dispatches an op (``item``), which this
    thread's own mode sees and counts."""
    if getattr(_tls, "running", None) is not None:
        return  # a run's reads are of values that were real when recorded (``data_ptr`` of inputs)
    st = owner_of(t)
    if st is None:
        return
    if st is getattr(_tls, "state", None):
        if not other_threads_only:
            flush(st, reason)
    else:
        _flush_for_reader(st, t)


def _flush_for_reader(st: TracerState, t) -> None:
    """Run ``st``'s window, another thread's, because this thread (not running a window) reads ``t``."""
    me = getattr(_tls, "state", None)
    if me is not None and me.busy:
        return  # no wait inside a busy stretch: never happens (the record path leaves it first)
    with st.claim_lock:  # one reader runs the window; the next finds its value real
        claim = st.claim = threading.Event()
        try:
            delay = 1e-5
            while st.busy:  # the owner finishes its op or its flush, then steps back
                time.sleep(delay)
                delay = min(2 * delay, 1e-3)
            if owner_of(t) is st:
                _run(st, "other_thread")
        finally:
            st.claim = None
            claim.set()


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


# ---------------------------------------------------------------------------------------------
# Record path


def needs_flush(st: TracerState, t: torch.Tensor) -> bool:
    """Whether reading ``t``'s memory now would see a pending write.

    A tensor is pending when it is a value of the open window (marked ``_ae``) or when its storage
    is written by a pending in-place op (a real tensor such as a parameter, or any view of it).
    """
    window = st.window
    if not window.nodes:
        return False
    o = getattr(t, "_ae", None)
    if o is not None and o.win is window.token:
        return True
    return bool(window.written) and _untyped_storage(t)._cdata in window.written


def _tensors(args, kwargs):
    """The tensors among an op's arguments (top level and inside lists), off the record path."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, _Tensor):
            yield a
        elif type(a) in (list, tuple):
            for x in a:
                if isinstance(x, _Tensor):
                    yield x


def _reads_pending(st: TracerState, args, kwargs) -> bool:
    return any(needs_flush(st, t) for t in _tensors(args, kwargs))


def _eager(st: TracerState, f, args, kwargs, reason: str | None):
    """Run the op now, flushing first if it reads pending data or writes anything.

    A write must wait for the window even if what it writes is not pending: a pending op may read
    the old value (write-after-read).
    """
    if reason is not None:
        token = st.window.token
        for t in _tensors(args, kwargs):
            o = getattr(t, "_ae", None)
            if o is not None and o.win is not token:
                _check_elsewhere(t, o)
        pending = st.window.nodes and (f.mutates or _reads_pending(st, args, kwargs))
        if pending:
            flush(st, reason)
        elif reason == "item" and st.scalar_fast_path and args[0].dim() == 0:
            # ``step.item()``: a read of a real 0-dim CPU tensor, nothing computed for it
            METRICS.host_scalar_ops += 1
        if reason not in ("item", "bool", "data_dependent", "device_copy", "collective"):
            METRICS.fallback_ops[f.name] += 1
            site = _user_source(2)
            METRICS.fallback_sites[(f.name, reason, site)] += 1
            if log.isEnabledFor(logging.INFO):
                log.info("eager op %s (%s) at %s", f.name, reason, where(site))
    METRICS.ops_eager += 1
    METRICS.launches += 1
    METRICS.eager_equivalent_launches += 1
    return f.func(*args, **kwargs)


def _touches_target(st: TracerState, f, args, kwargs) -> bool:
    if any(_on_target(st, t) for t in _tensors(args, kwargs)):
        return True
    dv = kwargs.get("device")
    if dv is not None and torch.device(dv).type == st.target:
        return True
    if f.factory and f.has_device_kw and "device" not in kwargs:
        return torch.get_default_device().type == st.target
    return False


def _meta(t):
    return _empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


_STRUCTURE_IDS: dict = {}  # op signature -> its id (>= 1); views' ids are negative (``_VIEW_IDS``)
_SIGNATURE_IDS = itertools.count(1)


def _compute_meta(f, args, kwargs, device, sig, ksig, written):
    """Output metadata by running the op on meta tensors (the slow path: ~65 us); or, for a
    signature eager rejects from its metadata, ``_Raises`` (Note [Overlapping writes]).
    ``written``: the (tensor, storage id) pairs of the tensors the op writes."""
    if any(_has_internal_overlap(t) == 1 for t, _ in written):
        error = _overlap_error(f, args, kwargs, shared=False)
        if error is not None:
            return _Raises(error)
    margs = list(args)
    for i in f.tensor_pos:
        if i < len(margs) and isinstance(margs[i], _Tensor):
            margs[i] = _meta(margs[i])
    for i in f.list_pos:
        if i < len(margs):
            margs[i] = [None if x is None else _meta(x) for x in margs[i]]
    mkwargs = {k: (_meta(v) if isinstance(v, _Tensor) else v) for k, v in kwargs.items()}
    if f.factory or "device" in mkwargs:
        mkwargs["device"] = "meta"
    res = f.func(*margs, **mkwargs)
    outs = res if isinstance(res, (tuple, list)) else (res,)
    specs = []
    nbytes = 0
    for j, r in enumerate(outs):
        if r is None or (j < len(f.alias_ret) and f.alias_ret[j] is not None):
            specs.append(None)
            continue
        if not isinstance(r, _Tensor):
            raise NotImplementedError(f"{f.name} returns a non-tensor")
        specs.append((tuple(r.shape), tuple(r.stride()), r.dtype))
        nbytes += _untyped_storage(r).nbytes() if r.numel() else 0
    specs = tuple(_eager_layouts(f, args, kwargs, specs))
    structure = (f, tuple(sig), ksig, specs)
    eid = _STRUCTURE_IDS.get(structure)
    if eid is None:
        # one atomic step: two threads never give two signatures one id (Note [Window signature])
        eid = _STRUCTURE_IDS.setdefault(structure, next(_SIGNATURE_IDS))
    return specs, nbytes, isinstance(res, list), eid


def _written(window: Window, t: torch.Tensor) -> bool:
    # a 0-dim tensor with a pending write must be read in window order, not snapshot now
    return bool(window.written) and _untyped_storage(t)._cdata in window.written


def _scalars_settled(window: Window, f, args, n: int) -> bool:
    """Whether an op on real 0-dim tensors may run now (Note [Scalar fast path]): none of them has
    a pending write (through another alias of its storage), and none it writes is read by a
    pending op through a recorded view."""
    written, viewed = window.written, window.viewed
    for i in f.tensor_pos:
        if i < n and isinstance(args[i], _Tensor):
            t = args[i]
            storage = _untyped_storage(t)
            if i in f.write_pos and storage.nbytes() != t.element_size():
                return False  # other elements of its storage may be read by pending ops
            sid = storage._cdata
            if sid in written or (i in f.write_pos and sid in viewed):
                return False
    return True


# Note [Eager layouts]
# A meta kernel knows an op's output shapes and dtypes, but not always the layout the device's own
# kernel picks: it has no device (a channels_last convolution comes out contiguous on meta, as do
# the FFTs, pixel_shuffle and others), and some Python meta kernels order strides differently from
# the device kernels (``div`` with a transposed operand). The program must see eager's strides
# while a value is pending, since they decide what a view of it is and whether ``reshape`` copies;
# the value's run would not fix them (``fuser.replay._bind`` keeps the placeholder's layout). So on
# a meta-cache miss (once per signature, never on the record fast path) the op also runs for real
# on its own device, and every fresh output takes that run's strides. The run reads the program's
# float tensors as they are (placeholders hold uninitialized memory: harmless to a kernel, and only
# the layout is kept) and copies nothing of them; integer and bool inputs are zeros of the same
# geometry (garbage indices would fail or read out of bounds; zero is a valid index into any
# non-empty dimension), and so is a written argument, so the run changes nothing the program holds.
# If that run raises (an integer division by zero, a kernel that checks its floats), every input is
# ones of its geometry for a second try; if that raises too, the meta kernel's layout stands.
# Factories have no input layout to follow and skip the run. Recorded ops draw no random numbers
# (Note [RNG] in _ops), so the run consumes no generator.


def _eager_layouts(f, args, kwargs, specs: list) -> list:
    """``specs`` with each fresh output's strides taken from a real run of the op (Note [Eager layouts])."""
    if f.factory or all(s is None for s in specs):
        return specs
    written = f.write_pos

    def stand_in(t, written: bool, fill):
        if not isinstance(t, _Tensor):
            return t
        if fill is None:
            if not written and (t.is_floating_point() or t.is_complex()):
                return t
            fill = 0
        return torch.full((_extent(t),), fill, dtype=t.dtype, device=t.device).as_strided(t.shape, t.stride())

    for fill in (None, 1):
        try:
            rargs = [[stand_in(x, i in written, fill) for x in a] if type(a) in (list, tuple)
                     else stand_in(a, i in written, fill) for i, a in enumerate(args)]
            with warnings.catch_warnings():  # the op warns when it runs, as eager's does
                warnings.simplefilter("ignore")
                res = f.func(*rargs, **{k: stand_in(v, k in written, fill) for k, v in kwargs.items()})
            break
        except Exception as e:  # noqa: BLE001 - the meta kernel's layout stands
            error = e
    else:
        log.debug("layout of %s from its meta kernel: a real run failed: %s", f.name, error)
        return specs
    outs = res if isinstance(res, (tuple, list)) else (res,)
    return [spec if spec is None or not (isinstance(r, _Tensor) and tuple(r.shape) == spec[0] and r.dtype == spec[2])
            else (spec[0], tuple(r.stride()), spec[2]) for spec, r in zip(specs, outs)]


# Note [Overlapping writes]
# Eager refuses some writes from metadata alone, before any kernel runs: a written tensor whose
# elements share memory (an expanded tensor: "more than one element of the written-to tensor
# refers to a single memory location"), or one that partly shares memory with an input
# (``x[1:].add_(x[:-1])``, ``x.add_(x.t())``: "some elements of the input tensor and the written-to
# tensor refer to a single memory location"). Which ops check is the kernel's own choice (``fill_``
# of an expanded tensor is fine, ``add_`` is not), so the op is run on zero stand-ins with the same
# geometry and, for the second case, the same sharing of storage among its arguments; if that run
# raises eager's overlap error, so does the op, at its line, with nothing recorded (``_record``).
# The stand-in run happens only when the metadata says eager could refuse: a written tensor with
# internal overlap (a function of its sizes and strides, so found once per signature at a
# meta-cache miss and kept as a ``_Raises`` entry), or another tensor argument over the written
# one's storage whose memory range meets it (checked per op, for mutating ops only, and only when
# another TensorImpl holds the written storage: its use count counts each TensorImpl and its one
# Python storage object, which the lookup of its id has made, as ``fuser.replay._bind`` reads it;
# so one use-count read per written tensor, then one storage lookup per further tensor argument;
# the in-place fast path leaves such ops to the general path).
_has_internal_overlap = torch._debug_has_internal_overlap  # 0: no, 1: yes, 2: too hard to tell


class _Raises:
    """A meta-cache entry for a signature eager rejects from metadata: raise its error at each op."""

    __slots__ = ("exception",)

    def __init__(self, exception: BaseException):
        self.exception = exception

    def error(self) -> BaseException:
        e = self.exception
        return type(e)(*e.args)


def _extent(t: torch.Tensor) -> int:
    """Elements from a tensor's first to its last, past its storage offset."""
    return 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0) if t.numel() else 0


def _shares_written(window: Window, args, kwargs, written: list) -> bool:
    """Whether a tensor argument, other than a written one itself, lies in the memory of a written
    one: eager's overlap status FULL or PARTIAL (``get_overlap_status`` in ATen's MemoryOverlap.cpp:
    two non-empty, non-overlapping and dense tensors whose byte ranges in one storage meet; for
    any other pair eager cannot tell and does not check). Note [Overlapping writes]."""
    # a storage held only by the written tensor and its storage object is shared with no argument
    storages = {sid for _, sid in written if _storage_use_count(sid) > 2}
    for a in _tensors(args, kwargs):
        if any(a is t for t, _ in written) or not a.numel() or _has_internal_overlap(a) != 0:
            continue
        o = getattr(a, "_ae", None)
        sid = o.storage if o is not None and o.win is window.token and o.kind == FRESH else _untyped_storage(a)._cdata
        if sid not in storages:
            continue
        start = a.storage_offset() * a.element_size()
        for t, s in written:
            if s == sid and t.numel() and _has_internal_overlap(t) == 0:
                begin = t.storage_offset() * t.element_size()
                if start < begin + t.numel() * t.element_size() and begin < start + a.numel() * a.element_size():
                    return True
    return False


def _overlap_error(f, args, kwargs, shared: bool) -> BaseException | None:
    """Eager's overlap error for this op, from a run on zero stand-ins of its arguments' geometry
    (over one buffer per storage they share when ``shared``), or None (Note [Overlapping writes])."""
    tensors = list(_tensors(args, kwargs))
    key = (lambda t: _untyped_storage(t)._cdata) if shared else id
    sizes: dict = {}  # buffer key -> (bytes, device)
    for t in tensors:
        k = key(t)
        sizes[k] = (max(sizes.get(k, (0,))[0], (t.storage_offset() + _extent(t)) * t.element_size()), t.device)
    buffers = {k: torch.zeros(n, dtype=torch.uint8, device=d).untyped_storage() for k, (n, d) in sizes.items()}

    def stand_in(t):
        if not isinstance(t, _Tensor):
            return t
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(buffers[key(t)], t.storage_offset(), t.shape,
                                                                    t.stride())

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            f.func(*[[stand_in(x) for x in a] if type(a) in (list, tuple) else stand_in(a) for a in args],
                   **{k: stand_in(v) for k, v in kwargs.items()})
    except RuntimeError as e:
        if str(e).startswith("unsupported operation:"):  # eager's overlap checks (MemoryOverlap.cpp)
            return type(e)(*e.args)
    except Exception:  # noqa: BLE001 - a failure of the stand-ins' values is not eager's answer
        pass
    return None


_META_CACHE: dict = {}

# Note [Record fast path]
# Most recorded ops are elementwise ops, reductions and matmuls: positional tensors and numbers,
# one fresh output, nothing written (``OpFacts.fast``). ``_record_fast`` records those with the
# same signature, meta-cache key and window entries as ``_record``, in about half the Python
# work. Anything it does not handle (a tensor on another device, a one-element real tensor that
# the scalar fast path must snapshot, a meta-cache miss) makes it return ``_DECLINED`` before it
# has changed anything (registered real inputs are forgotten again), and the op takes the general
# path. It also records in-place ops that write and return their first argument
# (``OpFacts.fast_inplace``: optimizer updates such as ``mul_``, ``lerp_``, ``addcdiv_(value=)``),
# which leave an ALIAS out and the write marks instead of a fresh placeholder. Measured on AdamW
# (200 parameters, foreach=False): 63 vs 91 ms per step recorded with and without the in-place
# case. tests/test_tracer.py checks that the window either path leaves is the same.


def _unslot(window: Window, n0: int) -> None:
    """Forget the real inputs registered by an op that was not recorded after all: a window
    must hold (and its region key count) only the real tensors its nodes use."""
    real = window.real_inputs
    slots = window.slots
    for t in real[n0:]:
        del slots[id(t)]
    del real[n0:]


def _decline(window: Window, n0: int):
    if len(window.real_inputs) != n0:
        _unslot(window, n0)
    return _DECLINED


def _alias_out(window: Window, node: Node, t, src, uid: int) -> Out:
    """The ALIAS out of an op that writes and returns ``t``; ``src`` is the argument as recorded
    (its Out when ``t`` is pending, else ``t`` itself). Marks ``t`` with it."""
    if type(src) is Out:  # a pending value: held weakly (Note [Weak window])
        o = Out(window.token, ALIAS, uid, src.meta, _weakref(t), slot=src.slot, alias=src)
    else:
        o = Out(window.token, ALIAS, uid, (t.shape, t.stride(), t.dtype), slot=window.slot_of(t), tensor=t, alias=src)
    t._ae = o
    window.others.append(o)
    return o


def _record_fast(st: TracerState, f, args, kwargs):
    """``_record`` for ``OpFacts.fast`` ops (no keywords) and ``OpFacts.fast_inplace`` ops (they
    write and return their first argument): Note [Record fast path]."""
    window = st.window
    n0 = len(window.real_inputs)
    n = len(args)
    sig = list(args)
    nargs = None
    inputs = []
    refs = []
    floats = None
    attr = st.target_attr
    scalar_fast_path = st.scalar_fast_path
    first = None
    for i in f.tensor_pos:
        if i >= n:
            break
        a = args[i]
        if a is None:
            continue
        if not isinstance(a, _Tensor):
            if a.__class__ is float and f.liftable:
                sig[i] = float
                if floats is None:
                    floats = []
                floats.append(i)
            else:
                sig[i] = (a.__class__, a)
            continue
        if attr is None or not getattr(a, attr):
            return _decline(window, n0)
        if first is None:
            first = a
        o = getattr(a, "_ae", None)
        if o is not None:
            if o.win is window.token:
                if nargs is None:
                    nargs = list(args)
                nargs[i] = o
                inputs.append(o)
                refs.append(o.uid)
                sig[i] = o.meta
                continue
            if pending_mark(o):
                _decline(window, n0)
                raise _Elsewhere(o.win.owner, a)
        if scalar_fast_path and a.numel() == 1:
            return _decline(window, n0)  # snapshots and the scalar fast path: the general path
        slot = window.slots.get(id(a))
        refs.append(-1 - (slot if slot is not None else window.slot_of(a)))
        sig[i] = (a.shape, a.stride(), a.dtype)
    if first is None:
        return _decline(window, n0)
    for i in f.scalar_pos:
        if i < n:
            v = args[i]
            if v.__class__ is float and f.liftable:
                sig[i] = float
                if floats is None:
                    floats = []
                floats.append(i)
            else:
                sig[i] = (v.__class__, v)
    for i in f.seq_pos:
        if i < n and type(args[i]) is list:
            sig[i] = tuple(args[i])
    ksig = ()
    if kwargs:  # fast_inplace only: numbers and flags (``alpha=``, ``value=``)
        ksig = []
        for k, v in kwargs.items():
            if v.__class__ is float and f.liftable:
                ksig.append((k, float))
                if floats is None:
                    floats = []
                floats.append(k)
            else:
                ksig.append((k, v.__class__, tuple(v) if type(v) is list else v))
        ksig = tuple(ksig)
    # several devices of the target type (cuda:0, cuda:1): the first tensor's, as ``_record`` picks
    device = first.device if st.device_varies else st.device
    if st.device_in_key:
        ksig = (ksig, device)
    try:
        entry = _META_CACHE.get((f, tuple(sig), ksig))
    except TypeError:  # an unhashable keyword value: the general path runs it eagerly
        return _decline(window, n0)
    if entry.__class__ is not tuple:  # a miss, _FAILED or _Raises: the general path
        return _decline(window, n0)
    specs, nbytes, _, eid = entry
    if f.fast_inplace:
        res = args[0]
        written = _untyped_storage(res)._cdata
        if _storage_use_count(written) > 2:  # another tensor over its memory: Note [Overlapping writes]
            for i in f.tensor_pos[1:]:
                if i < n:
                    a = args[i]
                    if isinstance(a, _Tensor) and a is not res and _untyped_storage(a)._cdata == written:
                        return _decline(window, n0)  # the general path decides
    if nargs is None:
        nargs = list(args)
    node = Node(f.func, nargs, kwargs, inputs, _user_source(3), len(window.nodes))
    uid = (node.index + 1) * OUTS_PER_NODE
    if f.fast_inplace:
        node.mutates = True
        o = _alias_out(window, node, res, nargs[0], uid)
        window.written.add(written)
        if o.slot >= 0:
            window.mutated.add(o.slot)
    else:
        spec = specs[0]
        alloc = st.alloc_cpu
        if alloc is not None:
            res = alloc(spec[0], spec[1], spec[2])
        else:
            res = _empty_strided(spec[0], spec[1], dtype=spec[2], device=device)
        o = Out(window.token, FRESH, uid, spec, _weakref(res), _untyped_storage(res)._weak_ref())  # Note [Weak window]
        res._ae = o
        window.fresh.append(o)
    node.outs.append(o)
    sigs = window.sigs  # Note [Window signature] in fuser.window
    sigs.append(eid)
    sigs.extend(refs)
    if floats is not None:
        node.fbase = len(window.scalars)
        node.fpos = floats
        window.scalars.extend([kwargs[p] if type(p) is str else args[p] for p in floats])
    window.nodes.append(node)
    window.pending_bytes += nbytes
    METRICS.ops_recorded += 1
    if len(window.nodes) >= st.cut_at:
        flush(st, "period" if st.periodicity.period else "window_cap")
    elif window.pending_bytes >= st.max_bytes:
        flush(st, "bytes_cap")
    return res


def _record(st: TracerState, f, args, kwargs):
    window = st.window
    n = len(args)
    sig = list(args)
    nargs = None
    inputs = []
    snaps = []
    device = None
    # Note [Scalar fast path]: on a CPU target, an op reading only real 0-dim tensors (AdamW's
    # ``step += 1``) runs now: deferring it would make the ``step.item()`` that follows a sync.
    # It may only write a tensor whose storage holds that one element, and recorded ops snapshot
    # every real one-element tensor they read, so no pending op can see the early write.
    # Recorded ops snapshot the real 0-dim tensors they read (unless a pending op writes them: then
    # they are read in window order), so running such an op now can
    # never change what a pending op will read.
    only_real_scalars = st.scalar_fast_path
    refs = []  # Note [Window signature] in fuser.window
    slots = window.slots
    floats = []  # positions of float arguments (Note [Scalar lifting] in _ops)
    for i in f.tensor_pos:
        if i >= n:
            break
        a = args[i]
        if a is None:
            continue
        if not isinstance(a, _Tensor):  # a Python number passed where the schema says Tensor
            if a.__class__ is float and f.liftable:
                sig[i] = float
                floats.append(i)
            else:
                sig[i] = (a.__class__, a)
            continue
        if not _on_target(st, a):
            if a.dim() == 0 and a.is_cpu and i not in f.write_pos:
                snaps.append((i, len(refs)))
                refs.append(0)
                sig[i] = (a.dtype, "cpu-scalar")
                continue
            return _DECLINED
        if device is None:
            device = a.device if st.device_varies else st.device
        o = getattr(a, "_ae", None)
        if o is not None and o.win is window.token:
            if nargs is None:
                nargs = list(args)
            nargs[i] = o
            inputs.append(o)
            refs.append(o.uid)
            only_real_scalars = False
            sig[i] = o.meta  # known since it was recorded: no shape/stride objects to build
            continue
        else:
            if o is not None:
                _check_elsewhere(a, o)
            if st.scalar_fast_path:
                if a.dim():
                    only_real_scalars = False
                if a.numel() == 1 and i not in f.write_pos and not _written(window, a):
                    snaps.append((i, len(refs)))
            slot = slots.get(id(a))
            refs.append(-1 - (slot if slot is not None else window.slot_of(a)))
        sig[i] = (a.shape, a.stride(), a.dtype)
    for i in f.list_pos:
        if i >= n:
            break
        lst = args[i]
        new = list(lst)
        lsig = []
        for j, a in enumerate(lst):
            if a is None:
                lsig.append(None)
                continue
            if not _on_target(st, a):
                return _DECLINED
            if device is None:
                device = a.device if st.device_varies else st.device
            o = getattr(a, "_ae", None)
            if o is not None and o.win is window.token:
                new[j] = o
                inputs.append(o)
                refs.append(o.uid)
                only_real_scalars = False
                lsig.append(o.meta)
                continue
            else:
                if o is not None:
                    _check_elsewhere(a, o)
                if st.scalar_fast_path:
                    if a.dim():
                        only_real_scalars = False
                    if a.numel() == 1 and i not in f.write_pos and not _written(window, a):
                        a = new[j] = a.clone()  # snapshot: see Note [Scalar fast path]
                refs.append(-1 - window.slot_of(a))
            lsig.append((a.shape, a.stride(), a.dtype))
        if nargs is None:
            nargs = list(args)
        nargs[i] = new
        sig[i] = tuple(lsig)
    if only_real_scalars and device is not None and not inputs and _scalars_settled(window, f, args, n):
        return _SCALAR
    for i in f.scalar_pos:
        if i < n:
            v = args[i]
            if v.__class__ is float and f.liftable:
                sig[i] = float
                floats.append(i)
            else:
                sig[i] = (v.__class__, v)  # 1, 1.0 and True hash alike but promote differently
    for i in f.seq_pos:
        if i < n and type(args[i]) is list:
            lst = args[i]
            if i in f.scalarlist_pos and f.liftable and all(x.__class__ is float for x in lst):
                sig[i] = (float, len(lst))
                floats.extend((i, j) for j in range(len(lst)))
            else:
                sig[i] = tuple(lst)
    nkwargs = kwargs
    ksig = ()
    if kwargs:
        ksig = []
        for k, v in kwargs.items():
            if k in f.tensor_kw and v is not None:
                if not isinstance(v, _Tensor) or not _on_target(st, v):
                    return _DECLINED
                o = getattr(v, "_ae", None)
                if o is not None and o.win is window.token:
                    if nkwargs is kwargs:
                        nkwargs = dict(kwargs)
                    nkwargs[k] = o
                    inputs.append(o)
                    refs.append(o.uid)
                else:
                    if o is not None:
                        _check_elsewhere(v, o)
                    refs.append(-1 - window.slot_of(v))
                ksig.append((k, v.shape, v.stride(), v.dtype))
            else:
                if k == "device" and v is not None:
                    dv = torch.device(v)
                    if dv.type != st.target:
                        return _DECLINED
                    device = dv
                if v.__class__ is float and f.liftable:
                    ksig.append((k, float))
                    floats.append(k)
                else:
                    ksig.append((k, v.__class__, tuple(v) if type(v) is list else v))
        ksig = tuple(ksig)
    if device is None:
        if not f.factory:
            return _DECLINED  # no tensor argument on the target device: not ours
        device = torch.get_default_device()
        if device.type != st.target:
            return _DECLINED
        ksig = (ksig, torch.get_default_dtype(), "default-device")
    elif st.device_in_key:
        ksig = (ksig, device)
    written = ()  # (tensor, storage id) of every written argument, returned or not
    if f.mutates:
        written = []
        shared = False  # another TensorImpl holds a written storage: Note [Overlapping writes]
        for pos in f.write_pos:
            w = kwargs.get(pos) if type(pos) is str else (args[pos] if pos < n else None)
            for t in (w if type(w) in (list, tuple) else (w,)):
                if isinstance(t, _Tensor):
                    sid = _untyped_storage(t)._cdata
                    written.append((t, sid))
                    if _storage_use_count(sid) > 2:
                        shared = True
        if shared and _shares_written(window, args, kwargs, written):
            error = _overlap_error(f, args, kwargs, shared=True)
            if error is not None:
                raise error
    key = (f, tuple(sig), ksig)
    try:
        entry = _META_CACHE.get(key)
    except TypeError:  # an unhashable argument we do not model: run it eagerly
        return _DECLINED
    if entry is None:
        try:
            entry = _compute_meta(f, args, kwargs, device, sig, ksig, written)
        except Exception as e:
            log.debug("cannot record %s: meta execution failed: %s", f.name, e)
            entry = _FAILED
        else:
            if entry.__class__ is tuple:
                _ARITY[entry[3]] = len(refs)  # Note [Window signature] in fuser.window
        _META_CACHE[key] = entry
    if entry.__class__ is not tuple:
        if entry is _FAILED:
            return _DECLINED
        raise entry.error()  # Note [Overlapping writes]
    specs, nbytes, returns_list, eid = entry

    if snaps:
        if nargs is None:
            nargs = list(args)
        for i, r in snaps:
            # Eager reads a 0-dim tensor when the op runs; snapshot it, the program may change it
            # later (Note [Scalar fast path])
            snap = nargs[i] = args[i].clone()
            refs[r] = -1 - window.slot_of(snap)
    node = Node(f.func, nargs if nargs is not None else list(args), nkwargs, inputs, _user_source(4), len(window.nodes))
    # an op with no outputs exists for its effect (``_linalg_check_errors`` raises): never dead
    node.mutates = f.mutates or f.nrets == 0
    outs = node.outs
    results = []
    alias_ret = f.alias_ret
    uid = (node.index + 1) * OUTS_PER_NODE
    for j, spec in enumerate(specs):
        if spec is None:
            target = alias_ret[j] if j < len(alias_ret) else None
            if target is None:
                outs.append(None)
                results.append(None)
                continue
            t = args[target] if type(target) is int else kwargs[target]
            src = (nargs[target] if nargs is not None else t) if type(target) is int else nkwargs[target]
            o = _alias_out(window, node, t, src, uid + j)
            outs.append(o)
            results.append(t)
            continue
        alloc = st.alloc_cpu
        if alloc is not None:
            p = alloc(spec[0], spec[1], spec[2])
        else:
            p = _empty_strided(spec[0], spec[1], dtype=spec[2], device=device)
        o = Out(window.token, FRESH, uid + j, spec, _weakref(p), _untyped_storage(p)._weak_ref())  # Note [Weak window]
        p._ae = o
        outs.append(o)
        window.fresh.append(o)
        results.append(p)
    if f.mutates:
        # Every written argument (BatchNorm's running stats are written but not returned; foreach
        # ops write lists): later reads must flush, compiled regions write back.
        for t, sid in written:
            window.written.add(sid)
            o = getattr(t, "_ae", None)
            live = o is not None and o.win is window.token
            slot = o.slot if live else window.slot_of(t)
            if slot >= 0:
                window.mutated.add(slot)
    sigs = window.sigs
    sigs.append(eid)
    sigs.extend(refs)
    if floats:
        node.fbase = len(window.scalars)
        node.fpos = floats
        sc = window.scalars
        for pos in floats:
            if type(pos) is int:
                sc.append(args[pos])
            elif type(pos) is str:
                sc.append(kwargs[pos])
            else:
                sc.append(args[pos[0]][pos[1]])
    window.nodes.append(node)
    window.pending_bytes += nbytes
    METRICS.ops_recorded += 1  # one eager launch each: counted in eager_equivalent_launches
    if len(window.nodes) >= st.cut_at:
        flush(st, "period" if st.periodicity.period else "window_cap")
    elif window.pending_bytes >= st.max_bytes:
        flush(st, "bytes_cap")
    if f.nrets == 0:
        return None
    if f.nrets == 1 and not returns_list:
        return results[0]
    return results if returns_list else tuple(results)


def _record_view(st: TracerState, f, args, kwargs):
    res = f.func(*args, **kwargs)  # views read no data: make the real view now
    window = st.window
    a = args[0] if args else None
    if not isinstance(a, _Tensor) or not _on_target(st, a):
        return res
    # Views of real tensors are recorded too: a compiled region then derives them from the real
    # input inside the graph, instead of taking an alias of an input it may also write (Note
    # [Out kinds]); ``W.t()`` in a forward pass and ``W.add_()`` in the optimizer step.
    o = getattr(a, "_ae", None)
    if o is not None and o.win is not window.token:
        _check_elsewhere(a, o)  # a view of another thread's pending value reads it later
        o = None
    nargs = list(args)
    if o is not None:
        nargs[0] = o
        inputs = [o]
        ref = o.uid
        slot = o.slot
    else:
        inputs = []
        slot = window.slot_of(a)
        ref = -1 - slot
        if st.scalar_fast_path and a.numel() == 1:
            # a pending op may read this one-element tensor through the view: no fast-path writes
            window.viewed.add(_untyped_storage(a)._cdata)
    node = Node(f.func, nargs, kwargs, inputs, None, len(window.nodes))
    node.is_view = True
    views = res if isinstance(res, (tuple, list)) else (res,)
    uid = (node.index + 1) * OUTS_PER_NODE
    for j, v in enumerate(views):
        # held weakly (Note [Weak window]); alive, it keeps its root's storage alive
        vo = Out(window.token, VIEW, uid + j, (v.shape, v.stride(), v.dtype), _weakref(v), slot=slot)
        v._ae = vo
        node.outs.append(vo)
        window.others.append(vo)
    # the view's own signature: op, input geometry (offset included: views keep it) and arguments
    key = (f, a.shape, a.stride(), a.storage_offset(), a.dtype,
           tuple(tuple(x) if type(x) is list else x for x in args[1:]), tuple(kwargs.items()))
    eid = _VIEW_IDS.get(key)
    if eid is None:
        # one atomic step: two threads never give two signatures one id (Note [Window signature])
        eid = _VIEW_IDS.setdefault(key, -next(_SIGNATURE_IDS))
        _ARITY[eid] = 1
    sigs = window.sigs
    sigs.append(eid)
    sigs.append(ref)
    window.nodes.append(node)
    return res


_VIEW_IDS: dict = {}
_ARITY: dict = {}  # op signature id -> how many dataflow refs follow it in ``Window.sigs``


def _op_ids(sigs: list) -> list[int]:
    """The op signature ids of a window, one per node, out of its flat ``sigs``."""
    ids = []
    i, n = 0, len(sigs)
    arity = _ARITY
    while i < n:
        eid = sigs[i]
        ids.append(eid)
        i += 1 + arity[eid]
    return ids


def _random_fill(st: TracerState, f, args, kwargs):
    self = args[0]
    if not _on_target(st, self):
        return f.func(*args, **kwargs)
    if not _dense(self):  # an expanded or overlapping target has no eager-equivalent temporary
        return _eager(st, f, args, kwargs, "random")
    o = getattr(self, "_ae", None)
    if o is not None and o.win is not st.window.token:
        _check_elsewhere(self, o)  # before the draw: the op is dispatched again after that window ran
    # Draw now, in program order (Note [RNG] in _ops), into a tensor of the same geometry so the
    # generator is consumed and the values land exactly as eager would place them.
    tmp = _empty_strided(self.shape, self.stride(), dtype=self.dtype, device=self.device)
    f.func(tmp, *args[1:], **kwargs)
    METRICS.ops_eager += 1
    METRICS.launches += 1
    _record_or_run(st, facts_for(_copy_), (self, tmp), {})
    return self


def _record_or_run(st: TracerState, f, args, kwargs):
    window = st.window
    n0 = len(window.real_inputs)
    try:
        res = _record(st, f, args, kwargs)
    except BaseException:  # another thread's value (_Elsewhere), or eager's error at the op
        _decline(window, n0)  # (Note [Overlapping writes]): nothing recorded
        raise
    if (res is _SCALAR or res is _DECLINED) and len(window.real_inputs) != n0:
        _unslot(window, n0)
    if res is _SCALAR:
        METRICS.host_scalar_ops += 1
        return _eager(st, f, args, kwargs, None)
    if res is not _DECLINED:
        return res
    if not _touches_target(st, f, args, kwargs):
        return f.func(*args, **kwargs)
    return _eager(st, f, args, kwargs, _reason_for_unrecordable(st, f, args, kwargs))


class LazyMode(TorchDispatchMode):
    """Records ATen ops on the target device instead of running them."""

    def __init__(self, state: TracerState):
        super().__init__()
        self.state = state
        self.profiling = False

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode would wrap __torch_dispatch__ in torch._disable_dynamo: ~2 us per op
        # on the hottest path. Dynamo never traces into this mode's frames, so skip the wrapper.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _profiler._is_profiler_enabled and not self.profiling:
            # torch.profiler is recording: show each op's recording as a range
            self.profiling = True
            try:
                with _profiler.record_function("adaptive_eager.record"):
                    return self.__torch_dispatch__(func, types, args, kwargs)
            finally:
                self.profiling = False
        st = self.state
        st.busy += 1  # Note [Reads from other threads]
        if st.claim is not None and st.busy == 1:
            _step_back(st)
        try:
            f = _ops.FACTS.get(func)
            if f is None:
                f = facts_for(func)
            kind = f.kind
            if kwargs is None:
                kwargs = {}
            if kind == RECORD:
                if (f.fast and not kwargs) or f.fast_inplace:
                    res = _record_fast(st, f, args, kwargs)
                    if res is not _DECLINED:
                        return res
                return _record_or_run(st, f, args, kwargs)
            if kind == VIEW_OP:
                return _record_view(st, f, args, kwargs)
            if kind == ALLOC:
                return func(*args, **kwargs)
            if kind == RANDOM_FILL:
                return _random_fill(st, f, args, kwargs)
            if kind == BATCH_NORM:
                # the same arguments and kernels, but the running-stat writes are in the schema, so they
                # are marked written and functionalization returns their new values
                mutating = len(args) > 5 and args[5] and args[3] is not None and args[4] is not None
                bn = torch.ops.aten._native_batch_norm_legit.default if mutating else func
                return _record_or_run(st, facts_for(bn), args, kwargs)
            if kind == RANDOM_NEW:
                if _touches_target(st, f, args, kwargs):
                    return _eager(st, f, args, kwargs, None)
                return func(*args, **kwargs)
            # FLUSH
            if _touches_target(st, f, args, kwargs):
                return _eager(st, f, args, kwargs, f.reason)
            return func(*args, **kwargs)
        except _Elsewhere as e:
            owner, value = e.args
        finally:
            st.busy -= 1
        # The op read a value pending in another thread's window (nothing of it was recorded):
        # run that window, then dispatch the op again.
        _flush_for_reader(owner, value)
        return self.__torch_dispatch__(func, types, args, kwargs)


def _reason_for_unrecordable(st, f, args, kwargs) -> str:
    """Why ``_record`` declined an op that touches the target device (for metrics and logs)."""
    for t in _tensors(args, kwargs):
        if not _on_target(st, t) and not (t.dim() == 0 and t.is_cpu):
            return "device_copy"
    dv = kwargs.get("device")
    if dv is not None and torch.device(dv).type != st.target:
        return "device_copy"
    return f.reason


# ---------------------------------------------------------------------------------------------
# Activation


def activate(options: Options) -> TracerState:
    st = current_state()
    if st is None:
        st = _tls.state = TracerState(options)
    if st.mode is None:
        st.periodicity = None  # a new program phase: find its period afresh
        st.set_options(options)
        st.mode = LazyMode(st)
        st.mode.__enter__()
        st.sync_gc()
        from . import _patches

        _patches.install()
        _register(st)
        _install_process_hooks()
    return st


def deactivate(st: TracerState) -> None:
    try:
        flush(st, "exit")
    finally:
        if st.mode is not None:
            mode, st.mode = st.mode, None
            mode.__exit__(None, None, None)
            _unregister(st)
            _gc.release(st)
            from . import _patches

            _patches.uninstall()


def is_pending(t: torch.Tensor) -> bool:
    """Whether ``t``'s value is pending in any thread's window (Note [Reads from other threads])."""
    return owner_of(t) is not None


# ---------------------------------------------------------------------------------------------
# Worker processes

# Note [Worker processes]
# ~~~~~~~~~~~~~~~~~~~~~~~
# A child process does not record unless asked (``workers=True``, NEURON_EAGER_WORKERS=1).
# DataLoader workers and other ``multiprocessing`` children hand tensors to their parent through
# shared memory, pickled by a queue's feeder thread; a value still pending in the child's window
# would reach the parent unwritten (DataLoader batches of zeros), and the child's window would run
# at some later sync point of the child, if ever. Their work (loading, collating) is eager work.
# - fork: the forking thread's window runs first (``_before_fork``), so the child's copy of each
#   of its values is real. In the child (``_after_fork_in_child``) that thread's mode goes off.
#   The other threads do not exist there: their states lose any claim those threads held, and a
#   window one of them was recording or running at that instant cannot finish and is poisoned
#   (NaN, never uninitialized memory); their other windows stay readable (a read runs them on the
#   child's copy of their inputs: Note [Reads from other threads]). ``fuser.compiled`` forgets its
#   compile thread the same way.
# - spawn: a fresh interpreter imports torch, and NEURON_EAGER=adaptive does not turn the mode on
#   in a ``multiprocessing`` child (``_autoload._in_worker_process``).
# - forkserver: the child is forked from the server (as above, if the server had it on), and may
#   then import torch itself before it knows it is a child; ``multiprocessing`` runs its after-fork
#   hooks (``multiprocessing.util.register_after_fork``) as the child starts its target, and the
#   mode goes off there, after flushing what the child's imports recorded.
# With ``workers``, a child keeps recording (after fork, with an empty window); what it hands to
# a queue is still real when pickled, since the feeder thread's read runs the window.

_process_hooks = False


def _install_process_hooks() -> None:
    global _process_hooks
    if _process_hooks:
        return
    _process_hooks = True
    import multiprocessing.util

    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    multiprocessing.util.register_after_fork(_tls, lambda _: _leave_in_child())


def _before_fork() -> None:
    st = current_state()
    if st is not None and st.mode is not None and not st.busy:
        flush(st, "fork")


def _after_fork_in_child() -> None:
    me = current_state()
    for st in _STATES:
        # what threads that do not exist here held: a claim, a window they were running, and the
        # window of a thread that was recording (its last op half recorded); those never finish
        st.claim, st.claim_lock = None, threading.Lock()
        broken = [st.running] if st.running is not None else []
        if st.busy and st is not me:
            broken.append(st.window)
            st.window, st.busy = Window(st), 0
        for window in broken:
            _poison(window)
            _release(window)
        st.running = None
    _leave_in_child()


def _leave_in_child() -> None:
    """This process is a worker: the mode goes off unless workers record (Note [Worker processes])."""
    st = current_state()
    if st is not None and st.mode is not None and not st.options.workers:
        st.depth = 0
        deactivate(st)


__all__ = ["LazyMode", "TracerState", "flush", "activate", "deactivate", "current_state", "is_pending"]
