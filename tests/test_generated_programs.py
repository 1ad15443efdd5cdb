"""Hypothesis-generated straight-line programs, run eagerly and under ``adaptive_eager()``.

A program is a list of steps over a pool of live tensors (float, int64 and bool). Steps are drawn
against the pool's current shapes and dtypes, so programs are valid by construction: the strategy
runs each step eagerly as it draws it, and a step that eager rejects is not kept. The test then runs
the program twice from the same inputs and generator state, once plain and once lazily, and compares
everything the program could observe: every pool tensor at the end (values, dtype, shape, strides,
which tensors share storage), the strides of every value when it is made, and every value it read
in the middle (``item``, ``tolist``, ``numpy``, ``print``, ``bool``, ``torch.equal``), each of which
is also a sync point.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Callable

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import adaptive_eager as ae
from _oracle import COMPILED, REPLAY, aliasing, first_difference
from adaptive_eager import adaptive_eager

MAX_STEPS = 24
MAX_NUMEL = 256  # keeps cat/stack/matmul chains from growing: the bugs live in the structure
RNG_SEED = 1234
DEVICE = "cpu"  # where inputs are made (tests/test_neuron_emulation.py runs these programs on ``neuron``)

# -------------------------------------------------------------------------------------------------
# Programs


@dataclasses.dataclass(frozen=True)
class Input:
    dtype: torch.dtype
    shape: tuple[int, ...]
    layout: str  # "contiguous" | "transposed" | "strided": non-dense inputs take other kernel paths
    seed: int

    def make(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed)
        shape = self.shape[::-1] if self.layout == "transposed" else self.shape
        if self.layout == "strided":
            shape = (*shape[:-1], 2 * shape[-1]) if shape else shape
        if self.dtype is torch.float32:
            t = torch.randn(shape, generator=g)
        elif self.dtype is torch.int64:
            t = torch.randint(-8, 9, shape, generator=g)
        else:
            t = torch.rand(shape, generator=g) > 0.5
        t = t.to(DEVICE)  # before the layout is made: ``to`` does not keep a non-dense one
        if self.layout == "transposed":
            return t.permute(tuple(reversed(range(t.dim()))))
        if self.layout == "strided" and t.dim():
            return t[..., ::2]
        return t


@dataclasses.dataclass(frozen=True)
class Step:
    op: str
    operands: tuple[int, ...]
    params: tuple = ()
    outputs: tuple[int, ...] = ()  # pool slots of the tensors it appends

    def __repr__(self) -> str:
        call = f"{self.op}({', '.join([f't{i}' for i in self.operands] + [repr(p) for p in self.params])})"
        if self.outputs:
            return f"{', '.join(f't{i}' for i in self.outputs)} = {call}"
        return call


@dataclasses.dataclass(frozen=True)
class Program:
    inputs: tuple[Input, ...]
    steps: tuple[Step, ...]

    def __repr__(self) -> str:
        lines = [f"t{i} = {x.layout} {x.dtype} {list(x.shape)} (seed {x.seed})" for i, x in enumerate(self.inputs)]
        return "\n".join(["Program:", *("    " + line for line in lines + [repr(s) for s in self.steps])])


@dataclasses.dataclass(frozen=True)
class Op:
    """``run(*operand_tensors, *params)``; ``draw(draw, pool)`` picks operands and params that are
    valid for the pool's current tensors, or returns None when the op does not apply."""

    run: Callable
    draw: Callable
    kind: str = "compute"  # compute: appends its results | inplace | observe: reads a value | drop


def execute(step: Step, pool: list, observations: list) -> None:
    op = OPS[step.op]
    if op.kind == "drop":
        pool[step.operands[0]] = None  # the program's last reference: the value is dead from here
        return
    result = op.run(*[pool[i] for i in step.operands], *step.params)
    if op.kind == "observe":
        observations.append((repr(step), result))
    elif op.kind == "compute":
        results = result if isinstance(result, (tuple, list)) else (result,)
        # each value's strides when it is made (pending, lazily): eager's from the start, not only
        # once the flush has computed it (Note [Eager layouts] in adaptive_eager._meta)
        observations.append((repr(step), "strides", [t.stride() for t in results]))
        pool.extend(results)


