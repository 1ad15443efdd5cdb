"""The emulated ``neuron`` device (adaptive_eager.neuron_emulation), with eager CPU as the oracle.

Renaming PrivateUse1 is for the whole process and cannot be undone, and a process with a
``neuron`` device defaults every ``adaptive_eager()`` to it: so each test runs its program in a
child interpreter, which prints what the test asserts on.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap

import pytest
from _oracle import program_env

from fuser.backends.stablehlo import INSTALL_HINT, missing_requirements

ROOT = pathlib.Path(__file__).resolve().parents[1]
needs_stablehlo = pytest.mark.skipif(bool(missing_requirements()), reason=f"the stablehlo backend: {INSTALL_HINT}")

PRELUDE = textwrap.dedent(
    """
    import torch
    import adaptive_eager as ae
    from adaptive_eager import neuron_emulation as ne

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.GELU(), torch.nn.Linear(8, 8),
                                   torch.nn.ReLU(), torch.nn.Linear(8, 2))

    def train(device, steps=3, adaptive=None):
        model = mlp().to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
        losses = []
        import contextlib
        with ae.adaptive_eager(**adaptive) if adaptive is not None else contextlib.nullcontext():
            for _ in range(steps):
                loss = model(x.to(device)).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        return losses, {k: v.cpu() for k, v in model.state_dict().items()}

    def close(a, b, atol):
        return all((a[k] - b[k]).abs().max().item() <= atol for k in a)
    """
)


def _child(code: str, tmp_path, env: dict | None = None, script: str | None = None, args=()) -> str:
    environ = program_env()
    environ.update({"PYTHONPATH": str(ROOT), "NEURON_EAGER_CACHE_DIR": str(tmp_path / "cache"), **(env or {})})
    if script is None:
        script = tmp_path / "child.py"
        script.write_text(PRELUDE + textwrap.dedent(code))
    out = subprocess.run([sys.executable, str(script), *args], env=environ, capture_output=True, text=True,
                         timeout=900, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout + out.stderr


def test_reading_settings_installs_nothing_the_entry_installs_the_emulation(tmp_path):
    """Building options from NEURON_EAGER_EMULATE=1 installed the emulated device as a side effect;
    it is installed by the mode's entry, which then records on it."""
    out = _child("""
        opts = ae.load_options()
        assert opts.emulate and opts.device == "neuron" and not ne.is_emulated(), opts
        with ae.adaptive_eager(backend="replay"):
            assert ne.is_emulated() and torch.neuron.is_available()
            y = torch.ones(3, device="neuron") * 2
            assert ae.is_lazy(y)
        assert y.cpu().tolist() == [2.0, 2.0, 2.0]
        print("ok")
        """, tmp_path, {"NEURON_EAGER_EMULATE": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})  # not at import torch
    assert "ok" in out


def test_device_factories_copies_and_device_module(tmp_path):
    out = _child("""
        ae.emulate_neuron(); ne.emulate_neuron()  # the public name; idempotent
        for t in (torch.empty(2, 3, device="neuron"), torch.zeros(2, device="neuron"), torch.randn(2, device="neuron"),
                  torch.empty_strided((2, 3), (1, 2), device="neuron"), torch.ones_like(torch.zeros(3, device="neuron"))):
            assert t.device == torch.device("neuron", 0) and t.device.type == "neuron", t.device
        c = torch.arange(6.0).reshape(2, 3)
        n = c.to("neuron")
        assert n.is_neuron and not n.is_cpu
        back = n.cpu()
        assert type(back) is torch.Tensor and back.device.type == "cpu" and torch.equal(back, c)
        assert torch.equal(n.to("cpu"), c) and torch.equal((n * 2 + 1).cpu(), c * 2 + 1)
        assert "device='neuron:0'" in repr(n)
        assert torch.neuron.is_available() and torch.neuron.device_count() == 1 and torch.neuron.current_device() == 0
        torch.neuron.synchronize()
        assert torch.accelerator.is_available() and torch.accelerator.current_accelerator().type == "neuron"
        # one launch per op that computes; views and allocations are none (Note [Emulated launches])
        a, b = torch.ones(4, device="neuron"), torch.ones(4, device="neuron")
        start = ne.launches()
        s = (a + b).view(2, 2).t().sin().sum()
        assert ne.launches() - start == 3, ne.launches() - start
        # a conjugate or negative view carries its bit on the device, so composites that resolve it
        # before a kernel (hfftn's _fft_c2r) do: without it hfftn was off by up to 19 (OpInfo sweep)
        z = torch.randn(5, 6, 7, generator=torch.Generator().manual_seed(0))
        assert torch.equal(torch.fft.hfftn(z.to("neuron"), norm="ortho").cpu(), torch.fft.hfftn(z, norm="ortho"))
        w = torch.randn(3, dtype=torch.complex64).to("neuron")
        assert w.conj().is_conj() and torch.ops.aten._neg_view(w).is_neg()
        assert torch.equal(w.conj().resolve_conj().cpu(), w.cpu().conj().resolve_conj())
        # a storage on the device cannot be made: torch crashed the process (PrivateUse1 has no allocator here)
        for make in (lambda: a.untyped_storage().clone(), lambda: torch.UntypedStorage(8, device="neuron")):
            try:
                make()
                raise AssertionError("made a storage on the emulated device")
            except ne.NeuronEmulationError as e:
                assert "t.cpu().untyped_storage()" in str(e), e
        assert torch.UntypedStorage(8).nbytes() == 8 and c.untyped_storage().clone().nbytes() == 24
        print("ok")
        """, tmp_path)
    assert "ok" in out


def test_module_to_state_dict_and_adamw_equal_eager_cpu(tmp_path):
    out = _child("""
        ne.emulate_neuron()
        cpu_losses, cpu_state = train("cpu")
        losses, state = train("neuron")
        assert losses == cpu_losses, (losses, cpu_losses)
        assert all(v.device.type == "cpu" for v in state.values()) and close(state, cpu_state, 0.0)
        model = mlp().to("neuron")
        assert all(p.device.type == "neuron" for p in model.parameters())
        model.to("cpu")
        assert all(type(p.data) is torch.Tensor and p.device.type == "cpu" for p in model.parameters())
        assert close(model.state_dict(), mlp().state_dict(), 0.0)
        print("ok")
        """, tmp_path)
    assert "ok" in out


