"""The persistent cache under attack (Note [Cache trust] in neff_cache.access).

Each test plants what another user, or anyone who can write the cache, could plant, and checks
that no stored code runs, that a cache others may write is not used, and that the program still
gets eager's values. A planted pickle's payload creates a marker file: the proof that it ran.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import shutil
import sqlite3
import stat
import subprocess
import sys
import tempfile
import textwrap
import traceback
import zipfile

import diskcache
import pytest
import torch
from _oracle import artifacts

import adaptive_eager as ae
import fuser
import fuser.regions
from fuser import partition
from adaptive_eager import adaptive_eager
from fuser.backends._common import BackendCompileError
from neff_cache import FORMAT_VERSION, ArtifactStore
from neff_cache.cli import main as cli

ROOT = os.geteuid() == 0
NOBODY = 65534
needs_root = pytest.mark.skipif(not ROOT, reason="a second uid needs root (os.setuid in a forked child)")
SYNC = dict(backend="inductor", hot_after=1, async_compile=False)
KEY = "ab" * 16
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

X = torch.randn(64)


def wide():
    return (X * 3).sin() + 1  # shape (64,)


def narrow():
    return ((X * 2).cos() - 1).sum()  # shape ()


class Payload:
    """Unpickling it creates ``path`` (``padding`` makes the pickle large enough for a file of its own)."""

    def __init__(self, path, padding: int = 0):
        self.path, self.padding = str(path), padding

    def __reduce__(self):
        return exec, (f"open({self.path!r}, 'w').close()\n#" + "x" * self.padding,)


def forget_regions():
    """A new process's view: no compiled region in memory, no store open (metrics() counts theirs)."""
    fuser.cache_clear(store_handles=True)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def modes(root) -> dict[str, int]:
    return {os.path.relpath(os.path.join(d, n), root): stat.S_IMODE(os.lstat(os.path.join(d, n)).st_mode)
            for d, dirs, files in os.walk(root) for n in dirs + files}


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A cache holding the artifacts of ``wide`` and ``narrow``: {"dir", "wide", "narrow", "fingerprint"}."""
    directory = tmp_path_factory.mktemp("template") / "cache"
    forget_regions()
    keys = {}
    for program in (wide, narrow):
        before = {e["key"] for e in artifacts(ArtifactStore(directory))}
        with adaptive_eager(**SYNC, cache_dir=str(directory)):
            kept = program()  # noqa: F841 - a value nobody keeps is dead: nothing would compile
        (keys[program.__name__],) = {e["key"] for e in artifacts(ArtifactStore(directory))} - before
    (fingerprint,) = {e["fingerprint"] for e in artifacts(ArtifactStore(directory))}
    forget_regions()
    return {"dir": directory, "fingerprint": fingerprint, **keys}


@pytest.fixture
def cache(template, tmp_path):
    """A copy of the template cache, seen by a new process."""
    forget_regions()
    copy = tmp_path / "cache"
    shutil.copytree(template["dir"], copy, symlinks=True)
    return copy


def plant(directory, key: str, data: bytes, fingerprint: str) -> None:
    """Store ``data`` as the artifact of ``key``: whoever can write the cache can recompute the checksum."""
    with ArtifactStore(directory) as store:
        store.put(key, data, fingerprint=fingerprint, backend="inductor", compile_seconds=0.0)


def artifact(directory, key: str) -> bytes:
    with ArtifactStore(directory) as store:
        return store.get(key)


def run_checked(program, directory, **options):
    """``program`` under adaptive eager with ``directory`` as the cache; asserts eager's value."""
    with adaptive_eager(**SYNC, cache_dir=str(directory), **options):
        got = program()
    want = program()
    assert got.shape == want.shape and got.stride() == want.stride()
    torch.testing.assert_close(got, want)
    return ae.metrics()


# ---------------------------------------------------------------------------------- pickles


def test_a_planted_pickle_artifact_never_runs_and_is_evicted(cache, template, tmp_path, caplog):
    marker = tmp_path / "pickle-ran"
    plant(cache, template["wide"], pickle.dumps(Payload(marker)), template["fingerprint"])
    with caplog.at_level(logging.WARNING):
        m = run_checked(wide, cache)
    assert not marker.exists()
    assert m["corrupt_entries"] == 1 and m["cache_hits_disk"] == 0 and m["replayed_regions"] >= 1
    assert not ArtifactStore(cache).contains(template["wide"])
    assert any("not an adaptive eager artifact" in w for w in warnings_of(caplog))


