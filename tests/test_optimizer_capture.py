"""A hot optimizer.step() runs as one guarded call: Note [Optimizer capture] in adaptive_eager._optim.

Every test trains the same tiny model eagerly and under adaptive eager (same seeds) and compares
parameters, optimizer state and ``param_groups``; ``metrics()`` says whether the hot path ran or
missed. Most run the capture with TorchDynamo's ``eager`` backend (the same guarded call, without an
Inductor compile, so each test stays short) under the name ``replay``; the 1,000-step test and
``test_replay_is_not_captured`` use the library's own mapping.
"""

import functools
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import _optim

HOT_AFTER = 2  # the default: steps 1-2 are recorded, step 3 is captured, later steps are hot
# hot steps of a run whose step ``i`` misses once: it runs recorded and step ``i + 1`` recaptures
ONE_MISS = HOT_AFTER + 3
# Inductor on cpu captures at the first step (Note [Training captured at once] in adaptive_eager._capture)
ONE_MISS_AT_ONCE = ONE_MISS - HOT_AFTER
X = torch.linspace(-1, 1, 12).reshape(3, 4)


@pytest.fixture(autouse=True)
def _fresh_dynamo(monkeypatch):
    """Dynamo remembers which floats changed in earlier frames of the same function (its automatic
    dynamic state): forget it, so that a float's first change is a miss in every test. A test
    that calls ``monkeypatch.undo()`` sees the library's own backend mapping."""
    torch._dynamo.reset()
    monkeypatch.setitem(_optim._DYNAMO_BACKENDS, "replay", "eager")


def _params():
    torch.manual_seed(0)
    return [torch.randn(4, 3, requires_grad=True), torch.randn(3, requires_grad=True)]


def _backward(params, i):
    loss = ((X @ params[0] + params[1]) ** 2 * (1 + i % 3)).sum()
    loss.backward()


def _train(make_opt, steps, lazy, edit=None, sched=None, set_to_none=True, backend="replay", async_compile=False,
           **options):
    """``steps`` steps of ``make_opt(params)``; ``edit(i, params, opt)`` runs before step ``i``.
    Dynamo traces the step in the step that captures it (Note [Capture compiles off the step]), and
    without ``async_compile`` its graph's compile is waited for: the counts are the same in every run."""
    params = _params()
    opt = make_opt(params)
    scheduler = sched(opt) if sched else None
    ctx = ae.adaptive_eager(backend=backend, async_compile=async_compile, **options) if lazy else _nothing()
    with ctx:
        for i in range(steps):
            opt.zero_grad(set_to_none=set_to_none)
            _backward(params, i)
            if edit is not None:
                edit(i, params, opt)
            opt.step()
            if scheduler is not None:
                scheduler.step()
    return params, opt


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _assert_same(eager, lazy, **tol):
    (pe, oe), (pl, ol) = eager, lazy
    for a, b in zip(pe, pl):
        torch.testing.assert_close(b, a, **tol)
    se, sl = oe.state_dict(), ol.state_dict()
    assert sl["param_groups"] == se["param_groups"]  # floats stay floats, capturable stays False
    assert sl["state"].keys() == se["state"].keys()
    for k in se["state"]:
        assert sl["state"][k].keys() == se["state"][k].keys()
        for name, v in se["state"][k].items():
            w = sl["state"][k][name]
            assert type(w) is type(v)
            if isinstance(v, torch.Tensor):
                assert (w.dtype, w.shape, w.device) == (v.dtype, v.shape, v.device), name
                torch.testing.assert_close(w, v, **tol)
            else:
                assert w == v, name


def _check(make_opt, steps=6, **kw):
    eager = _train(make_opt, steps, False, **kw)
    ae.reset_metrics()
    lazy = _train(make_opt, steps, True, **kw)
    _assert_same(eager, lazy)
    return ae.metrics()


