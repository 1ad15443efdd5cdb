"""Errors eager raises at an op come at that op's line (Note [Errors from data] in
adaptive_eager._data_checks): those its kernel finds from the arguments' metadata, dtypes and
scalars always, those it finds in an index's values when the index is real; when the index is
pending, at the next sync point at the latest, and never dropped with the op's unused result.
Plain eager is the oracle: the exception's type and message, and every value after it."""

import pytest
import torch
import torch.nn.functional as F

import adaptive_eager as ae
from adaptive_eager import adaptive_eager
from fuser.backends.stablehlo import missing_requirements

CONFIGS = {
    "replay": dict(backend="replay"),
    # every window compiled at first sight, in this thread
    "compiled": dict(backend="inductor", hot_after=1, async_compile=False),
}
if not missing_requirements():
    # the lowering the neuron path uses: its regions check their indices (Note [Checked indices] in
    # fuser.backends._stablehlo_lowering)
    CONFIGS["stablehlo"] = dict(backend="stablehlo", hot_after=1, async_compile=False)


def _pending(t: torch.Tensor, pending: bool) -> torch.Tensor:
    """``t``, or a value of the open window equal to it (a recorded op's result)."""
    return t.clone() if pending else t


def _outcome(statement):
    """The statement's exception, as (type, message), or None; raised at the statement or not at all."""
    try:
        statement()
    except Exception as e:  # noqa: BLE001 - the outcome compared with eager's
        return type(e), str(e)
    return None


# Each case builds its tensors (``pending``: as results of recorded ops), runs one statement that
# eager refuses, and returns that statement's outcome and the tensors whose values follow it.
def _index_dropped(p):
    r = _pending(torch.arange(10.0), p)
    return _outcome(lambda: r[torch.LongTensor([10])]), [r]


def _index_negative_dropped(p):
    r = _pending(torch.arange(10.0), p)
    return _outcome(lambda: r[torch.LongTensor([-11])]), [r]


def _setitem_bool_shape(p):
    a = _pending(torch.randn(2, 3), p)
    return _outcome(lambda: a.__setitem__(torch.tensor(True), a.expand(5, 1, 2, 3))), [a]


def _setitem_index_shape(p):
    x = _pending(torch.zeros(4, 3), p)
    return _outcome(lambda: x.__setitem__(torch.tensor([0, 1]), torch.ones(3, 3))), [x]


def _setitem_slice_shape(p):
    x = _pending(torch.zeros(4, 3), p)
    return _outcome(lambda: x.__setitem__(slice(0, 2), torch.ones(4))), [x]


def _setitem_out_of_range(p):
    x = _pending(torch.zeros(4, 3), p)
    return _outcome(lambda: x.__setitem__(torch.tensor([1, 4]), 1.0)), [x]


def _index_fill_complex(p):
    x = _pending(torch.tensor([[1.0, 2.0], [4.0, 5.0]]), p)
    i = torch.tensor([0])
    x.index_fill_(1, i, 0)
    return _outcome(lambda: x.index_fill_(1, i, 1 + 1j)), [x]


def _index_copy_index_dtype(p):
    x = _pending(torch.zeros(3, 2), p)
    return _outcome(lambda: x.index_copy_(0, torch.tensor([0, 1], dtype=torch.int32), torch.ones(2, 2))), [x]


def _index_copy_length(p):
    x = _pending(torch.zeros(3, 2), p)
    return _outcome(lambda: x.index_copy_(0, torch.tensor([0, 1, 2]), torch.ones(2, 2))), [x]


def _index_copy_dim(p):
    x = _pending(torch.zeros(3, 2), p)
    return _outcome(lambda: x.index_copy_(2, torch.tensor([0, 1]), torch.ones(2, 2))), [x]


def _index_copy_out_of_range(p):
    x = _pending(torch.zeros(3, 2), p)
    return _outcome(lambda: x.index_copy_(0, torch.tensor([0, 3]), torch.ones(2, 2))), [x]


def _add_bool_alpha(p):
    b = _pending(torch.ones(4, dtype=torch.bool), p)
    first = _outcome(lambda: torch.add(b, b, alpha=1.1))
    return (first, _outcome(lambda: torch.add(b, b, alpha=2.5))), [b]


def _index_select_dropped(p):
    x = _pending(torch.randn(5, 2), p)
    return _outcome(lambda: x.index_select(0, torch.tensor([1, 5]))), [x]


def _gather_dropped(p):
    x = _pending(torch.randn(5, 2), p)
    return _outcome(lambda: x.gather(0, torch.tensor([[0, 7]]))), [x]


def _embedding_dropped(p):
    w = _pending(torch.randn(5, 2), p)
    return _outcome(lambda: F.embedding(torch.tensor([[1, 5]]), w)), [w]


def _cross_entropy_target(p):
    x = _pending(torch.randn(3, 4), p)
    return _outcome(lambda: F.cross_entropy(x, torch.tensor([0, 4, 1]))), [x]


