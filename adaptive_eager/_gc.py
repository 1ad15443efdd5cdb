"""Python's cyclic garbage collector while windows are recorded.

Note [GC threshold]
A recorded op leaves a handful of small container objects (its Node and Out, their lists, the
placeholder tensor and its ``__dict__``) that live until the window's flush, then die together.
CPython 3.11-3.13 collects generation 0 after every 700 net new container objects, so a
1000-op window sees a dozen young collections while it records; each promotes the still-live
window objects, and promoted objects count toward the next *full* collection, which walks every
object of the process (hundreds of thousands once torch is imported). Measured on the suite's
AdamW step (200 parameters, foreach=False, ~2000 recorded ops, steady state, CPU): a full
collection of ~250 ms about every 10 steps, so the mean step took 56-60 ms against 37-39 ms with
gc off (the median hides it: 42 ms). Eager makes no such objects and pays none of this.

So while adaptive eager is on, the generation-0 threshold is raised to ``_OBJECTS_PER_OP`` times
the window's op cap: a whole window fits in generation 0, and its objects die there, as eager's
temporaries do. Collections still run (every ~16k net new objects instead of 700), so cyclic
garbage is still freed. The old thresholds come back when the last tracer turns off, unless the
program set its own meanwhile (those are kept). A threshold already as high, or 0 (automatic
collection off), is left alone: a program that wants its own thresholds sets them. No setting
turns it off: on the user's loop it costs nothing measurable, and on a recorded step it removes
the full collections (benchmarks/RESULTS.md, "Session 23: switches").
"""

from __future__ import annotations

import gc
import threading

_OBJECTS_PER_OP = 16  # ~8 container objects per recorded op, twice over for the program's own

_lock = threading.Lock()
_wanted: dict[int, int] = {}  # holder id -> generation-0 threshold it asks for
_saved: tuple[int, int, int] = (0, 0, 0)  # the program's thresholds when the first holder came
_ours: tuple[int, int, int] | None = None  # what we set, while it is in force
_yielded = False  # the program set thresholds of its own while we held ours: hands off


def hold(holder: object, window_ops: int) -> None:
    """Ask for a generation-0 threshold fitting a window of ``window_ops`` ops (Note [GC threshold])."""
    global _saved, _yielded
    with _lock:
        if not _wanted:
            _saved = gc.get_threshold()
            _yielded = False
        _wanted[id(holder)] = _OBJECTS_PER_OP * window_ops
        _apply()


def release(holder: object) -> None:
    """Drop ``holder``'s request; the last one out restores the program's thresholds."""
    global _ours
    with _lock:
        if _wanted.pop(id(holder), None) is None:
            return
        if _wanted:
            _apply()
        elif _ours is not None and gc.get_threshold() == _ours:
            gc.set_threshold(*_saved)
        if not _wanted:
            _ours = None


def _apply() -> None:
    global _ours, _yielded
    if _yielded:
        return
    if _ours is not None and gc.get_threshold() != _ours:
        _yielded, _ours = True, None
        return
    gen0, gen1, gen2 = _saved
    want = max(_wanted.values())
    if gen0 == 0 or gen0 >= want:  # automatic collection off, or already as high
        if _ours is not None:
            gc.set_threshold(*_saved)
            _ours = None
        return
    _ours = (want, gen1, gen2)
    gc.set_threshold(*_ours)
