"""The dispatch mode: each ATen op on the target device is recorded (``_record``), run now
(``_eager``) or drawn now (random ops, Note [RNG] in ``_ops``); turning the mode on and off; and
worker processes (Note [Worker processes])."""

from __future__ import annotations

import os
import threading

import torch
import torch.autograd.profiler as _profiler
from torch.utils._python_dispatch import TorchDispatchMode

from fuser.window import Window

from . import _dropout, _gc, _heap, _patches, _state
from ._eager import _eager, _reason_for_unrecordable, _touches_target, run_untouched
from ._flush import _poison, _release, apply_frees, flush
from ._metrics import METRICS
from ._data_checks import CPU_KERNEL_DEVICES as _CPU_KERNEL_DEVICES, EAGER as _CHECK_EAGER, KEEP as _CHECK_KEEP
from ._data_checks import check as _data_check
from ._ops import HOST_DRAWN_DROPOUT as _HOST_DRAWN_DROPOUT, host_dropout_masks as _host_dropout_masks
from ._ops import host_dropout_scale as _host_dropout_scale
from ._ops import (
    ALLOC, BATCH_NORM, CHECKED, HOST_READ, INLINE, RANDOM_FILL, RANDOM_NEW, VIEW as VIEW_OP, facts_for,
    unseeded_facts,
)
from ._record import (_DECLINED, _decline, _dtype_changed, _dtype_check, _record, _record_view,
                      view_of_unwritten)
from ._state import (
    TracerState,
    _default_dtype,
    _on_target,
    _register,
    _step_back,
    _tls,
    _unregister,
    current_state,
    unpark,
)
from ._threads import _check_elsewhere, _Elsewhere, _flush_for_reader, read_on_host
from .config import Options

_empty_strided = torch.empty_strided

# Note [Tensor subclasses]
# A mode sees an op before any tensor subclass among its arguments does. A subclass made of inner
# tensors (``__tensor_flatten__``: DTensor, which FSDP2 and tensor parallelism hand out as
# parameters) is left to its own ``__torch_dispatch__`` (NotImplemented): it unwraps, computes its
# own metadata and runs plain ops on its inner tensors, which come back here and are recorded.
# Recorded with the subclass as an input, the op would run at the flush on a mix of subclass and
# plain (pending) tensors, which DTensor refuses. Other subclasses (the emulated neuron device's
# wrapper) are recorded as before.
_composite_types: dict[type, bool] = {}


def _composite(types) -> bool:
    for t in types:
        known = _composite_types.get(t)
        if known is None:
            known = _composite_types[t] = hasattr(t, "__tensor_flatten__")
        if known:
            return True
    return False

_copy_ = torch.ops.aten.copy_.default

def _dense(t: torch.Tensor) -> bool:
    from torch._prims_common import is_non_overlapping_and_dense_or_false

    try:
        return is_non_overlapping_and_dense_or_false(t)
    except (RuntimeError, NotImplementedError):  # no strides: sparse (Note [Tensors the mode leaves alone] in _state)
        return False


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
    _record_made(st, facts_for(_copy_), (self, tmp))
    return self


_native_dropout = torch.ops.aten.native_dropout.default
_lift_fresh = torch.ops.aten.lift_fresh.default
_bernoulli_ = torch.ops.aten.bernoulli_.float
_add = torch.ops.aten.add.Tensor
_mul = torch.ops.aten.mul.Tensor
_mul_scalar_ = torch.ops.aten.mul_.Scalar


