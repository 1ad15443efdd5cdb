"""Cost per recorded op: a loop of tiny ops, plain eager vs an empty TorchDispatchMode vs recording.

    python benchmarks/record_overhead.py [--ops 2000] [--repeats 15] [--inplace]

All variants run in one process, interleaved, and the median of the repeats is reported, since
absolute times drift on a shared machine. "record" is the time to record the ops (the window is
flushed outside the timed region); "record+replay" includes running the window op by op.
``--inplace`` times optimizer-style in-place updates instead (``mul_``, ``add_(alpha=)``,
``addcmul_(value=)``, ``lerp_``), which take the in-place fast path.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import adaptive_eager as ae


class EmptyMode(TorchDispatchMode):
    """The floor every Python dispatch mode pays: intercept and run the op."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:  # same treatment as adaptive eager's mode
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def tiny_ops(x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    y = x
    for _ in range(n // 4):  # 4 ops per iteration: a mix of binary, scalar and unary ops
        y = y * w
        y = y + 1.0
        y = torch.tanh(y)
        y = y - x
    return y


def inplace_ops(p: torch.Tensor, g: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n // 4):  # 4 in-place updates per iteration, as an optimizer step makes
        p.mul_(0.999)
        p.add_(g, alpha=-0.01)
        p.addcmul_(g, g, value=0.001)
        p.lerp_(g, 0.1)
    return p


def measure(ops: int, repeats: int, inplace: bool = False) -> dict[str, float]:
    x, w = torch.randn(16), torch.randn(16)
    run = tiny_ops
    if inplace:
        def run(x, w, n):
            return inplace_ops(x, w, n)

        x, w = torch.randn(16) * 0.01, torch.randn(16) * 0.01
    samples: dict[str, list[float]] = {"eager": [], "empty mode": [], "record": [], "record+replay": []}
    with ae.adaptive_eager(window=ops + 10):  # warm the metadata cache once
        run(x, w, ops)
    for _ in range(repeats):
        t0 = time.perf_counter()
        run(x, w, ops)
        samples["eager"].append(time.perf_counter() - t0)

        with EmptyMode():
            t0 = time.perf_counter()
            run(x, w, ops)
            samples["empty mode"].append(time.perf_counter() - t0)

        with ae.adaptive_eager(window=ops + 10):
            t0 = time.perf_counter()
            y = run(x, w, ops)
            t1 = time.perf_counter()
            ae.sync()
            t2 = time.perf_counter()
        samples["record"].append(t1 - t0)
        samples["record+replay"].append(t2 - t0)
        del y
    return {k: statistics.median(v) / ops * 1e6 for k, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--inplace", action="store_true", help="optimizer-style in-place updates")
    args = parser.parse_args()
    us = measure(args.ops, args.repeats, args.inplace)
    kind = "in-place updates" if args.inplace else "tiny ops"
    print(f"torch {torch.__version__}, {args.ops} {kind} x {args.repeats} repeats, median us per op")
    print("| variant | us / op | x eager | x empty mode |")
    print("| --- | ---: | ---: | ---: |")
    for k, v in us.items():
        print(f"| {k} | {v:.2f} | {v / us['eager']:.2f} | {v / us['empty mode']:.2f} |")


if __name__ == "__main__":
    main()
