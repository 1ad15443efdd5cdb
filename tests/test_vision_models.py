"""Stock torchvision models (resnet18, mobilenet_v3_small; no weights download) trained with
BatchNorm in ``train()`` and served in ``eval()`` under adaptive eager as in plain eager: the
losses, the parameters and BatchNorm's running statistics are eager's. Replay runs eager's kernels
(bitwise equal); Inductor compiles the windows (within compiled tolerances).

torchvision's wheel is built against one torch release: beside this project's torch 2.13.0 its
import raises ``RuntimeError: operator torchvision::nms does not exist``, so these tests skip there.
To run them, make a venv with a matching pair::

    python3.11 -m venv /work/venv-tv
    /work/venv-tv/bin/pip install torch==2.14.1 torchvision==0.29.1 numpy xxhash diskcache pytest hypothesis
    PYTHONPATH=$PWD /work/venv-tv/bin/python -m pytest -q tests/test_vision_models.py -m 'slow or not slow'
"""

import tempfile

import pytest
import torch

try:
    import torchvision
except Exception as e:  # noqa: BLE001 - a wheel built for another torch raises RuntimeError, not ImportError
    pytest.skip(f"torchvision does not import beside torch {torch.__version__} ({type(e).__name__}: {e}); "
                f"run these tests in a venv with `pip install torch==2.14.1 torchvision==0.29.1` "
                f"(see this module's docstring)", allow_module_level=True)

import adaptive_eager as ae  # noqa: E402
from adaptive_eager import adaptive_eager  # noqa: E402

CLASSES = 10
MODELS = {
    "resnet18": lambda: torchvision.models.resnet18(num_classes=CLASSES),
    "mobilenet_v3_small": lambda: torchvision.models.mobilenet_v3_small(num_classes=CLASSES),
}
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
}


def _images(seed=0, batch=4, size=32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, size, size, generator=g), torch.randint(0, CLASSES, (batch,), generator=g)


def _train_and_serve(name, optimizer, steps, **options):
    """``steps`` training steps in train() (BatchNorm updating its statistics), then an eval()
    forward; the losses as tensors (read after the block: no sync per step), the eval logits and
    the model's state (parameters and BatchNorm buffers)."""
    torch.manual_seed(0)
    model = MODELS[name]()
    opt = OPTIMIZERS[optimizer](model.parameters())
    x, y = _images()
    losses = []

    def run():
        model.train()
        for _ in range(steps):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        model.eval()
        with torch.no_grad():
            return model(_images(seed=1)[0])

    if options:
        with adaptive_eager(**options):
            logits = run()
    else:
        logits = run()
    return torch.stack(losses), logits, {k: v.clone() for k, v in model.state_dict().items()}


def _assert_state_close(got, want, **tolerance):
    assert got.keys() == want.keys()
    for key in want:  # running_mean/var and num_batches_tracked included
        torch.testing.assert_close(got[key], want[key], msg=key, **tolerance)


@pytest.mark.slow  # 20-50 s each on 2 loaded cores: a model's 3 steps, eagerly and recorded
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_training_and_eval_replay_eagers_values_bit_for_bit(name, optimizer):
    """Replayed windows run eager's kernels in eager's order: losses, eval logits, parameters and
    BatchNorm's running statistics are eager's bit for bit. No op falls back to eager and no window
    ends at a random op; a training step is one window (the optimizer's step does not end it)."""
    steps = 3
    want = _train_and_serve(name, optimizer, steps)
    got = _train_and_serve(name, optimizer, steps, backend="replay")
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    _assert_state_close(got[2], want[2], rtol=0, atol=0)
    m = ae.metrics()
    assert m["fallback_ops"] == {}, m["fallback_ops"]
    assert "random" not in m["flushes"] and "fallback" not in m["flushes"], m["flushes"]


@pytest.mark.slow  # Inductor compiles a whole training step of each model (3-30 min on 2 loaded cores)
@pytest.mark.parametrize("name", [
    "mobilenet_v3_small",
    pytest.param("resnet18", marks=pytest.mark.xfail(reason="open: the third compiled loss is 7% off eager's "
                                                             "(0.0158 absolute; the first two agree), not yet explained")),
])
def test_training_and_eval_compile_within_compiled_tolerances(name, fresh_regions):
    """The same steps compiled by Inductor: every step after the first runs compiled (hot_after=1),
    with no compile failure, blacklisted region or op run alone; values within the tolerances of
    a reordered float reduction."""
    steps = 3
    want = _train_and_serve(name, "sgd", steps)
    got = _train_and_serve(name, "sgd", steps, backend="inductor", hot_after=1, async_compile=False,
                           cache_dir=tempfile.mkdtemp())
    m = ae.metrics()
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-3, atol=1e-4)
    _assert_state_close(got[2], want[2], rtol=1e-3, atol=1e-4)
    assert m["compile_failures"] == 0 and m["blacklisted"] == 0 and m["not_compiled"] == {}, str(m)
    assert m["compiled_runs"] >= steps - 1 and m["run_alone"] == {}, str(m)
    assert m["fallback_ops"] == {}, m["fallback_ops"]
