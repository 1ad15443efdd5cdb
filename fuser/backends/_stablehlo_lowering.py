"""The lowering the stablehlo and neuron backends share: an FX graph to StableHLO, and its output plan.

``fuser.backends.stablehlo`` compiles the text with XLA's CPU client, ``fuser.backends.neuron`` with
neuronx-cc; both call ``_lower`` (Note [StableHLO lowering]), plan the outputs with ``_output_plan``
(Note [Outputs that share storage]), narrow 64-bit types with ``_narrow`` (Note [64-bit types]) and
learn which ops run alone with ``_signature`` / ``_alone`` / ``_miscompiled`` (Note [Ops that run
alone]).

Note [StableHLO lowering]
~~~~~~~~~~~~~~~~~~~~~~~~~
``compile``: the graph is traced again with torch-mlir's decomposition table (what its own
``export_and_import`` applies: core ATen decompositions plus the few it needs, without those it
cannot lower; e.g. ``nll_loss_forward`` crashes its importer undecomposed, lowers decomposed) and
ours, for ops it has no lowering for (Note [Our decompositions] in ``_stablehlo_decompositions``), the
result imported by torch-mlir's ``FxImporter`` and lowered by the pipelines
``torch_mlir.fx.stateless_fx_import(..., output_type="stablehlo")`` runs (``_lower`` says why not
through that function), the module text compiled by ``get_backend("cpu").compile_and_load`` and
serialized with ``serialize_executable``. ``load`` is ``deserialize_executable``: no compile in a warm process.

StableHLO has value semantics: the executable takes and returns dense row-major arrays and knows
nothing of strides or views. The artifact therefore carries the calling convention the ``Backend``
contract asks for (Note [Outputs that share storage]); inputs cross as their contiguous values.

Note [Outputs that share storage]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Outputs that are views of one another in eager (``z[1:, ::2]`` and ``z.t()``) must share storage,
with eager's shape, stride and storage offset each. So the executable returns one result per
storage the outputs use: the value of the node that owns it (its root, ``z``: the first node of the
graph with that storage), and the callable rebuilds each output as ``as_strided`` of its root.
XLA returns row-major arrays. A root whose eager strides order its dimensions otherwise, densely (a
pointwise op keeps its input's layout: SDPA's math decomposition scales the transposed key, which
Llama's captured forward saves for the backward), is returned transposed into eager's memory order
(``_memory_order``): the row-major array is then eager's memory, and each output of the root is an
``as_strided`` view of it, a view and no launch, where a copy into eager's strides after the
executable was one more launch each. Only a root that is no permutation of a dense layout is copied
into eager's strides (``restrided``); a row-major root is the output itself. (A root that eager
lays out with gaps or at an offset, which no op of these graphs does, is refused.)

Note [64-bit types]
~~~~~~~~~~~~~~~~~~~
Neuron has no float64, and torch-neuronx runs int64 as int32. With ``narrow_64bit=True`` (the
neuron backend turns it on; off by default here, so CPU results keep eager's exact dtypes) the
region computes in 32 bits: after lowering, every f64 / i64 / ui64 type in the module (arguments,
results, block arguments of reduction bodies, constants) becomes f32 / i32 / ui32, integer constants
saturated (the init of an int64 max-reduction, INT64_MIN, becomes INT32_MIN, the same identity),
and the callable converts at the boundary: inputs to 32 bits before the call, outputs back to
eager's dtype after it. Values are then float32-accurate, and integers must fit in int32.

Note [Ops that run alone]
~~~~~~~~~~~~~~~~~~~~~~~~~
Whether torch-mlir lowers an op is learned by trying, and memoized per op signature (op, the dtypes
and ranks of its tensors, its other arguments; float values and sizes left out, so AdamW's lr and a
model's many shapes do not each cost a lowering). The fuser asks ``unsupported(node)`` about every
node of a region before compiling it; the first node of unknown signature makes the backend lower
the node's whole graph, as ``compile`` would (StableHLO only, no XLA compile). If that succeeds,
every op in it is known to lower and ``compile``, called next with the same graph, reuses the
lowering: a region costs one lowering, as without the question. If it fails, each op of unknown
signature is lowered alone (its inputs, the node, its tensor outputs: ~30-80 ms each), and one that
fails is "not_lowerable": the fuser runs it alone, between compiled pieces, and counts it (Note
[Partitions] in ``fuser.partition``). A region that fails to lower although each of its ops lowered
alone fails in ``compile``, which then lowers each op alone at its own sizes (whether an op lowers
can depend on them: ``isin`` decomposes to ``searchsorted`` only against many test elements) and names the
first that fails as the error's ``target``: the fuser compiles the region again with that op run
alone ("compile_failed"). With no such op, the region is replayed.

Some ops lower without complaint to code that computes other values than eager; the OpInfo sweep
in tests/test_stablehlo.py finds them, and ``_MISCOMPILED`` lists them ("miscompiled": also run
alone, counted; ``compile`` refuses a graph holding one).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable

import torch
from torch.fx.node import map_arg

from ._common import BackendCompileError, fake_values, op_name, output_nodes

# Note [64-bit types]: eager dtype -> the dtype the region computes in
_NARROW = {torch.float64: torch.float32, torch.int64: torch.int32, torch.uint64: torch.uint32}
_NARROW_MLIR = {"f64": "f32", "i64": "i32", "si64": "si32", "ui64": "ui32"}
_INT32_RANGE = {"i32": (-(2**31), 2**31 - 1), "si32": (-(2**31), 2**31 - 1), "ui32": (0, 2**32 - 1)}

# Note [Ops that run alone]: ops torch-mlir 20261001 lowers to code that computes other values than
# eager (found by the OpInfo sweep in tests/test_stablehlo.py): op -> (for which calls, None: all; why)
_MISCOMPILED = {
    "aten.remainder.Scalar": (None, "C's fmod sign, not Python's: remainder(-1.5, 1.0) gives -0.5, eager 0.5"),
    "aten.remainder.Tensor": (None, "C's fmod sign, not Python's: remainder(-1.5, 1.0) gives -0.5, eager 0.5"),
    "aten.logcumsumexp.default": (None, "exp overflows: logcumsumexp of [100.0] gives inf"),
    "aten.take.default": (None, "negative indices are not wrapped"),
    # an index out of range is clamped (XLA's gather and scatter) and these have no bounds check of
    # their own yet (Note [Checked indices]): run alone, eager raises at the user's line
    "aten.take_along_dim.default": (None, "an index out of range is clamped (XLA's gather), where eager raises"),
    # found with more OpInfo samples (AE_TEST_OPINFO_SAMPLES=12): torch-mlir's var of no elements
    **dict.fromkeys([f"aten.{op}" for op in (
        "var.correction", "var.dim", "var.default", "std.correction", "std.dim", "std.default",
        "var_mean.correction", "var_mean.dim", "var_mean.default", "std_mean.correction", "std_mean.dim",
        "std_mean.default",
    )], (lambda node: _empty_input(node), "over no elements it gives -0.0, eager NaN")),
    "aten.avg_pool3d.default": (lambda node: node.kwargs.get("divisor_override", (node.args + (None,) * 7)[6])
                                is not None, "divisor_override is not applied"),
}


def _empty_input(node: torch.fx.Node) -> bool:
    first = node.args[0] if node.args else None
    value = first.meta.get("val") if isinstance(first, torch.fx.Node) else None
    return isinstance(value, torch.Tensor) and value.numel() == 0


def _miscompiled(node: torch.fx.Node) -> str | None:
    """Why torch-mlir lowers ``node`` to wrong values, or None (``_MISCOMPILED``)."""
    entry = _MISCOMPILED.get(op_name(node.target)) if node.op == "call_function" else None
    if entry is None or (entry[0] is not None and not entry[0](node)):
        return None
    return entry[1]


@functools.cache
def _decompositions(narrow_64bit: bool) -> dict:
    """torch-mlir's table and ours (Note [Our decompositions] in ``_stablehlo_decompositions``)."""
    from torch_mlir.extras.fx_decomp_util import get_decomposition_table

    from ._stablehlo_decompositions import decompositions

    theirs = get_decomposition_table()
    return {**theirs, **decompositions(narrow_64bit, theirs)}


