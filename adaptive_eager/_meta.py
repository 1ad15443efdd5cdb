"""An op's output metadata from its signature: the meta cache (Note [Meta cache key]), the meta
kernel run on a miss, and eager's layouts (Note [Eager layouts])."""

from __future__ import annotations

import functools

import torch
from fuser.backends._common import launches_op
from fuser.window import ARITY

from . import _meta_disk, _signatures
from ._kernel_warnings import kernel_warnings, warnings_of
from ._log import log
from ._metrics import METRICS
from ._source import warn
from ._overlap import _Raises, _extent, _has_internal_overlap, _overlap_error

_Tensor = torch.Tensor
_empty_strided = torch.empty_strided
_untyped_storage = torch._C.TensorBase.untyped_storage  # unpatched (adaptive_eager._patches)


class _Failed:
    """A meta-cache entry for a signature that cannot be recorded (its meta kernel raised): the op
    runs eagerly, and the reason is kept for ``cache_info()``."""

    __slots__ = ("op", "reason")

    def __init__(self, op: str, reason: str):
        self.op, self.reason = op, reason


class _Resizes:
    """A meta-cache entry for an ``out=`` signature whose output eager resizes (Note [Out
    resizing]): the new geometry of each written argument that changes, and the warnings eager
    gives for it."""

    __slots__ = ("changes", "warnings")

    def __init__(self, changes: tuple, warnings: tuple):
        self.changes = changes  # ((argument position or keyword, shape, stride), ...)
        self.warnings = warnings  # ((category, message), ...)


class _Warns:
    """A meta-cache entry for a signature whose kernel warns each time it runs: the op runs eagerly,
    where eager's kernel gives its warnings (Note [Kernel warnings])."""

    __slots__ = ("op", "warnings")

    def __init__(self, op: str, warnings: tuple):
        self.op = op
        self.warnings = warnings  # ((category, message), ...), for cache_info()


def _texts(caught) -> list:
    return [(w.category, str(w.message)) for w in caught]


def _meta(t):
    return _empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _written_args(f, args, kwargs):
    """(position or keyword, tensor) of each tensor argument the op writes."""
    for pos in f.write_pos:
        t = kwargs.get(pos) if type(pos) is str else (args[pos] if pos < len(args) else None)
        if isinstance(t, _Tensor):
            yield pos, t


def _compute_meta(f, args, kwargs, dtype, sig, ksig, written):
    """Output metadata by running the op on meta tensors (the slow path: ~65 us); or, for a
    signature eager rejects from its metadata, ``_Raises`` (Note [Overlapping writes]).
    ``written``: the (tensor, storage id) pairs of the tensors the op writes; ``dtype``: the
    default dtype (Note [Meta cache key])."""
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
    run = lambda: f.func(*margs, **mkwargs)  # noqa: E731
    res, caught = kernel_warnings(run)  # the meta kernel's: Note [Kernel warnings]
    if f.mutates and any(t.shape != m.shape or t.stride() != m.stride()
                         for (_, t), (_, m) in zip(_written_args(f, args, kwargs), _written_args(f, margs, mkwargs))):
        return _out_resizes(f, args, kwargs)
    outs = res if isinstance(res, (tuple, list)) else (res,)
    specs = []
    nbytes = 0
    for j, r in enumerate(outs):
        if r is None or (j < len(f.alias_ret) and f.alias_ret[j] is not None):
            specs.append(None)
            continue
        if not isinstance(r, _Tensor):
            raise NotImplementedError(f"{f.name} returns a non-tensor")
        if r.layout is not torch.strided:  # Note [Tensors the mode leaves alone] in _state
            raise NotImplementedError(f"{f.name} returns a {r.layout} tensor: sparse layouts run eagerly")
        specs.append((tuple(r.shape), tuple(r.stride()), r.dtype))
        nbytes += _untyped_storage(r).nbytes() if r.numel() else 0
    specs, probe = _eager_layouts(f, args, kwargs, specs)
    specs = tuple(specs)
    eid = _signatures.structure_id((f, tuple(sig), ksig, specs, dtype))
    entry = (specs, nbytes, isinstance(res, list), eid)
    if probe is None:  # no device run: the meta kernel's warnings stand for the device's
        first, probe = _texts(caught), run
    else:
        first = _texts(caught) + probe[0]
        probe = probe[1]
    if not first:
        return entry, ()
    again = _texts(warnings_of(probe))  # what it gives each time; the rest, once a process
    once = tuple(dict.fromkeys(w for w in first if w not in again))
    return (_Warns(f.name, tuple(again)) if again else entry), once


