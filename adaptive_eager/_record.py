"""One op into the window, by one path for every window (Note [One record path]): ``_record`` for an
op, ``_record_view`` for a view. See Note [Placeholders] and Note [Out kinds] in ``fuser.window`` for
what a pending value is.

This is the hottest code of the library: it does no pytree walking, builds no strings, and pays one
dict lookup for an op's output metadata (none in a hot window); the mode reads the op's facts off
the op (``_ops.facts_for``)."""

from __future__ import annotations

import weakref

import torch
from fuser.window import ALIAS, FRESH, OUTS_PER_NODE, Node, Out, Window, finish_hot

from . import _signatures
from ._emit import (alias_out as _alias_out, hot_placeholder, mark_written, node as _node, placeholder as _placeholder,
                    view_out)
from ._flush import flush, is_written
from ._hot import NOT_RUN, expect_hot, run_small
from ._meta import _META_CACHES, _Failed, _Resizes, _Warns, _written_args, meta_entry
from ._metrics import METRICS
from ._args import _tensors
from ._eager import _eager
from ._overlap import _overlap_error, _shares_written
from ._source import _user_source, warn
from ._state import TracerState, _default_dtype, _on_target, _strided
from ._threads import _check_elsewhere, pending_mark

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_weakref = weakref.ref
_untyped_storage = torch._C.TensorBase.untyped_storage  # unpatched (adaptive_eager._patches)
_storage_use_count = torch._C._storage_Use_Count


_DECLINED = object()  # ``_record``'s answer for an op it does not record (nothing changed): it runs eagerly

# Note [Scalar fast path]
# ~~~~~~~~~~~~~~~~~~~~~~~
# On a CPU target, an op reading only real 0-dim tensors (AdamW's ``step += 1``) runs now, eagerly
# (``_record_full``): deferred, it would make the ``step.item()`` that follows a sync point. Running
# it early must not change what a pending op reads:
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


