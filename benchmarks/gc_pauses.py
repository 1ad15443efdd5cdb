"""Garbage-collector pauses in a recorded training loop: the mean step hides them less than the median.

    python benchmarks/gc_pauses.py [--steps 60] [--rounds 2] [--recorded]

The suite's AdamW workload (foreach=False, 200 parameters of 256 floats, ~2000 recorded ops per
step) under adaptive eager in compiled steady state, with the raised generation-0 threshold (Note
[GC threshold] in ``adaptive_eager/_gc.py``, always on) and with CPython's default one, which the
program sets itself inside the block (a program's own threshold is kept), alternating in one
process. Each round builds a fresh workload per variant, warms it up, then times ``--steps`` steps
one by one. A full collection every few steps shows in the mean and the max, not in the median.
By default ``opt.step()`` is captured (one guarded call, few objects); ``--recorded`` turns the
capture off so that its ~2000 ops are recorded into windows, the case the threshold is for.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import adaptive_eager as ae  # noqa: E402
from workloads import ADAPTIVE_OPTIONS, build_adamw  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--recorded", action="store_true", help="tiers=hot: the step's ops are recorded, not captured")
    args = parser.parse_args()
    options = dict(ADAPTIVE_OPTIONS, tiers="hot") if args.recorded else ADAPTIVE_OPTIONS
    print("| round | gen-0 threshold | mean ms | median ms | max ms |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for r in range(args.rounds):
        for tune in (True, False):
            wl = build_adamw("cpu")
            saved = gc.get_threshold()
            with ae.adaptive_eager(**options):
                if not tune:
                    gc.set_threshold(700, saved[1], saved[2])  # CPython's default, the program's own
                threshold = gc.get_threshold()[0]
                for _ in range(8):  # replay, scalar lifting, compile: steady state after
                    wl.adaptive()
                    ae.sync()
                times = []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    wl.adaptive()
                    ae.sync()
                    times.append(time.perf_counter() - t0)
            gc.set_threshold(*saved)
            ms = [t * 1e3 for t in times]
            print(f"| {r + 1} | {threshold} | {statistics.mean(ms):.1f} | {statistics.median(ms):.1f} | {max(ms):.1f} |")


if __name__ == "__main__":
    main()
