"""``out=`` tensors of another shape than the result (Note [Out resizing] in adaptive_eager._meta):
eager resizes them (with a deprecation warning when they had elements) and restrides them to the
kernel's layout, or refuses; adaptive eager must leave the same tensors, values, warnings (at the
user's line, once) and errors. Plain eager is the oracle."""

import warnings

import numpy as np
import pytest
import torch

import adaptive_eager as ae
from _device import COMPILED_BACKEND
from test_hot_windows import SYNC, _hot_loop, _step

COMPILED = dict(SYNC, backend=COMPILED_BACKEND)  # a window seen once replays, then compiles
torch.manual_seed(0)
A, B, M = torch.randn(3, 4), torch.randn(3, 4), torch.randn(4, 5)
AT = torch.randn(4, 3).t()  # a transposed input: a resized out takes its layout


def _src(x, pending):
    return x * 1 if pending else x  # ``x * 1``: a value pending in the window


# each case: (pending) -> the tensors to compare; the out= op is on the line after ``o = ...``
CASES = {
    "add_into_empty": lambda p: [torch.add(_src(A, p), B, out=(o := torch.empty(0))), o][1:],
    "add_into_wrong_shape": lambda p: [torch.add(_src(A, p), B, out=(o := torch.empty(2, 2))), o][1:],
    "add_into_a_pending_out": lambda p: [torch.add(_src(A, p), B, out=(o := torch.zeros(5) + 1)), o][1:],
    "mm_into_wrong_shape": lambda p: [torch.mm(_src(A, p), M, out=(o := torch.empty(2, 7))), o][1:],
    "sum_into_empty": lambda p: [torch.sum(_src(A, p), 0, out=(o := torch.empty(0))), o][1:],
    "sum_into_wrong_shape": lambda p: [torch.sum(_src(A, p), 0, out=(o := torch.empty(7))), o][1:],
    "cat_into_empty": lambda p: [torch.cat([_src(A, p), B], out=(o := torch.empty(0))), o][1:],
    "cat_into_wrong_shape": lambda p: [torch.cat([_src(A, p), B], 1, out=(o := torch.empty(3))), o][1:],
    "into_a_wider_dtype": lambda p: [torch.add(_src(A, p), B, out=(o := torch.empty(0, dtype=torch.float64))), o][1:],
    "sum_into_a_wider_dtype": lambda p: [torch.sum(_src(A, p), 0, out=(o := torch.empty(0, dtype=torch.float64))), o][1:],
    "into_a_narrower_dtype": lambda p: [torch.add(_src(A, p), B, out=(o := torch.empty(0, dtype=torch.int64))), o][1:],
    "mm_into_another_dtype": lambda p: [torch.mm(_src(A, p), M, out=(o := torch.empty(0, dtype=torch.float64))), o][1:],
    "takes_the_inputs_layout": lambda p: [torch.add(_src(AT, p), B, out=(o := torch.empty(0))), o][1:],
    "restrided_with_elements": lambda p: [torch.mul(_src(AT, p), AT, out=(o := torch.empty(5))), o][1:],
    "a_view_within_its_storage": lambda p: [torch.add(_src(A, p), B, out=(o := (base := torch.zeros(20))[:4])), o, base][1:],
    "a_view_whose_storage_grows": lambda p: [torch.add(_src(AT, p), B, out=(o := (base := torch.zeros(5))[2:4])), o, base][1:],
    "a_pending_view": lambda p: [torch.add(_src(A, p), B, out=(o := (base := torch.zeros(20) + 1)[:4])), o, base][1:],
    "read_before_the_resize": lambda p: [y := (o := torch.ones(4)) * 2, torch.add(_src(A, p), B, out=o), o, y][2:],
    "a_storage_that_cannot_grow": lambda p: [torch.add(_src(A, p), B, out=(o := torch.from_numpy(np.ones(2, np.float32)))), o][1:],
    "an_out_that_is_an_input": lambda p: [torch.add(o := torch.arange(4.0) * (2 if p else 1), B, out=o), o][1:],
    "an_out_over_an_input": lambda p: [torch.mm((o := torch.arange(4.0) * (2 if p else 1)).view(2, 2), torch.ones(2, 1),
                                                 out=o), o][1:],
    "correct_shape": lambda p: [torch.add(_src(A, p), B, out=(o := torch.empty(3, 4))), o][1:],
    "correct_shape_transposed": lambda p: [torch.add(_src(A, p), B, out=(o := torch.empty(4, 3).t())), o][1:],
}


def _version_bumps(p):
    o = torch.empty(2)
    v = o._version
    torch.add(_src(A, p), B, out=o)
    return [o, torch.tensor(o._version - v)]


