"""Threads: a pending value read in another thread (Note [Reads from other threads] in
adaptive_eager._threads), and several threads recording and compiling at once (Note [One lock for
the region tables] in fuser.regions). Plain eager is the oracle; every thread is joined with a
timeout, so a deadlock fails the test instead of hanging it."""

import contextlib
import copy
import io
import pickle
import sys
import threading
import time

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


def _saved(t):
    buf = io.BytesIO()
    torch.save(t, buf)
    buf.seek(0)
    return torch.load(buf)


def _printed(t):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print(t)
    return out.getvalue()


# (what is read, how): each reads a pending tensor in a thread without the mode
READERS = {
    "float": (lambda y, s: float(s)),
    "item": (lambda y, s: s.item()),
    "format": (lambda y, s: f"{s:.6f}"),
    "tolist": (lambda y, s: y.tolist()),
    "numpy": (lambda y, s: y.numpy().tolist()),
    "repr": (lambda y, s: repr(y)),
    "print": (lambda y, s: _printed(y)),
    "torch.save": (lambda y, s: _saved(y).tolist()),
    "pickle": (lambda y, s: pickle.loads(pickle.dumps(y)).tolist()),
    "deepcopy": (lambda y, s: copy.deepcopy(y).tolist()),
    "data": (lambda y, s: y.data.tolist()),
    "iter": (lambda y, s: [float(v) for v in y]),
    "bool": (lambda y, s: bool(s)),
    # an alias made in the reading thread, without the mode: no mark, the placeholder's storage
    "detach float": (lambda y, s: float(s.detach())),
    "detach numpy": (lambda y, s: y.detach().numpy().tolist()),
    "view tolist": (lambda y, s: y.view(2, 3).tolist()),
    "index item": (lambda y, s: y[4].item()),
    # the documented hand-over: after one Python-level read, ATen ops see the value too
    "read then op": (lambda y, s: (float(s), (y + 1).tolist())),
}


@pytest.mark.parametrize("reader", READERS)
def test_another_thread_reads_the_eager_value(reader):
    read = READERS[reader]
    x = torch.randn(6)
    want_y = torch.sin(x) * 3 + 1
    want = read(want_y, want_y.sum())
    got = {}
    with adaptive_eager(backend="replay"):
        y = torch.sin(x) * 3 + 1
        s = y.sum()

        def other():
            got["lazy"] = (ae.is_lazy(y), ae.is_lazy(s))
            got["value"] = read(y, s)

        _run_in_threads(other)
        assert not ae.is_lazy(s)  # the other thread's read ran this thread's window
        z = y * 2  # recording goes on in the owning thread
    assert got["lazy"] == (True, True)
    assert got["value"] == want
    assert torch.equal(z, want_y * 2)
    assert ae.metrics()["flushes"].get("other_thread") == 1


