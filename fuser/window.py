"""The window: a short, finished list of recorded ATen ops, handed from the tracer to the fuser.

The tracer owns recording; this module only defines the data it produces, so the fuser can run a
window (by replay now, by compiled regions later) without knowing anything about dispatch modes.

Note [Placeholders]
Every value a recorded op produces is a real tensor from the start: the tracer allocates its
storage (``empty_strided`` with the eager shape, stride, dtype and device) and hands it to the user.
Only its *contents* are pending. That keeps identity, ``type(t)``, autograd's saved tensors,
``.grad`` and escape from the context exactly eager, and makes write-back of in-place updates free:
running a window writes straight into the tensors the program already holds. The price is that
everything reading memory without the dispatcher (``numpy``, ``tolist``, ``data_ptr``, pickling)
must flush first; ``adaptive_eager._patches`` does that.

Note [Out kinds]
An ``Out`` is one value a node produces:
- FRESH: a new tensor, its placeholder;
- ALIAS: the result of an in-place / ``out=`` op, i.e. the mutated argument itself (``out.alias``
  is that argument: a real tensor or another ``Out``); an ``out=`` eager would resize already has
  the result's geometry when the op is recorded (Note [Out resizing] in adaptive_eager._meta);
- VIEW: a view of a pending value (or of a real tensor), created eagerly on the placeholder at
  record time (views read no data), so the program's view already is the final tensor.

Note [Weak window]
The window holds no strong reference to anything the program made: each Out keeps a weak
reference to its tensor (``out.ref``) and a FRESH Out a weak reference to its placeholder's
storage (``out.storage``, a ``UntypedStorage._weak_ref`` handle). So
- a value the program drops dies at once, as in eager: its tensor and its storage's memory are
  freed while the window records, not at the flush (a weak handle keeps only the small
  ``StorageImpl`` record, which the flush frees with the handle);
- autograd's ``AccumulateGrad`` can steal a gradient (a strong reference raises the use count,
  and it then copies the gradient into a new buffer, every step, for every parameter);
- a FRESH value is observable exactly when its storage is still alive: the placeholder itself,
  a view of it (the program's or autograd's), ``.data``, or autograd's saved copy of an output
  (a TensorImpl of its own over the same storage) all hold it. ``fuser.replay.value_is_dead``
  reads that, with no reference counting of our own references.
A hot window (Note [Hot windows] in adaptive_eager._hot) holds less: a FRESH value is live while
its Python tensor is, and the window keeps no Out and no storage handle of a value that died
(``Window.alive``, ``HotRef``; why that is the same thing there: Note [Hot liveness]).
Real tensors the window reads or writes are held strongly (``Window.real_inputs``): they exist
before the window and are its region's inputs. Replay rebuilds a view's value from its input
when a later op reads it; a live value is written into its placeholder's storage at the flush.

Note [Window release]
A window's objects form no reference cycle: an Out names its window by ``Out.win``, the window's
``token`` (a ``Token``: it names the window's recorder, never the window), not by its node, and a
node does not name its window. So dropping a window frees its nodes and Outs by reference counting,
in one cascade, without visiting them one by one. (The recorder holds its open window, whose token
names the recorder back: that cycle goes when the recorder moves on to a new window.) A tensor's
mark ``t._ae`` is pending exactly while ``t._ae.win`` is the token of its recorder's open window
(or of the window it is running); a mark left behind never matches a later window. At the flush
(``adaptive_eager._flush._release``) only the Outs whose tensors can outlive the window are visited: the live
FRESH ones (``Window.live``) and the ALIAS and VIEW ones (``Window.others``) lose their marks and
their references, so a surviving tensor keeps nothing of the window. A dead FRESH Out needs no
visit: every tensor carrying its mark would share its storage, and that storage is gone. Each FRESH
Out's storage handle (a raw weak pointer) is freed explicitly. The window keeps those handles in a
flat list beside its Outs (``Window.handles``), so the liveness read and this release are each one
``map`` of a C function over it: a 1000-op window of dead intermediates costs no Python iteration
per value, only the calls; a hot window makes none for a value that died (Note [Hot flush cost]
in adaptive_eager._hot).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

FRESH, ALIAS, VIEW = 0, 1, 2
OUTS_PER_NODE = 1 << 16  # uid = (node index + 1) * OUTS_PER_NODE + output index


def storage_bytes(meta) -> int:
    """The bytes of a FRESH value's placeholder storage (``empty_strided`` of its ``Out.meta``:
    shape, strides, dtype), as the tracer's meta counts them."""
    shape, stride, dtype = meta[0], meta[1], meta[2]
    if any(s == 0 for s in shape):
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(shape, stride))) * dtype.itemsize


