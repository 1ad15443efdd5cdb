"""The stablehlo backend: a region lowered to StableHLO by torch-mlir, compiled by XLA's CPU client.

This is the lowering the Trainium path uses (torch-neuronx builds on the same ``torch_mlir.fx``
importer, and StableHLO is what it hands to ``neuronx-cc``); where no Neuron compiler exists, XLA's
CPU client from ``jaxlib`` compiles the StableHLO instead, so the lowering runs and is tested on any
machine. It is a test vehicle, not a fast CPU backend: a call on tiny inputs costs ~60 us (DLPack
in and out, an XLA launch), against ~3 us for Inductor.

Needs the optional extra: ``pip install -e ".[neuron]"`` (torch-mlir and jax[cpu]).

Note [StableHLO lowering]
~~~~~~~~~~~~~~~~~~~~~~~~~
``compile``: the graph is traced again with torch-mlir's decomposition table (what its own
``export_and_import`` applies: core ATen decompositions plus the few it needs, without those it
cannot lower; e.g. ``nll_loss_forward`` crashes its importer undecomposed, lowers decomposed), the
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
A root whose eager strides are not the row-major ones XLA returns is first copied into eager's
strides (``restrided``); otherwise the DLPack tensor is the output itself, no copy. (A root that
eager lays out with gaps or at an offset, which no op of these graphs does, is refused.)

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
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import operator
import platform
import struct
import time
import weakref
import zlib
from collections.abc import Callable

import torch
from torch.fx.node import map_arg

from ._common import (
    BackendCompileError, below_autograd, check_graph, fake_values, op_name, output_nodes, restrided,
)

log = logging.getLogger(__name__)

_FORMAT = 1
_MAGIC = b"adaptive-eager stablehlo\n"
_DEVICE_TYPES = ("cpu",)
_REQUIREMENTS = {"torch_mlir": "torch-mlir", "jax": "jax", "jaxlib": "jaxlib"}
INSTALL_HINT = 'pip install -e ".[neuron]"'

# Note [64-bit types]: eager dtype -> the dtype the region computes in
_NARROW = {torch.float64: torch.float32, torch.int64: torch.int32, torch.uint64: torch.uint32}
_NARROW_MLIR = {"f64": "f32", "i64": "i32", "si64": "si32", "ui64": "ui32"}
_INT32_RANGE = {"i32": (-(2**31), 2**31 - 1), "si32": (-(2**31), 2**31 - 1), "ui32": (0, 2**32 - 1)}
_DLPACK_CPU = 1  # DLDeviceType.kDLCPU

# Note [Ops that run alone]: ops torch-mlir 20261001 lowers to code that computes other values than
# eager (found by the OpInfo sweep in tests/test_stablehlo.py): op -> (for which calls, None: all; why)
_MISCOMPILED = {
    "aten.remainder.Scalar": (None, "C's fmod sign, not Python's: remainder(-1.5, 1.0) gives -0.5, eager 0.5"),
    "aten.remainder.Tensor": (None, "C's fmod sign, not Python's: remainder(-1.5, 1.0) gives -0.5, eager 0.5"),
    "aten.logcumsumexp.default": (None, "exp overflows: logcumsumexp of [100.0] gives inf"),
    "aten.take.default": (None, "negative indices are not wrapped"),
    "aten.avg_pool3d.default": (lambda node: node.kwargs.get("divisor_override", (node.args + (None,) * 7)[6])
                                is not None, "divisor_override is not applied"),
}


def _miscompiled(node: torch.fx.Node) -> str | None:
    """Why torch-mlir lowers ``node`` to wrong values, or None (``_MISCOMPILED``)."""
    entry = _MISCOMPILED.get(op_name(node.target)) if node.op == "call_function" else None
    if entry is None or (entry[0] is not None and not entry[0](node)):
        return None
    return entry[1]


def missing_requirements(requirements: dict[str, str] = _REQUIREMENTS) -> list[str]:
    """The distributions of ``requirements`` (module -> distribution; default: this backend's) that
    are not installed, found without importing them."""
    return [dist for module, dist in requirements.items() if importlib.util.find_spec(module) is None]


class StablehloBackend:
    """Lowers with torch-mlir, compiles with XLA's CPU client; see the module notes.

    The lowering (``unsupported``, the checks and the output plan of ``compile``) is shared with the
    neuron backend (``fuser.backends.neuron``), which overrides only what turns StableHLO text into
    an executable and runs it: ``_build``, ``_callable``, ``_identity``."""

    name = "stablehlo"
    device_types: tuple[str, ...] = _DEVICE_TYPES
    requirements: dict[str, str] = _REQUIREMENTS
    magic = _MAGIC

    def __init__(self, device_type: str, *, narrow_64bit: bool = False) -> None:
        if device_type not in self.device_types and not _emulated(device_type):
            raise ValueError(
                f"the {self.name} backend supports device types {', '.join(self.device_types)}, not {device_type!r}"
            )
        missing = missing_requirements(self.requirements)
        if missing:
            raise ImportError(
                f"the {self.name} backend needs {' and '.join(missing)}, which are not installed: {INSTALL_HINT}"
            )
        self.device_type = device_type
        self.narrow_64bit = narrow_64bit
        self._fingerprint = "|".join([
            f"{self.name}-{_FORMAT}",
            f"torch-{torch.__version__}",
            f"torch-mlir-{importlib.metadata.version('torch-mlir')}",
            *self._identity(),
            "narrow64" if narrow_64bit else "exact64",
        ])
        # Note [Ops that run alone]: op signature -> reason or None; the last graph ``unsupported`` lowered
        self._lowerable: dict[tuple, str | None] = {}
        self._lowered: tuple | None = None

    def _identity(self) -> list[str]:
        """What else makes the executables this backend produces: the compiler and its target."""
        return [f"jaxlib-{importlib.metadata.version('jaxlib')}",
                f"{self.device_type}-{platform.machine()}-{_cpu_features()}"]  # XLA compiles for the host's ISA

    def fingerprint(self) -> str:
        """Format, torch / torch-mlir / compiler versions, the target, and the 64-bit option."""
        return self._fingerprint

    def unsupported(self, node: torch.fx.Node) -> str | None:
        """"not_lowerable" for a node torch-mlir cannot lower to StableHLO, "miscompiled" for one it
        lowers wrongly (Note [Ops that run alone])."""
        if _miscompiled(node):
            return "miscompiled"
        key = _signature(node)
        if key not in self._lowerable:
            self._check(node.graph)
        return self._lowerable.get(key)

    def _check(self, graph: torch.fx.Graph) -> None:
        """Learn whether the ops of ``graph`` lower: the whole graph at once (kept for ``compile``),
        and only if that fails, each op not yet known alone (Note [Ops that run alone])."""
        nodes = [n for n in graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]
        gm = graph.owning_module
        examples = _examples(gm) if gm is not None else None
        if examples is not None and not any(_miscompiled(n) for n in nodes):
            try:
                check_graph(self.name, gm, examples)
                self._lowered = (weakref.ref(gm), _input_key(examples), self._lower_region(gm, examples))
            except BackendCompileError:
                pass
            else:
                for n in nodes:
                    self._lowerable.setdefault(_signature(n), None)
                return
        for n in nodes:
            key = _signature(n)
            if key not in self._lowerable:
                self._lowerable[key] = self._probe(n)

    def _probe(self, node: torch.fx.Node) -> str | None:
        alone = _alone(node)
        if alone is None:
            return None  # no tensor metadata to build inputs from: let the region's compile decide
        gm, examples = alone
        try:
            _lower(gm, examples, self.narrow_64bit)
        except BackendCompileError as e:
            log.info("stablehlo: %s runs alone: %s", op_name(node.target), str(e).removeprefix("stablehlo: "))
            return "not_lowerable"
        return None

    def _culprit(self, gm: torch.fx.GraphModule):
        """The first op of ``gm`` that does not lower alone at its own sizes (Note [Ops that run
        alone]: an op whose lowering depends on sizes passes ``unsupported``), or None."""
        for node in gm.graph.nodes:
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and self._probe(node):
                return node.target
        return None

    def _lower_region(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> tuple[list, list, str]:
        """The output plan (Note [Outputs that share storage]) and the StableHLO of ``gm``."""
        roots, results, outputs = _output_plan(gm, example_inputs, self.narrow_64bit)
        return results, outputs, _lower(_returning(gm, roots), example_inputs, self.narrow_64bit)

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> bytes:
        """Lower ``gm`` to StableHLO and compile it into a serialized XLA executable (Note [StableHLO lowering])."""
        check_graph(self.name, gm, example_inputs)
        for i, t in enumerate(example_inputs):
            # a lifted float is a 0-dim cpu tensor on every device (Note [Scalar lifting] in fuser.compiled)
            if t.device.type != self.device_type and not (t.device.type == "cpu" and t.dim() == 0):
                raise BackendCompileError(
                    f"stablehlo: example input {i} is on {t.device}, this backend compiles for {self.device_type}"
                )
        for node in gm.graph.nodes:
            why = _miscompiled(node)
            if why is not None:
                error = BackendCompileError(f"stablehlo: cannot compile {op_name(node.target)} (node {node.name}): "
                                            f"torch-mlir lowers it to wrong values ({why})")
                error.target = node.target
                raise error
        start = time.perf_counter()
        lowered, self._lowered = self._lowered, None
        if lowered is not None and lowered[0]() is gm and lowered[1] == _input_key(example_inputs):
            results, outputs, text = lowered[2]  # lowered by ``unsupported`` a moment ago
        else:
            try:
                results, outputs, text = self._lower_region(gm, example_inputs)
            except BackendCompileError as e:
                e.target = self._culprit(gm)  # the fuser compiles the rest with it run alone
                raise
        lowered = time.perf_counter()
        blob, extra = self._build(text, results)
        header = {
            "format": _FORMAT,
            "fingerprint": self._fingerprint,
            "inputs": [_wire(t.dtype, self.narrow_64bit) for t in example_inputs],
            "results": results,
            "outputs": outputs,
            **extra,
        }
        artifact = _pack(header, blob, self.magic)
        log.debug("%s: lowered %d nodes in %.2f s, compiled in %.2f s, %d bytes", self.name, len(gm.graph.nodes),
                  lowered - start, time.perf_counter() - lowered, len(artifact))
        return artifact

    def _build(self, text: str, results: list[dict]) -> tuple[bytes, dict]:
        """The executable of StableHLO ``text`` as bytes, and what else its header holds."""
        client = _client()
        try:
            executable = client.compile_and_load(text, client.devices()[:1], _xla().CompileOptions())
            blob = client.serialize_executable(executable)
        except Exception as e:
            raise BackendCompileError(f"stablehlo: XLA cannot compile the region: {type(e).__name__}: {str(e)[:800]}") from e
        for i, layout in enumerate(executable.get_output_layouts()):
            rank = len(results[i]["shape"])
            if str(layout) != "{" + ",".join(str(d) for d in reversed(range(rank))) + "}":
                raise BackendCompileError(f"stablehlo: XLA returns result {i} in layout {layout}, not row-major")
        return blob, {}

    def load(self, artifact: bytes) -> Callable[[list[torch.Tensor]], tuple[torch.Tensor, ...]]:
        """Load the executable (no compile) and wrap it in the ``Backend`` calling convention."""
        header, blob = _unpack(artifact, self.magic, self.name)
        if header.get("fingerprint") != self._fingerprint:
            raise BackendCompileError(
                f"{self.name}: artifact was made for {header.get('fingerprint')!r}, this process is {self._fingerprint!r}"
            )
        try:
            return below_autograd(caller(self._callable(blob, header), header))
        except BackendCompileError:
            raise
        except Exception as e:
            raise BackendCompileError(f"{self.name}: artifact does not load: {type(e).__name__}: {e}") from e

    def _callable(self, blob: bytes, header: dict) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
        """``blob`` loaded: a function from the inputs (in the wire dtypes) to the results (root values
        in the wire dtypes, row-major), Note [Outputs that share storage]."""
        client = _client()
        executable = client.deserialize_executable(blob, client.devices()[:1], _xla().CompileOptions())
        device = client.devices()[0]
        # jaxlib's own DLPack calls: jax.dlpack.from_dlpack would make int64 int32 (jax's default
        # dtypes), and jax.Array.__dlpack__ costs ~20 us of Python checks per result
        to_buffer = _xla().dlpack_managed_tensor_to_buffer
        to_capsule = _xla().buffer_to_dlpack_managed_tensor
        from_dlpack = torch.from_dlpack
        execute = executable.execute

        def results(args: list[torch.Tensor]) -> list[torch.Tensor]:
            buffers = []
            for t in args:
                if t.requires_grad:  # DLPack refuses tensors that require grad; the call runs below autograd
                    t = t.detach()
                if not t.is_contiguous():
                    t = t.contiguous()
                buffers.append(to_buffer(t.__dlpack__(), device, None, None, _DLPACK_CPU))
            # exporting a result waits for the execution to finish (it reads the inputs in place until then)
            return [from_dlpack(to_capsule(r)) for r in execute(buffers)]

        if _emulated(self.device_type):  # XLA runs on the CPU data: Note [Emulated storage] in adaptive_eager.neuron_emulation
            from adaptive_eager.neuron_emulation import cpu_data, on_device

            on_cpu = results

            def results(args: list[torch.Tensor]) -> list[torch.Tensor]:
                return [on_device(r) for r in on_cpu([cpu_data(t) for t in args])]

        return results


# ---------------------------------------------------------------------------------------- lowering


@functools.cache
def _xla():
    from jaxlib import _jax

    return _jax


@functools.cache
def _client():
    from jax.extend.backend import get_backend

    return get_backend("cpu")


@functools.cache
def _decompositions() -> dict:
    from torch_mlir.extras.fx_decomp_util import get_decomposition_table

    return get_decomposition_table()


# torch-mlir's pipelines, as ``torch_mlir.fx.stateless_fx_import(..., output_type="stablehlo")`` runs them
_PIPELINES = (
    "builtin.module(func.func(torch-match-quantized-custom-ops), torchdynamo-export-to-torch-backend-pipeline)",
    "builtin.module(torch-backend-to-stablehlo-backend-pipeline{allow-non-finites=True})",
)


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
            decomposed = make_fx(gm, decomposition_table=_decompositions(), tracing_mode="fake")(*example_inputs)
    except Exception as e:
        raise BackendCompileError(f"stablehlo: cannot decompose the graph: {type(e).__name__}: {str(e)[:800]}") from e
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


def _returning(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node]) -> Callable:
    """A function computing ``gm``'s values of ``nodes`` (the storage roots), for tracing."""

    def roots(*inputs):
        interpreter = torch.fx.Interpreter(gm, garbage_collect_values=False)
        interpreter.run(*inputs)
        return tuple(interpreter.env[n] for n in nodes)

    return roots


def _output_plan(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor], narrow_64bit: bool) -> tuple[list, list, list]:
    """Note [Outputs that share storage]: the root nodes the executable returns; per result its
    eager layout (or None: the row-major DLPack tensor is it); per output, where its storage comes
    from (a result, or an input: a piece of a split region may return a view of its input) and, for
    a view, the view's (shape, stride, storage offset; relative to the input's for an input)."""
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
            results.append({
                "shape": list(r.shape),
                "dtype": _dtype_name(r.dtype),
                "wire": _wire(r.dtype, narrow_64bit)[1],
                # eager's strides of the root, when they are not those of XLA's row-major result
                "stride": None if r.stride() == _row_major(r.shape) else list(r.stride()),
            })
        view = None if v is values[root] else [list(v.shape), list(v.stride()), v.storage_offset()]
        outputs.append(["result", roots.index(root), view])
    return roots, results, outputs


