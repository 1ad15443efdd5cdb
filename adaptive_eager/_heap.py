"""glibc malloc's thresholds while windows run on the CPU.

Note [Heap thresholds]
~~~~~~~~~~~~~~~~~~~~~~
On CPU every tensor's memory comes from the C library's ``malloc`` (PyTorch's CPU allocator caches
nothing). glibc gives the top of its heap back to the system whenever a free leaves more than its
trim threshold there, and serves a block at or above its mmap threshold with a fresh mapping that
is unmapped at its free; either way the next allocation of that memory faults every 4 KiB page in
again. Both thresholds start at 128 KiB and rise as the process frees mapped blocks: to the size of
the largest block freed so far (mmap) and twice that (trim), up to glibc's own ceilings of 32 and
64 MiB, which any process reaches once it frees one 32 MiB tensor.

A window's placeholders hold memory from the op that recorded them, and a compiled region frees it
before its run and allocates its outputs anew (Note [Placeholder memory at a compiled run] in
fuser.replay), so a steady step allocates and frees its large values in a different order from
eager's. The suite's MLP step (3x Linear(1024), batch 64, SGD: three 4 MiB weight gradients),
whose process had freed no block larger than 4 MiB, ran with an 8 MiB trim threshold: the heap's
top was given back twice a step and the region faulted its outputs in, ~3,000 minor faults a step
(`benchmarks/step_parts.py`), its run 8.5 ms against 4.4-4.9 ms with no faults (session 18,
RESULTS.md). Eager's order happened to fault rarely in the same process. Whether a given order
faults depends on where small blocks land: a loop of three 4 MiB tensors faults ~2,000 times a
round in about half of the processes that run it and never in the rest (tests/test_heap.py).

So at the process's first activation with a CPU target both thresholds are set to those ceilings
with ``mallopt``: the state glibc itself moves to in a process that frees a 32 MiB block, fixed
there from the start. What it costs: up to 64 MiB of freed memory at the top of each of malloc's
arenas stays with the process instead of going back to the system, and blocks of 128 KiB to
32 MiB come from the heap instead of their own mappings (as they do once glibc's thresholds have
risen). It is process-wide and cannot be undone (glibc stops adjusting its thresholds once they
are set, and has no call that reads them), so it stays after the block's exit; it is never done
where the program chose for itself: a ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` or
``MALLOC_TOP_PAD_`` variable, ``glibc.malloc.*`` in ``GLIBC_TUNABLES``, or another allocator in
``LD_PRELOAD`` (jemalloc, tcmalloc, mimalloc). Not glibc (musl, macOS, Windows): nothing is done.
A program keeps glibc's own behaviour by choosing for itself (those variables); no setting of
adaptive eager turns it off (benchmarks/RESULTS.md, "Session 23: switches"). ``metrics()["malloc_tuned"]``
says whether it was done.
"""

from __future__ import annotations

import ctypes
import sys
import threading

from .config import malloc_chosen_by_program

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for its dynamic mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 64 << 20  # twice that: where its dynamic trim threshold follows

_lock = threading.Lock()
_done: list[str | None] = [None]  # None: not tried; else what happened ("tuned", or why not)


def tuned() -> bool:
    return _done[0] == "tuned"


def outcome() -> str | None:
    """What the process's tuning did: None (not tried yet), "tuned", or why not."""
    return _done[0]


def tune() -> str:
    """Once per process: fix glibc's thresholds at their ceilings (Note [Heap thresholds])."""
    with _lock:
        if _done[0] is not None:
            return _done[0]
        _done[0] = _tune()
        return _done[0]


def _tune() -> str:
    if not sys.platform.startswith("linux"):
        return "not linux"
    why = malloc_chosen_by_program()
    if why is not None:
        return why
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only (musl has mallopt with other meanings)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "not glibc"
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if not mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        return "mallopt refused"
    mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    return "tuned"
