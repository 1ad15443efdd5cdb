"""Where compiles run and artifacts live: the store handle per cache directory, the compile
thread of this process, and the background compile jobs (worker processes) per store."""

from __future__ import annotations

import atexit
import ctypes
import json
import logging
import os
import queue
import threading
from concurrent.futures import Future

from .stats import STATS

log = logging.getLogger("adaptive_eager.fuser")


# Note [Background compiles]
# With async_compile, a hot region is compiled in a worker *process* (neff_cache.CompileJobs),
# never a thread of this process: Inductor saves and restores the global RNG state around a
# compile, which would rewind the random numbers the program draws meanwhile. The program keeps
# replaying; the artifact lands in the store, and the region's next window loads it. A worker
# must not record its own compile: ``import torch`` turns adaptive eager on in any process whose
# environment says ``NEURON_EAGER=adaptive`` (the user's, inherited), so the worker is started
# with ``NEURON_EAGER=eager`` (``WORKER_ENV``) and ``fuser.compile.compile_job`` needs no import of
# the tracer (imports go one way: adaptive_eager -> fuser -> neff_cache).
_JOBS: dict = {}
WORKER_ENV = {"NEURON_EAGER": "eager"}  # adaptive_eager.config.ENV_SWITCH, off


_PENDING: dict = {}  # persistent key -> the region entry waiting for its background compile


def _jobs(store, options):
    from neff_cache import CompileJobs

    jobs = _JOBS.get(id(store))
    if jobs is None:
        jobs = _JOBS[id(store)] = CompileJobs(store, max_workers=1, finish_after_exit_s=options.compile_after_exit_s,
                                              worker_env=WORKER_ENV)
    return jobs


_WARMED: list = []  # whether this process started a compile worker ahead of its first compile


def warm_worker(store, backend, options) -> None:
    """Start the compile worker of ``store`` and warm it up (Note [Warm workers] in neff_cache.jobs),
    once a process: at the mode's entry, so that a short program's first compile does not wait
    for the worker's imports. Once, not per store: every store has its workers, and a process that
    opens many (a test suite) would keep one idle each."""
    if _WARMED:
        return
    _WARMED.append(True)
    payload = json.dumps({"backend": backend.name, "device": options.device}).encode()
    _jobs(store, options).warm("fuser.compile:warm_up", payload)


def stop_warm_up() -> None:
    """End the warm-up ``warm_worker`` started, unless a job was given to a worker since (Note
    [Warm workers] in neff_cache.jobs): called when a capture's record is found in the store, the
    sign of a program that ran before on this cache. Its warm-up, seconds of imports on another
    core, only slows the program's compiled steps (benchmarks/RESULTS.md)."""
    if _PID != os.getpid():
        return
    for jobs in list(_JOBS.values()):
        jobs.stop_warming()


def submit_job(entry, backend, store, options) -> bool:
    """Hand the compile of region ``entry`` (its key claimed) to a worker; False if the jobs cannot
    take it (shut down at exit): the caller compiles it here instead. The region is then picked up
    from the store at a later sight (``entry.other_process``)."""
    from .compile import cache_fingerprint

    store.release(entry.pkey)  # CompileJobs claims the key itself
    payload = compile_payload(entry.pkey, entry.program, backend, options.device)
    fingerprint = cache_fingerprint(backend)  # artifacts and failures alike
    try:
        submitted = _jobs(store, options).submit(
            entry.pkey, "fuser.compile:compile_job", payload, fingerprint=fingerprint, backend=backend.name,
            failure_fingerprint=fingerprint,
        )
    except Exception as e:  # noqa: BLE001 - no worker for it: compiled here instead
        log.info("adaptive_eager: compiling in this process: %s", e)
        return False
    entry.other_process = True
    _PENDING[entry.pkey] = entry
    _prepare_loads(backend)
    if not submitted:
        STATS.waited_for_other_process += 1
    return True


def compile_payload(pkey: str, program, backend, device: str) -> bytes:
    """``fuser.compile.compile_job``'s payload for ``program`` under key ``pkey``."""
    return json.dumps({"backend": backend.name, "device": device, "key": pkey,
                       "program": program.to_bytes().decode()}).encode()


# Note [Loads prepared while the first compile runs]
# A background compile's artifact is loaded on the compile thread (Note [Compile thread]) once it
# lands, and the window or captured graph replays until then. The stablehlo backend's first load
# in a process imports jax and makes XLA's client: 2.3-5.2 s measured on 2 shared cores (the
# emulated device's GPT-2 and Llama steps), spent after the compile and before the first compiled
# step. So the first background compile of a backend also sends the thread its ``prepare_load``,
# which does those imports while the worker compiles: work the first load would do anyway, done
# earlier. Once per backend class and process. An import cannot be stopped at exit as a compile is
# (Note [Compile thread]): ``_Shutdown`` raised in a C extension's init (jaxlib's MLIR libraries
# call back into Python) ends in ``std::terminate``, and a program that exited while the thread
# imported jax aborted. So the stop hook waits for a running preparation (``_PREPARE_LOCK``) before
# it raises, and a preparation that begins after the hook does nothing.
_PREPARED: set = set()
_PREPARE_LOCK = threading.Lock()