def _dropout_now(st: TracerState, args, kwargs):
    """``native_dropout`` with its mask drawn now and the rest recorded (Note [Dropout drawn at
    record time] in _ops), or None where its kernel must run instead."""
    x = args[0]
    p = args[1] if len(args) > 1 else kwargs["p"]
    train = args[2] if len(args) > 2 else kwargs.get("train")
    if train is False or not _on_target(st, x) or x.numel() == 0:
        return None
    host = x.device.type in _HOST_DRAWN_DROPOUT
    compiled = st.options.dropout == "compiled" and (host or x.is_contiguous()) and x.numel() < _dropout.MAX_NUMEL
    if host or compiled:
        if not 0.0 < p < 1.0 or not x.is_floating_point():
            return None
    elif x.device.type not in _CPU_KERNEL_DEVICES or not _dense(x):
        return None
    o = getattr(x, "_ae", None)
    if o is not None and o.win is not st.window.token:
        _check_elsewhere(x, o)  # before the draw: the op is dispatched again after that window ran
    if compiled:
        return _dropout_compiled(st, x, p, host)
    METRICS.ops_eager += 1
    METRICS.launches += 1  # the draw on the device, or the host-drawn mask's copy onto it
    if host:
        mask, = _host_dropout_masks([(x.shape, p)], x.device)
        out = _record_made(st, facts_for(_mul), (x, mask))
        return _record_made(st, facts_for(_mul), (out, _host_dropout_scale(p, x.dtype))), mask
    p1m = 1.0 - p
    mask = _empty_strided(x.shape, x.stride(), dtype=torch.bool, device=x.device)
    _bernoulli_(mask, p1m)
    out = _record_made(st, facts_for(_mul), (x, mask))
    return _record_made(st, facts_for(_mul_scalar_), (out, 0.0 if p1m == 0 else 1.0 / p1m)), mask


def _dropout_compiled(st: TracerState, x, p: float, host: bool):
    """``native_dropout`` with its mask computed by recorded ops (Note [Dropout in the compiled
    code] in _dropout), the device's state advanced by one."""
    state, made = _dropout.current_state(x.device)
    if made:
        METRICS.ops_eager += 1
        METRICS.launches += 1  # the state's copy onto the device
    mask = _dropout.keep_mask(lambda op, a, kw: _record_made(st, facts_for(op), a, kw or None), state, x.shape, p, 0,
                              x.device)
    _dropout.advance(x.device, _record_made(st, facts_for(_add), (state, 1)))
    out = _record_made(st, facts_for(_mul), (x, mask))
    if host:
        return _record_made(st, facts_for(_mul), (out, _host_dropout_scale(p, x.dtype))), mask
    return _record_made(st, facts_for(_mul_scalar_), (out, 1.0 / (1.0 - p))), mask


def _record_made(st: TracerState, f, args, kwargs=None):
    """``_record_or_run`` for an op the mode makes itself or records with facts of its own (a random
    fill's copy from its drawn temporary, a dropout's multiplies by its drawn mask, attention
    without dropout): in a hot window it is validated as a dispatched op is (Note [Hot windows] in
    _hot), so a step with dropout or attention runs hot; a drawn tensor is a new real input each
    step, in the slot the template has for it."""
    _dtype_check(st)
    return _record_or_run(st, f, args, kwargs)


def _record_checked(st: TracerState, f, args, kwargs):
    """A CHECKED op: eagerly where its real values fail its kernel's check, else recorded, its result
    kept for the flush where they are pending (Note [Errors from data] in _data_checks)."""
    verdict = _data_check(st, f, args, kwargs)
    if verdict == _CHECK_EAGER:
        return _eager(st, f, args, kwargs if kwargs is not None else {}, "index_check")
    _dtype_check(st)
    res = _record_or_run(st, f, args, kwargs)
    if verdict == _CHECK_KEEP:
        # an in-place op's result is the tensor it writes: held, a write into a dropped
        # intermediate is computed too (a compiled region drops the writes nothing reads)
        kept = st.window.kept
        for t in (res if type(res) in (tuple, list) else (res,)):
            if getattr(t, "_ae", None) is not None:
                kept.append(t)
    return res


def _record_or_run(st: TracerState, f, args, kwargs):
    """Record the op (``_record``) or, where it is not recorded, run it eagerly; ``kwargs`` may be
    None (none given); the caller checked the default dtype (``_record._dtype_check``).
    ``LazyMode.__torch_dispatch__`` has this inline."""
    window = st.window
    try:
        res = _record(st, window, f, args, kwargs, window.hot)
    except BaseException:  # another thread's value (_Elsewhere), or eager's error at the op
        _decline(window)  # (Note [Overlapping writes]): nothing recorded
        raise
    if res is not _DECLINED:
        return res
    return _not_recorded(st, f, args, kwargs)


