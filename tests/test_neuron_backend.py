"""The neuron backend's protocol with torch-neuronx (fuser/backends/neuron.py, Note [NEFFs in our cache]).

torch-neuronx is not installable here, so ``torch_neuronx._C`` is replaced by a stand-in that
behaves as ../shared/TRAINIUM.md records the real one (``compile_graph`` compiles StableHLO once
per key and process, ``execute_compiled_graph`` runs only keys compiled in this process, a NEFF
put with ``put_neff_cache`` is found by a later ``compile_graph`` without compiling), with XLA's CPU
client standing in for ``neuronx-cc`` and the runtime, on cpu tensors. That tests everything of
ours; the real compiler and device are tested only by the last test, on a Trainium host.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import sys
import types

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import adaptive_eager as ae
import fuser.backends as backends
from adaptive_eager.config import ConfigError, load_options
from fuser.backends import BackendCompileError
from fuser.backends.neuron import NeuronBackend
from fuser.backends.stablehlo import INSTALL_HINT, missing_requirements

_MISSING = missing_requirements()
needs_stablehlo = pytest.mark.skipif(bool(_MISSING), reason=f"the stand-in compiles with XLA: {INSTALL_HINT}")


class FakeNeuronx:
    """``torch_neuronx._C`` as TRAINIUM.md describes it, compiling with XLA's CPU client."""

    def __init__(self):
        self.disk: dict[str, bytes] = {}  # its persistent NEFF cache (survives a "process")
        self.new_process()

    def new_process(self):
        self.compiled: dict[str, object] = {}  # full key -> executable, this process only
        self.compiles = 0  # neuronx-cc runs
        self.aliased = 0  # outputs that were an input's memory

    def _persistent(self, key: str, source: bytes) -> str:
        return hashlib.blake2b(key.encode() + source, digest_size=16).hexdigest()

    def compile_graph(self, base_key: str, source: bytes, has_collectives: bool) -> str:
        from jax.extend.backend import get_backend
        from jaxlib import _jax

        client = get_backend("cpu")
        key = f"{base_key}:{len(source)}"
        persistent = self._persistent(key, source)
        neff = self.disk.get(persistent)
        if neff is None:
            self.compiles += 1
            executable = client.compile_and_load(source.decode(), client.devices()[:1], _jax.CompileOptions())
            self.disk[persistent] = neff = client.serialize_executable(executable)
        # result -> the argument whose memory it is (Note [Aliased outputs] in fuser.backends.neuron)
        aliases = {int(k): int(i) for i, k in re.findall(r"%arg(\d+): [^,)]*\{tf.aliasing_output = (\d+) : i32\}",
                                                         source.decode())}
        self.compiled[key] = (persistent, client.deserialize_executable(neff, client.devices()[:1], _jax.CompileOptions()),
                              aliases)
        return key

    def get_neff_info(self, key: str):
        if key not in self.compiled:
            return None
        persistent = self.compiled[key][0]
        return persistent, self.disk[persistent]

    def put_neff_cache(self, key: str, neff: bytes) -> bool:
        self.disk[key] = neff
        return True

    def execute_compiled_graph(self, graph_name, key, inputs, outputs, has_collectives):
        from jax.extend.backend import get_backend
        from jaxlib import _jax

        executable, aliases = self.compiled[key][1:]
        for k, out in enumerate(outputs):  # the NEFF writes an output's memory while reading the inputs'
            memory = out.untyped_storage().data_ptr()
            shared = [i for i, t in enumerate(inputs) if t.untyped_storage().data_ptr() == memory]
            if shared:
                assert shared == [aliases.get(k)], f"output {k} is input {shared}'s memory, not aliased in the module"
                self.aliased += 1
        device = get_backend("cpu").devices()[0]
        buffers = [_jax.dlpack_managed_tensor_to_buffer(t.detach().__dlpack__(), device, None, None, 1) for t in inputs]
        for out, r in zip(outputs, executable.execute(buffers)):
            out.copy_(torch.from_dlpack(_jax.buffer_to_dlpack_managed_tensor(r)))


class CpuNeuron(NeuronBackend):
    """The neuron backend on cpu tensors, for the stand-in (the device type is its only difference)."""

    device_types = ("cpu",)


@pytest.fixture
def neuronx(monkeypatch):
    fake = FakeNeuronx()
    module = types.ModuleType("torch_neuronx")
    module._C = fake
    monkeypatch.setitem(sys.modules, "torch_neuronx", module)
    monkeypatch.setattr(torch, "neuron", types.SimpleNamespace(synchronize=lambda device=None: None), raising=False)
    monkeypatch.setattr("fuser.backends.stablehlo.missing_requirements", lambda requirements=None: [])
    return fake


def _region(x, w, idx):
    h = torch.nn.functional.gelu(x @ w).double()
    # int64 values computed as int32 (Note [64-bit types]); not as gather indices, which run alone
    # (Note [Unchecked indices] in fuser.backends._stablehlo_lowering)
    picked = h[:3] * idx.unsqueeze(1)
    return picked.sum(0), h.t(), idx * 2


