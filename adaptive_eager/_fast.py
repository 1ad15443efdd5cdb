"""The record fast path (Note [Record fast path]) and hot records (Note [Hot windows] in ``_hot``):
the two ways an op is recorded without the general path's work. Both leave exactly what
``_record._record`` would, or answer ``_DECLINED`` having changed nothing.

The hottest code of the library: no pytree walking, no strings, one dict lookup for the op's facts
and one for its output metadata (none for a hot record)."""

from __future__ import annotations

import weakref

import torch
from fuser.window import ALIAS, FRESH, OUTS_PER_NODE, Out, Window, finish_hot

from ._emit import alias_out, hot_placeholder, mark_written, node as _node, placeholder, view_out, write_overlaps
from ._record import (_DECLINED, _add, _append, _decline, _demote, _keyword, _number, _numbers,
                      _real_slot)
from ._source import _user_source
from ._state import TracerState, _strided
from ._threads import _Elsewhere, pending_mark

_Tensor = torch.Tensor
_untyped_storage = torch._C.TensorBase.untyped_storage  # unpatched (adaptive_eager._patches)
_get_default_device = torch.get_default_device
_weakref = weakref.ref


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


def _miss(window: Window, n0: int, cause: str):
    """``_record_hot``'s answer for an op that does not match: nothing of it stays in the window."""
    window.hot_miss = (cause, len(window.nodes))
    return _decline(window, n0)


def _record_hot(st: TracerState, window: Window, f, args, kwargs):
    """Record an op of a hot window against its template's position (Note [Hot windows] and Note
    [Hot views] in ``_hot``): the same placeholders or ALIAS Out, slots and marks as
    ``_record_fast`` (or, for the general path's ops a template holds, ``_record._record``), without
    its signature, meta lookup or Node. ``_DECLINED`` (nothing changed) when it does not match.
    ``kwargs`` may be None (none given); the caller checked the default dtype (``_record._dtype_check``).
    Note [Hot record cost] says what each line costs."""
    i = len(window.nodes)
    ops = window.hot.ops
    real = window.real_inputs
    n0 = len(real)
    try:
        p = ops[i]
    except IndexError:  # no cost when not raised, unlike a length test
        return _miss(window, n0, "past_end")
    if p.f is not f or len(args) != p.n:
        return _miss(window, n0, "op")
    token = window.token
    for pos, ref in p.tensors:
        a = args[pos]
        o = getattr(a, "_ae", None)
        if ref > 0:
            if o is None or o.win is not token or o.uid != ref:
                return _miss(window, n0, "binding")
            continue
        if o is not None and (o.win is token or pending_mark(o)):
            return _miss(window, n0, "binding")
        slot = -1 - ref
        if slot < n0 and real[slot] is a:  # the tensor in its slot already: a tensor, slotted there
            continue
        cause = _hot_slot(window, a, slot, n0)  # its first use in this window: registered there
        if cause is not None:
            return _miss(window, n0, cause)
    if p.other or kwargs:
        if p.lists:
            cause = _hot_lists(window, p, args, n0)
            if cause is not None:
                return _miss(window, n0, cause)
        if p.factory and _get_default_device().type != st.target:
            return _miss(window, n0, "metadata")  # the general path declines it: not ours
        if (p.consts or kwargs or p.kw) and _other_args_differ(p, args, kwargs):
            return _miss(window, n0, "scalar")
    fpos = p.fpos
    if fpos:
        for pos, v in zip(fpos, p.fvals):
            a = args[pos] if type(pos) is int else kwargs.get(pos)
            if a.__class__ is not float or (v is not None and a != v):
                return _miss(window, n0, "scalar")
    if f.fast_inplace:
        res = args[0]
        written = _untyped_storage(res)._cdata
        if write_overlaps(f, args, res, written):
            return _miss(window, n0, "overlap")  # the general path decides
        o = getattr(res, "_ae", None)  # validated above: a pending value of this window, or real
        o = alias_out(window, res, o if o is not None and o.win is token else res, p.uid)
        mark_written(window, written, o.slot)
    elif p.multi is not None:
        res = _hot_outputs(st, window, p)
        o = None  # its record: its Outs are the window's only while their tensors live
    else:
        res = hot_placeholder(st.alloc_cpu, window, p.spec, p.uid)
        o = None  # a fresh value's record: its Out is the window's only while its tensor lives (Note [Hot liveness])
    _add(st, window, o, fpos, args, kwargs, p.nbytes)  # its hot record: Note [Hot windows]
    return res


