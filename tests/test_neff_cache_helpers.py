"""Functions that test_neff_cache.py runs in other processes (compile workers, racing processes).

Kept apart from the tests so those processes import nothing heavy; this module holds no tests.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time

from neff_cache import ArtifactStore


def artifact_for(key: str) -> bytes:
    return f"artifact of {key}".encode() * 100


def compile_upper(payload: bytes) -> bytes:
    return payload.upper()


def compile_and_log_call(payload: bytes) -> bytes:
    """Appends a line to the file named by the payload, so a test can count the attempts."""
    with open(payload, "a") as calls:
        calls.write(f"{os.getpid()}\n")
    return b"compiled " + payload


def exit_abruptly(payload: bytes) -> bytes:
    compile_and_log_call(payload)
    os._exit(1)


def kill_self(payload: bytes) -> bytes:
    compile_and_log_call(payload)
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: SIGKILL cannot be caught")


def exit_on_first_call(payload: bytes) -> bytes:
    """Dies the first time (no log file yet), succeeds on the retry."""
    first_call = not os.path.exists(payload)
    compile_and_log_call(payload)
    if first_call:
        os._exit(1)
    return b"compiled on retry"


def raise_compile_error(payload: bytes) -> bytes:
    compile_and_log_call(payload)
    raise RuntimeError("lowering failed: op aten::frobnicate has no kernel")


class Refusal(Exception):
    """A job function's refusal of its input by design (Note [Answers, not failures] in neff_cache.jobs)."""


def refuse(payload: bytes) -> bytes:
    compile_and_log_call(payload)
    raise Refusal("not_for_me: a graph this job declines")


def environment_of(payload: bytes) -> bytes:
    """The worker's values of the environment variables named in the payload (JSON in, JSON out)."""
    return json.dumps({name: os.environ.get(name) for name in json.loads(payload)}).encode()


def return_text(payload: bytes) -> bytes:
    return "not bytes"  # type: ignore[return-value]


def sleep_forever(payload: bytes) -> bytes:
    """Records its pid in the file named by the payload, then sleeps far longer than any test."""
    with open(payload, "w") as pid_file:
        pid_file.write(str(os.getpid()))
    time.sleep(60)
    return b"too late"


def race_for_keys(directory: str, keys: list[str], seed: int, start, results) -> None:
    """Get every key, compiling those this process wins the claim for and waiting for the rest.

    Puts (compiled keys, keys whose artifact was wrong or missing) on ``results``.
    """
    store = ArtifactStore(directory)
    order = list(keys)
    random.Random(seed).shuffle(order)
    compiled, wrong = [], []
    start.wait()
    for key in order:
        data = store.get(key)
        if data is None:
            if store.claim(key, ttl_s=60):
                time.sleep(0.05)  # a compile long enough for the others to pile up behind the claim
                data = artifact_for(key)
                store.put(key, data, fingerprint="fp", backend="test", compile_seconds=0.05)
                store.release(key)
                compiled.append(key)
            else:
                data = store.wait_for(key, timeout_s=30)
        if data != artifact_for(key):
            wrong.append(key)
    results.put((compiled, wrong))


def hold_claim_and_sleep(directory: str, key: str) -> None:
    """Claim ``key``, say so on stdout, and sleep until killed (a compile that never finishes)."""
    store = ArtifactStore(directory)
    assert store.claim(key, ttl_s=900)
    print("claimed", flush=True)
    time.sleep(600)


def kill_self_at(stage: str) -> None:
    """Make this process SIGKILL itself at ``stage`` of its next ``ArtifactStore.put`` of a large
    value (Note [Storage layout] in neff_cache._disk): after the value file is written ("value-file"),
    after its row is inserted but before the transaction commits ("row"), or after an evicted row is
    deleted but before its file is ("evict")."""
    import diskcache.core

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    from neff_cache.access import SafeDisk  # neff_cache's Disk: it writes and removes value files itself

    if stage == "value-file":
        store_value = SafeDisk.store

        def store_then_die(self, value, read, key=diskcache.core.UNKNOWN):
            result = store_value(self, value, read, key)
            if result[2] is not None:  # a value file was written
                die()
            return result

        SafeDisk.store = store_then_die
    elif stage == "row":
        row_insert = diskcache.core.Cache._row_insert

        def insert_then_die(self, *args):
            row_insert(self, *args)
            die()

        diskcache.core.Cache._row_insert = insert_then_die
    elif stage == "evict":
        SafeDisk.remove = lambda self, file_path: die()
    else:
        raise ValueError(stage)


def sleep_then_compile(payload: bytes) -> bytes:
    """Sleeps for the number of seconds in the payload (a compile that takes that long)."""
    time.sleep(float(payload))
    return b"compiled after " + payload


_REMEMBERED = [b"nothing"]


def remember(payload: bytes) -> bytes:
    """A warm-up (Note [Warm workers] in neff_cache.jobs): leaves its payload in the worker."""
    _REMEMBERED[0] = payload
    return b""


def wait_for_a_job(payload: bytes) -> bytes:
    """A warm-up that waits up to ``payload`` seconds for a job to be sent and leaves whether one
    came (``job_waiting``, which a staged warm-up asks between its stages)."""
    from neff_cache._worker import job_waiting

    deadline = time.monotonic() + float(payload)
    while not job_waiting() and time.monotonic() < deadline:
        time.sleep(0.01)
    _REMEMBERED[0] = b"a job waits" if job_waiting() else b"no job"
    return b""


def remembered(payload: bytes) -> bytes:
    """What the worker's warm-up left, if any."""
    return _REMEMBERED[0]


def allocate_and_hold(payload: bytes) -> bytes:
    """Touches ``payload`` (an int, as text) MiB of memory and holds it longer than any test, in
    C code that keeps the GIL (a compiler's pass), so that only a process outside can stop it."""
    import ctypes

    block = bytearray(int(payload) << 20)  # touched: zero-filled
    ctypes.PyDLL(None).sleep(60)  # PyDLL keeps the GIL through the call (CDLL releases it)
    return bytes(block[:1])


def sleep_then_name_a_follow_up(payload: bytes) -> bytes:
    """Sleep ``payload`` seconds, then name a follow-up compile of key ``"b" * 32`` (Note [Follow-up
    compiles after exit] in neff_cache._worker)."""
    from neff_cache._worker import follow_up

    time.sleep(float(payload))
    follow_up("b" * 32, __name__ + ":compile_upper", b"follow-up", backend="b2")
    return b"traced"
