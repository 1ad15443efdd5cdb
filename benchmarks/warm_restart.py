"""Cold vs warm start: time to the first step and to steady state, adaptive eager vs torch.compile.

    python benchmarks/warm_restart.py [--steps 30] [--write]

Each variant is a fresh process training the same MLP (3 x Linear(512, 512), batch 64, SGD):
adaptive eager with an empty persistent cache (compiling in place), then again on the cache that
run filled, twice: with ``async_compile=False`` (a window whose artifact is on disk waits for its
load, Inductor's import included) and with the default options (it replays while the artifact
loads in the background, counted in "replayed while loading"); torch.compile with an empty
Inductor cache directory, then again on it. A second run of adaptive eager compiles nothing.
"""

from __future__ import annotations

import argparse
import json
import os
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
        with ae.adaptive_eager(**({} if mode == "adaptive-default" else {"async_compile": False})):
            for _ in range(steps):
                t0 = time.perf_counter(); step(); ae.sync(); times.append(time.perf_counter() - t0)
        m = ae.metrics()
        extra = {"compiles": m["compiles"], "cache_hits_disk": m["cache_hits_disk"],
                 "loading": m["replay_reasons"].get("loading", 0)}
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
    return {"first_ms": times[0] * 1e3, "to_steady_s": sum(times[:reach]), "steady_ms": steady * 1e3,
            **{k: v for k, v in result.items() if k != "times"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--write", action="store_true", help="write the table into benchmarks/RESULTS.md")
    args = parser.parse_args()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NEURON_EAGER", "TORCHINDUCTOR"))}
    rows = []
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as inductor:
        adaptive_env = {**base, "NEURON_EAGER_CACHE_DIR": cache}
        compile_env = {**base, "TORCHINDUCTOR_CACHE_DIR": inductor}
        rows.append(("eager", summarize(run("eager", args.steps, base))))
        rows.append(("adaptive eager, cold cache", summarize(run("adaptive", args.steps, adaptive_env))))
        rows.append(("adaptive eager, warm cache", summarize(run("adaptive", args.steps, adaptive_env))))
        rows.append(("adaptive eager, warm cache, default options",
                     summarize(run("adaptive-default", args.steps, adaptive_env))))
        rows.append(("torch.compile, cold Inductor cache", summarize(run("compile", args.steps, compile_env))))
        rows.append(("torch.compile, warm Inductor cache", summarize(run("compile", args.steps, compile_env))))
    lines = [
        "| variant | first step ms | time to steady state s | steady step ms | compiles | disk hits | "
        "replayed while loading |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in rows:
        lines.append(f"| {name} | {r['first_ms']:.1f} | {r['to_steady_s']:.2f} | {r['steady_ms']:.2f} | "
                     f"{r.get('compiles', '—')} | {r.get('cache_hits_disk', '—')} | {r.get('loading', '—')} |")
    table = "\n".join(lines)
    print(table)
    if args.write:
        write_section("warm", f"## Cold vs warm start\n\nReproduce: `python benchmarks/warm_restart.py --steps {args.steps} "
                      f"--write` (each row a fresh process; MLP 3 x Linear(512), batch 64, SGD; {os.cpu_count()} cores)"
                      f"\n\n{table}")


if __name__ == "__main__":
    main()