def test_tensor_constructor_tolist_and_repr_on_the_device(tmp_path):
    """``torch.tensor(data, device="neuron")`` moves its data with the Python key excluded (it reached
    no kernel: NotImplementedError for ``aten::_copy_from``); ``tolist()`` of a subclass raised in C++;
    under adaptive eager both read a pending value after its window ran, counted by their own reason."""
    out = _child("""
        ne.emulate_neuron()
        start = ne.launches()
        t = torch.tensor([[1.5, -2.0]], device="neuron")
        assert t.device.type == "neuron" and t.tolist() == [[1.5, -2.0]] and ne.launches() - start == 1
        assert torch.tensor(3, device="neuron").cpu().item() == 3
        with ae.adaptive_eager(backend="replay"):
            y = t * 2
            assert y.tolist() == [[3.0, -4.0]]
            z = t + 1
            assert repr(z) == "tensor([[ 2.5000, -1.0000]], device='neuron:0')", repr(z)
            assert ae.metrics()["flushes"] == {"tolist": 1, "repr": 1}, ae.metrics()["flushes"]
        print("ok")
        """, tmp_path)
    assert "ok" in out


def test_refuses_when_privateuse1_is_another_device(tmp_path):
    out = _child("""
        torch.utils.rename_privateuse1_backend("foo")
        try:
            ne.emulate_neuron()
        except ne.NeuronEmulationError as e:
            print("refused:", e)
        """, tmp_path)
    assert "refused: PrivateUse1 is already the 'foo' device" in out


def test_a_first_step_counts_what_reaches_the_device(tmp_path):
    """A first step runs each new op once on stand-ins to learn its layout (Note [Eager layouts] in
    adaptive_eager._meta): a view's run (``_unsafe_view`` is one) reaches no device and was counted
    a launch, a copy from the host onto the device reaches it and was not counted. And the device
    counted ``empty_like`` (an allocation, run at once) where the library did not."""
    out = _child("""
        ne.emulate_neuron()
        w = torch.randn(4, 4).to("neuron")
        rows = []
        with ae.adaptive_eager(hot_after=1, async_compile=False):
            for _ in range(3):
                d0, l0 = ne.launches(), ae.metrics()["launches"]
                x = torch.randn(2, 3, 4).to("neuron")
                scale = torch.tensor(2.0).to("neuron", torch.float32)  # a host scalar: recorded
                y = (x @ w.t() * scale).relu()  # matmul's mm, then its result's _unsafe_view
                y = y + torch.empty_like(y).fill_(1.0)  # an allocation launches nothing
                y.sum().item()
                rows.append((ne.launches() - d0, ae.metrics()["launches"] - l0))
        assert all(device == counted for device, counted in rows), rows
        print("ok", rows)
        """, tmp_path)
    assert "ok" in out


def test_adaptive_eager_records_on_neuron_and_reads_flush(tmp_path):
    """Backward runs on autograd's device thread for a non-CPU device: the tracer found no user's
    frame there and the process aborted ("terminate called without an active exception")."""
    out = _child("""
        ne.emulate_neuron()
        opts = ae.load_options()
        assert opts.device == "neuron", opts
        cpu_losses, cpu_state = train("cpu")
        losses, state = train("neuron", adaptive={"backend": "replay"})
        assert losses == cpu_losses and close(state, cpu_state, 0.0), (losses, cpu_losses)
        x = torch.arange(6.0, device="neuron")
        with ae.adaptive_eager(backend="replay"):
            v = x[2:]  # a view the program holds while its base is written lazily
            x.mul_(2)
            y = (v + 1).sum()
            assert ae.is_lazy(y) and ae.is_lazy(x)
            print("printed", y)
            assert y.item() == 2 * (2 + 3 + 4 + 5) + 4
            assert torch.equal(v.cpu(), torch.tensor([4.0, 6.0, 8.0, 10.0]))
            try:
                torch.ones(2, 3, device="neuron") @ torch.ones(2, 3, device="neuron")
            except RuntimeError as e:
                import traceback
                print("error at line", traceback.extract_tb(e.__traceback__)[0].line)
        print("recorded", ae.metrics()["ops_recorded"] > 0)
        """, tmp_path)
    assert "recorded True" in out and "printed tensor(32., device='neuron:0')" in out
    assert "error at line torch.ones(2, 3, device=\"neuron\") @ torch.ones(2, 3, device=\"neuron\")" in out


@pytest.mark.slow  # 16 s of CPU, 50-65 s under load; test_tracer's native_dropout test covers the draw on cpu
def test_dropout_masks_are_drawn_at_record_time_bitwise_as_eager_there(tmp_path):
    """On a PrivateUse1 device ``F.dropout`` is ``native_dropout``, a random op that ended the window
    (8 flushes a step in examples/finetune_transformer.py); its mask is now drawn at record time as
    the device's kernel draws it (torch-neuronx's, on the host: Note [Emulated dropout]): same seed,
    the same masks, values and generator state as plain eager on the emulated device, with no
    "random" flush. bfloat16 included: the kernel scales in the input's dtype; a strided input's
    mask is contiguous."""
    out = _child("""
        import torch.nn.functional as F
        ne.emulate_neuron()

        def run(adaptive, dtype):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.3), torch.nn.GELU(),
                                        torch.nn.Linear(16, 4)).to("neuron", dtype)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1)).to("neuron", dtype)
            seen = []
            import contextlib
            with ae.adaptive_eager(backend="replay") if adaptive else contextlib.nullcontext():
                for _ in range(4):
                    out, mask = torch.ops.aten.native_dropout(x.t(), 0.5, True)  # strided input
                    loss = (F.dropout(model(x), 0.25) + out.t().sum()).square().mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    seen += [out.cpu(), mask.cpu(), loss.detach().cpu()]
                after = torch.rand(3, device="neuron").cpu()  # the generator's state after the steps
            return seen + [after] + [p.detach().cpu() for p in model.parameters()]

        for dtype in (torch.float32, torch.bfloat16):
            eager = run(False, dtype)
            ae.reset_metrics()
            lazy = run(True, dtype)
            m = ae.metrics()
            assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(eager, lazy)), dtype
            assert "random" not in m["flushes"] and not m["fallback_ops"], m
        print("ok")
        """, tmp_path)
    assert "ok" in out


