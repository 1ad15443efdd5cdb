"""Jupyter / IPython: ``%load_ext adaptive_eager`` (see Note [Cell boundaries] in ``_ipython``).

Two layers: ``examples/notebook.ipynb`` executed by nbclient in a real ipykernel (cell outputs
checked against the same code run eagerly here), and in-process ``InteractiveShell`` tests for the
magic, the per-cell flush, threads and the debugger.
"""

from __future__ import annotations

import ast
import concurrent.futures
import contextlib
import io
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import adaptive_eager as ae

pytest.importorskip("IPython")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from IPython.core.error import UsageError  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402
from IPython.utils.capture import capture_output  # noqa: E402
from traitlets.config import Config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "notebook.ipynb"
USAGE = "Usage: %adaptive_eager on|off|report"


# ---------------------------------------------------------------------------------------------
# The example notebook in a real kernel


def _tags(cell) -> list[str]:
    return cell.metadata.get("tags", [])


def _kernel_manager(tmp: Path):
    """A kernel manager whose "python3" is this interpreter, whatever kernelspecs the machine has.

    The spec lives in a private directory and the native-kernel fallback is off, so a user-wide
    "python3" spec pointing at another Python can never be picked up."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    spec_dir = tmp / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (adaptive_eager tests)",
        "language": "python",
        "env": {
            "PYTHONPATH": pythonpath,
            "IPYTHONDIR": str(tmp / "ipython"),  # no user profile or startup files
            "NEURON_EAGER": "eager",  # only %load_ext turns it on
            "NEURON_EAGER_CACHE_DIR": str(tmp / "cache"),
        },
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    ksm = KernelSpecManager(kernel_dirs=[str(tmp / "kernels")], ensure_native_kernel=False)
    return KernelManager(kernel_name="python3", kernel_spec_manager=ksm)


# Test-only cell appended to the example: the main shell's cells run in the thread that loaded the
# extension (the kernel's main thread), with the mode on there.
THREAD_CELL = "import sys, threading\n(threading.current_thread() is threading.main_thread(), ae.is_enabled(), sys.executable)"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The example notebook run by nbclient; returns (notebook, reply status per cell index)."""
    from nbclient import NotebookClient

    tmp = tmp_path_factory.mktemp("jupyter")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(THREAD_CELL, metadata={"tags": ["thread-check"]}))
    status = {}

    def on_cell_executed(cell, cell_index, execute_reply):
        status[cell_index] = execute_reply["content"]["status"]

    NotebookClient(
        nb, km=_kernel_manager(tmp), timeout=120, allow_errors=True, on_cell_executed=on_cell_executed,
        resources={"metadata": {"path": str(tmp)}},
    ).execute()
    return nb, status


def _outputs(cell):
    stdout = "".join(o["text"] for o in cell.outputs if o["output_type"] == "stream" and o["name"] == "stdout")
    results = [o["data"]["text/plain"] for o in cell.outputs if o["output_type"] == "execute_result"]
    errors = [o for o in cell.outputs if o["output_type"] == "error"]
    return stdout, results, errors


def _run_eagerly(nb) -> dict:
    """Each Python cell of ``nb`` run here with adaptive eager off: index -> (stdout, repr of the
    last expression or None, exception or None)."""
    ae.disable()
    ns: dict = {"__name__": "__main__"}
    out = {}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or cell.source.lstrip().startswith("%"):
            continue
        tree = ast.parse(cell.source)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        buf, shown, error = io.StringIO(), None, None
        with contextlib.redirect_stdout(buf):
            try:
                exec(compile(tree, f"<cell {i}>", "exec"), ns)
                if last is not None:
                    value = eval(compile(ast.Expression(last.value), f"<cell {i}>", "eval"), ns)
                    shown = None if value is None else repr(value)
            except Exception as e:  # noqa: BLE001 - compared with the kernel's error below
                error = e
        out[i] = (buf.getvalue(), shown, error)
    return out


_NUMBER = re.compile(r"-?\d+\.\d+(?:e[-+]?\d+)?")


