"""The same small programs on every device this machine has: cpu always, cuda when present.

CI has no GPU, so there the cuda cases are skipped; ``benchmarks/device_check.sh`` runs this
file on a GPU machine (with the cuda suite). Each program runs eagerly and under adaptive eager
with compiled regions, and must give eager's values, strides and devices.
"""

import tempfile

import pytest
import torch
import torch.nn.functional as F

import adaptive_eager as ae
from adaptive_eager import adaptive_eager

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _options(device):
    return dict(device=device, backend="inductor", hot_after=2, async_compile=False,
                cache_dir=tempfile.mkdtemp(prefix="ae_devices_"))


@pytest.fixture(params=DEVICES)
def device(request, fresh_regions):
    return request.param


def _same(got, want):
    assert got.device == want.device and got.shape == want.shape and got.stride() == want.stride()
    torch.testing.assert_close(got, want)


# Note [No waiting for the device]: on CUDA a flush launches its window (a compiled region, or
# op by op) and returns; the host records window N+1 while the GPU runs window N. Nothing on the
# flush path reads a device value on the host (``.item()``, ``.tolist()``, ``bool(t)``,
# ``nonzero``, a blocking copy to the host) or waits for the device (``torch.cuda.synchronize``,
# a stream's or an event's ``synchronize``, ``Event.wait``). Checked by counting those calls, not
# by timing: the training test's ``waits`` (any machine) and the set_sync_debug_mode test (cuda).
_HOST_READS = ("item", "tolist", "__bool__", "cpu", "numpy", "nonzero")


@pytest.fixture
def waits(monkeypatch):
    """Note [No waiting for the device], on any machine: the Python-level host reads and
    synchronizes called while a window runs (a wait inside an ATen kernel only the cuda test
    below sees), by name."""
    from adaptive_eager._state import _tls

    calls = []

    def counting(name, original):
        def during_flushes(*args, **kwargs):
            if getattr(_tls, "running", None) is not None:  # a window is running (adaptive_eager._flush)
                calls.append(name)
            return original(*args, **kwargs)
        return during_flushes

    for name in _HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch.cuda, "synchronize", counting("cuda.synchronize", torch.cuda.synchronize))
    for owner, name in ((torch.cuda.Stream, "synchronize"), (torch.cuda.Event, "synchronize"),
                        (torch.cuda.Event, "wait")):
        monkeypatch.setattr(owner, name, counting(f"{owner.__name__}.{name}", getattr(owner, name)))
    return calls


def test_elementwise_chain_compiles_on_the_device(device):
    x = torch.randn(1000, 33, device=device)

    def chain(x):
        return ((x * 1.5 + 0.5).sin() * x.cos()).relu().t() / 3

    with adaptive_eager(**_options(device)):
        outs = []
        for _ in range(4):
            outs.append(chain(x))
            ae.sync()
    for y in outs:
        _same(y, chain(x))
    m = ae.metrics()
    assert m["compiled_runs"] >= 2 and m["blacklisted"] == 0


@pytest.mark.usefixtures("small_windows_off")
def test_training_steps_match_eager_on_the_device(device, waits):
    """Eager's values, and no flush of the steps waits for the device (Note [No waiting for the device])."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                                torch.nn.Linear(64, 8)).to(device)
    twin = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                               torch.nn.Linear(64, 8)).to(device)
    twin.load_state_dict(model.state_dict())
    x, y = torch.randn(16, 32, device=device), torch.randn(16, 8, device=device)

    def train(m, steps):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = F.mse_loss(m(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    want = train(twin, 6)
    with adaptive_eager(**_options(device)):
        got = train(model, 6)
    for g, w in zip(got, want):
        _same(g, w)
    for p, q in zip(model.parameters(), twin.parameters()):
        _same(p, q)
        _same(p.grad, q.grad)
    m = ae.metrics()
    assert m["compiled_runs"] >= 2 and m["blacklisted"] == 0
    assert waits == []


def test_views_and_in_place_writes_on_the_device(device):
    base = torch.randn(6, 4, device=device)
    p = torch.randn(6, 4, device=device)

    def program(base, p):
        y = base * 2
        row = y[1]
        row.add_(1)  # through a view of a pending value
        p.mul_(0.5).add_(y, alpha=0.1)  # a real tensor, in place
        return y, row

    want_p = p.clone()
    want_y, want_row = program(base, want_p)
    with adaptive_eager(**_options(device)):
        for _ in range(3):
            q = p.clone()
            y, row = program(base, q)
            ae.sync()
    _same(y, want_y)
    _same(row, want_row)
    _same(q, want_p)
    assert row._base is y


def test_a_check_runs_alone_and_raises_on_the_device(device):
    good = torch.eye(4, device=device) * 2
    with adaptive_eager(**_options(device)):
        invs = []
        for _ in range(3):
            invs.append(torch.linalg.inv(good))
            ae.sync()
        with pytest.raises(torch.linalg.LinAlgError):
            torch.linalg.inv(torch.zeros(4, 4, device=device))
            ae.sync()
    for inv in invs:
        _same(inv, torch.linalg.inv(good))  # LAPACK's column-major strides, as eager gives
    assert ae.metrics()["run_alone"].get("check_op", 0) >= 1


def test_ops_are_recorded_on_the_device(device, monkeypatch):
    """Note [One record path]: elementwise ops and in-place updates with keywords are recorded on a
    target with several devices (cuda) too."""
    from adaptive_eager import _mode, _record

    real = _record._record
    recorded = []

    def counting(*a):
        res = real(*a)
        recorded.append(res is not _record._DECLINED)
        return res

    monkeypatch.setattr(_mode, "_record", counting)
    x, p = torch.randn(64, device=device), torch.randn(64, device=device)
    # a compiled window's next one is validated, not recorded (Note [Hot windows]): this counts records
    with adaptive_eager(**_options(device), tiers="regions"):
        for _ in range(3):  # the first sight of each signature fills the meta cache
            y = (x * 2).sin() + x
            p.mul_(0.9).add_(y, alpha=0.1)
            ae.sync()
    assert sum(recorded) >= 8, recorded
    assert y.device == x.device


def _train_step(model, opt, x, y):
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def _model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                               torch.nn.Linear(64, 8)).to(device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CI has none: benchmarks/device_check.sh runs it)")
def test_compiled_training_steps_never_wait_for_the_gpu(fresh_regions):
    """Note [No waiting for the device], on CUDA: with ``torch.cuda.set_sync_debug_mode("error")``
    every call that synchronizes with the device raises (a host read of a cuda tensor, a blocking
    copy to the host, ``nonzero``, ``torch.cuda.synchronize``), in the library's Python, in torch's
    and inside ATen kernels alike. Hot steps of a compiled training loop, with a flush each, must
    run through it."""
    model, twin = _model("cuda"), _model("cuda")
    x, y = torch.randn(16, 32, device="cuda"), torch.randn(16, 8, device="cuda")
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    want = [_train_step(twin, twin_opt, x, y) for _ in range(9)]
    with adaptive_eager(**_options("cuda")):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        got = [_train_step(model, opt, x, y) for _ in range(4)]  # replay, compile, then compiled runs
        ae.sync()
        torch.cuda.synchronize()
        runs = ae.metrics()["compiled_runs"]
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(5):
                got.append(_train_step(model, opt, x, y))
                ae.sync()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert ae.metrics()["compiled_runs"] - runs >= 5
    for g, w in zip(got, want):
        _same(g, w)
    for p, q in zip(model.parameters(), twin.parameters()):
        _same(p, q)
