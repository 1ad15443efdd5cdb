"""Captured modules and optimizer steps on the emulated ``neuron`` device with the stablehlo backend
(Note [Captured modules] in adaptive_eager._capture, Note [Emulated tensors under Dynamo] in
adaptive_eager.neuron_emulation): a hot training step is one executable for the forward, one for
the backward and one for the optimizer step, with CPU eager's values, and every launch is counted
twice, by ``metrics()`` and by the emulated device (``neuron_emulation.launches()``: every op that
reached it and every executable it ran).

Each test runs its program in a child interpreter (the device rename is for the whole process),
which prints one JSON line the test asserts on.
"""

from __future__ import annotations

import json
import pathlib
import textwrap

import pytest
from test_neuron_emulation import _child, needs_stablehlo

pytestmark = needs_stablehlo

STEP = """
    import copy, json, sys
    import torch.nn as nn
    import torch.nn.functional as F
    ne.emulate_neuron()

    def run(base, x, y, device, steps, adaptive=None, loss_of=F.mse_loss):
        torch.manual_seed(0)
        model = copy.deepcopy(base).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = x.to(device), y.to(device)
        losses, per_step = [], []
        import contextlib
        with ae.adaptive_eager(**adaptive) if adaptive is not None else contextlib.nullcontext():
            for _ in range(steps):
                before, counted = ne.launches(), ae.metrics()["launches"]
                opt.zero_grad(set_to_none=True)
                loss = loss_of(model(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.detach())
                if adaptive is not None:
                    ae.sync()
                per_step.append((ne.launches() - before, ae.metrics()["launches"] - counted))
        losses = [l.item() for l in losses]
        return losses, {k: v.cpu() for k, v in model.state_dict().items()}, per_step

    def compare(base, x, y, steps=6, loss_of=F.mse_loss):
        cpu_losses, cpu_state, _ = run(base, x, y, "cpu", steps, loss_of=loss_of)
        ae.reset_metrics()
        losses, state, per_step = run(base, x, y, "neuron", steps, {"hot_after": 1, "async_compile": False},
                                      loss_of=loss_of)
        m = ae.metrics()
        print(json.dumps({
            "loss_error": max(abs(a - b) / (1 + abs(b)) for a, b in zip(losses, cpu_losses)),
            "state_error": max((state[k].double() - cpu_state[k].double()).abs().max().item() for k in state),
            "errors": {k: (state[k].double() - cpu_state[k].double()).abs().max().item() for k in state},
            "per_step": per_step,
            "metrics": {k: v for k, v in m.items() if k.startswith(("module_", "optimizer_")) or k == "run_alone"},
            "joined_runs": m["joined_runs"], "not_joined": m["not_joined"],
            # Note [Dynamo's work for nothing] in adaptive_eager._capture
            "inductor_compiler": sorted(name for name in sys.modules if name in (
                "torch._inductor.compile_fx", "torch._inductor.cudagraph_trees", "torch._inductor.select_algorithm")),
        }))
"""


def _result(code: str, tmp_path) -> dict:
    """``code`` run after ``STEP`` in a child interpreter: the JSON line it printed last."""
    out = _child(textwrap.dedent(STEP) + textwrap.dedent(code), tmp_path)
    # a background compile's failure may be reported after it, at the exit
    return json.loads([line for line in out.strip().splitlines() if line.startswith("{")][-1])


def _hot(r: dict) -> list:
    """Launches per step once the captures run compiled: (device's count, metrics' count)."""
    return r["per_step"][3:]