def run_program(program: Program, lazy: bool, **options) -> tuple[list, list]:
    """The final pool and the observed values; inputs are made outside the mode, like real data."""
    # A lazy run that failed to leave the mode would turn the oracle into the thing under test.
    assert not ae.is_enabled(), "adaptive eager is still on from an earlier run"
    pool = [x.make() for x in program.inputs]
    observations: list = []
    torch.default_generator.manual_seed(RNG_SEED)
    if lazy:
        with adaptive_eager(**options):
            for step in program.steps:
                execute(step, pool, observations)
    else:
        for step in program.steps:
            execute(step, pool, observations)
    return pool, observations


def assert_lazy_matches_eager(program: Program, **options) -> None:
    eager_pool, eager_seen = run_program(program, lazy=False)
    lazy_pool, lazy_seen = run_program(program, lazy=True, **options)
    diff = (
        first_difference(eager_seen, lazy_seen, "observed")
        or first_difference(eager_pool, lazy_pool, "pool")
        or _aliasing_difference(eager_pool, lazy_pool)
    )
    assert diff is None, f"{diff}\n{program!r}"


def _aliasing_difference(eager_pool: list, lazy_pool: list) -> str | None:
    expected, actual = aliasing(eager_pool, eager_pool), aliasing(lazy_pool, lazy_pool)
    if expected != actual:
        return f"pool tensors share storage as {actual}, eager {expected}"
    return None


# -------------------------------------------------------------------------------------------------
# Drawing operands


def is_float(t):
    return t.is_floating_point()


def is_int(t):
    return t.dtype is torch.int64


def is_bool(t):
    return t.dtype is torch.bool


def is_numeric(t):
    return t.dtype is not torch.bool


def is_any(t):
    return True


def is_writable(t):
    """Eager refuses in-place writes to tensors whose elements share memory (expanded views)."""
    return all(stride or size <= 1 for size, stride in zip(t.shape, t.stride()))


def broadcasts(a, b) -> tuple | None:
    try:
        return tuple(torch.broadcast_shapes(a.shape, b.shape))
    except RuntimeError:
        return None


def pick(draw, pool, pred, *, min_dim: int = 0):
    choices = [i for i, t in enumerate(pool) if t is not None and pred(t) and t.dim() >= min_dim]
    return draw(st.sampled_from(choices)) if choices else None


def pick_partner(draw, pool, first: int, pred, *, into_first: bool = False):
    """A second operand that broadcasts with ``pool[first]`` (onto its shape when ``into_first``)."""
    a = pool[first]
    choices = [
        i for i, t in enumerate(pool)
        if t is not None and pred(t) and broadcasts(a, t) is not None
        and (not into_first or broadcasts(a, t) == tuple(a.shape))
    ]
    return draw(st.sampled_from(choices)) if choices else None


def draw_dim(draw, t):
    return draw(st.integers(-t.dim(), t.dim() - 1))


def draw_scalar(draw, t):
    """Python ints and floats promote differently: draw both kinds."""
    if is_float(t):
        return draw(st.sampled_from([2, -1, 0.5, 1.5, -3.25]))
    return draw(st.sampled_from([2, -1, 3]))


def unary(pred=is_numeric, min_dim=0, max_dim=8):
    def draw_unary(draw, pool):
        i = pick(draw, pool, lambda t: pred(t) and t.dim() <= max_dim, min_dim=min_dim)
        return None if i is None else ((i,), ())

    return draw_unary


def binary(pred=is_numeric, partner=None, into_first=False):
    def draw_binary(draw, pool):
        i = pick(draw, pool, pred)
        if i is None:
            return None
        j = pick_partner(draw, pool, i, partner or pred, into_first=into_first)
        return None if j is None else ((i, j), ())

    return draw_binary


def with_scalar(pred=is_numeric):
    def draw_with_scalar(draw, pool):
        i = pick(draw, pool, pred)
        return None if i is None else ((i,), (draw_scalar(draw, pool[i]),))

    return draw_with_scalar


def clamp_bounds(pred=is_numeric):
    def draw_bounds(draw, pool):
        i = pick(draw, pool, pred)
        if i is None:
            return None
        low = draw(st.sampled_from([-1, 0, -0.5] if is_float(pool[i]) else [-2, 0]))
        return (i,), (low, low + draw(st.sampled_from([1, 3])))

    return draw_bounds


