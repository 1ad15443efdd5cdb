"""A process's first window runs eagerly, and the cache opens at the mode's entry (Note [Eager start]
in adaptive_eager/_mode.py). Most tests run a fresh process: in this one the first window is over
before any test runs (conftest), and the others set its count by hand."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from _oracle import program_env

from adaptive_eager import _mode, _state


def run(script: str, tmp_path, stderr: list | None = None, **env) -> dict:
    """``script`` in a fresh interpreter with a private cache; the JSON it prints last (and what it
    wrote to stderr, appended to ``stderr``)."""
    full = program_env(first_window_recorded=False)  # the default: the first window runs eagerly
    full.update({"NEURON_EAGER_CACHE_DIR": str(tmp_path / "cache"), **env})
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=full, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    if stderr is not None:
        stderr.append(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


FIRST_WINDOW = """
    import json, torch
    import adaptive_eager as ae
    x = torch.ones(4)
    with ae.adaptive_eager(backend="replay"{options}):
        y = (x * 3 + 1).sum()  # the first window
        first = {{"lazy": ae.is_lazy(y), "start": ae.metrics()["ops_eager_start"],
                  "recorded": ae.metrics()["ops_recorded"]}}
        ae.sync()  # a sync point ends it
        z = (x * 2).sum()
        second = {{"lazy": ae.is_lazy(z), "recorded": ae.metrics()["ops_recorded"]}}
        values = [y.item(), z.item()]
    print(json.dumps({{"first": first, "second": second, "values": values}}))
"""


def test_the_first_window_runs_eagerly_and_a_sync_point_ends_it(tmp_path):
    out = run(FIRST_WINDOW.format(options=""), tmp_path)
    assert out["first"] == {"lazy": False, "start": 3, "recorded": 0}  # mul, add, sum ran as eager runs them
    assert out["second"] == {"lazy": True, "recorded": 2}
    assert out["values"] == [16.0, 8.0]


def test_eager_start_off_records_the_first_window(tmp_path):
    for out in (run(FIRST_WINDOW.format(options=", eager_start=False"), tmp_path),
                run(FIRST_WINDOW.format(options=""), tmp_path, NEURON_EAGER_EAGER_START="0")):
        assert out["first"] == {"lazy": True, "start": 0, "recorded": 3}
        assert out["values"] == [16.0, 8.0]


def test_the_first_window_ends_after_window_ops_without_a_sync_point(tmp_path):
    out = run("""
        import json, torch
        import adaptive_eager as ae
        x = torch.ones(4)
        with ae.adaptive_eager(backend="replay", window=5):
            ys = [x + i for i in range(8)]
            lazy = [ae.is_lazy(y) for y in ys]
            start = ae.metrics()["ops_eager_start"]
            values = [y.sum().item() for y in ys]
        print(json.dumps({"lazy": lazy, "start": start, "values": values}))
    """, tmp_path)
    assert out["lazy"] == [False] * 5 + [True] * 3
    assert out["start"] == 5
    assert out["values"] == [4.0 * (1 + i) for i in range(8)]


def test_a_later_block_with_eager_start_off_ends_it():
    """Its thread records from its first op, so no other thread may still run eagerly."""
    _state.EAGER_START[0] = 3  # this process: as if its first window had 3 ops left
    try:
        import adaptive_eager as ae

        with ae.adaptive_eager(backend="replay", eager_start=False):
            assert ae.is_lazy(torch.ones(2) + 1)
        assert _state.EAGER_START[0] == 0
    finally:
        _state.EAGER_START[0] = 0


def test_a_sync_point_in_another_thread_ends_it_for_every_thread():
    import adaptive_eager as ae

    _state.EAGER_START[0] = 100  # this process: as if its first window had 100 ops left
    x = torch.ones(3)
    try:
        with ae.adaptive_eager(backend="replay", eager_start=True):
            a = x + 1
            assert not ae.is_lazy(a) and _state.EAGER_START[0] == 99

            def other():
                with ae.adaptive_eager(backend="replay", eager_start=True):
                    ae.sync()

            thread = threading.Thread(target=other)
            thread.start()
            thread.join()
            b = a * 2
            assert ae.is_lazy(b)  # recorded from here on
            assert b.tolist() == [4.0, 4.0, 4.0]
    finally:
        _state.EAGER_START[0] = 0


def test_an_ended_first_window_never_comes_back():
    """The countdown runs under a lock: a thread's last eager op cannot reset a count that another
    thread's sync point set to 0 (which would let it read that thread's pending values)."""
    _state.EAGER_START[0] = 2
    try:
        add = torch.ops.aten.add.Tensor
        assert _mode._eager_start_op(add) and _state.EAGER_START[0] == 1
        _state.end_eager_start()  # another thread's sync point
        assert not _mode._eager_start_op(add)
        assert _state.EAGER_START[0] == 0
    finally:
        _state.EAGER_START[0] = 0


TRAINING = """
    import json, sys, torch
    import adaptive_eager as ae

    def train(steps=6):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.25),
                                    torch.nn.Linear(32, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        x, y = torch.randn(8, 16), torch.randn(8, 1)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x + torch.randn_like(x)), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return [float(l) for l in losses], [p.detach().clone() for p in model.parameters()]

    backend = sys.argv[1]
    with ae.adaptive_eager(backend=backend, hot_after=1, async_compile=False):
        losses, params = train()
        m = ae.metrics()
    eager_losses, eager_params = train()
    print(json.dumps({"losses": losses, "eager": eager_losses, "start": m["ops_eager_start"],
                      "recorded": m["ops_recorded"], "compiled_runs": m["compiled_runs"],
                      "params": max((p - q).abs().max().item() for p, q in zip(params, eager_params))}))
