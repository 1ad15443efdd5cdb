"""Partitions: the pieces of a region's graph a backend compiles, and the nodes that run alone.

Note [Partitions]
A window becomes one graph (``Program.graph``). Some of its nodes must not be compiled:

- check ops (``_linalg_check_errors``, ``_assert_async``...): they return nothing and write
  nothing; they exist only to raise eager's error, so a compiler would drop them as dead code;
- nodes the backend declares it cannot compile (``Backend.unsupported(node)`` returns a reason: a
  neuron backend names the ops neuronx-cc has no lowering for). Inductor lowers every ATen op or
  calls it as an extern kernel, so it declares none;
- ops the backend failed on: a compile that fails with a ``BackendCompileError`` naming an op of
  the graph (``target``) is retried with that op run alone ("compile_failed"), a few times, so
  one op a compiler cannot handle no longer sends the whole window to replay.

Random ops and data-dependent ops never reach a graph: random draws run at record time (Note [RNG]
in ``adaptive_eager._ops``) and ops that need data flush the window first.

``split`` cuts such a graph with torch.fx's ``CapabilityBasedPartitioner`` into maximal pieces
that contain no such node and compiles each piece with the backend as a graph of its own. What is
left is a plan, in program order: call a piece, take an item of its result, or run one op alone
(eagerly, as the window's replay would). The artifact is the plan (JSON) and the pieces' artifacts;
``load`` turns it into one callable with the backend's calling convention, so the fuser runs a
split region like any other. A graph with no such node is not split: the backend gets it whole.

Nodes that run alone are counted by reason per region compiled or loaded (``metrics()["run_alone"]``).
A split region is never compiled in place (Note [In-place regions] in ``fuser.compiled``): a check
can fail part way, after a piece has run.
"""

from __future__ import annotations

import copy
import json
import operator
import pickle
from collections import Counter

import torch
from torch.fx.passes.operator_support import OperatorSupportBase

from .backends._common import BackendCompileError, below_autograd, decode_torch_value, encode_torch_value, op_name

_CHECK_OPS: dict = {}


def is_check(func) -> bool:
    """An op that returns nothing and writes nothing exists only to raise (``_linalg_check_errors``)."""
    known = _CHECK_OPS.get(func)
    if known is None:
        schema = func._schema
        known = _CHECK_OPS[func] = not schema.returns and not any(
            a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    return known


def alone(gm: torch.fx.GraphModule, backend, failed=frozenset()) -> dict:
    """{node: reason} for the nodes of ``gm`` that must run outside compiled code; ``failed``: ops
    the backend failed to compile in this graph before."""
    unsupported = getattr(backend, "unsupported", None)
    found = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if is_check(node.target):
            why = "check_op"
        elif node.target in failed:
            why = "compile_failed"
        else:
            why = unsupported(node) if unsupported is not None else None
        if why:
            found[node] = why
    return found


def keep_checks(node: torch.fx.Node) -> bool:
    """``is_impure_node`` for dead-code elimination: check ops stay (they raise), as do FX's own."""
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and is_check(node.target):
        return True
    return node.is_impure()


class _Compilable(OperatorSupportBase):
    def __init__(self, alone: dict):
        self.alone = alone

    def is_node_supported(self, submodules, node: torch.fx.Node) -> bool:
        return node.op == "call_function" and node not in self.alone


# plan steps: each appends one value to the run's environment (inputs first)
_PART, _GET, _OP = 0, 1, 2


def split(gm: torch.fx.GraphModule, examples: list[torch.Tensor], alone: dict, backend) -> bytes:
    """Compile the pieces of ``gm`` around the ``alone`` nodes; the artifact ``load`` takes.
    ``gm`` is not changed (the pieces are cut from a copy)."""
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
    from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

    names = {n.name: why for n, why in alone.items()}
    gm = copy.deepcopy(gm)
    alone = {n: names[n.name] for n in gm.graph.nodes if n.name in names}

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in val.shape):
                raise BackendCompileError("a region with nodes that run alone is compiled per shape")
    partitioner = CapabilityBasedPartitioner(gm, _Compilable(alone), allows_single_node_partition=True)
    pieces = [p for p in partitioner.propose_partitions() if any(n.op == "call_function" for n in p.nodes)]
    outer = fuse_by_partitions(gm, [dict.fromkeys(p.nodes) for p in pieces], prefix="piece_",
                               always_return_tuple=True)
    index: dict = {}
    steps, parts = [], []

    def ref(a):
        if isinstance(a, torch.fx.Node):
            return {"$v": index[a]}
        if type(a) in (list, tuple):
            return [ref(x) for x in a] if type(a) is list else {"$tuple": [ref(x) for x in a]}
        if type(a) is dict:
            return {"$dict": {k: ref(v) for k, v in a.items()}}
        if a is None or type(a) in (bool, int, float, str):
            return a
        tagged = encode_torch_value(a)
        if tagged is None:
            raise BackendCompileError(f"cannot store argument {a!r} of an op that runs alone")
        return tagged

    outputs = None
    for node in outer.graph.nodes:
        if node.op == "placeholder":
            index[node] = len(index)
            continue
        if node.op == "output":
            outputs = [index[a] for a in node.args[0]]
            continue
        if node.op == "call_module":
            sub = getattr(outer, node.target)
            sub_examples = [_example(n.meta["val"]) for n in sub.graph.nodes if n.op == "placeholder"]
            parts.append(backend.compile(sub, sub_examples))
            steps.append([_PART, len(parts) - 1, [index[a] for a in node.args]])
        elif node.target is operator.getitem:
            steps.append([_GET, index[node.args[0]], node.args[1]])
        elif isinstance(node.target, torch._ops.OpOverload):
            steps.append([_OP, op_name(node.target), ref(list(node.args)), ref(dict(node.kwargs))])
        else:
            raise BackendCompileError(f"cannot run {op_name(node.target)} alone (node {node.name})")
        index[node] = len(index)
    n_inputs = sum(1 for n in outer.graph.nodes if n.op == "placeholder")
    if n_inputs != len(examples):
        raise BackendCompileError(f"split graph takes {n_inputs} inputs for {len(examples)} examples")
    plan = {"inputs": n_inputs, "steps": steps, "outputs": outputs}
    return pickle.dumps({"plan": json.dumps(plan), "parts": parts})


