"""What one setting buys on the user's loop: fresh processes with its default and another value, interleaved.

    python benchmarks/switches.py [--switch tiers=hot] [--rounds 3] [--steps 60] [--only blocks8,mlp] [--cold]
    python benchmarks/switches.py --gc [--rounds 10] [--steps 20] [--only blocks8]

Each run is a fresh process running ``user_step.py``'s training loop (AdamW, ``loss.item()`` per
step) inside one ``with adaptive_eager():`` with default options, or with one setting changed
(``--switch NAME=VALUE``, given as its environment variable). Warm runs share one cache directory that a priming run (default options)
filled, as a user's second process does; ``--cold`` runs each process on empty adaptive eager,
Inductor and temporary directories instead. Per process: ``entry s`` (the ``with`` statement's
entry), ``first s`` (the first step), ``entry + 2 steps s`` (before the third sight captures the
step), ``to compiled s`` (process start to the end of the first step that ran without replaying a
window or running a captured graph op by op), ``steady ms`` and
``mean ms`` (median and mean of the last half of the steps: a collection every few steps shows in
the mean), ``max ms`` (the slowest step after the first). The table gives medians over the rounds
and the ratio other/default of each (above 1: the default is faster).

``--gc``: the raised gc threshold (Note [GC threshold] in adaptive_eager/_gc.py), which a process
can undo, measured in one process instead: two copies of the loop, each in its own ``with
adaptive_eager():`` block, one of them setting CPython's default threshold itself inside it (a
program's own threshold is kept), run in alternating rounds of ``--steps`` steps (as in
``user_step.py``); median, mean and max step of the second half of each copy's steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# each against the defaults; eager_start, tune_gc, tune_malloc and meta_on_disk were measured here
# before their removal (RESULTS.md, "Session 23: switches" and "Session 24")
SWITCHES = ("tiers=hot", "tiers=regions")

CHILD = textwrap.dedent(
    """
    import json, statistics, sys, time
    t_start = float(sys.argv[1]); workload = sys.argv[2]; steps = int(sys.argv[3])
    sys.path.insert(0, sys.argv[4])
    import torch, torch.nn as nn
    import adaptive_eager as ae
    from user_step import WORKLOADS, _UNCOMPILED, train_step

    def mlp(device):
        # the Note [Heap thresholds] step's shapes: three 4 MiB weight gradients
        model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                              nn.Linear(1024, 1024))
        x, y = torch.randn(64, 1024), torch.randn(64, 1024)
        return model, lambda m: nn.functional.mse_loss(m(x), y)

    build = dict(WORKLOADS, mlp=mlp)[workload]
    torch.manual_seed(0)
    model, loss_of = build("cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times, compiled = [], None
    t0 = time.perf_counter()
    ctx = ae.adaptive_eager()
    ctx.__enter__()
    entry = time.perf_counter() - t0
    try:
        for i in range(steps):
            before = ae.metrics()
            t0 = time.perf_counter()
            train_step(model, loss_of, opt)
            times.append(time.perf_counter() - t0)
            after = ae.metrics()
            if compiled is None and (after["compiled_runs"] > before["compiled_runs"]
                                     and after["replayed_regions"] == before["replayed_regions"]
                                     and all(after.get(k, 0) == before.get(k, 0) for k in _UNCOMPILED)):
                compiled = time.time() - t_start
    finally:
        ctx.__exit__(None, None, None)
    late = times[len(times) // 2:]
    print(json.dumps({"entry": entry, "first": times[0], "start": entry + sum(times[:2]), "to_compiled": compiled,
                      "steady": statistics.median(late) * 1e3, "mean": statistics.mean(late) * 1e3,
                      "max": max(times[1:]) * 1e3}))
    """
)

COLUMNS = ("entry", "first", "start", "to_compiled", "steady", "mean", "max")
HEAD = ("entry s", "first s", "entry + 2 steps s", "to compiled s", "steady ms", "mean ms", "max ms")


def _env(extra: dict[str, str], tmp: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_EAGER")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if tmp is not None:
        for name in ("NEURON_EAGER_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TMPDIR"):
            path = os.path.join(tmp, name.lower())
            os.makedirs(path, exist_ok=True)
            env[name] = path
    env.update(extra)
    return env


def run(workload: str, steps: int, extra: dict[str, str], tmp: str | None) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, repr(time.time()), workload, str(steps), HERE],
                         env=_env(extra, tmp), capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise SystemExit(f"child failed ({extra}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def _gc_block(raised: bool):
    import gc

    import adaptive_eager as ae

    saved = gc.get_threshold()
    with ae.adaptive_eager():
        if not raised:
            gc.set_threshold(700, saved[1], saved[2])
        yield
    gc.set_threshold(*saved)


def gc_in_process(workloads: str, rounds: int, steps: int) -> None:
    sys.path.insert(0, HERE)
    import adaptive_eager as ae
    from user_step import WORKLOADS, Variant

    print(f"the gc threshold in one process, {rounds} rounds of {steps} steps per copy")
    print("| workload | gen-0 threshold | median ms | mean ms | max ms |")
    print("| --- | --- | ---: | ---: | ---: |")
    for w in workloads.split(","):
        copies = [Variant(name, "cpu", WORKLOADS[w], context=lambda raised=raised: _gc_block(raised))
                  for name, raised in (("raised", True), ("700 (the program's)", False))]
        for r in range(rounds):
            for c in copies if r % 2 == 0 else copies[::-1]:
                c.run(steps)
            print(f"[switches] {w} round {r + 1}/{rounds}", file=sys.stderr, flush=True)
        for c in copies:
            late = c.times[len(c.times) // 2:]
            print(f"| {w} | {c.name} | {statistics.median(late) * 1e3:.2f} | "
                  f"{statistics.mean(late) * 1e3:.2f} | {max(late) * 1e3:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--switch", action="append", choices=SWITCHES, help="default: all of them")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--only", default="blocks8", help="comma-separated workloads: blocks8, rnn, cnn, mlp")
    parser.add_argument("--cold", action="store_true", help="every process on empty caches")
    parser.add_argument("--gc", action="store_true", help="the raised gc threshold against the program's own, in one process")
    args = parser.parse_args()
    if args.gc:
        return gc_in_process(args.only, args.rounds, args.steps)
    switches = args.switch or list(SWITCHES)
    with tempfile.TemporaryDirectory() as warm:
        if not args.cold:
            for w in args.only.split(","):
                run(w, args.steps, {}, warm)  # fills the shared cache
        results: dict[tuple[str, str, str], list[dict]] = {}
        for r in range(args.rounds):
            for w in args.only.split(","):
                for switch in switches:
                    name, _, other = switch.partition("=")
                    order = ("default", other) if r % 2 == 0 else (other, "default")  # alternate which runs first
                    for value in order:
                        extra = {} if value == "default" else {"NEURON_EAGER_" + name.upper(): value}
                        if args.cold:
                            with tempfile.TemporaryDirectory() as tmp:
                                res = run(w, args.steps, extra, tmp)
                        else:
                            res = run(w, args.steps, extra, warm)
                        results.setdefault((w, switch, value), []).append(res)
                        print(f"[switches] round {r + 1} {w} {name}={value}: {res}", file=sys.stderr, flush=True)
    print(f"{'cold' if args.cold else 'warm'} cache, {args.rounds} rounds, {args.steps} steps, "
          f"load {os.getloadavg()[0]:.2f}")
    print("| workload | setting | " + " | ".join(HEAD) + " |")
    print("| --- | --- |" + " ---: |" * len(HEAD))
    for w in args.only.split(","):
        for switch in switches:
            name, _, other = switch.partition("=")
            med = {}
            for value in ("default", other):
                runs = results[(w, switch, value)]
                med[value] = {c: statistics.median([x[c] if x[c] is not None else float("inf") for x in runs])
                              for c in COLUMNS}
                cells = [f"{med[value][c]:.3g}" for c in COLUMNS]
                print(f"| {w} | {name} {value} | " + " | ".join(cells) + " |")
            ratio = [f"{med[other][c] / med['default'][c]:.2f}x" if med["default"][c] else "-" for c in COLUMNS]
            print(f"| {w} | {switch} / default | " + " | ".join(ratio) + " |")


if __name__ == "__main__":
    main()
