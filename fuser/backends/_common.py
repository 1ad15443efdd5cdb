"""What every backend shares: the error type, the graph checks, and how compiled code is called."""

from __future__ import annotations

import functools
import importlib
import json
import operator
import struct
from collections.abc import Callable, Mapping, Sequence

import torch
from torch.fx.node import _get_qualified_name, map_arg

# device type -> ``host(storage, result) -> (storage, result) | None``: the host storage and tensor
# behind a placeholder's storage and a result of a device whose tensors wrap host memory, which
# ``fuser.replay._swap_storages`` swaps (registered by adaptive_eager.neuron_emulation, a layer above)
HOST_SWAPS: dict = {}


class BackendCompileError(RuntimeError):
    """A graph a backend cannot compile, or an artifact it cannot load.

    Never fatal to the program: the fuser counts the reason and runs the region by replay.
    ``target``: the op the backend blames, when it can tell (the fuser then runs that op alone
    and compiles the rest: Note [Partitions] in ``fuser.partition``). ``inplace``: the backend
    cannot write the graph's inputs itself (the fuser then compiles the region again with a
    write-back: Note [In-place regions] in ``fuser.compilable``).
    """

    target = None
    inplace = False


# Note [One trace at a time]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# FX tracing keeps process-wide state: ``torch.fx._symbolic_trace.CURRENT_PATCHER`` (make_fx's
# tracer patches module globals for the trace's duration and reverts them at its end), before
# torch 2.14 also ``_is_fx_tracing_flag``, and a compile patches Inductor's config. Two traces at once in two
# threads of one process corrupt each other: with four training threads, a region compiling while
# another thread's optimizer step was being captured by Dynamo failed with "AssertionError:
# CURRENT_PATCHER is None in finally block" and was blacklisted (tests/test_threads.py). Dynamo
# serializes its own compiles with ``torch._dynamo.convert_frame.compile_lock``; every compile of
# ours (tracing the Program, partitioning, the backend's compile) holds that same lock, so ours,
# the optimizer capture's (adaptive_eager._optim) and a user's ``torch.compile`` never trace at
# once. No deadlock: a holder never waits for a flush. Ours holds it in the compile thread or a
# worker process (Note [Compile thread] in fuser.artifacts), which run no user code; Dynamo holds it
# with every dispatch mode disabled, and the capture flushes the step's window before it compiles.
def trace_lock():
    """The process's one lock for FX traces (Note [One trace at a time]); a reentrant lock."""
    from torch._dynamo.convert_frame import compile_lock

    return compile_lock


# Note [Launches of a compiled callable]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``metrics()["launches"]`` counts what reaches the device, and a compiled callable is not always
# one launch: a split region runs its pieces and the ops that run alone (Note [Partitions] in
# fuser.partition); the stablehlo backend's caller casts inputs and results, copies results into
# eager's strides and clones a new value that is a view of an input before its store; the replay
# backend runs every op of its graph. A callable that makes more than one says how many a call
# makes as ``run.launches`` (known when it is loaded: they do not depend on the values); one that
# does not say makes one (Inductor's callable: one call of its compiled code). Wrappers carry the
# count on (``below_autograd``, ``restrided``: plus its copies). On the emulated neuron device a
# test holds this count to the device's own (Note [Emulated launches] in
# adaptive_eager.neuron_emulation).
class EagerWouldRaise(RuntimeError):
    """A compiled run found a value its op's eager kernel refuses (an index out of range, an
    integer divisor of 0) and wrote nothing (Note [Checked indices] in
    ``fuser.backends._stablehlo_lowering``): the caller runs the ops eagerly instead, and eager's
    kernel raises its own error at the op."""


def launches_of(run) -> int:
    """The device launches one call of a compiled callable makes (Note [Launches of a compiled callable])."""
    return getattr(run, "launches", 1)


# allocations reserve memory and compute nothing (torch's factories decompose to these);
# ``_unsafe_view`` is a view by what it does though not by schema (a reshape's result that autograd
# does not track): the emulated device does not count it either (``_NO_LAUNCH`` in
# adaptive_eager.neuron_emulation)
ALLOCATORS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"})
_NO_COMPUTE = frozenset({torch.ops.aten._unsafe_view.default, torch.ops.aten.sym_size.int})


def launches_op(target) -> bool:
    """Whether a graph's call of ``target``, run op by op, is a device launch: an ATen op that is
    neither a view nor an allocation (Note [Launches of a compiled callable])."""
    return (isinstance(target, torch._ops.OpOverload) and not target.is_view and target not in _NO_COMPUTE
            and target._opname not in ALLOCATORS)