def _assert_same_text(lazy: str, eager: str) -> None:
    """Same text; numbers agree to the digits printed (a compiled region may differ in the last
    float bit, which can flip the last printed digit)."""
    assert _NUMBER.sub("#", lazy) == _NUMBER.sub("#", eager), (lazy, eager)
    for a, b in zip(_NUMBER.findall(lazy), _NUMBER.findall(eager)):
        digits = len(b.split("e")[0].split(".")[1])
        assert abs(float(a) - float(b)) <= 1.5 * 10**-digits + 1e-5 * abs(float(b)), (lazy, eager)


@pytest.fixture(scope="module")
def eager(executed):
    return _run_eagerly(executed[0])


def test_notebook_values_are_eager_values(executed, eager):
    nb, status = executed
    checked = [i for i, c in enumerate(nb.cells) if "same-as-eager" in _tags(c)]
    assert len(checked) >= 3
    for i in checked:
        stdout, results, errors = _outputs(nb.cells[i])
        eager_stdout, eager_shown, eager_error = eager[i]
        assert eager_error is None and not errors and status[i] == "ok", (i, errors)
        assert stdout.strip() or results, f"cell {i} shows nothing to compare"
        _assert_same_text(stdout, eager_stdout)
        assert len(results) == (eager_shown is not None)
        if results:
            _assert_same_text(results[0], eager_shown)
    # the displayed tensor (last expression) was pending when the cell ended: its values show
    shown = [c for c in nb.cells if c.source.startswith("model[0].weight")]
    assert "tensor([[" in _outputs(shown[0])[1][0]


def test_notebook_deferred_error_is_raised_in_its_own_cell(executed, eager):
    nb, status = executed
    [i] = [i for i, c in enumerate(nb.cells) if "raises-exception" in _tags(c)]
    eager_error = eager[i][2]
    stdout, results, errors = _outputs(nb.cells[i])
    assert status[i] == "error" and len(errors) == 1 and not results
    err = errors[0]
    assert isinstance(eager_error, IndexError) and err["ename"] == type(eager_error).__name__
    assert "index out of range" in err["evalue"]
    # names the op and the cell line that recorded it (line 2), and says it ran at the cell's end
    assert "aten.index_select" in err["evalue"]
    assert re.search(r"recorded at \S+:2 ", err["evalue"]), err["evalue"]
    assert "flushed (cell)" in err["evalue"]
    # deferred: eager raises at the index_select line; here the cell-end flush raised it
    assert "_cell_end" in "\n".join(err["traceback"])
    # the next code cell runs on a clean window
    nxt = next(j for j in range(i + 1, len(nb.cells)) if nb.cells[j].cell_type == "code")
    assert status[nxt] == "ok" and not _outputs(nb.cells[nxt])[2]
    assert all(s == "ok" for j, s in status.items() if j != i), status


def test_notebook_report_and_threads(executed):
    nb, status = executed
    [report] = [c for c in nb.cells if "report" in _tags(c)]
    stdout = _outputs(report)[0]
    assert "flushes by reason" in stdout
    flushes = dict(re.findall(r"^\s+(\w+)\s+(\d+)$", stdout.split("flushes by reason")[1], re.M))
    # each of the 6 steps ends its window at the optimizer step, or, once the module is captured, at
    # its backward (Note [The interim backward] in adaptive_eager._capture), after which the optimizer
    # step finds nothing pending
    steps = int(flushes.get("optimizer_step", 0)) + int(flushes.get("module_capture", 0))
    assert int(flushes.get("cell", 0)) >= 2 and steps == 6, stdout
    [thread_cell] = [c for c in nb.cells if "thread-check" in _tags(c)]
    assert _outputs(thread_cell)[1] == [repr((True, True, sys.executable))]


# ---------------------------------------------------------------------------------------------
# In-process: IPython's InteractiveShell


def _cell(ip, source):
    """Run a cell as a notebook does (stored in history: IPython's ";" check reads the history)."""
    return ip.run_cell(source, store_history=True)


@pytest.fixture(scope="module")
def shell(tmp_path_factory):
    cfg = Config()
    cfg.HistoryManager.hist_file = ":memory:"
    ip = InteractiveShell.instance(config=cfg, ipython_dir=str(tmp_path_factory.mktemp("ipython")))
    yield ip
    InteractiveShell.clear_instance()


