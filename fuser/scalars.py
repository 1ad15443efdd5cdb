"""Scalar lifting: a float argument that changes between windows of one structure becomes a
runtime input of the compiled region instead of a constant baked into it.

Note [Scalar lifting]
~~~~~~~~~~~~~~~~~~~~~
A learning-rate schedule or Adam's bias correction passes a new Python float every step; baked into
the compiled code, each value would be a region of its own, compiled again every step. So floats
are kept apart from the structure from recording on: an op's float arguments (where its schema
takes a Scalar or a Tensor that a Python float may stand for, ``OpFacts.liftable``) are recorded as
the type ``float`` in the op's signature and their values appended to ``Window.scalars``
(``Node.fbase``/``Node.fpos`` say where each sits in the op's arguments). Ops whose floats decide an
output shape (``arange``, ``interpolate``, ...) keep them in the signature instead (``_ops``).
At the flush, ``_scalar_key`` finds the structure's ``_Group`` and compares the values with those of
its last window: a position whose value changed ``LIFT_AFTER`` times is lifted (a compile of the
group after one with fewer floats lifted counts as a ``scalar_lifted`` recompile: ``lift_cause``;
a float lifted before anything of the group compiled recompiles nothing). The region key is (group, lifted positions, the values not lifted):
values that stay put are still baked in, so a constant ``0.9`` costs nothing at run time.
In the Program a lifted float is ``_Lifted(index)``; the graph is traced with a quiet-NaN sentinel
carrying the index in its payload (``_sentinel``), and ``lift`` turns each sentinel into a 0-dim
tensor placeholder (float64 next to a float64 operand, else float32: what eager's scalar promotion
computes with). Anything that transformed the sentinel (a NaN without our payload), an op that needs
the float as a Python number, or a sentinel folded into a constant raises ``LiftError``: the group
is marked ``unliftable`` and its windows go back to one region per value (``not_compiled``
"unliftable_scalars"). At run time each lifted float is passed as ``torch.scalar_tensor`` of the
dtype the compile chose (``launch._inputs``), one per run, after the real inputs.
"""

from __future__ import annotations

import struct
from collections import Counter
from itertools import compress as _compress

import torch

from .lru import LRU

# a lifted scalar's 0-dim input: torch.tensor's argument parsing and type inference cost twice as
# much, per scalar per run (AdamW lifts 2 per parameter)
_scalar_tensor = torch.scalar_tensor


LIFT_AFTER = 2  # a float argument that changed this many times becomes a runtime input


class _Group:
    """What windows of one structure (scalar values aside) have shown: Note [Scalar lifting]."""

    __slots__ = ("last", "changes", "lifted", "unliftable", "keep", "compiled_lifted")

    def __init__(self):
        self.last: tuple | None = None
        self.changes: Counter[int] = Counter()
        self.lifted: tuple[int, ...] = ()
        self.unliftable = False  # the compiled graph could not take these floats as inputs
        self.keep: list[bool] | None = None  # per scalar: not lifted (the baked ones), for compress
        self.compiled_lifted: tuple[int, ...] | None = None  # ``lifted`` at its last compile; None: none yet


GROUPS = LRU(_Group)  # structure -> its scalar group; as many as the region LRU holds regions


def _scalar_key(structure, scalars: list) -> tuple:
    """The part of a region key that scalar values contribute, after lifting the ones that vary."""
    group = GROUPS.get(structure)
    values = tuple(scalars)
    last = group.last
    baked = None
    if last is not None and values != last and len(values) == len(last) and not group.unliftable:
        if group.lifted:  # the lifted values change every window: look further only if others do
            keep = _keep(group, len(values))
            baked = tuple(_compress(values, keep))
            changed = baked != tuple(_compress(last, keep))
        else:
            changed = True
        if changed:
            lifted = set(group.lifted)
            for i, (a, b) in enumerate(zip(values, last)):
                if a != b and i not in lifted:
                    group.changes[i] += 1
                    if group.changes[i] >= LIFT_AFTER:
                        lifted.add(i)
            if len(lifted) != len(group.lifted):
                group.lifted = tuple(sorted(lifted))
                group.keep = baked = None
    group.last = values
    if not group.lifted:
        return (group, (), values)
    if baked is None:
        baked = tuple(_compress(values, _keep(group, len(values))))
    return (group, group.lifted, baked)


def lift_cause(group: _Group | None) -> str | None:
    """"scalar_lifted" when ``group`` compiles again because more of its floats are lifted than at
    its last compile (Note [Scalar lifting]); called for each compile of the group."""
    if group is None:
        return None
    before, group.compiled_lifted = group.compiled_lifted, group.lifted
    return "scalar_lifted" if before is not None and before != group.lifted else None


def _keep(group: _Group, n: int) -> list[bool]:
    """Per scalar of the group's windows: whether it is baked (not lifted), for ``compress``."""
    keep = group.keep
    if keep is None or len(keep) != n:
        lifted = set(group.lifted)
        keep = group.keep = [i not in lifted for i in range(n)]
    return keep


def _sentinel(k: int) -> float:
    # a quiet NaN with a payload: anything a decomposition derives from it is a NaN without the
    # payload, so a lifted float that was transformed (not just passed along) is detected
    return struct.unpack("<d", struct.pack("<Q", 0x7FF8_0ADE_0000_0000 | k))[0]


def _sentinel_index(x) -> int | None:
    if type(x) is not float or x == x:
        return None
    bits = struct.unpack("<Q", struct.pack("<d", x))[0]
    if bits & 0xFFFF_FFFF_0000_0000 != 0x7FF8_0ADE_0000_0000:
        return -1  # a NaN that is not one of ours as passed: derived from a lifted float
    return bits & 0xFFFF_FFFF


class LiftError(Exception):
    """The graph cannot take a lifted float as an input (it was transformed, or an op needs it as a
    Python number); the region is compiled with the values baked in instead."""


_LIFT_ERROR = f"{LiftError.__module__}.{LiftError.__qualname__}:"  # how a LiftError's reason begins


def lift(gm: torch.fx.GraphModule, lifted) -> list[tuple[int, torch.dtype]]:
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
    if found != set(lifted):
        raise LiftError("a lifted float disappeared from the graph")
    return spec
