"""Shape classes: windows of one structure that differ only in sizes share one symbolic region
(Note [Dynamic shapes])."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from .program import Program, _In, _Lifted, _Ref, _Sym
from .stats import STATS
from .window import Window

if TYPE_CHECKING:
    from .table import _Entry


# Note [Dynamic shapes]
# ~~~~~~~~~~~~~~~~~~~~~
# The exact key (Note [Region key]) holds every shape, so a loop over batch sizes would compile each
# region once per size. On an exact-key miss (never on a hit: a hit costs what it always did), the
# structure's Program is split into a *shape class* (everything but the ints: ops, dataflow,
# dtypes, devices, floats, live outputs, written inputs, lifted floats) and a *shape* (the ints:
# input sizes and strides and every int argument, in one fixed order). Once a class has shown two
# shapes, the positions that differ are explained by symbols: each varying input dimension whose
# values (across the shapes seen) form a new column is a symbol; a varying int argument must be a
# fixed multiple of a symbol (``x.view(B, -1)``, ``mean``'s ``div(grad, B * 10)``); an input with a
# symbolic dimension must be contiguous. Anything else (a size that is B - 1, a strided input) is
# counted in ``STATS.not_dynamic`` and the class stays per-shape, as before.
# The class is then compiled once symbolically (``Program.dims``/``_Sym`` arguments, make_fx with a
# ShapeEnv whose symbols are exactly those dims, Inductor with the graph's ShapeEnv). The artifact is
# used for a new shape only if (a) every non-symbolic position equals the class's value, every
# symbolic argument is its multiple of its symbol (the stride of a dimension of size 1, never used,
# may vary: ``x[:, -1:]`` of a growing ``x``), symbolic inputs are contiguous and every symbol is
# >= 2 (ShapeEnv specializes 0 and 1), (b) the guards Inductor recorded (e.g. ``s0 <= 4096``) hold for
# the window's inputs, and (c) at its first run for that exact key, every output's shape, stride
# and dtype equal the placeholders the program already holds (checked before anything is written;
# a mismatch replays). The exact key is then registered with the symbolic callable, so its next
# window is a plain hit. A failed symbolic compile blacklists only the class's symbolic entry.
# The symbolic Program's persistent key leaves out the hint sizes, so another process that sees the
# same varying dims loads it from the store.
SHAPE_CLASSES_MAX = 1024
MAX_SHAPES = 8  # shapes remembered per class (only their differences matter)


class _Hole:
    """An int of a Program in its shape-class key."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "#"


_HOLE = _Hole()


class _ShapeClass:
    __slots__ = ("shapes", "where", "pattern", "reps", "dims", "dyn_slots", "base", "sym", "compiled",
                 "dynamic_ok", "family")

    def __init__(self, where: list, family):
        self.shapes: list[tuple] = []  # distinct shapes seen
        self.where = where  # per shape position: ("size"|"stride", slot, dim) or None for an argument
        self.pattern: list | None = None  # per position: None (fixed), "contiguous", "free" or (symbol, factor)
        self.reps: list[tuple[int, int]] = []  # symbol k -> its (slot, dim)
        self.dims: list[tuple[int, int, int]] = []
        self.dyn_slots: set[int] = set()
        self.base: tuple | None = None
        self.sym: _Entry | None = None  # the symbolic region
        self.compiled = 0  # static compiles of this class
        self.dynamic_ok = True
        self.family = family  # the class key with dtypes erased: tells a "new_dtype" recompile


_CLASSES: OrderedDict = OrderedDict()
_FAMILIES: dict = {}  # dtype-erased class key -> the class that compiled first


