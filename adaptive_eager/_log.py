"""The library's loggers and their level (NEURON_EAGER_LOG / ``log=``)."""

from __future__ import annotations

import logging

log = logging.getLogger("adaptive_eager")

# The roots of the library's loggers. The fuser and the cache name theirs after their own packages
# (they are usable without this one: ``python -m neff_cache``), so the level and the handler go
# on each root rather than on ``adaptive_eager`` alone.
ROOTS = ("adaptive_eager", "fuser", "neff_cache")
_log_configured = False


def _apply_log_level(level: str) -> None:
    """NEURON_EAGER_LOG / log=: the level of the library's loggers (``ROOTS``). With no logging set
    up by the program, records go to stderr; a program's own logging configuration is kept."""
    global _log_configured
    if level == "warning" and not _log_configured:
        return  # the default: leave the program's logging alone
    _log_configured = True
    handler = None
    for name in ROOTS:
        root = logging.getLogger(name)
        root.setLevel(getattr(logging, level.upper()))
        if level != "warning" and not root.handlers and not logging.getLogger().handlers:
            if handler is None:
                handler = logging.StreamHandler()
                handler.setFormatter(logging.Formatter("[%(name)s] %(levelname)s: %(message)s"))
            root.addHandler(handler)
