"""One op into the window: the general path, views, and the helpers the fast path and hot records
share (``_fast``). See Note [Placeholders] and Note [Out kinds] in ``fuser.window`` for what a pending value is.

This is the hottest code of the library: it does no pytree walking, builds no strings, and pays one
dict lookup for the op's facts and one for its output metadata."""

from __future__ import annotations

import weakref

import torch
from fuser.window import OUTS_PER_NODE, Node, Window

from . import _signatures
from ._emit import alias_out as _alias_out, mark_written, node as _node, placeholder as _placeholder, view_out
from ._flush import flush, is_written
from ._hot import expect_hot
from ._meta import _META_CACHES, _Failed, _Resizes, _Warns, _written_args, meta_entry
from ._metrics import METRICS
from ._args import _tensors
from ._overlap import _overlap_error, _shares_written
from ._source import _user_source, warn
from ._state import TracerState, _default_dtype, _on_target, _strided
from ._threads import _check_elsewhere, pending_mark

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_weakref = weakref.ref
_untyped_storage = torch._C.TensorBase.untyped_storage  # unpatched (adaptive_eager._patches)
_storage_use_count = torch._C._storage_Use_Count
_DECLINED = object()  # _record's answer for an op it does not defer (None is a valid op result)
_SCALAR = object()  # _record's answer for an op to run now (Note [Scalar fast path])
_WARNS = object()  # _record's answer for an op whose kernel warns each run (Note [Kernel warnings])

# Note [Scalar fast path]
# ~~~~~~~~~~~~~~~~~~~~~~~
# On a CPU target, an op reading only real 0-dim tensors (AdamW's ``step += 1``) runs now
# (``_SCALAR``): deferred, it would make the ``step.item()`` that follows a sync point. Running it
# early must not change what a pending op reads:
# - recorded ops snapshot every real one-element tensor they read (a clone, taken at the op, as
#   eager reads it then), unless a pending op writes its storage: then it is read in window order;
# - so the early op may not read a tensor with a pending write, nor write one whose storage holds
#   more than that one element or that a pending op reads through a recorded view
#   (``Window.viewed``): ``_scalars_settled``.


_storage_nbytes = torch._C.StorageBase.nbytes  # the C method (``_patches`` wraps UntypedStorage.nbytes)

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
            if i in f.write_pos and _storage_nbytes(storage) != t.element_size():
                return False  # other elements of its storage may be read by pending ops
            sid = storage._cdata
            if sid in written or (i in f.write_pos and sid in viewed):
                return False
    return True


def _dtype_check(st: TracerState) -> None:
    """The check, before any path (hot, fast or general) records an op, that the default dtype is
    still the one the open window records under (Note [Meta cache key]); ``LazyMode.__torch_dispatch__``
    has it inline. If the program changed it: a hot window stops being hot (cause ``default_dtype``:
    its template's outputs were made under the old one), the open window runs under the old one
    (reason ``default_dtype``), the ops from here on read the new one's meta cache, and the next
    window is armed only with a template made under the new one (the flush armed it under the old)."""
    if _default_dtype() is not st.dtype:
        _dtype_changed(st)


def _dtype_changed(st: TracerState) -> None:
    """``_dtype_check``'s answer to a change (see there)."""
    window = st.window
    if window.hot is not None:
        _demote(window, "default_dtype")
    flush(st, "default_dtype")
    dtype = st.dtype = _default_dtype()
    st.meta_cache = _META_CACHES.setdefault(dtype, {})
    expect_hot(st)


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


def _number(f, v, i: int, floats: list):
    """The signature of number ``v`` at argument position ``i``, for every path: a liftable float is
    ``float``, its value a window scalar (Note [Scalar recording] in ``_ops``: its position joins
    ``floats``); any other number its type and value (1, 1.0 and True hash alike but promote
    differently)."""
    if v.__class__ is float and f.liftable:
        floats.append(i)
        return float
    return (v.__class__, v)


def _numbers(f, args, n: int, sig: list, floats: list) -> None:
    """The signatures of an op's number arguments (``f.scalar_pos``): ``_number``'s."""
    for i in f.scalar_pos:
        if i < n:
            sig[i] = _number(f, args[i], i, floats)


def _keyword(f, k: str, v, floats: list) -> tuple:
    """The signature of keyword ``k``'s value ``v`` (not a tensor), for every path: a liftable float
    as ``_number``'s (its name joins ``floats``), anything else its type and value."""
    if v.__class__ is float and f.liftable:
        floats.append(k)
        return (k, float)
    return (k, v.__class__, tuple(v) if type(v) is list else v)


