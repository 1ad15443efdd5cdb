"""PyTorch's own test files as a differential check of adaptive eager.

Runs each named test file of the pytorch/pytorch repository with pytest, once per mode, each run in
its own process with a fresh, private cache directory, and compares the per-test outcomes read from
pytest's junit XML:

- ``plain``: eager PyTorch (``NEURON_EAGER`` unset), the oracle;
- ``adaptive``: ``NEURON_EAGER=adaptive``, which turns the library on at ``import torch``;
- ``first_sight``: as adaptive, with every region compiled the first time it is seen
  (``NEURON_EAGER_HOT_AFTER=1``, ``NEURON_EAGER_ASYNC_COMPILE=0``).

It prints, per file, each mode's summary, the tests that pass plainly and fail or error under a
mode (with the first line of the failure), and any crash: a run killed by a signal, one past
``--timeout``, or one that exited non-zero without writing its junit file (the test that was running
is named when pytest had printed it). Exit status: 0 when no difference and no crash, 1 otherwise,
2 for a bad command line.

The test files are not part of this repository: take them from the pytorch/pytorch repository at
the tag of the installed torch (``python -c "import torch; print(torch.__version__)"``), e.g.
``git clone --depth 1 --branch v2.13.0 https://github.com/pytorch/pytorch`` and point
``--pytorch-tests`` at its ``test/`` directory (the files import helpers that live next to them).

    PYTHONPATH=$PWD python tests/pytorch_diff.py --pytorch-tests ~/pytorch/test \\
        --files test_view_ops.py,test_indexing.py \\
        -k 'test_torch.py:test_index or test_view' --timeout 900

This file is a script, not a test module: pytest does not collect it (its name does not start with
``test_``); tests/test_pytorch_diff_script.py tests it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_FILES = ("test_view_ops.py", "test_indexing.py", "test_type_promotion.py",
                 "test_autograd.py", "test_nn.py", "test_torch.py")

# Each mode's settings; every other NEURON_EAGER* variable of the caller's environment is dropped so
# that a run measures the library's defaults, not whatever the developer's shell has set.
MODES = {
    "plain": {},
    "adaptive": {"NEURON_EAGER": "adaptive"},
    "first_sight": {"NEURON_EAGER": "adaptive", "NEURON_EAGER_HOT_AFTER": "1",
                    "NEURON_EAGER_ASYNC_COMPILE": "0"},
}
ORACLE = "plain"
BAD = ("failed", "error")
# worst first: a test reported twice (a failing call, then an erroring teardown) keeps the worst
RANK = {"error": 0, "failed": 1, "skipped": 2, "passed": 3}


@dataclasses.dataclass
class Outcome:
    status: str  # passed | failed | error | skipped
    message: str = ""  # the first line of the failure, error or skip reason


@dataclasses.dataclass
class Run:
    file: str
    mode: str
    returncode: int | None  # None: killed at --timeout
    junit: str  # the junit XML file's path (absent after a crash)
    log: str  # pytest's output
    seconds: float
    outcomes: dict[str, Outcome] = dataclasses.field(default_factory=dict)

    @property
    def crash(self) -> str:
        """Why this run's outcomes are incomplete, or '' when pytest finished."""
        if self.returncode is None:
            return "timed out"
        if self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            return f"killed by {name}"
        if self.returncode > 128 and self.returncode - 128 in signal.Signals._value2member_map_:
            return f"killed by {signal.Signals(self.returncode - 128).name} (exit {self.returncode})"
        if self.returncode != 0 and not os.path.exists(self.junit):
            return f"exit {self.returncode} and no junit file"
        if self.returncode not in (0, 1, 5):  # 2 interrupted, 3 internal error, 4 usage error
            return f"exit {self.returncode} (pytest did not finish)"
        return ""


def first_line(text: str | None, limit: int = 200) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            line = line.strip()
            return line if len(line) <= limit else line[:limit - 3] + "..."
    return ""


def parse_junit(xml_text: str) -> dict[str, Outcome]:
    """Per-test outcomes of a junit XML document, keyed ``classname::name``."""
    root = ET.fromstring(xml_text)
    outcomes: dict[str, Outcome] = {}
    for case in root.iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = Outcome("passed")
        for child in case:
            status = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(child.tag)
            if status is None:
                continue
            message = first_line(child.get("message")) or first_line(child.text)
            if RANK[status] < RANK[outcome.status]:
                outcome = Outcome(status, message)
        seen = outcomes.get(test_id)
        if seen is None or RANK[outcome.status] < RANK[seen.status]:
            outcomes[test_id] = outcome
    return outcomes


def summary(outcomes: dict[str, Outcome]) -> str:
    counts = {status: 0 for status in ("passed", "failed", "skipped", "error")}
    for outcome in outcomes.values():
        counts[outcome.status] += 1
    return ", ".join(f"{n} {status}" for status, n in counts.items())


def differences(oracle: dict[str, Outcome], other: dict[str, Outcome]) -> list[tuple[str, Outcome]]:
    """Tests that pass in ``oracle`` and fail or error in ``other``, in ``oracle``'s order."""
    return [(test_id, other[test_id]) for test_id, outcome in oracle.items()
            if outcome.status == "passed" and test_id in other and other[test_id].status in BAD]


