"""What recording an op leaves in its window, made here for every window (``_record``'s one record path,
Note [One record path], and ``_hot``'s demotion): its Node, its Outs, the
placeholders they mark, and the write marks. Every Node the tracer makes is made by ``node``; every
Out by ``hot_out``, or by ``placeholder`` and ``hot_placeholder``, which spell its stores inline (each
is once per op).

The hottest code of the library (Note [Hot record cost] in ``_hot``): no pytree walking, no strings."""

from __future__ import annotations

import weakref

import torch
from fuser.window import ALIAS, FRESH, VIEW, HotRef, Node, Out, Window, finish_hot

_Tensor = torch.Tensor
_new = object.__new__
_weakref = weakref.ref
_empty_strided = torch.empty_strided
_untyped_storage = torch._C.TensorBase.untyped_storage  # unpatched (adaptive_eager._patches)
_storage_use_count = torch._C._storage_Use_Count


def node(func, args, kwargs, inputs, source, index: int, mutates: bool, is_view: bool) -> Node:
    """The Node of a recorded op, for every path: ``Node.__init__``'s fields, stored without calling
    the class (Note [Hot record cost] in ``_hot``), so a field added to ``Node`` must be added here
    (tests/test_hot_windows.py checks every field is set)."""
    n = _new(Node)
    n.index = index
    n.fpos = ()
    n.fbase = 0
    n.func = func
    n.args = args
    n.kwargs = kwargs
    n.inputs = inputs
    n.outs = []
    n.mutates = mutates
    n.is_view = is_view
    n.source = source
    n.needed = False
    return n


def hot_out(token, kind: int, uid: int, meta, slot: int) -> Out:
    """An Out with only the fields anything reads while its window records (Note [Hot Outs] in
    fuser.window), made without ``Out.__init__`` (Note [Hot record cost] in ``_hot``). A hot window's
    FRESH value keeps it so until ``finish_hot`` (its adoption, or its demotion dead); every other
    Out is completed at once, here."""
    o = _new(Out)
    o.win = token
    o.kind = kind
    o.uid = uid
    o.meta = meta
    o.slot = slot
    o.storage = None
    return o


def dead_out(token, uid: int, spec) -> Out:
    """The Out of a hot window's FRESH value whose tensor died before its demotion (Note [Hot
    liveness] in ``_hot``): no tensor, no storage handle, never live."""
    o = hot_out(token, FRESH, uid, spec, -1)
    finish_hot(o, None, None)
    return o


def view_out(token, uid: int, spec, ref, slot: int) -> Out:
    """The VIEW Out of a view over slot ``slot`` (-1: over a pending value), ``ref`` a weak
    reference to the view (Note [Weak window])."""
    o = hot_out(token, VIEW, uid, spec, slot)
    finish_hot(o, ref, None)
    return o


def placeholder(st, window: Window, spec: tuple, uid: int, device):
    """A fresh output of a recorded op: an uninitialized tensor with eager's metadata (``spec``),
    marked with its Out, which the window holds weakly (Note [Weak window]); both returned."""
    alloc = st.alloc_cpu
    if alloc is not None:
        p = alloc(spec[0], spec[1], spec[2])
    else:
        p = _empty_strided(spec[0], spec[1], dtype=spec[2], device=device)
    h = _untyped_storage(p)._weak_ref()
    # ``hot_out`` and ``finish_hot``, inline: one op in two makes one (Note [Hot record cost] in ``_hot``)
    o = _new(Out)
    o.win = window.token
    o.kind = FRESH
    o.uid = uid
    o.meta = spec
    o.slot = -1
    o.storage = h
    o.ref = _weakref(p)
    o.tensor = o.alias = o.value = None
    o.needed = o.live = False
    o.last = -1
    p._ae = o
    window.fresh.append(o)
    window.handles.append(h)
    return p, o


def hot_placeholder(alloc, window: Window, spec: tuple, uid: int):
    """``placeholder`` in a hot window (Note [Hot liveness] in ``_hot``): the Out is a hot one, held
    by its tensor's mark and by a ``HotRef`` in ``Window.alive``, which the tensor's death removes; no
    storage handle. Its other fields are set when it is adopted (``adopt_hot``) or
    demoted dead (``dead_out``)."""
    t = alloc(*spec)  # (shape, stride, dtype)
    o = _new(Out)  # ``hot_out``, inline: every hot op makes one (Note [Hot record cost] in ``_hot``)
    o.win = window.token
    o.kind = FRESH
    o.uid = uid
    o.meta = spec
    o.slot = -1
    o.storage = None
    r = HotRef(t, window.discard)
    r.out = o
    window.alive.add(r)
    t._ae = o
    return t


def alias_out(window: Window, t, uid: int, sid: int | None = None) -> Out:
    """The ALIAS Out of an op that writes and returns ``t``, its ``alias`` the argument as recorded
    (its Out when ``t`` is a pending value of this window, else ``t`` itself); marks ``t`` with it.
    ``sid``: ``t``'s storage, marked written here (an op that writes its first argument)."""
    token = window.token
    src = getattr(t, "_ae", None)
    if src is not None and src.win is token:  # a pending value: held weakly (Note [Weak window])
        o = hot_out(token, ALIAS, uid, src.meta, src.slot)
        finish_hot(o, _weakref(t), None)
    else:
        src = t
        o = hot_out(token, ALIAS, uid, (t.shape, t.stride(), t.dtype), window.slot_of(t))
        finish_hot(o, None, None)
        o.tensor = t
    o.alias = src
    t._ae = o
    window.others.append(o)
    if sid is not None:  # ``mark_written``, inline
        window.written.add(sid)
        if o.slot >= 0:
            window.mutated.add(o.slot)
    return o


def mark_written(window: Window, sid: int, slot: int) -> None:
    """An op writes storage ``sid`` (a real input's in slot ``slot`` >= 0): later reads of it flush or
    read in window order, and a compiled region writes the slot back."""
    window.written.add(sid)
    if slot >= 0:
        window.mutated.add(slot)
