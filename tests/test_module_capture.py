"""A hot module call runs as one guarded call: Note [Captured modules] in adaptive_eager._capture.

Each test trains (or calls) the same tiny model eagerly and under adaptive eager, compares values,
and reads ``metrics()`` for whether the call was captured, ran compiled, or missed and why. The
tests of guards run the captured graphs op by op (``_uncompiled``): what they check is Dynamo's
guards and the fallback, not Inductor.
"""

import functools
import json
import logging
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.nn as nn

import adaptive_eager as ae
from _oracle import count_aot_traces
from adaptive_eager import _capture

HOT_AFTER = 2  # the default: a call that does not train is captured at its third call
RECORDED = 0  # training calls recorded before the capture (Note [Training captured at once])


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def _uncompiled(monkeypatch):
    """The captured graphs run op by op: no artifact is ever looked for (nor a joined one: Note
    [Joined runs] in fuser.joined)."""
    monkeypatch.setattr(_capture._Graph, "_obtain", lambda self: None)
    monkeypatch.setattr(_capture._Graph, "join_request", lambda self, args: None)


def _mlp(norm=nn.LayerNorm):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), norm(16), nn.GELU(), nn.Linear(16, 4))


def _batches(n, rows=5):
    torch.manual_seed(1)
    return [torch.randn(rows, 8) for _ in range(n)]


class _SGD(torch.optim.Optimizer):
    """SGD with momentum, written out: an optimizer the optimizer capture does not take (Note
    [Optimizer capture] in adaptive_eager._optim), so these tests capture the module's calls alone;
    its step still ends the window, as every optimizer's does."""

    def __init__(self, params, lr, momentum=0.9):
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].get("momentum")
                if buf is None:
                    buf = self.state[p]["momentum"] = p.grad.clone()
                else:
                    buf.mul_(group["momentum"]).add_(p.grad)
                p.add_(buf, alpha=-group["lr"])


def _train(model, xs, lazy, edit=None, **options):
    """SGD steps on ``xs``; ``edit(i, model)`` runs before step ``i``. The losses and the model."""
    opt = _SGD(model.parameters(), lr=0.1)
    losses = []
    ctx = ae.adaptive_eager(**options) if lazy else _nothing()
    with ctx:
        for i, x in enumerate(xs):
            if edit is not None:
                edit(i, model)
            opt.zero_grad()
            loss = (model(x) ** 2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.detach().clone())
    return torch.stack(losses), model


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _assert_same(eager, lazy, exact=False):
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(lazy[0], eager[0], **tol)
    for a, b in zip(eager[1].parameters(), lazy[1].parameters()):
        torch.testing.assert_close(b, a, **tol)


def test_training_matches_eager_with_forward_and_backward_compiled(tmp_path):
    steps = 8
    eager = _train(_mlp(), _batches(steps), False)
    lazy = _train(_mlp(), _batches(steps), True, async_compile=False, cache_dir=str(tmp_path))
    _assert_same(eager, lazy)
    m = ae.metrics()
    assert m["module_captures"] == 1
    assert m["module_captured_calls"] == steps - RECORDED
    # compiled in the capturing step (async_compile off), and every later forward and backward ran
    # the artifact: the backward went through the captured call
    assert m["module_compiled_runs"] == 2 * (steps - RECORDED), m
    assert m["module_uncompiled_runs"] == 0
    assert m["module_capture_misses"] == {}


class _Recurrence(nn.Module):
    """A recurrent cell unrolled in its forward (benchmarks/user_step.py's), over ``steps`` rows."""

    def __init__(self, steps=6):
        super().__init__()
        self.steps = steps
        self.inp, self.hid, self.out = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, xs):
        h = torch.zeros(3, 8)
        for t in range(self.steps):
            h = torch.tanh(self.inp(xs[t]) + self.hid(h))
        return self.out(h)


def _saved(partition_fn, module, x):
    """How many tensors AOTAutograd's forward saves for the backward of ``module(x).sum()`` split by
    ``partition_fn``."""
    from torch._functorch.aot_autograd import aot_module_simplified

    saved = []

    def forward(gm, _):
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        saved.append(len(outputs) - 1)  # one user output
        return gm

    def backward(gm, _):
        return gm

    class _Tupled(nn.Module):  # aot_module_simplified takes a graph with tuple outputs
        def __init__(self):
            super().__init__()
            self.inner = module

        def forward(self, x):
            return (self.inner(x),)

    gm = torch.fx.symbolic_trace(_Tupled())
    aot_module_simplified(gm, [x], fw_compiler=forward, bw_compiler=backward, partition_fn=partition_fn)
    return saved[0]


def test_captured_graphs_are_split_as_torch_compile_splits_them_but_around_convolutions():
    """Note [The forward and backward partition] in adaptive_eager._capture: with Inductor, the
    min-cut partition (fewer saved tensors: a recurrence saves neither a weight's transpose nor a
    tensor twice); the default one where the graph has a convolution, and on the other backends."""
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

    from adaptive_eager.config import Options

    torch.manual_seed(0)
    cell, xs = _Recurrence(), torch.randn(6, 3, 4)
    ours = _capture._partition_fn(Options(device="cpu", backend="inductor"))
    assert _saved(ours, cell, xs) < _saved(default_partition, cell, xs)
    assert _capture._partition_fn(Options(backend="stablehlo", device="neuron")) is default_partition
    # a graph where min-cut would save one tensor fewer: here the default's count
    conv = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3))
    image = torch.randn(2, 3, 8, 8)
    min_cut = functools.partial(min_cut_rematerialization_partition, compiler="inductor")
    assert _saved(ours, conv, image) == _saved(default_partition, conv, image) > _saved(min_cut, conv, image)


def test_the_stance_is_set_as_dynamos_set_stance_sets_it(monkeypatch):
    """``_capture.swap_stance``: Dynamo's stance for a captured call, as ``eval_frame._set_stance``
    sets it; a torch whose function does more gets its function."""
    from torch._dynamo import eval_frame

    stance = _capture._fail_on_recompile()
    prior = _capture.swap_stance(stance)
    try:
        assert eval_frame._stance is stance
    finally:
        assert _capture.swap_stance(prior) is stance
    assert eval_frame._stance is prior
    calls = []

    def other_set_stance(new):
        calls.append(new)  # a name the known function does not use
        return prior

    monkeypatch.setattr(eval_frame, "_set_stance", other_set_stance)
    _capture._stance_parts.cache_clear()
    try:
        assert _capture.swap_stance(stance) is prior and calls == [stance]
    finally:
        monkeypatch.undo()
        _capture._stance_parts.cache_clear()


def test_a_recurrent_cell_trains_as_eager_with_its_graphs_compiled(tmp_path):
    """The min-cut partition recomputes in the backward what the forward no longer saves: eager's
    values within compiled tolerances, every call compiled."""
    steps = 6
    torch.manual_seed(2)
    xs = [torch.randn(5, 3, 4) for _ in range(steps)]

    def cell():
        torch.manual_seed(0)
        return _Recurrence(5)

    eager = _train(cell(), xs, False)
    lazy = _train(cell(), xs, True, async_compile=False, cache_dir=str(tmp_path))
    _assert_same(eager, lazy)
    m = ae.metrics()
    assert m["module_compiled_runs"] == 2 * (steps - RECORDED) and m["module_uncompiled_runs"] == 0, m


