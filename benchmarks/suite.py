"""Performance suite: plain eager vs adaptive eager (steady state) vs torch.compile, in one process.

    python benchmarks/suite.py [--device cpu|cuda] [--repeats N] [--quick] [--write]
                               [--only KEYS] [--profile KEY]

Every workload runs in three variants (plus references where the brief names one), interleaved
(eager, adaptive, compile, eager, adaptive, compile, ...), and the MEDIAN of the repeats is
reported, since absolute times drift on a shared machine. Each timed sample runs ``iters``
iterations (calibrated so a sample lasts ~0.3 s) and ends with a synchronization that makes the
work happen: ``ae.sync()`` after every adaptive iteration (the window is part of the timed work),
``torch.cuda.synchronize()`` at the end of every sample on cuda. The flush time per iteration is
the library's ``metrics()["flush_seconds"]``.

Adaptive eager is measured in steady state: it is warmed up until an iteration runs every window
compiled with no new compile (``compiled_runs`` grows, ``replayed_regions`` and
``compiles`` do not), or for a bounded number of iterations; a workload that never gets
there is reported as such. torch.compile is warmed up (compiled) outside timing.

Launches per iteration come from ``ae.metrics()`` deltas over the timed samples
(``eager_equivalent_launches`` -> ``launches``; device launches leave out ``host_scalar_ops`` on
both sides). As a cross-check that does not trust the
library's own counters, one extra untimed iteration of each variant is profiled and its kernels are
counted: on cuda the device kernels/memcpys the profiler sees; on cpu the leaf ATen compute ops
(allocation and view ops excluded) plus the calls into Inductor-built C++ kernels (``.so``
functions, counted with ``sys.setprofile``); for adaptive only what runs inside a flush, plus the
ops the tracer ran eagerly (``ops_eager``).

``--write`` puts the tables, the targets with PASS/FAIL, the command and the machine into
``benchmarks/RESULTS.md`` between ``<!-- suite:begin -->`` and ``<!-- suite:end -->`` (cuda:
``suite-cuda``; other sections of that file are kept) and saves ``benchmarks/results.png``
(``results_cuda.png``).
``--profile KEY`` runs one workload's adaptive variant in steady state under cProfile instead.

The workloads are in ``workloads.py``, how they are measured in ``measure.py``, the tables and
RESULTS.md sections in ``report.py``; this file is the command line.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# measure first: it quiets the profiler's log before torch loads
from measure import Result, Runner, load, log, machine_info, run_workload, short_error  # noqa: E402, I001
import torch  # noqa: E402

import adaptive_eager as ae  # noqa: E402
from report import (RESULTS_MD, detail_table, errors_md, main_table, plot, png_name, section_md,  # noqa: E402
                    suite_section, targets, targets_md, write_section)
from workloads import BUILDERS  # noqa: E402


def profile_adaptive(runner: Runner, key: str, iters: int) -> None:
    wl = BUILDERS[key](runner.device)
    warm = runner.warm_adaptive(wl.adaptive)
    log(f"{key}: adaptive {warm['state']} after {warm['iterations']} iterations; profiling {iters} iterations")
    prof = cProfile.Profile()
    with runner.adaptive():
        prof.enable()
        for _ in range(iters):
            out = wl.adaptive()
            ae.sync()
        runner.barrier()
        prof.disable()
        del out
    pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(35)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="fewer repeats and warm-up iterations (same sizes)")
    parser.add_argument("--write", action="store_true", help="write benchmarks/RESULTS.md and results.png")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {','.join(BUILDERS)}")
    parser.add_argument("--profile", default="", help="cProfile one workload's adaptive steady state instead")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False")
    repeats = min(args.repeats, 3) if args.quick else args.repeats
    runner = Runner(args.device, repeats, max_warm=8 if args.quick else 10)
    if args.profile:
        profile_adaptive(runner, args.profile, iters=20)
        return
    keys = [k.strip() for k in args.only.split(",") if k.strip()] or list(BUILDERS)
    unknown = [k for k in keys if k not in BUILDERS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {list(BUILDERS)}")
    command = " ".join(["python", "benchmarks/suite.py", *sys.argv[1:]])
    info = machine_info(args.device)
    log(f"device {args.device}, repeats {repeats}, workloads {keys}; {info}")
    t_start = time.perf_counter()
    results = []
    for key in keys:
        try:
            results.append(run_workload(runner, key, BUILDERS[key]))
        except Exception as e:  # noqa: BLE001 - a broken builder must not hide the other workloads
            traceback.print_exc()
            r = Result(key, key, "iter")
            r.errors["build"] = short_error(e)
            results.append(r)
    wall = time.perf_counter() - t_start
    print(main_table(results))
    print()
    print(detail_table(results))
    print()
    print(targets_md(targets(results)))
    errs = errors_md(results)
    if errs:
        print("\nErrors:\n" + errs)
    info["load at end"] = load()
    print(f"\n{command}: {wall / 60:.1f} min; {', '.join(f'{k} {v}' for k, v in info.items())}")
    if args.write:
        write_section(suite_section(args.device), section_md(results, command, info, wall, repeats))
        png = os.path.join(os.path.dirname(RESULTS_MD), png_name(args.device))
        try:
            plot(results, png, args.device)
        except Exception as e:  # noqa: BLE001 - the markdown is written either way
            log(f"wrote {RESULTS_MD}; the plot failed ({short_error(e)}), so {png} is unchanged: install the "
                "bench extra: pip install matplotlib")
        else:
            log(f"wrote {RESULTS_MD} and {png}")


if __name__ == "__main__":
    main()

