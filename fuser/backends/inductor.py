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
in it, and on CUDA the Triton cache files of its kernels. ``load`` executes the wrapper with
``AsyncCompile`` replaced by ``_Kernels``, which hands each C++ kernel its bundled ``.so`` (written
to a temporary file only long enough to ``dlopen`` it) and passes Triton kernels to the real
``AsyncCompile`` after restoring their cache files, so Triton finds them instead of compiling.
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

Note [Atomic Inductor builds]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Inductor (2.11-2.13) builds each C++ object and shared library with the compiler writing straight
to its final path in the cache directory, and afterwards believes any file at that path: its
existence checks (``_worker_compile_cpp``, ``VecISA.check_build``) look for nothing more. A compile
killed mid-build (a worker killed at exit, the OOM killer, a power cut) left a torn ``.so`` that
every later compile of that kernel on the machine loaded and failed on, so the region was
blacklisted in every process. While this backend compiles, ``CppBuilder.build`` writes to a
temporary file beside its target, flushes it to disk and renames it into place, so a target is
whole or absent; and ``CppBuilder.get_target_file_path``, which Inductor calls just before each of
those existence checks, deletes a target in the compile's cache directory that is empty or not a
whole ELF file (a torn one from before this, or from another tool), so that it is built again
instead of believed. A dead builder's temporary files are removed when its target is next built.

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

Note [Symbolic Inductor artifacts]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A graph whose placeholders carry only concrete sizes is compiled statically
(``dynamic_shapes="from_example_inputs"`` specializes on the example shapes; the wrapper's
``assert_size_stride`` rejects others). A graph traced symbolically (the fuser's ``Program`` with
dynamic dims: placeholders' ``meta["val"]`` are fake tensors with SymInt sizes, outputs carry
``meta["example_value"]``) is compiled with ``dynamic_shapes="from_graph"``: Inductor uses that
graph's ``ShapeEnv``, the wrapper reads the sizes off its input tensors (no SymInt inputs), and
every assumption Inductor made about the symbols (sizes >= 2, ``s0 <= 4096`` for an accumulator
choice, ...) lands in that ``ShapeEnv`` as a guard. The manifest keeps those guards as one Python
expression over ``L['t0']``, ``L['t1']``, ... (the inputs in order, ``ShapeEnv.produce_guards_expression``)
and the callable from ``load`` carries it, compiled, as ``guards`` (None for static artifacts): the
caller must evaluate it (``eval(run.guards, SYMPY_INTERP, {"L": {...}})``) before using the
artifact for inputs of other sizes. The calling-convention check compares output metadata at the
example (hint) sizes; the caller verifies it for other sizes.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import glob
import hashlib
import io
import json
import logging
import os
import platform
import shutil
import struct
import sys
import tempfile
import threading
import time
import uuid
import zipfile
import zlib
from collections.abc import Callable

import torch

from ._common import (
    BackendCompileError, below_autograd, check_graph, eager_output_meta, op_name, restrided, tensor_meta,
)

log = logging.getLogger(__name__)

_FORMAT = 2  # 2: repeated outputs are copied (Note [Repeated outputs]); format-1 artifacts may share them
_DEVICE_TYPES = ("cpu", "cuda")

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
}

_ASYNC_COMPILE_IMPORT = "from torch._inductor.async_compile import AsyncCompile\n"
_TRITON_DIR_PLACEHOLDER = b"@ADAPTIVE_EAGER_TRITON_KERNEL_DIR@"
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # fixed, so one compile result always packs to the same bytes

# A compile patches Inductor's process-wide config and cache-dir environment variables for its
# duration; two compiles at once in one process would see each other's.
_compile_lock = threading.Lock()

