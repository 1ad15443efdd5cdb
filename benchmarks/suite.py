"""Performance suite: plain eager vs adaptive eager (steady state) vs torch.compile, in one process.

    python benchmarks/suite.py [--device cpu|cuda] [--repeats N] [--quick] [--write]
                               [--only KEYS] [--profile KEY]

Every workload runs in three variants (plus references where the brief names one), interleaved
(eager, adaptive, compile, eager, adaptive, compile, ...), and the MEDIAN of the repeats is
reported, since absolute times drift on a shared machine. Each timed sample runs ``iters``
iterations (calibrated so a sample lasts ~0.3 s) and ends with a synchronization that makes the
work happen: ``ae.sync()`` after every adaptive iteration (the window is part of the timed work),
``torch.cuda.synchronize()`` at the end of every sample on cuda.

Adaptive eager is measured in steady state: it is warmed up until an iteration runs every window
compiled with no new compile (``compiled_runs`` grows, ``replayed_regions`` and
``regions_compiled`` do not), or for a bounded number of iterations; a workload that never gets
there is reported as such. torch.compile is warmed up (compiled) outside timing.

Launches per iteration come from ``ae.metrics()`` deltas over the timed samples
(``eager_equivalent_launches`` -> ``launches``; device launches leave out ``host_scalar_ops`` on
both sides). As a cross-check that does not trust the
library's own counters, one extra untimed iteration of each variant is profiled and its kernels are
counted: on cuda the device kernels/memcpys the profiler sees; on cpu the leaf ATen compute ops
(allocation and view ops excluded) plus the calls into Inductor-built C++ kernels (``.so``
functions, counted with ``sys.setprofile``); for adaptive only what runs inside a flush, plus the
ops the tracer ran eagerly (``ops_eager``).

``--write`` puts the tables, the targets with PASS/FAIL, the command and the machine into
``benchmarks/RESULTS.md`` between ``<!-- suite:begin -->`` and ``<!-- suite:end -->`` (cuda:
``suite-cuda``; other sections of that file are kept) and saves ``benchmarks/results.png``
(``results_cuda.png``).
``--profile KEY`` runs one workload's adaptive variant in steady state under cProfile instead.
"""

from __future__ import annotations

import argparse
import cProfile
import copy
import datetime
import gc
import math
import os
import platform
import pstats
import re
import statistics
import subprocess
import sys
import time
import traceback
import types
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler cross-check would print a line per start/stop
import torch
import torch.nn as nn
import torch.nn.functional as F

import adaptive_eager as ae

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS_MD = os.path.join(HERE, "RESULTS.md")


def _png(device: str) -> str:
    return "results.png" if device == "cpu" else f"results_{device}.png"


def _markers(device: str) -> tuple[str, str]:
    """Each device's table has its own section of RESULTS.md (a cuda run keeps the cpu one)."""
    name = "suite" if device == "cpu" else f"suite-{device}"
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"

ADAPTIVE_OPTIONS = dict(backend="inductor", hot_after=2, async_compile=False)
SAMPLE_SECONDS = {"cpu": 0.3, "cuda": 0.1}  # calibrated length of one timed sample
MAX_ITERS = 200
FLUSH_TARGET_MS = 0.3
LAUNCH_TARGET = 20.0

