"""Process-wide counters behind ``metrics()`` / ``report()`` (STYLE habit 4: every fallback counted)."""

from __future__ import annotations

from collections import Counter

from . import _heap


class Metrics:
    """Plain attributes, bumped on the hot path without locks (the GIL keeps them coherent enough
    for counters; nothing depends on them for correctness)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.ops_recorded = 0
        self.ops_eager = 0  # ops on the target device that ran immediately (fallbacks, RNG draws)
        # of those, ops on real 0-dim CPU tensors on a CPU target (AdamW's ``step += 1`` and
        # ``step.item()``): on an accelerator these tensors stay on the host, not device launches
        self.host_scalar_ops = 0
        self.launches = 0
        self.eager_equivalent_launches = 0  # besides ops_recorded: ops that ran eagerly
        self.ops_materialized = 0
        self.ops_eliminated = 0
        self.windows = 0
        # host seconds spent running windows (every flush that had ops, wherever it was triggered;
        # on cpu this includes the window's compute): what a sync point costs the program
        self.flush_seconds = 0.0
        self.flushes: Counter[str] = Counter()
        self.fallback_ops: Counter[str] = Counter()
        # Note [Optimizer capture] in ``_optim``: steps captured, steps run as one guarded call,
        # steps recorded before a (re)capture, steps that ran recorded instead (guard misses and
        # why the step is not captured), by cause; seconds the capturing steps took (Dynamo's and
        # AOTAutograd's traces); hot steps whose graph ran compiled and op by op (artifact not yet
        # loaded), graphs never compiled by cause
        self.optimizer_cold_steps = 0
        self.optimizer_captures = 0
        self.optimizer_hot_steps = 0
        self.optimizer_misses: Counter[str] = Counter()
        self.optimizer_capture_seconds = 0.0
        self.optimizer_compiled_runs = 0
        self.optimizer_uncompiled_runs = 0
        self.optimizer_uncompiled_graphs: Counter[str] = Counter()
        # Note [Captured modules] in ``_capture``: Dynamo entries compiled (captures), module calls
        # run as one guarded call, calls recorded instead by cause (and, for explain(), by
        # (cause, module type, (code, line))), seconds the capturing calls took (Dynamo's and
        # AOTAutograd's traces, in the step), graph runs compiled and op by op (artifact not yet
        # loaded), graphs never compiled by cause
        self.module_captures = 0
        self.module_captured_calls = 0
        self.module_capture_misses: Counter[str] = Counter()
        self.module_capture_sites: Counter[tuple] = Counter()
        self.module_capture_seconds = 0.0
        self.module_compiled_runs = 0
        self.module_uncompiled_runs = 0
        self.module_uncompiled_graphs: Counter[str] = Counter()
        # Note [Captures from the cache] in ``_capture``: records written, hit, and why none was kept
        self.capture_records: Counter[str] = Counter()
        # Note [User torch.compile] in ``_compile``: calls of the program's compiled code (and
        # compiled backward graphs) that ran with the mode stepped aside
        self.compiled_calls = 0
        # for explain(): (reason, user, inside) and (op, reason, user, inside), each a (code, line) of
        # the user's line and of the library's it called or None (Note [Whose line] in _source)
        self.flush_sites: Counter[tuple] = Counter()
        self.fallback_sites: Counter[tuple] = Counter()
        # Note [Hot windows] in _hot: windows validated against a template and run directly, the
        # ops they took, and the windows demoted, by cause; for explain(): (cause, expected op, line)
        self.hot_windows = 0
        self.hot_ops = 0
        self.small_windows = 0  # windows run eagerly, op by op (Note [Small windows run eagerly] in _hot)
        self.parked = 0  # stretches between captured calls with the mode off (Note [The mode parked between captured calls] in _state)
        self.hot_mismatches: Counter[str] = Counter()
        self.hot_break_sites: Counter[tuple] = Counter()
        # compiled regions whose windows can never run hot, by (cause, op, line): _hot.template_of
        self.hot_refusals: Counter[tuple] = Counter()

    def as_dict(self) -> dict:
        return {
            "ops_recorded": self.ops_recorded,
            "ops_eager": self.ops_eager,
            "host_scalar_ops": self.host_scalar_ops,
            "launches": self.launches,
            "eager_equivalent_launches": self.ops_recorded + self.eager_equivalent_launches,
            "ops_materialized": self.ops_materialized,
            "ops_eliminated": self.ops_eliminated,
            "windows": self.windows,
            "flush_seconds": self.flush_seconds,
            "flushes": dict(self.flushes),
            "fallback_ops": dict(self.fallback_ops),
            "optimizer_cold_steps": self.optimizer_cold_steps,
            "optimizer_captures": self.optimizer_captures,
            "optimizer_hot_steps": self.optimizer_hot_steps,
            "optimizer_misses": dict(self.optimizer_misses),
            "optimizer_capture_seconds": self.optimizer_capture_seconds,
            "optimizer_compiled_runs": self.optimizer_compiled_runs,
            "optimizer_uncompiled_runs": self.optimizer_uncompiled_runs,
            "optimizer_uncompiled_graphs": dict(self.optimizer_uncompiled_graphs),
            "module_captures": self.module_captures,
            "module_captured_calls": self.module_captured_calls,
            "module_capture_misses": dict(self.module_capture_misses),
            "module_capture_seconds": self.module_capture_seconds,
            "module_compiled_runs": self.module_compiled_runs,
            "module_uncompiled_runs": self.module_uncompiled_runs,
            "module_uncompiled_graphs": dict(self.module_uncompiled_graphs),
            "capture_records": dict(self.capture_records),
            "compiled_calls": self.compiled_calls,
            "hot_windows": self.hot_windows,
            "hot_ops": self.hot_ops,
            "small_windows": self.small_windows,
            "parked": self.parked,
            "hot_mismatches": dict(self.hot_mismatches),
            "hot_refusals": self._refusals(),
            "malloc_tuned": _heap.tuned(),  # Note [Heap thresholds] in _heap
        }

    def _refusals(self) -> dict:
        """Compiled regions that can never run hot, by cause (``hot_refusals`` has their lines)."""
        causes: Counter[str] = Counter()
        for (cause, _, _), n in self.hot_refusals.items():
            causes[cause] += n
        return dict(causes)


METRICS = Metrics()


def format_report(m: dict) -> str:
    lines = ["adaptive_eager report", "=" * 40]
    for k in ("ops_recorded", "ops_eager", "host_scalar_ops", "windows", "ops_materialized",
              "ops_eliminated", "launches",
              "eager_equivalent_launches", "compiled_runs", "replayed_regions", "compiles", "compile_seconds",
              "cache_hits_memory", "cache_hits_disk", "blacklisted", "optimizer_captures",
              "optimizer_hot_steps", "optimizer_compiled_runs", "module_captures", "module_captured_calls",
              "module_compiled_runs", "small_windows", "parked", "compiled_calls"):
        if k in m:
            lines.append(f"{k:<28}{m[k]:>12}")
    eq = m["eager_equivalent_launches"]
    if eq:
        lines.append(f"{'launches / eager':<28}{m['launches'] / eq:>12.3f}")
    for title, key in (("flushes by reason", "flushes"), ("fallback ops", "fallback_ops"),
                       ("recompiles by cause", "recompiles"), ("optimizer steps not hot", "optimizer_misses"),
                       ("module calls not captured", "module_capture_misses"),
                       ("windows not compiled", "not_compiled"),
                       ("nodes run alone in compiled regions", "run_alone")):
        if key not in m:
            continue
        lines.append("")
        lines.append(title)
        items = sorted(m[key].items(), key=lambda kv: -kv[1])
        if not items:
            lines.append("  (none)")
        for name, count in items:
            lines.append(f"  {name:<40}{count:>8}")
    return "\n".join(lines)