def test_planted_pickles_in_control_never_run(tmp_path, caplog):
    directory = tmp_path / "cache"
    with ArtifactStore(directory) as store:
        store.put(KEY, b"artifact", fingerprint="fp", backend="inductor", compile_seconds=0.0)
        store.put(KEY[::-1], b"another", fingerprint="fp", backend="inductor", compile_seconds=0.0)
    markers = [tmp_path / f"ran-{i}" for i in range(3)]
    planted = {
        "count/evictions": Payload(markers[0]),  # a pickle inside SQLite
        "count/corrupt_entries": Payload(markers[1], padding=40_000),  # a pickle in a file of its own
        f"claim/v{FORMAT_VERSION}/{KEY}": Payload(markers[2]),
    }
    with diskcache.Cache(str(directory / "control")) as raw:  # diskcache pickles what it is given
        for key, value in planted.items():
            raw.set(key, value, expire=600 if key.startswith("claim") else None)
    with caplog.at_level(logging.WARNING, logger="neff_cache"):
        with ArtifactStore(directory) as store:
            stats = store.stats()
            assert not store.is_claimed(KEY)  # the foreign claim is dropped, not believed
            store.release(KEY)
            store.get(KEY[::-1], fingerprint="other")  # counts an incompatible entry
        assert cli(["stats", "--cache-dir", str(directory)]) == 0
    assert not any(marker.exists() for marker in markers)
    assert stats["evictions"] == 0 and stats["corrupt_entries"] == 0 and not stats["in_memory"]
    with diskcache.Cache(str(directory / "control")) as raw:
        assert not any(key in raw for key in planted)
    assert ArtifactStore(directory).stats()["incompatible_entries"] == 1
    assert sum("foreign value" in w for w in warnings_of(caplog)) == 3


def test_nothing_is_stored_that_diskcache_would_pickle(tmp_path):
    with ArtifactStore(tmp_path / "cache") as store:
        for cache in (store._backend._artifacts, store._backend._control):
            for value in ({"a": 1}, 2**70, "x" * 40_000):
                with pytest.raises(TypeError, match="neff_cache stores"):
                    cache.set("count/x", value)
    assert not [name for name in modes(tmp_path / "cache") if name.endswith(".val")]  # nor a text file


