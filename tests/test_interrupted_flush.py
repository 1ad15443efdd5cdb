"""An exception that escapes the run of a window (Ctrl-C caught by the program, an internal error,
an unusable cache directory) leaves what the window had not computed as NaN (0 for integers and
bools), never uninitialized memory; values it had computed keep them; the exception itself goes
on unchanged; the next window runs normally (DESIGN.md, the semantic contract). Faults are
injected into the fuser's own functions, at the point where part of the window has run."""

import pytest
import torch

import adaptive_eager as ae
import fuser
import fuser.launch
import fuser.replay
from adaptive_eager import adaptive_eager


@pytest.fixture(autouse=True)
def _fresh(fresh_regions):
    yield


def _program(x):
    """Five live values, one op each, so the run writes them in this order (replay: node order;
    a compiled region: live order); two float, three int or bool."""
    a = x * 2
    b = a.sin()
    k = x > 0
    i = k.long()
    j = i + 1
    return [a, b, k, i, j]


def _assert_poisoned(t):
    if t.is_floating_point():
        assert torch.isnan(t).all(), t
    else:
        assert (t == 0).all(), t


def _fail_after(monkeypatch, target, name, error, calls):
    """``target.name`` raising ``error`` at its call number ``calls + 1``."""
    original = getattr(target, name)
    seen = [0]

    def failing(*args, **kwargs):
        if seen[0] == calls:
            raise error
        seen[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, failing)


@pytest.mark.parametrize("backend, target, name, error, computed", [
    # Ctrl-C between two ops of a replay: the first value was written
    ("replay", fuser.replay, "_finish", KeyboardInterrupt(), 1),
    # an internal error in the replay loop (outside the op's own call: not the program's error)
    ("replay", fuser.replay, "_finish", RuntimeError("internal"), 3),
    # Ctrl-C while a compiled region's outputs are bound: two were
    ("inductor", fuser.launch, "_bind", KeyboardInterrupt(), 2),
    # an internal error before the region runs: nothing was computed
    ("inductor", fuser, "read_liveness", RuntimeError("internal"), 0),
])
def test_an_exception_mid_run_poisons_what_was_not_computed(monkeypatch, tmp_path, backend, target, name, error,
                                                           computed):
    x = torch.randn(64)
    want = _program(x)
    with adaptive_eager(backend=backend, hot_after=1, async_compile=False, cache_dir=str(tmp_path)):
        got = _program(x)
        _fail_after(monkeypatch, target, name, error, computed)
        with pytest.raises(type(error)) as raised:
            ae.sync()
        assert raised.value is error  # the program's exception, not a wrapper
        assert any("NaN" in note for note in getattr(error, "__notes__", ())), "says what became of the values"
        monkeypatch.undo()
        for g, w in zip(got[:computed], want[:computed]):
            torch.testing.assert_close(g, w)
        for g in got[computed:]:
            assert not ae.is_lazy(g)
            _assert_poisoned(g)
        # the next window (the same structure: a compiled region is a hit) runs normally
        again = _program(x)
        ae.sync()
    for g, w in zip(again, want):
        torch.testing.assert_close(g, w)


def test_an_unusable_cache_dir_never_leaves_uninitialized_values(tmp_path):
    """A cache path the OS rejects outright: the flush may fail (then every value is poisoned) or
    fall back to an in-memory cache (then every value is eager's); never garbage."""
    x = torch.randn(64)
    want = _program(x)
    try:
        with adaptive_eager(backend="inductor", hot_after=1, async_compile=False, cache_dir=f"{tmp_path}/a\0b"):
            got = _program(x)
            ae.sync()
    except Exception as e:  # noqa: BLE001 - either outcome is allowed; garbage is not
        assert any("NaN" in note for note in getattr(e, "__notes__", ())), e
        for g in got:
            _assert_poisoned(g)
    else:
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
    with adaptive_eager(backend="inductor", hot_after=1, async_compile=False, cache_dir=str(tmp_path)):
        again = _program(x)
        ae.sync()
    for g, w in zip(again, want):
        torch.testing.assert_close(g, w)
