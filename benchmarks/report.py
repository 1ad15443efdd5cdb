"""The suite's report: tables, targets with PASS/FAIL, the plot, and sections of RESULTS.md.

Reads what ``measure.Result`` holds; imports nothing heavy (``warm_restart.py`` writes its
section with ``write_section`` without importing torch).
"""

from __future__ import annotations

import datetime
import os
import statistics
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from measure import Result

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS_MD = os.path.join(HERE, "RESULTS.md")
HISTORY = "\n# History\n"  # RESULTS.md: the current figures above it, earlier ones below
FLUSH_TARGET_MS = 0.3
LAUNCH_TARGET = 20.0


def png_name(device: str) -> str:
    return "results.png" if device == "cpu" else f"results_{device}.png"


def suite_section(device: str) -> str:
    """Each device's table has its own section of RESULTS.md (a cuda run keeps the cpu one)."""
    return "suite" if device == "cpu" else f"suite-{device}"


def top(kinds: Counter, n: int = 6) -> str:
    items = kinds.most_common()
    text = ", ".join(f"{k} {v}" for k, v in items[:n])
    rest = sum(v for _, v in items[n:])
    return text + (f", other {rest}" if rest else "")


def kernel_breakdown(results: list[Result]) -> str:
    lines = []
    for r in results:
        for name in ("eager", "adaptive", "torch.compile"):
            kinds = r.kernel_kinds.get(name)
            if kinds:
                lines.append(f"- {r.key}, {name} ({sum(kinds.values())}): {top(kinds)}")
    return "\n".join(lines)


def _ms(s: float | None) -> str:
    return "—" if s is None else (f"{s * 1e3:.3f}" if s < 0.01 else f"{s * 1e3:.2f}")


def _x(a: float | None, b: float | None) -> str:
    return "—" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def _n(v: float | None) -> str:
    if v is None:
        return "—"
    return f"{v:.0f}" if abs(v - round(v)) < 0.05 else f"{v:.1f}"


