"""Fault injection: real processes killed at every stage of a compile and of a cache write, torn build
outputs, full and read-only disks, Ctrl-C, and programs that exit before their first compile.

After each fault the next process gets eager's values and the cache recovers: the region compiles
again (or loads), no claim of a dead process blocks it, no orphaned file is left and the cache stays
within its size bound. The kills of a cache write without a compile are in test_neff_cache.py
(``test_files_orphaned_by_a_writer_killed_mid_write_are_removed``). Each child runs under a timeout.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from _oracle import artifacts, program_env

import adaptive_eager as ae
import fuser
from adaptive_eager import adaptive_eager
from fuser.backends import _inductor_artifacts, inductor
from neff_cache import ArtifactStore

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**program_env(), "PYTHONPATH": REPO_ROOT}


def unique_constant() -> float:
    """A float32-exact constant no other test uses, so the region's kernel is new to Inductor's
    caches (its C++ source holds ``repr`` of it)."""
    return 1 + random.randrange(1, 2**20) / 2**21


X = torch.linspace(-2, 2, 2048)


def program(c: float) -> torch.Tensor:
    return ((X * c).sin() + c).sum()  # the children below run this same window


def new_process() -> None:
    """What a new process starts with: no region, shape class, scalar group or store handle in memory."""
    fuser.cache_clear(store_handles=True)
    ae.reset_metrics()


def run_here(cache_dir, c: float) -> dict:
    """Run the program in this process as a new process would, checking its value against eager."""
    new_process()
    with adaptive_eager(cache_dir=str(cache_dir), hot_after=1, async_compile=False):
        got = program(c)
    torch.testing.assert_close(got, program(c))
    return ae.metrics()


def orphans(cache_dir) -> int:
    with ArtifactStore(cache_dir) as store:
        return store.remove_orphans(grace_s=0)[0]


def claimed_keys(cache_dir) -> list[str]:
    """The keys with a claim row, live or not (read directly: ``is_claimed`` ignores dead holders)."""
    database = sqlite3.connect(os.path.join(cache_dir, "control", "cache.db"))
    try:
        return [row[0].rpartition("/")[2] for row in database.execute("SELECT key FROM Cache WHERE key LIKE 'claim/%'")]
    finally:
        database.close()


# ------------------------------------------------------------------ kills during a compile

KILLED_CHILD = textwrap.dedent(
    """
    import os, shlex, signal, sys, torch
    import adaptive_eager as ae
    import fuser.compile
    from neff_cache import ArtifactStore
    cache_dir, stage, c = sys.argv[1], sys.argv[2], float(sys.argv[3])

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    if stage == "trace":  # the claim is taken and the compile has begun
        fuser.compile.compile_program = lambda *args: die()
    elif stage == "build":  # the C++ compiler has written half of the region's kernel library
        import torch._inductor.cpp_builder as cpp_builder
        run = cpp_builder.run_compile_cmd

        def half_written(cmd_line, cwd):
            run(cmd_line, cwd)
            argv = shlex.split(cmd_line)
            if any(repr(c) in open(a).read() for a in argv if a.endswith(".cpp")):
                output = argv[argv.index("-o") + 1]
                os.truncate(output, os.path.getsize(output) // 2)
                die()

        cpp_builder.run_compile_cmd = half_written
    elif stage == "stored":  # the artifact is stored, the claim not yet released
        put = ArtifactStore.put

        def put_then_die(self, *args, **kwargs):
            put(self, *args, **kwargs)
            die()

        ArtifactStore.put = put_then_die
    x = torch.linspace(-2, 2, 2048)
    with ae.adaptive_eager(cache_dir=cache_dir, hot_after=1, async_compile=False):
        got = ((x * c).sin() + c).sum()
    print("survived")
    """
)
COMPILE_STAGES = ("trace", "build", "stored")


@pytest.fixture(scope="module")
def killed_compiles(tmp_path_factory):
    """One child per stage, run at once, each SIGKILLed at its stage (and one, "none", that compiles
    to the end): stage -> (cache dir, constant, exit status, stdout, stderr)."""
    started = {}
    for stage in (*COMPILE_STAGES, "none"):
        cache_dir, c = tmp_path_factory.mktemp(f"killed_{stage}"), unique_constant()
        child = subprocess.Popen([sys.executable, "-c", KILLED_CHILD, str(cache_dir), stage, repr(c)], env=ENV,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started[stage] = (cache_dir, c, child)
    finished = {}
    for stage, (cache_dir, c, child) in started.items():
        stdout, stderr = child.communicate(timeout=300)
        finished[stage] = (cache_dir, c, child.returncode, stdout, stderr)
    return finished


@pytest.mark.parametrize("stage", COMPILE_STAGES)
def test_next_process_recovers_from_a_compile_killed_at(killed_compiles, stage):
    cache_dir, c, status, _, stderr = killed_compiles[stage]
    assert status == -signal.SIGKILL, stderr
    (left_claimed,) = claimed_keys(cache_dir)  # by the dead child
    m = run_here(cache_dir, c)
    assert m["compile_failures"] == 0 and m["blacklisted"] == 0 and m["compiled_runs"] == 1, m
    assert m["waited_for_other_process"] == 0  # the dead process's claim was taken over at once
    if stage == "stored":
        assert (m["cache_hits_disk"], m["compiles"]) == (1, 0)
    else:
        assert (m["cache_hits_disk"], m["compiles"]) == (0, 1)
    with ArtifactStore(cache_dir) as store:
        (entry,) = artifacts(store)
        assert entry["key"] == left_claimed and not store.is_claimed(left_claimed) and not store.in_memory
    assert orphans(cache_dir) == 0


def kernel_libraries(c: float) -> list[str]:
    """The built libraries of the kernels whose C++ source holds ``c``, in the backend's Inductor dir."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    sources = glob.glob(os.path.join(default_cache_dir(), "adaptive_eager", "*", "*.cpp"))
    found = []
    for source in sources:
        with open(source) as f:
            if repr(c) in f.read():
                found.append(source[: -len(".cpp")] + ".so")
    return [library for library in found if os.path.exists(library)]


def test_torn_kernel_library_is_rebuilt_not_believed(killed_compiles, tmp_path):
    """A torn .so in Inductor's build directory (from a kill before builds were atomic, a power cut)
    made every later compile of that kernel on the machine fail, and the region was replayed."""
    _, c, status, stdout, stderr = killed_compiles["none"]  # compiled by another process: not loaded here
    assert status == 0 and stdout == "survived\n", stderr
    libraries = kernel_libraries(c)
    assert libraries
    for library in libraries:
        os.truncate(library, 0)  # the state the issue found: a 0-byte .so
    m = run_here(tmp_path, c)
    assert m["compiles"] == 1 and m["compile_failures"] == 0 and m["compiled_runs"] == 1, m
    assert not any(_inductor_artifacts._torn(library) for library in libraries)


@pytest.mark.parametrize("length", [0, 1000, 30_000])
def test_torn_shared_object_is_told_from_a_whole_one(tmp_path, length):
    whole = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))[0]
    with open(whole, "rb") as f:
        (tmp_path / "torn.so").write_bytes(f.read(length))
    assert _inductor_artifacts._torn(str(tmp_path / "torn.so")) and not _inductor_artifacts._torn(whole)
    assert not _inductor_artifacts._torn(str(tmp_path / "absent.so"))


