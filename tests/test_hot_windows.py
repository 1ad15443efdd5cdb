"""Hot windows (Note [Hot windows] in adaptive_eager._hot): once a window's structure runs compiled,
the next one is recorded against it op by op; the first op that differs turns the window into an
ordinary recording. Plain eager is the oracle; ``tiers="regions"`` gives the full recording to
compare a demoted window with."""

import threading

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager._state import current_state
from fuser.window import Out

SYNC = dict(backend="inductor", hot_after=2, async_compile=False)  # a window seen once replays
N = 50  # ops of the step


@pytest.fixture(autouse=True)
def _no_small_windows(monkeypatch):
    """These tests are of hot recording: a window small enough would run eagerly instead (Note
    [Small windows run eagerly] in adaptive_eager._hot, tested in tests/test_small_windows.py)."""
    from adaptive_eager import _hot

    monkeypatch.setattr(_hot, "_SMALL_OPS", -1)


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


@pytest.mark.parametrize("shape", [(16,), (4, 4)], ids=["ops", "views_and_keywords"])
def test_a_hot_window_runs_its_region_without_recording(fresh_regions, shape):
    step = _step if shape == (16,) else _vstep  # (``_vstep``: views and ops with keywords, below)
    x, w = torch.randn(shape), torch.randn(shape)
    want = step(x, w)
    ys = []
    with ae.adaptive_eager(**SYNC):
        for _ in range(5):
            ys.append(step(x, w))
            ae.sync()
    m = ae.metrics()
    for y in ys:
        torch.testing.assert_close(y, want)
    assert m["hot_windows"] == 3 and m["hot_ops"] == 3 * N and m["hot_mismatches"] == {}, m
    assert m["compiled_runs"] == 4  # replayed, compiled, then three hot windows


def _diverge_at_each(step, x, w, kind, positions):
    """Run ``step`` until hot, then once diverging (``kind``) at each of ``positions``, each
    followed by the step itself: each divergence is one mismatch and no hot window, and the window
    after it is hot again; every value is eager's."""
    want = {at: step(x, w, kind, at) for at in positions}
    got, counts = {}, []
    with ae.adaptive_eager(**SYNC):
        for _ in range(3):
            kept = step(x, w)  # kept: a window nothing observes is dead, it never runs
            ae.sync()
        assert ae.metrics()["hot_windows"] >= 1, ae.metrics()["hot_mismatches"]
        for at in positions:
            before = ae.metrics()
            got[at] = step(x, w, kind, at)
            ae.sync()
            after = ae.metrics()
            # the window after it is the compiled one again: hot
            got[at, "next"] = step(x, w)
            ae.sync()
            counts.append((sum(after["hot_mismatches"].values()) - sum(before["hot_mismatches"].values()),
                           after["hot_windows"] - before["hot_windows"], ae.metrics()["hot_windows"] - after["hot_windows"]))
    assert counts == [(1, 0, 1)] * len(positions), counts  # each demoted once, not run hot; the next one hot
    for at in positions:
        torch.testing.assert_close(got[at], want[at], msg=f"diverged at {at}")
        torch.testing.assert_close(got[at, "next"], step(x, w))


@pytest.mark.parametrize("kind", DIVERGE)
def test_a_window_that_diverges_at_any_position(fresh_regions, kind):
    _diverge_at_each(_step, torch.randn(16), torch.randn(16), kind, range(N))


def test_an_op_called_with_another_count_of_arguments_is_a_mismatch(fresh_regions):
    """``clamp(y, t)`` and ``clamp(y, None, t)`` are one overload with the same tensors (the None is
    no ref) and no other argument: only the count of arguments tells the minimum from the maximum."""

    def step(x, t, upper):
        y = x * 2
        for _ in range(8):
            y = torch.clamp(y, None, t) if upper else torch.clamp(y, t)
            y = y - 0.5
        return y

    x, t = torch.randn(16), torch.zeros(16)
    with ae.adaptive_eager(**SYNC):
        for _ in range(3):
            kept = step(x, t, False)
            ae.sync()
        assert ae.metrics()["hot_windows"] >= 1, ae.metrics()["hot_mismatches"]
        got = step(x, t, True)
        ae.sync()
        assert ae.metrics()["hot_mismatches"] == {"op": 1}
    torch.testing.assert_close(kept, step(x, t, False))
    torch.testing.assert_close(got, step(x, t, True))


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
        # the line the error names; a pending index (a real one out of range raises at the line)
        rows = torch.index_select(table, 0, idx + 0)
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
    line = step.__code__.co_firstlineno + 2
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
                # by slot: a placeholder's storage id is not compared, a dead one's may have been reused
                # (a hot window keeps no handle of it: Note [Hot liveness] in adaptive_eager._hot)
                written=sorted(storages[sid] for sid in window.written if sid in storages),
                # the values still observable: a hot window keeps no Out for a value that died
                fresh=[(o.uid, o.meta) for o in window.fresh if not torch.UntypedStorage._expired(o.storage)],
                others=[(o.uid, o.kind) for o in window.others],
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
    with ae.adaptive_eager(**SYNC, tiers="regions"):
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