def reduction(pred=is_numeric, full=True):
    """``dim=None`` is the full reduction (where the op has one); otherwise a dim and keepdim."""

    def draw_reduction(draw, pool):
        i = pick(draw, pool, pred, min_dim=0 if full else 1)
        if i is None:
            return None
        t = pool[i]
        if full and (t.dim() == 0 or draw(st.booleans())):
            return (i,), (None, False)
        return (i,), (draw_dim(draw, t), draw(st.booleans()))

    return draw_reduction


def along_dim(pred=is_numeric):
    def draw_along_dim(draw, pool):
        i = pick(draw, pool, pred, min_dim=1)
        return None if i is None else ((i,), (draw_dim(draw, pool[i]),))

    return draw_along_dim


def reduce(fn):
    def run(t, dim, keepdim):
        return fn(t) if dim is None else fn(t, dim, keepdim=keepdim)

    return run


# -------------------------------------------------------------------------------------------------
# Draw functions of the ops with their own shape rules


def draw_reshape(draw, pool):
    i = pick(draw, pool, is_any)
    if i is None:
        return None
    n = pool[i].numel()
    divisors = [d for d in range(1, n + 1) if n % d == 0] or [1]
    d = draw(st.sampled_from(divisors))
    return (i,), (draw(st.sampled_from([(-1,), (d, -1), (-1, d, 1)])),)


def draw_view_flat(draw, pool):
    i = pick(draw, pool, lambda t: t.is_contiguous())
    return None if i is None else ((i,), ())


def draw_two_dims(draw, pool):
    i = pick(draw, pool, is_any, min_dim=2)
    if i is None:
        return None
    t = pool[i]
    return (i,), (draw_dim(draw, t), draw_dim(draw, t))


def draw_permute(draw, pool):
    i = pick(draw, pool, is_any, min_dim=1)
    return None if i is None else ((i,), (tuple(draw(st.permutations(range(pool[i].dim())))),))


def draw_slice(draw, pool):
    i = pick(draw, pool, is_any, min_dim=1)
    if i is None:
        return None
    t = pool[i]
    dim = draw_dim(draw, t)
    size = t.shape[dim]
    start = draw(st.integers(0, size))
    stop = draw(st.integers(start, size))
    return (i,), (dim, start, stop, draw(st.sampled_from([1, 2])))


def draw_select(draw, pool):
    i = pick(draw, pool, lambda t: 0 not in t.shape, min_dim=1)
    if i is None:
        return None
    dim = draw_dim(draw, pool[i])
    return (i,), (dim, draw(st.integers(-pool[i].shape[dim], pool[i].shape[dim] - 1)))


def draw_narrow(draw, pool):
    i = pick(draw, pool, is_any, min_dim=1)
    if i is None:
        return None
    dim = draw_dim(draw, pool[i])
    size = pool[i].shape[dim]
    start = draw(st.integers(0, size))
    return (i,), (dim, start, draw(st.integers(0, size - start)))


def draw_expand(draw, pool):
    i = pick(draw, pool, is_any)
    if i is None:
        return None
    shape = tuple(3 if n == 1 and draw(st.booleans()) else n for n in pool[i].shape)
    return (i,), ((2, *shape) if draw(st.booleans()) else shape,)


def draw_unsqueeze(draw, pool):
    i = pick(draw, pool, is_any)
    return None if i is None else ((i,), (draw(st.integers(-pool[i].dim() - 1, pool[i].dim())),))


def draw_squeeze(draw, pool):
    i = pick(draw, pool, lambda t: 1 in t.shape)
    return None if i is None else ((i,), (draw(st.sampled_from([d for d, n in enumerate(pool[i].shape) if n == 1])),))


def draw_chunk(draw, pool):
    i = pick(draw, pool, is_any, min_dim=1)
    return None if i is None else ((i,), (draw(st.integers(1, 3)), draw_dim(draw, pool[i])))


def draw_fill_value(draw, pool):
    i = pick(draw, pool, lambda t: is_writable(t) and is_numeric(t))
    return None if i is None else ((i,), (draw_scalar(draw, pool[i]),))