# torch-mlir's pipelines, as ``torch_mlir.fx.stateless_fx_import(..., output_type="stablehlo")`` runs them
_PIPELINES = (
    "builtin.module(func.func(torch-match-quantized-custom-ops), torchdynamo-export-to-torch-backend-pipeline)",
    "builtin.module(torch-backend-to-stablehlo-backend-pipeline{allow-non-finites=True})",
)


# Note [Lowerings that crash]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch-mlir (20261001) does not reject some graphs: its passes crash the process (SIGSEGV), which
# no ``except`` can catch, so a program would die where eager runs. Seen: an op over dimensions of a
# 0-dim tensor (``var``, ``std``, ``logsumexp``, ``argmax``, ``var_mean``, ``_softmax``,
# ``cumsum``; ``sum``, ``mean``, ``amax``, ``prod`` lower). Such graphs are refused before the
# passes run: a reduction (``Tag.reduction``) or an op taking a ``dim`` whose first tensor argument
# has no dimension (harmless ones included). The whole region is checked after decomposition, so a
# composite that decomposes into one is caught too; the common ones never get here: they are traced
# over a 1-element vector instead (Note [Reductions over a 0-dim tensor] in _stablehlo_decompositions).


def _crashes_torch_mlir(graph: torch.fx.Graph) -> str | None:
    """The op of ``graph`` that torch-mlir would crash on (Note [Lowerings that crash]), or None."""
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        first = next((a for a in node.args if isinstance(a, torch.fx.Node)), None)
        value = first.meta.get("val") if first is not None else None
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            continue
        if torch.Tag.reduction in target.tags or any(a.name == "dim" for a in target._schema.arguments):
            return f"{target} over a 0-dim tensor"
    return None


