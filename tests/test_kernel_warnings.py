"""Warnings a recorded op's kernel gives (Note [Kernel warnings] in adaptive_eager._kernel_warnings):
each comes once per run of the op, at the user's line, with eager's category and text, whether the
window replays, compiles or runs hot, at first sight or from the meta cache, and never
again when the window runs. Plain eager is the oracle, under the "always" and "default" filters."""

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
from _oracle import program_env
import torch

import adaptive_eager as ae
from _device import COMPILED_BACKEND
from test_hot_windows import SYNC, _step

COMPILED = dict(SYNC, backend=COMPILED_BACKEND)  # replays, compiles, then runs hot
REPLAY = dict(backend="replay")
torch.manual_seed(0)
X, ONE = torch.randn(4, 3), torch.randn(1)


def _src(x, pending):
    return x * 1 if pending else x  # ``x * 1``: a value pending in the window


# each case: (input, pending) -> a tensor; the op that warns is the case's one line (``_line``)
CASES = {
    # TORCH_WARN in the kernels (ReduceOps.cpp: degrees of freedom <= 0), each time they run
    "std_of_one_element": lambda p: _src(ONE, p).std(),
    "std_dim_correction": lambda p: torch.std(_src(X, p), dim=0, correction=4),
    "var_of_one_element": lambda p: _src(ONE, p).var(),
    "var_dim_correction": lambda p: _src(X, p).var(0, correction=5),
    "std_mean": lambda p: torch.std_mean(_src(ONE, p))[0],
    "var_mean": lambda p: torch.var_mean(_src(X, p), 1, correction=3)[1],
    "std_then_more_ops": lambda p: (_src(ONE, p).std() + 1) * 2,
    # composite ops (their warning is above the mode), data-dependent ops, torch.tensor(t), out=
    "cov_of_one_observation": lambda p: torch.cov(_src(X, p)[:, :1]),
    "uint8_mask_index": lambda p: _src(X, p)[torch.ones(4, 3, dtype=torch.uint8)],
    # an in-place op (no fresh output) whose kernel warns and fails on stand-ins' values (the mask)
    "uint8_mask_setitem": lambda p: (x := _src(X, p) * 1).__setitem__(torch.ByteTensor([1, 0, 1, 0]), X[:2]) or x,
    "tensor_of_a_tensor": lambda p: torch.tensor(_src(X, p)) + 1,
    "resized_out": lambda p: torch.mul(_src(X, p), 2, out=torch.empty(3)),
    "softmax_without_dim": lambda p: torch.nn.functional.softmax(_src(X, p)),
}
_LINES = {}


def _line(name: str) -> int:
    if not _LINES:
        with open(__file__) as f:
            for i, text in enumerate(f, 1):
                for case in CASES:
                    if text.lstrip().startswith(f'"{case}":'):
                        _LINES[case] = i
    return _LINES[name]


def _observe(name: str, pending: bool, flt: str, steps: int, options=None):
    """The warnings of ``steps`` runs of the case (category, text, file, line) and its values."""
    values = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter(flt)
        for _ in range(steps):
            if options is None:
                values.append(CASES[name](pending))
            else:
                values.append(CASES[name](pending))
                ae.sync()
    return [(w.category, str(w.message), w.filename, w.lineno) for w in caught
            if w.filename == __file__], values


@pytest.mark.parametrize("flt", ["always", "default"])
@pytest.mark.parametrize("pending", [True, False], ids=["pending", "real"])
@pytest.mark.parametrize("options", [REPLAY, COMPILED], ids=["replay", "compiled"])
@pytest.mark.parametrize("name", CASES)
def test_a_kernels_warning_comes_once_per_run_at_the_users_line(fresh_regions, name, pending, options, flt):
    want, want_values = _observe(name, pending, flt, 4)
    assert want and all(line == _line(name) for *_, line in want), want  # the oracle warns, at the line
    with ae.adaptive_eager(**options):
        got, values = _observe(name, pending, flt, 4, options)
    assert got == want, (got, want)
    for v, w in zip(values, want_values):
        torch.testing.assert_close(v, w, equal_nan=True)


def test_the_flush_gives_no_warning_of_its_own(fresh_regions):
    """The brief's case: ``.item()`` ran the window, whose replay warned again, at
    ``adaptive_eager/_patches.py`` (the patched reader) instead of the user's line."""
    with ae.adaptive_eager(**COMPILED):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                y = (ONE * 1).std()  # MARK-std
                y.item()
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, _mark("MARK-std"))] * 3, \
        [(w.filename, w.lineno, str(w.message)) for w in caught]
    assert ae.metrics()["fallback_ops"].get("aten.std.correction") == 3, ae.metrics()["fallback_ops"]


def test_a_warning_op_between_the_ops_of_a_hot_window(fresh_regions):
    """The op that warns runs eagerly beside a window that goes on (it reads nothing pending) and
    runs hot: a warning each step, at its line, and none from the hot window's runs."""
    x, w = torch.randn(16), torch.randn(16)
    want = _step(_step(x, w), w)
    got = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ae.adaptive_eager(**COMPILED):
            for _ in range(5):
                y = _step(x, w)
                ONE.std()  # MARK-hot
                got.append(_step(y, w))
                ae.sync()
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, _mark("MARK-hot"))] * 5, \
        [(w.filename, w.lineno, str(w.message)) for w in caught]
    assert ae.metrics()["hot_windows"] >= 1, ae.metrics()
    for v in got:
        torch.testing.assert_close(v, want)


