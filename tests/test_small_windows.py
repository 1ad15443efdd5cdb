"""Small windows run eagerly (Note [Small windows run eagerly] in adaptive_eager._hot): once a window
of a few ops on small tensors has run compiled, its next occurrences run op by op as they come,
with eager's kernels. Plain eager is the oracle, bitwise."""

import pytest
import torch
import torch.nn as nn

import adaptive_eager as ae

SYNC = dict(backend="inductor", hot_after=2, async_compile=False)  # a window seen once replays


def _small(x, w):
    return (torch.tanh(x * w) + 0.5).sum()  # 4 ops on 16 floats


def _big(x, w):
    y = x
    for _ in range(10):  # 20 ops: more than a small window holds
        y = torch.tanh(y * w)
    return y.sum()


def _wide(x, w):
    _wide.out = torch.tanh(x)  # read by later code only
    return x.sum()


def _run(step, steps, lazy, edit_at=None, size=16):
    torch.manual_seed(0)
    x, w = torch.randn(size), torch.randn(size)
    values, windows, small = [], [], []
    with ae.adaptive_eager(**SYNC) if lazy else _nothing():
        for i in range(steps):
            before = ae.metrics() if lazy else {}
            f = torch.sigmoid if i == edit_at else torch.tanh
            values.append((step(x, w) if f is torch.tanh else (f(x * w) + 0.5).sum()).item())
            if lazy:
                after = ae.metrics()
                windows.append(after["windows"] - before["windows"])
                small.append(after["small_windows"] - before["small_windows"])
    return values, windows, small


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_small_window_runs_eagerly_once_compiled(fresh_regions):
    eager, _, _ = _run(_small, 8, False)
    lazy, windows, small = _run(_small, 8, True)
    torch.testing.assert_close(torch.tensor(lazy), torch.tensor(eager))
    assert lazy[-3:] == eager[-3:]  # bitwise once run eagerly: eager's kernels
    # recorded and replayed while cold, compiled at the third, then run op by op as it comes
    assert windows[-3:] == [0, 0, 0] and small[-3:] == [1, 1, 1], (windows, small)
    m = ae.metrics()
    assert m["compiled_runs"] == 1 and m["compiles"] == 1, m


def test_a_window_of_more_ops_stays_compiled(fresh_regions):
    eager, _, _ = _run(_big, 8, False)
    lazy, windows, small = _run(_big, 8, True)
    torch.testing.assert_close(torch.tensor(lazy), torch.tensor(eager))
    assert windows[-3:] == [1, 1, 1] and small == [0] * 8, (windows, small)
    assert ae.metrics()["hot_windows"] >= 3


def test_a_window_that_differs_from_the_small_one_is_recorded(fresh_regions):
    """An op that is not the template's next one (sigmoid for tanh, at step 5) is recorded, as any
    op: the values are eager's, and the steps after it run eagerly again."""
    eager, _, _ = _run(_small, 9, False, edit_at=5)
    lazy, windows, small = _run(_small, 9, True, edit_at=5)
    torch.testing.assert_close(torch.tensor(lazy), torch.tensor(eager))
    assert lazy[:5] == eager[:5] and lazy[6:] == eager[6:]
    assert windows[5] == 1 and small[5] == 0 and small[-2:] == [1, 1], (windows, small)


def test_dropout_in_a_small_window_keeps_eagers_random_numbers(fresh_regions):
    def run(lazy):
        torch.manual_seed(0)
        x = torch.randn(16)
        out = []
        with ae.adaptive_eager(**SYNC) if lazy else _nothing():
            for _ in range(8):
                out.append(torch.nn.functional.dropout(x * 2, 0.5).sum().item())
        return out

    eager, lazy = run(False), run(True)
    torch.testing.assert_close(torch.tensor(lazy), torch.tensor(eager))  # the compiled step's sum: not bitwise
    assert lazy[-3:] == eager[-3:]  # the small windows': the same masks, eager's kernels
    assert ae.metrics()["small_windows"] >= 3


def test_a_window_whose_wide_output_only_later_code_reads_runs_eagerly(fresh_regions):
    """What bounds a small window is the bytes it makes and reads again itself (none here): its
    128 KiB output is written by a compiled region as by eager, so fusing saves nothing."""
    eager, _, _ = _run(_wide, 8, False, size=1 << 15)
    lazy, windows, small = _run(_wide, 8, True, size=1 << 15)
    assert lazy[-3:] == eager[-3:]
    assert windows[-3:] == [0, 0, 0] and small[-3:] == [1, 1, 1], (windows, small)


def test_a_short_chain_on_wide_tensors_stays_compiled(fresh_regions):
    """The same 4 ops as the small window on 32K floats: their 128 KiB intermediates are read again
    inside the window, so the region that keeps them in registers runs."""
    eager, _, _ = _run(_small, 8, False, size=1 << 15)
    lazy, windows, small = _run(_small, 8, True, size=1 << 15)
    torch.testing.assert_close(torch.tensor(lazy), torch.tensor(eager))
    assert windows[-3:] == [1, 1, 1] and small == [0] * 8, (windows, small)


@pytest.mark.parametrize("width", [1, 512])
def test_a_training_steps_loss_window_runs_eagerly(fresh_regions, tmp_path, width):
    """The window between a captured forward and its captured backward (the loss, the backward's
    seed and the loss's backward) is small: it runs eagerly, with the mode parked (Note [The mode
    parked between captured calls] in adaptive_eager._state), and each step flushes no window. At
    width 512 the loss's gradient is 128 KiB, which only the captured backward reads."""

    def run(lazy):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, width))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        x, y = torch.randn(64, 8), torch.randn(64, width)
        losses, windows = [], []
        with ae.adaptive_eager(async_compile=False, cache_dir=str(tmp_path)) if lazy else _nothing():
            for _ in range(8):
                before = ae.metrics()["windows"] if lazy else 0
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                windows.append(ae.metrics()["windows"] - before if lazy else 0)
        return losses, model, windows

    eager, lazy = run(False), run(True)
    torch.testing.assert_close(torch.tensor(lazy[0]), torch.tensor(eager[0]), rtol=1e-4, atol=1e-5)
    for a, b in zip(eager[1].parameters(), lazy[1].parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    m = ae.metrics()
    assert lazy[2][-3:] == [0, 0, 0] and m["parked"] >= 3, (lazy[2], m)
    assert m["module_compiled_runs"] > 0 and m["module_uncompiled_runs"] == 0, m


@pytest.mark.parametrize("device", ["cpu"])
def test_an_error_in_a_small_window_is_raised_at_its_op(fresh_regions, device):
    """Run eagerly, an op's error is eager's, at the op's own line."""
    x, w = torch.randn(16), torch.randn(16)
    with ae.adaptive_eager(**SYNC):
        for _ in range(5):
            _small(x, w).item()
        assert ae.metrics()["small_windows"] >= 1
        with pytest.raises(RuntimeError, match="size of tensor"):
            _small(x, torch.randn(3))
