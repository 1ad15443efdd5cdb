"""Each step's time in a cold process, from the first, and where the main thread spends the slow ones.

    python benchmarks/cold_steps.py [--only blocks8] [--rounds 4] [--steps 20] [--threads N]

``benchmarks/user_step.py`` gives medians and the slowest step; this prints every step of one
workload's loop under default options (one ``with adaptive_eager():`` per round of ``--steps``
steps, as user_step.py's rounds) on the cache ``NEURON_EAGER_CACHE_DIR`` names (use a fresh
directory for a cold run), then what a sampler thread saw the main thread doing (its innermost
frames every 5 ms, while a step runs) and ``metrics()``' capture counts. ``--threads N`` calls
``torch.set_num_threads(N)`` first: the steps before the first compiled one depend on it (RESULTS.md,
session 26).
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
import traceback

import torch

import adaptive_eager as ae


def main() -> None:
    from user_step import WORKLOADS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="blocks8", choices=sorted(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="steps a round")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads(N) first (0: leave it)")
    parser.add_argument("--no-sampler", action="store_true", help="no sampler thread (it competes for the GIL)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, loss_of = WORKLOADS[args.only]("cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    main_id = threading.main_thread().ident
    seen: collections.Counter = collections.Counter()
    sampling = threading.Event()

    def sample():
        while True:
            time.sleep(0.005)
            if sampling.is_set():
                frame = sys._current_frames().get(main_id)
                if frame is not None:
                    stack = traceback.extract_stack(frame)[-5:]
                    seen[" <- ".join(f"{f.name}:{f.lineno}" for f in reversed(stack))] += 1

    if not args.no_sampler:
        threading.Thread(target=sample, daemon=True).start()
    print(f"{args.only}, default options, torch threads {torch.get_num_threads()}: ms per step, a line a round")
    for _ in range(args.rounds):
        times = []
        with ae.adaptive_eager():
            for _ in range(args.steps):
                sampling.set()
                t0 = time.perf_counter()
                loss = loss_of(model)
                loss.backward()
                opt.step()
                opt.zero_grad()
                loss.item()
                times.append((time.perf_counter() - t0) * 1e3)
                sampling.clear()
        print(" ".join(f"{t:.0f}" for t in times), flush=True)
    m = ae.metrics()
    print({k: m[k] for k in ("compiled_runs", "module_captured_calls", "optimizer_hot_steps", "capture_records")})
    print("where the main thread was (samples, innermost frame first):")
    for where, n in seen.most_common(8):
        print(f"{n:6d}  {where}")


if __name__ == "__main__":
    main()
