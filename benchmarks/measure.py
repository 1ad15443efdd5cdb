"""How the benchmarks measure: interleaved samples of every variant, medians, the adaptive
steady state, metrics deltas, the profiled kernel count, and the machine and its load.

Every sample of a variant runs ``iters`` iterations (calibrated to last ~``SAMPLE_SECONDS``) and
ends with a synchronization that makes the work happen: ``ae.sync()`` after every adaptive
iteration (the window is part of the timed work), ``torch.cuda.synchronize()`` at the end of every
sample on cuda. Samples of the variants alternate (eager, adaptive, compile, eager, ...) and the
median is reported, since absolute times drift on a shared machine. The host time of the flushes
is the library's own ``metrics()["flush_seconds"]``; the kernel count finds the flushes by the
library's ``adaptive_eager.flush`` profiler range.
"""

from __future__ import annotations

import contextlib
import gc
import os
import platform
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
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import adaptive_eager as ae  # noqa: E402
from report import top  # noqa: E402
from workloads import ADAPTIVE_OPTIONS, Workload  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SAMPLE_SECONDS = {"cpu": 0.3, "cuda": 0.1}  # calibrated length of one timed sample
MAX_ITERS = 200
FLUSH_RANGE = "adaptive_eager.flush"  # the library's profiler range around a window's run

_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[suite {time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


class EmptyMode(TorchDispatchMode):
    """The floor every Python dispatch mode pays: intercept and run the op."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:  # same treatment as adaptive eager's mode
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _metric_delta(before: dict, after: dict, key: str) -> float:
    return after.get(key, 0) - before.get(key, 0)


class Runner:
    def __init__(self, device: str, repeats: int, max_warm: int, options: dict = ADAPTIVE_OPTIONS):
        self.device = device
        self.repeats = repeats
        self.max_warm = max_warm
        self.options = options

    def barrier(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def adaptive(self):
        return ae.adaptive_eager(device=self.device, **self.options)

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
            self.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                out = step()
                ae.sync()  # the window is part of the work: end it inside the timed region
            self.barrier()
            dt = time.perf_counter() - t0
            after = ae.metrics()
            del out
        delta = {k: _metric_delta(before, after, k) / iters for k in (
            "launches", "eager_equivalent_launches", "compiled_runs", "replayed_regions",
            "compiles", "cache_hits_memory", "cache_hits_disk", "blacklisted", "windows", "ops_eager",
            "host_scalar_ops", "optimizer_hot_steps", "flush_seconds")}
        return dt / iters, delta.pop("flush_seconds"), delta

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
                     ("compiled_runs", "replayed_regions", "compiles", "cache_hits_disk", "blacklisted",
                      "windows", "optimizer_hot_steps", "optimizer_cold_steps", "optimizer_captures")}
                info["iterations"] = i + 1
                log(f"    adaptive warm-up {i + 1}: {info['last_s'] * 1e3:.1f} ms, {d}")
                # a hot optimizer step is one compiled call too (Note [Optimizer capture] in adaptive_eager._optim)
                ran_compiled = d["compiled_runs"] + d["optimizer_hot_steps"] > 0
                # and no optimizer step still to be captured (its compile would land in the timing)
                if ran_compiled and d["replayed_regions"] == 0 and d["compiles"] == 0 and d["optimizer_captures"] == 0 \
                        and d["optimizer_cold_steps"] == 0 and d["cache_hits_disk"] == 0 and d["blacklisted"] == 0:
                    info["state"] = "compiled"
                    break
                info["state"] = "partly compiled" if ran_compiled else "replay only"
        end = ae.metrics()
        info["seconds"] = time.perf_counter() - t_start
        info["compile_s"] = _metric_delta(start, end, "compile_seconds")
        info["compiles"] = _metric_delta(start, end, "compiles")
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
        """Kernels one iteration runs, and how many of each kind: a cross-check that does not
        trust the library's own counters. On cuda the device kernels/memcpys the profiler sees;
        on cpu the leaf ATen compute ops (allocation and view ops excluded) plus the calls into
        Inductor-built C++ kernels (``.so`` functions, counted with ``sys.setprofile``); for
        adaptive only what runs inside a flush (the library's ``FLUSH_RANGE``), plus the ops the
        tracer ran eagerly (``ops_eager``)."""
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

        with self.adaptive() if adaptive else contextlib.nullcontext():
            before = ae.metrics()
            with profile(activities=activities) as prof:
                sys.setprofile(hook if self.device == "cpu" else None)
                try:
                    out = step()
                    if adaptive:
                        ae.sync()
                finally:
                    sys.setprofile(None)
                self.barrier()
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
            roots = [e for e in events if e.name == FLUSH_RANGE and not _has_flush_ancestor(e)]
            eager_ops = int(_metric_delta(before, after, "ops_eager"))
            if eager_ops:
                names["ops the tracer ran eagerly (ops_eager)"] += eager_ops
        else:
            roots = [e for e in events if e.cpu_parent is None]
        for e in roots:
            _compute_ops(e, names)
        return sum(names.values()), names


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
        if p.name == FLUSH_RANGE:
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
        compiled += self.per_iter("optimizer_hot_steps")  # Note [Optimizer capture] in adaptive_eager._optim
        if compiled and not replayed:
            return "compiled"
        return "partly compiled" if compiled else "replay only"


def short_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def run_workload(runner: Runner, key: str, build: Callable[[str], Workload]) -> Result:
    """Build workload ``key``, warm every variant up, time ``runner.repeats`` interleaved samples
    of each, then check the adaptive value against eager and count each variant's kernels
    (untimed). Built here, so that its tensors go before the next workload is built."""
    device = runner.device
    log(f"{key}: building")
    wl = build(device)
    res = Result(wl.key, wl.title, wl.unit)
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
            res.errors[name] = short_error(e)
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
        res.errors["adaptive"] = short_error(e)
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
                        if not (delta["compiles"] or delta["cache_hits_disk"] or delta["blacklisted"]):
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
                res.errors[name] = short_error(e)
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
            res.check = "check failed: " + short_error(e)
    for name in ("eager", "adaptive", "torch.compile"):
        if not alive.get(name):
            continue
        try:
            step = wl.adaptive if name == "adaptive" else plain[name]
            res.kernels[name], res.kernel_kinds[name] = runner.count_kernels(step, adaptive=name == "adaptive")
        except Exception as e:  # noqa: BLE001
            log(f"{key}: kernel count for {name} failed: {short_error(e)}")
            res.kernels[name] = None
    log(f"{key}: done; kernels (profiled) {res.kernels}")
    for name, kinds in res.kernel_kinds.items():
        log(f"    {name}: {top(kinds)}")
    del wl, plain
    gc.collect()
    return res


# ---------------------------------------------------------------------------------------------


def load() -> str:
    """The machine's load averages (1, 5, 15 min): a figure from a loaded machine says so."""
    try:
        return " / ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "unknown"


def machine_info(device: str) -> dict:
    info = {
        "nproc": str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()),
        "torch": torch.__version__,
        "torch threads": str(torch.get_num_threads()),
        "python": platform.python_version(),
        "device": device,
        "load at start": load(),
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