def restrided(run, fixes: list):
    """``run`` with the outputs ``fixes`` names ((index, shape, stride) each) copied into that
    layout: eager's, where a compiled output came back in another; with no shape and stride, into
    a buffer of its own in the layout it came back in (Note [Repeated outputs] in
    ``fuser.backends.inductor``). ``.fix(outs)`` applies it to outputs already returned."""
    empty_strided = torch.empty_strided
    fixes = [(i, None, None) if shape is None else (i, tuple(shape), tuple(stride)) for i, shape, stride in fixes]

    def fix(outs):
        outs = list(outs)
        for i, shape, stride in fixes:
            r = outs[i]
            if shape is None:
                shape, stride = r.shape, r.stride()
            outs[i] = empty_strided(shape, stride, dtype=r.dtype, device=r.device).copy_(r)
        return outs

    def restrided_run(inputs):
        return fix(run(inputs))

    restrided_run.fix = fix
    restrided_run.launches = launches_of(run) + len(fixes)  # a copy each
    return restrided_run


def op_name(target: object) -> str:
    """How errors and serialized graphs name a node's target ("aten.add.Tensor")."""
    for name, known in _OPERATORS.items():
        if target is known:
            return name
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    try:
        return _get_qualified_name(target)  # FX's spelling: "torch.sin", not its C binding's
    except Exception:
        return repr(target)


# Size arithmetic in symbolically traced graphs (a view to ``2 * B`` rows): Python operators on SymInts.
SIZE_ARITHMETIC = frozenset({operator.mul, operator.add, operator.sub, operator.floordiv, operator.mod, operator.neg})


def check_graph(backend: str, gm: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> None:
    """Raise ``BackendCompileError`` unless ``gm`` has the shape the ``Backend`` contract promises.

    Checked before any compiler runs, so a graph the fuser built wrong fails with a message that
    names the node, not with an error from deep inside a compiler.
    """
    placeholders = 0
    outputs = 0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            placeholders += 1
        elif node.op == "call_function":
            if not (isinstance(node.target, torch._ops.OpOverload) or node.target is operator.getitem
                    or node.target in SIZE_ARITHMETIC):
                raise BackendCompileError(
                    f"{backend}: cannot compile {op_name(node.target)} (node {node.name}): "
                    "only ATen OpOverloads and operator.getitem are supported"
                )
        elif node.op == "output":
            outputs += 1
            result = node.args[0]
            if not isinstance(result, (tuple, list)) or not all(isinstance(r, torch.fx.Node) for r in result):
                raise BackendCompileError(f"{backend}: the output node must return a tuple of tensors, got {result!r}")
        else:
            raise BackendCompileError(
                f"{backend}: cannot compile {node.op} node {node.name} ({node.target}): "
                "graphs hold only placeholders, ATen calls and one output"
            )
    if outputs != 1:
        raise BackendCompileError(f"{backend}: graph has {outputs} output nodes, expected 1")
    if placeholders != len(example_inputs):
        raise BackendCompileError(
            f"{backend}: graph has {placeholders} placeholders but {len(example_inputs)} example inputs"
        )
    for i, t in enumerate(example_inputs):
        if not isinstance(t, torch.Tensor):
            raise BackendCompileError(f"{backend}: example input {i} is a {type(t).__name__}, not a tensor")


def eager_output_meta(
    backend: str, gm: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor]
) -> list[tuple]:
    """(shape, stride, storage offset, dtype) of each output as eager execution would produce it."""
    values = fake_values(backend, gm, example_inputs)
    return [tensor_meta(backend, values[n]) for n in output_nodes(backend, gm)]


def fake_values(
    backend: str, gm: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor]
) -> dict[torch.fx.Node, object]:
    """Each node's value when the graph runs eagerly on fake tensors (layouts and storage sharing
    as eager's), found node by node, so an op that cannot even be shape-propagated (no meta kernel,
    data-dependent output shape) is named in the error."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    values: dict[torch.fx.Node, object] = {}
    inputs = iter(example_inputs)
    with torch.no_grad(), mode:
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                values[node] = mode.from_tensor(next(inputs))
            elif node.op == "call_function":
                args = map_arg(node.args, values.__getitem__)
                kwargs = map_arg(node.kwargs, values.__getitem__)
                try:
                    values[node] = node.target(*args, **kwargs)
                except Exception as e:
                    raise BackendCompileError(
                        f"{backend}: cannot compile {op_name(node.target)} (node {node.name}): "
                        f"{type(e).__name__}: {e}"
                    ) from e
    return values


def output_nodes(backend: str, gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The nodes the graph's output node returns (``check_graph`` makes sure there is one)."""
    for node in reversed(gm.graph.nodes):
        if node.op == "output":
            return list(node.args[0])
    raise BackendCompileError(f"{backend}: graph has no output node")


