"""Each step's time in a cold process, from the first, and where the main thread spends the slow ones.

    python benchmarks/cold_steps.py [--only blocks8] [--rounds 4] [--steps 20] [--threads N]

``benchmarks/user_step.py`` gives medians and the slowest step; this prints every step of one
workload's loop under default options (one ``with adaptive_eager():`` per round of ``--steps``
steps, as user_step.py's rounds) on the cache ``NEURON_EAGER_CACHE_DIR`` names (use a fresh
directory for a cold run), then what the main thread was doing (its innermost frames every 5 ms,
while a step runs: Note [Sampling the main thread from itself]) and ``metrics()``' capture counts. ``--threads N`` calls
``torch.set_num_threads(N)`` first: the steps before the first compiled one depend on it (RESULTS.md,
session 26).
"""

from __future__ import annotations

import argparse
import collections
import signal
import threading
import time

import torch

import adaptive_eager as ae


# Note [Sampling the main thread from itself]
# The samples are taken by a ``SIGALRM`` handler, which Python runs in the main thread between two
# bytecodes, on the frame chain that thread is executing; a ticker thread only sends the signal
# (``signal.pthread_kill``, to the main thread alone, with ``siginterrupt(False)`` so that an
# interrupted system call restarts) and touches no frame. Sampling from another thread with
# ``sys._current_frames()`` and ``f_back`` crashed this script under Python 3.11 once the step ran
# Dynamo-guarded captured calls: the sampler walks frames while the main thread goes on (the walk
# drops the GIL between bytecodes), and a frame object it reached could point into the main thread's
# data stack after that frame was popped, so ``f_back`` returned a Tensor, a dict or a list, or
# ``f_lineno`` read a NULL code object (SIGSEGV in ``PyCode_Addr2Line``). A handler deferred by a
# long C call (a kernel, a lock wait) counts the ticks sent meanwhile, so each count is about 5 ms of
# a step, as the thread's samples were.
PERIOD_S = 0.005


def start_sampler(seen: collections.Counter, sampling: threading.Event, period_s: float = PERIOD_S):
    """Every ``period_s`` while ``sampling`` is set, count the main thread's 5 innermost frames
    (innermost first) in ``seen`` (Note [Sampling the main thread from itself]). Call from the main
    thread; returns a function that stops the ticker (before the ``SIGALRM`` handler is replaced:
    a tick that meets the default handler ends the process)."""
    main_id = threading.main_thread().ident
    stopped = threading.Event()
    sent = [0]  # ticks sent and not yet counted: a handler deferred by a long C call counts them all

    def on_tick(signum, frame):
        ticks, sent[0] = sent[0], 0
        if not ticks:
            return
        names = []
        while frame is not None and len(names) < 5:
            names.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
            frame = frame.f_back
        if names:
            seen[" <- ".join(names)] += ticks

    def tick():
        while not stopped.wait(period_s):
            if sampling.is_set():
                sent[0] += 1
                signal.pthread_kill(main_id, signal.SIGALRM)

    signal.signal(signal.SIGALRM, on_tick)
    signal.siginterrupt(signal.SIGALRM, False)
    ticker = threading.Thread(target=tick, name="cold_steps_ticker", daemon=True)
    ticker.start()

    def stop() -> None:
        stopped.set()
        ticker.join()

    return stop


def main() -> None:
    from user_step import WORKLOADS, train_step

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="blocks8", choices=sorted(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="steps a round")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads(N) first (0: leave it)")
    parser.add_argument("--no-sampler", action="store_true", help="take no samples (each is a signal handler's run)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, loss_of = WORKLOADS[args.only]("cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen: collections.Counter = collections.Counter()
    sampling = threading.Event()
    if not args.no_sampler:
        start_sampler(seen, sampling)
    print(f"{args.only}, default options, torch threads {torch.get_num_threads()}: ms per step, a line a round")
    for _ in range(args.rounds):
        times = []
        with ae.adaptive_eager():
            for _ in range(args.steps):
                sampling.set()
                t0 = time.perf_counter()
                train_step(model, loss_of, opt)
                times.append((time.perf_counter() - t0) * 1e3)
                sampling.clear()
        print(" ".join(f"{t:.0f}" for t in times), flush=True)
    m = ae.metrics()
    print({k: m[k] for k in ("compiled_runs", "module_captured_calls", "optimizer_hot_steps", "capture_records")})
    print("where the main thread was (samples, innermost frame first):")
    for where, n in seen.most_common(8):
        print(f"{n:6d}  {where}")


if __name__ == "__main__":
    main()
