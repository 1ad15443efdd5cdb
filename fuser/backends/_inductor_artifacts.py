"""The inductor backend's artifacts: the container, the loader of its bundled kernels, and the builds.

What ``fuser.backends.inductor`` compiles is packed here into one self-contained artifact (Note
[Self-contained Inductor artifacts] in ``fuser.backends.inductor``): a zip of Inductor's Python
wrapper, the ``.so`` of each of its C++ kernels and, on CUDA, its Triton cache files (``_pack``,
``_unpack``); ``_instantiate`` executes the wrapper with ``_Kernels`` as its ``AsyncCompile``, at
compile time with a recorder of the built kernels and at load time with the bundled ones. Inductor
builds those kernels atomically (Note [Atomic Inductor builds]) in a directory nobody else can
write (Note [Trusted build directory]).


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
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import hashlib
import io
import json
import logging
import os
import shutil
import struct
import sys
import tempfile
import uuid
import zipfile
import zlib
from collections.abc import Callable

import torch

from ._common import BackendCompileError

log = logging.getLogger("fuser.backends.inductor")  # the backend's logger: its warnings are the backend's

# 2: repeated outputs are copied (Note [Repeated outputs] in fuser.backends.inductor); format-1 artifacts may share them
# 3: a symbolic artifact's wrapper takes its symbols' sizes after the tensors (Note [Symbols as inputs])
_FORMAT = 3
_ASYNC_COMPILE_IMPORT = "from torch._inductor.async_compile import AsyncCompile\n"
_TRITON_DIR_PLACEHOLDER = b"@ADAPTIVE_EAGER_TRITON_KERNEL_DIR@"
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # fixed, so one compile result always packs to the same bytes

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
