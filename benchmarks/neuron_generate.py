"""Hugging Face ``generate()`` on the ``neuron`` device: launches per token and compiles, eager and adaptive.

    python benchmarks/neuron_generate.py [--models gpt2,llama] [--variants dynamic,static] [--tokens 16] [--calls 3]
                                         [--per-call]

The tiny stock GPT-2 and Llama of ``neuron_launches.py`` (``tiny_model``: 2 layers, width 32, same
weights on every device) greedily generate ``--tokens`` tokens from an 8-token prompt on the
emulated ``neuron`` device (``adaptive_eager.emulate_neuron()``, the stablehlo backend: static
shapes only, as neuronx-cc). Variants: ``dynamic``, the default cache
(``model.generate(ids, max_new_tokens=N, do_sample=False)``), and ``static``,
``cache_implementation="static"`` (transformers' StaticCache: fixed-shape K/V, ``cache_position`` a
tensor), with ``disable_compile=True``: on a ``neuron`` device transformers otherwise wraps the
forward in ``torch.compile(backend="neuron")``, torch-neuronx's backend, which the emulation does
not register (and which is not adaptive eager's). These are counts, not times. Per variant, two fresh
processes with an empty cache directory each:

- eager: the device's own launch count per token of plain eager ``generate()``;
- default options, first call: compiles and launches per token of the first ``generate()`` under
  ``adaptive_eager()`` (background compiles: what a user sees first);
- ``hot_after=1, async_compile=False``: compiles of the first call and of the last of ``--calls``
  calls, launches per token of the last call counted by the library (``metrics()['launches']``)
  and by the device (``neuron_emulation.launches()``), and the host reads per token of the last
  call (flushes whose reason is a read of a value: ``bool``, ``item``...);
- tokens: whether every call's tokens equal CPU eager's.

``--per-call`` prints instead, per model, cache and ``tiers`` ('capture', the default, and 'hot':
the forward recorded with the rest of the token), each of ``--calls`` calls' compiles and launches
per token (the library's, the device's) with ``hot_after=1, async_compile=False``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

MODELS = ("gpt2", "llama")
VARIANTS = ("dynamic", "static")
PROMPT = 8
NOT_HOST_READS = {"module_capture", "optimizer_step", "torch_compile", "window_full", "sync", "exit"}


def _generate(model, ids, variant: str, tokens: int):
    extra = {"cache_implementation": "static", "disable_compile": True} if variant == "static" else {}
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                          do_sample=False, use_cache=True, pad_token_id=0, **extra)


DETAIL = ("flushes", "module_capture_misses", "module_captured_calls", "run_alone", "replay_reasons", "ops_eager",
          "compiled_runs", "module_compiled_runs", "windows")


def _diff(a: dict, b: dict) -> dict:
    """What changed between two ``metrics()``: counters as differences, counter dicts key by key."""
    out = {}
    for k, v in b.items():
        if isinstance(v, dict):
            d = {kk: vv - a[k].get(kk, 0) for kk, vv in v.items() if isinstance(vv, (int, float)) and vv != a[k].get(kk, 0)}
            if d:
                out[k] = d
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and v != a[k]:
            out[k] = v - a[k]
    return out


def _child(model_name: str, variant: str, mode: str, tokens: int, calls: int) -> dict:
    """Runs in its own process: the emulated device is process-wide and compiled regions are kept
    per process (and compiles in the background outlive their call), so each measurement starts
    from nothing. ``mode``: ``default`` (the first call with default options), ``hot`` (eager, then
    ``--calls`` calls with ``hot_after=1``), or ``tiers-`` and a ``tiers`` value for ``--per-call``."""
    import adaptive_eager as ae
    from adaptive_eager import neuron_emulation as ne
    from neuron_launches import tiny_model

    ids = torch.randint(1, 64, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    reference = _generate(tiny_model(model_name, "cpu").eval(), ids, variant, tokens).tolist()
    ne.emulate_neuron()
    model = tiny_model(model_name, "neuron").eval()
    device_ids = ids.to("neuron")
    if mode == "default":
        with ae.adaptive_eager():
            m0, d0 = ae.metrics(), ne.launches()
            out = _generate(model, device_ids, variant, tokens)
            ae.sync()
            m1 = ae.metrics()
            return {"compiles": m1["compiles"] - m0["compiles"], "launches": (ne.launches() - d0) / tokens,
                    "equal": out.cpu().tolist() == reference}
    if mode.startswith("tiers-"):  # --per-call: each call's compiles and launches, with these tiers
        rows = []
        with ae.adaptive_eager(hot_after=1, async_compile=False, tiers=mode.removeprefix("tiers-")):
            for _ in range(calls):
                m0, d0 = ae.metrics(), ne.launches()
                out = _generate(model, device_ids, variant, tokens)
                ae.sync()
                m1, d1 = ae.metrics(), ne.launches()
                rows.append({"compiles": m1["compiles"] - m0["compiles"],
                             "library": (m1["launches"] - m0["launches"]) / tokens, "device": (d1 - d0) / tokens,
                             "equal": out.cpu().tolist() == reference})
        return {"calls": rows}
    before = ne.launches()
    equal = _generate(model, device_ids, variant, tokens).cpu().tolist() == reference
    r = {"eager": (ne.launches() - before) / tokens}
    with ae.adaptive_eager(hot_after=1, async_compile=False):
        for call in range(calls):
            m0, d0 = ae.metrics(), ne.launches()
            out = _generate(model, device_ids, variant, tokens)
            ae.sync()
            m1, d1 = ae.metrics(), ne.launches()
            equal &= out.cpu().tolist() == reference
            if call == 0:
                r["first_compiles"] = m1["compiles"] - m0["compiles"]
    r["equal"] = equal
    r["last_compiles"] = m1["compiles"] - m0["compiles"]
    r["library"] = (m1["launches"] - m0["launches"]) / tokens
    r["device"] = (d1 - d0) / tokens
    r["detail"] = {k: v for k, v in _diff(m0, m1).items() if k in DETAIL}
    reads = {k: v - m0["flushes"].get(k, 0) for k, v in m1["flushes"].items() if k not in NOT_HOST_READS}
    r["host_reads"] = sum(reads.values()) / tokens
    return r


def _run_child(model_name: str, variant: str, mode: str, tokens: int, calls: int) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NEURON_EAGER_CACHE_DIR": cache}
        env.pop("NEURON_EAGER_EMULATE", None)
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", f"{model_name}:{variant}:{mode}",
                              "--tokens", str(tokens), "--calls", str(calls)], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{model_name} {variant} {mode}: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS))
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    parser.add_argument("--tokens", type=int, default=16, help="new tokens per generate() call")
    parser.add_argument("--calls", type=int, default=3, help="generate() calls with hot_after=1 (the last is reported)")
    parser.add_argument("--per-call", action="store_true",
                        help="instead: each call's compiles and launches a token, the captured forward "
                             "(tiers='capture', the default) against tiers='hot'")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(*args.child.split(":"), args.tokens, args.calls)))
        return
    models = [m for m in args.models.split(",") if m]
    variants = [v for v in args.variants.split(",") if v]
    bad = [m for m in models if m not in MODELS] + [v for v in variants if v not in VARIANTS]
    if bad:
        parser.error(f"unknown model(s) or variant(s) {bad}; models: {', '.join(MODELS)}; variants: {', '.join(VARIANTS)}")
    print(f"python benchmarks/neuron_generate.py --models {','.join(models)} --variants {','.join(variants)} "
          f"--tokens {args.tokens} --calls {args.calls}{' --per-call' if args.per_call else ''}; the emulated "
          f"neuron device (stablehlo backend), torch {torch.__version__}")
    if args.per_call:
        _per_call(models, variants, args.tokens, args.calls)
        return
    print("| model | cache | eager launches / token | default options, 1st call: compiles, launches / token "
          "| hot_after=1: compiles 1st call, last call | launches / token, library (device) | host reads / token "
          "| tokens = CPU eager's |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for model_name in models:
        for variant in variants:
            try:
                d = _run_child(model_name, variant, "default", args.tokens, args.calls)
                r = _run_child(model_name, variant, "hot", args.tokens, args.calls)
            except RuntimeError as e:
                print(f"| {model_name} | {variant} | failed: {str(e).splitlines()[-1:]} |", flush=True)
                continue
            print(f"| {model_name} | {variant} | {r['eager']:.1f} | {d['compiles']}, {d['launches']:.1f} "
                  f"| {r['first_compiles']}, {r['last_compiles']} | {r['library']:.1f} ({r['device']:.1f}) "
                  f"| {r['host_reads']:.2f} | {'yes' if r['equal'] and d['equal'] else 'NO'} |", flush=True)
            print(f"<!-- {model_name} {variant}, last call: {r['detail']} -->", flush=True)


def _per_call(models, variants, tokens: int, calls: int) -> None:
    """Each ``generate()`` call's compiles and launches a token (library's, device's), with
    ``hot_after=1, async_compile=False``, ``tiers`` 'capture' and 'hot'."""
    print("| model | cache | tiers | " + " | ".join(f"call {c + 1}: compiles, launches / token (device)"
                                                    for c in range(calls)) + " | tokens = CPU eager's |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in range(calls)) + " | --- |")
    for model_name in models:
        for variant in variants:
            for tiers in ("capture", "hot"):
                try:
                    rows = _run_child(model_name, variant, f"tiers-{tiers}", tokens, calls)["calls"]
                except RuntimeError as e:
                    print(f"| {model_name} | {variant} | {tiers} | failed: {str(e).splitlines()[-1:]} |", flush=True)
                    continue
                cells = [f"{r['compiles']}, {r['library']:.1f} ({r['device']:.1f})" for r in rows]
                equal = "yes" if all(r["equal"] for r in rows) else "NO"
                print(f"| {model_name} | {variant} | {tiers} | " + " | ".join(cells) + f" | {equal} |", flush=True)


if __name__ == "__main__":
    main()
