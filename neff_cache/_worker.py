"""The compile worker process: receives ("module:function", payload, destination, bounds), replies
with the result.

Started by ``neff_cache.jobs`` as ``python -c BOOTSTRAP <fd> <sys.path as JSON> <parent pid>
<limits fd>``; see Note [Compile worker processes] there. It imports nothing heavy itself: the
compile function's module does. With a destination (the store the parent uses), the worker stores
the artifact, or the failure, itself, so that a compile that outlives its program still lands (Note
[Compiles that outlive the program]), and then runs the compiles the job named for a program that is
gone (Note [Follow-up compiles after exit]). A watchdog process bounds each job's memory and time
(Note [Compile limits]).
"""

from __future__ import annotations

import importlib
import os
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, Callable

BOOTSTRAP = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[2]); "
    "from neff_cache._worker import serve; serve(int(sys.argv[1]), int(sys.argv[3]), int(sys.argv[4]))"
)

_PARENT_POLL_S = 0.2
_LIMIT_POLL_S = 0.1  # how often the watchdog reads the compile's memory and time
LIMIT_EXCEEDED = "CompileLimitExceeded"  # how an abandoned compile's failure begins (Note [Compile limits])
WARM = "warm"  # a message's destination that asks for a warm-up: Note [Warm workers] in neff_cache.jobs


_CONNECTION: list = []  # the connection to the parent, in a worker process (``job_waiting``)


def job_waiting() -> bool:
    """Whether the parent has sent this worker a job that waits to be read: a warm-up asks between
    its stages and ends early if so (Note [Warm workers] in neff_cache.jobs). False outside a worker."""
    try:
        return bool(_CONNECTION) and _CONNECTION[0].poll(0)
    except (OSError, EOFError):
        return False


def resolve(fn_path: str) -> Callable[[bytes], bytes]:
    """Import the function named by ``"package.module:function"`` (the function may be dotted)."""
    module_name, _, qualname = fn_path.partition(":")
    target = importlib.import_module(module_name)
    for attribute in qualname.split("."):
        target = getattr(target, attribute)
    return target


class _Job:
    """What the parent-watching thread needs to know about the job running now."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.after_exit_s: float | None = None  # None: no job running


# Note [Follow-up compiles after exit]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Some jobs make what the program then compiles: a captured graph's trace (Note [Traces off the
# step] in adaptive_eager._capture) makes the graphs whose compiles the program submits once it
# reads the record. A program that exits before reading it (a short run whose worker was still
# importing the compiler when the trace was sent) submits none, and nobody compiled those graphs:
# the next process found the record, submitted them itself and ran them op by op (and the windows
# around them as they are recorded beside an uncompiled graph) for as long as they took. So a job
# function names such compiles (``follow_up``), and once its own result is stored and sent, a
# worker whose program is gone runs them itself: one after the other, each under its own key
# claimed in the job's store and stored there with the job's fingerprint, each bounded as a job is
# (Note [Compile limits]) and within the program's time after exit. While the program lives they
# are held, not dropped: a program may exit after the result was sent and before it read it (a
# capture polls for its record every ``_POLL_S``), and then nobody else would compile them. A held
# compile whose key the program stored or claimed first (it read the result and submitted it
# itself) is skipped. The held ones run once the program is gone: after the job running then, or at
# end-of-input.
_PARENT = [0]  # the program's pid, once serving
_FOLLOW_UPS: list = []  # (key, fn_path, payload, backend) named by the running job
_HELD: list = []  # (key, fn_path, payload, destination, bounds) named by the jobs run, until the program is gone
_HELD_MAX = 256  # the newest kept: a long program reads its results and submits their compiles itself


def program_gone() -> bool:
    """Whether this is a worker whose program has exited (Note [Follow-up compiles after exit])."""
    return _PARENT[0] != 0 and os.getppid() != _PARENT[0]


def follow_up(key: str, fn_path: str, payload: bytes, *, backend: str) -> None:
    """Have ``fn_path(payload)`` compile ``key`` once the program is gone, unless the program compiled
    it first (Note [Follow-up compiles after exit]); its artifact is stored where the job's result goes."""
    _FOLLOW_UPS.append((key, fn_path, bytes(payload), backend))


def _watch_parent(parent: int, running: _Job) -> None:
    """Once the parent is gone, give the job running then (or the one it sent last, read after it
    exited) ``after_exit_s`` to finish, then kill this process group (the worker and the
    compilers it started). An idle worker exits by itself, at end-of-input."""
    while os.getppid() == parent:
        time.sleep(_PARENT_POLL_S)
    # Let go of the program's stdout and stderr: a reader that drains them to the end (a shell
    # pipeline, a caller's capture) would otherwise wait for this compile.
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(devnull, fd)
    deadline = None
    while True:
        with running.lock:
            if running.after_exit_s is not None:
                if deadline is None:
                    deadline = time.monotonic() + running.after_exit_s
                if time.monotonic() >= deadline:
                    os.killpg(os.getpgrp(), signal.SIGKILL)
        time.sleep(_PARENT_POLL_S)


