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
    varying, extra, symbolic = {}, {}, None
    if program.sizes_alone:  # Note [Sizes that vary, run alone]
        symbolic = program.graph()
        program = program.at_hints(inplace=getattr(backend, "writes_inputs", False))
    gm = program.graph()
    examples = program.example_inputs() + program.lifted_examples()
    failed: set = set()  # ops the backend failed on: retried alone (Note [Partitions])
    while True:
        if symbolic is not None and extra.get("graph") is not gm:
            varying, guards, sizes = _varying(gm, symbolic)
            extra = {"graph": gm, "guards": guards, "sizes": sizes}
        alone = partition.alone(gm, backend, failed)
        alone.update(varying)
        if alone and program.inplace and not getattr(backend, "stores_after_run", False):
            program.inplace = False  # a split region writes back instead (Note [Partitions])
            gm = program.graph()
            continue
        try:
            if not alone:
                return backend.compile(gm, examples), program.lifted_inputs, {"alone": {}, "inplace": program.inplace}
            counts = partition.counts(alone)
            cut = gm
            if extra.get("sizes"):
                cut, arithmetic = _sized(gm, extra["sizes"])
                names = {n.name: why for n, why in alone.items()}
                alone = {n: names[n.name] if n.name in names else "varying_size" for n in cut.graph.nodes
                         if n.name in names or n in arithmetic}
            # ... unless its backend stores after its run: one last piece stores (Note [A split region's stores])
            artifact = partition.split(cut, examples, alone, backend)
            how = {"alone": counts, "inplace": program.inplace}
            if "guards" in extra:
                how["guards"] = extra["guards"]
            return artifact, program.lifted_inputs, how
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


# Note [Sizes that vary, run alone]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A backend that compiles static shapes only (stablehlo and neuron: a NEFF has fixed shapes)
# compiled a window whose sizes change from call to call once per size: Hugging Face's
# ``generate()`` grows ``input_ids`` and ``attention_mask`` by a token a call (``cat``), so every
# token's window, the model's forward included, compiled again (20 compiles for 16 tokens of the
# tiny GPT-2 with a static K/V cache; on Trainium each a neuronx-cc run). Most of such a window
# never sees the varying size: of that token window's 189 ops, 6 do (the two ``cat``s and the
# slices ``[:, -1:]`` of the growing tensors).
#
# Once a shape class (Note [Dynamic shapes] in fuser.shapes) has shown two sizes, such a backend
# (``sizes_alone``) gets the class's symbolic Program with ``sizes_alone``. It is traced twice:
# symbolically (the class's symbols) and at the window's own sizes. The two graphs must be the same
# op for op (else the compile fails and the class stays per size). An op whose inputs or outputs
# hold a symbol in the symbolic graph runs alone ("varying_size", Note [Partitions] in
# fuser.partition), eagerly, so it takes whatever size comes; the rest is cut into pieces, each
# compiled once at its static sizes, which no symbol reaches. A symbolic stride or offset does not
# count: the backends' executables take their inputs by value, made contiguous (``x[:, -1:]`` of a
# growing ``x`` has a symbolic offset). An op that runs alone and takes a size as an argument
# (``expand(x, [1, 4, 1, s0 + 1])`` of attention over a growing K/V cache) gets it computed at
# run time from the inputs' sizes (``sym_size`` and ``operator.add``/``mul`` nodes in the plan);
# a size that is not a sum of multiples of input sizes fails the compile. So does a class where
# more than a quarter of the computing ops vary: a batch size reaches every op, and one executable
# per size (one launch a step) beats running them alone. Those classes compile per size, as
# before, said at info, not warned (``metrics()["not_dynamic"]["sizes_alone"]``). One rewrite
# keeps the pieces few: a slice of a ``cat``'s end that lies in its last input reads that input
# (``_slices_of_cats``), so ``generate()``'s stopping check on the grown ``input_ids`` joins the
# piece before the ``cat`` instead of making a piece of its own after it.
#
# The symbolic trace's guards on its symbols (``produce_guards_expression``, as the inductor
# backend's) go with the artifact and are checked for each new size before it is used, so a size
# the trace specialized on compiles per size; the inputs' static sizes and strides are the class's
# check (``_fits``). The region writes its inputs in place where the backend stores after its run
# (one stores piece, not a copy per written input), and its first run for a new size checks its
# outputs before that piece runs (Note [A check before the stores] in fuser.partition).
#
# Measured (``benchmarks/neuron_generate.py``, RESULTS.md "Session 42"): 16 tokens of the tiny
# GPT-2 compile 10 regions in the first call with a static cache (35 before) and 17 with the
# default cache (31), none of them per length; a token then launches more (the ops that run alone):
# 7.4 a token with the static cache (4.8 before), 16.8 with the default cache (2.9), where eager
# launches 108 and 87.
_VARYING_SHARE = 4  # at most 1 in this many computing ops may vary
SIZES_ALONE = "sizes alone: "  # how the reason of a class that stays per size begins