def _real_slot(window: Window, a) -> int | None:
    """The slot of real input ``a``, registered at the next one on its first use; None for a tensor
    the mode leaves alone (sparse: Note [Tensors the mode leaves alone] in _state)."""
    slot = window.slots.get(id(a))
    if slot is None:
        if a.layout is not _strided:
            return None
        slot = window.slot_of(a)
    return slot


def _append(st: TracerState, window: Window, node: Node, eid: int, refs: list, floats, args, kwargs,
            nbytes: int) -> None:
    """The window's tail for an op recorded in full (the general and fast paths): its signature and
    dataflow refs (Note [Window signature] in fuser.window), where its floats start, its count, then
    ``_add``."""
    sigs = window.sigs
    sigs.append(eid)
    sigs.extend(refs)
    if floats:
        node.fbase = len(window.scalars)
        node.fpos = floats
    METRICS.ops_recorded += 1  # one eager launch each: counted in eager_equivalent_launches
    _add(st, window, node, floats, args, kwargs, nbytes)


def _add(st: TracerState, window: Window, record, floats, args, kwargs, nbytes: int) -> None:
    """What every path adds to the window for an op (a hot record counts its ops when the window
    ends): its liftable floats (Note [Scalar recording] in ``_ops``: positions, keyword names, or
    (list position, index)), its record (a Node, or a hot record: Note [Hot windows] in ``_hot``), its
    output bytes, and the window's cut (Note [Period detection]) or byte cap after it."""
    if floats:
        sc = window.scalars
        for pos in floats:
            if type(pos) is int:
                sc.append(args[pos])
            elif type(pos) is str:
                sc.append(kwargs[pos])
            else:
                sc.append(args[pos[0]][pos[1]])
    nodes = window.nodes
    nodes.append(record)
    window.pending_bytes += nbytes
    if len(nodes) >= st.cut_at or window.pending_bytes >= st.max_bytes:
        _cut(st, window)


def _cut(st: TracerState, window: Window) -> None:
    """End the window after an op if it reached its cut (Note [Period detection]) or byte cap."""
    if len(window.nodes) >= st.cut_at:
        flush(st, "period" if st.periodicity.period else "window_cap")
    elif window.pending_bytes >= st.max_bytes:
        flush(st, "bytes_cap")


def _demote(window: Window, cause: str) -> None:
    """A recording path is about to add to a hot window: turn it into an ordinary one first (Note
    [Hot windows] in ``_hot``), counted under the cause ``_record_hot`` found at this position."""
    miss = window.hot_miss
    if miss is not None and miss[1] == len(window.nodes):
        cause = miss[0]
    window.hot.demote(window, cause)