def test_inductors_loss_window_and_backward_run_apart(tmp_path):
    """Note [Joined runs] in fuser.joined: Inductor's runs are not joined (tests/test_neuron_capture.py
    has the backends whose runs are): the loss window runs its own compiled region and the captured
    backward its artifact, eager's values, and no joined program is ever compiled."""
    import fuser.joined

    joins = []
    steps = 8
    eager = _train(_mlp(), _batches(steps), False)
    ae.reset_metrics()
    original = fuser.joined.try_joined
    fuser.joined.try_joined = lambda *a: joins.append(a) or original(*a)
    try:
        lazy = _train(_mlp(), _batches(steps), True, async_compile=False, cache_dir=str(tmp_path))
    finally:
        fuser.joined.try_joined = original
    _assert_same(eager, lazy)
    m = ae.metrics()
    assert joins == [] and m["joined_runs"] == 0 and not m["not_joined"], m
    assert m["module_compiled_runs"] == 2 * (steps - RECORDED) and m["module_uncompiled_runs"] == 0, m


def test_the_compile_is_off_the_step_and_a_new_process_loads_it(tmp_path, monkeypatch):
    """With async_compile, the graphs go to a worker: nothing compiles on the program's thread
    (the in-process compile entry is never called), the graphs run op by op meanwhile; a new
    process on the same cache loads them and compiles nothing."""
    import fuser.compile

    here = []
    original = fuser.compile.compile_program
    monkeypatch.setattr(fuser.compile, "compile_program", lambda *a: here.append(1) or original(*a))
    steps = 6
    eager = _train(_mlp(), _batches(steps), False)
    # the graphs compile once their AOTAutograd trace has landed (Note [Traces off the step])
    wait = lambda i, model: i == RECORDED + 1 and _wait_for_workers()  # noqa: E731
    lazy = _train(_mlp(), _batches(steps), True, wait, async_compile=True, cache_dir=str(tmp_path))
    _assert_same(eager, lazy)
    m = ae.metrics()
    assert here == []
    assert m["module_captured_calls"] == steps - RECORDED
    assert m["module_uncompiled_runs"] > 0
    import fuser

    for jobs in fuser.compile_jobs():  # the worker's compiles land
        jobs.poll(timeout_s=300)
        while jobs.pending():
            jobs.poll(timeout_s=300)
    script = f"""
import json, sys, time, torch
sys.path[:0] = {sys.path!r}
import adaptive_eager as ae, test_module_capture as t
m = t._mlp(); xs = t._batches(40)
opt = t._SGD(m.parameters(), lr=0.1, momentum=0.0)
with ae.adaptive_eager(async_compile=True, cache_dir={str(tmp_path)!r}):
    for x in xs:
        opt.zero_grad(); (m(x) ** 2).mean().backward(); opt.step()
        if ae.metrics()["module_compiled_runs"] >= 4:
            break
        time.sleep(0.2)
print(json.dumps(ae.metrics()))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_EAGER")}
    env["PYTHONPATH"] = os.path.dirname(__file__) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    warm = json.loads(out.stdout.strip().splitlines()[-1])
    assert warm["compiles"] == 0, warm
    assert warm["module_compiled_runs"] >= 4, warm
    assert warm["cache_hits_disk"] >= 2, warm  # the forward's and the backward's artifacts


@pytest.mark.parametrize("edit, cause", [
    (lambda i, m: None, None),
    (lambda i, m: m[0].weight.requires_grad_(i < 4), "requires_grad"),
    (lambda i, m: m.train(i % 4 != 3), "train_eval"),
], ids=["none", "requires_grad", "train_eval"])
def test_a_guard_miss_falls_back_and_recaptures(_uncompiled, edit, cause):
    steps = 8
    model = lambda: _mlp(nn.BatchNorm1d)  # BatchNorm reads ``training``
    eager = _train(model(), _batches(steps), False, edit=edit)
    lazy = _train(model(), _batches(steps), True, edit=edit)
    _assert_same(eager, lazy)
    m = ae.metrics()
    assert m["module_captured_calls"] > 0
    if cause is None:
        assert m["module_capture_misses"] == {}
    else:
        assert m["module_capture_misses"].get(cause, 0) >= 1, m["module_capture_misses"]
        assert m["module_captures"] >= 2


class _Masked(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 4)

    def forward(self, x, mask=None):
        y = self.lin(x)
        return y if mask is None else y * mask


def test_a_call_with_other_arguments_misses_as_arguments_and_the_log_names_the_guard(_uncompiled, caplog):
    """explain() sends a user to NEURON_EAGER_LOG=info for a guard it cannot classify; nothing logged
    the guard, so that advice led nowhere. A miss now logs its first failed guard at info, and a
    call whose keyword arguments differ from the capture's (Hugging Face's generate(): its first
    token's call passes other keywords than the next tokens') has a cause of its own."""
    xs = _batches(6)
    mask = torch.rand(5, 4)

    def run(lazy):
        model = _Masked()
        outs = []
        # log=: an earlier test that set the library's log level leaves the mode's entry setting it
        with ae.adaptive_eager(log="info") if lazy else _nothing():
            for i, x in enumerate(xs):
                outs.append(model(x) if i < 3 else model(x, mask=mask))  # the fourth call adds a keyword
            out = torch.stack(outs)
        return out.detach()

    eager = run(False)
    with caplog.at_level(logging.INFO, logger="adaptive_eager"):
        lazy = run(True)
    torch.testing.assert_close(lazy, eager, rtol=1e-4, atol=1e-5)
    m = ae.metrics()
    assert m["module_capture_misses"].get("arguments", 0) >= 1, m["module_capture_misses"]
    logged = [r.getMessage() for r in caplog.records if "missed its guards" in r.getMessage()]
    assert logged and "_Masked missed its guards (arguments): not kwargs" in logged[0], logged


def test_a_capture_tokenizes_no_source_file_unless_dynamos_line_logs_are_on(_uncompiled):
    """Note [Dynamo's work for nothing] in adaptive_eager._capture: Dynamo tokenized every source file
    a capture traced, for a debug log that was off. While the mode is on, the lookup answers None
    with the logs off and Dynamo's name with ``trace_call`` on; leaving the mode puts Dynamo's back."""
    from torch._dynamo import funcname_cache, symbolic_convert

    dynamos = symbolic_convert.get_funcname
    funcname_cache.clearcache()
    eager = _train(_mlp(), _batches(3), False)
    lazy = _train(_mlp(), _batches(3), True)
    _assert_same(eager, lazy)
    assert ae.metrics()["module_captures"] == 1
    assert not [f for f in funcname_cache.cache if f.endswith(("test_module_capture.py", "linear.py"))], \
        list(funcname_cache.cache)
    line = _Masked.forward.__code__.co_firstlineno + 2  # inside ``forward``
    with ae.adaptive_eager():
        _train(_mlp(), _batches(1), False)  # a capture inside the mode
        assert symbolic_convert.get_funcname is not dynamos
        assert symbolic_convert.get_funcname(__file__, line) is None
        torch._logging.set_logs(trace_call=True)
        try:
            assert symbolic_convert.get_funcname(__file__, line) == "_Masked.forward"
        finally:
            torch._logging.set_logs()
    assert symbolic_convert.get_funcname is dynamos


def test_a_new_batch_size_misses_and_gives_eagers_values(_uncompiled):
    xs = _batches(5) + _batches(3, rows=3) + _batches(3)
    eager = _train(_mlp(), xs, False)
    lazy = _train(_mlp(), xs, True)
    _assert_same(eager, lazy)
    m = ae.metrics()
    # the first small batch runs recorded, the second recaptures; the old entry serves the rest
    assert m["module_capture_misses"]["shape"] == 2
    assert m["module_captures"] == 2
    assert m["module_captured_calls"] == len(xs) - RECORDED - 1


def test_batches_out_of_the_programs_dynamic_compile_are_captured_with_static_shapes(_uncompiled):
    """Note [Static captures]: the program's own torch.compile, having seen two batch sizes,
    compiles the batch dimension symbolically and marks its outputs (AOTAutograd's unguarded
    ``_dynamo_propagated_dynamic_indices``). Our trace made that dimension symbolic too: the graphs
    took a SymInt input and ran op by op for good (``non_tensor_input``), the capture and its
    recapture at a new batch size alike. The marks are the program's again after each trace."""
    double = torch.compile(lambda t: t * 2, backend="aot_eager")
    double(torch.randn(2, 8))
    xs = [double(x) for x in _batches(4) + _batches(3, rows=3)]
    assert all(getattr(x, _capture._MARK, None) == {0} for x in xs)
    eager = _train(_mlp(), xs, False)
    lazy = _train(_mlp(), xs, True)
    _assert_same(eager, lazy)
    m = ae.metrics()
    assert m["module_uncompiled_graphs"] == {}, m
    assert m["module_captures"] == 2 and m["module_capture_misses"]["shape"] == 2, m
    assert all(getattr(x, _capture._MARK, None) == {0} for x in xs)


@pytest.mark.parametrize("checked", [True, False], ids=["checked-first", "refused-by-dynamo"])
def test_a_call_while_another_thread_traces_runs_recorded(_uncompiled, monkeypatch, checked):
    """Dynamo refuses a compiled call while FX traces (up to torch 2.13 in any thread: a region
    compiling in another thread, tests/test_threads.py): that call, a capture's or a captured
    one's, runs recorded, is counted, and the next call is captured or runs captured."""
    from torch.fx import _symbolic_trace

    if not checked:  # the other thread begins to trace between the check and the call
        monkeypatch.setattr(_capture, "traced_elsewhere", lambda: False)

    def edit(i, model):  # FX traces during the first capture's call (2) and a captured call (4)
        if hasattr(_symbolic_trace, "_is_fx_tracing_tls"):  # torch 2.14: a flag per thread
            monkeypatch.setattr(_symbolic_trace._is_fx_tracing_tls, "flag", i in (2, 4), raising=False)
        else:
            monkeypatch.setattr(_symbolic_trace, "_is_fx_tracing_flag", i in (2, 4))

    steps = 7
    eager = _train(_mlp(), _batches(steps), False, edit=edit)
    lazy = _train(_mlp(), _batches(steps), True, edit=edit)
    _assert_same(eager, lazy)
    m = ae.metrics()
    assert m["module_capture_misses"] == {"traced_elsewhere": 2}, m
    assert m["module_captures"] == 1 and m["module_captured_calls"] == steps - RECORDED - 2, m


_FIRST_STEPS = """
import json, sys, torch
sys.path[:0] = {path!r}
import adaptive_eager as ae, test_module_capture as t
import fuser.artifacts

KEYS = ("module_captures", "optimizer_captures", "module_compiled_runs", "module_uncompiled_runs",
        "optimizer_compiled_runs", "optimizer_uncompiled_runs")


def train(options):
    model = t._mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    steps = []
    with ae.adaptive_eager(**options):
        for x in t._batches(6):
            before = ae.metrics()
            opt.zero_grad()
            (model(x) ** 2).mean().backward()
            opt.step()
            after = ae.metrics()
            steps.append({{k: after[k] - before[k] for k in KEYS}})
    return steps, [p.detach().tolist() for p in model.parameters()]


runs = [train(options) for options in {runs!r}]
workers = [w for jobs in fuser.artifacts.compile_jobs() for w in jobs._workers]
print(json.dumps({{"runs": runs, "records": ae.metrics()["capture_records"], "workers": len(workers)}}))
"""


def _steps_child(tmp_path, runs) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_EAGER")}
    env["NEURON_EAGER_CACHE_DIR"] = str(tmp_path)
    env["PYTHONPATH"] = os.path.dirname(__file__) + os.pathsep + env.get("PYTHONPATH", "")
    script = _FIRST_STEPS.format(path=sys.path, runs=runs)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_training_is_captured_at_its_first_step_and_a_warm_process_runs_compiled_from_its_second(tmp_path):
    """Note [Training captured at once]: a module called with grad on and trainable parameters is
    captured at its first call and the optimizer at its first step, in a cold process (twice: a
    second model too) and in a warm one, whose second step runs every captured graph compiled
    (Note [Loads in the capturing step]: each artifact is loaded in the step that captured). The
    capture's record stops the compile worker's warm-up (Note [Warm workers] in neff_cache.jobs):
    nothing was compiled, so no worker is left."""
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x in _batches(6):
        opt.zero_grad()
        (model(x) ** 2).mean().backward()
        opt.step()
    first = _steps_child(tmp_path, [{"async_compile": False}, {"async_compile": False}])
    for steps, _ in first["runs"]:
        assert [i for i, s in enumerate(steps) if s["module_captures"]] == [0], steps
        assert [i for i, s in enumerate(steps) if s["optimizer_captures"]] == [0], steps
    warm = _steps_child(tmp_path, [{}])
    (steps, params), = warm["runs"]
    assert [i for i, s in enumerate(steps) if s["module_captures"]] == [0], steps
    assert [i for i, s in enumerate(steps) if s["optimizer_captures"]] == [0], steps
    for s in steps[1:]:
        assert s["module_compiled_runs"] >= 1 and s["optimizer_compiled_runs"] == 1, steps
        assert s["module_uncompiled_runs"] == 0 and s["optimizer_uncompiled_runs"] == 0, steps
    assert warm["workers"] == 0, warm
    for run in (*first["runs"], warm["runs"][0]):
        for got, want in zip(run[1], model.parameters(), strict=True):
            torch.testing.assert_close(torch.tensor(got), want.detach(), rtol=1e-4, atol=1e-5)


def _dropout_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.GELU(), nn.Linear(16, 4), nn.Dropout(0.3))


