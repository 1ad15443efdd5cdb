"""Hot windows: a window whose structure has a compiled region is recorded against it, position by
position (Note [Hot windows]), instead of being recorded in full.

Note [Hot windows]
~~~~~~~~~~~~~~~~~~
After a window ran compiled (outcome compiled or loaded), the tracer keeps a ``Template`` for its
region entry (Note [Templates by region]):
per position, what recording that window again would produce and what it depends on: the op
(``OpFacts``), the binding of each tensor argument (an earlier Out's uid, or a real-input slot, with
the metadata of the real input a slot holds), the numbers baked into the region, where its lifted
floats sit, its output's metadata and its signature entries (the region key's ``Window.sigs``). The
next window is armed with it (``Window.hot``; with the template of the window that followed this
one last time, if any, so that two alternating windows each predict the other). While armed,
each op is recorded by the one record path (Note [One record path] in ``_record``) with the
template's position ``len(window.nodes)`` as its metadata source: the walk binds its arguments as in
any window, and the op must match the position (the same op, each pending input the expected Out
of this window, each real input in its expected slot with that slot's metadata, the same numbers,
the same value for each float compiled into the region and a float for each one it takes as an
input); its placeholder or ALIAS Out is then made from the position's specs, with the same slots,
written/mutated marks, scalars and pending bytes as in any window. It skips what the template
already knows: the signature, the meta-cache lookup, the Node, the user's line. ``window.nodes``
then holds, per validated op, its *hot record* instead of a Node (an in-place op's ALIAS Out, None
for a fresh value: Note [Hot liveness]), so everything that asks
whether a window has pending ops (``window.nodes``, its length, the cuts) reads it unchanged. The
rest of each op's arguments needs no record: a validated op's pending inputs are the Outs the
template names by uid, its real inputs the tensors in the slots it names, its numbers the
template's (equal) and its floats the window's scalars, in order.

Every validated window is one a full recording would have keyed to the same region: same ops,
bindings, metadata, baked numbers, slots. At its flush, if it ended exactly at the template's end,
its survivors are adopted (Note [Hot liveness]) and it is handed to the fuser with the entry it was
validated against (Note [Validated windows] in fuser.regions): if the live values are those the
region was compiled for, the entry runs directly, with no key built or hashed; else the fuser
declines it, saying why. Anything else *demotes* the window (``Template.demote``, always called
here in the tracer): the Nodes and signature of the validated prefix are built from the hot records
and the template, exactly as recording would have built them (tests/test_hot_windows.py compares
the two), and the window goes on as an ordinary one (at a flush: the fuser's declined run resumes).
It happens at the first op that does not match and that the general path records (an op the
scalar fast path runs now, or one that runs eagerly without touching the window, leaves the window
hot: ``_record._demote`` is called where a recording path commits), at a flush that is not at the
template's end, and when the fuser declines the window (the liveness differs, the region lost its
callable, a window that replays whatever its key, a compiled run that failed: its replay needs the
nodes). The causes are counted (``metrics()["hot_mismatches"]``) with the user's line (``explain()``).

A demoted node's ``source`` (the user's line errors name) is the template's line at that
position: the same op at the same position of the same structure comes, in a loop, from the same
line; a structure reached from two call sites names the one the template saw.

Hot recording is for a CPU target (one device, the placeholders' ``alloc_cpu``); a template is made
only of windows whose every op is a view (Note [Hot views]) or an op of one fresh output
(``OpFacts.one_out``, with or without keywords) or one that writes and returns its first argument
(``writes_first``); a window with any other op is recorded in full. ``tiers='regions'`` (``NEURON_EAGER_TIERS=regions``) turns it off.

Note [Hot views]
~~~~~~~~~~~~~~~~
A training step's window is a third views: ``nn.Linear``'s ``W.t()``, autograd's ``detach`` of each
saved output and of each gradient it stores in ``.grad``, a bias gradient's ``view`` (27 of the
suite's 48-op MLP step). Until they were validated, no such window was ever hot. A view's position
(``_view_pos``) holds its viewed value (an earlier Out's uid, or a real input's slot, with that
input's storage offset: a view's signature holds it) and its other arguments, compared equal;
``_record._record_view`` makes the real view (views read no data) and its VIEW Out with the
position's spec, with no signature and no Node, and adds no bytes and makes no cut, as a full
recording does not. Ops called with keywords (the backward's ``ones_like(memory_format=)``,
``add(alpha=)``) are validated with their keywords compared; so are ops of several fresh outputs (``native_layer_norm`` and its backward, whose output mask leaves
None outputs) and of tensor lists (``cat``: each element bound as a tensor argument is, in the
general path's slot order), and views of several outputs (``split``: a VIEW Out each, the hot
record their tuple), each made from the position's specs; so are factories (``zeros``, ``arange``,
``scalar_tensor``: the masks and positions a Hugging Face model makes each step), their sizes and
keywords compared, the default dtype as for every op and the default device checked as in any
window; and attention with ``dropout_p=0`` (its kernel's unseeded facts, validated only
once ``_ops.unseeded_facts`` has found the call draws nothing). Ops that write, or whose lists hold None or a real one-element tensor (a recording snapshots those) keep
their windows recorded in full. The ops the mode makes itself (a dropout's multiplies by the mask
it drew at record time, a random fill's copy from its drawn temporary: ``_mode._record_made``) are
validated too; the drawn tensor is a new real input each step, in the slot the template has. With these the suite's GPT block step (layer norms, ``split``,
``cat``) runs hot too.

One rule keeps liveness what a full recording has (Note [Hot liveness] rests on a value's memory
being reachable only through its tensor): a view shares its value's storage, and may outlive the
value's tensor (``detach`` has no ``_base`` to keep it), so the moment a view of a hot FRESH value
(or of an in-place write of one) is made, that value is *pinned* (``_record._pin_root``): it gets its
storage handle and a place in ``Window.fresh`` at once, and from then on it is live while its
storage is, as in a full recording. ``adopt_hot`` merges the pinned values with the
survivors, in window order. tests/test_hot_windows.py keeps values only through a view, a view of a
view, a ``detach``, views and in-place writes in both orders, and compares windows demoted at a
view, a keyword and a real input's offset with full recordings.

Note [Hot liveness]
~~~~~~~~~~~~~~~~~~~
In a hot window a fresh value is live while its Python tensor is, not while its storage is (Note
[Weak window] in fuser.window). Its Out (a hot Out: Note [Hot Outs] in fuser.window) is held by the tensor's mark and by a ``HotRef`` in
``Window.alive``: a weak reference to the tensor whose callback (the set's own ``discard``, a C
call) takes it out of the set when the tensor dies. It has no storage handle, and ``window.nodes``
holds None at its position. So a value the program drops leaves nothing behind, at the moment it
is dropped (its tensor, mark, Out and reference go together), and the flush visits only the
values still alive: ``adopt_hot`` gives each its storage handle and makes it an
ordinary FRESH Out (``Window.fresh``, in window order); from there liveness is read as for any
window. A demotion adopts the same way first, and builds a dead Out (no tensor, no handle, never
live) for each value that died, as the template knows it (``Template.demote``).

That a tensor's life is its value's life here rests on how memory can be shared. Whatever observes
a placeholder's memory holds its TensorImpl or another TensorImpl over its storage.
- Its own TensorImpl, held in C++ (autograd's graph and saved inputs, ``.grad``, a DLPack
  capsule, an extension): torch keeps the Python object alive while the TensorImpl is used
  (PyObject preservation), so its ``HotRef`` stays alive.
- Another TensorImpl over its storage is made by a dispatched op (a view, ``detach``, ``alias``,
  ``set_``; autograd saving an output and ``.data`` make a ``detach`` while a mode is on), which
  demotes the window while the tensor is still alive, or by C++ that dispatches nothing:
  ``_make_subclass`` (``nn.Parameter``), the ``.data`` setter and ``to_dlpack`` flush first (Note
  [Storage sharers] in ``_patches``); ``as_subclass``'s alias is a view whose base keeps the tensor.
- Raw readers (``numpy``, ``untyped_storage``, ``data_ptr``, pickling, ``__dlpack__``) flush
  already (Note [Placeholders]).
tests/test_hot_windows.py keeps a value only through each of these routes (and a saved-tensor hook,
a Python holder, a nested tensor) and checks it. Not covered: a C extension that builds a
TensorImpl over a tensor's storage without dispatching and then lets the tensor go; with it in
the loop, ``tiers='regions'`` keeps liveness by storage.

One thing is weaker than in a full recording: ``Window.written`` may keep the storage id of a
placeholder that died (no handle keeps its ``StorageImpl``), and a new storage may reuse that
address. Every reader of ``written`` then takes the new storage for one with a pending write
(it flushes first, or reads it in window order instead of snapshotting it), which is safe.

Note [Hot flush cost]
~~~~~~~~~~~~~~~~~~~~~
Before Note [Hot liveness], ~85% of a hot flush of the 1000-op loop (``benchmarks/flush_cost.py``,
1000 values, one live) was per value: ``UntypedStorage._expired`` on each FRESH Out's handle,
``_free_weak_ref``, and freeing the 1000 Outs. Now the flush visits one value, and what it costs
is what a 10-op window's flush costs plus the kernel (11.5 us for the 1000 ops on 16 floats, 2.8 us
for 10): no line of it grows with the window (cProfile, and per-function timers, compared between a
10-op and a 1000-op window). Its time is the fixed path running on cold caches: on the shared
2-core machine the same 10-op flush takes ~34 us of CPU time right after another one and 160-440
us after 2.5-14 ms of anything else (2500 eager ops, a Python loop, even ``time.sleep(0.003)``
while other processes run), every line alike. What is left to cut is the fixed path's length:
the calls and objects a flush touches. (Counting a hot window's records, ``count_hot``, and
completing its survivors' hot Outs, Note [Hot Outs] in fuser.window, add one call each.)

Note [Hot record cost]
~~~~~~~~~~~~~~~~~~~~~~
Issue 14's target: a hot window records at <= 1.15x an empty ``TorchDispatchMode``
(``benchmarks/record_overhead.py``, hot-window row; 1000s of 4-op iterations on 16 floats). Per
op, the empty mode pays the interception (C++ to the Python mode and back) and the kernel, ~2.5-4
us of its ~4.3-7 us here; a hot record pays the same interception and, instead of the kernel, its
own Python: ``__torch_dispatch__``'s prologue, then the record path (Note [One record path] in
``_record``) with the template's position as its metadata source. Each part timed alone (a
function-local loop, min of 41 runs): the placeholder's alloc + free (Inductor's
``_empty_strided_cpu``) 320-600 ns, its mark (``_ae``: a ``__dict__`` per tensor) ~80, the
``HotRef`` and ``alive.add`` 155-180 (plus its callback at the tensor's death), an ``Out`` by
``__init__`` 135-245 against 137-143 for a hot Out (Note [Hot Outs]), a facts lookup by the
``OpOverload`` (its ``__hash__`` is Python) 101-107 against 61-69 by ``id`` and about 0 (within
the loop's noise, against 72 by ``id`` in the same run) as an attribute the op carries
(``_ops.facts_for``), the default-dtype check 22-45, a Python call ~35. So a hot record makes
no ``Out.__init__`` call, counts nothing per op (``count_hot`` counts a window's records when it
ends, ``metrics()`` adds the open windows': ``_state.pending_hot_ops``), calls ``_cut`` only at a
cut (``_record._add``, the one append of every op, checks it inline), tests a position's rarer
parts (lists, a factory, other arguments, keywords) behind one flag (``_Pos.other``), and reads
the template's next position without a length test (an ``IndexError`` costs nothing until
raised). What stands is the mark, the ``HotRef`` and the allocation (each is what makes a value
pending, live while its tensor lives, and real memory), and the walk over the op's arguments,
one bytecode at a time, each ref compared with the position's where the walk reaches it
(``_Pos.ref_at``: no list of refs built and compared, 330 instructions an op). Counted with
``sys.settrace`` on the tiny-op loop, an op's dispatch and hot record run 344 bytecodes (401 when
the one record path came); the hot records' own validator, which looped over the template's
tensor positions instead of the op's (before the one record path), ran 346 with its dispatch.
Valgrind counts 35,970 instructions an op against its 36,240 (``benchmarks/RESULTS.md``).

Note [Hot view cost]
~~~~~~~~~~~~~~~~~~~~
Views are 60% of a training step's intercepted ops (86 of the GPT block step's 142), and a hot
view, unlike a hot record, runs its op (the real view over the placeholder). On a real training
window (``benchmarks/record_overhead.py --step``) hot recording costs what the empty mode costs;
what a hot view adds to the empty mode's view is its Out, its weak reference and its mark. Two
Python frames went (timed alone, 200k calls, session 21): the view is called through the
overload's C++ callable (``OpFacts.call``, ``OpOverload._op``) instead of ``OpOverload.__call__``,
whose frame only forwards to it (1.23 against 1.57 us for a ``t``), and its VIEW Out is made without
``Out.__init__``'s keyword parsing (``_emit.view_out``: ``_emit.hot_out``, then ``finish_hot``: 0.2-0.3
against 0.49 us), as every Out the tracer makes is.
"""

