"""adaptive_eager: unmodified eager PyTorch that runs like compiled code.

    from adaptive_eager import adaptive_eager
    with adaptive_eager():
        loss = model(x).sum(); loss.backward(); opt.step()

Ops on the target device are recorded into a window and run at the next sync point; everything a
program can observe (values, errors, prints, random numbers, autograd) stays eager.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

from ._metrics import METRICS, format_report
from .config import ConfigError, Options, defaults, entry_options, load_options, options_doc
from .errors import AdaptiveEagerError

# The tracer imports torch internals; ``import torch`` imports this package (backend autoload)
# before torch has finished importing, so the tracer's modules are imported on first use, in the
# functions below, not here.


def __getattr__(name):
    if name == "emulate_neuron":  # a neuron device backed by CPU memory (neuron_emulation)
        return importlib.import_module(".neuron_emulation", __name__).emulate_neuron
    raise AttributeError(f"module 'adaptive_eager' has no attribute {name!r}")

__version__ = "0.1.0"


def _install_emulation() -> None:
    """The emulated neuron device, installed at the entry of a mode whose ``emulate`` setting is on
    (reading settings installs nothing: adaptive_eager.config)."""
    importlib.import_module(".neuron_emulation", __name__).emulate_neuron()


def _state_or_none():
    from ._state import current_state

    st = current_state()
    return st if st is not None and st.mode is not None else None


def enable(**options: Any) -> None:
    """Turn adaptive eager on for the current thread until ``disable()`` (what NEURON_EAGER uses).

    Keyword options are those of ``adaptive_eager(...)``; the environment supplies the rest.
    Calling it again while on flushes and applies the new options.
    """
    from ._flush import flush
    from ._mode import activate

    opts = entry_options(None, _install_emulation, **options)
    st = _state_or_none()
    if st is not None:
        flush(st, "options")
        st.set_options(opts)
        return
    activate(opts)


def disable() -> None:
    """Flush and turn adaptive eager off for the current thread (no-op when it is off)."""
    st = _state_or_none()
    if st is not None:
        from ._mode import deactivate

        st.depth = 0
        deactivate(st)


@contextlib.contextmanager
def adaptive_eager(**options: Any):
    """Record ops lazily inside the block; leaving it flushes. Nesting is allowed: an inner block
    starts from the outer block's options and applies its own keywords until it exits."""
    from ._flush import flush
    from ._log import log
    from ._mode import activate, deactivate

    st = _state_or_none()
    if st is None:
        opts = entry_options(None, _install_emulation, **options)
        st = activate(opts)
        owner = True
        previous = None
    else:
        owner = False
        previous = st.options
        opts = entry_options(previous, _install_emulation, **options)
        if opts != previous:
            flush(st, "options")
            st.set_options(opts)
    st.depth += 1
    try:
        yield
    except BaseException:
        # Keep the program's own exception: the flush still runs (tensors it made stay usable in
        # the handler), but its error must not replace the one already propagating.
        st.depth -= 1
        try:
            if owner:
                deactivate(st)
            else:
                flush(st, "exit")
        except Exception as flush_error:  # noqa: BLE001 - reported, the original error wins
            log.warning("adaptive_eager: flush while leaving on an exception failed: %s", flush_error)
        raise
    st.depth -= 1
    if owner:
        deactivate(st)
    else:
        try:
            flush(st, "exit")
        finally:
            if previous is not None and previous != st.options:
                st.set_options(previous)


# help() lists every option with its default and meaning, from the one table of settings
adaptive_eager.__doc__ = adaptive_eager.__doc__.rstrip() + options_doc()
enable.__doc__ = enable.__doc__.rstrip() + options_doc()


def sync() -> None:
    """Flush the current thread's window now (every pending value becomes real)."""
    from ._flush import flush
    from ._state import current_state

    st = current_state()
    if st is not None:
        flush(st, "sync")


def is_lazy(t) -> bool:
    """Whether ``t`` holds a pending value (its contents are computed at the next sync point)."""
    from ._threads import is_pending

    return is_pending(t)


def is_enabled() -> bool:
    """Whether adaptive eager is on for the current thread."""
    return _state_or_none() is not None


