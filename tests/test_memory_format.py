"""Layouts: a pending value's strides are eager's from the moment it is recorded (DESIGN.md, the
semantic contract: strides), for the ops whose output layout follows a memory format
(channels_last), forward and backward, replayed and compiled. Eager is the oracle; strides are
compared exactly, while the values are pending and after they are computed."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adaptive_eager as ae
from adaptive_eager import adaptive_eager

CL = torch.channels_last


@pytest.fixture(autouse=True, params=["replay", "inductor"])
def backend(request, fresh_regions, tmp_path):
    with ae.defaults(backend=request.param, hot_after=1, async_compile=False, cache_dir=str(tmp_path)):
        yield request.param


def _conv(cin, cout, k=3, memory_format=torch.contiguous_format):
    torch.manual_seed(0)
    return nn.Conv2d(cin, cout, k, padding=1).to(memory_format=memory_format)


# each: (inputs) -> outputs; inputs are (2, 4, 6, 6) channels_last and contiguous, made pending
# by the first op so that layouts also flow from one recorded op to the next
CASES = {
    "conv2d": lambda x, c: _conv(4, 3)(x),
    "conv2d of a contiguous input, channels_last weight": lambda x, c: _conv(4, 3, memory_format=CL)(c),
    "batch_norm (training)": lambda x, c: nn.BatchNorm2d(4)(x),
    "batch_norm (eval)": lambda x, c: nn.BatchNorm2d(4).eval()(x),
    "max_pool2d": lambda x, c: F.max_pool2d(x, 2),
    "max_pool2d with indices": lambda x, c: F.max_pool2d(x, 2, return_indices=True),
    "avg_pool2d": lambda x, c: F.avg_pool2d(x, 2),
    "adaptive_avg_pool2d to 1": lambda x, c: F.adaptive_avg_pool2d(x, 1),
    "adaptive_avg_pool2d to 3": lambda x, c: F.adaptive_avg_pool2d(x, 3),
    "upsample nearest": lambda x, c: F.interpolate(x, scale_factor=2),
    "upsample bilinear": lambda x, c: F.interpolate(x, scale_factor=2, mode="bilinear"),
    "add channels_last + contiguous": lambda x, c: x + c,
    "add contiguous + channels_last": lambda x, c: c + x,
    "relu": lambda x, c: F.relu(x),
    "clone(preserve_format)": lambda x, c: x.clone(memory_format=torch.preserve_format),
    "empty_like": lambda x, c: torch.empty_like(x).fill_(1),
    "to(channels_last) of contiguous": lambda x, c: c.to(memory_format=CL),
    "contiguous of channels_last": lambda x, c: x.contiguous(),
    "flatten of a conv output": lambda x, c: _conv(4, 3)(x).flatten(1),
    "pixel_shuffle": lambda x, c: F.pixel_shuffle(x, 2),
    "channel_shuffle": lambda x, c: F.channel_shuffle(x, 2),
}


def _inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 6, 6, generator=g).to(memory_format=CL).requires_grad_()
    c = torch.randn(2, 4, 6, 6, generator=g).requires_grad_()
    return x, c


def _run(case, lazy: bool):
    """Forward and backward of ``case``; the strides of its outputs and gradients as the program
    sees them when they are made (pending, under adaptive eager), then the tensors."""
    x, c = _inputs()
    seen = []
    with adaptive_eager() if lazy else _null():
        outs = CASES[case](x * 1, c * 1)
        outs = outs if isinstance(outs, tuple) else (outs,)
        seen.append([(o.stride(), o._base is not None) for o in outs])  # and whether a view
        pending = [ae.is_lazy(o) for o in outs]
        floats = [o for o in outs if o.is_floating_point()]
        loss = sum(((o * (i + 1)).sum() for i, o in enumerate(floats)), torch.zeros(()))
        if loss.requires_grad:
            loss.backward()
        grads = [t.grad for t in (x, c) if t.grad is not None]
        seen.append([t.stride() for t in grads])
        pending += [ae.is_lazy(t) for t in grads]
    return seen, [*outs, *grads], pending


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("case", list(CASES))
def test_pending_strides_are_eager_strides(case):
    want_seen, want, _ = _run(case, lazy=False)
    got_seen, got, pending = _run(case, lazy=True)
    assert any(pending), f"{case}: nothing was pending, nothing tested"
    assert got_seen == want_seen, f"{case}: strides while pending {got_seen}, eager {want_seen}"
    for g, w in zip(got, want):
        assert g.stride() == w.stride(), f"{case}: strides once computed {g.stride()}, eager {w.stride()}"
        if case != "empty_like":
            torch.testing.assert_close(g, w)


class LeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5, padding=2)
        self.bn1 = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.avg_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        return self.fc2(F.relu(self.fc1(x)))


def test_lenet_trained_in_channels_last_matches_eager():
    torch.manual_seed(0)
    model = LeNet().to(memory_format=CL)
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 1, 28, 28, generator=g).to(memory_format=CL), torch.randint(0, 10, (8,), generator=g))
               for _ in range(4)]

    def train(net, ctx):
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        losses = []
        with ctx:
            for x, y in batches:
                opt.zero_grad()
                logits = net(x)
                loss = F.cross_entropy(logits, y)
                loss.backward()
                opt.step()
                losses.append((loss.detach().clone(), logits.stride()))
        return losses

    got = train(model, adaptive_eager())
    want = train(twin, _null())
    for step, ((gl, gs), (wl, ws)) in enumerate(zip(got, want)):
        assert gs == ws, f"step {step}"
        torch.testing.assert_close(gl, wl, msg=f"step {step}")
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert p.stride() == q.stride(), name
        torch.testing.assert_close(p, q, msg=name)


def test_an_lstm_trains_with_eagers_values_and_its_workspace_is_never_run_on_stand_ins(monkeypatch, backend):
    """Note [Eager layouts]: the layout probe runs a first-sight op on the program's placeholders,
    uninitialized memory; ``mkldnn_rnn_layer_backward`` reads the forward's workspace as its own
    state, and that probe crashed the process (a segmentation fault, in about one run of four).
    Such an op keeps its meta kernel's layout, and the training matches eager. A window with
    ``mkldnn_rnn_layer`` (its workspace exists only in grad mode) replays, counted, never
    compiled to fail at its first run (``GRAD_MODE_OPS`` in fuser.compilable)."""
    import contextlib

    from adaptive_eager import _meta

    probed = []

    def train(lazy):
        torch.manual_seed(0)
        m = nn.LSTM(4, 6, batch_first=True)
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        xs = [torch.randn(b, 5, 4) for b in (4, 4, 2, 3)]
        losses = []
        with adaptive_eager() if lazy else contextlib.nullcontext():
            for x in xs:
                loss = m(x)[0].pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
        return losses, [p.detach() for p in m.parameters()]

    monkeypatch.setattr(_meta, "_eager_layouts", _watch_layouts(_meta._eager_layouts, probed))
    _meta.cache_clear()  # every op at first sight, in each variant
    ae.reset_metrics()
    lazy = train(True)
    m = ae.metrics()
    eager = train(False)
    assert m["blacklisted"] == 0 and m["compile_failures"] == 0, m
    if backend != "replay":
        assert m["not_compiled"].get("grad_mode_op"), m
    assert lazy[0] == pytest.approx(eager[0], rel=1e-5, abs=1e-7)
    for a, b in zip(lazy[1], eager[1]):
        torch.testing.assert_close(a, b)
    assert probed and not [name for name in probed if "rnn" in name and "backward" in name], probed


def _watch_layouts(eager_layouts, probed):
    """``_eager_layouts`` that lists the ops it runs on stand-ins."""
    def watched(f, args, kwargs, specs):
        specs, probe = eager_layouts(f, args, kwargs, specs)
        if probe is not None:
            probed.append(f.name)
        return specs, probe

    return watched