def test_our_capture_keeps_the_programs_default_filter():
    """``warnings.catch_warnings`` clears every module's warning registry (it bumps the filters'
    version): a program's ``"default"`` filter then shows a warning it had shown already. The
    library's captures (the layout probe on each new signature, ``float(loss)`` of a tensor that
    requires grad) must not."""
    from adaptive_eager._kernel_warnings import kernel_warnings

    x = torch.randn(3, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for i in range(3):
            warnings.warn("the program's own")  # MARK-own
            kernel_warnings(lambda: torch.ops.aten.std.correction(ONE))
            with ae.adaptive_eager(backend="replay"):
                float((x * 2).sum())
    own = [w for w in caught if "the program's own" in str(w.message)]
    assert [(w.filename, w.lineno) for w in own] == [(__file__, _mark("MARK-own"))], own


def _mark(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if marker in line and "_mark(" not in line)


# TORCH_WARN_ONCE: once a process, which the layout probe of a new signature used to use up
ONCE = textwrap.dedent("""
    import warnings, torch, adaptive_eager as ae
    x = torch.randn(4, 3)
    with ae.adaptive_eager(backend=BACKEND, hot_after=2, async_compile=False):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                y = torch.searchsorted((x * 1).t(), torch.zeros(3, 2))
                ae.sync()
    for w in caught:
        print("WARNING", w.filename, w.lineno, w.message)
    assert torch.equal(y, torch.searchsorted(x.t().contiguous(), torch.zeros(3, 2)))
""")


@pytest.mark.parametrize("backend", ["replay", COMPILED_BACKEND])
def test_a_once_a_process_warning_comes_once(tmp_path, backend):
    script = tmp_path / "prog.py"
    script.write_text(ONCE.replace("BACKEND", repr(backend)))
    env = program_env()
    env.update(NEURON_EAGER_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=os.pathsep.join(sys.path))
    # a second process on the same cache directory too: its first sight is not skipped by the
    # metadata kept on disk (Note [Meta entries on disk]), so it issues the warning again, once
    for _ in range(2 if backend == "replay" else 1):
        out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        lines = [line for line in out.stdout.splitlines() if line.startswith("WARNING") and "searchsorted" in line]
        assert len(lines) == 1 and lines[0].startswith(f"WARNING {script} 8 "), out.stdout + out.stderr


# Note [Kernel warnings]: the capture around the library's own probes is the capturing thread's
def _warn_in_a_thread(*messages):
    import threading

    def run():
        for m in messages:
            warnings.warn(m)

    t = threading.Thread(target=run)
    t.start()
    t.join()


def test_another_threads_warning_meets_the_programs_filters_and_is_shown():
    from adaptive_eager._kernel_warnings import caught_warnings

    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")
        warnings.filterwarnings("ignore", message="ignored by the program")
        with caught_warnings() as caught:
            warnings.warn("the probe's")  # this thread's: caught, whatever the program's filters
            _warn_in_a_thread("from a logging thread", "ignored by the program")
            warnings.warn("ignored by the program")  # this thread's, caught too
        warnings.warn("after")
    assert [str(w.message) for w in caught] == ["the probe's", "ignored by the program"]
    assert [str(w.message) for w in shown] == ["from a logging thread", "after"]
    assert shown[0].filename == __file__


def test_captures_in_two_threads_end_in_any_order():
    import threading

    from adaptive_eager._kernel_warnings import _ALWAYS, caught_warnings

    program = warnings.showwarning
    entered, release, seen = threading.Event(), threading.Event(), {}

    def other():
        with caught_warnings() as caught:
            entered.set()
            release.wait(10)
            warnings.warn("the other thread's probe")
        seen["other"] = [str(w.message) for w in caught]

    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        program = warnings.showwarning
        t = threading.Thread(target=other)
        with caught_warnings() as caught:
            t.start()
            entered.wait(10)
            warnings.warn("this thread's probe")
        # this capture ended first: the other's still catches, and this thread's warnings show
        warnings.warn("between")
        release.set()
        t.join()
        assert warnings.showwarning is program and _ALWAYS not in warnings.filters
        warnings.warn("after")
    assert [str(w.message) for w in caught] == ["this thread's probe"]
    assert seen["other"] == ["the other thread's probe"]
    assert [str(w.message) for w in shown] == ["between", "after"]


def test_a_logging_threads_warnings_all_reach_the_program():
    """A thread warns while the program records ops that miss the meta cache (each runs its meta
    kernel and layout probe under a capture): every warning is shown, as in eager."""
    import threading
    import time

    stop, said = threading.Event(), []

    def logger():
        while not stop.is_set() or not said:
            said.append(f"log line {len(said)}")
            warnings.warn(said[-1])
            time.sleep(0)  # lets the program's thread run

    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        t = threading.Thread(target=logger)
        t.start()
        with ae.adaptive_eager(backend="replay"):  # replay keeps no metadata on disk
            for i in range(1, 150):
                y = torch.ones(i).cumsum(0) * 2  # a new shape each step: meta-cache misses
            ae.sync()
        stop.set()
        t.join()
    assert sorted(str(w.message) for w in shown if "log line" in str(w.message)) == sorted(said)
    assert torch.equal(y, torch.ones(149).cumsum(0) * 2)
