"""Quickstart: train a small MLP eagerly and under adaptive eager; same losses, fewer launches.

    python examples/quickstart.py
"""

import torch

import adaptive_eager as ae
from adaptive_eager import adaptive_eager


def train(steps: int, lazy: bool) -> list[float]:
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
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return [l.item() for l in losses]


if __name__ == "__main__":
    eager = train(30, lazy=False)
    ae.reset_metrics()
    lazy = train(30, lazy=True)
    print(f"final loss  eager: {eager[-1]:.6f}   adaptive eager: {lazy[-1]:.6f}")
    # replayed steps are bitwise eager; compiled regions agree within float tolerance
    print(f"largest loss difference: {max(abs(a - b) for a, b in zip(eager, lazy)):.2e}")
    print(ae.report())