def draw_index_source(draw, pool):
    """A tensor to index along ``dim`` and an int64 pool tensor whose values become the indices."""
    i = pick(draw, pool, lambda t: 0 not in t.shape, min_dim=1)
    j = pick(draw, pool, lambda t: is_int(t) and t.numel() > 0)
    if i is None or j is None:
        return None
    return (i, j), (draw_dim(draw, pool[i]),)


def indices_from(source: torch.Tensor, size: int) -> torch.Tensor:
    """In-range indices computed from pending values (``remainder`` of a positive modulus is >= 0)."""
    return source.reshape(-1).remainder(size)


def run_index_add_(t, source, dim):
    idx = indices_from(source, t.shape[dim])
    t.index_add_(dim, idx, t.index_select(dim, idx) * 0.5 if is_float(t) else t.index_select(dim, idx))


def draw_index_add_(draw, pool):
    drawn = draw_index_source(draw, pool)
    if drawn is None or not is_writable(pool[drawn[0][0]]) or is_bool(pool[drawn[0][0]]):
        return None
    return drawn


def draw_masked_fill(draw, pool):
    i = pick(draw, pool, lambda t: is_writable(t) and is_numeric(t))
    if i is None:
        return None
    j = pick_partner(draw, pool, i, is_bool, into_first=True)
    return None if j is None else ((i, j), (draw_scalar(draw, pool[i]),))


def draw_where(draw, pool):
    c = pick(draw, pool, is_bool)
    if c is None:
        return None
    a = pick_partner(draw, pool, c, is_numeric)
    if a is None:
        return None
    b = pick_partner(draw, pool, a, is_numeric)
    return None if b is None or broadcasts(pool[c], pool[b]) is None else ((c, a, b), ())


def draw_mm(draw, pool):
    i = pick(draw, pool, lambda t: is_numeric(t) and t.dim() == 2)
    if i is None:
        return None
    a = pool[i]
    choices = [(j, False) for j, t in enumerate(pool) if t is not None and t.dim() == 2 and t.dtype == a.dtype and t.shape[0] == a.shape[1]]
    choices += [(j, True) for j, t in enumerate(pool) if t is not None and t.dim() == 2 and t.dtype == a.dtype and t.shape[1] == a.shape[1]]
    j, transpose = draw(st.sampled_from(choices))
    return (i, j), (transpose,)


def draw_bmm(draw, pool):
    i = pick(draw, pool, lambda t: is_numeric(t) and t.dim() == 3)
    return None if i is None else ((i,), ())


def draw_matmul(draw, pool):
    i = pick(draw, pool, is_numeric, min_dim=1)
    if i is None:
        return None
    a = pool[i]
    choices = [j for j, t in enumerate(pool) if t is not None and t.dim() >= 1 and t.dtype == a.dtype and t.shape[0 if t.dim() == 1 else -2] == a.shape[-1]]
    return None if not choices else ((i, draw(st.sampled_from(choices))), ())


def draw_cat(draw, pool):
    i = pick(draw, pool, is_any, min_dim=1)
    if i is None:
        return None
    a = pool[i]
    dim = draw_dim(draw, a)
    same_but_dim = [
        j for j, t in enumerate(pool)
        if t is not None and t.dtype == a.dtype and t.dim() == a.dim()
        and all(n == m for d, (n, m) in enumerate(zip(t.shape, a.shape)) if d != dim % a.dim())
    ]
    return (i, draw(st.sampled_from(same_but_dim))), (dim,)


def draw_stack(draw, pool):
    i = pick(draw, pool, is_any)
    if i is None:
        return None
    a = pool[i]
    same = [j for j, t in enumerate(pool) if t is not None and t.dtype == a.dtype and t.shape == a.shape]
    return (i, draw(st.sampled_from(same))), (draw(st.integers(-a.dim() - 1, a.dim())),)


def draw_topk(draw, pool):
    i = pick(draw, pool, is_numeric, min_dim=1)
    if i is None:
        return None
    dim = draw_dim(draw, pool[i])
    return (i,), (draw(st.integers(0, pool[i].shape[dim])), dim)


def draw_roll(draw, pool):
    i = pick(draw, pool, is_any, min_dim=1)
    return None if i is None else ((i,), (draw(st.integers(-3, 3)), draw_dim(draw, pool[i])))