def test_a_hot_training_step_is_three_executables_and_the_loss(tmp_path):
    """An MLP with AdamW: the forward, the backward (joined with the loss window: Note [Joined runs]
    in fuser.joined) and the step each run as one executable, counted alike by the device and by
    ``metrics()``; before, the captures declined on stablehlo ("backend") and a step launched dozens
    of ops."""
    r = _result("""
        base = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))
        compare(base, torch.randn(8, 16), torch.randn(8, 4))
        """, tmp_path)
    m = r["metrics"]
    assert r["loss_error"] <= 1e-5 and r["state_error"] <= 1e-5, r
    assert m["module_captures"] == 1 and m["optimizer_captures"] == 1 and not m["module_capture_misses"], m
    assert m["module_compiled_runs"] and m["optimizer_compiled_runs"] and not m["module_uncompiled_graphs"], m
    assert all(device == counted <= 3 for device, counted in _hot(r)), r
    # the first steps too: the stand-ins' runs that compute an op's layout (a view's reaches no
    # device) and the optimizer trace's copies of AdamW's steps onto the device (Note [Steps put
    # back] in adaptive_eager._optim) were counted as the device does not and not counted
    assert all(device == counted for device, counted in r["per_step"]), r
    # Dynamo's trace of the optimizer step imported Inductor's compiler, which nothing on this device runs
    assert r["inductor_compiler"] == [], r["inductor_compiler"]


def test_a_foreach_step_lowers_whole(tmp_path):
    """Dynamo traces AdamW's foreach path on the device (a plain ``neuron`` tensor to it): the
    ``_foreach_*`` ops decompose for the lowering (Note [Our decompositions]), so the step is one
    executable; before, each ran alone between pieces (43 launches a step for this MLP)."""
    r = _result("""
        base = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        compare(base, torch.randn(4, 8), torch.randn(4, 2))
        """, tmp_path)
    m = r["metrics"]
    assert r["loss_error"] <= 1e-5 and r["state_error"] <= 1e-5, r
    assert m["optimizer_compiled_runs"] and not m["optimizer_uncompiled_graphs"] and not m["run_alone"], m
    assert all(device == counted <= 3 for device, counted in _hot(r)), r


def test_a_split_captured_graph_counts_each_launch(tmp_path):
    """An op torch-mlir cannot lower (``bessel_j0``: Note [Ops that run alone]) splits the captured
    forward; ``metrics()`` counts its pieces and the op run alone, as the device does."""
    r = _result("""
        class Tagger(nn.Module):
            def __init__(self):
                super().__init__()
                self.inp, self.out = nn.Linear(4, 8), nn.Linear(8, 3)
            def forward(self, x):
                return self.out(torch.tanh(self.inp(x)) * torch.special.bessel_j0(x).sum(-1, keepdim=True))
        compare(Tagger(), torch.randn(2, 3, 4), torch.randn(2, 3, 3))
        """, tmp_path)
    m = r["metrics"]
    assert r["loss_error"] <= 1e-5 and r["state_error"] <= 1e-5, r
    assert m["module_compiled_runs"] and m["run_alone"], m
    assert all(device == counted for device, counted in _hot(r)), r
    assert all(counted > 3 for _, counted in _hot(r)), r  # the pieces are counted, not one launch per program