# ------------------------------------------------------------------ claims of dead processes

HOLDER = textwrap.dedent(
    """
    import sys, time
    from neff_cache import ArtifactStore
    assert ArtifactStore(sys.argv[1]).claim(sys.argv[2])
    print("claimed", flush=True)
    time.sleep(600)
    """
)


@pytest.mark.usefixtures("small_windows_off")
def test_process_waiting_on_a_claim_compiles_once_its_holder_dies(tmp_path):
    """A process that saw another's claim replayed the region for ever, even after the claim lapsed."""
    c = unique_constant()
    run_here(tmp_path / "scratch", c)
    with ArtifactStore(tmp_path / "scratch") as scratch:
        (entry,) = artifacts(scratch)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "cache"), entry["key"]], env=ENV,
                              stdout=subprocess.PIPE, text=True)
    expected, got = program(c), []
    try:
        assert holder.stdout.readline() == "claimed\n"
        new_process()
        with adaptive_eager(cache_dir=str(tmp_path / "cache"), hot_after=1, async_compile=False):
            for _ in range(2):
                got.append(program(c))
                ae.sync()
            waiting = ae.metrics()
            holder.kill()
            holder.wait(timeout=30)
            for _ in range(2):
                got.append(program(c))
                ae.sync()
    finally:
        holder.kill()
        holder.wait(timeout=30)
    for value in got:
        torch.testing.assert_close(value, expected)
    assert waiting["waited_for_other_process"] == 1 and waiting["compiles"] == 0 and waiting["replayed_regions"] == 2
    m = ae.metrics()
    assert m["compiles"] == 1 and m["compiled_runs"] == 2, m


# ------------------------------------------------------------------ remembered failures


