"""Errors of adaptive eager itself (kept import-light: ``import torch`` may load this package)."""


class AdaptiveEagerError(RuntimeError):
    """The root of adaptive eager's own errors (``ConfigError``: a setting it cannot use); the
    message says what to do. Errors of the program's ops are eager's own types."""