def draw_equal(draw, pool):
    i = pick(draw, pool, is_any)
    if i is None:
        return None
    same = [j for j, t in enumerate(pool) if t is not None and t.shape == pool[i].shape and t.dtype == pool[i].dtype]
    return (i, draw(st.sampled_from(same))), ()


def draw_drop(draw, pool):
    i = pick(draw, pool, is_any)
    return None if i is None else ((i,), ())


def draw_nothing(draw, pool):
    return (), ()


def draw_view_then_inplace(draw, pool):
    """An in-place op through a fresh view: the write must show through the base and other views."""
    i = pick(draw, pool, lambda t: is_writable(t) and is_numeric(t) and 0 not in t.shape, min_dim=1)
    if i is None:
        return None
    t = pool[i]
    dim = draw_dim(draw, t)
    how = draw(st.sampled_from(["select", "narrow", "transpose", "diagonal"] if t.dim() >= 2 else ["select", "narrow"]))
    where = draw(st.integers(0, t.shape[dim] - 1))
    return (i,), (how, dim, where, draw(st.sampled_from(["add_", "mul_", "zero_", "fill_"])), draw_scalar(draw, t))


def run_view_then_inplace(t, how, dim, where, method, value):
    view = {
        "select": lambda: t.select(dim, where),
        "narrow": lambda: t.narrow(dim, where, t.shape[dim] - where),
        "transpose": lambda: t.transpose(dim, -1),
        "diagonal": lambda: t.diagonal(0, dim, -1),
    }[how]()
    getattr(view, method)(*(() if method == "zero_" else (value,)))


def mm(a, b, transpose):
    return torch.mm(a, b.t() if transpose else b)


def show(t):
    text = io.StringIO()
    print(t, file=text)  # builtin print is a sync point: the text must be eager's, in order
    return text.getvalue()


def sum_item(t):
    return (t.any() if is_bool(t) else t.sum()).item()


def where_positive(a, b):
    return torch.where(a > 0, a, b)


def positive_elements(t):
    return t[t > 0]  # boolean-mask indexing: the output shape depends on the data


