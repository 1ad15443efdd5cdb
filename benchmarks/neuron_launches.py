"""NEFF launches per step on the ``neuron`` device: plain eager, adaptive eager, and what
torch-neuronx's own op concatenation would make of the same op stream at best.

    python benchmarks/neuron_launches.py [--only mlp_train,gpt,cnn] [--steps 3]
    python benchmarks/neuron_launches.py --only cnn,gpt2 --defaults 30
    python benchmarks/neuron_launches.py --only gpt2,bert --dropout 0.1

Runs the suite's workloads (``workloads.py``, and its ``cnn``) on ``neuron``: the real device where
torch-neuronx is installed, else the emulated one (``adaptive_eager.emulate_neuron()``, the stablehlo
backend standing in for neuronx-cc). These are counts, not times, so the machine's load does not
change them. Per step:

- eager: the ops of one eager step that compute (Note [Emulated launches] in
  ``adaptive_eager.neuron_emulation``: views, metadata and allocations launch nothing);
- concatenation: the same eager op stream cut as torch-neuronx's concatenation engine cuts it
  (``../shared/TRAINIUM.md``): a fused segment ends at a matmul-family op and includes it; a copy,
  an in-place op (dead intermediates are pruned by default) or any op it cannot compile ends the
  open segment and runs alone; a step's end (its sync) ends the open segment. This is its best case:
  it ignores the 1024-op buffer limit and the unfused flush when the device queue runs low;
- adaptive, library: ``metrics()['launches']`` per steady-state step, after warm-up steps that
  compile every region in place (``hot_after=1, async_compile=False``);
- adaptive, device: the same steps counted by the emulated device itself (``launches()``: the ops that
  reached it and the compiled executables run on it), with the executables among them; the two
  adaptive counts are equal (``tests/test_neuron_emulation.py`` holds them so). On a real device
  only the library's count is printed.

``--defaults N``: instead, N steps from the first under default options (``adaptive_eager()`` as a
user enters it: background compiles, ``hot_after`` 2), one row a step (device launches, ops that
reached the device outside executables, windows replayed, captured graphs run op by op while their
compile ran, compiles and compile seconds so far, the step's wall time), and the first step from
which every step runs compiled: no window replayed, no op run eagerly and no captured graph run op
by op, and on the emulated device no op reaching it outside an executable but the one copy of the
dropout masks (``--dropout``: Note [Dropout drawn at record time]). Run it with a
fresh ``NEURON_EAGER_CACHE_DIR`` to see a first run; the step depends on how fast the compiles are
(the machine's load), unlike the counts above.

Besides the suite's workloads: ``cnn`` (2 conv blocks with BatchNorm, cross-entropy, AdamW) and
stock Hugging Face ``gpt2``, ``bert``, ``llama`` training steps from tiny configs (2 layers, width
32, AdamW, as tests/test_models.py builds them) with dropout 0 (``--dropout P`` for GPT-2's and BERT's:
their masks are drawn on the host as torch-neuronx's kernel draws them, Note [Dropout drawn at record
time] in ``adaptive_eager._ops``), ``use_cache=False`` (the cache's
``torch.tensor([], device=...)`` does not trace on the emulated device yet) and ``model.loss_type``
set (transformers 5.x logs a ``warning_once`` in ``loss_function`` otherwise, which TorchDynamo
cannot trace, so the forward would not be captured).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import adaptive_eager as ae  # noqa: E402
from adaptive_eager import neuron_emulation as ne  # noqa: E402
from workloads import BUILDERS, Workload, build_cnn  # noqa: E402

# torch-neuronx ends a fused segment at these (forward and backward: their ATen ops)
MATMUL_FAMILY = {"mm", "bmm", "addmm", "baddbmm", "addbmm", "linear", "matmul", "convolution",
                 "convolution_backward", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention"}
RUNS_ALONE = {"copy_", "_to_copy", "_local_scalar_dense"}  # copies and host reads: not fused


class OpStream(TorchDispatchMode):
    """The packet names of the ops that launch (Note [Emulated launches]), in program order."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in ("empty", "empty_strided", "_unsafe_view"):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def concatenated_launches(ops: list[str]) -> int:
    """Launches of one step's op stream under torch-neuronx's concatenation, at best (see above)."""
    launches, open_segment = 0, 0
    for name in ops:
        if name in MATMUL_FAMILY:
            launches += 1  # the segment, ending with (and including) the matmul
            open_segment = 0
        elif name in RUNS_ALONE or name.endswith("_"):
            launches += (1 if open_segment else 0) + 1
            open_segment = 0
        else:
            open_segment += 1
    return launches + (1 if open_segment else 0)