def test_an_embedding_forward_is_one_executable_and_raises_eagers_error_out_of_range(tmp_path):
    """Note [Checked indices] in fuser.backends._stablehlo_lowering: an embedding no longer splits the
    captured forward (it ran alone, the graph in pieces: 8 launches a step here); the executable
    checks the ids. Ids out of range: the call raises eager's IndexError at the module call, with
    the state (BatchNorm's running statistics) as eager leaves it, and the graph stays compiled."""
    out = _child(textwrap.dedent(STEP) + textwrap.dedent("""
        class Tagger(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb, self.norm, self.out = nn.Embedding(10, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)
            def forward(self, ids):
                return self.out(torch.tanh(self.norm(self.emb(ids))))
        base, ids, y = Tagger(), torch.tensor([1, 2, 3, 4, 5, -1 + 10]), torch.randn(6, 3)
        compare(base, ids, y)

        def out_of_range(device, adaptive=None):
            torch.manual_seed(0)
            model = copy.deepcopy(base).to(device)
            import contextlib
            with ae.adaptive_eager(**adaptive) if adaptive is not None else contextlib.nullcontext():
                for _ in range(4):
                    model(ids.to(device)).sum().backward()
                try:
                    model(torch.tensor([1, 2, 30, 4, 5, 6]).to(device))  # eager raises here
                    error = None
                except IndexError as e:
                    error = str(e)
                after = model(ids.to(device)).detach().cpu().tolist()
            return error, after, {k: v.cpu().tolist() for k, v in model.state_dict().items()}

        want = out_of_range("cpu")
        ae.reset_metrics()
        got = out_of_range("neuron", {"hot_after": 1, "async_compile": False})
        m = ae.metrics()
        print(json.dumps({"want": want[0], "got": got[0], "state_equal": got[2] == want[2] or
                          max(abs(a - b) for k in want[2] for a, b in zip(torch.tensor(got[2][k]).flatten().tolist(),
                                                                          torch.tensor(want[2][k]).flatten().tolist())),
                          "after_error": max(abs(a - b) for ra, rb in zip(got[1], want[1]) for a, b in zip(ra, rb)),
                          "compiled_runs": m["module_compiled_runs"], "uncompiled": m["module_uncompiled_graphs"]}))
        """), tmp_path)
    r, e = (json.loads(line) for line in [x for x in out.strip().splitlines() if x.startswith("{")][-2:])
    m = r["metrics"]
    assert m["module_compiled_runs"] and not m["run_alone"] and not m["module_uncompiled_graphs"], m
    assert all(device == counted <= 3 for device, counted in _hot(r)), r
    # the last JSON line: the out-of-range call
    assert e["want"] == e["got"] and e["got"] is not None, e
    assert e["state_equal"] is True or e["state_equal"] <= 1e-6, e
    assert e["after_error"] <= 1e-5 and not e["uncompiled"], e


def test_batch_norm_statistics_are_written_in_place(tmp_path):
    """A CNN: the captured forward writes BatchNorm's running statistics and ``num_batches_tracked``
    inside its executable (the backend stores after its run: Note [Written inputs]), not by a copy
    each; and the loss's target check (cross-entropy) reads the emulated device's CPU data, as a
    real device runs no such check: 3 launches a step, eager's statistics."""
    r = _result("""
        # no conv bias: BatchNorm cancels its gradient to rounding noise, which AdamW scales up to lr
        base = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(4 * 4 * 4, 5))
        compare(base, torch.randn(6, 3, 8, 8), torch.tensor([0, 1, 2, 3, 4, 0]), loss_of=F.cross_entropy)
        """, tmp_path)
    m = r["metrics"]
    assert r["loss_error"] <= 1e-5 and r["state_error"] <= 1e-5, r  # the running statistics among the state
    assert m["module_compiled_runs"] and not m["module_capture_misses"], m
    assert all(device == counted <= 3 for device, counted in _hot(r)), r


