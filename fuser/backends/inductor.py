"""The inductor backend: a region compiled by TorchInductor into one self-contained artifact.

Note [Self-contained Inductor artifacts]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Inductor's own saved artifacts (``standalone_compile(...).save``) hold generated source. Loading one
re-derives each C++ kernel's cache key from the compiler command line, which runs ``g++ --version``
and the vector-ISA dry compiles even when the built ``.so`` is present, and reruns g++ when it is
not (measured: 18 s in a fresh process with an empty cache; fails outright with no compiler on
PATH). AOTInductor's ``.pt2`` needs no compiler to load, but compiling a 10-op chain took 90 s (vs
1-10 s here) and a call costs ~25 us on tiny inputs (vs ~3 us here).

So the artifact keeps what Inductor generated and adds what it built: the Python wrapper module
(``CompiledFxGraph.source_code``), the ``.so`` behind each ``async_compile.cpp_pybinding(...)`` call
in it, and on CUDA the Triton cache files of its kernels (packed and loaded in
``fuser.backends._inductor_artifacts``). ``load`` executes the wrapper with ``AsyncCompile``
replaced by ``_Kernels``, which hands each C++ kernel its bundled ``.so`` (written to a temporary
file only long enough to ``dlopen`` it) and passes Triton kernels to the real ``AsyncCompile``
after restoring their cache files, so Triton finds them instead of compiling.
A fresh process therefore loads an artifact with no C++ compiler and no cache directory.
``compile`` runs that same wrapper-executing code with a recorder as the kernel source, so an
Inductor whose wrapper has a shape the loader does not understand fails at compile time, never at
load time.

Note [Calling the wrapper directly]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The callable from ``load`` is the wrapper's ``call(args)`` with no AOTAutograd runtime wrappers and
no guards (~2 us of Python on tiny inputs; Inductor's ``CompiledArtifact`` costs ~6-9 us). That is
sound only when the wrapper's calling convention is the graph's: ``compile`` checks that the graph
Inductor compiled has one input per example input and outputs whose shape, stride, storage offset
and dtype are what eager gives, that it holds no constants, and that it writes exactly the inputs
the graph writes (Note [In-place regions] in ``fuser.compilable``). Of the skipped
wrappers' work, the backend redoes the two parts a functional inference graph needs: grad mode and
autocast off (``below_autograd``), and on CUDA a copy of any input whose address breaks the
alignment the kernels were compiled to assume (``inputs_to_check``).

Note [Repeated outputs]
~~~~~~~~~~~~~~~~~~~~~~~
AOTAutograd merges identical computations (common subexpressions) before Inductor sees the graph,
so two outputs of the fuser's graph can become one node, and the wrapper then returns one buffer
for both (``a, b = y.clone(), y.clone()``; a logged gradient and SGD's first momentum buffer, both
clones of the clipped gradient). Eager gives each its own memory, and the fuser binds each output
to its own placeholder: sharing one buffer, an in-place write to one (the next momentum update)
would show through the other. The calling-convention check lists every output that repeats an
earlier one (or is an input) in the manifest's ``relayout`` with no layout of its own, and the
callable from ``load`` copies it into a buffer of its own in the layout it came back in.
Not where both are outputs no program tensor is bound to: a captured forward's outputs that only
its backward reads (the tensors it saves), which the forward's Program lists in ``shared``
(``adaptive_eager._capture._share_saved``). Those are read, never written, as AOTAutograd's own
runtime and ``torch.compile`` pass them: a recurrent cell's ``tanh`` saved twice per time step
(once for its own backward, once for the next step's matmul) made 16 copies a step, 63 us of a
1.7 ms step (benchmarks/RESULTS.md). An input returned as a saved output is still copied.

Note [No size asserts]
~~~~~~~~~~~~~~~~~~~~~~
Inductor's wrapper begins with an ``assert_size_stride`` per input (~0.35 us each): 170 a step for
an AdamW step over 34 parameters, 60 us of a 1.1 ms launch-bound training step
(benchmarks/RESULTS.md). A static artifact is compiled without them, because everything that calls
one has checked its inputs' shapes and strides already: a region's inputs are the window's, whose
signature (its cache key) holds each real input's shape, stride and dtype and each pending one's
recorded metadata, which the region producing it was checked to give (``_check_calling_convention``);
a captured graph runs behind TorchDynamo's guards, whose ``TENSOR_MATCH`` checks the size and
stride of every tensor the graph reads (parameters included), its backward on the tensors its
forward saved and tangents made in their traced strides (``adaptive_eager._capture._traced_strides``).
A symbolic artifact keeps them: its key fixes strides only up to its symbols.

Note [Symbolic Inductor artifacts]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A graph whose placeholders carry only concrete sizes is compiled statically
(``dynamic_shapes="from_example_inputs"`` specializes on the example shapes; the callers check
the shapes: Note [No size asserts]). A graph traced symbolically (the fuser's ``Program`` with
dynamic dims: placeholders' ``meta["val"]`` are fake tensors with SymInt sizes, outputs carry
``meta["example_value"]``) is compiled with ``dynamic_shapes="from_graph"``: Inductor uses that
graph's ``ShapeEnv``, the wrapper reads the sizes off its inputs (Note [Symbols as inputs]), and
every assumption Inductor made about the symbols (sizes >= 2, ``s0 <= 4096`` for an accumulator
choice, ...) lands in that ``ShapeEnv`` as a guard. The manifest keeps those guards as one Python
expression over ``L['t0']``, ``L['t1']``, ... (the inputs in order, ``ShapeEnv.produce_guards_expression``)
and the callable from ``load`` carries it, compiled, as ``guards`` (None for static artifacts): the
caller must evaluate it (``eval(run.guards, SYMPY_INTERP, {"L": {...}})``) before using the
artifact for inputs of other sizes. The calling-convention check compares output metadata at the
example (hint) sizes; the caller verifies it for other sizes.

Note [Symbols as inputs]
~~~~~~~~~~~~~~~~~~~~~~~~
AOTAutograd's ``tensorify_python_scalars`` pass rewrites float arithmetic on sizes (``2 / numel``
in the backward of ``mse_loss``, ``smooth_l1_loss`` and ``huber_loss``) into tensor ops, and finds
each symbol through a graph node whose value is that symbol: in Dynamo's graphs, a SymInt placeholder.
The fuser's symbolic graph had none (its symbols are only its tensors' sizes), so such a region
failed to compile (``KeyError: s53``) and every batch size compiled on its own. So the graph
Inductor gets has one more placeholder per symbol, after the tensors, valued by the first size
that is that symbol; the manifest lists those sizes (``sym_inputs``: input index and dim), and
the callable from ``load`` passes them, read off its inputs, after its inputs.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import platform
import sys
import time
from collections.abc import Callable

import torch

from ._common import (
    BackendCompileError, below_autograd, check_graph, fake_values, op_name, output_nodes, restrided, tensor_meta,
    trace_lock,
)
from ._inductor_artifacts import (
    _FORMAT, _atomic_builds, _build_dir, _collect_triton, _instantiate, _kernel_key, _load_cpp_kernel, _pack,
    _restore_triton, _unpack,
)

log = logging.getLogger(__name__)

_DEVICE_TYPES = ("cpu", "cuda")

# The rewrites the graph gets before Inductor sees it: an artifact compiled without one of them may
# compute other values (Note [as_strided over a computed storage]), so they are part of the fingerprint.
_GRAPH_PASSES = ("views_as_reshapes", "as_strided_on_storage")

# Inductor settings that shape the generated code (so they are part of the fingerprint).
_CONFIG = {
    # No worker pool: starting one costs seconds, and regions are compiled off the hot path anyway.
    "compile_threads": 1,
    # The loader executes Inductor's Python wrapper (Note [Self-contained Inductor artifacts]).
    "cpp_wrapper": False,
    # CUDA graphs are installed by the post-compile step the loader skips.
    "triton.cudagraphs": False,
    # Frozen parameters would become constants that the artifact would have to carry.
    "freezing": False,
    # Note [No size asserts]: a static artifact's inputs have the shapes and strides it was compiled
    # for (a symbolic compile turns them back on: ``_run_inductor``).
    "size_asserts": False,
    # Our graphs reach Inductor as inference graphs (detached inputs), for which it moves each
    # node's producers next to it (``reorder_for_locality``, a post-grad pass it runs for inference
    # graphs only). On a graph that returns many values (a captured forward's saved activations, a
    # window's live results) it hoisted all 16 input projections of the recurrent cell of
    # ``benchmarks/user_step.py`` ahead of the recurrence, an order ``torch.compile``'s training
    # forward does not have; that forward ran 30-40 us (7%) slower inside the training step
    # (benchmarks/RESULTS.md, session 45). So the graph keeps its program order, as a training graph does.
    "reorder_for_locality": False,
}


class InductorBackend:
    """Compiles with ``torch._inductor.standalone_compile``; see the module notes for the format."""

    name = "inductor"
    writes_inputs = True  # graphs may copy_ into their inputs (Note [In-place regions] in fuser.compilable)
    dynamic_shapes = True  # compiles symbolically traced graphs (Note [Symbolic Inductor artifacts]; the fuser's side: Note [Dynamic shapes] in fuser.shapes)

    def __init__(self, device_type: str) -> None:
        if device_type not in _DEVICE_TYPES:
            raise ValueError(
                f"the inductor backend supports device types {', '.join(_DEVICE_TYPES)}, not {device_type!r}"
            )
        self.device_type = device_type
        self._fingerprint: str | None = None

    def fingerprint(self) -> str:
        """Backend format, torch build, Python ABI, machine, the device's code target, and ``_CONFIG``.

        The device part is what the binaries are built for: ATen's CPU capability (the ISA Inductor
        vectorizes for) on CPU; CUDA version, compute capability and Triton version on CUDA.
        """
        if self._fingerprint is None:
            self._fingerprint = _fingerprint(self.device_type)
        return self._fingerprint

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> bytes:
        """Compile ``gm`` into a self-contained artifact (Note [Self-contained Inductor artifacts])."""
        check_graph(self.name, gm, example_inputs)
        for i, t in enumerate(example_inputs):
            if t.device.type != self.device_type:
                raise BackendCompileError(
                    f"inductor: example input {i} is on {t.device}, this backend compiles for {self.device_type}"
                )
        values = fake_values(self.name, gm, example_inputs)
        expected = [tensor_meta(self.name, values[n]) for n in output_nodes(self.name, gm)]
        storages = _as_strided_storages(gm, values)
        placeholders = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
        symbolic = any(isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in v.shape)
                       for v in placeholders)
        start = time.perf_counter()
        # A compile patches Inductor's process-wide config and cache-dir environment variables for
        # its duration: one at a time in a process (Note [One trace at a time] in ._common).
        with trace_lock():
            source, cpp_kernels, triton_files, inputs_to_check, relayout, sym_inputs = _run_inductor(
                gm, example_inputs, expected, self.device_type, symbolic, storages,
                frozenset(gm.meta.get("shared_outputs", ())),
            )
        guards = None
        if symbolic:
            shape_env = next(d.node.shape_env for v in placeholders if isinstance(v, torch.Tensor)
                             for d in v.shape if isinstance(d, torch.SymInt))
            guards = shape_env.produce_guards_expression(placeholders, ignore_static=False) or "True"
        members: dict[str, bytes] = {"wrapper.py": source.encode()}
        kernel_members = {}
        for key, blob in cpp_kernels.items():
            kernel_members[key] = f"cpp/{hashlib.sha256(blob).hexdigest()}.so"
            members[kernel_members[key]] = blob
        members.update(triton_files)
        manifest = {
            "format": _FORMAT,
            "fingerprint": self.fingerprint(),
            "inputs_to_check": inputs_to_check,
            "cpp_kernels": kernel_members,
            "triton_device": _device_index(example_inputs) if triton_files else None,
            "triton_files": sorted(triton_files),
            "guards": guards,
            "written": written_inputs(gm),
            "relayout": relayout,
            "sym_inputs": sym_inputs,
        }
        artifact = _pack(manifest, members)
        log.debug(
            "inductor: compiled %d nodes in %.2f s into %d bytes (%d C++ kernels, %d Triton files)",
            len(gm.graph.nodes), time.perf_counter() - start, len(artifact), len(cpp_kernels), len(triton_files),
        )
        return artifact

    def load(self, artifact: bytes) -> Callable[[list[torch.Tensor]], tuple[torch.Tensor, ...]]:
        """Rebuild the compiled callable; runs no compiler (Note [Self-contained Inductor artifacts])."""
        manifest, members = _unpack(artifact)
        if manifest.get("fingerprint") != self.fingerprint():
            raise BackendCompileError(
                f"inductor: artifact was made for {manifest.get('fingerprint')!r}, "
                f"this process is {self.fingerprint()!r}"
            )

        def bundled_kernel(argtypes: list[str], source_code: str, kwargs: dict) -> Callable:
            member = manifest["cpp_kernels"].get(_kernel_key(argtypes, source_code, kwargs))
            if member is None:
                raise BackendCompileError("inductor: artifact lacks a C++ kernel its wrapper asks for")
            return _load_cpp_kernel(members[member])

        try:
            if manifest["triton_files"]:
                _restore_triton(manifest["triton_device"], {name: members[name] for name in manifest["triton_files"]})
            call = _instantiate(members["wrapper.py"].decode(), bundled_kernel)
            if manifest.get("sym_inputs"):
                call = _with_sizes(call, manifest["sym_inputs"])
            run = _boxed(call, manifest["inputs_to_check"], frozenset(manifest.get("written", ())))
            if manifest.get("relayout"):
                run = restrided(run, manifest["relayout"])
            run = below_autograd(run)
            guards = manifest.get("guards")
            run.guards = None if guards is None else compile(guards, "<inductor guards>", "eval")
            return run
        except BackendCompileError:
            raise
        except Exception as e:
            raise BackendCompileError(f"inductor: artifact does not load: {type(e).__name__}: {e}") from e


def written_inputs(gm: torch.fx.GraphModule) -> list[int]:
    """Indices of the placeholders the graph writes (``copy_`` into them; Note [In-place regions])."""
    index = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    return sorted({index[n.args[0]] for n in gm.graph.nodes
                   if n.op == "call_function" and n.target is torch.ops.aten.copy_.default and n.args[0] in index})


def _run_inductor(
    gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor], expected: list[tuple], device_type: str,
    symbolic: bool = False, storages: dict[str, tuple[str, tuple[int, ...] | None]] | None = None,
    shared: frozenset = frozenset(),
) -> tuple[str, dict[str, bytes], dict[str, bytes], list[int], list[tuple]]:
    """Compile in an Inductor cache dir of our own; return the wrapper source and the binaries it uses."""
    from torch._inductor import config, standalone_compile
    from torch._inductor.codecache import CppPythonBindingsCodeCache
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir, temporary_cache_dir
    from torch._inductor.utils import fresh_cache

    captured = []

    def capture(inner_gm: torch.fx.GraphModule, inner_inputs: list, **kwargs: object) -> object:
        compiled = compile_fx_inner(inner_gm, inner_inputs, **kwargs)
        captured.append((inner_gm, compiled))
        return compiled

    # compile_fx takes ownership of the graph and its passes rewrite it in place; gm is the fuser's
    # record of the window (it may replay it after a failed compile), so Inductor gets a copy.
    gm = copy.deepcopy(gm)
    _views_as_reshapes(gm)
    if storages:
        _as_strided_on_storage(gm, storages)
    # Detached, so AOTAutograd traces an inference graph (outputs 1:1 with ours, no backward), and
    # distinct objects, so a tensor passed for two placeholders is not deduplicated into one input.
    inputs = [t.detach() for t in example_inputs]
    sym_inputs = _symbols_as_inputs(gm) if symbolic else []
    if symbolic:
        # The graph's own fake inputs: from real examples, AOTAutograd would make its own symbols
        # (duck-sized by value, so a batch of 4 beside 4 classes would be specialized to 4).
        inputs = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    if device_type == "cuda":
        # a fresh directory, so every Triton file in it belongs to this compile (_collect_triton)
        cache_dir = fresh_cache()
    else:
        # A directory that outlives the process: Inductor keeps its vector-ISA probe builds there,
        # which makes the first compile in a process ~10 s instead of ~25 s. Ours, so it does not
        # mix with torch.compile's entries; the environment variable is restored afterwards.
        # Only if nobody else can write it: Note [Trusted build directory] in fuser.backends._inductor_artifacts.
        cache_dir = temporary_cache_dir(_build_dir(default_cache_dir(), "adaptive_eager"))
    # AOTAutograd's cache would answer a repeated graph without calling inner_compile, leaving
    # nothing to capture; Inductor's own graph cache still makes such a compile fast.
    no_autograd_cache = torch._functorch.config.patch(enable_autograd_cache=False)
    settings = {**_CONFIG, "size_asserts": symbolic}  # Note [No size asserts]
    with (torch.no_grad(), cache_dir, no_autograd_cache, config.patch(settings), _atomic_builds(),
          _keyed_by_vec_isa(device_type)):
        try:
            standalone_compile(gm, inputs, dynamic_shapes="from_graph" if symbolic else "from_example_inputs",
                               options={"inner_compile": capture})
        except Exception as e:
            name, target = _culprit(e, gm)
            error = BackendCompileError(f"inductor: cannot compile {name}: {type(e).__name__}: {str(e)[:800]}")
            error.target = target
            raise error from e
        if len(captured) != 1:
            raise BackendCompileError(f"inductor: expected one compiled graph, Inductor produced {len(captured)}")
        inner_gm, compiled = captured[0]
        source = getattr(compiled, "source_code", None)
        if not isinstance(source, str):
            raise BackendCompileError(f"inductor: compiled a {type(compiled).__name__}, which has no Python wrapper")
        relayout = _check_calling_convention(inner_gm, compiled, expected, len(inputs), written_inputs(gm), shared)

        cpp_kernels: dict[str, bytes] = {}

        def record(argtypes: list[str], source_code: str, kwargs: dict) -> Callable:
            fn = CppPythonBindingsCodeCache.load_pybinding(argtypes, source_code, **kwargs)
            path = getattr(getattr(fn, "__self__", None), "__file__", None)
            if path is None:
                raise BackendCompileError("inductor: cannot find the shared object of a compiled C++ kernel")
            with open(path, "rb") as f:
                cpp_kernels[_kernel_key(argtypes, source_code, kwargs)] = f.read()
            return fn

        try:
            _instantiate(source, record)
        except BackendCompileError:
            raise
        except Exception as e:
            raise BackendCompileError(f"inductor: the generated wrapper does not load: {type(e).__name__}: {e}") from e
        triton_files = _collect_triton(_device_index(example_inputs)) if device_type == "cuda" else {}
    return source, cpp_kernels, triton_files, list(compiled.inputs_to_check), relayout, sym_inputs


# Note [Vector ISA in the graph cache key]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Inductor's C++ kernels are generated for the vector ISA ``pick_vec_isa()`` picks in this process
# (``ATEN_CPU_CAPABILITY`` chooses it: avx2 gives 8 float lanes, avx512 16): the loops step by its
# lane count and a float ``store`` writes a whole ``Vectorized<float>``. Inductor's FX graph cache
# (torch 2.13) does not key on that ISA, while the kernel's build does (the ISA's compiler flags).
# So a graph compiled once under ``ATEN_CPU_CAPABILITY=avx2`` left 8-lane source in the cache that
# a later process on an AVX-512 machine took and built with AVX-512 flags: ``x0 += 8`` with 16-lane
# stores wrote 32 bytes past a 16-float output buffer ("malloc(): unaligned tcache chunk detected"),
# and the other way round (16-lane source built for avx2: ``x0 += 16``, 8-lane loads and stores)
# half of each output is never written. Our build directory is shared by every process of this
# user (it ignores TORCHINDUCTOR_CACHE_DIR: Note [Trusted build directory]), so a compile adds the
# picked ISA to ``torch.compiler.config.cache_key_tag``, which is part of the FX graph cache key.


@contextlib.contextmanager
def _keyed_by_vec_isa(device_type: str):
    """Note [Vector ISA in the graph cache key]; enter inside the compile's cache directory (the
    ISA probes build there)."""
    if device_type != "cpu":  # no C++ kernels; picking would build the ISA probes for nothing
        yield
        return
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    tag = f"{torch.compiler.config.cache_key_tag}|adaptive_eager-vec-isa:{isa}:{isa.bit_width()}:{isa.build_arch_flags()}"
    with torch.compiler.config.patch(cache_key_tag=tag):
        yield


def _symbols_as_inputs(gm: torch.fx.GraphModule) -> list[list[int]]:
    """Note [Symbols as inputs]: a placeholder per symbol of ``gm``'s input sizes, after the
    others (rewrites ``gm`` in place); the (input, dim) whose size each one takes."""
    import sympy

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    first: dict = {}
    for i, node in enumerate(placeholders):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            for d, size in enumerate(val.shape):
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                    first.setdefault(size.node.expr, (i, d, size))
    last = placeholders[-1] if first else None  # a symbol is a placeholder's size
    for k, (_, _, size) in enumerate(first.values()):
        with gm.graph.inserting_after(last):
            last = gm.graph.placeholder(f"sym_size_{k}")
        last.meta["val"] = size
    gm.recompile()
    return [[i, d] for i, d, _ in first.values()]


def _with_sizes(call: Callable, sym_inputs: list) -> Callable:
    """The wrapper of a graph with ``_symbols_as_inputs``: the sizes after the inputs."""
    where = [(int(i), int(d)) for i, d in sym_inputs]

    def with_sizes(args: list) -> tuple:
        return call(args + [args[i].shape[d] for i, d in where])

    return with_sizes


# Note [Views as reshapes]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# A ``view`` in the fuser's graph is one eager ran: its input's strides allowed it. Inductor traces
# the graph again with its own decompositions, which do not always give eager's strides: ``cat``
# of a legacy empty tensor and one other tensor (GPT-2's key cache, ``cat([empty(0), k], -2)``)
# decomposes to ``k.clone()``, which keeps ``k``'s permuted layout where eager's ``cat`` returns a
# contiguous tensor, and the ``view`` that follows then fails in the trace. In a functional graph
# ``view`` and ``reshape`` give the same values, and ``reshape`` is a view wherever the traced
# strides allow one (a copy elsewhere), so the compiled graph asks for ``reshape``. Outputs whose
# layout then differs from eager's are copied into eager's (Note [Calling the wrapper directly]).
_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def _views_as_reshapes(gm: torch.fx.GraphModule) -> None:
    """Note [Views as reshapes]: rewrites ``gm`` in place."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _VIEWS:
            node.target = torch.ops.aten.reshape.default
    gm.recompile()