@needs_stablehlo
def test_a_forward_with_dropout_is_captured_on_the_device_with_eagers_masks(tmp_path):
    """Note [Dropout drawn at record time] in adaptive_eager._ops: torch-neuronx's dropout draws its
    mask on the host (the emulated device's does too: Note [Emulated dropout]). A training forward
    with dropout is now captured and compiled on the device, where it declined (``random``) and stayed
    recorded, cut at each dropout with the hardware's kernel (stock GPT-2 at dropout 0.1: 76 launches
    a step). Each call draws eager's masks on the host and moves them in one copy: a steady step is
    the forward, the backward, the optimizer step and that copy, as the device counts them; the
    masks (the zeros of every output) and the generator's next draws are eager's, in bfloat16 too."""
    out = _child("""
        import contextlib, json
        ne.emulate_neuron()

        def run(lazy, dtype):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.GELU(),
                                        torch.nn.Linear(16, 4), torch.nn.Dropout(0.3)).to("neuron", dtype)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            xs = [torch.randn(5, 8, generator=torch.Generator().manual_seed(i)).to("neuron", dtype) for i in range(6)]
            torch.manual_seed(5)
            outs, rows = [], []
            with ae.adaptive_eager(hot_after=1, async_compile=False) if lazy else contextlib.nullcontext():
                for x in xs:
                    m0, d0, x0 = ae.metrics()["launches"], ne.launches(), ne.executables_run()
                    opt.zero_grad()
                    y = model(x)
                    (y.float() ** 2).mean().backward()
                    opt.step()
                    ae.sync()
                    rows.append((ae.metrics()["launches"] - m0, ne.launches() - d0, ne.executables_run() - x0))
                    outs.append(y.detach().cpu())
                after = torch.rand(3)
            return outs, after, rows

        report = {}
        for dtype in (torch.float32, torch.bfloat16):
            eager = run(False, dtype)
            ae.reset_metrics()
            lazy = run(True, dtype)
            m = ae.metrics()
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            report[str(dtype)] = {
                "masks": all(torch.equal(a == 0, b == 0) for a, b in zip(eager[0], lazy[0])),
                "close": all(torch.allclose(a.float(), b.float(), rtol=tol, atol=tol) for a, b in zip(eager[0], lazy[0])),
                "generator": torch.equal(eager[1], lazy[1]), "rows": lazy[2][3:],
                "misses": m["module_capture_misses"], "compiled": m["module_compiled_runs"]}
        print(json.dumps(report))
        """, tmp_path)
    r = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    for dtype, d in r.items():
        assert d["masks"] and d["close"] and d["generator"], (dtype, d)
        assert d["misses"] == {} and d["compiled"] >= 6, (dtype, d)
        assert all(row == [4, 4, 3] for row in d["rows"]), (dtype, d)


@needs_stablehlo
def test_dropout_compiled_makes_its_masks_in_the_executables(tmp_path):
    """Note [Dropout in the compiled code] in adaptive_eager._dropout: with ``dropout='compiled'`` a
    steady training step with dropout is the forward, the backward and the optimizer step, as the
    device counts them: no mask drawn on the host or copied (4 launches with eager's masks, above).
    The captured call, the hot window (``tiers='hot'``) and the op-by-op run (``backend='replay'``)
    make the same masks from the same seed, train to the same parameters, restart at
    ``torch.manual_seed`` and leave the program's generator untouched; the masks keep ``1 - p`` of
    the elements, independently from one draw to the next; an input too large for int32 indices
    keeps eager's mask."""
    out = _child("""
        import json
        ne.emulate_neuron()

        def run(**options):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.GELU(),
                                        torch.nn.Linear(16, 4), torch.nn.Dropout(0.3)).to("neuron")
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            xs = [torch.randn(5, 8, generator=torch.Generator().manual_seed(i)).to("neuron") for i in range(6)]
            torch.manual_seed(5)
            outs, rows = [], []
            with ae.adaptive_eager(hot_after=1, async_compile=False, dropout="compiled", **options):
                for x in xs:
                    m0, d0, x0 = ae.metrics()["launches"], ne.launches(), ne.executables_run()
                    opt.zero_grad()
                    y = model(x)
                    (y ** 2).mean().backward()
                    opt.step()
                    ae.sync()
                    rows.append((ae.metrics()["launches"] - m0, ne.launches() - d0, ne.executables_run() - x0))
                    outs.append(y.detach().cpu())
            return outs, torch.rand(3), rows, [p.detach().cpu() for p in model.parameters()]

        captured, again, hot, replay = run(), run(), run(tiers="hot"), run(backend="replay")
        torch.manual_seed(5)
        fresh = torch.rand(3)
        with ae.adaptive_eager(dropout="compiled"):
            kept = [(torch.nn.functional.dropout(torch.ones(1000, 1000, device="neuron"), 0.25) != 0).cpu()
                    for _ in range(3)]
        from adaptive_eager import _dropout
        _dropout.MAX_NUMEL = 100  # a larger input's mask is eager's: here 2500 elements
        big = []
        for mode in ("eager", "compiled"):
            torch.manual_seed(7)
            with ae.adaptive_eager(dropout=mode):
                big.append(torch.nn.functional.dropout(torch.ones(50, 50, device="neuron"), 0.5).cpu())
        report = {
            "big": torch.equal(big[0], big[1]),
            "masks": [all(torch.equal(a == 0, b == 0) for a, b in zip(captured[0], r[0])) for r in (again, hot, replay)],
            "zeros": sum(int((y == 0).sum()) for y in captured[0]),
            "close": [all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(captured[0] + captured[3], r[0] + r[3]))
                      for r in (again, hot, replay)],
            "generator": all(torch.equal(r[1], fresh) for r in (captured, hot, replay)),
            "rows": captured[2][3:], "hot_rows": hot[2][3:],
            "kept": [k.float().mean().item() for k in kept],
            "agree": [(a == b).float().mean().item() for a, b in zip(kept, kept[1:])]}
        print(json.dumps(report))
        """, tmp_path)
    r = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert r["masks"] == [True, True, True] and r["close"] == [True, True, True] and r["generator"] and r["big"], r
    assert 15 < r["zeros"] < 60, r  # 6 outputs of 20 elements, each dropped with probability 0.3: 36 +- 5
    assert all(row == [3, 3, 3] for row in r["rows"]), r
    assert all(row == [1, 1, 1] for row in r["hot_rows"]), r  # the whole step one window
    assert all(abs(k - 0.75) < 0.005 for k in r["kept"]), r  # 0.75 +- 4.3e-4 per draw of 1e6
    assert all(abs(a - 0.625) < 0.005 for a in r["agree"]), r  # 0.75**2 + 0.25**2 if independent