def _decline(window: Window):
    """Not recorded: the real inputs the op registered are forgotten (``Window.unslot``)."""
    window.unslot()
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
    [Hot windows] in ``_hot``), counted under the cause its match found at this position (``_miss``)."""
    miss = window.hot_miss
    if miss is not None and miss[1] == len(window.nodes):
        cause = miss[0]
    window.hot.demote(window, cause)


# Note [One record path]
# ~~~~~~~~~~~~~~~~~~~~~~
# Every op the mode records goes through ``_record`` (views through ``_record_view``), in three
# steps, whatever the window:
# - the walk: each tensor argument (positional, in a list, then keywords) is bound to a pending
#   value of this window (its Out's uid) or to a real input's slot (registered at its first use),
#   giving the op's dataflow refs (Note [Window signature] in fuser.window), or the op is declined;
#   then the arguments it writes, checked for overlap (Note [Overlapping writes]);
# - the output metadata: in a hot window, the template's position (Note [Hot windows] in ``_hot``):
#   the refs, the other arguments and the floats equal to what it recorded (and the argument count,
#   for an op whose calls may leave out trailing defaults: ``OpFacts.arity_varies``; one test,
#   ``_Pos.checks``, skips all but the refs for most ops), its output specs; the walk compares each
#   ref with the position's (``_Pos.ref_at``) where it reaches it, so a hot record builds no list; in
#   any other window, the meta cache (Note [Meta cache key] in ``_meta``), keyed by the signature
#   the walk built along (each argument's metadata, numbers, keywords, device);
# - the emission (``_emit``): placeholders or ALIAS Outs and write marks, and the one append
#   (``_add``), of the op's Node and signature entries, or in a hot window of its hot record. A hot
#   op of the two kinds most positions hold (one fresh output; a write of its first argument) is
#   emitted right after its checks, by the same emitters (``hot_placeholder``, ``alias_out``); the
#   rarer kinds, in any window, by ``_emit_others``. What an op of the common kinds never reaches
#   (the rarer writes, the snapshots, the rarer emission) sits in helpers, and so does what follows
#   the walk of an op recorded in full (``_record_full``), so that the frame ``_record`` sets up
#   and clears at every op holds only the locals a hot record uses (Python clears every local of a
#   frame at its return: with 44 locals a hot record cost 0.4% more instructions than with 31).
# So a hot record is the record of an op whose signature is known: it skips the signature, the
# meta lookup, the Node and the user's line, nothing else. An op that does not match its
# template's position (``_miss``: the cause, counted if the window is demoted at it) is walked
# again as in any window, having left nothing.

_get_default_device = torch.get_default_device


def _position(window: Window, f, args):
    """The template position a hot window's next op must match, or None (the cause kept for
    ``_demote``)."""
    i = len(window.nodes)
    try:
        p = window.hot.ops[i]
    except IndexError:  # no cost when not raised, unlike a length test
        window.hot_miss = ("past_end", i)
        return None
    if p.f is not f or len(args) != p.n:
        window.hot_miss = ("op", i)
        return None
    return p


def _miss(st: TracerState, f, args, kwargs, cause: str):
    """An op of a hot window that does not match its template's position: nothing of it stays, and
    it is recorded as in any window (``_demote`` counts ``cause`` if that demotes the window)."""
    window = st.window
    window.hot_miss = (cause, len(window.nodes))
    _decline(window)
    return _record(st, window, f, args, kwargs, None)


def _slot_differs(window: Window, a) -> bool:
    """Whether real input ``a``, registered in a hot window at the next slot, is not what the
    template's slot there holds (Note [Hot windows] in ``_hot``): its shape, strides, dtype, a CPU
    tensor; no conjugate or negative bit (Note [Conjugate and negative bits] in fuser.compilable: a
    window with one is recorded in full and replays)."""
    slot_meta = window.hot.slot_meta
    slot = len(window.real_inputs)
    if slot >= len(slot_meta):
        return True
    shape, stride, dtype = slot_meta[slot]
    return (a.dtype is not dtype or not a.is_cpu or a.shape != shape or a.stride() != stride
            or a.is_conj() or a.is_neg())


def _new_slot(window: Window, a, hot: bool) -> int:
    """The slot real input ``a`` gets at its first use in the window; -1 for a tensor the mode leaves
    alone (sparse: Note [Tensors the mode leaves alone] in _state), -2 in a hot window for one that is
    not what the template's next slot holds (``_slot_differs``)."""
    if a.layout is not _strided:
        return -1
    if hot and _slot_differs(window, a):
        return -2
    return window.slot_of(a)


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


def _hot_differs(st: TracerState, p, args) -> str | None:
    """The cause for which a hot op's lists or factory differ from its template position's (a list's
    length, the default device of a factory), or None."""
    for pos, length, _ in p.lists:
        lst = args[pos]
        if type(lst) not in (list, tuple) or len(lst) != length:
            return "binding"
    if p.factory and _get_default_device().type != st.target:
        return "metadata"  # a factory of another device: not ours
    return None


def _mark(window: Window, token, written) -> None:
    """Mark every argument an op writes (BatchNorm's running stats are written but not returned;
    foreach ops write lists): later reads flush or read in window order, and a compiled region
    writes the slot back."""
    for t, sid in written:
        o = getattr(t, "_ae", None)
        mark_written(window, sid, o.slot if o is not None and o.win is token else window.slot_of(t))


def _writes(f, args, kwargs, n: int):
    """The arguments an op other than ``writes_first`` writes, as (tensor, storage id), and whether
    another TensorImpl holds one of their storages (Note [Overlapping writes])."""
    written = []
    shared = False
    for pos in f.write_pos:
        w = (kwargs.get(pos) if kwargs else None) if type(pos) is str else (args[pos] if pos < n else None)
        for t in (w if type(w) in (list, tuple) else (w,)):
            if isinstance(t, _Tensor):
                sid = _untyped_storage(t)._cdata
                written.append((t, sid))
                if _storage_use_count(sid) > 2:
                    shared = True
    return written, shared


