"""Background compile jobs: run a compile function named by import path on a payload, in worker
processes, and store the bytes it returns in an ArtifactStore.

The compile function is ``f(payload: bytes) -> bytes``, named ``"package.module:function"``; the
runner measures its wall time in the worker (not counting the first import of its module) and
records it as the artifact's compile seconds.

Note [Compile worker processes]
Workers are fresh interpreters started with ``subprocess`` (``python -c``): not forked, since torch
is not fork-safe, and not multiprocessing's "spawn" either, because spawn re-imports the parent's
``__main__`` in every worker, so a training script without an ``if __name__ == "__main__"`` guard
(common, and adaptive eager is switched on by an environment variable with no code change) would
run again inside each worker. A worker gets the parent's ``sys.path`` so that "module:function"
resolves as it would in the parent, and the parent's environment with the caller's ``worker_env``
over it: whatever a worker must not inherit (the switch that turns adaptive eager on at ``import
torch``: a compile must not itself be recorded) is set by the code that starts it, so that the
compile function need not import the package that submitted it. Each worker runs one job at a time over its own pipe, so when a
worker dies the job it was running is known exactly; that job is retried once, alone (no other job
runs beside it, so a second death is its own), and then reported as failed. Workers run in a
session of their own: Ctrl-C reaches only the user's program, and killing a worker's process group
also stops the compilers it started.

Note [Warm workers]
A fresh worker spends seconds before its first compile can start: importing torch, then the
compiler's own modules (Dynamo, AOTAutograd and Inductor: 5.6 s of a small region's first compile
of 8.5 s, against 0.8 s for the same compile again, in one worker on 2 shared cores). Started at
the first ``submit``, the worker makes a short program wait that long for its first compiled
window (a DataLoader loop of 31 steps an epoch ran three epochs replayed). ``warm`` starts a
worker before any job and sends it a warm-up: ``fn_path(payload)`` run once, its result dropped
(nothing stored, a failure ignored: the first job meets it again and reports it; the one reply,
``(WARM,)``, says only that it ended, for ``busy``). A job sent to that worker meanwhile waits in
its pipe until the warm-up ends; so a warm-up made of stages asks ``_worker.job_waiting()`` between
them and ends early when a job waits: the job needs the imports, but not the warm-up's own
compile, and a first job that compiles nothing (a captured graph's trace) waited for all of it
(Inductor's: 5.3 s in a worker on 2 shared cores, 3.7 s of it imports). A worker that dies warming up is replaced when a job needs one, as
an idle worker that dies is. A program that finds what it needs in the store (a capture's record:
adaptive_eager._capture) ends the warm-up with ``stop_warming``, which kills a worker still
warming if no job was ever queued: its seconds of imports on the other core made a warm process's
compiled steps 130-1090 ms where they take 2-24 ms (benchmarks/RESULTS.md); a later job starts a
worker as if none had been warmed.

Note [Results are collected by poll]
No thread runs in the background: ``submit`` starts jobs and ``poll`` collects finished ones,
releases their claims and starts queued jobs. The fuser polls when a window's region waits for
a compile elsewhere, not at every flush. So nothing can hold the interpreter at exit.

Note [Compiles that outlive the program]
A program shorter than its first compile (a test, a 20-step run on a loaded machine) would never
benefit from the cache if its compiles died with it. So a worker is told where the parent's store
is and stores each artifact (or remembered failure) itself, and at exit the parent hands the claim
of each running job over to its worker (Note [Claim holders] in neff_cache.claims) and leaves it
running, without waiting: the worker finishes, stores, releases the claim and exits. A thread in
the worker bounds this: once the parent is gone, the running job gets ``finish_after_exit_s``
seconds, after which the worker kills its process group (itself and its compilers). Jobs still
queued at exit go to that worker too, their claims handed over to it, and run after the running
one within the same ``finish_after_exit_s`` (a program whose steps outrun its compiles, say a
cold run of a few seconds, left half its compiles to the next run when they were dropped); they
are sent by a thread the exit waits for up to ``_SEND_AT_EXIT_S``, since a worker busy compiling
reads nothing and a full pipe would block (a job cut off mid-message ends the worker at its next
read, after its running job, and the claims of those not run go with it). With
``finish_after_exit_s=0``, or a store that is not on a writable disk, the workers are killed at
exit instead and the claims of running and queued jobs released,
so that other processes need not wait for the claim ttl. The parent stores a result itself only
when the worker could not (``stored`` in its reply) or its own store is no longer on that disk.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import NamedTuple

from neff_cache._worker import BOOTSTRAP, WARM
from neff_cache.store import BYTES_PER_MB, ArtifactStore

log = logging.getLogger("neff_cache")

_FN_PATH_PATTERN = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")
_ATTEMPTS = 2  # a job whose worker dies is retried once
_SEND_AT_EXIT_S = 1.0  # Note [Compiles that outlive the program]
# Note [Compile limits] in neff_cache._worker: the bounds a job runs under unless CompileJobs is
# given others. Memory: a share of the machine's (or the cgroup's) memory, so that the program
# beside the compile keeps the rest: 11.5 GiB on a 23 GiB machine, where the compile worker of the
# test suite's GPT-2 and Llama training steps on stablehlo peaked at 0.68 and 0.60 GiB resident
# (the runaway lowering of Note [Slice bounds] in fuser.backends._stablehlo_lowering reached
# ~20 GB). Time: None: the claim's ttl (15 minutes by default), after which other processes
# would take the key anyway; those compiles took 20-35 s each on 2 shared cores.
COMPILE_MEMORY_SHARE = 0.5
COMPILE_TIME_LIMIT_S: float | None = None

# Note [Answers, not failures]
# A job's function may refuse its input by design: a capture's trace job declines a graph it must
# not capture (``adaptive_eager._capture._Decline``), which the program reads back and counts
# (``capture_records``, ``explain()``). Such a refusal is remembered as any failure is, but logged
# at INFO: as a WARNING, "compile job for key ... failed" reached the user for a module that
# writes its input in place, about nothing they should change. The layers above name their
# exception types here (``answers_not_failures``); this module imports none of them.
_ANSWERS: set[str] = set()


def answers_not_failures(exception_type: type) -> None:
    """Jobs that raise ``exception_type`` refused their input by design (Note [Answers, not failures])."""
    _ANSWERS.add(f"{exception_type.__module__}.{exception_type.__qualname__}")


def default_memory_limit() -> int:
    """``COMPILE_MEMORY_SHARE`` of the memory this process may use: the machine's, or its cgroup's
    limit when lower."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                total = min(total, int(f.read().strip()))
            break
        except (OSError, ValueError):
            continue
    return int(total * COMPILE_MEMORY_SHARE)