@needs_stablehlo
def test_unsafe_split_aliases_its_input_in_eager_and_compiled_as_on_cpu(tmp_path):
    """Note [Emulated aliases]: unsafe_split / unsafe_chunk results share the input's storage on
    cpu and in a compiled region; the emulated device's plain eager gave them storages of their own."""
    out = _child("""
        import json
        ne.emulate_neuron()

        def program(x):
            return [*torch.unsafe_split(x * 2, 2), *torch.unsafe_chunk(x * 2, 3, 1)]

        def layout(outs):
            base = outs[0].untyped_storage()._cdata
            return [[o.untyped_storage()._cdata == base if i < 3 else o.untyped_storage()._cdata ==
                     outs[3].untyped_storage()._cdata, o.storage_offset(), list(o.stride())] for i, o in enumerate(outs)]

        x = torch.randn(6, 4)
        cpu, eager = program(x), program(x.to("neuron"))
        with ae.adaptive_eager(backend="stablehlo", hot_after=1, async_compile=False):
            compiled = program(x.to("neuron"))
            ae.sync()
        print(json.dumps({"cpu": layout(cpu), "eager": layout(eager), "compiled": layout(compiled),
                          "values": all(torch.equal(a, b.cpu()) and torch.equal(a, c.cpu())
                                        for a, b, c in zip(cpu, eager, compiled))}))
        """, tmp_path)
    r = json.loads(out.strip().splitlines()[-1])
    assert r["eager"] == r["cpu"] == r["compiled"] and r["values"], r
    assert all(shared for shared, _, _ in r["cpu"]), r


@needs_stablehlo
def test_batch_norm_statistics_in_evaluation_have_the_devices_shape(tmp_path):
    """Note [Emulated batch-norm statistics]: in evaluation the statistics a device (and its fake
    tensors) return are the running mean and 1/sqrt(running_var + eps), [C]; the emulated device ran
    CPU's kernel, [0], so its eager disagreed with the recorded shapes and with stablehlo's [C]."""
    out = _child("""
        import json
        ne.emulate_neuron()
        aten = torch.ops.aten

        def program(x, w, b, rm, rv):
            x = x * 1
            return [*aten.native_batch_norm(x, w, b, rm, rv, False, 0.1, 1e-5),
                    *aten._native_batch_norm_legit(x, None, None, rm, rv, False, 0.1, 1e-5),
                    *aten._native_batch_norm_legit_no_training(x.half(), w, b, rm, rv, 0.1, 1e-3)]

        torch.manual_seed(0)
        args = [torch.randn(3, 2, 4), torch.randn(2), torch.randn(2), torch.randn(2), torch.rand(2)]
        on = [a.to("neuron") for a in args]
        eager = program(*on)
        with ae.adaptive_eager(backend="stablehlo", hot_after=1, async_compile=False):
            compiled = program(*on)
            ae.sync()
        rm, rv = args[3], args[4]
        want = [rm, 1 / torch.sqrt(rv + 1e-5), rm, 1 / torch.sqrt(rv + 1e-5), rm, 1 / torch.sqrt(rv + 1e-3)]
        stats = [t for i, t in enumerate(eager) if i % 3]
        print(json.dumps({"eager": [[list(t.shape), str(t.dtype)] for t in eager],
                          "compiled": [[list(t.shape), str(t.dtype)] for t in compiled],
                          "stats": all(torch.allclose(s.cpu(), w) for s, w in zip(stats, want)),
                          "values": all(torch.allclose(e.cpu(), c.cpu(), rtol=1e-3, atol=1e-3)
                                        for e, c in zip(eager, compiled))}))
        """, tmp_path)
    r = json.loads(out.strip().splitlines()[-1])
    assert r["eager"] == r["compiled"] and r["stats"] and r["values"], r
    assert [shape for shape, _ in r["eager"]] == [[3, 2, 4], [2], [2]] * 3, r


@needs_stablehlo
def test_stablehlo_is_the_default_backend_and_trains_like_eager_cpu(tmp_path):
    out = _child("""
        ne.emulate_neuron()
        assert ae.load_options().backend == "stablehlo"
        cpu_losses, cpu_state = train("cpu", steps=4)
        ae.reset_metrics()
        start = ne.launches()
        losses, state = train("neuron", steps=4, adaptive={"hot_after": 1, "async_compile": False})
        m = ae.metrics()
        # nothing blacklisted (a lifted float is a cpu input) or run alone (factories on neuron, among
        # them threshold_backward's decomposition: ReLU's backward ran alone)
        assert m["compiled_runs"] > 0 and m["compiles"] > 0 and not m["blacklisted"] and not m["run_alone"], m
        assert all(abs(a - b) <= 1e-5 * (1 + abs(b)) for a, b in zip(losses, cpu_losses)), (losses, cpu_losses)
        assert close(state, cpu_state, 1e-5)
        print(ne.sizing_report(m, 4))
        """, tmp_path)
    assert "NEFF launches, adaptive eager" in out


@needs_stablehlo
def test_a_recorded_foreach_adamw_step_with_a_schedule_compiles_once(tmp_path):
    """AdamW on the device takes torch.optim's foreach path; recorded (tiers='hot'), its step's floats
    are lifted before the first compile, except those a decomposition needs as numbers: the foreach
    lerp's weight was not known as one, so the first compile failed (LiftError), the window replayed
    ("scalars_baked") and compiled again. The lr changes every step (a schedule)."""
    out = _child("""
        import contextlib
        import json
        ne.emulate_neuron()

        def run(device, adaptive=None):
            model = mlp().to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 10)
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
            with ae.adaptive_eager(**adaptive) if adaptive is not None else contextlib.nullcontext():
                for _ in range(4):
                    loss = model(x.to(device)).square().mean()
                    loss.backward()
                    opt.step()
                    sched.step()
                    opt.zero_grad()
                    loss.item()
            return {k: v.cpu() for k, v in model.state_dict().items()}

        cpu_state = run("cpu")
        ae.reset_metrics()
        state = run("neuron", {"hot_after": 1, "async_compile": False, "tiers": "hot"})
        m = ae.metrics()
        assert close(state, cpu_state, 1e-5)
        print(json.dumps({"replay_reasons": m["replay_reasons"], "compile_failures": m["compile_failures"],
                          "optimizer_captures": m["optimizer_captures"]}))
        """, tmp_path)
    r = json.loads(out.strip().splitlines()[-1])
    assert r["optimizer_captures"] == 0 and r["compile_failures"] == 0, r
    assert "scalars_baked" not in r["replay_reasons"], r


