"""Op signature ids (Note [Window signature] in ``fuser.window``, which also holds their arities
and the decoder of a window's flat ``sigs``)."""

from __future__ import annotations

import itertools

from fuser.window import ARITY

# Note [Bounded tables]
# ~~~~~~~~~~~~~~~~~~~~~
# The meta cache and the signature id tables grow with every new signature a program shows (a new
# shape, a new Python number where it is not lifted): a long run with varying shapes would keep
# them all. Each holds at most ``MAX_ENTRIES`` entries; an insert into a full one drops its oldest
# quarter (insertion order: no bookkeeping on the record path's hits, and one copy of the keys per
# quarter of inserts). Dropping an entry costs a recomputation (a meta-cache miss, ~65 us) or a new
# id for a structure seen again (its windows are new regions: compiled again, or loaded from the
# persistent cache); an id is never given to two signatures (``_SIGNATURE_IDS`` only counts up).
# ``fuser.window.ARITY`` is not bounded: a window open in any thread may hold any id ever given,
# and its decoding needs that id's arity.
MAX_ENTRIES = 1 << 16
EVICTIONS = [0]  # entries dropped from full tables since the last cache_clear()


def bounded_put(table: dict, key, value):
    """``table.setdefault(key, value)``, dropping ``table``'s oldest quarter first when it is full
    (Note [Bounded tables]). One atomic step for the insert: two threads never give one signature
    two entries (Note [Window signature])."""
    if len(table) >= MAX_ENTRIES:
        old = list(table)[: max(1, len(table) // 4)]  # one C-level copy: no iteration under mutation
        for k in old:
            table.pop(k, None)
        EVICTIONS[0] += len(old)
    return table.setdefault(key, value)


_STRUCTURE_IDS: dict = {}  # op signature -> its id (>= 1); views' ids are negative (``_VIEW_IDS``)
_VIEW_IDS: dict = {}
_SIGNATURE_IDS = itertools.count(1)


def structure_id(structure) -> int:
    """The id of an op's structure (its signature and output metadata), given at a meta-cache miss."""
    eid = _STRUCTURE_IDS.get(structure)
    if eid is None:
        eid = bounded_put(_STRUCTURE_IDS, structure, next(_SIGNATURE_IDS))
    return eid


def view_id(key) -> int:
    """The id of a view's signature (negative), with its arity: one ref, the viewed value."""
    eid = _VIEW_IDS.get(key)
    if eid is None:
        eid = bounded_put(_VIEW_IDS, key, -next(_SIGNATURE_IDS))
        ARITY[eid] = 1
    return eid