# The decoder of Note [Window signature]: the tracer gives each op signature an id and records here how
# many dataflow refs follow that id in ``Window.sigs``. Not bounded: a window open in any thread may
# hold any id ever given, and decoding it needs that id's arity (two ints an id).
ARITY: dict[int, int] = {}


def op_ids(sigs: list) -> list[int]:
    """The op signature ids of a window, one per node, out of its flat ``sigs``."""
    ids = []
    i, n = 0, len(sigs)
    arity = ARITY
    while i < n:
        eid = sigs[i]
        ids.append(eid)
        i += 1 + arity[eid]
    return ids


class Out:
    """One value produced by a node (see Note [Out kinds])."""

    __slots__ = ("win", "kind", "tensor", "alias", "value", "needed", "live", "uid", "slot", "meta", "ref",
                 "storage", "last")

    def __init__(self, win: object, kind: int, uid: int, meta, ref=None, storage=None, slot: int = -1,
                 tensor=None, alias=None):
        self.win = win  # the ``Window.token`` of its window: Note [Window release]
        self.uid = uid  # position in the window (node index and output index): part of region keys
        self.slot = slot  # ALIAS/VIEW of a real input: that input's slot in ``Window.real_inputs``
        self.meta = meta  # (shape, stride, dtype) of the tensor: the record path's signature of it
        self.kind = kind
        self.tensor = tensor  # ALIAS of a real tensor: that tensor (the window holds it anyway)
        self.ref = ref  # a weak reference to the program's tensor (Note [Weak window])
        self.storage = storage  # FRESH: weak handle of the placeholder's storage (Note [Weak window])
        self.alias = alias  # ALIAS: the argument it aliases (tensor or Out)
        self.value = None  # the tensor holding the computed value once the node ran
        self.needed = False  # a needed op of the window reads it
        self.live = False  # the program can still observe its placeholder (set by mark_needed)
        self.last = -1  # index of the last needed node that reads it (set by mark_needed)


# Note [Hot Outs]
# A hot window's FRESH value (Note [Hot liveness] in adaptive_eager._hot) gets a *hot* Out: made
# without ``__init__`` (``object.__new__``), with only the fields anything reads while its window
# records set: ``win``, ``kind`` (FRESH), ``uid``, ``meta``, ``slot`` (-1) and ``storage`` (None).
# ``__init__`` (13 stores and a Python frame) was the largest single cost of a hot record (Note
# [Hot record cost] in adaptive_eager._hot). Before anything reads the rest (the flush, a replay, a
# demotion's Nodes) it is completed by ``finish_hot``: ``adaptive_eager._hot.adopt_hot`` for each value
# whose tensor lives, ``Template.demote`` for a dead one an ALIAS Out names. Nothing else can reach
# a hot Out: its tensor's mark, its ``HotRef`` (both adopted) and an ALIAS Out's ``alias``.


def finish_hot(o: Out, ref, storage) -> None:
    """Set the fields a hot Out was made without (Note [Hot Outs]), as ``Out.__init__`` sets them."""
    o.ref = ref
    o.storage = storage
    o.tensor = o.alias = o.value = None
    o.needed = o.live = False
    o.last = -1


class HotRef(weakref.ref):
    """A hot window's reference to a FRESH value's tensor (Note [Hot liveness] in adaptive_eager._hot):
    a weak reference whose callback takes it out of ``Window.alive`` when the tensor dies; ``out``
    is its Out. Hashed and compared by identity: a plain weak reference hashes and compares its
    referent, and a tensor's ``__hash__`` is Python and its ``==`` an op."""

    __slots__ = ("out",)
    __hash__ = object.__hash__
    __eq__ = object.__eq__


