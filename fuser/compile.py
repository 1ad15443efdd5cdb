"""Compiling a Program with a backend, and the artifact the store holds for it: a manifest (the
key, the lifted inputs, how it runs) and the backend's bytes, packed without pickle."""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import struct
import time
import traceback
import zipfile

import torch

from . import partition
from .backends._common import BackendCompileError, launches_of, pack_sections, trace_lock, unpack_sections
from ._library import library_digest
from .program import FORMAT, Program, _In

log = logging.getLogger("adaptive_eager.fuser")


# Note [Artifacts from disk]
# An artifact read from the store passed its checksum, which proves only that whoever wrote it
# computed one (Note [Cache trust] in neff_cache.access). Loading checks its structure (Note
# [Artifact container], the key it was packed for, the backend's own format, a symbolic region's
# shape guards); an artifact that fails is evicted from the store (counted in corrupt_entries)
# and the region is replayed in this process. A static region loaded from disk is also
# ``_Unverified`` until its first run succeeds: the count, shapes, strides and dtypes of its
# outputs must be the placeholders' before anything is written, else the window is replayed and
# the artifact evicted. An artifact that writes its inputs in place (Note [In-place regions])
# would have written them by then, and the replay would apply the update twice: its first run
# writes copies of them instead, copied into the inputs once the check passed (``_run_compiled``).
# (A symbolic region never writes in place; its outputs are checked at each shape's first run:
# ``_run_checked``.) No check catches an artifact edited to compute other values with the same
# metadata: within the cache's trust boundary, that is the writer's power.
class _Unverified:
    """A static region's callable from disk, until its first run (Note [Artifacts from disk])."""

    __slots__ = ("run", "store")

    def __init__(self, run, store):
        self.run = run
        self.store = store  # where it came from: evicted from there if it fails

    def __call__(self, inputs):
        return self.run(inputs)

    @property
    def launches(self) -> int:
        return launches_of(self.run)  # Note [Launches of a compiled callable] in fuser.backends._common


def compile_job(payload: bytes) -> bytes:
    """Compile-worker entry point (named by import path in neff_cache.CompileJobs): a serialized
    Program and backend name in, the packed artifact out. The worker runs with adaptive eager off
    (Note [Background compiles] in fuser.artifacts)."""
    doc = json.loads(payload)
    from .backends import get_backend

    backend = get_backend(doc["backend"], doc["device"])
    program = Program.from_bytes(doc["program"].encode())
    torch.set_default_dtype(program.default_dtype)  # this process's, for tracing the program
    return _pack(*compile_program(program, backend), doc["key"])


# A warm-up's stages before its compile (Note [Warm workers] in neff_cache.jobs): the compiler's
# imports, the slowest first (a captured graph's trace in a worker needs Dynamo and AOTAutograd).
_WARM_IMPORTS = {
    None: ("torch._dynamo", "torch._functorch.aot_autograd"),
    "inductor": ("torch._dynamo", "torch._functorch.aot_autograd", "torch._inductor.lowering",
                 "torch._inductor.compile_fx"),
}


def warm_up(payload: bytes) -> bytes:
    """A compile worker's warm-up (Note [Warm workers] in neff_cache.jobs): compile a one-op program
    with the backend the payload names, so that the compiler's imports and its one-time probes are
    done before the first region arrives; it ends after any stage at which a job waits. Nothing of it
    is kept."""
    from neff_cache._worker import job_waiting

    from .backends import get_backend
    from .window import FRESH

    doc = json.loads(payload)
    for module in _WARM_IMPORTS.get(doc["backend"], _WARM_IMPORTS[None]):
        if job_waiting():  # Note [Warm workers]: the job does the imports it needs itself
            return b""
        importlib.import_module(module)
    if job_waiting():
        return b""
    backend = get_backend(doc["backend"], doc["device"])
    uid = 1 << 16
    program = Program([(torch.ops.aten.add.Tensor, [_In(0), 1.0], {}, [(FRESH, uid, None)])],
                      [((8,), (1,), torch.float32, doc["device"])], [uid], ())
    compile_program(program, backend)
    return b""


_MAX_FAILED_OPS = 4  # ops retried alone after a failed compile before the region is given up


