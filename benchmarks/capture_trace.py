"""What an optimizer step's capture costs in the step that captures it: Dynamo's trace and
AOTAutograd's (Note [Capture compiles off the step] in adaptive_eager._optim).

    python benchmarks/capture_trace.py [adamw|blocks8]

``adamw``: AdamW (foreach=False) over the suite's 200 x 256 parameters; ``blocks8``: AdamW over
the parameters of ``user_step.py``'s 8-block model. Imports are done first, so the numbers are the
traces alone; no compile runs in that step (it runs in a worker process), and none is waited for.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch._dynamo  # noqa: F401 - imported before the timed step
import torch._functorch.aot_autograd  # noqa: F401
import torch._inductor.decomposition  # noqa: F401
import torch.nn as nn

import adaptive_eager as ae
from adaptive_eager import _capture


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", nargs="?", choices=["adamw", "blocks8"], default="adamw",
                        help="AdamW over the suite's 200 x 256 params, or over the 8-block model's")
    which = parser.parse_args().which
    aot: list[float] = []
    traced = _capture._Backend.__call__

    def timed(self, gm, examples):
        t0 = time.perf_counter()
        try:
            return traced(self, gm, examples)
        finally:
            aot.append(time.perf_counter() - t0)

    _capture._Backend.__call__ = timed
    if which == "adamw":
        params = [torch.randn(256, requires_grad=True) for _ in range(200)]
    else:
        layers: list[nn.Module] = []
        for _ in range(8):
            layers += [nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU()]
        params = list(nn.Sequential(*layers, nn.Linear(64, 1)).parameters())
    opt = torch.optim.AdamW(params, lr=0.01, foreach=False)
    ae.reset_metrics()
    with ae.adaptive_eager(backend="inductor"):
        for _ in range(3):  # hot_after=2: the third step captures
            for p in params:
                p.grad = torch.full_like(p, 0.1)
            opt.step()
    m = ae.metrics()
    total = m["optimizer_capture_seconds"]
    print(f"{which}: {len(params)} params, capturing step {total:.2f} s = Dynamo {total - sum(aot):.2f} s "
          f"+ AOTAutograd and Program {sum(aot):.2f} s (captures {m['optimizer_captures']})")


if __name__ == "__main__":
    main()