# Note [as_strided over a computed storage]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``as_strided`` addresses its input's storage, not its input: ``y.expand(5, 5).as_strided([5, 5],
# [0, 1], 0)`` has ``y`` in every row, ``y[1:].as_strided([3, 4], [1, 6], 1)`` reads ``y``'s storage
# from element 1. Inductor (torch 2.13; torch.compile alone too) gets this wrong when the input is
# a view (an expand, a slice) of a value computed in the graph: it gave every element ``y[0]`` for
# the expand, and read the slice's case from the slice's own offset (gradcheck's ``as_strided`` of
# an expand of ``x + eps * u`` is one). Of an input, or of a computed value that is not a view, it
# is right. So the graph Inductor gets takes such an ``as_strided`` from the value that owns the
# storage (the first node whose eager value has it), as that value lies in memory in eager: the
# owner itself when it is contiguous, else the owner permuted to memory order and cloned
# contiguous. An owner that does not fill its storage densely cannot be written so: such a graph
# is not compiled (its window replays).
_AS_STRIDED = torch.ops.aten.as_strided.default


def _as_strided_storages(gm: torch.fx.GraphModule, values: dict) -> dict[str, tuple[str, tuple[int, ...] | None]]:
    """Note [as_strided over a computed storage]: {as_strided node's name: (its storage's owner's
    name, the permutation to memory order or None when the owner is contiguous)} for each
    ``as_strided`` of a view of a computed value; ``values``: each node's eager (fake) value."""
    found: dict[str, tuple[str, tuple[int, ...] | None]] = {}
    if not any(n.op == "call_function" and n.target is _AS_STRIDED for n in gm.graph.nodes):
        return found
    owners: dict[int, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        value = values.get(node)
        if isinstance(value, torch.Tensor):
            owners.setdefault(value.untyped_storage()._cdata, node)
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not _AS_STRIDED:
            continue
        source = node.args[0]
        owner = owners.get(values[source].untyped_storage()._cdata)
        if owner is None or owner is source or owner.op == "placeholder":
            continue
        base = values[owner]
        perm = tuple(sorted(range(base.dim()), key=lambda d: -base.stride(d)))
        if (base.storage_offset() != 0 or not base.permute(perm).is_contiguous()
                or base.untyped_storage().nbytes() != base.numel() * base.element_size()):
            raise BackendCompileError(
                f"inductor: cannot compile as_strided (node {node.name}) of a view of {owner.name}, whose "
                f"elements do not fill its storage densely (Note [as_strided over a computed storage])")
        found[node.name] = (owner.name, None if base.is_contiguous() else perm)
    return found


def _as_strided_on_storage(gm: torch.fx.GraphModule, storages: dict[str, tuple[str, tuple[int, ...] | None]]) -> None:
    """Note [as_strided over a computed storage]: rewrites ``gm`` (a copy of the graph
    ``_as_strided_storages`` read) in place."""
    nodes = {n.name: n for n in gm.graph.nodes}
    for name, (owner_name, perm) in storages.items():
        node, owner = nodes[name], nodes[owner_name]
        storage = owner
        if perm is not None:
            with gm.graph.inserting_before(node):
                permuted = gm.graph.call_function(torch.ops.aten.permute.default, (owner, list(perm)))
                storage = gm.graph.call_function(torch.ops.aten.clone.default, (permuted,),
                                                 {"memory_format": torch.contiguous_format})
        node.args = (storage, *node.args[1:])
    gm.recompile()


def _check_calling_convention(
    inner_gm: torch.fx.GraphModule, compiled: object, expected: list[tuple], n_inputs: int,
    graph_writes: list[int], shared: frozenset = frozenset(),
) -> list:
    """See Note [Calling the wrapper directly]."""
    nodes = list(inner_gm.graph.nodes)
    n_placeholders = sum(n.op == "placeholder" for n in nodes)
    if n_placeholders != n_inputs:
        raise BackendCompileError(
            f"inductor: compiled code takes {n_placeholders} inputs for the graph's {n_inputs}"
        )
    outputs = next(n for n in reversed(nodes) if n.op == "output").args[0]
    if len(outputs) != len(expected):
        raise BackendCompileError(
            f"inductor: compiled code returns {len(outputs)} outputs for the graph's {len(expected)}"
        )
    relayout = []
    first: dict = {}  # node -> the first output it is
    for i, (out, want) in enumerate(zip(outputs, expected)):
        j = first.setdefault(out, i)
        repeated = j != i or out.op == "placeholder"
        got = _at_hints(tensor_meta("inductor", getattr(out, "meta", {}).get("val")))
        if got == want:
            if repeated and not (out.op != "placeholder" and i in shared and j in shared):
                relayout.append((i, None, None))  # a buffer of its own: Note [Repeated outputs]
            continue
        concrete = not any(isinstance(d, torch.SymInt) for part in want[:2] for d in part)
        if concrete and got[0] == want[0] and got[3] == want[3]:
            # the same values in another layout: Inductor returned a view into a buffer of its own
            # (the clone of a slice whose base is otherwise dead); copied into eager's at run time
            relayout.append((i, tuple(want[0]), tuple(want[1])))
            continue
        raise BackendCompileError(
            f"inductor: compiled output {i} would be (shape, stride, offset, dtype) {got}, eager gives {want}"
        )
    for attribute in ("constants", "torchbind_constants"):
        if getattr(compiled, attribute, None):
            raise BackendCompileError(f"inductor: compiled code has {attribute}, which artifacts cannot carry")
    # Note [In-place regions]: the graph may write its inputs (trailing copy_ into placeholders);
    # the generated kernels then store into those inputs themselves. Sound only if Inductor
    # writes exactly the inputs the graph writes (none moved to extra outputs for a wrapper to copy).
    written = sorted(getattr(compiled, "mutated_input_idxs", ()) or ())
    if written != graph_writes:
        error = BackendCompileError(
            f"inductor: compiled code writes inputs {written}, the graph writes {graph_writes}"
        )
        error.inplace = True
        raise error
    return relayout


def _at_hints(meta: tuple) -> tuple:
    """Output metadata with symbolic sizes at their example values (reads hints: adds no guard)."""
    from torch.fx.experimental import symbolic_shapes

    # torch 2.13 renamed ``hint_int`` (2.11) to ``guarding_hint_or_throw``
    hint = getattr(symbolic_shapes, "guarding_hint_or_throw", None) or symbolic_shapes.hint_int

    def concrete(x: object) -> object:
        if isinstance(x, torch.SymInt):
            return hint(x)
        if isinstance(x, tuple):
            return tuple(concrete(v) for v in x)
        return x

    return tuple(concrete(v) for v in meta)


def _culprit(error: BaseException, gm: torch.fx.GraphModule) -> tuple[str, object]:
    """The first op of ``gm`` that Inductor's error names (its lowering errors print the target):
    how to name it, and the target (None when the error names no op of the graph)."""
    texts = []
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        texts.append(str(e))
        pending += [e.__cause__, e.__context__, getattr(e, "inner_exception", None)]
    text = "\n".join(texts)
    for node in gm.graph.nodes:
        if node.op == "call_function" and op_name(node.target) in text:
            return f"{op_name(node.target)} (node {node.name})", node.target
    return "the graph (the error names none of its ops)", None


def _boxed(call: Callable, inputs_to_check: list[int], written: frozenset = frozenset()) -> Callable[[list[torch.Tensor]], tuple]:
    if not inputs_to_check:
        # the wrapper clears the list it is given, to free inputs early; the caller keeps theirs
        return lambda inputs: call(list(inputs))
    from torch._inductor.utils import ALIGNMENT, clone_preserve_strides

    def realigned(inputs: list[torch.Tensor]) -> tuple:
        args = list(inputs)
        moved = []
        for i in inputs_to_check:
            if args[i].data_ptr() % ALIGNMENT:
                args[i] = clone_preserve_strides(args[i])
                if i in written:
                    moved.append(i)
        result = call(list(args))
        for i in moved:  # an input the kernels wrote through an aligned copy (Note [In-place regions])
            inputs[i].copy_(args[i])
        return result

    return realigned


def _device_index(example_inputs: list[torch.Tensor]) -> int:
    for t in example_inputs:
        if t.device.type == "cuda":
            return t.device.index if t.device.index is not None else torch.cuda.current_device()
    return torch.cuda.current_device()


def _fingerprint(device_type: str) -> str:
    parts = [
        f"inductor-{_FORMAT}",
        f"torch-{torch.__version__}@{(torch.version.git_version or 'unknown')[:12]}",
        sys.implementation.cache_tag,  # the kernels are Python extension modules
        platform.machine(),
    ]
    if device_type == "cpu":
        parts.append(f"cpu-{torch.backends.cpu.get_cpu_capability()}")
    else:
        try:
            import triton

            triton_version = triton.__version__
        except ImportError:
            triton_version = "none"
        major, minor = torch.cuda.get_device_capability()
        toolkit = torch.version.cuda or f"hip{torch.version.hip}"
        parts.append(f"cuda-{toolkit}-sm{major}{minor}-triton-{triton_version}")
    parts.append("config-" + hashlib.sha256(json.dumps(_CONFIG, sort_keys=True).encode()).hexdigest()[:16])
    parts.append("passes-" + ",".join(_GRAPH_PASSES))
    return "|".join(parts)