def _prepare_loads(backend) -> None:
    prepare = getattr(backend, "prepare_load", None)
    if prepare is None or type(backend) in _PREPARED or compile_thread_stopped():
        return
    _PREPARED.add(type(backend))
    _submit(_prepared, prepare)  # a failure is the first load's to report: it meets it again


def _prepared(prepare) -> None:
    with _PREPARE_LOCK:
        if _STOPPED:
            return
        try:
            prepare()
        except Exception as e:  # noqa: BLE001 - the first load tries again and reports it
            log.info("adaptive_eager: preparing loads failed: %s: %s", type(e).__name__, e)


# Note [Jobs that are not compiles]
# A job of another kind (a captured graph's AOTAutograd trace: Note [Traces off the step] in
# adaptive_eager._capture) runs in the same workers, one queue with the compiles, and its result
# lands in the store as theirs do; but it is no compile (not counted in ``compiles`` or
# ``compile_failures``) and nobody compiles it here when it fails: its submitter reads its result
# (``other_job``) and decides.
_OTHER: dict = {}  # key -> its JobResult once finished, None while it runs


def submit_other_job(key: str, fn_path: str, payload: bytes, store, options, *, fingerprint: str,
                     backend: str) -> bool | None:
    """Hand ``fn_path(payload)`` for ``key`` to a worker (Note [Jobs that are not compiles]): True
    if it runs here, False if another process holds its claim (its result will be in ``store``),
    None if the jobs cannot take it (shut down at exit, no worker)."""
    try:
        # first: the compiles it leads to wait for it, and the program runs slowest until it lands
        submitted = _jobs(store, options).submit(key, fn_path, payload, fingerprint=fingerprint, backend=backend,
                                                 first=True)
    except Exception as e:  # noqa: BLE001 - the caller does it here instead
        log.info("adaptive_eager: a %s job runs in this process: %s", fn_path, e)
        return None
    if submitted:
        _OTHER[key] = None
    return submitted


def other_job(key: str):
    """The JobResult of job ``key`` of ``submit_other_job`` once finished (then forgotten), else None;
    collect with ``fuser.regions.poll_jobs``."""
    result = _OTHER.get(key)
    if result is not None:
        del _OTHER[key]
    return result


def other_job_pending(key: str) -> bool:
    """Whether job ``key`` of ``submit_other_job`` is queued or running here."""
    return any(key in jobs.pending() for jobs in compile_jobs())


def finished_jobs() -> list:
    """The background compiles that failed since the last call, as (entry, JobResult); the others'
    artifacts are in the store now, and are counted here."""
    failed = []
    for jobs in compile_jobs():
        for result in jobs.poll():
            if result.key in _OTHER:  # Note [Jobs that are not compiles]
                _OTHER[result.key] = result
                continue
            entry = _PENDING.pop(result.key, None)
            STATS.compile_seconds += result.seconds
            if result.ok:
                STATS.compiles += 1
                log.info("adaptive_eager: compiled region %s in a worker process in %.2fs (key %s)", result.key[:8],
                         result.seconds, result.key)
            elif entry is None:
                STATS.compile_failures += 1
            else:
                failed.append((entry, result))
    return failed


def abandoned(pkey: str, store) -> bool:
    """Whether the compile of region ``pkey`` that this process waits for will never land: no job
    of ours runs it and nobody holds its claim (its holder failed or died: Note [Claim holders] in
    neff_cache.claims), so this process compiles it."""
    return pkey not in _PENDING and not store.is_claimed(pkey)