def _record(st: TracerState, f, args, kwargs):
    window = st.window
    n = len(args)
    sig = list(args)
    nargs = None
    inputs = []
    snaps = []
    device = None
    only_real_scalars = st.scalar_fast_path  # Note [Scalar fast path]
    refs = []  # Note [Window signature] in fuser.window
    floats = []  # positions of float arguments (Note [Scalar recording] in _ops)
    for i in f.tensor_pos:
        if i >= n:
            break
        a = args[i]
        if a is None:
            continue
        if not isinstance(a, _Tensor):  # a Python number passed where the schema says Tensor
            sig[i] = _number(f, a, i, floats)
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
            slot = _real_slot(window, a)
            if slot is None:
                return _DECLINED
            if st.scalar_fast_path:
                if a.dim():
                    only_real_scalars = False
                if a.numel() == 1 and i not in f.write_pos and not _written(window, a):
                    snaps.append((i, len(refs)))
            refs.append(-1 - slot)
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
                    if (a.numel() == 1 and i not in f.write_pos and not _written(window, a)
                            and a.layout is _strided):
                        a = new[j] = a.clone()  # snapshot: see Note [Scalar fast path]
                slot = _real_slot(window, a)
                if slot is None:
                    return _DECLINED
                refs.append(-1 - slot)
            lsig.append((a.shape, a.stride(), a.dtype))
        if nargs is None:
            nargs = list(args)
        nargs[i] = new
        sig[i] = tuple(lsig)
    if only_real_scalars and device is not None and not inputs and _scalars_settled(window, f, args, n):
        return _SCALAR
    if f.scalar_pos:
        _numbers(f, args, n, sig, floats)
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
                    slot = _real_slot(window, v)
                    if slot is None:
                        return _DECLINED
                    refs.append(-1 - slot)
                ksig.append((k, v.shape, v.stride(), v.dtype))
            else:
                if k == "device" and v is not None:
                    dv = torch.device(v)
                    if dv.type != st.target:
                        return _DECLINED
                    device = dv
                ksig.append(_keyword(f, k, v, floats))
        ksig = tuple(ksig)
    if device is None:
        if not f.factory:
            return _DECLINED  # no tensor argument on the target device: not ours
        device = torch.get_default_device()
        if device.type != st.target:
            return _DECLINED
        ksig = (ksig, "default-device")  # the default dtype: Note [Meta cache key]
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
        entry = st.meta_cache.get(key)
    except TypeError:  # an unhashable argument we do not model: run it eagerly
        return _DECLINED
    if entry is None:
        entry = meta_entry(st.meta_cache, f, args, kwargs, st.dtype, sig, ksig, written, key, len(refs), st.options)
    if entry.__class__ is not tuple:
        if entry.__class__ is _Failed:
            return _DECLINED
        if entry.__class__ is _Warns:
            return _WARNS  # Note [Kernel warnings] in _kernel_warnings
        if entry.__class__ is _Resizes:
            return entry  # Note [Out resizing] in _meta: ``resize_outs``, then the op again
        raise entry.error()  # Note [Overlapping writes]
    specs, nbytes, returns_list, eid = entry
    if window.hot is not None:
        _demote(window, "general_path")
    if snaps:
        if nargs is None:
            nargs = list(args)
        for i, r in snaps:
            # Eager reads a 0-dim tensor when the op runs; snapshot it, the program may change it
            # later (Note [Scalar fast path])
            snap = nargs[i] = args[i].clone()
            refs[r] = -1 - window.slot_of(snap)
    # an op with no outputs exists for its effect (``_linalg_check_errors`` raises): never dead
    node = _node(f.func, nargs if nargs is not None else list(args), nkwargs, inputs, _user_source(4), len(window.nodes),
                 f.mutates or f.nrets == 0, False)
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
            o = _alias_out(window, t, src, uid + j)
            outs.append(o)
            results.append(t)
            continue
        p, o = _placeholder(st, window, spec, uid + j, device)
        outs.append(o)
        results.append(p)
    if f.mutates:
        # Every written argument (BatchNorm's running stats are written but not returned; foreach
        # ops write lists): later reads must flush, compiled regions write back.
        for t, sid in written:
            o = getattr(t, "_ae", None)
            mark_written(window, sid, o.slot if o is not None and o.win is window.token else window.slot_of(t))
    _append(st, window, node, eid, refs, floats, args, kwargs, nbytes)
    if f.nrets == 0:
        return None
    if f.nrets == 1 and not returns_list:
        return results[0]
    return results if returns_list else tuple(results)


_resize_ = torch.ops.aten.resize_.default
_as_strided_ = torch.ops.aten.as_strided_.default


def resize_outs(st: TracerState, f, entry: _Resizes, args, kwargs) -> bool:
    """Do to an op's ``out=`` tensors what its eager kernel does before it computes: warn, resize,
    restride (Note [Out resizing] in _meta); the window runs first where it reads or writes them.
    False, with nothing done, for an out that shares memory with another argument: the op runs
    eagerly then (what it computes depends on the order in which its kernel reads and writes)."""
    outs = dict(_written_args(f, args, kwargs))
    changed = [outs[pos] for pos, _, _ in entry.changes]
    sids = {_untyped_storage(t)._cdata for t in changed}
    for a in _tensors(args, {k: v for k, v in kwargs.items() if k not in outs}):
        if _untyped_storage(a)._cdata in sids:
            return False
    window = st.window
    if window.nodes:
        for t in changed:
            o = getattr(t, "_ae", None)
            sid = _untyped_storage(t)._cdata
            if ((o is not None and o.win is window.token) or id(t) in window.slots or sid in window.written
                    or _storage_use_count(sid) > 2):
                flush(st, "out_resize")
                break
    for category, message in entry.warnings:
        warn(message, category, as_kernel=True)
    with torch._C._AutoDispatchBelowADInplaceOrView():  # as eager's kernel does it: no version bump
        for pos, shape, stride in entry.changes:
            t = outs[pos]
            _resize_(t, shape)
            if t.stride() != stride:
                _as_strided_(t, shape, stride)
    return True