def test_a_process_that_imports_the_fuser_first_emulates_the_device(tmp_path):
    """A compile worker imports ``fuser.compile`` before torch; ``import torch`` then loads adaptive
    eager (NEURON_EAGER_EMULATE=1), whose ``_hot`` imported a name of the half-imported
    ``fuser.replay``: "adaptive_eager stays off: cannot import name 'adopt_hot'", no device."""
    environ = program_env()
    environ.update(PYTHONPATH=str(ROOT), NEURON_EAGER="eager", NEURON_EAGER_EMULATE="1",
                   NEURON_EAGER_CACHE_DIR=str(tmp_path / "cache"))
    code = ("import fuser.compile\nfrom fuser.backends.stablehlo import _HOST_DEVICES\n"
            "import torch\nprint(sorted(_HOST_DEVICES), torch._C._get_privateuse1_backend_name())")
    out = subprocess.run([sys.executable, "-W", "error", "-c", code], env=environ, capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.split() == ["['neuron']", "neuron"], out.stdout + out.stderr


@needs_stablehlo
def test_background_compiles_on_the_emulated_device_land(tmp_path):
    """With the default options a region compiles in a worker process, which emulates the device
    at its ``import torch`` (``emulate_neuron()`` sets NEURON_EAGER_EMULATE for children). When that
    failed (the import cycle of the test above) every compile failed ("supports device types cpu,
    not 'neuron'") and the region was replayed for good; the tests of this file compile in place
    (``async_compile=False``), so none saw it."""
    _child("""
        import time
        ne.emulate_neuron()
        model = mlp().to("neuron")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1)).to("neuron")
        deadline = time.monotonic() + 300
        with ae.adaptive_eager(hot_after=1):
            while ae.metrics()["compiled_runs"] == 0 and time.monotonic() < deadline:
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                loss.item()
                time.sleep(0.05)
        m = ae.metrics()
        assert m["compiled_runs"] > 0 and not m["blacklisted"] and not m["compile_failures"], m
        """, tmp_path)


def test_unmodified_script_with_the_environment(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import torch
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2).to("neuron")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            loss = model(torch.ones(3, 4).to("neuron")).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
        print("loss", loss.item())
        import adaptive_eager  # only to look at what happened
        print("enabled", adaptive_eager.is_enabled(), "recorded", adaptive_eager.metrics()["ops_recorded"] > 0)
        """))
    eager = _child("", tmp_path, {"NEURON_EAGER_EMULATE": "1"}, script=script)
    adaptive = _child("", tmp_path, {"NEURON_EAGER": "adaptive", "NEURON_EAGER_EMULATE": "1",
                                     "NEURON_EAGER_BACKEND": "replay"}, script=script)
    assert "enabled False" in eager and "enabled True recorded True" in adaptive
    assert eager.split("loss ")[1].split()[0] == adaptive.split("loss ")[1].split()[0]


def test_trainium_example_runs_emulated(tmp_path):
    out = _child("", tmp_path, {"NEURON_EAGER_BACKEND": "replay"}, script=ROOT / "examples" / "trainium.py")
    assert "the neuron device is emulated" in out and "sizing report, per step" in out
    eager = out.split("losses, eager:")[1].split("\n")[0].split()
    adaptive = out.split("losses, adaptive:")[1].split("\n")[0].split()
    assert eager == adaptive and len(eager) == 4


@needs_stablehlo
def test_warm_restart_on_the_emulated_device_compiles_nothing(tmp_path):
    """The second process of a run on ``neuron`` (the same cache directory) loads every NEFF
    stand-in from disk: no lowering, no compile, the same losses."""
    code = """
        import json, sys
        import fuser.backends.stablehlo as stablehlo
        if sys.argv[1:] == ["warm"]:
            def no_lowering(*args, **kwargs):
                raise AssertionError("a warm process lowered a graph")
            stablehlo._lower = no_lowering  # fails any compile, and any op probe, loudly
        ne.emulate_neuron()
        ae.reset_metrics()
        losses, _ = train("neuron", steps=4, adaptive={"hot_after": 1, "async_compile": False})
        m = ae.metrics()
        print("RESULT", json.dumps({k: m[k] for k in ("compiles", "cache_hits_disk", "compiled_runs",
                                                      "compile_failures", "blacklisted")} | {"losses": losses}))
        """
    script = tmp_path / "warm.py"
    script.write_text(PRELUDE + textwrap.dedent(code))

    def run(mode):
        environ = program_env()
        environ.update({"PYTHONPATH": str(ROOT), "NEURON_EAGER_CACHE_DIR": str(tmp_path / "cache")})
        out = subprocess.run([sys.executable, str(script), mode], env=environ, capture_output=True, text=True,
                             timeout=900, cwd=tmp_path)
        assert out.returncode == 0, out.stdout + out.stderr
        return json.loads(out.stdout.split("RESULT ")[1].splitlines()[0])

    cold, warm = run("cold"), run("warm")
    assert cold["compiles"] >= 1 and cold["compile_failures"] == 0 and cold["blacklisted"] == 0, cold
    assert warm["compiles"] == 0 and warm["cache_hits_disk"] == cold["compiles"], (cold, warm)
    assert warm["compile_failures"] == 0 and warm["compiled_runs"] == cold["compiled_runs"], (cold, warm)
    assert warm["losses"] == cold["losses"]


@needs_stablehlo
def test_train_example_on_the_emulated_device_matches_eager(tmp_path):
    """examples/train.py --device neuron: eager on the emulated device and adaptive eager compiled by
    stablehlo train to the same losses (the example asserts it), and the steps run compiled."""
    out = _child("", tmp_path, script=ROOT / "examples" / "train.py", args=("--device", "neuron", "--steps", "10"))
    assert "the neuron device is emulated" in out
    assert "timed adaptive steps: 10 compiled, 0 replayed" in out, out


@needs_stablehlo
@pytest.mark.slow
def test_finetune_example_on_the_emulated_device_matches_eager(tmp_path):
    """examples/finetune_transformer.py --device neuron (~60 s): eager on the emulated device (CPU's
    values) and adaptive eager compiled by stablehlo end at the same loss (the example exits non-zero
    otherwise), and the fine-tuning steps' windows run compiled."""
    out = _child("", tmp_path, {"NEURON_EAGER_ASYNC_COMPILE": "0"}, script=ROOT / "examples" / "finetune_transformer.py",
                 args=("--device", "neuron", "--steps", "10"))
    assert "the neuron device is emulated" in out
    eager, adaptive = (float(v) for v in out.split("final loss      eager ")[1].split("(")[0].split("adaptive eager"))
    assert abs(eager - adaptive) <= 1e-4 * abs(eager), (eager, adaptive)
    assert int(out.split(" windows: ")[1].split(" ran compiled")[0]) > 0, out


@needs_stablehlo
@pytest.mark.parametrize("backend", ["replay", "stablehlo"])
def test_generated_programs_on_the_emulated_device_match_eager_there(tmp_path, backend):
    """tests/test_generated_programs.py's differential test with every tensor on ``neuron``: views
    among outputs, write-backs, dead values, int64/bool programs, replayed and compiled from first
    sight (the oracle is eager on the same device, whose values are CPU's)."""
    out = _child(f"""
        import sys
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from hypothesis import Phase, given, settings
        import test_generated_programs as g
        ne.emulate_neuron()
        g.DEVICE = "neuron"
        runs = []

        @settings(max_examples=12, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
                  database=None)
        @given(g.programs(drop_values=True))
        def check(program):
            g.assert_lazy_matches_eager(program, backend={backend!r}, hot_after=1, async_compile=False)
            runs.append(1)

        check()
        m = ae.metrics()
        print("programs", len(runs), "compiled_runs", m["compiled_runs"], "ops", m["ops_recorded"])
        """, tmp_path)
    programs, compiled = int(out.split("programs ")[1].split()[0]), int(out.split("compiled_runs ")[1].split()[0])
    assert programs >= 12 and int(out.split(" ops ")[1].split()[0]) > 0, out
    assert (compiled > 0) == (backend == "stablehlo"), out


def _pytest_on_neuron(tmp_path, *args: str, env: dict | None = None) -> str:
    """``pytest args`` in a child process whose test device is the emulated ``neuron`` device
    (Note [Test device] in tests/_device.py); its summary is printed for the test log."""
    environ = program_env(("NEURON_EAGER", "AE_TEST_"))
    environ.update({"PYTHONPATH": str(ROOT), "AE_TEST_DEVICE": "neuron", **(env or {})})
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rxs", *args], env=environ,
                         capture_output=True, text=True, timeout=3000, cwd=ROOT)
    print(out.stdout[-6000:])
    assert out.returncode == 0, out.stdout[-20000:] + out.stderr[-5000:]
    return out.stdout