# Note [Eager layouts]
# A meta kernel knows an op's output shapes and dtypes, but not always the layout the device's own
# kernel picks: it has no device (a channels_last convolution comes out contiguous on meta, as do
# the FFTs, pixel_shuffle and others), and some Python meta kernels order strides differently from
# the device kernels (``div`` with a transposed operand). The program must see eager's strides
# while a value is pending, since they decide what a view of it is and whether ``reshape`` copies;
# the value's run would not fix them (``fuser.replay._bind`` keeps the placeholder's layout). So on
# a meta-cache miss (once per signature, never in a hot window) the op also runs for real
# on its own device, and every fresh output takes that run's strides. The run reads the program's
# float tensors as they are (placeholders hold uninitialized memory: harmless to a kernel, and only
# the layout is kept) and copies nothing of them; integer and bool inputs are zeros of the same
# geometry (garbage indices would fail or read out of bounds; zero is a valid index into any
# non-empty dimension), and so is a written argument, so the run changes nothing the program holds.
# If that run raises (an integer division by zero, a kernel that checks its floats), every input is
# ones of its geometry for a second try; if that raises too, the signature runs eagerly (Note
# [Errors at the statement]). Factories have no input layout to follow and skip the run. An op
# whose outputs are all its arguments (in place, ``out=``) has no layout to learn but runs as well,
# for its errors and warnings (Note [Kernel warnings]: ``index_put_`` with a uint8 mask warns in its
# kernel, not in its meta kernel); its written arguments are stand-ins, so that run costs one copy
# of them, once per signature. Recorded ops draw no random numbers
# (Note [RNG] in _ops), so the run consumes no generator. Ops that take a kernel's opaque state
# skip the run too (an argument named ``workspace`` or ``reserve``: ``mkldnn_rnn_layer_backward``,
# cuDNN's RNN and batch-norm backward): the kernel reads what its forward wrote there as its own
# bookkeeping, not as numbers, and a placeholder's uninitialized memory there crashed the process
# (a segmentation fault training ``nn.LSTM``); their meta kernel's layout stands.


# Note [Errors at the statement]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Eager raises at the op what its kernel finds wrong with the arguments' metadata, dtypes and
# scalars (``torch.add(b, b, alpha=1.1)`` of bools, ``index_fill_`` with a complex value, an
# ``index_put_`` whose values do not broadcast to the indexed shape), and many of those checks are
# in the device's kernel only, not in the meta kernel. Recorded, the op would raise when its window
# runs: past the user's ``try``, or never when its result is dropped. Such checks do not depend on
# the values, so the real run Note [Eager layouts] makes at a meta-cache miss finds them: it runs
# for every op that is not a factory (in-place ops too, which have no layout to learn), and when
# every try raises, the signature cannot be recorded (``_Failed``): each call runs eagerly, after a
# flush where it reads pending values, and raises eager's own error (type and message) at its line,
# having changed nothing eager's kernel would not. The key names each non-float scalar by type and
# value and each tensor by dtype (Note [Meta cache key]), so another scalar or dtype is a miss,
# probed again. Two limits: a liftable float is ``float`` in the key (Note [Scalar recording] in
# _ops), so a check on a float's value (not its type) that the meta kernel lacks is found for the
# value seen first; and an in-place op whose written stand-ins would exceed
# ``PROBE_WRITTEN_BYTES`` (a foreach optimizer update of a large model: the probe would hold a copy
# of all of it) skips the run, and its meta kernel's checks stand. Errors that depend on the
# values: Note [Errors from data] in _data_checks.


