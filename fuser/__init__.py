"""Window -> regions -> compiled (or replayed) execution. Knows nothing of dispatch modes.

The tracer hands over a finished ``Window``; ``mark_needed`` decides what is observable and
``run_window`` runs it with the backend the options name.
"""

from __future__ import annotations

from .replay import ReplayError, mark_needed, placeholder_of, replay_window, value_is_dead
from .window import ALIAS, FRESH, VIEW, Node, Out, Window


def run_window(window: Window, options) -> tuple[int, int, int]:
    """Run ``window`` with the backend ``options`` names; return (device launches made, ops
    computed, ops found dead). A compiled region counts its ops as computed: the compiler does
    its own dead-code elimination. Leaves ``window.outcome`` (and, compiled, ``window.region``)
    for the flush log line."""
    if options.backend == "replay":
        dead = mark_needed(window)
        # no region key is built on this path (nothing is looked up), so ``window.region`` stays None
        window.outcome = "replayed" if dead < len(window.nodes) else "dead"
        return replay_window(window), _computed(window), dead
    from . import regions
    from .backends import get_backend

    return regions.run(window, get_backend(options.backend, options.device), options)


def _computed(window: Window) -> int:
    return sum(1 for n in window.nodes if n.needed and not n.is_view)


__all__ = ["Window", "Node", "Out", "FRESH", "ALIAS", "VIEW", "mark_needed", "run_window", "ReplayError", "value_is_dead",
           "placeholder_of"]