def _outputs(model, xs, lazy, edit=None, **options):
    """Training steps that keep each forward's output and, after them, the generator's next draws;
    ``edit(i, model)`` runs before step ``i``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outs = []
    with ae.adaptive_eager(**options) if lazy else _nothing():
        for i, x in enumerate(xs):
            if edit is not None:
                edit(i, model)
            opt.zero_grad()
            y = model(x)
            (y ** 2).mean().backward()
            opt.step()
            outs.append(y.detach().clone())
        after = torch.rand(3)
    return outs, after


def _assert_eagers_draws(eager, lazy):
    """Every dropout mask is eager's (the zeros of each output, bit for bit), the values are within
    compiled tolerances, and the generator is where eager's is."""
    for a, b in zip(eager[0], lazy[0]):
        assert torch.equal(a == 0, b == 0)
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    assert torch.equal(lazy[1], eager[1])


@pytest.mark.parametrize("compiled", [False, True])
def test_dropout_is_captured_with_eagers_random_numbers(tmp_path, monkeypatch, compiled):
    """Note [Masks drawn by the call]: a forward with dropout is captured; each call draws eager's
    masks in eager's order, op by op and compiled."""
    if not compiled:
        monkeypatch.setattr(_capture._Graph, "_obtain", lambda self: None)
        monkeypatch.setattr(_capture._Graph, "join_request", lambda self, args: None)
    steps = 6
    torch.manual_seed(5)
    eager = _outputs(_dropout_model(), _batches(steps), False)
    torch.manual_seed(5)
    lazy = _outputs(_dropout_model(), _batches(steps), True, async_compile=False, cache_dir=str(tmp_path))
    _assert_eagers_draws(eager, lazy)
    m = ae.metrics()
    assert m["module_capture_misses"] == {}, m["module_capture_misses"]
    assert m["module_captured_calls"] == steps - RECORDED
    key = "module_compiled_runs" if compiled else "module_uncompiled_runs"
    assert m[key] == 2 * (steps - RECORDED), m