# Note [Views of unwritten memory]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A view of a real tensor whose memory no recorded op writes is not recorded: the program gets
# the real view, and an op that reads it takes it as a real input of its own (a slot, keyed by
# shape, strides and dtype). A DataLoader's batch is made of such views: ``TensorDataset``
# indexes its tensors one row at a time (``X[i]``: ``select(X, 0, i)``) and ``default_collate``
# stacks the rows. Recorded, each row was a view node whose signature holds its index and which
# the compiled region derived from the whole dataset inside its graph: the sampler's indices were
# part of the window's key, so a shuffled loader made a new key each step and an unshuffled one a
# key per batch of the epoch, and no window of the loop was ever compiled in time. Taken as
# inputs, the rows leave the key the same whatever rows the sampler picks.
# Views are recorded (as view nodes over their real input: Note [Out kinds] in fuser.window) where
# taking them as inputs would hand a region two inputs over one memory, one of them written, which
# its graph cannot always express (Note [Inputs over one memory] in fuser.compilable): a view of memory a pending op of
# the window writes already (``Window.written``), or of memory some earlier window wrote
# (``_flush.WRITTEN``: parameters, optimizer state and buffers that recorded steps update,
# learned at each flush from the window's written real inputs, ``_flush.learn_written``). The
# first window that views a tensor and then writes it (a parameter's ``W.t()`` in the forward,
# the optimizer's recorded update after it) has both as inputs: the region derives a transpose
# from the written input inside its graph, and replays anything else ("aliased_inputs"); from the
# next window on its views are recorded as before. A view of a real tensor of one element is
# left unrecorded too, its storage in ``Window.viewed`` as a recorded view's is: the scalar fast
# path may not write it before the window runs (Note [Scalar fast path]), and an op reading the
# view snapshots it, as any real one-element input. Recorded, AccumulateGrad's ``detach`` of a
# captured backward's gradient of one element (a ``Linear(n, 1)`` bias) made a window of its own
# every step, and the hot window a mismatch. A bounded table (Note [Bounded tables] in _signatures) of weak
# references: a storage forgotten costs one replayed window, never a wrong value, and an address a
# freed storage left is not taken for written memory (once it was, and a dataset allocated there
# had every row recorded, its loop never compiled).


def view_of_unwritten(st: TracerState, window: Window, a) -> bool:
    """Whether a view of ``a`` is left unrecorded (Note [Views of unwritten memory]); if so the
    window is marked (``Window.passed``)."""
    if a.__class__ is not _Tensor and a.__class__ is not _Parameter:
        return False  # a subclass (the emulated device's wrapper) keeps its views recorded
    o = getattr(a, "_ae", None)
    if o is not None and (o.win is window.token or pending_mark(o)):
        return False
    if a.layout is not _strided or not _on_target(st, a):
        return False  # _record_view leaves it alone: Note [Tensors the mode leaves alone] in _state
    sid = _untyped_storage(a)._cdata
    if sid in window.written or is_written(sid):
        return False
    if st.scalar_fast_path and a.numel() == 1:
        window.viewed.add(sid)  # as a recorded view's: no early scalar write to it in this window
    window.passed = True
    return True


def _record_view(st: TracerState, f, args, kwargs):
    res = f.call(*args, **kwargs)  # views read no data: the real view now (Note [Hot view cost] in _hot)
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
    if o is None and id(a) not in window.slots and a.layout is not _strided:
        return res  # a view of a sparse tensor: Note [Tensors the mode leaves alone] in _state
    if window.hot is not None:
        _demote(window, "view")
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
    node = _node(f.func, nargs, kwargs, inputs, None, len(window.nodes), False, True)
    views = res if isinstance(res, (tuple, list)) else (res,)
    uid = (node.index + 1) * OUTS_PER_NODE
    for j, v in enumerate(views):
        # held weakly (Note [Weak window]); alive, it keeps its root's storage alive
        vo = view_out(window.token, uid + j, (v.shape, v.stride(), v.dtype), _weakref(v), slot)
        v._ae = vo
        node.outs.append(vo)
        window.others.append(vo)
    # the view's own signature: op, input geometry (offset included: views keep it) and arguments
    key = (f, a.shape, a.stride(), a.storage_offset(), a.dtype,
           tuple(tuple(x) if type(x) is list else x for x in args[1:]), tuple(kwargs.items()))
    eid = _signatures.view_id(key)
    sigs = window.sigs
    sigs.append(eid)
    sigs.append(ref)
    window.nodes.append(node)
    return res
