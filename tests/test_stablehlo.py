"""The stablehlo backend (torch-mlir lowering, XLA CPU executable) under adaptive eager, against eager.

The backend contract tests (tests/test_backends.py) run against it too. Regions here are compiled
from first sight (``hot_after=1``) in this process, so every window exercises the lowering.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
from _oracle import program_env
import torch
from hypothesis import Phase, given, settings
from torch.fx.experimental.proxy_tensor import make_fx

import adaptive_eager as ae
from adaptive_eager.config import ConfigError, load_options
from fuser.backends.stablehlo import INSTALL_HINT, StablehloBackend, missing_requirements
from test_generated_programs import assert_lazy_matches_eager, programs
from test_neuron_backend import train_mlp, update_in_place

_MISSING = missing_requirements()
needs_stablehlo = pytest.mark.skipif(bool(_MISSING), reason=f"needs {', '.join(_MISSING)}: {INSTALL_HINT}")
STABLEHLO = dict(backend="stablehlo", hot_after=1, async_compile=False)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_missing_packages_are_named_with_the_install_command(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch_mlir" else find_spec(name, *a))
    with pytest.raises(ImportError, match=r"needs torch-mlir, which are not installed: pip install -e \"\.\[neuron\]\""):
        StablehloBackend("cpu")
    # at enable(), before any window runs
    with pytest.raises(ConfigError, match=r"torch-mlir.*pip install -e \"\.\[neuron\]\""):
        load_options({}, backend="stablehlo", device="cpu")


@needs_stablehlo
def test_backend_is_chosen_by_the_environment_for_cpu_only():
    assert load_options({"NEURON_EAGER_BACKEND": "stablehlo", "NEURON_EAGER_DEVICE": "cpu"}).backend == "stablehlo"
    with pytest.raises(ConfigError, match="backend 'stablehlo' compiles for cpu, not 'cuda'"):
        load_options({"NEURON_EAGER_BACKEND": "stablehlo", "NEURON_EAGER_DEVICE": "cuda"})


@needs_stablehlo
def test_training_loop_matches_eager(fresh_regions):
    want_losses, want_params = train_mlp("cpu", None)
    ae.reset_metrics()
    got_losses, got_params = train_mlp("cpu", STABLEHLO)
    m = ae.metrics()
    assert m["compiled_runs"] >= 3 and m["blacklisted"] == 0 and m["compile_failures"] == 0, m
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-5, atol=1e-5)
    for got, want in zip(got_params, want_params):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@needs_stablehlo
def test_a_region_that_writes_its_inputs_stores_them_in_its_own_launch(fresh_regions):
    """Tensors updated in place: the region stores their new values itself (Note [Regions that write
    their inputs]) instead of the fuser copying each back, one launch per tensor (4 a step before);
    the tensors keep their memory and eager's version counters, and values match eager. The window
    reads an int64 tensor, which keeps Inductor's regions from writing in place (a kernel's index
    check could fail after some stores); these stores come after the run (``stores_after_run``)."""
    want, _, _ = update_in_place(None, read_ints=True)
    got, launches, kept = update_in_place(STABLEHLO, read_ints=True)
    m = ae.metrics()
    assert m["compiled_runs"] == 3 and m["compile_failures"] == 0, m
    assert launches == [1, 1, 1] and kept, launches
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


_WARM = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, sys.argv[1])
    import adaptive_eager as ae
    import fuser.backends.stablehlo as stablehlo

    if sys.argv[3] == "warm":
        def no_lowering(*args, **kwargs):
            raise AssertionError("a warm process lowered a graph")
        stablehlo._lower = no_lowering  # would fail any compile, and any op probe, loudly
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    losses = []
    with ae.adaptive_eager(cache_dir=sys.argv[2], backend="stablehlo", hot_after=1, async_compile=False):
        for _ in range(3):
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    m = ae.metrics()
    print(json.dumps({k: m[k] for k in ("compiles", "cache_hits_disk", "compiled_runs", "compile_failures",
                                        "blacklisted")} | {"losses": losses}))
    """
)


