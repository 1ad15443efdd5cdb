"""neff_cache: the persistent artifact store, cross-process claims, compile workers and the CLI."""

from __future__ import annotations

import errno
import json
import logging
import multiprocessing
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import textwrap
import threading
import time

import diskcache
import diskcache.core
import pytest
from _oracle import CACHE_ENV, program_env
from hypothesis import given, settings
from hypothesis import strategies as st

from neff_cache import FORMAT_VERSION, ArtifactStore, CompileJobs

# The helpers module is imported by name in worker processes, which get this process's sys.path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_neff_cache_helpers as helpers  # noqa: E402

KEY_A, KEY_B, KEY_C, KEY_D = (f"{digit}" * 32 for digit in "abcd")
FN = helpers.__name__ + ":"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def put(store: ArtifactStore, key: str, data: bytes, fingerprint="fp", backend="inductor") -> None:
    store.put(key, data, fingerprint=fingerprint, backend=backend, compile_seconds=1.25)


def warnings_of(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]


def cache_sql(directory, statement: str, *args) -> list[tuple]:
    """Run one statement on the cache's SQLite index directly, as a damaged disk or a clock would."""
    database = sqlite3.connect(os.path.join(directory, "cache.db"))
    try:
        with database:
            return database.execute(statement, args).fetchall()
    finally:
        database.close()


def backdate(directory, key: str, seconds: float) -> None:
    """Make the entry look created and last used ``seconds`` ago."""
    cache_sql(
        directory,
        "UPDATE Cache SET access_time = access_time - ?, store_time = store_time - ? WHERE key = ?",
        seconds,
        seconds,
        f"v{FORMAT_VERSION}/{key}",
    )


def value_file(directory, key: str) -> str:
    ((filename,),) = cache_sql(directory, "SELECT filename FROM Cache WHERE key = ?", f"v{FORMAT_VERSION}/{key}")
    return os.path.join(directory, filename)


@pytest.fixture
def store(tmp_path):
    with ArtifactStore(tmp_path / "cache") as opened:
        yield opened


# ------------------------------------------------------------------------------------- store


@pytest.mark.parametrize("size", [100, 200_000], ids=["inline-in-sqlite", "own-file"])
def test_put_get_round_trip_with_metadata(tmp_path, size):
    data = os.urandom(size)
    with ArtifactStore(tmp_path) as writer:
        put(writer, KEY_A, data)
    with ArtifactStore(tmp_path) as reader:  # a fresh instance, as another process would open it
        assert reader.get(KEY_B) is None
        assert reader.get(KEY_A, fingerprint="fp") == data
        assert reader.get(KEY_A) == data
        (entry,) = reader.entries()
        stats = reader.stats()
    assert entry["key"] == KEY_A and entry["format_version"] == FORMAT_VERSION
    assert (entry["backend"], entry["fingerprint"]) == ("inductor", "fp")
    assert (entry["size"], entry["hits"]) == (size, 2)
    assert entry["compile_seconds"] == 1.25 and len(entry["checksum"]) == 32
    assert entry["created"] <= entry["last_used"] <= time.time()
    assert stats["entries"] == 1 and stats["bytes"] == size and stats["hits"] == 2
    assert stats["backends"] == {"inductor": {"entries": 1, "bytes": size, "hits": 2}}
    assert stats["oldest"] == stats["newest"] == entry["created"]
    assert not stats["in_memory"]


def test_put_replaces_and_validates_input(store):
    put(store, KEY_A, b"old")
    put(store, KEY_A, b"new", backend="neuron")
    assert store.get(KEY_A) == b"new"
    assert [entry["backend"] for entry in store.entries()] == ["neuron"]
    with pytest.raises(ValueError, match="hex digest"):
        store.get("../etc/passwd")
    with pytest.raises(ValueError, match="hex digest"):
        put(store, "ABCDEF0123456789", b"x")
    with pytest.raises(TypeError, match="must be bytes"):
        store.put(KEY_A, "text", fingerprint="fp", backend="b", compile_seconds=0)


def test_format_version_bump_never_reads_old_entries(tmp_path):
    with ArtifactStore(tmp_path, format_version=1) as old:
        put(old, KEY_A, b"format one")
    with ArtifactStore(tmp_path, format_version=2) as new:
        assert new.get(KEY_A) is None
        assert not new.contains(KEY_A)
        assert [(entry["key"], entry["format_version"]) for entry in new.entries()] == [(KEY_A, 1)]
    with ArtifactStore(tmp_path, format_version=1) as old:
        assert old.get(KEY_A) == b"format one"


def test_corrupt_value_files_are_evicted_counted_and_warned_once(tmp_path, caplog):
    with ArtifactStore(tmp_path) as store:
        for key in (KEY_A, KEY_B, KEY_C):
            put(store, key, os.urandom(100_000))
        flipped = value_file(tmp_path, KEY_A)
        with open(flipped, "r+b") as file:
            file.seek(5000)
            byte = file.read(1)
            file.seek(5000)
            file.write(bytes([byte[0] ^ 0xFF]))
        with open(value_file(tmp_path, KEY_B), "r+b") as file:
            file.truncate(1000)
        os.remove(value_file(tmp_path, KEY_C))

        with caplog.at_level(logging.DEBUG, logger="neff_cache"):
            assert [store.get(key) for key in (KEY_A, KEY_B, KEY_C)] == [None, None, None]
        assert store.corrupt_entries == 3 and store.incompatible_entries == 0
        assert store.entries() == []
        assert not os.path.exists(flipped)
        (warning,) = warnings_of(caplog)
        assert "corrupt" in warning and KEY_A in warning and "checksum mismatch" in warning
        debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
        assert any("truncated: 1000 of 100000 bytes" in m for m in debug)
        assert any("missing or unreadable" in m for m in debug)
    with ArtifactStore(tmp_path) as other_process:  # the count is persistent, for the CLI
        assert other_process.stats()["corrupt_entries"] == 3


@pytest.mark.parametrize("damage", ["other-bytes", "metadata-not-json", "metadata-missing"])
def test_damaged_inline_entries_are_evicted(tmp_path, damage, caplog):
    with ArtifactStore(tmp_path) as store:
        put(store, KEY_A, b"small artifact kept inside sqlite")
        stored_key = f"v{FORMAT_VERSION}/{KEY_A}"
        with diskcache.Cache(str(tmp_path)) as raw:
            _, tag = raw.get(stored_key, tag=True)
            if damage == "other-bytes":
                raw.set(stored_key, b"small artifact kept inside sqlitE", tag=tag)
            elif damage == "metadata-not-json":
                raw.set(stored_key, b"small artifact kept inside sqlite", tag="{not json")
            else:
                raw.set(stored_key, b"small artifact kept inside sqlite")
        with caplog.at_level(logging.WARNING, logger="neff_cache"):
            assert store.get(KEY_A) is None
        assert store.corrupt_entries == 1
        assert not store.contains(KEY_A)
        assert len(warnings_of(caplog)) == 1


def test_fingerprint_mismatch_is_evicted_and_counted(store, caplog):
    put(store, KEY_A, b"compiled by compiler 1.0", fingerprint="compiler-1.0")
    put(store, KEY_B, b"also by 1.0", fingerprint="compiler-1.0")
    with caplog.at_level(logging.WARNING, logger="neff_cache"):
        assert store.get(KEY_A, fingerprint="compiler-2.0") is None
        assert store.get(KEY_B, fingerprint="compiler-2.0") is None
    assert store.incompatible_entries == 2 and store.corrupt_entries == 0
    assert not store.contains(KEY_A) and not store.contains(KEY_B)
    (warning,) = warnings_of(caplog)
    assert "incompatible" in warning and "compiler-1.0" in warning and "compiler-2.0" in warning
    assert store.stats()["incompatible_entries"] == 2


