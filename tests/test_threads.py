"""Threads: several threads recording and compiling at once (Note [One lock for the region
tables] in fuser.compiled). Plain eager is the oracle; every thread is joined with a timeout, so a
deadlock fails the test instead of hanging it."""

import contextlib
import sys
import threading

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import adaptive_eager

JOIN_S = 120


def _run_in_threads(*targets, timeout: float = JOIN_S):
    """Run each target in a thread of its own; re-raise the first error; fail if one hangs."""
    errors = []

    def guarded(fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(fn,), daemon=True) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread hung (deadlock?)"
    if errors:
        raise errors[0]


@contextlib.contextmanager
def _switch_often(interval: float = 1e-5):
    """Make thread switches frequent, so that races show."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


# ---------------------------------------------------------------------------------------------
# Several threads training at once with compiled regions


ACTIVATIONS = (torch.nn.Tanh, torch.nn.Sigmoid, torch.nn.SiLU, torch.nn.ELU, torch.nn.Softplus, torch.nn.Mish,
               torch.nn.Softsign, torch.nn.CELU, torch.nn.SELU, torch.nn.Hardswish)


def _model(seed: int, kind: int, activation):
    """Two structures (``kind`` 0 and 1): no two windows of different structures differ only in
    sizes, so no region is compiled for varying shapes."""
    g = torch.Generator().manual_seed(seed)
    layers = [torch.nn.Linear(6, 12), activation(), torch.nn.Linear(12, 3)]
    if kind == 1:
        layers[2:2] = [torch.nn.Linear(12, 12), activation()]
    model = torch.nn.Sequential(*layers)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _train(seed: int, kind: int, activation, steps: int, start=None, **options):
    g = torch.Generator().manual_seed(100 + seed)
    batches = [(torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)) for _ in range(steps)]
    model = _model(seed, kind, activation)
    # no optimizer state: every step is one window structure, so each pair compiles it once
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=1e-3)
    losses = []
    with adaptive_eager(**options) if options else contextlib.nullcontext():
        if start is not None:
            start.wait()
        for x, y in batches:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()]


@pytest.fixture
def no_background_compiles_left():
    """Stop the compile workers a test started (ten rounds queue more compiles than they finish)."""
    import fuser.compiled as fc

    yield
    for jobs in list(fc._JOBS.values()):
        jobs.shutdown()
    fc._JOBS.clear()


@pytest.mark.parametrize("async_compile, window, rounds", [(False, 1024, 1), (True, 24, 10)],
                         ids=["compile-in-process", "compile-in-background"])
def test_four_threads_train_at_once_with_compiled_regions(tmp_path, no_background_compiles_left, async_compile,
                                                          window, rounds):
    """Four threads, each training its own model, in two pairs of one structure (each pair hits the
    same regions), from the first sight of every window (each round has new structures), with
    frequent thread switches: every step and every final parameter is eager's. Compiling in
    process, the threads wait for compiles (one each, shared by a pair); in the background, they
    race through first sights and claims while the compiles run elsewhere."""
    steps = 5
    options = dict(backend="inductor", hot_after=1, window=window, async_compile=async_compile,
                   cache_dir=str(tmp_path))
    for r in range(rounds):
        models = [(seed, seed // 2, ACTIVATIONS[r]) for seed in range(4)]  # (seed, kind, activation)
        want = [_train(*m, steps) for m in models]
        got = [None] * len(models)
        start = threading.Barrier(len(models), timeout=JOIN_S)

        def trainer(i):
            return lambda: got.__setitem__(i, _train(*models[i], steps, start, **options))

        with _switch_often():
            _run_in_threads(*(trainer(i) for i in range(len(models))), timeout=600)
        for (losses, params), (want_losses, want_params) in zip(got, want):
            torch.testing.assert_close(losses, want_losses)
            for a, b in zip(params, want_params):
                torch.testing.assert_close(a, b)
    m = ae.metrics()
    assert m["blacklisted"] == 0 and m["compile_failures"] == 0
    if not async_compile:
        assert m["compiled_runs"] > 0