def _row_major(shape) -> tuple[int, ...]:
    """The strides of the tensor DLPack makes of a row-major XLA result (torch's contiguous strides)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


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


def _emulated(device_type: str) -> bool:
    """Whether ``device_type`` is the emulated neuron device (adaptive_eager.neuron_emulation),
    whose tensors hold CPU data that XLA's CPU client runs on."""
    from adaptive_eager.neuron_emulation import DEVICE, is_emulated

    return device_type == DEVICE and is_emulated()


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


# ----------------------------------------------------------------------------------------- calling


def caller(execute: Callable[[list[torch.Tensor]], list[torch.Tensor]], header: dict
           ) -> Callable[[list[torch.Tensor]], tuple[torch.Tensor, ...]]:
    """``execute`` (inputs in wire dtypes -> row-major roots in wire dtypes) in the ``Backend``
    calling convention (Notes [Outputs that share storage], [64-bit types])."""
    as_strided = torch.as_strided

    casts_in = [(i, _dtype(wire)) for i, (dtype, wire) in enumerate(header["inputs"]) if dtype != wire]
    casts_out = [(k, _dtype(r["dtype"])) for k, r in enumerate(header["results"]) if r["wire"] != r["dtype"]]
    # per output: (from an input?, index, view (shape, stride, storage offset) or None)
    outputs = [(kind == "input", k, None if view is None else (tuple(view[0]), tuple(view[1]), view[2]))
               for kind, k, view in header["outputs"]]

    def results(args: list[torch.Tensor]) -> list[torch.Tensor]:
        """The executable's results as tensors of eager's dtypes, in the row-major layout."""
        roots = execute(args)
        for k, dtype in casts_out:
            roots[k] = roots[k].to(dtype)
        return roots

    fixes = [(k, r["shape"], r["stride"]) for k, r in enumerate(header["results"]) if r["stride"] is not None]
    if fixes:  # results eager lays out otherwise: copied into eager's strides
        results = restrided(results, fixes)

    def run(inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        args = inputs
        if casts_in:
            args = list(inputs)
            for i, wire in casts_in:
                args[i] = args[i].to(wire)
        roots = results(args)
        return tuple(
            as_strided(inputs[k], view[0], view[1], inputs[k].storage_offset() + view[2]) if of_input
            else roots[k] if view is None else as_strided(roots[k], *view)
            for of_input, k, view in outputs
        )

    return run


# ---------------------------------------------------------------------------------------- artifact


def _pack(header: dict, executable: bytes, magic: bytes = _MAGIC) -> bytes:
    """magic, header length, JSON header, executable; the header holds the executable's CRC-32."""
    header = {**header, "executable_crc32": zlib.crc32(executable), "executable_size": len(executable)}
    data = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return magic + struct.pack("<I", len(data)) + data + executable


def _unpack(artifact: bytes, magic: bytes = _MAGIC, name: str = "stablehlo") -> tuple[dict, bytes]:
    """The header and the executable; checks that they are whole (a damaged executable must never
    reach ``deserialize_executable``, which trusts its input)."""
    try:
        if not artifact.startswith(magic):
            raise ValueError(f"no {name} magic")
        start = len(magic) + 4
        (size,) = struct.unpack_from("<I", artifact, len(magic))
        header = json.loads(artifact[start:start + size])
        executable = artifact[start + size:]
        if not isinstance(header, dict) or header.get("format") != _FORMAT:
            raise ValueError(f"not format {_FORMAT}")
        if len(executable) != header["executable_size"] or zlib.crc32(executable) != header["executable_crc32"]:
            raise ValueError("the executable is damaged (size or CRC-32)")
    except (ValueError, KeyError, TypeError, struct.error) as e:
        raise BackendCompileError(f"{name}: artifact is corrupt or not a {name} artifact: {e}") from e
    return header, executable


@functools.cache
def _cpu_features() -> str:
    """A short digest of the CPU's feature flags: XLA's CPU code uses every extension the host has."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return hashlib.sha256((flags or platform.processor()).encode()).hexdigest()[:12]