def test_lru_eviction_keeps_the_most_recently_used(tmp_path, caplog):
    artifact_size = 300 * 1024
    with ArtifactStore(tmp_path, size_limit_mb=1) as store:
        for key in (KEY_A, KEY_B, KEY_C):
            put(store, key, os.urandom(artifact_size))
        assert store.evictions == 0
        assert store.get(KEY_A) is not None  # A is now more recent than B
        with caplog.at_level(logging.INFO, logger="neff_cache"):
            put(store, KEY_D, os.urandom(artifact_size))
        kept = {key for key in (KEY_A, KEY_B, KEY_C, KEY_D) if store.contains(key)}
        assert kept == {KEY_A, KEY_C, KEY_D}
        assert store.evictions == 1 and store.stats()["evictions"] == 1
        assert any("evicted 1 least-recently-used" in m for m in (r.getMessage() for r in caplog.records))


def test_prune_by_age_and_size_and_clear(tmp_path):
    with ArtifactStore(tmp_path) as store:
        for key in (KEY_A, KEY_B, KEY_C, KEY_D):
            put(store, key, os.urandom(100_000))
        backdate(tmp_path, KEY_A, 3 * 86400)
        backdate(tmp_path, KEY_B, 2 * 86400)
        removed = store.prune(older_than_s=2.5 * 86400)
        assert [entry["key"] for entry in removed] == [KEY_A]
        store.get(KEY_C)  # C becomes the most recently used, D the least after B
        removed = store.prune(max_size_mb=150_000 / 2**20)
        assert [entry["key"] for entry in removed] == [KEY_B, KEY_D]
        assert [entry["key"] for entry in store.clear()] == [KEY_C]
        assert store.entries() == [] and store.clear() == []
        with pytest.raises(ValueError, match="max_size_mb and/or older_than_s"):
            store.prune()


@given(
    operations=st.lists(
        st.tuples(
            st.sampled_from(["put", "get", "prune-all"]), st.sampled_from([KEY_A, KEY_B, KEY_C]), st.binary()
        ),
        max_size=12,
    )
)
@settings(max_examples=15, deadline=None)
def test_store_behaves_like_a_dict(tmp_path_factory, operations):
    model: dict[str, bytes] = {}
    with ArtifactStore(tmp_path_factory.mktemp("model")) as store:
        for operation, key, data in operations:
            if operation == "put":
                put(store, key, data)
                model[key] = data
            elif operation == "get":
                assert store.get(key, fingerprint="fp") == model.get(key)
            else:
                store.prune(older_than_s=0)
                model.clear()
        listed = {entry["key"]: entry["size"] for entry in store.entries()}
        assert listed == {key: len(data) for key, data in model.items()}


def test_hot_read_of_a_1mb_artifact_is_cheap(store):
    data = os.urandom(2**20)
    put(store, KEY_A, data)
    timings = []
    for _ in range(30):
        start = time.perf_counter()
        assert store.get(KEY_A, fingerprint="fp") is not None
        timings.append(time.perf_counter() - start)
    # Measured ~0.25 ms on the 2-core CI machine (file read ~0.1 ms); 5 ms leaves room for a busy box
    # but catches a lock held across the read, an fsync per read or a scan of the table.
    assert statistics.median(timings) < 0.005


# ------------------------------------------------------------------------------- degrading


