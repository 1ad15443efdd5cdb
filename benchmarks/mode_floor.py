"""The floor of per-op interception: the suite's workloads in eager, under an empty
TorchDispatchMode, and in adaptive eager (steady state), interleaved.

    python benchmarks/mode_floor.py [--only mlp_train,adamw] [--repeats 9] [--ops]

An empty mode intercepts every ATen op in Python and runs it: nothing recorded, nothing fused. Its
time over eager's is what any design built on a Python dispatch mode pays before it does any work
of its own; where that alone makes a workload slower than eager, fusion has to win it back first.
Each sample times a few iterations of one variant (each adaptive iteration ends with a sync, so
its flush is inside the sample); medians over ``--repeats`` interleaved samples. Ratios are time
over eager's time (above 1: slower than eager).

``--ops`` prints instead, per workload, the ATen ops torch.profiler sees in one eager iteration and
in one under the empty mode: each op the mode intercepts shows once more there (the profiler's range
of its Python-key entry) and nothing else differs when the mode changes no decomposition
or allocation (issue 14, part 3: the MLP step's ops are those).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import adaptive_eager as ae  # noqa: E402
from measure import EmptyMode  # noqa: E402
from workloads import ADAPTIVE_OPTIONS, BUILDERS  # noqa: E402

SAMPLE_SECONDS = 0.25


class CountingMode(TorchDispatchMode):
    """Counts the ops an empty mode intercepts (one untimed iteration)."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.by_op: Counter = Counter()  # by the profiler's name of the op ("aten::mm")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.by_op[f"aten::{func._schema.name.split('::')[1]}"] += 1
        return func(*args, **(kwargs or {}))


def _profiled_ops(step, mode=None) -> Counter:
    from torch.profiler import ProfilerActivity, profile

    with mode if mode is not None else contextlib.nullcontext():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
    return Counter(e.name for e in prof.events() if e.name.startswith("aten::"))


def print_ops(key: str, device: str) -> None:
    """The ATen ops of one eager iteration, alone and under the empty mode (``--ops``)."""
    w = BUILDERS[key](device)
    w.eager()  # lazy initialisation (optimizer state) out of the way
    eager, under = _profiled_ops(w.eager), _profiled_ops(w.eager, EmptyMode())
    counting = CountingMode()
    with counting:
        w.eager()
    print(f"{key}, one iteration:")
    print("| ATen op | eager | under the empty mode | intercepted | the same op list |")
    print("| --- | ---: | ---: | ---: | --- |")
    for name in sorted(set(eager) | set(under)):
        n = counting.by_op[name]
        print(f"| {name} | {eager[name]} | {under[name]} | {n} | {'yes' if under[name] == eager[name] + n else 'NO'} |")


def _timed(step, iters: int, sync) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        out = step()
        sync()
    del out
    return (time.perf_counter() - t0) / iters


def measure(key: str, device: str, repeats: int) -> dict:
    w = BUILDERS[key](device)
    dev_sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def adaptive_sync():
        ae.sync()
        dev_sync()

    opts = dict(ADAPTIVE_OPTIONS, device=device) if device != "cpu" else ADAPTIVE_OPTIONS
    counting = CountingMode()
    with counting:
        w.eager()
    with ae.adaptive_eager(**opts):
        for _ in range(4):  # replay, compile (or load), then compiled hits
            w.adaptive()
            ae.sync()
    t0 = time.perf_counter()
    w.eager()
    dev_sync()
    iters = max(1, min(200, int(SAMPLE_SECONDS / max(time.perf_counter() - t0, 1e-6))))
    samples: dict[str, list[float]] = {"eager": [], "empty mode": [], "adaptive": []}
    for _ in range(repeats):
        samples["eager"].append(_timed(w.eager, iters, dev_sync))
        with EmptyMode():
            samples["empty mode"].append(_timed(w.eager, iters, dev_sync))
        with ae.adaptive_eager(**opts):
            samples["adaptive"].append(_timed(w.adaptive, iters, adaptive_sync))
    med = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    return {"title": w.title, "iters": iters, "ops": counting.ops, **med}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--only", default=",".join(BUILDERS), help="comma-separated subset of " + ",".join(BUILDERS))
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--ops", action="store_true", help="print the ATen ops of eager and the empty mode instead")
    args = parser.parse_args()
    keys = [k for k in args.only.split(",") if k]
    unknown = [k for k in keys if k not in BUILDERS]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; choose from {', '.join(BUILDERS)}")
    if args.ops:
        for key in keys:
            print_ops(key, args.device)
        return
    print(f"python benchmarks/mode_floor.py --only {','.join(keys)} --repeats {args.repeats} --device {args.device}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| workload | ops intercepted / iter | eager ms | empty mode ms | adaptive ms | empty mode / eager "
          "| adaptive / eager | adaptive / empty mode |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for key in keys:
        r = measure(key, args.device, args.repeats)
        e, m, a = r["eager"], r["empty mode"], r["adaptive"]
        print(f"| {key} | {r['ops']} | {e:.3f} | {m:.3f} | {a:.3f} | {m / e:.2f} | {a / e:.2f} | {a / m:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
