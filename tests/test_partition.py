"""Partitions (Note [Partitions] in fuser.partition): nodes that run alone between compiled pieces."""

import tempfile

import pytest
import torch

import adaptive_eager as ae
import fuser
import fuser.regions
from adaptive_eager import adaptive_eager
from fuser import partition
from fuser.backends import get_backend


def _options(**kw):
    return dict(backend="inductor", hot_after=2, async_compile=False,
                cache_dir=tempfile.mkdtemp(prefix="ae_partition_"), **kw)


@pytest.fixture
def no_sin(monkeypatch):
    """The inductor backend, declaring ``aten.sin`` not lowerable (as a neuron backend would
    declare the ops its compiler lacks)."""
    backend = get_backend("inductor", "cpu")
    asked = []

    def unsupported(node):
        asked.append(node.target)
        return "not_lowerable" if node.target is torch.ops.aten.sin.default else None

    monkeypatch.setattr(backend, "unsupported", unsupported, raising=False)
    return asked


def test_check_op_runs_alone_and_the_rest_is_compiled(fresh_regions):
    good = torch.eye(3) * 2
    invs = []
    with adaptive_eager(**_options()):
        for _ in range(4):
            invs.append(torch.linalg.inv(good))
            ae.sync()
    for inv in invs:
        torch.testing.assert_close(inv, torch.eye(3) / 2)
    m = ae.metrics()
    assert m["compiled_runs"] == 3 and m["run_alone"] == {"check_op": 1}, str(m)
    assert m["blacklisted"] == 0


def test_a_check_that_fails_raises_eagers_error_and_keeps_the_region(fresh_regions):
    good, bad = torch.eye(3) * 2, torch.zeros(3, 3)
    invs = []
    with adaptive_eager(**_options()):
        for a in (good, good, good, bad, good, bad, good):
            if a is bad:
                with pytest.raises(torch.linalg.LinAlgError, match="recorded at"):
                    kept = torch.linalg.inv(a)  # noqa: F841 - live, so the same region as the good ones
                    ae.sync()
            else:
                invs.append(torch.linalg.inv(a))
                ae.sync()
    for inv in invs:
        torch.testing.assert_close(inv, torch.eye(3) / 2)
    m = ae.metrics()
    # the failing windows ran compiled, raised, and were replayed for eager's error; the region
    # stays (the data was at fault, not the compiled code): the good windows after them run compiled
    assert m["blacklisted"] == 0 and m["compiles"] == 1 and m["compiled_runs"] == 4


@pytest.mark.usefixtures("small_windows_off")
def test_backend_unsupported_op_runs_alone_between_compiled_pieces(no_sin, fresh_regions):
    x = torch.randn(64, 32)
    w = torch.randn(32, 16)

    def program(x):
        h = (x * 1.5 + 0.25) @ w
        return (h.sin() * h).exp().sum(1), h.cos()

    with adaptive_eager(**_options()):
        for _ in range(4):
            got = program(x)
            ae.sync()
    want = program(x)
    for g, e in zip(got, want):
        assert g.stride() == e.stride()
        torch.testing.assert_close(g, e)
    m = ae.metrics()
    assert m["run_alone"] == {"not_lowerable": 1} and m["compiled_runs"] == 3 and m["blacklisted"] == 0
    assert torch.ops.aten.sin.default in no_sin


@pytest.mark.usefixtures("small_windows_off")
def test_split_region_with_writes_to_real_tensors(no_sin, fresh_regions):
    """A window that would compile in place (parameter updates) is split with write-back instead."""
    p = torch.randn(100)
    p_eager = p.clone()
    g = torch.randn(100)
    with adaptive_eager(**_options()):
        for _ in range(5):
            p.add_(g.sin() * 0.1)
            p.mul_(0.99)
            ae.sync()
    for _ in range(5):
        p_eager.add_(g.sin() * 0.1)
        p_eager.mul_(0.99)
    torch.testing.assert_close(p, p_eager)
    m = ae.metrics()
    assert m["compiled_runs"] == 4 and m["run_alone"] == {"not_lowerable": 1} and m["blacklisted"] == 0
    (entry,) = [e for e in fuser.regions.CACHE.entries.values() if e.run is not None]
    assert not entry.inplace


def test_split_artifact_loads_from_disk(no_sin, fresh_regions):
    x = torch.randn(50)
    options = _options()
    with adaptive_eager(**options):
        for _ in range(3):
            y = (x.sin() + 1).sqrt()
            ae.sync()
    fuser.cache_clear()
    ae.reset_metrics()
    with adaptive_eager(**options):
        y = (x.sin() + 1).sqrt()
        ae.sync()
    torch.testing.assert_close(y, (x.sin() + 1).sqrt())
    m = ae.metrics()
    assert m["cache_hits_disk"] == 1 and m["compiled_runs"] == 1 and m["run_alone"] == {"not_lowerable": 1}


