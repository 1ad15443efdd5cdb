"""Explainable behaviour: logging (NEURON_EAGER_LOG), explain(), torch.profiler ranges and flush seconds."""

import logging
import os
import subprocess
import sys
import textwrap
import time
from collections import Counter

import pytest
import torch

import adaptive_eager as ae


def _line_of(marker: str) -> int:
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if marker in line and "_line_of" not in line:
                return i
    raise AssertionError(marker)


def _loop_with_reads(steps=4, **options):
    x = torch.randn(16, 8)
    w = torch.randn(8, 8)
    with ae.adaptive_eager(**options):
        for _ in range(steps):
            y = (x @ w).tanh().sum()
            y.item()  # MARK-item
            x[x > 0]  # MARK-mask
    return y


def test_flush_log_names_reason_ops_region_outcome_and_user_line(caplog):
    with caplog.at_level(logging.INFO, logger="adaptive_eager"):
        _loop_with_reads(steps=3, log="info", backend="replay")
    flushes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("flush (")]
    item = [m for m in flushes if m.startswith("flush (item)")]
    assert len(item) == 3, flushes
    assert f"{__file__}:{_line_of('MARK-item')}" in item[0]
    assert "3 ops" in item[0] and "replayed" in item[0]
    fallbacks = [r.getMessage() for r in caplog.records if r.getMessage().startswith("eager op")]
    assert any("aten.index.Tensor" in m and "dynamic_shape" in m and f":{_line_of('MARK-mask')}" in m
               for m in fallbacks), fallbacks


def test_compile_and_hit_are_logged(caplog):
    with caplog.at_level(logging.INFO, logger="adaptive_eager"):
        _loop_with_reads(steps=4, log="info", async_compile=False, hot_after=2)
    messages = [r.getMessage() for r in caplog.records]
    compiled = [m for m in messages if "compiled region" in m]
    assert compiled and any(" in " in m and "s (key" in m for m in compiled), messages
    item = [m for m in messages if m.startswith("flush (item)")]
    assert "replayed" in item[0] and any("compiled" in m for m in item[2:]), item


def test_default_level_logs_nothing(caplog):
    with caplog.at_level(logging.DEBUG):
        logging.getLogger("adaptive_eager").setLevel(logging.NOTSET)
        with ae.adaptive_eager(backend="replay"):
            pass
        logging.getLogger("adaptive_eager").setLevel(logging.WARNING)
        _loop_with_reads(steps=2, backend="replay")
    assert not [r for r in caplog.records if r.name.startswith("adaptive_eager")]


