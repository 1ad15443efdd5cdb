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
a float lifted before anything of the group compiled recompiles nothing). An optimizer's step is
known to pass new floats every step (bias corrections from the step count, a schedule's learning
rate) and its hyperparameters beside them: waiting for changes compiled a training step three times
before the steady one (baked, baked again, lifted). So the floats recorded between an optimizer
step's pre-hook and its end (``Window.lift_from``) are lifted at the group's first window
(``optimizer_floats``), before any compile, and a training loop compiles its step once. Some ops
record a float that their decomposition needs as a number (lerp's weight becomes a ``full``):
those (``NUMBERS``, seeded and learned) stay baked; a LiftError that names others bakes them
(``unlift``: the window replays, the next compiles) instead of making the group unliftable.
The region key is (group, lifted positions, the values not lifted):
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

import re
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

    __slots__ = ("last", "changes", "lifted", "unliftable", "keep", "compiled_lifted", "speculative", "baked",
                 "origin")

    def __init__(self):
        self.last: tuple | None = None
        self.changes: Counter[int] = Counter()
        self.lifted: tuple[int, ...] = ()
        self.unliftable = False  # the compiled graph could not take these floats as inputs
        self.keep: list[bool] | None = None  # per scalar: not lifted (the baked ones), for compress
        self.compiled_lifted: tuple[int, ...] | None = None  # ``lifted`` at its last compile; None: none yet
        self.speculative: set[int] = set()  # lifted before any change was seen (an optimizer's floats)
        self.baked: set[int] = set()  # of those, the ones the graph could not take as inputs
        self.origin: dict[int, tuple] = {}  # speculative float -> (its op, its position): ``unlift``


GROUPS = LRU(_Group)  # structure -> its scalar group; as many as the region LRU holds regions


# (op, float position) of floats that a compiled graph needs as Python numbers although the op
# records them as liftable: an optimizer step's are not lifted before they change. Learned from
# LiftErrors (``unlift``); seeded with lerp's weight (AdamW's ``1 - beta1``), which its
# decomposition passes to ``full``, in its foreach form too (the step of a device that takes
# torch.optim's foreach path: there the first compile of the step failed, the window replayed and
# compiled again, a second compile of the training step).
NUMBERS: set[tuple] = {(op, pos) for op in (torch.ops.aten.lerp.Scalar, torch.ops.aten.lerp_.Scalar,
                                            torch.ops.aten._foreach_lerp.Scalar, torch.ops.aten._foreach_lerp_.Scalar)
                       for pos in (2, "weight")}


def optimizer_floats(window) -> dict[int, tuple]:
    """The floats of ``window``'s optimizer step that become runtime inputs before any change is
    seen (Note [Scalar lifting]): index -> (op, position)."""
    start, found = window.lift_from, {}
    if start is None:
        return found
    for node in window.nodes:
        if node.fpos and node.fbase + len(node.fpos) > start:
            for j, pos in enumerate(node.fpos):
                if node.fbase + j >= start and (node.func, pos) not in NUMBERS:
                    found[node.fbase + j] = (node.func, pos)
    return found


def _scalar_key(structure, scalars: list, window=None) -> tuple:
    """The part of a region key that scalar values contribute, after lifting the ones that vary
    (and, at the group's first window, the floats of ``window``'s optimizer step)."""
    group = GROUPS.get(structure)
    values = tuple(scalars)
    last = group.last
    baked = None
    if (last is None and window is not None and window.lift_from is not None and not group.lifted
            and not group.unliftable):
        group.origin = {i: o for i, o in optimizer_floats(window).items() if i not in group.baked}
        group.speculative = set(group.origin)
        group.lifted = tuple(sorted(group.speculative))
        group.keep = None
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


def unlift(group: _Group, reason: str) -> bool:
    """After a LiftError (``reason``, as ``_failure_reason`` gives it) in a compile of ``group``:
    bake the floats lifted before any change was seen that the graph could not take as inputs (those
    the error names, else all such) and return True; False when the error concerns no such float
    (the group is then unliftable: Note [Scalar lifting])."""
    if not group.speculative:
        return False
    match = _FLOATS.search(reason)
    named = {int(k) for k in match.group(1).split()} if match else set()
    dropped = (named & group.speculative) or set(group.speculative)
    NUMBERS.update(group.origin[i] for i in dropped if i in named)  # other groups do not try them
    group.baked |= dropped
    group.speculative -= dropped
    group.lifted = tuple(i for i in group.lifted if i not in dropped)
    group.keep = None
    group.compiled_lifted = None  # the compile that failed compiled nothing: the next is not a recompile
    return True


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
_FLOATS = re.compile(r"\(floats ([\d ]+)\)")  # the indices a LiftError names: ``unlift``


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
    numbers: dict[int, str] = {}  # floats an op needs as Python numbers: index -> the op
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
                numbers.setdefault(k, str(node.target))
                continue
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
    if numbers:
        raise LiftError(f"{', '.join(sorted(set(numbers.values())))} needs a lifted float as a Python number "
                        f"(floats {' '.join(str(k) for k in sorted(numbers))})")
    found = {k for k, _ in spec}
    if found != set(lifted):
        raise LiftError("a lifted float disappeared from the graph")
    return spec
