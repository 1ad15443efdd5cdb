"""The compile worker process: receives ("module:function", payload), replies with the result.

Started by ``neff_cache.jobs`` as ``python -c BOOTSTRAP <fd> <sys.path as JSON>``; see Note [Worker
processes] there. It imports nothing heavy itself: the compile function's module does.
"""

from __future__ import annotations

import importlib
import time
import traceback
from multiprocessing.connection import Connection
from typing import Callable

BOOTSTRAP = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[2]); "
    "from neff_cache._worker import serve; serve(int(sys.argv[1]))"
)


def resolve(fn_path: str) -> Callable[[bytes], bytes]:
    """Import the function named by ``"package.module:function"`` (the function may be dotted)."""
    module_name, _, qualname = fn_path.partition(":")
    target = importlib.import_module(module_name)
    for attribute in qualname.split("."):
        target = getattr(target, attribute)
    return target


def serve(fd: int) -> None:
    """Run jobs sent over the connection on ``fd`` one at a time until the parent closes it.

    Each reply is ``(True, artifact bytes, seconds)`` or ``(False, traceback text, seconds)``.
    """
    connection = Connection(fd)
    functions: dict[str, Callable[[bytes], bytes]] = {}
    while True:
        try:
            fn_path, payload = connection.recv()
        except EOFError:
            return
        start = time.perf_counter()
        try:
            function = functions.get(fn_path)
            if function is None:
                function = functions[fn_path] = resolve(fn_path)
                start = time.perf_counter()  # importing the compiler (torch, ...) is not compile time
            artifact = function(payload)
            if not isinstance(artifact, (bytes, bytearray, memoryview)):
                returned = type(artifact).__name__
                raise TypeError(f"{fn_path} returned {returned}; a compile function must return bytes")
            reply = (True, bytes(artifact), time.perf_counter() - start)
        except Exception:
            reply = (False, traceback.format_exc(), time.perf_counter() - start)
        try:
            connection.send(reply)
        except (BrokenPipeError, ConnectionResetError):
            return  # the parent is gone; nobody wants the result