@pytest.mark.slow
def test_a_gpt_block_step_is_three_launches(tmp_path):
    """The suite's GPT block (attention spelled out, LayerNorm, GELU), AdamW."""
    r = _result("""
        import sys
        sys.path.insert(0, %r)
        from workloads import GPTBlock
        torch.manual_seed(0)
        compare(GPTBlock(d=32, heads=4, seq=16), torch.randn(2, 16, 32), torch.randn(2, 16, 32))
        """ % str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"), tmp_path)
    m = r["metrics"]
    assert r["loss_error"] <= 1e-5 and r["state_error"] <= 1e-3, r  # AdamW's update of near-zero gradients
    assert m["module_captures"] == 1 and m["optimizer_captures"] == 1, m
    assert all(device == counted <= 3 for device, counted in _hot(r)), r


def test_a_second_optimizer_of_other_shapes_is_compiled(tmp_path):
    """Dynamo's automatic dynamic shapes are kept per code object of torch.optim's functions: a
    second AdamW over parameters of other shapes was captured with symbolic shapes, which a Program
    cannot hold, and ran op by op (uncounted). Captures are static: both steps compile."""
    r = _result("""
        compare(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), torch.randn(4, 8), torch.randn(4, 2), steps=4)
        compare(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2)), torch.randn(4, 16), torch.randn(4, 2))
        """, tmp_path)
    m = r["metrics"]
    assert r["loss_error"] <= 1e-5 and r["state_error"] <= 1e-5, r
    assert m["optimizer_captures"] == 1 and not m["optimizer_uncompiled_graphs"], m
    assert all(device == counted <= 3 for device, counted in _hot(r)), r


def test_a_captured_call_run_op_by_op_counts_the_devices_launches(tmp_path):
    """While a captured forward's compile runs in the background, its graph runs op by op: its
    views and allocations (``_unsafe_view`` too) launch nothing on the device, so ``metrics()``
    does not count them either (it counted every node of the graph: a GPT-2 generate() call's
    first run counted 190 launches a token where the device made 134); nor does a replayed
    window count an ``_unsafe_view`` it records. A recorded call and a captured one, compiled or
    not, count what the device counts."""
    r = _result("""
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

            def forward(self, x):  # views between the matmuls: reshape, transpose, Linear's t
                h = F.gelu(self.a(x)).view(4, 2, 16).transpose(0, 1).reshape(8, 16)
                return self.b(h)

        torch.manual_seed(0)
        model = Net().eval().to("neuron")
        x = torch.randn(8, 8).to("neuron")
        calls = []
        with torch.no_grad(), ae.adaptive_eager():
            for _ in range(6):
                m0, d0 = ae.metrics(), ne.launches()
                y = model(x)
                ae.sync()
                m1 = ae.metrics()
                calls.append([m1["module_uncompiled_runs"] - m0["module_uncompiled_runs"], ne.launches() - d0,
                              m1["launches"] - m0["launches"]])
        print(json.dumps({"calls": calls}))
        """, tmp_path)
    op_by_op = [c for c in r["calls"] if c[0]]
    assert op_by_op, r  # the compile in the background takes longer than a call of a tiny model
    # the calls after the first (which shapes the program, the first sight of everything)
    assert all(device == counted for _, device, counted in r["calls"][1:]), r


JOINED = """
    import sys

    import fuser.regions

    class Broken(RuntimeError):
        pass

    def broken(run):
        def call(inputs):
            raise Broken("the joined executable failed")
        return call

    if BREAK:  # every joined region's callable fails at its first run: the window runs alone
        poll = fuser.regions.poll

        def failing(entry, backend, options, **kwargs):  # the captured graphs poll too: break only joined regions
            poll(entry, backend, options, **kwargs)
            joined = sys._getframe(1).f_globals["__name__"] == "fuser.joined"
            if joined and entry.run is not None and not getattr(entry.run, "broken", False):
                entry.run = broken(entry.run)
                entry.run.broken = True
        fuser.regions.poll = failing

    base = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))
    compare(base, torch.randn(8, 16), torch.randn(8, 4))
    """


def _joined(tmp_path, broken: bool) -> dict:
    out = _child(textwrap.dedent(STEP) + f"BREAK = {broken}\n" + textwrap.dedent(JOINED), tmp_path)
    return json.loads([line for line in out.strip().splitlines() if line.startswith("{")][-1])  # a warning may follow


def test_the_loss_window_runs_joined_with_the_backward(tmp_path):
    """Note [Joined runs] in fuser.joined: the window between the captured forward and backward (the
    loss, ``ones_like``, the loss's backward) runs in one executable with the backward graph, so a
    hot step is 3 launches (forward, loss and backward, optimizer step), counted alike by the device
    and ``metrics()``, with CPU eager's losses; it was 4 (that window ran alone)."""
    r = _joined(tmp_path, broken=False)
    m = r["metrics"]
    assert r["loss_error"] <= 1e-5 and r["state_error"] <= 1e-5, r
    assert m["module_compiled_runs"] and m["optimizer_compiled_runs"], m
    assert r["joined_runs"] >= 3 and not r["not_joined"], r
    assert all(device == counted == 3 for device, counted in _hot(r)), r


def test_a_joined_run_that_fails_runs_the_window_alone(tmp_path):
    """A joined executable that raises is blacklisted (counted in ``not_joined``) and the step runs
    as before, the window alone and the backward after it: 4 launches, eager's values."""
    r = _joined(tmp_path, broken=True)
    m = r["metrics"]
    assert r["loss_error"] <= 1e-5 and r["state_error"] <= 1e-5, r
    assert m["module_compiled_runs"] and r["joined_runs"] == 0, r
    assert list(r["not_joined"]) == ["run_failed"], r  # its first run, then each window after it
    assert all(device == counted == 4 for device, counted in _hot(r)), r


def test_a_host_read_of_the_loss_before_the_backward_still_joins(tmp_path):
    """``loss.item()`` before the backward runs the loss there (its window, then the read: the
    device counts both); ``ones_like`` and the loss's backward still run joined with the backward
    graph: 3 launches and the read's 2."""
    out = _child(textwrap.dedent(STEP) + textwrap.dedent("""
        base = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))

        def read_first(out, y):
            loss = F.mse_loss(out, y)
            loss.item()
            return loss
        compare(base, torch.randn(8, 16), torch.randn(8, 4), loss_of=read_first)
        """), tmp_path)
    r = json.loads([line for line in out.strip().splitlines() if line.startswith("{")][-1])
    assert r["loss_error"] <= 1e-5 and r["state_error"] <= 1e-5, r
    assert r["joined_runs"] >= 3 and not r["not_joined"], r
    assert all(device == counted == 5 for device, counted in _hot(r)), r


def test_a_loss_on_a_reshaped_output_still_joins(tmp_path):
    """Note [Joined views] in fuser.joined: a loss on ``model(x).reshape(...)`` hands the backward
    a view of its gradient, which is no live output of the loss window; the join declined it
    (``not_live``) and the window ran alone: 4 launches a step. Now 3: the gradient is bound under
    its view with no copy (the emulated device swaps the memory behind it: Note [Emulated storage])."""
    out = _child(textwrap.dedent(STEP) + textwrap.dedent("""
        base = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 12))

        def reshaped(out, y):
            return F.cross_entropy(out.reshape(-1, 4), y.reshape(-1))
        compare(base, torch.randn(8, 16), torch.randint(0, 4, (8, 3)), loss_of=reshaped)
        """), tmp_path)
    r = json.loads([line for line in out.strip().splitlines() if line.startswith("{")][-1])
    assert r["loss_error"] <= 1e-5 and r["state_error"] <= 1e-5, r
    assert r["joined_runs"] >= 3 and not r["not_joined"], r
    assert all(device == counted == 3 for device, counted in _hot(r)), r


def test_the_first_background_compile_prepares_the_loads_once(tmp_path):
    """Note [Loads prepared while the first compile runs] in fuser.artifacts: the first background
    compile sends the compile thread the backend's ``prepare_load`` (XLA's client: jax's import),
    once a process, before any artifact is loaded; the loss still matches CPU eager."""
    r = _result("""
        from fuser.backends import stablehlo
        events = []
        prepare, load = stablehlo.StablehloBackend.prepare_load, stablehlo.StablehloBackend.load
        stablehlo.StablehloBackend.prepare_load = lambda self: events.append("prepare") or prepare(self)
        stablehlo.StablehloBackend.load = lambda self, a: events.append("load") or load(self, a)
        import fuser
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        x, y = torch.randn(6, 8), torch.randn(6, 4)
        cpu_losses, _, _ = run(base, x, y, "cpu", 8)
        losses, _, _ = run(base, x, y, "neuron", 8, {"async_compile": True})
        for jobs in fuser.compile_jobs():  # the compiles land, and the next steps load them
            while jobs.pending():
                jobs.poll(timeout_s=300)
        more, _, _ = run(base, x, y, "neuron", 3, {"async_compile": True})
        print(json.dumps({"events": events, "compiles": ae.metrics()["compiles"],
                          "error": max(abs(a - b) / (1 + abs(b)) for a, b in zip(losses, cpu_losses))}))
        """, tmp_path)
    assert r["error"] < 1e-5, r
    assert r["events"].count("prepare") == 1, r
    assert "load" in r["events"] and r["events"].index("prepare") < r["events"].index("load"), r


def test_the_compile_worker_is_warmed_at_the_entry(tmp_path):
    """Note [Warm workers] in neff_cache.jobs: on the emulated device the stablehlo backend's
    worker is started and warmed at the mode's entry, before the first compile is submitted (it
    was started cold by the first job, the captured forward's compile)."""
    r = _result("""
        from neff_cache import jobs
        events = []
        warm, submit = jobs.CompileJobs.warm, jobs.CompileJobs.submit
        jobs.CompileJobs.warm = lambda self, *a, **k: events.append("warm") or warm(self, *a, **k)
        jobs.CompileJobs.submit = lambda self, *a, **k: events.append("submit") or submit(self, *a, **k)
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        x, y = torch.randn(6, 8), torch.randn(6, 4)
        run(base, x, y, "neuron", 4, {})
        print(json.dumps({"events": events}))
        """, tmp_path)
    assert r["events"].count("warm") == 1 and "submit" in r["events"], r
    assert r["events"].index("warm") < r["events"].index("submit"), r


def test_a_program_that_exits_while_loads_are_prepared_waits_for_the_preparation(tmp_path):
    """Note [Loads prepared while the first compile runs] in fuser.artifacts: an import on the
    compile thread is not interrupted at exit (jax's, interrupted inside jaxlib's init, aborted the
    process with std::terminate): the exit waits for it. Here the preparation sleeps, then writes a
    file: the program exits in the middle and the file is written all the same."""
    done = tmp_path / "prepared"
    out = _child(textwrap.dedent(STEP) + textwrap.dedent(f"""
        import time
        from fuser.backends import stablehlo
        def prepare_load(self):
            time.sleep(4)
            open({str(done)!r}, "w").write("done")
        stablehlo.StablehloBackend.prepare_load = prepare_load
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        x, y = torch.randn(6, 8), torch.randn(6, 4)
        run(base, x, y, "neuron", 3, {{"async_compile": True, "compile_after_exit_s": 0}})
        print("exiting")
        """), tmp_path)
    assert "exiting" in out
    assert done.read_text() == "done", out


def test_a_scheduled_lr_that_dynamo_specializes_again_stops_the_recaptures(tmp_path):
    """Note [Specialized floats] in adaptive_eager._optim: the device takes AdamW's foreach path,
    where TorchDynamo cannot make a scheduled lr a graph input (it reaches ``_foreach_mul_`` with the
    weight decay) and specializes it at every recapture. The step was captured four times (each a
    Dynamo trace in the step and a compile never used); it stops at the second param_group miss on
    the same lr and stays recorded, with CPU eager's values. Note [Steps put back]: the AdamW steps
    the trace moved onto the device are back on cpu once the captures end, where the user had them:
    a recorded step read them on the host (an ``item`` flush every step)."""
    out = _child("""
        import contextlib
        import json
        ne.emulate_neuron()

        def run(device, adaptive=None):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 10)
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1)).to(device)
            with ae.adaptive_eager(**adaptive) if adaptive is not None else contextlib.nullcontext():
                for _ in range(8):
                    loss = model(x).square().mean()
                    loss.backward()
                    opt.step()
                    sched.step()
                    opt.zero_grad()
            devices = sorted({s["step"].device.type for s in opt.state.values()})
            return {k: v.cpu() for k, v in model.state_dict().items()}, devices

        cpu_state, _ = run("cpu")
        ae.reset_metrics()
        state, devices = run("neuron", {"hot_after": 1, "async_compile": False})
        m = ae.metrics()
        print(json.dumps({"error": max((state[k] - cpu_state[k]).abs().max().item() for k in state),
                          "captures": m["optimizer_captures"], "misses": m["optimizer_misses"],
                          "devices": devices, "item_flushes": m["flushes"].get("item", 0)}))
        """, tmp_path)
    r = json.loads(next(line for line in out.splitlines() if line.startswith("{")))  # the warning follows
    assert "recorded op by op from now on" in out
    assert r["error"] <= 1e-5, r
    assert r["captures"] == 2 and r["misses"]["param_group"] == 2 and "recapture_limit" not in r["misses"], r
    assert r["devices"] == ["cpu"] and r["item_flushes"] <= 1, r  # the one miss before the captures end