# Note [Slice bounds]
# ~~~~~~~~~~~~~~~~~~
# Python's ``x[..., k:]`` reaches ATen as ``slice(x, -1, k, 9223372036854775807)`` (INT64_MAX: "to
# the end"), and autograd's ``slice_backward`` decomposes to ``slice_scatter`` with the same end
# (Llama's ``rotate_half``). torch-mlir (20261001) does not clamp such a bound when it lowers
# ``slice_scatter``: it allocated ~20 GB over 58 s and failed with ``std::bad_alloc`` on Llama's
# backward, where the clamped end lowers in 1.5-3 s. ATen clamps every bound to the dimension
# (a negative one counted from the end, then into [0, size], the end no less than the start), so
# the decomposed graph's slices get the bounds ATen uses, as plain ints, before the import.
_SLICES = {torch.ops.aten.slice.Tensor: (1, 2, 3), torch.ops.aten.slice_scatter.default: (2, 3, 4)}


def _clamp_slices(graph: torch.fx.Graph) -> None:
    """Every slice bound of ``graph`` as ATen clamps it to its dimension (Note [Slice bounds])."""
    for node in graph.nodes:
        places = _SLICES.get(node.target) if node.op == "call_function" else None
        if places is None:
            continue
        names = ("dim", "start", "end")
        args = list(node.args) + [None] * (places[2] + 1 - len(node.args))
        for name, place in zip(names, places):
            if name in node.kwargs:
                args[place] = node.kwargs[name]
        dim, start, end = (args[p] for p in places)
        base = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        if not isinstance(base, torch.Tensor) or base.dim() == 0:
            continue
        size = base.shape[(0 if dim is None else dim) % base.dim()]
        if not isinstance(size, int) or not all(b is None or isinstance(b, int) for b in (start, end)):
            continue  # a symbolic size or bound: nothing to clamp at compile time

        def clamp(bound, default):
            bound = default if bound is None else bound
            return min(max(bound + size if bound < 0 else bound, 0), size)

        start = clamp(start, 0)
        args[places[0]] = 0 if dim is None else dim
        args[places[1]], args[places[2]] = start, max(clamp(end, size), start)
        node.args = tuple(args)
        node.kwargs = {k: v for k, v in node.kwargs.items() if k not in names}


