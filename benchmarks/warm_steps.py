"""A warm process's steps: issue 32's warm bound, each step of a new process on a full cache.

    python benchmarks/warm_steps.py [--only blocks8,rnn,cnn] [--steps 30] [--rounds 3]

Per workload of ``benchmarks/user_step.py``: a first process trains ``--steps`` steps on a fresh
cache directory with the default options (cold: it fills the cache), and the script waits for its
compile workers to end. Then ``--rounds`` rounds, interleaved: an eager process, then a new
adaptive eager process on that cache (default options, one ``with adaptive_eager():`` around the
loop), each timing every step (a step ends with ``loss.item()``). Printed per workload: eager's
median step over the rounds, the bound (1.5x that + 20 ms), and per warm process its first two
steps, its slowest step from the third on, and the first step from which every step ran compiled
(no window replayed, no captured module or optimizer graph run op by op). For the cold process:
the first step, the steps after it over issue 32's cold bound (3x eager's median + 100 ms), and
from which step it ran compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loader_loop import process_gone  # noqa: E402


def child(name: str, steps: int, adaptive: bool) -> dict:
    import torch

    from user_step import WORKLOADS, train_step

    torch.manual_seed(0)
    model, loss_of = WORKLOADS[name]("cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times, compiled = [], []
    if not adaptive:
        for _ in range(steps):
            t0 = time.perf_counter()
            train_step(model, loss_of, opt)
            times.append((time.perf_counter() - t0) * 1e3)
        return {"times": times}
    import adaptive_eager as ae
    import fuser

    keys = ("module_uncompiled_runs", "optimizer_uncompiled_runs", "replayed_regions")
    with ae.adaptive_eager():
        for _ in range(steps):
            before = ae.metrics()
            t0 = time.perf_counter()
            train_step(model, loss_of, opt)
            times.append((time.perf_counter() - t0) * 1e3)
            after = ae.metrics()
            compiled.append(not any(after[k] - before[k] for k in keys))
    workers = [w.process.pid for jobs in fuser.compile_jobs() for w in jobs._workers]
    return {"times": times, "compiled": compiled, "workers": workers}


def _run(name: str, steps: int, adaptive: bool, cache: str) -> dict:
    env = {**os.environ, "NEURON_EAGER_CACHE_DIR": cache}
    out = subprocess.run([sys.executable, __file__, "--child", name, "--steps", str(steps)]
                         + (["--adaptive"] if adaptive else []), env=env, check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _compiled_from(compiled: list[bool]) -> str:
    for i in range(len(compiled)):
        if all(compiled[i:]):
            return str(i + 1)
    return "never"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="blocks8,rnn,cnn")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--adaptive", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.adaptive)))
        return
    for name in args.only.split(","):
        cache = tempfile.mkdtemp(prefix="warm_steps_")
        first = _run(name, args.steps, True, cache)
        t0 = time.monotonic()
        while not all(process_gone(pid) for pid in first["workers"]) and time.monotonic() - t0 < 600:
            time.sleep(0.2)
        waited = time.monotonic() - t0
        eager, warm = [], []
        for _ in range(args.rounds):
            eager += _run(name, args.steps, False, cache)["times"][1:]
            warm.append(_run(name, args.steps, True, cache))
        median = statistics.median(eager)
        bound = 1.5 * median + 20
        cold_bound = 3 * median + 100
        over = ", ".join(f"step {i + 1} {t:.0f} ms" for i, t in enumerate(first["times"]) if i and t > cold_bound)
        print(f"{name}: eager median step {median:.1f} ms, bound {bound:.1f} ms; cold process: step 1 "
              f"{first['times'][0]:.0f} ms, over the cold bound ({cold_bound:.0f} ms) after it: {over or 'none'}, "
              f"compiled from step {_compiled_from(first['compiled'])}, its workers ended {waited:.0f} s after it")
        for r in warm:
            later = max(r["times"][2:])
            print(f"  warm process: steps 1-2 {r['times'][0]:.0f}, {r['times'][1]:.0f} ms; slowest from step 3 "
                  f"{later:.1f} ms ({'within' if later <= bound else 'over'} the bound); compiled from step "
                  f"{_compiled_from(r['compiled'])}; compile workers left {len(r['workers'])}")


if __name__ == "__main__":
    main()