def metrics() -> dict:
    """Counters since the last ``reset_metrics()`` (process-wide, all threads)."""
    import fuser

    from ._state import pending_hot_ops

    m = METRICS.as_dict()
    records, launches = pending_hot_ops()  # Note [Hot record cost] in _hot: counted when each window ends
    m["hot_ops"] += records
    m["ops_recorded"] += launches
    m["eager_equivalent_launches"] += launches
    return {**m, **fuser.metrics()}


def reset_metrics() -> None:
    import fuser

    from . import neuron_emulation
    from ._state import hot_ops_counted

    METRICS.reset()
    hot_ops_counted()
    fuser.reset_metrics()
    _DEVICE_LAUNCHES[0] = neuron_emulation.launches()


# the emulated neuron device's own count of its launches at the last ``reset_metrics()`` (``report``)
_DEVICE_LAUNCHES = [0]


def cache_info() -> dict:
    """The tracer's caches: the meta cache (output metadata by op signature) and the signature ids,
    each bounded; misses and dropped entries since ``cache_clear()``; the signatures that cannot
    be recorded (they run eagerly), by op, with the reason."""
    from ._meta import cache_info as info

    return info()


def cache_clear() -> None:
    """Empty the tracer's caches, as a new process starts (ops compute their metadata again)."""
    from ._meta import cache_clear as clear

    clear()


def report(explain: bool = False) -> str:
    """A readable table of ``metrics()`` and the persistent cache in use; with ``explain=True``,
    followed by ``explain()``."""
    import fuser

    from . import neuron_emulation

    m = metrics()
    lines = [format_report(m)]
    if neuron_emulation.is_emulated():
        # Note [Emulated launches]: what reached the device, counted by it (eager ops outside
        # adaptive eager included), beside the library's ``launches``
        lines.append(f"{'emulated neuron device launches':<32}{neuron_emulation.launches() - _DEVICE_LAUNCHES[0]:>8} "
                     f"(counted by the device since reset_metrics(); the library counted {m['launches']})")
    for store in fuser.stores():
        s = store.stats()
        lines.append(f"cache {s['directory']}: {s['entries']} entries, {s['bytes'] / 2**20:.1f} MiB, {s['hits']} hits"
                     f"{' (in memory: the directory is not usable)' if s.get('in_memory') else ''}"
                     f"{' (read-only: new compiles stay in memory)' if s.get('read_only') else ''}")
    for jobs in fuser.compile_jobs():
        pending, running = jobs.pending(), jobs.running()
        if pending:
            after = (f"go on after the program exits, for up to {jobs.finish_after_exit_s:.0f} s "
                     "(compile_after_exit_s), and land in the cache" if jobs.finish_after_exit_s else "stop at exit")
            lines.append(f"background compiles pending: {len(pending)}, {len(running)} running "
                         f"({', '.join(sorted(key[:8] for key in running)) or '-'}): running ones {after}; "
                         "queued ones are dropped at exit")
    if explain:
        lines.append("")
        lines.append(_explain_text())
    return "\n".join(lines)


def explain(top: int = 5) -> str:
    """The top causes of flushes, recompiles and eager fallbacks since ``reset_metrics()``, each
    with the user's ``file:line`` and what to change."""
    return _explain_text(top)


def _explain_text(top: int = 5) -> str:  # report()'s ``explain`` argument shadows explain()
    from ._explain import explain as build

    return build(metrics(), METRICS.flush_sites, METRICS.fallback_sites, top=top)


def load_ipython_extension(ipython) -> None:
    """``%load_ext adaptive_eager``: adaptive eager on for every cell, each cell ending with a flush.

    Adds the ``%adaptive_eager on|off|report`` line magic. IPython is imported only here."""
    from . import _ipython

    _ipython.load(ipython)


def unload_ipython_extension(ipython) -> None:
    """``%unload_ext adaptive_eager``: flush and turn adaptive eager off."""
    from . import _ipython

    _ipython.unload(ipython)


__all__ = [
    "adaptive_eager", "enable", "disable", "sync", "is_lazy", "is_enabled", "metrics",
    "reset_metrics", "report", "explain", "cache_info", "cache_clear", "emulate_neuron", "AdaptiveEagerError",
    "ConfigError", "Options", "load_options", "defaults",
]