def _raise_overlap(f, args, kwargs) -> None:
    """Raise eager's error for an op whose written memory overlaps what it reads, if it has one
    (Note [Overlapping writes])."""
    error = _overlap_error(f, args, kwargs or {}, shared=True)
    if error is not None:
        raise error


def _snapshots(window: Window, args, nargs, refs: list, snaps) -> list:
    """Snapshot the real 0-dim tensors an op reads (``snaps``: argument position, index in ``refs``):
    eager reads one when the op runs, and the program may change it later (Note [Scalar fast path]).
    The op's recorded arguments, with the snapshots."""
    if nargs is None:
        nargs = list(args)
    for i, r in snaps:
        snap = nargs[i] = args[i].clone()
        refs[r] = -1 - window.slot_of(snap)
    return nargs


def _first_on_target(st: TracerState, f, args):
    """The device of an op's first tensor argument on the target (a target type of several
    devices: cuda:0, cuda:1), as the walk of ``_record`` meets them."""
    n = len(args)
    for i in f.tensor_pos:
        if i < n and isinstance(args[i], _Tensor) and _on_target(st, args[i]):
            return args[i].device
    for i in f.list_pos:
        if i < n:
            for a in args[i]:
                if a is not None and _on_target(st, a):
                    return a.device
    return None


def _unbound(st: TracerState, f, p, args, kwargs, n: int):
    """A hot op whose tensor arguments are not its position's (``_record``'s walk): a miss, counted as
    ``op`` where the call has another count of arguments (``clamp(y, t)`` against ``clamp(y, None,
    t)``: the same tensors, by position apart), else as ``binding``."""
    return _miss(st, f, args, kwargs, "op" if p.n != n and (p.checks or kwargs) else "binding")