CASES = {
    "sgd": lambda p, f: torch.optim.SGD(p, lr=0.1, foreach=f),
    "sgd_momentum_nesterov_wd": lambda p, f: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True,
                                                            weight_decay=0.01, foreach=f),
    "sgd_maximize": lambda p, f: torch.optim.SGD(p, lr=0.1, momentum=0.5, maximize=True, foreach=f),
    "adam": lambda p, f: torch.optim.Adam(p, lr=0.01, foreach=f),
    "adam_amsgrad_wd": lambda p, f: torch.optim.Adam(p, lr=0.01, amsgrad=True, weight_decay=0.1, foreach=f),
    "adamw_maximize": lambda p, f: torch.optim.AdamW(p, lr=0.01, maximize=True, foreach=f),
    "rmsprop_centered": lambda p, f: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True,
                                                         weight_decay=0.1, foreach=f),
    "adagrad_wd": lambda p, f: torch.optim.Adagrad(p, lr=0.1, weight_decay=0.1, foreach=f),
}


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_hot_steps_match_eager(case, foreach):
    m = _check(lambda p: CASES[case](p, foreach), steps=6)
    assert m["optimizer_captures"] == 1
    assert m["optimizer_hot_steps"] == 6 - HOT_AFTER - 1
    assert m["optimizer_misses"] == {}


def test_1000_steps_with_a_schedule_compiled_by_inductor(monkeypatch):
    """A cosine schedule changes lr every step: after the first change lr is a graph input (one
    recapture, then no more), no scheduler warning, values within compiled tolerances."""
    monkeypatch.undo()
    def sched(opt):
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)

    def make(p):
        return torch.optim.AdamW(p, lr=0.01, weight_decay=0.05)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eager = _train(make, 1000, False, sched=sched)
        ae.reset_metrics()
        lazy = _train(make, 1000, True, sched=sched, backend="inductor")
    _assert_same(eager, lazy, rtol=1e-4, atol=1e-5)
    m = ae.metrics()
    assert m["optimizer_misses"] == {"param_group": 1}, m  # the first lr change: lr becomes an input
    assert m["optimizer_captures"] == 2
    assert m["optimizer_hot_steps"] == 1000 - ONE_MISS_AT_ONCE


def test_a_scheduler_sees_its_step_after_the_optimizers():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" would raise
        m = _check(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), steps=8,
                   sched=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    assert m["optimizer_misses"] == {"param_group": 1}  # lr changes: after one recapture an input
    assert m["optimizer_hot_steps"] == 8 - ONE_MISS


def _hot_then(edit_at, edit, make=lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1), steps=8):
    def at(i, params, opt):
        if i == edit_at:
            edit(params, opt)
    return _check(make, steps=steps, edit=at)


def test_hyperparameters_edited_mid_run():
    def edit(params, opt):
        g = opt.param_groups[0]
        g["lr"], g["weight_decay"], g["betas"] = 0.05, 0.0, (0.5, 0.6)

    m = _hot_then(4, edit)
    assert m["optimizer_misses"] == {"param_group": 1}
    assert m["optimizer_captures"] == 2 and m["optimizer_hot_steps"] == 8 - ONE_MISS


def test_a_parameter_added_to_a_group():
    def edit(params, opt):
        extra = torch.ones(3, requires_grad=True)  # one per run
        extra.grad = torch.full((3,), 0.5)
        opt.add_param_group({"params": [extra], "lr": 0.2})

    m = _hot_then(4, edit)
    assert m["optimizer_misses"] == {"param_group": 1}
    assert m["optimizer_hot_steps"] == 8 - ONE_MISS


def test_a_grad_set_to_none():
    def at(i, params, opt):
        if i == 4:
            params[1].grad = None  # this step skips params[1]

    m = _check(lambda p: torch.optim.Adam(p, lr=0.01), steps=7, edit=at)
    assert m["optimizer_misses"] == {"grad": 1}
    assert m["optimizer_hot_steps"] == 7 - ONE_MISS