def _lower(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor], narrow_64bit: bool) -> str:
    """StableHLO text of ``gm`` (Note [StableHLO lowering]); BackendCompileError if it does not lower.

    The pipelines run here rather than through ``stateless_fx_import``, whose error path swaps
    ``sys.stderr`` for the whole process while it runs (output of the program's other threads would
    vanish) and writes a repro file to /tmp; a diagnostic handler of our own context keeps MLIR's
    errors for the message instead of printing them."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch_mlir import ir
    from torch_mlir.dialects import torch as torch_dialect
    from torch_mlir.extras.fx_importer import FxImporter
    from torch_mlir.passmanager import PassManager

    try:
        with torch.no_grad():
            decomposed = make_fx(gm, decomposition_table=_decompositions(narrow_64bit), tracing_mode="fake")(*example_inputs)
    except Exception as e:
        raise BackendCompileError(f"stablehlo: cannot decompose the graph: {type(e).__name__}: {str(e)[:800]}") from e
    for node in decomposed.graph.nodes:
        # StableHLO has no devices, and torch-mlir legalizes factories only for the ones it knows: a
        # decomposition's ``scalar_tensor(0, device=neuron)`` (threshold_backward's) left every
        # ReLU backward on the neuron device to run alone. The region's device is the caller's.
        device = node.kwargs.get("device") if node.op == "call_function" else None
        if isinstance(device, torch.device) and device.type not in ("cpu", "cuda"):
            node.kwargs = {**node.kwargs, "device": torch.device("cpu")}
    _clamp_slices(decomposed.graph)
    crash = _crashes_torch_mlir(decomposed.graph)
    if crash is not None:
        raise BackendCompileError(f"stablehlo: torch-mlir would crash lowering {crash} (Note [Lowerings that crash])")
    context = ir.Context()
    torch_dialect.register_dialect(context)
    errors: list[str] = []
    context.attach_diagnostic_handler(lambda d: errors.append(str(d.message)) or True)
    try:
        importer = FxImporter(context=context, hooks=_dense_literals())
        importer.import_stateless_graph(decomposed.graph, func_name="main")
        module = importer.module
        with context:
            context.emit_error_diagnostics = True
            for pipeline in _PIPELINES:
                PassManager.parse(pipeline).run(module.operation)
            if narrow_64bit:
                _narrow(module)
            return str(module)
    except BackendCompileError:
        raise
    except Exception as e:
        reason = errors[0] if errors else f"{type(e).__name__}: {e}"
        raise BackendCompileError(f"stablehlo: torch-mlir cannot lower the graph: {reason[:800]}") from e


@functools.cache
def _dense_literals():
    """Importer hooks that inline tensor constants (decompositions make some: group_norm's) as dense
    elements: torch-mlir's default, a ``dense_resource`` blob, is refused by XLA ("Only dense
    elements attr are supported")."""
    import numpy as np
    from torch_mlir.extras.fx_importer import (
        TORCH_DTYPE_TO_NPY_TYPE, FxImporterHooks, create_mlir_tensor_type,
    )
    from torch_mlir.ir import DenseElementsAttr, Operation

    class DenseLiterals(FxImporterHooks):
        def resolve_literal(self, gni, literal, info):
            if not isinstance(literal, torch.Tensor) or literal.numel() <= 1:
                return None  # one element: torch-mlir makes a dense splat itself
            array = np.array(literal.tolist()).astype(TORCH_DTYPE_TO_NPY_TYPE[literal.dtype])
            attr = DenseElementsAttr.get(np.ascontiguousarray(array), type=create_mlir_tensor_type(literal))
            return Operation.create("torch.vtensor.literal", results=[gni._cc.tensor_to_vtensor_type(literal)],
                                    attributes={"value": attr}).result

    return DenseLiterals()


# Note [Checked indices]
# ~~~~~~~~~~~~~~~~~~~~~~
# XLA's gather and scatter clamp an index out of range (``x[tensor([1, 10])]`` of 5 values gives
# ``x[1] + x[4]``) where eager raises (``IndexError: index 10 is out of bounds``), and XLA divides
# integers by zero where eager raises ZeroDivisionError. So the lowered region computes, besides its
# results, one boolean: whether any value an op reads is one its eager kernel refuses
# (``_INDEX_CHECKS``: an index out of the indexed dimension's size, from ``-n`` where eager counts
# a negative index from the end, else from 0; a class target of ``nll_loss`` out of ``[0, C)``,
# not ``ignore_index``; an integer divisor of 0), the OR of each op's test. It is the executable's
# last result (the header's ``bounds``), and the callable reads it before anything else (``caller``
# in ``stablehlo``): set, it raises ``EagerWouldRaise`` and stores nothing into the inputs; its
# caller runs the region's ops eagerly (a window's replay, a captured graph's op-by-op run), and
# eager's kernel raises its own error, at the op, with the program's state as eager leaves it.
# Nothing is stored first because that eager run reads the region's inputs as they were: a
# parameter or optimizer state the failed run had written would be read updated, and updated twice.
# (The neuron backend, whose NEFF writes inputs as it runs, compiles such regions with write-backs
# instead: ``stores_after_run`` is False, Note [In-place regions] in fuser.compilable.)
# Where eager counts a negative index from the end (``index``, ``index_put``, ``index_fill``), the
# lowered op gets ``where(i < 0, i + n, i)``: XLA's gather would clamp it to 0. The test costs a
# compare and a reduction per index (a few hundred token ids), and one byte read back per run.
# Not caught: an int64 index beyond int32 where the region computes in 32 bits (Note [64-bit
# types], neuron only): it is narrowed, wrapping, before the test.
def _size(t: torch.Tensor, dim) -> int | None:
    """The size of ``t``'s dimension ``dim`` (a 0-dim tensor has one of size 1); None where unknown."""
    if type(dim) is not int or not isinstance(t, torch.Tensor):
        return None
    n = t.dim()
    if n == 0:
        return 1 if dim in (0, -1) else None
    dim = dim + n if dim < 0 else dim
    size = t.shape[dim] if 0 <= dim < n else None
    return size if type(size) is int else None


def _arg(target, args, kwargs, name: str):
    """(value, where) of argument ``name`` of a call of ``target``: where is its position or name."""
    names = [a.name for a in target._schema.arguments]
    pos = names.index(name)
    if pos < len(args):
        return args[pos], pos
    return kwargs.get(name, target._schema.arguments[pos].default_value), name


def _indices_check(target, args, kwargs):
    """``index``, ``index_put``: a list of indices over ``self``'s leading dimensions."""
    self, _ = _arg(target, args, kwargs, "self")
    indices, where = _arg(target, args, kwargs, "indices")
    checks, d = [], 0
    for k, t in enumerate(indices):
        if not isinstance(t, torch.Tensor):
            d += 1
            continue
        if t.dtype in (torch.bool, torch.uint8):  # a mask: its shape is its metadata
            d += t.dim()
            continue
        n = _size(self, d) if self.dim() > d else None
        d += 1
        if n is not None:
            checks.append((t, -n, n, None, (where, k)))
    return checks


def _dim_check(wraps: bool):
    def check(target, args, kwargs):
        """An index along ``dim`` of ``self``: ``index_select``, ``gather``, ``scatter``..."""
        self, _ = _arg(target, args, kwargs, "self")
        dim, _ = _arg(target, args, kwargs, "dim")
        index, where = _arg(target, args, kwargs, "index")
        n = _size(self, dim)
        return [] if n is None else [(index, -n if wraps else 0, n, None, (where, None) if wraps else None)]
    return check


def _embedding_check(target, args, kwargs):
    weight, _ = _arg(target, args, kwargs, "weight")
    indices, _ = _arg(target, args, kwargs, "indices")
    n = _size(weight, 0) if weight.dim() else None
    return [] if n is None else [(indices, 0, n, None, None)]


def _target_check(target, args, kwargs):
    """``nll_loss``: class ids in ``[0, C)``, or ``ignore_index``."""
    self, _ = _arg(target, args, kwargs, "self")
    labels, _ = _arg(target, args, kwargs, "target")
    ignore, _ = _arg(target, args, kwargs, "ignore_index")
    n = _size(self, 1 if self.dim() >= 2 else 0)
    return [] if n is None else [(labels, 0, n, ignore if type(ignore) is int else None, None)]


def _divisor_check(target, args, kwargs):
    """Integer ``floor_divide``, ``fmod``, ``div`` with a rounding mode: no zero divisor (eager
    raises ZeroDivisionError; XLA divides)."""
    names = [a.name for a in target._schema.arguments]
    if "other" not in names or (target._overloadpacket.__name__.startswith("div")
                                and ("rounding_mode" not in names or _arg(target, args, kwargs, "rounding_mode")[0] is None)):
        return []  # true division: a float result, no error
    self, _ = _arg(target, args, kwargs, "self")
    other, _ = _arg(target, args, kwargs, "other")
    if isinstance(self, torch.Tensor) and self.dtype not in _INT_INDEX or type(self) is float:
        return []
    return [(other, None, None, None, None)]


# overload packet -> its check (Note [Checked indices]); each gives, per index it reads: (the
# index, its least and its bound, an allowed value, where to put it wrapped or None); a divisor
# has no bounds: zero is its one bad value
_INDEX_CHECKS = {
    **dict.fromkeys(("index", "index_put", "index_put_", "_index_put_impl", "_index_put_impl_"), _indices_check),
    **dict.fromkeys(("index_select", "gather", "index_add", "index_add_", "index_copy", "index_copy_", "index_reduce",
                     "index_reduce_", "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce",
                     "scatter_reduce_"), _dim_check(False)),
    **dict.fromkeys(("index_fill", "index_fill_"), _dim_check(True)),  # eager counts a negative index from the end
    "embedding": _embedding_check,
    **dict.fromkeys(("floor_divide", "floor_divide_", "fmod", "fmod_", "div", "div_"), _divisor_check),
    # not their backward: autograd refuses a saved target changed since the forward read it
    **dict.fromkeys(("nll_loss_forward", "nll_loss2d_forward"), _target_check),
}
_INT_INDEX = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32,
                        torch.uint64})