def counts(alone: dict) -> dict:
    return dict(Counter(alone.values()))


def _example(val) -> torch.Tensor:
    return torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device=val.device)


def load(artifact: bytes, backend):
    """The callable of a split artifact: the backend's calling convention (a list of tensors in, a
    tuple out, below autograd and autocast)."""
    doc = pickle.loads(artifact)
    plan = json.loads(doc["plan"])
    parts = [backend.load(a) for a in doc["parts"]]
    n_inputs, outputs = plan["inputs"], plan["outputs"]
    steps = []
    last: dict[int, int] = {}  # value index -> the last step that reads it
    for s, step in enumerate(plan["steps"]):
        kind = step[0]
        if kind == _PART:
            steps.append((_PART, parts[step[1]], step[2]))
            reads = step[2]
        elif kind == _GET:
            steps.append((_GET, step[1], step[2]))
            reads = [step[1]]
        else:
            namespace, packet, overload = step[1].split(".")
            func = getattr(getattr(getattr(torch.ops, namespace), packet), overload)
            args, kwargs = _resolve_plan(step[2]), _resolve_plan(step[3])
            steps.append((_OP, func, (args, kwargs)))
            reads = _refs(step[2]) + _refs(step[3])
        for i in reads:
            last[i] = s
    keep = set(outputs)
    drop = [[] for _ in steps]  # values no later step reads: freed as the run goes
    for i, s in last.items():
        if i not in keep:
            drop[s].append(i)

    def run(inputs: list[torch.Tensor]) -> tuple:
        env = list(inputs)
        inputs.clear()  # the backends' convention: the callable owns the list
        for (kind, a, b), dead in zip(steps, drop):
            if kind == _PART:
                env.append(a([env[i] for i in b]))
            elif kind == _GET:
                env.append(env[a][b])
            else:
                args, kwargs = b
                r = a(*_bind(args, env), **_bind(kwargs, env))
                env.append(r)
            for i in dead:
                env[i] = None
        return tuple(env[i] for i in outputs)

    run = below_autograd(run)
    run.guards = None
    return run


class _V:
    """A value of the plan's environment."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


def _resolve_plan(x):
    if type(x) is list:
        return [_resolve_plan(v) for v in x]
    if type(x) is dict:
        ((tag, v),) = x.items()
        if tag == "$v":
            return _V(v)
        if tag == "$tuple":
            return tuple(_resolve_plan(e) for e in v)
        if tag == "$dict":
            return {k: _resolve_plan(e) for k, e in v.items()}
        return decode_torch_value(tag, v)
    return x


def _refs(x) -> list[int]:
    if type(x) is list:
        return [i for v in x for i in _refs(v)]
    if type(x) is dict:
        ((tag, v),) = x.items()
        if tag == "$v":
            return [v]
        if tag in ("$tuple", "$dict"):
            return _refs(list(v) if tag == "$tuple" else list(v.values()))
    return []


def _bind(x, env):
    t = type(x)
    if t is _V:
        return env[x.i]
    if t is list:
        return [_bind(v, env) for v in x]
    if t is tuple:
        return tuple(_bind(v, env) for v in x)
    if t is dict:
        return {k: _bind(v, env) for k, v in x.items()}
    return x
