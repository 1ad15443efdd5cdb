"""The commonest training loop, a DataLoader over a TensorDataset, in adaptive eager with default
options: counts per epoch, not times.

    python benchmarks/loader_loop.py [--epochs 3] [--shuffle on|off|both] [--at-once]

A 20-64-1 MLP trained with AdamW on 1000 rows, batches of 32 (31 full batches and one of 8 an
epoch), ``num_workers=0``, in a cold cache directory, then in a second process on the same cache,
started once the first process's compile workers have ended (the compiles a short run leaves
queued go on after its exit: Note [Compiles that outlive the program] in neff_cache.jobs), or at
once with ``--at-once``.
Prints, per process and epoch: windows (and how many had nothing to run), compiled runs, small
windows and parked stretches (run eagerly once compiled), and the windows replayed, while cold or while their compile (or load) was in flight; then the captured
calls (model calls and optimizer steps) and how many of their graphs ran compiled or op by op. Note [Views of unwritten memory] in adaptive_eager._record
says why a shuffled batch once made a new window each step; Note [Warm workers] in neff_cache.jobs
why the first compile lands sooner.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def train(epochs: int, shuffle: bool) -> list[dict]:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import adaptive_eager as ae

    torch.manual_seed(0)
    x, y = torch.randn(1000, 20), torch.randn(1000, 1)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=shuffle)
    rows = []
    with ae.adaptive_eager():
        for _ in range(epochs):
            before = ae.metrics()
            for xb, yb in loader:
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
            ae.sync()
            m = ae.metrics()
            reasons = {k: v - before["replay_reasons"].get(k, 0) for k, v in m["replay_reasons"].items()}
            rows.append({"windows": m["windows"] - before["windows"],
                         "compiled": m["compiled_runs"] - before["compiled_runs"],
                         # run eagerly after their region was compiled (Note [Small windows run eagerly])
                         "small": m["small_windows"] - before["small_windows"],
                         # stretches between captured calls run with the mode off, in place of small
                         # windows (Note [The mode parked between captured calls] in adaptive_eager._state)
                         "parked": m["parked"] - before["parked"],
                         "replayed": m["replayed_regions"] - before["replayed_regions"],
                         "cold": reasons.get("cold", 0),
                         "in_flight": reasons.get("compiling", 0) + reasons.get("loading", 0),
                         "captured": m["module_captured_calls"] - before["module_captured_calls"]
                         + m["optimizer_hot_steps"] - before["optimizer_hot_steps"],
                         "captured_compiled": m["module_compiled_runs"] - before["module_compiled_runs"]
                         + m["optimizer_compiled_runs"] - before["optimizer_compiled_runs"],
                         "captured_uncompiled": m["module_uncompiled_runs"] - before["module_uncompiled_runs"]
                         + m["optimizer_uncompiled_runs"] - before["optimizer_uncompiled_runs"]})
    return rows


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie not yet reaped counts); warm_steps.py uses it too."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"  # ended, not yet reaped
    except OSError:
        return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--shuffle", choices=("on", "off", "both"), default="both")
    parser.add_argument("--at-once", action="store_true",
                        help="start the second process as the first exits, not once its compile workers ended")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        rows = train(args.epochs, args.shuffle == "on")
        import fuser

        workers = [w.process.pid for jobs in fuser.compile_jobs() for w in jobs._workers]
        print(json.dumps({"rows": rows, "workers": workers}))
        return
    for shuffle in (("on", "off") if args.shuffle == "both" else (args.shuffle,)):
        cache = tempfile.mkdtemp(prefix="loader_loop_")
        for process in ("cold cache", "second process"):
            env = {**os.environ, "NEURON_EAGER_CACHE_DIR": cache}
            out = subprocess.run([sys.executable, __file__, "--child", "--epochs", str(args.epochs), "--shuffle",
                                  shuffle], env=env, check=True, capture_output=True, text=True).stdout
            child = json.loads(out.strip().splitlines()[-1])
            rows = child["rows"]
            small = sum(r["small"] + r["parked"] for r in rows)
            ran = sum(r["compiled"] + r["replayed"] for r in rows) + small
            compiled = sum(r["compiled"] for r in rows)
            print(f"shuffle {shuffle}, {process}: {compiled + small}/{ran} windows that ran ops compiled or, "
                  f"small, eagerly after their compile ({100 * (compiled + small) / max(ran, 1):.0f}%; "
                  f"{small} small, of them {sum(r['parked'] for r in rows)} parked stretches)")
            for epoch, r in enumerate(rows):
                # a window none of whose ops is needed runs nothing (an optimizer step's flush
                # right after a captured call): neither compiled nor replayed
                print(f"  epoch {epoch}: windows {r['windows']} ({r['windows'] - r['compiled'] - r['replayed']} "
                      f"with nothing to run), compiled {r['compiled']}, small {r['small']}, parked {r['parked']}, "
                      f"replayed {r['replayed']}: cold "
                      f"{r['cold']}, compiling or loading {r['in_flight']}; captured calls {r['captured']} "
                      f"(their graphs compiled {r['captured_compiled']}, run op by op {r['captured_uncompiled']})")
            if process == "cold cache" and not args.at_once:
                t0 = time.monotonic()
                while not all(process_gone(pid) for pid in child["workers"]) and time.monotonic() - t0 < 600:
                    time.sleep(0.2)
                print(f"  (its compile workers ended {time.monotonic() - t0:.1f} s after it exited)")


if __name__ == "__main__":
    main()
