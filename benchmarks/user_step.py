"""Training steps as a user runs them: default options, one ``with adaptive_eager():`` around the loop.

    python benchmarks/user_step.py [--device cpu|cuda] [--steps N] [--only KEYS] [--no-compile]

Every other script here measures adaptive eager in its steady state with tuned settings; this one
measures what a new user sees. Each workload's training loop runs as six variants, interleaved in
rounds of ``--round`` steps (eager, adaptive, torch.compile of the model, torch.compile of the
model and of ``opt.step`` (PyTorch's "compiling the optimizer" recipe), the user's torch.compile
inside adaptive eager, torch.compile reduce-overhead on cuda),
each variant keeping its own model and optimizer across rounds, so adaptive eager's background
compiles land while the other variants run, as they would while a user's loop goes on. Per variant:

- ``steady ms``: the median step time over the last half of the steps (a step ends with
  ``loss.item()``, the read a user's loop makes, which also waits for the device);
- ``first step s``: the first step's time (compiles that block it count here);
- ``max later ms``: the slowest step after the first (a compile that stalls a step shows here);
- ``compiled at``: for adaptive, the first step whose windows all ran compiled (no replayed
  region in that step; a small window runs eagerly once its region was compiled) and whose captured
  calls all ran compiled (no captured module or optimizer graph run op by op while its artifact was
  not loaded), from ``ae.metrics()``;
- ``kernels/step`` (cuda): device kernels and memcpys of one step, counted by ``torch.profiler``, not
  by the library;
- ``host syncs/step`` (cuda): synchronizations the step makes, counted by
  ``torch.cuda.set_sync_debug_mode("warn")``'s warnings (the ``loss.item()`` is one).

Counts and times are printed as one table; nothing is written. ``benchmarks/device_check.sh`` runs
it on a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import torch
import torch.nn as nn

import adaptive_eager as ae


def train_step(model, loss_of, opt) -> None:
    """One step of the user's loop, ending with the ``loss.item()`` a user's loop makes."""
    loss = loss_of(model)
    loss.backward()
    opt.step()
    opt.zero_grad()
    loss.item()


def blocks8(device):
    """Launch-bound: 8 x (Linear(64, 64), LayerNorm, GELU) + Linear, batch 32."""
    layers = []
    for _ in range(8):
        layers += [nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(64, 1)).to(device)
    x, y = torch.randn(32, 64, device=device), torch.randn(32, 1, device=device)
    return model, lambda m: nn.functional.mse_loss(m(x), y)


class _Cell(nn.Module):
    """A recurrent cell unrolled over 16 time steps inside the forward (a hand-written loop)."""

    def __init__(self):
        super().__init__()
        self.inp, self.hid, self.out = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 1)

    def forward(self, xs):
        h = xs.new_zeros(xs.shape[1], 64)
        for t in range(xs.shape[0]):
            h = torch.tanh(self.inp(xs[t]) + self.hid(h))
        return self.out(h)


def rnn(device):
    model = _Cell().to(device)
    xs, y = torch.randn(16, 32, 32, device=device), torch.randn(32, 1, device=device)
    return model, lambda m: nn.functional.mse_loss(m(xs), y)


def cnn(device):
    """A small CNN: 2 conv blocks with BatchNorm, batch 16 of 3x32x32, 10 classes."""
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(32, 10)).to(device)
    x, y = torch.randn(16, 3, 32, 32, device=device), torch.randint(0, 10, (16,), device=device)
    return model, lambda m: nn.functional.cross_entropy(m(x), y)


def gemm(device):
    """GEMM-bound: 3 x (Linear(1024, 1024), GELU) + Linear(1024, 1), batch 64."""
    layers = []
    for _ in range(3):
        layers += [nn.Linear(1024, 1024), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(1024, 1)).to(device)
    x, y = torch.randn(64, 1024, device=device), torch.randn(64, 1, device=device)
    return model, lambda m: nn.functional.mse_loss(m(x), y)


def _stock(name):
    """A stock Hugging Face model from a small config (4 layers, width 128, vocab 1000; the
    config's own dropout), batch 4 x 64 tokens, the model's own loss. ``loss_type`` is set because
    transformers logs a ``warning_once`` in ``loss_function`` otherwise."""

    def build(device):
        import transformers

        common = dict(vocab_size=1000, bos_token_id=0, eos_token_id=0)
        if name == "gpt2":
            model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
                n_layer=4, n_embd=128, n_head=4, n_positions=128, **common))
        elif name == "bert":
            model = transformers.BertForMaskedLM(transformers.BertConfig(
                num_hidden_layers=4, hidden_size=128, num_attention_heads=4, intermediate_size=512,
                max_position_embeddings=128, vocab_size=1000))
        else:
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
                num_hidden_layers=4, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=512, max_position_embeddings=128, **common))
        model.loss_type = "ForMaskedLM" if name == "bert" else "ForCausalLM"
        model = model.to(device)
        ids = torch.randint(1, 1000, (4, 64), generator=torch.Generator().manual_seed(0)).to(device)
        return model, lambda m: m(input_ids=ids, labels=ids).loss
    build.__doc__ = f"stock {name}: " + (_stock.__doc__ or "")
    return build


WORKLOADS = {"blocks8": blocks8, "rnn": rnn, "cnn": cnn, "gemm": gemm,
             **{n: _stock(n) for n in ("gpt2", "bert", "llama")}}


_UNCOMPILED = ("module_uncompiled_runs", "optimizer_uncompiled_runs")  # captured graphs run op by op
# what runs once compiled: regions, captured graphs, and small windows, which run eagerly once their
# region was compiled (Note [Small windows run eagerly] in adaptive_eager._hot)
_COMPILED = ("compiled_runs", "module_compiled_runs", "optimizer_compiled_runs", "small_windows")


class Variant:
    def __init__(self, name, device, build, wrap=None, context=None, compile_step=False):
        torch.manual_seed(0)
        model, self.loss_of = build(device)
        model.train()
        self.model = wrap(model) if wrap else model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if compile_step:  # the optimizer step compiled too, as PyTorch's "compiling the optimizer" recipe does
            self.opt.step = torch.compile(self.opt.step)
        self.name, self.device, self.context = name, device, context
        self.times: list[float] = []
        self.compiled_at = None
        self.error = None

    def run(self, steps):
        if self.error:
            return
        ctx = self.context() if self.context else _null()
        try:
            with ctx:
                for _ in range(steps):
                    before = ae.metrics() if self.context else None
                    t0 = time.perf_counter()
                    train_step(self.model, self.loss_of, self.opt)
                    self.times.append(time.perf_counter() - t0)
                    if before is not None and self.compiled_at is None:
                        after = ae.metrics()
                        if (any(after.get(k, 0) > before.get(k, 0) for k in _COMPILED)
                                and after.get("replayed_regions", 0) == before.get("replayed_regions", 0)
                                and all(after.get(k, 0) == before.get(k, 0) for k in _UNCOMPILED)):
                            self.compiled_at = len(self.times)
        except Exception as e:  # noqa: BLE001 - one broken variant must not hide the others
            self.error = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"

    def counts(self):
        """(kernels, host syncs) of one more step, counted outside the library (cuda only)."""
        if self.device != "cuda" or self.error:
            return None, None
        ctx = self.context() if self.context else _null()
        from torch.profiler import ProfilerActivity, profile
        with ctx, profile(activities=[ProfilerActivity.CUDA]) as prof:
            self.run_one()
        kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        with ctx, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                self.run_one()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = sum(1 for w in caught if "synchroniz" in str(w.message))
        return kernels, syncs

    def run_one(self):
        train_step(self.model, self.loss_of, self.opt)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--steps", type=int, default=200, help="steps per variant (default 200)")
    parser.add_argument("--round", type=int, default=20, help="steps of one variant before the next runs")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {','.join(WORKLOADS)}"
                        " (default: all)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile variants")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False")
    keys = [k.strip() for k in args.only.split(",") if k.strip()] or list(WORKLOADS)
    unknown = [k for k in keys if k not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {list(WORKLOADS)}")
    rows = []
    for key in keys:
        build = WORKLOADS[key]
        variants = [Variant("eager", args.device, build),
                    Variant("adaptive", args.device, build, context=lambda: ae.adaptive_eager(device=args.device))]
        if not args.no_compile:
            variants.append(Variant("torch.compile", args.device, build, wrap=torch.compile))
            variants.append(Variant("torch.compile + step", args.device, build, wrap=torch.compile, compile_step=True))
            # the user's own torch.compile inside the mode (Note [User torch.compile] in
            # adaptive_eager._compile): no slower than torch.compile alone
            variants.append(Variant("torch.compile in adaptive", args.device, build, wrap=torch.compile,
                                    context=lambda: ae.adaptive_eager(device=args.device)))
            if args.device == "cuda":
                variants.append(Variant("reduce-overhead", args.device, build,
                                        wrap=lambda m: torch.compile(m, mode="reduce-overhead")))
        done = 0
        while done < args.steps:
            n = min(args.round, args.steps - done)
            for v in variants:
                v.run(n)
            done += n
            print(f"[user_step] {key}: {done}/{args.steps} steps", file=sys.stderr, flush=True)
        eager_ms = statistics.median(variants[0].times[args.steps // 2:]) * 1e3
        for v in variants:
            if v.error or not v.times:
                rows.append((key, v.name, v.error or "no steps", "", "", "", "", "", ""))
                continue
            steady = statistics.median(v.times[len(v.times) // 2:]) * 1e3
            kernels, syncs = v.counts()
            rows.append((key, v.name, f"{steady:.2f}", f"{eager_ms / steady:.2f}x", f"{v.times[0]:.2f}",
                         f"{max(v.times[1:], default=0) * 1e3:.0f}",
                         "" if v.context is None else str(v.compiled_at or "never"),
                         "-" if kernels is None else str(kernels), "-" if syncs is None else str(syncs)))
    head = ("workload", "variant", "steady ms", "speed vs eager", "first step s", "max later ms",
            "compiled at step", "kernels/step", "host syncs/step")
    print(f"\npython benchmarks/user_step.py {' '.join(sys.argv[1:])}  (torch {torch.__version__}, "
          f"{args.steps} steps, default options)\n")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
