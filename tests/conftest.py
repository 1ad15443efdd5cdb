import os

import pytest

import _device
import adaptive_eager as ae

_device.install()  # before any test module is imported: Note [Test device] in _device.py

from _oracle import CACHE_ENV  # noqa: E402 - after the device's install

# Variants of parametrized tests that the default run leaves out (marked ``slow``), each the slower
# twin of one that stays: CI must stay under 20 minutes (`--durations` of session 10, under load).
SLOW_VARIANTS = {
    # 81 s; its replay twin (20 s) checks the same growth of memory over a long loop
    "test_tracer.py::test_long_loop_keeps_memory_flat[inductor]",
    # 41 s; the replay twin (29 s) checks the same reference counting
    "test_tracer.py::test_a_flushed_window_is_freed_by_reference_counting[inductor]",
    # 77 s; compile-in-process (31 s) runs the same four threads against compiled regions
    "test_threads.py::test_four_threads_train_at_once_with_compiled_regions[compile-in-background]",
    # 15 s under load (session 24); its inductor twin (14 s) checks the same once-a-process warning
    "test_kernel_warnings.py::test_a_once_a_process_warning_comes_once[replay]",
    # Session 40 (CI at 1163 s of its 1200): each with a twin in the default run.
    # 15 s; test_fuser.py's warm restart checks the same no-compile second process on the CPU
    "test_neuron_emulation.py::test_warm_restart_on_the_emulated_device_compiles_nothing",
    # 10 s; its twin (the program gone before its records land) runs the same follow-up compiles
    "test_module_capture.py::test_a_program_gone_with_its_records_unread_leaves_their_graphs_compiled",
    # 7 s; test_neuron_capture.py's op-by-op run of a captured call counts the same launches
    "test_neuron_emulation.py::test_launches_of_captured_graphs_run_op_by_op_are_what_reaches_the_device",
    # 15 s; test_threads.py's four threads train against compiled regions in the default run
    "test_generated_training.py::test_training_loops_in_two_threads_match_eager",
    # 6 s; the thread variant is the one whose exit aborted
    "test_cache_faults.py::test_ctrl_c_during_a_compile_exits_cleanly[in-process]",
    # Session 47 (quiet CI 951 s, a loaded one 1645 s; `--durations`, under load): each with a twin.
    # 22 s; test_neff_cache.py's claims tests check that a key is compiled by one process only
    "test_fuser.py::test_four_processes_on_a_cold_cache_compile_each_region_once",
    # 18 s; the warm-process test of Note [Training captured at once] checks the same worker
    # compile and the new process's loads
    "test_module_capture.py::test_the_compile_is_off_the_step_and_a_new_process_loads_it",
    # 15 s; test_trainium_example_runs_emulated and the default-backend training test cover it
    "test_neuron_emulation.py::test_train_example_on_the_emulated_device_matches_eager",
    # 19 s; tiers='hot' only: test_neuron_capture.py's scheduled-lr test checks the default path
    "test_neuron_emulation.py::test_a_recorded_foreach_adamw_step_with_a_schedule_compiles_once",
    # 14 s and 7 s; test_generated_programs.py runs the same differential test on the CPU
    "test_neuron_emulation.py::test_generated_programs_on_the_emulated_device_match_eager_there[stablehlo]",
    "test_neuron_emulation.py::test_generated_programs_on_the_emulated_device_match_eager_there[replay]",
    # 15 s; test_neuron_capture.py's foreach step lowered whole checks the foreach path compiled
    "test_neuron_emulation.py::test_adamw_takes_the_foreach_path_on_the_device_with_cpus_values",
}


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if item.nodeid.rpartition("/")[2] in SLOW_VARIANTS:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir(tmp_path_factory):
    """Compiled regions go to a cache of this test session, never the user's ~/.cache: this
    process's (``ae.defaults``) and a program's a test starts (the environment, which
    ``_oracle.program_env`` keeps; a program that found none wrote the user's cache)."""
    path = str(tmp_path_factory.mktemp("adaptive_eager_cache"))
    saved = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = path
    try:
        with ae.defaults(cache_dir=path):
            yield
    finally:
        if saved is None:
            os.environ.pop(CACHE_ENV, None)
        else:
            os.environ[CACHE_ENV] = saved


@pytest.fixture(autouse=True)
def _fresh_metrics():
    """Every test starts with zeroed counters and leaves adaptive eager off for this thread."""
    ae.reset_metrics()
    yield
    ae.disable()


@pytest.fixture(autouse=True)
def _workers_of_the_test_stopped():
    """The compile workers a test started for a cache of its own stop with the test. A process keeps
    one worker per store that had a compile (``fuser.artifacts``), which a program with one cache
    never notices; this one opens hundreds, and kept 32 idle workers (6 GB) by the middle of the run."""
    from fuser import artifacts

    before = set(artifacts._JOBS)
    yield
    session_cache = os.path.realpath(os.path.expanduser(ae.load_options().cache_dir))
    for key in set(artifacts._JOBS) - before:
        jobs = artifacts._JOBS[key]
        if os.path.realpath(jobs.store.directory) != session_cache:
            del artifacts._JOBS[key]
            jobs.shutdown(wait=False)


@pytest.fixture
def small_windows_off(monkeypatch):
    """For tests of what windows, regions and compiles do, which use windows of a few tiny ops: those
    would run eagerly once compiled (Note [Small windows run eagerly] in adaptive_eager._hot, tested
    in tests/test_small_windows.py)."""
    from adaptive_eager import _hot

    monkeypatch.setattr(_hot, "_SMALL_OPS", -1)
    for template in list(_hot.TEMPLATES.values()):
        if template:
            template.small = None  # made before this test


@pytest.fixture
def parking_off(monkeypatch):
    """For tests of where a training step's windows are cut: once its loss window runs small, the
    mode would park between its captured calls and no window would be cut there (Note [The mode
    parked between captured calls] in adaptive_eager._state, tested in tests/test_parked.py)."""
    from adaptive_eager import _state

    monkeypatch.setattr(_state, "_CHECK_EVERY", 1)  # every chance recorded


@pytest.fixture
def fresh_regions():
    """No in-memory region, shape class or scalar group of an earlier test answers for this one
    (tests that count compiles or replays need a cold process's view)."""
    import fuser

    fuser.cache_clear()
    yield


@pytest.fixture
def windows_not_captured():
    """For tests that count what windows and regions do: the model's and the optimizer's calls would
    otherwise be captured once hot (Note [Captured modules] in adaptive_eager._capture, tested in
    tests/test_module_capture.py), taking their ops out of the windows counted."""
    import adaptive_eager as ae

    with ae.defaults(tiers="hot"):
        yield