@pytest.mark.slow  # 53 s; test_neuron_emulation's warm restart (28 s) checks the same on stablehlo
@needs_stablehlo
def test_warm_restart_compiles_nothing_and_loads_every_region_from_disk(tmp_path):
    env = program_env()

    def run(mode):
        out = subprocess.run([sys.executable, "-c", _WARM, REPO, str(tmp_path), mode], env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    cold, warm = run("cold"), run("warm")
    assert cold["compiles"] >= 1 and cold["compile_failures"] == 0, cold
    assert warm["compiles"] == 0 and warm["cache_hits_disk"] == cold["compiles"], (cold, warm)
    assert warm["compile_failures"] == 0 and warm["blacklisted"] == 0 and warm["compiled_runs"] == cold["compiled_runs"]
    assert warm["losses"] == cold["losses"]


def _ops_torch_mlir_cannot_lower(x, i):
    a = torch.special.bessel_j0(x.clamp(-0.5, 0.5)) * 2  # torch-mlir has no lowering for bessel_j0
    b = torch.remainder(x, 0.75) + 1  # lowered to C's fmod: wrong sign for negative x
    return a + b + i


@needs_stablehlo
def test_ops_it_cannot_lower_run_alone_and_are_counted(fresh_regions):
    x, i = torch.randn(6, 5), torch.arange(5.0)
    want = _ops_torch_mlir_cannot_lower(x, i)
    with ae.adaptive_eager(**STABLEHLO):
        got = _ops_torch_mlir_cannot_lower(x, i)
    m = ae.metrics()
    assert m["run_alone"] == {"not_lowerable": 1, "miscompiled": 1} and m["compiled_runs"] == 1, m
    assert m["blacklisted"] == 0 and m["compile_failures"] == 0, m
    torch.testing.assert_close(got, want)


@needs_stablehlo
@pytest.mark.parametrize("index", [
    lambda x, i: x[i],
    lambda x, i: x.index_select(0, i),
    lambda x, i: torch.gather(x, 0, i),
    lambda x, i: torch.nn.functional.embedding(i, x.unsqueeze(1)),
    lambda x, i: x.index_put((i,), torch.ones(2)),
    lambda x, i: x.scatter(0, i, torch.ones(2)),
], ids=["index", "index_select", "gather", "embedding", "index_put", "scatter"])
def test_an_index_out_of_range_raises_eagers_error_instead_of_being_clamped(fresh_regions, index):
    """XLA clamps a gather or scatter index out of range: compiled, x[[1, 10]] of 5 values gave
    x[1] + x[4]. The region checks its indices (Note [Checked indices]): in range it runs whole and
    agrees with eager, out of range its run raises and the replay raises eager's own error."""
    x = torch.randn(5)
    good, bad = torch.tensor([1, 3]), torch.tensor([1, 10])
    with pytest.raises((IndexError, RuntimeError)) as eager:
        index(x * 2, bad)
    want = index(x * 2, good).sin()
    with ae.adaptive_eager(**STABLEHLO):
        got = index(x * 2, good).sin()
        torch.testing.assert_close(got, want)
        with pytest.raises(type(eager.value), match=re.escape(str(eager.value))):
            index(x * 2, bad.clone()).sin().sum().item()  # a pending index: the region checks it
        got = index(x * 2, good).sin()
        torch.testing.assert_close(got, want)
    m = ae.metrics()
    assert not m["run_alone"] and m["compiled_runs"] >= 2 and m["blacklisted"] == 0, m


@needs_stablehlo
@pytest.mark.parametrize("index", [
    lambda x, i: x[i],
    lambda x, i: x.index_put((i,), torch.ones(2)),
    lambda x, i: x.index_fill(0, i, 3.0),
], ids=["index", "index_put", "index_fill"])
def test_negative_indices_count_from_the_end_in_a_region(fresh_regions, index):
    """Eager counts these ops' negative indices from the end; XLA's gather would clamp them to 0."""
    x = torch.randn(5)
    with ae.adaptive_eager(**STABLEHLO):
        got = [index(x * 2, i * 1) for i in (torch.tensor([-1, -5]), torch.tensor([-2, 4]))]
        ae.sync()
    torch.testing.assert_close(got, [index(x * 2, i) for i in (torch.tensor([-1, -5]), torch.tensor([-2, 4]))])
    assert not ae.metrics()["run_alone"], ae.metrics()


@needs_stablehlo
def test_unsupported_names_only_ops_that_do_not_lower():
    backend = StablehloBackend("cpu")
    gm = make_fx(_ops_torch_mlir_cannot_lower)(torch.randn(6, 5), torch.arange(5.0))
    verdicts = {str(n.target): backend.unsupported(n) for n in gm.graph.nodes if n.op == "call_function"}
    assert verdicts == {"aten.clamp.default": None, "aten.special_bessel_j0.default": "not_lowerable", "aten.mul.Tensor": None,
                        "aten.remainder.Scalar": "miscompiled", "aten.add.Tensor": None}, verdicts


@needs_stablehlo
def test_op_that_lowers_only_at_some_sizes_runs_alone_where_it_does_not(fresh_regions):
    """``isin`` decomposes to a broadcast compare against few test elements and to ``searchsorted``,
    which torch-mlir cannot lower, against many: same op signature, so ``unsupported`` passes it;
    the failed compile names it and the region is compiled again with it run alone."""
    from fuser.backends import get_backend

    get_backend("stablehlo", "cpu")._lowerable.clear()  # what earlier tests learned about isin
    x, few, many = torch.arange(3.0), torch.tensor([1.0, 2.0]), torch.arange(100.0) % 7
    got = []
    with ae.adaptive_eager(**STABLEHLO):
        for tests in (few, many):
            got.append(torch.isin(x * 1, tests))
            ae.sync()
    torch.testing.assert_close(got, [torch.isin(x, tests) for tests in (few, many)])
    m = ae.metrics()
    assert m["run_alone"] == {"compile_failed": 1} and m["compiled_runs"] == 2, m
    assert m["compile_failures"] == 0 and m["blacklisted"] == 0, m


@needs_stablehlo
def test_tensor_constants_of_decompositions_compile():
    """group_norm's decomposition makes a tensor constant; XLA takes it only as dense elements."""
    x, w, b = torch.randn(2, 6, 5), torch.randn(6), torch.randn(6)
    gm = make_fx(lambda x, w, b: (torch.nn.functional.group_norm(x, 3, w, b),))(x, w, b)
    backend = StablehloBackend("cpu")
    torch.testing.assert_close(backend.load(backend.compile(gm, [x, w, b]))([x, w, b]), gm(x, w, b))


def _view_after_bessel_j0(x):
    a = torch.special.bessel_j0(x)
    return a.t()[1:], (a * 2).sum(0)


@needs_stablehlo
def test_piece_that_returns_a_view_of_its_input_shares_its_storage():
    """Around a node that runs alone, a piece may return a view of the value it takes (here
    ``a.t()[1:]``, a piece of its own): the output is that view of the input at call time, with
    eager's strides and storage offset (it was refused: "output aliases an input")."""
    from fuser import partition

    backend = StablehloBackend("cpu")
    x = torch.randn(6, 8).clamp(-0.5, 0.5)
    gm = make_fx(_view_after_bessel_j0)(x)
    alone = partition.alone(gm, backend)
    assert list(alone.values()) == ["not_lowerable"]
    run = partition.load(partition.split(gm, [x], alone, backend), backend)
    got, want = run([x]), gm(x)
    for g, w in zip(got, want):
        assert (g.shape, g.stride(), g.storage_offset()) == (w.shape, w.stride(), w.storage_offset())
        torch.testing.assert_close(g, w)


def _permuted_roots(x):
    y = x.transpose(1, 2) * 2  # a pointwise op keeps its input's layout: eager's strides permute row-major
    z = x.permute(2, 0, 3, 1).exp()
    ones = x[:, :1].transpose(0, 3) + 1  # sizes of 1 among the permuted dimensions
    return y, y[:, 1:], z, ones


@needs_stablehlo
def test_roots_laid_out_as_a_permutation_are_returned_in_eagers_memory_order():
    """Note [Outputs that share storage]: a root whose eager strides permute the row-major ones (a
    pointwise op of a transposed view: SDPA's scaled key in Llama) comes out of the executable in
    eager's memory order, and its outputs are views of it with eager's strides: one launch a call.
    It was copied into eager's strides after the run, one launch more per such root (Llama's
    captured forward, 2 a step on the emulated device)."""
    backend = StablehloBackend("cpu")
    x = torch.randn(2, 3, 4, 5)
    gm = make_fx(_permuted_roots)(x)
    run = backend.load(backend.compile(gm, [x]))
    got, want = run([x]), gm(x)
    for g, w in zip(got, want):
        assert (g.shape, g.stride(), g.storage_offset()) == (w.shape, w.stride(), w.storage_offset())
        torch.testing.assert_close(g, w)
    assert got[0].untyped_storage().data_ptr() == got[1].untyped_storage().data_ptr()
    assert run.launches == 1, run.launches


def _wide(x, i):
    d = x.to(torch.float64)
    tiny = (d + 1e-12) - d  # 1e-12 in float64, 0 in float32
    return (d.exp() * 3, tiny, i.amax(), i.sum(0), (i * 3).argmax(), torch.where(i > -3, d, 1e300))


def _wide_inputs():
    # all-negative ints: an int64 max-reduction starts from INT64_MIN, which must become INT32_MIN
    return [torch.randn(4, 3), torch.randint(-9, -1, (4, 3))]


@needs_stablehlo
@pytest.mark.parametrize("narrow", [False, True], ids=["exact", "narrow_64bit"])
def test_64_bit_types_keep_eager_dtypes_at_the_boundary(narrow):
    inputs = _wide_inputs()
    gm = make_fx(_wide)(*inputs)
    backend = StablehloBackend("cpu", narrow_64bit=narrow)
    got = backend.load(backend.compile(gm, inputs))(inputs)
    want = gm(*inputs)
    assert [t.dtype for t in got] == [t.dtype for t in want] == [torch.float64, torch.float64, torch.int64,
                                                                 torch.int64, torch.int64, torch.float64]
    for g, w in zip(got, want):
        if narrow:
            # float32 arithmetic: ~1e-7 relative; 1e300 saturates to inf in float32
            torch.testing.assert_close(g, w.to(torch.float32).to(w.dtype), rtol=1e-6, atol=1e-6)
        else:
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-15)
    assert (got[1] == 0).all() if narrow else (got[1] > 0).all()


