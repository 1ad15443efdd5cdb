"""Where a training step's time goes, phase by phase: eager against adaptive eager, interleaved.

    python benchmarks/step_parts.py [--workload mlp|gpt] [--threads 2] [--repeats 10] [--iters 10]
                                    [--option NAME=VALUE ...]

The suite's MLP train step (``workloads.build_mlp_train``: 3x Linear(1024, 1024), batch 64, SGD)
or, with ``--workload gpt``, its GPT block train step (``workloads.build_gpt``: d256, 4 heads,
seq 128, batch 8, AdamW), timed per phase with ``perf_counter`` around each call of the step: ``zero_grad``, the forward
(with the loss), ``backward``, ``opt.step()`` and the final ``ae.sync()``. Under adaptive eager the
forward and backward only record; the window runs at ``opt.step()`` (its flush, whose time
``metrics()["flush_seconds"]`` gives, is split out of the step's), and ``region`` is the compiled
region's own call inside that flush (``fuser.launch._run_compiled``: the kernels and the binding
of their outputs). Medians over ``--repeats`` interleaved samples of ``--iters`` steps each; the
minor page faults per step (``getrusage``) say how often the step touched memory the allocator
had just given back to the system (Note [Placeholder memory at a compiled run] in fuser.replay).
"""

from __future__ import annotations

import argparse
import ast
import copy
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import adaptive_eager as ae  # noqa: E402
import fuser.launch  # noqa: E402
from workloads import ADAPTIVE_OPTIONS, GPTBlock  # noqa: E402

PHASES = ("zero_grad", "forward", "backward", "step", "flush", "region", "sync")
_REGION: list[float] = []


def _timed_region(run):
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return run(*args, **kwargs)
        finally:
            _REGION.append(time.perf_counter() - t0)
    return timed


def make_step(model, x, y, times, make_opt):
    opt = make_opt(model.parameters())
    clock = time.perf_counter

    def step():
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        a = clock()
        opt.zero_grad(set_to_none=True)
        b = clock()
        loss = F.mse_loss(model(x), y)
        c = clock()
        loss.backward()
        d = clock()
        flushed, regions = ae.metrics()["flush_seconds"], len(_REGION)
        opt.step()
        e = clock()
        ae.sync()
        f = clock()
        times["faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
        flush = ae.metrics()["flush_seconds"] - flushed
        for name, v in (("zero_grad", b - a), ("forward", c - b), ("backward", d - c), ("step", e - d - flush),
                        ("flush", flush), ("region", sum(_REGION[regions:])), ("sync", f - e)):
            times[name].append(v)
        return loss
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("mlp", "gpt"), default="mlp")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="an adaptive_eager() option over the suite's, e.g. tiers=hot")
    args = parser.parse_args()
    options = dict(ADAPTIVE_OPTIONS)
    for item in args.option:
        name, _, value = item.partition("=")
        options[name] = ast.literal_eval(value)
    torch.set_num_threads(args.threads)
    fuser.launch._run_compiled = _timed_region(fuser.launch._run_compiled)
    torch.manual_seed(0)
    if args.workload == "mlp":
        base = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                   torch.nn.ReLU(), torch.nn.Linear(1024, 1024))
        x, y = torch.randn(64, 1024), torch.randn(64, 1024)
        make_opt = lambda params: torch.optim.SGD(params, lr=0.01)  # noqa: E731
    else:
        base = GPTBlock()
        x, y = torch.randn(8, 128, 256), torch.randn(8, 128, 256)
        make_opt = lambda params: torch.optim.AdamW(params, lr=1e-3)  # noqa: E731
    times = {name: {p: [] for p in (*PHASES, "faults")} for name in ("eager", "adaptive")}
    eager = make_step(copy.deepcopy(base), x, y, times["eager"], make_opt)
    adaptive = make_step(copy.deepcopy(base), x, y, times["adaptive"], make_opt)
    with ae.adaptive_eager(**options):
        for _ in range(8):  # to the compiled steady state
            adaptive()
    for _ in range(3):
        eager()
    for t in times.values():
        for v in t.values():
            v.clear()
    for _ in range(args.repeats):
        for _ in range(args.iters):
            eager()
        with ae.adaptive_eager(**options):
            for _ in range(args.iters):
                adaptive()
    load = os.getloadavg()[0]
    print(f"python benchmarks/step_parts.py --workload {args.workload} --threads {args.threads} --repeats {args.repeats} --iters {args.iters}"
          f"; torch {torch.__version__}, load {load:.1f}; ms per step, medians")
    print("| phase | eager | adaptive |")
    print("| --- | ---: | ---: |")
    totals = {}
    for p in PHASES:
        row = []
        for name in ("eager", "adaptive"):
            v = statistics.median(times[name][p]) * 1e3
            row.append(v)
        print(f"| {p} | {row[0]:.3f} | {row[1]:.3f} |")
    for name in ("eager", "adaptive"):
        totals[name] = sum(statistics.median(times[name][p]) for p in PHASES if p != "region") * 1e3
    print(f"| total (the phases but region) | {totals['eager']:.2f} | {totals['adaptive']:.2f} |")
    print(f"adaptive / eager time: {totals['adaptive'] / totals['eager']:.3f}")
    faults = [statistics.median(times[name]["faults"]) for name in ("eager", "adaptive")]
    print(f"minor page faults per step (medians): eager {faults[0]:.0f}, adaptive {faults[1]:.0f}")


if __name__ == "__main__":
    main()