def test_plan_runs_multi_output_pieces_and_ops_with_kwargs(no_sin):
    """``split``/``load`` directly: an alone op with keyword arguments between pieces with several
    outputs, values freed as the plan goes."""
    backend = get_backend("inductor", "cpu")

    def f(a, b):
        s = torch.ops.aten.add.Tensor(a, b, alpha=2)
        m = torch.ops.aten.mul.Tensor(a, b)
        t = torch.ops.aten.sin.default(s)
        return [torch.ops.aten.add.Tensor(t, m), torch.ops.aten.cumsum.default(m, 0, dtype=torch.float64)]

    from torch.fx.experimental.proxy_tensor import make_fx

    a, b = torch.randn(4, 5), torch.randn(4, 5)
    gm = make_fx(f, tracing_mode="fake")(a, b)
    alone = partition.alone(gm, backend)
    assert list(alone.values()) == ["not_lowerable"]
    run = partition.load(partition.split(gm, [a, b], alone, backend), backend)
    got = run([a, b])
    want = f(a, b)
    assert len(got) == 2
    for g, e in zip(got, want):
        assert g.dtype == e.dtype and g.stride() == e.stride()
        torch.testing.assert_close(g, e)


def test_varying_shapes_with_a_check_op_compile_per_shape(fresh_regions, caplog):
    """A split region is compiled per shape: no symbolic attempt, no blacklisting."""
    with adaptive_eager(**_options()):
        for n in (3, 4, 5, 3, 4, 5):
            inv = torch.linalg.inv(torch.eye(n) * 2)
            ae.sync()
            torch.testing.assert_close(inv, torch.eye(n) / 2)
    m = ae.metrics()
    assert m["blacklisted"] == 0 and m["not_dynamic"].get("run_alone", 0) >= 1
    assert "blacklisted" not in caplog.text


@pytest.mark.usefixtures("small_windows_off")
def test_an_op_the_compiler_fails_on_runs_alone_and_the_rest_compiles(monkeypatch, fresh_regions, caplog):
    """A compile that fails naming an op of the graph is retried with that op run alone."""
    from fuser.backends import BackendCompileError

    backend_class = type(get_backend("inductor", "cpu"))
    real_compile = backend_class.compile
    seen = []

    def compile(self, gm, examples):
        targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
        seen.append(targets)
        for bad in (torch.ops.aten.sin.default, torch.ops.aten.cos.default):
            if bad in targets:
                error = BackendCompileError(f"cannot lower {bad}")
                error.target = bad
                raise error
        return real_compile(self, gm, examples)

    monkeypatch.setattr(backend_class, "compile", compile)  # the class: no instance attribute left behind
    x = torch.randn(40)

    def program(x):
        return ((x * 2).sin() + 1).cos().exp() * 3

    with adaptive_eager(**_options()):
        for _ in range(4):
            y = program(x)
            ae.sync()
    torch.testing.assert_close(y, program(x))
    m = ae.metrics()
    assert m["run_alone"] == {"compile_failed": 2} and m["compiled_runs"] == 3
    assert m["blacklisted"] == 0 and m["compile_failures"] == 0
    assert any(torch.ops.aten.exp.default in t and torch.ops.aten.sin.default not in t for t in seen)


@pytest.mark.usefixtures("small_windows_off")
def test_split_region_with_a_lifted_float(no_sin, fresh_regions):
    """A float that changes every window becomes an input of the region (Note [Scalar lifting] in
    fuser.scalars); a piece that takes it is compiled like any other."""
    x = torch.randn(100)
    got = []
    with adaptive_eager(**_options()):
        for k in range(6):
            got.append((x.sin() * (0.5 + k / 10)).exp())
            ae.sync()
    for k, out in enumerate(got):
        torch.testing.assert_close(out, (x.sin() * (0.5 + k / 10)).exp())
    m = ae.metrics()
    assert m["compile_failures"] == 0 and m["blacklisted"] == 0 and m["compiled_runs"] >= 2, str(m)
    assert m["run_alone"] == {"not_lowerable": 1}, str(m)


@pytest.mark.usefixtures("small_windows_off")
def test_a_piece_of_views_only_stays_in_the_plan(no_sin, fresh_regions):
    """Between two ops that run alone, a ``detach`` computes nothing: Inductor would compile no
    code for it (it used to fail with "compiled a function, which has no Python wrapper" and send
    GPT-2's whole step to replay), so it runs in the plan."""
    x = torch.randn(8, 4)

    def program(x):
        return (x * 2).sin().detach().sin() * 3

    with adaptive_eager(**_options()):
        for _ in range(3):
            got = program(x)
            ae.sync()
    torch.testing.assert_close(got, program(x), rtol=0, atol=0)
    m = ae.metrics()
    assert m["blacklisted"] == 0 and m["compiled_runs"] == 2 and m["run_alone"] == {"not_lowerable": 2}, str(m)
