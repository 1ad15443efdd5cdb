"""Host time of eager's dropout masks on ``neuron``: what ``dropout='compiled'`` takes off the host.

    python benchmarks/dropout_masks.py [--batch 8] [--tokens 1024] [--hidden 768] [--masks 25] [--repeats 5]

torch-neuronx's dropout draws each mask on the host from CPU's generator, and adaptive eager's
default (``dropout='eager'``) draws it the same way to keep eager's numbers (Note [Dropout drawn at
record time] in adaptive_eager/_ops.py): ``host_dropout_masks``, the library's own call, one bool
per element. With ``dropout='compiled'`` the masks are computed in the compiled code on the device
and the host draws nothing (Note [Dropout in the compiled code] in adaptive_eager/_dropout.py).
This times the host's part for one training step's masks of a model of the given shape (the
defaults: GPT-2 small's hidden states at batch 8 x 1024 tokens, ~25 masks a step), on one core,
the copy onto the device left out (a DMA on hardware). Medians of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from adaptive_eager._ops import host_dropout_masks  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--masks", type=int, default=25, help="masks a step")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    shape = (args.batch, args.tokens, args.hidden)
    one, step = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        host_dropout_masks([(shape, 0.1)], "cpu")
        t1 = time.perf_counter()
        host_dropout_masks([(shape, 0.1)] * args.masks, "cpu")
        t2 = time.perf_counter()
        one.append(t1 - t0)
        step.append(t2 - t1)
    print(f"python benchmarks/dropout_masks.py --batch {args.batch} --tokens {args.tokens} --hidden {args.hidden} "
          f"--masks {args.masks} --repeats {args.repeats}; torch {torch.__version__}, 1 thread")
    print(f"one mask of {shape} ({torch.Size(shape).numel() / 1e6:.1f} M elements): "
          f"{statistics.median(one) * 1e3:.1f} ms on the host (dropout='eager'), 0 with dropout='compiled'")
    print(f"a step's {args.masks} masks, drawn and joined for one copy: {statistics.median(step) * 1e3:.0f} ms "
          f"on the host (dropout='eager'), 0 with dropout='compiled'")


if __name__ == "__main__":
    main()