def _graph():
    x, w, idx = torch.randn(8, 16), torch.randn(16, 4), torch.tensor([0, 3, 5])
    return make_fx(_region)(x, w, idx), [x, w, idx]


@needs_stablehlo
def test_a_region_compiles_to_a_neff_and_runs_like_eager(neuronx):
    gm, inputs = _graph()
    backend = CpuNeuron("cpu")
    artifact = backend.compile(gm, inputs)
    assert neuronx.compiles == 1
    got = backend.load(artifact)(inputs)
    want = _region(*inputs)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape and g.stride() == w.stride()
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)  # float32 accuracy of float64 values


@needs_stablehlo
def test_a_warm_process_puts_the_neff_back_and_runs_no_compiler(neuronx):
    gm, inputs = _graph()
    artifact = CpuNeuron("cpu").compile(gm, inputs)
    neuronx.disk.clear()  # the warm process's own NEFF cache is empty: only ours has it
    neuronx.new_process()
    got = CpuNeuron("cpu").load(artifact)(inputs)
    assert neuronx.compiles == 0
    torch.testing.assert_close(got[0], _region(*inputs)[0], rtol=1e-5, atol=1e-5)


@needs_stablehlo
def test_a_neff_from_another_toolchain_is_refused(neuronx, monkeypatch):
    gm, inputs = _graph()
    artifact = CpuNeuron("cpu").compile(gm, inputs)
    neuronx.new_process()
    monkeypatch.setattr(neuronx, "_persistent", lambda key, source: "another-toolchain's key")
    with pytest.raises(BackendCompileError, match="another toolchain"):
        CpuNeuron("cpu").load(artifact)