from __future__ import annotations

import weakref
from itertools import accumulate
from operator import attrgetter

import torch
from fuser.window import ALIAS, FRESH, OUTS_PER_NODE, VIEW, Node, Out, Window, finish_hot, storage_bytes

from . import _ops
from ._args import _tensors
from ._emit import dead_out, node as _node
from ._metrics import METRICS
from ._source import _user_source

_Tensor = torch.Tensor
_untyped_storage = torch._C.TensorBase.untyped_storage  # unpatched: see _patches
_weakref = weakref.ref
_uid = attrgetter("uid")

# Note [Templates by region]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# The tracer's table of templates: per region entry that ran compiled (``FlushResult.entry``), its
# template, or False for one whose windows cannot be recorded hot (``template_of`` refused it:
# not tried again). Weak both ways (the table by key, ``Template.entry`` a weak reference): the
# fuser decides how long an entry lives (its LRU), and an entry it dropped takes its template
# with it (a window recorded against it is demoted, "region": ``_flush._run_validated``). One it forgot but that lives on (``fuser.cache_clear``: ``_Entry.forgotten``) arms no
# window (``expect_hot``) and runs no validated one (Note [Validated windows] in fuser.regions).
# A template made under other options or another default dtype than the window that ran arms
# nothing (``expect_hot``), so it is made again from that window: a program that changed an
# option that leaves the region as it was (``window_mb``) never ran hot again.
TEMPLATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Pos:
    """One position of a template: what recording its op produced (Note [Hot windows])."""

    __slots__ = ("f", "n", "tensors", "consts", "fpos", "fvals", "kw", "spec", "uid",
                 "nbytes", "source", "sig_end", "view", "offset", "lists", "multi",
                 "factory", "other", "checks", "ref_at", "specs", "fchecks")

    def __init__(self):
        self.f = None  # the op's OpFacts
        self.n = 0  # len(args)
        self.tensors: tuple = ()  # (arg position, ref): ref an Out uid (> 0) or -(slot + 1)
        self.consts: tuple = ()  # (arg position, value) of the other arguments, compared equal
        # its floats kept apart from the signature (Note [Scalar recording] in ``_ops``): argument
        # positions and keyword names, in ``Window.scalars`` order, and per float the value compiled
        # into the region, or None for one the region takes as an input (Note [Scalar lifting])
        self.fpos: list = []
        self.fvals: list = []
        self.fchecks: tuple = ()  # (fpos, fvals) pairs, as the record path checks them
        self.kw: tuple = ()  # (name, value) of keywords (in-place ops); the value ``float`` for a float
        self.spec = None  # the fresh output's (shape, stride, dtype); None for an in-place op
        self.uid = 0  # its Out's uid
        self.nbytes = 0  # what it adds to ``Window.pending_bytes``
        self.source = None  # the user's line of the template's op here
        self.sig_end = 0  # where its entries end in ``Template.sigs``
        # a view (Note [Hot views]): its Out is a VIEW Out; a real input's storage offset, which its
        # signature holds
        self.view = False
        self.offset = 0
        # what the walk of ``_record`` checks and the emission makes (Note [One record path] in
        # ``_record``): the op's refs (as its signature entries have them) by argument position, None
        # at a position of no tensor, a list argument's a list by element, each compared where the
        # walk reaches it; and its output specs, as its meta-cache entry has them (None for an output
        # that is an argument, or none)
        self.ref_at: list = []
        self.specs: tuple = ()
        # an op of tensor lists or several outputs (Note [Hot views]): per list argument (position,
        # length, (element index, ref) per tensor); per output (uid, its spec or None), for an op
        # ``_op_pos`` takes that is not of one output (or a view of several outputs)
        self.lists: tuple = ()
        self.multi: tuple | None = None
        self.factory = False  # an op of no tensor (``zeros``): the default device must still be the target
        self.other = False  # any of ``lists``, ``factory``, ``consts``, ``kw``: one test skips them all
        # ``other``, floats, or an op whose calls may pass fewer arguments: one test skips every check
        # but the op's and the refs' (Note [One record path] in ``_record``)
        self.checks = False


