"""Note [GC threshold]: while adaptive eager is on, a window's objects die in generation 0."""

import gc
import threading

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import _gc
from adaptive_eager.config import ConfigError


@pytest.fixture(autouse=True)
def _program_thresholds():
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # CPython's defaults, whatever earlier tests did
    yield
    gc.set_threshold(*saved)


def test_raised_while_on_and_restored_at_exit():
    with ae.adaptive_eager(device="cpu", backend="replay", window=1000):
        assert gc.get_threshold() == (16000, 10, 10)
    assert gc.get_threshold() == (700, 10, 10)


def test_the_removed_setting_is_refused_or_warned_naming_gc_set_threshold(monkeypatch):
    """``tune_gc`` is no longer a setting: turning it off is refused, naming what keeps the
    program's thresholds; asking for it on is said once (keyword and environment alike)."""
    from adaptive_eager import config

    for spelled in ({"tune_gc": False}, {"tune_gc": "maybe"}):
        with pytest.raises(ConfigError, match=r"tune_gc is no longer a setting .*gc\.set_threshold\(\)"):
            ae.adaptive_eager(device="cpu", **spelled).__enter__()
    with pytest.raises(ConfigError, match="NEURON_EAGER_TUNE_GC='0'"):
        config.load_options({"NEURON_EAGER_TUNE_GC": "0"})
    monkeypatch.setattr(config, "_warned_removed", set())
    with pytest.warns(UserWarning, match="option tune_gc=True: tune_gc is no longer a setting"):
        with ae.adaptive_eager(device="cpu", backend="replay", tune_gc=True):
            assert gc.get_threshold()[0] > 700


def test_the_programs_own_thresholds_win():
    with ae.adaptive_eager(device="cpu", backend="replay"):
        gc.set_threshold(500, 5, 5)  # the program tunes gc itself while on
        with ae.adaptive_eager(window=2048):  # options change: must not undo the program's choice
            assert gc.get_threshold() == (500, 5, 5)
    assert gc.get_threshold() == (500, 5, 5)
    gc.set_threshold(100000, 10, 10)  # already higher than a window needs: left as it is
    with ae.adaptive_eager(device="cpu", backend="replay"):
        assert gc.get_threshold() == (100000, 10, 10)
    assert gc.get_threshold() == (100000, 10, 10)
    gc.set_threshold(0, 10, 10)  # automatic collection off: left off
    with ae.adaptive_eager(device="cpu", backend="replay"):
        assert gc.get_threshold() == (0, 10, 10)


def test_enable_with_new_window_follows_and_disable_restores():
    ae.enable(device="cpu", backend="replay", window=100)
    assert gc.get_threshold()[0] == 1600
    ae.enable(window=500)
    assert gc.get_threshold()[0] == 8000
    ae.enable()  # enable() starts from the defaults again
    assert gc.get_threshold()[0] == 16 * 1024
    ae.disable()
    assert gc.get_threshold() == (700, 10, 10)


def test_threads_share_the_raise_until_the_last_one_leaves():
    entered, leave = threading.Event(), threading.Event()
    seen = []

    def other():
        with ae.adaptive_eager(device="cpu", backend="replay", window=2000):
            entered.set()
            leave.wait(30)
        seen.append(gc.get_threshold())

    with ae.adaptive_eager(device="cpu", backend="replay", window=1000):
        t = threading.Thread(target=other)
        t.start()
        assert entered.wait(30)
        assert gc.get_threshold()[0] == 32000  # the larger window's request
    assert gc.get_threshold()[0] == 32000  # the other thread is still on
    leave.set()
    t.join(30)
    assert seen == [(700, 10, 10)]
    assert gc.get_threshold() == (700, 10, 10)


def _young_collections(tune: bool) -> int:
    """Generation-0 collections while recording 4 windows of 900 ops (the op cap is 1000); not
    ``tune``: the program sets CPython's default threshold itself once on, which is then kept."""
    count = [0]

    def cb(phase, info):
        if phase == "start":
            count[0] += 1

    x = torch.ones(8)
    gc.collect()
    gc.callbacks.append(cb)
    try:
        with ae.adaptive_eager(device="cpu", backend="replay", window=1000):
            if not tune:
                gc.set_threshold(700, 10, 10)
            for _ in range(4):
                y = x
                for _ in range(900):
                    y = y + 1
                assert y[0].item() == 901.0  # a flush: the window's objects die here
    finally:
        gc.callbacks.remove(cb)
    return count[0]


def test_a_window_records_without_collections():
    assert _young_collections(tune=False) >= 8  # the cost the raise avoids: each promotes the window
    assert _young_collections(tune=True) <= 1


def test_release_of_an_unknown_holder_is_a_no_op():
    _gc.release(object())
    assert gc.get_threshold() == (700, 10, 10)
