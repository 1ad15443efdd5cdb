"""Cost per recorded op: a loop of tiny ops, plain eager vs an empty TorchDispatchMode vs recording.

    python benchmarks/record_overhead.py [--ops 2000] [--repeats 15] [--inplace | --step]

All variants run in one process, interleaved, and the median of the repeats is reported, since
absolute times drift on a shared machine. "record" is the time to record the ops in full
(``tiers="regions"``; the window is flushed outside the timed region); "record+replay" includes
running the window op by op. "hot window" records the same window once its compiled region exists,
against that region's template (Note [Hot windows] in adaptive_eager._hot); "hot window+run"
includes the flush that runs the region. ``--inplace`` times optimizer-style in-place updates
instead (``mul_``, ``add_(alpha=)``, ``addcmul_(value=)``, ``lerp_``): ops that write and return their first argument.
``--step`` times a training step's window instead of a loop: the forward and backward of the suite's
GPT block (``workloads.GPTBlock``) at tiny sizes (d 16, 4 heads, seq 8, batch 2), so that the empty
mode's time is its interception and the model's own Python rather than kernels. Its ~140
intercepted ops are what a real window holds: 60% views (``t``, ``detach``, ``view``,
``transpose``, ``expand``), ops of several outputs (``split``, ``native_layer_norm`` and its
backward), lists (``cat``); per-op figures divide by the ops a step intercepts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import adaptive_eager as ae  # noqa: E402
from measure import EmptyMode  # noqa: E402
from workloads import GPTBlock, inplace_ops, tiny_ops  # noqa: E402


def measure(ops: int, repeats: int, inplace: bool = False) -> dict[str, float]:
    x, w = torch.randn(16), torch.randn(16)
    run = tiny_ops
    if inplace:
        run = inplace_ops
        x, w = torch.randn(16) * 0.01, torch.randn(16) * 0.01
    samples: dict[str, list[float]] = {"eager": [], "empty mode": [], "record": [], "record+replay": [],
                                       "hot window": [], "hot window+run": []}
    full = dict(window=ops + 10, backend="replay", tiers="regions")
    hot = dict(window=ops + 10, backend="inductor", async_compile=False)
    with ae.adaptive_eager(**full):  # warm the metadata cache once
        run(x, w, ops)
    with ae.adaptive_eager(**hot):  # compile the window's region: the hot rows record against it
        for _ in range(4):
            y = run(x, w, ops)
            ae.sync()
    for _ in range(repeats):
        t0 = time.perf_counter()
        run(x, w, ops)
        samples["eager"].append(time.perf_counter() - t0)

        with EmptyMode():
            t0 = time.perf_counter()
            run(x, w, ops)
            samples["empty mode"].append(time.perf_counter() - t0)

        for name, options in (("record", full), ("hot window", hot)):
            with ae.adaptive_eager(**options):
                t0 = time.perf_counter()
                y = run(x, w, ops)
                t1 = time.perf_counter()
                ae.sync()
                t2 = time.perf_counter()
            samples[name].append(t1 - t0)
            samples[name + ("+replay" if name == "record" else "+run")].append(t2 - t0)
            del y
    hot_windows = ae.metrics()["hot_windows"]
    if hot_windows < repeats:
        raise SystemExit(f"only {hot_windows} of {repeats} hot-window samples ran hot: {ae.metrics()['hot_mismatches']}")
    return {k: statistics.median(v) / ops * 1e6 for k, v in samples.items()}


def measure_step(repeats: int, steps: int = 10) -> tuple[dict[str, float], int]:
    """``measure`` for a training step's window (``--step``): per step, the forward and backward of a
    tiny GPT block, timed to the end of ``backward()`` (the "+run" rows to the end of the flush)."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = GPTBlock(d=16, heads=4, seq=8)
    x, y = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    params = list(model.parameters())

    def step():
        for p in params:
            p.grad = None
        F.mse_loss(model(x), y).backward()

    samples: dict[str, list[float]] = {"eager": [], "empty mode": [], "record": [], "record+replay": [],
                                       "hot window": [], "hot window+run": []}
    full = dict(backend="replay", tiers="regions")
    # hot windows, not captures: under the default tiers the step is one captured call (Note
    # [Training captured at once] in adaptive_eager._capture), and no op of it is recorded
    hot = dict(backend="inductor", async_compile=False, tiers="hot")
    with ae.adaptive_eager(**full):  # warm the metadata cache once
        step()
    with ae.adaptive_eager(**hot):  # compile the window's region: the hot rows record against it
        for _ in range(4):
            step()
            ae.sync()
    intercepted = [0]

    class Counting(EmptyMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            intercepted[0] += 1
            return func(*args, **(kwargs or {}))

    with Counting():  # what a step intercepts
        step()
    ops = intercepted[0]
    before = ae.metrics()["hot_windows"]
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        samples["eager"].append((time.perf_counter() - t0) / steps)
        with EmptyMode():
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            samples["empty mode"].append((time.perf_counter() - t0) / steps)
        for name, options in (("record", full), ("hot window", hot)):
            recorded = ran = 0.0
            with ae.adaptive_eager(**options):
                for _ in range(steps):
                    t0 = time.perf_counter()
                    step()
                    t1 = time.perf_counter()
                    ae.sync()
                    t2 = time.perf_counter()
                    recorded += t1 - t0
                    ran += t2 - t0
            samples[name].append(recorded / steps)
            samples[name + ("+replay" if name == "record" else "+run")].append(ran / steps)
    hot_windows = ae.metrics()["hot_windows"] - before
    if hot_windows < repeats * steps:
        raise SystemExit(f"only {hot_windows} of {repeats * steps} hot-window steps ran hot: "
                         f"{ae.metrics()['hot_mismatches']}")
    return {k: statistics.median(v) / ops * 1e6 for k, v in samples.items()}, ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=15)
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--inplace", action="store_true", help="optimizer-style in-place updates")
    kind.add_argument("--step", action="store_true", help="a tiny GPT block's forward and backward")
    args = parser.parse_args()
    if args.step:
        us, ops = measure_step(args.repeats)
        print(f"torch {torch.__version__}, a tiny GPT block's forward+backward ({ops} intercepted ops) x "
              f"{args.repeats} repeats of 10 steps, median us per intercepted op")
    else:
        us = measure(args.ops, args.repeats, args.inplace)
        kind = "in-place updates" if args.inplace else "tiny ops"
        print(f"torch {torch.__version__}, {args.ops} {kind} x {args.repeats} repeats, median us per op")
    print("| variant | us / op | x eager | x empty mode |")
    print("| --- | ---: | ---: | ---: |")
    for k, v in us.items():
        print(f"| {k} | {v:.2f} | {v / us['eager']:.2f} | {v / us['empty mode']:.2f} |")


if __name__ == "__main__":
    main()