@needs_stablehlo
@pytest.mark.slow
def test_the_tracers_contract_tests_pass_on_the_emulated_device(tmp_path):
    """tests/test_tracer.py with every tensor on ``neuron``, replayed and compiled by stablehlo from
    first sight (~4 min on 2 cores). The tests that cannot apply there are skipped with the reason;
    nothing else may fail."""
    out = _pytest_on_neuron(tmp_path, "-rA", "tests/test_tracer.py")  # -rA: a PASSED line per test, with its id
    assert " passed" in out and " failed" not in out and out.count("PASSED tests/test_tracer.py::") > 90
    assert out.count("[stablehlo]") > 20  # the tests parametrized by backend ran compiled by stablehlo too


@needs_stablehlo
@pytest.mark.slow
def test_opinfo_float32_samples_on_the_emulated_device_agree_with_eager(tmp_path):
    """tests/test_stablehlo.py's OpInfo sweep with the samples on ``neuron``, a bounded subset
    (AE_TEST_OPINFO_OPS=50: every 13th of 677 ops, ~2 min); it prints the agreement and the ops that cannot be lowered."""
    out = _pytest_on_neuron(tmp_path, "-s", "tests/test_stablehlo.py", "-k", "opinfo",
                            env={"AE_TEST_STABLEHLO_OPINFO": "1", "AE_TEST_OPINFO_OPS": "50"})
    assert "OpInfo float32 samples on neuron compiled by stablehlo" in out and "1 passed" in out


@needs_stablehlo
def test_a_large_value_of_a_compiled_region_on_the_device_runs_compiled(tmp_path):
    """A placeholder of >= 1 MiB is released for its compiled run only on an allocator that takes
    the memory back (Note [Placeholder memory at a compiled run] in fuser.replay): the emulated
    device's wrapper storage cannot be resized, and its region was blacklisted by the attempt."""
    out = _child("""
        import json
        ae.emulate_neuron()
        x = torch.randn(1024, 512).to("neuron")  # 2 MiB
        with ae.adaptive_eager(hot_after=1, async_compile=False):
            for _ in range(3):
                y = (x * 2).sin() + 1
                ae.sync()
        m = ae.metrics()
        print(json.dumps({"close": torch.allclose(y.cpu(), (x.cpu() * 2).sin() + 1, atol=1e-6),
                          "compiled_runs": m["compiled_runs"], "blacklisted": m["blacklisted"]}))
        """, tmp_path)
    got = json.loads(out.strip().splitlines()[-1])
    assert got == {"close": True, "compiled_runs": 3, "blacklisted": 0}, out


# A training loop's steady steps under adaptive eager (hot_after=1, compiled in the step): per step,
# metrics()["launches"] and the device's own count (ops reaching it, executables run on it: Note
# [Emulated launches]), printed as JSON. ``make`` builds (model, loss of model) on the device.
_STEADY = """
    import json
    def steady(make, steps=6, warm=3):
        model, loss_of = make()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        rows = []
        with ae.adaptive_eager(hot_after=1, async_compile=False):
            for i in range(steps):
                m0, d0, x0 = ae.metrics()["launches"], ne.launches(), ne.executables_run()
                loss = loss_of(model)
                loss.backward()
                opt.step()
                opt.zero_grad()
                loss.item()
                if i >= warm:
                    rows.append((ae.metrics()["launches"] - m0, ne.launches() - d0, ne.executables_run() - x0))
        return rows
"""


@needs_stablehlo
def test_launches_per_step_are_what_reaches_the_device(tmp_path):
    """Note [Launches of a compiled callable]: metrics()["launches"] counts every executable run on the
    device and every op reaching it outside one (a split region's pieces and ops run alone, clones
    before its stores, binding and input copies, index checks, dropout masks), per steady step equal
    to the emulated device's own count. It counted each compiled run as one launch: the CNN's
    3 pieces and its clones were missing (19 counted of 57)."""
    out = _child(textwrap.dedent(_STEADY) + textwrap.dedent("""
        ne.emulate_neuron()
        def make_mlp():
            model = mlp().to("neuron")
            x, y = torch.randn(5, 4), torch.randn(5, 2)
            return model, lambda m: torch.nn.functional.mse_loss(m(x.to("neuron")), y.to("neuron"))
        def make_cnn():
            torch.manual_seed(0)
            model = torch.nn.Sequential(
                torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                torch.nn.Flatten(), torch.nn.Dropout(0.1), torch.nn.Linear(8, 10)).to("neuron")
            x, y = torch.randn(4, 3, 16, 16).to("neuron"), torch.randint(0, 10, (4,)).to("neuron")
            return model, lambda m: torch.nn.functional.cross_entropy(m(x), y)
        print(json.dumps({"mlp": steady(make_mlp), "cnn": steady(make_cnn)}))
        """), tmp_path)
    r = json.loads(out.strip().splitlines()[-1])
    for name, rows in r.items():
        assert all(lib == device for lib, device, _ in rows), (name, rows)
    # the MLP's step: its captured forward, the loss window joined with the captured backward (Note
    # [Joined runs] in fuser.joined) and the optimizer step, one executable each (Note [Captured
    # modules] in adaptive_eager._capture); the CNN's forward draws dropout masks, so it stays
    # recorded: a split region, its pieces
    assert all(executables == 3 for _, _, executables in r["mlp"]), r
    assert all(executables > 1 for _, _, executables in r["cnn"]), r


