"""Host time of one flush that hits a compiled region: the suite's 1000-tiny-op loop, many flushes.

    python benchmarks/flush_cost.py [--flushes 300]

The suite times a flush over few iterations per sample; this script times each of ``--flushes``
flushes (the library's own ``metrics()["flush_seconds"]``, garbage collection off, the loop's
window compiled and warm) and prints the median, which is steadier on a shared machine. The time
includes freeing the window (placeholders, nodes) and running the compiled region.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flushes", type=int, default=300)
    args = parser.parse_args()
    x, w = torch.randn(16), torch.randn(16)
    times: list[float] = []
    with ae.adaptive_eager(backend="inductor", async_compile=False):
        for _ in range(5):  # replay, compile (or load), then compiled hits
            y = tiny_loop(x, w)  # kept: a result nobody holds is dead code, nothing would run
            ae.sync()
        hits = ae.metrics()["compiled_runs"]
        gc.disable()
        try:
            for _ in range(args.flushes):
                y = tiny_loop(x, w)
                before = ae.metrics()["flush_seconds"]
                ae.sync()  # one flush
                times.append(ae.metrics()["flush_seconds"] - before)
        finally:
            gc.enable()
        hits = ae.metrics()["compiled_runs"] - hits
    torch.testing.assert_close(y, tiny_loop(x, w))
    print(f"1000-op window, flush hitting a compiled region: median {statistics.median(times) * 1e3:.3f} ms "
          f"over {len(times)} flushes ({hits} compiled runs)")


if __name__ == "__main__":
    main()
