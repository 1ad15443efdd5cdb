"""``adaptive_eager.explain()``: why the program flushed, recompiled and fell back, and what to change.

Counters alone say *how often*; the user needs *where* and *what to do*. The tracer keeps, per
flush reason and per eager fallback, the user's ``file:line`` that triggered it
(``METRICS.flush_sites`` / ``fallback_sites``); this module ranks them and attaches advice, the
way PyTorch/XLA's metrics report flags "compile too frequent" or "too many host transfers".
"""

from __future__ import annotations

from collections import Counter

from fuser.window import where as _where

from .reasons import REASONS

_RECOMPILE_ADVICE = {
    "new_shape": "shapes change between windows (a varying batch size or sequence length): pad or bucket "
                 "them; after a few sizes adaptive eager compiles the region with symbolic sizes",
    "new_dtype": "a region was seen with new dtypes: keep dtypes stable across steps",
    "scalar_lifted": "a Python number that changes every step (a learning-rate schedule) became a runtime "
                     "input: expected once per region",
    "dynamic": "a region was compiled with symbolic sizes: expected once per region",
}


def _advice(reason: str) -> str | None:
    r = REASONS.get(reason)
    return r.advice if r is not None else ""  # a reason missing from the table: tests/test_explain.py


def explain(metrics: dict, flush_sites: Counter, fallback_sites: Counter, top: int = 5) -> str:
    lines = ["adaptive_eager explain", "=" * 40]
    windows = metrics.get("windows", 0)
    compiles = metrics.get("compiles", 0)
    runs = metrics.get("compiled_runs", 0)
    lines.append(f"{windows} windows, {runs} ran compiled, {metrics.get('replayed_regions', 0)} replayed, "
                 f"{compiles} compiles ({metrics.get('compile_seconds', 0)} s)")
    findings = []
    if windows >= 20 and compiles > 0.2 * windows:
        findings.append(f"compile too frequent: {compiles} compiles for {windows} windows. Windows keep "
                        f"changing structure; see the recompile causes and flush sites below")
    recorded = metrics.get("ops_recorded", 0)
    if windows >= 20 and recorded < 8 * windows:
        findings.append(f"short windows: {recorded / windows:.1f} ops per window on average, too few to fuse. "
                        f"The flush sites below end them")
    if windows >= 20 and metrics.get("replayed_regions", 0) > 0.5 * windows:
        findings.append(f"mostly replayed: {metrics['replayed_regions']} of {windows} windows ran op by op. "
                        f"Windows that never repeat are never compiled: see the flush sites and recompile "
                        f"causes below (with async_compile, compiles finish in the background)")
    failed = metrics.get("run_alone", {}).get("compile_failed", 0)
    if failed:
        findings.append(f"compiler failures worked around: {failed} ops run outside compiled code because "
                        f"the compiler failed on them (NEURON_EAGER_LOG=info names them); the rest of "
                        f"their regions is compiled")
    if metrics.get("blacklisted", 0):
        findings.append(f"blacklisted: {metrics['blacklisted']} regions run op by op after a compile or run "
                        f"failure (the warnings say why)")
    if findings:
        lines.append("")
        lines.append("findings")
        lines.extend(f"  * {f}" for f in findings)

    lines.append("")
    lines.append("top flush sites (reason, count, where, what to change)")
    # what the user can act on first, unless it is rare (AdamW reads its step counter once, in
    # its first step); expected reasons (leaving the block, optimizer steps) after
    rare = max(2, windows // 100)
    ranked = [(n, reason, site) for (reason, site), n in flush_sites.items()]
    ranked.sort(key=lambda x: (_advice(x[1]) is None or x[0] < rare, -x[0]))
    if not ranked:
        lines.append("  (none)")
    for n, reason, site in ranked[:top]:
        lines.append(f"  {reason:<40}{n:>8}  {_where(site)}")
        advice = _advice(reason)
        if advice:
            lines.append(f"      -> {advice}")

    lines.append("")
    lines.append("recompiles by cause")
    recompiles = metrics.get("recompiles", {})
    if not recompiles:
        lines.append("  (none)")
    for cause, n in sorted(recompiles.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {cause:<40}{n:>8}")
        if cause in _RECOMPILE_ADVICE:
            lines.append(f"      -> {_RECOMPILE_ADVICE[cause]}")

    from ._metrics import METRICS

    if METRICS.hot_break_sites:  # Note [Hot windows] in _hot
        lines.append("")
        lines.append("lines that break hot windows (cause, count, where, op expected there)")
        for (cause, expected, site), n in METRICS.hot_break_sites.most_common(top):
            lines.append(f"  {cause:<40}{n:>8}  {_where(site)}  (expected {expected})")
        lines.append("      -> a window that differs from the compiled one is recorded in full: keep the step's "
                     "ops, shapes and Python numbers the same every step")

    lines.append("")
    lines.append("top eager fallbacks (op, reason, count, where)")
    ranked = sorted(((n, op, reason, site) for (op, reason, site), n in fallback_sites.items()), key=lambda x: -x[0])
    if not ranked:
        lines.append("  (none)")
    for n, op, reason, site in ranked[:top]:
        lines.append(f"  {op + ' (' + reason + ')':<40}{n:>8}  {_where(site)}")
    if ranked:
        lines.append("      -> each one flushes the window first; see the flush advice for its reason")
    return "\n".join(lines)
