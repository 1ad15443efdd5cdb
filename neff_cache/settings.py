"""Where the cache lives and who shares it: the two settings the cache itself needs, in one place.

Two programs read them. The library's settings table (``adaptive_eager.config``, the only reader
of the environment inside the library) takes its defaults and the sharing choices from here.
``python -m neff_cache`` is a program of its own: it reads the same two variables through
``from_environment`` so that it needs neither the tracer nor torch (imports go one way:
adaptive_eager -> fuser -> neff_cache). This module imports nothing else of neff_cache.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

DIRECTORY_VARIABLE = "NEURON_EAGER_CACHE_DIR"
SHARING_VARIABLE = "NEURON_EAGER_CACHE_SHARED"
DEFAULT_DIRECTORY = os.path.join("~", ".cache", "adaptive_eager")
SHARING = ("no", "group")  # who may write the directory besides the user: Note [Cache trust] in neff_cache.access
DEFAULT_SHARING = "no"


def from_environment(environ: Mapping[str, str]) -> tuple[str, str]:
    """The cache directory and who shares it as ``environ`` sets them, else the defaults; ValueError
    naming the variable for a value the library would refuse too."""
    directory = environ.get(DIRECTORY_VARIABLE, DEFAULT_DIRECTORY)
    if not directory:
        raise ValueError(f"{DIRECTORY_VARIABLE} is empty: unset it or give a value")
    raw = environ.get(SHARING_VARIABLE, DEFAULT_SHARING)
    sharing = raw.strip().lower()
    if sharing not in SHARING:
        raise ValueError(f"{SHARING_VARIABLE}={raw!r}: expected one of {', '.join(SHARING)}")
    return directory, sharing