@pytest.fixture
def dynamo_neuron(monkeypatch):
    """torch-neuronx's TorchDynamo backend ``neuron``, standing in as eager (the graphs it is given)."""
    from torch._dynamo.backends import registry

    graphs = []

    def neuron(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    monkeypatch.setitem(registry._BACKENDS, "neuron", None)  # registered the way torch-neuronx's entry point is
    monkeypatch.setitem(registry._COMPILER_FNS, "neuron", neuron)
    return graphs


@needs_stablehlo
@pytest.mark.parametrize("differs", ["a call is missing", "a call takes other arguments"])
def test_a_torch_neuronx_whose_calls_differ_compiles_through_torch_compile(neuronx, monkeypatch, dynamo_neuron,
                                                                           differs, caplog):
    """Note [When torch-neuronx differs]: the region is compiled by ``torch.compile(backend="neuron")``,
    counted and logged once, and its values are eager's."""
    if differs == "a call is missing":
        monkeypatch.delattr(FakeNeuronx, "get_neff_info")
    else:
        monkeypatch.setattr(FakeNeuronx, "compile_graph", lambda self, base_key, source: "a newer signature")
    monkeypatch.setattr("fuser.backends.neuron._warned", [])
    gm, inputs = _graph()
    backend = CpuNeuron("cpu")
    ae.reset_metrics()
    with caplog.at_level("WARNING", logger="adaptive_eager"):
        artifacts = [backend.compile(gm, inputs), backend.compile(gm, inputs)]
        runs = [backend.load(a) for a in artifacts]
    assert neuronx.compiles == 0 and ae.metrics()["neuron_fallbacks"] == 2
    warnings = [r.getMessage() for r in caplog.records if "torch.compile(backend='neuron')" in r.getMessage()]
    assert len(warnings) == 1, warnings
    got, want = runs[0](inputs), _region(*inputs)
    assert len(dynamo_neuron) == 1  # Dynamo handed the region to the neuron backend at its first run
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert not artifacts[0].startswith(b"{")  # not a replay artifact: another backend's load refuses it
    with pytest.raises(BackendCompileError, match="artifact"):
        backends.get_backend("replay", "cpu").load(artifacts[0])


def train_mlp(device: str, options: dict | None, steps: int = 3):
    """Losses and final parameters of a small AdamW training loop on ``device``; under adaptive
    eager with ``options``, plainly eager for None."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 3)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, 12).to(device), torch.randint(0, 3, (16,)).to(device)
    losses = []
    with ae.adaptive_eager(**options) if options is not None else contextlib.nullcontext():
        for _ in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses, [p.detach().cpu().clone() for p in model.parameters()]


def update_in_place(options: dict | None, dtype=torch.float32, device: str = "cpu", read_ints: bool = False):
    """Three steps of in-place updates of three tensors of ``dtype`` (one also read after another's
    update, in eager's order; with ``read_ints``, one also adds an int64 tensor); under adaptive eager
    with ``options`` (each step synced), else plainly eager. Returns the tensors, the launches of each
    step, and whether the tensors kept their memory and got eager's version counts."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(4, 3, generator=gen).to(device, dtype) for _ in range(3)]
    grads = [torch.randn(4, 3, generator=gen).to(device, dtype) for _ in range(3)]
    addresses, versions = [p.data_ptr() for p in params], [p._version for p in params]
    launches = []
    with ae.adaptive_eager(**options) if options is not None else contextlib.nullcontext():
        for _ in range(3):
            before = ae.metrics()["launches"]
            for p, g in zip(params, grads):
                p.mul_(0.9).add_(g, alpha=-0.1)
            params[0].add_(params[1][:1])
            if read_ints:
                params[2].add_(torch.arange(3, device=device))
            ae.sync()
            launches.append(ae.metrics()["launches"] - before)
    kept = ([p.data_ptr() for p in params] == addresses
            and [p._version - v for p, v in zip(params, versions)] == [9, 6, 9 if read_ints else 6])
    return params, launches, kept


@needs_stablehlo
def test_a_region_that_writes_its_inputs_is_one_neff_that_writes_them(neuronx, monkeypatch, fresh_regions):
    """Note [Aliased outputs]: the StableHLO marks each written input as aliasing its new value and
    the NEFF is given the input itself as that output (the stand-in refuses an output sharing an
    input's memory the module does not alias): one launch a step. A float64 tensor, computed in
    float32 on Neuron, cannot share memory with its result: that region writes back, counted."""
    monkeypatch.setitem(backends._BACKENDS, "stablehlo", (__name__, "CpuNeuron"))
    backends._make_backend.cache_clear()
    try:
        options = dict(backend="stablehlo", hot_after=1, async_compile=False)
        want, _, _ = update_in_place(None)
        got, launches, kept = update_in_place(options)
        assert launches == [1, 1, 1] and kept and neuronx.aliased == 9, (launches, neuronx.aliased)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        want, _, _ = update_in_place(None, torch.float64)
        got, launches, kept = update_in_place(options, torch.float64)
        # the NEFF, its 6 inputs cast to float32 and 3 results back to float64 (Note [Launches of a
        # compiled callable]), 3 write-backs
        assert launches == [1 + 6 + 3 + 3] * 3 and kept and ae.metrics()["compile_failures"] == 0, launches
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    finally:
        backends._make_backend.cache_clear()


@needs_stablehlo
def test_a_training_loop_through_the_neuron_protocol_matches_eager(neuronx, monkeypatch, fresh_regions):
    monkeypatch.setitem(backends._BACKENDS, "stablehlo", (__name__, "CpuNeuron"))
    backends._make_backend.cache_clear()
    try:
        want_losses, want_params = train_mlp("cpu", None)
        ae.reset_metrics()
        got_losses, got_params = train_mlp("cpu", dict(backend="stablehlo", hot_after=1, async_compile=False))
        m = ae.metrics()
        assert neuronx.compiles >= 1 and m["compiled_runs"] >= 3 and m["compile_failures"] == 0, (m, neuronx.compiles)
        torch.testing.assert_close(got_losses, want_losses, rtol=1e-5, atol=1e-5)
        for got, want in zip(got_params, want_params):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    finally:
        backends._make_backend.cache_clear()


def test_the_neuron_backend_needs_torch_neuronx_and_a_neuron_device(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch_neuronx" else find_spec(name, *a))
    with pytest.raises(ConfigError, match="backend 'neuron' needs torch-neuronx"):
        load_options({}, backend="neuron", device="neuron")
    # without torch-neuronx a neuron device runs op by op, as plain eager does
    assert load_options({}, device="neuron").backend == "replay"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name in ("torch_neuronx", "torch_mlir") else find_spec(name, *a))
    assert load_options({}, device="neuron").backend == "neuron"
    with pytest.raises(ConfigError, match="backend 'neuron' compiles for neuron, not 'cpu'"):
        load_options({}, backend="neuron", device="cpu")


_HAS_NEURON = hasattr(torch, "neuron") and getattr(torch.neuron, "is_available", lambda: False)()


@pytest.mark.skipif(not _HAS_NEURON, reason="needs a Trainium host with torch-neuronx (the neuron backend has not run on hardware yet)")
def test_on_trainium_a_training_step_matches_cpu():  # pragma: no cover - runs on Trainium only
    ae.reset_metrics()
    got, _ = train_mlp("neuron", dict(device="neuron", backend="neuron", hot_after=1, async_compile=False))
    assert ae.metrics()["compiled_runs"] >= 3
    torch.testing.assert_close(got, train_mlp("cpu", None)[0], rtol=1e-3, atol=1e-4)
    # Note [Aliased outputs]: the NEFF writes the tensors it updates in place, read in eager's order
    got, launches, kept = update_in_place(dict(device="neuron", backend="neuron", hot_after=1, async_compile=False),
                                          device="neuron")
    assert launches == [1, 1, 1] and kept, launches
    for g, w in zip(got, update_in_place(None)[0]):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-4, atol=1e-5)