def _other_args_differ(p, args, kwargs) -> bool:
    """Whether a hot op's arguments other than its tensors and floats (numbers, sizes, dtypes, flags,
    keywords) differ from its template position's, which are compared equal; a keyword float
    (``float`` in ``p.kw``) is checked with the floats."""
    for pos, v in p.consts:
        a = args[pos]
        if a.__class__ is not v.__class__ or a != v:
            return True
    if kwargs or p.kw:
        if len(kwargs or ()) != len(p.kw):
            return True
        for name, v in p.kw:
            a = kwargs.get(name, _DECLINED)
            if v is not float and (a.__class__ is not v.__class__ or a != v):
                return True
    return False


def _hot_lists(window: Window, p, args, n0: int) -> str | None:
    """Validate the tensor lists of a hot op (``cat``, ``stack``) against its template position as
    ``_record_hot`` validates its tensors; the cause of a mismatch, or None."""
    real = window.real_inputs
    token = window.token
    for pos, length, elems in p.lists:
        lst = args[pos] if pos < len(args) else None
        if type(lst) not in (list, tuple) or len(lst) != length:
            return "binding"
        for j, ref in elems:
            a = lst[j]
            o = getattr(a, "_ae", None)
            if ref > 0:
                if o is None or o.win is not token or o.uid != ref:
                    return "binding"
                continue
            if o is not None and (o.win is token or pending_mark(o)):
                return "binding"
            cause = _hot_slot(window, a, -1 - ref, len(real))
            if cause is not None:
                return cause
    return None


def _hot_slot(window: Window, a, slot: int, n0: int) -> str | None:
    """A real input of a hot op where the template has slot ``slot``: already there (among the
    first ``n0`` slots), or registered there now if it is the next slot and has that slot's
    metadata; the cause of a mismatch, or None."""
    real = window.real_inputs
    if slot < n0 and real[slot] is a:
        return None
    if not isinstance(a, _Tensor) or window.slots.get(id(a)) is not None or slot != len(real):
        return "binding"
    shape, stride, dtype = window.hot.slot_meta[slot]
    if a.dtype is not dtype or not a.is_cpu or a.layout is not _strided or a.shape != shape or a.stride() != stride \
            or a.is_conj() or a.is_neg():
        # a sparse tensor too: Note [Tensors the mode leaves alone] in _state; a bit: Note
        # [Conjugate and negative bits] in fuser.compilable (recorded in full, the window replays)
        return "metadata"
    window.slot_of(a)  # at ``slot``: the next one
    return None


def _hot_outputs(st: TracerState, window: Window, p):
    """The placeholders of a hot op with several outputs, or a list (Note [Hot views] in ``_hot``),
    each made as ``_record_hot`` makes one; answered as ``_record._record`` answers them."""
    alloc = st.alloc_cpu
    results = [None if spec is None else hot_placeholder(alloc, window, spec, uid) for uid, spec in p.multi]
    f = p.f
    if f.returns_list:
        return results
    return results[0] if f.nrets == 1 else tuple(results)