def _failing_inductor(monkeypatch) -> list:
    """Make every Inductor compile fail; answers the list its attempts are appended to."""
    attempts = []

    def failing_compile(self, gm, example_inputs):
        attempts.append(1)
        raise inductor.BackendCompileError("inductor: cannot compile the graph: RuntimeError: simulated")

    monkeypatch.setattr(inductor.InductorBackend, "compile", failing_compile)
    return attempts


def test_failed_compile_is_not_paid_again_by_the_next_process(tmp_path, monkeypatch):
    attempts = _failing_inductor(monkeypatch)
    c = unique_constant()
    first = run_here(tmp_path, c)
    assert len(attempts) == 1 and first["compile_failures"] == 1 and first["blacklisted"] == 1
    second = run_here(tmp_path, c)  # a new process: the failure is remembered with the fingerprint
    assert len(attempts) == 1, "the next process compiled the failing region again"
    assert second["compile_failures"] == 0 and second["blacklisted"] == 1
    assert second["not_compiled"] == {"failed_before": 1}


def test_a_failure_remembered_by_another_version_of_the_library_is_not_believed(tmp_path, monkeypatch):
    """A failure is remembered under the library's own digest too (Note [Remembered failures] in
    neff_cache.store): one that a bug of ours caused lapses with the version that fixes it."""
    import fuser._library

    attempts = _failing_inductor(monkeypatch)
    c = unique_constant()
    monkeypatch.setattr(fuser._library, "_LIBRARY_DIGEST", ["an-older-version"])
    first = run_here(tmp_path, c)
    assert len(attempts) == 1 and first["compile_failures"] == 1
    monkeypatch.setattr(fuser._library, "_LIBRARY_DIGEST", [])  # this version's digest, made afresh
    second = run_here(tmp_path, c)  # a new process of a new version: it compiles again
    assert len(attempts) == 2, "a failure remembered by another version of the library was believed"
    assert second["compile_failures"] == 1 and "failed_before" not in second["not_compiled"]


def test_an_artifact_stored_by_another_version_of_the_library_is_not_loaded(tmp_path, monkeypatch):
    """An artifact is what our lowering made of a program, so it is keyed by the library's digest
    too (``fuser.compile.cache_fingerprint``): one a bug of ours made wrong is not run by the
    version that fixes it; the same version loads it."""
    import fuser._library

    c = unique_constant()
    monkeypatch.setattr(fuser._library, "_LIBRARY_DIGEST", ["an-older-version"])
    first = run_here(tmp_path, c)
    assert first["compiles"] == 1
    monkeypatch.setattr(fuser._library, "_LIBRARY_DIGEST", [])  # this version's digest, made afresh
    second = run_here(tmp_path, c)
    assert second["compiles"] == 1 and second["cache_hits_disk"] == 0, "another version's artifact was run"
    third = run_here(tmp_path, c)
    assert third["compiles"] == 0 and third["cache_hits_disk"] == 1


# ------------------------------------------------------------------ full and read-only disks


def test_disk_full_while_storing_keeps_values_and_the_next_process_stores_it(tmp_path, monkeypatch, caplog):
    import diskcache.core

    c = unique_constant()

    def disk_full(self, *args):
        raise sqlite3.OperationalError("database or disk is full")  # SQLITE_FULL, as SQLite reports it

    monkeypatch.setattr(diskcache.core.Cache, "_row_insert", disk_full)
    with caplog.at_level(logging.WARNING, logger="neff_cache"):
        m = run_here(tmp_path, c)
    assert m["compiles"] == 1 and m["compiled_runs"] == 1 and m["compile_failures"] == 0
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "disk is full" in warning and "free space" in warning
    monkeypatch.undo()
    assert artifacts(ArtifactStore(tmp_path)) == [] and orphans(tmp_path) == 0
    m = run_here(tmp_path, c)  # space again: the next process compiles and stores it
    assert m["compiles"] == 1 and len(artifacts(ArtifactStore(tmp_path))) == 1


def run_read_only(directory, argv: list[str]) -> subprocess.CompletedProcess:
    """Run ``argv`` with ``directory`` read-only. As root, chmod does not stop writes, so the child
    gets a read-only bind mount of it in a mount namespace of its own (unshare -m); otherwise the
    directory is made read-only with chmod for the child's duration."""
    if os.geteuid() == 0:
        if shutil.which("unshare") is None:
            pytest.skip("root and no unshare: cannot make a directory read-only to this user")
        mount = 'mount --bind -o ro "$0" "$0" && exec "$@"'
        argv = ["unshare", "-m", "sh", "-c", mount, str(directory), *argv]
        return subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=300)
    paths = [directory, *glob.glob(os.path.join(directory, "**"), recursive=True)]
    modes = {path: os.stat(path).st_mode for path in paths}
    for path in paths:
        os.chmod(path, modes[path] & ~0o222)
    try:
        return subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=300)
    finally:
        for path in paths:
            os.chmod(path, modes[path])


