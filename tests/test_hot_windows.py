"""Hot windows (Note [Hot windows] in adaptive_eager._hot): once a window's structure runs compiled,
the next one is recorded against it op by op; the first op that differs turns the window into an
ordinary recording. Plain eager is the oracle; ``hot_windows=False`` gives the full recording to
compare a demoted window with."""

import threading

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager._state import current_state
from fuser.window import Out

SYNC = dict(backend="inductor", hot_after=2, async_compile=False)  # a window seen once replays
N = 50  # ops of the step


def _op(i, y, x, w):
    """The step's op at position ``i``: a mix of binary, scalar, unary and in-place ops."""
    k = i % 5
    if k == 0:
        return y * w
    if k == 1:
        return y + 0.5
    if k == 2:
        return torch.tanh(y)
    if k == 3:
        return y - x
    return y.mul_(2)  # in place, on a pending value


W_STRIDED = torch.randn(16, 2)[:, 0]  # w's shape and dtype, another stride
W_DOUBLE = torch.randn(16, dtype=torch.float64)


def _other_binding(i, y, x, w):
    k = i % 5
    if k == 0:
        return y * x  # x, in slot 0, where w (slot 1) was: one tensor for two slots
    if k in (1, 2):
        return _op(i, x, x, w)  # a real input where a pending value was
    if k == 3:
        return y - w
    return (y * 1).mul_(2)


# the ways an op at a position can differ from the one the compiled window had there
DIVERGE = {
    "op": lambda i, y, x, w: torch.sigmoid(y),
    "binding": _other_binding,
    "metadata": lambda i, y, x, w: y * (W_DOUBLE if i % 2 else W_STRIDED),
    "scalar": lambda i, y, x, w: y + 0.25 if i % 5 == 1 else (y.mul_(3) if i % 5 == 4 else _op(i, y, x, w) * 1),
}


def _step(x, w, diverge=None, at=-1, n=N):
    y = x
    for i in range(n):
        y = DIVERGE[diverge](i, y, x, w) if i == at else _op(i, y, x, w)
    return y


def _hot_loop(x, w, steps=3):
    """Run the step until its window runs hot; returns its eager value."""
    for _ in range(steps):
        y = _step(x, w)
        ae.sync()
    assert ae.metrics()["hot_windows"] >= 1, ae.metrics()["hot_mismatches"]
    return y


def test_a_hot_window_runs_its_region_without_recording(fresh_regions):
    x, w = torch.randn(16), torch.randn(16)
    want = _step(x, w)
    ys = []
    with ae.adaptive_eager(**SYNC):
        for _ in range(5):
            ys.append(_step(x, w))
            ae.sync()
    m = ae.metrics()
    for y in ys:
        torch.testing.assert_close(y, want)
    assert m["hot_windows"] == 3 and m["hot_ops"] == 3 * N and m["hot_mismatches"] == {}, m
    assert m["compiled_runs"] == 4  # replayed, compiled, then three hot windows


@pytest.mark.parametrize("kind", DIVERGE)
def test_a_window_that_diverges_at_any_position(fresh_regions, kind):
    x, w = torch.randn(16), torch.randn(16)
    want = {at: _step(x, w, kind, at) for at in range(N)}
    got, counts = {}, []
    with ae.adaptive_eager(**SYNC):
        _hot_loop(x, w)
        for at in range(N):
            before = ae.metrics()
            got[at] = _step(x, w, kind, at)
            ae.sync()
            after = ae.metrics()
            # the window after it is the compiled one again: hot
            got[at, "next"] = _step(x, w)
            ae.sync()
            counts.append((sum(after["hot_mismatches"].values()) - sum(before["hot_mismatches"].values()),
                           after["hot_windows"] - before["hot_windows"], ae.metrics()["hot_windows"] - after["hot_windows"]))
    assert counts == [(1, 0, 1)] * N  # each demoted once, not run hot; the next one hot
    for at in range(N):
        torch.testing.assert_close(got[at], want[at], msg=f"diverged at {at}")
        torch.testing.assert_close(got[at, "next"], _step(x, w))