def main_table(results: list[Result]) -> str:
    rows = [
        "| workload | eager ms | adaptive ms | torch.compile ms | adaptive/eager speedup | "
        "adaptive/compile time ratio | launches/iter eager -> adaptive |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        e, a, c = r.median("eager"), r.median("adaptive"), r.median("torch.compile")
        eq, la = r.per_iter("eager_equivalent_launches"), r.per_iter("launches")
        launches = "—" if eq is None else f"{_n(eq)} -> {_n(la)} ({_x(eq, la)} fewer)"
        profiled = r.kernels.get("eager")
        if eq == 0 and la and profiled:
            # captured at its first call (an optimizer step): the library saw no eager op to count,
            # so eager's side is its profiled kernels (the details table's cross-check)
            launches = f"{_n(profiled)} profiled -> {_n(la)} ({_x(profiled, la)} fewer)"
        host = r.per_iter("host_scalar_ops")
        if eq is not None and host:
            launches += f"; without {_n(host)} host-scalar ops: {_n(eq - host)} -> {_n(la - host)} ({_x(eq - host, la - host)} fewer)"
        a_txt = _ms(a) if "adaptive" not in r.errors else "error"
        c_txt = _ms(c) if "torch.compile" not in r.errors else ("n/a" if r.errors["torch.compile"] == "not applicable" else "error")
        state = r.steady_state()
        if state and state != "compiled" and a is not None:
            a_txt += f" ({state})"
        rows.append(f"| {r.title} (per {r.unit}) | {_ms(e)} | {a_txt} | {c_txt} | {_x(e, a)} | {_x(a, c)} | {launches} |")
        for name in r.times:
            if name not in ("eager", "adaptive", "torch.compile"):
                rows.append(f"| ↳ reference: {name} | {_ms(r.median(name))} | — | — | "
                            f"adaptive vs it: {_x(r.median(name), a)} | — | — |")
    return "\n".join(rows)


def detail_table(results: list[Result]) -> str:
    rows = [
        "| workload | iters/sample eager / adaptive / compile | adaptive state in timed samples (warm-up) | windows/iter compiled / replayed "
        "| adaptive launches/iter: regions + eager-run ops | adaptive flush ms/iter | adaptive warm-up compiles; loads from neff_cache "
        "| torch.compile warm-up s | profiled kernels/iter eager / adaptive / compile | adaptive value check |",
        "| --- | ---: | --- | --- | --- | ---: | ---: | ---: | --- | --- |",
    ]
    for r in results:
        w = r.warm
        if w:
            state = f"{r.steady_state() or 'not timed'} (warm-up: {w['state']} after {w['iterations']} it)"
            if w.get("not_compiled"):
                state += f"; not compiled: {w['not_compiled']}"
            if w.get("blacklisted"):
                state += f"; blacklisted: {w['blacklisted']}"
            if r.unsteady_samples:
                state += f"; {r.unsteady_samples} samples retaken (compiled during timing)"
        else:
            state = "error: " + r.errors.get("adaptive", "not run")
        windows = "—" if not r.deltas else f"{_n(r.per_iter('compiled_runs'))} / {_n(r.per_iter('replayed_regions'))}"
        split = "—"
        if r.deltas:
            la, ea = r.per_iter("launches"), r.per_iter("ops_eager")
            split = f"{_n(la)} = {_n(la - ea)} + {_n(ea)}"
        flush = _ms(statistics.median(r.flush)) if r.flush else "—"
        k = r.kernels
        kern = " / ".join("—" if k.get(n) is None else str(k[n]) for n in ("eager", "adaptive", "torch.compile"))
        cs = f"{w['compiles']} in {w['compile_s']:.1f} s; {w['disk_hits']} from disk" if w else "—"
        tc = "—" if r.compile_warm_s is None else f"{r.compile_warm_s:.1f}"
        check = "—" if r.check is None else (r.check or "matches eager")
        iters = " / ".join(str(r.iters.get(n, "—")) for n in ("eager", "adaptive", "torch.compile"))
        rows.append(f"| {r.key} | {iters} | {state} | {windows} | {split} | {flush} | {cs} | {tc} | {kern} | {check} |")
    return "\n".join(rows)


def targets(results: list[Result]) -> list[tuple[str, bool | None, str]]:
    """(target, passed (None: could not be measured), evidence)."""
    by = {r.key: r for r in results}
    out = []
    if "chain" in by:
        r = by["chain"]
        e, a, c = r.median("eager"), r.median("adaptive"), r.median("torch.compile")
        ok = None if None in (e, a, c) else (a <= 1.25 * c and e >= 2 * a)
        out.append(("chain: adaptive <= 1.25x torch.compile's time and >= 2x faster than eager", ok,
                    f"{_x(a, c)} torch.compile's time; {_x(e, a)} eager's speed"))
    if "mlp_train" in by:
        r = by["mlp_train"]
        e, a = r.median("eager"), r.median("adaptive")
        ok = None if e is None or a is None else a <= e
        out.append(("MLP train step: adaptive no slower than eager", ok, f"{_ms(a)} ms vs {_ms(e)} ms ({_x(e, a)})"))
    if "adamw" in by:
        r = by["adamw"]
        a, ref = r.median("adaptive"), r.median("eager foreach=True")
        ok = None if a is None or ref is None else a <= ref
        out.append(("AdamW: adaptive foreach=False step no slower than eager foreach=True", ok,
                    f"{_ms(a)} ms vs {_ms(ref)} ms"))
    if "gpt" in by:
        r = by["gpt"]
        eq, la = r.per_iter("eager_equivalent_launches"), r.per_iter("launches")
        host = r.per_iter("host_scalar_ops") or 0
        # device launches: on an accelerator AdamW's 0-dim step counters are CPU tensors, which
        # adaptive eager does not intercept (they count on neither side); on a CPU target they do
        ok = None if eq is None or not la else (eq - host) / max(la - host, 1) >= LAUNCH_TARGET
        k = r.kernels
        extra = f"; counting {_n(host)} host-scalar ops (0-dim CPU step counters) as launches: {_n(eq)} -> {_n(la)} ({_x(eq, la)})" if host else ""
        if k.get("eager") and k.get("adaptive"):
            extra += f"; profiled kernels {k['eager']} -> {k['adaptive']} ({k['eager'] / k['adaptive']:.1f}x)"
        out.append((f"GPT block step: >= {LAUNCH_TARGET:.0f}x fewer device launches (metrics: a compiled region "
                    "is one launch, as a NEFF is on Trainium; the profiled count has each Inductor kernel)", ok,
                    f"{_n(eq - host)} -> {_n(la - host)} per step ({_x(eq - host, la - host)}){extra}"))
    if "tiny" in by:
        r = by["tiny"]
        fl = statistics.median(r.flush) if r.flush else None
        hits = r.per_iter("cache_hits_memory")
        compiled = r.per_iter("compiled_runs")
        hit = bool(hits) and bool(compiled) and r.per_iter("replayed_regions") == 0
        ok = None if fl is None else (fl * 1e3 <= FLUSH_TARGET_MS and hit)
        out.append((f"1000-op window: flush that hits a compiled region <= {FLUSH_TARGET_MS} ms host time", ok,
                    f"{_ms(fl)} ms per flush; compiled hits/iter {_n(hits)}, replayed/iter {_n(r.per_iter('replayed_regions'))}"))
    for r in results:
        state = r.steady_state()
        evidence = state or r.errors.get("adaptive", "not run")
        if r.deltas:
            evidence += (f" ({_n(r.per_iter('compiled_runs'))} compiled / {_n(r.per_iter('replayed_regions'))} "
                         f"replayed windows per iteration)")
        if r.warm.get("not_compiled"):
            evidence += f"; not compiled: {r.warm['not_compiled']}"
        out.append((f"{r.key}: adaptive runs in compiled steady state", None if state is None else state == "compiled",
                    evidence))
    return out


def targets_md(ts) -> str:
    lines = []
    for name, ok, evidence in ts:
        mark = "PASS" if ok else ("FAIL" if ok is False else "NOT MEASURED")
        lines.append(f"- **{mark}** {name}: {evidence}")
    return "\n".join(lines)


def errors_md(results: list[Result]) -> str:
    lines = [f"- {r.key} / {v}: {msg}" for r in results for v, msg in r.errors.items() if msg != "not applicable"]
    return "\n".join(lines)



def plot(results: list[Result], path: str, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.key for r in results]
    xs = list(range(len(results)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))

    def speedup(r: Result, variant: str) -> float | None:
        e, v = r.median("eager"), r.median(variant)
        return e / v if e and v else None

    w = 0.38
    for offset, variant, label in ((-w / 2, "adaptive", "adaptive eager"), (w / 2, "torch.compile", "torch.compile")):
        vals = [speedup(r, variant) for r in results]
        pos = [x + offset for x, v in zip(xs, vals) if v]
        got = [v for v in vals if v]
        # bars grow from 1x (no change) up or down, so a slowdown reads as a slowdown on a log axis
        ax1.bar(pos, [v - 1 for v in got], w, bottom=1, label=label)
        for x, v in zip(pos, got):
            ax1.annotate(f"{v:.2g}x", (x, v), ha="center", va="bottom" if v >= 1 else "top", fontsize=8)
    ax1.axhline(1.0, color="k", lw=0.8)
    ax1.set_yscale("log")
    ax1.set_xticks(xs, names, rotation=20)
    ax1.set_ylabel("speedup vs plain eager (median, log scale)")
    ax1.set_title(f"Speedup vs plain eager ({device})")
    ax1.legend(loc="upper left")

    w = 0.27
    series = (
        ("eager: eager_equivalent_launches", [r.per_iter("eager_equivalent_launches") for r in results]),
        ("adaptive: launches (metrics)", [r.per_iter("launches") for r in results]),
        ("adaptive: profiled kernels", [r.kernels.get("adaptive") for r in results]),
    )
    for i, (label, vals) in enumerate(series):
        pos = [x + (i - 1) * w for x, v in zip(xs, vals) if v]
        ax2.bar(pos, [v for v in vals if v], w, label=label)
    ax2.set_yscale("log")
    ax2.set_xticks(xs, names, rotation=20)
    ax2.set_ylabel("per iteration (log scale)")
    ax2.set_title("Launches per iteration")
    ax2.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_section(name: str, section: str) -> None:
    """Put ``section`` into RESULTS.md between ``<!-- name:begin -->`` and ``<!-- name:end -->``,
    replacing what was there; the file's other sections are kept. A new section goes at the end of
    the current figures (before ``# History``)."""
    BEGIN, END = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = ""
    if os.path.exists(RESULTS_MD):
        with open(RESULTS_MD) as f:
            text = f.read()
    block = f"{BEGIN}\n{section.rstrip()}\n{END}"
    if BEGIN in text and END in text and text.index(BEGIN) < text.index(END):
        text = text[: text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    elif HISTORY in text:
        at = text.index(HISTORY)
        text = text[:at] + block + "\n\n" + text[at:]
    elif text:
        text = text.rstrip() + "\n\n" + block + "\n"
    else:
        text = "# Benchmark results\n\n" + block + "\n"
    tmp = RESULTS_MD + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, RESULTS_MD)


def section_md(results, command: str, info: dict, wall_s: float, repeats: int) -> str:
    machine = ", ".join(f"{k} {v}" for k, v in info.items())
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    errs = errors_md(results)
    return f"""#### eager vs adaptive eager vs torch.compile

Reproduce: `{command}` (whole run: {wall_s / 60:.1f} min, compiles included)

Machine: {machine}. Date: {date}.

Medians of {repeats} interleaved samples (eager, adaptive, torch.compile, references), each sample
`iters` iterations ending in a sync (adaptive: `ae.sync()` after every iteration; cuda:
`torch.cuda.synchronize()`). Adaptive eager runs with `backend="inductor", hot_after=2,
async_compile=False`, measured after warm-up in the state the details table names. Launches per
iteration are `ae.metrics()` deltas (`eager_equivalent_launches` -> `launches`); "host-scalar ops"
(`host_scalar_ops`) are ops on real 0-dim CPU tensors (AdamW's `step += 1` and `step.item()`),
which on an accelerator stay on the host and are not intercepted at all, so the device-launch
count leaves them out on both sides. The adaptive/compile time ratio is adaptive time divided by
torch.compile time (below 1: adaptive is faster).

{main_table(results)}

#### Targets

{targets_md(targets(results))}

#### Details

"profiled kernels" is a cross-check that does not use the library's counters: one untimed
iteration under `torch.profiler`; cpu counts leaf ATen compute ops (no allocations or views) plus
calls into Inductor-built C++ kernels, for adaptive only inside flushes plus ops it ran eagerly;
cuda counts the device kernels and copies. "adaptive flush ms/iter" is the host time spent in the
tracer's flushes per iteration (on cpu this includes the compute of the window). Compile and
warm-up times depend on Inductor's on-disk cache and on adaptive eager's persistent cache
(`NEURON_EAGER_CACHE_DIR`): a first run on a clean machine compiles more and takes longer.

{detail_table(results)}

What the profiled kernels are (per iteration, most frequent first):

{kernel_breakdown(results)}
{chr(10) + "Errors:" + chr(10) + chr(10) + errs + chr(10) if errs else ""}
![speedups and launches]({png_name(info["device"])})
"""