def _shape_key(program: Program, erase_dtypes: bool = False):
    """(class key, shape, where): Note [Dynamic shapes]. The walk order is ``_with_symbols``'s."""
    values: list[int] = []
    where: list = []

    def walk(x):
        t = type(x)
        if t is int:
            values.append(x)
            where.append(None)
            return _HOLE
        if t is list or t is tuple:
            return (t, tuple(walk(v) for v in x))
        if t is dict:
            return (dict, tuple((k, walk(v)) for k, v in x.items()))
        if t is _Ref:
            return ("%", x.uid)
        if t is _In:
            return ("in", x.slot)
        if t is _Lifted:
            return ("lifted", x.index)
        if erase_dtypes and t is torch.dtype:
            return "dtype"
        return x

    ops = tuple((func, walk(args), walk(kwargs), tuple(None if o is None else (o[0], o[1], walk(o[2])) for o in outs))
                for func, args, kwargs, outs in program.ops)
    inputs = []
    for slot, (shape, stride, dtype, device) in enumerate(program.inputs):
        for d, n in enumerate(shape):
            values.append(n)
            where.append(("size", slot, d))
        for d, n in enumerate(stride):
            values.append(n)
            where.append(("stride", slot, d))
        inputs.append((len(shape), "dtype" if erase_dtypes else dtype, device))
    key = (ops, tuple(inputs), tuple(program.live), tuple(program.mutated), tuple(program.lifted))
    return key, tuple(values), where


def _classify(entry: _Entry) -> None:
    """File the structure's shape under its class (at first sight of an exact key only)."""
    try:
        key, shape, where = _shape_key(entry.program)
        cls = _CLASSES.get(key)
    except TypeError:  # an unhashable argument: no class, per-shape as before
        STATS.not_dynamic["unhashable_argument"] += 1
        return
    if cls is None:
        cls = _CLASSES[key] = _ShapeClass(where, None)
        if len(_CLASSES) > SHAPE_CLASSES_MAX:
            _CLASSES.popitem(last=False)
    entry.shape_class = cls
    entry.shape = shape
    if shape not in cls.shapes and len(cls.shapes) < MAX_SHAPES:
        cls.shapes.append(shape)
        if cls.pattern is not None and cls.sym is None:
            cls.pattern = None  # not compiled yet: plan again with the new shape


def _static_cause(entry: _Entry) -> str | None:
    """Why a static compile of ``entry`` is a recompile: its class compiled another shape
    ("new_shape"), or the same program with other dtypes compiled ("new_dtype")."""
    cls = entry.shape_class
    if cls is None:
        return None
    cls.compiled += 1
    if cls.compiled > 1 or cls.sym is not None:
        return "new_shape"
    if cls.family is None and entry.program is not None:
        try:
            cls.family = _shape_key(entry.program, erase_dtypes=True)[0]
            first = _FAMILIES.setdefault(cls.family, cls)
        except TypeError:
            return None
        if first is not cls:
            return "new_dtype"
    return None


def _contiguous(shape) -> tuple:
    strides, n = [], 1
    for d in reversed(shape):
        strides.append(n)
        n *= d
    return tuple(reversed(strides))


def _plan(cls: _ShapeClass) -> str | None:
    """Explain the positions that vary between the class's shapes by symbols; the reason not, or None."""
    columns = list(zip(*cls.shapes))
    varying = [i for i, col in enumerate(columns) if len(set(col)) > 1]
    pattern: list = [None] * len(columns)
    symbols: dict[tuple, int] = {}
    reps, dims = [], []
    for i in varying:
        w = cls.where[i]
        if w is not None and w[0] == "size":
            k = symbols.get(columns[i])
            if k is None:
                k = symbols[columns[i]] = len(reps)
                reps.append((w[1], w[2]))
            dims.append((w[1], w[2], k))
            pattern[i] = (k, 1)
    if not reps:
        return "no_varying_input_size"
    dyn_slots = {slot for slot, _, _ in dims}
    for i, w in enumerate(cls.where):
        if w is not None and w[0] == "stride" and w[1] in dyn_slots:
            pattern[i] = "contiguous"
    for i in varying:
        w = cls.where[i]
        if w is not None:
            if w[0] == "stride" and w[1] not in dyn_slots:
                if all(n == 1 for n in columns[cls.where.index(("size", w[1], w[2]))]):
                    pattern[i] = "free"  # the stride of a dimension of size 1 is never used
                    continue
                return "varying_stride"
            continue
        col = columns[i]
        for column, k in symbols.items():
            if column[0] and col[0] % column[0] == 0:
                factor = col[0] // column[0]
                if factor >= 1 and all(a == factor * b for a, b in zip(col, column)):
                    pattern[i] = (k, factor)
                    break
        else:
            return "derived_size"
    for shape in cls.shapes:
        for slot in dyn_slots:
            sizes = [shape[i] for i, w in enumerate(cls.where) if w is not None and w[0] == "size" and w[1] == slot]
            strides = [shape[i] for i, w in enumerate(cls.where) if w is not None and w[0] == "stride" and w[1] == slot]
            if tuple(strides) != _contiguous(sizes):
                return "non_contiguous_input"
    cls.pattern, cls.reps, cls.dims, cls.dyn_slots, cls.base = pattern, reps, dims, dyn_slots, cls.shapes[0]
    return None


