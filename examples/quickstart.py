"""Quickstart: train a small MLP eagerly and under adaptive eager; same losses, fewer launches.

    python examples/quickstart.py
"""

import argparse
import statistics
import time

import torch

import adaptive_eager as ae
from adaptive_eager import adaptive_eager


def train(steps: int, lazy: bool, times: list[float]) -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(256, 32), torch.randn(256, 1)
    losses = []
    # async_compile=False compiles hot regions in this process, so even this short demo runs
    # compiled steps; by default they compile in a background worker while the steps replay.
    with adaptive_eager(async_compile=False) if lazy else torch.enable_grad():
        for _ in range(steps):
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            if lazy:
                ae.sync()  # the step's window has run: the time is the step's, not the recording's
            times.append(time.perf_counter() - t0)
    return [l.item() for l in losses]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="training steps of each run (default 30; at least 21)")
    steps = parser.parse_args().steps
    if steps < 21:
        parser.error(f"--steps {steps}: the step time is the median of the last 20 steps; pass 21 or more")
    eager_times, lazy_times = [], []
    eager = train(steps, lazy=False, times=eager_times)
    ae.reset_metrics()
    lazy = train(steps, lazy=True, times=lazy_times)
    print(f"final loss  eager: {eager[-1]:.6f}   adaptive eager: {lazy[-1]:.6f}")
    # the first steps replay and compile; the median of the last 20 is the steady state
    e_ms, a_ms = (statistics.median(t[-20:]) * 1e3 for t in (eager_times, lazy_times))
    print(f"median step time of the last 20 steps  eager: {e_ms:.2f} ms   adaptive eager: {a_ms:.2f} ms "
          f"(see README.md, 'Performance')")
    # replayed steps are bitwise eager's until compiled code has run; from then on within float tolerance
    print(f"largest loss difference: {max(abs(a - b) for a, b in zip(eager, lazy)):.2e}")
    print(ae.report())