def test_zero_grad_keeping_the_grads():
    m = _check(lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), steps=7, set_to_none=False)
    assert m["optimizer_misses"] == {} and m["optimizer_hot_steps"] == 7 - HOT_AFTER - 1


def test_a_hook_registered_after_capture_runs():
    seen = []

    def edit(params, opt):
        opt.register_step_pre_hook(lambda o, a, k: seen.append(("pre", o.state[params[0]]["step"].item())))
        opt.register_step_post_hook(lambda o, a, k: seen.append(("post", o.state[params[0]]["step"].item())))

    m = _hot_then(4, edit, steps=7)
    # the hooks run around the compiled call, eagerly, and see the state before and after it
    assert seen == [("pre", 4.0), ("post", 5.0), ("pre", 5.0), ("post", 6.0), ("pre", 6.0), ("post", 7.0)] * 2
    assert m["optimizer_misses"] == {} and m["optimizer_hot_steps"] == 7 - HOT_AFTER - 1


def _step_ranges(monkeypatch):
    """The ``record_function`` ranges named for an optimizer step that the program enters."""
    import torch.autograd.profiler as profiler

    names = []
    real = profiler.record_function

    class counted(real):
        def __init__(self, name, args=None):
            if name.startswith("Optimizer.step#"):
                names.append(name)
            super().__init__(name, args)

    monkeypatch.setattr(profiler, "record_function", counted)
    return names


def test_a_hot_step_enters_no_profiler_range_while_nothing_profiles(monkeypatch):
    """Note [The step's profiler range] in adaptive_eager._optim: the range reaches nothing then,
    and a captured step skips it, as torch.compile's does; the values are the same."""
    names = _step_ranges(monkeypatch)
    m = _check(lambda p: torch.optim.AdamW(p, lr=0.01), steps=6)
    assert m["optimizer_hot_steps"] == 6 - HOT_AFTER - 1
    assert names == ["Optimizer.step#AdamW.step"] * 6, names  # eager's six steps only


def test_a_hot_step_keeps_its_range_in_the_profiler():
    params = _params()
    opt = torch.optim.AdamW(params, lr=0.01)
    with ae.adaptive_eager(backend="replay", async_compile=False):
        for i in range(4):
            opt.zero_grad()
            _backward(params, i)
            opt.step()
        with torch.profiler.profile() as prof:
            opt.zero_grad()
            _backward(params, 4)
            opt.step()
        assert ae.metrics()["optimizer_hot_steps"] >= 2
    assert "Optimizer.step#AdamW.step" in {e.name for e in prof.events()}


def test_a_global_step_hook_runs_around_a_hot_step(monkeypatch):
    """A hook of the program's own, registered for every optimizer, takes torch's wrapper, range
    and all: it runs at every step, and the step stays captured."""
    names = _step_ranges(monkeypatch)
    seen = []
    from torch.optim.optimizer import register_optimizer_step_post_hook

    handle = register_optimizer_step_post_hook(lambda o, a, k: seen.append(len(seen)))
    try:
        m = _check(lambda p: torch.optim.AdamW(p, lr=0.01), steps=6)
    finally:
        handle.remove()
    assert len(seen) == 12 and len(names) == 12  # eager's six steps and ours
    assert m["optimizer_hot_steps"] == 6 - HOT_AFTER - 1


def test_load_state_dict_after_capture():
    saved = {}

    def at(i, params, opt):
        if i == 2:
            saved["sd"] = opt.state_dict()
            saved["sd"] = {"state": {k: {n: v.clone() for n, v in s.items()} for k, s in saved["sd"]["state"].items()},
                           "param_groups": saved["sd"]["param_groups"]}
        if i == 5:
            opt.load_state_dict(saved["sd"])

    m = _check(lambda p: torch.optim.Adam(p, lr=0.01), steps=8, edit=at)
    assert m["optimizer_misses"] == {"state": 1}
    assert m["optimizer_hot_steps"] == 8 - ONE_MISS


