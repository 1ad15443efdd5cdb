"""What the user reads: warnings point at the user's own line, settings errors name the setting as
the user spelled it, a device the machine lacks is refused, and help() lists every option."""

import ast
import os
import pathlib
import subprocess
import sys
import textwrap
import warnings

import pytest
from _oracle import program_env
import torch

import adaptive_eager as ae
import fuser
import neff_cache
from adaptive_eager.config import SETTINGS, ConfigError, load_options


def _line_of(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if marker in line and "_line_of" not in line)


def test_every_warning_of_the_library_goes_through_the_users_line_helper():
    """``warnings.warn`` with a fixed stacklevel points into this library or torch whenever the
    depth differs (a ``with`` block adds contextlib's frame, ``import torch`` its own): every
    warning of the library is issued by ``_source.warn``, which finds the user's frame."""
    raw = []
    for package in (ae, fuser, neff_cache):
        for path in pathlib.Path(package.__file__).parent.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("warn", "warn_explicit")
                        and getattr(node.func.value, "id", None) == "warnings"):
                    raw.append(f"{path.name}:{node.lineno}")
    assert raw == ["_source.py:" + str(n) for n in _warn_lines()], raw


def _warn_lines() -> list[int]:
    import adaptive_eager._source as source

    tree = ast.parse(pathlib.Path(source.__file__).read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "warn")
    return [n.lineno for n in ast.walk(fn) if isinstance(n, ast.Call) and getattr(n.func, "attr", None) in
            ("warn", "warn_explicit")]


def test_unknown_setting_warning_points_at_the_users_with_line(monkeypatch):
    monkeypatch.setenv("NEURON_EAGER_WINDOWZ", "7")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ae.adaptive_eager(backend="replay"):  # MARK-with
            pass
    (w,) = [w for w in caught if "NEURON_EAGER_WINDOWZ" in str(w.message)]
    assert (w.filename, w.lineno) == (__file__, _line_of("MARK-with")), (w.filename, w.lineno)
    assert "did you mean NEURON_EAGER_WINDOW?" in str(w.message)


def test_unknown_setting_suggests_a_name_only_when_one_is_close():
    with pytest.warns(UserWarning) as caught:
        load_options({"NEURON_EAGER_FOO": "1"}, device="cpu")
    message = str(caught[0].message)
    assert "did you mean" not in message and "valid: NEURON_EAGER_ASYNC_COMPILE" in message, message
    with pytest.warns(UserWarning, match="did you mean NEURON_EAGER_HOT_AFTER"):
        load_options({"NEURON_EAGER_HOTAFTER": "1"}, device="cpu")


SCRIPT = textwrap.dedent("""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import torch
    for w in caught:
        if "adaptive_eager" in str(w.message):
            print("WARNING", w.filename, w.lineno, w.message)
""")


@pytest.mark.parametrize("env", [{"NEURON_EAGER": "adaptiv"},  # stays off
                                 {"NEURON_EAGER": "adaptive", "NEURON_EAGER_BACKEND": "nope"}])  # cannot turn on
def test_warnings_at_import_torch_point_at_the_users_import(tmp_path, env):
    script = tmp_path / "prog.py"
    script.write_text(SCRIPT)
    full = program_env()
    full.update(env, NEURON_EAGER_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, str(script)], env=full, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("WARNING")]
    assert len(lines) == 1 and lines[0].startswith(f"WARNING {script} 5 "), out.stdout + out.stderr