def _record(st: TracerState, window: Window, f, args, kwargs, p):
    """Record op ``f`` (Note [One record path]): its placeholder(s) or written argument, as eager
    returns them; or its result, run now (an op of a small window: Note [Small windows run eagerly]
    in _hot; on host scalars: Note [Scalar fast path]; a kernel that warns: Note [Kernel warnings];
    ``out=`` tensors it could not resize); or ``_DECLINED``, nothing of it recorded, which the
    caller runs. ``kwargs`` may be None (none given); the caller checked the default dtype
    (``_dtype_check``) and, if this raises, forgets the real inputs it registered (``_decline``).
    ``window`` is ``st.window``; ``p`` its template (``window.hot``), or None: walk the op as in a
    window that is not hot."""
    n = len(args)
    if p is not None:  # ``_position``, inline
        i = len(window.nodes)
        if not i and p.small is not None:  # Note [Small windows run eagerly] in _hot
            res = run_small(st, p, f, args, kwargs)
            if res is not NOT_RUN:
                return res
        try:
            p = p.ops[i]
        except IndexError:  # no cost when not raised, unlike a length test
            window.hot_miss = ("past_end", i)
            p = None
        else:
            if p.f is not f:  # (its argument count is checked with ``p.checks``)
                window.hot_miss = ("op", i)
                p = None
            else:
                at = p.ref_at  # each argument's ref, as the walk below would build ``refs``
    token = window.token
    if p is None:
        refs = []  # Note [Window signature] in fuser.window
        sig = list(args)
        nargs = None
        inputs = []
        snaps = []
        floats = []  # positions of float arguments (Note [Scalar recording] in _ops)
        scalars = 0  # real 0-dim arguments on the target (Note [Scalar fast path])
        elsewhere = 0  # 0-dim CPU tensors of another target
        written = ()  # (tensor, storage id) of every written argument, returned or not (set below)
    for i in f.tensor_at[n]:
        a = args[i]
        o = getattr(a, "_ae", None)
        if o is not None:
            if o.win is token:  # a pending value of this window
                if p is None:
                    refs.append(o.uid)
                    if nargs is None:
                        nargs = list(args)
                    nargs[i] = o
                    inputs.append(o)
                    sig[i] = o.meta  # known since it was recorded: no shape/stride objects to build
                elif at[i] != o.uid:
                    return _unbound(st, f, p, args, kwargs, n)
                continue
            _check_elsewhere(a, o)  # another thread's pending value: that window runs first
        elif not isinstance(a, _Tensor):  # None, or a Python number passed where the schema says Tensor
            if p is None:
                if a is not None:
                    sig[i] = _number(f, a, i, floats)
            elif at[i] is not None:
                return _unbound(st, f, p, args, kwargs, n)
            continue
        slot = window.slots.get(id(a))  # a real input of the window: on the target
        if slot is None or p is None:  # in a hot window, a slotted one is checked by its ref
            if slot is None and not _on_target(st, a):
                if p is None and a.dim() == 0 and a.is_cpu and i not in f.write_pos:
                    snaps.append((i, len(refs)))
                    refs.append(0)
                    elsewhere += 1
                    sig[i] = (a.dtype, "cpu-scalar")
                    continue
                return _decline(window) if p is None else _miss(st, f, args, kwargs, "metadata")
            if st.scalar_fast_path and a.numel() == 1:
                if p is not None:
                    return _miss(st, f, args, kwargs, "metadata")  # a template holds no real scalar
                if not a.dim():
                    scalars += 1
                if i not in f.write_pos and not _written(window, a):
                    snaps.append((i, len(refs)))
            if slot is None:
                slot = _new_slot(window, a, p is not None)
                if slot < 0:
                    return _decline(window) if slot == -1 else _miss(st, f, args, kwargs, "metadata")
        if p is None:
            refs.append(-1 - slot)
            sig[i] = (a.shape, a.stride(), a.dtype)
        elif at[i] != -1 - slot:
            return _unbound(st, f, p, args, kwargs, n)
    if f.lists_or_writes:  # neither for most ops: one test skips both
        if f.list_pos:
            for i in f.list_pos:
                if i >= n:
                    break
                lst = args[i]
                if p is None:
                    new = list(lst)
                    lsig = []
                else:
                    lat = at[i]  # the list's refs, by element
                    if type(lat) is not list or len(lat) != len(lst):
                        return _unbound(st, f, p, args, kwargs, n)
                for j, a in enumerate(lst):
                    if a is None:
                        if p is None:
                            lsig.append(None)
                        elif lat[j] is not None:
                            return _unbound(st, f, p, args, kwargs, n)
                        continue
                    o = getattr(a, "_ae", None)
                    if o is not None and o.win is token:
                        if p is None:
                            refs.append(o.uid)
                            new[j] = o
                            inputs.append(o)
                            lsig.append(o.meta)
                        elif lat[j] != o.uid:
                            return _unbound(st, f, p, args, kwargs, n)
                        continue
                    if not _on_target(st, a):
                        return _decline(window) if p is None else _miss(st, f, args, kwargs, "metadata")
                    if o is not None:
                        _check_elsewhere(a, o)
                    if st.scalar_fast_path and a.numel() == 1:
                        if p is not None:
                            return _miss(st, f, args, kwargs, "metadata")
                        if not a.dim():
                            scalars += 1
                        if i not in f.write_pos and not _written(window, a) and a.layout is _strided:
                            a = new[j] = a.clone()  # snapshot: see Note [Scalar fast path]
                    slot = window.slots.get(id(a))
                    if slot is None:
                        slot = _new_slot(window, a, p is not None)
                        if slot < 0:
                            return _decline(window) if slot == -1 else _miss(st, f, args, kwargs, "metadata")
                    if p is None:
                        refs.append(-1 - slot)
                        lsig.append((a.shape, a.stride(), a.dtype))
                    elif lat[j] != -1 - slot:
                        return _unbound(st, f, p, args, kwargs, n)
                if p is None:
                    if nargs is None:
                        nargs = list(args)
                    nargs[i] = new
                    sig[i] = tuple(lsig)
        if f.writes_first:  # ``mul_``, ``addcdiv_``: most writes (Note [Overlapping writes])
            first = args[0]
            first_sid = _untyped_storage(first)._cdata
            written = ((first, first_sid),)  # marked at its emission
            if _storage_use_count(first_sid) > 2 and _shares_written(window, args, kwargs or {}, written):
                if p is not None:
                    return _miss(st, f, args, kwargs, "overlap")
                _raise_overlap(f, args, kwargs)
        elif f.mutates:
            written, shared = _writes(f, args, kwargs, n)
            if shared and _shares_written(window, args, kwargs or {}, written):
                if p is not None:
                    return _miss(st, f, args, kwargs, "overlap")
                _raise_overlap(f, args, kwargs)
    if p is not None:  # the template's position is the signature: Note [One record path]
        if p.checks or kwargs:
            if p.n != n:  # fewer or more trailing defaults than the template's call
                return _miss(st, f, args, kwargs, "op")
            if p.other or kwargs:
                if p.lists or p.factory:
                    cause = _hot_differs(st, p, args)
                    if cause is not None:
                        return _miss(st, f, args, kwargs, cause)
                if (p.consts or kwargs or p.kw) and _other_args_differ(p, args, kwargs):
                    return _miss(st, f, args, kwargs, "scalar")
            # each float compiled into the region equal, each one it takes as an input a float
            for i, v in p.fchecks:
                a = args[i] if type(i) is int else kwargs.get(i)
                if a.__class__ is not float or (v is not None and a != v):
                    return _miss(st, f, args, kwargs, "scalar")
        if f.fresh_one:  # most ops: the emission's first branch (below) for a hot record, which is None
            res = hot_placeholder(st.alloc_cpu, window, p.spec, p.uid)
            _add(st, window, None, p.fpos, args, kwargs, p.nbytes)  # Note [Hot liveness] in _hot
            return res
        if f.writes_first:  # the second: its ALIAS Out is its hot record
            _add(st, window, _alias_out(window, first, p.uid, first_sid), p.fpos, args, kwargs, p.nbytes)
            return first
        return _emit_others(st, window, f, p, p.specs, p.uid, None, None, args, kwargs,
                            written if f.mutates else (), token, None, None, None, 0)  # the rarer kinds
    return _record_full(st, window, f, args, kwargs, n, token, refs, sig, nargs, inputs, snaps, floats, scalars,
                        elsewhere, written)