# Note [Out resizing]
# ~~~~~~~~~~~~~~~~~~~
# Eager resizes an ``out=`` tensor whose shape is not the result's (``at::native::resize_output``):
# silently when it has no elements, with a UserWarning ("An output with one or more elements was
# resized ...", deprecated) otherwise; a structured kernel then gives it the strides it computed
# (``as_strided_``: an input's permutation, a memory format). The program sees the new geometry
# right after the op, so it cannot wait for the flush (where the recorded op would write a result
# of one shape into a placeholder of another). A meta-cache miss whose meta run changes a written
# argument's geometry runs the op for real on stand-ins (as Note [Eager layouts] does) to learn
# the device kernel's geometry and what it warns (Note [Kernel warnings]); the entry
# (``_Resizes``) keeps both. At each such op the recorder (``_record.resize_outs``) then does what
# the kernel would: the warnings, at the frame where eager's land (``_source.warn(as_kernel=True)``),
# and ``resize_`` then ``as_strided_`` on the real tensor, below the mode and below
# ADInplaceOrView (eager's kernel bumps no version for it); then it records the op again, with an
# ``out=`` of the result's geometry: an ordinary ``out=`` op (Note [Out kinds] in fuser.window).
# A resize changes the tensor's metadata, and its storage too when it grows (the same
# ``StorageImpl``, more memory, the old bytes copied, as in eager), so it must not happen under
# pending ops that use that tensor (by its TensorImpl: they would run on the new geometry) or its
# storage through another tensor: if the out is pending, is an input of the window, has a pending
# write, or shares its storage with another tensor, the window runs first (reason
# ``out_resize``). A fresh ``torch.empty(0)`` out, the common idiom, shares nothing and costs no
# flush. An out that shares memory with another argument of the op (``add(o, b, out=o)``, which
# eager refuses; ``mm(o.view(2, 2), w, out=o)``, whose value depends on the order the kernel reads
# and writes) runs eagerly, after a flush, for eager's error or value: the probes, on separate
# stand-ins, cannot tell. An op eager refuses from dtypes (a result it cannot cast to the out's)
# raises in the meta run, as eager's kernel checks before it resizes, and runs eagerly to raise
# eager's error; so does a signature whose stand-in runs fail.


def _out_resizes(f, args, kwargs):
    """The ``_Resizes`` entry of an out= signature eager resizes, from the op run on stand-ins of
    its arguments (Note [Out resizing]); raises when the runs fail (the signature is then _Failed)."""
    written = f.write_pos

    def stand_in(t, written: bool, fill):
        if not isinstance(t, _Tensor):
            return t
        if fill is None and not written and (t.is_floating_point() or t.is_complex()):
            return t
        return torch.full((_extent(t),), fill or 0, dtype=t.dtype, device=t.device).as_strided(t.shape, t.stride())

    for fill in (None, 1):
        try:
            rargs = [[stand_in(x, i in written, fill) for x in a] if type(a) in (list, tuple)
                     else stand_in(a, i in written, fill) for i, a in enumerate(args)]
            rkwargs = {k: stand_in(v, k in written, fill) for k, v in kwargs.items()}
            _, caught = kernel_warnings(lambda: f.func(*rargs, **rkwargs))
            break
        except Exception as e:  # noqa: BLE001 - try the other fill, then give up
            error = e
    else:
        raise error
    changes = tuple((pos, tuple(r.shape), tuple(r.stride()))
                    for (pos, t), (_, r) in zip(_written_args(f, args, kwargs), _written_args(f, rargs, rkwargs))
                    if t.shape != r.shape or t.stride() != r.stride())
    # only the resize's own warnings: others depend on the values, which the stand-ins do not hold
    return _Resizes(changes, tuple((w.category, str(w.message)) for w in caught if "resized" in str(w.message)))


_OPAQUE_STATE = ("workspace", "reserve")


@functools.cache
def _takes_opaque_state(func) -> bool:
    """Whether ``func`` reads a kernel's own state from a tensor argument (Note [Eager layouts])."""
    return any(a.name in _OPAQUE_STATE for a in func._schema.arguments)


PROBE_WRITTEN_BYTES = 64 << 20  # Note [Errors at the statement]


def _written_bytes(f, args, kwargs) -> int:
    """The bytes of the stand-ins a run of the op writes into (its written arguments' extents)."""
    n = 0
    for _, t in _written_args(f, args, kwargs):
        n += _extent(t) * t.element_size()
    for pos in f.write_pos:  # written lists (``_foreach_add_``)
        a = kwargs.get(pos) if type(pos) is str else (args[pos] if pos < len(args) else None)
        if type(a) in (list, tuple):
            n += sum(_extent(t) * t.element_size() for t in a if isinstance(t, _Tensor))
    return n