def _training(key: str, title: str, model: torch.nn.Module, forward_loss) -> Workload:
    """An AdamW step (zero_grad, forward and loss, backward, step) on two copies of ``model``."""

    def make(m):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)

        def step():
            opt.zero_grad(set_to_none=True)
            loss = forward_loss(m)
            loss.backward()
            opt.step()
            return loss
        return step

    return Workload(key, title, "step", eager=make(copy.deepcopy(model)), adaptive=make(copy.deepcopy(model)),
                    compile=None)


def tiny_model(name: str, device: str) -> torch.nn.Module:
    """Stock Hugging Face ``gpt2``, ``bert`` or ``llama`` from a tiny config (2 layers, width 32, vocab
    64, 32 positions, dropout 0, ``use_cache=False``), seeded, on ``device``: the same weights on every
    device. ``neuron_generate.py`` builds its models here too."""
    import transformers

    torch.manual_seed(0)
    vocab = 64
    if name == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=vocab, n_positions=32, bos_token_id=0, eos_token_id=0,
            resid_pdrop=DROPOUT, embd_pdrop=DROPOUT, attn_pdrop=DROPOUT, use_cache=False))
    elif name == "bert":
        model = transformers.BertForMaskedLM(transformers.BertConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=vocab,
            max_position_embeddings=32, hidden_dropout_prob=DROPOUT, attention_probs_dropout_prob=DROPOUT))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, vocab_size=vocab, max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
            use_cache=False))
    model.loss_type = "ForMaskedLM" if name == "bert" else "ForCausalLM"
    # tied weights stay tied on the emulated device, as on a real one (Note [Module conversions keep
    # parameters] in adaptive_eager.neuron_emulation): no ``tie_weights()`` after the move
    return model.to(device)


