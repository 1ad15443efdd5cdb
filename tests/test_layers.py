"""Imports go one way: adaptive_eager -> fuser -> neff_cache, none back up (lazy ones included).

A fresh interpreter (torch's backend autoload off, so that ``import torch`` does not import
adaptive_eager itself) imports every module of fuser and neff_cache, compiles a Program with the
compile workers' entry point, runs the artifact, and runs the cache CLI on the store it went to;
adaptive_eager must never have been imported.
"""

import json
import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys
    import torch
    import fuser, neff_cache

    for package in (fuser, neff_cache):
        for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if not module.name.endswith(".__main__"):  # that one runs the CLI (below)
                importlib.import_module(module.name)
    from fuser.backends import get_backend
    from fuser.compile import _load_artifact, _unpack, compile_job
    from fuser.program import Program, _In
    from fuser.window import FRESH
    from neff_cache import ArtifactStore
    from neff_cache.cli import main

    x = torch.randn(4)
    program = Program([(torch.ops.aten.mul.Tensor, [_In(0), 2.5], {}, [(FRESH, 1, None)])],
                      [(tuple(x.shape), tuple(x.stride()), x.dtype, "cpu")], [1], ())
    key, backend = "ab" * 16, get_backend("replay", "cpu")
    data = compile_job(json.dumps({"backend": "replay", "device": "cpu", "key": key,
                                   "program": program.to_bytes().decode()}).encode())
    artifact, lifted, how = _unpack(data, key)
    (y,) = _load_artifact(artifact, how, backend)([x])
    torch.testing.assert_close(y, x * 2.5)
    with ArtifactStore(sys.argv[1]) as store:
        store.put(key, data, fingerprint=backend.fingerprint(), backend="replay", compile_seconds=0.0)
    assert main(["ls"]) == 0  # the cache directory from NEURON_EAGER_CACHE_DIR
    print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "adaptive_eager")))
    """
)


def test_fuser_and_neff_cache_never_import_adaptive_eager(tmp_path):
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "NEURON_EAGER": "adaptive",
           "NEURON_EAGER_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "cache")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert "ab" * 16 in done.stdout  # the CLI listed the stored region: it found the directory
    assert json.loads(lines[-1]) == []


def _environment_uses(path) -> list[str]:
    """``os.environ``, ``os.getenv``, ``os.putenv`` and ``from os import environ`` in a module's code."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv", "unsetenv") \
                and isinstance(node.value, ast.Name) and node.value.id == "os":
            found.append(f"{path.name}:{node.lineno} os.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                a.name in ("environ", "getenv", "putenv", "unsetenv") for a in node.names):
            found.append(f"{path.name}:{node.lineno} from os import")
    return found


def test_config_is_the_only_module_of_adaptive_eager_that_touches_the_environment():
    """Note in adaptive_eager/config.py's docstring: _heap read MALLOC_* there, neuron_emulation wrote
    NEURON_EAGER_EMULATE."""
    import pathlib

    package = pathlib.Path(__file__).resolve().parents[1] / "adaptive_eager"
    uses = [u for path in sorted(package.glob("*.py")) if path.name != "config.py" for u in _environment_uses(path)]
    assert uses == [], f"read or write the environment through adaptive_eager.config: {uses}"
    assert _environment_uses(package / "config.py")  # the check sees what it looks for


# Layers of adaptive_eager, lowest first: a module imports (at the top or in a function) only from
# its own layer and the layers below it. Derived from the import graph; a new module needs a place.
LAYERS = (
    ("facts and settings", {"errors", "reasons", "config", "_source", "_log", "_args", "_signatures",
                            "_kernel_warnings", "_period", "_gc", "_heap", "_metrics", "_overlap", "_meta_disk",
                            "_meta"}),
    ("ops and hot templates", {"_data_checks", "_ops", "_dropout", "_emit", "_hot"}),
    ("per-thread state", {"_state", "_cores"}),
    ("flushing", {"_flush"}),
    ("other threads' values", {"_threads"}),
    ("recording", {"_record", "_eager"}),
    ("sync points, patches, captures, devices", {"_patches", "_capture", "_capture_trace", "_optim", "_compile",
                                                  "neuron_emulation"}),
    ("mode and API", {"_mode", "__init__", "_autoload", "_ipython", "_explain"}),
)


def _imports(path, modules: set[str]) -> list[tuple[int, str]]:
    """(line, module of adaptive_eager) for every import in a module's code, deferred ones included:
    ``from .x import``, ``from . import x``, ``import adaptive_eager.x``, ``importlib.import_module``."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 or (node.level == 0 and (node.module or "").split(".")[0] == "adaptive_eager"):
                parts = (node.module or "").split(".")[(1 if node.level == 0 else 0):]
                if parts and parts[0]:
                    names = [parts[0]]
                else:  # from . import x, y: each a module, or a name of the package's __init__
                    names = [a.name if a.name in modules else "__init__" for a in node.names]
            elif node.level > 1:
                raise AssertionError(f"{path.name}:{node.lineno}: an import from above the package")
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "adaptive_eager":
                    names.append(parts[1] if len(parts) > 1 else "__init__")
        elif _is_sys_modules_lookup(node):  # a module found without an import: the same edge
            key = node.slice if isinstance(node, ast.Subscript) else (node.args[0] if node.args else None)
            for c in ast.walk(key) if key is not None else ():
                if isinstance(c, ast.Constant) and isinstance(c.value, str):
                    parts = c.value.lstrip(".").split(".")
                    if c.value.startswith("."):
                        names.append(parts[0])
                    elif parts[0] == "adaptive_eager" and len(parts) > 1:
                        names.append(parts[1])
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                parts = arg.value.lstrip(".").split(".")
                if arg.value.startswith("."):
                    names = [parts[0]]
                elif parts[0] == "adaptive_eager":
                    names = [parts[1] if len(parts) > 1 else "__init__"]
        found += [(node.lineno, n) for n in names if n in modules and n != path.stem]
    return found


def _is_sys_modules_lookup(node) -> bool:
    """``sys.modules[...]`` or ``sys.modules.get(...)``."""
    import ast

    def is_sys_modules(x) -> bool:
        return (isinstance(x, ast.Attribute) and x.attr == "modules" and isinstance(x.value, ast.Name)
                and x.value.id == "sys")

    if isinstance(node, ast.Subscript):
        return is_sys_modules(node.value)
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
            and is_sys_modules(node.func.value))


def test_imports_inside_adaptive_eager_never_go_up_a_layer():
    """A deferred import up a layer made a 9-module circle (_ops flushed, _flush imported _patches,
    config turned the emulation on, ...): every import, deferred ones included, goes to the same
    layer or one below."""
    import pathlib

    package = pathlib.Path(__file__).resolve().parents[1] / "adaptive_eager"
    paths = {p.stem: p for p in package.glob("*.py")}
    layer_of = {m: i for i, (_, members) in enumerate(LAYERS) for m in members}
    assert sorted(set(paths) - set(layer_of)) == [], "put each new module of adaptive_eager in a layer (LAYERS)"
    assert sorted(set(layer_of) - set(paths)) == [], "LAYERS names a module that no longer exists"
    upward = [f"{name}.py:{line} imports {target} ({LAYERS[layer_of[name]][0]} -> {LAYERS[layer_of[target]][0]})"
              for name, path in sorted(paths.items()) for line, target in _imports(path, set(paths))
              if layer_of[target] > layer_of[name]]
    assert upward == [], ("imports up a layer: move the function to the layer that needs it, or pass it down "
                          f"as a callback: {upward}")


def test_the_layer_check_sees_deferred_imports(tmp_path):
    module = tmp_path / "_flush.py"
    module.write_text("def f():\n    from ._patches import apply_frees\n    import importlib\n"
                      "    importlib.import_module('._mode', __package__)\n")
    assert _imports(module, {"_flush", "_patches", "_mode"}) == [(2, "_patches"), (4, "_mode")]
    module = tmp_path / "config.py"
    module.write_text("import sys\ndef f():\n    return sys.modules.get(__package__ + '.neuron_emulation')\n"
                      "g = sys.modules['adaptive_eager._mode']\n")
    assert sorted(_imports(module, {"config", "neuron_emulation", "_mode"})) == [(3, "neuron_emulation"), (4, "_mode")]


# the tracer's fields of a Window (Note [Hot windows] in adaptive_eager._hot) and of its templates
_TRACER_STATE = {"hot", "alive", "hot_miss", "hot_counted", "frees", "demote", "template"}


def test_the_fuser_reads_none_of_the_tracers_hot_state():
    """State has one owner (Note [Validated windows] in fuser.regions): the fuser gets a validated
    window with the entry it was validated against, and answers why it declined it; it reads no
    template, demotes nothing and adopts no hot liveness (``Window.__init__`` declares the fields)."""
    import ast
    import pathlib

    package = pathlib.Path(__file__).resolve().parents[1] / "fuser"
    found = [f"{path.relative_to(package)}:{node.lineno} .{node.attr}"
             for path in sorted(package.rglob("*.py")) for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and node.attr in _TRACER_STATE
             and not (isinstance(node.value, ast.Name) and node.value.id == "self")]
    assert found == [], f"the fuser touches the tracer's hot-window state: {found}"