def _record_full(st: TracerState, window: Window, f, args, kwargs, n: int, token, refs: list, sig: list, nargs,
                 inputs: list, snaps: list, floats: list, scalars: int, elsewhere: int, written):
    """``_record`` past the walk in a window that is not hot (or an op that did not match its
    template's position): the rest of the signature (numbers, sequences, keywords, device), the meta
    cache's output metadata, the Node and the emission (Note [One record path]). Its own function:
    the locals it needs are not in the frame of a hot record."""
    bound = len(refs) - elsewhere  # tensor arguments on the target
    if kwargs is None:
        kwargs = {}
    if scalars and scalars == bound and _scalars_settled(window, f, args, n):
        _decline(window)  # every tensor argument a real 0-dim one (not a pending value): it runs now
        METRICS.host_scalar_ops += 1
        return _eager(st, f, args, kwargs, None)
    if f.scalar_pos:
        _numbers(f, args, n, sig, floats)
    if f.seq_pos:  # (none for most ops: no iterator made for them)
        for i in f.seq_pos:
            if i < n and type(args[i]) is list:
                lst = args[i]
                if i in f.scalarlist_pos and f.liftable and all(x.__class__ is float for x in lst):
                    sig[i] = (float, len(lst))
                    for j in range(len(lst)):  # (no generator: it would make ``i`` a cell in every call)
                        floats.append((i, j))
                else:
                    sig[i] = tuple(lst)
    device = None if not bound else _first_on_target(st, f, args) if st.device_varies else st.device
    nkwargs = kwargs
    ksig = ()
    if kwargs:
        ksig = []
        for k, v in kwargs.items():
            if k in f.tensor_kw and v is not None:
                if not isinstance(v, _Tensor):
                    return _decline(window)
                o = getattr(v, "_ae", None)
                if o is not None and o.win is token:
                    if nkwargs is kwargs:
                        nkwargs = dict(kwargs)
                    nkwargs[k] = o
                    inputs.append(o)
                    refs.append(o.uid)
                else:
                    if not _on_target(st, v):
                        return _decline(window)
                    if o is not None:
                        _check_elsewhere(v, o)
                    slot = _real_slot(window, v)
                    if slot is None:
                        return _decline(window)
                    refs.append(-1 - slot)
                ksig.append((k, v.shape, v.stride(), v.dtype))
            else:
                if k == "device" and v is not None:
                    device = torch.device(v)
                    if device.type != st.target:
                        return _decline(window)
                ksig.append(_keyword(f, k, v, floats))
        ksig = tuple(ksig)
    if device is None:
        if not f.factory:
            return _decline(window)  # no tensor argument on the target device: not ours
        device = _get_default_device()
        if device.type != st.target:
            return _decline(window)
        ksig = (ksig, "default-device")  # the default dtype: Note [Meta cache key]
    elif st.device_in_key:
        ksig = (ksig, device)
    key = (f, tuple(sig), ksig)
    try:
        entry = st.meta_cache.get(key)
    except TypeError:  # an unhashable argument we do not model: run it eagerly
        return _decline(window)
    if entry is None:
        entry = meta_entry(st.meta_cache, f, args, kwargs, st.dtype, sig, ksig, written, key, len(refs),
                           st.options)
    if entry.__class__ is not tuple:
        _decline(window)
        if entry.__class__ is _Failed:
            return _DECLINED
        if entry.__class__ is _Warns:
            return _eager(st, f, args, kwargs, "kernel_warning")  # Note [Kernel warnings] in _kernel_warnings
        if entry.__class__ is _Resizes:  # Note [Out resizing] in _meta: the outs resized, then the op again
            if not resize_outs(st, f, entry, args, kwargs):
                return _eager(st, f, args, kwargs, "out_resize")
            window = st.window  # a new one if the resize flushed
            try:
                return _record(st, window, f, args, kwargs, window.hot)
            except BaseException:
                _decline(window)
                raise
        raise entry.error()  # Note [Overlapping writes]
    specs, nbytes, _, eid = entry
    if window.hot is not None:
        _demote(window, "general_path")
    if snaps:
        nargs = _snapshots(window, args, nargs, refs, snaps)
    # an op with no outputs exists for its effect (``_linalg_check_errors`` raises): never dead
    node = _node(f.func, nargs if nargs is not None else list(args), nkwargs, inputs, _user_source(4),
                 len(window.nodes), f.mutates or f.nrets == 0, False)
    uid = (node.index + 1) * OUTS_PER_NODE
    # the emission: Note [One record path]
    if f.fresh_one:  # one fresh output: most ops (in a hot window, emitted above)
        if specs[0] is not None:
            res, o = _placeholder(st, window, specs[0], uid, device)
            node.outs.append(o)
        else:  # an optional output that is not there
            res = None
            node.outs.append(None)
    elif f.writes_first:  # it writes and returns its first argument (most writes): an ALIAS Out
        (res, sid), = written  # (in a hot window, emitted in ``_record``)
        node.outs.append(_alias_out(window, res, uid, sid))
    else:  # the rarer kinds
        return _emit_others(st, window, f, None, specs, uid, node, device, args, kwargs, written, token, eid, refs,
                            floats, nbytes)
    _append(st, window, node, eid, refs, floats, args, kwargs, nbytes)
    return res