# Note [Compile limits]
# ~~~~~~~~~~~~~~~~~~~~~
# A compiler can run away: torch-mlir lowering a ``slice_scatter`` that ends at INT64_MAX took
# ~20 GB over 58 s before failing with ``std::bad_alloc``, and a 24 GB machine running the program
# beside it has no such room. Each job therefore runs under a memory bound (the resident memory of
# the worker and every process it started: Inductor's and neuronx-cc's compilers) and a wall-time
# bound, both sent with the job. They cannot be watched by a thread of the worker: the compiler
# holds the GIL through its C++ passes (19 s without a switch, measured on that lowering), and
# ``RLIMIT_AS`` bounds address space, which XLA and torch reserve far beyond what they touch. So a
# watchdog process, forked before the worker imports anything heavy, reads the worker's memory and
# the job's age every ``_LIMIT_POLL_S``; past a bound it remembers the failure in the destination
# store (as a compile that raised is: Note [Remembered failures] in neff_cache.store), writes it on
# the parent's limits pipe, and kills the process group (worker, compilers, itself). The parent,
# seeing the worker die, reads that pipe: a job named there is not retried but reported failed with
# the reason, which begins with ``LIMIT_EXCEEDED``. The program never waits for the compile: its
# window replays, as for any failed compile. A compile in the program's own process (the fuser's
# ``async_compile=False``, or no worker could start) is not bounded: it cannot be killed alone.


def _tree_rss(pid: int) -> int:
    """Resident bytes of process ``pid`` and of its descendants (0 for those gone meanwhile)."""
    total, todo, page = 0, [pid], os.sysconf("SC_PAGE_SIZE")
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * page
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
    return total


def _watchdog(jobs: int, limits: int, worker: int) -> None:
    """The watchdog process's loop (Note [Compile limits]): ``jobs`` carries the worker's
    "start <JSON>" / "end" lines, ``limits`` goes to the parent; ends at the worker's end."""
    import json
    import select

    job, started, pending = None, 0.0, b""
    while True:
        ready, _, _ = select.select([jobs], [], [], _LIMIT_POLL_S)
        if ready:
            data = os.read(jobs, 65536)
            if not data:
                os._exit(0)  # the worker is gone
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                job, started = (json.loads(line[6:]), time.monotonic()) if line.startswith(b"start ") else (None, 0.0)
        if job is None:
            continue
        age, rss = time.monotonic() - started, _tree_rss(worker)
        memory, seconds = job.get("memory_bytes"), job.get("seconds")
        if memory is not None and rss > memory:
            why = (f"the compile used {rss / 2**30:.2f} GiB of memory, over its bound of {memory / 2**30:.2f} GiB, "
                   f"after {age:.1f} s")
        elif seconds is not None and age > seconds:
            why = f"the compile ran for {age:.0f} s, over its bound of {seconds:.0f} s"
        else:
            continue
        failure = f"{LIMIT_EXCEEDED}: {why}; abandoned (the region runs uncompiled)"
        destination = job.get("destination")
        stored = destination is not None and _store(destination, [False, failure, age, failure])
        try:
            os.write(limits, json.dumps({"key": job["key"], "failure": failure, "seconds": age,
                                         "stored": stored}).encode() + b"\n")
        finally:
            os.killpg(os.getpgrp(), signal.SIGKILL)


def _start_watchdog(limits: int, connection: int) -> int:
    """Fork the watchdog (Note [Compile limits]); the pipe to it, for ``_tell``."""
    jobs_read, jobs_write = os.pipe()
    worker = os.getpid()
    if os.fork() == 0:
        try:
            os.close(jobs_write)
            os.close(connection)  # the parent sees the worker's end as EOF, not the watchdog's
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):  # a reader of the program's output waits for the worker only (_watch_parent)
                os.dup2(devnull, fd)
            _watchdog(jobs_read, limits, worker)
        finally:
            os._exit(0)
    os.close(jobs_read)
    os.close(limits)
    return jobs_write


def _tell(watchdog: int, line: str) -> None:
    try:
        os.write(watchdog, line.encode() + b"\n")
    except OSError:
        pass  # no watchdog: the job runs unbounded


