"""The Program: a window as plain data (ops, dataflow, input metadata, live outputs, written
inputs), its encoding for compile workers, its persistent key, and its functional FX graph."""

from __future__ import annotations

import json

import torch
import xxhash

from . import partition
from .backends._common import decode_torch_value, encode_torch_value
from .compilable import _may_raise
from .scalars import LiftError, _scalar_tensor, _sentinel, _sentinel_index
from .window import ALIAS, Out, Window

FORMAT = 5  # bump when Program's encoding or the artifact packing changes


class _Ref:
    """A value produced inside the program (an ``Out.uid``)."""

    __slots__ = ("uid",)

    def __init__(self, uid: int):
        self.uid = uid

    def __repr__(self) -> str:
        return f"%{self.uid}"


class _In:
    """A real input of the program, by slot."""

    __slots__ = ("slot",)

    def __init__(self, slot: int):
        self.slot = slot

    def __repr__(self) -> str:
        return f"in{self.slot}"


class _Lifted:
    """A float argument that the compiled region takes as a runtime input (by ``Window.scalars``
    index): Note [Scalar lifting]."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"scalar{self.index}"


class _Sym:
    """An int argument that follows a dynamic size: ``factor`` times symbol ``k`` (Note [Dynamic
    shapes]); symbol ``k`` is the size of the input dimension ``Program.dynamic[k]``."""

    __slots__ = ("k", "factor")

    def __init__(self, k: int, factor: int = 1):
        self.k = k
        self.factor = factor

    def __repr__(self) -> str:
        return f"sym{self.k}" if self.factor == 1 else f"{self.factor}*sym{self.k}"



class Program:
    """A window as plain data: no reference to the program's tensors, so it can be compiled later,
    in another thread or process, after the window itself is gone."""

    def __init__(self, ops, inputs, live, mutated, lifted=(), scalars=(), dynamic=(), dims=(), inplace=False):
        self.ops = ops  # [(func, args, kwargs, [(kind, uid, alias) per output])]
        self.inputs = inputs  # [(shape, stride, dtype, device)] by slot
        self.live = live  # uids of the outputs, in order
        self.mutated = mutated  # slots whose final values follow the live outputs
        self.lifted = lifted  # Window.scalars indices that are runtime inputs
        self.scalars = scalars  # their values in the window compiled from (example inputs)
        # Note [Dynamic shapes]: symbol k is the size of input dimension ``dynamic[k]`` (slot, dim);
        # ``dims`` are all the input dimensions that are symbolic, as (slot, dim, k). Inputs with a
        # symbolic dimension are contiguous; ``inputs`` holds the sizes of one window (the hints).
        self.dynamic = tuple(dynamic)
        self.dims = tuple(dims)
        # Note [In-place regions]: the compiled region writes the ``mutated`` inputs itself (the
        # graph keeps functionalization's trailing copy_ nodes) instead of returning their values
        self.inplace = bool(inplace) and not self.dims

    @classmethod
    def from_window(cls, window: Window, live: list[Out], mutated: tuple[int, ...], lifted=(),
                    inplace: bool = False) -> Program:
        slots = {id(t): s for s, t in enumerate(window.real_inputs)}
        lifted_set = set(lifted)

        def enc(a):
            if type(a) is Out:
                return _Ref(a.uid)
            if type(a) is list:
                return [enc(x) for x in a]
            if isinstance(a, torch.Tensor):
                return _In(slots[id(a)])
            return a

        ops = []
        for node in window.nodes:
            if not (node.needed or node.is_view):
                continue
            outs = [None if o is None else (o.kind, o.uid, enc(o.alias) if o.kind == ALIAS else None)
                    for o in node.outs]
            kwargs = {k: enc(v) for k, v in node.kwargs.items()} if node.kwargs else {}
            args = [enc(a) for a in node.args]
            for n, pos in enumerate(node.fpos):
                index = node.fbase + n
                if index in lifted_set:
                    if type(pos) is int:
                        args[pos] = _Lifted(index)
                    elif type(pos) is str:
                        kwargs[pos] = _Lifted(index)
                    else:
                        args[pos[0]] = list(args[pos[0]])
                        args[pos[0]][pos[1]] = _Lifted(index)
            ops.append((node.func, args, kwargs, outs))
            if inplace and _may_raise(node):
                inplace = False
        inputs = [(tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device)) for t in window.real_inputs]
        scalars = tuple(window.scalars[i] for i in lifted)
        return cls(ops, inputs, [o.uid for o in live], mutated, tuple(lifted), scalars,
                   inplace=inplace and bool(mutated))

    def to_bytes(self) -> bytes:
        """JSON (OpOverloads and torch enums do not pickle): what a compile worker process gets."""
        doc = {
            "format": FORMAT,
            "ops": [[str(func), _enc(args), _enc(kwargs), [None if o is None else [o[0], o[1], _enc(o[2])] for o in outs]]
                    for func, args, kwargs, outs in self.ops],
            "inputs": [[list(shape), list(stride), str(dtype).removeprefix("torch."), device]
                       for shape, stride, dtype, device in self.inputs],
            "live": list(self.live), "mutated": list(self.mutated), "lifted": list(self.lifted),
            "scalars": list(self.scalars),
            "dynamic": [list(d) for d in self.dynamic], "dims": [list(d) for d in self.dims],
            "inplace": self.inplace,
        }
        return json.dumps(doc).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Program:
        doc = json.loads(data)
        if doc.get("format") != FORMAT:
            raise ValueError(f"program format {doc.get('format')} is not {FORMAT}")
        ops = [(_op(name), _dec(args), _dec(kwargs), [None if o is None else (o[0], o[1], _dec(o[2])) for o in outs])
               for name, args, kwargs, outs in doc["ops"]]
        inputs = [(tuple(shape), tuple(stride), getattr(torch, dtype), device) for shape, stride, dtype, device in doc["inputs"]]
        return cls(ops, inputs, doc["live"], tuple(doc["mutated"]), tuple(doc["lifted"]), tuple(doc["scalars"]),
                   [tuple(d) for d in doc.get("dynamic", ())], [tuple(d) for d in doc.get("dims", ())],
                   doc.get("inplace", False))

    def digest(self, fingerprint: str) -> str:
        """The persistent region key: xxh3_128 of the program's structure (ops, arguments, input
        metadata, outputs, lifted floats) and the backend fingerprint. Never tensor data; the
        same in every process (Note [Region key])."""
        if not self.dims:
            text = repr((FORMAT, fingerprint, self.ops, self.inputs, self.live, self.mutated, self.lifted,
                         self.inplace))
            return xxhash.xxh3_128_hexdigest(text.encode())
        # symbolic: the sizes of the window it was made from are only hints, so not part of the key
        symbolic = {(slot, d): f"s{k}" for slot, d, k in self.dims}
        inputs = [(tuple(symbolic.get((slot, d), n) for d, n in enumerate(shape)),
                   "contiguous" if any((slot, d) in symbolic for d in range(len(shape))) else stride, dtype, device)
                  for slot, (shape, stride, dtype, device) in enumerate(self.inputs)]
        text = repr((FORMAT, fingerprint, self.ops, inputs, self.live, self.mutated, self.lifted, self.dims))
        return xxhash.xxh3_128_hexdigest(text.encode())

    def example_inputs(self) -> list[torch.Tensor]:
        return [torch.empty_strided(shape, stride, dtype=dtype, device=device)
                for shape, stride, dtype, device in self.inputs]

    def graph(self) -> torch.fx.GraphModule:
        """The program as a functional ATen graph: inputs are the real tensors by slot, outputs the
        live values followed by the final values of the written real inputs."""
        from torch.fx.experimental.proxy_tensor import make_fx
        from torch.func import functionalize

        def program(*inputs):
            env: dict[int, object] = {}

            def value(a):
                if type(a) is _Ref:
                    return env[a.uid]
                if type(a) is _In:
                    return inputs[a.slot]
                if type(a) is _Lifted:
                    return _sentinel(a.index)
                if type(a) is _Sym:
                    slot, d = self.dynamic[a.k]
                    return inputs[slot].shape[d] * a.factor
                if type(a) is list:
                    return [value(x) for x in a]
                return a

            for func, args, kwargs, outs in self.ops:
                res = func(*[value(a) for a in args], **{k: value(v) for k, v in kwargs.items()})
                results = res if isinstance(res, (tuple, list)) else (res,)
                for out, r in zip(outs, results):
                    if out is not None:
                        kind, uid, alias = out
                        env[uid] = value(alias) if kind == ALIAS else r
            if self.inplace:
                return [env[u] for u in self.live]
            return [env[u] for u in self.live] + [inputs[s] for s in self.mutated]

        decompositions = None
        if self.lifted:
            # decomposed ops take numbers as Tensor arguments (mul.Tensor(x, s)), which is what
            # lets a lifted float become a graph input
            from torch._decomp import core_aten_decompositions

            decompositions = core_aten_decompositions()
        examples = self.example_inputs()
        mode = None
        if self.dims:
            examples, mode = self._symbolic_inputs(examples)
        with torch.no_grad():
            gm = make_fx(
                functionalize(program, remove="mutations"),
                decomposition_table=decompositions,
                tracing_mode="symbolic" if self.dims else "fake",
            )(*examples)
        # functionalize writes mutated inputs back with trailing copy_ nodes; the fuser does
        # write-back itself (backends take functional graphs) and those values are outputs already.
        for n in list(gm.graph.nodes):
            if n.op == "call_function" and n.target is torch.ops.aten.copy_.default and not n.users:
                if n.args[0].op == "placeholder" and not self.inplace:
                    gm.graph.erase_node(n)
        gm.graph.eliminate_dead_code(is_impure_node=partition.keep_checks)  # Note [Partitions]
        self.lifted_inputs = self._lift(gm) if self.lifted else []
        if self.lifted_inputs:
            # the new placeholders carry a value like make_fx's: partition.split and backends read it
            from torch._guards import detect_fake_mode
            from torch._subclasses.fake_tensor import FakeTensorMode

            placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
            fake = mode or detect_fake_mode([p.meta.get("val") for p in placeholders]) or FakeTensorMode()
            for ph, (_, dtype) in zip(placeholders[len(self.inputs):], self.lifted_inputs):
                ph.meta["val"] = fake.from_tensor(torch.tensor(0.0, dtype=dtype))
        if mode is not None:
            # standalone_compile(dynamic_shapes="from_graph") finds the ShapeEnv through these
            for out in next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]:
                out.meta["example_value"] = out.meta.get("val")
        gm.recompile()
        return gm

    def _symbolic_inputs(self, examples: list[torch.Tensor]):
        """Fake inputs whose ``dims`` are symbols (sizes >= 2, the hints being this program's)."""
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

        mode = FakeTensorMode(shape_env=ShapeEnv())
        symbolic = {(slot, d) for slot, d, _ in self.dims}
        fakes = []
        for slot, t in enumerate(examples):
            sizes = [DimDynamic.DYNAMIC if (slot, d) in symbolic else DimDynamic.STATIC for d in range(t.dim())]
            fakes.append(mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes)))
        return fakes, mode

    def _lift(self, gm: torch.fx.GraphModule) -> list[tuple[int, torch.dtype]]:
        """Replace the sentinel floats by new placeholders; return (scalar index, dtype) per new
        input, in order. Raises LiftError when a sentinel cannot become a tensor input."""
        graph = gm.graph
        last_input = [n for n in graph.nodes if n.op == "placeholder"][-1]
        made: dict[tuple[int, torch.dtype], torch.fx.Node] = {}
        spec: list[tuple[int, torch.dtype]] = []
        for name, buf in list(gm.named_buffers()) + list(gm.named_parameters()):
            if buf.is_floating_point() and torch.isnan(buf).any():
                raise LiftError(f"a lifted float was folded into the constant {name}")
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            schema = getattr(node.target, "_schema", None)
            for where, arg in list(enumerate(node.args)) + list(node.kwargs.items()):
                k = _sentinel_index(arg)
                if k is None:
                    continue
                if k < 0:
                    raise LiftError(f"{node.target} uses a value derived from a lifted float")
                argument = None
                if schema is not None:
                    for a in schema.arguments:
                        if (a.name == where) if type(where) is str else (schema.arguments.index(a) == where):
                            argument = a
                alpha = where == "alpha" and node.target in (torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor)
                if not alpha and (argument is None or str(argument.type) not in ("Tensor", "Optional[Tensor]")):
                    raise LiftError(f"{node.target} needs a lifted float as a Python number")
                first = next((a for a in node.args if isinstance(a, torch.fx.Node)), None)
                other = first.meta.get("val") if first is not None else None
                dtype = torch.float64 if getattr(other, "dtype", None) is torch.float64 else torch.float32
                ph = made.get((k, dtype))
                if ph is None:
                    with graph.inserting_after(last_input):
                        ph = made[(k, dtype)] = graph.placeholder(f"lifted_{k}_{len(made)}")
                    last_input = ph
                    spec.append((k, dtype))
                if alpha:
                    # x + alpha * y with alpha an input: the Scalar alpha becomes a multiply
                    with graph.inserting_before(node):
                        scaled = graph.call_function(torch.ops.aten.mul.Tensor, (node.args[1], ph))
                    scaled.meta["val"] = node.meta.get("val")
                    node.update_arg(1, scaled)
                    node.kwargs = {k: v for k, v in node.kwargs.items() if k != "alpha"}
                elif type(where) is str:
                    node.update_kwarg(where, ph)
                else:
                    node.update_arg(where, ph)
        found = {k for k, _ in spec}
        if found != set(self.lifted):
            raise LiftError("a lifted float disappeared from the graph")
        return spec

    def lifted_examples(self) -> list[torch.Tensor]:
        values = dict(zip(self.lifted, self.scalars))
        return [_scalar_tensor(values[k], dtype=dt) for k, dt in self.lifted_inputs]