@needs_stablehlo
def test_narrowed_module_has_no_64_bit_type():
    from fuser.backends._stablehlo_lowering import _lower

    inputs = _wide_inputs()
    text = _lower(make_fx(_wide)(*inputs), inputs, narrow_64bit=True)
    assert "f32" in text and "i32" in text
    assert "f64" not in text and "i64>" not in text and "xi64" not in text, text


# Shrinking would compile every candidate: a failure reports the program as generated instead.
@needs_stablehlo
@settings(max_examples=10, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate])
@given(programs(drop_values=True))
def test_generated_programs_compiled_from_first_sight_match_eager(program):
    """Views among outputs, write-backs, dead values and int64/bool programs through the lowering."""
    assert_lazy_matches_eager(program, **STABLEHLO)


OPINFO_SAMPLES = int(os.environ.get("AE_TEST_OPINFO_SAMPLES", "2"))  # the first samples of each op
# AE_TEST_OPINFO_OPS=N: every (len/N)-th op only, a bounded sweep (tests/test_neuron_emulation.py's)
OPINFO_OPS = int(os.environ.get("AE_TEST_OPINFO_OPS", "0"))
# AE_TEST_OPINFO_NAMES=amax,_to_copy,...: only the ops of these names (OpInfo's ``name``, as printed)
OPINFO_NAMES = {n for n in os.environ.get("AE_TEST_OPINFO_NAMES", "").split(",") if n}