class Template:
    """The expected content of the next window of one compiled region (Note [Hot windows])."""

    __slots__ = ("ops", "views", "sigs", "slot_meta", "entry", "dtype", "options", "after", "small", "parkable")

    def __init__(self, ops, sigs, slot_meta, entry, dtype, options):
        self.ops: list[_Pos] = ops
        # views[i]: how many of ops[:i] are views, which launch nothing and a recording does not
        # count in ``ops_recorded`` (``launches``)
        self.views: list[int] = list(accumulate((p.view for p in ops), initial=0))
        self.sigs: list[int] = sigs  # the region key's signature (Note [Window signature])
        self.slot_meta: list[tuple] = slot_meta  # per real-input slot: (shape, stride, dtype)
        # a weak reference to the region entry (``fuser.table._Entry``): Note [Templates by region]
        self.entry = _weakref(entry)
        self.dtype = dtype  # the default dtype its window was recorded under
        self.options = options  # the options its window ran under (they decide the region)
        self.after: Template | None = None  # the template of the window that followed it last time
        # its positions that are no view, if its windows run eagerly, op by op as they come, else
        # None (Note [Small windows run eagerly])
        ran = [p for p in ops if not p.view]
        self.small = (tuple(ran) if options.backend == "inductor" and len(ran) <= _SMALL_OPS
                      and _read_again_bytes(ops) <= _SMALL_BYTES else None)
        # the last ops that came while it was armed, small, were its ops (Note [The mode parked
        # between captured calls] in _state)
        self.parkable = False

    def fits(self, st) -> bool:
        """Whether it was made under ``st``'s options and default dtype (Note [Templates by region])."""
        return self.dtype is st.dtype and (self.options is st.options or self.options == st.options)

    def launches(self, start: int, end: int) -> int:
        """How many of the hot records ``start:end`` a recording would count as launches."""
        return end - start - (self.views[end] - self.views[start])

    def demote(self, window: Window, cause: str) -> None:
        """Turn ``window``'s hot records into the Nodes and signature recording would have made,
        and end its hot recording (Note [Hot windows]); ``cause`` is counted."""
        window.hot = None
        count_hot(window, self)
        adopt_hot(window)  # the values whose tensors live become ordinary FRESH Outs (Note [Hot liveness])
        records = window.nodes
        nodes = window.nodes = []
        # the outputs the ops made, by uid (their inputs' refs): the live values, the ALIAS records and
        # the values they write (a dead value's Out may live on as an ALIAS Out's ``alias``: a hot
        # Out, completed here, Note [Hot Outs] in fuser.window)
        outs = {o.uid: o for o in window.fresh}
        for o in window.others:
            outs[o.uid] = o
            a = o.alias
            if type(a) is Out and a.uid not in outs:
                if a.kind == FRESH:
                    finish_hot(a, None, None)  # its tensor died: not adopted
                outs[a.uid] = a
        token = window.token
        real, scalars = window.real_inputs, window.scalars
        fbase = 0
        for k, out in enumerate(records):
            p = self.ops[k]
            if out is None and p.multi is None:  # a fresh value: its Out if something still holds it, else a dead one
                out = outs.get(p.uid)
                if out is None:
                    out = outs[p.uid] = dead_out(token, p.uid, p.spec)
            args = [None] * p.n
            inputs = []
            for pos, ref in p.tensors:
                if ref > 0:
                    args[pos] = inp = outs[ref]
                    inputs.append(inp)
                else:
                    args[pos] = real[-1 - ref]
            for pos, length, elems in p.lists:
                lst = args[pos] = [None] * length
                for j, ref in elems:
                    if ref > 0:
                        lst[j] = inp = outs[ref]
                        inputs.append(inp)
                    else:
                        lst[j] = real[-1 - ref]
            for pos, v in p.consts:
                args[pos] = v  # equal to the program's (validated)
            floats = {}
            for j, pos in enumerate(p.fpos):  # in Window.scalars order, as recorded
                if type(pos) is int:
                    args[pos] = scalars[fbase + j]
                else:
                    floats[pos] = scalars[fbase + j]
            kwargs = {name: floats[name] if v is float else v for name, v in p.kw}
            node = _node(p.f.func, args, kwargs, inputs, p.source, k, p.f.writes_first, p.view)
            if p.multi is None:
                node.outs.append(out)
            elif p.view:
                node.outs.extend(out)  # its record: the VIEW Outs
            else:
                for uid, spec in p.multi:
                    if spec is None:
                        node.outs.append(None)
                        continue
                    o = outs.get(uid)
                    if o is None:
                        o = outs[uid] = dead_out(token, uid, spec)
                    node.outs.append(o)
            if p.fpos:
                node.fbase = fbase
                node.fpos = list(p.fpos)
                fbase += len(p.fpos)
            nodes.append(node)
        window.sigs = self.sigs[: self.ops[len(records) - 1].sig_end] if records else []
        METRICS.hot_mismatches[cause] += 1
        expected = self.ops[len(records)].f.name if len(records) < len(self.ops) else "(end of window)"
        METRICS.hot_break_sites[(cause, expected, _user_source(2))] += 1