def test_two_optimizers_sharing_parameters():
    def run(lazy):
        params = _params()
        sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        adam = torch.optim.Adam(params[:1], lr=0.01)
        with ae.adaptive_eager(backend="replay") if lazy else _nothing():
            for i in range(6):
                sgd.zero_grad()
                _backward(params, i)
                sgd.step()
                adam.step()
        return params, sgd, adam

    eager = run(False)
    ae.reset_metrics()
    lazy = run(True)
    _assert_same((eager[0], eager[1]), (lazy[0], lazy[1]))
    _assert_same((eager[0], eager[2]), (lazy[0], lazy[2]))
    m = ae.metrics()
    assert m["optimizer_captures"] == 2 and m["optimizer_hot_steps"] == 2 * (6 - HOT_AFTER - 1)


def test_turned_off():
    eager = _train(lambda p: torch.optim.Adam(p, lr=0.01), 5, False)
    params = _params()
    opt = torch.optim.Adam(params, lr=0.01)
    with ae.adaptive_eager(backend="replay", tiers="hot"):
        for i in range(5):
            opt.zero_grad()
            _backward(params, i)
            opt.step()
    _assert_same(eager, (params, opt))
    m = ae.metrics()
    assert m["optimizer_captures"] == m["optimizer_hot_steps"] == 0 and m["ops_recorded"] > 0


def test_a_captured_optimizer_is_not_kept_alive():
    import gc
    import weakref

    params = _params()
    opt = torch.optim.Adam(params, lr=0.01)
    with ae.adaptive_eager(backend="replay"):
        for i in range(4):
            opt.zero_grad()
            _backward(params, i)
            opt.step()
    assert ae.metrics()["optimizer_hot_steps"] == 1
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None


def test_replay_is_not_captured(monkeypatch):
    """The replay backend is bitwise eager; the captured step is not (tensor step counters)."""
    monkeypatch.undo()
    eager = _train(lambda p: torch.optim.Adam(p, lr=0.01), 5, False)
    lazy = _train(lambda p: torch.optim.Adam(p, lr=0.01), 5, True)
    _assert_same(eager, lazy, rtol=0, atol=0)
    m = ae.metrics()
    assert m["optimizer_captures"] == 0 and m["optimizer_misses"] == {"backend": 5}


def test_a_step_that_keeps_missing_stays_recorded():
    def at(i, params, opt):
        if i >= 3 and i % 2:
            params[1].grad = None  # every other step: each capture misses at the next step

    m = _check(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), steps=14, edit=at)
    assert m["optimizer_captures"] == _optim._MAX_CAPTURES and m["optimizer_hot_steps"] == 0
    limit = _optim._MAX_CAPTURES
    assert m["optimizer_misses"] == {"grad": limit, "recapture_limit": 14 - HOT_AFTER - 2 * limit}


def test_a_hot_step_counts_one_launch_for_what_eager_launches():
    """``metrics()``: eager's launches are the same whether the step is captured or recorded, and a
    captured step is one launch."""
    make = lambda p: torch.optim.AdamW(p, lr=0.01, foreach=False)  # noqa: E731
    counts = {}
    for capture in (False, True):
        ae.reset_metrics()
        with ae.defaults(tiers="capture" if capture else "hot"):
            _train(make, 7, lazy=True)
        counts[capture] = ae.metrics()
    on, off = counts[True], counts[False]
    assert on["optimizer_hot_steps"] == 7 - HOT_AFTER - 1 and off["optimizer_hot_steps"] == 0
    assert on["eager_equivalent_launches"] == off["eager_equivalent_launches"], (on, off)
    assert on["launches"] < off["launches"]


