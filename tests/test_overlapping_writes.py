"""Writes into memory that other elements or arguments share (an expanded tensor, ``x[1:].add_(x[:-1])``):
eager decides at the op, from metadata alone, whether to raise, so adaptive eager raises eager's
error (type and message) at the same line with nothing recorded for that op, and does what eager
does where eager allows it (``fill_`` of an expanded tensor). Eager is the oracle."""

import contextlib

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import adaptive_eager

RAISES = {
    # one written tensor whose elements share memory (eager: "more than one element of the written-to tensor...")
    "add_ of an expanded tensor": lambda x: x[0].expand(3, 4).add_(1),
    "mul_ of an expanded tensor": lambda x: x[:, :1].expand(3, 4).mul_(x),
    "addcmul_ of an expanded tensor": lambda x: x[0].expand(3, 4).addcmul_(x, x, value=0.5),
    "relu_ of an expanded tensor": lambda x: x[0].expand(3, 4).relu_(),
    "out= an expanded tensor": lambda x: torch.mul(x, 2, out=x[0].expand(3, 4)),
    # a written tensor and an input that partly share memory ("some elements of the input tensor and the written-to...")
    "add_ of its own transpose": lambda x: (s := x.view(12)[:9].view(3, 3)).add_(s.t()),
    "add_ of a shifted self": lambda x: x[1:].add_(x[:-1]),
    "copy_ of a shifted self": lambda x: x[1:].copy_(x[:-1]),
    "add_ of its own first row": lambda x: x.add_(x[:1]),
    "out= a shifted input": lambda x: torch.add(x[:-1], 1, out=x[1:]),
    "lerp_ of a shifted self": lambda x: x[1:].lerp_(x[:-1], 0.5),
    "foreach add_ of a shifted self": lambda x: torch._foreach_add_([x[1:]], [x[:-1]]),
    "foreach add_ of an expanded tensor": lambda x: torch._foreach_add_([x[0].expand(3, 4)], [x]),
}

ALLOWED = {  # what eager allows: also run compiled, where the write is through a view of the program's tensor
    "fill_ of an expanded tensor": lambda x: x[0].expand(3, 4).fill_(2),
    "zero_ of an expanded tensor": lambda x: x[0].expand(3, 4).zero_(),
    "add_ of itself": lambda x: x.add_(x),
    "add_ of a disjoint part": lambda x: x[:1].add_(x[2:]),
    "add_ of a view of all of itself": lambda x: x.add_(x.view(3, 4)),
    "add_ of a partly shared, not dense slice": lambda x: x[:, :2].add_(x[:, 1:3]),  # eager cannot tell
    "index_add_ of a shifted self": lambda x: x[1:].index_add_(0, torch.tensor([0]), x[:1]),
}


def _run(case, lazy: bool, pending: bool, backend: str = "replay"):
    x = torch.arange(12.0).reshape(3, 4) / 7
    error = None
    options = {"backend": backend, "hot_after": 1, "async_compile": False}
    with adaptive_eager(**options) if lazy else contextlib.nullcontext():
        if pending:
            x = x * 1  # a pending value: its views are written
        y = x.exp()  # recorded before the op: must survive its error
        recorded = ae.metrics()["ops_recorded"]
        try:
            case(x)
        except RuntimeError as e:
            error = e
            assert ae.metrics()["ops_recorded"] == recorded, "the failing op was recorded"
            assert not lazy or ae.is_lazy(y), "raised at the flush, not at the op"
    return error, x, y


def _compare(case, pending, backend="replay"):
    want_error, want_x, want_y = _run(case, lazy=False, pending=pending)
    got_error, got_x, got_y = _run(case, lazy=True, pending=pending, backend=backend)
    assert type(got_error) is type(want_error), (got_error, want_error)
    assert str(got_error) == str(want_error)
    exact = {"rtol": 0, "atol": 0} if backend == "replay" else {}
    torch.testing.assert_close(got_x, want_x, **exact)
    torch.testing.assert_close(got_y, want_y, **exact)


@pytest.mark.parametrize("pending", [False, True], ids=["real", "pending"])
@pytest.mark.parametrize("case", list(RAISES))
def test_an_overlapping_write_eager_refuses_raises_at_the_line(case, pending):
    _compare(RAISES[case], pending)


@pytest.mark.parametrize("backend", ["replay", "inductor"])
@pytest.mark.parametrize("pending", [False, True], ids=["real", "pending"])
@pytest.mark.parametrize("case", list(ALLOWED))
def test_an_overlapping_write_eager_allows_does_what_eager_does(case, pending, backend, fresh_regions):
    _compare(ALLOWED[case], pending, backend)