# Two-level choice (category, then op) keeps every op about equally likely: a flat draw from a
# hundred names leaves some of them out of a whole run.
CATEGORIES: dict[str, dict[str, Op]] = {
    "unary": {
        name: Op(fn, unary())
        for name, fn in {
            "neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "log": torch.log, "sin": torch.sin,
            "tanh": torch.tanh, "sigmoid": torch.sigmoid, "relu": torch.relu, "sqrt": torch.sqrt,
            "reciprocal": torch.reciprocal, "floor": torch.floor, "round": torch.round, "sign": torch.sign,
            "erf": torch.erf, "square": torch.square,
        }.items()
    },
    "binary": {
        **{
            name: Op(fn, binary())
            for name, fn in {
                "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
                "maximum": torch.maximum, "minimum": torch.minimum, "atan2": torch.atan2,
                # Integer division by zero raises: divide by |b| + 1.
                "remainder": lambda a, b: torch.remainder(a, b.abs() + 1),
                "floor_divide": lambda a, b: torch.floor_divide(a, b.abs() + 1),
            }.items()
        },
        "bitwise_xor": Op(torch.bitwise_xor, binary(lambda t: not is_float(t))),
    },
    "scalar": {
        f"{name}_scalar": Op(fn, with_scalar())
        for name, fn in {"add": torch.add, "mul": torch.mul, "gt": torch.gt, "pow": torch.pow}.items()
    }
    | {"clamp": Op(lambda t, lo, hi: t.clamp(lo, hi), clamp_bounds())},
    "compare": {
        **{name: Op(fn, binary(is_any)) for name, fn in {
            "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge,
        }.items()},
        "logical_and": Op(torch.logical_and, binary(is_any)),
        "logical_not": Op(torch.logical_not, unary(is_any)),
    },
    "reduce": {
        **{name: Op(reduce(fn), reduction(pred)) for name, (fn, pred) in {
            "sum": (torch.sum, is_any), "amax": (torch.amax, is_numeric), "amin": (torch.amin, is_numeric),
            "prod": (torch.prod, is_numeric), "mean": (torch.mean, is_float), "std": (torch.std, is_float),
            "any": (torch.any, is_any), "all": (torch.all, is_any),
        }.items()},
        "argmax": Op(lambda t, dim, keepdim: t.argmax(dim, keepdim), reduction(lambda t: is_numeric(t) and t.numel() > 0)),
        "logsumexp": Op(lambda t, dim, keepdim: t.logsumexp(dim, keepdim), reduction(is_float, full=False)),
    },
    "along_dim": {
        "softmax": Op(lambda t, dim: t.softmax(dim), along_dim(is_float)),
        "log_softmax": Op(lambda t, dim: t.log_softmax(dim), along_dim(is_float)),
        "cumsum": Op(lambda t, dim: t.cumsum(dim), along_dim()),
        "sort": Op(lambda t, dim: t.sort(dim=dim, stable=True), along_dim()),
        "topk": Op(lambda t, k, dim: t.topk(k, dim), draw_topk),
        "flip": Op(lambda t, dim: t.flip(dim), along_dim(is_any)),
        "roll": Op(torch.roll, draw_roll),
        "tril": Op(torch.tril, unary(is_any, min_dim=2)),
    },
    "view": {
        "reshape": Op(torch.reshape, draw_reshape),
        "view_flat": Op(lambda t: t.view(-1), draw_view_flat),
        "transpose": Op(torch.transpose, draw_two_dims),
        "permute": Op(torch.permute, draw_permute),
        "t": Op(torch.t, unary(is_any, max_dim=2)),
        "slice": Op(lambda t, dim, start, stop, step: t[(slice(None),) * (dim % t.dim()) + (slice(start, stop, step),)], draw_slice),
        "select": Op(torch.select, draw_select),
        "narrow": Op(torch.narrow, draw_narrow),
        "expand": Op(lambda t, shape: t.expand(shape), draw_expand),
        "unsqueeze": Op(torch.unsqueeze, draw_unsqueeze),
        "squeeze": Op(torch.squeeze, draw_squeeze),
        "flatten": Op(torch.flatten, unary(is_any)),
        "diagonal": Op(lambda t, d0, d1: t.diagonal(0, d0, d1), draw_two_dims),
        "unbind": Op(lambda t, dim: t.unbind(dim), along_dim(is_any)),
        "chunk": Op(lambda t, n, dim: t.chunk(n, dim), draw_chunk),
    },
    "inplace": {
        **{name: Op(fn, binary(lambda t: t.dtype is torch.float32 and is_writable(t), is_numeric, into_first=True), "inplace")
           for name, fn in {"add_": torch.Tensor.add_, "sub_": torch.Tensor.sub_, "mul_": torch.Tensor.mul_, "copy_": torch.Tensor.copy_}.items()},
        **{name: Op(fn, unary(lambda t: is_float(t) and is_writable(t)), "inplace")
           for name, fn in {"neg_": torch.Tensor.neg_, "abs_": torch.Tensor.abs_, "relu_": torch.Tensor.relu_, "zero_": torch.Tensor.zero_, "exp_": torch.Tensor.exp_}.items()},
        "int_add_": Op(torch.Tensor.add_, binary(lambda t: is_int(t) and is_writable(t), lambda t: not is_float(t), into_first=True), "inplace"),
        "clamp_": Op(lambda t, lo, hi: t.clamp_(lo, hi), clamp_bounds(lambda t: is_numeric(t) and is_writable(t)), "inplace"),
        "fill_": Op(torch.Tensor.fill_, draw_fill_value, "inplace"),
        "masked_fill_": Op(torch.Tensor.masked_fill_, draw_masked_fill, "inplace"),
        "index_add_": Op(run_index_add_, draw_index_add_, "inplace"),
        "view_then_inplace": Op(run_view_then_inplace, draw_view_then_inplace, "inplace"),
    },
    "cast": {
        "to_float64": Op(lambda t: t.to(torch.float64), unary(is_any)),
        "to_float32": Op(lambda t: t.to(torch.float32), unary(is_any)),
        "to_int64": Op(lambda t: t.to(torch.int64), unary(lambda t: not is_float(t) or bool(t.isfinite().all()))),
        "to_bool": Op(lambda t: t.to(torch.bool), unary(is_any)),
        "contiguous": Op(torch.Tensor.contiguous, unary(is_any)),
    },
    "matmul": {
        "mm": Op(mm, draw_mm),
        "bmm": Op(lambda t: torch.bmm(t, t.transpose(1, 2)), draw_bmm),
        "matmul": Op(torch.matmul, draw_matmul),
    },
    "index": {
        "index_tensor": Op(lambda t, source, dim: t.movedim(dim, 0)[indices_from(source, t.shape[dim])], draw_index_source),
        "index_select": Op(lambda t, source, dim: t.index_select(dim, indices_from(source, t.shape[dim])), draw_index_source),
        "gather_sorted": Op(lambda t, dim: t.gather(dim, t.argsort(dim=dim, stable=True)), along_dim(is_numeric)),
        "positive_elements": Op(positive_elements, unary()),
        "nonzero": Op(torch.nonzero, unary(is_any)),
    },
    "combine": {
        "cat": Op(lambda a, b, dim: torch.cat([a, b], dim), draw_cat),
        "stack": Op(lambda a, b, dim: torch.stack([a, b], dim), draw_stack),
        "where": Op(torch.where, draw_where),
        "where_positive": Op(where_positive, binary()),
    },
    "random": {
        "rand_like": Op(torch.rand_like, unary(is_float)),
        "randint_like": Op(lambda t: torch.randint_like(t, 10), unary(is_int)),
        "dropout": Op(lambda t: F.dropout(t, 0.5, training=True), unary(is_float)),
        "uniform_": Op(torch.Tensor.uniform_, unary(lambda t: is_float(t) and is_writable(t)), "inplace"),
        "bernoulli_": Op(lambda t: t.bernoulli_(0.3), unary(lambda t: is_float(t) and is_writable(t)), "inplace"),
    },
    "observe": {
        "item": Op(sum_item, unary(is_any), "observe"),
        # Looked up at call time, as programs do: the sync hook lives on the class attribute.
        "tolist": Op(lambda t: t.tolist(), unary(is_any), "observe"),
        "numpy": Op(lambda t: t.numpy().tolist(), unary(is_any), "observe"),
        "print": Op(show, unary(is_any), "observe"),
        "bool": Op(lambda t: bool(t.any()), unary(is_any), "observe"),
        "equal": Op(torch.equal, draw_equal, "observe"),
        "sync": Op(ae.sync, draw_nothing, "observe"),
    },
    "drop": {"drop": Op(None, draw_drop, "drop")},
}
OPS: dict[str, Op] = {name: op for ops in CATEGORIES.values() for name, op in ops.items()}
COMPUTE_CATEGORIES = [c for c in CATEGORIES if c not in ("observe", "drop")]