def compile_program(program: Program, backend) -> tuple[bytes, list, dict]:
    """Compile ``program`` with ``backend``: the artifact, the lifted float inputs it expects after
    the real inputs ((Window.scalars index, dtype) each), and how to run it: ``alone``, the nodes
    that run outside compiled code by reason (Note [Partitions]; none: the artifact is
    ``backend.load``'s, else ``partition.load``'s), and ``inplace``, whether it writes the mutated
    inputs itself (a split region only with a backend that stores after its run: Note [A split
    region's stores] in fuser.partition)."""
    with trace_lock(), _meta_failures_unlogged():  # Note [One trace at a time] in fuser.backends._common
        return _compile_program(program, backend)


# Note [Failed meta runs]
# A compile that traces an op whose meta kernel raises (the symbolic compile of
# ``upsample_bilinear2d_backward``: "isIntList() INTERNAL ASSERT FAILED") fails, and the fuser says
# so once, at the level the user chose, and compiles per shape. Before raising, FakeTensorMode
# logs each such failure at ERROR with its traceback (``failed while attempting to run meta
# for``): 9 lines in the middle of the program's output, from our compile (in a worker process,
# whose stderr is the program's, too). While a compile of ours runs (one at a time in a process:
# the trace lock) those records are dropped, unless adaptive eager logs at debug.
_META_FAILURE = "failed while attempting to run meta for"


def _not_a_meta_failure(record: logging.LogRecord) -> bool:
    return not (isinstance(record.msg, str) and record.msg.startswith(_META_FAILURE))


@contextlib.contextmanager
def _meta_failures_unlogged():
    """Note [Failed meta runs]."""
    if logging.getLogger("adaptive_eager").isEnabledFor(logging.DEBUG):
        yield
        return
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    logger.addFilter(_not_a_meta_failure)
    try:
        yield
    finally:
        logger.removeFilter(_not_a_meta_failure)


def _compile_program(program: Program, backend) -> tuple[bytes, list, dict]:
    gm = program.graph()
    examples = program.example_inputs() + program.lifted_examples()
    failed: set = set()  # ops the backend failed on: retried alone (Note [Partitions])
    while True:
        alone = partition.alone(gm, backend, failed)
        if alone and program.inplace and not getattr(backend, "stores_after_run", False):
            program.inplace = False  # a split region writes back instead (Note [Partitions])
            gm = program.graph()
            continue
        try:
            if not alone:
                return backend.compile(gm, examples), program.lifted_inputs, {"alone": {}, "inplace": program.inplace}
            # ... unless its backend stores after its run: one last piece stores (Note [A split region's stores])
            artifact = partition.split(gm, examples, alone, backend)
            return artifact, program.lifted_inputs, {"alone": partition.counts(alone), "inplace": program.inplace}
        except BackendCompileError as e:
            if e.inplace and program.inplace:
                # the compiled code would not write the inputs the graph writes (Inductor on torch
                # 2.11 reports no written inputs for a loop of add_ into one): write back instead
                log.info("adaptive_eager: %s; compiling with a write-back instead", e)
                program.inplace = False
                gm = program.graph()
                continue
            target = e.target
            if (not isinstance(target, torch._ops.OpOverload) or target in failed
                    or len(failed) >= _MAX_FAILED_OPS):
                raise
            log.info("adaptive_eager: %s; compiling the rest with it run alone", str(e).splitlines()[0])
            log.debug("adaptive_eager: the whole error: %s", e)
            failed.add(target)


def _pack(artifact: bytes, lifted_inputs, how: dict, key: str) -> bytes:
    """What the store holds for region ``key``: Note [Artifact container], no pickle."""
    lifted = [[i, str(dt).removeprefix("torch.")] for i, dt in lifted_inputs]
    return pack_sections({"format": FORMAT, "key": key, "lifted": lifted, **how}, [artifact])


def _unpack(data: bytes, key: str):
    """``_pack``'s parts; BackendCompileError for anything this process would not have packed for ``key``."""
    header, sections = unpack_sections(data, "artifact")
    lifted, alone, inplace = header.get("lifted"), header.get("alone"), header.get("inplace")
    problem = None
    if header.get("format") != FORMAT or header.get("key") != key or len(sections) != 1:
        problem = f"it was packed as format {header.get('format')} for key {header.get('key')!r}"
    elif type(inplace) is not bool or type(alone) is not dict or not all(
            type(k) is str and type(n) is int for k, n in alone.items()):
        problem = f"how it runs is malformed: alone={alone!r}, inplace={inplace!r}"
    elif type(lifted) is not list or not all(
            type(x) is list and len(x) == 2 and type(x[0]) is int and x[0] >= 0 and type(x[1]) is str
            and isinstance(getattr(torch, x[1], None), torch.dtype) for x in lifted):
        problem = f"its lifted inputs are malformed: {str(lifted)[:200]}"
    if problem is not None:
        raise BackendCompileError(f"artifact: not one for region {key} of format {FORMAT}: {problem}")
    return sections[0], [(i, getattr(torch, dt)) for i, dt in lifted], {"alone": alone, "inplace": inplace}