def test_tiers_below_hot_record_every_window_in_full(fresh_regions, monkeypatch):
    monkeypatch.setenv("NEURON_EAGER_TIERS", "regions")
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
        assert ae.metrics()["hot_mismatches"].get("op") == 1, ae.metrics()["hot_mismatches"]  # a view where the template has none
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
        assert ae.metrics()["hot_mismatches"].get("op") == 1, ae.metrics()["hot_mismatches"]  # a view where the template has none
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


# Note [Hot liveness] in adaptive_eager._hot: a hot window's value is live while its Python tensor
# is. Each way a program can keep a value without keeping that tensor object, or share its memory,
# must still see the eager value: the routes below keep an intermediate only that way (the
# window's template, recorded without the route, has it dead), and ``_read`` reads it back after
# the context as eager would.
class _Held:
    """Something of the program's that is not a tensor and holds one (a Python-level wrapper)."""

    def __init__(self, t):
        self.t = t


def _pack_subclass(store):
    def pack(t):
        store.append(torch.Tensor._make_subclass(torch.Tensor, t))  # a sharer with no mark
        return len(store) - 1

    return pack


_REAL = torch.zeros(16)  # a real tensor made before any window


def _route(route, h, w):
    """Keep ``h`` only through ``route``; answers what the program keeps."""
    import pickle

    if route == "the_tensor":
        return h
    if route == "a_view":
        return h.view(4, 4)
    if route == "a_views_base":
        return h[1:]
    if route == "in_place_then_kept":
        return h.mul_(2)
    if route == "data":
        return h.data
    if route == "data_setter":
        a = _REAL.clone()  # recorded: a pending value, given h's memory
        a.data = h
        return _Held(torch.cat([a, a * 2]))  # read in the same window too
    if route == "data_setter_of_a_real_tensor":
        a = _HELD_REAL[0]
        a.data = h
        return _Held(a * 2)  # read in the same window, through the tensor that took the storage
    if route == "data_setter_of_the_value":
        h.data = _HELD_REAL[1]  # the pending tensor is given a real tensor's memory
        return h
    if route == "parameter":
        return torch.nn.Parameter(h)
    if route == "make_subclass":
        return torch.Tensor._make_subclass(torch.Tensor, h)
    if route == "as_subclass":
        return h.as_subclass(torch.Tensor)
    if route == "to_dlpack":
        return torch.utils.dlpack.to_dlpack(h)
    if route == "__dlpack__":
        return h.__dlpack__()
    if route == "numpy":
        return h.numpy()
    if route == "untyped_storage":
        return (h.untyped_storage(), h.shape)
    if route == "pickle":
        return pickle.dumps(h)
    if route == "grad":
        leaf = torch.zeros(16, requires_grad=True)
        leaf.grad = h
        return leaf
    if route == "set_":
        return torch.empty(0).set_(h)
    if route == "nested":
        return torch.nested.as_nested_tensor([h])
    if route == "python_holder":
        return _Held(h)
    if route == "autograd":  # tanh's output, saved for the backward
        return (torch.tanh(h * w) * 2).sum()
    if route == "saved_tensors_hooks":
        store = []
        with torch.autograd.graph.saved_tensors_hooks(_pack_subclass(store), lambda i: store[i]):
            return (h * w).sum(), store  # mul saves h for w's gradient: only the hook's sharer keeps it
    raise AssertionError(route)