def draw_op_name(draw, drop_values: bool) -> str:
    # Syncs are rarer than compute, so windows hold several ops; drops rarer still.
    roll = draw(st.integers(0, 11))
    if roll < 2:
        category = "observe"
    elif roll == 2 and drop_values:
        category = "drop"
    else:
        category = draw(st.sampled_from(COMPUTE_CATEGORIES))
    return draw(st.sampled_from(sorted(CATEGORIES[category])))


@st.composite
def programs(draw, drop_values: bool = False) -> Program:
    """A valid program: each step is drawn against the shapes the previous steps produced."""
    inputs = [draw(inputs_of(torch.float32)), draw(inputs_of(torch.int64))]
    inputs += draw(st.lists(st.sampled_from([torch.float32, torch.int64, torch.bool]).flatmap(inputs_of), max_size=3))
    pool = [x.make() for x in inputs]
    steps = []
    torch.default_generator.manual_seed(RNG_SEED)
    for _ in range(draw(st.integers(1, MAX_STEPS))):
        name = draw_op_name(draw, drop_values)
        drawn = OPS[name].draw(draw, pool)
        if drawn is None:
            continue
        operands, params = drawn
        before = len(pool)
        if not try_step(Step(name, operands, params), pool):
            continue
        if any(t is not None and t.numel() > MAX_NUMEL for t in pool[before:]):
            del pool[before:]
            continue
        steps.append(Step(name, operands, params, tuple(range(before, len(pool)))))
    return Program(tuple(inputs), tuple(steps))


