"""The mode parked between captured calls (Note [The mode parked between captured calls] in
adaptive_eager._state): once a training step is hot, the ops between its captured calls (the loss,
the backward, ``zero_grad``, ``item``) run with the mode off the dispatch stack. Plain eager is the
oracle; what crosses the mode is counted by a wrapper of its ``__torch_dispatch__``, not by the
library's metrics."""

import contextlib
import threading

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import adaptive_eager as ae
from adaptive_eager import _mode, _state

TOL = dict(rtol=1e-4, atol=1e-5)  # the captured graphs run compiled


def _stack():
    return [torch._C._get_dispatch_stack_at(i) for i in range(torch._C._len_torch_dispatch_stack())]


@pytest.fixture
def crossings(monkeypatch):
    """How many ops crossed the mode, counted around its ``__torch_dispatch__``."""
    count = [0]
    original = _mode.LazyMode.__torch_dispatch__

    def counted(self, func, types, args=(), kwargs=None):
        count[0] += 1
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(_mode.LazyMode, "__torch_dispatch__", counted)
    return count


def _loop(tmp_path, steps, lazy, between=None, each=None):
    """A small training loop; ``between(i, loss)`` runs between the forward and the backward,
    ``each(i)`` after each step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x, y = torch.randn(5, 8), torch.randn(5, 1)
    losses = []
    with ae.adaptive_eager(async_compile=False, cache_dir=str(tmp_path)) if lazy else contextlib.nullcontext():
        for i in range(steps):
            loss = nn.functional.mse_loss(model(x), y)
            if between is not None:
                loss = between(i, loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if each is not None:
                each(i)
    return losses, model


def _same(lazy, eager):
    torch.testing.assert_close(torch.tensor(lazy[0]), torch.tensor(eager[0]), **TOL)
    for a, b in zip(eager[1].parameters(), lazy[1].parameters()):
        torch.testing.assert_close(b, a, **TOL)


def _sgd_steps(optimizer=torch.optim.SGD):
    """A model, its input, and a training step of it (no loss function: the output's sum)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    x = torch.randn(5, 8)
    opt = optimizer(model.parameters(), lr=0.01)

    def step():
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    return model, x, step


def test_a_hot_step_crosses_the_mode_with_no_op(fresh_regions, tmp_path, crossings):
    per_step = []

    def each(i):
        per_step.append(crossings[0])
        crossings[0] = 0

    eager = _loop(tmp_path, 8, False)
    crossings[0] = 0
    lazy = _loop(tmp_path, 8, True, each=each)
    _same(lazy, eager)
    # the loss, its backward's seed and backward, six AccumulateGrad detaches, zero_grad's profiler
    # range, item: every one of them crossed the mode before (the step's range is not entered while
    # nothing profiles: Note [The step's profiler range] in adaptive_eager._optim)
    assert per_step[0] >= 10 and per_step[-4:] == [0, 0, 0, 0], per_step
    m = ae.metrics()
    assert m["parked"] >= 8 and m["module_compiled_runs"] >= 8, m
    assert _stack() == [] and _state.current_state().parked == 0  # left with the context


def test_a_stretch_that_grows_is_recorded_again(fresh_regions, tmp_path, monkeypatch):
    """Every ``_CHECK_EVERY``-th chance is recorded: a stretch that now holds 40 ops on a 64x64
    tensor (from step 6) stops the parking, and its window runs compiled."""
    monkeypatch.setattr(_state, "_CHECK_EVERY", 3)
    w = torch.randn(64, 64)

    def between(i, loss):
        if i < 6:
            return loss
        z = w
        for _ in range(20):
            z = torch.tanh(z * w)
        return loss + z.mean()

    parked = []
    eager = _loop(tmp_path, 20, False, between=between)
    lazy = _loop(tmp_path, 20, True, between=between, each=lambda i: parked.append(ae.metrics()["parked"]))
    _same(lazy, eager)
    assert parked[5] > 0 and parked[-1] == parked[-6], parked  # parked before the change, never in the last 5 steps
    assert ae.metrics()["compiled_runs"] >= 5


def test_an_error_in_a_parked_stretch_is_raised_at_its_line(fresh_regions, tmp_path):
    def between(i, loss):
        if i >= 4 and _state.current_state().parked:
            return loss + torch.ones(3, 2) @ torch.ones(3, 2)  # the line eager raises at
        return loss

    with pytest.raises(RuntimeError, match="cannot be multiplied") as info:
        _loop(tmp_path, 12, True, between=between)
    assert info.traceback[-1].frame.code.name == "between"
    assert _stack() == []


def test_hooks_run_in_a_parked_backward(fresh_regions, tmp_path):
    """A backward started with the mode parked runs with no mode: its captured graph, then autograd's
    accumulation and the parameters' hooks, as in eager."""
    calls = []

    def between(i, loss):
        if i == 0:
            for p in model_of[0].parameters():
                p.register_post_accumulate_grad_hook(lambda p: calls.append((tuple(p.shape), p.grad.norm().item())))
        return loss

    model_of = []
    real_sequential = nn.Sequential

    def keep(*layers):
        m = real_sequential(*layers)
        model_of.append(m)
        return m

    nn.Sequential = keep
    try:
        eager = _loop(tmp_path, 8, False, between=between)
        eager_calls, calls[:] = list(calls), []
        model_of.clear()
        lazy = _loop(tmp_path, 8, True, between=between)
    finally:
        nn.Sequential = real_sequential
    _same(lazy, eager)
    assert ae.metrics()["parked"] > 0
    # each step's hooks, a call per parameter (in the order autograd found them ready: a captured
    # backward makes every gradient at once)
    assert len(calls) == len(eager_calls) == 8 * 4
    for step in range(8):
        got, want = sorted(calls[4 * step:4 * step + 4]), sorted(eager_calls[4 * step:4 * step + 4])
        assert [s for s, _ in got] == [s for s, _ in want]
        torch.testing.assert_close(torch.tensor([n for _, n in got]), torch.tensor([n for _, n in want]), **TOL)


def test_a_mode_entered_while_parked_stays_above_ours(fresh_regions, tmp_path):
    model, x, step = _sgd_steps()
    seen = []

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with ae.adaptive_eager(async_compile=False, cache_dir=str(tmp_path)):
        for _ in range(6):
            step()
        st = _state.current_state()
        assert st.parked, ae.metrics()
        with Counting() as counting:
            assert _stack() == [counting]
            out = model(x)  # a captured call: ours comes back, under theirs
            assert _stack() == [st.mode, counting]
            doubled = out * 2  # theirs sees it first, as had ours been on all along
        assert _stack() == [st.mode] and not st.parked
        assert seen, "the program's mode saw no op"
        torch.testing.assert_close(doubled, model(x).detach() * 2, **TOL)
    assert _stack() == []


def test_another_thread_turning_the_mode_on_hands_over_real_values(fresh_regions, tmp_path):
    """A thread with the mode parked does not see another thread's pending values: a thread that
    turns the mode on meanwhile ends each window after one op; the parked thread parks no more
    while that thread lives."""
    _, _, step = _sgd_steps(torch.optim.AdamW)
    handed, go_on, done = [], threading.Event(), threading.Event()

    def other():
        with ae.adaptive_eager(async_compile=False, cache_dir=str(tmp_path)):
            a = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
            b = (a * 2).exp() + 1
            handed.append((a, b, ae.is_lazy(b)))
            go_on.set()
            done.wait(timeout=60)

    with ae.adaptive_eager(async_compile=False, cache_dir=str(tmp_path)):
        for _ in range(6):
            step()
        st = _state.current_state()
        assert st.parked
        thread = threading.Thread(target=other)
        thread.start()
        assert go_on.wait(timeout=60)
        a, b, lazy = handed[0]
        assert not lazy
        assert torch.equal(b, (a * 2).exp() + 1)  # ATen ops of this thread, its mode parked
        parked = ae.metrics()["parked"]
        for _ in range(3):
            step()
        assert ae.metrics()["parked"] == parked and not st.parked  # the other thread's mode is on
        done.set()
        thread.join()
        for _ in range(3):
            step()
        assert ae.metrics()["parked"] > parked


def test_leaving_with_the_mode_parked(fresh_regions, tmp_path):
    """``disable()`` and a block's exit with the mode parked leave no mode on the stack; a block
    with other options brings it back for its duration."""
    model, x, step = _sgd_steps()
    options = dict(async_compile=False, cache_dir=str(tmp_path))
    ae.enable(**options)
    try:
        for _ in range(6):
            step()
        st = _state.current_state()
        assert st.parked and _stack() == []
    finally:
        ae.disable()
    assert _stack() == [] and not st.parked and st.mode is None
    ae.enable(**options)
    try:
        for _ in range(3):
            step()
        assert st.parked and _stack() == []
        with ae.adaptive_eager(window_mb=512):  # other options: the mode is back on for the block
            assert not st.parked and _stack() == [st.mode]
            y = model(x) * 2
            assert ae.is_lazy(y)
        assert _stack() == [st.mode]
    finally:
        ae.disable()
    assert _stack() == []


def test_a_step_parks_again_after_the_options_change(fresh_regions, tmp_path):
    """An option that leaves the regions as they were (``window_mb``): their templates are made
    again under the new options (Note [Templates by region] in adaptive_eager._hot), so the loss
    window runs small and the step parks again; before, a template of the old options armed
    nothing, and the step stayed recorded for good."""
    _, _, step = _sgd_steps()
    options = dict(async_compile=False, cache_dir=str(tmp_path))
    ae.enable(**options)
    try:
        for _ in range(6):
            step()
        st = _state.current_state()
        assert st.parked
        ae.enable(**options, window_mb=512)
        parked = []
        for _ in range(8):
            step()
            parked.append(st.parked)
        assert parked[-1], (parked, ae.metrics()["hot_windows"])
    finally:
        ae.disable()