def _reused(p):
    o = torch.empty(2)
    got = []
    for _ in range(3):
        torch.add(_src(A, p), B, out=o)
        got.append(o * 1)
        o.resize_(2)
    return got


CASES["version_counter"] = _version_bumps
CASES["one_out_reused"] = _reused


def _observe(case, pending):
    """What the program sees: each tensor's geometry and value, the warnings (text, file, line)
    and the error (type, message), all after a sync."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ts = CASES[case](pending)
            error = None
        except Exception as e:  # raised by the op, at its line (a sync later would be too late)
            ts, error = [], (type(e), str(e))
        now = [(tuple(t.shape), t.stride(), t.storage_offset(), t.dtype) for t in ts]  # while pending
        ae.sync()
    seen = [(*geometry, t.clone()) for geometry, t in zip(now, ts)]
    return seen, error, [(w.category, str(w.message), w.filename, w.lineno) for w in caught]


def _compare(want, got, exact):
    (wt, we, ww), (gt, ge, gw) = want, got
    assert ge == we
    assert gw == ww
    assert [t[:4] for t in gt] == [t[:4] for t in wt]
    for (*_, w), (*_, g) in zip(wt, gt):
        if exact:
            assert torch.equal(g, w)
        else:
            torch.testing.assert_close(g, w)


@pytest.mark.parametrize("pending", [False, True], ids=["real_input", "pending_input"])
@pytest.mark.parametrize("case", CASES)
def test_an_out_of_another_shape_is_what_eager_leaves(case, pending):
    want = _observe(case, pending)
    with ae.adaptive_eager(backend="replay"):
        got = _observe(case, pending)
        again = _observe(case, pending)  # the meta cache's entry this time
    _compare(want, got, exact=True)
    _compare(want, again, exact=True)


def _program():
    """A step of out= ops that resize, some reading pending values, kept in a compiled region."""
    y = torch.tanh(A) * 2
    o1 = torch.empty(0)
    torch.add(y, B, out=o1)
    o2 = torch.empty(2, 2)
    torch.mm(o1 * 1, M, out=o2)
    o3 = torch.empty(0, dtype=torch.float64)
    torch.mul(AT, y, out=o3)
    o4 = torch.empty(0)
    torch.sum(o2, 0, out=o4)
    o5 = torch.empty(3)
    torch.cat([o1, y], 1, out=o5)
    return [o1 + 1, o2, o3, o4, o5 * 2]


def _run_program():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ts = _program()
        now = [(tuple(t.shape), t.stride(), t.storage_offset(), t.dtype) for t in ts]
        ae.sync()
    seen = [(*geometry, t.clone()) for geometry, t in zip(now, ts)]
    # only the program's own warnings: a compile may warn from torch's files
    return seen, None, [(w.category, str(w.message), w.filename, w.lineno) for w in caught if w.filename == __file__]


def test_out_resizes_in_compiled_windows(fresh_regions):
    want = _run_program()
    assert len(want[2]) == 2  # the two outs that had elements
    with ae.adaptive_eager(**COMPILED):
        got = [_run_program() for _ in range(4)]
        m = ae.metrics()
    assert m["compiled_runs"] >= 2, m
    for g in got:
        _compare(want, g, exact=False)


def test_an_out_resize_in_a_hot_window(fresh_regions):
    # not test_hot_windows.py's shapes: its counts assume no region of its steps on disk yet
    x, w = torch.randn(24), torch.randn(24)

    def step():
        y = _step(x, w, n=20)
        o = torch.empty(3)
        torch.mul(y, w, out=o)  # demotes the hot window here
        return _step(o, w, n=30), o

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        want = step()
    with ae.adaptive_eager(**COMPILED):
        _hot_loop(x, w)
        with warnings.catch_warnings(record=True) as got_caught:
            warnings.simplefilter("always")
            got = step()
            ae.sync()
        assert sum(ae.metrics()["hot_mismatches"].values()) >= 1
    for g, t in zip(got, want):
        torch.testing.assert_close(g, t)
        assert g.stride() == t.stride()
    assert [(str(c.message), c.lineno) for c in got_caught] == [(str(c.message), c.lineno) for c in caught]


def test_an_empty_out_costs_no_flush():
    with ae.adaptive_eager(backend="replay"):
        y = A * 2
        o = torch.empty(0)
        torch.add(y, B, out=o)  # nothing pending uses ``o``: recorded as it is resized
        assert o.shape == (3, 4)
        z = torch.zeros(4) + 1
        with pytest.warns(UserWarning, match="was resized"):
            torch.add(y, B, out=z)  # a pending out: the window runs before its resize
        assert ae.metrics()["flushes"] == {"out_resize": 1}
        ae.sync()
    torch.testing.assert_close(o, A * 2 + B)
    torch.testing.assert_close(z, A * 2 + B)