def tensor_meta(backend: str, t: object) -> tuple:
    """The output metadata the ``Backend`` contract promises to reproduce."""
    if not isinstance(t, torch.Tensor):
        raise BackendCompileError(f"{backend}: graph output is a {type(t).__name__}, not a tensor")
    return (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)


_is_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_is_any_autocast_enabled = torch._C._is_any_autocast_enabled
_DisableAutocast = torch._C._DisableAutocast


def below_autograd(
    fn: Callable[[list[torch.Tensor]], tuple[torch.Tensor, ...]],
) -> Callable[[list[torch.Tensor]], tuple[torch.Tensor, ...]]:
    """Wrap ``fn`` so the graph's ops run as they were recorded: grad mode and autocast off.

    The recorder sees ops below autograd and autocast, so the graph already holds autocast's casts
    and no autograd; re-entering either would record history on outputs, cast again, or reject
    Inductor's ``out=`` kernels when an input requires grad. Plain function calls instead of
    ``torch.no_grad()``: that context manager adds ~5 us per call, these ~1 us.
    """

    def run(inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        grad = _is_grad_enabled()
        _set_grad_enabled(False)
        try:
            if _is_any_autocast_enabled():
                with _DisableAutocast():
                    return fn(inputs)
            return fn(inputs)
        finally:
            _set_grad_enabled(grad)

    if hasattr(fn, "launches"):
        run.launches = fn.launches  # Note [Launches of a compiled callable]
    return run


# JSON tags for the torch values an op argument can hold besides numbers, strings and lists: the
# replay backend's artifacts and the programs sent to compile workers share them.
_TORCH_ENUMS = {"$dtype": torch.dtype, "$layout": torch.layout, "$memory_format": torch.memory_format}


def encode_torch_value(x: object) -> dict | None:
    """``{tag: value}`` for a dtype, device, layout, memory format or complex; None for anything else."""
    if isinstance(x, torch.dtype):
        return {"$dtype": str(x).removeprefix("torch.")}
    if isinstance(x, torch.device):
        return {"$device": str(x)}
    if isinstance(x, torch.layout):
        return {"$layout": str(x).removeprefix("torch.")}
    if isinstance(x, torch.memory_format):
        return {"$memory_format": str(x).removeprefix("torch.")}
    if type(x) is complex:
        return {"$complex": [x.real, x.imag]}
    return None


# Note [One codec]
# A Program (``fuser.program``, for compile workers and the persistent key) and the graphs the
# replay backend and split regions store (``encode_arg``) are both ATen calls whose arguments are
# JSON: None, bool, int, float and str as themselves (JSON keeps 1, 1.0 and True apart, so scalar
# types survive; a float is written by ``repr``, which round-trips), lists as lists, tuples and
# dicts tagged (``{"$tuple": [...]}``, ``{"$dict": {...}}``), torch values tagged by
# ``encode_torch_value``, and what only the caller's IR holds (an FX node, a Program's reference to
# an input) tagged by the caller (``leaf`` and ``tags``). One walker, so the two cannot drift apart,
# and the encoding is canonical: the same arguments give the same bytes in every process, which is
# what the persistent key hashes (``Program.digest``).
def encode_value(x: object, leaf: Callable[[object], dict | None] | None = None) -> object:
    """``x`` as JSON (Note [One codec]); TypeError for a value it cannot describe."""
    if x is None or type(x) in (bool, int, float, str):
        return x
    if isinstance(x, list):  # FX stores lists as immutable_list
        return [encode_value(v, leaf) for v in x]
    if isinstance(x, tuple):
        return {"$tuple": [encode_value(v, leaf) for v in x]}
    if type(x) is dict:
        return {"$dict": {k: encode_value(v, leaf) for k, v in x.items()}}
    tagged = None if leaf is None else leaf(x)
    if tagged is None:
        tagged = encode_torch_value(x)
    if tagged is None:
        raise TypeError(f"cannot encode {x!r} ({type(x).__name__})")
    return tagged


def decode_value(x: object, tags: Mapping[str, Callable[[object], object]] | None = None) -> object:
    """``encode_value``'s value back; ``tags`` decode the caller's own tags. ValueError for a tag
    or a value nobody knows."""
    if type(x) is list:
        return [decode_value(v, tags) for v in x]
    if type(x) is not dict:
        return x
    if len(x) != 1:
        raise ValueError(f"unknown value {x!r}")
    ((tag, v),) = x.items()
    if tag == "$tuple" and type(v) is list:
        return tuple(decode_value(e, tags) for e in v)
    if tag == "$dict" and type(v) is dict:
        return {k: decode_value(e, tags) for k, e in v.items()}
    if tags is not None and tag in tags:
        return tags[tag](v)
    return decode_torch_value(tag, v)


def encode_arg(x: object, index: dict, backend: str, op: str) -> object:
    """An FX node argument as JSON (Note [One codec]): nodes as ``{"$n": position in index}``."""

    def node(v: object) -> dict | None:
        return {"$n": index[v]} if isinstance(v, torch.fx.Node) else None

    try:
        return encode_value(x, node)
    except TypeError:
        raise BackendCompileError(f"{backend}: cannot compile {op}: argument {x!r} ({type(x).__name__}) "
                                  "cannot be stored") from None


def decode_arg(x: object, values: list, backend: str) -> object:
    """``encode_arg``'s argument back, with ``{"$n": i}`` as ``values[i]``."""

    def node(v: object) -> object:
        if type(v) is not int or not 0 <= v < len(values):
            # a stored graph only names values defined before (a negative index would wrap)
            raise BackendCompileError(f"{backend}: artifact names value {v!r} of {len(values)}")
        return values[v]

    try:
        return decode_value(x, {"$n": node})
    except ValueError:
        raise BackendCompileError(f"{backend}: artifact holds an unknown value {x!r}") from None


# the module that registers a namespace's ops that torch does not register at its import: Inductor's
# decompositions name ``prims.fma`` (AdamW's step), which a worker that traced nothing has not loaded
_REGISTERED_BY = {"prims": "torch._inductor.inductor_prims"}


# the Python functions a stored graph may call besides ATen ops: a tuple's item, and a size's
# arithmetic (Note [Sizes that vary, run alone] in fuser.compile)
_OPERATORS = {"operator.getitem": operator.getitem, "operator.add": operator.add, "operator.mul": operator.mul}


def resolve_op(name: str, backend: str) -> object:
    """The target ``op_name`` named."""
    if name in _OPERATORS:
        return _OPERATORS[name]
    try:
        namespace, packet, overload = name.split(".")
    except ValueError as e:
        raise BackendCompileError(f"{backend}: cannot load {name}: no such op in this process ({e})") from e
    for attempt in range(2):
        try:
            return getattr(getattr(getattr(torch.ops, namespace), packet), overload)
        except (AttributeError, RuntimeError) as e:
            if attempt or namespace not in _REGISTERED_BY:
                raise BackendCompileError(f"{backend}: cannot load {name}: no such op in this process ({e})") from e
            importlib.import_module(_REGISTERED_BY[namespace])


def decode_torch_value(tag: str, v: object) -> object:
    """The value ``encode_torch_value`` tagged; ValueError for a tag or name this torch lacks."""
    if tag == "$device":
        return torch.device(v)
    if tag == "$complex":
        return complex(*v)
    kind = _TORCH_ENUMS.get(tag)
    value = getattr(torch, v, None) if kind is not None and type(v) is str else None
    if value is None or not isinstance(value, kind):
        raise ValueError(f"unknown value {tag} {v!r}")
    return value


# Note [Artifact container]
# A stored artifact that holds more than one part (the fuser's packing of a backend's artifact, a
# split region's plan and pieces) is ``_MAGIC``, the length of a JSON header (8 bytes, little
# endian), the header, and the parts' bytes back to back; the header lists the parts' lengths.
# No pickle (Note [No pickle] in ``neff_cache.access``): reading one runs no stored code, and any
# malformation (another magic, a header that is not a JSON object, lengths that do not add up to
# the size) is a BackendCompileError naming what is wrong, never a crash or a part cut wrong.
_MAGIC = b"adaptive-eager artifact\n"
_LENGTH = struct.Struct("<Q")


def pack_sections(header: dict, sections: Sequence[bytes]) -> bytes:
    """``header`` (JSON, with the key "sections") and ``sections`` as one artifact: Note [Artifact container]."""
    text = json.dumps({**header, "sections": [len(s) for s in sections]}, sort_keys=True).encode()
    return b"".join([_MAGIC, _LENGTH.pack(len(text)), text, *sections])


def unpack_sections(data: bytes, what: str) -> tuple[dict, list[bytes]]:
    """``pack_sections``'s header and sections back; BackendCompileError naming ``what`` for anything malformed."""
    if not data.startswith(_MAGIC):
        raise BackendCompileError(f"{what}: not an adaptive eager artifact (it starts {bytes(data[:len(_MAGIC)])!r})")
    start = len(_MAGIC) + _LENGTH.size
    header = None
    if len(data) >= start:
        (length,) = _LENGTH.unpack_from(data, len(_MAGIC))
        try:
            header = json.loads(data[start:start + length]) if start + length <= len(data) else None
        except (ValueError, RecursionError):
            pass
    sizes = header.get("sections") if isinstance(header, dict) else None
    if not (type(sizes) is list and all(type(n) is int and n >= 0 for n in sizes)
            and start + length + sum(sizes) == len(data)):
        raise BackendCompileError(f"{what}: the artifact's header is malformed or does not match its {len(data)} bytes")
    sections, offset = [], start + length
    for n in sizes:
        sections.append(data[offset:offset + n])
        offset += n
    return header, sections


# Note [Foreach ops]
# ~~~~~~~~~~~~~~~~~~
# On a device of torch.optim's foreach list (``neuron`` is one) an optimizer's default step and
# ``clip_grad_norm_`` are ``_foreach_*`` ops, each over a list of tensors. torch-mlir lowers none of
# them ("failed to legalize operation 'torch.operator'", or a KeyError on a list of numbers), so
# each ran alone and split the step's region: an AdamW step of 6 parameters made 9 launches and
# two pieces more. Each functional ``_foreach_<op>`` is that op per element of its lists: a list
# argument (of tensors, or of numbers for a ``ScalarList`` overload) gives the element at the same
# position, any other argument (a scalar, one tensor) is passed to every call; eager's CPU foreach
# kernels compute the same per-tensor ops. ``_foreach_norm`` is ``linalg_vector_norm`` per tensor.
# An overload whose per-element op is not ``aten.<op>``, or that takes a tensor of per-element
# scalars (``addcdiv``/``addcmul`` ``.Tensor``), is left as it is (under stablehlo: run alone).
# The stablehlo lowering decomposes them so (Note [Our decompositions] in
# fuser.backends._stablehlo_decompositions), and so does every region whose floats are lifted (Note
# [Scalar lifting] in fuser.scalars, ``Program.graph``): a ``ScalarList`` of per-step floats (AdamW's
# bias corrections) cannot be a graph input, the floats of the per-element ops can. Kept whole,
# such a region was compiled again at every step, its floats baked in.
@functools.cache
def foreach_decompositions() -> dict:
    """Each functional ``_foreach_*`` overload as its op per element (Note [Foreach ops])."""
    aten = torch.ops.aten
    table = {}
    for name in dir(aten):
        if not name.startswith("_foreach_") or name.endswith("_"):
            continue
        base = name.removeprefix("_foreach_")
        if base == "norm":
            per = _foreach_norm_element
        elif base in ("addcdiv", "addcmul"):
            per = functools.partial(_pointwise_with_value, getattr(aten, base))
        elif hasattr(aten, base):
            per = getattr(aten, base)
        else:
            continue
        packet = getattr(aten, name)
        for overload in packet.overloads():
            if overload == "Tensor" and base in ("addcdiv", "addcmul"):
                continue
            one = per
            if base in ("maximum", "minimum") and overload in ("Scalar", "ScalarList"):
                one = aten.clamp_min if base == "maximum" else aten.clamp_max  # a number: no Tensor overload
            table[getattr(packet, overload)] = functools.partial(_per_element, one)
    return table


def _per_element(op, *args, **kwargs):
    n = next((len(a) for a in args if type(a) in (list, tuple)), None)
    if n is None:
        return NotImplemented
    return [op(*(a[k] if type(a) in (list, tuple) else a for a in args), **kwargs) for k in range(n)]


def _pointwise_with_value(op, t, t1, t2, value=1):
    return op(t, t1, t2, value=value)  # keyword-only in the per-tensor schema, positional in the foreach one


def _foreach_norm_element(t, ord=2, dtype=None):
    return torch.linalg.vector_norm(t, ord, dtype=dtype)