_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[suite {time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Flush timing: the tracer's flush is wrapped (in this process only, no library change) so that
# the host time of every flush is measured wherever it happens (ae.sync(), optimizer.step()'s
# hook, a window cap), and so the kernel count can tell flush work from recording.


class FlushTimer:
    def __init__(self):
        self.seconds = 0.0
        self.count = 0
        self.profiling = False
        self.installed = False

    def install(self) -> None:
        tracer = getattr(ae, "_tracer", None)  # gone (issue 13): flush times read 0 until bench13
        original = getattr(tracer, "flush", None)
        if original is None or getattr(original, "_suite_wrapped", False):
            self.installed = original is not None
            return
        timer = self
        clock = time.perf_counter

        def flush(st, reason):
            if timer.profiling:
                with torch.profiler.record_function("adaptive_eager::flush"):
                    return original(st, reason)
            t0 = clock()
            try:
                return original(st, reason)
            finally:
                timer.seconds += clock() - t0
                timer.count += 1

        flush._suite_wrapped = True
        tracer.flush = flush
        self.installed = True


FLUSH = FlushTimer()


# ---------------------------------------------------------------------------------------------
# Workloads. Each builder returns the steps of every variant; a step is a zero-argument callable
# that does one iteration and returns what it produced (kept alive until the sync, so adaptive
# eager must materialize it: a result nobody holds is dead code it would rightly skip).


@dataclass
class Workload:
    key: str
    title: str
    unit: str
    eager: Callable[[], object]
    adaptive: Callable[[], object]
    compile: Callable[[], object] | None
    refs: dict[str, Callable[[], object]] = field(default_factory=dict)  # extra eager references
    check: Callable[[object, object], str] | None = None  # (eager out, adaptive out) -> "" or problem
    flush_relevant: bool = False


def _chain(x: torch.Tensor) -> torch.Tensor:
    y = x * 1.1 + 0.5
    y = torch.sin(y)
    y = torch.cos(y)
    y = torch.relu(y)
    y = torch.sigmoid(y)
    y = torch.exp(y)
    y = torch.tanh(y)
    y = y * y
    y = y - 0.25
    return y  # 10 ops


def _close(a, b) -> str:
    try:
        torch.testing.assert_close(a, b)
    except AssertionError as e:
        return "adaptive result differs from eager: " + str(e).splitlines()[0]
    return ""


def build_chain(device: str) -> Workload:
    x = torch.randn(4 * 1024 * 1024, device=device)
    compiled = torch.compile(_chain)
    return Workload(
        "chain", "1. 10 elementwise ops, 4M float32", "call",
        eager=lambda: _chain(x), adaptive=lambda: _chain(x), compile=lambda: compiled(x),
        check=_close, flush_relevant=True,
    )


class MLPBlock(nn.Module):
    """Pre-LayerNorm transformer MLP: x + fc2(gelu(fc1(ln(x))))."""

    def __init__(self, d: int = 1024, hidden: int = 4096):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


def build_mlp_block(device: str) -> Workload:
    torch.manual_seed(0)
    base = MLPBlock().to(device)
    x = torch.randn(64, 64, 1024, device=device)  # 64 sequences x 64 tokens

    def make(model):
        def fwd_bwd():
            model.zero_grad(set_to_none=True)
            loss = model(x).square().mean()
            loss.backward()
            return loss, [p.grad for p in model.parameters()]
        return fwd_bwd

    return Workload(
        "mlp_block", "2. LayerNorm+GELU MLP block 1024-4096-1024, 64x64 tokens, fwd+bwd", "iter",
        eager=make(copy.deepcopy(base)), adaptive=make(copy.deepcopy(base)),
        compile=torch.compile(make(copy.deepcopy(base))), flush_relevant=True,
    )


def build_mlp_train(device: str) -> Workload:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))
    base = base.to(device)
    x = torch.randn(64, 1024, device=device)
    y = torch.randn(64, 1024, device=device)

    return _training_workload(
        "mlp_train", "3. MLP train step, 3x Linear(1024,1024), batch 64, SGD", base, x, y,
        lambda params: torch.optim.SGD(params, lr=0.01),
    )


def _training_workload(name: str, title: str, base: nn.Module, x, target, make_opt) -> Workload:
    """One MSE training step (zero_grad, forward, backward, optimizer step) on three copies of
    ``base``: eager, adaptive and torch.compile."""

    def make(model):
        opt = make_opt(model.parameters())

        def step():
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x), target)
            loss.backward()
            opt.step()
            return loss
        return step

    return Workload(
        name, title, "step",
        eager=make(copy.deepcopy(base)), adaptive=make(copy.deepcopy(base)),
        compile=torch.compile(make(copy.deepcopy(base))),
    )


