"""Reads of pending values from any thread (Note [Reads from other threads]): who owns a value, and
running another thread's window for a reader."""

from __future__ import annotations

import threading
import time

import torch

from . import _state
from ._args import _tensors
from ._flush import _run, flush
from ._state import TracerState, _on_target, _strided, _tls, current_state

_untyped_storage = torch._C.TensorBase.untyped_storage  # unpatched (adaptive_eager._patches)

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
# - An alias made without the mode: ``loss.detach()`` (or any view) in a thread without the mode
#   is a new tensor with no mark over the placeholder's storage, so ``owner_of`` also looks, for
#   a tensor with no mark, among the FRESH placeholders' storages of the *other* threads' windows
#   (``Window.handles``; while hot, the storages of the tensors in ``Window.alive``). Only there:
#   in the owner's own thread such an alias is made by a recorded op and carries a mark, so its
#   hot per-op reads (``item`` in an optimizer) pay nothing for it. A hot window's value is live
#   while its tensor is (Note [Hot liveness] in ``_hot``), so the alias reads right while the
#   program still holds the original (the usual case: the thread got the loss and detaches it);
#   an alias kept after the program dropped the original is the case below.
# - Not covered: ATen ops on a pending value in a thread *without* the mode (``t + 1``,
#   ``torch.cat``, a module's forward there). Dispatch modes are per thread and a plain tensor has
#   no ``__torch_function__``, so no Python sees those ops: they read the placeholder's memory.
#   Every Python-level read is covered (``item``, ``float``/``int``, ``tolist``, ``numpy``,
#   ``repr``/``print``/formatting, pickling and ``torch.save``, ``copy.deepcopy``, storage and
#   ``data_ptr`` access, and so ``torch.multiprocessing``'s sharing), as is any op in a thread
#   with the mode on. A value used by ATen ops in a plain thread must be handed over after one of
#   those reads, or after ``adaptive_eager.sync()`` in the owning thread. So must an alias made
#   there (``detach``, a view) that the thread keeps after the program dropped the original, in a
#   hot window: no Python saw it made, and the value died with its tensor.


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


def _holds_fresh(window, sid: int) -> bool:
    """Whether storage ``sid`` is a FRESH placeholder's of ``window``: ``Window.handles`` (equal to
    the storages' ``_cdata``) and, while hot, the storages of the tensors in ``Window.alive``."""
    if sid in window.handles:
        return True
    alive = window.alive
    if alive:
        for r in list(alive):  # a copy: a value dying now takes its reference out of the set
            p = r()
            if p is not None and _untyped_storage(p)._cdata == sid:
                return True
    return False


def owner_of(t) -> TracerState | None:
    """The state whose window holds ``t``'s pending value, any thread's; None when ``t`` is real."""
    o = getattr(t, "_ae", None)
    if o is not None and pending_mark(o):
        return o.win.owner
    sid = None
    me = getattr(_tls, "state", None)
    for st in _state._STATES:
        window = st.window
        written = window.written
        running = st.running
        if running is not None:
            written = written | running.written
        # an unmarked alias of another thread's placeholder (Note [Reads from other threads])
        fresh = o is None and st is not me and (window.nodes or running is not None)
        if (written or fresh) and _on_target(st, t):  # Note [Tensors the mode leaves alone] in _state
            if sid is None:
                if t.layout is not _strided:
                    return None  # no storage of its own; its ops flush for what they read
                try:
                    sid = _untyped_storage(t)._cdata
                except (RuntimeError, NotImplementedError):  # no storage: no pending op writes it
                    return None
            if sid in written:
                return st
            if fresh and (_holds_fresh(window, sid) or running is not None and _holds_fresh(running, sid)):
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


def nothing_pending() -> bool:
    """Whether no thread's window holds a recorded op, open or running: then no value is pending
    anywhere, and ``owner_of`` answers None for every tensor (as ``_state._prune`` decides)."""
    for st in _state._STATES:
        if st.window.nodes or st.running is not None:
            return False
    return True


def single_owner(tensors) -> TracerState | None:
    """The one state whose window holds pending values among ``tensors``; None when none is pending
    or several windows hold them. With one window holding ops anywhere (the usual case), the first
    pending tensor answers: ``tensors`` in the order most likely to find it first."""
    holders = [st for st in _state._STATES if st.window.nodes or st.running is not None]
    if not holders:
        return None
    if len(holders) == 1:
        for t in tensors:
            if isinstance(t, torch.Tensor) and owner_of(t) is not None:
                return holders[0]
        return None
    owners = {owner_of(t) for t in tensors if isinstance(t, torch.Tensor)}
    owners.discard(None)
    return owners.pop() if len(owners) == 1 else None


def sync_values(tensors, reason: str) -> None:
    """``sync_value`` for each of ``tensors``, until nothing is pending anywhere: the first read
    usually runs the one window that holds them all."""
    for t in tensors:
        if nothing_pending():
            return
        if isinstance(t, torch.Tensor):
            sync_value(t, reason)


def _flush_for_reader(st: TracerState, t) -> None:
    """Run ``st``'s window, another thread's, because this thread (not running a window) reads ``t``
    (None: whatever the window holds, Note [Storage resize] in ``_patches``)."""
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
            if t is None or owner_of(t) is st:
                _run(st, "other_thread")
        finally:
            st.claim = None
            claim.set()


def is_pending(t: torch.Tensor) -> bool:
    """Whether ``t``'s value is pending in any thread's window (Note [Reads from other threads])."""
    return owner_of(t) is not None


def read_on_host(op, where, args, kwargs) -> bool:
    """Make the values a composite reads on the host real (Note [Composites that read memory] in _ops);
    True when it must run with the mode off, its window run first (it reads what it computes)."""
    if where is None:
        for t in _tensors(args, kwargs):
            sync_value(t, "host_indices")  # another thread's value
        st = current_state()
        if st is not None and st.window.nodes:
            flush(st, "host_indices")
        return True
    for i, name in where:
        t = args[i] if i < len(args) else kwargs.get(name)
        if isinstance(t, torch.Tensor):
            sync_value(t, "host_indices")
    return False