class Node:
    """One recorded op: ``func(*args, **kwargs)`` where pending inputs appear as ``Out`` objects."""

    __slots__ = (
        "func", "args", "kwargs", "outs", "inputs", "mutates", "is_view", "source", "needed", "index",
        "fbase", "fpos",
    )

    def __init__(self, func, args, kwargs, inputs, source, index: int):
        self.index = index  # position in ``Window.nodes``
        # float arguments (Note [Scalar lifting]): positions (arg index, kwarg name or (list arg
        # index, element index)) and where their values start in ``Window.scalars``
        self.fpos = ()
        self.fbase = 0
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.inputs = inputs  # the Out objects among args/kwargs (dataflow edges)
        self.outs: list[Out] = []
        self.mutates = False
        self.is_view = False
        self.source = source  # (code object, line) of the user's line that issued the op
        self.needed = False

    def where(self) -> str:
        """The user's ``file:line`` that recorded this op (or '<unknown location>')."""
        return where(self.source)


def where(source) -> str:
    """``file:line (in function)`` of a (code object, line) source, as errors and logs print it."""
    if source is None:
        return "<unknown location>"
    code, line = source
    return f"{code.co_filename}:{line} (in {code.co_name})"


class FlushResult(NamedTuple):
    """What ``fuser.run_window`` did with a window (for ``metrics()`` and the flush log line)."""

    launches: int  # device launches: ops replayed, compiled runs and their copies
    computed: int  # ops computed (a compiled region counts its ops: the compiler does its own dead-code elimination)
    dead: int  # ops found dead (nothing observes their values)
    # "compiled", "loaded" (from disk), "replayed", "compiling" or "loading" (replayed meanwhile), "dead",
    # or "declined": a validated window not run as validated, nothing run (Note [Validated windows] in fuser.regions)
    outcome: str
    region: str | None  # a short stable hex id of its region; None on the replay backend
    entry: object = None  # the region entry it ran compiled with (``table._Entry``), else None
    declined: str | None = None  # "declined": why (a cause of ``hot_mismatches``)
    resume: object = None  # "declined": what ``fuser.run_window(..., resume=)`` takes up


class Token:
    """What the Outs of one window carry as ``Out.win`` (Note [Window release]). ``owner`` is
    whatever records the window (the tracer's per-thread state), so that any thread holding a mark
    finds who can run its window (Note [Reads from other threads] in ``adaptive_eager._threads``)."""

    __slots__ = ("owner",)

    def __init__(self, owner):
        self.owner = owner


