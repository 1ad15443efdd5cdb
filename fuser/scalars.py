"""Scalar lifting: a float argument that changes between windows of one structure becomes a
runtime input of the compiled region instead of a constant baked into it (Note [Scalar lifting])."""

from __future__ import annotations

import struct
from collections import Counter, OrderedDict
from itertools import compress as _compress

import torch

from .stats import _recompile

# a lifted scalar's 0-dim input (Note [Scalar lifting]): torch.tensor's argument parsing and type
# inference cost twice as much, per scalar per run (AdamW lifts 2 per parameter)
_scalar_tensor = torch.scalar_tensor
GROUPS_MAX = 1024  # scalar groups kept (as many as the region LRU holds regions)


LIFT_AFTER = 2  # a float argument that changed this many times becomes a runtime input


class _Group:
    """What windows of one structure (scalar values aside) have shown: Note [Scalar lifting]."""

    __slots__ = ("last", "changes", "lifted", "unliftable", "keep")

    def __init__(self):
        self.last: tuple | None = None
        self.changes: Counter[int] = Counter()
        self.lifted: tuple[int, ...] = ()
        self.unliftable = False  # the compiled graph could not take these floats as inputs
        self.keep: list[bool] | None = None  # per scalar: not lifted (the baked ones), for compress


_GROUPS: OrderedDict = OrderedDict()


def _scalar_key(structure, scalars: list) -> tuple:
    """The part of a region key that scalar values contribute, after lifting the ones that vary."""
    group = _GROUPS.get(structure)
    if group is None:
        group = _GROUPS[structure] = _Group()
        if len(_GROUPS) > GROUPS_MAX:
            _GROUPS.popitem(last=False)
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
                _recompile("scalar_lifted", None)
    group.last = values
    if not group.lifted:
        return (group, (), values)
    if baked is None:
        baked = tuple(_compress(values, _keep(group, len(values))))
    return (group, group.lifted, baked)


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
