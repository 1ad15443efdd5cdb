"""Note [Cores beside a compile] in adaptive_eager._cores: the ops we run leave a core to each
compile of ours running beside the program; the program's own code keeps its number of threads."""

import os
import time

import pytest
import torch

import adaptive_eager as ae
import fuser.artifacts
import fuser.regions
from adaptive_eager import _cores

pytestmark = pytest.mark.skipif(_cores._openmp() is None, reason="no OpenMP runtime in this build of torch")

SEEN: list = []  # the intra-op threads of each window replay


@pytest.fixture
def seen(monkeypatch):
    """Notes ``torch.get_num_threads()`` as each window replays (the ops we run at a flush)."""
    replay = fuser.regions.replay_window

    def noting(window):
        SEEN.append(torch.get_num_threads())
        return replay(window)

    monkeypatch.setattr(fuser.regions, "replay_window", noting)


@pytest.fixture
def threads(seen):
    before = torch.get_num_threads()
    SEEN.clear()
    _cores._tls.cores_check = 0.0  # look afresh at whether a compile runs
    yield
    torch.set_num_threads(before)


def _step(x):
    time.sleep(_cores._CHECK_S * 1.5)  # past the last look at whether a compile runs
    y = (x * 2).exp()
    ae.sync()
    return torch.get_num_threads()


def test_a_compile_beside_takes_a_core_from_the_ops_we_run_only(threads, monkeypatch, tmp_path):
    running = [1]
    monkeypatch.setattr(fuser.artifacts, "compiling", lambda: running[0])
    monkeypatch.setattr(_cores, "_cores", lambda: 2)
    torch.set_num_threads(2)
    with ae.adaptive_eager(cache_dir=str(tmp_path)):  # a new shape each time: each window replays
        outside = [_step(torch.randn(8))]
        running[0] = 0
        outside.append(_step(torch.randn(9)))
        running[0] = 1
        outside.append(_step(torch.randn(10)))
    assert SEEN == [1, 2, 1]  # the window's run, at the flush
    assert outside == [2, 2, 2]  # the program's code between the flushes
    assert torch.get_num_threads() == 2


def test_fewer_threads_than_free_cores_are_left_alone(threads, monkeypatch, tmp_path):
    monkeypatch.setattr(fuser.artifacts, "compiling", lambda: 1)
    monkeypatch.setattr(_cores, "_cores", lambda: 8)
    torch.set_num_threads(4)
    with ae.adaptive_eager(cache_dir=str(tmp_path)):
        _step(torch.randn(11))  # a shape no other test runs: its window replays
    assert SEEN == [4]


def test_the_number_is_the_calling_threads_alone(threads, monkeypatch):
    """Another thread (one the program starts, the compile thread) keeps its number meanwhile."""
    import threading

    monkeypatch.setattr(fuser.artifacts, "compiling", lambda: 1)
    monkeypatch.setattr(_cores, "_cores", lambda: 2)
    torch.set_num_threads(2)
    have = _cores.lower()
    try:
        assert have == 2 and torch.get_num_threads() == 1
        other = []
        thread = threading.Thread(target=lambda: other.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert other == [2]
    finally:
        _cores.restore(have)
    assert torch.get_num_threads() == 2


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to leave one")
def test_a_cold_loop_runs_its_ops_with_a_core_less_while_its_first_compile_runs(threads, tmp_path):
    """Default options, a cold cache: while the worker warms up (from the mode's entry) and compiles,
    the ops of the step's window run with one intra-op thread less; the program's code sees its
    number throughout."""
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    outside = []
    with ae.adaptive_eager(cache_dir=str(tmp_path)):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and 1 not in SEEN[3:]:
            loss = (model(x) - y).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss.item()
            outside.append(torch.get_num_threads())
            time.sleep(0.03)
    assert 1 in SEEN[3:], SEEN
    assert set(outside) == {2}
    assert torch.get_num_threads() == 2


def test_the_interim_backward_runs_with_a_core_less(threads, monkeypatch, tmp_path):
    """Note [The interim backward] in adaptive_eager._capture: the gradients of Dynamo's graph, run
    while the capture's trace is in the worker, are ops we run (at 2 threads beside a compile, the
    cold steps of an 8-block MLP took 10-200 ms against 6-7 ms)."""
    from adaptive_eager import _capture

    monkeypatch.setattr(fuser.artifacts, "compiling", lambda: 1)
    monkeypatch.setattr(_cores, "_cores", lambda: 2)
    monkeypatch.setattr(_capture._Interim, "_poll", lambda self, args: None)  # its record never lands
    grads = []
    grad = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: grads.append(torch.get_num_threads()) or grad(*a, **k))
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    outside = []
    with ae.adaptive_eager(backend="inductor", cache_dir=str(tmp_path), hot_after=2):
        for _ in range(5):
            model(torch.randn(8, 16)).square().mean().backward()
            outside.append(torch.get_num_threads())
    assert grads == [1] * 5, grads  # every call: a training call is captured at the first
    assert set(outside) == {2}