class JobResult(NamedTuple):
    """A finished job: ``error`` is None when the artifact was stored, else says why it was not;
    ``failure`` is the exception the compile function raised, as the end of its traceback reads
    (what the store remembers: Note [Remembered failures] in
    neff_cache.store), None when it did not raise."""

    key: str
    ok: bool
    error: str | None
    seconds: float = 0.0  # how long the worker compiled (0 when it died)
    failure: str | None = None


@dataclasses.dataclass
class _Job:
    key: str
    fn_path: str
    payload: bytes
    fingerprint: str
    backend: str
    destination: dict | None  # where the worker stores the result: Note [Compiles that outlive the program]
    failure_fingerprint: str | None = None  # what a failure is remembered under (default: ``fingerprint``)
    attempts: int = 0
    alone: bool = False  # a retry after a worker died runs with no other job beside it
    first: bool = False  # queued ahead of the others (``submit``)


class _Worker:
    """One worker process and the pipe to it; it runs at most one job at a time."""

    def __init__(self, env: dict[str, str], bounds: dict) -> None:
        connection, child_end = multiprocessing.Pipe()
        limits, limits_end = os.pipe()  # Note [Compile limits] in neff_cache._worker
        os.set_blocking(limits, False)
        parent_sys_path = json.dumps([str(entry) for entry in sys.path])
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", BOOTSTRAP, str(child_end.fileno()), parent_sys_path, str(os.getpid()),
                 str(limits_end)],
                pass_fds=(child_end.fileno(), limits_end),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, **env} if env else None,  # Note [Compile worker processes]
            )
        except BaseException:
            connection.close()
            os.close(limits)
            raise
        finally:
            child_end.close()  # else the worker's death would not show as EOF on our end
            os.close(limits_end)
        self.connection = connection
        self.limits = limits
        self.bounds = bounds
        self.job: _Job | None = None
        self.warming = False  # a warm-up sent and its end not yet read (Note [Warm workers])

    def start(self, job: _Job) -> None:
        job.attempts += 1
        self.job = job
        self.connection.send((job.fn_path, job.payload, job.destination, {"key": job.key, **self.bounds}))

    def abandoned(self, key: str) -> dict | None:
        """What the watchdog reported when it abandoned job ``key`` (Note [Compile limits] in
        neff_cache._worker), or None: the worker died otherwise."""
        try:
            data = os.read(self.limits, 1 << 20)
        except (BlockingIOError, OSError):
            return None
        for line in data.splitlines():
            try:
                report = json.loads(line)
            except ValueError:
                continue
            if isinstance(report, dict) and report.get("key") == key and isinstance(report.get("failure"), str):
                return report
        return None

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.connection.close()
        try:
            self.process.wait(timeout=5.0)  # reap it; SIGKILL takes effect at once unless the kernel is stuck
        except subprocess.TimeoutExpired:
            pass
        self._close_limits()

    def _close_limits(self) -> None:
        if self.limits >= 0:
            os.close(self.limits)
            self.limits = -1

    def stop(self, timeout_s: float) -> None:
        """Let an idle worker exit on end-of-input; kill it if it does not within ``timeout_s``."""
        self.connection.close()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
        self._close_limits()

    def exit_description(self) -> str:
        returncode = self.process.poll()
        if returncode is None:
            return "stopped responding"
        if returncode < 0:
            try:
                return f"killed by {signal.Signals(-returncode).name}"
            except ValueError:
                return f"killed by signal {-returncode}"
        return f"exited with code {returncode}"