def _not_recorded(st: TracerState, f, args, kwargs):
    """What ``_record_or_run`` does with an op ``_record`` declined: run it now."""
    if kwargs is None:
        kwargs = {}
    if not _touches_target(st, f, args, kwargs):
        return run_untouched(f, args, kwargs)  # Note [Tensors the mode leaves alone] in _state
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
        if types and _composite(types):  # empty for plain tensors: Note [Tensor subclasses]
            return NotImplemented
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
            try:
                f = func._ae_facts  # (``facts_for``)
            except AttributeError:
                f = facts_for(func)
            kind = f.kind
            if not kind:  # RECORD (0): ``_dtype_check``, then ``_record_or_run``, inline: the hottest lines of the library
                if _default_dtype() is not st.dtype:  # ``_dtype_check``, inline
                    _dtype_changed(st)
                window = st.window
                try:
                    res = _record(st, window, f, args, kwargs, window.hot)  # kwargs None or a dict
                except BaseException:  # ``_record_or_run``, inline
                    _decline(window)
                    raise
                if res is not _DECLINED:
                    return res
                return _not_recorded(st, f, args, kwargs)
            if kind == CHECKED:
                return _record_checked(st, f, args, kwargs)
            if kind == VIEW_OP:
                if func is _lift_fresh and args[0].device.type != "cpu":
                    # ``torch.tensor(data, device=...)``: its copy from the host ran below this mode
                    METRICS.launches += 1
                    METRICS.eager_equivalent_launches += 1
                window = st.window
                if args and view_of_unwritten(st, window, args[0]):  # Note [Views of unwritten memory] in _record
                    return f.call(*args, **kwargs) if kwargs else f.call(*args)
                return _record_view(st, f, args, kwargs)  # kwargs None or a dict
            if kwargs is None:
                kwargs = {}
            if kind == ALLOC:
                if f.factory and (dv := kwargs.get("device")) is not None and dv.type != st.target:
                    return run_untouched(f, args, kwargs)  # Note [Tensors the mode leaves alone] in _state
                return func(*args, **kwargs)
            if kind == RANDOM_FILL:
                return _random_fill(st, f, args, kwargs)
            if kind == BATCH_NORM:
                # the same arguments and kernels, but the running-stat writes are in the schema, so they
                # are marked written and functionalization returns their new values
                mutating = len(args) > 5 and args[5] and args[3] is not None and args[4] is not None
                bn = torch.ops.aten._native_batch_norm_legit.default if mutating else func
                _dtype_check(st)
                return _record_or_run(st, facts_for(bn), args, kwargs)
            if kind == RANDOM_NEW:
                if _touches_target(st, f, args, kwargs):
                    return _eager(st, f, args, kwargs, None)
                return run_untouched(f, args, kwargs)
            if kind == INLINE:
                with self:  # its ops come back here (Note [Ops run inline] in _ops)
                    return f.decomposition(*args, **kwargs)
            if kind == HOST_READ:  # Note [Composites that read memory] in _ops
                if read_on_host(func, f.host_read, args, kwargs):
                    return func(*args, **kwargs)  # the mode is off here: its kernel runs eagerly
                with self:
                    return f.decomposition(*args, **kwargs)
            # FLUSH
            if func is _native_dropout and (res := _dropout_now(st, args, kwargs)) is not None:
                return res
            if f.unseeded is not None and (unseeded := unseeded_facts(f, args, kwargs)) is not None:
                return _record_made(st, unseeded, args, kwargs)  # attention without dropout: it draws nothing
            if _touches_target(st, f, args, kwargs):
                return _eager(st, f, args, kwargs, f.reason)
            return run_untouched(f, args, kwargs)
        except _Elsewhere as e:
            owner, value = e.args
        finally:
            st.busy -= 1
        # The op read a value pending in another thread's window (nothing of it was recorded):
        # run that window, then dispatch the op again.
        _flush_for_reader(owner, value)
        return self.__torch_dispatch__(func, types, args, kwargs)