@needs_stablehlo
@pytest.mark.slow
def test_gpt2_launches_per_step_are_what_reaches_the_device(tmp_path):
    """As above for a stock GPT-2 (a tiny config): embeddings, gathers and index_put run alone and
    split its region, its dropout masks are drawn, and clones precede the split region's stores (the
    library counted 40 launches a step of the 146 that reached the device)."""
    pytest.importorskip("transformers")
    out = _child(textwrap.dedent(_STEADY) + textwrap.dedent("""
        import transformers
        ne.emulate_neuron()
        def make_gpt2():
            torch.manual_seed(0)
            model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
                n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0))
            model = model.to("neuron")
            ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
            return model, lambda m: m(input_ids=ids.to("neuron"), labels=ids.to("neuron")).loss
        print(json.dumps(steady(make_gpt2, steps=6, warm=4)))
        """), tmp_path)
    rows = json.loads(next(line for line in out.splitlines() if line.startswith("[[")))  # transformers warns after it
    assert all(lib == device for lib, device, _ in rows) and all(x > 1 for _, _, x in rows), rows


@needs_stablehlo
def test_launches_of_captured_graphs_run_op_by_op_are_what_reaches_the_device(tmp_path):
    """While their compile runs in the background, a captured forward, backward and optimizer step
    run op by op: the library counts their ops that launch (no view or allocation: Note [Launches of
    a compiled callable]) as the device does. It counted every node of their graphs, views too (the
    CNN of neuron_launches.py: 115 a step where 102 reached the device). The capture step itself is
    left out: Dynamo moves AdamW's step counters onto the device while it traces, unseen."""
    out = _child(textwrap.dedent("""
        import json
        ne.emulate_neuron()
        model = mlp().to("neuron")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = torch.randn(5, 4).to("neuron"), torch.randn(5, 2).to("neuron")
        rows = []
        with ae.adaptive_eager(hot_after=1):  # compiles in the background, as by default
            for i in range(6):
                m0, d0 = ae.metrics(), ne.launches()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                ae.sync()
                m1 = ae.metrics()
                by_op = sum(m1[k] - m0[k] for k in ("module_uncompiled_runs", "optimizer_uncompiled_runs"))
                rows.append((m1["launches"] - m0["launches"], ne.launches() - d0, by_op))
        print(json.dumps(rows))
        """), tmp_path)
    rows = json.loads(next(line for line in out.splitlines() if line.startswith("[[")))
    rows = rows[2:]  # after the first sight and the capture step
    assert any(by_op for _, _, by_op in rows), rows
    assert all(lib == device for lib, device, _ in rows), rows


@needs_stablehlo
def test_attention_runs_as_its_executables_and_nothing_else(tmp_path):
    """Note [Outputs that share storage] in fuser.backends._stablehlo_lowering: SDPA's math
    decomposition (Llama's attention on the device) scales the transposed key, a pointwise op that
    keeps its layout, and saves it for the backward in eager's strides: the captured forward's
    executable returns it in that memory order, so a steady step is its 3 executables (the loss window
    joined with the backward: Note [Joined runs] in fuser.joined) and the loss's host read, nothing else reaches the device, with CPU eager's losses. The key was copied into
    eager's strides after the forward's run (Llama: 6 launches a step, 4 executables)."""
    out = _child(textwrap.dedent(_STEADY) + textwrap.dedent("""
        class Rotary(torch.nn.Module):
            def __init__(self):
                super().__init__()
                torch.manual_seed(0)
                self.q, self.o = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
                self.k, self.v = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)  # one head, shared by two
                angles = torch.arange(6.0)[:, None] * torch.arange(1.0, 5.0)
                self.register_buffer("cos", angles.cos())
                self.register_buffer("sin", angles.sin())

            def forward(self, x):
                b, s, _ = x.shape
                q = self.q(x).view(b, s, 2, 4).transpose(1, 2)
                k, v = (p(x).view(b, s, 1, 4).transpose(1, 2) for p in (self.k, self.v))
                q = q * self.cos + q.flip(-1) * self.sin
                k = k * self.cos + k.flip(-1) * self.sin
                # Llama's repeat_kv: a contiguous key, whose transpose SDPA scales
                k, v = (t[:, :, None].expand(b, 1, 2, s, 4).reshape(b, 2, s, 4) for t in (k, v))
                y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                y = y.transpose(1, 2).reshape(b, s, 8)
                return self.o(y).square().mean()

        def make(device):
            model = Rotary().to(device)
            x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(1)).to(device)
            return model, lambda m: m(x)

        def losses(device, adaptive):
            model, loss_of = make(device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            out = []
            import contextlib
            with ae.adaptive_eager(**adaptive) if adaptive else contextlib.nullcontext():
                for _ in range(5):
                    loss = loss_of(model)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    out.append(loss.item())
            return out

        ne.emulate_neuron()  # before any backward: autograd sizes its device queues at the first
        cpu = losses("cpu", None)
        print(json.dumps({"steady": steady(lambda: make("neuron")), "cpu": cpu,
                          "neuron": losses("neuron", {"hot_after": 1, "async_compile": False})}))
        """), tmp_path)
    r = json.loads(out.strip().splitlines()[-1])
    # the executables, and the host read of ``loss.item()``
    assert r["steady"] and all(row == [4, 4, 3] for row in r["steady"]), r
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(r["neuron"], r["cpu"])), r


_TIED = """
    import json

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb = torch.nn.Embedding(16, 8)
            self.mid = torch.nn.Linear(8, 8)
            self.head = torch.nn.Linear(8, 16, bias=False)
            self.head.weight = self.emb.weight  # tied, as a language model's head and embedding

        def forward(self, ids):
            logits = self.head(torch.tanh(self.mid(self.emb(ids))))
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())

    def losses_of(model, device, steps=4, adaptive=None):
        held = model.emb.weight if hasattr(model, "emb") else None
        model = model.to(device)
        n = len(list(model.parameters()))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(1))
        losses = []
        import contextlib
        with ae.adaptive_eager(**adaptive) if adaptive is not None else contextlib.nullcontext():
            for _ in range(steps):
                loss = model(ids.to(device))
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        return n, losses, held is None or held is model.emb.weight
"""


