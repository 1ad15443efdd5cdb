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
left is a plan, the outer graph in program order: call a piece, take an item of its result, or
run one op alone (eagerly, as the window's replay would). It is stored in the replay backend's
JSON (``encode_arg``); the artifact is the plan and the pieces' artifacts (Note [Artifact
container] in ``fuser.backends._common``). ``load`` checks the plan's structure and rebuilds the
plan as an FX graph calling the loaded pieces: one callable with the backend's calling
convention, so the fuser runs a split region like any other. A graph with no such node is not split: the backend gets it whole.

Nodes that run alone are counted by reason per region compiled or loaded (``metrics()["run_alone"]``).
A split region is compiled in place (Note [In-place regions] in ``fuser.compilable``) only with a
backend that stores after its run, its stores one last piece (Note [A split region's stores]);
otherwise it writes back through the fuser: a check can fail part way, after a piece has run.
"""

from __future__ import annotations

import copy
import threading
from collections import Counter

import torch
from torch.fx.passes.operator_support import OperatorSupportBase

from .backends._common import (
    BackendCompileError, below_autograd, decode_arg, encode_arg, launches_of, launches_op, op_name, pack_sections,
    resolve_op, unpack_sections,
)

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
    def __init__(self, alone: dict, stores: set):
        self.alone, self.stores = alone, stores

    def is_node_supported(self, submodules, node: torch.fx.Node) -> bool:
        return node.op == "call_function" and node not in self.alone and node not in self.stores


# Note [A split region's stores]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A region that writes its inputs (Note [In-place regions] in fuser.compilable) ends in
# functionalization's ``copy_`` of each new value into its input. Split, it wrote back through the
# fuser, one copy (one launch) per written tensor: 128 a step of examples/finetune_transformer.py on
# the emulated device. With a backend that stores only once its executable has finished
# (``stores_after_run``) those ``copy_`` nodes become one piece of their own, run last, after every
# other piece and every node that runs alone: one launch stores every input. Last, so no node reads
# an input after its store (the pieces' graph has no edge from a store to a later reader of the old
# value), and a node that raises (a check, an index out of range run alone) raises before anything
# is stored, so replaying the window after a failed run applies no update twice.


def _is_store(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and node.target is torch.ops.aten.copy_.default and not node.users
            and node.args[0].op == "placeholder")


def split(gm: torch.fx.GraphModule, examples: list[torch.Tensor], alone: dict, backend) -> bytes:
    """Compile the pieces of ``gm`` around the ``alone`` nodes; the artifact ``load`` takes.
    ``gm`` is not changed (the pieces are cut from a copy). The plan is the outer graph in the
    replay backend's JSON (``encode_arg``), a piece's call as ``{"piece": k, "args": [...]}``."""
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
    # Note [A split region's stores]: the graph's stores into its inputs, one piece run last
    stores = [n for n in gm.graph.nodes if _is_store(n)] if getattr(backend, "stores_after_run", False) else []
    partitioner = CapabilityBasedPartitioner(gm, _Compilable(alone, set(stores)), allows_single_node_partition=True)
    # A piece of views only computes nothing: Inductor would compile no code for it (AOTAutograd
    # turns outputs that alias inputs into views it regenerates outside the graph), so its views
    # stay in the plan, where they cost what they cost in eager.
    pieces = [dict.fromkeys(p.nodes) for p in partitioner.propose_partitions() if any(_computes(n) for n in p.nodes)]
    if stores:
        pieces.append(dict.fromkeys(stores))
    outer = fuse_by_partitions(gm, pieces, prefix="piece_", always_return_tuple=True)
    if stores:
        last = next(n for n in outer.graph.nodes if n.op == "call_module" and n.target == f"piece_{len(pieces) - 1}")
        if last.users:
            raise BackendCompileError("split: the stores' piece has outputs")
        next(n for n in outer.graph.nodes if n.op == "output").prepend(last)
    index: dict = {}
    nodes, parts, outputs = [], [], []
    for node in outer.graph.nodes:
        if node.op == "placeholder":
            index[node] = len(index)
        elif node.op == "output":
            outputs = [encode_arg(n, index, "split", "output") for n in node.args[0]]
        elif node.op == "call_module":
            sub = getattr(outer, node.target)
            sub_examples = [_example(n.meta["val"]) for n in sub.graph.nodes if n.op == "placeholder"]
            parts.append(backend.compile(sub, sub_examples))
            nodes.append({"piece": len(parts) - 1, "args": encode_arg(list(node.args), index, "split", node.target)})
            index[node] = len(index)
        else:
            op = op_name(node.target)
            nodes.append({"op": op, "args": encode_arg(node.args, index, "split", op),
                          "kwargs": {k: encode_arg(v, index, "split", op) for k, v in node.kwargs.items()}})
            index[node] = len(index)
    if len(examples) != sum(1 for n in outer.graph.nodes if n.op == "placeholder"):
        raise BackendCompileError(f"split graph does not take the region's {len(examples)} inputs")
    plan = {"inputs": len(examples), "nodes": nodes, "outputs": outputs}
    if stores:
        plan["stores"] = len(parts) - 1  # Note [A check before the stores]
    return pack_sections({"plan": plan}, parts)


def _computes(node: torch.fx.Node) -> bool:
    """A call that is more than a view of its inputs (``operator.getitem`` of a split is one)."""
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and not node.target.is_view


def counts(alone: dict) -> dict:
    return dict(Counter(alone.values()))


def _example(val) -> torch.Tensor:
    return torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device=val.device)


def load(artifact: bytes, backend):
    """The callable of a split artifact: the backend's calling convention (a list of tensors in, a
    tuple out, below autograd and autocast). The plan becomes an FX graph calling the loaded
    pieces and the ops that run alone, so its generated code frees each value after its last use."""
    header, pieces = unpack_sections(artifact, "split")
    parts = [backend.load(a) for a in pieces]
    graph = torch.fx.Graph()
    launches = 0  # Note [Launches of a compiled callable]: each piece's, and each op run alone that computes
    check = threading.local()  # Note [A check before the stores]
    try:
        plan = header["plan"]
        stores = plan.get("stores")
        if stores is not None and (type(stores) is not int or stores != len(parts) - 1):
            raise IndexError(f"stores piece {stores!r} of {len(parts)}")
        values = [graph.placeholder(f"in{i}") for i in range(plan["inputs"])]
        outputs = None
        for node in plan["nodes"]:
            if "piece" in node:
                piece = node["piece"]
                if type(piece) is not int or not 0 <= piece < len(parts):
                    raise IndexError(f"piece {piece!r} of {len(parts)}")
                args = (decode_arg(node["args"], values, "split"),)
                if piece == stores:  # the last node: every output is computed by now
                    outputs = tuple(decode_arg(o, values, "split") for o in plan["outputs"])
                    values.append(graph.call_function(_checked_stores(parts[piece], check), args + (outputs,)))
                else:
                    values.append(graph.call_function(parts[piece], args))
                launches += launches_of(parts[piece])
            else:
                kwargs = {k: decode_arg(v, values, "split") for k, v in node["kwargs"].items()}
                op = resolve_op(node["op"], "split")
                values.append(graph.call_function(op, decode_arg(node["args"], values, "split"), kwargs))
                launches += launches_op(op)
        graph.output(outputs if outputs is not None else tuple(decode_arg(o, values, "split") for o in plan["outputs"]))
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, AssertionError) as e:  # FX asserts
        raise BackendCompileError(f"split: the artifact's plan is malformed: {type(e).__name__}: {e}") from e
    forward = torch.fx.GraphModule(torch.nn.Module(), graph).forward
    run = below_autograd(lambda inputs: forward(*inputs))
    run.guards = None
    run.launches = launches
    if stores is not None:
        def checked(inputs, before_stores):
            check.before = before_stores
            try:
                return run(inputs)
            finally:
                check.before = None

        run.checked = checked
    return run


# Note [A check before the stores]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A split region that writes its inputs stores them in its last piece (Note [A split region's
# stores]). The first run of a region for a new exact key checks its outputs against the window's
# placeholders, and a mismatch replays the window (Note [Sizes that vary, run alone] in
# fuser.compile, ``_run_checked`` in fuser.launch); a replay after the stores would apply the
# window's updates twice. ``run.checked(inputs, before_stores)`` calls ``before_stores(outputs)``
# after every output is computed and before the stores piece runs: it raises, nothing is stored.
def _checked_stores(piece, check):
    def stores(args, outputs):
        before = getattr(check, "before", None)
        if before is not None:
            before(outputs)
        return piece(args)

    return stores