def test_env_var_sends_log_to_stderr_without_logging_setup(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent("""
        import torch
        x = torch.ones(4)
        y = (x * 2).sum()
        print(y.item())
    """))
    env = dict(os.environ, NEURON_EAGER="adaptive", NEURON_EAGER_LOG="info", NEURON_EAGER_BACKEND="replay",
               NEURON_EAGER_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "8.0"
    assert "flush (item): " in out.stderr and " ops, region " in out.stderr, out.stderr
    assert f"{script}:5" in out.stderr, out.stderr


def test_env_var_log_level_reaches_the_cache_and_the_backends(tmp_path):
    """NEURON_EAGER_LOG sets one level for all the library's loggers: the fuser's backends and the
    persistent cache log under their own package names."""
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent("""
        import logging
        import torch
        (torch.ones(4) * 2).sum().item()
        for name in ("fuser.backends.inductor", "neff_cache.store", "adaptive_eager.fuser"):
            logging.getLogger(name).info("probe from %s", name)
    """))
    env = dict(os.environ, NEURON_EAGER="adaptive", NEURON_EAGER_LOG="info", NEURON_EAGER_BACKEND="replay",
               NEURON_EAGER_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    for name in ("fuser.backends.inductor", "neff_cache.store", "adaptive_eager.fuser"):
        assert f"[{name}] INFO: probe from {name}" in out.stderr, out.stderr


def test_explain_ranks_sites_with_lines_and_advice():
    _loop_with_reads(steps=5, backend="replay")
    text = ae.explain()
    assert f"{__file__}:{_line_of('MARK-item')}" in text
    assert f"{__file__}:{_line_of('MARK-mask')}" in text
    assert ".item() once" in text  # the advice for host reads
    assert "aten.index.Tensor (dynamic_shape)" in text
    # expected flushes (leaving the block) are listed after the ones to act on
    lines = text.splitlines()
    sites = lines[lines.index("top flush sites (reason, count, where, what to change)") + 1:]
    reasons = [l.split()[0] for l in sites if l.startswith("  ") and not l.startswith("      ")]
    assert reasons[0] in ("item", "dynamic_shape") and "exit" not in reasons[:2], text
    assert "adaptive_eager explain" in ae.report(explain=True)
    assert "adaptive_eager explain" not in ae.report()


@pytest.mark.usefixtures("small_windows_off")
def test_explain_flags_compiles_too_frequent():
    x = torch.randn(8)
    with ae.adaptive_eager(hot_after=1, async_compile=False):
        for n in range(2, 26):  # a new structure every step: every window compiles
            y = (torch.roll(x, n) * 2 + 1).sum()  # MARK-varying (a new shift: a new structure)
            y.item()
    text = ae.explain()
    assert "compile too frequent" in text, text


def test_explain_with_nothing_recorded():
    assert "(none)" in ae.explain()


def test_profiler_shows_record_flush_compile_and_region_ranges():
    x = torch.randn(64, 64)
    with ae.adaptive_eager(hot_after=1, async_compile=False):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(2):
                y = (x * 3 + 1).relu().sum()
                y.item()
    names = {e.name for e in prof.events()}
    assert "adaptive_eager.record" in names
    assert "adaptive_eager.flush" in names
    assert "adaptive_eager.compile" in names
    assert any(n.startswith("adaptive_eager.region[") for n in names), sorted(n for n in names if "adaptive" in n)


def test_no_profiler_ranges_when_profiler_is_off():
    assert torch.autograd.profiler._is_profiler_enabled is False
    x = torch.randn(8)
    with ae.adaptive_eager(backend="replay"):
        (x * 2).sum().item()
    st = ae._state.current_state()
    assert st is None or st.mode is None or not st.mode.profiling


def test_flush_seconds_is_the_host_time_of_every_flush():
    """``metrics()["flush_seconds"]``: recording costs none of it; every sync point (``sync()``, a
    read, leaving the mode) adds the time its flush ran, which on cpu holds the window's compute;
    ``reset_metrics()`` zeroes it. Benchmarks read it instead of timing the tracer from outside."""
    a = torch.randn(384, 384)
    with ae.adaptive_eager(backend="replay"):
        y = a
        for _ in range(20):
            y = (y @ a).tanh()
        assert ae.metrics()["flush_seconds"] == 0.0  # recorded, nothing run yet
        t0 = time.perf_counter()
        ae.sync()
        wall = time.perf_counter() - t0
        first = ae.metrics()["flush_seconds"]
        assert 0.5 * wall <= first <= wall  # the 20 matmuls ran inside the flush, and only the flush is counted
        (y * 2).sum().item()  # a read flushes
        second = ae.metrics()["flush_seconds"]
        assert second > first
        z = y + 1
    assert ae.metrics()["flush_seconds"] > second  # leaving the mode flushes
    want = a
    for _ in range(20):
        want = (want @ a).tanh()
    torch.testing.assert_close(z, want + 1)
    ae.reset_metrics()
    assert ae.metrics()["flush_seconds"] == 0.0


@pytest.mark.parametrize("value", ["loud", "INFO "])
def test_bad_log_level_is_a_clear_error_or_normalized(value, monkeypatch):
    monkeypatch.setenv("NEURON_EAGER_LOG", value)
    if value.strip().lower() == "info":
        assert ae.load_options().log == "info"
    else:
        with pytest.raises(ae.ConfigError, match="NEURON_EAGER_LOG"):
            ae.load_options()


def test_explain_flags_short_windows_and_not_a_one_off_read():
    x = torch.randn(8)
    with ae.adaptive_eager(hot_after=1000):  # never hot: every window replays
        for _ in range(30):
            (x * 2).sum().item()  # two ops per window
    text = ae.explain()
    assert "short windows" in text and "mostly replayed" in text, text
    ae.reset_metrics()
    w = torch.randn(8, 8)
    with ae.adaptive_eager(backend="replay"):
        (w @ w).sum().item()  # once, before the loop
        for _ in range(250):
            y = w
            for _ in range(5):
                y = (y @ w).tanh()  # ten ops per window
            ae.sync()
    text = ae.explain()
    assert "short windows" not in text
    sites = text.split("top flush sites")[1].splitlines()[1]
    assert sites.split()[0] == "sync", text  # the one-off item is not ranked first


def test_explain_names_compiler_failures_worked_around_and_blacklisted_regions():
    from adaptive_eager._explain import explain

    metrics = {"windows": 3, "compiles": 1, "compiled_runs": 2, "run_alone": {"compile_failed": 2}, "blacklisted": 1}
    text = explain(metrics, Counter(), Counter())
    assert "compiler failures worked around: 2 ops" in text and "blacklisted: 1 regions" in text
    assert "compiler failures" not in explain({"windows": 3}, Counter(), Counter())


@pytest.mark.parametrize("read", ["data_ptr", "storage", "pickle"])
def test_explain_advises_on_memory_reads(read):
    """A pending value's memory read outside the dispatcher ends the window: explain() names the
    line and says what to change, as for every other reason."""
    import pickle

    x = torch.randn(8)
    with ae.adaptive_eager(backend="replay"):
        y = x * 2
        if read == "data_ptr":
            y.data_ptr()  # MARK-data_ptr
        elif read == "storage":
            y.untyped_storage()  # MARK-storage
        else:
            pickle.dumps(y)  # MARK-pickle
    assert ae.metrics()["flushes"][read] == 1
    lines = ae.explain().splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:1] == [read])
    assert f"{__file__}:{_line_of('MARK-' + read)}" in lines[at]
    assert lines[at + 1].strip().startswith("-> "), lines