class Window:
    """Ops recorded since the last flush, in program order."""

    __slots__ = ("nodes", "pending_bytes", "written", "sigs", "slots", "real_inputs", "mutated", "scalars",
                 "others", "fresh", "handles", "live", "viewed", "token", "hot", "hot_miss", "frees", "alive",
                 "discard", "hot_counted", "passed", "kept", "bits", "lift_from", "superseded", "slot_op", "slot_from")

    def __init__(self, owner=None):
        self.token = Token(owner)  # what its Outs carry as ``Out.win``: Note [Window release]
        self.nodes: list[Node] = []
        self.pending_bytes = 0
        self.written: set[int] = set()  # storages (``_cdata``) that pending in-place ops write
        # Note [Window signature]
        # Per node, its op signature id followed by its dataflow refs,
        # appended at record time into one flat list of ints, so the structural key of a window
        # costs nothing to build at flush and little to hash and free (no tuples per node). A
        # ref is an Out's ``uid`` (> 0) or ``-(slot + 1)`` for a real (non-pending) input tensor.
        # The list reads back unambiguously: a signature id fixes how many refs follow it (the
        # op's tensor arguments are part of what the id stands for; ``ARITY``, ``op_ids``).
        self.sigs: list[int] = []
        self.slots: dict[int, int] = {}  # id(real tensor) -> slot
        self.real_inputs: list = []  # the real tensors the window reads or writes, by slot
        # the op at node index ``slot_op`` registered the slots from ``slot_from`` on (``unslot``)
        self.slot_op = -1
        self.slot_from = 0
        self.mutated: set[int] = set()  # slots of real inputs written by pending in-place ops
        self.scalars: list[float] = []  # float arguments of the nodes, in order (not in ``sigs``)
        # where an optimizer's step began in ``scalars``: its floats are runtime inputs from the
        # first compile (Note [Scalar lifting] in fuser.scalars); None: no step in this window
        self.lift_from: int | None = None
        # the tracer expects no window of this structure again (it holds ops of a module call whose
        # next call is captured: Note [Windows a capture supersedes] in adaptive_eager._capture):
        # its region is compiled only if it is seen again after all
        self.superseded = False
        self.fresh: list[Out] = []  # the FRESH Outs (placeholders whose liveness decides outputs)
        # their ``Out.storage`` handles, in the same order: the flush reads their liveness and frees
        # them in one pass of C calls each, not one Python iteration per value (Note [Window release])
        self.handles: list[int] = []
        self.others: list[Out] = []  # the ALIAS and VIEW Outs
        self.live: list[Out] = []  # the FRESH Outs found live at the flush (``Out.live``)
        self.viewed: set[int] = set()  # storages of real 0-dim tensors with recorded views
        # the tracer's (Note [Hot windows] in adaptive_eager._hot): while ``hot`` (its template of the
        # expected window) is set, ``nodes`` holds its hot records, not Nodes; it hands such a
        # window over only as validated (Note [Validated windows] in fuser.regions), whose nodes
        # the fuser never reads
        self.hot = None
        self.hot_miss: tuple | None = None  # (cause, position) of the last op that did not match
        # storages the program freed (``resize_(0)``) while ops of this window still use them, by
        # ``_cdata``: freed once the window ran. The tracer's alone: Note [Storage resize] in
        # adaptive_eager._patches
        self.frees: dict = {}
        # while hot: a ``HotRef`` per FRESH value whose tensor lives, and its callback (``alive.discard``),
        # instead of ``fresh``/``handles`` entries (Note [Hot liveness] in adaptive_eager._hot); None
        # once ``adaptive_eager._hot.adopt_hot`` has turned the survivors into ordinary FRESH Outs
        # (the tracer's: before it hands the window over)
        self.alive: set | None = None
        self.discard = None
        # how many of its hot records ``METRICS`` counts already (``adaptive_eager._hot.count_hot``)
        self.hot_counted = 0
        # a view of a real tensor was left unrecorded, its result read as a real input (Note [Views of
        # unwritten memory] in adaptive_eager._record): the flush checks those inputs against its writes
        self.passed = False
        # results of ops that may raise from values still pending, held so that the flush finds
        # them live and computes them, dropped or not (Note [Errors from data] in adaptive_eager._data_checks)
        self.kept: list = []
        # a real input has the conjugate or negative bit: the window replays (Note [Conjugate and
        # negative bits] in fuser.compilable)
        self.bits = False

    def slot_of(self, t) -> int:
        """The slot of real tensor ``t``, registered at the next one on its first use."""
        slot = self.slots.get(id(t))
        if slot is None:
            slot = self.slots[id(t)] = len(self.real_inputs)
            if self.slot_op != len(self.nodes):  # the first slot the next op registers
                self.slot_op = len(self.nodes)
                self.slot_from = slot
            self.real_inputs.append(t)
            if t.is_conj() or t.is_neg():
                self.bits = True  # Note [Conjugate and negative bits] in fuser.compilable
        return slot

    def unslot(self) -> None:
        """Forget the real inputs that the next op (not recorded after all) registered: a window
        holds, and its region key counts, only the real tensors its nodes use."""
        if self.slot_op == len(self.nodes):
            real = self.real_inputs
            slots = self.slots
            for t in real[self.slot_from:]:
                del slots[id(t)]
            del real[self.slot_from:]
            self.slot_op = -1

    def __len__(self) -> int:
        return len(self.nodes)