@pytest.fixture
def ip(shell):
    """The shell with the extension loaded (unloaded after the test)."""
    r = _cell(shell, "%load_ext adaptive_eager")
    assert r.success
    _cell(shell, "import torch\nimport adaptive_eager as ae")
    ae.reset_metrics()
    yield shell
    _cell(shell, "%unload_ext adaptive_eager")
    shell.ast_node_interactivity = "last_expr"


def test_load_turns_it_on_and_unload_off(shell):
    assert not ae.is_enabled()
    assert _cell(shell, "%load_ext adaptive_eager").success
    assert ae.is_enabled() and "adaptive_eager" in shell.magics_manager.magics["line"]
    assert _cell(shell, "%unload_ext adaptive_eager").success
    assert not ae.is_enabled() and "adaptive_eager" not in shell.magics_manager.magics["line"]
    # no transformer left behind: a cell's ops are eager now
    _cell(shell, "import torch\nv = torch.ones(2) * 2")
    assert ae.metrics()["ops_recorded"] == 0


def test_import_does_not_import_ipython():
    code = "import adaptive_eager, sys; print('IPython' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("arg", ["bogus", "on off", "ON"])
def test_magic_rejects_bad_arguments_with_usage(ip, arg):
    r = _cell(ip, f"%adaptive_eager {arg}")
    assert isinstance(r.error_in_exec, UsageError)
    assert USAGE in str(r.error_in_exec) and repr(arg) in str(r.error_in_exec)
    assert ae.is_enabled()  # a bad argument changes nothing


def test_magic_on_off_report(ip, capsys):
    assert _cell(ip, "%adaptive_eager off").success
    assert not ae.is_enabled()
    _cell(ip, "v = torch.ones(3) * 2")
    assert ae.metrics()["ops_recorded"] == 0
    capsys.readouterr()
    _cell(ip, "%adaptive_eager")
    assert "adaptive_eager is off" in capsys.readouterr().out
    assert _cell(ip, "%adaptive_eager on").success
    assert ae.is_enabled()
    _cell(ip, "v = torch.ones(3) * 2\nw = v + 1")
    assert ae.metrics()["ops_recorded"] >= 2
    capsys.readouterr()
    assert _cell(ip, "%adaptive_eager report").success
    out = capsys.readouterr().out
    assert "adaptive_eager report" in out
    assert re.search(r"^\s+cell\s+1$", out.split("flushes by reason")[1], re.M), out


def test_each_cell_ends_with_a_flush(ip):
    r = _cell(ip, "v = torch.arange(4.) * 3\nwas_lazy = ae.is_lazy(v)")
    assert r.success and ip.user_ns["was_lazy"] is True
    assert not ae.is_lazy(ip.user_ns["v"])
    assert ae.metrics()["flushes"] == {"cell": 1}
    assert ip.user_ns["v"].tolist() == [0.0, 3.0, 6.0, 9.0]
    # a cell ending in a compound statement is flushed too
    r = _cell(ip, "for i in range(2):\n    v = v + 1")
    assert r.success and not ae.is_lazy(ip.user_ns["v"])
    assert ae.metrics()["flushes"] == {"cell": 2}


def test_last_expression_is_still_displayed(ip):
    r = _cell(ip, "v = torch.arange(4.)\nv * 2")
    assert r.success
    assert isinstance(r.result, torch.Tensor) and r.result.tolist() == [0.0, 2.0, 4.0, 6.0]
    assert ip.user_ns["_"] is r.result and not ae.is_lazy(r.result)
    assert _cell(ip, "v * 2;").result is None  # a trailing ";" still hides it
    ip.ast_node_interactivity = "last_expr_or_assign"
    r = _cell(ip, "w = v + 1")
    assert r.result is not None and r.result.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_pending_tensor_displays_its_values(ip):
    eager = repr(torch.arange(6.).reshape(2, 3) * 2)
    with capture_output() as cap:
        r = _cell(ip, "v = torch.arange(6.).reshape(2, 3) * 2\nwas_lazy = ae.is_lazy(v)\ndisplay(v)\nv.sum()")
    assert r.success and ip.user_ns["was_lazy"] is True
    assert cap.outputs[0].data["text/plain"] == eager
    fmt, _ = ip.display_formatter.format(r.result)
    assert fmt["text/plain"] == "tensor(30.)"


