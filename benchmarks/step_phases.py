"""A training step phase by phase: eager, adaptive eager and torch.compile + step, in one process.

``torch.compile + step`` compiles the model and ``opt.step`` (PyTorch's "compiling the optimizer"
recipe).

    python benchmarks/step_phases.py [--only rnn,cnn] [--rounds 7] [--steps 100]

Per workload of ``benchmarks/user_step.py`` (default options, one ``with adaptive_eager():``
around each adaptive round): each variant trains until adaptive eager's step runs compiled and no
compile of ours runs beside it (``fuser.artifacts.compiling()``: while one runs, the ops we run use
fewer intra-op threads, Note [Cores beside a compile]), then ``--rounds`` rounds of ``--steps``
steps, the variants interleaved within each round, each phase of each step timed on its own:
the model's call, the loss, ``loss.backward()``, ``opt.step()``, ``opt.zero_grad()`` and
``loss.item()``. Prints each phase's median over the rounds (of each round's median), in us, and
adaptive eager's time over ``torch.compile + step``'s. ``user_step.py`` times whole steps, variant
after variant; interleaving in one process takes the machine's load swings out of the ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import adaptive_eager as ae

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import user_step  # noqa: E402 - the workloads and variants

PHASES = ("model", "loss", "backward", "step", "zero_grad", "item", "total")


def _phases(variant, steps: int) -> list[float]:
    clock = time.perf_counter
    rows = []
    ctx = variant.context() if variant.context else user_step._null()
    model, opt = variant.model, variant.opt
    calls = []

    def traced(*args, **kwargs):  # the loss function's model call, timed apart from its loss
        t = clock()
        out = model(*args, **kwargs)
        calls.append(clock() - t)
        return out

    with ctx:
        for _ in range(steps):
            calls.clear()
            t0 = clock()
            loss = variant.loss_of(traced)
            t1 = clock()
            loss.backward()
            t2 = clock()
            opt.step()
            t3 = clock()
            opt.zero_grad()
            t4 = clock()
            loss.item()
            t5 = clock()
            rows.append((calls[0], t1 - t0 - calls[0], t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0))
    return [statistics.median(column) * 1e6 for column in zip(*rows)]


def measure(name: str, rounds: int, steps: int) -> None:
    from fuser.artifacts import compiling

    build = user_step.WORKLOADS[name]
    variants = [user_step.Variant("eager", "cpu", build),
                user_step.Variant("adaptive", "cpu", build, context=ae.adaptive_eager),
                user_step.Variant("torch.compile + step", "cpu", build, wrap=torch.compile, compile_step=True)]
    adaptive = variants[1]
    for v in variants:
        v.run(30)
    start = time.time()
    quiet = 0  # checks in a row with the step compiled and no compile running: a compile that a step
    # submits only once another landed can start between one check and the timing
    while quiet < 2 and time.time() - start < 300:
        adaptive.run(10)
        time.sleep(0.2)
        quiet = quiet + 1 if adaptive.compiled_at is not None and not compiling() else 0
    if adaptive.compiled_at is None:
        print(f"{name}: adaptive eager not compiled after {time.time() - start:.0f} s; skipped")
        return
    for v in variants:
        if v.error:
            print(f"{name}: {v.name} failed: {v.error}")
            return
    results = {v.name: [] for v in variants}
    for _ in range(rounds):
        for v in variants:
            results[v.name].append(_phases(v, steps))
    med = {k: [statistics.median(c) for c in zip(*rows)] for k, rows in results.items()}
    print(f"\n{name} ({rounds} rounds of {steps} steps, us, medians; compiled from step {adaptive.compiled_at})\n")
    print("| phase | eager | adaptive | torch.compile + step | adaptive / torch.compile + step |")
    print("| --- | ---: | ---: | ---: | ---: |")
    tc = med["torch.compile + step"]
    for i, phase in enumerate(PHASES):
        print(f"| {phase} | {med['eager'][i]:.0f} | {med['adaptive'][i]:.0f} | {tc[i]:.0f} | {med['adaptive'][i] / tc[i]:.3f} |")
    ratios = [a[-1] / t[-1] for a, t in zip(results["adaptive"], results["torch.compile + step"])]
    print(f"\nper round, total adaptive / torch.compile + step: {', '.join(f'{r:.3f}' for r in ratios)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="blocks8,rnn,cnn")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    print(f"python benchmarks/step_phases.py --only {args.only} --rounds {args.rounds} --steps {args.steps}"
          f"  (torch {torch.__version__}, default options)")
    for name in args.only.split(","):
        measure(name, args.rounds, args.steps)


if __name__ == "__main__":
    main()