@pytest.mark.parametrize("value", ["abc", "0"])
def test_a_bad_keyword_names_the_keyword_not_the_environment_variable(value):
    with pytest.raises(ConfigError) as e:
        with ae.adaptive_eager(window=value):
            pass
    assert str(e.value).startswith(f"option window={value!r}: expected an integer >= 1"), str(e.value)
    assert "NEURON_EAGER" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^NEURON_EAGER_WINDOW='abc': expected an integer >= 1$"):
        load_options({"NEURON_EAGER_WINDOW": "abc"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_device_the_machine_lacks_is_a_clear_error(monkeypatch):
    """Recording for cuda on a machine without it recorded nothing, silently: every op ran on cpu."""
    with pytest.raises(ConfigError, match="option device='cuda': this machine has no cuda device, so adaptive "
                                          "eager would record nothing: pass device='cpu' or leave it out"):
        with ae.adaptive_eager(device="cuda"):
            pass
    monkeypatch.setenv("NEURON_EAGER_DEVICE", "cuda")
    with pytest.raises(ConfigError, match="NEURON_EAGER_DEVICE=cuda: .* unset NEURON_EAGER_DEVICE"):
        ae.enable()
    assert not ae.is_enabled()
    with pytest.raises(ConfigError, match="no such device type"):
        with ae.adaptive_eager(device="gpu"):
            pass


def test_a_device_object_is_its_device_type():
    x = torch.randn(8)
    with ae.adaptive_eager(device=torch.device("cpu"), backend="replay"):
        y = x * 2 + 1
        assert ae.is_lazy(y)  # recorded: before, a device object matched no tensor's device
    torch.testing.assert_close(y, x * 2 + 1)
    assert ae.metrics()["ops_recorded"] == 2
    with pytest.raises(ConfigError, match="expected a device type"):
        with ae.adaptive_eager(device=torch.device("cpu", 0)):
            pass


def test_help_shows_every_option_with_its_default_and_meaning():
    """The docstring of ``adaptive_eager`` is built from config.SETTINGS: it cannot drift."""
    import pydoc

    text = pydoc.render_doc(ae.adaptive_eager, renderer=pydoc.plaintext)
    for name, (_, description) in SETTINGS.items():
        assert f"{name}: " in text and f"NEURON_EAGER_{name.upper()}" in text, name
        assert "default" in description, name
        assert " ".join(description.split()[:4]) in " ".join(text.split()), name
    assert ae.enable.__doc__.count("NEURON_EAGER_") >= len(SETTINGS)



FLOAT_SCRIPT = textwrap.dedent("""
    import warnings, torch, adaptive_eager as ae
    x = torch.randn(3, requires_grad=True)
    with ae.adaptive_eager(backend="replay"):
        loss = (x * 2).sum()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = float(loss)
    assert value == float((x.detach() * 2).sum())
    for w in caught:
        print("WARNING", w.filename, w.lineno, w.message)
""")


def test_torchs_own_warning_in_float_points_at_the_users_line(tmp_path):
    """``float(loss)`` of a tensor that requires grad: torch warns (once a process) from C++, which
    names the innermost Python frame; with the readers wrapped that was ``adaptive_eager/_patches.py``,
    not the user's line (Note [Warnings of wrapped readers])."""
    script = tmp_path / "prog.py"
    script.write_text(FLOAT_SCRIPT)
    full = program_env()
    full.update(NEURON_EAGER_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, str(script)], env=full, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("WARNING")]
    assert len(lines) == 1 and lines[0].startswith(f"WARNING {script} 8 "), out.stdout + out.stderr
    assert "requires_grad=True to a scalar" in lines[0], lines


class _Records(list):
    def __init__(self):
        super().__init__()
        import logging

        self.handler = logging.Handler()
        self.handler.emit = self.append


def test_a_failed_meta_run_inside_our_compile_is_not_logged_by_torch():
    """Note [Failed meta runs] in fuser.compile: FakeTensorMode's ERROR record (with its
    traceback) of a meta kernel that raised is dropped while a compile of ours runs, unless
    adaptive eager logs at debug; the fuser's own one-line warning says what happened."""
    import logging

    from fuser.compile import _meta_failures_unlogged

    torch_log = logging.getLogger("torch._subclasses.fake_tensor")
    records = _Records()
    torch_log.addHandler(records.handler)
    ours = logging.getLogger("adaptive_eager")
    level = ours.level
    try:
        with _meta_failures_unlogged():
            torch_log.error("failed while attempting to run meta for %s", "aten.some_op.default")
            torch_log.error("something else")
        torch_log.error("failed while attempting to run meta for %s", "aten.outside.default")
        ours.setLevel(logging.DEBUG)
        with _meta_failures_unlogged():
            torch_log.error("failed while attempting to run meta for %s", "aten.at_debug.default")
    finally:
        ours.setLevel(level)
        torch_log.removeHandler(records.handler)
    assert [r.getMessage() for r in records] == [
        "something else", "failed while attempting to run meta for aten.outside.default",
        "failed while attempting to run meta for aten.at_debug.default"]
    assert not torch_log.filters


@pytest.mark.parametrize("example", sorted(p.name for p in (pathlib.Path(__file__).parent.parent / "examples").glob("*.py")))
def test_every_examples_help_prints_its_usage_and_runs_nothing(example):
    """`quickstart.py --help` and `ddp.py --help` ran the whole example."""
    root = pathlib.Path(__file__).parent.parent
    out = subprocess.run([sys.executable, f"examples/{example}", "--help"], cwd=root, capture_output=True,
                         text=True, timeout=120, env=program_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage:"), out.stdout[:200]
    assert "final loss" not in out.stdout and "report" not in out.stdout.split("options:")[0]


ROOT = pathlib.Path(__file__).parent.parent


def test_readmes_settings_table_is_the_one_config_builds():
    """README.md's settings table is generated from config.SETTINGS; a setting added, renamed or
    redescribed without the README fails here (print it with config.settings_table())."""
    from adaptive_eager.config import SETTINGS_BEGIN, SETTINGS_END, settings_table

    text = (ROOT / "README.md").read_text()
    assert SETTINGS_BEGIN in text and SETTINGS_END in text
    block = text.split(SETTINGS_BEGIN, 1)[1].split(SETTINGS_END, 1)[0].strip()
    assert block == settings_table()


def test_the_readme_is_short_and_every_link_of_the_docs_exists():
    import re

    readme = (ROOT / "README.md").read_text()
    assert len(readme) <= 10_000, len(readme)
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


def test_dropout_is_eagers_by_default_and_a_wrong_value_names_the_closest():
    """``dropout='compiled'`` is opt-in (Note [Dropout in the compiled code] in adaptive_eager._dropout)."""
    assert load_options({}).dropout == "eager"
    assert load_options({"NEURON_EAGER_DROPOUT": "Compiled"}).dropout == "compiled"
    with pytest.raises(ConfigError, match=r"option dropout='compile': expected one of eager, compiled; "
                                          r"did you mean 'compiled'\?"):
        load_options({}, dropout="compile")
    with pytest.raises(ConfigError, match=r"option dropout=True: expected one of eager, compiled"):
        load_options({}, dropout=True)


def test_tiers_is_one_ladder_and_the_booleans_it_replaced_name_its_value(monkeypatch):
    """``tiers`` turns each tier on with the ones below it; ``hot_windows``, ``module_capture`` and
    ``optimizer_capture`` are refused whatever their value, keyword and environment alike, with
    the ladder's value that replaces them."""
    on = {t: [load_options({}, tiers=t).reaches(r) for r in ("regions", "hot", "capture")]
          for t in ("regions", "hot", "capture")}
    assert on == {"regions": [True, False, False], "hot": [True, True, False], "capture": [True, True, True]}
    assert load_options({}).tiers == "capture"
    assert load_options({"NEURON_EAGER_TIERS": "Hot"}).tiers == "hot"
    with pytest.raises(ConfigError, match=r"NEURON_EAGER_TIERS='hott': expected one of regions, hot, capture; "
                                          r"did you mean 'hot'\?"):
        load_options({"NEURON_EAGER_TIERS": "hott"})
    with pytest.raises(ConfigError, match=r"option tiers=2: expected one of regions, hot, capture"):
        load_options({}, tiers=2)
    replaced = {"hot_windows": "tiers='regions' \\(NEURON_EAGER_TIERS=regions\\)",
                "module_capture": "tiers='hot' \\(NEURON_EAGER_TIERS=hot\\)",
                "optimizer_capture": "tiers='hot' \\(NEURON_EAGER_TIERS=hot\\)"}
    for name, fix in replaced.items():
        for value in (False, True):
            with pytest.raises(ConfigError, match=rf"option {name}={value}: {name} is no longer a setting: .*{fix}"):
                load_options({}, **{name: value})
            with pytest.raises(ConfigError, match=rf"option {name}={value}: .*{fix}"):
                with ae.defaults(**{name: value}):
                    pass
        env = "NEURON_EAGER_" + name.upper()
        with pytest.raises(ConfigError, match=rf"{env}='0': {name} is no longer a setting: .*{fix}"):
            load_options({env: "0"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a removed name is said by the error, not warned about as unknown
        with pytest.raises(ConfigError):
            load_options({"NEURON_EAGER_HOT_WINDOWS": "1"})


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.py")))
def test_no_examples_docstring_states_a_time(example):
    """A time measured once on one machine (``took 36 s with an empty cache``) goes stale and
    contradicts README.md's measured figures; README.md and benchmarks/RESULTS.md hold the numbers."""
    import re

    doc = ast.get_docstring(ast.parse((ROOT / "examples" / example).read_text())) or ""
    times = re.findall(r"\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?\s*(?:s|ms|min|seconds|minutes)\b", doc)
    assert not times, f"{example}'s docstring states {times}"


def test_every_counter_of_metrics_is_named_in_the_observability_page():
    """docs/observability.md lists what ``metrics()`` returns; a counter added or renamed without
    the page had left it stale (``capture_records`` and the ``module_*`` counters were missing)."""
    import pathlib

    import adaptive_eager as ae

    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "observability.md").read_text()
    missing = [k for k in ae.metrics() if f"`{k}`" not in page and not (
        k.startswith("optimizer_") and f"`module_{k[len('optimizer_'):]}`" in page)]
    assert not missing, f"docs/observability.md does not name {missing}"