def test_deferred_error_is_the_cells_error(ip):
    cell = "x = torch.arange(6.).reshape(3, 2)\npicked = torch.index_select(x, 0, torch.tensor([3]) + 0)\nok = x + 1"
    r = _cell(ip, cell)
    assert isinstance(r.error_in_exec, IndexError), r.error_in_exec
    msg = str(r.error_in_exec)
    assert "aten.index_select" in msg and re.search(r"recorded at <ipython-input-\d+-\w+>:2 ", msg), msg
    r = _cell(ip, "y = torch.index_select(x, 0, torch.tensor([2]))\ny")
    assert r.success and r.result.tolist() == [[4.0, 5.0]]


def test_cell_that_raises_still_flushes_its_ops(ip, caplog):
    cell = "v = torch.ones(2) * 2\nbad = torch.index_select(v, 0, torch.tensor([5]) + 0)\nraise ValueError('own')"
    with caplog.at_level(logging.WARNING, logger="adaptive_eager"):
        r = _cell(ip, cell)
    assert isinstance(r.error_in_exec, ValueError)  # the cell's own error wins
    assert "index out of range" in caplog.text  # the pending ops ran (and failed) at the cell's end
    assert not ae.is_lazy(ip.user_ns["v"]) and ip.user_ns["v"].tolist() == [2.0, 2.0]
    r = _cell(ip, "(v + 1).tolist()")
    assert r.success and r.result == [3.0, 3.0]


def test_cells_in_another_thread_follow_the_setting(ip):
    # ipykernel 7 runs a subshell's cells in a thread of its own (Note [Cell threads])
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as other:
        r = other.submit(_cell, ip, "t_on = ae.is_enabled()\nt_v = torch.ones(2) * 2\nt_lazy = ae.is_lazy(t_v)").result()
        assert r.success and ip.user_ns["t_on"] is True and ip.user_ns["t_lazy"] is True
        assert other.submit(ae.is_lazy, ip.user_ns["t_v"]).result() is False  # flushed at its end
        assert _cell(ip, "%adaptive_eager off").success and not ae.is_enabled()
        r = other.submit(_cell, ip, "t_on = ae.is_enabled()").result()
        assert r.success and ip.user_ns["t_on"] is False
        assert _cell(ip, "%adaptive_eager on").success and ae.is_enabled()
        r = other.submit(_cell, ip, "t_on = ae.is_enabled()").result()
        assert ip.user_ns["t_on"] is True
        other.submit(ae.disable).result()  # leave no thread with the mode on


def test_breakpoint_sees_real_values(monkeypatch, ip):
    seen = []
    _cell(ip, "%adaptive_eager off")  # the hook is wrapped when the mode turns on
    monkeypatch.setattr(sys, "breakpointhook", lambda *a, **k: seen.append(ae.is_lazy(ip.user_ns["v"])))
    _cell(ip, "%adaptive_eager on")
    r = _cell(ip, "v = torch.ones(2) * 2\nbreakpoint()\nw = v + 1")
    assert r.success and seen == [False]
    assert ae.metrics()["flushes"]["breakpoint"] == 1


def test_debug_post_mortem_after_a_deferred_error(ip, monkeypatch, capsys):
    r = _cell(ip, "y = torch.arange(4.) * 5\nbad = torch.index_select(y, 0, torch.tensor([9]) + 0)")
    assert isinstance(r.error_in_exec, IndexError)
    # the debugger starts at the innermost frame; walk up to the cell's frame
    frames, tb = [], sys.last_traceback
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    ups = len(frames) - 1 - max(i for i, f in enumerate(frames) if f.startswith("<ipython-input"))
    commands = "up\n" * ups + "p ('value', y.tolist(), ae.is_lazy(y))\nq\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(commands))
    capsys.readouterr()
    _cell(ip, "%debug")
    out = capsys.readouterr().out
    assert "('value', [0.0, 5.0, 10.0, 15.0], False)" in out, out
