"""The first script to run on Trainium: train a small model a few steps on the ``neuron`` device,
eagerly and under adaptive eager, and print how many NEFF launches a step takes each way.

    python examples/trainium.py              # on a Trn host with torch-neuronx: the real device
    python examples/trainium.py --steps 8    # anywhere else: an emulated neuron device (CPU memory)

Where torch-neuronx is not installed, ``adaptive_eager.emulate_neuron()`` gives the process a
``neuron`` device whose eager ops each count as one NEFF launch, and the stablehlo backend (the
lowering the neuron backend hands to neuronx-cc, compiled by XLA on cpu) stands in for neuronx-cc:
that sizes the win before renting a Trn2. Compile times there are XLA's, not neuronx-cc's (minutes
for a large graph on first sight; the persistent cache makes later runs skip them).
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

import adaptive_eager as ae
from adaptive_eager import neuron_emulation


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.GELU(), torch.nn.Linear(32, 4),
    )


def train(steps: int, device: str, adaptive: bool) -> list[float]:
    model = make_model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=data), torch.randn(8, 4, generator=data)
    losses = []
    # compiles in this thread: the sizing then covers the compiled steps (hot after 2 sightings)
    with ae.adaptive_eager(async_compile=False) if adaptive else contextlib.nullcontext():
        for _ in range(steps):
            loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    if not neuron_emulation.real_device_present():
        neuron_emulation.emulate_neuron()
        print("no torch-neuronx here: the neuron device is emulated (CPU memory)")
    emulated = neuron_emulation.is_emulated()

    before = neuron_emulation.launches()
    eager = train(args.steps, "neuron", adaptive=False)
    eager_launches = neuron_emulation.launches() - before

    ae.reset_metrics()
    start = time.perf_counter()
    before = neuron_emulation.launches()
    adaptive = train(args.steps, "neuron", adaptive=True)
    device_launches = neuron_emulation.launches() - before
    seconds = time.perf_counter() - start
    m = ae.metrics()

    print(f"losses, eager:    {' '.join(f'{v:.5f}' for v in eager)}")
    print(f"losses, adaptive: {' '.join(f'{v:.5f}' for v in adaptive)}")
    # on the emulated device the device counts its launches too (executables run, ops reaching it)
    print(neuron_emulation.sizing_report(m, args.steps, eager_launches if emulated else None,
                                         device_launches if emulated else None))
    print(f"adaptive run: {seconds:.1f} s, backend {ae.load_options().backend}")


if __name__ == "__main__":
    main()