def test_dropout_masks_are_drawn_from_a_record_as_from_a_trace(tmp_path, monkeypatch):
    """Note [Captures from the cache]: a capture rebuilt from its record draws the same masks."""
    traces = count_aot_traces(monkeypatch)
    steps = 5
    torch.manual_seed(5)
    eager = _outputs(_dropout_model(), _batches(steps), False)
    traced = []
    for hit in ("module_written", "module_hit"):
        traced.append(len(traces))
        torch._dynamo.reset()
        ae.reset_metrics()
        torch.manual_seed(5)
        lazy = _outputs(_dropout_model(), _batches(steps), True, async_compile=False, cache_dir=str(tmp_path))
        _assert_eagers_draws(eager, lazy)
        assert ae.metrics()["capture_records"].get(hit) == 1, ae.metrics()["capture_records"]
    assert len(traces) == traced[1] > traced[0], traces  # the first run traced, the second did not


@pytest.mark.parametrize("async_compile", [False, True])
def test_a_forward_with_another_random_op_is_not_captured_and_keeps_eagers_random_numbers(async_compile):
    """Only dropout's mask is drawn by the call: a forward that draws otherwise (here ``randn_like``)
    stays recorded, counted, with eager's numbers. In the step, the trace declines the graph; with
    async compiles the worker's trace does (Note [Traces off the step]), and until then Dynamo's
    graph runs eagerly, drawing eager's random numbers."""

    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, x):
            return self.lin(x + 0.1 * torch.randn_like(x))

    steps = 6
    # the next call polls for the worker's answer: past the poll interval
    wait = (lambda i, m: i == RECORDED + 1 and (_wait_for_workers(), time.sleep(_capture._POLL_S))) \
        if async_compile else None
    torch.manual_seed(0)
    eager = _outputs(Noisy(), _batches(steps), False)
    torch.manual_seed(0)
    lazy = _outputs(Noisy(), _batches(steps), True, wait, async_compile=async_compile)
    for a, b in zip(eager[0], lazy[0]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    assert torch.equal(lazy[1], eager[1])
    m = ae.metrics()
    if async_compile:  # one call ran Dynamo's graph, the next traced in the step, which declined
        assert m["capture_records"].get("module_trace_declined:random") == 1, m["capture_records"]
        assert m["module_capture_misses"]["random"] == steps - RECORDED - 1, m
        assert m["module_captures"] == 1 and m["module_captured_calls"] == 1, m
    else:
        assert m["module_capture_misses"]["random"] == steps - RECORDED
        assert m["module_captures"] == 0 and m["module_captured_calls"] == 0
    assert "random" in ae.explain()


def test_the_capturing_call_runs_dynamos_graph_even_when_the_worker_has_answered(monkeypatch):
    """The capturing call runs Dynamo's graph whatever the worker's speed: here its trace has
    declined before that call begins (as a fast worker's may while Dynamo builds its guards), and
    still only the later calls trace in the step (the test above failed by that race under load)."""
    start = _capture._Interim.start

    def start_and_wait(*args, **kwargs):
        interim = start(*args, **kwargs)
        _wait_for_workers()
        time.sleep(_capture._POLL_S)
        return interim

    monkeypatch.setattr(_capture._Interim, "start", classmethod(lambda cls, *a, **k: start_and_wait(*a, **k)))

    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, x):
            return self.lin(x - 0.1 * torch.randn_like(x))

    steps = 4
    torch.manual_seed(0)
    eager = _outputs(Noisy(), _batches(steps), False)
    torch.manual_seed(0)
    lazy = _outputs(Noisy(), _batches(steps), True, async_compile=True)
    for a, b in zip(eager[0], lazy[0]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    assert torch.equal(lazy[1], eager[1])
    m = ae.metrics()
    assert m["capture_records"].get("module_trace_declined:random") == 1, m["capture_records"]
    assert m["module_capture_misses"]["random"] == steps - RECORDED - 1, m["module_capture_misses"]
    assert m["module_uncompiled_runs"] == 1, m


def test_a_module_with_hooks_is_not_captured_and_its_hooks_run(_uncompiled):
    seen = []
    steps = 5
    for lazy in (False, True):
        model = _mlp()
        model[1].register_forward_hook(lambda mod, args, out: seen.append(out.shape))
        _train(model, _batches(steps), lazy)
    assert len(seen) == 2 * steps
    m = ae.metrics()
    assert m["module_capture_misses"]["hooks"] == steps - HOT_AFTER  # not capturable: not captured at once
    assert m["module_captured_calls"] == 0


def test_inference_under_no_grad_after_training(_uncompiled):
    xs = _batches(6)
    probe = torch.randn(4, 8)
    results = []
    for lazy in (False, True):
        model, outs = _mlp(), []
        _train(model, xs, lazy)
        with ae.adaptive_eager() if lazy else _nothing():
            for _ in range(4):
                with torch.no_grad():
                    outs.append(model(probe))
                with torch.inference_mode():
                    outs.append(model(probe))
        results.append(torch.stack(outs))
    torch.testing.assert_close(results[1], results[0])
    assert ae.metrics()["module_capture_misses"].get("grad_mode", 0) >= 1


def test_only_a_training_call_is_captured_at_its_first_call(_uncompiled):
    """Note [Training captured at once]: grad on with a trainable parameter, or an input that
    requires grad (a loss module), is captured at the first call; under ``no_grad``, or a frozen
    module on inputs that need no grad, at call ``hot_after + 1``."""
    def captured_at(model, grad=True, x_grad=False, **options):
        calls = []
        with ae.adaptive_eager(**options), torch.set_grad_enabled(grad):
            for i, x in enumerate(_batches(5)):
                before = ae.metrics()["module_captures"]
                model(x.requires_grad_(x_grad))
                if ae.metrics()["module_captures"] > before:
                    calls.append(i + 1)
        return calls

    assert captured_at(_mlp()) == [1]
    assert captured_at(_mlp().requires_grad_(False), x_grad=True) == [1]
    assert captured_at(_mlp(), grad=False) == [HOT_AFTER + 1]
    assert captured_at(_mlp().requires_grad_(False)) == [HOT_AFTER + 1]


def test_no_trace_while_another_thread_has_the_mode_on(_uncompiled):
    """Note [Traces beside other threads]: Dynamo's compile makes ``torch.compiler.is_compiling()``
    true in every thread, so nothing is captured while another thread has the mode on (counted as
    ``threads``); once it is off, the next training call is captured."""
    on, off = threading.Event(), threading.Event()

    def other():
        with ae.adaptive_eager():
            on.set()
            off.wait(60)

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    assert on.wait(60)
    model, xs = _mlp(), _batches(4)
    try:
        eager = _train(_mlp(), xs[:3], False)
        lazy = _train(model, xs[:3], True)
    finally:
        off.set()
        thread.join(60)
    _assert_same(eager, lazy)
    m = ae.metrics()
    assert m["module_captures"] == 0 and m["module_capture_misses"] == {"threads": 3}, m
    _train(model, xs[3:], True)
    assert ae.metrics()["module_captures"] == 1, ae.metrics()


def test_off_switch_records_every_call(_uncompiled):
    steps = 4
    eager = _train(_mlp(), _batches(steps), False)
    lazy = _train(_mlp(), _batches(steps), True, tiers="hot")
    _assert_same(eager, lazy)
    assert ae.metrics()["module_captured_calls"] == 0


@pytest.mark.parametrize("compiled", [False, True])
def test_a_second_capture_of_the_same_graph_is_built_from_its_record(tmp_path, monkeypatch, compiled):
    """Note [Captures from the cache]: a module of the same structure, captured again (here after
    ``torch._dynamo.reset()``, as in a new process), runs no AOTAutograd trace, and trains as eager
    does, op by op (its Program) and compiled."""
    if not compiled:  # as _uncompiled does
        monkeypatch.setattr(_capture._Graph, "_obtain", lambda self: None)
        monkeypatch.setattr(_capture._Graph, "join_request", lambda self, args: None)
    traces = count_aot_traces(monkeypatch)
    steps = 6
    eager = _train(_mlp(), _batches(steps), False)
    options = {"async_compile": False, "cache_dir": str(tmp_path)}
    first = _train(_mlp(), _batches(steps), True, **options)
    _assert_same(eager, first)
    assert len(traces) == 1 and ae.metrics()["capture_records"] == {"module_written": 1}, ae.metrics()
    torch._dynamo.reset()
    ae.reset_metrics()
    second = _train(_mlp(), _batches(steps), True, **options)
    _assert_same(eager, second)
    m = ae.metrics()
    assert len(traces) == 1 and m["capture_records"] == {"module_hit": 1}, m
    assert m["module_captures"] == 1 and m["module_captured_calls"] == steps - RECORDED, m
    key = "module_compiled_runs" if compiled else "module_uncompiled_runs"
    assert m[key] == 2 * (steps - RECORDED), m


class _Writes(nn.Module):
    """A module whose capture keeps no record: it writes its input, which requires grad, or
    returns a view of it (Note [Captures from the cache])."""

    def __init__(self, how):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.how = nn.Linear(8, 4), how

    def forward(self, x):
        if self.how == "written_input_requires_grad":
            x.mul_(2)
        out = self.lin(x)
        return (out, x.view(-1)) if self.how == "aliased_output" else (out, None)


@pytest.mark.parametrize("how", ["written_input_requires_grad", "aliased_output"])
def test_a_graph_whose_wrapper_is_not_ours_keeps_no_record(_uncompiled, tmp_path, monkeypatch, how):
    """Counted with its cause; the next capture traces again and gives eager's values."""
    traces = count_aot_traces(monkeypatch)

    def run(lazy):
        model, grads = _Writes(how), []
        with ae.adaptive_eager(cache_dir=str(tmp_path), async_compile=False) if lazy else _nothing():
            for i, a in enumerate(_batches(5)):
                a = a.clone().requires_grad_()
                out, view = model(a * 1)
                (out.sum() + (0 if view is None else view.sum())).backward()
                grads.append(a.grad)
        return torch.stack(grads), model

    eager = run(False)
    for _ in range(2):
        torch._dynamo.reset()
        _assert_same(eager, run(True))
    assert len(traces) == 2
    assert ae.metrics()["capture_records"] == {f"module_declined:{how}": 2}


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def _images(n):
    torch.manual_seed(1)
    return [torch.randn(4, 3, 8, 8) for _ in range(n)]


def _cnn_run(lazy, steps, **options):
    """``_train`` of ``_cnn``, then in eval mode four calls on a probe: the losses, the model, the
    probe's outputs and ``running_mean``'s version after each training step."""
    model, versions = _cnn(), []
    edit = lambda i, m: versions.append(m[1].running_mean._version)
    losses, model = _train(model, _images(steps), lazy, edit=edit, **options)
    versions.append(model[1].running_mean._version)
    model.eval()
    torch.manual_seed(2)
    probe = torch.randn(2, 3, 8, 8)
    with ae.adaptive_eager(**options) if lazy else _nothing():
        outs = [model(probe).detach() for _ in range(4)]
    return losses, model, torch.stack(outs), versions[1:]


def _assert_same_cnn(eager, lazy):
    _assert_same(eager[:2], lazy[:2])
    for (name, a), b in zip(eager[1].named_buffers(), lazy[1].buffers()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(lazy[2], eager[2], rtol=1e-4, atol=1e-5)


def test_a_cnn_with_batchnorm_is_built_from_its_record_in_a_new_process(tmp_path, monkeypatch):
    """Note [Written inputs in a record]: a training graph that writes BatchNorm's running
    statistics keeps a record; a new process on the same cache builds its captures from the
    records (no AOTAutograd trace), runs the artifacts, and gives eager's losses, parameters,
    running statistics, ``num_batches_tracked`` and outputs in eval mode; every captured call
    bumps the statistics' version, as eager's in-place update does."""
    traces = count_aot_traces(monkeypatch)
    steps = 5
    eager = _cnn_run(False, steps)
    first = _cnn_run(True, steps, async_compile=False, cache_dir=str(tmp_path))
    _assert_same_cnn(eager, first)
    m = ae.metrics()
    assert not [k for k in m["capture_records"] if "_declined" in k or "_unkeyed" in k], m["capture_records"]
    assert m["capture_records"].get("module_written", 0) >= 2 and len(traces) >= 2, (m["capture_records"], traces)
    script = f"""
import json, sys, torch
sys.path[:0] = {sys.path!r}
import adaptive_eager as ae, test_module_capture as t
from _oracle import count_aot_traces
traces = count_aot_traces(type("MonkeyPatch", (), {{"setattr": staticmethod(setattr)}}))
losses, model, outs, versions = t._cnn_run(True, {steps}, async_compile=False)
print(json.dumps({{"metrics": ae.metrics(), "traces": len(traces), "losses": losses.tolist(),
                  "state": {{k: v.tolist() for k, v in model.state_dict().items()}},
                  "outs": outs.tolist(), "versions": versions}}))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_EAGER")}
    env["NEURON_EAGER_CACHE_DIR"] = str(tmp_path)
    env["PYTHONPATH"] = os.path.dirname(__file__) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    warm = json.loads(out.stdout.strip().splitlines()[-1])
    m = warm["metrics"]
    assert warm["traces"] == 0, m["capture_records"]
    assert m["capture_records"].get("module_hit", 0) >= 2, m["capture_records"]
    assert not [k for k in m["capture_records"] if k != "module_hit"], m["capture_records"]
    # the captured graphs' artifacts come from disk (the steps' other windows may compile: the
    # first process may have found their regions in memory, made by another test)
    assert m["module_uncompiled_runs"] == 0 and m["module_uncompiled_graphs"] == {}, m
    assert m["module_compiled_runs"] >= 2 * (steps - RECORDED), m
    model = _cnn()
    model.load_state_dict({k: torch.tensor(v, dtype=model.state_dict()[k].dtype) for k, v in warm["state"].items()})
    _assert_same_cnn(eager, (torch.tensor(warm["losses"]), model, torch.tensor(warm["outs"])))
    versions = warm["versions"]  # after each training call, all captured, and after the last
    assert all(b > a for a, b in zip(versions, versions[1:])), warm["versions"]


def test_a_max_pool_is_captured_in_a_process_that_never_compiled_with_inductor(tmp_path):
    """Inductor's decomposition of max_pool2d_with_indices calls into Inductor's lowering without
    importing it: a process that never compiled with Inductor captures a model with MaxPool2d."""
    script = f"""
import json, sys, torch, torch.nn as nn
sys.path[:0] = {sys.path!r}
import adaptive_eager as ae, test_module_capture as t
from adaptive_eager import _capture
_capture._Graph._obtain = lambda self: None
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(36, 2))
xs = [torch.randn(2, 3, 8, 8) for _ in range(4)]
eager = t._train(model, xs, False)[0]
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(36, 2))
lazy = t._train(model, xs, True)[0]
torch.testing.assert_close(lazy, eager, rtol=1e-4, atol=1e-5)
print(json.dumps(ae.metrics()))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_EAGER")}
    env["NEURON_EAGER_CACHE_DIR"] = str(tmp_path)  # a cache of its own: no hint of an earlier run
    env["PYTHONPATH"] = os.path.dirname(__file__) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["module_captures"] == 1 and m["module_capture_misses"] == {}, m
    assert m["module_captured_calls"] == 4 - RECORDED, m


