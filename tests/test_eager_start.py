"""The process's first window is recorded like every other (``eager_start``, which ran it eagerly,
is no longer a setting: benchmarks/RESULTS.md, "Session 24"), and the cache opens at the mode's
entry (``_open_caches`` in adaptive_eager/_mode.py). The programs run in fresh processes: a first
window is a process's."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest
from _oracle import program_env

import adaptive_eager as ae
from adaptive_eager import config
from adaptive_eager.config import ConfigError, load_options


def run(script: str, tmp_path, stderr: list | None = None, **env) -> dict:
    """``script`` in a fresh interpreter with a private cache; the JSON it prints last (and what it
    wrote to stderr, appended to ``stderr``)."""
    full = program_env()
    full.update({"NEURON_EAGER_CACHE_DIR": str(tmp_path / "cache"), **env})
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=full, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    if stderr is not None:
        stderr.append(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_first_window_is_recorded(tmp_path):
    out = run("""
        import json, torch
        import adaptive_eager as ae
        x = torch.ones(4)
        with ae.adaptive_eager(backend="replay"):
            y = (x * 3 + 1).sum()  # the process's first window
            first = {"lazy": ae.is_lazy(y), "recorded": ae.metrics()["ops_recorded"]}
            values = [y.item()]
        print(json.dumps({"first": first, "values": values}))
    """, tmp_path)
    assert out == {"first": {"lazy": True, "recorded": 3}, "values": [16.0]}


def test_eager_start_is_no_longer_a_setting(monkeypatch):
    """Asking for the first window to run eagerly is refused, saying so; asking for what now always
    happens is warned about once; keyword and environment alike."""
    monkeypatch.setattr(config, "_warned_removed", set())
    for spelled in ({"eager_start": True}, {"eager_start": "1"}):
        with pytest.raises(ConfigError, match=r"eager_start=.*eager_start is no longer a setting and cannot be "
                                              r"changed: the process's first window is recorded like every other"):
            load_options({}, **spelled)
    with pytest.raises(ConfigError, match=r"NEURON_EAGER_EAGER_START='1': eager_start is no longer a setting"):
        load_options({"NEURON_EAGER_EAGER_START": "1"})
    with pytest.warns(UserWarning, match=r"NEURON_EAGER_EAGER_START='0': eager_start is no longer a setting "
                                         r"\(it is always off\): .*remove the setting") as said:
        load_options({"NEURON_EAGER_EAGER_START": "0"})
        with ae.adaptive_eager(device="cpu", backend="replay", eager_start=False):
            pass
    assert len(said) == 1, [str(w.message) for w in said]


def test_the_cache_opens_at_the_modes_entry(tmp_path):
    out = run("""
        import json, torch
        import adaptive_eager as ae
        import fuser
        with ae.adaptive_eager(backend="inductor"):
            opened = len(fuser.artifacts.stores())
        with ae.adaptive_eager(backend="replay"):
            pass
        print(json.dumps({"opened": opened}))
    """, tmp_path)
    assert out == {"opened": 1}


def test_an_unusable_cache_at_the_modes_entry_is_reported_as_before(tmp_path):
    """A cache directory every user may write is not used, with one warning, though the mode's
    entry already tried to open it; the program runs on, compiled in memory."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    script = """
        import json, torch
        import adaptive_eager as ae
        with ae.adaptive_eager(backend="inductor", hot_after=1, async_compile=False):
            x = torch.ones(8)
            for _ in range(3):
                v = ((x * 2).sin() + 1).sum().item()
            runs = ae.metrics()["compiled_runs"]
        print(json.dumps({"v": v, "compiled_runs": runs}))
    """
    err: list = []
    out = run(script, tmp_path, err, NEURON_EAGER_CACHE_DIR=str(shared))
    assert out["v"] == pytest.approx(8 * (math.sin(2.0) + 1), rel=1e-6)
    assert out["compiled_runs"] > 0
    for text in err:
        assert text.count("not using the compiled-artifact cache at") == 1, text
        assert "is writable by every user" in text
