"""Host time of one flush that hits a compiled region: the suite's 1000-tiny-op loop, many flushes.

    python benchmarks/flush_cost.py [--flushes 300] [--profile]

The suite times a flush over few iterations per sample; this script times each of ``--flushes``
flushes (the library's own ``metrics()["flush_seconds"]``, garbage collection off, the loop's
window compiled and warm) and prints the median, which is steadier on a shared machine. The time
includes freeing the window (placeholders, nodes) and running the compiled region. It is measured
for hot windows (recorded against the region's template: Note [Hot windows] in adaptive_eager._hot)
and for windows recorded in full. ``--profile`` prints instead where the host time of the hot
flushes goes (cProfile, the functions with the most time of their own).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import adaptive_eager as ae  # noqa: E402
from workloads import tiny_loop  # noqa: E402


def profile(flushes: int) -> None:
    """cProfile of ``flushes`` hot flushes of the 1000-op loop's window (``--profile``)."""
    import cProfile
    import pstats

    x, w = torch.randn(16), torch.randn(16)
    prof = cProfile.Profile()
    with ae.adaptive_eager(backend="inductor", async_compile=False):
        for _ in range(5):
            y = tiny_loop(x, w)
            ae.sync()
        gc.disable()
        try:
            for _ in range(flushes):
                y = tiny_loop(x, w)
                prof.enable()
                ae.sync()
                prof.disable()
        finally:
            gc.enable()
    del y
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


def measure(flushes: int, hot_windows: bool) -> tuple[float, int]:
    """Median flush seconds and compiled runs of ``flushes`` flushes of the 1000-op loop's window."""
    x, w = torch.randn(16), torch.randn(16)
    times: list[float] = []
    with ae.adaptive_eager(backend="inductor", async_compile=False, tiers="hot" if hot_windows else "regions"):
        for _ in range(5):  # replay, compile (or load), then compiled hits
            y = tiny_loop(x, w)  # kept: a result nobody holds is dead code, nothing would run
            ae.sync()
        hits = ae.metrics()["compiled_runs"]
        hot = ae.metrics()["hot_windows"]
        gc.disable()
        try:
            for _ in range(flushes):
                y = tiny_loop(x, w)
                before = ae.metrics()["flush_seconds"]
                ae.sync()  # one flush
                times.append(ae.metrics()["flush_seconds"] - before)
        finally:
            gc.enable()
        hits = ae.metrics()["compiled_runs"] - hits
        hot = ae.metrics()["hot_windows"] - hot
    torch.testing.assert_close(y, tiny_loop(x, w))
    assert hot == (flushes if hot_windows else 0), (hot, ae.metrics()["hot_mismatches"])
    return statistics.median(times), hits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flushes", type=int, default=300)
    parser.add_argument("--profile", action="store_true", help="profile the hot flushes instead of timing them")
    args = parser.parse_args()
    if args.profile:
        profile(args.flushes)
        return
    for hot_windows in (True, False):
        median, hits = measure(args.flushes, hot_windows)
        kind = "hot windows (validated, run without a key)" if hot_windows else "recorded in full (tiers='regions')"
        print(f"1000-op window, flush hitting a compiled region, {kind}: median {median * 1e3:.3f} ms "
              f"over {args.flushes} flushes ({hits} compiled runs)")


if __name__ == "__main__":
    main()