"""


@pytest.mark.parametrize("backend", ["replay", "inductor"])
def test_a_training_loop_keeps_eagers_values_through_its_first_window(tmp_path, backend):
    """Dropout and randn_like in the first window (eager) and after it (drawn at record time): the
    same random numbers as eager's, in the same order."""
    script = TRAINING.replace("backend = sys.argv[1]", f"backend = {backend!r}")
    out = run(script, tmp_path)
    assert out["start"] > 0 and out["recorded"] > 0
    if backend == "replay":  # bitwise eager
        assert out["losses"] == out["eager"] and out["params"] == 0.0
    else:
        assert out["compiled_runs"] > 0
        assert out["losses"][0] == out["eager"][0]  # the first window ran eagerly
        assert max(abs(a - b) for a, b in zip(out["losses"], out["eager"])) < 1e-5
        assert out["params"] < 1e-5


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
    """A cache directory every user may write is not used, with one warning, whether or not the
    mode's entry already tried to open it; the program runs on, compiled in memory."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    script = """
        import json, torch
        import adaptive_eager as ae
        with ae.adaptive_eager(backend="inductor", hot_after=1, async_compile=False{options}):
            x = torch.ones(8)
            for _ in range(3):
                v = ((x * 2).sin() + 1).sum().item()
            runs = ae.metrics()["compiled_runs"]
        print(json.dumps({{"v": v, "compiled_runs": runs}}))
    """
    err: list = []
    with_start = run(script.format(options=""), tmp_path, err, NEURON_EAGER_CACHE_DIR=str(shared))
    without = run(script.format(options=", eager_start=False"), tmp_path, err, NEURON_EAGER_CACHE_DIR=str(shared))
    assert with_start["v"] == pytest.approx(without["v"], rel=1e-6)  # eager's sin or a compiled one
    assert with_start["compiled_runs"] > 0 and without["compiled_runs"] > 0
    for text in err:
        assert text.count("not using the compiled-artifact cache at") == 1, text
        assert "is writable by every user" in text


def test_the_first_window_on_the_emulated_neuron_device(tmp_path):
    """The first window's ops reach the emulated device's own dispatch, as eager's do; the window
    after the sync point is recorded and runs compiled, with eager's values."""
    out = run("""
        import json, torch
        import adaptive_eager as ae
        ae.emulate_neuron()
        x = torch.arange(8.0).to("neuron")
        eager = [((x * 2).sin() + 1).sum().item() for _ in range(4)]
        with ae.adaptive_eager(device="neuron", backend="stablehlo", hot_after=1, async_compile=False):
            y = ((x * 2).sin() + 1).sum()
            first = {"lazy": ae.is_lazy(y), "device": y.device.type, "start": ae.metrics()["ops_eager_start"]}
            values = [y.item()] + [((x * 2).sin() + 1).sum().item() for _ in range(3)]
            runs = ae.metrics()["compiled_runs"]
        print(json.dumps({"first": first, "values": values, "eager": eager, "runs": runs}))
    """, tmp_path)
    assert out["first"] == {"lazy": False, "device": "neuron", "start": 4}
    assert out["values"][0] == out["eager"][0]
    assert out["values"] == pytest.approx(out["eager"], rel=1e-6)
    assert out["runs"] > 0