def _has_symbol(value) -> bool:
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    if isinstance(value, torch.Tensor):  # sizes only: such a backend's pieces read their inputs by value
        return any(isinstance(d, torch.SymInt) for d in value.shape)
    if isinstance(value, (list, tuple)):
        return any(_has_symbol(v) for v in value)
    return False


def _ops(gm: torch.fx.GraphModule) -> list:
    """The op calls of ``gm``, leaving out the size arithmetic a symbolic trace adds and the stores
    into inputs of a static trace in place (the symbolic one writes back instead)."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and not partition._is_store(n)
            and not isinstance(n.meta.get("val"), (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool))]


def _varying(gm: torch.fx.GraphModule, symbolic: torch.fx.GraphModule) -> tuple[dict, str, dict]:
    """Note [Sizes that vary, run alone]: ``{node of gm: "varying_size"}``, the symbolic trace's
    guards, and ``{name of a node of gm: (args, kwargs)}`` with a _Size for each size argument of
    an op that runs alone; BackendCompileError where the class is to compile per size."""
    static_ops, symbolic_ops = _ops(gm), _ops(symbolic)
    if len(static_ops) != len(symbolic_ops) or any(a.target != b.target for a, b in zip(static_ops, symbolic_ops)):
        raise BackendCompileError(SIZES_ALONE + "the symbolic trace is not the static one op for op")
    _slices_of_cats(static_ops, symbolic_ops)
    placeholders = [n.meta.get("val") for n in symbolic.graph.nodes if n.op == "placeholder"]
    symbols = {}  # each symbol: the first (input, dim) whose size it is
    for slot, v in enumerate(placeholders):
        if isinstance(v, torch.Tensor):
            for d, size in enumerate(v.shape):
                if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                    symbols.setdefault(size.node.expr, (slot, d))
    varying, sizes = {}, {}
    for a, b in zip(static_ops, symbolic_ops):
        flat = torch.utils._pytree.tree_leaves((b.args, b.kwargs))
        sized = any(_size_of(x) is not None for x in flat)
        if sized or _has_symbol(b.meta.get("val")) or any(
                isinstance(x, torch.fx.Node) and _has_symbol(x.meta.get("val")) for x in flat):
            varying[a] = "varying_size"
        if sized:  # the sizes in its arguments, as sums over the inputs' sizes
            def spell(x):
                size = _size_of(x)
                return x if size is None else _linear(size, symbols, b.target)

            sizes[a.name] = (torch.fx.node.map_aggregate(b.args, spell), torch.fx.node.map_aggregate(b.kwargs, spell))
    computing = sum(1 for a in static_ops if partition._computes(a))
    moving = sum(1 for a in varying if partition._computes(a))
    if moving * _VARYING_SHARE > computing:
        raise BackendCompileError(SIZES_ALONE + f"{moving} of {computing} ops see a varying size")
    slots = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    if any(partition._is_store(n) and _has_symbol(placeholders[slots[n.args[0]]]) for n in gm.graph.nodes):
        raise BackendCompileError(SIZES_ALONE + "the window writes an input whose size varies")
    shape_env = next(d.node.shape_env for v in placeholders if isinstance(v, torch.Tensor)
                     for d in v.shape if isinstance(d, torch.SymInt))
    # the guards on the symbols; the inputs' static sizes and strides are checked by the class (``_fits``)
    return varying, shape_env.produce_guards_expression(placeholders, ignore_static=True) or "True", sizes


def _slices_of_cats(static_ops: list, symbolic_ops: list) -> None:
    """``cat(xs, d)`` sliced from ``-k`` to its end reads only the last of ``xs`` where that one is
    at least ``k`` long whatever the sizes: the slice reads it instead (in both graphs), so that it,
    and what is computed from it, no longer waits for a ``cat`` that runs alone
    (``generate()``'s stopping check reads the new token so: ``input_ids[:, -1:]`` of the grown
    ``input_ids``). Only where the slice feeds computing ops: no view of it can tell which tensor
    it was cut from."""
    aligned = dict(zip(symbolic_ops, static_ops))
    for a, b in zip(static_ops, symbolic_ops):
        if b.target is not torch.ops.aten.slice.Tensor or b.kwargs or len(b.args) < 3:
            continue
        source, dim, start, end, step = (*b.args, None, 1)[:5] if len(b.args) == 3 else (*b.args, 1)[:5]
        if (not isinstance(source, torch.fx.Node) or source.target is not torch.ops.aten.cat.default
                or source not in aligned or type(start) is not int or start >= 0 or step != 1
                or not (end is None or (type(end) is int and end >= 2 ** 62))
                or any(u.op != "call_function" or not isinstance(u.target, torch._ops.OpOverload) or u.target.is_view
                       for u in b.users)):
            continue
        parts, val = source.args[0], b.meta.get("val")
        along = source.args[1] if len(source.args) > 1 else source.kwargs.get("dim", 0)
        if not isinstance(val, torch.Tensor) or not isinstance(parts[-1], torch.fx.Node) or type(dim) is not int:
            continue
        rank = val.dim()
        last = parts[-1].meta.get("val") if isinstance(parts[-1], torch.fx.Node) else None
        if (along % rank != dim % rank or not isinstance(last, torch.Tensor)
                or type(last.shape[dim % rank]) is not int or last.shape[dim % rank] < -start):
            continue
        static_cat = aligned[source]
        b.replace_input_with(source, parts[-1])
        a.replace_input_with(static_cat, static_cat.args[0][-1])


class _Size:
    """A size argument of an op that runs alone: ``const`` plus the sum of ``coeff`` times the
    size of input ``slot``'s dimension ``dim``, over ``terms`` ((slot, dim, coeff) each)."""

    def __init__(self, terms: list, const: int):
        self.terms, self.const = terms, const


