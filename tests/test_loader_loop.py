"""The commonest training loop: a DataLoader over a TensorDataset, shuffled or not (Note [Views of
unwritten memory] in adaptive_eager._record). Its batches are rows picked by the sampler, and its
windows must repeat whatever rows it picks. Plain eager is the oracle."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import adaptive_eager as ae

# the windows of the loop are what is counted: the model's and the optimizer's calls are not
# captured (Note [Captured modules] in adaptive_eager._capture, tests/test_module_capture.py)
SYNC = dict(backend="inductor", hot_after=2, async_compile=False, tiers="hot")


def _train(steps: int, shuffle: bool):
    torch.manual_seed(0)
    x, y = torch.randn(96, 6), torch.randn(96, 1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=shuffle,
                        generator=torch.Generator().manual_seed(1))
    losses = []
    for xb, yb in loader:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        if len(losses) == steps:
            break
    return losses, list(model.parameters())


@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffled", "in_order"])
def test_a_loader_loops_windows_repeat_whatever_rows_the_sampler_picks(fresh_regions, shuffle):
    want_losses, want_params = _train(12, shuffle)
    ae.reset_metrics()
    with ae.adaptive_eager(**SYNC):
        losses, params = _train(12, shuffle)
    m = ae.metrics()
    # one structure from the third step on (the first steps differ: AdamW makes its state and reads
    # its step counter, and the parameters' views are recorded once the optimizer wrote them),
    # compiled (or loaded: the other parameter compiled it) at its second sight, then run compiled at each step whatever rows the batch holds
    assert m["compiles"] + m["cache_hits_disk"] == 1 and m["compiled_runs"] >= 12 - 4, (m["compiled_runs"], m["replay_reasons"])
    for a, b in zip(losses + params, want_losses + want_params):
        torch.testing.assert_close(a, b)


def test_a_view_of_memory_the_window_writes_later_is_read_in_eagers_order(fresh_regions):
    def step(w, r):
        v = w.t()  # a view of memory nothing has written yet: an input of its own
        w.add_(1)  # ... which the same window then writes
        return (v * 2 + r.t()).sum()

    want_w, r = torch.randn(4, 4), torch.randn(4, 4)
    want = [step(want_w, r) for _ in range(4)]
    w = torch.zeros(4, 4) + want_w - 4
    ae.reset_metrics()
    with ae.adaptive_eager(**{**SYNC, "hot_after": 1}):
        got = []
        for _ in range(4):
            got.append(step(w, r))
            ae.sync()
    m = ae.metrics()
    # the first window has two inputs over w's memory, one written: its transpose is derived from w
    # inside the graph (Note [Inputs over one memory] in fuser.compilable); from then on w's views are
    # recorded; r's view stays an input
    assert m["replay_reasons"] == {}, m["replay_reasons"]
    assert m["compiled_runs"] == 4, m
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(w, want_w)


def test_memory_a_freed_written_tensor_left_is_not_written(fresh_regions):
    """A storage recorded ops wrote, once freed, is forgotten: a dataset allocated at its address
    (CI's full run did so) had every row recorded as a view, and its loop never compiled."""
    from adaptive_eager._flush import is_written

    p = torch.zeros(96, 6)
    with ae.adaptive_eager(**SYNC):
        p.add_(1)
        p.sum().item()
    sid = p.untyped_storage()._cdata
    assert is_written(sid)
    del p
    assert not is_written(sid)
    reused = [torch.randn(96, 6) for _ in range(8)]  # likely one at the freed address
    assert not any(is_written(t.untyped_storage()._cdata) for t in reused)