@pytest.mark.parametrize("checked", [True, False], ids=["checked-first", "refused-by-dynamo"])
def test_a_step_while_another_thread_traces_runs_recorded(monkeypatch, checked):
    """Dynamo refuses a compiled call while FX traces (up to torch 2.13 in any thread: a region
    compiling in another thread): that step runs recorded, is counted, and the next one is hot again."""
    from torch.fx import _symbolic_trace

    if not checked:  # the other thread begins to trace between the check and the call
        monkeypatch.setattr(_optim, "_traced_elsewhere", lambda: False)

    def edit(i, params, opt):  # FX traces during the capture and a hot step
        if hasattr(_symbolic_trace, "_is_fx_tracing_tls"):  # torch 2.14: a flag per thread
            monkeypatch.setattr(_symbolic_trace._is_fx_tracing_tls, "flag", i in (2, 4), raising=False)
        else:
            monkeypatch.setattr(_symbolic_trace, "_is_fx_tracing_flag", i in (2, 4))

    make = lambda p: torch.optim.Adam(p, lr=0.01)  # noqa: E731
    eager = _train(make, 7, lazy=False)
    ae.reset_metrics()
    lazy = _train(make, 7, lazy=True, edit=edit)
    _assert_same(eager, lazy, rtol=1e-5, atol=1e-6)
    m = ae.metrics()
    assert m["optimizer_misses"] == {"traced_elsewhere": 2}, m
    assert m["optimizer_captures"] == 1 and m["optimizer_hot_steps"] == 7 - HOT_AFTER - 1 - 2, m


def test_the_capture_compiles_on_the_programs_thread(monkeypatch):
    """Note [Capture compiles off the step]: PyTorch's compiler is not thread-safe, so Dynamo's
    backend (the trace) runs in the step, on the program's thread, and the compile in a worker
    process."""
    import threading

    threads = []

    def backend(gm, inputs):
        threads.append(threading.current_thread())
        return gm.forward

    monkeypatch.setitem(_optim._DYNAMO_BACKENDS, "replay", backend)
    make = lambda p: torch.optim.AdamW(p, lr=0.01)  # noqa: E731
    eager = _train(make, 6, False)
    ae.reset_metrics()
    lazy = _train(make, 6, True)
    _assert_same(eager, lazy)
    assert threads and all(t is threading.main_thread() for t in threads), threads
    m = ae.metrics()
    assert m["optimizer_captures"] == 1 and m["optimizer_hot_steps"] == 6 - HOT_AFTER - 1, m
    assert "optimizer_uncompiled_steps" not in m


def test_the_capture_is_a_tier_the_environment_can_set():
    """The captures are the top of the ``tiers`` ladder; ``optimizer_capture``, once a setting of
    its own, is refused whatever its value (``background`` too), naming the ladder's value."""
    from adaptive_eager.config import ConfigError, load_options

    assert load_options({}).reaches("capture")  # by default the step is captured
    assert not load_options({"NEURON_EAGER_TIERS": "hot"}).reaches("capture")
    for raw in ("0", "1", "background"):
        with pytest.raises(ConfigError, match=rf"NEURON_EAGER_OPTIMIZER_CAPTURE='{raw}': optimizer_capture is no "
                                              r"longer a setting: .*tiers='hot' \(NEURON_EAGER_TIERS=hot\)"):
            load_options({"NEURON_EAGER_OPTIMIZER_CAPTURE": raw})
    for value in (False, True, "background"):
        with pytest.raises(ConfigError, match="optimizer_capture is no longer a setting: .*tiers='hot'"):
            load_options({}, optimizer_capture=value)


def _adamw(p):
    return torch.optim.AdamW(p, lr=0.01, weight_decay=0.05)


def _wait_for_workers():
    import fuser

    for jobs in fuser.compile_jobs():
        jobs.poll(timeout_s=300)
        while jobs.pending():
            jobs.poll(timeout_s=300)


