"""A cold machine's time from process start to the first step that ran compiled, and where it goes.

    python benchmarks/cold_start.py [--rounds 3] [--steps 8] [--tree PATH ...] [--profile]

Each run is a fresh process with fresh caches: ``NEURON_EAGER_CACHE_DIR``,
``TORCHINDUCTOR_CACHE_DIR`` and ``TMPDIR`` (Inductor's default directory, where adaptive eager's
kernel builds and Inductor's vector-ISA probe live, is under it) all new, empty temporary
directories; Python's bytecode caches are warm. The program is examples/quickstart.py's loop (an
MLP, AdamW, ``async_compile=False``). The figure is the wall time from the parent's ``Popen`` to
the end of the first step after which ``ae.metrics()["compiled_runs"]`` grew. Several trees
(``--tree``: a checkout each, e.g. a base commit and a branch) run interleaved, round by round;
the table gives the median per tree and the ratio to the first tree.

``--profile`` also times, inside each child, ``import torch``, ``import adaptive_eager``, the
first compile (``compile_seconds``), and the parts of it in Inductor's vector-ISA probe
(``VecISA.check_build``: a g++ build per ISA the first time a directory is used, then a Python
subprocess that loads it, in every process).
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
import time

CHILD = textwrap.dedent(
    """
    import json, sys, time
    t_start = float(sys.argv[2]); profile = sys.argv[3] == "1"
    marks = {}
    t = time.time(); import torch; marks["import torch"] = time.time() - t
    isa = [0.0]
    if profile:
        import torch._inductor.cpu_vec_isa as vec_isa
        check = vec_isa.VecISA.check_build
        def timed(self, code):
            t0 = time.time()
            try:
                return check(self, code)
            finally:
                isa[0] += time.time() - t0
        vec_isa.VecISA.check_build = timed
    t = time.time(); import adaptive_eager as ae; marks["import adaptive_eager"] = time.time() - t
    steps = int(sys.argv[1])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                                torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(256, 32), torch.randn(256, 1)
    first = None
    steps_done = []
    with ae.adaptive_eager(async_compile=False):
        for i in range(steps):
            t0 = time.time()
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            ae.sync()
            steps_done.append(time.time() - t0)
            if first is None and ae.metrics()["compiled_runs"] > 0:
                first = (i, time.time() - t_start)
    m = ae.metrics()
    print(json.dumps({"first_compiled_step": first[0] if first else None,
                      "to_first_compiled_s": first[1] if first else None,
                      "compile_seconds": m["compile_seconds"], "compiles": m["compiles"],
                      "isa_probe_s": isa[0], "steps_s": steps_done, **marks}))
    """
)


def run(tree: str, steps: int, profile: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NEURON_EAGER", "TORCHINDUCTOR"))}
        for name in ("NEURON_EAGER_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TMPDIR"):
            os.makedirs(os.path.join(tmp, name), mode=0o700)
            env[name] = os.path.join(tmp, name)
        env["PYTHONPATH"] = tree
        t0 = time.time()
        out = subprocess.run([sys.executable, "-c", CHILD, str(steps), repr(t0), "1" if profile else "0"],
                             env=env, capture_output=True, text=True, timeout=900, cwd=tree)
        wall = time.time() - t0
    if out.returncode != 0:
        raise RuntimeError(f"{tree} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["process_s"] = wall
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--tree", action="append", help="a checkout to run (default: this one)")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    trees = args.tree or [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    results: dict[str, list[dict]] = {t: [] for t in trees}
    for r in range(args.rounds):
        for tree in (trees if r % 2 == 0 else trees[::-1]):  # alternate the order too
            res = run(tree, args.steps, args.profile)
            results[tree].append(res)
            load = os.getloadavg()[0]
            print(f"round {r} {tree}: first compiled step {res['first_compiled_step']} at "
                  f"{res['to_first_compiled_s']:.2f} s (compile {res['compile_seconds']:.2f} s, "
                  f"ISA probe {res['isa_probe_s']:.2f} s, import torch {res['import torch']:.2f} s; steps "
                  f"{' '.join(f'{t:.2f}' for t in res['steps_s'])} s), load {load:.1f}", flush=True)
    base = None
    print("\n| tree | to first compiled step s (median, min-max) | compile s | ISA probe s | import torch s | ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for tree in trees:
        rs = results[tree]
        med = statistics.median(r["to_first_compiled_s"] for r in rs)
        base = base or med
        lo, hi = min(r["to_first_compiled_s"] for r in rs), max(r["to_first_compiled_s"] for r in rs)
        print(f"| {tree} | {med:.2f} ({lo:.2f}-{hi:.2f}) | {statistics.median(r['compile_seconds'] for r in rs):.2f} | "
              f"{statistics.median(r['isa_probe_s'] for r in rs):.2f} | "
              f"{statistics.median(r['import torch'] for r in rs):.2f} | {med / base:.2f} |")


if __name__ == "__main__":
    main()
