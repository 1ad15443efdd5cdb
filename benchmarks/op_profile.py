"""Where one suite workload's time goes, op by op: eager vs adaptive eager under torch.profiler.

    python benchmarks/op_profile.py mlp_train [--iters 10] [--top 10]

Builds the workload as ``benchmarks/suite.py`` does (same sizes), warms adaptive eager up to its
compiled steady state, then profiles ``--iters`` iterations of each variant in this process and
prints, per variant, the ops with the most self CPU time per iteration. Under adaptive eager,
``adaptive_eager.record`` is the recording of ops, ``adaptive_eager.region[...]`` a compiled
region's own code (Inductor kernels; extern kernels such as ``aten::mm`` are listed apart), and
ops appear once more at dispatch (recorded, not run: their self time is ~0), and the total
time inside the ``adaptive_eager.region[...]`` ranges is printed as the compiled regions' share.
Also prints the wall time per iteration of each variant and of adaptive eager's flushes alone
(``metrics()["flush_seconds"]``: on cpu the compiled regions' compute and the binding of their
outputs), eager and adaptive interleaved, medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from torch.profiler import ProfilerActivity, profile  # noqa: E402

import adaptive_eager as ae  # noqa: E402
from workloads import ADAPTIVE_OPTIONS, BUILDERS, Workload  # noqa: E402

REGION_RANGE = "adaptive_eager.region["  # the library's profiler range around a compiled region's run


def adaptive_iteration(wl: Workload) -> None:
    out = wl.adaptive()
    ae.sync()  # with the result held: a result nobody holds is dead code, and nothing would run
    del out


def interleaved(wl: Workload, iters: int, repeats: int, options: dict = ADAPTIVE_OPTIONS) -> dict[str, float]:
    """Seconds per iteration of eager, adaptive and adaptive's flushes alone: medians of
    ``repeats`` interleaved samples of ``iters`` iterations."""
    times: dict[str, list[float]] = {"eager": [], "adaptive": [], "adaptive flushes alone": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            wl.eager()
        times["eager"].append((time.perf_counter() - t0) / iters)
        with ae.adaptive_eager(**options):
            flushed = ae.metrics()["flush_seconds"]
            t0 = time.perf_counter()
            for _ in range(iters):
                adaptive_iteration(wl)
            times["adaptive"].append((time.perf_counter() - t0) / iters)
            times["adaptive flushes alone"].append((ae.metrics()["flush_seconds"] - flushed) / iters)
    return {name: statistics.median(v) for name, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=sorted(BUILDERS))
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    wl = BUILDERS[args.workload]("cpu")
    with ae.adaptive_eager(**ADAPTIVE_OPTIONS):
        for _ in range(8):  # to the compiled steady state (the suite checks it; see its warm-up)
            adaptive_iteration(wl)
    for _ in range(3):
        wl.eager()

    times = interleaved(wl, args.iters, args.repeats)
    print(f"{wl.title}: ms per {wl.unit}, medians of {args.repeats} interleaved samples of {args.iters}")
    for name, v in times.items():
        print(f"  {name:<24}{v * 1e3:9.2f}")

    for name in ("eager", "adaptive"):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            if name == "eager":
                for _ in range(args.iters):
                    wl.eager()
            else:
                with ae.adaptive_eager(**ADAPTIVE_OPTIONS):
                    for _ in range(args.iters):
                        adaptive_iteration(wl)
        averages = prof.key_averages()
        events = sorted(averages, key=lambda e: -e.self_cpu_time_total)[: args.top]
        print(f"\n{name}: self CPU ms per {wl.unit} (calls per {wl.unit})")
        for e in events:
            print(f"  {e.key[:64]:<64}{e.self_cpu_time_total / args.iters / 1e3:9.3f}  ({e.count / args.iters:g})")
        if name == "adaptive":
            regions = [e for e in averages if e.key.startswith(REGION_RANGE)]
            print(f"  compiled regions, total CPU ms per {wl.unit} (calls per {wl.unit}): "
                  f"{sum(e.cpu_time_total for e in regions) / args.iters / 1e3:.3f}  "
                  f"({sum(e.count for e in regions) / args.iters:g})")


if __name__ == "__main__":
    main()