def _run_script(script, env_extra=None, timeout=600):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_EAGER")}
    env["PYTHONPATH"] = os.path.dirname(__file__) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_capture_compiles_off_the_step_and_a_new_process_loads_it(tmp_path, monkeypatch):
    """Note [Capture compiles off the step]: with async_compile, no compiler runs in this process
    (neither the fuser's in-process compile nor Inductor's), the step's graph runs op by op until
    its artifact lands; a new process on the same cache runs every hot step compiled, with 0
    compiles, within compiled tolerances of eager."""
    import fuser.compile
    import torch._inductor.compile_fx as compile_fx

    here = []
    for owner, name in ((fuser.compile, "compile_program"), (compile_fx, "compile_fx")):
        original = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _o=original, _n=name, **k: here.append(_n) or _o(*a, **k))
    steps = 8
    eager = _train(_adamw, steps, False)
    # the graph compiles once its AOTAutograd trace has landed (Note [Traces off the step] in
    # adaptive_eager._capture)
    wait = lambda i, params, opt: i == 1 and _wait_for_workers()  # noqa: E731
    lazy = _train(_adamw, steps, True, wait, backend="inductor", async_compile=True, cache_dir=str(tmp_path))
    _assert_same(eager, lazy, rtol=1e-5, atol=1e-6)
    m = ae.metrics()
    assert here == [], here
    # captured at its first step (Note [Training captured at once] in adaptive_eager._capture)
    assert m["optimizer_captures"] == 1 and m["optimizer_hot_steps"] == steps - 1, m
    # the capturing step runs the graph too
    assert m["optimizer_compiled_runs"] + m["optimizer_uncompiled_runs"] == m["optimizer_hot_steps"] + 1, m
    _wait_for_workers()
    # the loss's windows are regions whose compiles (lifted scalars, dynamic shapes) follow the
    # workers' timing: the compiles counted are the optimizer graph's
    warm = _run_script(f"""
import json, sys, torch
sys.path[:0] = {sys.path!r}
import adaptive_eager as ae, test_optimizer_capture as t
from adaptive_eager import _capture
import fuser.regions
compiled, graphs = [], []
here = fuser.regions._compile_here
fuser.regions._compile_here = lambda entry, *a: compiled.append(entry.pkey) or here(entry, *a)
obtain = _capture._Graph._obtain
_capture._Graph._obtain = lambda self: (graphs.append(self), obtain(self))[1]
eager = t._train(t._adamw, 8, False)
ae.reset_metrics()
lazy = t._train(t._adamw, 8, True, backend="inductor", cache_dir={str(tmp_path)!r})
t._assert_same(eager, lazy, rtol=1e-5, atol=1e-6)
m = ae.metrics()
m["optimizer_graph_compiles"] = len({{g.entry.pkey for g in graphs if g.who == "optimizer"}} & set(compiled))
print(json.dumps(m))
""")
    assert warm["optimizer_graph_compiles"] == 0, json.dumps(warm)
    assert warm["optimizer_hot_steps"] == 8 - 1, warm
    assert warm["optimizer_compiled_runs"] == warm["optimizer_hot_steps"] + 1, warm  # and the capturing step
    assert warm["optimizer_uncompiled_runs"] == 0 and warm["optimizer_uncompiled_graphs"] == {}, warm


_MODEL_LOOP = """
import json, sys, torch, torch.nn as nn
sys.path[:0] = {path!r}
import adaptive_eager as ae


def train(lazy):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    xs = [torch.randn(5, 8) for _ in range(10)]
    ctx = ae.adaptive_eager(backend="inductor", async_compile=False, cache_dir={cache!r}) if lazy else None
    losses = []
    if ctx:
        ctx.__enter__()
    for x in xs:
        opt.zero_grad()
        loss = (model(x) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if ctx:
        ctx.__exit__(None, None, None)
    return losses, list(model.parameters())


eager = train(False)
ae.reset_metrics()
lazy = train(True)
torch.testing.assert_close(lazy[0], eager[0], rtol=1e-4, atol=1e-5)
for a, b in zip(eager[1], lazy[1]):
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
print(json.dumps(ae.metrics()))
"""


