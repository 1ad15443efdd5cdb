"""The Program: a window as plain data (ops, dataflow, input metadata, live outputs, written
inputs), its encoding for compile workers, its persistent key, and its functional FX graph."""

from __future__ import annotations

import json

import torch
import xxhash

from . import partition
from .backends._common import decode_value, encode_value, resolve_op
from .compilable import _may_raise
from .scalars import _scalar_tensor, _sentinel, lift
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



# ops whose decomposition makes other outputs than the kernel, which other kernels read as the kernel's
_KERNEL_LAYOUTS = frozenset({torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default})


class Program:
    """A window as plain data: no reference to the program's tensors, so it can be compiled later,
    in another thread or process, after the window itself is gone."""

    def __init__(self, ops, inputs, live, mutated, lifted=(), scalars=(), dynamic=(), dims=(), inplace=False,
                 default_dtype=None, derived=(), shared=(), sizes_alone=False):
        self.ops = ops  # [(func, args, kwargs, [(kind, uid, alias) per output])]
        # what ``i * 1.5`` and factories without dtype= make: a window runs under the default dtype
        # it was recorded under (Note [Meta cache key] in adaptive_eager._meta), and so is traced
        self.default_dtype = default_dtype or torch.get_default_dtype()
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
        # (slot, base slot, permutation): slots the graph makes from a written input instead of
        # reading their own (Note [Inputs over one memory] in fuser.compilable)
        self.derived = tuple(derived)
        # live output indices that may share one buffer with each other (Note [Repeated outputs]
        # in fuser.backends.inductor): a captured forward's outputs that only its backward reads
        self.shared = tuple(shared)
        # Note [Sizes that vary, run alone] in fuser.compile: a symbolic program for a backend that
        # compiles static shapes only; the ops its symbols reach run alone, the rest compiles once
        self.sizes_alone = bool(sizes_alone) and bool(self.dims)

    @classmethod
    def from_window(cls, window: Window, live: list[Out], mutated: tuple[int, ...], lifted=(),
                    inplace: bool = False, stores_after_run: bool = False, derived=()) -> Program:
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
            if not node.needed:
                # as in replay: a view nothing needed reads is dead, and so may be its input
                # (``arange(n).unsqueeze(0)`` of a mask that was never used)
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
            if inplace and not stores_after_run and _may_raise(node):  # Note [In-place regions]
                inplace = False
        inputs = [(tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device)) for t in window.real_inputs]
        scalars = tuple(window.scalars[i] for i in lifted)
        return cls(ops, inputs, [o.uid for o in live], mutated, tuple(lifted), scalars,
                   inplace=inplace and bool(mutated), derived=derived)

    def _document(self) -> dict:
        """The program as JSON data: its one encoding (Note [One codec] in fuser.backends._common)."""
        doc = {
            "format": FORMAT,
            "ops": [[str(func), encode_value(args, _leaf), encode_value(kwargs, _leaf),
                     [None if o is None else [o[0], o[1], encode_value(o[2], _leaf)] for o in outs]]
                    for func, args, kwargs, outs in self.ops],
            "inputs": [[list(shape), list(stride), str(dtype).removeprefix("torch."), device]
                       for shape, stride, dtype, device in self.inputs],
            "live": list(self.live), "mutated": list(self.mutated), "lifted": list(self.lifted),
            "scalars": list(self.scalars),
            "dynamic": [list(d) for d in self.dynamic], "dims": [list(d) for d in self.dims],
            "inplace": self.inplace, "default_dtype": str(self.default_dtype).removeprefix("torch."),
        }
        if self.derived:  # only where there are any: the keys of every other program stay as they were
            doc["derived"] = [[v, w, list(perm)] for v, w, perm in self.derived]
        if self.shared:  # likewise
            doc["shared"] = list(self.shared)
        if self.sizes_alone:  # likewise
            doc["sizes_alone"] = True
        return doc

    def to_bytes(self) -> bytes:
        """JSON (OpOverloads and torch enums do not pickle): what a compile worker process gets."""
        return json.dumps(self._document()).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Program:
        doc = json.loads(data)
        if doc.get("format") != FORMAT:
            raise ValueError(f"program format {doc.get('format')} is not {FORMAT}")
        ops = [(resolve_op(name, "program"), decode_value(args, _TAGS), decode_value(kwargs, _TAGS),
                [None if o is None else (o[0], o[1], decode_value(o[2], _TAGS)) for o in outs])
               for name, args, kwargs, outs in doc["ops"]]
        inputs = [(tuple(shape), tuple(stride), getattr(torch, dtype), device) for shape, stride, dtype, device in doc["inputs"]]
        return cls(ops, inputs, doc["live"], tuple(doc["mutated"]), tuple(doc["lifted"]), tuple(doc["scalars"]),
                   [tuple(d) for d in doc["dynamic"]], [tuple(d) for d in doc["dims"]], doc["inplace"],
                   getattr(torch, doc["default_dtype"]),
                   tuple((v, w, tuple(perm)) for v, w, perm in doc.get("derived", ())),
                   tuple(doc.get("shared", ())), doc.get("sizes_alone", False) is True)

    def digest(self, fingerprint: str) -> str:
        """The persistent region key: xxh3_128 of the program's one encoding (``to_bytes``'s, keys
        sorted) and the backend fingerprint. Left out is what does not change the compiled code:
        the lifted floats' values in the window it was made from (example inputs only) and, for a
        symbolic program, that window's sizes of its symbolic dims (hints). Never tensor data; the
        same in every process (Note [Region key]). TypeError for an argument the codec cannot
        describe (such a window has no persistent key and is not compiled)."""
        doc = self._document()
        del doc["scalars"]
        if self.dims:
            symbolic = {(slot, d): f"s{k}" for slot, d, k in self.dims}
            doc["inputs"] = [[[symbolic.get((slot, d), n) for d, n in enumerate(shape)],
                              "contiguous" if any((slot, d) in symbolic for d in range(len(shape))) else stride,
                              dtype, device]
                             for slot, (shape, stride, dtype, device) in enumerate(doc["inputs"])]
        return xxhash.xxh3_128_hexdigest(json.dumps([fingerprint, doc], sort_keys=True).encode())

    def mapped_ops(self, leaf) -> list:
        """The ops with ``leaf`` applied to every argument that is not a list, tuple or dict (an
        output alias's too), in program order: ``at_hints``'s and fuser.shapes' ``_with_symbols``'s walk."""
        def walk(x):
            t = type(x)
            if t is list:
                return [walk(v) for v in x]
            if t is tuple:
                return tuple(walk(v) for v in x)
            if t is dict:
                return {k: walk(v) for k, v in x.items()}
            return leaf(x)

        return [(func, walk(args), walk(kwargs), [None if o is None else (o[0], o[1], walk(o[2])) for o in outs])
                for func, args, kwargs, outs in self.ops]

    def at_hints(self, inplace: bool = False) -> Program:
        """This symbolic program with its symbols at the window's sizes (its hints): a static program
        (``inplace``: writing its inputs itself, Note [In-place regions] in fuser.compilable)."""
        def hint(x):
            if type(x) is _Sym:
                slot, d = self.dynamic[x.k]
                return self.inputs[slot][0][d] * x.factor
            return x

        ops = self.mapped_ops(hint)
        return Program(ops, self.inputs, self.live, self.mutated, self.lifted, self.scalars,
                       inplace=inplace and bool(self.mutated), default_dtype=self.default_dtype,
                       derived=self.derived, shared=self.shared)

    def example_inputs(self) -> list[torch.Tensor]:
        return [torch.empty_strided(shape, stride, dtype=dtype, device=device)
                for shape, stride, dtype, device in self.inputs]

    def evaluate(self, inputs: list) -> list:
        """Run the ops on ``inputs`` (real tensors, or fakes while tracing) one by one: the live
        values, then the written inputs' final values unless ``inplace``. A lifted float is its
        tracing sentinel, so only a traced program has any."""
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

    def graph(self) -> torch.fx.GraphModule:
        """The program as a functional ATen graph: inputs are the real tensors by slot, outputs the
        live values followed by the final values of the written real inputs."""
        from torch.fx.experimental.proxy_tensor import make_fx
        from torch.func import functionalize

        derived = self.derived

        def program(*inputs):
            inputs = list(inputs)
            if derived:  # Note [Inputs over one memory] in fuser.compilable
                for v, w, perm in derived:
                    inputs[v] = torch.ops.aten.permute.default(inputs[w], list(perm))
            return self.evaluate(inputs)

        decompositions = None
        if self.lifted:
            # decomposed ops take numbers as Tensor arguments (mul.Tensor(x, s)), which is what
            # lets a lifted float become a graph input
            from torch._decomp import core_aten_decompositions

            from .backends._common import foreach_decompositions

            # and a foreach op's list of floats is none (Note [Foreach ops] in fuser.backends._common).
            # Not CPU flash attention: its decomposition returns another logsumexp (another shape) and
            # another output layout than the kernel, and the kernel's backward (not decomposed) read
            # them as the kernel makes them: a training step with lifted floats got wrong gradients
            decompositions = {op: f for op, f in core_aten_decompositions().items() if op not in _KERNEL_LAYOUTS}
            decompositions.update(foreach_decompositions())
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
        self.lifted_inputs = lift(gm, self.lifted) if self.lifted else []
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
        if self.shared:  # Note [Repeated outputs] in fuser.backends.inductor
            gm.meta["shared_outputs"] = self.shared
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

    def lifted_examples(self) -> list[torch.Tensor]:
        values = dict(zip(self.lifted, self.scalars))
        return [_scalar_tensor(values[k], dtype=dt) for k, dt in self.lifted_inputs]


def _leaf(x) -> dict | None:
    """The Program's own argument kinds, tagged for ``encode_value``."""
    t = type(x)
    if t is _Ref:
        return {"$ref": x.uid}
    if t is _In:
        return {"$in": x.slot}
    if t is _Lifted:
        return {"$lifted": x.index}
    if t is _Sym:
        return {"$sym": [x.k, x.factor]}
    return None


_TAGS = {"$ref": _Ref, "$in": _In, "$lifted": _Lifted, "$sym": lambda v: _Sym(*v)}  # ``_leaf``'s, back