# Note [Trusted build directory]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Inductor builds C++ kernels in its cache directory and loads a .so it finds there under the
# kernel's hash without building it; Triton does the same with its cache. Both default to a
# predictable name under the temporary directory (``/tmp/torchinductor_$USER``): another user who
# makes that directory first owns every build in it, and a kernel built here is bundled into the
# artifact (Note [Self-contained Inductor artifacts]), so their .so would run in every process that
# loads it. So a compile builds only where nobody but this user (and root) can write: Inductor's
# directory and ours in it pass ``neff_cache.access.open_directory`` (owner, no group or other
# write, not a symbolic link; made 0700 if missing), else the process builds in a private
# temporary directory (its first compile is slower: the vector-ISA probes are built again), with
# one WARNING naming the directory and the fix. A load writes bundled .so files only to a fresh
# ``mkdtemp`` directory (0700, created exclusively: ``_load_cpp_kernel``) and Triton kernels only
# to a Triton cache that passes the same check, else the load fails. What stays trusted: whoever
# can write these directories as this user, as for the artifact cache (Note [Cache trust] in
# ``neff_cache.access``), and torch.compile's own use of ``/tmp/torchinductor_$USER``, which
# this backend does not govern.
_stand_in_build_dirs: dict[str, str] = {}  # an untrusted build directory -> this process's private one


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
        expected = eager_output_meta(self.name, gm, example_inputs)
        placeholders = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
        symbolic = any(isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in v.shape)
                       for v in placeholders)
        start = time.perf_counter()
        with _compile_lock:
            source, cpp_kernels, triton_files, inputs_to_check, relayout = _run_inductor(
                gm, example_inputs, expected, self.device_type, symbolic
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
    symbolic: bool = False,
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
    # Detached, so AOTAutograd traces an inference graph (outputs 1:1 with ours, no backward), and
    # distinct objects, so a tensor passed for two placeholders is not deduplicated into one input.
    inputs = [t.detach() for t in example_inputs]
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
        # Only if nobody else can write it: Note [Trusted build directory].
        cache_dir = temporary_cache_dir(_build_dir(default_cache_dir(), "adaptive_eager"))
    # AOTAutograd's cache would answer a repeated graph without calling inner_compile, leaving
    # nothing to capture; Inductor's own graph cache still makes such a compile fast.
    no_autograd_cache = torch._functorch.config.patch(enable_autograd_cache=False)
    with torch.no_grad(), cache_dir, no_autograd_cache, config.patch(_CONFIG), _atomic_builds():
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
        relayout = _check_calling_convention(inner_gm, compiled, expected, len(inputs), written_inputs(gm))

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
    return source, cpp_kernels, triton_files, list(compiled.inputs_to_check), relayout


@contextlib.contextmanager
def _atomic_builds():
    """Inductor's C++ builds made atomic, and torn outputs rebuilt: Note [Atomic Inductor builds]."""
    from torch._inductor.cpp_builder import CppBuilder
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    ours = os.path.join(os.path.realpath(cache_dir()), "")
    build, target_file_path = CppBuilder.build, CppBuilder.get_target_file_path

    def atomic_build(builder: CppBuilder) -> None:
        target = builder.get_target_file_path()
        output = builder._output
        if not output.endswith(" " + target):  # a command line of another shape (Windows, remote builds)
            return build(builder)
        _remove_dead_builders_files(target)
        temporary = f"{target}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
        builder._output = output[: -len(target)] + temporary
        try:
            build(builder)
            with open(temporary, "rb") as built:
                os.fsync(built.fileno())
            os.replace(temporary, target)
        finally:
            builder._output = output
            with contextlib.suppress(FileNotFoundError):
                os.remove(temporary)

    def checked_target_file_path(builder: CppBuilder) -> str:
        path = target_file_path(builder)
        if os.path.realpath(path).startswith(ours) and path.endswith((".so", ".o")) and _torn(path):
            log.warning("inductor: %s is torn (a build was killed while writing it); building it again", path)
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        return path

    CppBuilder.build, CppBuilder.get_target_file_path = atomic_build, checked_target_file_path
    try:
        yield
    finally:
        CppBuilder.build, CppBuilder.get_target_file_path = build, target_file_path


def _remove_dead_builders_files(target: str) -> None:
    for path in glob.glob(glob.escape(target) + ".*-*.tmp"):
        pid = path[len(target) + 1 :].partition("-")[0]
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        except (ValueError, PermissionError):
            pass


def _torn(path: str) -> bool:
    """Whether the build output at ``path`` exists but is not whole: empty, or on Linux not an ELF
    file whose section header table (written last by GNU as and ld) lies within the file."""
    try:
        with open(path, "rb") as output:
            header = output.read(64)
            size = os.fstat(output.fileno()).st_size
    except FileNotFoundError:
        return False
    except OSError:
        return True
    if size == 0:
        return True
    if not sys.platform.startswith("linux"):
        return False  # Mach-O and PE files: nothing more is checked
    if len(header) < 52 or header[:4] != b"\x7fELF" or header[4] not in (1, 2) or header[5] not in (1, 2):
        return True
    endian = "<" if header[5] == 1 else ">"
    if header[4] == 2:  # ELFCLASS64
        (section_table,) = struct.unpack_from(endian + "Q", header, 0x28)
        entry_size, entries = struct.unpack_from(endian + "HH", header, 0x3A)
    else:
        (section_table,) = struct.unpack_from(endian + "I", header, 0x20)
        entry_size, entries = struct.unpack_from(endian + "HH", header, 0x2E)
    return section_table + entry_size * entries > size


def _check_calling_convention(
    inner_gm: torch.fx.GraphModule, compiled: object, expected: list[tuple], n_inputs: int,
    graph_writes: list[int],
) -> None:
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
    returned = set()
    for i, (out, want) in enumerate(zip(outputs, expected)):
        repeated = out in returned or out.op == "placeholder"
        returned.add(out)
        got = _at_hints(tensor_meta("inductor", getattr(out, "meta", {}).get("val")))
        if got == want:
            if repeated:
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


class _Kernels:
    """What Inductor's wrapper gets from ``AsyncCompile()`` when this backend executes it.

    C++ kernels come from ``cpp_kernel`` (the recorder at compile time, the artifact at load time);
    Triton kernels go to the real ``AsyncCompile``, as in Inductor's own loading. Any other kernel
    kind is a wrapper this backend cannot make self-contained, reported at compile time.
    """

    def __init__(self, cpp_kernel: Callable[[list[str], str, dict], Callable]) -> None:
        self._cpp_kernel = cpp_kernel
        self._async_compile = None

    def cpp_pybinding(self, argtypes: list[str], source_code: str, **kwargs: object) -> Callable:
        return self._cpp_kernel(argtypes, source_code, kwargs)

    def triton(self, kernel_name: str, source_code: str, device_str: str = "cuda") -> object:
        if self._async_compile is None:
            from torch._inductor.async_compile import AsyncCompile

            self._async_compile = AsyncCompile()
        return self._async_compile.triton(kernel_name, source_code, device_str)

    def wait(self, scope: dict) -> None:
        if self._async_compile is not None:
            self._async_compile.wait(scope)

    def __getattr__(self, kind: str) -> object:
        if kind.startswith("__"):
            raise AttributeError(kind)
        raise BackendCompileError(f"inductor: generated code uses {kind!r} kernels, which artifacts cannot carry")


def _instantiate(source: str, cpp_kernel: Callable[[list[str], str, dict], Callable]) -> Callable:
    """Execute Inductor's wrapper module with ``_Kernels`` as its ``AsyncCompile``; return ``call``."""
    if _ASYNC_COMPILE_IMPORT not in source:
        raise BackendCompileError(
            f"inductor: the wrapper torch {torch.__version__} generates does not import AsyncCompile "
            "the way this loader expects; artifacts cannot be made self-contained"
        )
    from torch._inductor import config

    kernels = _Kernels(cpp_kernel)
    # Removing the import leaves our name in place: the wrapper can only build kernels through
    # ``kernels``, so one that reaches for the real compiler fails here instead of compiling.
    namespace = {"__name__": f"{__name__}.wrapper", "AsyncCompile": lambda: kernels}
    code = compile(source.replace(_ASYNC_COMPILE_IMPORT, ""), "<inductor wrapper>", "exec")
    # A Triton cache miss compiles in this thread instead of starting Inductor's worker pool.
    with config.patch(compile_threads=1):
        exec(code, namespace)
    call = namespace.get("call")
    if not callable(call):
        raise BackendCompileError("inductor: the generated wrapper defines no call()")
    return call


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


def _kernel_key(argtypes: list[str], source_code: str, kwargs: dict) -> str:
    return hashlib.sha256(repr((list(argtypes), source_code, sorted(kwargs.items()))).encode()).hexdigest()


def _build_dir(inductor_dir: str, name: str) -> str:
    """``inductor_dir/name`` for our builds if only this user can write both, else a private
    directory of this process (Note [Trusted build directory])."""
    from neff_cache.access import UntrustedCache

    path = os.path.join(inductor_dir, name)
    if path in _stand_in_build_dirs:
        return _stand_in_build_dirs[path]
    try:
        _trusted_dirs(inductor_dir, path)
        return path
    except UntrustedCache as error:
        stand_in = _stand_in_build_dirs[path] = tempfile.mkdtemp(prefix="adaptive_eager_inductor_")
        atexit.register(shutil.rmtree, stand_in, ignore_errors=True)
        log.warning(
            "inductor: not building kernels in %s: %s; whoever can write it could run code in this process. "
            "Building in %s for this process instead (its first compile is slower). To fix it, %s.",
            path, error, stand_in, error.fix,
        )
        return stand_in


def _trusted_dirs(top: str, path: str) -> None:
    """``open_directory`` (made 0700 if missing, checked) for ``top`` and each directory below it
    down to ``path``; raises UntrustedCache."""
    from neff_cache.access import open_directory

    directory = top
    open_directory(directory)
    for part in os.path.relpath(path, top).split(os.sep):
        if part != os.curdir:
            directory = os.path.join(directory, part)
            open_directory(directory)


def _load_cpp_kernel(blob: bytes) -> Callable:
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    # Named by content, so a kernel shared by several artifacts is loaded once per process.
    key = "adaptive_eager_" + hashlib.sha256(blob).hexdigest()[:40]
    # dlopen needs a file, but the mapping outlives it: nothing is left on disk. mkdtemp makes the
    # directory 0700 and fails if the name exists: nobody else can put a file there (Note [Trusted
    # build directory]).
    with tempfile.TemporaryDirectory(prefix="adaptive_eager_kernel_", ignore_cleanup_errors=True) as d:
        path = os.path.join(d, "kernel.so")
        with open(path, "wb") as f:
            f.write(blob)
        module = CppPythonBindingsCodeCache._load_library(path, key)
    return getattr(module, CppPythonBindingsCodeCache.entry_function)


def _device_index(example_inputs: list[torch.Tensor]) -> int:
    for t in example_inputs:
        if t.device.type == "cuda":
            return t.device.index if t.device.index is not None else torch.cuda.current_device()
    return torch.cuda.current_device()


def _collect_triton(device_index: int) -> dict[str, bytes]:
    """This compile's Triton cache files (its cache dir is private to the compile), made relocatable."""
    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

    base = triton_cache_dir(device_index)
    files: dict[str, bytes] = {}
    if not os.path.isdir(base):
        return files
    for kernel_hash in sorted(os.listdir(base)):
        kernel_dir = os.path.join(base, kernel_hash)
        if kernel_hash.startswith("tmp.") or not os.path.isdir(kernel_dir):
            continue
        for name in sorted(os.listdir(kernel_dir)):
            if name.endswith(".lock") or name.startswith("tmp."):
                continue
            with open(os.path.join(kernel_dir, name), "rb") as f:
                data = f.read()
            if name.endswith(".json"):
                # Triton's group index records absolute paths; Inductor's TritonBundler relocates them the same way.
                data = data.replace(kernel_dir.encode(), _TRITON_DIR_PLACEHOLDER)
            files[f"triton/{kernel_hash}/{name}"] = data
    return files


def _restore_triton(device_index: int, files: dict[str, bytes]) -> None:
    """Put bundled Triton kernels where this process's Triton cache will look for them, if only this
    user can write it (Note [Trusted build directory])."""
    from neff_cache.access import UntrustedCache
    from torch._inductor.runtime.cache_dir_utils import cache_dir, triton_cache_dir

    base = triton_cache_dir(device_index)
    inductor_dir = cache_dir()
    try:
        _trusted_dirs(inductor_dir if base.startswith(inductor_dir + os.sep) else base, base)
    except UntrustedCache as error:
        raise BackendCompileError(
            f"inductor: Triton's cache {base} is not safe to load kernels from: {error}; to fix it, {error.fix} "
            "(or set TRITON_CACHE_DIR to a directory of your own)"
        ) from None
    kernels: dict[str, list[tuple[str, bytes]]] = {}
    for member, data in files.items():
        _, kernel_hash, name = member.split("/")
        kernels.setdefault(kernel_hash, []).append((name, data))
    for kernel_hash, entries in kernels.items():
        target = os.path.join(base, kernel_hash)
        if os.path.isdir(target) and os.listdir(target):
            continue
        tmp = os.path.join(base, f"tmp.{uuid.uuid4().hex}")
        os.makedirs(tmp)
        for name, data in entries:
            if name.endswith(".json"):
                data = data.replace(_TRITON_DIR_PLACEHOLDER, target.encode())
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
        try:
            # a rename, so Triton never sees a half-written kernel directory
            os.replace(tmp, target)
        except OSError:
            # another process restored the same kernel first
            shutil.rmtree(tmp, ignore_errors=True)


def _pack(manifest: dict, members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in {"manifest.json": json.dumps(manifest, sort_keys=True).encode(), **members}.items():
            info = zipfile.ZipInfo(name, date_time=_ZIP_DATE)
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
    return buf.getvalue()


def _unpack(artifact: bytes) -> tuple[dict, dict[str, bytes]]:
    """Manifest and members; zip's CRC-32 on every member catches corruption, and a manifest whose
    fields do not have the types ``compile`` writes, or that names members the zip lacks, is refused."""
    try:
        with zipfile.ZipFile(io.BytesIO(artifact)) as z:
            members = {name: z.read(name) for name in z.namelist()}
        manifest = json.loads(members.pop("manifest.json"))
    except (zipfile.BadZipFile, zlib.error, KeyError, ValueError, EOFError, RecursionError) as e:
        raise BackendCompileError(f"inductor: artifact is corrupt or not an inductor artifact: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        raise BackendCompileError(f"inductor: artifact manifest is not format {_FORMAT}: {str(manifest)[:200]}")
    problem = _manifest_problem(manifest, members)
    if problem is not None:
        raise BackendCompileError(f"inductor: artifact manifest is malformed: {problem}")
    return manifest, members


def _manifest_problem(manifest: dict, members: dict[str, bytes]) -> str | None:
    def ints(x: object) -> bool:
        return type(x) is list and all(type(i) is int and i >= 0 for i in x)

    kernels, triton = manifest.get("cpp_kernels"), manifest.get("triton_files")
    if "wrapper.py" not in members:
        return "no wrapper.py"
    if not (type(kernels) is dict and all(type(m) is str and m in members for m in kernels.values())):
        return f"cpp_kernels {str(kernels)[:200]}"
    if not (type(triton) is list and all(type(m) is str and m in members and _is_triton_member(m) for m in triton)):
        return f"triton_files {str(triton)[:200]}"
    if triton and type(manifest.get("triton_device")) is not int:
        return f"triton_device {manifest.get('triton_device')!r}"
    if not (ints(manifest.get("inputs_to_check")) and ints(manifest.get("written", []))):
        return f"inputs_to_check {manifest.get('inputs_to_check')!r}, written {manifest.get('written')!r}"
    if not isinstance(manifest.get("guards"), (str, type(None))):
        return f"guards {manifest.get('guards')!r}"
    relayout = manifest.get("relayout") or []
    # (index, shape, stride), or (index, None, None): a buffer of its own (Note [Repeated outputs])
    if not (type(relayout) is list and all(type(r) is list and len(r) == 3 and type(r[0]) is int and (
            (ints(r[1]) and ints(r[2])) or (r[1] is None and r[2] is None)) for r in relayout)):
        return f"relayout {str(relayout)[:200]}"
    return None


def _is_triton_member(name: str) -> bool:
    """``triton/<kernel hash>/<file>``: ``_restore_triton`` writes it there, under Triton's cache, and nowhere else."""
    parts = name.split("/")
    return len(parts) == 3 and parts[0] == "triton" and all(p not in ("", ".", "..") and "\0" not in p for p in parts)


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
    return "|".join(parts)