def _enc(x):
    # JSON keeps 1, 1.0 and True apart; everything else is tagged
    if x is None or type(x) in (bool, int, float, str):
        return x
    if type(x) is list:
        return [_enc(v) for v in x]
    if type(x) is tuple:
        return {"$tuple": [_enc(v) for v in x]}
    if type(x) is dict:
        return {"$dict": {k: _enc(v) for k, v in x.items()}}
    if type(x) is _Ref:
        return {"$ref": x.uid}
    if type(x) is _In:
        return {"$in": x.slot}
    if type(x) is _Lifted:
        return {"$lifted": x.index}
    if type(x) is _Sym:
        return {"$sym": [x.k, x.factor]}
    tagged = encode_torch_value(x)
    if tagged is None:
        raise TypeError(f"cannot send {x!r} ({type(x).__name__}) to a compile worker")
    return tagged


def _dec(x):
    if type(x) is list:
        return [_dec(v) for v in x]
    if type(x) is not dict:
        return x
    ((tag, v),) = x.items()
    if tag == "$tuple":
        return tuple(_dec(e) for e in v)
    if tag == "$dict":
        return {k: _dec(e) for k, e in v.items()}
    if tag == "$ref":
        return _Ref(v)
    if tag == "$in":
        return _In(v)
    if tag == "$lifted":
        return _Lifted(v)
    if tag == "$sym":
        return _Sym(*v)
    return decode_torch_value(tag, v)


def _op(name: str):
    namespace, packet, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)
