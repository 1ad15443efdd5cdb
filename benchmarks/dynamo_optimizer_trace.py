"""Dynamo's trace of an optimizer step alone, by variant: what stays of the optimizer capture in a
process whose capture is built from a record (Note [Captures from the cache] in adaptive_eager._capture).

    python benchmarks/dynamo_optimizer_trace.py [default|foreach|no_gc ...] [--repeats 5]

AdamW over the 8-block model's 34 parameters (``user_step.py``'s), CPU, its state made by one step
first as at a capture. Each variant's step body is traced with ``fullgraph`` and a backend that
returns the graph as it is (no AOTAutograd, no compile), after ``torch._dynamo.reset()``; the
variants are interleaved, and the minimum of the main thread's CPU time is printed (the wall time
on a shared machine is mostly the load). ``default``: torch's default (the per-parameter loop on
CPU); ``foreach``: ``foreach=True``; ``no_gc``: Dynamo's ``run_gc_after_compile`` off.
"""

from __future__ import annotations

import argparse
import inspect
import os
import time

import torch
import torch._dynamo
import torch.nn as nn

VARIANTS = {"default": ({}, None), "foreach": ({}, True), "no_gc": ({"run_gc_after_compile": False}, None)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*",
                        help=f"any of {', '.join(VARIANTS)} (default: all)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats (default 5)")
    args = parser.parse_args()
    unknown = [n for n in args.variants if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant {unknown[0]!r}: choose from {', '.join(VARIANTS)}")
    names = args.variants or list(VARIANTS)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU()]
    params = list(nn.Sequential(*layers, nn.Linear(64, 1)).parameters())
    nodes: dict[str, int] = {}

    def trace(name):
        config, foreach = VARIANTS[name]
        opt = torch.optim.AdamW(params, foreach=foreach)
        for p in params:
            p.grad = torch.full_like(p, 0.1)
        opt.step()
        body = inspect.unwrap(type(opt).step)  # the step without its grad-mode wrapper's graph break

        def backend(gm, _):
            nodes[name] = len(gm.graph.nodes)
            return gm.forward

        torch._dynamo.reset()
        fn = torch.compile(lambda: body(opt), backend=backend, fullgraph=True)
        with torch._dynamo.config.patch(**config), torch.no_grad():
            c0 = time.thread_time()
            fn()
            return time.thread_time() - c0

    trace(names[0])  # the imports
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.repeats):
        for n in names:
            cpu[n].append(trace(n))
    for n in names:
        print(f"{n:8s} {nodes[n]:4d} graph nodes, trace CPU min {min(cpu[n]):.2f} s "
              f"median {sorted(cpu[n])[len(cpu[n]) // 2]:.2f} s")
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