def only_in_other(oracle: dict[str, Outcome], other: dict[str, Outcome]) -> list[str]:
    """Tests that pass in ``other`` and fail or error in ``oracle``: the library changed an outcome
    for the better, which is a difference too (a check that no longer fires)."""
    return [test_id for test_id, outcome in other.items()
            if outcome.status == "passed" and test_id in oracle and oracle[test_id].status in BAD]


def missing(oracle: dict[str, Outcome], other: dict[str, Outcome]) -> list[str]:
    """Tests ``oracle`` ran that ``other`` has no outcome for (its run crashed or timed out first)."""
    return [test_id for test_id in oracle if test_id not in other]


VERBOSE_STATUS = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped",
                  "XFAIL": "skipped", "XPASS": "passed"}


def junit_id(node_id: str) -> str:
    """``dir/test_x.py::Class::test_y`` as junit names it: ``dir.test_x.Class::test_y``."""
    parts = node_id.split("::")
    module = parts[0][:-3] if parts[0].endswith(".py") else parts[0]
    return ".".join([module.replace("/", ".")] + parts[1:-1]) + "::" + parts[-1]


def parse_verbose_log(log_text: str) -> dict[str, Outcome]:
    """Per-test outcomes from pytest ``-v`` output, for a run that died before writing its junit
    file: what finished before the crash or the timeout still counts."""
    outcomes: dict[str, Outcome] = {}
    for line in log_text.splitlines():
        words = line.split()
        if len(words) >= 2 and "::" in words[0] and words[1] in VERBOSE_STATUS:
            outcomes[junit_id(words[0])] = Outcome(VERBOSE_STATUS[words[1]], "(from the log: no junit file)")
    return outcomes


def last_started_test(log_text: str) -> str:
    """The node id pytest ``-v`` printed last: the test running when the process died."""
    for line in reversed(log_text.splitlines()):
        word = line.split(" ", 1)[0]
        if "::" in word:
            return word
    return ""


