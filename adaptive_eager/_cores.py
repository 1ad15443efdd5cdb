"""The intra-op threads of the ops we run while a compile of ours runs beside the program (Note [Cores
beside a compile])."""

from __future__ import annotations

import ctypes
import os
import time

import torch

from ._log import log
from ._state import _tls, current_state

# Note [Cores beside a compile]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Until its compiled code lands, a cold program's ops run one by one, by us (window replays, the
# captured graphs' op-by-op runs), while a compile of ours runs beside it (a worker process
# compiling or warming up, or the compile thread loading). With torch's intra-op pool at one
# OpenMP thread per core, those steps were 10-50x slower than eager's (blocks8 on 2 cores,
# ``benchmarks/cold_steps.py``: 100-1000 ms a step against eager's 3.7 ms; the process busy one
# core's worth and its main thread half of that, the rest spent at OpenMP's barriers, whose
# threads spin for each other), and 14-20 ms with one intra-op thread. Running the compile worker
# at the lowest priority (``SCHED_IDLE``) changed nothing; neither did a worker at ``nice 19``.
# So while ``fuser.artifacts.compiling()`` counts N such compiles, the ops we run (a window's run
# at a flush, a captured graph's op-by-op run: ``running``) use ``cores - N`` intra-op threads
# (at least 1; never more than the thread had), and the thread's own number again right after.
# A captured graph's compiled run too: Inductor's own C++ kernels keep the number they were
# compiled for, but its extern kernels (``mm``, ``addmm``) take the thread's. The cold steps in
# which the first artifacts landed while the worker compiled the next ones took 200-1900 ms
# (blocks8, 17 ``mm`` calls 224 ms of a 422 ms step), 100-370 ms with it (benchmarks/RESULTS.md).
# Only there: the program's own code never sees another number (``torch.get_num_threads()``),
# since what reads it may keep it. Inductor's C++ kernels are compiled for
# ``torch.get_num_threads()`` (``torch._inductor.utils.parallel_num_threads``), so a
# ``torch.compile`` of the program's that compiled while the number was lowered would run with
# that many threads for good. For the same reason the number is the calling thread's OpenMP
# setting alone (``omp_set_num_threads`` of the OpenMP runtime torch loaded), not
# ``torch.set_num_threads``, which also sets the number every thread that starts later begins
# with. Without an OpenMP runtime in the process (another build of torch) nothing is changed.
# Not with ``backend='replay'``: a reduction's result depends on how many threads split it
# (the embedding's backward differed from eager's in the last bit), and that backend's promise is
# eager's bits; a compile beside it is another thread's.
# Whether a compile runs is asked at most every ``_CHECK_S``.

_CHECK_S = 0.02


def _openmp():
    """``(omp_get_max_threads, omp_set_num_threads)`` of the OpenMP runtime in this process, or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "omp" in line.rsplit("/", 1)[-1]}
    except OSError:  # not Linux
        return None
    for path in sorted(paths):
        if not os.path.basename(path).startswith(("libgomp", "libomp", "libiomp")):
            continue
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            get, set_ = lib.omp_get_max_threads, lib.omp_set_num_threads
        except (OSError, AttributeError):
            continue
        get.restype, get.argtypes, set_.restype, set_.argtypes = ctypes.c_int, [], None, [ctypes.c_int]
        return get, set_
    return None


_OMP: list = []  # [(get, set) or None] once looked up


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _want(now: float) -> int:
    """The number of intra-op threads our ops should use now in this thread; 0: leave it."""
    if now < getattr(_tls, "cores_check", 0.0):
        return _tls.cores_want
    _tls.cores_check = now + _CHECK_S
    from fuser.artifacts import compiling

    running = compiling()
    want = 0
    if running:
        if not _OMP:
            _OMP.append(_openmp())
        if _OMP[0] is not None:
            torch.get_num_threads()  # torch sets a thread's number at its first use: before ours
            want = max(1, _cores() - running)
    _tls.cores_want = want
    return want


def lower() -> int:
    """Before we run ops: this thread's intra-op threads lowered if a compile runs beside; returns
    what ``restore`` needs (0: nothing was changed)."""
    st = current_state()
    if st is not None and st.options.backend == "replay":  # its values are eager's bits: eager's threads
        return 0
    want = _want(time.perf_counter())
    if not want:
        return 0
    get, set_ = _OMP[0]
    have = get()
    if want >= have:
        return 0
    set_(want)
    if not getattr(_tls, "cores_logged", False):
        _tls.cores_logged = True
        log.info("adaptive_eager: the ops it runs use %d intra-op threads instead of %d while a compile runs "
                 "beside the program (Note [Cores beside a compile])", want, have)
    return have


def restore(have: int) -> None:
    """After the ops: the thread's own number again."""
    if have:
        _OMP[0][1](have)


def running(fn, *args):
    """``fn(*args)``: ops we run, between ``lower`` and ``restore``."""
    have = lower()
    try:
        return fn(*args)
    finally:
        restore(have)