def _train_adamw(steps, lazy, wait_at=None, **options):
    """The MLP trained with AdamW (its step captured too); the jobs of the workers are waited for after
    step ``wait_at``. The losses and the model."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = []
    with ae.adaptive_eager(backend="inductor", **options) if lazy else _nothing():
        for i, x in enumerate(_batches(steps)):
            opt.zero_grad()
            loss = (model(x) ** 2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.detach().clone())
            if i == wait_at:
                _wait_for_workers()
    return torch.stack(losses), model


def _wait_for_workers():
    import fuser

    for jobs in fuser.compile_jobs():
        while jobs.pending():
            jobs.poll(timeout_s=300)


def test_the_aot_trace_runs_in_the_worker_and_its_record_takes_over(tmp_path, monkeypatch):
    """Note [Traces off the step] in adaptive_eager._capture: with async compiles, the capturing step
    runs no AOTAutograd trace (the module's and the optimizer step's graphs run as Dynamo made them,
    eagerly), the worker's records land, and the later steps run the graphs built from them, with
    eager's values."""
    traces = count_aot_traces(monkeypatch)
    graphs = []
    call = _capture._Graph.__call__
    monkeypatch.setattr(_capture._Graph, "__call__", lambda self, *a: graphs.append(self.who) or call(self, *a))
    steps = 8
    eager = _train_adamw(steps, False)
    lazy = _train_adamw(steps, True, wait_at=RECORDED, cache_dir=str(tmp_path))
    _assert_same(eager, lazy)
    m = ae.metrics()
    assert traces == [], m["capture_records"]
    records = m["capture_records"]
    for who in ("module", "optimizer"):
        assert records.get(f"{who}_trace_submitted") == 1 and records.get(f"{who}_trace_landed") == 1, records
        assert f"{who}_trace_in_step" not in records, records
    # the steps after the wait ran the records' graphs: forward, backward and the optimizer's
    assert graphs.count("module") >= 2 * (steps - RECORDED - 1), graphs
    assert graphs.count("optimizer") >= steps - RECORDED - 1, graphs
    assert m["module_captured_calls"] == steps - RECORDED and m["optimizer_hot_steps"] == steps - RECORDED - 1, m