def adopt_hot(window: Window) -> None:
    """End a hot window's liveness by tensor (Note [Hot liveness]): each value whose tensor still
    lives becomes an ordinary FRESH Out, with its weak storage handle, in ``Window.fresh`` and
    ``Window.handles`` in window order; the values that died left nothing. Before the window is
    handed to the fuser (``_flush``), at a demotion, and before a failed flush settles its values."""
    alive = window.alive
    if alive is None:
        return
    refs = list(alive)  # a copy first: a value dying now takes its reference out of the set
    alive.clear()  # the references' callbacks name the set: no cycle is left behind
    window.alive = window.discard = None
    outs = []
    for r in refs:
        o = r.out
        if o.storage is not None:
            continue  # a viewed value, live by its storage already (Note [Hot views])
        t = r()
        if t is not None:
            finish_hot(o, _weakref(t), _untyped_storage(t)._weak_ref())  # Note [Hot Outs] in fuser.window
            outs.append(o)
    # a hot window was hot from its first op (``expect_hot`` arms only an empty one): its only other
    # FRESH Outs are the viewed values
    fresh = window.fresh
    if fresh:
        outs.extend(fresh)
        fresh.clear()
        window.handles.clear()
    if len(outs) > 1:
        outs.sort(key=_uid)
    fresh.extend(outs)
    window.handles.extend([o.storage for o in outs])