def _emitted_reasons() -> set:
    """Every flush or eager-op reason the library's code can give: the string arguments of its
    flush calls and eager runs, the reasons op facts are given, and the readers' tables."""
    import ast
    import pathlib

    import adaptive_eager
    from adaptive_eager import _ops, _patches

    calls = {"flush", "_run", "_flush_current", "_eager", "sync_value"}
    found = set(_patches._TENSOR_READERS.values()) | set(_ops._SYNC_REASONS.values())
    found |= {reason for _, _, reason, _ in _patches._opaque_entry_points()}
    for path in pathlib.Path(adaptive_eager.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            parts = []
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in calls:
                parts = node.args[1:]
            elif isinstance(node, ast.Assign):
                for target in node.targets:  # f.reason = "..." and f.kind, f.reason = ..., "..."
                    targets = target.elts if isinstance(target, ast.Tuple) else [target]
                    values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
                    parts += [v for t, v in zip(targets, values) if getattr(t, "attr", None) == "reason"]
            for part in parts:
                found |= {c.value for c in ast.walk(part) if isinstance(c, ast.Constant) and type(c.value) is str}
    return found - {""}


def test_every_reason_the_code_gives_is_in_the_table():
    from adaptive_eager.reasons import REASONS

    emitted = _emitted_reasons()
    assert {"item", "data_ptr", "storage", "pickle", "default_dtype", "window_cap", "other_thread"} <= emitted
    missing = emitted - set(REASONS)
    assert not missing, f"reasons without an entry (and advice) in adaptive_eager/reasons.py: {sorted(missing)}"
    # every actionable reason has advice explain() prints; only expected ends of a window have none
    assert {r.name for r in REASONS.values() if r.advice is None} == {
        "breakpoint", "collective", "period", "optimizer_step", "module_capture", "torch_compile", "exit", "sync", "options", "cell",
        "fork"}


LIBRARY = textwrap.dedent('''
    import torch

    def normalize(x):
        if x.abs().max() > 1:  # a branch on a value: the window ends inside this package
            x = x / x.abs().max()
        return x * 2
''')


@pytest.fixture
def installed_library(tmp_path, monkeypatch):
    """A package as pip installs one (under a ``site-packages`` directory), which a user's loop calls."""
    root = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    (root / "somelib").mkdir(parents=True)
    (root / "somelib" / "__init__.py").write_text(LIBRARY)
    monkeypatch.syspath_prepend(str(root))
    import somelib

    yield somelib
    sys.modules.pop("somelib", None)


def test_explain_names_the_users_line_and_the_library_that_flushed(installed_library):
    """Note [Whose line]: a flush inside an installed package is attributed to the user's line that
    called it, names the package's line, and never advises editing that package's code."""
    x = torch.randn(16) * 3
    with ae.adaptive_eager(backend="replay"):
        for _ in range(4):
            y = installed_library.normalize(x + 1)  # MARK-library
    torch.testing.assert_close(y, (x + 1) / (x + 1).abs().max() * 2)
    text = ae.explain()
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:1] == ["bool"])
    assert f"{__file__}:{_line_of('MARK-library')}" in lines[at], text
    assert "inside somelib.normalize (" in lines[at + 1] and "somelib" + os.sep + "__init__.py:5" in lines[at + 1], text
    assert "somelib's code, not yours" in lines[at + 2], text
    assert "torch.where" not in text, text  # the user's-own-code advice is not given for a library's line