# a program whose captures' records it never reads, on the cache ``cache``: ``before`` makes it so
_EXITS_WITH_RECORDS_UNREAD = """
import json, sys, time
sys.path[:0] = [{tests!r}, {root!r}]
import torch
import adaptive_eager as ae
import fuser
from adaptive_eager import _capture
from fuser.regions import poll_jobs
from neff_cache import ArtifactStore

{before}
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
with ae.adaptive_eager(backend="inductor", cache_dir={cache!r}, hot_after={hot_after}):
    for _ in range(6):
        opt.zero_grad()
        (model(torch.randn(5, 8)) ** 2).mean().backward()
        opt.step()
    ae.sync()
    if {wait}:  # for both traces to end, their results sent while the program lives
        store = ArtifactStore({cache!r})
        deadline = time.monotonic() + 300
        while sum(e["backend"] == _capture._RECORD_BACKEND for e in store.entries()) < 2 and time.monotonic() < deadline:
            poll_jobs()  # the results are read (a worker's reply waits for that), the records are not
            time.sleep(0.1)
        time.sleep(0.5)
    workers = [w.process.pid for jobs in fuser.compile_jobs() for w in jobs._workers]
    print(json.dumps({{"records": ae.metrics()["capture_records"], "workers": workers}}))
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"  # a zombie nobody reaped has ended
    except OSError:
        return True


def test_a_program_gone_before_its_records_land_leaves_their_graphs_compiled(tmp_path):
    """Note [Follow-up compiles after exit] in neff_cache._worker: a program that exits before its
    captures' AOTAutograd traces land (a short run: the worker still imports the compiler) never
    submits their graphs' compiles; the worker that traces after the exit compiles them, so that the
    next process finds the module's forward and backward and the optimizer step compiled."""
    _exit_then_compiled_graphs(tmp_path, '_capture._TRACE_JOB = "_oracle:trace_job_after_exit"', False)




def _exit_then_compiled_graphs(tmp_path, before: str, wait: bool) -> None:
    """Run ``_EXITS_WITH_RECORDS_UNREAD`` (6 steps of an MLP and AdamW whose records it never reads) and wait
    for its compile workers to end: the module's forward and backward and the optimizer step's graph
    must then be compiled and stored (Note [Follow-up compiles after exit] in neff_cache._worker)."""
    import torch._inductor.inductor_prims  # noqa: F401 - the records' graphs name its ops (AdamW's prims.fma)
    from fuser.backends import get_backend
    from fuser.compile import cache_fingerprint
    from fuser.program import Program
    from neff_cache import ArtifactStore

    cache = str(tmp_path / "cache")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = _EXITS_WITH_RECORDS_UNREAD.format(tests=os.path.join(root, "tests"), root=root, cache=cache,
                                             hot_after=HOT_AFTER, before=before, wait=wait)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_EAGER")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    child = json.loads(out.stdout.strip().splitlines()[-1])
    records = child["records"]
    assert records.get("module_trace_submitted") == 1 and records.get("optimizer_trace_submitted") == 1, records
    assert not any(k.endswith("_trace_landed") for k in records), records  # the program read no record
    deadline = time.monotonic() + 300
    while not all(_gone(pid) for pid in child["workers"]):
        assert time.monotonic() < deadline, "the compile worker did not end after its program"
        time.sleep(0.2)
    store = ArtifactStore(cache)
    backend = get_backend("inductor", "cpu")
    fingerprint = cache_fingerprint(backend)
    graphs = []
    for entry in store.entries():
        if entry["backend"] != _capture._RECORD_BACKEND:
            continue
        record = json.loads(store.get(entry["key"], fingerprint=fingerprint))
        for kind in ("forward", "backward"):
            if kind in record:
                program = Program.from_bytes(json.dumps(record[kind]["program"]).encode())
                key = _capture._graph_key(program, record[kind]["may_write"], backend, fingerprint)
                graphs.append((kind, store.contains(key)))
    # the module's forward and backward, the optimizer step's one graph: each compiled and stored
    assert sorted(graphs) == [("backward", True), ("forward", True), ("forward", True)], graphs


def test_a_program_gone_with_its_records_unread_leaves_their_graphs_compiled(tmp_path):
    """Note [Follow-up compiles after exit] in neff_cache._worker: the traces end while the program
    runs, and the program exits before it reads their results (so it submits none of their graphs'
    compiles); the worker holds the compiles the traces named and runs them once the program is gone."""
    _exit_then_compiled_graphs(tmp_path, '_capture._POLL_S = 1e9  # the captures never look for their records', True)


def test_a_declined_trace_runs_in_the_next_step(tmp_path, monkeypatch):
    """Note [Traces off the step]: a worker that declines the trace (here every one) leaves the graphs
    running eagerly until the next call, which traces in the step, as with async compiles off; the
    values stay eager's."""
    monkeypatch.setattr(_capture, "_TRACE_JOB", "_oracle:declining_trace_job")
    traces = count_aot_traces(monkeypatch)
    steps = 6
    eager = _train_adamw(steps, False)
    lazy = _train_adamw(steps, True, wait_at=RECORDED, cache_dir=str(tmp_path))
    _assert_same(eager, lazy)
    records = ae.metrics()["capture_records"]
    assert len(traces) == 2, records
    for who in ("module", "optimizer"):
        assert records.get(f"{who}_trace_declined:test_decline") == 1, records
        assert records.get(f"{who}_trace_in_step") == 1 and records.get(f"{who}_written") == 1, records


