"""Window -> regions -> compiled (or replayed) execution. Knows nothing of dispatch modes.

The tracer hands over a finished ``Window``; ``mark_needed`` decides what is observable and
``run_window`` runs it with the backend the options name.
"""

from __future__ import annotations

from .replay import ReplayError, mark_needed, replay_window
from .window import ALIAS, FRESH, VIEW, Node, Out, Window


def run_window(window: Window, options) -> int:
    """Run ``window`` (after ``mark_needed``) with the backend ``options`` names; return the
    number of device launches made."""
    if options.backend == "replay":
        return replay_window(window)
    from . import compiled
    from .backends import get_backend

    return compiled.run(window, get_backend(options.backend, options.device), options)


__all__ = ["Window", "Node", "Out", "FRESH", "ALIAS", "VIEW", "mark_needed", "run_window", "ReplayError"]
