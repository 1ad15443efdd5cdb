"""Persistent, content-addressed store of compiled artifacts, with cross-process compile claims,
background compile workers and a CLI (``python -m neff_cache stats|ls|clear|prune|repair``).

It stores bytes under hex-digest keys and knows nothing of graphs or torch.
"""

from neff_cache.jobs import CompileJobs, JobResult
from neff_cache.store import FORMAT_VERSION, ArtifactStore

__all__ = ["FORMAT_VERSION", "ArtifactStore", "CompileJobs", "JobResult"]
