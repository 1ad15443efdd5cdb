"""tests/pytorch_diff.py, the differential check on PyTorch's own test files, without PyTorch's
test files: its junit diff on hand-written XML, its command line, and one end-to-end run on a tiny
test file of ours that imports no torch (so each pytest process takes about a second)."""

import os
import subprocess
import sys
import textwrap

import pytest

import pytorch_diff

SCRIPT = pytorch_diff.__file__

EAGER_XML = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="1" skipped="1" tests="5">
<testcase classname="test_indexing.TestIndexingCPU" name="test_index_cpu" time="0.1"/>
<testcase classname="test_indexing.TestIndexingCPU" name="test_setitem_cpu" time="0.1"/>
<testcase classname="test_indexing.TestIndexingCPU" name="test_bool_cpu" time="0.1"/>
<testcase classname="test_indexing.TestIndexingCPU" name="test_cuda_only_cpu" time="0.0">
  <skipped type="pytest.skip" message="Only runs on cuda">skip</skipped></testcase>
<testcase classname="test_indexing.TestIndexingCPU" name="test_broken_cpu" time="0.1">
  <failure message="AssertionError: broken in eager too">trace</failure></testcase>
</testsuite></testsuites>"""

ADAPTIVE_XML = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="2" skipped="1" tests="5">
<testcase classname="test_indexing.TestIndexingCPU" name="test_index_cpu" time="0.1">
  <failure message="AssertionError: IndexError not raised&#10;second line">Traceback ...</failure></testcase>
<testcase classname="test_indexing.TestIndexingCPU" name="test_setitem_cpu" time="0.1">
  <failure message="">
RuntimeError: shape mismatch
more</failure>
  <error message="failed on teardown with &quot;RuntimeError: late&quot;">trace</error></testcase>
<testcase classname="test_indexing.TestIndexingCPU" name="test_bool_cpu" time="0.1"/>
<testcase classname="test_indexing.TestIndexingCPU" name="test_cuda_only_cpu" time="0.0">
  <skipped type="pytest.skip" message="Only runs on cuda">skip</skipped></testcase>
<testcase classname="test_indexing.TestIndexingCPU" name="test_broken_cpu" time="0.1"/>
</testsuite></testsuites>"""


def test_junit_outcomes_and_the_eager_pass_adaptive_fail_list():
    eager = pytorch_diff.parse_junit(EAGER_XML)
    adaptive = pytorch_diff.parse_junit(ADAPTIVE_XML)
    assert pytorch_diff.summary(eager) == "3 passed, 1 failed, 1 skipped, 0 error"
    # a failing call and an erroring teardown of one test count once, as the worse: an error
    assert pytorch_diff.summary(adaptive) == "2 passed, 1 failed, 1 skipped, 1 error"
    diff = pytorch_diff.differences(eager, adaptive)
    assert [(test_id, o.status, o.message) for test_id, o in diff] == [
        ("test_indexing.TestIndexingCPU::test_index_cpu", "failed", "AssertionError: IndexError not raised"),
        ("test_indexing.TestIndexingCPU::test_setitem_cpu", "error", 'failed on teardown with "RuntimeError: late"'),
    ]
    assert pytorch_diff.only_in_other(eager, adaptive) == ["test_indexing.TestIndexingCPU::test_broken_cpu"]
    assert pytorch_diff.missing(eager, adaptive) == []
    # the failure's message is empty: its text's first line stands in
    assert pytorch_diff.parse_junit(ADAPTIVE_XML.replace(
        '<error message="failed on teardown with &quot;RuntimeError: late&quot;">trace</error>', "")
    )["test_indexing.TestIndexingCPU::test_setitem_cpu"].message == "RuntimeError: shape mismatch"


def test_a_run_is_a_crash_when_killed_timed_out_or_silent(tmp_path):
    junit = str(tmp_path / "absent.xml")
    crash = lambda rc: pytorch_diff.Run("f.py", "adaptive", rc, junit, "", 0.0).crash  # noqa: E731
    assert crash(-11) == "killed by SIGSEGV"
    assert crash(139) == "killed by SIGSEGV (exit 139)"
    assert crash(None) == "timed out"
    assert crash(1) == "exit 1 and no junit file"
    (tmp_path / "absent.xml").write_text(EAGER_XML)
    assert crash(1) == "" and crash(0) == "" and crash(5) == ""
    assert crash(3) == "exit 3 (pytest did not finish)"
    log = "t.py::A::test_a PASSED [ 50%]\nt.py::A::test_b \nFatal Python error: Segmentation fault\n"
    assert pytorch_diff.last_started_test(log) == "t.py::A::test_b"