def _size_of(x):
    """The symbolic size ``x`` is (a SymInt, or a node of one), or None."""
    if isinstance(x, torch.fx.Node):
        x = x.meta.get("val")
    return x if isinstance(x, torch.SymInt) else None


def _linear(size: torch.SymInt, symbols: dict, target) -> object:
    """``size`` as a _Size (an int where it has no symbol); BackendCompileError where it is not a
    sum of multiples of the inputs' sizes."""
    import sympy

    expr = sympy.expand(size.node.expr)
    if expr.is_Integer:
        return int(expr)
    terms, const = [], 0
    for term, coeff in expr.as_coefficients_dict().items():
        if not coeff.is_Integer or (term != 1 and term not in symbols):
            raise BackendCompileError(SIZES_ALONE + f"{target} takes the size {expr}, not a sum of input sizes")
        if term == 1:
            const = int(coeff)
        else:
            terms.append((*symbols[term], int(coeff)))
    return _Size(terms, const)


def _sized(gm: torch.fx.GraphModule, sizes: dict) -> tuple[torch.fx.GraphModule, list]:
    """A copy of ``gm`` whose ops named in ``sizes`` take their size arguments computed from the
    inputs' sizes at run time (``sym_size``, ``operator.mul``/``add``), and the nodes that
    compute them (they run alone with the op)."""
    import copy
    import operator

    gm = copy.deepcopy(gm)
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    added = []
    for node in list(gm.graph.nodes):
        if node.name not in sizes:
            continue
        with gm.graph.inserting_before(node):
            def make(x):
                if type(x) is not _Size:
                    return x
                total = x.const
                for slot, d, coeff in x.terms:
                    term = gm.graph.call_function(torch.ops.aten.sym_size.int, (inputs[slot], d))
                    added.append(term)
                    if coeff != 1:
                        term = gm.graph.call_function(operator.mul, (term, coeff))
                        added.append(term)
                    if total != 0:
                        term = gm.graph.call_function(operator.add, (total, term))
                        added.append(term)
                    total = term
                return total

            args, kwargs = sizes[node.name]
            node.args = _rebuild(args, node.args, make)
            node.kwargs = _rebuild(kwargs, node.kwargs, make)
    gm.recompile()
    return gm, added


