"""Cold vs warm start: time to the first step and to steady state, adaptive eager vs torch.compile.

    python benchmarks/warm_restart.py [--steps 30] [--runs 5] [--write]

Each variant is a fresh process training the same MLP (3 x Linear(512, 512), batch 64, SGD):
adaptive eager with an empty persistent cache (compiling in place), then again on the cache that
run filled, twice: with ``async_compile=False`` (a window whose artifact is on disk waits for its
load, Inductor's import included) and with the default options (it replays while the artifact
loads in the background, counted in "replayed while loading"); torch.compile with an empty
Inductor cache directory, then again on it. A second run of adaptive eager compiles nothing.

The warm rows and eager are run ``--runs`` times, interleaved (eager, then each warm variant, per
round), each a fresh process on the caches the cold runs filled; the table gives medians over the
rounds (eager's own first step swings 5-100 ms on a shared machine: OpenMP threads waiting for a
core), and "first step / eager's" is the ratio of the medians, issue 14's warm-restart figure.
"Mode entry" is the first ``with adaptive_eager()`` of the process, timed apart from the steps: it
opens the cache that the first recorded window needs (Note [Eager start] in adaptive_eager/_mode.py),
and "(entry + first step) / eager's" counts it in.
The cold rows run once (they fill the caches). Python writes bytecode for the children
(``PYTHONDONTWRITEBYTECODE`` is dropped from their environment): a first process on a machine
that forbids it compiles the library's modules from source at every start (~160 ms).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from report import write_section  # noqa: E402

CHILD = textwrap.dedent(
    """
    import json, sys, time
    import torch
    mode, steps = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                torch.nn.ReLU(), torch.nn.Linear(512, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 512), torch.randn(64, 1)

    def step():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    times = []
    if mode.startswith("adaptive"):
        import adaptive_eager as ae
        block = ae.adaptive_eager(**({} if mode == "adaptive-default" else {"async_compile": False}))
        t1 = time.perf_counter()
        block.__enter__()  # the mode's entry opens the cache: Note [Eager start] in adaptive_eager/_mode.py
        entry = time.perf_counter() - t1
        for _ in range(steps):
            t0 = time.perf_counter(); step(); ae.sync(); times.append(time.perf_counter() - t0)
        block.__exit__(None, None, None)
        m = ae.metrics()
        extra = {"compiles": m["compiles"], "cache_hits_disk": m["cache_hits_disk"],
                 "loading": m["replay_reasons"].get("loading", 0), "entry_ms": entry * 1e3}
    elif mode == "compile":
        compiled = torch.compile(step)
        for _ in range(steps):
            t0 = time.perf_counter(); compiled(); times.append(time.perf_counter() - t0)
        extra = {}
    else:
        for _ in range(steps):
            t0 = time.perf_counter(); step(); times.append(time.perf_counter() - t0)
        extra = {}
    print(json.dumps({"times": times, **extra}))
    """
)


def run(mode: str, steps: int, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(steps)], env=env, capture_output=True, text=True,
                         timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(result: dict) -> dict:
    times = result["times"]
    steady = sorted(times[len(times) // 2:])[len(times) // 4]
    # steady state starts after the last step that took over 3x the steady step (a compile or load;
    # smaller spikes are this machine's noise)
    reach = max((i + 1 for i, t in enumerate(times) if t > 3 * steady), default=0)
    return {"first_ms": times[0] * 1e3, "second_ms": times[1] * 1e3 if len(times) > 1 else float("nan"),
            "to_steady_s": sum(times[:reach]), "steady_ms": steady * 1e3, "longest_ms": max(times) * 1e3,
            **{k: v for k, v in result.items() if k != "times"}}


def medians(results: list) -> dict:
    """Each figure's median over the runs of one variant (the counters: the first run's)."""
    out = dict(results[0])
    for k in ("first_ms", "second_ms", "to_steady_s", "steady_ms", "longest_ms", "entry_ms"):
        if k in out:
            out[k] = statistics.median(r[k] for r in results)
    out["runs"] = len(results)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--runs", type=int, default=5, help="fresh-process runs of eager and each warm variant")
    parser.add_argument("--write", action="store_true", help="write the table into benchmarks/RESULTS.md")
    args = parser.parse_args()
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("NEURON_EAGER", "TORCHINDUCTOR", "PYTHONDONTWRITEBYTECODE"))}
    rows = []
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as inductor:
        adaptive_env = {**base, "NEURON_EAGER_CACHE_DIR": cache}
        compile_env = {**base, "TORCHINDUCTOR_CACHE_DIR": inductor}
        cold = summarize(run("adaptive", args.steps, adaptive_env))
        compile_cold = summarize(run("compile", args.steps, compile_env))
        warm = {"eager": [], "adaptive": [], "adaptive-default": [], "compile": []}
        for _ in range(args.runs):
            warm["eager"].append(summarize(run("eager", args.steps, base)))
            for mode in ("adaptive", "adaptive-default"):
                warm[mode].append(summarize(run(mode, args.steps, adaptive_env)))
            warm["compile"].append(summarize(run("compile", args.steps, compile_env)))
        eager = medians(warm["eager"])
        rows.append(("eager", eager))
        rows.append(("adaptive eager, cold cache", cold))
        rows.append(("adaptive eager, warm cache, `async_compile=False`", medians(warm["adaptive"])))
        rows.append(("adaptive eager, warm cache, default options", medians(warm["adaptive-default"])))
        rows.append(("torch.compile, cold Inductor cache", compile_cold))
        rows.append(("torch.compile, warm Inductor cache", medians(warm["compile"])))
    lines = [
        "| variant | runs | mode entry ms | first step ms | first step / eager's | (entry + first step) / eager's | "
        "second step ms | longest step ms | time to steady state s | steady step ms | compiles | disk hits | "
        "replayed while loading |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in rows:
        entry = r.get("entry_ms")
        both = "—" if entry is None else f"{(entry + r['first_ms']) / eager['first_ms']:.2f}"
        lines.append(f"| {name} | {r.get('runs', 1)} | {'—' if entry is None else f'{entry:.1f}'} | {r['first_ms']:.1f} | "
                     f"{r['first_ms'] / eager['first_ms']:.2f} | {both} | "
                     f"{r['second_ms']:.1f} | {r['longest_ms']:.0f} | {r['to_steady_s']:.2f} | {r['steady_ms']:.2f} | "
                     f"{r.get('compiles', '—')} | {r.get('cache_hits_disk', '—')} | {r.get('loading', '—')} |")
    table = "\n".join(lines)
    print(table)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    if args.write:
        write_section("warm", f"## Cold vs warm start\n\nReproduce: `python benchmarks/warm_restart.py --steps {args.steps} "
                      f"--runs {args.runs} --write` (each row a fresh process, warm rows and eager medians of "
                      f"{args.runs} interleaved runs; MLP 3 x Linear(512), batch 64, SGD; {os.cpu_count()} cores)"
                      f"\n\n{table}")


if __name__ == "__main__":
    main()