def try_step(step: Step, pool: list) -> bool:
    try:
        execute(step, pool, [])
    except (RuntimeError, IndexError, ValueError, TypeError):
        return False  # eager rejects it (a dtype it cannot promote in place, an empty reduction...)
    return True


def inputs_of(dtype: torch.dtype):
    return st.builds(
        Input,
        st.just(dtype),
        st.lists(st.integers(1, 4), max_size=3).map(tuple),
        st.sampled_from(["contiguous", "transposed", "strided"]),
        st.integers(0, 2**16),
    )


# -------------------------------------------------------------------------------------------------
# Tests

DERANDOMIZED = settings(max_examples=600, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def test_every_op_can_be_generated():
    """An op whose every draw eager rejects would silently vanish from the programs."""
    accepted: set[str] = set()

    @settings(DERANDOMIZED, max_examples=40)
    @given(st.data())
    def try_every_op(data):
        inputs = [data.draw(inputs_of(dtype)) for dtype in (torch.float32, torch.int64, torch.bool, torch.float32)]
        for name, op in OPS.items():
            pool = [x.make() for x in inputs]
            drawn = op.draw(data.draw, pool)
            if drawn is not None and try_step(Step(name, *drawn), pool):
                accepted.add(name)

    try_every_op()
    assert len(OPS) >= 40
    assert accepted == set(OPS), f"never valid on fresh inputs: {sorted(set(OPS) - accepted)}"


@DERANDOMIZED
@given(programs())
def test_program_matches_eager(program):
    assert_lazy_matches_eager(program, **REPLAY)


@settings(DERANDOMIZED, max_examples=300)
@given(programs())
def test_program_matches_eager_with_tiny_window(program):
    """A 3-op cap flushes in the middle of chains: values cross window boundaries (a pending input
    of one window is the placeholder another window writes)."""
    assert_lazy_matches_eager(program, window=3, **REPLAY)


@settings(DERANDOMIZED, max_examples=300)
@given(programs(drop_values=True))
def test_program_with_dropped_values_matches_eager(program):
    """Dropped intermediates are dead unless a view or a later op still needs them."""
    assert_lazy_matches_eager(program, **REPLAY)


# Shrinking would compile every candidate: a failure reports the program as generated instead.
@settings(DERANDOMIZED, max_examples=12, phases=[Phase.explicit, Phase.generate])
@given(programs(drop_values=True))
def test_compiled_program_matches_eager(program):
    """Regions compiled by Inductor (about 2 s each on CPU, hence few examples): fused kernels must
    keep eager's strides, write-backs, aliasing and dead values."""
    assert_lazy_matches_eager(program, **COMPILED)


def test_dropped_values_are_eliminated():
    """The harness itself must not keep dropped tensors alive, or the variant above tests nothing."""
    program = Program(
        (Input(torch.float32, (3, 4), "contiguous", 0), Input(torch.int64, (2,), "contiguous", 1)),
        (Step("exp", (0,), (), (2,)), Step("sum", (2,), (None, False), (3,)), Step("drop", (2,)), Step("drop", (3,))),
    )
    ae.reset_metrics()
    pool, _ = run_program(program, lazy=True, **REPLAY)
    assert pool[2] is None and pool[3] is None
    assert ae.metrics()["ops_eliminated"] == 2


def _every_third_node(node):
    """A backend that cannot lower a fixed third of the nodes (by name, the same in every run)."""
    import zlib

    return "not_lowerable" if zlib.crc32(node.name.encode()) % 3 == 0 else None


@settings(DERANDOMIZED, max_examples=8, phases=[Phase.explicit, Phase.generate])
@given(programs(drop_values=True))
def test_split_program_matches_eager(program):
    """Regions cut into pieces around nodes that run alone (Note [Partitions] in fuser.partition):
    values that cross pieces (views among them), write-backs and dead values stay eager's. (With
    this seed, 5 of the first 6 programs were split: 6 nodes ran alone.)"""
    from fuser.backends import get_backend

    backend = get_backend("inductor", "cpu")
    backend.unsupported = _every_third_node
    try:
        assert_lazy_matches_eager(program, **COMPILED)
    finally:
        del backend.unsupported
