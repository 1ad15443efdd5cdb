"""``adaptive_eager.explain()``: why the program flushed, recompiled and fell back, and what to change.

Counters alone say *how often*; the user needs *where* and *what to do*. The tracer keeps, per
flush reason and per eager fallback, the user's ``file:line`` that triggered it
(``METRICS.flush_sites`` / ``fallback_sites``); this module ranks them and attaches advice, the
way PyTorch/XLA's metrics report flags "compile too frequent" or "too many host transfers".
"""

from __future__ import annotations

from collections import Counter

from fuser.window import where as _where

from ._source import module_of
from .reasons import CAPTURE_MISSES, NOT_COMPILED, REASONS, RECOMPILES, REPLAYED


def _advice(reason: str) -> str | None:
    r = REASONS.get(reason)
    return r.advice if r is not None else ""  # a reason missing from the table: tests/test_explain.py


def _site_lines(reason: str, inside) -> list[str]:
    """What explain() says under a flush or fallback site: what to change on the user's line, or,
    where a library it called did it, which library and what the user can do (Note [Whose line]
    in _source)."""
    r = REASONS.get(reason)
    if r is None:
        return []  # a reason missing from the table: tests/test_explain.py
    if r.advice is None:
        return [f"      -> expected: this line {r.does}"]
    if inside is None:
        return [f"      -> {r.advice}"]
    package = module_of(inside[0]).rsplit(".", 1)[0]  # torch.optim, transformers.models.llama
    return [_inside_line(inside),
            f"      -> {package} {r.does} there: that is {package}'s code, not yours, and nothing on your line "
            f"needs to change. What you can do: if it shows every step, call into it less often, or look for "
            f"an option of {package} that avoids it"]


def _inside_line(inside) -> str:
    code, line = inside
    return f"      inside {module_of(code)}.{code.co_name} ({code.co_filename}:{line}), which the line above calls"