def _open_caches(options: Options) -> None:
    """What the first window's flush needs, done at the mode's entry rather than inside that flush
    (the fuser's modules, the store's SQLite open, the meta entries; not on a background thread,
    which would share the GIL with the program's first step); a failure is left for that flush to
    meet and report."""
    if options.backend == "replay":
        return  # replay opens no store
    try:
        import fuser.regions  # noqa: F401
        from fuser.artifacts import _store

        from . import _meta_disk

        backend = None
        # the backends whose compile worker a warm-up readies without a device: not ``neuron``,
        # whose worker would reach torch-neuronx (the stablehlo backend's first job in a cold
        # worker waited 5-10 s for torch, jax and torch-mlir's imports and XLA's first compile)
        if options.backend in ("inductor", "stablehlo"):
            from fuser.backends import get_backend

            backend = get_backend(options.backend, options.device)
        store = _store(options)
        _meta_disk.table_for(options)
        if backend is not None and options.async_compile:
            from fuser.artifacts import warm_worker

            warm_worker(store, backend, options)  # Note [Warm workers] in neff_cache.jobs
    except Exception as e:  # noqa: BLE001 - the flush opens the store again and says what is wrong
        from ._log import log

        log.debug("adaptive_eager: the cache was not opened at the mode's entry: %s", e)


def activate(options: Options) -> TracerState:
    st = current_state()
    if st is None:
        st = _tls.state = TracerState(options)
    if st.mode is None:
        if options.device == "cpu" and _heap.outcome() is None:
            _heap.tune()  # once per process: Note [Heap thresholds] in _heap
        _open_caches(options)
        st.periodicity = None  # a new program phase: find its period afresh
        st.theirs, st.parks = False, 0  # (Note [The mode parked between captured calls] in _state)
        st.set_options(options)
        st.mode = LazyMode(st)
        st.mode.__enter__()
        st.sync_gc()
        _patches.install()
        for _ in range(_register(st)):  # ended threads' states, each with the patches installed
            _patches.uninstall()
        _install_process_hooks()
    return st


def deactivate(st: TracerState) -> None:
    if st.parked:  # Note [The mode parked between captured calls] in _state
        unpark(st)
    try:
        flush(st, "exit")
    finally:
        if st.mode is not None:
            mode, st.mode = st.mode, None
            mode.__exit__(None, None, None)
            _unregister(st)
            _gc.release(st)
            _patches.uninstall()


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
#   child's copy of their inputs: Note [Reads from other threads]). ``fuser.artifacts`` forgets its
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


# Note [Flush at a fork]
# ~~~~~~~~~~~~~~~~~~~~~~
# The flush before a fork (Note [Worker processes]) runs inside ``os.fork``'s before-fork hooks,
# and those of other libraries may already have run: filelock (4.x, which Inductor uses around
# its C++ builds) closes a gate there that no other thread passes until the fork is over. A flush
# that compiled here would wait for the compile thread, stopped at that gate: the program hung at
# its DataLoader's ``iter()`` (seen: a window due for its compile at the fork, async_compile=False).
# So this flush waits for no other thread (``fuser.run_window(..., now=True)``): the window runs
# compiled if its region's callable is in memory, else it replays ("fork" in ``replay_reasons``;
# its next sight compiles as usual); no compile, load, store access or background job starts, and
# none in flight is waited for. A window another thread is running for this one at that instant
# (a claim, Note [Reads from other threads]) is not waited for either: the fork goes on, and the
# child finds that window poisoned (below), the parent its values when the claim ends.
def _before_fork() -> None:
    st = current_state()
    if st is not None and st.mode is not None and not st.busy and st.claim is None:
        flush(st, "fork", now=True)  # Note [Flush at a fork]


def _after_fork_in_child() -> None:
    me = current_state()
    for st in _state._STATES:
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
            apply_frees(window)  # Note [Storage resize] in _patches: they wait for nothing now
        st.running = None
    _leave_in_child()


def _leave_in_child() -> None:
    """This process is a worker: the mode goes off unless workers record (Note [Worker processes])."""
    st = current_state()
    if st is not None and st.mode is not None and not st.options.workers:
        st.depth = 0
        deactivate(st)
