"""Garbage-collector pauses in a recorded training loop: the mean step hides them less than the median.

    python benchmarks/gc_pauses.py [--steps 60] [--rounds 2]

The suite's AdamW workload (foreach=False, 200 parameters of 256 floats, ~2000 recorded ops per
step) under adaptive eager in compiled steady state, with ``tune_gc`` on (the default: Note [GC
threshold] in ``adaptive_eager/_gc.py``) and off, alternating in one process. Each round builds a
fresh workload per variant, warms it up, then times ``--steps`` steps one by one. A full
collection every few steps shows in the mean and the max, not in the median.
"""

from __future__ import annotations

import argparse
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
    args = parser.parse_args()
    print("| round | tune_gc | mean ms | median ms | max ms |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for r in range(args.rounds):
        for tune in (True, False):
            wl = build_adamw("cpu")
            with ae.adaptive_eager(**ADAPTIVE_OPTIONS, tune_gc=tune):
                for _ in range(8):  # replay, scalar lifting, compile: steady state after
                    wl.adaptive()
                    ae.sync()
                times = []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    wl.adaptive()
                    ae.sync()
                    times.append(time.perf_counter() - t0)
            ms = [t * 1e3 for t in times]
            print(f"| {r + 1} | {tune} | {statistics.mean(ms):.1f} | {statistics.median(ms):.1f} | {max(ms):.1f} |")


if __name__ == "__main__":
    main()
