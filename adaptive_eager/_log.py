"""The library's logger and its level (NEURON_EAGER_LOG / ``log=``)."""

from __future__ import annotations

import logging

log = logging.getLogger("adaptive_eager")

_log_configured = False


def _apply_log_level(level: str) -> None:
    """NEURON_EAGER_LOG / log=: the level of the ``adaptive_eager`` loggers. With no logging set
    up by the program, records go to stderr; a program's own logging configuration is kept."""
    global _log_configured
    if level == "warning" and not _log_configured:
        return  # the default: leave the program's logging alone
    _log_configured = True
    root = logging.getLogger("adaptive_eager")
    root.setLevel(getattr(logging, level.upper()))
    if level != "warning" and not root.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s] %(levelname)s: %(message)s"))
        root.addHandler(handler)
