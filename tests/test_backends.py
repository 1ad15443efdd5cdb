"""Compile backends against the oracle: the same ATen graph run eagerly.

Each graph is compiled once per backend (Inductor compiles cost seconds) and shared by the tests.
"""

from __future__ import annotations

import functools
import io
import json
import operator
import os
import subprocess
import sys
import tempfile
import zipfile

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from fuser import partition
from fuser.backends import BackendCompileError, get_backend
from fuser.backends.inductor import _culprit
from fuser.backends.stablehlo import INSTALL_HINT, missing_requirements

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MISSING = missing_requirements()
NEEDS_STABLEHLO = pytest.mark.skipif(bool(_MISSING), reason=f"needs {', '.join(_MISSING)}: {INSTALL_HINT}")
BACKENDS = ["replay", "inductor", pytest.param("stablehlo", marks=NEEDS_STABLEHLO)]
INSTALLED = ["replay", "inductor"] + ([] if _MISSING else ["stablehlo"])


@torch.library.custom_op("ae_backend_test::opaque", mutates_args=())
def _opaque(x: torch.Tensor) -> torch.Tensor:
    # no fake (meta) implementation on purpose: Inductor cannot trace through it, eager can run it
    return x.clone()


def _chain(x, y):
    a = torch.sin(x) * 2.0 + y
    b = torch.lerp(a, x, 0.25)
    c = torch.addcdiv(a, b, y.abs() + 1.0, value=0.5)
    d = torch.sqrt(c.abs())
    e = torch.where(d > 0.5, d, -d)
    return (e, e.sum(dim=1), torch.exp(x.to(torch.float64)) + y)


def _chain_inputs():
    # x is a transposed view: eager's elementwise outputs follow its strides, compiled ones must too
    return [torch.randn(16, 8).t(), torch.randn(16)]


def _block(x, w, b, gamma, beta):
    h = F.linear(x, w, b)
    out, mean, rstd = torch.ops.aten.native_layer_norm.default(h, [32], gamma, beta, 1e-5)
    return (F.gelu(out), mean, rstd)


def _block_inputs():
    return [torch.randn(8, 16), torch.randn(32, 16), torch.randn(32), torch.randn(32), torch.randn(32)]


def _views(x, w, row):
    y = x * 2
    z = torch.mm(y, w)
    return (y.t(), z[1:, ::2], (y + row).unsqueeze(0).expand(3, 4, 6), z.permute(1, 0), torch.clone(y.t()))


def _views_inputs():
    # row is an expanded input (stride 0)
    return [torch.randn(4, 6), torch.randn(6, 6), torch.randn(6).expand(4, 6)]


def _ints(a, b, m):
    c = a * 3 + b
    d = torch.div(c, 4, rounding_mode="floor")
    e = torch.remainder(c, 5)
    f = torch.where(m, d, e)
    return (f, (f > 2) & m, f.to(torch.int32), f.sum(0), torch.bitwise_xor(a, b))


def _ints_inputs():
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(-100, 100, (6, 5), generator=g),
        torch.randint(-100, 100, (6, 5), generator=g),
        torch.rand(6, 5, generator=g) > 0.5,
    ]


GRAPHS = {
    "chain": (_chain, _chain_inputs),
    "block": (_block, _block_inputs),
    "views": (_views, _views_inputs),
    "ints": (_ints, _ints_inputs),
}


@functools.cache
def _graph(graph: str):
    fn, make_inputs = GRAPHS[graph]
    torch.manual_seed(0)
    inputs = make_inputs()
    return make_fx(fn, pre_dispatch=False)(*inputs), inputs


@functools.cache
def _compiled(backend: str, graph: str) -> bytes:
    gm, inputs = _graph(graph)
    return get_backend(backend, "cpu").compile(gm, inputs)


def _loaded(backend: str, graph: str):
    """The graph's callable as the fuser makes it: split around the nodes a backend declares it
    cannot compile (Note [Partitions]), whole otherwise."""
    gm, inputs = _graph(graph)
    b = get_backend(backend, "cpu")
    alone = partition.alone(gm, b)
    if alone:
        return partition.load(partition.split(gm, inputs, alone, b), b)
    return b.load(_compiled(backend, graph))


