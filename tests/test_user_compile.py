"""A program's own ``torch.compile``, and the rest of PyTorch's stack, inside adaptive eager (Note
[User torch.compile] in adaptive_eager._compile).

Each ``torch.compile`` case runs the same program three ways: under ``torch.compile`` alone, under
it inside ``adaptive_eager()`` (regions replayed, and compiled from first sight), and, where the
program allows, with ``torch.compile`` taken away (plain eager, the oracle). The values must match,
the backend must be handed the same graphs as many times (a counting backend), and nothing may
warn. The compositions that worked before stay covered against plain eager.
"""

import contextlib
import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from _oracle import COMPILED, REPLAY
from torch.utils._python_dispatch import TorchDispatchMode

import adaptive_eager as ae
from adaptive_eager._capture import at_once
from adaptive_eager.config import Options

MODES = [pytest.param(REPLAY, id="replay"), pytest.param(COMPILED, id="compiled")]
# the compiled variants whose Inductor compiles (our regions', our optimizer capture's) take a
# minute or more on 2 shared cores: their replay twins run the same program
SLOW_MODES = [pytest.param(REPLAY, id="replay"), pytest.param(COMPILED, id="compiled", marks=pytest.mark.slow)]


@pytest.fixture(autouse=True)
def _fresh_dynamo(monkeypatch):
    """No graph of an earlier test answers for this one; and under ``replay`` our optimizer
    capture runs with Dynamo's ``eager`` backend (as in test_optimizer_capture.py), so the replay
    variants see it too."""
    from adaptive_eager import _optim

    monkeypatch.setitem(_optim._DYNAMO_BACKENDS, "replay", "eager")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Counting:
    """A Dynamo backend that counts the graphs it is handed and compiles them with ``backend``."""

    def __init__(self, backend="eager"):
        from torch._dynamo.backends.registry import lookup_backend

        self.inner = lookup_backend(backend)
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return self.inner(gm, example_inputs)


