"""Machine instructions per recorded op, counted by valgrind: a figure the machine's load does not move.

    PY=$(python -c 'import sys; print(sys.executable)')   # the interpreter itself, not a shim
    valgrind --tool=callgrind --callgrind-out-file=/dev/null --collect-atstart=no \\
        --toggle-collect=functools_reduce $PY benchmarks/record_instructions.py [--inplace] [--recorded]

prints nothing itself; valgrind's "Collected" line, divided by ``--reps`` x ``--ops``, is the count
per op. The loops are ``record_overhead.py``'s (tiny ops, or ``--inplace`` updates) in a hot window
(the default) or recorded in full (``--recorded``), flush included, after the same warm-up; only
what runs inside ``functools.reduce`` is counted, so the interpreter's start and the compile are not.
Counts move by about 0.3% between runs (addresses differ, and with them hash-table layouts).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import adaptive_eager as ae  # noqa: E402
from workloads import inplace_ops, tiny_ops  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--inplace", action="store_true", help="in-place updates instead of tiny ops")
    parser.add_argument("--recorded", action="store_true", help="recorded in full instead of in a hot window")
    args = parser.parse_args()
    torch.set_num_threads(1)
    run, x, w = tiny_ops, torch.randn(16), torch.randn(16)
    if args.inplace:
        run, x, w = inplace_ops, torch.randn(16) * 0.01, torch.randn(16) * 0.01
    if args.recorded:
        options = dict(window=args.ops + 10, backend="replay", tiers="regions")
    else:
        options = dict(window=args.ops + 10, backend="inductor", async_compile=False)
    with ae.adaptive_eager(**options):
        for _ in range(8):  # the metadata cache, the region and the template
            y = run(x, w, args.ops)  # kept: a window whose result is dropped runs nothing
            ae.sync()

    def rep(acc, _):
        y = run(x, w, args.ops)
        ae.sync()
        return acc + (y is not None)

    with ae.adaptive_eager(**options):
        functools.reduce(rep, range(args.reps), 0)  # what valgrind counts


if __name__ == "__main__":
    main()
