"""Step alignment without an optimizer: Note [Period detection] in adaptive_eager._period."""

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager._period import Periodicity


pytestmark = pytest.mark.usefixtures("windows_not_captured")  # conftest: captures off



def _feed(per: Periodicity, stream: list[int], reasons=None) -> list[int]:
    """Cut ``stream`` into windows the way the tracer does; return the window lengths."""
    lengths, i = [], 0
    while i < len(stream):
        n = min(per.next_cut(), len(stream) - i)
        by_cut = n == per.next_cut()
        per.on_flush(n, stream[i:i + n], by_cut, list)
        lengths.append(n)
        i += n
    return lengths


def test_finds_the_step_period_and_cuts_on_it():
    step = list(range(37))
    per = Periodicity(cap=100)
    _feed(per, step * 20)
    assert per.period == 37
    # from the reference on, every window is three whole steps starting at the same phase
    assert per.next_cut() % 37 == (per.pos - per.ref) % 37 or per.next_cut() <= 100


def test_every_period_window_has_the_same_signature():
    step = list(range(37))
    per = Periodicity(cap=100)
    stream = step * 40
    i = 0
    seen = []
    while i < len(stream):
        n = min(per.next_cut(), len(stream) - i)
        window = stream[i:i + n]
        by_cut = n == per.next_cut()
        if per.period and by_cut:
            seen.append(tuple(window))
        per.on_flush(n, window, by_cut, list)
        i += n
    assert len(seen) > 10 and len(set(seen[:-1])) == 1  # the last one may be cut short


def test_a_repeated_layer_inside_a_step_is_not_the_period():
    layer = [1, 2, 3, 4, 5]
    step = [9] + layer * 6 + [7, 8, 6]  # six identical layers, then loss and update
    per = Periodicity(cap=20)  # the step (34 ops) is longer than the cap; the layer (5) is shorter
    _feed(per, step * 30)
    assert per.period == len(step)


def test_period_longer_than_the_cap_is_cut_into_the_same_chunks():
    step = list(range(180))  # detectable up to twice the cap
    per = Periodicity(cap=100)
    _feed(per, step * 8)
    assert per.period == 180
    lengths = _feed(per, step * 4)
    assert lengths[1:7] == [100, 80] * 3  # the first one finishes the period in progress


def test_no_period_in_a_stream_that_does_not_repeat():
    per = Periodicity(cap=64)
    _feed(per, list(range(2000)))
    assert per.period == 0


def test_a_changed_loop_drops_the_period_and_finds_the_new_one():
    per = Periodicity(cap=100)
    _feed(per, list(range(30)) * 30)
    assert per.period == 30
    _feed(per, list(range(100, 141)) * 60)
    assert per.period == 41


def test_a_sync_off_the_grid_is_followed_by_a_cut_back_on_it():
    per = Periodicity(cap=100)
    _feed(per, list(range(30)) * 30)
    assert per.period == 30
    per.on_flush(7, [0] * 7, False, list)  # an .item() in the middle of a step
    assert (per.pos + per.next_cut() - per.ref) % 30 == 0


def _manual_sgd(steps, lazy, layers=1, reads_every=0, warmup=None, **options):
    torch.manual_seed(0)
    x = torch.randn(32, 16)
    ws = [(torch.randn(16, 16) / 4).requires_grad_() for _ in range(layers)]
    head = (torch.randn(16, 1) / 4).requires_grad_()
    ctx = ae.adaptive_eager(**options) if lazy else torch.enable_grad()
    with ctx:
        for i in range(steps):
            if lazy and i == (steps // 3 if warmup is None else warmup):
                ae.reset_metrics()  # warm-up done: count only the steady state
            h = x
            for w in ws:
                h = (h @ w).tanh()
            loss = (h @ head).pow(2).mean()
            loss.backward()
            with torch.no_grad():  # a hand-written update: no optimizer.step() to align on
                for p in (*ws, head):
                    p -= 0.01 * p.grad
                    p.grad = None
            if reads_every and i % reads_every == reads_every - 1:
                loss.item()
        metrics = ae.metrics() if lazy else None
    return [p.detach().clone() for p in (*ws, head)], metrics


def _steady_hit_rate(m):
    cut_windows = m["windows"] - m["flushes"].get("exit", 0)
    return m["compiled_runs"] / cut_windows


def test_loop_without_optimizer_or_syncs_hits_compiled_regions():
    eager, _ = _manual_sgd(150, lazy=False)
    lazy, m = _manual_sgd(150, lazy=True, window=97, async_compile=False)
    torch.testing.assert_close(lazy, eager)
    assert m["flushes"].get("period", 0) >= 20, m["flushes"]
    assert _steady_hit_rate(m) >= 0.99, m


def test_loop_with_identical_layers_and_rare_syncs_hits_compiled_regions():
    eager, _ = _manual_sgd(150, lazy=False, layers=4, reads_every=50)
    lazy, m = _manual_sgd(150, lazy=True, layers=4, reads_every=50, window=64, async_compile=False)
    torch.testing.assert_close(lazy, eager)
    non_period = m["windows"] - m["flushes"].get("period", 0)
    assert m["compiled_runs"] >= 0.99 * (m["windows"] - non_period), m
    assert m["flushes"].get("period", 0) >= 20, m["flushes"]


@pytest.mark.parametrize("detect", [True, False])
def test_period_cuts_compile_one_region_where_cap_cuts_drift(detect, monkeypatch, tmp_path, fresh_regions):
    """The control for the tests above: with detection off, cap cuts drift through the step, so
    the loop needs many regions (and replays each one until it is hot) instead of one."""
    if not detect:
        monkeypatch.setattr(Periodicity, "_search", lambda self, end: None)
    # a cap that is no multiple of the step's recorded ops, so that cap cuts drift (the step records
    # fewer ops since views of unwritten memory are inputs: Note [Views of unwritten memory])
    _, m = _manual_sgd(150, lazy=True, warmup=0, window=101, async_compile=False, cache_dir=str(tmp_path))
    if detect:
        # the first windows replay until the parameters are known as written (their views are
        # inputs, then view nodes: Note [Views of unwritten memory]); then one region runs
        assert m["compiles"] == 1 and m["replayed_regions"] <= 8, m
    else:
        assert m["flushes"].get("period", 0) == 0
        assert m["compiles"] >= 4 and m["replayed_regions"] > 3, m  # more than with detection
