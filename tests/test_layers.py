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