def test_explain_attributes_the_optimizers_own_read_to_the_optimizer():
    """AdamW reads its step counter (``.item()``) inside torch.optim: explain() names the user's
    ``opt.step()`` line and says torch.optim did it, instead of telling the user to stop calling
    ``.item()`` there."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(8, 4)
    with ae.adaptive_eager(backend="replay"):
        for _ in range(2):
            model(x).square().mean().backward()
            opt.step()  # MARK-step
            opt.zero_grad()
    lines = ae.explain().splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:1] == ["item"])
    assert f"{__file__}:{_line_of('MARK-step')}" in lines[at], lines
    assert lines[at + 1].strip().startswith("inside torch.optim."), lines
    assert "torch.optim reads a tensor's value on the host" in lines[at + 2], lines
    assert ".item() once" not in "\n".join(lines), lines


def test_no_recompile_is_counted_when_nothing_compiled():
    """A float that changes every step is lifted, but nothing compiled before it was: no region was
    compiled again, so no recompile is counted (nor printed)."""
    x = torch.randn(8)
    with ae.adaptive_eager(hot_after=1000):  # never hot: nothing compiles
        for step in range(6):
            (x * (0.1 * (step + 1))).sum().item()
    assert ae.metrics()["compiles"] == 0
    assert ae.metrics()["recompiles"] == {}
    text = ae.explain()
    assert "scalar_lifted" not in text and "learning-rate" not in text, text


def _fuser_counter_keys() -> tuple[set, set]:
    """The recompile causes and the not-compiled reasons fuser/ can count: the string constants
    given to ``_recompile`` / ``STATS.not_compiled[...]``, and those returned by the functions
    whose result is counted (``_static_cause``, ``lift_cause``, ``_not_compilable``)."""
    import ast
    import pathlib

    import fuser

    recompiles, not_compiled = set(), set()
    returning = {"_static_cause": recompiles, "lift_cause": recompiles, "_not_compilable": not_compiled}

    def strings(node):
        return {c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and type(c.value) is str}

    for path in pathlib.Path(fuser.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name in returning:
                for r in ast.walk(node):
                    if isinstance(r, ast.Return) and r.value is not None:
                        returning[node.name].update(strings(r.value))
            elif isinstance(node, ast.Subscript) and getattr(node.value, "attr", None) == "not_compiled":
                not_compiled.update(strings(node.slice))
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_recompile":
                recompiles.update(strings(node.args[0]))
            # why a window replayed (``replay_reasons``): explain() prints them with the not-compiled ones
            elif isinstance(node, ast.Subscript) and getattr(node.value, "attr", None) == "replay_reasons":
                not_compiled.update(strings(node.slice))
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_replay":
                not_compiled.update(c.value for c in node.args[1:2] if isinstance(c, ast.Constant))
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_blacklist" and len(node.args) > 2:
                not_compiled.update(strings(node.args[2]))
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_Plan" and len(node.args) > 1 \
                    and getattr(node.args[0], "value", None) == "replay":
                not_compiled.update(c.value for c in node.args[1:2] if isinstance(c, ast.Constant))
            elif isinstance(node, ast.Assign) and [getattr(t, "attr", None) for t in node.targets] == ["blacklisted"]:
                not_compiled.update(strings(node.value))  # entry.blacklisted = "...": its windows replay for it
            elif isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["cause"]:
                recompiles.update(strings(node.value))  # cause = "dynamic" if ... else ...
    return recompiles, not_compiled


def test_every_reason_and_counter_key_explain_prints_has_text():
    """Every flush reason (at the user's line and inside a library), every recompile cause and
    every not-compiled reason that explain() can print is followed by its explanation."""
    from adaptive_eager._explain import explain
    from adaptive_eager.reasons import NOT_COMPILED, REASONS, RECOMPILES, REPLAYED

    recompiles, not_compiled = _fuser_counter_keys()
    assert {"cold", "compiling", "fork", "run_failed", "compile_failed"} <= not_compiled
    assert {"new_shape", "scalar_lifted", "dynamic"} <= recompiles and {"aliased_inputs", "failed_before"} <= not_compiled
    assert recompiles <= set(RECOMPILES), sorted(recompiles - set(RECOMPILES))
    assert not_compiled <= set(NOT_COMPILED) | set(REPLAYED), sorted(not_compiled - set(NOT_COMPILED) - set(REPLAYED))
    assert all(r.does for r in REASONS.values()), [r.name for r in REASONS.values() if not r.does]

    def user_code():
        return sys._getframe().f_code, 1

    def library_code():
        return torch.optim.Optimizer.zero_grad.__code__, 2

    site, inside = user_code(), library_code()
    # a site of the user's own and one inside a library, on two lines (one line's are one entry)
    flush_sites = Counter({(name, (site[0], line), where): 1 for name in REASONS
                           for line, where in ((1, None), (2, inside))})
    metrics = {"windows": 1, "recompiles": dict.fromkeys(recompiles, 1), "replay_reasons": dict.fromkeys(not_compiled, 1)}
    text = explain(metrics, flush_sites, Counter(), top=len(flush_sites))
    lines = text.splitlines()
    printed = [(i, line.split()[0]) for i, line in enumerate(lines)
               if line.startswith("  ") and not line.startswith("   ") and line.split()[0] in
               set(REASONS) | recompiles | not_compiled]
    assert len(printed) == len(flush_sites) + len(recompiles) + len(not_compiled), text
    for i, key in printed:
        follow = lines[i + 1].strip()
        if follow.startswith("inside "):
            follow = lines[i + 2].strip()
        assert follow.startswith("-> ") and len(follow) > 20 and "no explanation" not in follow, (key, text)


def test_a_captured_loop_is_explained_as_captured_with_each_line_once():
    """A captured model's backward is the capture's, not the program's torch.compile; one line's
    flushes of one reason are one entry (an optimizer's cold steps and its captured ones); the
    replayed windows are explained by why."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    ae.reset_metrics()
    with ae.adaptive_eager():
        for _ in range(8):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()  # noqa: E702 - one line, several flushes
    m = ae.metrics()
    assert m["module_captured_calls"] > 0 and m["compiled_calls"] == 0, m
    assert "torch_compile" not in m["flushes"], m["flushes"]
    text = ae.explain()
    entries = [tuple(line.split()[0::2]) for line in text.splitlines()
               if line.startswith("  ") and not line.startswith("   ") and "test_explain.py" in line]
    assert entries and len(entries) == len(set(entries)), text
    assert "module calls and" in text and "windows replayed, by why" in text, text


def test_a_read_every_n_steps_gets_no_advice_to_read_every_n_steps():
    """A host read that ends few of the windows (a loss printed every 10 steps) is named, with no
    advice to do what the program does already."""
    x = torch.randn(16)
    ae.reset_metrics()
    with ae.adaptive_eager(tiers="hot"):
        for step in range(60):
            y = (x * 2 + 1).relu()
            ae.sync()
            if step % 10 == 0:
                (y * 3).sum().item()
    text = ae.explain()
    lines = text.splitlines()
    at = [i for i, line in enumerate(lines) if line.lstrip().startswith("item ")]
    assert at, text
    assert "nothing to change" in lines[at[0] + 1] and "every N" not in lines[at[0] + 1], text


def _two_codes_at_one_line():
    """Two code objects of one file:line, as a cell run again after an edit makes them (equal code
    objects are one key already)."""
    codes = []
    for value in (1, 2):
        scope: dict = {}
        exec(compile(f"def f():\n    return {value}\n", "/tmp/cell.py", "exec"), scope)
        codes.append(scope["f"].__code__)
    assert codes[0] != codes[1]
    return [(code, 2) for code in codes]


def test_explain_lists_a_flush_site_once_when_two_code_objects_share_its_line():
    from adaptive_eager._explain import explain

    a, b = _two_codes_at_one_line()
    text = explain({"windows": 10}, Counter({("item", a, None): 3, ("item", b, None): 4}), Counter())
    at = [line for line in text.splitlines() if "/tmp/cell.py:2" in line]
    assert len(at) == 1 and at[0].split()[:2] == ["item", "7"], text


def test_explain_points_only_at_sections_that_list_something():
    """Findings say "below" only where the section below lists something: a program that compiles
    a new structure each window with no recompile, no flush site and no replay reason counted."""
    from adaptive_eager._explain import explain

    metrics = {"windows": 40, "compiles": 20, "ops_recorded": 40, "replayed_regions": 30}
    text = explain(metrics, Counter(), Counter())
    assert "compile too frequent" in text and "short windows" in text and "mostly replayed" in text, text
    assert "below" not in text, text
    assert "eager's values" not in text, text  # a replayed window after compiled code is not bitwise eager's
    a, _ = _two_codes_at_one_line()
    text = explain({**metrics, "recompiles": {"shape": 3}, "replay_reasons": {"cold": 30}},
                   Counter({("item", a, None): 40}), Counter())
    assert "see the recompile causes and the flush sites below" in text, text
    assert "The flush sites below end them" in text and "see 'windows replayed, by why' below" in text, text


def test_explain_gives_each_fallback_its_own_advice():
    """An eager fallback's entry carries its reason's advice, not a pointer to a flush site that may
    be past the top ones shown (or absent: a fallback with nothing pending flushes nothing)."""
    from adaptive_eager._explain import explain
    from adaptive_eager.reasons import REASONS

    a, _ = _two_codes_at_one_line()
    text = explain({"windows": 3}, Counter(), Counter({("aten.nonzero", "data_dependent", a, None): 5}))
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("aten.nonzero (data_dependent)"))
    assert lines[at + 1] == f"      -> {REASONS['data_dependent'].advice}", text
    assert "see the flush advice" not in text, text
