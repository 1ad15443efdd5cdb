"""The benchmark scripts stay runnable: every module imports, every command line parses, and the
suite's tiniest workload goes once through measurement and report (replayed, one repeat, no
torch.compile, so it takes seconds; the figures themselves are not checked)."""

import dataclasses
import importlib
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
SCRIPTS = sorted(f[:-3] for f in os.listdir(BENCH) if f.endswith(".py"))


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    return importlib.import_module


def test_the_scripts_are_all_here():
    assert {"suite", "workloads", "measure", "report", "record_overhead", "flush_cost"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_benchmark_imports_and_its_command_line_parses(bench, name, monkeypatch, capsys):
    module = bench(name)
    if not hasattr(module, "main"):
        return  # a library module of the scripts (workloads, measure, report)
    monkeypatch.setattr(sys, "argv", [f"benchmarks/{name}.py", "--help"])
    with pytest.raises(SystemExit) as exit_:
        module.main()
    assert exit_.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_no_benchmark_imports_the_suite_cli():
    for name in SCRIPTS:
        with open(os.path.join(BENCH, name + ".py")) as f:
            text = f.read()
        assert "from suite import" not in text and "import suite" not in text, name


def test_the_suites_tiniest_workload_runs_through_measure_and_report(bench):
    measure, report, workloads = bench("measure"), bench("report"), bench("workloads")
    runner = measure.Runner("cpu", repeats=1, max_warm=2, options=dict(backend="replay"))

    def build(device):
        return dataclasses.replace(workloads.build_tiny(device), compile=None)

    r = measure.run_workload(runner, "tiny", build)
    assert not {k: v for k, v in r.errors.items() if v != "not applicable"}, r.errors
    assert r.check == ""  # the adaptive value matches eager's
    assert len(r.times["eager"]) == len(r.times["adaptive"]) == 1
    assert r.flush and 0 < r.flush[0] <= r.times["adaptive"][0]  # metrics()["flush_seconds"] per iteration
    assert r.per_iter("windows") == 1 and r.per_iter("eager_equivalent_launches") >= 1000
    assert r.kernels["eager"] >= 1000 and r.kernels["adaptive"] >= 1000  # replayed: op by op inside the flush
    info = measure.machine_info("cpu")
    section = report.section_md([r], "pytest", info, wall_s=1.0, repeats=1)
    assert "| tiny |" in section and "Targets" in section and "6. 1000 tiny ops" in section


def test_op_profile_times_the_work_of_a_workload_whose_product_is_its_result(bench):
    """op_profile's adaptive iteration holds the step's result through the sync: a result nobody
    holds is dead code that adaptive eager rightly skips, and the tiny loop would time nothing."""
    import adaptive_eager as ae

    op_profile, workloads = bench("op_profile"), bench("workloads")
    wl = dataclasses.replace(workloads.build_tiny("cpu"), compile=None)
    times = op_profile.interleaved(wl, iters=2, repeats=1, options=dict(backend="replay"))
    m = ae.metrics()
    assert m["ops_eliminated"] == 0 and m["ops_materialized"] == 2000, m
    assert 0 < times["adaptive flushes alone"] <= times["adaptive"]


def test_cold_steps_samples_the_main_thread_from_itself(bench):
    """Note [Sampling the main thread from itself] in benchmarks/cold_steps.py: no thread of the
    script reads another thread's frames (a sampler thread's ``sys._current_frames()`` and
    ``f_back`` crashed it under Python 3.11 once the step ran captured calls), and the main
    thread's own samples name its innermost frame."""
    import collections
    import signal
    import threading
    import time

    import ast

    with open(os.path.join(BENCH, "cold_steps.py")) as f:
        tree = ast.parse(f.read())
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "_current_frames"]
    cold_steps = bench("cold_steps")
    seen, sampling = collections.Counter(), threading.Event()
    handler = signal.getsignal(signal.SIGALRM)

    def spin_here():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.3:
            pass

    stop = cold_steps.start_sampler(seen, sampling, period_s=0.002)
    try:
        sampling.set()
        spin_here()
        sampling.clear()
    finally:
        stop()
        signal.signal(signal.SIGALRM, handler)
    assert sum(seen.values()) >= 20, seen
    assert sum(n for where, n in seen.items() if where.startswith("spin_here:")) >= 0.8 * sum(seen.values()), seen