def _index_check(node: torch.fx.Node):
    """The check of ``node``'s indices (Note [Checked indices]), or None."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    return _INDEX_CHECKS.get(node.target._overloadpacket.__name__)


class _Checked(torch.fx.Interpreter):
    """Runs a graph for tracing, adding the bounds test of each index (Note [Checked indices]) to
    ``out_of_range`` and wrapping the negative indices eager counts from the end."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__(gm, garbage_collect_values=False)
        self.out_of_range = None

    def call_function(self, target, args, kwargs):
        check = _INDEX_CHECKS.get(target._overloadpacket.__name__) if isinstance(target, torch._ops.OpOverload) else None
        if check is not None:
            args, kwargs = list(args), dict(kwargs)
            for index, lo, hi, allowed, wrap in check(target, args, kwargs):
                if not isinstance(index, torch.Tensor) or index.dtype not in _INT_INDEX or index.numel() == 0:
                    continue
                bad = index == 0 if lo is None else (index < lo) | (index >= hi)
                if allowed is not None:
                    bad = bad & (index != allowed)
                bad = bad.any()
                self.out_of_range = bad if self.out_of_range is None else self.out_of_range | bad
                if wrap is not None:
                    wrapped = torch.where(index < 0, index + hi, index)
                    where, k = wrap
                    box = args if type(where) is int else kwargs
                    if k is None:
                        box[where] = wrapped
                    else:
                        box[where] = [*box[where][:k], wrapped, *box[where][k + 1:]]
        return super().call_function(target, tuple(args), kwargs)