def _record_hot_view(st: TracerState, window: Window, f, args, kwargs):
    """Record a view in a hot window against its template's position (Note [Hot views] in
    ``_hot``): the real view, its VIEW Out and slot as ``_record._record_view`` makes them, without
    the signature or the Node; ``_DECLINED`` (nothing changed) when it does not match."""
    nodes = window.nodes
    i = len(nodes)
    ops = window.hot.ops
    real = window.real_inputs
    n0 = len(real)
    if i >= len(ops):
        return _miss(window, n0, "past_end")
    p = ops[i]
    if p.f is not f or len(args) != p.n:
        return _miss(window, n0, "op")
    a = args[0]
    ref = p.tensors[0][1]
    o = getattr(a, "_ae", None)
    token = window.token
    if ref > 0:
        if o is None or o.win is not token or o.uid != ref:
            return _miss(window, n0, "binding")
        slot = o.slot
    else:
        if not isinstance(a, _Tensor) or (o is not None and (o.win is token or pending_mark(o))):
            return _miss(window, n0, "binding")
        slot = -1 - ref
        cause = _hot_slot(window, a, slot, n0)
        if cause is not None:
            return _miss(window, n0, cause)
        if a.storage_offset() != p.offset:  # part of a view's signature
            return _miss(window, n0, "metadata")
    if (p.consts or kwargs or p.kw) and _other_args_differ(p, args, kwargs):
        return _miss(window, n0, "scalar")
    res = f.call(*args, **kwargs) if kwargs else f.call(*args)  # views read no data: the real view now
    multi = p.multi
    if multi is not None and (type(res) not in (list, tuple) or len(res) != len(multi)):
        return _miss(window, n0, "metadata")  # not the views the template has (nothing else was changed)
    if ref > 0:
        # a view shares its value's storage: that value is live while its storage is, from here on
        root = o
        while root.kind == ALIAS and type(root.alias) is Out:
            root = root.alias
        if root.kind == FRESH and root.storage is None:
            _pin(window, root, a)
    elif p.viewed:
        window.viewed.add(_untyped_storage(a)._cdata)
    if multi is None:
        vo = view_out(token, p.uid, p.spec, _weakref(res), slot)  # held weakly (Note [Weak window])
        res._ae = vo
        window.others.append(vo)
        nodes.append(vo)  # its hot record; a view adds no bytes and makes no cut, as in a full recording
        return res
    vos = []
    for v, (uid, spec) in zip(res, multi):
        vo = view_out(token, uid, spec, _weakref(v), slot)
        v._ae = vo
        window.others.append(vo)
        vos.append(vo)
    nodes.append(tuple(vos))  # its hot record: its VIEW Outs
    return res


def _pin(window: Window, o: Out, t) -> None:
    """A view of hot FRESH value ``o`` (placeholder ``t``) was made: from now on ``o`` is live while
    its storage is, as in a full recording (Note [Hot views] in ``_hot``)."""
    h = _untyped_storage(t)._weak_ref()
    finish_hot(o, _weakref(t), h)
    window.fresh.append(o)
    window.handles.append(h)


def _record_fast(st: TracerState, f, args, kwargs):
    """``_record`` for ``OpFacts.fast`` ops (no keywords) and ``OpFacts.fast_inplace`` ops (they
    write and return their first argument): Note [Record fast path]. The caller checked the default
    dtype (``_record._dtype_check``)."""
    window = st.window
    n0 = len(window.real_inputs)
    n = len(args)
    sig = list(args)
    nargs = None
    inputs = []
    refs = []
    floats = []  # Note [Scalar recording] in _ops
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
            sig[i] = _number(f, a, i, floats)
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
        slot = _real_slot(window, a)
        if slot is None:
            return _decline(window, n0)
        refs.append(-1 - slot)
        sig[i] = (a.shape, a.stride(), a.dtype)
    if first is None:
        return _decline(window, n0)
    if f.scalar_pos:
        _numbers(f, args, n, sig, floats)
    for i in f.seq_pos:
        if i < n and type(args[i]) is list:
            sig[i] = tuple(args[i])
    ksig = ()
    if kwargs:  # fast_inplace only: numbers and flags (``alpha=``, ``value=``)
        ksig = []
        for k, v in kwargs.items():
            ksig.append(_keyword(f, k, v, floats))
        ksig = tuple(ksig)
    # several devices of the target type (cuda:0, cuda:1): the first tensor's, as ``_record`` picks
    device = first.device if st.device_varies else st.device
    if st.device_in_key:
        ksig = (ksig, device)
    try:
        entry = st.meta_cache.get((f, tuple(sig), ksig))
    except TypeError:  # an unhashable keyword value: the general path runs it eagerly
        return _decline(window, n0)
    if entry.__class__ is not tuple:  # a miss, _Failed or _Raises: the general path
        return _decline(window, n0)
    specs, nbytes, _, eid = entry
    if f.fast_inplace:
        res = args[0]
        written = _untyped_storage(res)._cdata
        if write_overlaps(f, args, res, written):
            return _decline(window, n0)  # the general path decides
    if window.hot is not None:
        _demote(window, "op")
    if nargs is None:
        nargs = list(args)
    node = _node(f.func, nargs, kwargs, inputs, _user_source(3), len(window.nodes), f.fast_inplace, False)
    uid = (node.index + 1) * OUTS_PER_NODE
    if f.fast_inplace:
        o = alias_out(window, res, nargs[0], uid)
        mark_written(window, written, o.slot)
    else:
        res, o = placeholder(st, window, specs[0], uid, device)
    node.outs.append(o)
    _append(st, window, node, eid, refs, floats, args, kwargs, nbytes)
    return res
