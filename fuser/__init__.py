"""Window -> regions -> compiled (or replayed) execution. Knows nothing of dispatch modes.

The tracer hands over a finished ``Window``; ``run_window`` reads what is observable, runs it with
the backend the options name, and answers a ``FlushResult``. Imports go one way: adaptive_eager ->
fuser -> neff_cache.

| you want to change | open |
| --- | --- |
| what a window holds; the signature format | ``window.py`` |
| which values are observable; replay; binding results | ``replay.py`` |
| why a window replays instead of compiling; hot_after; blacklisting | ``regions.py`` (Note [Tiers]) |
| what is kept per region; the lock over the fuser's tables | ``table.py`` |
| which windows may compile, or compile in place | ``compilable.py`` |
| a float that keeps recompiling | ``scalars.py`` |
| a varying batch size | ``shapes.py`` |
| the persistent key; what a worker receives | ``program.py``, ``backends/_common.py`` (Note [One codec]) |
| compiling; the artifact's manifest | ``compile.py`` |
| running a compiled region on a window | ``launch.py`` |
| nodes run outside compiled code | ``partition.py`` |
| background compiles; the store handle; the compile thread | ``artifacts.py``, ``neff_cache.jobs`` |
| counters | ``stats.py`` (``fuser.metrics()``) |
| a compiler | ``backends/`` |
"""

from __future__ import annotations

import sys

from .replay import ReplayError, mark_needed, placeholder_of, read_liveness, replay_window, value_is_dead
from .window import ALIAS, FRESH, VIEW, FlushResult, Node, Out, Window


def run_window(window: Window, options, now: bool = False, validated=None, resume=None) -> FlushResult:
    """Run ``window`` with the backend ``options`` names. Its liveness is read here, once
    (Note [Liveness during a flush]); every later step uses what was read. ``now``: without
    waiting for any other thread (``regions.run_now``). ``validated``: the region entry (an
    earlier ``FlushResult.entry``) the tracer recorded the window against, whose nodes are then
    the tracer's records; ``resume``: a declined run's ``FlushResult.resume``, the nodes made
    since (Note [Validated windows] in fuser.regions)."""
    if resume is not None or validated is not None:
        from . import regions  # an entry exists: regions ran here
        from .backends import get_backend

        backend = None if now else get_backend(options.backend, options.device)
        if resume is not None:
            return regions.run_resumed(window, resume, backend, options, now)
        live = read_liveness(window)
        if now:
            return regions.run_now(window, live, validated)
        return regions.run(window, live, backend, options, validated)
    live = read_liveness(window)
    if now:
        regions = sys.modules.get("fuser.regions")
        if regions is not None:  # else no region was ever run here: nothing to import at a fork
            return regions.run_now(window, live)
    if options.backend == "replay" or now:
        # no region key is built on this path (nothing is looked up): no region
        if now:
            from .stats import STATS

            STATS.replay_reasons["fork"] += 1
        dead = mark_needed(window)
        launched = replay_window(window)
        return FlushResult(launched, _computed(window), dead, "replayed" if dead < len(window.nodes) else "dead", None)
    from . import regions
    from .backends import get_backend

    return regions.run(window, live, get_backend(options.backend, options.device), options)


def metrics() -> dict:
    """The fuser's counters since ``reset_metrics()`` (process-wide), with the artifacts the
    stores in use found corrupt or incompatible."""
    from .artifacts import stores
    from .stats import STATS

    corrupt = sum(s.corrupt_entries + s.incompatible_entries for s in stores())
    return {"corrupt_entries": corrupt, **STATS.as_dict()}


def reset_metrics() -> None:
    from .stats import STATS

    STATS.reset()


def stores() -> list:
    """The persistent artifact stores this process has opened (one per cache directory)."""
    from .artifacts import stores

    return stores()


def compile_jobs() -> list:
    """The background compile jobs (``neff_cache.CompileJobs``), one per store that has had one."""
    from .artifacts import compile_jobs

    return compile_jobs()


def cache_clear(store_handles: bool = False) -> None:
    """Forget every region, shape class and scalar group in memory: what a new process knows is
    only the persistent cache, which is untouched. With ``store_handles``, also forget the open store
    handles (each is opened again at its next use)."""
    from . import artifacts, table

    table.cache_clear()
    if store_handles:
        artifacts.forget_stores()


def cache_info() -> dict:
    """The bounded in-memory tables, each as ``CacheInfo(hits, misses, maxsize, currsize)``:
    ``regions`` (by window structure, Note [Region key]) and ``scalar_groups`` (Note [Scalar
    lifting]). ``cache_clear()`` empties both and zeroes their counts."""
    from .scalars import GROUPS
    from .table import CACHE

    return {"regions": CACHE.cache_info(), "scalar_groups": GROUPS.cache_info()}


def _computed(window: Window) -> int:
    return sum(1 for n in window.nodes if n.needed and not n.is_view)


__all__ = ["Window", "Node", "Out", "FlushResult", "FRESH", "ALIAS", "VIEW", "mark_needed", "run_window", "ReplayError", "value_is_dead",
           "placeholder_of", "metrics", "reset_metrics", "stores", "compile_jobs", "cache_clear", "cache_info"]
