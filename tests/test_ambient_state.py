"""Ambient state that can change an op's result (Note [Meta cache key] in adaptive_eager._meta):
the program changes it between windows and in the middle of one; plain eager is the oracle."""

import contextlib

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import adaptive_eager


@pytest.fixture(autouse=True, params=["replay", "inductor"])
def backend(request, tmp_path):
    """Op-by-op replay, and compiled regions from the first sight of a window, with a cache of
    this test's own (a region compiled under another default dtype must not answer)."""
    with ae.defaults(backend=request.param, hot_after=1, async_compile=False, cache_dir=str(tmp_path)):
        yield request.param
    m = ae.metrics()
    assert m["compile_failures"] == 0 and m["blacklisted"] == 0 and m["corrupt_entries"] == 0


@pytest.fixture
def default_dtype():
    """Restores the default dtype the test changes."""
    before = torch.get_default_dtype()
    yield
    torch.set_default_dtype(before)


def _same(got, want, backend):
    """Eager's dtype, and its values: exact when replayed, within tolerance when compiled."""
    assert got.dtype == want.dtype
    exact = backend == "replay" or not got.is_floating_point()
    torch.testing.assert_close(got, want, **({"rtol": 0, "atol": 0} if exact else {}))


def _promoting(i):
    """Ops whose result dtype is the default dtype: an integer tensor with a Python float, true
    division of integers, factories without dtype=."""
    return [i * 1.5, i / 3, (i + 0.25).exp(), torch.full((3,), 2.5), torch.arange(0.0, 2.0, 0.5), torch.ones(2) + i[:2]]


@pytest.mark.usefixtures("default_dtype")
def test_default_dtype_changed_between_windows(backend):
    i = torch.arange(1, 5)
    for dtype in (torch.float32, torch.float64, torch.float32, torch.float64):
        torch.set_default_dtype(dtype)
        want = _promoting(i)
        with adaptive_eager():
            got = _promoting(i)
        for g, w in zip(got, want):
            _same(g, w, backend)
    # a window that ran eagerly (the third, whose region was compiled with float32: Note [Small
    # windows run eagerly] in adaptive_eager._hot) flushed nothing
    m = ae.metrics()
    assert m["flushes"] == {"exit": 4 - m["small_windows"]} and m["small_windows"] <= 1, m


@pytest.mark.usefixtures("default_dtype")
def test_default_dtype_changed_mid_window(backend):
    i = torch.arange(1, 5)
    want = _promoting(i)
    torch.set_default_dtype(torch.float64)
    want += _promoting(i)
    torch.set_default_dtype(torch.float32)
    with adaptive_eager():
        got = _promoting(i)
        torch.set_default_dtype(torch.float64)
        got += _promoting(i)
        assert all(ae.is_lazy(t) for t in got[-6:])
        torch.set_default_dtype(torch.float32)
    for g, w in zip(got, want):
        _same(g, w, backend)
    # the window ends where the default dtype changes with ops pending
    assert ae.metrics()["flushes"] == {"default_dtype": 1, "exit": 1}


@pytest.mark.usefixtures("default_dtype")
def test_window_runs_under_the_default_dtype_it_was_recorded_under(backend):
    i = torch.arange(1, 5)
    torch.set_default_dtype(torch.float64)
    want = _promoting(i)
    with adaptive_eager():
        got = _promoting(i)
        torch.set_default_dtype(torch.float32)  # no op after it: the exit flush runs the window
    assert torch.get_default_dtype() == torch.float32
    for g, w in zip(got, want):
        _same(g, w, backend)


@pytest.mark.parametrize("state", ["inference_mode", "no_grad", "deterministic", "autocast", "default_device"])
def test_ambient_state_changed_mid_window(state):
    """Each piece of ambient state the fake-tensor cache keys on (or that acts above the mode)
    turned on for part of a window: values, dtypes and flags as eager's."""

    @contextlib.contextmanager
    def scope():
        if state == "inference_mode":
            with torch.inference_mode():
                yield
        elif state == "no_grad":
            with torch.no_grad():
                yield
        elif state == "deterministic":
            torch.use_deterministic_algorithms(True)
            try:
                yield
            finally:
                torch.use_deterministic_algorithms(False)
        elif state == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                yield
        else:
            with torch.device("meta"):
                yield

    def program(x, w):
        a = x @ w + 1
        with scope():
            b = x @ w * 2
            c = a.cumsum(0) * 3
            z = torch.zeros(4, 4)  # on meta under torch.device("meta")
        d = (a * w).sum() + b.float().sum() + c.sum()
        if state != "inference_mode":
            d.backward()
        return a, b, c, z, d

    torch.manual_seed(0)
    x, w = torch.randn(4, 4), torch.randn(4, 4, requires_grad=True)
    want = program(x, w)
    want_grad, w.grad = w.grad, None
    with adaptive_eager():
        got = program(x, w)
    for g, e in zip(got, want):
        assert (g.dtype, g.device, g.requires_grad, g.is_inference()) == (e.dtype, e.device, e.requires_grad,
                                                                          e.is_inference())
        if g.device.type != "meta":
            torch.testing.assert_close(g, e)
    if want_grad is not None:
        torch.testing.assert_close(w.grad, want_grad)


def test_value_recorded_in_inference_mode_read_outside_and_back(backend):
    x = torch.randn(8)
    with torch.inference_mode():
        want_a = x * 2
    want_b = want_a + 1
    with torch.inference_mode():
        want_sum = float(want_b.sum())
    with adaptive_eager():
        with torch.inference_mode():
            a = x * 2
        b = a + 1
        with torch.inference_mode():
            total = float(b.sum())
    assert a.is_inference() and not b.is_inference()
    _same(a, want_a, backend)
    _same(b, want_b, backend)
    tolerance = {"rtol": 0, "atol": 0} if backend == "replay" else {"rtol": 1.3e-6, "atol": 1e-5}
    torch.testing.assert_close(total, want_sum, **tolerance)