def serve(fd: int, parent: int, limits: int) -> None:
    """Run jobs sent over the connection on ``fd`` one at a time until the parent closes it, each
    under the memory and time bounds it comes with (Note [Compile limits]; ``limits``: the pipe on
    which an abandoned job is reported).

    Each reply is ``(True, artifact bytes, seconds, None, stored)`` or ``(False, traceback text,
    seconds, exception text, stored)``; ``stored`` says whether the worker put the result in the
    destination store itself.
    """
    watchdog = _start_watchdog(limits, fd)  # before any thread: it forks
    connection = Connection(fd)
    _CONNECTION[:] = [connection]
    running = _Job()
    _PARENT[0] = parent
    # the parent's pid from the parent: it may have exited before this process got here
    threading.Thread(target=_watch_parent, args=(parent, running), daemon=True).start()
    functions: dict[str, Callable[[bytes], bytes]] = {}
    while True:
        try:
            fn_path, payload, destination, bounds = connection.recv()
        except (EOFError, ConnectionError):
            # the parent closed its end: an exit with a reply of ours unread resets the connection
            if program_gone():
                _follow_ups(functions, watchdog, running)
            return
        if destination == WARM:  # Note [Warm workers] in neff_cache.jobs: nothing stored, one reply
            try:
                function = functions.get(fn_path) or functions.setdefault(fn_path, resolve(fn_path))
                function(payload)
            except Exception:  # noqa: BLE001 - the first job imports and fails (and says why) in its turn
                pass
            try:
                connection.send((WARM,))
            except (BrokenPipeError, ConnectionResetError):
                pass  # the parent is gone: what it sent is read, then end-of-input ends this process
            continue
        _FOLLOW_UPS.clear()
        reply = _run(functions, fn_path, payload, destination, bounds, watchdog, running)
        stored = destination is not None and _store(destination, reply)
        try:
            connection.send((*reply, stored))
        except (BrokenPipeError, ConnectionResetError):
            # the parent is gone; the result is in the store if it had one. The jobs it queued
            # for after its exit are still to be read (Note [Compiles that outlive the program]
            # in neff_cache.jobs); then end-of-input ends this process
            pass
        if destination is not None:
            _HELD.extend((key, follow_fn, follow_payload, {**destination, "key": key, "backend": backend}, bounds)
                         for key, follow_fn, follow_payload, backend in _FOLLOW_UPS)
            del _HELD[:-_HELD_MAX]
        _FOLLOW_UPS.clear()
        if program_gone():
            _follow_ups(functions, watchdog, running)


def _follow_ups(functions: dict, watchdog: int, running: _Job) -> None:
    """The compiles the jobs named (Note [Follow-up compiles after exit]), each unless its key is
    stored or claimed meanwhile (the program submitted it before it exited)."""
    while _HELD:
        key, fn_path, payload, where, bounds = _HELD.pop(0)
        store = _open(where)
        if store is None or store.contains(key) or not store.claim(key, ttl_s=where.get("claim_ttl_s", 900.0)):
            continue
        _store(where, _run(functions, fn_path, payload, where, {**bounds, "key": key}, watchdog, running))


def _run(functions: dict, fn_path: str, payload: bytes, destination: dict | None, bounds: dict, watchdog: int,
         running: _Job) -> list:
    """One job, under its bounds (Note [Compile limits]): its reply without ``stored``."""
    import json

    with running.lock:
        running.after_exit_s = destination["after_exit_s"] if destination is not None else 0.0
    start = time.perf_counter()
    _tell(watchdog, "start " + json.dumps({**bounds, "destination": destination}))
    try:
        function = functions.get(fn_path)
        if function is None:
            function = functions[fn_path] = resolve(fn_path)
            start = time.perf_counter()  # importing the compiler (torch, ...) is not compile time
        artifact = function(payload)
        if not isinstance(artifact, (bytes, bytearray, memoryview)):
            returned = type(artifact).__name__
            raise TypeError(f"{fn_path} returned {returned}; a compile function must return bytes")
        reply = [True, bytes(artifact), time.perf_counter() - start, None]
    except Exception as error:
        failure = "".join(traceback.format_exception_only(error)).strip()
        reply = [False, traceback.format_exc(), time.perf_counter() - start, failure]
    _tell(watchdog, "end")
    with running.lock:
        running.after_exit_s = None
    return reply


_STORES: dict[tuple, Any] = {}


def _open(destination: dict):
    """The destination's store, opened once per process; None if it cannot be opened."""
    from neff_cache.store import ArtifactStore

    where = (destination["directory"], destination["size_limit_mb"], destination["format_version"])
    try:
        store = _STORES.get(where)
        if store is None:
            store = _STORES[where] = ArtifactStore(where[0], size_limit_mb=where[1], format_version=where[2])
        return store
    except Exception:  # noqa: BLE001 - the parent stores it instead
        return None


def _store(destination: dict, reply: list) -> bool:
    """Put the artifact (or the failure) in the destination store and release the job's claim if it
    was handed over to this process; True if it landed on disk."""
    try:
        store = _open(destination)
        if store is None:
            return False
        ok, result, seconds, failure = reply
        key, fingerprint, backend = destination["key"], destination["fingerprint"], destination["backend"]
        if ok:
            store.put(key, result, fingerprint=fingerprint, backend=backend, compile_seconds=seconds)
        else:
            store.put_failure(key, failure, fingerprint=destination.get("failure_fingerprint") or fingerprint,
                              backend=backend)
        store.release(key)  # only a claim handed over to this process (Note [Claim holders] in neff_cache.claims)
        return not (store.in_memory or store.read_only)
    except Exception:  # noqa: BLE001 - the parent stores it instead
        return False