READ_ONLY_CHILD = textwrap.dedent(
    """
    import json, os, sys, torch
    import adaptive_eager as ae
    cache_dir, c = sys.argv[1], float(sys.argv[2])
    try:
        open(os.path.join(cache_dir, "probe"), "w")
        sys.exit("the cache directory is writable")
    except OSError:
        pass
    x = torch.linspace(-2, 2, 2048)
    expected = [((x * c).sin() + c).sum(), (x * c).cos().sum()]
    with ae.adaptive_eager(cache_dir=cache_dir, hot_after=1, async_compile=False):
        stored = ((x * c).sin() + c).sum()  # compiled into the cache before it became read-only
        ae.sync()
        new = (x * c).cos().sum()  # not in the cache: compiled, kept in memory
    torch.testing.assert_close([stored, new], expected)
    m = ae.metrics()
    print(json.dumps({k: m[k] for k in ("cache_hits_disk", "compiles", "compiled_runs", "compile_failures")}))
    """
)


def test_read_only_cache_is_read_and_new_compiles_stay_in_memory(tmp_path):
    """A read-only cache (baked into an image) was ignored: everything compiled again."""
    c = unique_constant()
    run_here(tmp_path, c)
    result = run_read_only(tmp_path, [sys.executable, "-c", READ_ONLY_CHILD, str(tmp_path), repr(c)])
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == {
        "cache_hits_disk": 1, "compiles": 1, "compiled_runs": 2, "compile_failures": 0}
    assert result.stderr.count("cannot be written") == 1 and "its artifacts are used" in result.stderr
    for command in ("stats", "ls"):
        listed = run_read_only(tmp_path, [sys.executable, "-m", "neff_cache", command, "--cache-dir", str(tmp_path)])
        assert listed.returncode == 0, listed.stderr
    assert "(read-only)" in run_read_only(
        tmp_path, [sys.executable, "-m", "neff_cache", "stats", "--cache-dir", str(tmp_path)]).stdout
    cleared = run_read_only(tmp_path, [sys.executable, "-m", "neff_cache", "clear", "--cache-dir", str(tmp_path)])
    assert cleared.returncode == 1 and "read-only" in cleared.stderr
    assert len(artifacts(ArtifactStore(tmp_path))) == 1


# ------------------------------------------------------------------ a program shorter than its compile

SHORT_PROGRAM = textwrap.dedent(
    """
    import json, sys, torch
    import adaptive_eager as ae
    cache_dir, c, mode = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    x = torch.linspace(-2, 2, 2**15)  # too large a window to run eagerly (Note [Small windows run eagerly])
    expected = ((x * c).sin() + c).sum().item()
    with ae.adaptive_eager(cache_dir=cache_dir, hot_after=1, async_compile=mode == "async"):
        got = [((x * c).sin() + c).sum().item() for _ in range(3)]  # a step ends with a sync
        print(ae.report())
    assert all(abs(value - expected) <= 1e-4 * abs(expected) for value in got)
    m = ae.metrics()
    print(json.dumps({k: m[k] for k in ("cache_hits_disk", "compiles", "compiled_runs")}))
    """
)


def test_compile_of_a_program_that_exits_first_lands_in_the_cache_for_the_next_run(tmp_path):
    """A program shorter than its first compile never benefited: its compile died with it."""
    c = unique_constant()
    command = [sys.executable, "-c", SHORT_PROGRAM, str(tmp_path), repr(c)]
    start = time.monotonic()
    first = subprocess.run(command + ["async"], env=ENV, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout.splitlines()[-1])["compiles"] == 0  # it exited before the compile ended
    assert "background compiles pending: 1, 1 running" in first.stdout
    assert time.monotonic() - start < 60  # exit does not wait for the compile
    with ArtifactStore(tmp_path) as store:
        deadline = time.monotonic() + 240
        while not artifacts(store) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert artifacts(store), "the compile running at exit never landed in the cache"
    second = subprocess.run(command + ["sync"], env=ENV, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout.splitlines()[-1]) == {"cache_hits_disk": 1, "compiles": 0, "compiled_runs": 3}


# ------------------------------------------------------------------ Ctrl-C during a compile

