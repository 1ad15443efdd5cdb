"""DDP under adaptive eager: 2 processes on CPU (gloo) train a small MLP; the parameters match
plain eager DDP, and both ranks share one cache, so each region is compiled by one of them.

    python examples/ddp.py

Every collective (DDP's gradient all-reduce, its bucket broadcasts) flushes the window first, so the
process group reads and writes real memory; the report counts those flushes as "collective".
"""

import argparse
import datetime
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import adaptive_eager as ae
from adaptive_eager import adaptive_eager

WORLD = 2
STEPS = 12


def train(rank: int, lazy: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)  # the same initial model on every rank (DDP also broadcasts rank 0's)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 1)
    )
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)  # each rank its own shard of data
    x, y = torch.randn(64, 32, generator=g), torch.randn(64, 1, generator=g)
    # async_compile=False compiles hot regions in this process so this short run uses them; by
    # default they compile in a background worker while the steps replay.
    with adaptive_eager(async_compile=False) if lazy else torch.enable_grad():
        for _ in range(STEPS):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            loss.backward()  # DDP all-reduces the gradients here
            opt.step()
    return [p.detach().clone() for p in model.parameters()]


def run(rank: int, port: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    eager = train(rank, lazy=False)
    ae.reset_metrics()
    lazy = train(rank, lazy=True)
    diff = max((a - b).abs().max().item() for a, b in zip(eager, lazy))
    for a, b in zip(eager, lazy):
        torch.testing.assert_close(b, a)  # compiled regions agree within float tolerance
    m = ae.metrics()
    summary = torch.tensor([m["compiles"], m["cache_hits_disk"], m["compiled_runs"]])
    gathered = [torch.zeros_like(summary) for _ in range(WORLD)]
    dist.all_gather(gathered, summary)
    if rank == 0:
        print(f"parameters after {STEPS} steps: adaptive eager DDP == eager DDP (largest difference {diff:.1e})")
        for r, (compiles, hits, runs) in enumerate(t.tolist() for t in gathered):
            print(f"rank {r}: compiled {compiles} regions, loaded {hits} from the shared cache, {runs} compiled runs")
        print(ae.report())
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    ctx = mp.start_processes(run, args=(free_port(),), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    # join returns when one rank ends (and raises if it failed); a rank that hangs times out
    while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            sys.exit("examples/ddp.py: the ranks did not finish within 120 s")