def _emit_others(st: TracerState, window: Window, f, p, specs, uid: int, node, device, args, kwargs, written, token,
                 eid, refs, floats, nbytes):
    """The emission of ``_record`` (Note [One record path]) for the kinds of op other than one fresh
    output and a write of the first argument, then the one append; ``p`` the hot position, or None
    (then ``node``, ``device``, ``eid``, ``refs``, ``floats`` and ``nbytes`` are the op's)."""
    if f.one_ret:  # one output of an op that writes
        record = None
        spec = specs[0]
        if spec is None:  # it writes and returns another argument (``out=``): an ALIAS Out
            target = f.alias_ret[0]
            res = args[target] if type(target) is int else kwargs[target]
            record = o = _alias_out(window, res, uid)
            if p is None:
                node.outs.append(o)
        elif p is not None:
            res = hot_placeholder(st.alloc_cpu, window, spec, uid)
        else:
            res, o = _placeholder(st, window, spec, uid, device)
            node.outs.append(o)
        if written:
            _mark(window, token, written)
    else:
        record = None
        results = []
        alias_ret = f.alias_ret
        for j, spec in enumerate(specs):
            o = None
            if spec is None:
                target = alias_ret[j] if j < len(alias_ret) else None
                t = None if target is None else args[target] if type(target) is int else kwargs[target]
                if t is not None:
                    o = _alias_out(window, t, uid + j)
                results.append(t)
            elif p is not None:
                results.append(hot_placeholder(st.alloc_cpu, window, spec, uid + j))
            else:
                t, o = _placeholder(st, window, spec, uid + j, device)
                results.append(t)
            if p is None:
                node.outs.append(o)
        res = None if f.nrets == 0 else results if f.returns_list else tuple(results)
        if written:
            _mark(window, token, written)
    if p is not None:
        _add(st, window, record, p.fpos, args, kwargs, p.nbytes)  # its hot record: Note [Hot windows] in _hot
    else:
        _append(st, window, node, eid, refs, floats, args, kwargs, nbytes)
    return res