def _eager_layouts(f, args, kwargs, specs: list):
    """``(specs, probe)``: ``specs`` with each fresh output's strides taken from a real run of the
    op (Note [Eager layouts]), and ``(the warnings it gave, the run)``, or None where there was no
    such run (Note [Kernel warnings]). Raises the run's error where every try raised (Note
    [Errors at the statement]): the op then runs eagerly, and its kernel warns at the user's line."""
    if f.factory or _takes_opaque_state(f.func):
        return specs, None
    written = f.write_pos
    if all(s is None for s in specs) and _written_bytes(f, args, kwargs) > PROBE_WRITTEN_BYTES:
        return specs, None  # Note [Errors at the statement]: what its meta kernel checks stands

    launched = [0]  # on an accelerator each fill and each run reaches it: counted as launches

    def stand_in(t, written: bool, fill):
        if not isinstance(t, _Tensor):
            return t
        if fill is None:
            if not written and (t.is_floating_point() or t.is_complex()):
                return t
            fill = 0
        if t.device.type != "cpu":
            launched[0] += 1
        return torch.full((_extent(t),), fill, dtype=t.dtype, device=t.device).as_strided(t.shape, t.stride())

    device = next((t.device.type for a in (*args, *kwargs.values()) for t in (a if type(a) in (list, tuple) else (a,))
                   if isinstance(t, _Tensor)), "cpu")
    if device == "cpu" and kwargs.get("device") is not None:  # a copy from the host onto a device
        device = torch.device(kwargs["device"]).type
    launches = device != "cpu" and launches_op(f.func)  # a view's or an allocation's run reaches no device
    for fill in (None, 1):
        if launches:
            launched[0] += 1
        try:
            rargs = [[stand_in(x, i in written, fill) for x in a] if type(a) in (list, tuple)
                     else stand_in(a, i in written, fill) for i, a in enumerate(args)]
            # the op warns when it runs, as eager's does: Note [Kernel warnings]
            rkwargs = {k: stand_in(v, k in written, fill) for k, v in kwargs.items()}
            run = lambda: f.func(*rargs, **rkwargs)  # noqa: E731
            res, caught = kernel_warnings(run)
            break
        except Exception as e:  # noqa: BLE001 - try the other fill, then raise (the signature runs eagerly)
            error = e
    else:
        METRICS.launches += launched[0]
        raise error
    METRICS.launches += launched[0]
    outs = res if isinstance(res, (tuple, list)) else (res,)
    return [spec if spec is None or not (isinstance(r, _Tensor) and tuple(r.shape) == spec[0] and r.dtype == spec[2])
            else (spec[0], tuple(r.stride()), spec[2]) for spec, r in zip(specs, outs)], (_texts(caught), run)


# Note [Meta cache key]
# The meta cache answers an op's output metadata from its signature: the op, its arguments'
# geometry and dtypes, its non-tensor arguments (``1``, ``1.0`` and ``True`` apart), and its device.
# Whatever else can change the answer must be in the key too. Of the ambient state PyTorch's
# fake-tensor dispatch cache keys on (``FakeTensorMode._cache_key``):
# - the default dtype: keyed. It decides the result dtype of an integer tensor with a Python
#   float (``i * 1.5``), of true division of integers, and of factories without ``dtype=``. The
#   cache is one dict per default dtype (``_META_CACHES``), and a window holds the ops of one
#   default dtype: when the program changes it (``torch.set_default_dtype``) with ops pending, the
#   window is flushed first (reason ``default_dtype``), and it runs, and is compiled, under the
#   dtype it was recorded under (``_recorded_dtype``: at a flush the program may have changed it
#   since). So an op pays one ``torch.get_default_dtype()`` (40 ns) before any path records it,
#   ``_record._dtype_check`` (a hot window stops being hot there, cause ``default_dtype``), and
#   nothing in the key; the structure ids hold the dtype too, so regions of two dtypes never share
#   a key.
# - the default device: keyed for factories without ``device=`` (``torch.set_default_device`` is a
#   function mode above the dispatcher, which fills ``device=`` in for most of them); any other op
#   takes its device from its tensors.
# - inference mode and grad mode: not keyed. Both act above this mode (autograd and the
#   inference-tensor flag are dispatch keys before Python's): an op's output metadata does not
#   depend on them, and a placeholder, allocated at the op, gets the flags eager's output would.
# - autocast: not keyed; it is a dispatch key above this mode, so the casts it inserts are ops
#   recorded like any other.
# - deterministic algorithms: not keyed. They choose among kernels, not output metadata; the one
#   CPU effect on values, filling new memory (``fill_uninitialized_memory``), is for the
#   allocation ops, which run at once (``ALLOC``) and are never recorded.
# - the shape environment and proxy tracing of fake tensors: nothing of the kind reaches this
#   mode (a window is traced later, by the fuser, from plain data).
_META_CACHES: dict = {}  # default dtype -> {op signature: its entry}; Note [Bounded tables]
_MISSES = [0]  # meta-cache misses since the last cache_clear()


