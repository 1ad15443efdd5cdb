"""Train an MLP with AdamW on synthetic data, plain eager and under adaptive eager, in one process;
time both, check that they compute the same losses, and explain what adaptive eager did.

    python examples/train.py
    python examples/train.py --device neuron --steps 20   # on Trainium, or an emulated neuron device

Two copies of the same model (same seed, same batches) train side by side. Steps alternate in
blocks, eager then adaptive, so a noisy machine slows both alike; the medians of the per-step
times are compared. Each step ends with ``loss.item()``, as a training loop that logs would, so
the adaptive time includes running the step's window.

Warm-up: the first sight of a step replays it op by op, the second compiles it with Inductor.
``async_compile=False`` compiles in this process, so the compile time is paid inside the warm-up
steps and every timed step after them runs compiled; by default (``async_compile=True``) the
compile runs in a background worker while the steps replay. Compiled regions are kept in the
persistent cache (``~/.cache/adaptive_eager`` or ``NEURON_EAGER_CACHE_DIR``): a second run of
this script compiles nothing and loads them from disk, so it is faster than the first.
"""

import argparse
import statistics
import time

import torch

import adaptive_eager as ae
from adaptive_eager import adaptive_eager

STEPS = 300  # timed steps for each of eager and adaptive
BLOCK = 10  # steps per block; blocks alternate eager, adaptive, eager, ...
WARMUP = 5  # adaptive steps before timing starts: replay, compile, first compiled runs
BATCH, D_IN, HIDDEN, CLASSES = 128, 64, 256, 10


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(D_IN, HIDDEN), torch.nn.GELU(), torch.nn.LayerNorm(HIDDEN),
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU(), torch.nn.LayerNorm(HIDDEN),
        torch.nn.Linear(HIDDEN, CLASSES),
    )


def make_data(n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Classify points by a fixed random linear map into CLASSES buckets (learnable, not trivial)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(D_IN, CLASSES, generator=g)
    batches = []
    for _ in range(n_batches):
        x = torch.randn(BATCH, D_IN, generator=g)
        batches.append((x, (x @ w).argmax(dim=1)))
    return batches


class Trainer:
    def __init__(self, device: str):
        self.device = device
        self.model = make_model().to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=1e-2)
        self.losses: list[float] = []
        self.times: list[float] = []

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        t0 = time.perf_counter()
        self.opt.zero_grad()
        x, y = x.to(self.device), y.to(self.device)
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.losses.append(loss.item())  # a sync point: the step's window has run when this returns
        self.times.append(time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda, or neuron (emulated in CPU memory where torch-neuronx is not installed)")
    parser.add_argument("--steps", type=int, default=STEPS, help="timed steps for each of eager and adaptive")
    args = parser.parse_args()
    if args.device == "neuron":
        from adaptive_eager import neuron_emulation

        if not neuron_emulation.real_device_present():
            neuron_emulation.emulate_neuron()  # the stablehlo backend stands in for neuronx-cc
            print("no torch-neuronx here: the neuron device is emulated (CPU memory)")
    steps = args.steps
    # A model this small gains nothing from intra-op threads, and on a shared 2-core machine they
    # mostly wait on each other (steps 3-10x slower under load); both runs use one thread.
    torch.set_num_threads(1)
    data = make_data(WARMUP + steps)
    eager, lazy = Trainer(args.device), Trainer(args.device)
    # what each adaptive step ran as (from metrics() deltas): "replayed" when every window of it ran
    # op by op and no captured call ran, else "compiled"
    kinds: list[str] = []
    compiled_code = ("compiled_runs", "module_captured_calls", "optimizer_hot_steps")

    def adaptive_steps(batches) -> None:
        with adaptive_eager(async_compile=False):
            for x, y in batches:
                before = ae.metrics()
                lazy.step(x, y)
                after = ae.metrics()
                ran = any(after[k] > before[k] for k in compiled_code)
                kinds.append("compiled" if ran else "replayed")

    def eager_steps(batches) -> None:
        for x, y in batches:
            eager.step(x, y)

    ae.reset_metrics()
    t0 = time.perf_counter()
    eager_steps(data[:WARMUP])
    adaptive_steps(data[:WARMUP])
    warm = ae.metrics()
    print(f"warm-up ({WARMUP} steps each, {time.perf_counter() - t0:.1f} s): adaptive eager compiled "
          f"{warm['compiles']} region(s) in {warm['compile_seconds']} s, loaded {warm['cache_hits_disk']} "
          f"from the persistent cache; steps ran as {', '.join(kinds)}")
    del eager.times[:], lazy.times[:]

    for start in range(WARMUP, WARMUP + steps, BLOCK):
        block = data[start:start + BLOCK]
        eager_steps(block)
        adaptive_steps(block)

    e_ms = statistics.median(eager.times) * 1e3
    a_ms = statistics.median(lazy.times) * 1e3
    steady = kinds[WARMUP:]
    print(f"{steps} timed steps each: median step time  eager {e_ms:.2f} ms   adaptive eager {a_ms:.2f} ms   "
          f"(adaptive / eager = {a_ms / e_ms:.2f}; below 1 is faster)")
    print(f"timed adaptive steps: {steady.count('compiled')} compiled, {steady.count('replayed')} replayed")

    # Replayed steps run eager's kernels in eager's order: bitwise equal, as long as no compiled
    # code has run. Once a step ran compiled (a region or a captured call), Inductor's fused kernels
    # round differently and the parameters it wrote differ in their last bits, so from there on,
    # replayed steps included, the two runs agree within float tolerance (and drift apart slowly,
    # as any two correct implementations do).
    first_compiled = kinds.index("compiled") if "compiled" in kinds else len(kinds)
    same = eager.losses[:first_compiled] == lazy.losses[:first_compiled]
    print(f"losses of the {first_compiled} replayed step(s) before the first compiled one: bitwise equal to eager: {same}")
    if not same:
        raise SystemExit("replayed steps differ from eager: this is a bug in adaptive eager")
    diff = max(abs(a - b) / max(abs(a), 1e-6) for a, b in zip(eager.losses, lazy.losses))
    print(f"all {len(eager.losses)} steps: final loss  eager {eager.losses[-1]:.6f}   adaptive eager "
          f"{lazy.losses[-1]:.6f}   largest relative loss difference {diff:.1e}")
    torch.testing.assert_close(torch.tensor(lazy.losses), torch.tensor(eager.losses), rtol=1e-3, atol=1e-5)
    print()
    print(ae.report(explain=True))


if __name__ == "__main__":
    main()