def count_hot(window: Window, template: Template) -> None:
    """Count ``window``'s hot records, made against ``template``, in ``METRICS``: once, when its hot
    recording ends (a demotion, the flush). A hot record is not counted per op (Note [Hot record
    cost]); ``metrics()`` adds the records of the hot windows still recording
    (``_state.pending_hot_ops``). ``hot_ops`` counts every record, ``ops_recorded`` its launches
    (not its views, as a full recording does not count them)."""
    end = len(window.nodes)
    start = window.hot_counted
    if end > start:
        METRICS.ops_recorded += template.launches(start, end)
        METRICS.hot_ops += end - start
        window.hot_counted = end


def template_for(st, window: Window, entry) -> Template | None:
    """The template of region ``entry``, made from ``window`` (which just ran compiled with it) the
    first time; None if its windows cannot be recorded hot (Note [Templates by region])."""
    template = TEMPLATES.get(entry)
    if template is None or (template and not template.fits(st)):
        template = TEMPLATES[entry] = template_of(st, window, entry) or False
    return template or None


def template_of(st, window: Window, entry) -> Template | None:
    """The template of ``window``, which just ran compiled with region ``entry``; None if an op of
    it is not one a hot record takes (Note [Hot windows], Note [Hot views])."""
    if not st.options.reaches("hot") or st.alloc_cpu is None or st.device_varies:
        return None
    slots = window.slots
    ops = []
    end = 0
    scalar_fast_path = st.scalar_fast_path
    lifted_inputs = {i for i, _ in entry.lifted_inputs}
    for node in window.nodes:
        f = _ops.FACTS.get(node.func)
        if f is None:
            return _refused("op", node)
        if f.unseeded is not None:
            f = f.unseeded  # attention without dropout: recorded with these facts (Note [Dropout probability] in _ops)
        if node.is_view:
            p = _view_pos(node, f, window)
            if p is None:
                return _refused("view", node)
            refs = [p.tensors[0][1]]
        else:
            p = _op_pos(node, f, window, scalar_fast_path, lifted_inputs)
            if p is None:
                return _refused("op", node)
            refs = [ref for _, ref in p.tensors] + [ref for _, _, elems in p.lists for _, ref in elems]
        p.ref_at = at = [None] * (len(f.tensor_at) - 1)  # a place for every argument of the schema
        for pos, ref in p.tensors:
            at[pos] = ref
        for pos, length, elems in p.lists:
            at[pos] = lst = [None] * length
            for j, ref in elems:
                lst[j] = ref
        # its signature entries: the id, then the refs in argument order (Note [Window signature])
        if window.sigs[end + 1: end + 1 + len(refs)] != refs:
            return _refused("signature", node)  # not what a recording makes: never guess
        end = p.sig_end = end + 1 + len(refs)
        ops.append(p)
    if end != len(window.sigs) or not ops:
        return None
    slot_meta = [(tuple(t.shape), tuple(t.stride()), t.dtype) for t in window.real_inputs]
    return Template(ops, list(window.sigs), slot_meta, entry, st.dtype, st.options)