_resize_ = torch.ops.aten.resize_.default
_as_strided_ = torch.ops.aten.as_strided_.default


def resize_outs(st: TracerState, f, entry: _Resizes, args, kwargs) -> bool:
    """Do to an op's ``out=`` tensors what its eager kernel does before it computes: warn, resize,
    restride (Note [Out resizing] in _meta); the window runs first where it reads or writes them.
    False, with nothing done, for an out that shares memory with another argument: the op runs
    eagerly then (what it computes depends on the order in which its kernel reads and writes); False
    too where the outs have the geometry asked for already (never expected: the op asked again
    after its resize)."""
    outs = dict(_written_args(f, args, kwargs))
    if all(outs[pos].shape == shape and outs[pos].stride() == stride for pos, shape, stride in entry.changes):
        return False
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


def _view_miss(window: Window, cause: str) -> None:
    """A view of a hot window that does not match its template's position: recorded as in any
    window (``_demote`` counts ``cause``)."""
    window.hot_miss = (cause, len(window.nodes))
    return None


def _record_view(st: TracerState, f, args, kwargs):
    """Record a view (Note [One record path]): the real view now (views read no data: Note [Hot view
    cost] in _hot), its VIEW Out(s) over its input's slot. Views of real tensors are recorded too:
    a compiled region then derives them from the real input inside the graph, instead of taking an
    alias of an input it may also write (Note [Out kinds]); ``W.t()`` in a forward pass and
    ``W.add_()`` in the optimizer step. ``kwargs`` may be None (none given)."""
    window = st.window
    a = args[0] if args else None
    if not isinstance(a, _Tensor) or not _on_target(st, a):
        return f.call(*args, **kwargs) if kwargs else f.call(*args)
    token = window.token
    o = getattr(a, "_ae", None)
    if o is not None and o.win is not token:
        _check_elsewhere(a, o)  # a view of another thread's pending value reads it later
        o = None
    p = _position(window, f, args) if window.hot is not None else None
    if o is not None:
        ref = o.uid
        slot = o.slot
    else:
        slot = window.slots.get(id(a))
        if slot is None:
            if a.layout is not _strided:  # a view of a sparse tensor: Note [Tensors the mode leaves alone] in _state
                return f.call(*args, **kwargs) if kwargs else f.call(*args)
            if p is not None and _slot_differs(window, a):
                p = _view_miss(window, "metadata")
            slot = window.slot_of(a)
        ref = -1 - slot
        if st.scalar_fast_path and a.numel() == 1:
            # a pending op may read this one-element tensor through the view: no fast-path writes
            window.viewed.add(_untyped_storage(a)._cdata)
    if p is not None:
        if ref != p.ref_at[0]:  # a view's tensor is its first argument
            p = _view_miss(window, "binding")
        elif ref < 0 and a.storage_offset() != p.offset:  # part of a view's signature
            p = _view_miss(window, "metadata")
        elif (p.consts or kwargs or p.kw) and _other_args_differ(p, args, kwargs):
            p = _view_miss(window, "scalar")
    res = f.call(*args, **kwargs) if kwargs else f.call(*args)
    uid = (len(window.nodes) + 1) * OUTS_PER_NODE
    others = window.others
    if p is not None:
        multi = p.multi
        if multi is None:  # one view, the template's spec: its hot record is its VIEW Out
            if o is not None:
                _pin_root(window, o, a)
            vo = view_out(token, uid, p.spec, _weakref(res), slot)  # held weakly (Note [Weak window])
            res._ae = vo
            others.append(vo)
            window.nodes.append(vo)  # a view adds no bytes and makes no cut, as in a full recording
            return res
        if type(res) in (list, tuple) and len(res) == len(multi):
            if o is not None:
                _pin_root(window, o, a)
            vos = []
            for j, v in enumerate(res):
                vo = view_out(token, uid + j, multi[j][1], _weakref(v), slot)
                v._ae = vo
                others.append(vo)
                vos.append(vo)
            window.nodes.append(tuple(vos))  # its hot record: its VIEW Outs
            return res
        _view_miss(window, "metadata")  # not the views the template has
    if window.hot is not None:
        _demote(window, "view")
    if kwargs is None:
        kwargs = {}
    nargs = list(args)
    if o is not None:
        nargs[0] = o
        inputs = [o]
    else:
        inputs = []
    node = _node(f.func, nargs, kwargs, inputs, None, len(window.nodes), False, True)
    for j, v in enumerate(res if isinstance(res, (tuple, list)) else (res,)):
        vo = view_out(token, uid + j, (v.shape, v.stride(), v.dtype), _weakref(v), slot)
        v._ae = vo
        node.outs.append(vo)
        others.append(vo)
    # the view's own signature: op, input geometry (offset included: views keep it) and arguments
    key = (f, a.shape, a.stride(), a.storage_offset(), a.dtype,
           tuple(tuple(x) if type(x) is list else x for x in args[1:]), tuple(kwargs.items()))
    eid = _signatures.view_id(key)
    sigs = window.sigs
    sigs.append(eid)
    sigs.append(ref)
    window.nodes.append(node)
    return res


def _pin_root(window: Window, o: Out, t) -> None:
    """A view of hot pending value ``o`` (tensor ``t``) is made: the FRESH value it shares storage
    with (``o``, or the value an in-place write of it returned) is live while its storage is, from
    here on, as in a full recording (Note [Hot views] in ``_hot``)."""
    root = o
    while root.kind == ALIAS and type(root.alias) is Out:
        root = root.alias
    if root.kind == FRESH and root.storage is None:
        h = _untyped_storage(t)._weak_ref()
        finish_hot(root, _weakref(t), h)
        window.fresh.append(root)
        window.handles.append(h)