def test_a_thread_reads_a_detached_loss_of_each_step():
    """A thread per step reads ``float(loss.detach())`` while the program holds ``loss``: the
    detach, made without the mode, carries no mark, and its storage is the placeholder's (Note
    [Reads from other threads]). Each read is the eager loss of its step."""

    def train(adaptive: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        xs, ys = torch.randn(6, 4, 8), torch.randn(6, 4, 1)
        seen, losses = [], []
        options = dict(backend="inductor", hot_after=1, async_compile=False)
        with adaptive_eager(**options) if adaptive else contextlib.nullcontext():
            for x, y in zip(xs, ys):
                loss = torch.nn.functional.mse_loss(model(x), y)
                _run_in_threads(lambda l=loss: seen.append(float(l.detach())))
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        return seen, losses

    eager_seen, eager_losses = train(False)
    seen, losses = train(True)
    assert seen == losses  # the thread read the value the program reads
    assert seen == pytest.approx(eager_seen, rel=1e-5, abs=1e-6)
    assert losses == pytest.approx(eager_losses, rel=1e-5, abs=1e-6)


@pytest.mark.usefixtures("small_windows_off")
def test_a_thread_reads_an_alias_of_a_hot_windows_value():
    """The same in hot windows, whose values are live while their tensors are (Note [Hot
    liveness]): a thread reads a detached value and an index into it while the program holds it."""
    x, w = torch.randn(16), torch.randn(16)

    def step(i):
        return torch.tanh(x * w + 0.5 * i) - x

    seen = []
    ae.reset_metrics()
    with adaptive_eager(backend="inductor", hot_after=1, async_compile=False):
        for i in range(6):
            y = step(i)
            _run_in_threads(lambda v=y: seen.append((float(v.detach()[3]), v.detach().tolist())))
            assert y.tolist() == seen[-1][1]
    assert ae.metrics()["hot_windows"] >= 3  # the reads met hot windows
    for i, (first, values) in enumerate(seen):
        want = step(i)
        assert first == want[3].item()
        assert values == pytest.approx(want.tolist(), rel=1e-6, abs=1e-6)


def test_a_logging_thread_reads_losses_while_the_owner_records():
    """The owner is in the middle of recording (small windows, frequent thread switches) whenever the
    logger reads: every value it logs is the eager loss of that step, and training is eager."""

    def train(lazy, log=None, steps=30):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        data = [(torch.randn(8, 6), torch.randn(8, 1)) for _ in range(steps)]
        losses = []
        with adaptive_eager(backend="replay", window=16) if lazy else contextlib.nullcontext():
            for step, (x, y) in enumerate(data):
                loss = torch.nn.functional.mse_loss(model(x), y)
                if log is not None:
                    log.append((step, loss.detach()))  # pending: read while this thread records on
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
        return [float(v) for v in losses], [p.detach().clone() for p in model.parameters()]

    want_losses, want_params = train(lazy=False)
    shared, logged, got, done = [], [], [], threading.Event()

    def logger():
        while not done.is_set() or shared:
            if shared:
                step, loss = shared.pop(0)
                logged.append((step, float(loss)))

    def owner():
        try:
            got.append(train(lazy=True, log=shared))
        finally:
            done.set()

    with _switch_often():
        _run_in_threads(owner, logger)
    ((got_losses, got_params),) = got
    assert got_losses == want_losses  # replay: bitwise
    for a, b in zip(got_params, want_params):
        assert torch.equal(a, b)
    assert len(logged) == 30 and all(value == want_losses[step] for step, value in logged)


def test_threads_with_the_mode_read_each_others_pending_values():
    """Each of two recording threads reads the other's pending value again and again, both at
    once: each read runs the other's window, and neither waits for the other while it records."""
    xa, xb = torch.randn(5), torch.randn(5)
    rounds = 40
    out = {}
    made = [None, None]
    barrier = threading.Barrier(2, timeout=JOIN_S)

    def side(i, x, scale):
        got = []
        with adaptive_eager(backend="replay"):
            for r in range(rounds):
                made[i] = x * scale + r
                barrier.wait()
                other = made[1 - i]
                got.append((other * 2 + made[i]).tolist())  # reads the other thread's pending value
                barrier.wait()
        out[i] = got

    with _switch_often():
        _run_in_threads(lambda: side(0, xa, 2.0), lambda: side(1, xb, 3.0))
    for r in range(rounds):
        a, b = xa * 2.0 + r, xb * 3.0 + r
        assert out[0][r] == (b * 2 + a).tolist()
        assert out[1][r] == (a * 2 + b).tolist()


def test_a_value_left_by_a_thread_that_ended_with_the_mode_on():
    x = torch.randn(7)
    left = []

    def worker():
        ae.enable(backend="replay")  # never disabled: the thread ends with its window open
        left.append((x.exp() - 1) * 4)

    _run_in_threads(worker)
    (t,) = left
    assert ae.is_lazy(t)
    assert t.tolist() == ((x.exp() - 1) * 4).tolist()
    assert not ae.is_lazy(t)


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
    import fuser.artifacts

    yield
    for jobs in list(fuser.artifacts._JOBS.values()):
        jobs.shutdown()
    fuser.artifacts._JOBS.clear()


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


def test_a_region_compile_waits_while_dynamo_compiles_in_another_thread(tmp_path):
    """FX tracing is process-wide state (Note [One trace at a time] in fuser.backends._common): a
    region's compile does not trace while another thread holds Dynamo's compile lock (as its
    optimizer capture or a torch.compile does); it compiles once the lock is free, and the values
    are eager's. Before, it traced at once, and the two traces could break each other."""
    from torch._dynamo.convert_frame import compile_lock
    from torch.fx import _symbolic_trace
    import torch.fx.experimental.proxy_tensor  # noqa: F401 - imported before the lock is held

    held, traced_while_held = threading.Event(), []

    def dynamo_compiling():
        with compile_lock:
            held.set()
            deadline = time.monotonic() + 3
            # a trace's patcher is process-wide (the tracing flag is per thread from torch 2.14)
            while time.monotonic() < deadline and _symbolic_trace.CURRENT_PATCHER is None:
                time.sleep(0.001)
            traced_while_held.append(_symbolic_trace.CURRENT_PATCHER is not None)

    x = torch.randn(64)
    want = ((x * 2 + 1).sin() * x).sum()
    other = threading.Thread(target=dynamo_compiling)
    other.start()
    held.wait(JOIN_S)
    with adaptive_eager(backend="inductor", hot_after=1, async_compile=False, cache_dir=str(tmp_path)):
        got = ((x * 2 + 1).sin() * x).sum()
        torch.testing.assert_close(got, want)
    other.join(JOIN_S)
    assert traced_while_held == [False]
    m = ae.metrics()
    assert m["compiles"] == 1 and m["compiled_runs"] == 1 and m["compile_failures"] == 0, str({k: v for k, v in m.items() if v})