def _refused(cause: str, node: Node) -> None:
    """A compiled window that gets no template: it will never run hot. Counted, with the op and the
    user's line, for ``explain()`` (``METRICS.hot_refusals``): a region that runs compiled but never
    hot is otherwise silent."""
    op = node.func.name() if hasattr(node.func, "name") else str(node.func)
    METRICS.hot_refusals[(cause, op, node.source)] += 1
    return None


def _op_pos(node: Node, f, window: Window, scalar_fast_path: bool, lifted_inputs) -> _Pos | None:
    """The template position of a recorded op (Note [Hot windows]): an op of one fresh output or one
    that writes and returns its first argument, with or without keywords (``ones_like(memory_format=)``,
    ``add(alpha=)``), or an op of several fresh outputs or of tensor lists (Note [Hot
    views]); None for one a hot record does not take."""
    fast = f.one_out or f.writes_first
    if fast:
        if node.mutates != f.writes_first or len(node.outs) != 1:
            return None
    elif node.mutates or f.mutates or f.nrets == 0 or f.scalarlist_pos:
        return None
    if any(type(x) is not int and type(x) is not str for x in node.fpos):
        return None  # a float of a list: not a position a hot record reads
    slots = window.slots
    p = _Pos()
    p.f, p.n, p.source = f, len(node.args), node.source
    lifted = [x for x in node.fpos if type(x) is int]
    tensors, consts, lists = [], [], []
    for j, a in enumerate(node.args):
        if type(a) is Out:
            tensors.append((j, a.uid))
        elif isinstance(a, _Tensor):
            if not a.is_cpu or (scalar_fast_path and a.numel() == 1):
                return None  # a real scalar: a recording snapshots it
            tensors.append((j, -1 - slots[id(a)]))
        elif j in f.list_pos and type(a) is list:
            elems = []
            for k, x in enumerate(a):
                if type(x) is Out:
                    elems.append((k, x.uid))
                elif isinstance(x, _Tensor) and x.is_cpu and not (scalar_fast_path and x.numel() == 1):
                    elems.append((k, -1 - slots[id(x)]))
                else:
                    return None  # None, or a real one-element tensor the general path snapshots
            lists.append((j, len(a), tuple(elems)))
        elif j not in lifted:
            if type(a) in (list, tuple) and any(isinstance(x, _Tensor) or type(x) is Out for x in a):
                return None
            consts.append((j, a))
    if not tensors and not lists:
        if not f.factory:
            return None
        p.factory = True  # ``zeros``, ``arange``, ``scalar_tensor``: made on the default device
    p.tensors, p.consts, p.fpos = tuple(tensors), tuple(consts), list(node.fpos)
    p.lists = tuple(lists)
    # a float the region takes as an input may change; one compiled in must not (Note [Scalar lifting])
    p.fvals = [None if node.fbase + j in lifted_inputs else window.scalars[node.fbase + j]
               for j in range(len(node.fpos))]
    p.fchecks = tuple(zip(p.fpos, p.fvals))
    for v in node.kwargs.values():
        if isinstance(v, _Tensor) or type(v) is Out:
            return None
    p.kw = tuple((name, float if name in node.fpos else v) for name, v in node.kwargs.items())
    p.other = bool(p.lists or p.factory or p.consts or p.kw)
    p.checks = p.other or bool(p.fpos) or f.arity_varies
    if fast:
        o = node.outs[0]
        if o is None or o.kind != (ALIAS if f.writes_first else FRESH):
            return None
        p.uid = o.uid
        if f.writes_first:
            p.specs = (None,)
        else:
            p.spec = o.meta
            p.specs = (o.meta,)
            p.nbytes = storage_bytes(o.meta)
        return p
    # several outputs (``native_layer_norm``), a list (``unbind``), or one output of an op with lists
    multi = []
    for o in node.outs:
        if o is None:
            multi.append((0, None))  # no output there (a backward's output_mask)
        elif o.kind != FRESH:
            return None
        else:
            multi.append((o.uid, o.meta))
            p.nbytes += storage_bytes(o.meta)
    p.multi = tuple(multi)
    p.specs = tuple(spec for _, spec in multi)
    p.spec = p.specs[0]  # what the emission of one fresh output (``cat``) takes
    p.uid = (node.index + 1) * OUTS_PER_NODE  # its first output's, present or not
    return p


