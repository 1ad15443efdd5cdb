"""Fine-tune a small transformer under adaptive eager: a learning-rate schedule, gradient clipping,
dropout and a loss logged every few steps, the way a real fine-tuning loop looks; the same run in
plain eager (same seed) ends at the same loss.

    python examples/finetune_transformer.py
    python examples/finetune_transformer.py --device neuron --steps 40   # on Trainium, or an emulated neuron device

The model (a 2-layer ``nn.TransformerEncoder``, d_model 64) is first "pretrained" for a few steps
on copying random token sequences, then fine-tuned to reverse them. Only the fine-tuning runs
twice, eagerly and under ``adaptive_eager()`` with its default settings: a hot step compiles in
a background worker process while the steps keep running (replayed op by op), and switches to
the compiled code once it is ready; with an empty cache that compile may finish late in the run,
with a warm one (a second run of the script) the compiled code loads from the cache. The dropout
masks are drawn eagerly, so the same seed gives the same masks in both runs; the losses agree
within float tolerance once compiled code has run (README.md, "Limits").

With ``--device neuron`` the pretraining stays on cpu and the fine-tuning runs on ``neuron``
(both runs; eager there is one NEFF launch per op). Where torch-neuronx is not installed the
device is emulated in CPU memory (its eager values are CPU's, its dropout torch-neuronx's) and the
stablehlo backend stands in for neuronx-cc, as in examples/train.py.
"""

import argparse
import copy
import math
import time

import torch
from torch import nn

import adaptive_eager as ae
from adaptive_eager import adaptive_eager

VOCAB, SEQ, BATCH = 16, 16, 64
PRETRAIN_STEPS, FINETUNE_STEPS, WARMUP_STEPS, LOG_EVERY = 50, 200, 20, 25


class Reverser(nn.Module):
    def __init__(self, d_model: int = 64, heads: int = 4, layers: int = 2):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Parameter(torch.randn(SEQ, d_model))
        layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=4 * d_model, dropout=0.1,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.encoder(self.tok(tokens) + self.pos)))


def batch(g: torch.Generator, task: str) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return x, (x if task == "copy" else x.flip(1))


def train_step(model, opt, sched, x, y) -> torch.Tensor:
    loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
    opt.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    opt.step()
    sched.step()
    return loss.detach()


def pretrain() -> dict:
    torch.manual_seed(0)
    model = Reverser()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    g = torch.Generator().manual_seed(1)
    for _ in range(PRETRAIN_STEPS):
        train_step(model, opt, sched, *batch(g, "copy"))
    return copy.deepcopy(model.state_dict())


def finetune(checkpoint: dict, lazy: bool, label: str, device: str = "cpu",
             steps: int = FINETUNE_STEPS) -> tuple[float, float]:
    """Returns (final loss, token accuracy on a held-out batch)."""
    torch.manual_seed(2)  # dropout masks
    model = Reverser()
    model.load_state_dict(checkpoint)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)

    def warmup_then_cosine(step: int) -> float:
        if step < WARMUP_STEPS:
            return (step + 1) / WARMUP_STEPS
        return 0.5 * (1 + math.cos(math.pi * (step - WARMUP_STEPS) / max(1, steps - WARMUP_STEPS)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_then_cosine)
    g = torch.Generator().manual_seed(3)
    t0 = time.perf_counter()
    with adaptive_eager() if lazy else torch.enable_grad():
        for step in range(1, steps + 1):
            x, y = batch(g, "reverse")
            loss = train_step(model, opt, sched, x.to(device), y.to(device))
            if step % LOG_EVERY == 0:
                # .item() is a sync point; reading it every LOG_EVERY steps keeps it out of most steps
                extra = ""
                if lazy:
                    m = ae.metrics()
                    extra = f"   windows so far: {m['compiled_runs']} compiled, {m['replayed_regions']} replayed"
                print(f"[{label}] step {step:4d}  loss {loss.item():.4f}  lr {sched.get_last_lr()[0]:.2e}"
                      f"  {time.perf_counter() - t0:5.1f} s{extra}")
        model.eval()
        with torch.no_grad():
            x, y = (t.to(device) for t in batch(g, "reverse"))
            accuracy = (model(x).argmax(-1) == y).float().mean().item()
    return loss.item(), accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda, or neuron (emulated in CPU memory where torch-neuronx is not installed)")
    parser.add_argument("--steps", type=int, default=FINETUNE_STEPS, help="fine-tuning steps of each run")
    args = parser.parse_args()
    if args.device == "neuron":
        from adaptive_eager import neuron_emulation

        if not neuron_emulation.real_device_present():
            neuron_emulation.emulate_neuron()  # the stablehlo backend stands in for neuronx-cc
            print("no torch-neuronx here: the neuron device is emulated (CPU memory)")
    # A model this small gains nothing from intra-op threads, and on a shared 2-core machine they
    # mostly wait on each other (steps 3-10x slower under load); both runs use one thread.
    torch.set_num_threads(1)
    checkpoint = pretrain()
    eager_loss, eager_acc = finetune(checkpoint, lazy=False, label="eager", device=args.device, steps=args.steps)
    ae.reset_metrics()
    lazy_loss, lazy_acc = finetune(checkpoint, lazy=True, label="adaptive", device=args.device, steps=args.steps)
    m = ae.metrics()
    print()
    print(f"final loss      eager {eager_loss:.6f}   adaptive eager {lazy_loss:.6f}   "
          f"(difference {abs(eager_loss - lazy_loss):.1e})")
    print(f"held-out token accuracy  eager {eager_acc:.3f}   adaptive eager {lazy_acc:.3f}")
    print(f"{m['windows']} windows: {m['compiled_runs']} ran compiled, {m['replayed_regions']} replayed; "
          f"{m['compiles']} regions compiled in {m['compile_seconds']} s, {m['cache_hits_disk']} loaded from the cache")
    # Compiled regions round differently from eager's kernels; over a few hundred steps the two
    # runs stay within a loose tolerance (a larger gap would mean wrong values, not rounding).
    # With dropout='compiled' the masks are other random numbers: the runs are not comparable so.
    if ae.config.setting("dropout") == "compiled" and args.device != "cpu":
        print("dropout='compiled' (NEURON_EAGER_DROPOUT): dropout's masks are not eager's numbers, so the two "
              "final losses are not compared")
    elif not math.isclose(eager_loss, lazy_loss, rel_tol=1e-2, abs_tol=1e-3):
        raise SystemExit("adaptive eager's final loss differs from eager's beyond rounding")
    print()
    print(ae.report())


if __name__ == "__main__":
    main()