def test_tied_weights_stay_tied_on_the_device(tmp_path):
    """Note [Module conversions keep parameters]: ``.to("neuron")`` keeps a tied weight one parameter
    (and the parameter object the program held), as ``.to("cuda")`` does: eager and adaptive eager on
    the emulated device train to CPU eager's losses. It made two parameters, trained apart."""
    out = _child(textwrap.dedent(_TIED) + textwrap.dedent("""
        ne.emulate_neuron()
        cpu = losses_of(Tied(), "cpu")
        eager = losses_of(Tied(), "neuron")
        adaptive = losses_of(Tied(), "neuron", adaptive={"hot_after": 1, "async_compile": False, "backend": "replay"})
        back = Tied().to("neuron").to("cpu")
        print(json.dumps({"cpu": cpu, "eager": eager, "adaptive": adaptive,
                          "back": [len(list(back.parameters())), back.head.weight is back.emb.weight,
                                   type(back.emb.weight.data) is torch.Tensor]}))
        """), tmp_path)
    r = json.loads(out.strip().splitlines()[-1])
    assert r["cpu"][0] == 3 and r["cpu"][2], r
    for name in ("eager", "adaptive"):
        n, losses, kept = r[name]
        assert n == 3 and kept, (name, r)
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, r["cpu"][1])), (name, r)
    assert r["back"] == [3, True, True], r


def test_a_stock_gpt2_keeps_its_tied_weights_on_the_device(tmp_path):
    """GPT-2's LM head is its token embedding: 28 parameters after ``.to("neuron")`` as on CPU (29
    before), and eager on the emulated device trains to CPU eager's losses without ``tie_weights()``."""
    pytest.importorskip("transformers")
    out = _child("""
        import json, transformers
        ne.emulate_neuron()
        def run(device):
            torch.manual_seed(0)
            model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
                n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0))
            model = model.to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
            losses = []
            for _ in range(4):
                torch.manual_seed(2)  # dropout's masks: the same draws on both devices (cpu's generator)
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            return len(list(model.parameters())), losses
        print(json.dumps({"cpu": run("cpu"), "neuron": run("neuron")}))
        """, tmp_path)
    r = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert r["neuron"][0] == r["cpu"][0] == 28, r
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(r["neuron"][1], r["cpu"][1])), r


@needs_stablehlo
def test_adamw_takes_the_foreach_path_on_the_device_with_cpus_values(tmp_path):
    """torch.optim takes its foreach path on a device of its foreach list (PrivateUse1's name is on
    it) only for tensor types it knows: the emulated tensor is one of them, as a real device's tensor
    is, so AdamW's default step is a few foreach ops, not 6-8 ops per parameter; eager and adaptive
    eager on the device train to CPU's values, with the foreach ops inside the compiled step."""
    out = _child("""
        import json
        from torch.optim.optimizer import _default_to_fused_or_foreach
        from torch.utils._python_dispatch import TorchDispatchMode
        ne.emulate_neuron()

        class Names(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.names = []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.names.append(func.overloadpacket.__name__)
                return func(*args, **(kwargs or {}))

        params = list(mlp().to("neuron").parameters())
        for p in params:
            p.grad = torch.ones_like(p)
        opt = torch.optim.AdamW(params, lr=1e-2)
        opt.step()  # the state is made at the first step
        names = Names()
        with names:
            opt.step()
        cpu_losses, cpu_state = train("cpu", steps=8)
        losses, state = train("neuron", steps=8)
        ae.reset_metrics()
        ae_losses, ae_state = train("neuron", steps=8, adaptive={"hot_after": 1, "async_compile": False})
        m = ae.metrics()
        print(json.dumps({
            "default": _default_to_fused_or_foreach(params, False, False),
            "foreach_ops": sum(n.startswith("_foreach_") for n in names.names), "ops": len(names.names),
            "eager": [losses == cpu_losses, close(state, cpu_state, 0.0)],
            # compiled (the step's captured calls): within float tolerance, as compiled regions are
            "adaptive": [all(abs(a - b) <= 1e-5 * (1 + abs(b)) for a, b in zip(ae_losses, cpu_losses)),
                         close(ae_state, cpu_state, 1e-5)],
            "compiles": m["compiles"], "run_alone": m["run_alone"]}))
        """, tmp_path)
    r = json.loads(out.strip().splitlines()[-1])
    assert r["default"] == [False, True], r
    assert r["foreach_ops"] > 0 and r["ops"] < 5 * 6, r  # 6 parameters: the single-tensor path makes 6-8 ops each
    assert r["eager"] == [True, True] and r["adaptive"] == [True, True], r
    # Note [Foreach ops]: the foreach ops lower (none runs alone), and the per-step floats of their
    # lists are lifted, so the step compiles as the single-tensor one does, not once a step
    assert not r["run_alone"] and r["compiles"] <= 4, r


@needs_stablehlo
def test_an_index_out_of_range_in_a_compiled_region_raises_eagers_error_and_writes_nothing(tmp_path):
    """Note [Checked indices] in fuser.backends._stablehlo_lowering: a step gathering rows by a
    pending index and updating a state tensor runs as one executable (the gather checked inside,
    not run alone); an index out of range raises eager's IndexError at the next sync, the state is
    eager's (nothing stored by the failed run, the update not applied twice), the message names the
    statement's line, and the region stays compiled for the next steps."""
    out = _child("""
        import json, sys
        ne.emulate_neuron()

        def run(device, adaptive=None):
            import contextlib
            table = torch.arange(40.0).reshape(10, 4).to(device)
            state = torch.zeros(4, device=device)
            good, bad = torch.tensor([1, -2, 3]).to(device), torch.tensor([1, 20, 3]).to(device)
            outs, error = [], None
            with ae.adaptive_eager(**adaptive) if adaptive is not None else contextlib.nullcontext():
                for k in range(6):
                    idx = (bad if k == 4 else good) * 1  # a value of the window: the region checks it
                    try:
                        line = sys._getframe().f_lineno + 1
                        state.add_(table[idx].sum(0))  # eager raises here, before the add
                        outs.append(state.sum().item())  # adaptive eager at this sync
                    except IndexError as e:
                        error = str(e).splitlines()[0]
                        named = f"recorded at {__file__}:{line}" in str(e) or adaptive is None
                        outs.append(named)
                m = ae.metrics()
            return outs, state.cpu().tolist(), error, m

        want = run("cpu")
        ae.reset_metrics()
        before = ne.launches()
        got = run("neuron", {"hot_after": 1, "async_compile": False})
        m = got[3]
        print(json.dumps({"want": want[:3], "got": got[:3], "compiled_runs": m["compiled_runs"],
                          "run_alone": m["run_alone"], "blacklisted": m["blacklisted"],
                          "replay_reasons": m["replay_reasons"], "launches": ne.launches() - before}))
        """, tmp_path)
    r = json.loads(out.strip().splitlines()[-1])
    assert r["got"] == r["want"] and r["want"][2] is not None, r
    assert not r["run_alone"] and not r["blacklisted"] and r["compiled_runs"] >= 4, r