@needs_stablehlo
@pytest.mark.skipif(os.environ.get("AE_TEST_STABLEHLO_OPINFO") != "1",
                    reason="compiles ~1000 regions (~30 min on 2 cores): AE_TEST_STABLEHLO_OPINFO=1 runs it")
@pytest.mark.filterwarnings("ignore")
def test_opinfo_float32_samples_compiled_by_stablehlo_agree_with_eager(monkeypatch, capsys, fresh_regions):
    """tests/test_opinfo.py's differential test with every sample's window compiled by this backend
    (its first samples, the op's own form: in-place forms and pending inputs test the tracer, which
    test_opinfo.py covers); prints the agreement and the ops torch-mlir cannot lower. The samples
    are on the test device (Note [Test device] in _device.py)."""
    import itertools
    import time

    import test_opinfo as opinfo
    from torch.testing._internal.common_methods_invocations import op_db

    from _device import DEVICE
    from fuser.backends import get_backend
    from fuser.backends._common import op_name

    monkeypatch.setattr(opinfo, "BACKEND", "stablehlo")
    tally, replayed = opinfo.Tally(), {}
    start = time.perf_counter()
    with ae.defaults(hot_after=1, async_compile=False):
        ops = [op for op in op_db if torch.float32 in op.supported_dtypes("cpu")
               and (not OPINFO_NAMES or op.name in OPINFO_NAMES or opinfo.full_name(op) in OPINFO_NAMES)]
        for op in ops[::max(1, len(ops) // OPINFO_OPS)] if OPINFO_OPS else ops:
            name = opinfo.full_name(op)
            try:
                samples = list(itertools.islice(op.sample_inputs(DEVICE, torch.float32), OPINFO_SAMPLES))
            except Exception as e:  # noqa: BLE001 - a broken OpInfo is reported, not fatal
                tally.skipped[name] = f"sample_inputs raised {type(e).__name__}"
                continue
            for sample in samples:
                if opinfo.is_sparse((sample.input, sample.args, sample.kwargs)):
                    continue
                failures = ae.metrics()["compile_failures"]
                opinfo.check_sample(op, sample, name, op.name, False, tally)
                if ae.metrics()["compile_failures"] > failures:
                    replayed[name] = replayed.get(name, 0) + 1
    backend = get_backend("stablehlo", DEVICE)
    not_lowerable = sorted({op_name(key[0]) for key, why in backend._lowerable.items() if why})
    with capsys.disabled():
        tally.print_summary(f"OpInfo float32 samples on {DEVICE} compiled by stablehlo", time.perf_counter() - start,
                            opinfo.REQUIRED_AGREEMENT)
        print(f"  ops torch-mlir cannot lower (run alone, {len(not_lowerable)}): {', '.join(not_lowerable)}")
        print(f"  samples whose region failed to compile and was replayed ({sum(replayed.values())}): "
              + ", ".join(f"{k} ({v})" for k, v in sorted(replayed.items())))
    assert tally.rate >= opinfo.REQUIRED_AGREEMENT, f"agreement {tally.rate:.2%}"


_ZERO_DIM = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, sys.argv[1])
    import adaptive_eager as ae

    def program(t, i):
        x = t.sum() * 0.25  # pending: a 0-dim op on real cpu tensors would run at once (the scalar fast path)
        return [x.var(), x.std(), x.logsumexp(0), x.argmax(), torch.var_mean(x)[0], x.softmax(0), x.cumsum(0),
                x.sum() + x.amax() * 2, torch.lt(x, i), x.amin(-1, keepdim=True), x.argmin(0), *x.max(0),
                *x.min(-1, keepdim=True), x.max(), (x > 0).all(), (x > 1).any(0), x.log_softmax(-1), x.cumprod(0),
                *x.cummax(0), x.norm(), x.prod(0), x.mean((0,)), torch.stack([x, x * 2]), x.unsqueeze(-1).squeeze(0)]

    t, i = torch.tensor([0.75, 2.0, -1.0]), torch.tensor(3)
    want = program(t, i)
    with ae.adaptive_eager(cache_dir=sys.argv[2], backend="stablehlo", hot_after=1, async_compile=False):
        got = program(t, i)
        ae.sync()
    m = ae.metrics()
    assert m["compiled_runs"] == 1 and not m["run_alone"], m  # Note [Reductions over a 0-dim tensor]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, equal_nan=True)
    print("ok")
    """
)


@needs_stablehlo
def test_reductions_over_a_0_dim_tensor_lower_over_one_element_instead_of_crashing_torch_mlir(tmp_path):
    """torch-mlir's passes crash the process (SIGSEGV) on these (Note [Lowerings that crash]); they
    are traced over a 1-element vector (Note [Reductions over a 0-dim tensor]) and lower in one
    region. A child process, so that a regression fails this test instead of killing the test run."""
    env = program_env()
    out = subprocess.run([sys.executable, "-c", _ZERO_DIM, REPO, str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (out.returncode, out.stderr[-3000:])


def _pool_inputs(shape=(2, 3, 9, 7)):
    return [torch.randn(*shape)]


def _avg_backward(*args):
    def f(x):
        out = torch.ops.aten.avg_pool2d(x, *args)
        return torch.ops.aten.avg_pool2d_backward(out.cos(), x, *args)
    return f


def _max_backward(*args):
    def f(x):
        out, indices = torch.ops.aten.max_pool2d_with_indices(x, *args)
        return out, torch.ops.aten.max_pool2d_with_indices_backward(out.cos(), x, *args, indices)
    return f


def _adaptive_backward(size):
    def f(x):
        out = torch.ops.aten._adaptive_avg_pool2d(x, size)
        return out, torch.ops.aten._adaptive_avg_pool2d_backward(out.cos(), x)
    return f


def _with_specials(t):
    t = t.clone()
    t.view(-1)[:4] = torch.tensor([float("nan"), 0.0, float("inf"), -float("inf")])[: t.numel()]
    return t


_NEWLY_LOWERED = {
    # op -> (program, inputs): each op ran alone (not_lowerable) before Note [Our decompositions]
    "addmv": (lambda a, m, v: (torch.addmv(a, m, v), torch.addmv(a, m, v, beta=0.5, alpha=-2.0)),
              lambda: [torch.randn(5), torch.randn(5, 7), torch.randn(7)]),
    "all/any over dims": (lambda x, u: (torch.ops.aten.all.dims(x, [0, -1]), torch.ops.aten.any.dims(x, [1], True),
                                        torch.ops.aten.all.dims(x, []), torch.ops.aten.any.dims(u, None)),
                          lambda: [torch.randint(0, 3, (3, 4, 5)).float(), torch.randint(0, 2, (4, 3), dtype=torch.uint8)]),
    "batch norm in evaluation": (
        lambda x, w, b, rm, rv: (*torch.ops.aten.native_batch_norm(x, w, b, rm, rv, False, 0.1, 1e-5),
                                 *torch.ops.aten._native_batch_norm_legit(x, None, b, rm, rv, False, 0.1, 1e-3),
                                 *torch.ops.aten._native_batch_norm_legit_no_training(x[:, :, 0], w, None, rm, rv, 0.1, 1e-5)),
        lambda: [torch.randn(3, 2, 4, 5), torch.randn(2), torch.randn(2), torch.randn(2), torch.rand(2)]),
    "fmax": (lambda a, b: (torch.fmax(a, b), torch.fmax(b[0], a)),
             lambda: [_with_specials(torch.randn(4, 5)), torch.tensor([[1.0], [float("nan")], [0.5], [-2.0]])]),
    "fmin": (lambda a, b: (torch.fmin(a, b), torch.fmin(b[0], a)),
             lambda: [_with_specials(torch.randn(4, 5)), torch.tensor([[1.0], [float("nan")], [0.5], [-2.0]])]),
    "cumprod": (lambda x, i: (x.cumprod(1), x.cumprod(0), x.cumprod(-1, dtype=torch.float64), i.cumprod(0)),
                lambda: [torch.randn(5, 11) * 1.5, torch.randint(-3, 4, (7, 2))]),
    "cummax": (lambda x, i: (*x.cummax(1), *x.cummax(0), *i.cummax(0)),
               lambda: [_with_specials(torch.randint(-2, 3, (6, 9)).float()), torch.randint(-3, 4, (7, 2))]),
    "cummin": (lambda x, i: (*x.cummin(1), *x.cummin(0), *i.cummin(0)),
               lambda: [_with_specials(torch.randint(-2, 3, (6, 9)).float()), torch.randint(-3, 4, (7, 2))]),
    "erfc": (lambda x, h: (torch.erfc(x), torch.erfc(h)),
             lambda: [_with_specials(torch.linspace(-11, 11, 4001)), torch.linspace(-4, 4, 101).half()]),
    "erfinv": (lambda x: (torch.erfinv(x),),
               lambda: [torch.cat([torch.linspace(-1, 1, 4001), torch.tensor([1.5, -1.5, float("nan")]),
                                   1 - torch.logspace(-7, -1, 50)])]),
    "avg_pool2d divisor_override": (
        lambda x: tuple(torch.ops.aten.avg_pool2d(x, [3, 2], [2, 1], [1, 1], ceil, pad, 5)
                        for ceil in (False, True) for pad in (False, True)), _pool_inputs),
    "avg_pool2d_backward": (
        lambda x: (_avg_backward([3, 3], [2, 2], [1, 1], True, False, None)(x),
                   _avg_backward([2, 3], [2, 2], [0, 1], False, True, None)(x),
                   _avg_backward([2, 2], [], [0, 0], True, True, 3)(x)), _pool_inputs),
    "_adaptive_avg_pool2d_backward": (
        lambda x: (*_adaptive_backward([4, 3])(x), *_adaptive_backward([1, 1])(x), *_adaptive_backward([9, 2])(x[0])),
        _pool_inputs),
    "max_pool2d_with_indices_backward": (
        lambda x: (*_max_backward([3, 3], [2, 2], [1, 1], [1, 1], False)(x),
                   *_max_backward([2, 2], [2, 1], [0, 0], [2, 1], True)(x),
                   *_max_backward([3, 2], [1, 1], [1, 0], [1, 1], False)(x[0])),
        lambda: [torch.randint(-3, 3, (2, 3, 9, 7)).float()]),  # ties: eager's index is the first
}


@needs_stablehlo
@pytest.mark.parametrize("name", list(_NEWLY_LOWERED))
def test_ops_torch_mlir_lacks_are_decomposed_and_match_eager(name):
    """Note [Our decompositions]: each op lowers in one region with the ops around it (before, it
    ran alone: "not_lowerable") and its values, dtypes and shapes are eager's, NaN and infinities
    included, within float32 tolerances."""
    program, inputs = _NEWLY_LOWERED[name]
    torch.manual_seed(0)
    inputs = inputs()
    gm = make_fx(program)(*inputs)
    backend = StablehloBackend("cpu")
    verdicts = {str(n.target): backend.unsupported(n) for n in gm.graph.nodes if n.op == "call_function"}
    assert not any(verdicts.values()), verdicts
    got, want = backend.load(backend.compile(gm, inputs))(inputs), gm(*inputs)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g.dtype, g.shape) == (w.dtype, w.shape)
        torch.testing.assert_close(g, w, equal_nan=True, **({"rtol": 1e-3, "atol": 1e-3} if w.dtype == torch.half else {}))


@needs_stablehlo
@pytest.mark.parametrize("narrow", [False, True], ids=["exact", "narrow_64bit"])
def test_float32_formulas_lower_float64_only_when_the_region_computes_in_32_bits(narrow):
    """erfc/erfinv are float32-accurate (Note [Our decompositions]): exact float64 keeps them run alone."""
    x = torch.linspace(-0.9, 0.9, 50, dtype=torch.float64)
    gm = make_fx(lambda x: (torch.erfc(x * 3), torch.erfinv(x)))(x)
    backend = StablehloBackend("cpu", narrow_64bit=narrow)
    verdicts = [backend.unsupported(n) for n in gm.graph.nodes if n.op == "call_function"]
    assert verdicts == ([None, None, None] if narrow else [None, "not_lowerable", "not_lowerable"]), verdicts
    if narrow:
        for g, w in zip(backend.load(backend.compile(gm, [x]))([x]), gm(x)):
            assert g.dtype == torch.float64
            torch.testing.assert_close(g, w, rtol=2e-6, atol=1e-6)


@needs_stablehlo
def test_variance_of_no_elements_is_nan_as_in_eager(fresh_regions):
    """torch-mlir lowers var/std over no elements to -0.0 (eager: NaN); found with 12 OpInfo
    samples an op, so such calls ran alone ("miscompiled", Note [Ops that run alone]). Their kernels
    warn (degrees of freedom <= 0), so they now run eagerly, never in a region (Note [Kernel
    warnings] in adaptive_eager._kernel_warnings); the values must stay eager's either way."""
    x = torch.randn(0, 5)
    want = [x.var(), x.std(1), torch.var_mean(x, 0)[0]]
    with ae.adaptive_eager(**STABLEHLO):
        got = [(x * 1).var(), (x * 1).std(1), torch.var_mean(x * 1, 0)[0]]
        ae.sync()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, equal_nan=True)
    m = ae.metrics()
    assert sum(m["fallback_ops"].values()) == 3 and m["flushes"].get("kernel_warning") == 3, m