def test_a_window_that_ends_early_or_runs_past_the_end(fresh_regions):
    x, w = torch.randn(16), torch.randn(16)
    with ae.adaptive_eager(**SYNC):
        _hot_loop(x, w)
        y = _step(x, w, n=20)
        s = y.tolist()  # mid-window: a read ends it before the template's end
        y = _step(y, w, n=N - 20)
        ae.sync()
        # the read ended the window; the next one starts hot (its ops are the step's first ones) and
        # ends early too
        assert ae.metrics()["hot_mismatches"] == {"ended_early": 2}
        z = _step(x, w, n=N + 5)
        ae.sync()
    assert ae.metrics()["hot_mismatches"] == {"ended_early": 2, "past_end": 1}
    want = _step(x, w, n=20)
    assert s == want.tolist()
    torch.testing.assert_close(y, _step(want, w, n=N - 20))
    torch.testing.assert_close(z, _step(x, w, n=N + 5))


def test_an_error_in_a_hot_window_is_raised_at_the_users_line(fresh_regions):
    table = torch.randn(10, 4)

    def step(idx):
        rows = torch.index_select(table, 0, idx)  # the line the error names
        return torch.tanh(rows * 2) + 1

    good, bad = [torch.tensor([1, 2, 3]) for _ in range(4)], torch.tensor([1, 20, 3])
    with ae.adaptive_eager(**SYNC):
        for idx in good:
            y = step(idx)
            ae.sync()
        assert ae.metrics()["hot_windows"] >= 1
        y = step(bad)  # recorded hot: the out-of-range index shows when it runs
        with pytest.raises(IndexError, match=r"recorded at .*test_hot_windows.py:\d+ \(in step\)") as err:
            ae.sync()
    line = step.__code__.co_firstlineno + 1
    assert f"test_hot_windows.py:{line} " in str(err.value)
    assert ae.metrics()["hot_mismatches"].get("run_failed") == 1
    del y


def test_a_kept_intermediate_changes_the_liveness(fresh_regions):
    x, w = torch.randn(16), torch.randn(16)

    def step(keep):
        h = torch.tanh(x * w)
        kept = h if keep else None
        return torch.sigmoid(h) + 1, kept

    with ae.adaptive_eager(**SYNC):
        for _ in range(4):
            y, _ = step(False)
            ae.sync()
        hot = ae.metrics()["hot_windows"]
        assert hot >= 1
        y, kept = step(True)  # the same ops, one more value observable
        ae.sync()
        assert ae.metrics()["hot_mismatches"].get("liveness") == 1
        assert ae.metrics()["hot_windows"] == hot
    torch.testing.assert_close(kept, torch.tanh(x * w))
    torch.testing.assert_close(y, torch.sigmoid(torch.tanh(x * w)) + 1)


def test_another_thread_reads_a_pending_value_of_a_hot_window(fresh_regions):
    x, w = torch.randn(16), torch.randn(16)
    got = {}
    with ae.adaptive_eager(**SYNC):
        _hot_loop(x, w)
        y = _step(x, w, n=20)
        reader = threading.Thread(target=lambda: got.setdefault("y", y.tolist()), daemon=True)
        reader.start()
        reader.join(120)
        assert not reader.is_alive()
        z = _step(y, w, n=N - 20)  # recording goes on in the owning thread
        ae.sync()
    want = _step(x, w, n=20)
    assert got["y"] == want.tolist()
    torch.testing.assert_close(z, _step(want, w, n=N - 20))
    # the read ended the window; the rest of the step, recorded hot from the template's start, ends early too
    assert ae.metrics()["hot_mismatches"] == {"ended_early": 2}
    assert ae.metrics()["flushes"].get("other_thread") == 1


