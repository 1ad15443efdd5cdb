"""Op signature ids and the decoder of a window's flat ``sigs`` (Note [Window signature] in
``fuser.window``). The decoder belongs with the window's format, in ``fuser.window``: it is here
until that module takes it."""

from __future__ import annotations

import itertools

_STRUCTURE_IDS: dict = {}  # op signature -> its id (>= 1); views' ids are negative (``_VIEW_IDS``)
_SIGNATURE_IDS = itertools.count(1)


_VIEW_IDS: dict = {}
_ARITY: dict = {}  # op signature id -> how many dataflow refs follow it in ``Window.sigs``


def _op_ids(sigs: list) -> list[int]:
    """The op signature ids of a window, one per node, out of its flat ``sigs``."""
    ids = []
    i, n = 0, len(sigs)
    arity = _ARITY
    while i < n:
        eid = sigs[i]
        ids.append(eid)
        i += 1 + arity[eid]
    return ids