def _view_pos(node: Node, f, window: Window) -> _Pos | None:
    """The template position of a recorded view (Note [Hot views]); None for one a hot record does
    not take (several outputs, a tensor among its other arguments)."""
    if not node.args or not node.outs or any(o is None or o.kind != VIEW for o in node.outs):
        return None
    if f.returns_list or f.nrets != 1:  # ``split``, ``unbind``: a VIEW Out each
        multi = tuple((o.uid, o.meta) for o in node.outs)
    elif len(node.outs) == 1:
        multi = None
    else:
        return None
    o = node.outs[0]
    p = _Pos()
    p.multi = multi
    p.f, p.n, p.source, p.view = f, len(node.args), node.source, True
    a = node.args[0]
    if type(a) is Out:
        p.tensors = ((0, a.uid),)
    elif isinstance(a, _Tensor) and a.is_cpu:
        p.tensors = ((0, -1 - window.slots[id(a)]),)
        p.offset = a.storage_offset()
    else:
        return None
    for j, v in enumerate(node.args[1:], 1):
        if isinstance(v, _Tensor) or type(v) is Out:
            return None
        if type(v) in (list, tuple) and any(isinstance(x, _Tensor) or type(x) is Out for x in v):
            return None
    for v in node.kwargs.values():
        if isinstance(v, _Tensor) or type(v) is Out:
            return None
    p.consts = tuple(enumerate(node.args[1:], 1))
    p.kw = tuple(node.kwargs.items())
    p.spec = o.meta
    p.uid = o.uid
    return p