def _run(program, options, caplog, backend="eager"):
    """``program(compile)`` where ``compile(fn, **kw)`` is ``torch.compile`` with a counting backend:
    under adaptive eager with ``options``, or without it (``options`` None); ``compile`` is None for
    plain eager. Returns what it returned (computed) and how many graphs the backend was handed."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    counting = Counting(backend) if backend is not None else None

    def compile(fn, **kwargs):
        return torch.compile(fn, backend=counting, **kwargs)

    ctx = ae.adaptive_eager(**options) if options is not None else contextlib.nullcontext()
    caplog.clear()
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        with ctx:
            out = program(compile if counting is not None else None)
    # DeprecationWarnings of torch's own first imports (a region's compile imports Inductor) are not
    # the program's; everything else that warns, and any warning logged (a recompile limit, a skipped
    # frame), fails the test
    warned = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if w.category is not DeprecationWarning]
    warned += [r.getMessage() for r in caplog.records]
    assert not warned, "\n".join(warned)
    return out, counting.graphs if counting is not None else None


def _same(expected, actual, exact=True):
    if isinstance(expected, (list, tuple)):
        assert len(expected) == len(actual)
        for e, a in zip(expected, actual):
            _same(e, a, exact)
        return
    if isinstance(expected, torch.Tensor):
        assert not ae.is_lazy(actual)
        if exact:
            torch.testing.assert_close(actual, expected, rtol=0, atol=0)
        else:
            torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)
        return
    assert expected == actual


def _three_ways(program, options, caplog, backend="eager", exact=True, eager_oracle=True):
    """``program`` under torch.compile alone and inside adaptive eager, and (``eager_oracle``) in
    plain eager; the graphs the backend was handed under adaptive eager."""
    alone, graphs_alone = _run(program, None, caplog, backend)
    ae.reset_metrics()
    inside, graphs_inside = _run(program, options, caplog, backend)
    m = ae.metrics()
    assert graphs_inside == graphs_alone, "the program's torch.compile compiled more, or less, inside adaptive eager"
    _same(alone, inside, exact)
    if eager_oracle:
        plain, _ = _run(program, None, caplog, backend=None)
        _same(plain, inside, exact=False)
    return graphs_inside, m


# -- the program's torch.compile ---------------------------------------------------------------

def _function(compile):
    f = (compile or (lambda fn, **kw: fn))(lambda a: (a.sin() + 1).cos())
    x = torch.randn(16)
    outs = []
    for i in range(3):
        y = f(x * (i + 1))  # a pending input: computed before the call
        outs.append(y)
        outs.append(y * 2)  # the output is an ordinary tensor, recorded on as any
    return outs


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("options", MODES)
@pytest.mark.usefixtures("small_windows_off")
def test_a_compiled_function(options, backend, caplog):
    graphs, m = _three_ways(_function, options, caplog, backend, exact=backend == "eager")
    assert graphs == 1
    assert m["flushes"].get("torch_compile") == 3  # x * (i + 1) was pending at each call
    assert m["compiled_calls"] == 3


def test_the_first_program_of_the_issue():
    """The crash of issue 37: Dynamo built guards on our mode's open window."""
    f = torch.compile(lambda a: (a.sin() + 1).cos())
    x = torch.randn(16)
    with ae.adaptive_eager(**REPLAY):
        total = f(x).sum()
    torch.testing.assert_close(total, (x.sin() + 1).cos().sum())


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def _training(compile, steps=6, make_opt=None):
    model = _model()
    cm = compile(model) if compile else model
    opt = (make_opt or (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)))(model.parameters())
    torch.manual_seed(1)
    losses = []
    for i in range(steps):
        x = torch.randn(3 if i < 3 else 5, 8)  # a guard miss at step 3: a second compile
        loss = cm(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("options", MODES)
@pytest.mark.usefixtures("small_windows_off")
def test_a_compiled_module_trains_with_a_guard_miss(options, caplog):
    # our optimizer capture compiles the step the program did not compile: within compiled
    # tolerances of eager's
    graphs, m = _three_ways(_training, options, caplog, "aot_eager", exact=False)
    assert graphs == 2
    assert m["compiled_calls"] == 12  # six forwards, six compiled backwards (AOTAutograd's)
    assert m.get("module_captures", 0) == 0  # the program compiled the model: its compile wins
    assert m["flushes"]["torch_compile"] >= 6  # each backward's tangents were pending


@pytest.mark.parametrize("options", SLOW_MODES)
def test_a_compiled_module_trains_with_inductor(options, caplog):
    graphs, _ = _three_ways(lambda c: _training(c, steps=3), options, caplog, "inductor", exact=False)
    assert graphs == 1


@pytest.mark.parametrize("options", MODES)
def test_fullgraph(options, caplog):
    def program(compile):
        f = (compile or (lambda fn, **kw: fn))(lambda a, b: F.gelu(a @ b).sum(0), fullgraph=True)
        a, b = torch.randn(4, 5), torch.randn(5, 3)
        return [f(a + 1, b), f(a, b * 2)]

    assert _three_ways(program, options, caplog)[0] == 1


@pytest.mark.parametrize("options", MODES)
def test_dynamic_shapes(options, caplog):
    def program(compile):
        f = (compile or (lambda fn, **kw: fn))(lambda a: a.softmax(-1) * a.shape[0], dynamic=True)
        return [f(torch.randn(n, 6) + 0) for n in (2, 3, 7)]

    assert _three_ways(program, options, caplog)[0] == 1  # one graph with symbolic sizes


@pytest.mark.parametrize("options", MODES)
def test_a_graph_break_with_a_print(options, caplog, capsys):
    def program(compile):
        def g(a):
            b = a.sin()
            print("inside", tuple(b.shape))
            return b.cos()

        f = compile(g) if compile else g
        x = torch.randn(5)
        return [f(x + i) for i in range(3)]

    graphs, _ = _three_ways(program, options, caplog)
    assert graphs == 2  # before and after the print
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["inside (5,)"] * 9  # alone, inside, plain eager: in the program's order


@pytest.mark.parametrize("options", SLOW_MODES)
def test_a_compiled_optimizer_step_is_the_programs(options, caplog):
    """The program compiled the step: our capture steps aside (no second compile, no capture)."""

    def program(compile):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = compile(lambda: opt.step()) if compile else opt.step
        for i in range(5):
            model(torch.randn(3, 8)).pow(2).mean().backward()
            step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    graphs, m = _three_ways(program, options, caplog, exact=False)
    assert graphs == 1
    assert m["optimizer_captures"] == 0 and m["optimizer_hot_steps"] == 0


@pytest.mark.parametrize("options", SLOW_MODES)
def test_a_compiled_module_with_a_captured_optimizer(options, caplog):
    """The program compiled the module, not the step: the step is ours to capture; the program's
    graphs are compiled as often as without us."""
    graphs, m = _three_ways(lambda c: _training(c, steps=5, make_opt=lambda p: torch.optim.AdamW(p, lr=1e-2)),
                            options, caplog, exact=False)
    assert graphs == 2
    # five steps: hot_after cold ones, the one that captures, then every one runs the capture; with
    # Inductor on cpu the first step captures (Note [Training captured at once] in adaptive_eager._capture)
    resolved = Options("cpu", **{k: v for k, v in options.items() if k in ("backend", "hot_after")})
    cold = 1 if at_once(resolved) else resolved.hot_after + 1
    assert m["optimizer_captures"] == 1 and m["optimizer_hot_steps"] == 5 - cold, m
    assert not m["optimizer_misses"], m


@pytest.mark.parametrize("options", SLOW_MODES)
def test_reentrant_checkpoint_inside_a_compiled_module(options, caplog):
    from torch.utils.checkpoint import checkpoint

    def program(compile):
        lin = _model()
        f = (compile or (lambda fn, **kw: fn))(lambda x: checkpoint(lin, x, use_reentrant=True).sum())
        x = torch.randn(3, 8, requires_grad=True)
        f(x * 2).backward()
        return [x.grad] + [p.grad for p in lin.parameters()]

    _three_ways(program, options, caplog, exact=False)


def test_a_programs_mode_inside_keeps_dynamo_off_as_without_us(caplog):
    """A dispatch mode of the program's own makes Dynamo run the frame eagerly, under it, with or
    without adaptive eager: no graph either way, and the mode sees the same ops."""

    class Names(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    def program(compile):
        f = compile(lambda a: (a.sin() + 1).cos())
        with Names() as names:
            y = f(torch.randn(4))
        return [y, names.names]

    graphs, _ = _three_ways(program, REPLAY, caplog, eager_oracle=False)
    assert graphs == 0


# -- what composed before, and must still ------------------------------------------------------

def _vs_eager(fn, options=REPLAY, exact=False):
    torch.manual_seed(0)
    expected = fn()
    torch.manual_seed(0)
    with ae.adaptive_eager(**options):
        actual = fn()
    _same(expected, actual, exact)


@pytest.mark.parametrize("options", SLOW_MODES)
def test_vmap_grad_jacrev(options):
    def fn():
        w = torch.randn(5, 3)
        xs = torch.randn(4, 5)
        f = lambda x: (x @ w).tanh().sum()  # noqa: E731
        return [torch.vmap(lambda x: x @ w)(xs), torch.func.grad(f)(xs[0]), torch.func.jacrev(lambda x: (x @ w).tanh())(xs[0])]

    _vs_eager(fn, options)


def test_flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    def fn():
        a, b = torch.randn(8, 16), torch.randn(16, 4)
        with FlopCounterMode(display=False) as counter:
            out = (a @ b).relu()
        return [out, counter.get_total_flops()]

    _vs_eager(fn)


@pytest.mark.parametrize("options", SLOW_MODES)
def test_checkpoint_and_complex(options):
    from torch.utils.checkpoint import checkpoint

    def fn():
        lin = _model()
        x = torch.randn(3, 8, requires_grad=True)
        checkpoint(lin, x, use_reentrant=False).sum().backward()
        checkpoint(lin, x, use_reentrant=True).sum().backward()
        z = torch.randn(6, dtype=torch.complex64)
        return [x.grad, lin[0].weight.grad, (z * z.conj()).exp(), torch.fft.fft(z)]

    _vs_eager(fn, options)


def test_autocast_to_bfloat16():
    def fn():
        lin = _model()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = lin(torch.randn(3, 8))
        return [low.dtype, low]

    _vs_eager(fn, exact=True)  # replay: each op eager's kernel, bit for bit


def test_export_inside_the_mode():
    _export(torch.nn.Linear(8, 4))


def _export(model):
    x = torch.randn(3, 8)
    with ae.adaptive_eager(**REPLAY):
        exported = torch.export.export(model, (x,))
        out = exported.module()(x * 1)
    torch.testing.assert_close(out, model(x))


def test_a_programs_mode_nested_inside():
    class Doubling(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            return out * 2 if func is torch.ops.aten.sin.default else out

    def fn():
        x = torch.randn(6)
        with Doubling():
            y = x.sin() + 1
        return [y, y.cos()]

    _vs_eager(fn)


@pytest.mark.parametrize("options", MODES)
def test_compiled_autograd_runs_the_backward_as_without_us(options, caplog):
    """Compiled autograd (``torch._dynamo.compiled_autograd``): the backward is traced and run by
    Dynamo, with adaptive eager stepped aside; the gradients are eager's, each backward one
    compiled call, and the backend is handed the same graphs."""
    from torch._dynamo import compiled_autograd

    def program(compile):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
        x = torch.randn(4, 8)
        for _ in range(3):
            with compiled_autograd._enable(compile):  # the backward graph goes to torch.compile
                model(x).pow(2).mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    ae.reset_metrics()
    got, graphs = _run(program, options, caplog)
    m = ae.metrics()
    alone, graphs_alone = _run(program, None, caplog)
    assert graphs == graphs_alone
    assert m["compiled_calls"] >= 3
    for a, b in zip(got, alone):
        torch.testing.assert_close(a, b)
