"""The compile worker process: receives ("module:function", payload, destination), replies with the
result.

Started by ``neff_cache.jobs`` as ``python -c BOOTSTRAP <fd> <sys.path as JSON> <parent pid>``; see
Note [Compile worker processes] there. It imports nothing heavy itself: the compile function's module does. With a
destination (the store the parent uses), the worker stores the artifact, or the failure, itself, so
that a compile that outlives its program still lands (Note [Compiles that outlive the program]).
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
    "from neff_cache._worker import serve; serve(int(sys.argv[1]), int(sys.argv[3]))"
)

_PARENT_POLL_S = 0.2
WARM = "warm"  # a message's destination that asks for a warm-up: Note [Warm workers] in neff_cache.jobs


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


def serve(fd: int, parent: int) -> None:
    """Run jobs sent over the connection on ``fd`` one at a time until the parent closes it.

    Each reply is ``(True, artifact bytes, seconds, None, stored)`` or ``(False, traceback text,
    seconds, exception text, stored)``; ``stored`` says whether the worker put the result in the
    destination store itself.
    """
    connection = Connection(fd)
    running = _Job()
    # the parent's pid from the parent: it may have exited before this process got here
    threading.Thread(target=_watch_parent, args=(parent, running), daemon=True).start()
    functions: dict[str, Callable[[bytes], bytes]] = {}
    while True:
        try:
            fn_path, payload, destination = connection.recv()
        except (EOFError, ConnectionError):
            # the parent closed its end: an exit with a reply of ours unread resets the connection
            return
        if destination == WARM:  # Note [Warm workers] in neff_cache.jobs: no reply, nothing stored
            try:
                function = functions.get(fn_path) or functions.setdefault(fn_path, resolve(fn_path))
                function(payload)
            except Exception:  # noqa: BLE001 - the first job imports and fails (and says why) in its turn
                pass
            continue
        with running.lock:
            running.after_exit_s = destination["after_exit_s"] if destination is not None else 0.0
        start = time.perf_counter()
        failure = None
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
        stored = destination is not None and _store(destination, reply)
        with running.lock:
            running.after_exit_s = None
        try:
            connection.send((*reply, stored))
        except (BrokenPipeError, ConnectionResetError):
            return  # the parent is gone; the result is in the store if it had one


_STORES: dict[tuple, Any] = {}


def _store(destination: dict, reply: list) -> bool:
    """Put the artifact (or the failure) in the destination store and release the job's claim if it
    was handed over to this process; True if it landed on disk."""
    from neff_cache.store import ArtifactStore

    where = (destination["directory"], destination["size_limit_mb"], destination["format_version"])
    try:
        store = _STORES.get(where)
        if store is None:
            store = _STORES[where] = ArtifactStore(where[0], size_limit_mb=where[1], format_version=where[2])
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