def _checks_indices(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` holds an op whose indices the lowered region checks (Note [Checked indices])."""
    return any(_index_check(n) is not None for n in gm.graph.nodes)


# the executable's last result, when it checks indices (Note [Checked indices])
OUT_OF_RANGE = {"shape": [], "dtype": "bool", "wire": "bool", "stride": None}


def _returning(gm: torch.fx.GraphModule, nodes: list[tuple[torch.fx.Node, list[int] | None]],
               checked: bool = False) -> Callable:
    """A function computing ``gm``'s values of ``nodes`` (the storage roots, each with the order of
    its dimensions in eager's memory where that is not row-major: Note [Outputs that share
    storage]), for tracing; with ``checked``, and whether an index was out of range (Note [Checked
    indices])."""

    def roots(*inputs):
        interpreter = _Checked(gm) if checked else torch.fx.Interpreter(gm, garbage_collect_values=False)
        interpreter.run(*inputs)
        values = tuple(interpreter.env[n] if order is None else interpreter.env[n].permute(order)
                       for n, order in nodes)
        if checked:
            flag = interpreter.out_of_range
            values += (torch.zeros((), dtype=torch.bool) if flag is None else flag,)
        return values

    return roots


def _output_plan(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor], narrow_64bit: bool) -> tuple[list, list, list]:
    """Note [Outputs that share storage]: the root nodes the executable returns, each with the order
    it returns its dimensions in (None: as they are); per result its shape as returned and eager's
    strides where it copies them (else None); per output, where its storage comes from (a result, or
    an input: a piece of a split region may return a view of its input) and, for a view, the view's
    (shape, stride, storage offset; relative to the input's for an input)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    values = fake_values("stablehlo", gm, example_inputs)
    owner: dict = {}
    for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        owner.setdefault(StorageWeakRef(values[node].untyped_storage()), i)
    for node in gm.graph.nodes:
        v = values.get(node)
        if node.op == "call_function" and isinstance(v, torch.Tensor):
            owner.setdefault(StorageWeakRef(v.untyped_storage()), node)
    roots: list[torch.fx.Node] = []
    orders: list[list[int] | None] = []
    results: list[dict] = []
    outputs: list[list] = []
    for i, node in enumerate(output_nodes("stablehlo", gm)):
        v = values[node]
        if not isinstance(v, torch.Tensor):
            raise BackendCompileError(f"stablehlo: graph output {i} is a {type(v).__name__}, not a tensor")
        root = owner[StorageWeakRef(v.untyped_storage())]
        if type(root) is int:  # a view of input ``root``
            base = example_inputs[root].storage_offset()
            outputs.append(["input", root, [list(v.shape), list(v.stride()), v.storage_offset() - base]])
            continue
        if root not in roots:
            roots.append(root)
            r = values[root]
            if r.storage_offset() or r.untyped_storage().nbytes() != _extent(r) * r.element_size():
                raise BackendCompileError(f"stablehlo: graph output {i} is a view of a storage that "
                                          f"{op_name(root.target)} (node {root.name}) lays out with gaps")
            row_major = r.stride() == _row_major(r.shape)
            order = None if row_major else _memory_order(r)
            orders.append(order)
            results.append({
                "shape": list(r.shape) if order is None else [r.shape[d] for d in order],
                "dtype": _dtype_name(r.dtype),
                "wire": _wire(r.dtype, narrow_64bit)[1],
                # eager's strides of the root, where the result is copied into them
                "stride": None if row_major or order is not None else list(r.stride()),
            })
        k = roots.index(root)
        view = (None if v is values[root] and orders[k] is None
                else [list(v.shape), list(v.stride()), v.storage_offset()])
        outputs.append(["result", k, view])
    return list(zip(roots, orders)), results, outputs


# Note [Regions that write their inputs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A region whose program writes real inputs (parameters, optimizer state, buffers) reaches the
# backend with functionalization's trailing ``copy_`` into those placeholders when the backend says
# it writes inputs itself (``writes_inputs``, Note [In-place regions] in fuser.compilable); else the
# fuser copies each new value back, one launch per tensor (600 for AdamW over 200 parameters).
# StableHLO has value semantics, so ``_functional`` turns the write-backs into results, after the
# graph's outputs, and the artifact's ``writes`` names the input each one belongs to; the callable
# (``caller``) stores them into those inputs once the executable has finished, so a run that fails
# writes nothing (the executable computes into fresh buffers and reads the inputs until it ends).
# The stores are part of the region's launch: on XLA's CPU client a host copy into the input's memory
# (jaxlib cannot write a DLPack-imported buffer in place: donating it is refused); on Neuron the
# NEFF writes the input itself (Note [Aliased outputs] in fuser.backends.neuron).
_copy_ = torch.ops.aten.copy_.default


def _write_back(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a write-back into an input (Note [Regions that write their inputs])."""
    return node.op == "call_function" and node.target is _copy_ and node.args[0].op == "placeholder"


def _functional(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[int]]:
    """``gm`` with its write-backs returned after its outputs instead, and the index of the input
    each one writes (Note [Regions that write their inputs]); ``gm`` itself when it writes none."""
    writes = [n for n in gm.graph.nodes if _write_back(n)]
    if not writes:
        return gm, []
    index = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    for n in writes:
        dst, src = n.args[:2]
        if (n.users or len(n.args) > 2 or n.kwargs or not isinstance(src, torch.fx.Node)
                or not _same_value_type(dst, src)):
            error = BackendCompileError(f"stablehlo: {n.name} is not a write-back of a whole input")
            error.inplace = True  # the fuser writes back instead
            raise error
    val_map: dict = {}
    graph = torch.fx.Graph()
    outputs = graph.graph_copy(gm.graph, val_map)
    for n in writes:
        graph.erase_node(val_map[n])
    graph.output((*outputs, *(val_map[n.args[1]] for n in writes)))
    return torch.fx.GraphModule(gm, graph), [index[n.args[0]] for n in writes]


def _aliases(results: list[dict], outputs: list[list], writes: list[int], example_inputs: list[torch.Tensor],
             narrow_64bit: bool) -> dict[int, int]:
    """Which written inputs can be the memory of their new value's result (input index -> result
    index, Note [Aliased outputs] in fuser.backends.neuron): the new value is a whole result that
    no other output uses, computed in the input's own dtype and layout (contiguous, row-major)."""
    n_out = len(outputs) - len(writes)
    uses: dict[int, int] = {}
    for kind, k, _ in outputs:
        if kind == "result":
            uses[k] = uses.get(k, 0) + 1
    aliases = {}
    for slot, (kind, k, view) in zip(writes, outputs[n_out:]):
        t = example_inputs[slot]
        r = results[k] if kind == "result" else None
        if (r is not None and view is None and uses[k] == 1 and r["stride"] is None and r["wire"] == r["dtype"]
                and t.is_contiguous() and _wire(t.dtype, narrow_64bit)[1] == _dtype_name(t.dtype)):
            aliases[slot] = k
    return aliases


def _declare_aliases(text: str, aliases: dict[int, int]) -> str:
    """``text`` with each argument of ``aliases`` marked ``tf.aliasing_output`` (its memory is the
    given result's, as jax marks a donated argument)."""
    start = text.index("func.func @main(") + len("func.func @main(")
    depth, args, begin = 0, [], start
    for i in range(start, len(text)):
        c = text[i]
        if c in "(<[{":
            depth += 1
        elif c in ")>]}" and depth:
            depth -= 1
        elif c == ")" or (c == "," and depth == 0):
            args.append((begin, i))
            begin = i + 1
            if c == ")":
                break
    pieces, last = [], 0
    for index, (a, b) in enumerate(args):
        if index in aliases:
            if "{" in text[a:b]:
                raise BackendCompileError(f"stablehlo: argument {index} of the module has attributes already")
            pieces += [text[last:b], f" {{tf.aliasing_output = {aliases[index]} : i32}}"]
            last = b
    return "".join(pieces) + text[last:]


def _same_value_type(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape
            and va.dtype == vb.dtype)


def _row_major(shape) -> tuple[int, ...]:
    """The strides of the tensor DLPack makes of a row-major XLA result (torch's contiguous strides)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _memory_order(t: torch.Tensor) -> list[int] | None:
    """The order of ``t``'s dimensions in its memory, outermost first, where its strides are the
    row-major ones of its shape so permuted (Note [Outputs that share storage]); else None. Sizes of
    1 are left out of the comparison: their strides address nothing."""
    if t.numel() == 0:
        return None
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    shape = [t.shape[d] for d in order]
    permuted = [t.stride(d) for d in order]
    if any(size != 1 and stride != expected for size, stride, expected in zip(shape, permuted, _row_major(shape))):
        return None
    return order


def _extent(t: torch.Tensor) -> int:
    """Elements of storage ``torch.empty_strided`` allocates for ``t``'s shape and strides."""
    return 0 if t.numel() == 0 else 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def _narrow(module) -> None:
    """Note [64-bit types]: rewrite every 64-bit type of the lowered module to 32 bits, in place."""
    import numpy as np
    from torch_mlir import ir

    def narrowed(t):
        if isinstance(t, ir.RankedTensorType):
            element = _NARROW_MLIR.get(str(t.element_type))
            return None if element is None else ir.RankedTensorType.get(t.shape, ir.Type.parse(element))
        element = _NARROW_MLIR.get(str(t))
        return None if element is None else ir.Type.parse(element)

    def constant(attr, new_type):
        values = np.array([attr.get_splat_value().value]) if attr.is_splat else np.array(attr)
        element = str(new_type.element_type)
        if element == "f32":
            with np.errstate(over="ignore"):  # beyond float32's range: inf, as a float64 -> float32 cast gives
                values = values.astype(np.float32)
        else:
            low, high = _INT32_RANGE[element]
            values = np.clip(values.astype(object), low, high).astype(np.uint32 if element == "ui32" else np.int32)
        # a one-element buffer makes a splat of the type's shape
        return ir.DenseElementsAttr.get(np.ascontiguousarray(values), type=new_type)

    def walk(op) -> None:
        for region in op.regions:
            for block in region.blocks:
                for arg in block.arguments:
                    new = narrowed(arg.type)
                    if new is not None:
                        arg.set_type(new)
                for inner in block.operations:
                    walk(inner)
        if op.name in ("stablehlo.constant", "arith.constant"):
            new = narrowed(op.results[0].type)
            if new is not None:
                op.attributes["value"] = constant(op.attributes["value"], new)
        for result in op.results:
            new = narrowed(result.type)
            if new is not None:
                result.set_type(new)

    with module.context, ir.Location.unknown():
        for func in module.body.operations:
            walk(func.operation)
            if func.operation.name != "func.func":
                continue
            block = func.regions[0].blocks[0]
            returned = [v.type for v in list(block.operations)[-1].operands]
            func.attributes["function_type"] = ir.TypeAttr.get(
                ir.FunctionType.get([a.type for a in block.arguments], returned))
        if not module.operation.verify():
            raise BackendCompileError("stablehlo: the module does not verify after narrowing 64-bit types")


def _wire(dtype: torch.dtype, narrow_64bit: bool) -> list[str]:
    """[eager dtype, the dtype the executable takes or returns] (Note [64-bit types])."""
    return [_dtype_name(dtype), _dtype_name(_NARROW.get(dtype, dtype) if narrow_64bit else dtype)]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise BackendCompileError(f"stablehlo: artifact names an unknown dtype {name!r}")
    return dtype


# ------------------------------------------------------------------------------- ops that run alone


def _signature(node: torch.fx.Node) -> tuple:
    """What decides whether a node lowers (Note [Ops that run alone])."""

    def sig(a):
        if isinstance(a, torch.fx.Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                return ("tensor", v.dtype, v.dim(), 0 in v.shape)
            return ("node", type(v).__name__)
        if isinstance(a, (list, tuple)):
            return tuple(sig(x) for x in a)
        if isinstance(a, float):
            return float
        return a

    return (node.target, sig(node.args), tuple((k, sig(v)) for k, v in node.kwargs.items()))


def _example(v: torch.Tensor) -> torch.Tensor:
    # on the graph's device: its factories name it (``zeros(..., device=neuron)``)
    return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=v.device)


def _examples(gm: torch.fx.GraphModule) -> list[torch.Tensor] | None:
    """Example inputs for ``gm`` made from its placeholders' metadata; None where one has none."""
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return None
    return [_example(v) for v in vals]


def _input_key(example_inputs: list[torch.Tensor]) -> tuple:
    return tuple((tuple(t.shape), t.stride(), t.dtype) for t in example_inputs)


def _alone(node: torch.fx.Node) -> tuple[torch.fx.GraphModule, list[torch.Tensor]] | None:
    """A graph holding ``node`` alone (its tensor inputs as placeholders) and example inputs for it."""
    graph = torch.fx.Graph()
    inputs: dict[torch.fx.Node, torch.fx.Node] = {}
    examples: list[torch.Tensor] = []

    def placeholder(n: torch.fx.Node) -> torch.fx.Node:
        if n not in inputs:
            v = n.meta.get("val")
            if not isinstance(v, torch.Tensor):
                raise LookupError(n.name)
            inputs[n] = graph.placeholder(f"in{len(inputs)}")
            inputs[n].meta["val"] = v
            examples.append(_example(v))
        return inputs[n]

    value = node.meta.get("val")
    try:
        call = graph.call_function(node.target, map_arg(node.args, placeholder), map_arg(node.kwargs, placeholder))
    except LookupError:
        return None
    if isinstance(value, torch.Tensor):
        results = [call]
    elif isinstance(value, (tuple, list)):
        results = [graph.call_function(operator.getitem, (call, i)) for i, v in enumerate(value)
                   if isinstance(v, torch.Tensor)]
    else:
        return None
    if not results:
        return None
    graph.output(tuple(results))
    return torch.fx.GraphModule(torch.nn.Module(), graph), examples