def test_outcomes_before_a_crash_come_from_the_verbose_log():
    log = ("d/t.py::A::test_a PASSED      [ 25%]\n"
           "d/t.py::A::test_b SKIPPED (needs cuda) [ 50%]\n"
           "t.py::test_c FAILED [ 75%]\n"
           "t.py::test_d \n")
    outcomes = pytorch_diff.parse_verbose_log(log)
    assert {k: o.status for k, o in outcomes.items()} == {
        "d.t.A::test_a": "passed", "d.t.A::test_b": "skipped", "t::test_c": "failed"}
    # the ids are junit's, so that they meet the oracle's
    assert pytorch_diff.junit_id("test_indexing.py::TestIndexingCPU::test_index_cpu") == \
        "test_indexing.TestIndexingCPU::test_index_cpu"


def test_keywords_per_file():
    assert pytorch_diff.parse_keywords(["test_torch.py:test_index or test_view",
                                        'test_nn.py:-k "TestNN and conv"']) == {
        "test_torch.py": "test_index or test_view", "test_nn.py": "TestNN and conv"}
    for bad in ("test_index", "test_torch.py:", "torch:test_index"):
        with pytest.raises(Exception, match="FILE.py:EXPRESSION"):
            pytorch_diff.parse_keywords([bad])


def test_help_prints_usage():
    done = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for option in ("--pytorch-tests", "--files", "-k FILE:EXPR", "--modes", "--timeout", "--jobs"):
        assert option in done.stdout


def test_a_missing_test_file_is_a_usage_error(tmp_path):
    done = subprocess.run([sys.executable, SCRIPT, "--pytorch-tests", str(tmp_path), "--files", "test_nn.py"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "not in" in done.stderr and "test_nn.py" in done.stderr


def test_end_to_end_on_a_file_whose_outcome_depends_on_the_mode(tmp_path):
    """No torch is imported, so NEURON_EAGER only shows in the environment: the run sees each mode's
    settings and a fresh cache, diffs, names the crash and the test that was running."""
    (tmp_path / "test_modes.py").write_text(textwrap.dedent("""
        import os
        import signal

        def test_same():
            pass

        def test_plain_only():
            assert os.environ.get("NEURON_EAGER") is None, "adaptive here"

        def test_settings():
            assert os.path.isdir(os.environ["NEURON_EAGER_CACHE_DIR"])
            assert "NEURON_EAGER_WINDOW" not in os.environ  # the caller's settings are dropped
            first_sight = os.environ.get("NEURON_EAGER") == "adaptive"
            assert os.environ.get("NEURON_EAGER_HOT_AFTER") == ("1" if first_sight else None)
            assert os.environ.get("NEURON_EAGER_ASYNC_COMPILE") == ("0" if first_sight else None)

        def test_skipped_by_k():
            assert False
    """))
    (tmp_path / "test_crash.py").write_text(textwrap.dedent("""
        import os
        import signal

        def test_a_first():
            pass

        def test_dies():
            if os.environ.get("NEURON_EAGER"):
                os.kill(os.getpid(), signal.SIGSEGV)
    """))
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, SCRIPT, "--pytorch-tests", str(tmp_path), "--files", "test_modes.py,test_crash.py",
         "-k", "test_modes.py:not skipped_by_k", "--modes", "plain,first_sight", "--timeout", "120",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "NEURON_EAGER_WINDOW": "7"})
    assert done.returncode == 1, done.stdout + done.stderr
    text = done.stdout
    assert "plain        3 passed, 0 failed, 0 skipped, 0 error" in text, text
    assert "first_sight  2 passed, 1 failed, 0 skipped, 0 error" in text, text
    assert "pass plain, fail first_sight: 1" in text
    assert "test_modes::test_plain_only  [failed] AssertionError: adaptive here" in text
    assert "CRASH: killed by SIGSEGV while running test_crash.py::test_dies (outcomes before it from the log)" in text
    assert "first_sight  1 passed, 0 failed, 0 skipped, 0 error" in text  # test_a_first, read from the log
    assert "run plain, no outcome first_sight: 1 (the run crashed)\n    test_crash::test_dies" in text
    assert sorted(os.listdir(out)) == sorted(f"test_{name}.{mode}.{ext}" for name in ("modes", "crash")
                                             for mode in ("plain", "first_sight") for ext in ("log", "xml")
                                             if not (name, mode, ext) == ("crash", "first_sight", "xml"))