def _floor_divide_by_zero(p):
    x = _pending(torch.arange(4), p)
    return _outcome(lambda: x // torch.tensor([1, 1, 0, 1])), [x]


CASES = {f.__name__.lstrip("_"): f for f in (
    _index_dropped, _index_negative_dropped, _setitem_bool_shape, _setitem_index_shape, _setitem_slice_shape,
    _setitem_out_of_range, _index_fill_complex, _index_copy_index_dtype, _index_copy_length, _index_copy_dim,
    _index_copy_out_of_range, _add_bool_alpha, _index_select_dropped, _gather_dropped, _embedding_dropped,
    _cross_entropy_target, _floor_divide_by_zero,
)}


def _values(tensors):
    return [t.tolist() for t in tensors]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("pending", [False, True], ids=["real", "pending"])
@pytest.mark.parametrize("name", CASES)
def test_an_error_eager_raises_at_a_statement_is_raised_there(name, pending, config):
    torch.manual_seed(0)
    want, want_state = CASES[name](pending)
    assert want is not None
    want_state = _values(want_state)
    torch.manual_seed(0)
    with adaptive_eager(**CONFIGS[config]):
        got, state = CASES[name](pending)
        assert got == want
        assert _values(state) == want_state  # a failed write changed nothing eager's did not


def test_an_error_is_raised_at_the_statement_each_time_in_a_loop():
    """The same statement, failing again: its signature is not remembered as recordable."""
    b = torch.ones(4, dtype=torch.bool)
    r = torch.empty(10)
    with adaptive_eager():
        for _ in range(3):
            with pytest.raises(RuntimeError, match="alpha must not be a floating point"):
                torch.add(b, b, alpha=1.1)
            with pytest.raises(IndexError, match="out of bounds"):
                r[torch.LongTensor([10])]
        ae.sync()


def _step(table, idx):
    rows = table[idx]  # the statement that fails in the last step; its result is used
    return torch.tanh(rows * 2) + 1


@pytest.mark.parametrize("pending", [False, True], ids=["real", "pending"])
@pytest.mark.usefixtures("small_windows_off")
def test_an_out_of_range_index_in_a_hot_window(fresh_regions, pending):
    """A step recorded against its compiled region (Note [Hot windows] in adaptive_eager._hot): a
    real index out of range raises at its statement, a pending one at the next sync point; what
    follows is eager's."""
    table = torch.randn(10, 4)
    good, bad = torch.tensor([1, 2, 3]), torch.tensor([1, 20, 3])
    with adaptive_eager(backend="inductor", hot_after=2, async_compile=False):
        for _ in range(6):
            y = _step(table, good.clone() if pending else good)
            ae.sync()
        assert ae.metrics()["hot_windows"] >= 1
        if pending:
            _step(table, bad.clone())  # its result is dropped: the error still comes
            with pytest.raises(IndexError, match="out of bounds"):
                ae.sync()
        else:
            with pytest.raises(IndexError, match="out of bounds"):
                _step(table, bad)
        y = _step(table, good)
        assert y.tolist() == _step(table, good).tolist()


@pytest.mark.parametrize("config", CONFIGS)
def test_a_pending_index_out_of_range_is_raised_at_the_next_sync_though_its_result_is_dropped(config):
    r = torch.empty(10)
    with adaptive_eager(**CONFIGS[config]):
        idx = torch.tensor([10]) * 1  # pending
        r[idx]
        with pytest.raises(IndexError, match="index 10 is out of bounds"):
            ae.sync()
        x = torch.arange(4)
        d = torch.tensor([1, 0, 1, 1]) * 1
        x // d
        with pytest.raises(RuntimeError, match="ZeroDivisionError"):
            ae.sync()
        x = torch.zeros(3) * 1
        x[torch.tensor([0, 5]) * 1] = 1.0  # a write into a value nothing reads after it
        del x
        with pytest.raises(IndexError, match="index 5 is out of bounds"):
            ae.sync()


def test_indices_in_range_are_recorded_without_a_flush():
    """Embedding and cross-entropy with real or pending indices every step: each step is one window,
    nothing runs eagerly."""
    torch.manual_seed(0)
    emb, lin = torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50)
    opt = torch.optim.SGD([*emb.parameters(), *lin.parameters()], lr=0.1)
    batches = [(torch.randint(0, 50, (4, 6)), torch.randint(0, 50, (4 * 6,))) for _ in range(6)]
    batches[2][1][3] = -100  # ignore_index

    def train(pending_targets):
        losses = []
        for ids, target in batches:
            if pending_targets:
                target = target * 1
            loss = F.cross_entropy(lin(emb(ids)).flatten(0, 1), target)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return losses

    state = [p.detach().clone() for p in (*emb.parameters(), *lin.parameters())]
    want = train(False)
    for pending_targets in (False, True):
        with torch.no_grad():
            for p, s in zip((*emb.parameters(), *lin.parameters()), state):
                p.copy_(s)
        ae.reset_metrics()
        with adaptive_eager():
            got = train(pending_targets)
            m = ae.metrics()
        assert [g.item() for g in got] == [w.item() for w in want]
        assert not m["fallback_ops"], m["fallback_ops"]
        assert "index_check" not in m["flushes"], m["flushes"]


def _fill_step(x, i, value):
    y = (x * 2).index_fill(1, i, value)  # the statement that fails in the last step
    return y + 1


@pytest.mark.usefixtures("small_windows_off")
def test_a_value_eager_refuses_in_a_hot_window_raises_at_the_statement(fresh_regions):
    """The statement, validated against its compiled region's template until its scalar differs."""
    step, good, bad = _fill_step, 0.5, 1 + 1j
    x, i = torch.ones(2, 3), torch.tensor([0, 2])  # not one element: the general path snapshots those
    want = _outcome(lambda: step(x, i, bad))
    assert want is not None
    with adaptive_eager(backend="inductor", hot_after=2, async_compile=False):
        for _ in range(6):
            y = step(x, i, good)
            ae.sync()
        assert ae.metrics()["hot_windows"] >= 1
        assert _outcome(lambda: step(x, i, bad)) == want
        y = step(x, i, good)
        assert y.tolist() == step(x, i, good).tolist()