def _snapshot(window):
    """What a window holds, with Outs named by uid and tensors by identity: two recordings of one
    program compare equal."""

    def norm(a):
        if type(a) is Out:
            return ("out", a.uid, a.kind, a.slot)
        if isinstance(a, torch.Tensor):
            return ("tensor", id(a))
        if type(a) in (list, tuple):
            return type(a)(norm(x) for x in a)
        return a

    storage = torch._C.TensorBase.untyped_storage  # unpatched: ``t.untyped_storage()`` would flush
    storages = {storage(t)._cdata: slot for slot, t in enumerate(window.real_inputs)}
    nodes = [(n.func, norm(n.args), norm(n.kwargs), [o.uid for o in n.inputs], n.mutates, n.is_view, list(n.fpos),
              n.fbase, n.source, [(o.uid, o.kind, o.meta, o.slot) for o in n.outs], n.index) for n in window.nodes]
    return dict(nodes=nodes, sigs=list(window.sigs), scalars=list(window.scalars), slots=dict(window.slots),
                real=[id(t) for t in window.real_inputs], mutated=set(window.mutated),
                written=sorted(storages.get(sid, -1) for sid in window.written),  # by slot; -1: a placeholder's
                fresh=[(o.uid, o.meta) for o in window.fresh], others=[(o.uid, o.kind) for o in window.others],
                pending_bytes=window.pending_bytes)


def test_a_demoted_window_is_the_window_a_full_recording_makes(fresh_regions):
    x, w, buf = torch.randn(16), torch.randn(16), torch.zeros(16)

    def program(at):
        y = _step(x, w, "op", at, n=N)
        buf.add_(y)  # an in-place write of a real tensor, recorded after the demotion
        return y

    with ae.adaptive_eager(**SYNC):
        _hot_loop(x, w)
        hot_windows = ae.metrics()["hot_windows"]
        y = program(30)
        assert ae.metrics()["hot_mismatches"] == {"op": 1}
        hot = _snapshot(current_state().window)
        ae.sync()
        # the window after a demotion is recorded against the template again, and runs hot
        y2 = _step(x, w)
        ae.sync()
        assert ae.metrics()["hot_windows"] == hot_windows + 1
    with ae.adaptive_eager(**SYNC, hot_windows=False):
        y3 = program(30)
        full = _snapshot(current_state().window)
        ae.sync()
    assert ae.metrics()["hot_windows"] == hot_windows + 1
    assert len(hot["nodes"]) == N + 1
    assert hot == full
    torch.testing.assert_close(y, y3)
    torch.testing.assert_close(y2, _step(x, w))
    torch.testing.assert_close(buf, 2 * y3)


def test_metrics_and_explain_name_the_line_that_breaks_a_hot_window(fresh_regions):
    x, w = torch.randn(16), torch.randn(16)
    with ae.adaptive_eager(**SYNC):
        _hot_loop(x, w)
        y = _step(x, w, "op", 7)
        ae.sync()
    m = ae.metrics()
    assert m["hot_mismatches"] == {"op": 1}
    text = ae.explain()
    line = DIVERGE["op"].__code__.co_firstlineno
    assert "lines that break hot windows" in text
    assert f"test_hot_windows.py:{line} " in text and "(expected aten.tanh.default)" in text, text
    del y


def test_hot_windows_off_records_every_window_in_full(fresh_regions, monkeypatch):
    monkeypatch.setenv("NEURON_EAGER_HOT_WINDOWS", "0")
    x, w = torch.randn(16), torch.randn(16)
    with ae.adaptive_eager(**SYNC):
        for _ in range(4):
            y = _step(x, w)
            ae.sync()
    m = ae.metrics()
    assert m["hot_windows"] == 0 and m["hot_ops"] == 0 and m["compiled_runs"] >= 3 and m["hot_mismatches"] == {}
    torch.testing.assert_close(y, _step(x, w))