class _Rotary(nn.Module):
    """Llama's rotary half, taken with ``x[..., :n]``: an Ellipsis in Dynamo's graph, which the
    record's key could not encode (``module_unkeyed:argument``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 4)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], 2, -1, 4).transpose(0, 1).chunk(3, dim=-2)
        q = torch.cat([-q[..., 2:], q[..., :2]], dim=-1)
        a = torch.softmax(q @ k.transpose(-1, -2), -1) @ v
        return self.out(a.transpose(0, 1).reshape(x.shape[0], -1, 8).sum(1))


def test_a_graph_with_an_ellipsis_keeps_a_record(tmp_path, monkeypatch):
    traces = count_aot_traces(monkeypatch)
    xs = [torch.randn(6, 8) for _ in range(5)]
    eager = _train(_Rotary(), xs, False)
    for hit in ("module_written", "module_hit"):
        torch._dynamo.reset()
        ae.reset_metrics()
        lazy = _train(_Rotary(), xs, True, async_compile=False, cache_dir=str(tmp_path))
        _assert_same(eager, lazy)
        m = ae.metrics()
        assert m["module_capture_misses"] == {} and m["module_captured_calls"] == len(xs) - RECORDED, m
        assert m["capture_records"] == {hit: 1}, m["capture_records"]
    assert len(traces) == 1


class _Attention(_Rotary):
    """Llama's attention: SDPA, tagged random for its dropout, called with ``dropout_p=0``."""

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], -1, 3, 4).transpose(1, 2).chunk(3, dim=1)
        a = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)
        return self.out(a.transpose(1, 2).reshape(x.shape[0], -1, 8).sum(1))


def test_attention_without_dropout_is_captured_and_rebuilt_from_its_record(tmp_path, monkeypatch):
    """Note [Dropout probability] in adaptive_eager._ops: SDPA with ``dropout_p=0`` draws nothing,
    so a forward calling it is captured (Llama's); a second capture on the same cache rebuilds it
    from its record; AdamW's step is captured too; eager's values throughout."""
    traces = count_aot_traces(monkeypatch)
    torch.manual_seed(3)
    xs = [torch.randn(3, 16) for _ in range(6)]

    def run(lazy):
        model = _Attention()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        losses = []
        with ae.adaptive_eager(async_compile=False, cache_dir=str(tmp_path)) if lazy else _nothing():
            for x in xs:
                opt.zero_grad()
                loss = (model(x.view(3, 2, 8)) ** 2).mean()
                loss.backward()
                opt.step()
                losses.append(loss.detach().clone())
        return torch.stack(losses), model

    eager = run(False)
    for hit in ("module_written", "module_hit"):
        torch._dynamo.reset()
        ae.reset_metrics()
        _assert_same(eager, run(True))
        m = ae.metrics()
        assert m["module_capture_misses"] == {} and m["module_captured_calls"] == len(xs) - RECORDED, m
        assert m["capture_records"].get(hit) == 1, m["capture_records"]
    assert len(traces) == 2  # the module's and the optimizer's, in the first run only


class _Cell(nn.Module):
    """A recurrent cell unrolled over 8 time steps in its forward: its backward graph reads the
    ~30 tensors the forward saved, and the loss backward's tangent."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.hid, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, xs):
        h = xs.new_zeros(xs.shape[1], 16)
        for t in range(xs.shape[0]):
            h = torch.tanh(self.inp(xs[t]) + self.hid(h))
        return self.out(h)


def test_a_captured_backward_looks_for_pending_inputs_until_none_is_left(_uncompiled, monkeypatch, tmp_path):
    """The captured backward runs the window holding its pending tangent first; once no window
    holds anything, it reads its saved tensors without asking each whose window it is in
    (``_threads.sync_values``). Eager's values."""
    from adaptive_eager import _threads

    looked, inside = [], []
    owner_of, call = _threads.owner_of, _capture._Graph.__call__
    monkeypatch.setattr(_threads, "owner_of", lambda t: inside and looked.append(1) or owner_of(t))

    def counted(self, *args):
        inside.append(1)
        try:
            return call(self, *args)
        finally:
            inside.pop()

    monkeypatch.setattr(_capture._Graph, "__call__", counted)
    torch.manual_seed(1)
    xs = [torch.randn(8, 5, 8) for _ in range(6)]
    eager = _train(_Cell(), xs, False)
    lazy = _train(_Cell(), xs, True, async_compile=False, cache_dir=str(tmp_path))
    _assert_same(eager, lazy)
    m = ae.metrics()
    captured = len(xs) - RECORDED
    assert m["module_captured_calls"] == captured and m["module_capture_misses"] == {}, m
    assert len(looked) <= captured, len(looked)  # the tangent's, not one per saved tensor


@pytest.mark.usefixtures("small_windows_off")
def test_a_one_element_gradient_makes_no_window_of_its_own(tmp_path):
    """AccumulateGrad's ``detach`` of a captured backward's one-element gradient (the output
    layer's bias) is a view of real memory left unrecorded (Note [Views of unwritten memory] in
    adaptive_eager._record): a hot step flushes one window (the loss and its backward seed), not a
    second one holding that view, and its hot window never mismatches. Eager's values."""

    def run(lazy):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        losses, windows = [], []
        with ae.adaptive_eager(async_compile=False, cache_dir=str(tmp_path)) if lazy else _nothing():
            for x in _batches(8):
                before = ae.metrics()["windows"] if lazy else 0
                loss = (model(x) ** 2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                windows.append(ae.metrics()["windows"] - before if lazy else 0)
        return torch.tensor(losses), model, windows

    eager, lazy = run(False), run(True)
    _assert_same(eager[:2], lazy[:2])
    m = ae.metrics()
    assert m["module_captured_calls"] == 8 - RECORDED and m["optimizer_hot_steps"] > 0, m
    assert lazy[2][-3:] == [1, 1, 1], lazy[2]
    assert "op" not in m["hot_mismatches"], m["hot_mismatches"]


class _Recurrent(nn.Module):
    """A cell unrolled over time steps: each step's ``tanh`` is saved twice (for its own backward
    and for the next step's matmul), and Inductor returns one buffer for both."""

    def __init__(self):
        super().__init__()
        self.inp, self.hid, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 1)

    def forward(self, xs):
        h = xs.new_zeros(xs.shape[1], 16)
        for t in range(xs.shape[0]):
            h = torch.tanh(self.inp(xs[t]) + self.hid(h))
        return self.out(h)