def _rebuild(spelled, actual, make):
    """``actual`` (the static node's arguments) with the _Size of ``spelled`` made at their places."""
    if type(spelled) is _Size:
        return make(spelled)
    if isinstance(spelled, (list, tuple)) and isinstance(actual, (list, tuple)) and len(spelled) == len(actual):
        return type(actual)(_rebuild(s, a, make) for s, a in zip(spelled, actual))
    if isinstance(spelled, dict) and isinstance(actual, dict):
        return {k: _rebuild(spelled.get(k), v, make) for k, v in actual.items()}
    return actual


def _pack(artifact: bytes, lifted_inputs, how: dict, key: str) -> bytes:
    """What the store holds for region ``key``: Note [Artifact container], no pickle."""
    lifted = [[i, str(dt).removeprefix("torch.")] for i, dt in lifted_inputs]
    return pack_sections({"format": FORMAT, "key": key, "lifted": lifted, **how}, [artifact])


def _unpack(data: bytes, key: str):
    """``_pack``'s parts; BackendCompileError for anything this process would not have packed for ``key``."""
    header, sections = unpack_sections(data, "artifact")
    lifted, alone, inplace = header.get("lifted"), header.get("alone"), header.get("inplace")
    guards = header.get("guards")
    problem = None
    if header.get("format") != FORMAT or header.get("key") != key or len(sections) != 1:
        problem = f"it was packed as format {header.get('format')} for key {header.get('key')!r}"
    elif type(inplace) is not bool or type(alone) is not dict or not all(
            type(k) is str and type(n) is int for k, n in alone.items()):
        problem = f"how it runs is malformed: alone={alone!r}, inplace={inplace!r}"
    elif guards is not None and (type(guards) is not str or not alone):
        problem = f"its guards are malformed: {str(guards)[:200]}"
    elif type(lifted) is not list or not all(
            type(x) is list and len(x) == 2 and type(x[0]) is int and x[0] >= 0 and type(x[1]) is str
            and isinstance(getattr(torch, x[1], None), torch.dtype) for x in lifted):
        problem = f"its lifted inputs are malformed: {str(lifted)[:200]}"
    if problem is not None:
        raise BackendCompileError(f"artifact: not one for region {key} of format {FORMAT}: {problem}")
    how = {"alone": alone, "inplace": inplace}
    if guards is not None:
        how["guards"] = guards
    return sections[0], [(i, getattr(torch, dt)) for i, dt in lifted], how


def _load_artifact(artifact: bytes, how: dict, backend):
    if not how["alone"]:
        return backend.load(artifact)
    run = partition.load(artifact, backend)
    if "guards" in how:  # Note [Sizes that vary, run alone]
        try:
            run.guards = compile(how["guards"], "<size guards>", "eval")
        except (SyntaxError, ValueError) as e:
            raise BackendCompileError(f"artifact: its size guards do not compile: {e}") from e
    return run


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