def _send_all(worker: _Worker, jobs: list) -> None:
    """Send ``jobs`` to ``worker`` after the one it runs (Note [Compiles that outlive the program])."""
    try:
        for job in jobs:
            job.attempts += 1
            worker.connection.send((job.fn_path, job.payload, job.destination, {"key": job.key, **worker.bounds}))
    except OSError:
        pass  # the worker is gone: the claims handed to it are stale, anyone may compile them


class CompileJobs:
    """Runs compile functions in background worker processes and stores their artifacts.

    ``submit`` starts a job unless its key is pending, stored, or claimed by another process (so
    the key is compiled once across processes); ``poll`` returns finished jobs. A worker that dies
    is replaced and its job retried once; the caller never sees an exception from a job. A job
    running at exit finishes within ``finish_after_exit_s`` (Note [Compiles that outlive the
    program]). Not meant to be shared across ``fork``: a forked child starts with no jobs and its
    own workers.
    """

    def __init__(
        self, store: ArtifactStore, max_workers: int = 1, *, claim_ttl_s: float = 900.0,
        finish_after_exit_s: float = 0.0, worker_env: Mapping[str, str] | None = None,
        memory_limit_bytes: int | None = None, time_limit_s: float | None = None,
    ):
        if type(max_workers) is not int or max_workers < 1:
            raise ValueError(f"max_workers must be an integer >= 1, got {max_workers!r}")
        if not claim_ttl_s > 0:
            raise ValueError(f"claim_ttl_s must be positive, got {claim_ttl_s!r}")
        if not finish_after_exit_s >= 0:
            raise ValueError(f"finish_after_exit_s must be >= 0, got {finish_after_exit_s!r}")
        self.store = store
        self.max_workers = max_workers
        self.claim_ttl_s = claim_ttl_s
        self.finish_after_exit_s = float(finish_after_exit_s)
        self.worker_env = dict(worker_env or {})  # set in each worker's environment: Note [Compile worker processes]
        # Note [Compile limits] in neff_cache._worker
        memory = default_memory_limit() if memory_limit_bytes is None else memory_limit_bytes
        seconds = (COMPILE_TIME_LIMIT_S or claim_ttl_s) if time_limit_s is None else time_limit_s
        if not memory > 0 or not seconds > 0:
            raise ValueError(f"compile limits must be positive, got {memory!r} bytes and {seconds!r} s")
        self.bounds = {"memory_bytes": int(memory), "seconds": float(seconds)}
        self._queue: collections.deque[_Job] = collections.deque()
        self._workers: list[_Worker] = []
        self._finished: list[JobResult] = []
        self._lock = threading.RLock()
        self._pid = os.getpid()
        self._shut_down = False
        self._submitted = False  # a job was queued here once: a warming worker is kept (``stop_warming``)
        atexit.register(self._stop_at_exit)

    def submit(self, key: str, fn_path: str, payload: bytes, *, fingerprint: str, backend: str,
               failure_fingerprint: str | None = None, first: bool = False) -> bool:
        """Queue ``fn_path(payload)`` to compile ``key``; False if ``key`` is already pending here,
        already stored, or being compiled by another process (use ``store.wait_for`` for that). A
        failure is remembered under ``failure_fingerprint`` (default: ``fingerprint``; Note
        [Remembered failures] in neff_cache.store). ``first``: ahead of the queued jobs (a job
        whose result others wait for), not of a retry that must run alone."""
        if type(fn_path) is not str or _FN_PATH_PATTERN.fullmatch(fn_path) is None:
            raise ValueError(f"fn_path must name a function as 'package.module:function', got {fn_path!r}")
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise TypeError(f"payload for key {key} must be bytes, got {type(payload).__name__}")
        with self._lock:
            self._forget_parent_jobs_after_fork()
            if self._shut_down:
                raise RuntimeError("CompileJobs.submit after shutdown(); create a new CompileJobs")
            if key in self._pending_keys() or self.store.contains(key):
                return False
            if not self.store.claim(key, ttl_s=self.claim_ttl_s):
                return False
            failure_fp = str(fingerprint if failure_fingerprint is None else failure_fingerprint)
            destination = self._destination(key, fingerprint, backend, failure_fp)
            job = _Job(key, fn_path, bytes(payload), str(fingerprint), str(backend), destination,
                       failure_fingerprint=failure_fp, first=first)
            self._submitted = True
            if first:
                ahead = sum(1 for queued in self._queue if queued.alone or queued.first)
                self._queue.insert(ahead, job)
            else:
                self._queue.append(job)
            self._start_queued_jobs()
            return True

    def warm(self, fn_path: str, payload: bytes) -> bool:
        """Start a worker now, if none runs, and have it call ``fn_path(payload)`` before any job
        (Note [Warm workers]); False if a worker runs already or none could start."""
        with self._lock:
            self._forget_parent_jobs_after_fork()
            if self._shut_down or self._workers:
                return False
            try:
                worker = _Worker(self.worker_env, self.bounds)
            except OSError as error:
                log.info("no compile worker was started ahead of the first compile: %s", error)
                return False
            try:
                worker.connection.send((fn_path, bytes(payload), WARM, {}))
            except OSError:
                worker.kill()
                return False
            worker.warming = True
            self._workers.append(worker)
            return True

    def stop_warming(self) -> bool:
        """Kill a worker that is still warming up, if no job was ever given to this process's
        workers (Note [Warm workers]): the program found what it needs in the store. A later
        ``submit`` starts a worker as it would with none warmed. True if one was killed."""
        with self._lock:
            self._forget_parent_jobs_after_fork()
            if self._submitted or self._queue:
                return False
            warming = [w for w in self._workers if w.warming and w.job is None]
            for worker in warming:
                self._workers.remove(worker)
                worker.warming = False
                worker.kill()
            return bool(warming)

    def busy(self) -> int:
        """How many workers compile or warm up now (queued jobs wait for them). Asked at every flush
        while it is not 0 (Note [Cores beside a compile] in adaptive_eager._cores): it takes the lock
        only when that is free, and then collects what ended without waiting, as ``poll(0)``
        does (what it collects, ``poll`` reports)."""
        if self._pid != os.getpid():
            return 0
        busy = [w for w in list(self._workers) if w.job is not None or w.warming]
        if busy and self._lock.acquire(blocking=False):
            try:
                self._collect(0.0)
                self._start_queued_jobs()
            finally:
                self._lock.release()
            busy = [w for w in list(self._workers) if w.job is not None or w.warming]
        return len(busy)

    def poll(self, timeout_s: float = 0.0) -> list[JobResult]:
        """Collect finished jobs (their artifacts are stored by now) and start queued ones; waits up
        to ``timeout_s`` for at least one job to finish. Every submitted key is reported once."""
        with self._lock:
            self._forget_parent_jobs_after_fork()
            deadline = time.monotonic() + timeout_s
            while True:
                self._collect(max(0.0, deadline - time.monotonic()))
                self._start_queued_jobs()
                running = any(worker.job is not None for worker in self._workers)
                if self._finished or not running or time.monotonic() >= deadline:
                    break
            finished, self._finished = self._finished, []
            return finished

    def pending(self) -> set[str]:
        """Keys submitted here and not yet reported by ``poll`` as finished."""
        with self._lock:
            self._forget_parent_jobs_after_fork()
            return self._pending_keys()

    def running(self) -> set[str]:
        """Keys whose compile is running in a worker now (the rest of ``pending`` is queued)."""
        with self._lock:
            self._forget_parent_jobs_after_fork()
            return {worker.job.key for worker in self._workers if worker.job is not None}

    def shutdown(self, wait: bool = False) -> None:
        """Stop the workers. With ``wait``, first let every pending job finish and store its artifact;
        without, kill them now and report unfinished jobs as cancelled (their claims are released)."""
        with self._lock:
            self._forget_parent_jobs_after_fork()
            while wait and self._pending_keys():
                self._collect(0.1)
                self._start_queued_jobs()
            for job in self._unfinished_jobs():
                self._finish(job, "cancelled: CompileJobs.shutdown() came before it finished", logging.INFO)
            self._queue.clear()
            for worker in self._workers:
                worker.job = None
                if wait:
                    worker.stop(timeout_s=5.0)
                else:
                    worker.kill()
            self._workers.clear()
            self._shut_down = True
            atexit.unregister(self._stop_at_exit)

    # ------------------------------------------------------------------------------ helpers

    def _destination(self, key: str, fingerprint: str, backend: str, failure_fingerprint: str) -> dict | None:
        store = self.store
        if store.in_memory or store.read_only:
            return None  # the worker could not reach what this process stores
        return {"directory": store.directory, "size_limit_mb": store.size_limit_bytes / BYTES_PER_MB,
                "format_version": store.format_version, "key": key, "fingerprint": str(fingerprint),
                "backend": str(backend), "after_exit_s": self.finish_after_exit_s,
                "failure_fingerprint": failure_fingerprint, "claim_ttl_s": self.claim_ttl_s}

    def _pending_keys(self) -> set[str]:
        return {job.key for job in self._unfinished_jobs()}

    def _unfinished_jobs(self) -> list[_Job]:
        return [worker.job for worker in self._workers if worker.job is not None] + list(self._queue)

    def _start_queued_jobs(self) -> None:
        for worker in [w for w in self._workers if w.job is None and w.process.poll() is not None]:
            self._workers.remove(worker)  # died while idle (OOM killer, a stray kill)
            worker.connection.close()
            worker._close_limits()
        while self._queue:
            busy = [worker.job for worker in self._workers if worker.job is not None]
            job = self._queue[0]
            if len(busy) >= self.max_workers or (busy and (job.alone or any(other.alone for other in busy))):
                return
            self._queue.popleft()
            worker = next((w for w in self._workers if w.job is None), None)
            if worker is None:
                try:
                    worker = _Worker(self.worker_env, self.bounds)
                except OSError as error:
                    self._finish(job, f"could not start a compile worker: {type(error).__name__}: {error}")
                    continue
                self._workers.append(worker)
            try:
                worker.start(job)
            except OSError:
                self._worker_died(worker)

    def _collect(self, timeout_s: float) -> None:
        busy = {worker.connection: worker for worker in self._workers if worker.job is not None or worker.warming}
        if not busy:
            return
        for connection in multiprocessing.connection.wait(list(busy), timeout_s):
            worker = busy[connection]
            try:
                reply = connection.recv()
                if worker.warming and reply == (WARM,):  # Note [Warm workers]: its job's reply, if any, follows
                    worker.warming = False
                    continue
                ok, result, seconds, failure, stored = reply
            except (EOFError, OSError):
                self._worker_died(worker)
                continue
            job, worker.job = worker.job, None
            if not stored or self.store.in_memory or self.store.read_only:
                if ok:
                    self.store.put(
                        job.key, result, fingerprint=job.fingerprint, backend=job.backend, compile_seconds=seconds
                    )
                else:
                    self.store.put_failure(job.key, failure, fingerprint=job.failure_fingerprint or job.fingerprint,
                                           backend=job.backend)
            if ok:
                self._finish(job, None, seconds=seconds)
            else:
                exception_line = result.strip().splitlines()[-1]
                error = f"{job.fn_path} raised {exception_line}\n{result}"
                level = logging.INFO if exception_line.partition(":")[0] in _ANSWERS else logging.WARNING
                self._finish(job, error, level, seconds=seconds, failure=failure)

    def _worker_died(self, worker: _Worker) -> None:
        job, worker.job, worker.warming = worker.job, None, False
        self._workers.remove(worker)
        if job is None:  # died warming up: replaced when a job needs one (Note [Warm workers])
            worker.kill()
            return
        abandoned = worker.abandoned(job.key)
        worker.kill()  # its compilers too, if the worker died before them
        if abandoned is not None:  # over a bound: never retried (Note [Compile limits] in neff_cache._worker)
            failure = abandoned["failure"]
            if not abandoned.get("stored") or self.store.in_memory or self.store.read_only:
                self.store.put_failure(job.key, failure, fingerprint=job.failure_fingerprint or job.fingerprint,
                                       backend=job.backend)
            self._finish(job, f"{job.fn_path} was abandoned: {failure}", seconds=float(abandoned.get("seconds", 0.0)),
                         failure=failure)
            return
        how = worker.exit_description()
        if job.attempts < _ATTEMPTS:
            log.warning(
                "compile worker for key %s died (%s) running %s; retrying it once",
                job.key,
                how,
                job.fn_path,
            )
            job.alone = True
            self._queue.appendleft(job)
        else:
            # remembered as a raised compile is: a job that kills its worker twice (most often the
            # kernel's OOM killer, before the watchdog saw the memory) would kill it in every process
            failure = f"compile worker died {job.attempts} times running {job.fn_path} (last: {how})"
            self.store.put_failure(job.key, failure, fingerprint=job.failure_fingerprint or job.fingerprint,
                                   backend=job.backend)
            self._finish(job, failure, failure=failure)

    def _finish(
        self, job: _Job, error: str | None, level: int = logging.WARNING, seconds: float = 0.0,
        failure: str | None = None,
    ) -> None:
        self.store.release(job.key)
        self._finished.append(JobResult(job.key, error is None, error, seconds, failure))
        if error is not None:
            log.log(level, "compile job for key %s failed: %s", job.key, error.splitlines()[0])

    def _forget_parent_jobs_after_fork(self) -> None:
        if os.getpid() == self._pid:
            return
        # The workers, their pipes and the claims belong to the parent: drop them untouched.
        self._pid = os.getpid()
        self._queue.clear()
        self._workers.clear()
        self._finished.clear()
        self._submitted = False

    def _stop_at_exit(self) -> None:
        # No lock: a daemon thread blocked in poll() may hold it, and exit must not wait for it.
        if os.getpid() != self._pid:
            return
        left, heir = [], None
        for worker in self._workers:
            job = worker.job
            if job is not None and job.destination is not None and self.finish_after_exit_s > 0 and \
                    self.store.hand_over(job.key, worker.process.pid, ttl_s=self.claim_ttl_s):
                left.append(job.key)  # Note [Compiles that outlive the program]
                # handed over, not forgotten: when the interpreter collects its Popen, no
                # "ResourceWarning: subprocess ... is still running" (shown under -X dev, -W)
                worker.process._child_created = False
                heir = heir or worker
                continue
            if job is not None:
                self.store.release(job.key)
            worker.kill()
        queued = []
        for job in self._queue:
            if heir is not None and job.destination is not None and not job.alone and \
                    self.store.hand_over(job.key, heir.process.pid, ttl_s=self.claim_ttl_s):
                queued.append(job)
            else:
                self.store.release(job.key)
        if queued:
            left += [job.key for job in queued]
            sender = threading.Thread(target=_send_all, args=(heir, queued), name="neff_cache_exit", daemon=True)
            sender.start()
            sender.join(_SEND_AT_EXIT_S)
        if left:
            log.info("%d background compile(s) go on after exit, for up to %.0f s, and land in %s: %s",
                     len(left), self.finish_after_exit_s, self.store.directory, ", ".join(left))