def test_a_pickled_key_is_never_read_and_never_stops_eviction(tmp_path):
    # A row keyed by a pickle (diskcache pickles keys that are not str, bytes or numbers) is the
    # least recently used: eviction must neither unpickle it nor spin on it forever.
    directory, marker = tmp_path / "cache", tmp_path / "key-ran"
    ArtifactStore(directory, size_limit_mb=1).close()
    with diskcache.Cache(str(directory)) as raw:
        raw.set(Payload(marker), b"planted")
    script = textwrap.dedent(f"""
        import os
        from neff_cache import ArtifactStore
        store = ArtifactStore({str(directory)!r}, size_limit_mb=1)
        for key in ("aa" * 16, "bb" * 16):
            store.put(key, os.urandom(600_000), fingerprint="fp", backend="b", compile_seconds=0)
        print(store.evictions, store.get("bb" * 16) is not None)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "True"]
    assert not marker.exists()


# -------------------------------------------------------------------------- who may write


@pytest.mark.parametrize("where, mode", [
    ("", 0o777), ("", 0o770), ("", 0o702), ("control", 0o775), ("cache.db", 0o666), ("control/cache.db", 0o664),
], ids=lambda x: (x or "directory") if isinstance(x, str) else oct(x))
def test_a_cache_others_may_write_is_not_used(tmp_path, where, mode, caplog):
    directory = tmp_path / "cache"
    with ArtifactStore(directory) as store:
        store.put(KEY, b"artifact", fingerprint="fp", backend="inductor", compile_seconds=0.0)
    os.chmod(directory / where, mode)
    with caplog.at_level(logging.WARNING, logger="neff_cache"):
        store = ArtifactStore(directory)
    assert store.in_memory and store.get(KEY) is None
    (warning,) = warnings_of(caplog)
    assert str(directory / where).rstrip("/") in warning and "writable by" in warning and "chmod" in warning
    if mode & stat.S_IWGRP and not mode & stat.S_IWOTH:
        assert "NEURON_EAGER_CACHE_SHARED=group" in warning


def test_a_planted_artifact_in_a_world_writable_cache_never_runs(cache, template, tmp_path):
    marker = tmp_path / "pickle-ran"
    plant(cache, template["wide"], pickle.dumps(Payload(marker)), template["fingerprint"])
    os.chmod(cache, 0o777)
    run_checked(wide, cache)
    assert not marker.exists()
    assert "in memory: the directory is not usable" in ae.report()


def test_files_are_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        with ArtifactStore(tmp_path / "made" / "for" / "cache") as store:
            store.put(KEY, os.urandom(100_000), fingerprint="fp", backend="b", compile_seconds=0)  # a value file
            store.put(KEY[::-1], b"inline", fingerprint="fp", backend="b", compile_seconds=0)
            store.claim("cd" * 16)
            store.release("cd" * 16)
    finally:
        os.umask(old)
    found = modes(tmp_path / "made")
    assert len([name for name in found if name.endswith(".val")]) == 1 and "for/cache/control/cache.db" in found
    for name, mode in found.items():
        is_dir = os.path.isdir(tmp_path / "made" / name)
        assert mode == (0o700 if is_dir else 0o600), (name, oct(mode))


def test_a_group_shared_cache_is_used_with_group_modes(tmp_path, monkeypatch, caplog):
    directory = tmp_path / "team-cache"
    directory.mkdir()
    os.chmod(directory, 0o2770)
    with caplog.at_level(logging.WARNING, logger="neff_cache"):
        assert ArtifactStore(directory).in_memory  # not shared by default: group write is refused
    assert "NEURON_EAGER_CACHE_SHARED=group" in warnings_of(caplog)[0]
    old = os.umask(0o077)
    try:
        with ArtifactStore(directory, shared="group") as store:
            assert not store.in_memory
            store.put(KEY, os.urandom(100_000), fingerprint="fp", backend="b", compile_seconds=0)
            assert store.get(KEY) is not None
    finally:
        os.umask(old)
    gid = os.stat(directory).st_gid
    for name, mode in modes(directory).items():
        st = os.stat(directory / name)
        assert st.st_gid == gid and mode == (0o2770 if stat.S_ISDIR(st.st_mode) else 0o660), (name, oct(mode))
    os.chmod(directory, 0o770)  # without the setgid bit, members' files would not get the group
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="neff_cache"):
        assert ArtifactStore(directory, shared="group").in_memory
    assert f"chmod g+s {directory}" in warnings_of(caplog)[0]
    assert cli(["stats", "--cache-dir", str(directory)]) == 1  # the CLI refuses it too, unless told
    monkeypatch.setenv("NEURON_EAGER_CACHE_SHARED", "group")
    os.chmod(directory, 0o2770)
    assert cli(["stats", "--cache-dir", str(directory)]) == 0
    assert ae.load_options({"NEURON_EAGER_CACHE_SHARED": "group"}, device="cpu").cache_shared == "group"
    with pytest.raises(ae.ConfigError, match="NEURON_EAGER_CACHE_SHARED"):
        ae.load_options({"NEURON_EAGER_CACHE_SHARED": "yes"}, device="cpu")


def test_programs_share_a_group_cache(tmp_path):
    forget_regions()
    directory = tmp_path / "team-cache"
    directory.mkdir()
    os.chmod(directory, 0o2770)
    assert run_checked(wide, directory, cache_shared="group")["compiles"] == 1
    forget_regions()
    ae.reset_metrics()
    m = run_checked(wide, directory, cache_shared="group")
    assert m["compiles"] == 0 and m["cache_hits_disk"] == 1


# ---------------------------------------------------------------------------- symbolic links


def test_a_symlinked_cache_directory_is_not_used(cache, template, tmp_path, caplog):
    marker = tmp_path / "pickle-ran"
    plant(cache, template["wide"], pickle.dumps(Payload(marker)), template["fingerprint"])
    link = tmp_path / "link"
    link.symlink_to(cache, target_is_directory=True)
    with caplog.at_level(logging.WARNING, logger="neff_cache"):
        run_checked(wide, link)
    assert not marker.exists()
    assert any("symbolic link" in w and str(cache) in w for w in warnings_of(caplog))


def _value_file(directory, key: str) -> str:
    db = sqlite3.connect(os.path.join(directory, "cache.db"))
    try:
        ((name,),) = db.execute("SELECT filename FROM Cache WHERE key = ?", (f"v{FORMAT_VERSION}/{key}",)).fetchall()
    finally:
        db.close()
    return name


@pytest.mark.parametrize("link", ["value file", "value directory"])
def test_a_symlink_inside_the_cache_is_never_followed(tmp_path, link, caplog):
    directory, outside = tmp_path / "cache", tmp_path / "outside"
    data = os.urandom(100_000)
    with ArtifactStore(directory) as store:
        store.put(KEY, data, fingerprint="fp", backend="b", compile_seconds=0)
    name = _value_file(directory, KEY)
    if link == "value file":  # the same bytes, so only the link itself can make the read fail
        outside.write_bytes(data)
        os.remove(directory / name)
        os.symlink(outside, directory / name)
        kept = outside
    else:
        first = name.split("/")[0]
        shutil.move(directory / first, outside)
        os.symlink(outside, directory / first, target_is_directory=True)
        kept = outside / os.path.relpath(name, first)
    with caplog.at_level(logging.WARNING, logger="neff_cache"):
        with ArtifactStore(directory) as store:
            assert store.get(KEY) is None
            assert store.corrupt_entries == 1 and not store.contains(KEY)
    assert kept.read_bytes() == data  # evicting the entry deleted nothing outside the cache


@pytest.mark.parametrize("where", ["control", "cache.db", "control/cache.db"])
def test_a_symlinked_part_of_the_cache_is_not_used(tmp_path, where, caplog):
    directory, outside = tmp_path / "cache", tmp_path / "outside"
    ArtifactStore(directory).close()
    shutil.move(directory / where, outside)
    os.symlink(outside, directory / where)
    with caplog.at_level(logging.WARNING, logger="neff_cache"):
        assert ArtifactStore(directory).in_memory
    assert "symbolic link" in warnings_of(caplog)[0]


def test_a_planted_row_naming_a_file_outside_is_neither_read_nor_deleted(tmp_path):
    directory, victim = tmp_path / "cache", tmp_path / "precious"
    victim.write_bytes(b"the user's file")
    with ArtifactStore(directory) as store:
        store.put(KEY, os.urandom(100_000), fingerprint="fp", backend="b", compile_seconds=0)
    db = sqlite3.connect(directory / "cache.db")
    with db:
        db.execute("UPDATE Cache SET filename = ? WHERE key = ?", (str(victim), f"v{FORMAT_VERSION}/{KEY}"))
    db.close()
    with ArtifactStore(directory) as store:
        assert store.get(KEY) is None and store.corrupt_entries == 1
    assert victim.read_bytes() == b"the user's file"


# ------------------------------------------------------------------- edited, checksum recomputed


@pytest.mark.parametrize("edit", ["truncated", "another region's", "another region's, header rewritten"])
def test_an_edited_artifact_is_evicted_and_replayed(cache, template, edit, caplog):
    other = artifact(cache, template["narrow"])
    if edit == "truncated":
        data = artifact(cache, template["wide"])[:-100]
    elif edit == "another region's":
        data = other
    else:  # everything right but the graph: caught at its first run, before anything is written
        from fuser.backends._common import pack_sections, unpack_sections

        header, sections = unpack_sections(other, "test")
        data = pack_sections({**header, "key": template["wide"]}, sections)
    plant(cache, template["wide"], data, template["fingerprint"])
    with caplog.at_level(logging.WARNING):
        m = run_checked(wide, cache)
    assert m["corrupt_entries"] == 1 and m["blacklisted"] == 1
    assert not ArtifactStore(cache).contains(template["wide"])
    assert any("evicted corrupt artifact" in w for w in warnings_of(caplog))


def _writes_rows(p: torch.Tensor) -> torch.Tensor:
    p.mul_(0.5).add_(1)  # compiled in place: the kernels write ``p`` (Note [In-place regions])
    return (p * 2).sum(1)  # shape (8,)


def _writes_columns(p: torch.Tensor) -> torch.Tensor:
    p.mul_(0.5).add_(1)
    return (p * 2).sum(0)  # shape (4,)


@pytest.mark.usefixtures("small_windows_off")
def test_an_edited_in_place_artifact_writes_nothing_before_its_check(tmp_path, fresh_regions):
    """Note [Artifacts from disk]: the first run of an artifact from disk is checked before anything
    is written, also when its kernels write the window's inputs in place: a mismatch replays the
    window, and the replay must not apply the update a second time."""
    directory, p0 = tmp_path / "cache", torch.randn(8, 4)
    keys = {}
    for program in (_writes_rows, _writes_columns):
        before, p = {e["key"] for e in artifacts(ArtifactStore(directory))}, p0.clone()  # a real input
        with adaptive_eager(**SYNC, cache_dir=str(directory)):
            kept = program(p)  # noqa: F841 - a value nobody keeps is dead: nothing would compile
        (keys[program],) = {e["key"] for e in artifacts(ArtifactStore(directory))} - before
    assert all(e.inplace for e in fuser.regions.CACHE.entries.values() if e.run is not None)
    from fuser.backends._common import pack_sections, unpack_sections

    header, sections = unpack_sections(artifact(directory, keys[_writes_columns]), "test")
    (fingerprint,) = {e["fingerprint"] for e in artifacts(ArtifactStore(directory))}
    plant(directory, keys[_writes_rows], pack_sections({**header, "key": keys[_writes_rows]}, sections), fingerprint)
    forget_regions()
    got, want = p0.clone(), p0.clone()
    with adaptive_eager(**SYNC, cache_dir=str(directory)):
        out = _writes_rows(got)
    torch.testing.assert_close(out, _writes_rows(want))
    torch.testing.assert_close(got, want)  # updated once
    m = ae.metrics()
    assert m["corrupt_entries"] == 1 and m["blacklisted"] == 1


def test_malformed_graphs_are_refused_at_load():
    from fuser.backends import get_backend

    replay = get_backend("replay", "cpu")
    doc = {"format": 1, "fingerprint": replay.fingerprint(), "inputs": 1,
           "nodes": [{"op": "aten.sin.default", "args": {"$tuple": [{"$n": -1}]}, "kwargs": {}}], "outputs": [{"$n": 1}]}
    with pytest.raises(BackendCompileError, match="names value -1"):
        replay.load(json.dumps(doc).encode())  # a negative index would wrap to another value
    doc["nodes"][0]["args"] = [{"$n": 0}]  # a list where FX wants a tuple: FX's assert, as a load error
    with pytest.raises(BackendCompileError, match="malformed"):
        replay.load(json.dumps(doc).encode())
    from fuser.backends._common import pack_sections
    malformed = [b"", pickle.dumps({"plan": "{}", "parts": []}), b"adaptive-eager artifact\n" + b"\xff" * 8,
                 pack_sections({"plan": []}, [b"x"])[:-1], pack_sections({"plan": []}, [])]
    for artifact_bytes in malformed:
        with pytest.raises(BackendCompileError, match="split"):
            partition.load(artifact_bytes, replay)


def test_an_inductor_manifest_cannot_name_a_path_outside_tritons_cache():
    from fuser.backends import _inductor_artifacts

    buffer = io.BytesIO()
    manifest = {"format": 1, "fingerprint": "fp", "inputs_to_check": [], "cpp_kernels": {}, "triton_device": 0,
                "triton_files": ["triton/../escaped"], "guards": None, "written": [], "relayout": []}
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr("manifest.json", json.dumps(manifest))
        z.writestr("wrapper.py", "")
        z.writestr("triton/../escaped", "planted")
    with pytest.raises(BackendCompileError, match="triton_files"):
        _inductor_artifacts._unpack(buffer.getvalue())


def test_tritons_cache_must_be_private_to_restore_kernels_into(tmp_path, monkeypatch):
    from fuser.backends._inductor_artifacts import _restore_triton

    base = tmp_path / "triton"
    base.mkdir()
    os.chmod(base, 0o777)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(base))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    with pytest.raises(BackendCompileError, match="writable by every user"):
        _restore_triton(0, {"triton/KERNEL/k.cubin": b"binary"})
    assert list(base.iterdir()) == []


def test_bundled_kernels_are_loaded_from_a_private_directory(cache, template, monkeypatch):
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    seen = []
    real = CppPythonBindingsCodeCache._load_library.__func__

    def spy(cls, path, key):
        st = os.stat(os.path.dirname(path))
        seen.append((stat.S_IMODE(st.st_mode), st.st_uid, os.path.dirname(os.path.dirname(path))))
        return real(cls, path, key)

    monkeypatch.setattr(CppPythonBindingsCodeCache, "_load_library", classmethod(spy))
    assert run_checked(wide, cache)["cache_hits_disk"] == 1
    assert seen and all(s == (0o700, os.geteuid(), tempfile.gettempdir()) for s in seen), seen


# ------------------------------------------------------------------------- another user (uid)


@pytest.fixture
def world_dir():
    """A directory like /tmp: every user may create entries (sticky), and reach it."""
    directory = tempfile.mkdtemp(prefix="ae_world_", dir="/tmp")
    os.chmod(directory, 0o1777)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def as_nobody(function, *args) -> int:
    """Run ``function(*args)`` in a forked child as uid and gid nobody; its result is the exit status."""
    pid = os.fork()
    if pid == 0:
        status = 99
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            status = function(*args)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _try_to_write(paths: list[str]) -> int:
    """How many of ``paths`` this process could create or write (0 is what the cache must allow)."""
    wrote = 0
    for path in paths:
        try:
            with open(path, "ab") as file:
                file.write(b"planted")
            wrote += 1
        except PermissionError:
            pass
    return wrote


@needs_root
def test_another_user_cannot_write_a_private_cache_whatever_the_umask(world_dir):
    directory = os.path.join(world_dir, "cache")
    old = os.umask(0)
    try:
        with ArtifactStore(directory) as store:
            store.put(KEY, os.urandom(100_000), fingerprint="fp", backend="b", compile_seconds=0)
    finally:
        os.umask(old)
    value = os.path.join(directory, _value_file(directory, KEY))
    targets = [os.path.join(directory, "planted"), os.path.join(os.path.dirname(value), "planted.val"), value,
               os.path.join(directory, "cache.db"), os.path.join(directory, "control", "cache.db")]
    assert as_nobody(_try_to_write, targets) == 0
    with ArtifactStore(directory) as store:
        assert store.get(KEY) is not None


@needs_root
@pytest.mark.parametrize("shared", ["no", "group"])
def test_a_value_file_someone_else_may_write_is_not_read(tmp_path, shared):
    directory = tmp_path / "cache"
    directory.mkdir()
    os.chmod(directory, 0o2770 if shared == "group" else 0o700)
    options = {"shared": shared} if shared == "group" else {}
    with ArtifactStore(directory, **options) as store:
        store.put(KEY, os.urandom(100_000), fingerprint="fp", backend="b", compile_seconds=0)
    value = directory / _value_file(directory, KEY)
    if shared == "group":
        os.chown(value, -1, NOBODY)  # group-writable, but for another group than the directory's
    else:
        os.chown(value, NOBODY, -1)  # another user's file, in our directory
    with ArtifactStore(directory, **options) as store:
        assert store.get(KEY) is None and store.corrupt_entries == 1


def _plant_as_attacker(directory: str, key: str, fingerprint: str, marker: str) -> int:
    with ArtifactStore(directory) as store:
        store.put(key, pickle.dumps(Payload(marker)), fingerprint=fingerprint, backend="inductor", compile_seconds=0)
    os.chmod(directory, 0o755)  # readable, as a cache left for others to use would be
    return 0


@needs_root
def test_a_cache_another_user_made_is_not_used(template, world_dir, tmp_path, caplog):
    forget_regions()
    directory, marker = os.path.join(world_dir, "cache"), str(tmp_path / "pickle-ran")
    assert as_nobody(_plant_as_attacker, directory, template["wide"], template["fingerprint"], marker) == 0
    with caplog.at_level(logging.WARNING, logger="neff_cache"):
        run_checked(wide, directory)
    assert not os.path.exists(marker)
    assert any("owned by nobody (uid 65534)" in w for w in warnings_of(caplog))


def _make_world_writable(path: str) -> int:
    os.makedirs(path)
    os.chmod(path, 0o777)
    return 0


@pytest.mark.parametrize("made_by", ["this user, writable by all", pytest.param("another user", marks=needs_root)])
def test_an_inductor_build_directory_others_can_write_is_not_used(world_dir, monkeypatch, made_by, caplog):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from fuser.backends import _inductor_artifacts

    monkeypatch.setattr(tempfile, "tempdir", world_dir)  # Inductor's default: <tempdir>/torchinductor_$USER
    monkeypatch.setattr(_inductor_artifacts, "_stand_in_build_dirs", {})
    planted = default_cache_dir()
    assert planted.startswith(world_dir)
    if made_by == "another user":
        assert as_nobody(_make_world_writable, planted) == 0
    else:
        _make_world_writable(planted)
    with caplog.at_level(logging.WARNING):
        built_in = _inductor_artifacts._build_dir(planted, "adaptive_eager")
        assert _inductor_artifacts._build_dir(planted, "adaptive_eager") == built_in  # one stand-in per process
    assert not built_in.startswith(planted)
    st = os.stat(built_in)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    (warning,) = [w for w in warnings_of(caplog) if "not building kernels" in w]
    assert planted in warning and ("owned by nobody" in warning if made_by == "another user" else "writable" in warning)
    assert os.listdir(planted) == []