def test_unusable_directory_degrades_to_memory_with_one_warning(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("a file where the cache directory should be")
    with caplog.at_level(logging.WARNING, logger="neff_cache"):
        store = ArtifactStore(blocker / "cache", size_limit_mb=1)
        put(store, KEY_A, b"kept in memory")
        assert store.get(KEY_A) == b"kept in memory"
        for key in (KEY_B, KEY_C, KEY_D):  # the memory store is size-bounded too
            put(store, key, os.urandom(400 * 1024))
        assert store.claim(KEY_A + "00") and not store.claim(KEY_A + "00")
    assert store.in_memory and store.stats()["in_memory"]
    assert not store.contains(KEY_A) and not store.contains(KEY_B) and store.evictions == 2
    (warning,) = warnings_of(caplog)
    assert str(blocker / "cache") in warning and "NEURON_EAGER_CACHE_DIR" in warning and "writable" in warning


def test_damaged_database_degrades_with_a_fix_that_names_it(tmp_path, caplog):
    (tmp_path / "cache.db").write_bytes(b"this is not an SQLite database" * 200)
    with caplog.at_level(logging.WARNING, logger="neff_cache"):
        store = ArtifactStore(tmp_path)
    assert store.in_memory
    (warning,) = warnings_of(caplog)
    assert "file is not a database" in warning and f"the index {tmp_path / 'cache.db'} is damaged" in warning
    assert f"python -m neff_cache repair --cache-dir {tmp_path}" in warning
    result = run_cli("stats", "--cache-dir", str(tmp_path))
    assert result.returncode == 1 and "file is not a database" in result.stderr


def test_damaged_control_database_is_named_and_repair_keeps_every_artifact(tmp_path, caplog):
    """The control database (claims, counters) was damaged, the index sound: the warning told the
    user to delete the index, which holds every artifact."""
    with ArtifactStore(tmp_path) as store:
        for key in (KEY_A, KEY_B):
            put(store, key, os.urandom(100_000))
    (tmp_path / "control" / "cache.db").write_bytes(b"scribbled over by a crash" * 200)
    with caplog.at_level(logging.WARNING, logger="neff_cache"):
        assert ArtifactStore(tmp_path).in_memory
    (warning,) = warnings_of(caplog)
    assert str(tmp_path / "control" / "cache.db") in warning and "no artifact is lost" in warning
    assert "delete the damaged database" not in warning and "the index" not in warning

    result = run_cli("repair", "--cache-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "index: sound" in result.stdout and "control database (claims and counters): rebuilt" in result.stdout
    with ArtifactStore(tmp_path) as store:
        assert not store.in_memory and len(store.entries()) == 2
        assert store.get(KEY_A, fingerprint="fp") is not None and store.claim(KEY_C)


def test_repair_rebuilds_a_damaged_index_from_the_rows_that_still_read(tmp_path):
    with ArtifactStore(tmp_path) as store:
        keys = [f"{index:032x}" for index in range(60)]
        for key in keys:
            put(store, key, key.encode() * 40 + os.urandom(40_000 if key.endswith(("0", "5")) else 400))
    index = tmp_path / "cache.db"
    sqlite3.connect(index).execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    data = bytearray(index.read_bytes())
    page = 4096
    ((table_root,),) = cache_sql(tmp_path, "SELECT rootpage FROM sqlite_master WHERE name = 'Cache'")
    damaged_page = len(data) // page - 2  # a leaf page of the Cache table near the end
    assert damaged_page != table_root - 1
    data[damaged_page * page : (damaged_page + 1) * page] = b"\xa5" * page
    index.write_bytes(bytes(data))
    with ArtifactStore(tmp_path) as store:
        store.entries()  # reading the damaged page degrades the store
        assert store.in_memory
    result = run_cli("repair", "--cache-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "index rebuilt: kept" in result.stdout and (tmp_path / "cache.db.damaged").exists()
    with ArtifactStore(tmp_path) as store:
        assert not store.in_memory
        kept = {entry["key"] for entry in store.entries()}
        assert 0 < len(kept) < len(keys)
        for key in kept:  # every kept entry verifies and reads back
            assert store.get(key, fingerprint="fp").startswith(key.encode() * 40)
        assert store.corrupt_entries == 0


@pytest.mark.parametrize("error", [OSError(errno.EROFS, "Read-only file system"),
                                   sqlite3.OperationalError("attempt to write a readonly database")])
def test_unwritable_directory_is_still_read_with_one_warning(tmp_path, monkeypatch, caplog, error):
    """Simulated: the directory refuses writes (as root, chmod would not stop them; the real
    read-only mount is in test_cache_faults.py)."""
    with ArtifactStore(tmp_path) as writer:
        put(writer, KEY_A, os.urandom(100_000))
        put(writer, KEY_B, b"small")
        writer.put_failure(KEY_C, "RuntimeError: no", fingerprint="fp", backend="b")

    def refuse_writes(self, directory, size_limit_bytes, shared=False):
        raise error

    monkeypatch.setattr("neff_cache._disk._DiskBackend.__init__", refuse_writes)
    with caplog.at_level(logging.WARNING, logger="neff_cache"):
        store = ArtifactStore(tmp_path)
        assert store.read_only and not store.in_memory
        assert store.get(KEY_A, fingerprint="fp") is not None and store.get(KEY_B) == b"small"
        assert store.failure(KEY_C) == "RuntimeError: no"
        put(store, KEY_D, b"compiled by this process")
        assert store.get(KEY_D) == b"compiled by this process" and store.claim(KEY_D + "00")
        assert {entry["key"] for entry in store.entries()} == {KEY_A, KEY_B, KEY_D}
        assert store.stats()["read_only"] and store.stats()["entries"] == 3
    (warning,) = warnings_of(caplog)
    assert "cannot be written" in warning and "its artifacts are used" in warning and str(tmp_path) in warning
    monkeypatch.undo()
    assert ArtifactStore(tmp_path).get(KEY_D) is None  # nothing was written


def test_disk_full_during_put_keeps_reading_the_disk_with_one_warning(store, monkeypatch, caplog):
    put(store, KEY_A, b"written before the disk filled up")

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(diskcache.Cache, "set", disk_full)
    with caplog.at_level(logging.WARNING, logger="neff_cache"):
        put(store, KEY_B, b"lands in memory")
        put(store, KEY_C, b"also in memory")
        assert store.get(KEY_B) == b"lands in memory"
        assert store.get(KEY_A) == b"written before the disk filled up"  # still read from the disk
    assert store.read_only and not store.in_memory
    (warning,) = warnings_of(caplog)
    assert "No space left on device" in warning and "free space" in warning and store.directory in warning
    assert ArtifactStore(store.directory).get(KEY_B) is None  # nothing half-written for other processes


def test_disk_full_halfway_through_a_value_file_leaves_no_orphan_for_long(tmp_path, monkeypatch):
    import neff_cache.access

    write = neff_cache.access.write_value

    def disk_fills_halfway(root, relative, data, access):
        write(root, relative, data[: len(data) // 2], access)
        raise OSError(errno.ENOSPC, "No space left on device")

    with ArtifactStore(tmp_path) as store:
        monkeypatch.setattr(neff_cache.access, "write_value", disk_fills_halfway)
        put(store, KEY_A, os.urandom(300_000))
        monkeypatch.undo()
        assert store.read_only and store.get(KEY_A) is not None  # kept in memory
    with ArtifactStore(tmp_path) as later:
        assert later.get(KEY_A) is None and not later.read_only
        assert later.remove_orphans(grace_s=0) == (1, 150_000)  # the half-written file


def test_database_error_while_reading_degrades_instead_of_raising(store, monkeypatch, caplog):
    put(store, KEY_A, b"x")

    def broken_rows(self):
        raise sqlite3.DatabaseError("database disk image is malformed")

    monkeypatch.setattr(type(store._backend), "rows", broken_rows)
    with caplog.at_level(logging.WARNING, logger="neff_cache"):
        assert store.entries() == []
    assert store.in_memory and "malformed" in warnings_of(caplog)[0]


# ---------------------------------------------------------------------------------- claims


def test_claim_is_exclusive_owned_and_respects_stored_artifacts(tmp_path):
    first, second = ArtifactStore(tmp_path), ArtifactStore(tmp_path)
    assert first.claim(KEY_A)
    assert first.is_claimed(KEY_A) and second.is_claimed(KEY_A)
    assert not second.claim(KEY_A)
    second.release(KEY_A)  # not its claim: must not free the key
    assert not second.claim(KEY_A)
    first.release(KEY_A)
    assert not first.is_claimed(KEY_A)
    assert second.claim(KEY_A)
    put(second, KEY_B, b"already compiled")
    assert not first.claim(KEY_B)  # nothing to compile
    assert not first.is_claimed(KEY_B)


def hold_claim_in_a_child(directory, key: str) -> subprocess.Popen:
    child = subprocess.Popen(
        [sys.executable, "-c", f"import sys; sys.path[:0] = {[REPO_ROOT, os.path.dirname(__file__)]!r}; "
         f"import test_neff_cache_helpers as h; h.hold_claim_and_sleep({str(directory)!r}, {key!r})"],
        stdout=subprocess.PIPE, text=True,
    )
    assert child.stdout.readline() == "claimed\n"
    return child


@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGTERM"])
def test_claim_of_a_killed_process_is_taken_over_at_once(tmp_path, signal_name):
    holder = hold_claim_in_a_child(tmp_path, KEY_A)
    store = ArtifactStore(tmp_path)
    assert store.is_claimed(KEY_A) and not store.claim(KEY_A)  # alive: its claim holds
    waiter = threading.Thread(target=lambda: waited.append(store.wait_for(KEY_A, timeout_s=60)))
    waited: list = []
    start = time.monotonic()
    waiter.start()
    holder.send_signal(getattr(signal, signal_name))
    holder.wait(timeout=30)
    waiter.join(timeout=30)
    assert waited == [None] and time.monotonic() - start < 10  # the waiter saw the holder die
    assert not store.is_claimed(KEY_A)
    assert store.claim(KEY_A)  # taken over, not after the 900 s ttl
    assert not ArtifactStore(tmp_path).claim(KEY_A)  # and now held by this process


def test_claim_handed_over_to_another_process_is_its_to_release(tmp_path):
    store, other_instance = ArtifactStore(tmp_path), ArtifactStore(tmp_path)
    assert store.claim(KEY_A)
    holder = hold_claim_in_a_child(tmp_path, KEY_B)  # just a live process to hand over to
    try:
        assert store.hand_over(KEY_A, holder.pid)
        assert not store.hand_over(KEY_A, holder.pid)  # no longer this store's
        store.release(KEY_A)
        other_instance.release(KEY_A)
        assert store.is_claimed(KEY_A)  # held by the child now, whatever this process releases
    finally:
        holder.kill()
        holder.wait()
    assert not store.is_claimed(KEY_A) and store.claim(KEY_A)
    assert not store.hand_over(KEY_A, holder.pid)  # to a process that is gone


def test_claim_of_a_dead_process_expires(tmp_path):
    dead = ArtifactStore(tmp_path)
    assert dead.claim(KEY_A, ttl_s=0.3)  # and never released, as if the process had died
    survivor = ArtifactStore(tmp_path)
    assert not survivor.claim(KEY_A)
    start = time.monotonic()
    assert survivor.wait_for(KEY_A, timeout_s=10) is None
    assert time.monotonic() - start < 5  # returned when the claim lapsed, not at the timeout
    assert survivor.claim(KEY_A)


def test_wait_for_returns_the_artifact_another_process_stores(tmp_path):
    compiler, waiter = ArtifactStore(tmp_path), ArtifactStore(tmp_path)
    assert compiler.claim(KEY_A)

    def finish_compile():
        put(compiler, KEY_A, b"compiled elsewhere")
        compiler.release(KEY_A)

    timer = threading.Timer(0.2, finish_compile)
    timer.start()
    try:
        assert waiter.wait_for(KEY_A, timeout_s=10) == b"compiled elsewhere"
    finally:
        timer.join()
    assert waiter.wait_for(KEY_B, timeout_s=0.05) is None  # nobody compiles B: no waiting


def test_four_processes_race_for_cold_keys_and_each_key_compiles_once(tmp_path):
    keys = [f"{index:032x}" for index in range(6)]
    context = multiprocessing.get_context("spawn")
    start, results = context.Event(), context.Queue()
    racers = [
        context.Process(target=helpers.race_for_keys, args=(str(tmp_path), keys, seed, start, results))
        for seed in range(4)
    ]
    for racer in racers:
        racer.start()
    start.set()
    outcomes = [results.get(timeout=60) for _ in racers]
    for racer in racers:
        racer.join(timeout=30)
        assert racer.exitcode == 0
    compiled = [key for keys_compiled, _ in outcomes for key in keys_compiled]
    assert sorted(compiled) == sorted(keys)  # every key exactly once, across all processes
    assert [wrong for _, wrong in outcomes] == [[], [], [], []]


def test_forked_child_uses_its_own_connection_and_cannot_release_the_parents_claim(tmp_path):
    store = ArtifactStore(tmp_path)
    put(store, KEY_A, b"from the parent")
    assert store.claim(KEY_B)
    child = os.fork()
    if child == 0:
        status = 1
        try:
            store.release(KEY_B)
            put(store, KEY_C, b"from the child")
            status = 0 if store.get(KEY_A) == b"from the parent" else 3
        finally:
            os._exit(status)
    _, wait_status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(wait_status) == 0
    assert store.get(KEY_C) == b"from the child"
    assert not ArtifactStore(tmp_path).claim(KEY_B)  # still held by the parent


# ----------------------------------------------------------------------- remembered failures


def test_failure_is_remembered_for_its_fingerprint_and_cleared_with_the_cache(tmp_path):
    with ArtifactStore(tmp_path) as store:
        store.put_failure(KEY_A, "BackendCompileError: cannot compile aten.frobnicate", fingerprint="fp", backend="b")
    with ArtifactStore(tmp_path) as other_process:
        assert other_process.failure(KEY_A, fingerprint="fp") == "BackendCompileError: cannot compile aten.frobnicate"
        assert other_process.failure(KEY_A, fingerprint="fp-2") is None  # a new compiler retries
        assert other_process.failure(KEY_B) is None
        assert other_process.entries() == [] and other_process.get(KEY_A) is None  # not an artifact
        put(other_process, KEY_B, b"x")
        other_process.clear()
        assert other_process.failure(KEY_A) is None


def test_failure_lapses_after_a_day_and_is_bounded_in_size(tmp_path):
    with ArtifactStore(tmp_path, size_limit_mb=1) as store:
        store.put_failure(KEY_A, "x" * 10_000_000, fingerprint="fp", backend="b")
        assert len(store.failure(KEY_A)) == 2000
        cache_sql(tmp_path, "UPDATE Cache SET expire_time = ? WHERE key LIKE 'fail/%'", time.time() - 1)
        assert store.failure(KEY_A) is None


def test_job_whose_compile_raises_is_remembered_by_the_worker(store, tmp_path):
    jobs = CompileJobs(store)
    try:
        assert jobs.submit(KEY_A, FN + "raise_compile_error", bytes(tmp_path / "calls"), fingerprint="fp", backend="b")
        (result,) = finished_within(jobs, 30, with_seconds=True)
    finally:
        jobs.shutdown()
    assert not result.ok and result.failure == "RuntimeError: lowering failed: op aten::frobnicate has no kernel"
    assert ArtifactStore(store.directory).failure(KEY_A, fingerprint="fp") == result.failure


def test_a_refusal_by_design_is_remembered_and_logged_as_information(store, tmp_path, caplog, monkeypatch):
    """Note [Answers, not failures]: a job that raises a type its caller named as an answer (a
    capture's trace job declining a graph) is remembered as any failure is, without a warning;
    another exception still warns."""
    from neff_cache import jobs as jobs_module

    monkeypatch.setattr(jobs_module, "_ANSWERS", set())
    jobs_module.answers_not_failures(helpers.Refusal)
    jobs = CompileJobs(store)
    try:
        with caplog.at_level(logging.INFO, logger="neff_cache"):
            assert jobs.submit(KEY_A, FN + "refuse", bytes(tmp_path / "calls"), fingerprint="fp", backend="b")
            (refused,) = finished_within(jobs, 30, with_seconds=True)
            assert jobs.submit(KEY_B, FN + "raise_compile_error", bytes(tmp_path / "calls"), fingerprint="fp",
                               backend="b")
            (failed,) = finished_within(jobs, 30, with_seconds=True)
    finally:
        jobs.shutdown()
    assert not refused.ok and refused.failure == "test_neff_cache_helpers.Refusal: not_for_me: a graph this job declines"
    assert ArtifactStore(store.directory).failure(KEY_A, fingerprint="fp") == refused.failure
    logged = {r.getMessage().split(" failed: ")[0]: r.levelno for r in caplog.records if " failed: " in r.getMessage()}
    assert logged == {f"compile job for key {KEY_A}": logging.INFO, f"compile job for key {KEY_B}": logging.WARNING}


# ------------------------------------------------------------------------------- orphans


def orphaned_files(directory) -> list[str]:
    named = {row[0] for row in cache_sql(directory, "SELECT filename FROM Cache WHERE filename IS NOT NULL")}
    found = []
    for top, _, names in os.walk(directory):
        for name in names:
            relative = os.path.relpath(os.path.join(top, name), directory)
            if name.endswith(".val") and not relative.startswith("control") and relative not in named:
                found.append(relative)
    return found


def put_in_a_child_killed_at(directory, stage: str, size_limit_mb=4096) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        sys.path[:0] = [{REPO_ROOT!r}, {os.path.dirname(os.path.abspath(__file__))!r}]
        import test_neff_cache_helpers as helpers
        from neff_cache import ArtifactStore
        store = ArtifactStore({str(directory)!r}, size_limit_mb={size_limit_mb})
        helpers.kill_self_at({stage!r})
        store.put({KEY_D!r}, b"d" * 300_000, fingerprint="fp", backend="b", compile_seconds=1)
        """
    )
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert killed.returncode == -signal.SIGKILL, killed.stderr


@pytest.mark.parametrize("stage", ["value-file", "row", "evict"])
def test_files_orphaned_by_a_writer_killed_mid_write_are_removed(tmp_path, stage):
    with ArtifactStore(tmp_path) as store:
        put(store, KEY_A, os.urandom(800_000))  # 1.1 MB with the child's: it evicts this one
    put_in_a_child_killed_at(tmp_path, stage, size_limit_mb=1)
    (orphan,) = orphaned_files(tmp_path)  # the killed writer's file, or the evicted entry's
    with ArtifactStore(tmp_path, size_limit_mb=1) as store:
        assert store.get(KEY_D) == (b"d" * 300_000 if stage == "evict" else None)
        put(store, KEY_B, b"the first put of a process sweeps, but only files past the grace period")
        assert orphaned_files(tmp_path) == [orphan]
        old = time.time() - 2 * 3600
        os.utime(tmp_path / orphan, (old, old))
        cache_sql(tmp_path / "control", "DELETE FROM Cache WHERE key = 'sweep/due'")  # an hour later
    with ArtifactStore(tmp_path, size_limit_mb=1) as store:
        put(store, KEY_C, b"a later process")
        assert orphaned_files(tmp_path) == []
        assert store.orphans_removed == 1 and store.stats()["orphans_removed"] == 1
    on_disk = sum(os.path.getsize(os.path.join(top, name)) for top, _, names in os.walk(tmp_path)
                  for name in names if name.endswith(".val"))
    assert on_disk <= 2**20  # back within the size bound


def test_prune_removes_orphans_at_once_past_the_grace_period(tmp_path):
    put_in_a_child_killed_at(tmp_path, "value-file")
    (orphan,) = orphaned_files(tmp_path)
    old = time.time() - 3600
    os.utime(tmp_path / orphan, (old, old))
    result = run_cli("prune", "--cache-dir", str(tmp_path), "--older-than", "30d")
    assert result.returncode == 0, result.stderr
    assert "removed 1 orphaned files" in result.stdout and orphaned_files(tmp_path) == []


# ------------------------------------------------------------------------------------ jobs


def finished_within(jobs: CompileJobs, seconds: float, with_seconds: bool = False) -> list:
    """The finished jobs as (key, ok, error), or the full JobResults with ``with_seconds``."""
    deadline = time.monotonic() + seconds
    results = []
    while jobs.pending() and time.monotonic() < deadline:
        results += jobs.poll(timeout_s=0.5)
    results += jobs.poll()
    return results if with_seconds else [tuple(r[:3]) for r in results]


def test_workers_start_with_the_environment_the_caller_gives(store):
    """Note [Compile worker processes]: ``worker_env`` is set over the parent's environment in each worker
    (the fuser starts its compile workers with adaptive eager switched off this way)."""
    names = ["NEFF_CACHE_TEST_GIVEN", "PATH"]
    jobs = CompileJobs(store, worker_env={"NEFF_CACHE_TEST_GIVEN": "given"})
    try:
        assert jobs.submit(KEY_A, FN + "environment_of", json.dumps(names).encode(), fingerprint="fp", backend="b")
        assert [r[:2] for r in finished_within(jobs, 60)] == [(KEY_A, True)]
    finally:
        jobs.shutdown()
    assert json.loads(store.get(KEY_A)) == {"NEFF_CACHE_TEST_GIVEN": "given", "PATH": os.environ.get("PATH")}
    assert "NEFF_CACHE_TEST_GIVEN" not in os.environ


def test_a_warmed_worker_runs_its_warm_up_before_the_first_job(store):
    """Note [Warm workers]: ``warm`` starts the worker before any job, and the first job runs in it,
    after the warm-up; a second ``warm`` starts nothing."""
    jobs = CompileJobs(store)
    try:
        assert jobs.warm(FN + "remember", b"warmed")
        assert not jobs.warm(FN + "remember", b"again")
        (worker,) = jobs._workers
        assert jobs.submit(KEY_A, FN + "remembered", b"", fingerprint="fp", backend="b")
        assert [r[:2] for r in finished_within(jobs, 60)] == [(KEY_A, True)]
        assert jobs._workers == [worker]
    finally:
        jobs.shutdown()
    assert store.get(KEY_A, fingerprint="fp") == b"warmed"


def test_stop_warming_kills_a_warming_worker_until_a_job_was_given(store):
    """Note [Warm workers]: ``stop_warming`` kills a worker still warming up when no job was ever
    queued (the program found what it needs in the store); a later job starts a worker of its
    own, without the warm-up; once a job was queued, nothing is stopped."""
    jobs = CompileJobs(store)
    try:
        assert jobs.warm(FN + "remember", b"warmed")
        (worker,) = jobs._workers
        assert jobs.busy() == 1
        assert jobs.stop_warming()
        assert jobs._workers == [] and jobs.busy() == 0 and worker.process.poll() is not None
        assert jobs.submit(KEY_A, FN + "remembered", b"", fingerprint="fp", backend="b")
        assert not jobs.stop_warming()
        assert [r[:2] for r in finished_within(jobs, 60)] == [(KEY_A, True)]
        assert jobs._workers[0] is not worker
    finally:
        jobs.shutdown()
    assert store.get(KEY_A, fingerprint="fp") == b"nothing"  # the new worker never warmed up
    jobs = CompileJobs(store)
    try:
        assert jobs.warm(FN + "sleep_then_compile", b"1.0")
        assert jobs.submit(KEY_B, FN + "remembered", b"", fingerprint="fp", backend="b")
        assert not jobs.stop_warming() and jobs._workers[0].process.poll() is None
        assert [r[:2] for r in finished_within(jobs, 60)] == [(KEY_B, True)]
    finally:
        jobs.shutdown()


def test_a_warm_up_sees_a_job_sent_meanwhile(store):
    """Note [Warm workers]: ``job_waiting`` tells a warm-up that a job waits in its pipe, so that it
    ends before its own compile; the job still runs after it, in the same worker."""
    jobs = CompileJobs(store)
    try:
        assert jobs.warm(FN + "wait_for_a_job", b"60")
        assert jobs.submit(KEY_A, FN + "remembered", b"", fingerprint="fp", backend="b")
        assert [r[:2] for r in finished_within(jobs, 90)] == [(KEY_A, True)]
    finally:
        jobs.shutdown()
    assert store.get(KEY_A, fingerprint="fp") == b"a job waits"


def test_busy_counts_a_worker_warming_up_or_compiling_until_it_ends(store):
    """Note [Cores beside a compile] in adaptive_eager._cores: ``busy`` counts a worker from its
    warm-up's start to its end (the warm-up's one reply) and while a job runs, and collects without
    ``poll``; ``poll`` still reports the job once."""
    jobs = CompileJobs(store)
    try:
        assert jobs.busy() == 0
        assert jobs.warm(FN + "sleep_then_compile", b"1.5")
        assert jobs.busy() == 1
        deadline = time.monotonic() + 60
        while jobs.busy() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert jobs.busy() == 0 and time.monotonic() < deadline  # the warm-up ended and said so
        assert jobs.submit(KEY_A, FN + "sleep_then_compile", b"1.0", fingerprint="fp", backend="b")
        assert jobs.busy() == 1
        while jobs.busy() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert jobs.busy() == 0 and time.monotonic() < deadline
        assert [r[:2] for r in jobs.poll()] == [(KEY_A, True)]  # collected by busy, reported by poll
        assert jobs.poll() == []
    finally:
        jobs.shutdown()
    assert store.get(KEY_A, fingerprint="fp") == b"compiled after 1.0"


def test_a_job_sent_while_the_worker_warms_up_is_reported_once(store):
    """The warm-up's reply is read before the job's (Note [Warm workers])."""
    jobs = CompileJobs(store)
    try:
        assert jobs.warm(FN + "sleep_then_compile", b"1.0")
        assert jobs.submit(KEY_A, FN + "sleep_then_compile", b"0.2", fingerprint="fp", backend="b")
        assert jobs.busy() == 1
        assert [r[:2] for r in finished_within(jobs, 60)] == [(KEY_A, True)]
        assert jobs.busy() == 0 and not jobs._workers[0].warming
    finally:
        jobs.shutdown()


def test_job_runs_in_a_worker_and_stores_the_artifact(store):
    jobs = CompileJobs(store)
    try:
        assert jobs.submit(KEY_A, FN + "compile_upper", b"payload", fingerprint="fp", backend="inductor")
        assert not jobs.submit(KEY_A, FN + "compile_upper", b"payload", fingerprint="fp", backend="inductor")
        assert jobs.pending() == {KEY_A}
        assert store.is_claimed(KEY_A)
        (result,) = finished_within(jobs, 30, with_seconds=True)
        assert tuple(result[:3]) == (KEY_A, True, None)
        assert jobs.pending() == set() and not store.is_claimed(KEY_A)
        assert store.get(KEY_A, fingerprint="fp") == b"PAYLOAD"
        (entry,) = store.entries()
        assert entry["backend"] == "inductor" and entry["compile_seconds"] > 0
        assert result.seconds == entry["compile_seconds"]  # what the fuser adds to compile_seconds
        # Stored now: a second submit is refused without running anything.
        assert not jobs.submit(KEY_A, FN + "compile_upper", b"payload", fingerprint="fp", backend="inductor")
    finally:
        jobs.shutdown()


def test_job_is_not_submitted_while_another_process_holds_the_claim(tmp_path):
    other_process = ArtifactStore(tmp_path)
    assert other_process.claim(KEY_A)
    jobs = CompileJobs(ArtifactStore(tmp_path))
    try:
        assert not jobs.submit(KEY_A, FN + "compile_upper", b"x", fingerprint="fp", backend="b")
        assert jobs.pending() == set()
    finally:
        jobs.shutdown()


@pytest.mark.parametrize("crash", ["exit_abruptly", "kill_self"])
def test_crashing_worker_is_retried_once_then_reported_and_later_jobs_work(store, tmp_path, crash, caplog):
    calls = tmp_path / "calls"
    jobs = CompileJobs(store)
    try:
        with caplog.at_level(logging.WARNING, logger="neff_cache"):
            assert jobs.submit(KEY_A, FN + crash, bytes(calls), fingerprint="fp", backend="b")
            ((key, ok, error),) = finished_within(jobs, 30)
        assert (key, ok) == (KEY_A, False)
        assert "died 2 times" in error and crash in error
        assert ("exited with code 1" if crash == "exit_abruptly" else "killed by SIGKILL") in error
        assert len(calls.read_text().splitlines()) == 2
        assert store.get(KEY_A) is None and not store.is_claimed(KEY_A)
        assert any("retrying it once" in message for message in warnings_of(caplog))

        assert jobs.submit(KEY_B, FN + "compile_upper", b"later", fingerprint="fp", backend="b")
        assert finished_within(jobs, 30) == [(KEY_B, True, None)]
        assert store.get(KEY_B) == b"LATER"
    finally:
        jobs.shutdown()


@pytest.mark.parametrize("bound", ["memory", "time"])
def test_a_job_over_its_bound_is_abandoned_and_remembered_without_a_retry(store, tmp_path, bound):
    """Note [Compile limits]: a compile past its memory or time bound, holding the GIL as a
    compiler's pass does, is killed by the watchdog, not retried, reported with the reason that
    the store remembers; the next job gets a fresh worker."""
    limits = {"memory_limit_bytes": 400 << 20} if bound == "memory" else {"time_limit_s": 1.0}
    jobs = CompileJobs(store, **limits)
    start = time.monotonic()
    try:
        assert jobs.submit(KEY_A, FN + "allocate_and_hold", b"600" if bound == "memory" else b"1",
                           fingerprint="fp", backend="b")
        (result,) = finished_within(jobs, 40, with_seconds=True)
        assert time.monotonic() - start < 30  # not the job's 60 s
        assert not result.ok and result.failure.startswith("CompileLimitExceeded: the compile ")
        assert ("GiB of memory, over its bound of 0.39 GiB" if bound == "memory" else "over its bound of 1 s") \
            in result.failure, result.failure
        assert ArtifactStore(store.directory).failure(KEY_A, fingerprint="fp") == result.failure
        assert not store.is_claimed(KEY_A)
        assert jobs.submit(KEY_B, FN + "compile_upper", b"later", fingerprint="fp", backend="b")
        assert finished_within(jobs, 30) == [(KEY_B, True, None)]
    finally:
        jobs.shutdown()


def test_a_job_that_kills_its_worker_twice_is_remembered(store, tmp_path):
    jobs = CompileJobs(store)
    try:
        assert jobs.submit(KEY_A, FN + "kill_self", bytes(tmp_path / "calls"), fingerprint="fp", backend="b")
        (result,) = finished_within(jobs, 30, with_seconds=True)
    finally:
        jobs.shutdown()
    assert ArtifactStore(store.directory).failure(KEY_A, fingerprint="fp") == result.failure
    assert "died 2 times" in result.failure and "killed by SIGKILL" in result.failure


def test_worker_that_dies_once_succeeds_on_the_retry(store, tmp_path):
    calls = tmp_path / "calls"
    jobs = CompileJobs(store)
    try:
        assert jobs.submit(KEY_A, FN + "exit_on_first_call", bytes(calls), fingerprint="fp", backend="b")
        assert finished_within(jobs, 30) == [(KEY_A, True, None)]
        assert store.get(KEY_A) == b"compiled on retry"
        assert len(set(calls.read_text().splitlines())) == 2  # two different worker processes
    finally:
        jobs.shutdown()


def test_compile_errors_are_reported_without_retry(store, tmp_path):
    calls = tmp_path / "calls"
    jobs = CompileJobs(store, max_workers=2)
    try:
        assert jobs.submit(KEY_A, FN + "raise_compile_error", bytes(calls), fingerprint="fp", backend="b")
        assert jobs.submit(KEY_B, FN + "return_text", b"", fingerprint="fp", backend="b")
        assert jobs.submit(KEY_C, "no_such_module_anywhere:compile", b"", fingerprint="fp", backend="b")
        results = {key: (ok, error) for key, ok, error in finished_within(jobs, 30)}
        assert set(results) == {KEY_A, KEY_B, KEY_C}
        assert not any(ok for ok, _ in results.values())
        assert results[KEY_A][1].startswith(
            FN + "raise_compile_error raised RuntimeError: lowering failed: op aten::frobnicate has no kernel"
        )
        assert "returned str; a compile function must return bytes" in results[KEY_B][1]
        assert "ModuleNotFoundError" in results[KEY_C][1]
        assert len(calls.read_text().splitlines()) == 1
        assert store.entries() == []
        with pytest.raises(ValueError, match="package.module:function"):
            jobs.submit(KEY_D, "not a function path", b"", fingerprint="fp", backend="b")
    finally:
        jobs.shutdown()


def test_shutdown_without_wait_cancels_and_releases_claims(store, tmp_path):
    pid_file = tmp_path / "worker.pid"
    jobs = CompileJobs(store)
    assert jobs.submit(KEY_A, FN + "sleep_forever", bytes(pid_file), fingerprint="fp", backend="b")
    assert jobs.submit(KEY_B, FN + "compile_upper", b"queued", fingerprint="fp", backend="b")
    deadline = time.monotonic() + 30
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    start = time.monotonic()
    jobs.shutdown(wait=False)
    assert time.monotonic() - start < 5
    assert sorted(r.key for r in jobs.poll() if not r.ok) == [KEY_A, KEY_B]
    assert store.claim(KEY_A) and store.claim(KEY_B)
    assert_process_gone(int(pid_file.read_text()))
    with pytest.raises(RuntimeError, match="after shutdown"):
        jobs.submit(KEY_C, FN + "compile_upper", b"", fingerprint="fp", backend="b")


def test_interpreter_exit_does_not_wait_for_a_running_compile(tmp_path):
    pid_file = tmp_path / "worker.pid"
    script = textwrap.dedent(
        f"""
        import os, sys, time
        sys.path[:0] = [{REPO_ROOT!r}, {os.path.dirname(os.path.abspath(__file__))!r}]
        from neff_cache import ArtifactStore, CompileJobs
        jobs = CompileJobs(ArtifactStore({str(tmp_path / "cache")!r}))
        sleeper = {FN + "sleep_forever"!r}
        assert jobs.submit({KEY_A!r}, sleeper, {bytes(pid_file)!r}, fingerprint="fp", backend="b")
        while not os.path.exists({str(pid_file)!r}):
            time.sleep(0.05)
        print("exiting with a compile running", flush=True)
        """
    )
    start = time.monotonic()
    finished = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert finished.returncode == 0, finished.stderr
    assert "exiting with a compile running" in finished.stdout
    assert time.monotonic() - start < 10
    assert_process_gone(int(pid_file.read_text()))
    with ArtifactStore(tmp_path / "cache") as store:
        assert not store.is_claimed(KEY_A)  # released at exit, not left for the ttl


def test_an_exit_with_a_reply_unread_prints_nothing_from_the_worker(tmp_path):
    """The program exits after a job ended (its artifact stored) but before it read the reply, as a
    training script ends with a background compile just done: the worker, waiting for its next job,
    sees a reset connection and leaves quietly, with no traceback on the user's terminal."""
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path[:0] = [{REPO_ROOT!r}, {os.path.dirname(os.path.abspath(__file__))!r}]
        from neff_cache import ArtifactStore, CompileJobs
        store = ArtifactStore({str(tmp_path)!r})
        jobs = CompileJobs(store, finish_after_exit_s=60)
        assert jobs.submit({KEY_A!r}, {FN + "compile_upper"!r}, b"x", fingerprint="fp", backend="b")
        assert store.wait_for({KEY_A!r}, timeout_s=60) is not None
        time.sleep(0.5)  # the reply is in this process's end of the pipe, unread
        """
    )
    # the worker shares the program's stderr: run() returns once the worker, too, has closed it
    finished = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert finished.returncode == 0, finished.stderr
    assert "Traceback" not in finished.stderr and "Error" not in finished.stderr, finished.stderr


def exit_with_a_compile_running(directory, seconds: float, finish_after_exit_s: float, how: str = "exit",
                                queued: int = 0) -> None:
    """A program that exits with a compile of ``seconds`` running and ``queued`` more of 1 s each
    (KEY_B, KEY_C, ...) waiting for it."""
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path[:0] = [{REPO_ROOT!r}, {os.path.dirname(os.path.abspath(__file__))!r}]
        from neff_cache import ArtifactStore, CompileJobs
        jobs = CompileJobs(ArtifactStore({str(directory)!r}), finish_after_exit_s={finish_after_exit_s})
        assert jobs.submit({KEY_A!r}, {FN + "sleep_then_compile"!r}, b"{seconds}", fingerprint="fp", backend="b")
        for key in {[KEY_B, KEY_C, KEY_D][:queued]!r}:
            assert jobs.submit(key, {FN + "sleep_then_compile"!r}, b"1", fingerprint="fp", backend="b")
        assert jobs.running() == {{{KEY_A!r}}}
        if {how!r} == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    start = time.monotonic()
    # ResourceWarning shown: a worker left running is handed over, not a subprocess forgotten
    finished = subprocess.run([sys.executable, "-W", "always::ResourceWarning", "-c", script], capture_output=True,
                              text=True, timeout=30)
    assert finished.returncode == (-signal.SIGKILL if how == "sigkill" else 0), finished.stderr
    assert time.monotonic() - start < 10  # exit does not wait for the compile
    assert "ResourceWarning" not in finished.stderr, finished.stderr


def test_compile_running_at_exit_finishes_and_lands_in_the_cache(tmp_path):
    exit_with_a_compile_running(tmp_path, seconds=2, finish_after_exit_s=60)
    store = ArtifactStore(tmp_path)
    assert store.is_claimed(KEY_A)  # held by the worker now, not released by the exiting program
    assert store.wait_for(KEY_A, timeout_s=60) == b"compiled after 2"
    # The worker stores, then releases (wait_for's docstring): the release may trail the artifact.
    deadline = time.monotonic() + 10
    while store.is_claimed(KEY_A) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not store.is_claimed(KEY_A)
    (entry,) = store.entries()
    assert entry["backend"] == "b" and entry["compile_seconds"] >= 2


def test_compiles_queued_at_exit_run_after_the_running_one_and_land(tmp_path):
    """Note [Compiles that outlive the program]: the jobs waiting at exit go to the worker that goes
    on, in order, their claims handed over; the next run finds them all in the cache."""
    exit_with_a_compile_running(tmp_path, seconds=1, finish_after_exit_s=60, queued=2)
    store = ArtifactStore(tmp_path)
    assert store.is_claimed(KEY_B) and store.is_claimed(KEY_C)  # held by the worker, not released
    assert store.wait_for(KEY_A, timeout_s=60) == b"compiled after 1"
    assert store.wait_for(KEY_B, timeout_s=60) == b"compiled after 1"
    assert store.wait_for(KEY_C, timeout_s=60) == b"compiled after 1"


def test_compiles_queued_at_exit_are_released_when_nothing_goes_on(tmp_path):
    exit_with_a_compile_running(tmp_path, seconds=60, finish_after_exit_s=0, queued=1)
    store = ArtifactStore(tmp_path)
    assert not store.is_claimed(KEY_A) and not store.is_claimed(KEY_B) and store.entries() == []


def test_compile_of_a_program_killed_by_sigkill_still_lands(tmp_path):
    exit_with_a_compile_running(tmp_path, seconds=1, finish_after_exit_s=60, how="sigkill")
    store = ArtifactStore(tmp_path)
    assert not store.is_claimed(KEY_A)  # its holder is dead: another process may compile it meanwhile
    deadline = time.monotonic() + 60
    while store.get(KEY_A) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert store.get(KEY_A) == b"compiled after 1"


def test_a_follow_up_compile_runs_once_the_program_is_gone(tmp_path):
    """Note [Follow-up compiles after exit] in neff_cache._worker: a job that ends after its program
    exited runs the compiles it named, each under its own key and backend, released once stored."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.path[:0] = [{REPO_ROOT!r}, {os.path.dirname(os.path.abspath(__file__))!r}]
        from neff_cache import ArtifactStore, CompileJobs
        jobs = CompileJobs(ArtifactStore({str(tmp_path)!r}), finish_after_exit_s=60)
        assert jobs.submit({KEY_A!r}, {FN + "sleep_then_name_a_follow_up"!r}, b"1", fingerprint="fp", backend="b")
        """
    )
    finished = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert finished.returncode == 0, finished.stderr
    store = ArtifactStore(tmp_path)
    assert store.wait_for(KEY_A, timeout_s=60) == b"traced"
    assert store.wait_for(KEY_B, timeout_s=60) == b"FOLLOW-UP"
    deadline = time.monotonic() + 10
    while store.is_claimed(KEY_B) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not store.is_claimed(KEY_B)
    assert {e["key"]: e["backend"] for e in store.entries()} == {KEY_A: "b", KEY_B: "b2"}


def test_a_follow_up_compile_is_dropped_while_the_program_lives(tmp_path):
    """... and while the program lives it is the program's to submit (it reads the job's result)."""
    store = ArtifactStore(tmp_path)
    jobs = CompileJobs(store, finish_after_exit_s=60)
    try:
        assert jobs.submit(KEY_A, FN + "sleep_then_name_a_follow_up", b"0", fingerprint="fp", backend="b")
        (result,) = jobs.poll(timeout_s=60)
        assert result.ok, result.error
        assert jobs.submit(KEY_C, FN + "compile_upper", b"next", fingerprint="fp", backend="b")
        (result,) = jobs.poll(timeout_s=60)  # the worker took the next job: the follow-up is behind it
        assert result.ok and store.get(KEY_C) == b"NEXT"
        assert not store.contains(KEY_B) and not store.is_claimed(KEY_B)
    finally:
        jobs.shutdown()


def test_compile_running_at_exit_is_bounded_by_finish_after_exit_s(tmp_path):
    exit_with_a_compile_running(tmp_path, seconds=60, finish_after_exit_s=1)
    store = ArtifactStore(tmp_path)
    start = time.monotonic()
    assert store.wait_for(KEY_A, timeout_s=30) is None  # its worker was killed, so its claim is stale
    assert time.monotonic() - start < 10 and store.entries() == [] and store.claim(KEY_A)


def assert_process_gone(pid: int) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        try:  # our own child lingers as a zombie until reaped
            if os.waitpid(pid, os.WNOHANG) != (0, 0):
                return
        except ChildProcessError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"worker process {pid} is still running")


# ------------------------------------------------------------------------------------- CLI


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "neff_cache", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=REPO_ROOT,
    )


@pytest.fixture
def filled_cache(tmp_path):
    with ArtifactStore(tmp_path) as store:
        put(store, KEY_A, os.urandom(2 * 2**20), backend="inductor")
        put(store, KEY_B, os.urandom(100), backend="neuron")
        put(store, KEY_C, os.urandom(300), backend="neuron")
        store.get(KEY_A)
        store.get(KEY_A)
        store.get(KEY_B)
    backdate(tmp_path, KEY_C, 10 * 86400)
    return tmp_path


def test_cli_stats(filled_cache):
    result = run_cli("stats", "--cache-dir", str(filled_cache))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert f"cache directory: {filled_cache}" in lines
    assert "entries: 3 (2.0 MB)" in lines
    assert "hits: 3" in lines
    assert "evicted: 0 to fit the size limit, 0 corrupt, 0 incompatible" in lines
    assert "backend inductor: 1 entries, 2.0 MB, 2 hits" in lines
    assert "backend neuron: 2 entries, 400 B, 1 hits" in lines
    assert any(line.startswith("oldest: ") and line.endswith("(10d ago)") for line in lines)
    assert any(line.startswith("newest: ") and line.endswith("s ago)") for line in lines)


def test_cli_ls_before_or_after_the_command(filled_cache):
    for args in (("ls", "--cache-dir", str(filled_cache)), ("--cache-dir", str(filled_cache), "ls")):
        result = run_cli(*args)
        assert result.returncode == 0, result.stderr
        header, *rows = result.stdout.splitlines()
        assert header.split() == "KEY FORMAT BACKEND SIZE HITS AGE UNUSED FOR COMPILE".split()
        assert [row.split()[0] for row in rows] == [KEY_B, KEY_A, KEY_C]  # most recently used first
        assert rows[1].split()[1:5] == ["v1", "inductor", "2.0", "MB"]
        hits, age, unused_for, compile_seconds = rows[1].split()[5:]
        assert (hits, compile_seconds) == ("2", "1.25s") and age.endswith("s") and unused_for.endswith("s")
        assert rows[2].split()[6:8] == ["10d", "10d"]


def test_cli_prune_and_clear(filled_cache):
    result = run_cli("prune", "--cache-dir", str(filled_cache), "--older-than", "7d")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"removed {KEY_C} (neuron, 300 B, 0 hits)",
        f"removed 1 entries (300 B) from {filled_cache}",
    ]
    result = run_cli("prune", "--cache-dir", str(filled_cache), "--max-size", "1")
    assert result.stdout.splitlines()[0] == f"removed {KEY_A} (inductor, 2.0 MB, 2 hits)"
    result = run_cli("clear", "--cache-dir", str(filled_cache))
    assert result.stdout.splitlines() == [
        f"removed {KEY_B} (neuron, 100 B, 1 hits)",
        f"removed 1 entries (100 B) from {filled_cache}",
    ]
    assert run_cli("ls", "--cache-dir", str(filled_cache)).stdout == "no entries\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["prune", "--max-size", "lots"], "expected a size in MB such as 512 or 0.5, got 'lots'"),
        (["prune", "--max-size", "-3"], "expected a size in MB"),
        (["prune", "--older-than", "7 fortnights"], "expected an age such as 3600, 90s, 30m, 12h, 7d or 2w"),
        (["prune"], "prune needs --max-size MB and/or --older-than AGE"),
        (["stats", "--max-size", "5"], "unrecognized arguments: --max-size 5"),
        ([], "the following arguments are required"),
    ],
)
def test_cli_bad_input_says_what_to_do_and_exits_2(tmp_path, args, message):
    result = run_cli(*args, "--cache-dir", str(tmp_path)) if args else run_cli()
    assert result.returncode == 2
    assert message in result.stderr
    assert "usage: python -m neff_cache" in result.stderr


def test_cli_on_a_missing_cache_creates_nothing(tmp_path):
    result = run_cli("stats", "--cache-dir", str(tmp_path / "never-used"))
    assert result.returncode == 0
    assert result.stdout == f"no compiled-artifact cache at {tmp_path / 'never-used'}\n"
    assert not (tmp_path / "never-used").exists()


def test_cli_on_a_path_that_is_no_cache_says_so_and_fails(tmp_path):
    """`--cache-dir /etc/passwd` (a file) and a directory of other files answered "no cache", exit 0."""
    not_a_dir = tmp_path / "passwd"
    not_a_dir.write_text("root:x:0:0")
    result = run_cli("stats", "--cache-dir", str(not_a_dir))
    assert result.returncode == 2 and "not a directory" in result.stderr
    others = tmp_path / "etc"
    others.mkdir()
    (others / "hosts").write_text("127.0.0.1 localhost")
    for command in ("stats", "clear"):
        result = run_cli(command, "--cache-dir", str(others))
        assert result.returncode == 1 and "holds files but no compiled-artifact cache" in result.stderr
    assert sorted(p.name for p in others.iterdir()) == ["hosts"]


def test_cli_default_directory_is_under_home(tmp_path):
    home_cache = tmp_path / ".cache" / "adaptive_eager"
    with ArtifactStore(home_cache) as store:
        put(store, KEY_A, b"found by default")
    env = program_env()
    env.pop(CACHE_ENV)  # the test session's: the default is what this test reads
    env.update(HOME=str(tmp_path), NEURON_EAGER_DEVICE="cpu")
    result = run_cli("stats", env=env)
    assert result.returncode == 0, result.stderr
    assert f"cache directory: {home_cache}" in result.stdout and "entries: 1 " in result.stdout