def mode_environment(mode: str, cache_dir: str, library: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_EAGER")}
    env.update(MODES[mode])
    env["NEURON_EAGER_CACHE_DIR"] = cache_dir
    if library:  # this checkout's library is the one turned on at ``import torch``
        env["PYTHONPATH"] = os.pathsep.join(p for p in (library, env.get("PYTHONPATH")) if p)
    return env


def pytest_command(path: str, junit: str, keyword: str | None, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", path, "-v", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    if keyword:
        cmd += ["-k", keyword]
    return cmd + extra


def run_one(file: str, mode: str, args: argparse.Namespace, out_dir: str) -> Run:
    stem = f"{os.path.splitext(file)[0]}.{mode}"
    junit = os.path.join(out_dir, f"{stem}.xml")
    log = os.path.join(out_dir, f"{stem}.log")
    with tempfile.TemporaryDirectory(prefix=f"pytorch_diff_{mode}_") as cache_dir:
        env = mode_environment(mode, cache_dir, args.library)
        cmd = pytest_command(os.path.join(args.pytorch_tests, file), junit, args.keyword.get(file),
                             shlex.split(args.pytest_args))
        start = time.monotonic()
        with open(log, "w") as log_file:
            # its own session, so that a timeout kills the run's children (compile workers) too
            proc = subprocess.Popen(cmd, cwd=args.pytorch_tests, env=env, stdout=log_file,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
            try:
                returncode = proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                returncode = None
        run = Run(file, mode, returncode, junit, log, time.monotonic() - start)
    if os.path.exists(junit):
        try:
            with open(junit) as f:
                run.outcomes = parse_junit(f.read())
        except ET.ParseError:
            pass  # a half-written file: the crash line says why
    if not run.outcomes and run.crash:
        with open(log, errors="replace") as f:
            run.outcomes = parse_verbose_log(f.read())
    return run


def report(file: str, runs: dict[str, Run], keyword: str | None) -> tuple[str, int]:
    """The text block of one file and its count of problems (differences, crashes, missing tests)."""
    lines = [f"== {file}" + (f"  (-k {keyword!r})" if keyword else "")]
    problems = 0
    for mode, run in runs.items():
        lines.append(f"  {mode:<12} {summary(run.outcomes)}  [{run.seconds:.0f} s]")
        if run.crash:
            problems += 1
            with open(run.log, errors="replace") as f:
                running = last_started_test(f.read())
            lines.append(f"  {'':<12} CRASH: {run.crash}" + (f" while running {running}" if running else "")
                         + (" (outcomes before it from the log)" if not os.path.exists(run.junit) else "")
                         + f"; log: {run.log}")
    oracle = runs.get(ORACLE)
    if oracle is None:
        return "\n".join(lines), problems
    for mode, run in runs.items():
        if mode == ORACLE:
            continue
        diff = differences(oracle.outcomes, run.outcomes)
        lines.append(f"  pass {ORACLE}, fail {mode}: {len(diff)}")
        for test_id, outcome in diff:
            lines.append(f"    {test_id}  [{outcome.status}] {outcome.message}")
        better = only_in_other(oracle.outcomes, run.outcomes)
        if better:
            lines.append(f"  fail {ORACLE}, pass {mode}: {len(better)}")
            lines.extend(f"    {test_id}" for test_id in better)
        gone = missing(oracle.outcomes, run.outcomes)
        if gone:
            lines.append(f"  run {ORACLE}, no outcome {mode}: {len(gone)}"
                         + (" (the run crashed)" if run.crash else ""))
            lines.extend(f"    {test_id}" for test_id in gone[:20])
            if len(gone) > 20:
                lines.append(f"    ... and {len(gone) - 20} more")
        problems += len(diff) + len(better) + len(gone)
    return "\n".join(lines), problems


def parse_keywords(items: list[str]) -> dict[str, str]:
    keywords = {}
    for item in items:
        file, sep, expr = item.partition(":")
        expr = expr.strip()
        if expr.startswith("-k "):  # 'test_torch.py:-k "test_index or test_view"' reads the same
            expr = expr[3:].strip().strip("'\"")
        if not sep or not file.endswith(".py") or not expr.strip():
            raise argparse.ArgumentTypeError(
                f"-k {item!r}: expected FILE.py:EXPRESSION, e.g. 'test_torch.py:test_index or test_view'")
        keywords[file] = expr
    return keywords


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pytorch_diff.py",
        description="Run PyTorch's own test files plainly and under adaptive eager, each in its own "
                    "process with a fresh cache, and list the tests that pass plainly and fail under "
                    "adaptive eager (plus crashes).",
        epilog="Example: PYTHONPATH=$PWD python tests/pytorch_diff.py --pytorch-tests ~/pytorch/test "
               "--files test_view_ops.py,test_torch.py -k 'test_torch.py:test_index or test_view'. "
               "Exit 0: no difference and no crash; 1: some; 2: bad command line.")
    parser.add_argument("--pytorch-tests", metavar="DIR", required=True,
                        help="the test/ directory of a pytorch/pytorch checkout at the installed torch's tag")
    parser.add_argument("--files", default=",".join(DEFAULT_FILES),
                        help="comma-separated test files in DIR (default: %(default)s)")
    parser.add_argument("-k", dest="keywords", action="append", default=[], metavar="FILE:EXPR",
                        help="a pytest -k expression for one file, e.g. 'test_nn.py:TestNN and test_Conv2d'; "
                             "repeat for other files")
    parser.add_argument("--modes", default="plain,adaptive,first_sight",
                        help=f"comma-separated, from {', '.join(MODES)}; {ORACLE} is the oracle (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=1800.0, metavar="S",
                        help="seconds one pytest run may take before it is killed and reported (default: %(default)s)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (default: %(default)s)")
    parser.add_argument("--out", metavar="DIR",
                        help="keep junit files and logs here (default: a temporary directory, kept and printed)")
    parser.add_argument("--library", default=REPO, metavar="DIR",
                        help="put DIR first on PYTHONPATH, so that its adaptive_eager is the one tested "
                             "(default: this checkout, %(default)s; '' for the installed one)")
    parser.add_argument("--pytest-args", default="", metavar="ARGS",
                        help="more arguments for every pytest run, e.g. '--tb=short -x'")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.keyword = parse_keywords(args.keywords)
    except argparse.ArgumentTypeError as e:
        parser.error(str(e))
    files = [f.strip() for f in args.files.split(",") if f.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}")
    args.pytorch_tests = os.path.abspath(os.path.expanduser(args.pytorch_tests))
    absent = [f for f in files if not os.path.isfile(os.path.join(args.pytorch_tests, f))]
    if absent:
        parser.error(f"not in {args.pytorch_tests}: {', '.join(absent)} (take them from pytorch/pytorch's "
                     f"test/ directory at the installed torch's tag)")
    stray = sorted(set(args.keyword) - set(files))
    if stray:
        parser.error(f"-k names files not in --files: {', '.join(stray)}")
    if args.jobs < 1:
        parser.error("--jobs: at least 1")
    out_dir = args.out or tempfile.mkdtemp(prefix="pytorch_diff_")
    os.makedirs(out_dir, exist_ok=True)
    print(f"junit files and logs: {out_dir}", flush=True)

    jobs = [(file, mode) for file in files for mode in modes]
    runs: dict[str, dict[str, Run]] = {file: {} for file in files}
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(run_one, file, mode, args, out_dir): (file, mode) for file, mode in jobs}
        for future in concurrent.futures.as_completed(futures):
            run = future.result()
            runs[run.file][run.mode] = run
            print(f"  done {run.file} {run.mode}: {summary(run.outcomes)} [{run.seconds:.0f} s]"
                  + (f" CRASH: {run.crash}" if run.crash else ""), flush=True)

    problems = 0
    for file in files:
        ordered = {mode: runs[file][mode] for mode in modes}
        text, count = report(file, ordered, args.keyword.get(file))
        print(text)
        problems += count
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