def test_a_tensor_the_forward_saves_twice_is_not_copied(tmp_path):
    """Note [Repeated outputs] in fuser.backends.inductor: the captured forward's saved outputs may
    share one buffer (only its backward reads them), so a compiled step makes no copy of them
    (``aten::copy_`` of its own, counted by torch.profiler; the old code made one per time step), and the
    gradients are eager's."""
    from torch.profiler import profile

    def run(lazy):
        torch.manual_seed(0)
        model = _Recurrent()
        xs = torch.randn(6, 5, 8)
        grads, copies = [], []
        with ae.adaptive_eager(async_compile=False, cache_dir=str(tmp_path)) if lazy else _nothing():
            for step in range(4):
                with profile() as prof:
                    loss = model(xs).square().mean()
                    loss.backward()
                    grads.append([p.grad.clone() for p in model.parameters()])
                model.zero_grad()
                # not the copies inside an op (``addmm`` copies its bias into its result)
                copies.append(sum(e.name == "aten::copy_" and not (e.cpu_parent and e.cpu_parent.name.startswith("aten::"))
                                  for e in prof.events()))
        return grads, copies

    eager, _ = run(False)
    for built_from in ("module_written", "module_hit"):  # traced, then from its record (as in a new process)
        torch._dynamo.reset()
        ae.reset_metrics()
        lazy, copies = run(True)
        for a, b in zip(eager, lazy):
            for x, y in zip(a, b):
                torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-6)
        m = ae.metrics()
        assert m["capture_records"] == {built_from: 1}, m
        assert m["module_compiled_runs"] > 0 and m["module_uncompiled_runs"] == 0, m
        assert copies[-1] == 0, copies


class _CheckedMLP(nn.Module):
    """A forward with a host read that TorchDynamo skips, as transformers' mask checks are
    (``is_torchdynamo_compiling()``): recorded, it flushes in the middle; captured, it is one graph."""

    def __init__(self):
        super().__init__()
        self.net = _mlp()

    def forward(self, x):
        h = self.net[0](x)
        if not torch.compiler.is_compiling() and not bool(torch.isfinite(h).all()):
            raise ValueError("not finite")
        return self.net[1:](h)


def test_the_windows_of_the_call_before_the_capture_are_not_compiled(tmp_path):
    """Note [Windows a capture supersedes]: the recorded call before the capture has two windows
    (to the host read, and from it to the loss's ``item()``), seen for the hot_after-th time; they
    never recur once the call is captured, so they are not compiled: the compiles are the
    captured graphs' and the window that goes on recurring (the loss)."""
    model, xs = _CheckedMLP(), _batches(6)
    with torch.no_grad():
        eager = [model(x).square().mean().item() for x in xs]
        with ae.adaptive_eager(async_compile=False, cache_dir=str(tmp_path)):
            lazy = [model(x).square().mean().item() for x in xs]
    torch.testing.assert_close(lazy, eager, rtol=1e-4, atol=1e-5)
    m = ae.metrics()
    assert m["module_captures"] == 1 and m["module_capture_misses"] == {}
    # the inference graph and the loss's window; neither superseded window
    assert m["compiles"] == 2, m
    assert m["replay_reasons"].get("capture_due") == 2, m["replay_reasons"]


def test_a_module_called_under_activation_checkpointing_stays_recorded(tmp_path):
    """A call made under a saved-tensor hook (``torch.utils.checkpoint``, non-reentrant) runs
    recorded: a captured graph saves other tensors than the recorded call, and the checkpoint
    compares how many its forward and its recomputation saved (CheckpointError). Counted, with
    the call's line."""
    from torch.utils.checkpoint import checkpoint

    def run(lazy):
        model = _mlp()
        opt = _SGD(model.parameters(), lr=0.1)
        losses = []
        ctx = ae.adaptive_eager(async_compile=False, cache_dir=str(tmp_path)) if lazy else _nothing()
        with ctx:
            for x in _batches(5):
                opt.zero_grad()
                loss = (checkpoint(model, x, use_reentrant=False) ** 2).mean()
                loss.backward()
                opt.step()
                losses.append(loss.detach().clone())
        return torch.stack(losses), model

    eager = run(False)
    ae.reset_metrics()
    lazy = run(True)
    _assert_same(eager, lazy)
    m = ae.metrics()
    assert m["module_capture_misses"]["saved_tensor_hooks"] >= 5 and not m["module_captured_calls"], m


def _interim_only(monkeypatch):
    """Keep every capture on Dynamo's graph run eagerly (its record never lands here), and count the
    module calls that ran behind the interim backward (Note [The interim backward])."""
    monkeypatch.setattr(_capture._Interim, "_poll", lambda self, args: None)
    behind = []
    apply = _capture._InterimBackward.apply
    monkeypatch.setattr(_capture._InterimBackward, "apply", lambda *a: behind.append(1) or apply(*a))
    return behind


def _backward_cuts(line_of_backward: int) -> int:
    return sum(n for (reason, site, _), n in ae._metrics.METRICS.flush_sites.items()
               if reason == "module_capture" and site is not None and site[1] == line_of_backward)


@pytest.mark.usefixtures("parking_off", "fresh_regions")
def test_the_interim_call_cuts_the_window_where_the_captured_backward_does(tmp_path, monkeypatch):
    """Note [The interim backward] in adaptive_eager._capture: while the worker's trace runs, a captured
    module's backward computes its tangents first and runs with the mode suspended, as the record's
    backward graph will: the loss's window ends at ``backward()`` (the window a later process, whose
    backward is the record's, meets), and the values are eager's."""
    behind = _interim_only(monkeypatch)
    steps = 6
    eager = _train_adamw(steps, False)
    lazy = _train_adamw(steps, True, cache_dir=str(tmp_path))
    _assert_same(eager, lazy)
    m = ae.metrics()
    assert m["capture_records"].get("module_trace_submitted") == 1, m["capture_records"]
    assert m["module_uncompiled_runs"] == steps - RECORDED and len(behind) == steps - RECORDED, m
    line = _train_adamw.__code__.co_firstlineno + 11  # ``loss.backward()``
    assert _backward_cuts(line) == steps - RECORDED, ae._metrics.METRICS.flush_sites


def test_the_interim_backward_keeps_eagers_autograd(tmp_path, monkeypatch):
    """Note [The interim backward]: gradients accumulated over two backwards, a retained graph's second
    backward, and a second backward through a freed graph raising eager's error."""
    behind = _interim_only(monkeypatch)

    def run(lazy):
        torch.manual_seed(0)
        model, xs = _mlp(), _batches(5)
        out = []
        with ae.adaptive_eager(backend="inductor", cache_dir=str(tmp_path)) if lazy else _nothing():
            for x in xs[:3]:
                model(x).sum().backward()  # accumulated: no zero_grad
            loss = (model(xs[3]) ** 2).mean()
            loss.backward(retain_graph=True)
            loss.backward()
            loss = model(xs[4]).sum()
            loss.backward()
            with pytest.raises(RuntimeError, match="backward through the graph a second time"):
                loss.backward()
            out = [p.grad.clone() for p in model.parameters()]
        return out

    eager, lazy = run(False), run(True)
    assert len(behind) == 5 - RECORDED, behind
    for a, b in zip(eager, lazy):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


class _ViewOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        x.mul_(2)  # in place into an input that requires grad
        return self.lin(x), x.view(-1)  # and an output that is a view of it


def test_a_graph_that_writes_or_returns_its_inputs_keeps_the_engines_nodes(tmp_path, monkeypatch):
    """Note [The interim backward]: a detached alias would cut the history of an input the graph writes
    in place or returns a view of; such a graph runs with autograd's own nodes, with eager's gradients."""
    behind = _interim_only(monkeypatch)

    def run(lazy):
        torch.manual_seed(0)
        model = _ViewOut()
        w = torch.randn(5, 8, requires_grad=True)
        with ae.adaptive_eager(backend="inductor", cache_dir=str(tmp_path)) if lazy else _nothing():
            for _ in range(5):
                y, v = model(w * 1.0)
                (y.sum() + (v ** 2).sum()).backward()
            grads = [w.grad.clone(), *(p.grad.clone() for p in model.parameters())]
        return grads

    eager, lazy = run(False), run(True)
    assert behind == [] and ae.metrics()["module_uncompiled_runs"] == 5 - RECORDED, ae.metrics()
    for a, b in zip(eager, lazy):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