def test_a_flush_runs_its_window_with_every_dispatch_mode_off_and_puts_them_back():
    """The flush takes the program's own dispatch mode off too (entered before adaptive eager:
    it sees nothing of the window's run), and puts both modes back in order."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Outer(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    x, w = torch.randn(16), torch.randn(16)
    with Outer() as outer:
        with ae.adaptive_eager(backend="replay"):  # the flush is the same on every backend
            mode = torch._C._get_dispatch_stack_at(1)
            for _ in range(3):
                y = _step(x, w)
                del seen[:]  # what recording allocated went through the outer mode
                ae.sync()
                assert seen == []
                assert torch._C._len_torch_dispatch_stack() == 2
                assert torch._C._get_dispatch_stack_at(0) is outer and torch._C._get_dispatch_stack_at(1) is mode
            z = y * 2
            assert ae.is_lazy(z)  # adaptive eager still records
    torch.testing.assert_close(y, _step(x, w))
    torch.testing.assert_close(z, _step(x, w) * 2)


def _until_hot(step, *args):
    """Run ``step(*args)`` until its window runs compiled and is then validated hot."""
    for _ in range(4):
        out = step(*args)  # kept: a window nothing observes is dead, it never runs
        ae.sync()
    assert ae.metrics()["hot_windows"] >= 1, ae.metrics()["hot_mismatches"]
    return out


def test_a_hot_intermediate_only_autograd_keeps_is_computed(fresh_regions):
    # tanh saves its output for the backward, over the placeholder's storage; the program drops the
    # tensor itself. Saving it dispatches a ``detach`` (a view), which turns the hot window into an
    # ordinary one, and the value is computed into that storage (Note [Weak window]).
    x, w = torch.randn(16), torch.randn(16)

    def step():
        return torch.tanh(x * w) * 3 + 1

    with ae.adaptive_eager(**SYNC):
        _until_hot(step)  # without autograd
        w.requires_grad_()
        y = step()  # the same ops, validated until autograd's save
        ae.sync()
        assert ae.metrics()["hot_mismatches"].get("view") == 1, ae.metrics()["hot_mismatches"]
    (g,) = torch.autograd.grad(y.sum(), w)  # eagerly, from the saved output
    want = x * 3 * (1 - torch.tanh(x * w.detach()) ** 2)
    torch.testing.assert_close(g, want)


def test_a_hot_intermediate_kept_through_data_is_computed(fresh_regions):
    # ``.data`` aliases a pending value (adaptive_eager._patches passes its mark on); the program
    # then drops the value itself. The alias dispatches a view, which turns the hot window into an
    # ordinary one; the alias observes the storage, so the value is live and computed.
    x, w = torch.randn(16), torch.randn(16)

    def step(keep):
        h = torch.tanh(x * w)
        alias = h.data if keep else None
        del h
        return torch.sigmoid(x) + 1, alias

    with ae.adaptive_eager(**SYNC):
        _until_hot(step, False)
        y, alias = step(True)
        ae.sync()
        assert ae.metrics()["hot_mismatches"].get("view") == 1, ae.metrics()["hot_mismatches"]
    torch.testing.assert_close(alias, torch.tanh(x * w))
    torch.testing.assert_close(y, torch.sigmoid(x) + 1)


def test_values_read_after_a_divergence_are_eager(fresh_regions):
    # the window diverges half-way; the program then reads an intermediate of the validated prefix
    # and the last value: both eager, the prefix computed once
    x, w = torch.randn(16), torch.randn(16)

    def step(diverge):
        kept = []
        y = x
        for i in range(N):
            y = torch.sigmoid(y) if (diverge and i == N // 2) else _op(i, y, x, w)
            if i == N // 2 - 3:
                kept.append(y)
        return y, kept[0]

    want_y, want_kept = step(True)
    with ae.adaptive_eager(**SYNC):
        _until_hot(step, False)
        y, kept = step(True)
        torch.testing.assert_close(kept, want_kept)  # a read: it flushes the demoted window
        torch.testing.assert_close(y, want_y)
        assert ae.metrics()["hot_mismatches"].get("op", 0) >= 1, ae.metrics()["hot_mismatches"]