@pytest.mark.slow
def test_a_warm_process_without_a_compiler_runs_every_step_compiled(tmp_path):
    """Issue 32's target: a second process on the same cache, with a C++ compiler that fails (and
    logs its calls) first on the PATH and in CXX/CC, runs the model's captured forward and backward,
    the captured optimizer step and the loss's windows compiled (from the step that captures, the
    first: Note [Training captured at once] in adaptive_eager._capture), and calls no compiler."""
    cache = str(tmp_path / "cache")
    cold = _run_script(_MODEL_LOOP.format(path=sys.path, cache=cache))
    assert cold["optimizer_captures"] == 1 and cold["module_captures"] >= 1, cold
    bin_dir, calls = tmp_path / "bin", tmp_path / "compiler_calls.log"
    bin_dir.mkdir()
    for name in ("g++", "gcc", "cc", "c++", "clang", "clang++"):
        tool = bin_dir / name
        tool.write_text(f"#!/bin/sh\necho {name} \"$@\" >> {calls}\nexit 1\n")
        tool.chmod(0o755)
    failing = str(bin_dir / "g++")
    warm = _run_script(_MODEL_LOOP.format(path=sys.path, cache=cache),
                       {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "CXX": failing,
                        "CC": str(bin_dir / "gcc")})
    assert not calls.exists(), calls.read_text()[:2000]
    assert warm["compiles"] == 0, warm
    assert warm["optimizer_hot_steps"] == 10 - 1, warm  # every step after the capturing one
    assert warm["optimizer_compiled_runs"] == warm["optimizer_hot_steps"] + 1, warm
    assert warm["module_uncompiled_runs"] == 0 and warm["module_compiled_runs"] > 0, warm
    assert warm["optimizer_uncompiled_runs"] == 0, warm
    # windows replay only at their first sight in the process (Note [Tiers] in fuser.regions: the
    # capturing step's, and the last loss's ``item()``), never for want of a compiler
    assert set(warm["replay_reasons"]) <= {"cold"} and warm["compiled_runs"] > 0, json.dumps(warm)
    assert warm["replayed_regions"] <= HOT_AFTER + 1, json.dumps(warm)
    # Note [Captures from the cache] in adaptive_eager._capture: the warm captures ran no AOTAutograd
    # trace, each built from the record the cold process kept
    records = warm["capture_records"]
    assert records.get("module_hit", 0) >= 1 and records.get("optimizer_hit", 0) >= 1, records
    assert not any(k.endswith("_written") for k in records), records


@pytest.mark.parametrize("case", ["adamw_maximize", "sgd_momentum_nesterov_wd"])
def test_a_second_capture_of_the_same_step_is_built_from_its_record(tmp_path, monkeypatch, case):
    """Note [Captures from the cache] in adaptive_eager._capture: the same step captured again (after
    ``torch._dynamo.reset()``, as in a new process) runs no AOTAutograd trace of ours, and its
    values are eager's; a scheduled lr (a graph input after the recapture) is keyed and kept too."""
    from _oracle import count_aot_traces

    traces = count_aot_traces(monkeypatch)
    make = functools.partial(CASES[case], f=False)
    sched = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=3, gamma=0.5)
    kw = {"steps": 8, "backend": "inductor", "cache_dir": str(tmp_path), "sched": sched}
    eager = _train(make, lazy=False, **kw)
    ae.reset_metrics()
    _assert_same(eager, _train(make, lazy=True, **kw))
    first, written = len(traces), ae.metrics()["capture_records"].get("optimizer_written", 0)
    assert first >= 1 and written >= 1, ae.metrics()
    torch._dynamo.reset()
    ae.reset_metrics()
    versions = []
    edit = lambda i, params, opt: versions.append(params[0]._version)
    _assert_same(eager, _train(make, lazy=True, edit=edit, **kw))
    m = ae.metrics()
    # every capture that kept a record is built from it; a capture that did not trace again
    assert len(traces) == 2 * first - written and m["capture_records"].get("optimizer_hit") == written, m
    assert m["optimizer_hot_steps"] >= 1, m
    # Note [Written inputs in a record]: each step bumps the parameters' version, as eager's does
    assert all(b > a for a, b in zip(versions, versions[1:])), versions