def _load_artifact(artifact: bytes, how: dict, backend):
    return partition.load(artifact, backend) if how["alone"] else backend.load(artifact)


# Note [Whose fault a failed load is]
# Only an artifact that fails its own decoding is evicted: what the backends raise for one that is
# corrupt or not theirs (BackendCompileError, by contract) and what reading malformed bytes raises.
# A load also imports the backend's modules (Inductor's, on the compile thread), and an import
# racing the same import in another thread can fail in either thread ("_DeadlockError: deadlock
# detected by _ModuleLock('torch._dynamo')", an ImportError of a partly initialized module): that
# load is tried once more, the other thread's import being done by then. Anything else (an import
# that fails again, MemoryError, an OSError of a temporary directory, an error of ours) is this
# process's: the load fails (its window replays), and the artifact stays for the next process.
_CORRUPT = (BackendCompileError, ValueError, KeyError, IndexError, EOFError, zipfile.BadZipFile, struct.error)


def _racing_import(error: BaseException) -> bool:
    return isinstance(error, ImportError) or type(error).__name__ == "_DeadlockError"


def _load(data: bytes, backend, store, key: str, dynamic: bool):
    """Load region ``key``'s artifact from ``store``; a symbolic (``dynamic``) region's must carry
    shape guards. One that does not decode is evicted (Note [Artifacts from disk], Note [Whose
    fault a failed load is])."""
    for attempt in (1, 2):
        try:
            artifact, lifted_inputs, how = _unpack(data, key)
            run = _load_artifact(artifact, how, backend)
            if dynamic != (getattr(run, "guards", None) is not None):
                raise BackendCompileError(f"artifact: a {'symbolic' if dynamic else 'per-shape'} region's artifact "
                                          f"{'lacks' if dynamic else 'has'} shape guards")
            break
        except _CORRUPT as e:
            store.discard(key, f"does not load: {type(e).__name__}: {e}")
            raise
        except Exception as e:
            if attempt == 2 or not _racing_import(e):
                raise
            log.info("adaptive_eager: loading region %s met another thread's import (%s: %s); trying again",
                     key[:8], type(e).__name__, e)
    run = run if dynamic else _Unverified(run, store)
    return run, lifted_inputs, None, how  # None: from disk, no compile


def _compile_and_store(program: Program, backend, store, pkey: str):
    t0 = time.perf_counter()
    try:
        artifact, lifted_inputs, how = compile_program(program, backend)
        seconds = time.perf_counter() - t0
        store.put(pkey, _pack(artifact, lifted_inputs, how, pkey), fingerprint=cache_fingerprint(backend),
                  backend=backend.name, compile_seconds=seconds)
    except Exception as e:
        store.put_failure(pkey, _failure_reason(e), fingerprint=cache_fingerprint(backend), backend=backend.name)
        raise
    finally:
        store.release(pkey)
    return _load_artifact(artifact, how, backend), lifted_inputs, seconds, how


def cache_fingerprint(backend) -> str:
    """What a region's persistent key is made with, and its artifact and a remembered failure are
    kept and read under (Note [Remembered failures] in neff_cache.store): the backend's fingerprint
    and ``library_digest()``. An artifact is what our lowering made of the program (the graph
    ``fuser.compiled`` builds, the backend's wrapping of it), so one that a bug of ours made wrong
    lapses with the version (or the edit) that fixes it, as a failure does, instead of running
    until someone remembers to bump a format number; the price is one compile per region after
    each upgrade of the library, as after one of torch."""
    return f"{backend.fingerprint()}|library-{library_digest()}"


def _failure_reason(error: BaseException) -> str:
    """How a failed compile is remembered: the exception as a traceback ends with it, as a compile worker
    reports it (``JobResult.failure``), so both kinds are handled alike by ``_compile_failed``."""
    return "".join(traceback.format_exception_only(error)).strip()