# Note [Compile thread]
# Compiles (and artifact loads) run on a thread of their own: a flush often happens inside the
# dispatch mode's __torch_dispatch__, where Python dispatch is off for the calling thread and graph
# tracing (make_fx, functionalization) cannot work; a fresh thread has clean dispatch state. The
# thread is a daemon, so a pending compile never holds the interpreter at exit. But a daemon thread
# must not still be inside torch at exit: the interpreter ends a daemon thread that wants the GIL
# back after finalization began with pthread_exit, whose unwinding through a C++ frame that
# released the GIL (every ATen call from Python does) calls std::terminate: "terminate called
# without an active exception", and the process aborts (as a Ctrl-C during an in-process compile
# did, when the main thread left the compile running). So an atexit hook stops the thread first: it raises ``_Shutdown`` in it (at
# its next Python bytecode: a running compile unwinds, releasing its claim, and a subprocess it
# waits on is killed by ``subprocess.run``) and waits up to ``_STOP_S`` for it to end. And the
# flushing thread waits for a result in slices (``_result``, ``regions._collect``): the kernel may deliver a Ctrl-C's
# SIGINT to the compile thread, which does not wake the main thread from a lock wait, so an
# unbounded wait would not raise KeyboardInterrupt until the compile ended.
# Once stopped, the thread is never asked again: a flush after the hook (adaptive eager's own
# atexit hook, registered at ``import torch``, before the thread's, so it runs after it, flushes
# what is pending) would wait for ever on a task no thread takes. So after the hook a window that
# would compile or load replays ("exiting" in ``replay_reasons``), and a wait for a task the
# stopped thread never finished ends (``compile_thread_stopped``).
_QUEUE: queue.SimpleQueue | None = None
_THREAD: threading.Thread | None = None
_PID = os.getpid()  # the process the thread runs in (a forked child has the queue, not the thread)
_STOP_S = 30.0  # longer than one step of a compile can hold the thread in C code (one g++ run)
_WORKING = [0]  # 1 while the compile thread runs a compile or a load (``compiling``)
_STOPPED = False  # the atexit hook stopped the thread: it is never started again in this process


class _Shutdown(BaseException):
    """Raised in the compile thread at interpreter exit (Note [Compile thread])."""


def _worker() -> None:
    try:
        while True:
            task = _QUEUE.get()
            if task is None:
                return
            future, fn, args = task
            if future.set_running_or_notify_cancel():
                _WORKING[0] = 1
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 - handed to the flushing thread
                    future.set_exception(e)
                    if isinstance(e, _Shutdown):
                        return
                finally:
                    _WORKING[0] = 0
    except _Shutdown:
        return


def compile_thread_stopped() -> bool:
    """Whether the interpreter is exiting and the compile thread is stopped (Note [Compile thread]):
    nothing may be compiled or loaded in this process any more."""
    return _STOPPED and _PID == os.getpid()


def _submit(fn, *args) -> Future:
    if compile_thread_stopped():
        raise RuntimeError("adaptive_eager: a compile or load was asked for after the compile thread "
                           "stopped at exit (Note [Compile thread]); the caller replays instead")
    if _THREAD is None or _PID != os.getpid():
        _start_compile_thread()
    future: Future = Future()
    _QUEUE.put((future, fn, args))
    return future


def _result(future: Future):
    while True:
        try:
            return future.result(timeout=0.1)  # Note [Compile thread]: a Ctrl-C is seen within 0.1 s
        except TimeoutError:
            pass


def _start_compile_thread() -> None:
    global _QUEUE, _THREAD, _PID
    _QUEUE, _PID = queue.SimpleQueue(), os.getpid()
    _THREAD = threading.Thread(target=_worker, name="adaptive_eager_compile", daemon=True)
    _THREAD.start()
    atexit.register(_stop_compile_thread)


def _stop_compile_thread() -> None:
    """Note [Compile thread]: no thread of ours may be inside torch when the interpreter finalizes."""
    global _STOPPED
    thread = _THREAD
    if thread is None or _PID != os.getpid():
        return
    _STOPPED = True
    if not thread.is_alive():
        return
    _QUEUE.put(None)  # an idle thread ends at once; a busy one is interrupted
    # ... but not inside an import (Note [Loads prepared while the first compile runs])
    if _PREPARE_LOCK.acquire(timeout=_STOP_S):
        _PREPARE_LOCK.release()
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(_Shutdown))
    thread.join(_STOP_S)


_STORES: dict = {}


def _store(options):
    """The persistent artifact store of ``options.cache_dir`` (one per directory and process)."""
    from neff_cache import ArtifactStore

    where = (os.path.expanduser(options.cache_dir), options.cache_size_mb, options.cache_shared, os.getpid())
    store = _STORES.get(where)
    if store is None:
        store = _STORES[where] = ArtifactStore(where[0], size_limit_mb=options.cache_size_mb,
                                               shared=options.cache_shared)
    return store


def stores() -> list:
    return list(_STORES.values())  # a copy: another thread may open one meanwhile


def forget_stores() -> None:
    _STORES.clear()


def compile_jobs() -> list:
    return list(_JOBS.values())


def compiling() -> int:
    """How many compiles (or loads, or workers' warm-ups) of this process run now beside its
    program: the compile thread's and the workers' (Note [Cores beside a compile] in
    adaptive_eager._cores)."""
    working = _WORKING[0] if _PID == os.getpid() else 0
    for jobs in list(_JOBS.values()):
        working += jobs.busy()
    return working