INTERRUPTED = textwrap.dedent(
    """
    import signal, sys, torch
    # Ctrl-C as at a terminal, whatever this test's own process inherited (a shell's background job
    # starts with SIGINT ignored, and so would the child, which would then never see the interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import adaptive_eager as ae
    import fuser.compile
    import fuser.regions
    from neff_cache import ArtifactStore
    torch.set_num_threads(1)
    a = torch.randn(256, 256)

    def in_torch(*args):  # a compile step holding the compile thread in ATen's C++ code
        print("compiling", flush=True)
        while True:
            torch.mm(a, a)

    mode = sys.argv[2]
    if mode == "in-process":
        fuser.compile.compile_program = in_torch
    else:  # loads of artifacts on the compile thread, while the program goes on
        ArtifactStore.get = lambda self, key, fingerprint=None: b"an artifact"
        fuser.regions._load = in_torch
    x = torch.randn(64)
    with ae.adaptive_eager(cache_dir=sys.argv[1], hot_after=1, async_compile=mode == "thread"):
        while True:
            (x.sin() * 2).sum().item()
    """
)


@pytest.mark.parametrize("mode", ["in-process", "thread"])
def test_ctrl_c_during_a_compile_exits_cleanly(tmp_path, mode):
    """The compile thread was still inside torch's C++ code at interpreter exit: the process aborted
    with "terminate called without an active exception". Three runs at once, each interrupted."""
    runs = [subprocess.Popen([sys.executable, "-c", INTERRUPTED, str(tmp_path / str(run)), mode], env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for run in range(3)]
    try:
        for child in runs:
            assert child.stdout.readline() == "compiling\n"
            child.send_signal(signal.SIGINT)
        for child in runs:
            _, stderr = child.communicate(timeout=60)
            assert "terminate called" not in stderr and child.returncode == -signal.SIGINT, stderr
            # the interrupt propagates as itself (the flush it cut adds a note after it)
            assert "\nKeyboardInterrupt\n" in stderr + "\n", stderr
    finally:
        for child in runs:
            child.kill()
            child.wait()


class _Store:
    """What ``fuser.compile._load`` asks of a store: only evictions."""

    def __init__(self):
        self.evicted = []

    def discard(self, key, problem):
        self.evicted.append((key, problem))


class _Backend:
    """A backend whose load raises ``errors`` in turn, then loads (Note [Whose fault a failed load is])."""

    def __init__(self, *errors):
        self.errors = list(errors)

    def load(self, artifact):
        if self.errors:
            raise self.errors.pop(0)
        return lambda inputs: [inputs[0] * 2]


def _deadlock():
    from importlib._bootstrap import _DeadlockError

    return _DeadlockError("deadlock detected by _ModuleLock('torch._dynamo') at 140000")


@pytest.mark.parametrize("error", [_deadlock, lambda: ImportError("cannot import name 'x' from partially "
                                                                  "initialized module 'torch._dynamo'")],
                         ids=["deadlock", "import_error"])
def test_a_load_that_meets_another_threads_import_loads_and_keeps_its_artifact(error):
    from fuser.compile import _load, _pack

    key = "a" * 64
    data = _pack(b"artifact", [], {"alone": {}, "inplace": False}, key)
    store = _Store()
    run, *_ = _load(data, _Backend(error()), store, key, False)
    assert store.evicted == []
    assert torch.equal(run([torch.ones(2)])[0], torch.full((2,), 2.0))


@pytest.mark.parametrize("error", [_deadlock, lambda: ImportError("no module"), lambda: MemoryError(),
                                   lambda: OSError(28, "No space left on device"), lambda: RuntimeError("ours")],
                         ids=["deadlock", "import_error", "memory", "disk_full", "a_bug"])
def test_a_load_error_that_is_not_the_artifacts_never_evicts_it(error):
    from fuser.compile import _load, _pack

    key = "b" * 64
    data = _pack(b"artifact", [], {"alone": {}, "inplace": False}, key)
    store = _Store()
    e = error()
    with pytest.raises(type(e)):
        _load(data, _Backend(e, e), store, key, False)  # failing on the second try too
    assert store.evicted == []


def test_an_artifact_that_does_not_decode_is_evicted():
    from fuser.backends._common import BackendCompileError
    from fuser.compile import _load, _pack

    key = "c" * 64
    store = _Store()
    with pytest.raises(BackendCompileError):
        _load(b"not an artifact", _Backend(), store, key, False)
    data = _pack(b"artifact", [], {"alone": {}, "inplace": False}, key)
    with pytest.raises(BackendCompileError):
        _load(data, _Backend(BackendCompileError("inductor: artifact is corrupt")), store, key, False)
    assert [k for k, _ in store.evicted] == [key, key]