def _check_outputs(got, want, bitwise: bool) -> None:
    def meta(t):
        return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device)

    assert type(got) is tuple
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert meta(g) == meta(w), f"output {i}"
        if bitwise:
            assert torch.equal(g, w), f"output {i}"
        else:
            torch.testing.assert_close(g, w, msg=f"output {i}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("graph", sorted(GRAPHS))
def test_outputs_match_eager(backend, graph):
    gm, inputs = _graph(graph)
    fn = _loaded(backend, graph)
    # replay runs eager's kernels, so it must be bitwise; int/bool results are exact either way
    # (assert_close compares integer dtypes exactly)
    _check_outputs(fn(list(inputs)), gm(*inputs), bitwise=backend == "replay")


@pytest.mark.parametrize("backend", BACKENDS)
def test_outputs_that_are_views_of_one_another_share_memory(backend):
    gm, inputs = _graph("views")
    compiled = _loaded(backend, "views")
    for outputs in (gm(*inputs), compiled(list(inputs))):
        _, z_slice, _, z_permuted, _ = outputs
        # z[1:, ::2] and z.permute(1, 0) are both views of z: a write through one shows in the other
        z_slice[0, 0] = 123.0
        assert z_permuted[0, 1].item() == 123.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_callable_runs_below_autograd_and_autocast(backend):
    gm, inputs = _graph("block")
    fn = _loaded(backend, "block")
    want = gm(*inputs)
    args = [t.detach().clone().requires_grad_() for t in inputs]
    passed = list(args)
    with torch.enable_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = fn(passed)
    assert passed == args  # the caller's list is left alone
    assert all(not t.requires_grad and t.grad_fn is None for t in got)
    _check_outputs(got, want, bitwise=backend == "replay")


def _child_env(**changes: str) -> dict[str, str]:
    # the children test the backends alone, not the library's torch entry point
    return {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", **changes}


_STATE_CHILD = r"""
import hashlib, json, os, sys, torch
sys.path.insert(0, sys.argv[1])
import torch._inductor.config as inductor_config
from torch.fx.experimental.proxy_tensor import make_fx
from fuser.backends import get_backend

x, y = torch.randn(4, 4), torch.randn(4, 4)
gm = make_fx(lambda x, y: (torch.sin(x) * y + 1.0, (x @ y).sum()), pre_dispatch=False)(x, y)

def state():
    env = dict(os.environ)
    # Inductor sets this (a process constant) whenever it loads a C++ kernel; torch.compile does too
    env.pop("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", None)
    return {
        "graph": gm.code + repr([(n.op, n.target, n.args, n.kwargs, sorted(n.meta)) for n in gm.graph.nodes]),
        "default dtype": str(torch.get_default_dtype()),
        "grad mode": torch.is_grad_enabled(),
        "rng": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest(),
        "inductor config": repr(sorted(inductor_config.get_config_copy().items())),
        "environment": sorted(env.items()),
    }

before = state()
for name in sys.argv[2:]:
    get_backend(name, "cpu").compile(gm, [x, y])
after = state()
print(json.dumps(sorted(k for k in before if before[k] != after[k])))
"""


def test_compile_leaves_graph_and_global_state_unchanged():
    # a fresh process, so this is its first Inductor compile: one-time setup is where state leaks
    child = subprocess.run(
        [sys.executable, "-c", _STATE_CHILD, REPO, *INSTALLED],
        env=_child_env(), capture_output=True, text=True, timeout=150,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert json.loads(child.stdout.splitlines()[-1]) == []


def _non_aten_graph() -> torch.fx.GraphModule:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.ops.aten.mul.Tensor, (x, x))
    z = g.call_function(torch.sin, (y,))
    g.output((z,))
    return torch.fx.GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_aten_op_raises_backend_compile_error(backend):
    with pytest.raises(BackendCompileError, match=rf"^{backend}: cannot compile torch\.sin"):
        get_backend(backend, "cpu").compile(_non_aten_graph(), [torch.randn(3)])


def test_op_without_fake_impl_cannot_be_compiled_but_can_be_replayed():
    x = torch.randn(5)
    gm = make_fx(lambda x: (torch.ops.ae_backend_test.opaque(x) + 1,), pre_dispatch=False)(x)
    with pytest.raises(BackendCompileError, match=r"^inductor: cannot compile ae_backend_test\.opaque\.default"):
        get_backend("inductor", "cpu").compile(gm, [x])
    replay = get_backend("replay", "cpu")
    _check_outputs(replay.load(replay.compile(gm, [x]))([x]), gm(x), bitwise=True)


def test_inductor_error_is_attributed_to_the_op_it_names():
    gm, _ = _graph("chain")
    inner = RuntimeError("LoweringException: boom\n  target: aten.lerp.Scalar\n  args[0]: ...")
    outer = RuntimeError("compile failed")
    outer.__cause__ = inner
    name, target = _culprit(outer, gm)
    assert name.startswith("aten.lerp.Scalar") and target is torch.ops.aten.lerp.Scalar
    name, target = _culprit(RuntimeError("no op here"), gm)
    assert name.startswith("the graph") and target is None


def _rewrite_inductor_manifest(artifact: bytes, **changes) -> bytes:
    with zipfile.ZipFile(io.BytesIO(artifact)) as z:
        members = {name: z.read(name) for name in z.namelist()}
    manifest = json.loads(members["manifest.json"])
    manifest.update(changes)
    members["manifest.json"] = json.dumps(manifest).encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


def _rewrite_replay_doc(artifact: bytes, **changes) -> bytes:
    return json.dumps({**json.loads(artifact), **changes}).encode()


def _rewrite_stablehlo_header(artifact: bytes, **changes) -> bytes:
    from fuser.backends.stablehlo import _pack, _unpack

    header, executable = _unpack(artifact)
    return _pack({**header, **changes}, executable)


_REWRITE = {"inductor": _rewrite_inductor_manifest, "replay": _rewrite_replay_doc, "stablehlo": _rewrite_stablehlo_header}


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_rejects_foreign_and_corrupt_artifacts(backend):
    b = get_backend(backend, "cpu")
    artifact = _compiled(backend, "chain")
    with pytest.raises(BackendCompileError, match="made for 'someone-else'"):
        b.load(_REWRITE[backend](artifact, fingerprint="someone-else"))
    for corrupt in (artifact[: len(artifact) // 2], b"\x00" * 64):
        with pytest.raises(BackendCompileError, match=f"^{backend}: "):
            b.load(corrupt)
    if backend != "replay":
        flipped = bytearray(artifact)
        # inside the compressed wrapper source; inside the executable (its header comes first)
        flipped[artifact.index(b"wrapper.py") + 200 if backend == "inductor" else -200] ^= 0xFF
        with pytest.raises(BackendCompileError):
            b.load(bytes(flipped))


def test_get_backend_names_the_valid_choices():
    with pytest.raises(ValueError, match="inductor, neuron, replay, stablehlo"):
        get_backend("tensorrt", "cpu")
    with pytest.raises(ValueError, match="cpu, cuda"):
        get_backend("inductor", "neuron")
    assert get_backend("inductor", "cpu") is get_backend("inductor", "cpu")


_CHILD = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from fuser.backends import get_backend
inductor = get_backend("inductor", "cpu")
fn = inductor.load(open(sys.argv[2], "rb").read())
torch.save(list(fn(torch.load(sys.argv[3]))), sys.argv[4])
print(json.dumps([inductor.fingerprint(), get_backend("replay", "cpu").fingerprint()]))
"""


def test_inductor_artifact_loads_in_a_fresh_process_without_compiler_or_cache(tmp_path):
    gm, inputs = _graph("chain")
    (tmp_path / "artifact").write_bytes(_compiled("inductor", "chain"))
    torch.save(list(inputs), tmp_path / "inputs.pt")
    no_tools = tmp_path / "bin"  # PATH holds no g++/cc: any attempt to compile fails
    no_tools.mkdir()
    empty_cache = tmp_path / "inductor-cache"
    empty_cache.mkdir()
    env = _child_env(PATH=str(no_tools), TORCHINDUCTOR_CACHE_DIR=str(empty_cache))
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, REPO, tmp_path / "artifact", tmp_path / "inputs.pt", tmp_path / "out.pt"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    _check_outputs(tuple(torch.load(tmp_path / "out.pt")), gm(*inputs), bitwise=False)
    assert json.loads(child.stdout.splitlines()[-1]) == [
        get_backend("inductor", "cpu").fingerprint(),
        get_backend("replay", "cpu").fingerprint(),
    ]
    assert list(empty_cache.iterdir()) == []  # nothing compiled, nothing cached


def test_triton_cache_files_move_between_cache_dirs(tmp_path, monkeypatch):
    # The CUDA path without a GPU: Triton's group index holds absolute paths, which must follow
    # the kernel from the compile's private cache dir to the loading process's cache dir.
    from torch._inductor.runtime import cache_dir_utils

    from fuser.backends._inductor_artifacts import _collect_triton, _restore_triton

    compile_dir, load_dir = tmp_path / "compile", tmp_path / "load"
    kernel = compile_dir / "KERNELHASH"
    kernel.mkdir(parents=True)
    (kernel / "k.cubin").write_bytes(b"binary")
    (kernel / "__grp__k.json").write_text(json.dumps({"child_paths": {"k.cubin": str(kernel / "k.cubin")}}))
    (kernel / "k.lock").write_bytes(b"")
    monkeypatch.setattr(cache_dir_utils, "triton_cache_dir", lambda device: str(compile_dir))
    files = _collect_triton(0)
    assert sorted(files) == ["triton/KERNELHASH/__grp__k.json", "triton/KERNELHASH/k.cubin"]

    monkeypatch.setattr(cache_dir_utils, "triton_cache_dir", lambda device: str(load_dir))
    _restore_triton(0, files)
    group = json.loads((load_dir / "KERNELHASH" / "__grp__k.json").read_text())
    assert group["child_paths"]["k.cubin"] == str(load_dir / "KERNELHASH" / "k.cubin")
    assert (load_dir / "KERNELHASH" / "k.cubin").read_bytes() == b"binary"
    # a kernel Triton already has is left alone, and no temporary directory is left behind
    (load_dir / "KERNELHASH" / "k.cubin").write_bytes(b"Triton's own")
    _restore_triton(0, files)
    assert (load_dir / "KERNELHASH" / "k.cubin").read_bytes() == b"Triton's own"
    assert [p.name for p in load_dir.iterdir()] == ["KERNELHASH"]


def test_fingerprints_name_backend_and_torch_version():
    fingerprints = {name: get_backend(name, "cpu").fingerprint() for name in INSTALLED}
    for name, fp in fingerprints.items():
        assert fp.startswith(name) and torch.__version__ in fp
    assert fingerprints["inductor"] != fingerprints["replay"]
    assert get_backend("replay", "cuda").fingerprint() != fingerprints["replay"]


def test_replay_round_trips_every_argument_kind():
    def fn(x):
        y = torch.ops.aten._to_copy.default(x, dtype=torch.float64, layout=torch.strided, device=torch.device("cpu"))
        z = torch.ops.aten.clone.default(y, memory_format=torch.contiguous_format)
        s = torch.ops.aten.sum.dim_IntList(z, [0], True)
        v = torch.ops.aten.view.default(s, (3,))
        m = torch.ops.aten.mul.Scalar(v, 2)  # int scalar: 2 and 2.0 must stay apart
        w = torch.ops.aten.add.Scalar(m, 1.5, alpha=2)
        mx = torch.ops.aten.max.dim(w, 0)
        return (w, operator.getitem(mx, 0), operator.getitem(mx, 1))

    x = torch.randn(2, 3)
    gm = make_fx(fn, pre_dispatch=False)(x)
    replay = get_backend("replay", "cpu")
    _check_outputs(replay.load(replay.compile(gm, [x]))([x]), gm(x), bitwise=True)


def test_inductor_graph_cache_is_keyed_by_the_vector_isa(tmp_path, monkeypatch):
    """Note [Vector ISA in the graph cache key]: source Inductor generated for another vector ISA
    (ATEN_CPU_CAPABILITY) is not taken from the shared FX graph cache. It was: 8-lane (avx2) source
    built with AVX-512 flags stored 16 floats at offset 8 of a 16-float buffer, and the process
    aborted ("malloc(): unaligned tcache chunk detected")."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    from fuser.backends import _inductor_artifacts
    from fuser.backends._inductor_artifacts import _unpack

    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    lanes = pick_vec_isa().nelements(torch.float) if pick_vec_isa() else 0
    if not lanes:
        pytest.skip("Inductor vectorizes nothing on this machine")
    # a build directory of this test's own: Inductor's default is <tempdir>/torchinductor_$USER
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(_inductor_artifacts, "_stand_in_build_dirs", {})
    x, w = torch.randn(16), torch.randn(16)
    gm = make_fx(lambda x, w: (torch.tanh(x * w + 0.8125) - x,), pre_dispatch=False)(x, w)

    def wrapper() -> str:
        return _unpack(get_backend("inductor", "cpu").compile(gm, [x, w]))[1]["wrapper.py"].decode()

    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")  # scalar code, cached first
    assert "Vectorized" not in wrapper()
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    assert f"x0+=static_cast<int64_t>({lanes}L)" in wrapper()


def test_static_inductor_artifacts_skip_size_asserts_and_symbolic_ones_keep_them():
    """Note [No size asserts]: a static artifact's callers have checked its inputs' shapes and
    strides (the window's key, Dynamo's guards), so its wrapper checks none (an AdamW step's 170
    checks were 60 us of a 1.1 ms step); a symbolic one still checks its inputs against its symbols."""
    from fuser.backends._inductor_artifacts import _unpack

    x, w = torch.randn(16), torch.randn(16)

    def checks(tracing_mode: str) -> int:
        gm = make_fx(lambda x, w: (torch.tanh(x * w + 0.8125) - x,), tracing_mode=tracing_mode)(x, w)
        source = _unpack(get_backend("inductor", "cpu").compile(gm, [x, w]))[1]["wrapper.py"].decode()
        return source.count("assert_size_stride(")

    assert checks("real") == 0
    assert checks("symbolic") == 2