def expect_hot(st) -> None:
    """Arm ``st``'s open window, if it is empty, with the template expected next: that of the
    window that followed the last compiled one last time, else the last compiled one's (Note [Hot
    windows]); none if the options or the default dtype differ from its window's, or its region
    was forgotten (Note [Templates by region])."""
    window = st.window
    t = st.hot_prev
    if t is not None:
        t = t.after or t
    if t is not None:
        entry = t.entry()
        if entry is None or entry.forgotten or not t.fits(st):
            t = None
    if not window.nodes:
        window.hot = t
        st.small = 0  # Note [Small windows run eagerly]
        if t is not None and window.alive is None:
            alive = window.alive = set()  # Note [Hot liveness]
            window.discard = alive.discard



# Note [Small windows run eagerly]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A window of a few ops on small tensors costs more recorded and run compiled than run eagerly:
# the flush of the rnn workload's loss window (``mse_loss``, the backward's ``ones_like`` seed,
# ``mse_loss_backward``: 3 ops on 32 floats) took 87 us, its three records about 25 us, against
# about 15 us for the three ops run eagerly through the mode (benchmarks/RESULTS.md, session 33).
# Fusing them saves no memory traffic worth that: a region writes every value read after it as
# eager does, and saves only the traffic of the values it makes and reads again itself. The MLP
# train step's loss window writes a 256 KiB gradient that only the captured backward reads; run
# compiled, it kept the mode from parking between the captured calls, and its step took 1.13x
# ``torch.compile``'s time, 1.07x run eagerly (RESULTS.md, session 40; bounding all outputs at
# 1 MiB instead ran longer chains eagerly and lost their fusion). So a template of at most ``_SMALL_OPS`` ops that
# are no view, whose values read again inside the window add up to at most ``_SMALL_BYTES``
# (``_read_again_bytes``), arms its window to run eagerly
# (``Template.small``: those ops): while the window is empty, each op that is the next of them (the
# same op, ``TracerState.small`` counting those run) and reads no other thread's pending value
# runs now, with eager's kernel, and is not recorded (``ops_eager``). Its views (autograd's
# ``detach`` of a saved output) are then views of real memory, which no window records (Note
# [Views of unwritten memory] in ``_record``). Nothing of this thread is pending while its window
# is empty, so every input is real and the values are eager's, bitwise.
# After the template's last position, the next template is armed as a flush would arm it
# (``metrics()["small_windows"]``); an op that is not the next position, or reads a pending value
# elsewhere, is recorded as usual (against the template's first position: what ran before it is
# done). Hot templates exist only on a CPU target (``template_of``), and only Inductor's run small
# windows eagerly: the StableHLO backends on a CPU target stand for a device whose every op is a
# launch, where the compiled region stays one.
_SMALL_OPS = 8
_SMALL_BYTES = 1 << 16


def _read_again_bytes(ops) -> int:
    """The bytes of the values ``ops`` make and then read again themselves: what a compiled region
    keeps out of memory (Note [Small windows run eagerly]). A view reads its base where its own
    reader does."""
    made = {}  # uid of an output (or a view of one) -> (its base's uid, bytes)
    read = set()
    for p in ops:
        for _, r in p.tensors:
            if r in made:
                read.add(made[r])
        for _, _, refs in p.lists:
            for _, r in refs:
                if r in made:
                    read.add(made[r])
        if p.view:
            base = made.get(p.tensors[0][1]) if p.tensors else None
            if base is not None:
                for uid, _ in p.multi or ((p.uid, None),):
                    made[uid] = base
            continue
        if p.multi:
            for uid, spec in p.multi:
                if uid:
                    made[uid] = (uid, storage_bytes(spec))
        elif p.spec is not None:
            made[p.uid] = (p.uid, p.nbytes)
    return sum(n for _, n in read)
NOT_RUN = object()  # ``run_small``'s answer for an op it leaves to the record path


def run_small(st, hot: Template, f, args, kwargs):
    """Run op ``f`` of a small window now (Note [Small windows run eagerly]), or ``NOT_RUN``.
    ``st.window`` is empty and armed with ``hot``; ``kwargs`` may be None."""
    k = st.small
    ops = hot.small
    p = ops[k]
    if p.f is not f or p.n != len(args):
        st.small = 0
        hot.parkable = False
        return NOT_RUN
    for t in _tensors(args, kwargs or {}):
        if getattr(t, "_ae", None) is not None:  # another thread's pending value: its window runs first
            st.small = 0
            hot.parkable = False
            return NOT_RUN
    out = f.func(*args, **kwargs) if kwargs else f.func(*args)
    METRICS.ops_eager += 1
    METRICS.launches += 1
    METRICS.eager_equivalent_launches += 1
    k += 1
    if k < len(ops):
        st.small = k
        return out
    METRICS.small_windows += 1
    hot.parkable = True
    prev = st.hot_prev
    if prev is not None and prev is not hot:
        prev.after = hot  # as a flush chains them (``_flush._arm``)
    st.hot_prev = hot
    expect_hot(st)
    return out
