"""What a window costs at first sight of its op signatures (every op a metadata-cache miss: the
meta kernel and the real run that gives eager's layouts, Note [Eager layouts]) against the same
window with a warm cache and plain eager; replayed, so no compile is timed.

    python benchmarks/first_sight.py [--repeats 9] [--only mlp_train,cnn_train,tiny]

One process, the variants interleaved, medians. ``cold`` empties the tracer's metadata cache before
each sample, as a new process, a new batch size or a new model does.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import adaptive_eager as ae


def mlp_train():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(64, 512), torch.randint(0, 10, (64,))

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def cnn_train():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                          nn.Linear(32 * 16, 10)).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(16, 3, 32, 32).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (16,))

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def tiny():
    xs = [torch.randn(n) for n in range(8, 208)]  # 200 shapes: 800 distinct signatures

    def step():
        for x in xs:
            ((x * 2 + 1).tanh() - x).sum()

    return step


WORKLOADS = {"mlp_train": mlp_train, "cnn_train": cnn_train, "tiny": tiny}


def measure(step, repeats: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {"eager": [], "cold": [], "warm": []}
    opts = dict(backend="replay", window=100_000)
    with ae.adaptive_eager(**opts):
        step()  # imports, lazily built tables
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        samples["eager"].append(time.perf_counter() - t0)
        for variant in ("cold", "warm"):
            if variant == "cold":
                ae.cache_clear()
            with ae.adaptive_eager(**opts):
                t0 = time.perf_counter()
                step()
                ae.sync()
                samples[variant].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--only", default=",".join(WORKLOADS))
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"{'workload':<12}{'eager ms':>10}{'cold ms':>10}{'warm ms':>10}{'cold-warm':>11}")
    for key in args.only.split(","):
        r = measure(WORKLOADS[key](), args.repeats)
        print(f"{key:<12}{r['eager'] * 1e3:>10.2f}{r['cold'] * 1e3:>10.2f}{r['warm'] * 1e3:>10.2f}"
              f"{(r['cold'] - r['warm']) * 1e3:>11.2f}")


if __name__ == "__main__":
    main()
