"""Compiles and replays of a training loop over batches of varying sizes (counts, not times).

    python benchmarks/varying_batch.py [--loss mse|cross_entropy] [--epochs 3]

A 20-64-5 MLP trained with AdamW over nine batches of sizes 9-32 made before the loop (as a
DataLoader with a bucketing sampler, or a smaller last batch, hands them over), in a fresh cache
directory, compiling in place (``async_compile=False``), so the counts do not depend on the load.
Once a window's structure has shown two shapes its regions compile once, symbolically in the batch
(Note [Dynamic shapes] in fuser.shapes); a region that fails that compile is replayed and every
new batch size compiles on its own. Prints ``metrics()``'s counters and the loop's wall time.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
import torch.nn.functional as F

import adaptive_eager as ae

SIZES = (32, 17, 25, 9, 32, 14, 21, 30, 23)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loss", choices=("mse", "cross_entropy"), default="mse")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x_all = torch.randn(sum(SIZES), 20)
    y_all = torch.randn(sum(SIZES), 5) if args.loss == "mse" else torch.randint(0, 5, (sum(SIZES),))
    loss_fn = F.mse_loss if args.loss == "mse" else F.cross_entropy
    batches, start = [], 0
    for b in SIZES:
        batches.append((x_all[start:start + b].clone(), y_all[start:start + b].clone()))
        start += b
    t0 = time.perf_counter()
    with ae.adaptive_eager(backend="inductor", async_compile=False, cache_dir=tempfile.mkdtemp()):
        for _ in range(args.epochs):
            for x, y in batches:
                loss = loss_fn(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                float(loss.detach())
    m = ae.metrics()
    keys = ("compiles", "compile_failures", "blacklisted", "recompiles", "compiled_runs", "replayed_regions")
    print(f"{args.loss}, {args.epochs} epochs of {len(SIZES)} batches: " + ", ".join(f"{k} {m[k]}" for k in keys)
          + f"; wall {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
