"""Warm start: a region whose artifact is on disk replays while the artifact loads in the
background, and runs compiled once it is loaded (Note [Tiers] in fuser.regions)."""

from __future__ import annotations

import json
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
from neff_cache import ArtifactStore

X = torch.randn(4096)


def program():
    return ((X * 3).sin() + 1).sum()


def other():
    return ((X * 2).cos() - 1).sum()


def compiled_into(cache, *programs) -> list[str]:
    """Compile each of ``programs`` into ``cache`` as a first process would; their keys, in order.
    Afterwards nothing is in memory and no store is open: a new process's view."""
    fuser.cache_clear(store_handles=True)  # an earlier test's regions would be memory hits: nothing stored
    keys = []
    for fn in programs:
        before = {e["key"] for e in artifacts(ArtifactStore(cache))}
        with adaptive_eager(backend="inductor", hot_after=1, async_compile=False, cache_dir=str(cache)):
            fn().item()
        (key,) = {e["key"] for e in artifacts(ArtifactStore(cache))} - before
        keys.append(key)
    fuser.cache_clear(store_handles=True)
    ae.reset_metrics()
    return keys


def run_until_loaded(fn, cache, timeout_s: float = 120.0):
    """``fn`` under the default options until a window ran from disk or the load failed: (the
    metrics after the first window, the metrics at the end, the values)."""
    values = []
    with adaptive_eager(backend="inductor", cache_dir=str(cache)):
        values.append(fn().item())
        first = ae.metrics()
        deadline = time.monotonic() + timeout_s
        while not ae.metrics()["compiled_runs"] and not ae.metrics()["blacklisted"] and time.monotonic() < deadline:
            time.sleep(0.01)  # the load runs on the compile thread; the windows replay meanwhile
            values.append(fn().item())
        values.append(fn().item())
    return first, ae.metrics(), values


def test_a_warm_start_replays_while_the_artifact_loads_then_runs_it(tmp_path):
    compiled_into(tmp_path, program)
    first, m, values = run_until_loaded(program, tmp_path)
    # the first window did not wait for the load: replayed, counted as such
    assert first["replay_reasons"] == {"loading": 1} and first["compiled_runs"] == 0, first
    assert m["compiles"] == 0 and m["cache_hits_disk"] == 1 and m["compiled_runs"] >= 1, m
    assert set(m["replay_reasons"]) == {"loading"} and m["compile_failures"] == 0 and m["blacklisted"] == 0, m
    want = program().item()
    assert values[0] == want  # replayed: bitwise eager
    torch.testing.assert_close(values, [want] * len(values), rtol=1e-5, atol=0)  # compiled: a sum's rounding


def test_an_artifact_that_fails_to_load_in_the_background_is_evicted_and_replayed(tmp_path, caplog):
    key, other_key = compiled_into(tmp_path, program, other)
    with ArtifactStore(tmp_path) as store:  # another region's artifact under this key: its checksum is right
        data, fingerprint = store.get(other_key), artifacts(store)[0]["fingerprint"]
        store.put(key, data, fingerprint=fingerprint, backend="inductor", compile_seconds=0.0)
    first, m, values = run_until_loaded(program, tmp_path)
    assert first["replay_reasons"] == {"loading": 1}, first
    # counted as what it was: no compile failed, the artifact was evicted, the region replays
    assert m["corrupt_entries"] == 1 and m["blacklisted"] == 1 and m["compile_failures"] == 0, m
    assert m["compiles"] == 0 and m["compiled_runs"] == 0 and m["replay_reasons"]["load_failed"] >= 1, m
    assert not ArtifactStore(tmp_path).contains(key)
    want = program().item()
    assert values == [want] * len(values)  # replayed: bitwise eager


WARM_CHILD = textwrap.dedent(
    """
    import json, sys, time, torch
    import adaptive_eager as ae
    torch.manual_seed(0)
    x = torch.randn(4096)
    with ae.adaptive_eager(backend="inductor", cache_dir=sys.argv[1]):
        values = [((x * 3).sin() + 1).sum().item()]
        first = ae.metrics()
        deadline = time.monotonic() + 300
        while not ae.metrics()["compiled_runs"] and time.monotonic() < deadline:
            time.sleep(0.05)
            values.append(((x * 3).sin() + 1).sum().item())
    m = ae.metrics()
    print(json.dumps({"first": first["replay_reasons"], "first_runs": first["compiled_runs"], "values": values,
                      "compiles": m["compiles"],
                      "disk": m["cache_hits_disk"], "runs": m["compiled_runs"]}))
    """
)


@pytest.mark.slow  # a child process importing torch and Inductor: ~15 s quiet, over a minute at load 10
def test_a_new_process_replays_its_first_step_while_inductor_imports(tmp_path):
    """In a fresh process the first load imports Inductor (seconds): the first window does not wait for it."""
    compiled_into(tmp_path, program)  # the key is the structure: the child's input has other values
    torch.manual_seed(0)
    x = torch.randn(4096)
    want = ((x * 3).sin() + 1).sum().item()
    env = program_env()
    out = subprocess.run([sys.executable, "-c", WARM_CHILD, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["first"] == {"loading": 1} and r["first_runs"] == 0, r
    assert r["compiles"] == 0 and r["disk"] == 1 and r["runs"] >= 1, r
    assert r["values"][0] == want  # replayed: bitwise eager
    torch.testing.assert_close(r["values"], [want] * len(r["values"]), rtol=1e-5, atol=0)



def test_a_window_replays_before_its_artifact_starts_loading(tmp_path, monkeypatch):
    """Note [Load after the replay] in fuser.regions: the load (Inductor's import, on the compile
    thread) would take the GIL from the window's own replay."""
    from fuser import regions

    compiled_into(tmp_path, program)
    events = []
    replay, submit = regions.replay_window, regions._submit
    monkeypatch.setattr(regions, "replay_window", lambda w: events.append("replay") or replay(w))
    monkeypatch.setattr(regions, "_submit", lambda fn, *a: events.append(fn.__name__) or submit(fn, *a))
    first, m, values = run_until_loaded(program, tmp_path)
    assert events[:2] == ["replay", "_load"], events
    assert first["replay_reasons"] == {"loading": 1} and m["compiles"] == 0 and m["cache_hits_disk"] == 1, m
    assert values[0] == program().item()


def test_a_replay_that_raises_still_starts_its_artifacts_load(tmp_path, monkeypatch):
    """The window's error is the program's; its region loads all the same, and is not compiled
    again at a later sight (Note [Load after the replay])."""
    from fuser import regions

    compiled_into(tmp_path, program)
    replay, calls = regions.replay_window, []

    def failing_once(window):
        calls.append(1)
        if len(calls) == 1:
            raise IndexError("index 7 is out of bounds")  # what a bad index gives at the replay
        return replay(window)

    monkeypatch.setattr(regions, "replay_window", failing_once)
    with adaptive_eager(backend="inductor", cache_dir=str(tmp_path)):
        with pytest.raises(IndexError):
            program().item()
    first, m, values = run_until_loaded(program, tmp_path)
    assert m["compiles"] == 0 and m["cache_hits_disk"] == 1 and m["compiled_runs"] >= 1, m
    torch.testing.assert_close(values, [program().item()] * len(values), rtol=1e-5, atol=0)