def meta_entry(cache: dict, f, args, kwargs, dtype, sig, ksig, written, key, arity: int, options=None):
    """The entry for a meta-cache miss, from the cache directory (Note [Meta entries on disk] in
    _meta_disk) or computed, and stored: output metadata, ``_Raises``, or ``_Failed`` with the
    reason (Note [Meta cache key])."""
    _MISSES[0] += 1
    disk = text = None
    if options is not None:
        disk = _meta_disk.table_for(options)
        text = None if disk is None else _meta_disk.key_text(f, sig, ksig, dtype)
        value = None if text is None else disk.get(text)
        if value is not None:
            entry = _meta_disk.decode(f, value, sig, ksig, dtype, arity)
            if entry is not None:
                _meta_disk.STATS["disk_hits"] += 1
                return _signatures.bounded_put(cache, key, entry)
            _meta_disk.STATS["disk_ignored"] += 1
    once = ()
    try:
        entry = _compute_meta(f, args, kwargs, dtype, sig, ksig, written)
    except Exception as e:
        log.debug("cannot record %s: meta execution failed: %s", f.name, e)
        entry = _Failed(f.name, f"{type(e).__name__}: {e}")
    else:
        if entry.__class__ is tuple:  # (the entry, its once-a-process warnings); else _Raises or _Resizes
            entry, once = entry
            if entry.__class__ is tuple:
                ARITY[entry[3]] = arity  # Note [Window signature] in fuser.window
                if text is not None and not once:  # a once-warning is issued at first sight only
                    disk.add(text, entry)
    entry = _signatures.bounded_put(cache, key, entry)
    for category, message in once:  # the kernel's TORCH_WARN_ONCE, which the runs above used up
        warn(message, category, as_kernel=True)
    return entry


def cache_info() -> dict:
    """The meta cache and the signature ids: entries (bounded: Note [Bounded tables]), misses and
    entries dropped since ``cache_clear()``, and the signatures that cannot be recorded (or run
    eagerly because their kernel warns), by op, with why."""
    failed = {}
    for cache in list(_META_CACHES.values()):
        for entry in list(cache.values()):
            if entry.__class__ is _Failed:
                failed.setdefault(entry.op, entry.reason)
            elif entry.__class__ is _Warns:
                failed.setdefault(entry.op, "its kernel warns: " + entry.warnings[0][1])
    return {
        "meta_entries": sum(len(c) for c in list(_META_CACHES.values())),
        "signature_ids": len(_signatures._STRUCTURE_IDS) + len(_signatures._VIEW_IDS),
        "max_entries": _signatures.MAX_ENTRIES,
        "meta_misses": _MISSES[0],
        "evictions": _signatures.EVICTIONS[0],
        "failures": failed,
        "meta_disk_hits": _meta_disk.STATS["disk_hits"],  # Note [Meta entries on disk] in _meta_disk
        "meta_disk_ignored": _meta_disk.STATS["disk_ignored"],
    }


def cache_clear() -> None:
    """Empty the meta cache and the signature ids: later ops compute their metadata again, and
    windows get new ids (their regions are looked up anew: Note [Bounded tables])."""
    for cache in list(_META_CACHES.values()):
        cache.clear()  # in place: each thread's state holds its dtype's dict
    _signatures._STRUCTURE_IDS.clear()
    _signatures._VIEW_IDS.clear()
    _MISSES[0] = _signatures.EVICTIONS[0] = 0
    _meta_disk.clear()  # what was read from the cache directories is read again at the next miss
    _meta_disk.STATS["disk_hits"] = _meta_disk.STATS["disk_ignored"] = 0
