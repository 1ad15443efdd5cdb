"""Persistent, content-addressed store of compiled artifacts, with cross-process compile claims,
background compile workers and a CLI (``python -m neff_cache stats|ls|clear|prune|repair``).

It stores bytes under hex-digest keys and knows nothing of graphs or torch. Its names are
imported on first use: ``adaptive_eager.config`` reads ``neff_cache.settings`` at ``import torch``
(the autoload), which must not pay for sqlite and diskcache.
"""

from __future__ import annotations

import importlib

_NAMES = {"CompileJobs": "jobs", "JobResult": "jobs", "LIMIT_EXCEEDED": "_worker", "FORMAT_VERSION": "store", "ArtifactStore": "store"}


def __getattr__(name: str):
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'neff_cache' has no attribute {name!r}")
    return getattr(importlib.import_module(f"neff_cache.{module}"), name)


__all__ = ["FORMAT_VERSION", "LIMIT_EXCEEDED", "ArtifactStore", "CompileJobs", "JobResult"]