def build_adamw(device: str) -> Workload:
    torch.manual_seed(0)
    base = [torch.randn(256, device=device) for _ in range(200)]
    grads = [torch.randn(256, device=device) for _ in range(200)]

    def make(foreach: bool):
        params = [p.clone().requires_grad_() for p in base]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=foreach)

        def step():
            opt.step()
            return None  # the parameters and the optimizer state are what the step writes
        return step

    compiled_step = make(False)
    return Workload(
        "adamw", "4. AdamW foreach=False, 200 params x 256, opt.step()", "step",
        eager=make(False), adaptive=make(False), compile=torch.compile(compiled_step),
        refs={"eager foreach=True": make(True)},
    )


class GPTBlock(nn.Module):
    """Pre-LN GPT block with attention spelled as matmul + mask + softmax (no SDPA)."""

    def __init__(self, d: int = 256, heads: int = 4, seq: int = 128):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.register_buffer("causal", torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1))

    def forward(self, x):
        b, t, c = x.shape
        hd = c // self.heads
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q = q.view(b, t, self.heads, hd).transpose(1, 2)
        k = k.view(b, t, self.heads, hd).transpose(1, 2)
        v = v.view(b, t, self.heads, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = att.masked_fill(self.causal[:t, :t], float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def build_gpt(device: str) -> Workload:
    torch.manual_seed(0)
    base = GPTBlock().to(device)
    x = torch.randn(8, 128, 256, device=device)
    target = torch.randn(8, 128, 256, device=device)

    return _training_workload(
        "gpt", "5. GPT block train step (d256, 4 heads, seq 128, batch 8, AdamW)", base, x, target,
        lambda params: torch.optim.AdamW(params, lr=1e-3),
    )


def _tiny_loop(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = x
    for _ in range(250):  # 4 ops per iteration: 1000 ops
        y = y * w
        y = y + 1.0
        y = torch.tanh(y)
        y = y - x
    return y


def build_tiny(device: str) -> Workload:
    torch.manual_seed(0)
    x = torch.randn(16, device=device)
    w = torch.randn(16, device=device)
    compiled = torch.compile(_tiny_loop)
    return Workload(
        "tiny", "6. 1000 tiny ops (16 floats) + sync", "loop",
        eager=lambda: _tiny_loop(x, w), adaptive=lambda: _tiny_loop(x, w), compile=lambda: compiled(x, w),
        check=_close, flush_relevant=True,
    )


BUILDERS = {
    "chain": build_chain,
    "mlp_block": build_mlp_block,
    "mlp_train": build_mlp_train,
    "adamw": build_adamw,
    "gpt": build_gpt,
    "tiny": build_tiny,
}


# ---------------------------------------------------------------------------------------------
# Measurement


def _metric_delta(before: dict, after: dict, key: str) -> float:
    return after.get(key, 0) - before.get(key, 0)


class Runner:
    def __init__(self, device: str, repeats: int, max_warm: int):
        self.device = device
        self.repeats = repeats
        self.max_warm = max_warm

    def barrier(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def adaptive(self):
        return ae.adaptive_eager(device=self.device, **ADAPTIVE_OPTIONS)

    # -- one timed sample ------------------------------------------------------------------

    def sample_plain(self, step, iters: int) -> float:
        gc.collect()
        self.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            out = step()
        self.barrier()
        dt = time.perf_counter() - t0
        del out
        return dt / iters

    def sample_adaptive(self, step, iters: int) -> tuple[float, float, dict]:
        """(seconds per iteration, flush seconds per iteration, metrics delta per iteration)."""
        gc.collect()
        with self.adaptive():
            before = ae.metrics()
            FLUSH.seconds = 0.0
            self.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                out = step()
                ae.sync()  # the window is part of the work: end it inside the timed region
            self.barrier()
            dt = time.perf_counter() - t0
            flush_s = FLUSH.seconds
            after = ae.metrics()
            del out
        delta = {k: _metric_delta(before, after, k) / iters for k in (
            "launches", "eager_equivalent_launches", "compiled_runs", "replayed_regions",
            "regions_compiled", "cache_hits_memory", "cache_hits_disk", "blacklisted", "windows", "ops_eager",
            "host_scalar_ops")}
        return dt / iters, flush_s / iters, delta

    # -- warm-up ---------------------------------------------------------------------------

    def warm_adaptive(self, step) -> dict:
        """Run until an iteration has every window compiled and nothing new compiled, or for
        ``max_warm`` iterations (keys can take several steps to repeat: optimizer state is created
        on the first step, scalars are lifted after a few distinct values); return how it went."""
        info = {"iterations": 0, "state": "replay only", "compile_s": 0.0, "seconds": 0.0, "last_s": 0.0}
        start = ae.metrics()
        t_start = time.perf_counter()
        with self.adaptive():
            for i in range(self.max_warm):
                before = ae.metrics()
                t0 = time.perf_counter()
                out = step()
                ae.sync()
                self.barrier()
                info["last_s"] = time.perf_counter() - t0
                del out
                after = ae.metrics()
                d = {k: _metric_delta(before, after, k) for k in
                     ("compiled_runs", "replayed_regions", "regions_compiled", "cache_hits_disk", "blacklisted",
                      "windows")}
                info["iterations"] = i + 1
                log(f"    adaptive warm-up {i + 1}: {info['last_s'] * 1e3:.1f} ms, {d}")
                if d["compiled_runs"] > 0 and d["replayed_regions"] == 0 and d["regions_compiled"] == 0 \
                        and d["cache_hits_disk"] == 0 and d["blacklisted"] == 0:
                    info["state"] = "compiled"
                    break
                info["state"] = "partly compiled" if d["compiled_runs"] > 0 else "replay only"
        end = ae.metrics()
        info["seconds"] = time.perf_counter() - t_start
        info["compile_s"] = _metric_delta(start, end, "compile_seconds")
        info["regions_compiled"] = _metric_delta(start, end, "regions_compiled")
        info["disk_hits"] = _metric_delta(start, end, "cache_hits_disk")
        info["blacklisted"] = _metric_delta(start, end, "blacklisted")
        for key in ("not_compiled", "fallback_ops", "flushes"):
            old = start.get(key, {})
            info[key] = {k: v - old.get(k, 0) for k, v in end.get(key, {}).items() if v - old.get(k, 0)}
        return info

    def warm_plain(self, step, times: int, name: str = "") -> tuple[float, float]:
        """(total warm-up seconds, seconds of the last call)."""
        t_start = time.perf_counter()
        last = 0.0
        for i in range(times):
            t0 = time.perf_counter()
            out = step()
            self.barrier()
            last = time.perf_counter() - t0
            del out
            if name == "torch.compile":
                log(f"    torch.compile warm-up {i + 1}: {last * 1e3:.1f} ms")
        return time.perf_counter() - t_start, last

    # -- kernel count cross-check -------------------------------------------------------------

    def count_kernels(self, step, adaptive: bool) -> tuple[int, Counter]:
        """Kernels one iteration runs, and how many of each kind (see the module docstring)."""
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device == "cuda":
            activities.append(ProfilerActivity.CUDA)
        names: Counter = Counter()
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        inductor_dir = os.path.realpath(default_cache_dir())

        def hook(frame, event, arg):
            # a call into a kernel module Inductor built: torch.compile's live in Inductor's cache
            # dir, adaptive eager's are loaded under "adaptive_eager_<digest>" from a temporary file
            if event == "c_call":
                owner = getattr(arg, "__self__", None)
                if type(owner) is types.ModuleType:
                    path = getattr(owner, "__file__", None) or ""
                    if path.endswith(".so") and (owner.__name__.startswith("adaptive_eager_")
                                                 or os.path.realpath(path).startswith(inductor_dir)):
                        names["Inductor C++ kernel"] += 1

        ctx = self.adaptive() if adaptive else _null()
        with ctx:
            before = ae.metrics()
            FLUSH.profiling = adaptive
            try:
                with profile(activities=activities) as prof:
                    sys.setprofile(hook if self.device == "cpu" else None)
                    try:
                        out = step()
                        if adaptive:
                            ae.sync()
                    finally:
                        sys.setprofile(None)
                    self.barrier()
            finally:
                FLUSH.profiling = False
            after = ae.metrics()
            del out
        events = prof.events()
        if self.device == "cuda":
            from torch.autograd import DeviceType

            for e in events:
                if e.device_type == DeviceType.CUDA:
                    names[e.name[:60]] += 1
            return sum(names.values()), names
        if adaptive:
            roots = [e for e in events if e.name == "adaptive_eager::flush" and not _has_flush_ancestor(e)]
            eager_ops = int(_metric_delta(before, after, "ops_eager"))
            if eager_ops:
                names["ops the tracer ran eagerly (ops_eager)"] += eager_ops
        else:
            roots = [e for e in events if e.cpu_parent is None]
        for e in roots:
            _compute_ops(e, names)
        return sum(names.values()), names


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ATen ops that launch no compute kernel: allocation, views, metadata, host reads.
_NOT_KERNELS = frozenset("aten::" + n for n in (
    "empty", "empty_strided", "empty_like", "as_strided", "view", "reshape", "_reshape_alias", "alias",
    "t", "transpose", "permute", "expand", "expand_as", "unsqueeze", "squeeze", "select", "slice",
    "detach", "detach_", "_unsafe_view", "resolve_conj", "resolve_neg", "lift_fresh", "set_", "unbind",
    "split", "split_with_sizes", "chunk", "narrow", "diagonal", "_local_scalar_dense", "item",
    "is_nonzero", "result_type", "size", "stride", "numel", "dim", "to", "contiguous", "flatten",
    "unflatten", "view_as", "_has_compatible_shallow_copy_type", "is_same_size", "requires_grad_",
    "record_stream", "_to_copy_meta", "matrix_H", "numpy_T", "lift", "conj", "_conj", "_neg_view",
))


_SCALAR_WRAPPING = frozenset({"aten::copy_", "aten::fill_", "aten::_to_copy", "aten::scalar_tensor", "aten::lift_fresh_copy"})


def _compute_ops(e, names: Counter) -> int:
    """Count the leaf ATen compute ops under ``e`` into ``names``; return how many.

    An op counts when none of its descendants does, except that an op whose only counted
    descendants are copies/fills counts once as itself: that is how a Python scalar argument
    (``x * 1.1``) or an ``out=``/clone copy shows up, one kernel either way.
    """
    below: Counter = Counter()
    for c in e.cpu_children:
        _compute_ops(c, below)
    is_op = e.name.startswith("aten::") and e.name not in _NOT_KERNELS
    if is_op and (not below or set(below) <= _SCALAR_WRAPPING):
        names[e.name] += 1
        return 1
    names.update(below)
    return sum(below.values())


def _has_flush_ancestor(e) -> bool:
    p = e.cpu_parent
    while p is not None:
        if p.name == "adaptive_eager::flush":
            return True
        p = p.cpu_parent
    return False


# ---------------------------------------------------------------------------------------------
# One workload, all variants


@dataclass
class Result:
    key: str
    title: str
    unit: str
    times: dict[str, list[float]] = field(default_factory=dict)  # variant -> per-iteration seconds
    flush: list[float] = field(default_factory=list)
    deltas: list[dict] = field(default_factory=list)
    warm: dict = field(default_factory=dict)
    compile_warm_s: float | None = None
    iters: dict[str, int] = field(default_factory=dict)  # variant -> iterations per sample
    kernels: dict[str, int | None] = field(default_factory=dict)
    kernel_kinds: dict[str, Counter] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    check: str | None = None  # None: no value check for this workload
    unsteady_samples: int = 0  # adaptive samples retaken because a compile happened inside them
    flush_relevant: bool = False

    def median(self, variant: str) -> float | None:
        v = self.times.get(variant)
        return statistics.median(v) if v else None

    def per_iter(self, key: str) -> float | None:
        vals = [d[key] for d in self.deltas]
        return statistics.median(vals) if vals else None

    def steady_state(self) -> str | None:
        """What the timed adaptive samples ran: every window compiled, some, or none."""
        if not self.deltas:
            return None
        compiled, replayed = self.per_iter("compiled_runs"), self.per_iter("replayed_regions")
        if compiled and not replayed:
            return "compiled"
        return "partly compiled" if compiled else "replay only"


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def run_workload(runner: Runner, key: str) -> Result:
    device = runner.device
    log(f"{key}: building")
    wl = BUILDERS[key](device)
    res = Result(wl.key, wl.title, wl.unit, flush_relevant=wl.flush_relevant)
    plain = {"eager": wl.eager, **wl.refs}
    if wl.compile is not None:
        plain["torch.compile"] = wl.compile
    else:
        res.errors["torch.compile"] = "not applicable"
    alive: dict[str, bool] = {}
    one_call: dict[str, float] = {}

    # warm-ups (outside timing)
    for name, step in plain.items():
        log(f"{key}: warming up {name}")
        try:
            total, last = runner.warm_plain(step, 3 if name == "torch.compile" else 2, name)
            if name == "torch.compile":
                res.compile_warm_s = total
            one_call[name] = last
            alive[name] = True
        except Exception as e:  # noqa: BLE001 - reported in the table, the suite goes on
            traceback.print_exc()
            res.errors[name] = _err(e)
            alive[name] = False
    log(f"{key}: warming up adaptive (until compiled steady state, at most {runner.max_warm} iterations)")
    try:
        res.warm = runner.warm_adaptive(wl.adaptive)
        one_call["adaptive"] = res.warm["last_s"]
        alive["adaptive"] = True
        log(f"{key}: adaptive steady state: {res.warm['state']} after {res.warm['iterations']} iterations, "
            f"compile {res.warm['compile_s']:.1f} s")
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        res.errors["adaptive"] = _err(e)
        alive["adaptive"] = False

    # Each variant runs enough iterations per sample to last ~SAMPLE_SECONDS (per-iteration times
    # are reported, so the counts may differ between variants).
    for name, seconds in one_call.items():
        res.iters[name] = max(1, min(MAX_ITERS, int(SAMPLE_SECONDS[device] / max(seconds, 1e-6))))
    order = ["eager", "adaptive", "torch.compile", *wl.refs]
    log(f"{key}: timing {runner.repeats} repeats, order {order}, iterations per sample {res.iters}")
    for r in range(runner.repeats):
        for name in order:
            if not alive.get(name):
                continue
            try:
                if name == "adaptive":
                    for attempt in range(3):
                        t, fl, delta = runner.sample_adaptive(wl.adaptive, res.iters[name])
                        if not (delta["regions_compiled"] or delta["cache_hits_disk"] or delta["blacklisted"]):
                            break
                        # not steady state: something compiled (or failed) inside the sample
                        res.unsteady_samples += 1
                        log(f"{key}: adaptive sample compiled/blacklisted during timing, retaking it: {delta}")
                    res.flush.append(fl)
                    res.deltas.append(delta)
                else:
                    t = runner.sample_plain(plain[name], res.iters[name])
                res.times.setdefault(name, []).append(t)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                res.errors[name] = _err(e)
                alive[name] = False
        log(f"{key}: repeat {r + 1}/{runner.repeats}: " + ", ".join(
            f"{n} {res.times[n][-1] * 1e3:.2f} ms" for n in order if n in res.times and len(res.times[n]) == r + 1))

    # cross-checks, untimed
    if wl.check is not None and alive.get("adaptive") and alive.get("eager"):
        try:
            expected = wl.eager()
            with runner.adaptive():
                got = wl.adaptive()
                ae.sync()
            res.check = wl.check(expected, got)
        except Exception as e:  # noqa: BLE001
            res.check = "check failed: " + _err(e)
    for name in ("eager", "adaptive", "torch.compile"):
        if not alive.get(name):
            continue
        try:
            step = wl.adaptive if name == "adaptive" else plain[name]
            res.kernels[name], res.kernel_kinds[name] = runner.count_kernels(step, adaptive=name == "adaptive")
        except Exception as e:  # noqa: BLE001
            log(f"{key}: kernel count for {name} failed: {_err(e)}")
            res.kernels[name] = None
    log(f"{key}: done; kernels (profiled) {res.kernels}")
    for name, kinds in res.kernel_kinds.items():
        log(f"    {name}: {_top(kinds)}")
    del wl, plain
    gc.collect()
    return res


# ---------------------------------------------------------------------------------------------
# Report


def _top(kinds: Counter, n: int = 6) -> str:
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
                lines.append(f"- {r.key}, {name} ({sum(kinds.values())}): {_top(kinds)}")
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
        cs = f"{w['regions_compiled']} in {w['compile_s']:.1f} s; {w['disk_hits']} from disk" if w else "—"
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


def machine_info(device: str) -> dict:
    info = {
        "nproc": str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()),
        "torch": torch.__version__,
        "torch threads": str(torch.get_num_threads()),
        "python": platform.python_version(),
        "device": device,
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"model name\s*:\s*(.+)", f.read())
        if m:
            info["cpu"] = m.group(1).strip()
    except OSError:
        pass
    try:
        root = os.path.dirname(HERE)
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        info["library tree"] = f"git {sha}" + (f" + {len(dirty.splitlines())} modified files" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return info


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


def write_results(section: str, device: str) -> None:
    BEGIN, END = _markers(device)
    text = ""
    if os.path.exists(RESULTS_MD):
        with open(RESULTS_MD) as f:
            text = f.read()
    block = f"{BEGIN}\n{section.rstrip()}\n{END}"
    if BEGIN in text and END in text and text.index(BEGIN) < text.index(END):
        text = text[: text.index(BEGIN)] + block + text[text.index(END) + len(END):]
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
    return f"""## Performance suite: eager vs adaptive eager vs torch.compile

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

### Targets

{targets_md(targets(results))}

### Details

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
![speedups and launches]({_png(info["device"])})
"""


# ---------------------------------------------------------------------------------------------


def profile_adaptive(runner: Runner, key: str, iters: int) -> None:
    wl = BUILDERS[key](runner.device)
    warm = runner.warm_adaptive(wl.adaptive)
    log(f"{key}: adaptive {warm['state']} after {warm['iterations']} iterations; profiling {iters} iterations")
    prof = cProfile.Profile()
    with runner.adaptive():
        prof.enable()
        for _ in range(iters):
            out = wl.adaptive()
            ae.sync()
        runner.barrier()
        prof.disable()
        del out
    pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(35)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="fewer repeats and warm-up iterations (same sizes)")
    parser.add_argument("--write", action="store_true", help="write benchmarks/RESULTS.md and results.png")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {','.join(BUILDERS)}")
    parser.add_argument("--profile", default="", help="cProfile one workload's adaptive steady state instead")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False")
    repeats = min(args.repeats, 3) if args.quick else args.repeats
    runner = Runner(args.device, repeats, max_warm=8 if args.quick else 10)
    FLUSH.install()
    if not FLUSH.installed:
        log("warning: adaptive_eager._tracer.flush not found; flush times will read 0")
    if args.profile:
        profile_adaptive(runner, args.profile, iters=20)
        return
    keys = [k.strip() for k in args.only.split(",") if k.strip()] or list(BUILDERS)
    unknown = [k for k in keys if k not in BUILDERS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {list(BUILDERS)}")
    command = " ".join(["python", "benchmarks/suite.py", *sys.argv[1:]])
    info = machine_info(args.device)
    log(f"device {args.device}, repeats {repeats}, workloads {keys}; {info}")
    t_start = time.perf_counter()
    results = []
    for key in keys:
        try:
            results.append(run_workload(runner, key))
        except Exception as e:  # noqa: BLE001 - a broken builder must not hide the other workloads
            traceback.print_exc()
            r = Result(key, key, "iter")
            r.errors["build"] = _err(e)
            results.append(r)
    wall = time.perf_counter() - t_start
    print(main_table(results))
    print()
    print(detail_table(results))
    print()
    print(targets_md(targets(results)))
    errs = errors_md(results)
    if errs:
        print("\nErrors:\n" + errs)
    print(f"\n{command}: {wall / 60:.1f} min; {', '.join(f'{k} {v}' for k, v in info.items())}")
    if args.write:
        write_results(section_md(results, command, info, wall, repeats), args.device)
        png = os.path.join(HERE, _png(args.device))
        try:
            plot(results, png, args.device)
        except Exception as e:  # noqa: BLE001 - the markdown is written either way
            log(f"plot failed ({_err(e)}); install the bench extra: pip install matplotlib")
        log(f"wrote {RESULTS_MD} and {png}")


if __name__ == "__main__":
    main()
