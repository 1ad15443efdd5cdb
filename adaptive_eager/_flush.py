"""A sync point: run the open window, bind every live result into the program's tensors, and on a
failure poison what was not computed and raise the user's error at the line it belongs to."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque

import torch
import torch.autograd.profiler as _profiler
from torch.multiprocessing.reductions import StorageWeakRef
from torch._ops import _len_torch_dispatch_stack_pre_dispatch
from torch.utils._python_dispatch import _disable_current_modes

import fuser
from fuser.window import Window, op_ids, where

from . import _cores, _meta_disk
from ._hot import adopt_hot, count_hot, expect_hot, template_for
from ._log import log
from ._metrics import METRICS
from ._signatures import bounded_put
from ._source import _flush_site
from ._state import TracerState, _default_dtype, _step_back, _tls, next_cut

_free_weak_ref = torch.UntypedStorage._free_weak_ref
_untyped_storage = torch._C.TensorBase.untyped_storage  # unpatched (adaptive_eager._patches)
_len_dispatch_stack = torch._C._len_torch_dispatch_stack
_pop_dispatch_stack = torch._C._pop_torch_dispatch_stack
_push_dispatch_stack = torch._C._push_on_torch_dispatch_stack
_storage_resize = torch.UntypedStorage.resize_  # the C method (``_patches`` wraps it while installed)
_DEFERRED: dict = {}  # storage ``_cdata`` -> the window whose run frees it (Note [Storage resize] in _patches)


class _modes_off:
    """``_disable_current_modes`` for every flush: the window runs with no dispatch mode (not this
    thread's LazyMode, nor a mode the program entered before it). Without pre-dispatch modes
    (``torch.export``'s tracing), which only the general version handles, it is the same pops and
    pushes of the mode stack; the general version's imports and checks cost ~40 us a flush."""

    __slots__ = ("modes", "general")

    def __enter__(self) -> None:
        if _len_torch_dispatch_stack_pre_dispatch():
            self.general = _disable_current_modes()
            self.general.__enter__()
            return
        self.general = None
        self.modes = [_pop_dispatch_stack(None) for _ in range(_len_dispatch_stack())]

    def __exit__(self, *exc) -> None:
        if self.general is not None:
            self.general.__exit__(*exc)
            return
        for mode in reversed(self.modes):
            _push_dispatch_stack(mode)

_CUTS = ("window_cap", "period")


def flush(st: TracerState, reason: str, now: bool = False) -> None:
    """Run the open window (if any) and bind every live result into the program's tensors.

    For the thread that owns ``st``; a read in another thread runs it with ``_flush_for_reader``.
    ``now``: without waiting for another thread (Note [Flush at a fork] in ``_mode``)."""
    if not st.window.nodes and st.claim is None:
        return
    st.busy += 1  # Note [Reads from other threads]
    if st.claim is not None and st.busy == 1:
        _step_back(st)
    try:
        _run(st, reason, now)
    finally:
        st.busy -= 1


def _run(st: TracerState, reason: str, now: bool = False) -> None:
    """``flush``'s work, by whichever thread may touch ``st``'s window now."""
    window = st.window
    if not window.nodes or getattr(_tls, "running", None) is not None:
        # nothing pending, or this thread is running a window: its ops read every value they
        # use when it was real, and the fuser is not reentrant (Note [Reads from other threads])
        return
    t0 = time.perf_counter()
    if window.hot is not None:
        count_hot(window, window.hot)  # its hot records: it records no more (Note [Hot record cost] in _hot)
    st.running = window  # before the swap: a reader in another thread always finds the window
    st.window = Window(st)  # first: anything the run triggers must not see the old window
    if getattr(_tls, "capture_due", False) and getattr(_tls, "state", None) is st:
        st.window.superseded = True  # Note [Windows a capture supersedes] in _capture
    _tls.running = window
    cores = _cores.lower()  # Note [Cores beside a compile]
    try:
        _run_window(st, window, reason, now)
        if _meta_disk._NEW[0] and not now:
            _meta_disk.after_flush()  # Note [Meta entries on disk]
    finally:
        _cores.restore(cores)
        _tls.running = st.running = None
        if window.frees:  # Note [Storage resize] in _patches: the frees that waited for it
            apply_frees(window)
        METRICS.flush_seconds += time.perf_counter() - t0


def apply_frees(window) -> None:
    """Free the storages whose ``resize_(0)`` waited for ``window`` (Note [Storage resize] in _patches)."""
    frees = window.frees
    if not frees:
        return
    window.frees = {}
    with _disable_current_modes():
        for sid, storage in frees.items():
            if _DEFERRED.get(sid) is window:
                del _DEFERRED[sid]
            _storage_resize(storage, 0)


def _run_window(st: TracerState, window: Window, reason: str, now: bool = False) -> None:
    ran = False
    site = result = None
    try:
        hot = window.hot  # Note [Hot windows] in _hot
        if hot is not None and len(window.nodes) != len(hot.ops):
            hot.demote(window, "ended_early")
            hot = None
        if window.mutated:
            learn_written(window)  # Note [Views of unwritten memory] in _record
        per = st.periodicity
        per.on_flush(len(window.nodes), window.sigs if hot is None else hot.sigs, reason in _CUTS, op_ids)
        st.cut_at = next_cut(st)
        METRICS.flushes[reason] += 1
        METRICS.windows += 1
        # the user's line that triggered the flush, and a library's it called: Note [Whose line]
        site, inside = _flush_site(2)
        METRICS.flush_sites[(reason, site, inside)] += 1
        with (_profiler.record_function("adaptive_eager.flush") if _profiler._is_profiler_enabled
              else contextlib.nullcontext()), _modes_off(), _recorded_dtype(st.dtype):
            if hot is None:
                result = fuser.run_window(window, st.options, now)
            else:
                result = _run_validated(st, window, hot, now)
        ran = True  # ``Window.live`` is read: Note [Window release]
        if window.hot is not None:  # validated, and run without a key (else it was demoted)
            METRICS.hot_windows += 1
        _arm(st, window, result)
        METRICS.launches += result.launches
        METRICS.ops_materialized += result.computed
        METRICS.ops_eliminated += result.dead
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
                     (result and result.region) or "-", result.outcome if result else "failed",
                     where(site))
        if not ran:
            adopt_hot(window)  # a hot window's values whose tensors live (Note [Hot liveness] in _hot)
            window.live = list(window.fresh)  # unread: any of them may be marked on a live tensor
        _release(window)


# storages (``_cdata``) of real tensors that recorded ops wrote -> a weak reference to the storage:
# an address a freed storage left is no written memory (``is_written``)
WRITTEN: dict[int, StorageWeakRef] = {}


def learn_written(window: Window) -> None:
    """Remember the storages of ``window``'s written real inputs (Note [Views of unwritten memory]
    in _record: their views are recorded from now on)."""
    real = window.real_inputs
    written = WRITTEN
    for slot in window.mutated:
        storage = _untyped_storage(real[slot])
        sid = storage._cdata
        if sid not in written or written[sid].expired():
            written.pop(sid, None)
            bounded_put(written, sid, StorageWeakRef(storage))


def is_written(sid: int) -> bool:
    """Whether recorded ops wrote the live storage at ``sid``; one that was freed is forgotten (its
    address, reused by a dataset's storage, made every row a recorded view: a new key each step)."""
    ref = WRITTEN.get(sid)
    if ref is None:
        return False
    if ref.expired():
        WRITTEN.pop(sid, None)
        return False
    return True


def _run_validated(st: TracerState, window: Window, hot, now: bool) -> fuser.FlushResult:
    """Run a window recorded hot against ``hot`` to its end: handed to the fuser with the region
    entry it was validated against; one the fuser declines is demoted, its Nodes made, and its
    run resumed (Note [Validated windows] in fuser.regions)."""
    adopt_hot(window)  # its liveness is by storage from here (Note [Hot liveness] in _hot)
    entry = hot.entry()
    if entry is None:  # the fuser dropped the region while the window recorded (Note [Templates by region])
        hot.demote(window, "region")
        return fuser.run_window(window, st.options, now)
    result = fuser.run_window(window, st.options, now, validated=entry)
    if result.declined is None:
        return result
    hot.demote(window, result.declined)
    return fuser.run_window(window, st.options, now, resume=result.resume)


def _arm(st: TracerState, window: Window, result: fuser.FlushResult) -> None:
    """After a window ran: the next one is recorded against the template of the last window that
    ran compiled, or of the one that followed that last time (Note [Hot windows])."""
    entry = result.entry
    if entry is not None:
        template = template_for(st, window, entry)
        if template is not None:
            if st.hot_prev is not None:
                st.hot_prev.after = template
            st.hot_prev = template
    expect_hot(st)


@contextlib.contextmanager
def _recorded_dtype(dtype: torch.dtype):
    """The window runs (and is compiled) under the default dtype its ops were recorded under, which
    the program may have changed since (Note [Meta cache key])."""
    ambient = _default_dtype()
    if dtype is None or dtype is ambient:
        yield
        return
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(ambient)


def _poison(window: Window) -> None:
    """A window failed: the values its later ops would have made were never computed. Eager
    would not have run those lines at all; make what the program holds of them unmistakable (NaN,
    or 0 for integers and bools) instead of leaving uninitialized memory. A value is computed once
    the run bound it (``Out.value``), in replay and compiled regions alike."""
    adopt_hot(window)  # a hot window's values whose tensors live (Note [Hot liveness] in _hot)
    with _disable_current_modes(), torch.no_grad():
        for o in window.fresh:
            if o.value is not None or fuser.value_is_dead(o):
                continue
            t = fuser.placeholder_of(o)
            if t.numel():
                t.fill_(float("nan") if (t.is_floating_point() or t.is_complex()) else 0)


def _release(window: Window) -> None:
    """Unmark the tensors that outlive ``window`` and drop what their Outs hold; free the storage
    handles. The rest goes with the window, by reference counting: Note [Window release]."""
    deque(map(_free_weak_ref, window.handles), maxlen=0)  # one C call each, no Python iteration
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
    window.handles.clear()
    window.live.clear()
    window.others.clear()
    window.nodes.clear()
    window.real_inputs.clear()
    window.kept.clear()


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
