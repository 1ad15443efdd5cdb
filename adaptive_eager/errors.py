"""Errors of adaptive eager itself (kept import-light: ``import torch`` may load this package)."""


class AdaptiveEagerError(RuntimeError):
    """A misuse of adaptive eager itself; the message says what to do."""