def _fits(cls: _ShapeClass, shape: tuple) -> str | None:
    """Whether the symbolic region of ``cls`` computes ``shape`` (its guards aside); else why not."""
    pattern, where = cls.pattern, cls.where
    values = []
    for slot, d in cls.reps:
        i = where.index(("size", slot, d))
        values.append(shape[i])
    if min(values) < 2:
        return "size_0_or_1"
    base = cls.base
    for i, p in enumerate(pattern):
        if p is None:
            if shape[i] != base[i]:
                return "other_fixed_size"
        elif p != "contiguous" and p != "free" and shape[i] != p[1] * values[p[0]]:
            return "other_size_relation"
    for slot in cls.dyn_slots:
        sizes = [shape[i] for i, w in enumerate(where) if w is not None and w[0] == "size" and w[1] == slot]
        strides = [shape[i] for i, w in enumerate(where) if w is not None and w[0] == "stride" and w[1] == slot]
        if tuple(strides) != _contiguous(sizes):
            return "non_contiguous_input"
    return None


def _with_symbols(program: Program, cls: _ShapeClass, sizes_alone: bool = False) -> Program:
    """``program`` with the class's symbolic ints as ``_Sym`` arguments and its dims symbolic
    (``sizes_alone``: for a backend of static shapes, Note [Sizes that vary, run alone] in fuser.compile)."""
    pattern = iter(cls.pattern)

    def symbol(x):
        if type(x) is int:
            p = next(pattern)
            return _Sym(*p) if type(p) is tuple else x
        return x

    ops = program.mapped_ops(symbol)
    inputs = [list(x) for x in program.inputs]
    for p, w in zip(cls.pattern, cls.where):
        if p == "free":  # one stride for every window, so that the persistent key is one too
            shape, stride = inputs[w[1]][0], list(inputs[w[1]][1])
            stride[w[2]] = _contiguous(shape)[w[2]]
            inputs[w[1]][1] = tuple(stride)
    return Program(ops, [tuple(x) for x in inputs], program.live, program.mutated, program.lifted, program.scalars,
                   cls.reps, cls.dims, default_dtype=program.default_dtype, derived=program.derived,
                   sizes_alone=sizes_alone)


class _GuardInputs(dict):
    """A guard's inputs: the window's real inputs, then its lifted floats (Note [Scalar lifting] in
    fuser.scalars), which run as 0-dim tensors; a guard on one (its size, stride, offset) is
    checked against such a tensor. An optimizer's floats are lifted from the first compile, so a
    symbolic region of a training step has them: its guards named ``t6`` past the real inputs,
    could not be evaluated, and every batch size compiled again."""

    def __missing__(self, key):
        return _SCALAR


_SCALAR = torch.scalar_tensor(0.0)


def _guards_fail(run, window: Window) -> str | None:
    code = getattr(run, "guards", None)
    if code is None:
        return None
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    try:
        ok = eval(code, SYMPY_INTERP, {"L": _GuardInputs({f"t{i}": t for i, t in enumerate(window.real_inputs)})})
    except Exception:  # noqa: BLE001 - a guard it cannot evaluate: do not use the region
        return "guard_error"
    return None if ok else "guards"
