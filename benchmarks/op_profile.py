"""Where one suite workload's time goes, op by op: eager vs adaptive eager under torch.profiler.

    python benchmarks/op_profile.py mlp_train [--iters 10] [--top 10]

Builds the workload as ``benchmarks/suite.py`` does (same sizes), warms adaptive eager up to its
compiled steady state, then profiles ``--iters`` iterations of each variant in this process and
prints, per variant, the ops with the most self CPU time per iteration. Under adaptive eager,
``adaptive_eager.record`` is the recording of ops, ``adaptive_eager.region[...]`` a compiled
region's own code (Inductor kernels; extern kernels such as ``aten::mm`` are listed apart), and
ops appear once more at dispatch (recorded, not run: their self time is ~0). Also prints the
wall time per iteration of each variant and of the compiled regions alone (a timer around
``fuser.regions._run_compiled``), eager and adaptive interleaved, medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import adaptive_eager as ae  # noqa: E402
import fuser.regions  # noqa: E402
from suite import BUILDERS  # noqa: E402

OPTIONS = dict(backend="inductor", hot_after=2, async_compile=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=sorted(BUILDERS))
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    wl = BUILDERS[args.workload]("cpu")

    def adaptive_iter():
        wl.adaptive()
        ae.sync()

    with ae.adaptive_eager(**OPTIONS):
        for _ in range(8):  # to the compiled steady state (the suite checks it; see its warm-up)
            adaptive_iter()
    for _ in range(3):
        wl.eager()

    region: list[float] = []
    run_compiled = fuser.regions._run_compiled

    def timed(*a):
        t0 = time.perf_counter()
        try:
            return run_compiled(*a)
        finally:
            region.append(time.perf_counter() - t0)

    fuser.regions._run_compiled = timed
    times: dict[str, list[float]] = {"eager": [], "adaptive": [], "compiled regions alone": []}
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for _ in range(args.iters):
            wl.eager()
        times["eager"].append((time.perf_counter() - t0) / args.iters)
        region.clear()
        with ae.adaptive_eager(**OPTIONS):
            t0 = time.perf_counter()
            for _ in range(args.iters):
                adaptive_iter()
            times["adaptive"].append((time.perf_counter() - t0) / args.iters)
        times["compiled regions alone"].append(sum(region) / args.iters)
    fuser.regions._run_compiled = run_compiled
    print(f"{wl.title}: ms per {wl.unit}, medians of {args.repeats} interleaved samples of {args.iters}")
    for name, v in times.items():
        print(f"  {name:<24}{statistics.median(v) * 1e3:9.2f}")

    for name in ("eager", "adaptive"):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            if name == "eager":
                for _ in range(args.iters):
                    wl.eager()
            else:
                with ae.adaptive_eager(**OPTIONS):
                    for _ in range(args.iters):
                        adaptive_iter()
        events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[: args.top]
        print(f"\n{name}: self CPU ms per {wl.unit} (calls per {wl.unit})")
        for e in events:
            print(f"  {e.key[:64]:<64}{e.self_cpu_time_total / args.iters / 1e3:9.3f}  ({e.count / args.iters:g})")


if __name__ == "__main__":
    main()