def _split_step(params, grads, index):
    for p, g in zip(params, grads):
        p.mul_(0.9).add_(torch.special.bessel_j0(g), alpha=-0.1)  # bessel_j0 runs alone: a split region
    return params[0][index].sum() * 2  # checked in the region (Note [Checked indices]): it may raise


def _run_split_steps(options, indices):
    """Steps of ``_split_step`` (synced) with each index; the tensors, each step's result (None
    where it raised IndexError), each step's launches, and whether memory and versions are eager's."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(4, 3, generator=gen) for _ in range(3)]
    grads = [torch.randn(4, 3, generator=gen) for _ in range(3)]
    addresses = [p.data_ptr() for p in params]
    launches, outs = [], []
    with ae.adaptive_eager(**options) if options else contextlib.nullcontext():
        for index in indices:
            before = ae.metrics()["launches"]
            try:
                out = _split_step(params, grads, index)
                ae.sync()  # adaptive eager raises eager's error here (the failed run is replayed)
            except IndexError:
                out = None
            outs.append(out)
            launches.append(ae.metrics()["launches"] - before)
    kept = [p.data_ptr() for p in params] == addresses and [p._version for p in params] == [2 * len(indices)] * 3
    return params, outs, launches, kept


@needs_stablehlo
def test_a_split_region_stores_its_inputs_in_one_last_launch(fresh_regions):
    """Note [A split region's stores]: a region split around ops that run alone stores the inputs it
    writes in one last piece, not one copy per tensor through the fuser; values, memory and version
    counters are eager's. An index out of range (checked in its piece: Note [Checked indices])
    raises before that piece runs, so the replay after the failed run applies each update once, as
    eager does."""
    good, bad = torch.tensor([1, 3]), torch.tensor([1, 10])
    indices = [good, good, good, bad, good]
    want, want_outs, _, _ = _run_split_steps(None, indices)
    got, got_outs, launches, kept = _run_split_steps(STABLEHLO, indices)
    m = ae.metrics()
    assert m["compile_failures"] == 0 and kept, m
    # no write-back copy through the fuser: the split region's run is its 2 pieces (the updates and
    # the checked index, then one that stores all 3 inputs: no clone before those stores, as no
    # store writes what another reads), the 3 bessel_j0 run alone, and the index's range check
    # (aminmax, 2 reads: Note [Errors from data]): Note [Launches of a compiled callable]
    assert [launches[i] for i in (1, 2, 4)] == [2 + 3 + 3] * 3, launches
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert [o is None for o in got_outs] == [o is None for o in want_outs] == [False, False, False, True, False]
    torch.testing.assert_close([o for o in got_outs if o is not None], [o for o in want_outs if o is not None])


def _rotate_half_step(x: torch.Tensor, w: torch.Tensor):
    """Llama's ``rotate_half`` forward and backward: slices to the end of the last dimension."""
    x = x.detach().requires_grad_()
    half = x.shape[-1] // 2
    y = torch.cat((-x[..., half:], x[..., :half]), dim=-1) * w
    y.sum().backward()
    return y.detach(), x.grad


@needs_stablehlo
def test_slices_to_the_end_lower_with_the_dimension_as_their_end(fresh_regions, monkeypatch):
    """Note [Slice bounds]: ``x[..., k:]`` and its backward's ``slice_scatter`` end at INT64_MAX,
    on which torch-mlir allocated until ``std::bad_alloc``; lowered with the dimension as the end
    they compile, and the StableHLO holds no INT64_MAX."""
    import fuser.backends.stablehlo as stablehlo

    texts = []
    lower = stablehlo._lower

    def recording(*args, **kwargs):
        texts.append(lower(*args, **kwargs))
        return texts[-1]

    monkeypatch.setattr(stablehlo, "_lower", recording)
    x, w = torch.randn(2, 3, 8), torch.randn(8)
    want = _rotate_half_step(x, w)
    with ae.adaptive_eager(**STABLEHLO):
        got = _rotate_half_step(x, w)
        ae.sync()
    m = ae.metrics()
    torch.testing.assert_close(got, want)
    assert m["compiled_runs"] >= 1 and m["compile_failures"] == 0 and not m["run_alone"], m
    assert texts and all(str(2**63 - 1) not in t for t in texts)


@needs_stablehlo
def test_foreach_ops_lower_per_tensor():
    """An optimizer's foreach ops (as Dynamo traces AdamW's foreach step for a captured step on
    the emulated device) lower as the op per tensor (Note [Our decompositions]); torch-mlir has no
    lowering of its own for them, so each ran alone."""

    def step(p0, p1, g0, g1, m0, m1):
        params, grads, moments = [p0, p1], [g0, g1], [m0, m1]
        moments = torch._foreach_lerp(moments, grads, 0.1)
        denom = torch._foreach_add(torch._foreach_sqrt(torch._foreach_mul(grads, grads)), 1e-8)
        update = torch._foreach_addcdiv(params, moments, denom, value=-0.01)
        return (*torch._foreach_maximum(update, -1.0), *torch._foreach_div(moments, [2.0, 3.0]),
                *torch._foreach_norm(grads, 2))

    inputs = [torch.randn(3, 4), torch.randn(5), torch.randn(3, 4), torch.randn(5), torch.randn(3, 4), torch.randn(5)]
    gm = make_fx(step)(*inputs)
    assert any("_foreach_" in str(n.target) for n in gm.graph.nodes)
    backend = StablehloBackend("cpu")
    got = backend.load(backend.compile(gm, inputs))(inputs)
    for g, e in zip(got, step(*inputs)):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)


@needs_stablehlo
def test_a_region_whose_result_is_a_0_dim_bool_is_not_taken_for_its_bounds_flag(fresh_regions):
    """Note [Checked indices]: the out-of-range flag is the last result only of a region that reads
    indices; a region returning one 0-dim bool of its own (``all``: GPT-2's attention mask test)
    returns it, in range or not."""
    x = torch.randn(5)
    with ae.adaptive_eager(**STABLEHLO):
        got = [bool((x * k > -10).all()) for k in (1, 100)]
    assert got == [bool((x * k > -10).all()) for k in (1, 100)]
    assert ae.metrics()["blacklisted"] == 0, ae.metrics()