def _read(route, kept, w):
    import pickle

    if route in ("a_view",):
        return kept.reshape(16)
    if route == "a_views_base":
        return kept._base
    if route in ("to_dlpack", "__dlpack__"):
        return torch.utils.dlpack.from_dlpack(kept)
    if route == "numpy":
        return torch.from_numpy(kept)
    if route == "untyped_storage":
        return torch.empty(0).set_(kept[0], 0, kept[1])
    if route == "pickle":
        return pickle.loads(kept)
    if route == "grad":
        return kept.grad
    if route == "nested":
        return kept.unbind()[0]
    if route in ("python_holder", "data_setter", "data_setter_of_a_real_tensor"):
        return kept.t
    if route == "autograd":
        (g,) = torch.autograd.grad(kept, w)
        return g
    if route == "saved_tensors_hooks":
        (g,) = torch.autograd.grad(kept[0], w)
        return g
    return kept.detach()


_HELD_REAL = []

ROUTES = ["the_tensor", "a_view", "a_views_base", "in_place_then_kept", "data", "data_setter",
          "data_setter_of_a_real_tensor", "data_setter_of_the_value", "parameter", "make_subclass", "as_subclass",
          "to_dlpack", "__dlpack__", "numpy", "untyped_storage", "pickle", "grad", "set_", "nested", "python_holder",
          "autograd", "saved_tensors_hooks"]


@pytest.mark.parametrize("route", ROUTES)
def test_a_hot_value_kept_only_through_a_route_is_computed(fresh_regions, route):
    x, w = torch.randn(16), torch.randn(16)
    wg = w.clone().requires_grad_()

    def step(route):
        h = torch.tanh(x * w)
        kept = _route(route, h, wg) if route else None
        del h  # the program keeps only what the route made
        return torch.sigmoid(x) + 1, kept

    def eager():
        _HELD_REAL[:] = [torch.zeros(16), torch.full((16,), 3.0)]
        y, kept = step(route)
        return y, _read(route, kept, wg)

    want_y, want = eager()
    _HELD_REAL[:] = [torch.zeros(16), torch.full((16,), 3.0)]
    with ae.adaptive_eager(**SYNC):
        _until_hot(step, None)
        hot_ops = ae.metrics()["hot_ops"]
        y, kept = step(route)
        assert ae.metrics()["hot_ops"] >= hot_ops + 2, "the route's value was not made in a hot window"
        ae.sync()
    torch.testing.assert_close(_read(route, kept, wg), want)
    torch.testing.assert_close(y, want_y)


def _runs_hot(step):
    """``step()``'s eager value, and its value from a window validated hot to its end."""
    want = step()
    with ae.adaptive_eager(**SYNC):
        _until_hot(step)
        hot = ae.metrics()["hot_windows"]
        got = step()
        ae.sync()
        assert ae.metrics()["hot_windows"] == hot + 1, ae.metrics()["hot_mismatches"]
    return got, want


def test_an_in_place_write_to_a_dying_hot_value(fresh_regions):
    # the hot window writes a value in place, reads it, and the program drops it: the write is
    # computed where a later op reads it, and nothing else of it is materialized
    x, w = torch.randn(16), torch.randn(16)

    def step():
        h = torch.tanh(x * w)
        h.add_(1)
        z = h * 3
        del h
        return z + x

    got, want = _runs_hot(step)
    torch.testing.assert_close(got, want)


def test_a_hot_window_keeps_no_out_for_a_value_that_died(fresh_regions):
    # Note [Hot liveness]: a value the program drops leaves nothing in a hot window; the flush
    # finds only the values whose tensors live
    x, w = torch.randn(16), torch.randn(16)
    with ae.adaptive_eager(**SYNC):
        _until_hot(_step, x, w)
        y = x
        for i in range(N):
            y = _op(i, y, x, w)
        window = current_state().window
        assert window.hot is not None and len(window.nodes) == N
        assert len(window.alive) == 1 and next(iter(window.alive)).out is y._ae.alias, len(window.alive)
        assert window.fresh == [] and window.handles == []
        ae.sync()
    torch.testing.assert_close(y, _step(x, w))


def test_a_parameter_of_a_pending_value_outside_a_hot_window_needs_no_flush():
    """Note [Storage sharers]: ``_make_subclass`` flushes only in a hot window (FSDP2 makes a
    Parameter of every all-gathered tensor, in windows that are not hot)."""
    x = torch.randn(3)
    with ae.adaptive_eager(backend="replay"):
        y = x * 2
        ae.reset_metrics()
        p = torch.nn.Parameter(y)
        del y
        z = p + 1
        assert ae.is_lazy(z) and not ae.metrics()["flushes"]
        assert torch.equal(z, x * 2 + 1)