def _hugging_face(name: str):
    def build(device: str) -> Workload:
        model = tiny_model(name, device)
        vocab = model.config.vocab_size
        ids = torch.randint(1, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(ids)
        mask[1, 9:] = 0
        ids, mask = ids.to(device), mask.to(device)
        return _training(name, f"stock {name} train step (tiny config, AdamW)", model,
                         lambda m: m(input_ids=ids, attention_mask=mask, labels=ids).loss)
    return build


DROPOUT = 0.0  # ``--dropout``: the stock models' dropout probabilities (Llama has none)
WORKLOADS = {**BUILDERS, "cnn": build_cnn, **{n: _hugging_face(n) for n in ("gpt2", "bert", "llama")}}


def measure(key: str, steps: int) -> dict:
    w = WORKLOADS[key]("neuron")
    w.eager()  # warm: lazily made state (AdamW's moments) launches only on the first step
    stream = OpStream()
    before = ne.launches()
    with stream:
        w.eager()
    eager = ne.launches() - before
    with ae.adaptive_eager(hot_after=1, async_compile=False):
        for _ in range(3):  # first sight, compile in place, compiled hits
            out = w.adaptive()  # held over the sync: what nobody holds is rightly not computed
            ae.sync()
        m0, d0, x0 = ae.metrics(), ne.launches(), ne.executables_run()
        for _ in range(steps):
            out = w.adaptive()
            ae.sync()
        m1, d1, x1 = ae.metrics(), ne.launches(), ne.executables_run()
    del out
    return {
        "title": w.title,
        "eager": eager,
        "stream": len(stream.ops),
        "concatenation": concatenated_launches(stream.ops),
        "adaptive": (m1["launches"] - m0["launches"]) / steps,
        "device": (d1 - d0) / steps if ne.is_emulated() else None,
        "executables": (x1 - x0) / steps if ne.is_emulated() else None,
        "compiles": m1["compiles"],
        "run_alone": (sum(m1["run_alone"].values()) - sum(m0["run_alone"].values())) / steps,
        "eager_run": (m1["ops_eager"] - m0["ops_eager"]) / steps,
        "replayed": (m1["replayed_regions"] - m0["replayed_regions"]) / steps,
    }


def _uncompiled(m0: dict, m1: dict) -> tuple[int, int, int]:
    """Windows replayed, ops run eagerly and captured graphs run op by op between two metrics()."""
    by_op = sum(m1[k] - m0[k] for k in ("module_uncompiled_runs", "optimizer_uncompiled_runs"))
    return m1["replayed_regions"] - m0["replayed_regions"], m1["ops_eager"] - m0["ops_eager"], by_op


def from_the_first_step(key: str, steps: int) -> None:
    """``--defaults``: per step from the first, under default options (see the module docstring)."""
    emulated = ne.is_emulated()
    w = WORKLOADS[key]("neuron")
    print(f"\n{key}: {w.title}, default options, {steps} steps")
    print("| step | device launches (executables) | outside executables | library launches | windows replayed "
          "| ops eager | captured graphs op by op | compiles so far | compile seconds so far | step ms |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    compiled_from = None
    ae.reset_metrics()  # compiles and compile seconds of this workload's run
    start = time.perf_counter()
    with ae.adaptive_eager():
        for step in range(1, steps + 1):
            m0, d0, x0, t0 = ae.metrics(), ne.launches(), ne.executables_run(), time.perf_counter()
            out = w.adaptive()
            ae.sync()
            m1, d1, x1 = ae.metrics(), ne.launches(), ne.executables_run()
            ms = (time.perf_counter() - t0) * 1e3
            replayed, eager, by_op = _uncompiled(m0, m1)
            outside = (d1 - d0) - (x1 - x0) if emulated else None
            masks = 1 if DROPOUT and key in ("gpt2", "bert") else 0  # their one copy a step
            compiled = replayed == eager == by_op == 0 and (not emulated or outside <= masks)
            compiled_from = (compiled_from or step) if compiled else None
            device = f"{d1 - d0} ({x1 - x0})" if emulated else "n/a"
            print(f"| {step} | {device} | {'n/a' if outside is None else outside} "
                  f"| {m1['launches'] - m0['launches']} | {replayed} | {eager} | {by_op} | {m1['compiles']} "
                  f"| {m1['compile_seconds']:.1f} | {ms:.0f} |", flush=True)
    del out
    print(f"{key}: every step compiled from step {compiled_from}" if compiled_from else
          f"{key}: step {steps} still not compiled", f"({time.perf_counter() - start:.1f} s for {steps} steps)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(BUILDERS), help="comma-separated subset of " + ",".join(WORKLOADS))
    parser.add_argument("--steps", type=int, default=3, help="steady-state steps counted per workload")
    parser.add_argument("--defaults", type=int, metavar="N", default=0,
                        help="instead: N steps from the first under default options, one row a step")
    parser.add_argument("--dropout", type=float, default=0.0, metavar="P",
                        help="dropout probability of the stock gpt2 and bert (default 0)")
    args = parser.parse_args()
    if not 0.0 <= args.dropout < 1.0:
        parser.error(f"--dropout must be in [0, 1), got {args.dropout}")
    global DROPOUT
    DROPOUT = args.dropout
    keys = [k for k in args.only.split(",") if k]
    unknown = [k for k in keys if k not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    device = "the real neuron device"
    if not ne.real_device_present():
        ne.emulate_neuron()
        device = "the emulated neuron device (stablehlo backend)"
    print(f"python benchmarks/neuron_launches.py --only {','.join(keys)} "
          f"{f'--defaults {args.defaults}' if args.defaults else f'--steps {args.steps}'}"
          f"{f' --dropout {args.dropout:g}' if args.dropout else ''}; {device}, "
          f"backend {ae.load_options().backend}, torch {torch.__version__}")
    if args.defaults:
        for key in keys:
            from_the_first_step(key, args.defaults)
        return
    print("| workload | eager launches / step | torch-neuronx concatenation, at best | adaptive eager, library count "
          "| adaptive eager, device count (executables) | eager / adaptive | concatenation / adaptive "
          "| of adaptive's: ops run alone, ops run eagerly, windows replayed |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for key in keys:
        r = measure(key, args.steps)
        a = max(r["adaptive"], 1e-9)
        device_count = "n/a" if r["device"] is None else f"{r['device']:.1f} ({r['executables']:g})"
        print(f"| {key} | {r['eager']} | {r['concatenation']} | {r['adaptive']:.1f} | {device_count} "
              f"| {r['eager'] / a:.1f}x | {r['concatenation'] / a:.1f}x "
              f"| {r['run_alone']:g}, {r['eager_run']:g}, {r['replayed']:g} |", flush=True)


if __name__ == "__main__":
    main()