def explain(metrics: dict, flush_sites: Counter, fallback_sites: Counter, top: int = 5) -> str:
    lines = ["adaptive_eager explain", "=" * 40]
    windows = metrics.get("windows", 0)
    compiles = metrics.get("compiles", 0)
    runs = metrics.get("compiled_runs", 0)
    lines.append(f"{windows} windows, {runs} ran compiled, {metrics.get('replayed_regions', 0)} replayed, "
                 f"{compiles} compiles ({metrics.get('compile_seconds', 0)} s)")
    if metrics.get("small_windows", 0):
        lines.append(f"{metrics['small_windows']} small windows ran their ops eagerly once compiled: cheaper "
                     f"than a flush (Note [Small windows run eagerly])")
    if metrics.get("parked", 0):
        lines.append(f"{metrics['parked']} stretches between captured calls ran with the mode off the dispatch stack, "
                     f"their ops eager's (Note [The mode parked between captured calls])")
    captured = metrics.get("module_captured_calls", 0) + metrics.get("optimizer_hot_steps", 0)
    if captured:
        lines.append(f"{metrics.get('module_captured_calls', 0)} module calls and "
                     f"{metrics.get('optimizer_hot_steps', 0)} optimizer steps ran captured "
                     f"({metrics.get('module_compiled_runs', 0) + metrics.get('optimizer_compiled_runs', 0)} "
                     f"compiled graph runs, {metrics.get('module_uncompiled_runs', 0) + metrics.get('optimizer_uncompiled_runs', 0)} "
                     f"op by op while their compile ran)")
    findings = []
    # a finding points at a section below only where that section lists something
    if windows >= 20 and compiles > 0.2 * windows:
        see = [name for name, shown in (("the recompile causes", metrics.get("recompiles")),
                                        ("the flush sites", flush_sites)) if shown]
        findings.append(f"compile too frequent: {compiles} compiles for {windows} windows. Windows keep "
                        f"changing structure" + (f"; see {' and '.join(see)} below" if see else ""))
    recorded = metrics.get("ops_recorded", 0)
    # windows between captured calls (the loss, zero_grad) are short by design
    if windows >= 20 and recorded < 8 * windows and captured < windows // 4:
        findings.append(f"short windows: {recorded / windows:.1f} ops per window on average, too few to fuse"
                        + (". The flush sites below end them" if flush_sites else ""))
    if windows >= 20 and metrics.get("replayed_regions", 0) > 0.5 * windows:
        findings.append(f"mostly replayed: {metrics['replayed_regions']} of {windows} windows ran op by op"
                        + (": see 'windows replayed, by why' below" if metrics.get("replay_reasons") else ""))
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
    # its first step); expected reasons (leaving the block, optimizer steps) and a library's own
    # reads after
    rare = max(2, windows // 100)
    # one entry per reason and printed line: the library frame under it (``inside``) can differ
    # between calls of one line (an optimizer's first, cold steps and its captured ones), and two
    # code objects can share a file:line (a cell or a file run twice); the commonest is shown
    merged: dict = {}
    for (reason, site, inside), n in flush_sites.most_common():
        total, first, shown = merged.get((reason, _where(site)), (0, site, inside))
        merged[(reason, _where(site))] = (total + n, first, shown)
    merged = {(reason, site): (n, inside) for (reason, _), (n, site, inside) in merged.items()}
    ranked = [(n, reason, site, inside) for (reason, site), (n, inside) in merged.items()]
    ranked.sort(key=lambda x: (_advice(x[1]) is None or x[0] < rare, x[3] is not None, -x[0]))
    if not ranked:
        lines.append("  (none)")
    for n, reason, site, inside in ranked[:top]:
        lines.append(f"  {reason:<40}{n:>8}  {_where(site)}")
        if _advice(reason) and windows >= 20 and n * 8 < windows:
            # a read every N steps already: the advice would tell the program to do what it does
            lines.append(f"      -> ends {n} of {windows} windows: too few to matter, nothing to change")
            continue
        lines.extend(_site_lines(reason, inside))

    _counted(lines, "recompiles by cause", metrics.get("recompiles", {}), RECOMPILES)
    _counted(lines, "windows replayed, by why (op by op, with eager's kernels and eager's speed)",
             metrics.get("replay_reasons", {}), {**NOT_COMPILED, **REPLAYED})

    from ._metrics import METRICS

    if METRICS.hot_break_sites:  # Note [Hot windows] in _hot
        lines.append("")
        lines.append("lines that break hot windows (cause, count, where, op expected there)")
        for (cause, expected, site), n in METRICS.hot_break_sites.most_common(top):
            lines.append(f"  {cause:<40}{n:>8}  {_where(site)}  (expected {expected})")
        lines.append("      -> a window that differs from the compiled one is recorded in full: keep the step's "
                     "ops, shapes and Python numbers the same every step")

    if METRICS.hot_refusals:  # compiled, but never hot: Note [Hot windows] in _hot
        lines.append("")
        lines.append("compiled windows that cannot run hot (cause, regions, where, op)")
        for (cause, op, site), n in METRICS.hot_refusals.most_common(top):
            lines.append(f"  {cause:<40}{n:>8}  {_where(site)}  ({op})")
        lines.append("      -> such a window runs compiled, but every step still records each of its ops in full, "
                     "because a hot window cannot validate the op named here (an in-place op of the general path, "
                     "a tensor among a view's arguments): write it out of place if you can")
    elif windows >= 20 and runs and not metrics.get("hot_windows", 0) and not METRICS.hot_break_sites:
        lines.append("")
        lines.append("no window ran hot: the regions that ran compiled were not on a CPU target with tiers "
                     "'hot' or 'capture' (Note [Hot windows])")
    if METRICS.module_capture_sites:  # Note [Captured modules] in _capture
        lines.append("")
        lines.append("module calls not captured (cause, count, where, module): each ran recorded, op by op")
        for (cause, module, site), n in METRICS.module_capture_sites.most_common(top):
            lines.append(f"  {cause:<40}{n:>8}  {_where(site)}  ({module})")
            lines.append(f"      -> {CAPTURE_MISSES.get(cause, 'no explanation yet: please report it')}")

    lines.append("")
    lines.append("top eager fallbacks (op, reason, count, where)")
    ranked = sorted(((n, op, reason, site, inside) for (op, reason, site, inside), n in fallback_sites.items()),
                    key=lambda x: -x[0])
    if not ranked:
        lines.append("  (none)")
    for n, op, reason, site, inside in ranked[:top]:
        lines.append(f"  {op + ' (' + reason + ')':<40}{n:>8}  {_where(site)}")
        # its own advice: its flush, if a window was pending, may be past the top flush sites shown
        lines.extend(_site_lines(reason, inside))
    return "\n".join(lines)


def _counted(lines: list[str], title: str, counts: dict, texts: dict[str, str]) -> None:
    lines.append("")
    lines.append(title)
    if not counts:
        lines.append("  (none)")
    for key, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {key:<40}{n:>8}")
        lines.append(f"      -> {texts.get(key, 'no explanation yet: please report it')}")