def test_a_dead_hot_value_written_in_place_in_a_demoted_window(fresh_regions):
    # Note [Hot Outs] in fuser.window: the value ``h`` dies while only the ALIAS Out of its in-place
    # write names its (hot) Out; the demotion completes that Out and the replay computes through it
    x, w = torch.randn(16), torch.randn(16)

    def step(diverge=False):
        h = torch.tanh(x * w)
        h.add_(1)
        z = h * 3
        del h
        return torch.sigmoid(z) if diverge else z + x

    with ae.adaptive_eager(**SYNC):
        _until_hot(step)
        got = step(diverge=True)
        assert ae.metrics()["hot_mismatches"] == {"op": 1}, ae.metrics()["hot_mismatches"]
        ae.sync()
        again = step()
        ae.sync()
    torch.testing.assert_close(got, step(diverge=True))
    torch.testing.assert_close(again, step())


def test_hot_records_are_counted_while_the_window_records_and_after_a_reset(fresh_regions):
    # Note [Hot record cost] in _hot: a hot window counts its records when it ends; metrics() adds
    # those of the windows still recording, and reset_metrics() forgets the ones made before it
    x, w = torch.randn(16), torch.randn(16)
    with ae.adaptive_eager(**SYNC):
        _until_hot(_step, x, w)
        ae.reset_metrics()
        y = x
        for i in range(10):
            y = _op(i, y, x, w)
        m = ae.metrics()
        assert current_state().window.hot is not None
        assert m["ops_recorded"] == m["hot_ops"] == 10 and m["eager_equivalent_launches"] == 10, m
        ae.reset_metrics()
        for i in range(10, N):
            y = _op(i, y, x, w)
        assert ae.metrics()["hot_ops"] == N - 10
        ae.sync()
        m = ae.metrics()
        assert m["hot_windows"] == 1 and m["hot_ops"] == m["ops_recorded"] == N - 10, m
        y = _step(x, w, "op", 20)  # demoted at 20: 20 hot records, then 30 ops recorded in full
        ae.sync()
        m = ae.metrics()
        assert m["hot_ops"] == N - 10 + 20 and m["ops_recorded"] == 2 * N - 10, m
    torch.testing.assert_close(y, _step(x, w, "op", 20))


# Note [Hot views] in adaptive_eager._hot: views (of pending values, of views, of real inputs,
# autograd's ``detach``) and fast-path ops called with keywords are validated too. ``_vop`` is one
# ATen op per position, over 4x4 float tensors.
R = torch.randn(4, 4)  # a real input the step reads only through a view
R_OFFSET = torch.randn(32)[16:].view(4, 4)  # R's shape and strides, at another storage offset


def _as_written(*tensors):
    """Make the views of ``tensors`` recorded, as views of memory that recorded ops wrote are (a
    parameter's); views of memory nothing writes are inputs of their own instead (Note [Views of
    unwritten memory] in adaptive_eager._record, tests/test_tracer.py)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from adaptive_eager._flush import WRITTEN

    for t in tensors:
        WRITTEN[t.untyped_storage()._cdata] = StorageWeakRef(t.untyped_storage())
    return tensors


_as_written(R, R_OFFSET)


def _vop(i, s, x, w, diverge=None):
    k = i % 10
    y = s["y"]
    if diverge == "op":  # then the step's layout again, where the next op needs it (a view)
        z = torch.sigmoid(y)
        s["y"] = z.view(4, 4) if k == 2 else z.contiguous()
    elif diverge == "view_args" and k == 1:
        s["y"] = y.view(2, 8)
    elif diverge == "view_args" and k == 6:
        s["r"] = R_OFFSET.t()  # the real input's offset is part of the view's signature
    elif diverge == "keyword" and k == 5:
        s["y"] = torch.add(y, x, alpha=0.25)
    elif diverge == "keyword" and k == 9:
        s["y"] = torch.clone(y, memory_format=torch.preserve_format).contiguous()
    elif k == 0:
        s["y"] = y * w
    elif k == 1:
        s["y"] = y.view(16)  # a view of a pending value
    elif k == 2:
        s["y"] = y.view(4, 4)  # a view of a view
    elif k == 3:
        y.mul_(2)  # in place, through the view
    elif k == 4:
        s["y"] = y.t()
    elif k == 5:
        s["y"] = torch.add(y, x, alpha=0.5)  # a keyword: the general path records it
    elif k == 6:
        s["r"] = R.t()  # a view of a real input
    elif k == 7:
        s["y"] = y * s["r"]
    elif k == 8:
        s["y"] = y.detach()
    else:
        s["y"] = torch.clone(y, memory_format=torch.contiguous_format)


def _vstep(x, w, diverge=None, at=-1, n=N):
    _as_written(R, R_OFFSET)  # again: another test's window may have made their addresses forgotten
    s = {"y": x, "r": w}
    for i in range(n):
        _vop(i, s, x, w, diverge if i == at else None)
    return s["y"]


V_DIVERGE = {"op": range(N), "view_args": [i for i in range(N) if i % 10 in (1, 6)],
             "keyword": [i for i in range(N) if i % 10 in (5, 9)]}


@pytest.mark.parametrize("kind", V_DIVERGE)
def test_a_window_of_views_that_diverges_at_any_position(fresh_regions, kind):
    _diverge_at_each(_vstep, torch.randn(4, 4), torch.randn(4, 4), kind, V_DIVERGE[kind])


@pytest.mark.parametrize("kind,at", [("op", at) for at in (1, 2, 3, 4, 5, 6, 8, 9, 27, 49)]
                         + [("view_args", 1), ("view_args", 6), ("keyword", 5), ("keyword", 9)])
def test_a_demoted_window_of_views_is_the_window_a_full_recording_makes(fresh_regions, kind, at):
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    with ae.adaptive_eager(**SYNC):
        for _ in range(3):
            kept = _vstep(x, w)  # kept: a window nothing observes is dead, it never runs
            ae.sync()
        y = _vstep(x, w, kind, at)
        assert sum(ae.metrics()["hot_mismatches"].values()) == 1
        hot = _snapshot(current_state().window)
        ae.sync()
    with ae.adaptive_eager(**SYNC, tiers="regions"):
        y2 = _vstep(x, w, kind, at)
        full = _snapshot(current_state().window)
        ae.sync()
    assert len(hot["nodes"]) >= N  # the divergence may add an op (``_vop``)
    assert hot == full
    torch.testing.assert_close(y, y2)


# A value the program keeps only through a view of it, where the template kept it that way too
# (so the window stays hot to its end): the view holds the value's storage, not its tensor, and the
# value must be computed into that storage (without Note [Hot views]' rule, the value is found dead
# at the flush and the view reads uninitialized memory).
KEPT = {
    "a_view": lambda h: h.view(2, 8),
    "a_view_of_a_view": lambda h: h.view(16)[2:].view(2, 7),
    "detach": lambda h: h.detach(),
    "in_place_then_a_view": lambda h: h.mul_(3).t(),
    "a_view_then_in_place": lambda h: h.t().add_(1),
    "two_views": lambda h: (h.t(), h.view(16)),
    "data": lambda h: h.data,  # a ``detach`` the tensor's ``.data`` makes (Note [Storage sharers])
    "unbind": lambda h: h.unbind(0)[1:],  # views of several outputs, some dropped
}


@pytest.mark.parametrize("route", KEPT)
def test_a_hot_value_kept_only_through_its_view_is_computed(fresh_regions, route):
    x, w = torch.randn(4, 4), torch.randn(4, 4)

    def step():
        h = torch.tanh(x * w)
        kept = KEPT[route](h)
        del h
        return torch.sigmoid(x) + 1, kept

    got, want = _runs_hot(step)
    torch.testing.assert_close(got, want)


def test_a_view_of_a_value_that_dies_before_the_flush(fresh_regions):
    # the view and its value both die before the flush: nothing of them is computed or kept
    x, w = torch.randn(4, 4), torch.randn(4, 4)

    def step():
        h = torch.tanh(x * w)
        v = h.t()
        z = v * 2
        del h, v
        return z

    with ae.adaptive_eager(**SYNC):
        _until_hot(step)
        z = step()
        window = current_state().window
        assert window.hot is not None
        ae.sync()
        assert ae.metrics()["hot_mismatches"] == {}
    torch.testing.assert_close(z, torch.tanh(x * w).t() * 2)


def test_a_training_step_runs_hot(fresh_regions):
    # the views autograd and nn.Linear make (``t``, ``detach``, ``view``), the backward's
    # ``ones_like(memory_format=)`` and LayerNorm's three outputs, forward and backward: the whole
    # step's window is validated, not recorded
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ref = copy_model = __import__("copy").deepcopy(model)
    x, y = torch.randn(5, 8), torch.randn(5, 4)

    def train(m, steps):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        losses = []
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    want = train(ref, 8)
    with ae.adaptive_eager(**SYNC):
        got = train(model, 8)
        ae.sync()
        m = ae.metrics()
    assert m["hot_windows"] >= 4, m["hot_mismatches"]
    torch.testing.assert_close(torch.stack(got), torch.stack(want))
    for p, q in zip(model.parameters(), copy_model.parameters()):
        torch.testing.assert_close(p, q)


# Ops of several outputs (``native_layer_norm``: two of its three die at once), of a list of
# outputs (``split``'s views), and of tensor lists (``cat``), validated in hot windows as well.
def _mop(i, s, x, w, diverge=False):
    k = i % 6
    y = s["y"]
    if diverge == "list" and k == 2:
        s["y"] = torch.cat([s["b"], s["a"]])  # the list's elements bound the other way round
    elif diverge == "list" and k == 3:
        s["y"] = torch.cat([y, w])  # a real input of another slot
    elif diverge:  # another op there, and the shape the normal op makes
        s["y"] = torch.sigmoid(y).repeat(2, 1) if k == 3 else torch.sigmoid(y[:4]) if k == 4 else torch.sigmoid(y)
    elif k == 0:
        s["y"] = torch.nn.functional.layer_norm(y, (4,))
    elif k == 1:
        s["a"], s["b"] = y.split(2)
    elif k == 2:
        s["y"] = torch.cat([s["a"], s["b"]])  # pending values in a list
    elif k == 3:
        s["y"] = torch.cat([y, x])  # and a real one
    elif k == 4:
        s["y"] = y[2:6]  # a view at an offset
    else:
        s["y"] = y * w


def _mstep(x, w, diverge=None, at=-1, n=36):
    s = {"y": x, "a": x[:2], "b": x[2:]}
    for i in range(n):
        _mop(i, s, x, w, diverge if i == at else None)
    return s["y"]


@pytest.mark.parametrize("kind", ["op", "list"])
def test_ops_of_several_outputs_and_of_lists_diverge_at_any_position(fresh_regions, kind):
    positions = range(36) if kind == "op" else [i for i in range(36) if i % 6 in (2, 3)]
    _diverge_at_each(_mstep, torch.randn(4, 4), torch.randn(4, 4), kind, positions)


@pytest.mark.parametrize("at", [0, 1, 2, 3, 4, 5, 20])
def test_a_demoted_window_of_several_outputs_is_the_window_a_full_recording_makes(fresh_regions, at):
    # x's slices, made by each step, are recorded views (not new real inputs), compared by uid
    x, w = *_as_written(torch.randn(4, 4)), torch.randn(4, 4)
    with ae.adaptive_eager(**SYNC):
        for _ in range(3):
            kept = _mstep(x, w)
            ae.sync()
        y = _mstep(x, w, "op", at)
        assert sum(ae.metrics()["hot_mismatches"].values()) == 1
        hot = _snapshot(current_state().window)
        ae.sync()
    with ae.adaptive_eager(**SYNC, tiers="regions"):
        y2 = _mstep(x, w, "op", at)
        full = _snapshot(current_state().window)
        ae.sync()
    assert hot == full
    torch.testing.assert_close(y, y2)


def test_a_foreach_op_of_pending_and_real_tensors_runs_hot(fresh_regions):
    # a list of outputs from lists of inputs (``_foreach_mul``, as a cold optimizer step records it)
    a, b = torch.randn(8), torch.randn(3)

    def step():
        x, y = torch._foreach_mul([a * 2, b], 0.5)
        return x + 1, y

    got, want = _runs_hot(step)
    torch.testing.assert_close(got, want)


def test_a_step_with_dropout_and_a_random_fill_runs_hot_with_eagers_numbers(fresh_regions):
    # the mode's own ops (a dropout's multiplies by the mask it drew, a random fill's copy from its
    # drawn temporary) are validated like dispatched ones: the drawn tensors fill their slots anew
    x, w = torch.randn(64), torch.randn(64)
    noise = torch.empty(64)

    def step():
        h = torch.nn.functional.dropout(torch.tanh(x * w), 0.25, training=True)
        noise.uniform_()  # in place, on a real tensor
        return h * 2 + noise

    def run(adaptive):
        torch.manual_seed(0)
        if not adaptive:
            return [step() for _ in range(6)]
        with ae.adaptive_eager(**SYNC):
            out = []
            for _ in range(6):
                out.append(step())
                ae.sync()
            assert ae.metrics()["hot_windows"] >= 3, ae.metrics()["hot_mismatches"]
        return out

    want = run(False)
    for got, ref in zip(run(True), want):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)


def test_factories_run_hot_on_the_default_device_only(fresh_regions):
    # ``zeros``, ``arange``, ``scalar_tensor`` (the masks and positions a Hugging Face model makes
    # each step) are validated: sizes, keywords, the default dtype and the default device
    x = torch.randn(4)

    def step():
        z = torch.zeros(4) + torch.arange(4.0, dtype=torch.float32) * torch.scalar_tensor(0.5)
        return x * 2 + z, torch.ones(2, 2)

    got, want = _runs_hot(step)
    torch.testing.assert_close(got, want)
    with ae.adaptive_eager(**SYNC):
        _until_hot(step)
        torch.set_default_device("meta")
        try:
            # where the template has a CPU factory: eager's device, not ours (``set_default_device``
            # passes ``device=`` as a keyword the template's op has not; a hot record also checks
            # the default device itself)
            made = torch.zeros(4)
        finally:
            torch.set_default_device(None)
        y = x * 2
        ae.sync()
    assert made.device.type == "meta"
    torch.testing.assert_close(y, x * 2)


def test_attention_without_dropout_runs_hot_and_with_dropout_does_not(fresh_regions):
    # ``scaled_dot_product_attention``'s kernel is tagged random; with ``dropout_p=0`` it draws
    # nothing and is validated as any op, forward and backward; with dropout it is never hot
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 4, requires_grad=True) for _ in range(3))

    def step(p=0.0):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        (g,) = torch.autograd.grad(out.sum(), q)
        return out.detach(), g

    got, want = _runs_hot(step)
    torch.testing.assert_close(got, want)
    torch.manual_seed(1)
    want = step(0.5)
    with ae.adaptive_eager(**SYNC):
        _until_hot(step)
        hot = ae.metrics()["hot_windows"]
        torch.manual_seed(1)
        got = step(0.5)
        ae.sync()
        assert ae.metrics()["hot_windows"] == hot
    torch.testing.assert_close(got, want)


def test_a_hot_step_counts_the_launches_a_full_recording_counts(fresh_regions):
    # a view launches nothing: a full recording does not count it in ops_recorded (nor in
    # eager_equivalent_launches), so a hot window must not either (it counted this step's 17 views,
    # nn.Linear's and autograd's ``t``, ``view`` and ``detach``: 29 ops recorded against 12)
    def counts(hot: bool) -> tuple[int, int, int]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        x, y = torch.randn(5, 8), torch.randn(5, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step():
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            ae.sync()

        # captures off in both: the step's every op is in its windows
        with ae.adaptive_eager(**SYNC, tiers="hot" if hot else "regions"):
            for _ in range(6):
                step()
            ae.reset_metrics()
            step()
            m = ae.metrics()
        return m["ops_recorded"], m["eager_equivalent_launches"], m["hot_windows"]

    recorded, launches, hot_windows = counts(True)
    assert hot_windows >= 1  # the check can fail: the step ran hot
    assert (recorded, launches, 0) == counts(False)


def test_every_out_the_tracer_makes_has_every_field():
    """Every Out the tracer makes comes from ``_emit`` (``hot_out`` completed by ``finish_hot``, Note
    [Hot Outs] in fuser.window, or ``placeholder``'s inline stores), a hot window's FRESH ones
    completed at their adoption: a field added to ``Out`` and not there fails here."""
    import weakref

    from adaptive_eager import _emit

    token, spec, t = object(), ((2, 3), (3, 1), torch.float32), torch.zeros(2, 3)
    made = [_emit.view_out(token, 7, spec, weakref.ref(t), 4), _emit.dead_out(token, 8, spec)]

    class _Window:  # what ``placeholder`` touches of a window
        token, fresh, handles, others = object(), [], [], []

        def slot_of(self, t):
            return 0

    class _State:
        alloc_cpu = None

    p, o = _emit.placeholder(_State(), _Window(), spec, 9, torch.device("cpu"))
    made += [o, _emit.alias_out(_Window(), t, 10), _emit.alias_out(_Window(), p, 11)]
    assert (made[-2].alias, made[-1].alias) == (t, o)  # a real tensor, a pending value
    for o in made:
        for name in Out.__slots__:
            assert hasattr(o, name), name
    assert (made[0].slot, made[0].ref(), made[0].live, made[0].last) == (4, t, False, -1)


def test_every_node_the_tracer_makes_has_every_field():
    """Every Node the tracer makes comes from ``_emit.node``, which stores ``Node.__init__``'s fields
    without calling it: a field added to ``Node`` and not there fails here, and the two agree."""
    from adaptive_eager import _emit
    from fuser.window import Node

    args, kwargs, inputs = [1], {"a": 2}, []
    made = _emit.node(torch.ops.aten.add.Tensor, args, kwargs, inputs, None, 3, True, False)
    ref = Node(torch.ops.aten.add.Tensor, args, kwargs, inputs, None, 3)
    ref.mutates = True
    for name in Node.__slots__:
        assert getattr(made, name) == getattr(ref, name), name


def test_a_hot_view_calls_the_overloads_own_callable():
    """``OpFacts.call`` is what ``OpOverload.__call__`` forwards to (Note [Hot view cost] in ``_hot``)."""
    from adaptive_eager._ops import facts_for

    f = facts_for(torch.ops.aten.t.default)
    x = torch.randn(2, 3)
    assert f.call(x).equal(torch.ops.aten.t.default(x)) and f.call(x).stride() == (1, 3)


def test_explain_names_the_op_that_keeps_a_compiled_window_from_running_hot(fresh_regions):
    """A window whose region runs compiled but which can never run hot (an op no template position
    takes: one with an ``out=`` tensor) is counted and named with its line, not silent."""
    x = torch.randn(8, 4)
    with ae.adaptive_eager(**SYNC):
        for _ in range(4):
            y = torch.empty_like(x)
            torch.mul(x, 2, out=y)  # the line explain() names
            y = y + 1
            ae.sync()
    m = ae.metrics()
    assert m["compiled_runs"] >= 2 and m["hot_windows"] == 0 and m["hot_refusals"] == {"op": 1}, (
        m["compiled_runs"], m["hot_windows"], m["hot_refusals"], m["replay_reasons"])
    text = ae.explain()
    assert "cannot run hot" in text and "aten::mul.out" in text and "test_hot_windows.py" in text, text
    torch.testing.assert_close(y, x * 2 + 1)


def test_a_hot_window_whose_default_dtype_changes_mid_window(fresh_regions):
    """The program changes the default dtype in a hot window: the next op does not match (cause
    ``default_dtype``), and the recording path flushes the window under the old one (reason
    ``default_dtype``, Note [Meta cache key]); every value is eager's."""
    x, w = torch.randn(16), torch.randn(16)
    ambient = torch.get_default_dtype()

    def step():
        y = x
        for i in range(N):
            if i == 20:
                torch.set_default_dtype(torch.float64)
            y = _op(i, y, x, w) + torch.ones(16) if i == 20 else _op(i, y, x, w)
        return y

    try:
        want = step()
        torch.set_default_dtype(ambient)
        with ae.adaptive_eager(**SYNC):
            _hot_loop(x, w)
            before = ae.metrics()
            got = step()
            ae.sync()
            after = ae.metrics()
            torch.set_default_dtype(ambient)
    finally:
        torch.set_default_dtype(ambient)
    torch.testing.assert_close(got, want)
    assert got.dtype == want.dtype == torch.float64  # ``torch.ones`` read the new default dtype
    assert after["hot_windows"] == before["hot_windows"]  # it did not run hot
    assert after["flushes"].get("default_dtype", 0) - before["flushes"].get("default_dtype", 0) == 1, after["flushes"]
    assert after["hot_mismatches"].get("default_dtype", 0) - before["hot_mismatches"].get("default_dtype", 0) == 1


def test_the_window_after_a_default_dtype_change_is_not_recorded_against_the_old_dtype(fresh_regions):
    """The flush at a default-dtype change arms the next window with the template expected next,
    made under the old dtype. The op after the change matches that template's first position (an
    integer tensor times a float: its dtype is the default dtype's) and must not be recorded
    against it: eager makes it under the new one."""
    x, w = torch.randn(16), torch.randn(16)
    ints = torch.arange(16)
    ambient = torch.get_default_dtype()

    def step(change=False):
        y = ints * 0.5
        for i in range(1, N):
            if change and i == 26:
                torch.set_default_dtype(torch.float64)
            y = ints * 0.5 + y if change and i == 26 else _op(i, y, x, w)
        return y

    try:
        want = step(True)
        torch.set_default_dtype(ambient)
        with ae.adaptive_eager(**SYNC):
            for _ in range(3):
                y = step()
                ae.sync()
            before = ae.metrics()
            assert before["hot_windows"] >= 1, before["hot_mismatches"]
            got = step(True)
            ae.sync()
            torch.set_default_dtype(ambient)
    finally:
        torch.set_default_dtype(ambient)
    assert got.dtype == want.dtype == torch.float64
    torch.testing.assert_close(got, want)
